# SPDX-License-Identifier: Apache-2.0
"""Admission of follow-up turns with long host-prefix hits (spec 4.15, F7;
issue 10 item 1) on vLLM's real scheduler.

In an agentic multi-turn workload every later turn is a large host hit: its
resident tables start as null entries for the hit and only the new pages
need GPU blocks. The resident groups' admission cost is therefore
min(new pages, cap_res) per group, however long the context is."""

from tests.hisparse.scheduler.harness import B, drain, make_request
from tests.hisparse.scheduler.helpers import coord, hs, prompt, step
from tests.hisparse.scheduler.invariants import check_drained

HIT_PAGES = 40
NEW_PAGES = 12


def _admission_cost(s, request) -> tuple[dict[int, int], int]:
    """Per-group blocks the pin's full-sequence admission gate asks for."""
    km = s.kv_cache_manager
    c = km.coordinator
    blocks, hit, _ = km.get_computed_blocks(request)
    managers = c.single_type_managers
    return {
        gid: managers[gid].get_num_blocks_to_allocate(
            request.request_id, request.num_tokens, blocks.blocks[gid], hit, hit,
            request.num_tokens, apply_admission_cap=True,
        )
        for gid in c.resident_group_ids
    }, hit


def _conversation(s, w):
    base = prompt(HIT_PAGES * B, 1)
    s.add_request(make_request("turn0", base, 1))
    drain(s, w)
    return base


def test_resident_admission_cost_of_a_host_hit_is_its_new_pages_capped(build):
    """F7 / 4.15: a 52-page follow-up with a 40-page host hit costs
    min(12, cap_res) pages per resident group at admission, not
    min(52, cap_res) - 40 = 0."""
    s, w = build(num_gpu_blocks=400, num_host_blocks=800, max_model_len=8192)
    base = _conversation(s, w)
    follow = make_request("turn1", base + prompt(NEW_PAGES * B, 2), 4)
    cost, hit = _admission_cost(s, follow)
    assert hit == HIT_PAGES * B
    cap = hs(s).cap_res_pages
    assert cap < NEW_PAGES
    assert cost == {gid: cap for gid in coord(s).resident_group_ids}
    short = make_request("turn1b", base + prompt(2 * B, 3), 4)
    cost, _ = _admission_cost(s, short)
    assert set(cost.values()) == {2}


def test_follow_up_turns_with_long_host_hits_admit_only_what_fits(build):
    """F7 / 4.15 with the real scheduler: a running request keeps most of a
    small pool; follow-up turns with long host hits arrive. Each is admitted
    only once the pool holds its whole capped need, so none is preempted
    (an undercounted admission starts a prefill whose next chunk cannot be
    allocated, and the scheduler preempts)."""
    s, w = build(num_gpu_blocks=160, num_host_blocks=1200, max_num_seqs=16,
                 max_num_batched_tokens=256, max_model_len=8192)
    base = _conversation(s, w)
    hog = make_request("hog", prompt(8 * B - 40, 5), 38)
    s.add_request(hog)
    step(s, w)
    turns = [make_request(f"turn{i}", base + prompt(NEW_PAGES * B, 10 + i), 8)
             for i in range(6)]
    for r in turns:
        s.add_request(r)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        step(s, w)
    assert all(r.is_finished() for r in [hog, *turns])
    assert sum(r.num_preemptions for r in [hog, *turns]) == 0
    drain(s, w)
    check_drained(s)
