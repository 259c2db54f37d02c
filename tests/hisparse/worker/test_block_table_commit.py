# SPDX-License-Identifier: Apache-2.0
"""Patch worker-block-table-skip-clean-commit (P2: the runner commits every
KV-cache group's block table every step; HiSparse adds two groups per
resident/hot pair): a commit with nothing changed since the last one copies
nothing, and every commit leaves the device rows it covers equal to the CPU
rows, whatever vLLM's InputBatch did to them in between."""

import random

import numpy as np
import pytest
import torch

from vllm.v1.worker.block_table import BlockTable

ROWS, WIDTH = 8, 12


def table() -> BlockTable:
    return BlockTable(64, ROWS, WIDTH, 512, pin_memory=False, device=torch.device("cpu"),
                      kernel_block_size=64, cp_kv_cache_interleave_size=1)


def counted(bt: BlockTable) -> list[int]:
    """The commits that copied (their row counts)."""
    copies: list[int] = []
    copy = bt.block_table.copy_to_gpu

    def copy_to_gpu(n=None):
        copies.append(n)
        return copy(n)

    bt.block_table.copy_to_gpu = copy_to_gpu
    return copies


def test_a_clean_table_is_not_copied_again():
    bt = table()
    copies = counted(bt)
    bt.add_row([3, 4], 0)
    bt.commit_block_table(2)
    bt.commit_block_table(2)
    bt.commit_block_table(1)  # fewer rows: already current
    assert copies == [2]
    bt.commit_block_table(3)  # a row never committed: copy
    bt.append_row([], 0)  # no block: the row is unchanged
    bt.clear_row(5)  # an empty row: unchanged
    bt.commit_block_table(3)
    assert copies == [2, 3]
    bt.append_row([7], 0)
    bt.commit_block_table(3)
    assert copies == [2, 3, 3]
    assert bt.block_table.gpu[0, :3].tolist() == [3, 4, 7]


def test_a_direct_write_needs_mark_dirty():
    """The contract for code that writes the CPU table itself (HiSparse's
    residency updates, binding.apply_residency_updates)."""
    bt = table()
    bt.add_row([3, 4], 0)
    bt.commit_block_table(1)
    bt.get_numpy_array()[0, 1] = 9
    bt.commit_block_table(1)
    assert bt.block_table.gpu[0, 1] == 4  # not marked: not copied
    bt.mark_dirty()
    bt.commit_block_table(1)
    assert bt.block_table.gpu[0, 1] == 9


@pytest.mark.parametrize("seed", range(6))
def test_every_commit_leaves_its_rows_current(seed):
    """Random InputBatch traffic (add, append, clear, condense, swap, a full
    clear, direct writes with mark_dirty) between commits of random row
    counts: after each commit the device rows equal the CPU rows, and
    commits after no change copy nothing."""
    rng = random.Random(seed)
    bt = table()
    copies = counted(bt)
    skipped = 0
    for _ in range(600):
        op = rng.randrange(8)
        row, other = rng.randrange(ROWS), rng.randrange(ROWS)
        ids = [rng.randrange(1, 100) for _ in range(rng.randrange(0, 3))]
        room = WIDTH - int(bt.num_blocks_per_row[row])
        if op == 0:
            bt.add_row(ids, row)
        elif op == 1 and len(ids) <= room:
            bt.append_row(ids, row)
        elif op == 2:
            bt.clear_row(row)
        elif op == 3:
            bt.move_row(row, other)
        elif op == 4:
            bt.swap_row(row, other)
        elif op == 5 and rng.random() < 0.05:
            bt.clear()
        elif op == 6 and int(bt.num_blocks_per_row[row]):
            bt.get_numpy_array()[row, 0] = rng.randrange(1, 100)
            bt.mark_dirty()
        n = rng.randrange(1, ROWS + 1)
        before = len(copies)
        bt.commit_block_table(n)
        cpu, gpu = bt.block_table.np[:n], bt.block_table.gpu[:n].numpy()
        assert np.array_equal(cpu, gpu)
        skipped += len(copies) == before
        copied = len(copies)
        bt.commit_block_table(rng.randrange(1, n + 1))  # nothing changed since
        assert len(copies) == copied
    assert skipped > 0
