# SPDX-License-Identifier: Apache-2.0
"""The array metadata the scheduler sends each step (spec 2.6, 4.1 step 3;
``vllm.v1.hisparse.metadata``), on vLLM's real scheduler.

Besides what each test asserts, the simulated worker checks on every step
that the residency-update CSR is exactly the per-request updates of spec
4.6 step 4 / R4 (computed from its own view of the tables), and that hot
regions are announced and released exactly once.
"""

import random

import numpy as np
from vllm.v1.hisparse.coordinator import _CLEAN

from tests.hisparse.scheduler.harness import (
    drain,
    make_request,
    model_output,
    schedule,
)
from tests.hisparse.scheduler.helpers import coord, hs, prompt, step
from tests.hisparse.scheduler.invariants import check_drained, check_invariants


def decoded_updates(meta) -> dict:
    """The CSR as {request: (start page, per resident group the block ids)}."""
    out = {}
    for i in range(len(meta.update_req_ids)):
        req_id, start, rows = meta.residency_update(i)
        out[req_id] = (start, tuple(tuple(rows[:, g].tolist()) for g in range(rows.shape[1])))
    return out


class OldUpdates:
    """The pre-array algorithm, run on the coordinator's state just before
    each ``build_step_metadata``: a loop over every scheduled request that
    sends (dirty_from, table[dirty_from:]) unless the request is new or
    resumed (its whole table travels with vLLM's block ids)."""

    def __init__(self, s):
        self.s = s
        self.per_step: list[tuple[dict, dict]] = []
        self.dirty_unscheduled = 0
        self.dirty_full_table = 0
        h = hs(s)
        build = h.build_step_metadata

        def observed(so, *args, **kwargs):
            expected = self.expected(so)
            meta = build(so, *args, **kwargs)
            self.per_step.append((expected, decoded_updates(meta)))
            return meta

        h.build_step_metadata = observed

    def expected(self, so) -> dict:
        h = hs(self.s)
        full = {r.req_id for r in so.scheduled_new_reqs}
        full |= so.scheduled_cached_reqs.resumed_req_ids
        self.dirty_unscheduled += sum(
            1 for req_id, st in h.states.items()
            if st.dirty_from != _CLEAN and req_id not in so.num_scheduled_tokens
        )
        out = {}
        for req_id in so.num_scheduled_tokens:
            st = h.states.get(req_id)
            if st is None or st.request is None or st.dirty_from == _CLEAN:
                continue
            if req_id in full:
                self.dirty_full_table += 1
                continue
            out[req_id] = (st.dirty_from, tuple(
                tuple(b.block_id for b in t[st.dirty_from:]) for t in h._tables(req_id)
            ))
        return out


def test_csr_updates_equal_the_per_request_updates_lost_pages(build):
    """S-7, INV-22, R4: under reuse pressure with arrivals sharing
    prefixes (pages lost, pages adopted at admission), the CSR rows are
    exactly the old per-request updates on every step: one row per scheduled
    dirty request, from its first changed page; clean requests get no row;
    new requests with adopted pages get none (their table is sent whole)."""
    rng = random.Random(4)
    s, w = build(num_gpu_blocks=90, num_host_blocks=260, max_num_seqs=8,
                 max_num_batched_tokens=256, admission_max_tokens=256)
    old = OldUpdates(s)
    prefixes = [prompt(rng.randint(64, 400), 50 + i) for i in range(4)]
    for i in range(1500):
        if len(s.waiting) < 4 and rng.random() < 0.6:
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            s.add_request(make_request(f"q{i}", head + prompt(rng.randint(20, 700), i),
                                       rng.randint(1, 160)))
        step(s, w)
        expected, got = old.per_step[-1]
        assert got == expected  # hence no row for a clean request
    rows = sum(len(got) for _, got in old.per_step)
    assert hs(s).stats.lost_pages > 0 and rows > 0
    assert hs(s).stats.pages_adopted > 0
    assert old.dirty_full_table > 0  # adopted at admission: no row
    drain(s, w)
    check_drained(s)


def test_an_unscheduled_request_keeps_its_change_until_scheduled(build):
    """S-7, INV-22, 4.6 step 4: a running request the scheduler skips (as
    under PP: ``next_decode_eligible_step``) loses pages while others
    allocate; no update is sent while it is not scheduled, and the first
    step that schedules it carries one row from its first lost page, equal
    to the per-request update."""
    s, w = build(num_gpu_blocks=90, admission_max_tokens=64, max_num_seqs=4)
    old = OldUpdates(s)
    a = make_request("a", prompt(640, 1), 200)
    s.add_request(a)
    for _ in range(4):
        step(s, w)
    st = hs(s).states["a"]
    assert st.unpinned and st.dirty_from == _CLEAN
    a.next_decode_eligible_step = 10**9  # skipped from now on
    s.add_request(make_request("b", prompt(1600, 2), 4))
    for _ in range(40):
        so = step(s, w)
        assert "a" not in so.num_scheduled_tokens
        assert "a" not in so.kv_connector_metadata.update_req_ids
        if st.dirty_from != _CLEAN and old.dirty_unscheduled >= 2:
            break
    lost_from = st.dirty_from
    assert lost_from != _CLEAN and old.dirty_unscheduled >= 2
    a.next_decode_eligible_step = 0
    so = step(s, w)
    assert "a" in so.num_scheduled_tokens
    expected, got = old.per_step[-1]
    assert got == expected and got["a"][0] == lost_from
    assert all(col[0] == 0 for col in got["a"][1])
    assert st.dirty_from == _CLEAN
    drain(s, w)
    check_drained(s)


def test_adopted_pages_travel_with_the_new_table_then_lost_pages_as_rows(build):
    """S-10, INV-23, R4: a host-prefix hit adopts surviving GPU copies at
    admission; the request is new, so the worker gets its whole table
    (adopted blocks included) through vLLM's block ids and the CSR has no
    row for it, exactly as before. Once those pages are unpinned and reused,
    the later losses come as rows starting at the first lost page."""
    s, w = build(num_gpu_blocks=150, num_host_blocks=400, max_num_seqs=4)
    old = OldUpdates(s)
    base = prompt(640, 7)
    s.add_request(make_request("a", base, 1))
    drain(s, w)
    assert hs(s).copies
    b = make_request("b", base + prompt(100, 8), 300)
    s.add_request(b)
    so = step(s, w)
    assert "b" in {r.req_id for r in so.scheduled_new_reqs}
    assert hs(s).stats.pages_adopted > 0
    expected, got = old.per_step[-1]
    assert "b" not in got and got == expected
    assert old.dirty_full_table >= 1
    st = hs(s).states["b"]
    assert st.dirty_from == _CLEAN and st not in hs(s)._dirty
    # Pressure: other requests reuse b's unpinned adopted pages.
    for i in range(3):
        s.add_request(make_request(f"f{i}", prompt(900, 20 + i), 2))
    saw_row = False
    for _ in range(200):
        so = step(s, w)
        expected, got = old.per_step[-1]
        assert got == expected
        if "b" in got:
            saw_row = True
            start, rows = got["b"]
            assert rows[0][0] == 0  # the first rewritten page is a lost one
        if not s.has_unfinished_requests():
            break
    assert saw_row
    drain(s, w)
    check_drained(s)


def test_reused_unpinned_blocks_null_their_owners_pages(build):
    """INV-3, INV-22: every unpinned GPU block the pool hands out nulls the
    pages that read it, in every resident group of a live owner."""
    s, w = build(num_gpu_blocks=90, admission_max_tokens=64, max_num_seqs=4)
    pool = coord(s).block_pool
    s.add_request(make_request("a", prompt(640, 1), 200))
    for _ in range(4):
        step(s, w)
    assert hs(s).states["a"].unpinned
    s.add_request(make_request("b", prompt(1600, 2), 4))
    reused_total = 0
    for _ in range(60):
        watched = set(pool._reuse_watchers)
        owners = {b: set(o) for b, o in hs(s).owners.items()}
        so = schedule(s)
        still = set(pool._reuse_watchers)
        s.update_from_output(so, model_output(s, so, w.step(so)))
        check_invariants(s)
        # Watchers leave only by reuse (a block unpinned and reused within
        # the pass is not seen here).
        reused = watched - still
        for block_id in reused:
            for st, page in owners.get(block_id, ()):
                if hs(s).is_current(st):
                    for t in hs(s)._tables(st.request_id):
                        assert t[page].is_null
        reused_total += len(reused)
        if not s.has_unfinished_requests():
            break
    assert reused_total > 0 and hs(s).stats.lost_pages > 0


def test_hot_regions_across_preempt_and_resume(build):
    """INV-5, INV-24: a request's hot region is announced when allocated
    (its first block in the first hot group); preemption releases it once;
    the resumed request gets a new "allocated" entry (a fresh state slot),
    and finishing releases that one once. The worker applies freed before
    allocated, so a start may be in both lists of one step."""
    s, w = build(num_gpu_blocks=300, admission_max_tokens=64)
    hot_mgr = coord(s).single_type_managers[coord(s).hot_group_ids[0]]
    r = make_request("r", prompt(640, 3), 80)
    s.add_request(r)
    allocated: list[int] = []
    freed: list[int] = []

    def record_step():
        meta = step(s, w).kv_connector_metadata
        allocated.extend(meta.hot_regions_allocated.tolist())
        freed.extend(meta.hot_regions_freed.tolist())
        return meta

    def region_of(req_id):
        blocks = hot_mgr.req_to_blocks.get(req_id)
        return blocks[0].block_id if blocks else None

    for _ in range(20):
        record_step()
        if region_of("r") is not None:
            break
    region = region_of("r")
    assert region is not None and allocated == [region] and freed == []
    for _ in range(3):
        record_step()
    assert allocated == [region] and freed == []  # stable while it runs (INV-5)
    s.running.remove(r)
    s._preempt_request(r, 0.0)
    check_invariants(s)
    assert region_of("r") is None
    meta = record_step()  # the next step carries the release
    assert meta.hot_regions_freed.tolist() == [region]
    for _ in range(20):
        if region_of("r") is not None:
            break
        record_step()
    resumed = region_of("r")
    assert resumed is not None
    assert allocated == [region, resumed]  # a new entry for the resumed request
    assert freed == [region]  # released exactly once
    while s.has_unfinished_requests() or s.connector.has_pending_push_work():
        record_step()
    assert r.is_finished()
    # The release of a finished request's region reaches the workers with
    # the next step, if it was not in the last one already.
    s.add_request(make_request("x", prompt(100, 9), 1))
    record_step()
    assert freed == [region, resumed]
    assert w.regions_freed == 2
    drain(s, w)
    check_drained(s)


def test_a_region_released_before_any_worker_saw_it_is_not_reported(build):
    """R17 (INV-24): a region allocated and released within one scheduling
    pass (its request preempted while the pass schedules another) reaches
    the workers in neither list; a region released after it was announced
    is listed as freed, even if the same start is allocated again that step."""
    s, w = build()
    h = hs(s)
    blk = coord(s).block_pool.blocks[7]
    h.note_hot_region_allocated("r", blk)
    h.note_hot_region_freed(blk)
    so = s.schedule()
    meta = so.kv_connector_metadata
    assert meta.hot_regions_allocated.tolist() == []
    assert meta.hot_regions_freed.tolist() == []
    h.note_hot_region_allocated("r", blk)
    meta = h.build_step_metadata(so)
    assert meta.hot_regions_allocated.tolist() == [7]
    assert meta.hot_region_requests == ["r"]  # F22: slots are found by request
    h.note_hot_region_freed(blk)
    h.note_hot_region_allocated("r", blk)
    meta = h.build_step_metadata(so)
    assert meta.hot_regions_freed.tolist() == [7]
    assert meta.hot_regions_allocated.tolist() == [7]


def test_arrays_have_the_contract_dtypes_and_shapes(build):
    """Spec 2.6 (array form): dtypes and shapes of every field, G columns
    for the resident groups even when empty, and one step number per call
    starting at 1."""
    s, w = build()
    g = len(coord(s).resident_group_ids)
    s.add_request(make_request("r", prompt(300), 4))
    metas = []
    for _ in range(3):
        metas.append(step(s, w).kv_connector_metadata)
    assert [m.step for m in metas] == [1, 2, 3]
    first = metas[0]
    assert first.num_transfers == 4  # pages 0-3 sealed by the prompt
    assert first.transfer_ids.dtype == np.int64
    assert first.transfer_host_blocks.dtype == np.int32
    assert first.transfer_resident_blocks.dtype == np.int32
    assert first.transfer_resident_blocks.shape == (4, g)
    assert first.transfer_restore.dtype == np.bool_
    assert first.new_source_block_ids.dtype == np.int32
    assert len(first.new_source_block_ids) == 4  # the first 256-token chunk
    for m in metas:
        assert m.update_block_ids.shape[1] == g and m.update_indptr.dtype == np.int64
        assert m.transfer_resident_blocks.shape[1] == g
        assert m.retired_transfer_ids.dtype == np.int64
    assert metas[1].retired_transfer_ids.tolist() == [1, 2, 3, 4]
    table = coord(s).single_type_managers[coord(s).source_group_id].req_to_blocks["r"]
    assert first.transfer_host_blocks.tolist() == [b.block_id for b in table[:4]]
    for col, gid in enumerate(coord(s).resident_group_ids):
        res = coord(s).single_type_managers[gid].req_to_blocks["r"]
        assert first.transfer_resident_blocks[:, col].tolist() == [
            b.block_id for b in res[:4]]
