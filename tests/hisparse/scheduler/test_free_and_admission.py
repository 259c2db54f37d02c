# SPDX-License-Identifier: Apache-2.0
"""What ``free`` does with a request's clean pages (spec 4.6 step 5, 2.3,
R5, R7) and the host side of admission (spec 4.15, R6), on vLLM's real
scheduler with the simulated worker."""

import pytest

from tests.hisparse.scheduler.harness import AsyncDriver, abort, drain, make_request
from tests.hisparse.scheduler.helpers import coord, hs, prompt, step
from tests.hisparse.scheduler.invariants import check_drained, check_invariants


def free_queue_ids(s) -> list[int]:
    return [b.block_id for b in coord(s).block_pool.free_block_queue.get_all_free_blocks()]


@pytest.mark.parametrize("path", ["free", "pop_blocks_for_free"])
def test_free_unpins_clean_pages_tail_first(build, path):
    """Spec 4.6 step 5 and 2.3, INV-20, INV-3, S-6: when a request leaves,
    its clean pinned pages become anonymous readable copies, unpinned in one
    batch tail-first, so they enter the free queue last page first (every
    resident group of a page together, in group order): under pressure the
    request's tail is reused first and its prefix, the part a later prefix
    hit adopts, survives longest. Every copy keeps a reuse watcher and its
    copies entry. Both ways out: ``free`` (sync), and ``pop_blocks_for_free``
    (async scheduling with a request aborted while a step is in flight: its
    other GPU blocks are deferred, the copies are readable at once, R7)."""
    async_scheduling = path == "pop_blocks_for_free"
    s, w = build(num_gpu_blocks=400, num_host_blocks=400, admission_max_tokens=2048,
                 max_num_batched_tokens=512, async_scheduling=async_scheduling)
    r = make_request("r", prompt(640, 3), 40)
    s.add_request(r)
    driver = AsyncDriver(s, w) if async_scheduling else None

    def one():
        if driver is None:
            step(s, w)
        else:
            driver.step()
            check_invariants(s)

    for _ in range(6):  # prompt computed, its 10 pages clean, a few decodes
        one()
    st = hs(s).states["r"]
    assert not st.hot_required and st.pinned_clean == set(range(10))
    tables = [list(coord(s).single_type_managers[g].req_to_blocks["r"])
              for g in coord(s).resident_group_ids]
    popped = []
    pop = coord(s).pop_blocks_for_free

    def observed_pop(request_id):
        popped.append(request_id)
        return pop(request_id)

    coord(s).pop_blocks_for_free = observed_pop
    abort(s, ["r"])
    check_invariants(s)
    assert popped == (["r"] if async_scheduling else [])
    expected = [t[p].block_id for p in range(9, -1, -1) for t in tables]
    queue = free_queue_ids(s)
    first = queue.index(expected[0])
    assert queue[first:first + len(expected)] == expected
    if async_scheduling:
        assert first + len(expected) == len(queue)  # the rest is deferred
    pool = coord(s).block_pool
    for t in tables:
        for p in range(10):
            assert pool.has_reuse_watcher(t[p])
    assert all(b.block_id in hs(s)._copy_of_block for t in tables for b in t[:10])
    if driver is not None:
        while driver.busy():
            driver.step()
            check_invariants(s)
    drain(s, w)
    check_drained(s)


@pytest.mark.parametrize("spare", [0, 1], ids=["prompt-only", "prompt+1"])
def test_host_admission_reserves_one_block_past_the_prompt(build, spare):
    """Spec 4.15 item 1, INV-6, R6 (F8): a new request is admitted only when
    the host pool has cdiv(prompt, B) + 1 free blocks (the source manager's
    admission cost adds the tail block). With exactly the prompt's blocks
    free it waits, unscheduled and never preempted; with one more it runs to
    the end of its 5th page without a preemption."""
    pages = 4
    s, w = build(num_gpu_blocks=300, num_host_blocks=1 + pages + spare)
    assert coord(s).host_pool.get_num_free_blocks() == pages + spare
    r = make_request("r", prompt(pages * 64, 2), 60)  # 316 tokens: 5 pages
    s.add_request(r)
    src = coord(s).single_type_managers[coord(s).source_group_id]
    blocks = src.get_num_blocks_to_allocate("r", r.num_tokens, [], 0, 0, r.num_tokens,
                                            apply_admission_cap=True)
    assert blocks == (0 if spare else coord(s).block_pool.num_gpu_blocks + 1)
    if not spare:
        for _ in range(5):
            so = step(s, w)
            assert so.total_num_scheduled_tokens == 0
        assert r in s.waiting and r.num_preemptions == 0
        assert not src.req_to_blocks.get("r")
        return
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s, w)
    assert r.is_finished() and r.num_preemptions == 0
    assert len(r.all_token_ids) == pages * 64 + 60
    drain(s, w)
    check_drained(s)


@pytest.mark.parametrize("hit", [2, 8])
def test_resident_admission_cost_after_a_host_prefix_hit(build, hit):
    """Spec 2.4 (resident admission cost, cap_res), 4.15 item 1, F7: a new
    request of 20 pages with a host prefix hit of ``hit`` pages (null
    resident entries) needs resident blocks for its remaining pages, capped
    at cap_res: min(20 - hit, cap_res) per resident group, for every hit
    length. (Survivor M03 of mutations/results.json.)"""
    s, w = build(admission_max_tokens=256)
    cap = hs(s).cap_res_pages
    assert cap == 6
    mgr = coord(s).single_type_managers[coord(s).resident_group_ids[0]]
    null = coord(s).block_pool.null_block
    cost = mgr.get_num_blocks_to_allocate(
        "x", 20 * 64, [null] * hit, hit * 64, hit * 64, 20 * 64, apply_admission_cap=True)
    assert cost == min(20 - hit, cap)
