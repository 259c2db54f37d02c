# SPDX-License-Identifier: Apache-2.0
"""Patch worker-block-table-fused-slot-mapping (P2): the slot mappings of
KV-cache groups that share a block layout in one launch.

Both Triton kernels, the pin's per-table ``_compute_slot_mapping_kernel``
and the fused ``_compute_slot_mappings_kernel``, run in Triton's
interpreter on the CPU (the CPU platform has no Triton driver, so vLLM's
module holds their plain functions: they are re-jitted here with the real
``triton``). Over random batches, every table's slot mapping through the
fused launch equals its own launch's, padding included."""

import os
import types

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from vllm.v1.worker import block_table as bt_mod  # noqa: E402
from vllm.v1.worker.block_table import (  # noqa: E402
    BlockTable,
    FusedSlotMappings,
    MultiGroupBlockTable,
    SlotMappingMode,
    _plan_slot_mapping_launches,
)

B = 16
MAX_TOKENS = 96


def interpreted(fn):
    """``fn`` (a kernel's plain function under vLLM's Triton placeholder)
    jitted for Triton's CPU interpreter, with the real triton.language."""
    import triton.language as real_tl

    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    g = {**fn.__globals__, "tl": real_tl, "triton": triton}
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__)
    new.__annotations__ = {n: real_tl.constexpr for n in fn.__annotations__ if n in names}
    new.__module__, new.__qualname__ = fn.__module__, fn.__qualname__
    os.environ["TRITON_INTERPRET"] = "1"
    return triton.jit(new, do_not_specialize=["num_tokens", "max_num_tokens"])


@pytest.fixture
def kernels(monkeypatch):
    old = os.environ.get("TRITON_INTERPRET")
    monkeypatch.setattr(bt_mod, "_compute_slot_mapping_kernel",
                        interpreted(bt_mod._compute_slot_mapping_kernel))
    monkeypatch.setattr(bt_mod, "_compute_slot_mappings_kernel",
                        interpreted(bt_mod._compute_slot_mappings_kernel))
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)


def table(block_size=B, kernel_block_size=B, max_blocks=8, mode=SlotMappingMode.TOKEN_TO_KV_SLOT):
    return BlockTable(block_size, 8, max_blocks, MAX_TOKENS, pin_memory=False,
                      device=torch.device("cpu"), kernel_block_size=kernel_block_size,
                      cp_kv_cache_interleave_size=1, slot_mapping_mode=mode)


def random_batch(rng, tables):
    """Rows of random blocks in every table, a batch of random query
    lengths at random positions; the slot mappings start as garbage."""
    num_reqs = int(rng.integers(1, 8))
    qlens = rng.integers(1, 12, size=num_reqs)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    positions = []
    for q in qlens:
        start = int(rng.integers(0, 5 * B))
        positions.extend(range(start, start + int(q)))
    for t in tables:
        for row in range(num_reqs):
            t.add_row(rng.integers(1, 500, size=t.max_num_blocks_per_req
                                   // t.blocks_per_kv_block).tolist(), row)
        t.commit_block_table(num_reqs)
        t.slot_mapping.gpu.copy_(torch.from_numpy(rng.integers(-5, 10**6, size=MAX_TOKENS)))
    return num_reqs, torch.from_numpy(qsl), torch.tensor(positions, dtype=torch.int64)


@pytest.mark.parametrize("seed", range(6))
def test_fused_launch_equals_each_tables_own_launch(kernels, seed):
    rng = np.random.default_rng(seed)
    tables = [table() for _ in range(3)]
    num_reqs, qsl, pos = random_batch(rng, tables)
    for t in tables:
        t.compute_slot_mapping(num_reqs, qsl, pos)
    own = [t.slot_mapping.gpu.clone() for t in tables]
    for t in tables:  # garbage again
        t.slot_mapping.gpu.fill_(12345)
    FusedSlotMappings(tables).compute_slot_mapping(num_reqs, qsl, pos)
    n = pos.shape[0]
    for t, expected in zip(tables, own):
        assert torch.equal(t.slot_mapping.gpu, expected)
        assert (expected[n:] == -1).all() and (expected[:n] >= 0).all()
    # each table read its own block table
    assert not torch.equal(own[0][:n], own[1][:n])


def test_kernel_block_split_fuses_too(kernels):
    """A table whose kernel block is smaller than its KV block
    (BLOCKS_PER_KV_BLOCK > 1) gets the same slots fused or not."""
    rng = np.random.default_rng(7)
    tables = [table(block_size=2 * B, kernel_block_size=B) for _ in range(2)]
    num_reqs, qsl, pos = random_batch(rng, tables)
    for t in tables:
        t.compute_slot_mapping(num_reqs, qsl, pos)
    own = [t.slot_mapping.gpu.clone() for t in tables]
    FusedSlotMappings(tables).compute_slot_mapping(num_reqs, qsl, pos)
    assert all(torch.equal(t.slot_mapping.gpu, e) for t, e in zip(tables, own))


def test_only_token_to_slot_tables_of_one_layout_fuse():
    """One fused launch per layout with two or more tables; a table alone in
    its layout, a table without slot mappings (Mamba, HiSparse's hot
    groups) and every table off CUDA keep their own launch."""
    a, b, c = table(), table(), table()
    other = table(block_size=2 * B, kernel_block_size=2 * B)
    none = table(mode=SlotMappingMode.NONE)
    plan = _plan_slot_mapping_launches([a, none, b, other, c], fuse=True)
    fused = [p for p in plan if isinstance(p, FusedSlotMappings)]
    assert len(fused) == 1 and fused[0].tables == [a, b, c]
    assert [p for p in plan if not isinstance(p, FusedSlotMappings)] == [none, other]
    assert _plan_slot_mapping_launches([a, b, c], fuse=False) == [a, b, c]
    with pytest.raises(ValueError, match="layouts"):
        FusedSlotMappings([a, other])


def test_the_runners_block_tables_fuse_only_on_cuda():
    """MultiGroupBlockTable plans its launches once, fused on CUDA only (the
    CPU runner swaps the per-table kernel for its C++ one)."""
    multi = MultiGroupBlockTable(8, MAX_TOKENS, False, torch.device("cpu"), [B, B], [B, B],
                                 [8, 8])
    assert multi._slot_mapping_launches == multi.block_tables
