# SPDX-License-Identifier: Apache-2.0
"""Event-driven residency (issue 10 item 2; spec 4.1 hot path, 4.5).

A request whose residency inputs did not change since its last full pass
is *settled*: its per-step cost is a comparison (no materialization, no
residency pass, no publication, no per-group allocation calls). These tests
pin down that the shortcut changes nothing observable: the scheduler's
decisions and the worker metadata are the ones the full pass every step
produces, and a settled request never hides an allocation it needs."""

import dataclasses
import random

import numpy as np
import pytest

from tests.hisparse.scheduler.harness import B, Faults, drain, make_request, run_step
from tests.hisparse.scheduler.helpers import coord, hs, prompt, step
from tests.hisparse.scheduler.invariants import check_drained, check_invariants
from tests.hisparse.scheduler.test_property import workload_step
from vllm.v1.hisparse.coordinator import HiSparseCoordinator
from vllm.v1.hisparse.kv_cache_coordinator import HiSparseKVCacheCoordinator


def _metadata_record(meta) -> dict:
    out = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        out[f.name] = v.tolist() if isinstance(v, np.ndarray) else v
    return out


def _pressure_trace(build, steps: int, seed: int) -> tuple[list, dict, list]:
    """Run the property workload; return every step's metadata, the final
    stats and the scheduled tokens per step."""
    rng = random.Random(seed)
    s, w = build(num_gpu_blocks=90, num_host_blocks=260, ranks=2,
                 faults=Faults(max_delay=2, lagging_rank_delay=1), seed=seed,
                 max_num_seqs=8, max_num_batched_tokens=256)
    prefixes = [prompt(rng.randint(64, 400), 100 + i) for i in range(5)]
    counter = [0]
    metas, scheduled = [], []
    for i in range(steps):
        workload_step(s, rng, prefixes, counter, i)
        so = run_step(s, w)
        check_invariants(s)
        metas.append(_metadata_record(w.last_meta))
        scheduled.append(dict(so.num_scheduled_tokens))
    drain(s, w)
    check_drained(s)
    return metas, dict(vars(hs(s).stats)), scheduled


def test_event_driven_residency_equals_the_full_pass_every_step(build, monkeypatch):
    """Issue 10 item 2, INV-1..23 as checked by the simulated worker: under
    pressure (lost pages, adoption, preemption, aborts, late and multi-rank
    acks) the event-driven coordinator sends exactly the metadata, and the
    scheduler makes exactly the decisions, of one that runs the full
    residency pass and the per-group allocation for every request in every
    step."""
    fast = _pressure_trace(build, 1200, seed=5)
    monkeypatch.setattr(HiSparseCoordinator, "is_settled", lambda self, r, n: False)
    monkeypatch.setattr(HiSparseKVCacheCoordinator, "_fits", lambda self, r, n: False)
    full = _pressure_trace(build, 1200, seed=5)
    stats = fast[1]
    assert stats["lost_pages"] > 0 and stats["pages_adopted"] > 0
    assert stats["spills_completed"] > 0
    assert fast[2] == full[2]
    assert fast[1] == full[1]
    for i, (a, b) in enumerate(zip(fast[0], full[0])):
        assert a == b, f"step {i + 1}: metadata differs"


def test_a_settled_decode_request_skips_the_full_pass(build, monkeypatch):
    """Issue 10 item 2: a decode request inside a page runs no residency
    pass; the page boundary (a new full page and an allocation) runs one."""
    s, w = build(num_gpu_blocks=400, num_host_blocks=400)
    r = make_request("r", prompt(3 * B + 10, 1), 200)
    s.add_request(r)
    while r.num_computed_tokens < r.num_prompt_tokens:
        step(s, w)
    step(s, w)
    passes = []
    real = HiSparseCoordinator.advance_scheduled

    def counted(self, request, num_tokens):
        passes.append(num_tokens)
        return real(self, request, num_tokens)

    monkeypatch.setattr(HiSparseCoordinator, "advance_scheduled", counted)
    assert hs(s).is_settled("r", r.num_computed_tokens + 1)
    while r.num_computed_tokens + 1 < 4 * B:
        step(s, w)
    assert passes == []
    step(s, w)  # the step that fills page 3
    step(s, w)  # the first token of page 4: its allocation and full pages
    assert passes, "a page boundary must run the full pass"
    drain(s, w)
    check_drained(s)


@pytest.mark.parametrize("num_gpu_blocks", [90, 400])
def test_room_never_hides_an_allocation(build, num_gpu_blocks):
    """Issue 10 item 2 / INV-5, INV-7: whenever a request is settled, the
    per-group answer at its room is "nothing to allocate" in every group
    (its hot region, if required, is complete), so the fast path returns
    what the slow one would."""
    s, w = build(num_gpu_blocks=num_gpu_blocks, num_host_blocks=600,
                 max_num_seqs=6, max_num_batched_tokens=256)
    for i in range(6):
        s.add_request(make_request(f"r{i}", prompt(300 + 170 * i, i), 150))
    c = coord(s)
    checked = 0
    for _ in range(900):
        if not s.has_unfinished_requests():
            break
        step(s, w)
        for req in s.running:
            st = hs(s).states.get(req.request_id)
            if st is None or not st.room:
                continue
            checked += 1
            for gid, m in enumerate(c.single_type_managers):
                assert m.get_num_blocks_to_allocate(
                    req.request_id, st.room, [], req.num_computed_tokens,
                    req.num_computed_tokens, st.room) == 0, (req.request_id, gid)
            if st.hot_required:
                assert hs(s).can_read_from_host(req.request_id)
    assert checked > 100
    drain(s, w)
    check_drained(s)


def test_the_watermark_turns_every_running_request_hot_in_one_step(build):
    """Spec 4.5 / INV-21, checked once per step (issue 10 item 2): while
    free GPU blocks stay at or above the watermark, requests below the
    admission window stay fully resident; the first step that ends below it
    makes every running request hot-required at once, and their regions
    are allocated on the next pass. R27: except those whose region costs
    more blocks than their pages beyond the tail could ever free (the
    small ones: 3 pages, 1 beyond the tail, 4 blocks < an 8-block region)."""
    s, w = build(num_gpu_blocks=400, admission_max_tokens=512,
                 max_num_batched_tokens=512, max_num_seqs=16)
    h = hs(s)
    assert h.transition_watermark == 40 and h.cap_res_pages == 10
    pool = coord(s).block_pool
    for i in range(3):
        s.add_request(make_request(f"small{i}", prompt(100, i), 60))
    step(s, w)
    i = 0
    while True:
        # Each filler: 8 pages (< cap_res) in 5 groups = 40 blocks.
        s.add_request(make_request(f"fill{i}", prompt(8 * B - 50, 10 + i), 40))
        i += 1
        step(s, w)
        below = pool.get_num_free_blocks() < h.transition_watermark
        running = [r.request_id for r in s.running]
        if not below:
            assert not any(h.is_hot_required(r) for r in running)
            continue
        break
    # The watermark is read when a step's metadata is built (inside
    # schedule()), so the next step has seen it at the latest.
    step(s, w)
    running = [r.request_id for r in s.running]
    assert len(running) >= 8
    region = h.hot_blocks_per_request
    assert region == 8
    worth = {r for r in running
             if (len(h._tables(r)[0]) - 2) * len(h.residents) > region}
    assert {r for r in running if r.startswith("fill")} <= worth
    assert not any(r.startswith("small") for r in worth)
    assert all(h.is_hot_required(r) == (r in worth) for r in running)
    # Their regions come on the next pass; their unpinned pages count as
    # free again, so later arrivals are admitted fully resident.
    step(s, w)
    assert all(h.can_read_from_host(r) == (r in worth) for r in running)
    drain(s, w)
    check_drained(s)
