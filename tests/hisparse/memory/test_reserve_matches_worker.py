# SPDX-License-Identifier: Apache-2.0
"""HiSparse's GPU reserve equals what the worker allocates (spec 2.8, 2.11,
3.5; docs/layout.md L17).

The pure ``hisparse_gpu_reserve`` is compared with the real runtime, data
plane and staging cache built over a CPU slab (the worker harness), byte for
byte: per item with the tensors the runtime names, and in total with a walk
of every tensor the objects hold, so a buffer added to them later fails here
until the reserve counts it. The block tables are compared with vLLM's own
``BlockTable``.
"""

import pytest
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.hisparse.memory import (
    BatchLimits,
    held_tensor_bytes,
    hisparse_gpu_reserve,
    hot_slot_state_bytes,
    num_index_groups,
    staging_block_count,
)
from vllm.v1.hisparse.staging import StagingCache
from vllm.v1.worker.block_table import BlockTable
from worker_harness import B, W, Batch, WorkerRig, tiny_config

NUM_GPU_BLOCKS = 256


class Bound(WorkerRig):
    """A worker bound as ``binding.bind_runtime`` binds it, on CPU: the
    pool, its in-slab staging blocks and batch tables sized for the limits,
    and the prefill staging cache."""

    def __init__(self, *, freq=1, topk=64, hot=None, seqs=8, tokens=512,
                 max_model_len=40 * B, layers=4, mtp=0, q=1, order=None):
        staging_blocks = staging_block_count(max_model_len, B, tokens)
        config = tiny_config(num_layers=layers, freq=freq, index_topk=topk,
                             device_buffer_size=hot, num_gpu_blocks=NUM_GPU_BLOCKS,
                             staging_blocks=staging_blocks, num_mtp=mtp, q=q,
                             order_misses=order)
        batch = Batch(len(config.layout.kv_cache_groups), max_reqs=seqs,
                      max_blocks=cdiv(max_model_len, B), max_tokens=tokens)
        super().__init__(config=config, tables=batch, max_num_seqs=seqs,
                         max_num_tokens=tokens, order_misses=order)
        self.staging = StagingCache(max_model_len, B, W, torch.device("cpu"))
        self.limits = BatchLimits(seqs, tokens)
        self.max_model_len = max_model_len

    def reserve(self):
        return hisparse_gpu_reserve(self.layout, self.limits, self.max_model_len)


@pytest.fixture
def bind():
    bound: list[Bound] = []

    def make(**case):
        bound.append(Bound(**case))
        return bound[-1]

    yield make
    for b in bound:
        b.worker.shutdown()


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.nbytes for t in tensors)


CASES = [
    dict(),                                         # 4 leaders, H = 2K, R_ws = S
    dict(freq=2),                                   # IndexShare: 2 index groups
    dict(topk=128, hot=1024, seqs=16, tokens=256),  # configured H
    dict(seqs=64, tokens=48, max_model_len=100 * B + 7),  # R_ws = T < S * q
]


@pytest.mark.parametrize("case", CASES)
def test_reserve_items_equal_the_runtime_tensors(bind, case):
    """2.8: dgi int32 + lru int16 [S + 1, H] and stats per index group,
    req_state, row_req and the LRU reset row; the workspace
    (int32 [R_ws, K] x 3 + [R_ws] x 2); 2.11: the staging cache; the mirror
    descriptors (K2); the in-slab staging blocks (K13) in the slab."""
    b = bind(**case)
    rt, reserve = b.rt, b.reserve()
    hot = sum(nbytes(g.dgi, g.lru, g.stats) for g in rt.groups) + nbytes(
        rt.req_state, rt.row_req, rt._lru_init)
    assert reserve.hot_slot_state == hot
    ws = rt.workspace
    assert reserve.workspace == nbytes(
        ws.out_rows, ws.valid_counts, ws.plan_src, ws.plan_dst, ws.plan_count)
    st = b.staging
    assert reserve.prefill_staging == nbytes(st.cache, st.block_table, st.zero_start)
    m = b.worker.mirror
    assert reserve.mirror == nbytes(
        m.src, m.dst, m.nbytes, m._pair_of_layer, m._src_base, m._dst_base)
    slab_bytes = {t.size for t in b.config.kv_cache_tensors}
    assert slab_bytes == {b.config.num_blocks * b.layout.bytes_per_block
                          + reserve.staging_bytes}
    assert reserve.staging_blocks == b.config.staging_blocks


@pytest.mark.parametrize("case", CASES)
def test_reserve_covers_every_tensor_the_worker_holds(bind, case):
    """Every storage reachable from the runtime, the data plane and the
    staging cache, less the slab and the host pool, is in the reserve: a new
    buffer that the reserve does not count makes this fail."""
    b = bind(**case)
    held = held_tensor_bytes([b.rt, b.worker, b.staging], "cpu",
                             exclude=[b.slab, b.pool.tensor])
    assert held == b.reserve().worker_state


def test_reserve_covers_the_mtp_drafters_slot_buffers(bind):
    """docs/mtp.md 3.11 (L17): with an MTP layer the reserve also counts the
    drafter's slot buffers, which ``bind_runtime`` attaches to the proposer
    and walks with the rest; without one it counts none."""
    from types import SimpleNamespace

    from vllm.v1.hisparse.drafter import attach_drafter

    b = bind(layers=3, mtp=1, q=2)
    draft = {"model.layers.3.self_attn.attn", "model.layers.3.self_attn.indexer.k_cache"}
    runner = SimpleNamespace(
        drafter=SimpleNamespace(hisparse=None, _draft_attn_layer_names=draft),
        kv_cache_config=b.config)
    binding = attach_drafter(runner, b.rt, b.limits.max_num_batched_tokens)
    reserve = b.reserve()
    assert reserve.drafter_slots == nbytes(*binding.buffers.values()) > 0
    held = held_tensor_bytes([b.rt, b.worker, b.staging, binding], "cpu",
                             exclude=[b.slab, b.pool.tensor])
    assert held == reserve.worker_state
    assert "MTP drafter slots" in reserve.describe()
    plain = bind()
    assert plain.reserve().drafter_slots == 0
    assert "MTP" not in plain.reserve().describe()


def test_held_bytes_count_shared_storage_once(bind):
    """Views (the layer views, workspace slices) are not counted again."""
    b = bind()
    rt = b.rt
    once = held_tensor_bytes([rt], "cpu", exclude=[b.slab, b.pool.tensor])
    views = [rt.workspace.out_rows[:3], rt.groups[0].dgi[1:], rt]
    assert held_tensor_bytes(views, "cpu", exclude=[b.slab, b.pool.tensor]) == once
    assert held_tensor_bytes([rt], "cuda") == 0


def test_index_groups_are_counted_as_the_runtime_builds_them(bind):
    for freq in (1, 2):
        b = bind(freq=freq)
        assert num_index_groups(b.layout.leaders) == len(b.rt.groups)
    assert num_index_groups([False, True, False]) == 2
    assert num_index_groups([]) == 0


def test_per_group_state_is_six_s_h_bytes():
    """3.5: per index group 6·S·H bytes (int32 dgi + int16 lru) on S + 1 state
    rows (row S is shared by requests without a hot region, K5), plus the
    four uint64 counters; nothing else grows with the number of groups."""
    limits = BatchLimits(max_num_seqs=256, max_num_batched_tokens=8192)
    one = hot_slot_state_bytes(1, limits, 4096)
    two = hot_slot_state_bytes(2, limits, 4096)
    assert two - one == 6 * 257 * 4096 + 32


@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
def test_block_tables_equal_vllm_block_tables(bind, case):
    """The runner keeps one ``BlockTable`` per KV-cache group; HiSparse's
    layout turns vLLM's one group into 2 + 2n (+ other), and the device half
    of each extra one (table + slot mapping) is in the reserve."""
    b = bind(**case)
    table = BlockTable(
        block_size=B, max_num_reqs=b.limits.max_num_seqs,
        max_num_blocks_per_req=cdiv(b.max_model_len, B),
        max_num_batched_tokens=b.limits.max_num_batched_tokens, pin_memory=False,
        device=torch.device("cpu"), kernel_block_size=B, cp_kv_cache_interleave_size=1)
    per_group = nbytes(table.block_table.gpu, table.slot_mapping.gpu)
    extra = len(b.layout.kv_cache_groups) - 1
    assert b.reserve().block_tables == extra * per_group


def test_describe_names_every_item(bind):
    """The startup line (6.4 style) gives the total and each item."""
    reserve = bind().reserve()
    line = reserve.describe()
    mib = 1 << 20
    assert line.startswith(
        f"HiSparse: reserved {reserve.total / mib:.1f} MiB of GPU memory per worker "
        "outside the KV pool, counted before KV sizing (in-slab staging "
        f"{reserve.staging_blocks} blocks ")
    for item in ("hot-slot state", "resolver workspace", "prefill staging cache",
                 "mirror descriptors", "block tables of the HiSparse groups"):
        assert item in line
    assert reserve.total == (reserve.staging_bytes + reserve.worker_state
                             + reserve.block_tables)


def test_reserve_covers_k7s_buffers_when_the_step_order_is_on(bind):
    """P9 with K7 (order_misses="step", L17): the reserve counts K7's four
    cell lists and its total exactly and CUB's scratch as an estimate (the
    CPU reference asks for none: the walk then holds less than the reserve
    by at most that estimate); with the order off it counts none."""
    from vllm.v1.hisparse.memory import step_order_bytes, workspace_bytes, workspace_rows

    b = bind(order="step")
    rows = workspace_rows(b.limits, b.layout.max_decode_query_len)
    cells = rows * b.layout.index_topk
    so = b.rt.workspace.step_order
    assert nbytes(so.keys, so.cells, so.sorted_keys, so.sorted_cells, so.total) == (
        4 * cells * 4 + 4)
    reserve = b.reserve()
    assert reserve.workspace == (workspace_bytes(rows, b.layout.index_topk)
                                 + step_order_bytes(rows, b.layout.index_topk))
    held = held_tensor_bytes([b.rt, b.worker, b.staging], "cpu",
                             exclude=[b.slab, b.pool.tensor])
    scratch = step_order_bytes(rows, b.layout.index_topk) - (4 * cells * 4 + 4)
    assert held <= reserve.worker_state <= held + scratch
    assert bind().reserve().workspace == workspace_bytes(rows, b.layout.index_topk)
