# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding with MTP on the scheduler side (spec 4.2 R_re, 4.9's
envelope widening, 4.14's EAGLE/MTP drop; docs/residency.md R2, R8, R16;
S-1, S-12, S-13).

HiSparse refuses MTP at config time until the worker runs the drafter's
layer (spec 6.3 #15), so these tests give vLLM's real scheduler MTP's
settings after the checks (``make_scheduler(num_speculative_tokens=k)``:
``use_eagle``, k draft and k lookahead tokens). The simulated worker writes
draft tokens with their own tags (wrong ones when the target rejects them,
rewritten the next step) and the drafter's junk at the lookahead positions;
the scheduler must back every such row with a resident and a host block,
never plan a spill of a page holding an unverified draft, and never publish
one.
"""

import random

import pytest
from vllm.utils.math_utils import cdiv

from tests.hisparse.scheduler.harness import (
    B,
    Drafter,
    Faults,
    drain,
    make_request,
    model_output,
    run_step,
    schedule,
)
from tests.hisparse.scheduler.helpers import coord, hs, prompt, published_pages
from tests.hisparse.scheduler.invariants import (
    check_drained,
    check_invariants,
    check_published,
)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_under_pressure_backs_drafts_and_publishes_only_final_kv(build, k):
    """S-13 (without envelopes, R16: the rows a forward writes, drafts and
    lookahead included, are what is mirrored), INV-6, INV-12, INV-7: every
    draft and lookahead row lands in a resident page of every resident group
    and the indexer, with a host block; R2 / INV-16: a completed spill holds
    the KV of final tokens only (the double checks each one), INV-18: no
    published host block holds a rejected draft or lookahead junk; INV-1:
    every read exact, with pages lost and read through the hot buffer."""
    s, w = build(num_gpu_blocks=100, num_host_blocks=300, max_num_seqs=6,
                 num_speculative_tokens=k, faults=Faults(max_delay=1))
    assert s.use_eagle and s.num_lookahead_tokens == k
    drafter = Drafter(accept=0.6, seed=k)
    rng = random.Random(3)
    shared = prompt(200, 1)
    for i in range(8):
        s.add_request(make_request(
            f"r{i}", shared + prompt(rng.randint(50, 500), 10 + i), rng.randint(20, 120)))
    crossings = 0
    mgr = s.kv_cache_manager
    groups = (*coord(s).resident_group_ids, coord(s).source_group_id, 1)
    steps = 0
    while s.has_unfinished_requests() or s.connector.has_pending_push_work():
        so = schedule(s)
        for req_id, n in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(req_id, ())
            request = s.requests[req_id]
            c = request.num_computed_tokens - n  # num_computed advanced at schedule
            need = cdiv(min(c + n + k, s.max_model_len), B)
            tables = mgr.get_block_ids(req_id)
            for gid in groups:  # lookahead slots allocated in every group
                assert len(tables[gid]) >= need, (req_id, gid, len(tables[gid]), need)
            crossings += bool(drafts) and (c + n + k - 1) // B > (c + n - 1) // B
        out = w.step(so)
        s.update_from_output(so, model_output(s, so, out))
        drafts = drafter.propose(s, so)
        if drafts is not None:
            s.update_draft_token_ids(drafts)
        check_invariants(s)
        steps += 1
        assert steps < 5000
    check_drained(s)
    assert drafter.wrong > 0 and w.draft_rows_written > 0 and crossings > 0
    assert hs(s).stats.lost_pages > 0 and w.hot_hits > 0
    assert w.spills_verified > 0
    assert check_published(s, w) > 0


def test_spills_never_cover_an_unverified_draft(build):
    """R2, INV-16, S-1: with every draft rejected, each decode step writes k
    wrong rows past the last verified token, often into the next page. A
    spill is planned only for pages below the verified tokens (the pin's
    publish bound, min(computed + scheduled, num_tokens)); the rejected rows
    are rewritten before that page seals, and the double checks every
    completed spill against the final tokens' KV."""
    k = 3
    s, w = build(num_gpu_blocks=200, num_host_blocks=200, num_speculative_tokens=k)
    drafter = Drafter(accept=0.0)
    r = make_request("r", prompt(250, 4), 200)
    s.add_request(r)
    crossing_steps = 0
    while s.has_unfinished_requests() or s.connector.has_pending_push_work():
        verified = r.num_tokens  # before the step: drafts are not tokens
        so = run_step(s, w, drafter)
        check_invariants(s)
        meta = so.kv_connector_metadata
        host = coord(s).single_type_managers[coord(s).source_group_id].req_to_blocks.get("r", [])
        pages = {b.block_id: p for p, b in enumerate(host)}
        for hb in meta.transfer_host_blocks.tolist():
            assert (pages[hb] + 1) * B <= verified, (
                f"page {pages[hb]} spilled with only {verified} verified tokens")
        drafts = so.scheduled_spec_decode_tokens.get("r")
        if drafts:
            assert so.num_scheduled_tokens["r"] == 1 + len(drafts)
            if (verified + len(drafts) - 1) // B > (verified - 1) // B:
                crossing_steps += 1  # drafts written past the verified page
    check_drained(s)
    assert crossing_steps >= 2 and drafter.wrong == drafter.proposed > 0
    assert w.spills_verified >= 6
    assert check_published(s, w) >= 6


@pytest.mark.parametrize("eagle", [False, True], ids=["no-spec", "mtp"])
def test_mtp_drops_the_last_block_of_the_common_hit(build, eagle):
    """R8 / spec 4.14 (INV-31), S-12: the start of a prefix hit is the
    common prefix of the host hit and the indexer hit; with MTP (EAGLE) the
    last block of that common hit is dropped once (as the pin drops it per
    group), not once per group. Host hit 6 pages (pages 6-9 of the first
    request still in flight), indexer hit 10: the start is 6 pages, 5 with
    MTP. Resident groups start with null entries, hot groups empty; the
    dropped page is computed into a fresh host block while the cached one
    stays cached for others; the request then decodes with exact reads."""
    s, w = build(num_gpu_blocks=300, num_host_blocks=400,
                 num_speculative_tokens=1 if eagle else 0)
    drafter = Drafter(accept=0.5) if eagle else None
    base = prompt(640, 9)  # 10 pages: 3 prefill steps (256, 256, 128)
    # ``a`` still decodes: a finished request's pages in flight would make
    # b wait for their publication instead (R30, test_residency).
    a = make_request("a", base, 40)
    s.add_request(a)
    w.hold = {7, 8, 9, 10}  # the spills of pages 6-9 (ids in page order)
    for _ in range(3):
        run_step(s, w, drafter)
    assert not a.is_finished() and published_pages(s, a) == 6
    b = make_request("b", base + prompt(100, 10), 8)
    blocks, hit, _ = coord(s).find_longest_cache_hit(b.block_hashes, b.num_tokens - 1)
    start = 5 if eagle else 6
    assert hit == start * B
    sid = coord(s).source_group_id
    assert len(blocks[sid]) == len(blocks[1]) == start
    for g in coord(s).resident_group_ids:
        assert len(blocks[g]) == start and all(x.is_null for x in blocks[g])
    for g in coord(s).hot_group_ids:
        assert blocks[g] == []
    s.add_request(b)
    so = run_step(s, w, drafter)
    new = {r.req_id: r for r in so.scheduled_new_reqs}["b"]
    assert new.num_computed_tokens == start * B
    host = coord(s).single_type_managers[sid].req_to_blocks["b"]
    cached = coord(s).host_pool.get_cached_block(b.block_hashes[5], [sid])
    assert cached is not None  # page 5 stays cached for others either way
    # With MTP page 5 is recomputed into a fresh host block.
    assert (host[5] is cached[0]) != eagle
    assert hs(s).is_hot_required("b")
    # The surviving GPU copies of the hit pages are adopted (INV-23), and
    # only those: never the dropped page's.
    assert hs(s).stats.pages_adopted == start
    w.hold = set()
    drain(s, w, drafter=drafter)
    check_drained(s)
    assert check_published(s, w) >= 10
