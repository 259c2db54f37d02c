# SPDX-License-Identifier: Apache-2.0
"""F17 (a completed copy proves nothing unless the forward that wrote the
page ran first) and F15 (host-prefix hits against a nearly full host pool
never deadlock), on vLLM's real scheduler with the simulated worker."""

import random

import pytest
from vllm.v1.hisparse.metadata import HiSparseWorkerAck

from tests.hisparse.scheduler.harness import drain, make_request
from tests.hisparse.scheduler.helpers import coord, hs, prompt, published_pages, step
from tests.hisparse.scheduler.invariants import (
    check_drained,
    check_published,
)


def test_f17_a_completion_submitted_before_the_planned_forward_is_ignored(build):
    """F17, INV-17, INV-18: a worker reporting a spill as submitted after
    the forward of a step *before* the one that carried it proves nothing
    about the page's KV: the completion is ignored (the page stays pending,
    nothing is published, the leases stay), however often it is repeated.
    A completion with no submitted step at all is ignored too. The correct
    report then completes it."""
    s, w = build()
    r = make_request("r", prompt(128), 100)
    s.add_request(r)
    w.faults.early_submit = {1, 2}  # the spills of pages 0 and 1
    for _ in range(3):
        step(s, w)
    st = hs(s).states["r"]
    assert sorted(st.pending) == [0, 1] and not st.valid
    assert published_pages(s, r) == 0
    assert hs(s).stats.completions_ignored >= 2 * 3
    for spill in hs(s).pending_spills.values():
        assert spill.planned_step == 1 and spill.submitted_step == 0
        assert spill.enqueued == frozenset({0}) and not spill.completed
        assert spill.host_block.ref_cnt == 2  # the request + the transfer lease
    w.faults.early_submit = set()
    step(s, w)
    assert st.valid >= {0, 1} and not st.pending
    assert published_pages(s, r) == 2

    # A completion without any submitted step (never reported) is ignored.
    w.hold = set(range(1, 1000))
    for _ in range(100):
        if st.pending:
            break
        step(s, w)  # decode until page 2 seals
    assert list(st.pending) == [2]
    (tid,) = st.pending.values()
    spill = hs(s).pending_spills[tid]
    spill.submitted_step = None
    hs(s).update_spills(HiSparseWorkerAck(
        enqueued={tid: frozenset({0})}, completed={tid: frozenset({0})}))
    assert tid in hs(s).pending_spills and 2 not in st.valid
    w.hold = set()
    drain(s, w)
    check_drained(s)
    assert check_published(s, w) >= 2


def test_f17_preempt_after_planning_before_the_forward_publishes_nothing(build):
    """F17, INV-19, R15: under the priority policy vLLM can preempt a
    request it already scheduled in this pass (a higher-priority one's
    allocation failed). Its spills planned in that pass are for a forward
    that will never include it: they are cancelled before any worker sees
    them (never in the metadata), their leases return at once, nothing of
    the preempted incarnation is published beyond what it had published,
    and after draining both pools are back to their initial accounting.

    Waiting for in-flight copies (R26) and giving pages up (R25) remove the
    GPU-pool preemptions this used to rely on; a host pool that cannot back
    b's next page (INV-6) still preempts. The numbers put a's page seal
    and b's host shortage in the same pass; the GPU pool lets b's whole
    sequence fit beside a's reservation, which admission requires (K33)."""
    s, w = build(num_gpu_blocks=120, num_host_blocks=35, max_num_seqs=4,
                 policy="priority", max_num_batched_tokens=256,
                 long_prefill_token_threshold=128)
    a = make_request("a", prompt(1000, 1), 200, priority=1)
    s.add_request(a)
    step(s, w)
    s.add_request(make_request("b", prompt(1002, 2), 200, priority=0))
    old = hs(s).states["a"]
    published_before = 0
    for _ in range(200):
        published_before = published_pages(s, a)
        so = step(s, w)
        if hs(s).stats.spills_cancelled:
            break
    assert hs(s).stats.spills_cancelled > 0
    # a was scheduled in that pass, then preempted by b's failed allocation.
    assert "a" in so.preempted_req_ids and "a" not in so.num_scheduled_tokens
    assert "b" in so.num_scheduled_tokens
    assert not hs(s).is_current(old) and old.publication is None
    planned = set(range(1, hs(s)._next_transfer_id))
    sent = set(w.transfers_seen)
    assert len(planned - sent) == hs(s).stats.spills_cancelled
    assert all(s_.planned_step for s_ in hs(s).pending_spills.values())
    assert published_pages(s, a) == published_before
    step(s, w)  # spills already sent complete, on a dead incarnation
    assert not old.pending
    assert published_pages(s, a) == published_before
    drain(s, w)
    check_drained(s)
    check_published(s, w)


@pytest.mark.parametrize("num_host_blocks", [30, 48])
def test_f15_host_prefix_hits_against_a_nearly_full_host_pool_make_progress(
    build, num_host_blocks
):
    """F15, INV-6, 4.15: many requests hit a published host prefix while the
    host pool has room for only a few of them at a time. Every request
    finishes, hits really happen, the host pool really runs (nearly) dry,
    and no step is empty of scheduled work while requests are waiting."""
    s, w = build(num_gpu_blocks=400, num_host_blocks=num_host_blocks,
                 max_num_seqs=8, max_num_batched_tokens=256)
    base = prompt(640, 5)  # 10 pages, published on host
    s.add_request(make_request("seed", base, 1))
    drain(s, w)
    rng = random.Random(5)
    reqs = [make_request(f"q{i}", base + prompt(rng.randint(70, 300), 100 + i),
                         rng.randint(20, 80)) for i in range(16)]
    for r in reqs:
        s.add_request(r)
    hits = 0
    host = coord(s).host_pool
    min_free = host.get_num_free_blocks()
    for i in range(5000):
        if not s.has_unfinished_requests():
            break
        waiting = len(s.waiting) + len(s.skipped_waiting)
        so = step(s, w)
        if waiting:
            min_free = min(min_free, host.get_num_free_blocks())
        hits += sum(1 for n in so.scheduled_new_reqs if n.num_computed_tokens > 0)
        assert not waiting or so.total_num_scheduled_tokens > 0, (
            f"step {i}: {waiting} requests wait and nothing was scheduled (F15)")
    assert all(r.is_finished() for r in reqs)
    assert hits >= 4 and min_free <= 2
    drain(s, w)
    check_drained(s)
    check_published(s, w)
