# SPDX-License-Identifier: Apache-2.0
"""F22 (spec 7), INV-24, INV-33/34: a batch row's request-state slot comes
from state the worker owns (the slot it gave to the row's *request*), never
from block-table contents it did not write.

vLLM's ``InputBatch`` clears a removed request's columns, but ``condense``
(``BlockTable.move_row``) copies a row down and leaves the source row's
contents, and ``add_row`` of a request without hot blocks writes nothing.
Deriving the slot from column 0 of the hot table, as the runtime did, gave a
region-less request placed in such a row the stale first block of another
request's hot region: that region's slot while it lived, and -1 (the
padding branch: every decode row masked, attention over nothing) once it was
freed. This drives vLLM's real ``InputBatch`` through add, remove, condense
and add, through the runner adapter the worker uses (``RunnerBatchState``),
with and without pressure, and checks the slots and the resolver's rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.hisparse.binding import RunnerBatchState
from vllm.v1.hisparse.metadata import HiSparseStepMetadata
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from worker_harness import B, WorkerRig, fill_pattern, tiny_config

MAX_REQS = 8
MAX_BLOCKS = 32


@pytest.fixture(autouse=True)
def no_pinned_memory(monkeypatch):
    """InputBatch pins its CPU buffers when the platform says it can; the
    CPU test platform says so without a CUDA allocator behind it."""
    import vllm.v1.worker.gpu_input_batch as gpu_input_batch

    monkeypatch.setattr(gpu_input_batch, "PIN_MEMORY", False)


class Runner:
    """What ``RunnerBatchState`` reads of the GPU model runner: the real
    persistent batch and the step's query start locations."""

    def __init__(self, num_groups: int) -> None:
        self.input_batch = InputBatch(
            max_num_reqs=MAX_REQS, max_model_len=MAX_BLOCKS * B,
            max_num_batched_tokens=512, device=torch.device("cpu"),
            vocab_size=8192, block_sizes=[B] * num_groups,
            kernel_block_sizes=[B] * num_groups,
            max_num_blocks_per_req=[MAX_BLOCKS] * num_groups)
        self.query_start_loc = SimpleNamespace(np=np.zeros(MAX_REQS + 1, np.int32))


class Rig(WorkerRig):
    """A WorkerRig over the runner's real ``InputBatch`` (``self.batch``),
    read through ``RunnerBatchState``; the slab filled. Requests come in
    through ``add`` (``place`` and ``run`` drive a harness ``Batch``)."""

    def __init__(self) -> None:
        config = tiny_config()
        self.runner = Runner(len(config.layout.kv_cache_groups))
        super().__init__(config=config, tables=RunnerBatchState(self.runner),
                         max_num_seqs=MAX_REQS)
        self.batch = self.runner.input_batch
        fill_pattern(self.slab, seed=3)
        self.seq_len = 100  # two pages per request

    def add(self, req_id: str, first: int, hot: list[int]) -> int:
        """A request of two pages: resident blocks first, first + 1 in every
        resident group (+50 per pair), host blocks alike, hot region ``hot``
        (empty: none)."""
        L = self.layout
        ids: list[list[int]] = [[] for _ in L.kv_cache_groups]
        for j, gid in enumerate(L.resident_group_ids):
            ids[gid] = [50 * j + first, 50 * j + first + 1]
        for j, gid in enumerate(L.hot_group_ids):
            ids[gid] = [50 * j + b for b in hot]
        ids[L.SOURCE_GROUP_ID] = [first, first + 1]
        ids[L.INDEXER_GROUP_ID] = [first, first + 1]
        state = CachedRequestState(
            req_id=req_id, prompt_token_ids=[1] * (self.seq_len - 1), mm_features=[],
            sampling_params=SamplingParams(temperature=0.0), generator=None,
            block_ids=tuple(ids), num_computed_tokens=self.seq_len - 1,
            output_token_ids=[])
        return self.batch.add_request(state)

    def remove(self, *req_ids: str) -> None:
        for r in req_ids:
            self.batch.remove_request(r)
        self.batch.condense()
        self.batch.refresh_metadata()

    def start(self, allocated=(), requests=(), freed=()) -> None:
        """One decode step of every request in the batch (W1)."""
        n = self.batch.num_reqs
        self.runner.query_start_loc.np[: n + 1] = np.arange(n + 1)
        for g in range(len(self.layout.kv_cache_groups)):
            self.batch.block_table[g].commit_block_table(n)
        self.step += 1
        meta = HiSparseStepMetadata(step=self.step)
        meta.hot_regions_allocated = np.asarray(allocated, dtype=np.int32)
        meta.hot_regions_freed = np.asarray(freed, dtype=np.int32)
        meta.hot_region_requests = list(requests)
        md = SimpleNamespace(
            req_id_per_token=torch.arange(MAX_REQS, dtype=torch.int32),
            num_prefills=0, num_decodes=n, num_decode_tokens=n,
            seq_lens=torch.full((n,), self.seq_len, dtype=torch.int32),
            block_table=self.batch.block_table[self.layout.SOURCE_GROUP_ID]
            .block_table.gpu[:n])
        self.worker.start_step(meta, md)
        self.md = md

    def resolve(self) -> torch.Tensor:
        """The leader of pair 0 resolves top-k = positions 3 and 70 for
        every row (page 0 and page 1, both resident)."""
        n = self.batch.num_reqs
        topk = torch.full((n, 64), -1, dtype=torch.int32)
        topk[:, :2] = torch.tensor([3, 70], dtype=torch.int32)
        layer = self.layout.sparse_layers[0]
        rows, _ = self.rt.decode_rows(layer, n, topk, self.md.seq_lens,
                                      self.md.block_table)
        return rows

    def finish(self) -> None:
        self.worker.finish_forward()

    def row(self, req_id: str) -> int:
        return self.batch.req_id_to_index[req_id]

    def hot_col0(self, req_id: str) -> int:
        gid = self.layout.hot_group_ids[0]
        return int(self.batch.block_table[gid].block_table.np[self.row(req_id), 0])


@pytest.mark.parametrize("pressure", [True, False], ids=["pressure", "no-pressure"])
def test_a_region_less_request_in_a_condensed_away_row_uses_the_resident_slot(pressure):
    """F22. Rows D, X, C, E (E with hot region 20 under pressure); X leaves,
    condense moves E from row 3 to row 1 (row 3 keeps E's hot blocks); E
    finishes (its region freed); F and then B (no region) are added, B into
    row 3. B's slot is the resident-only row, never E's stale region, and
    its rows resolve to its resident pages."""
    rig = Rig()
    rt = rig.rt
    sa = rt.geometry.attention_block_stride
    region = [20, 21] if pressure else []
    for i, (req, hot) in enumerate((("D", []), ("X", []), ("C", []), ("E", region))):
        assert rig.add(req, 2 + 2 * i, hot) == i
    rig.start(allocated=[20] if pressure else [], requests=["E"] if pressure else [])
    e_slot = rt.slots.of_request.get("E")
    assert (e_slot is not None) == pressure
    rig.finish()

    rig.remove("X")
    assert rig.row("E") == 1
    rig.start()
    assert int(rt.req_state[rig.row("E")]) == (e_slot if pressure else rt.resident_only_slot)
    rig.finish()

    rig.remove("E")  # finished: its region is freed this step
    rig.add("F", 12, [30, 31] if pressure else [])
    b_row = rig.add("B", 14, [])
    assert b_row == 3
    # vLLM left E's hot blocks in row 3: B's hot row is stale.
    assert rig.hot_col0("B") == (20 if pressure else 0)
    rig.start(allocated=[30] if pressure else [], requests=["F"] if pressure else [],
              freed=[20] if pressure else [])
    state = rt.req_state[: rig.batch.num_reqs].tolist()
    assert state[b_row] == rt.resident_only_slot  # INV-34: never -1 (F22)
    f_slot = rt.slots.of_request.get("F")
    assert state[rig.row("F")] == (f_slot if pressure else rt.resident_only_slot)
    assert state[rig.row("D")] == state[rig.row("C")] == rt.resident_only_slot
    assert rt.req_state[rig.batch.num_reqs:].eq(-1).all()  # F13 padding
    rows = rig.resolve()
    b_blocks = (14, 15)  # pair 0: B's resident blocks
    assert rows[b_row, :2].tolist() == [b_blocks[0] * sa + 3, b_blocks[1] * sa + 70 - B]
    assert (rows[:, :2] >= 0).all(), "a resident-only row took the padding branch"
    rig.finish()


def test_slots_follow_requests_through_free_and_reuse_of_a_region_start():
    """INV-5/INV-24: a region's first block can end one region and start
    another in the same step (freed first); the new owner gets a freshly
    reset slot and the old owner none; a second live region for one
    request is refused."""
    rig = Rig()
    rt = rig.rt
    rig.add("A", 2, [20, 21])
    rig.start(allocated=[20], requests=["A"])
    a_slot = rt.slots.of_request["A"]
    for group in rt.groups:
        group.dgi[a_slot].fill_(1234)
    rig.finish()
    rig.remove("A")
    rig.add("B", 4, [20, 21])
    rig.start(allocated=[20], requests=["B"], freed=[20])
    assert "A" not in rt.slots.of_request and rt.slots.num_live == 1
    b_slot = rt.slots.of_request["B"]
    for group in rt.groups:
        assert torch.all(group.dgi[b_slot] == -1)
    assert int(rt.req_state[rig.row("B")]) == b_slot
    rig.finish()
    with pytest.raises(RuntimeError, match="second hot region"):
        rt.apply_hot_regions(np.zeros(0, np.int32), np.array([40], np.int32), ["B"])
    with pytest.raises(RuntimeError, match="2 hot regions allocated for 1"):
        rt.apply_hot_regions(np.zeros(0, np.int32), np.array([41, 42], np.int32), ["C"])
