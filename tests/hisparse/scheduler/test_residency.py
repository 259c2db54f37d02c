# SPDX-License-Identifier: Apache-2.0
"""Scenario tests of the residency protocol on vLLM's real scheduler (spec
4.1-4.8, 4.15; tests S-1..S-14). Each step runs the simulated worker, which
checks that every KV row attention reads holds what the model wrote, and
``check_invariants`` recomputes all pool accounting from first principles.
"""

import pytest
from vllm.v1.core.kv_cache_utils import get_block_hash

from tests.hisparse.scheduler.harness import (
    B,
    Faults,
    abort,
    drain,
    make_request,
)
from tests.hisparse.scheduler.helpers import coord, hs, prompt, published_pages, step
from tests.hisparse.scheduler.invariants import check_drained, check_invariants


def test_s1_only_sealed_pages_are_planned_within_budget(build):
    """S-1, INV-16: transfers are planned for sealed pages only, once per
    page, and at most max(max_model_len, in-flight tokens) // B per step
    (R32): 20 decoding requests seal their first page in the same step,
    more than the budget of 16; the rest wait a step."""
    s, w = build(num_gpu_blocks=600, max_num_batched_tokens=1024, max_model_len=512,
                 max_num_seqs=20)
    budget = 1024 // B
    reqs = [make_request(f"r{i}", prompt(50, i), 30) for i in range(20)]
    for r in reqs:
        s.add_request(r)
    w.hold = set(range(1, 1000))  # keep everything in flight
    sealing = None
    for _ in range(20):
        so = step(s, w)
        if so.kv_connector_metadata.num_transfers:
            sealing = so.kv_connector_metadata
            break
        assert all(r.num_computed_tokens < B for r in reqs)  # nothing sealed yet
    assert sealing is not None and sealing.num_transfers == budget  # 20 sealed
    assert not sealing.transfer_restore.any()  # spills, after the forward
    second = step(s, w).kv_connector_metadata
    assert second.num_transfers == 20 - budget
    pages = {*sealing.transfer_host_blocks.tolist(), *second.transfer_host_blocks.tolist()}
    assert len(pages) == 20  # no page planned twice (INV-16)
    # Held transfers are never re-sent while in flight (decode seals nothing).
    for _ in range(2):
        assert step(s, w).kv_connector_metadata.num_transfers == 0
    assert len(hs(s).pending_spills) == 20


def test_r32_a_prefill_step_never_outruns_the_budget(build):
    """R32: with the batched tokens above max_model_len (1024 > 512), one
    prefill step seals 12 pages; the budget (1024 // B = 16, not 512 // B
    = 8) plans them all at once, so no backlog forms."""
    s, w = build(num_gpu_blocks=400, max_num_batched_tokens=1024,
                 max_model_len=512, max_num_seqs=4)
    reqs = [make_request(f"r{i}", prompt(256 + 40 * (i == 2), i), 4) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    w.hold = set(range(1, 1000))
    planned = step(s, w).kv_connector_metadata
    assert planned.num_transfers == 12
    # The request with 296 prompt tokens sealed 4 pages, not 5.
    assert sorted(hs(s).states["r2"].pending) == [0, 1, 2, 3]
    assert step(s, w).kv_connector_metadata.num_transfers == 0


def test_r32_short_requests_keep_their_prefix_published(build):
    """R32: 16 prompts of 16 pages prefilled in one step, each request done
    four tokens later. Under a cap of max_model_len // B = 32 pages per
    step, half of them finished before any of their pages was planned and
    never published: their next turn found no host prefix and recomputed
    (found by bench-scheduler --admit, session 13). Every prefix is
    published now, and a second turn hits it whole."""
    s, w = build(num_gpu_blocks=2400, num_host_blocks=1200, max_num_batched_tokens=16384,
                 max_model_len=2048, max_num_seqs=16)
    first = [make_request(f"a{i}", prompt(1024, i), 4) for i in range(16)]
    for r in first:
        s.add_request(r)
    drain(s, w)
    assert [published_pages(s, r) for r in first] == [16] * 16
    again = [make_request(f"b{i}", prompt(1024, i), 2) for i in range(16)]
    for r in again:
        s.add_request(r)
    so = step(s, w)
    assert sorted(r.num_computed_tokens for r in so.scheduled_new_reqs) == [1024 - B] * 16
    drain(s, w)
    check_drained(s)


def test_s2_two_phase_ack_waits_for_every_enqueuing_rank(build):
    """S-2, INV-17: a page is valid only when every rank that enqueued the
    transfer has completed it; until then both endpoints stay leased."""
    s, w = build(ranks=2, faults=Faults(lagging_rank_delay=3))
    r = make_request("r", prompt(128), 16)
    s.add_request(r)
    step(s, w)
    st = hs(s).states["r"]
    assert sorted(st.pending) == [0, 1]
    spill = next(iter(hs(s).pending_spills.values()))
    assert spill.enqueued == frozenset({0, 1})
    assert spill.completed == frozenset({0})  # rank 1 lags
    assert spill.host_block.ref_cnt == 2  # the request + the transfer lease
    assert not st.valid
    for _ in range(3):
        step(s, w)
    assert st.valid >= {0, 1} and not st.pending
    assert spill.host_block.ref_cnt == 1


def test_s3_ready_prefix_is_contiguous_and_bounds_publication(build):
    """S-3, INV-18: publication never passes the contiguous durable prefix,
    even when later pages complete first."""
    s, w = build()
    r = make_request("r", prompt(200), 8)
    s.add_request(r)
    w.hold = {1}  # the spill of page 0 (transfer ids start at 1)
    step(s, w)
    step(s, w)
    st = hs(s).states["r"]
    assert st.valid == {1, 2} and st.ready_prefix == 0
    assert published_pages(s, r) == 0
    w.hold = set()
    step(s, w)
    assert st.ready_prefix == 3
    assert published_pages(s, r) == 3


def test_s4_preempted_request_never_publishes_more(build):
    """S-4, INV-19: a request preempted with a spill in flight publishes
    nothing new; the late ack does not touch its next incarnation."""
    s, w = build()
    r = make_request("r", prompt(320), 100)
    s.add_request(r)
    step(s, w)  # pages 0-3 spill
    step(s, w)  # page 4 spills; all acks land
    assert published_pages(s, r) == 5
    w.hold = set(range(1, 1000))
    while not hs(s).states["r"].pending:
        step(s, w)  # decode until page 5 seals and spills
    old = hs(s).states["r"]
    assert sorted(old.pending) == [5]
    s.running.remove(r)
    s._preempt_request(r, 0.0)
    check_invariants(s)
    assert not hs(s).is_current(old) and old.publication is None
    w.hold = set(range(1, 1000)) - {old.pending[5]}
    step(s, w)  # the old spill completes; the request is re-admitted
    new = hs(s).states["r"]
    assert new is not old
    assert published_pages(s, r) == 5  # page 5 of the old incarnation: never
    assert 5 not in new.valid
    w.hold = set()
    drain(s, w)
    check_drained(s)


def test_s5_finished_request_publishes_once_after_its_spills_land(build):
    """S-5, INV-19: finishing with spills pending detaches the host prefix
    (leased), publishes it exactly once when the last spill completes."""
    s, w = build()
    r = make_request("r", prompt(256), 1)
    s.add_request(r)
    w.hold = set(range(1, 1000))
    step(s, w)
    assert r.is_finished()
    assert not s.has_unfinished_requests()
    assert s.connector.has_pending_push_work()  # INV-15 keeps stepping
    spills = list(hs(s).pending_spills.values())
    st = spills[0].state
    assert st.detached is not None and len(st.detached.host_blocks) == 4
    assert all(b.ref_cnt == 2 for b in st.detached.host_blocks)  # detach + lease
    assert published_pages(s, r) == 0
    w.hold = {spills[0].transfer_id}
    step(s, w)  # pages 1-3 land; page 0 still pending
    assert published_pages(s, r) == 0
    w.hold = set()
    drain(s, w)
    assert published_pages(s, r) == 4
    check_drained(s)


def test_s6_tail_pages_stay_pinned_and_unpinning_is_tail_first(build):
    """S-6, INV-20: the last two pages are never unpinned; pages unpinned
    together enter the free queue tail-first (the tail is reused first, the
    prefix stays readable longest)."""
    s, w = build(num_gpu_blocks=300, admission_max_tokens=64)
    r = make_request("r", prompt(640), 50)
    s.add_request(r)
    w.hold = set(range(1, 1000))
    for _ in range(3):
        step(s, w)  # the prompt: 10 pages pending, the request hot-capable
    st = hs(s).states["r"]
    assert sorted(st.pending) == list(range(10)) and not st.unpinned
    w.hold = set()
    step(s, w)  # every ack in one batch
    n = len(coord(s).single_type_managers[coord(s).resident_group_ids[0]].req_to_blocks["r"])
    assert n == 11 and st.unpinned == set(range(n - 2))
    assert {9, 10} & st.unpinned == set()
    tables = [coord(s).single_type_managers[g].req_to_blocks["r"]
              for g in coord(s).resident_group_ids]
    free = coord(s).block_pool.free_block_queue.get_all_free_blocks()
    tail = [b.block_id for b in free[-len(st.unpinned) * len(tables):]]
    expected = [t[p].block_id for p in sorted(st.unpinned, reverse=True) for t in tables]
    assert tail == expected


def test_s7_reuse_nulls_exactly_the_owners_and_reaches_the_worker(build):
    """S-7, INV-22: reusing an unpinned block nulls that page in every
    resident group of its owner (and no other page), drops its copies entry,
    and the next metadata of the owner carries the change."""
    s, w = build(num_gpu_blocks=90, admission_max_tokens=64, max_num_seqs=4)
    a = make_request("a", prompt(640, 1), 200)
    s.add_request(a)
    for _ in range(4):
        step(s, w)
    assert hs(s).states["a"].unpinned
    lost_before = hs(s).stats.lost_pages
    s.add_request(make_request("b", prompt(1600, 2), 4))
    saw_update = False
    for _ in range(40):
        so = step(s, w)
        meta = so.kv_connector_metadata
        if "a" in meta.update_req_ids:
            saw_update = True
            _, _, rows = meta.residency_update(meta.update_req_ids.index("a"))
            assert (rows[:1] == 0).all()  # the first rewritten page was lost
        if hs(s).stats.lost_pages > lost_before and saw_update:
            break
    assert hs(s).stats.lost_pages > lost_before and saw_update
    st = hs(s).states["a"]
    tables = [coord(s).single_type_managers[g].req_to_blocks["a"]
              for g in coord(s).resident_group_ids]
    lost = {p for p, b in enumerate(tables[0]) if b.is_null}
    assert lost and not (lost & st.unpinned)
    for t in tables:
        assert {p for p, b in enumerate(t) if b.is_null} == lost  # INV-7


def test_s8_pool_for_one_resident_request_runs_four_hybrid_ones(build):
    """S-8 / F7 / target P4 in miniature: a GPU pool that fits one fully
    resident request runs at least four concurrently through the hybrid
    regime, without a single preemption, losing pages under pressure."""
    pages = 64
    fully_resident = pages * 5  # indexer + 4 resident groups
    s, w = build(num_gpu_blocks=fully_resident + 40, num_host_blocks=600,
                 max_num_batched_tokens=256, max_num_seqs=8,
                 max_model_len=8192, admission_max_tokens=256)
    reqs = [make_request(f"r{i}", prompt(pages * B - 100, i), 60) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    max_running = 0
    for _ in range(600):
        if not s.has_unfinished_requests():
            break
        step(s, w)
        max_running = max(max_running, len(s.running))
    assert all(r.is_finished() for r in reqs)
    assert max_running >= 4
    assert sum(r.num_preemptions for r in reqs) == 0
    assert hs(s).stats.lost_pages > 0
    assert w.reads_checked > 0
    drain(s, w)
    check_drained(s)


def test_s9_host_exhaustion_preempts_never_a_gpu_only_page(build):
    """S-9, INV-6 / F8: a host pool too small for all requests makes the
    scheduler wait or preempt; every page keeps a host block and the KV the
    requests read stays exact."""
    s, w = build(num_gpu_blocks=400, num_host_blocks=36, max_num_seqs=4,
                 max_num_batched_tokens=512)
    reqs = [make_request(f"r{i}", prompt(900, i), 300) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        step(s, w)
    assert all(r.is_finished() for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    drain(s, w)
    check_drained(s)


def test_s10_host_prefix_hit_adopts_surviving_gpu_copies(build):
    """S-10, INV-23: a host prefix hit starts with null entries and adopts
    the published GPU copies that survive; attention then reads them from the
    GPU and they hold the host bytes (checked by the simulated worker)."""
    s, w = build(num_gpu_blocks=300, num_host_blocks=400)
    base = prompt(640, 7)
    a = make_request("a", base, 1)
    s.add_request(a)
    drain(s, w)
    copies = dict(hs(s).copies)
    # Pages 0-7 were clean while A ran; 8-9 landed after it finished.
    assert len(copies) == 8
    b = make_request("b", base + prompt(100, 8), 8)
    s.add_request(b)
    step(s, w)
    st = hs(s).states["b"]
    assert hs(s).stats.pages_adopted == 8
    table = coord(s).single_type_managers[coord(s).resident_group_ids[0]].req_to_blocks["b"]
    host = coord(s).single_type_managers[coord(s).source_group_id].req_to_blocks["b"]
    for p in range(8):
        key = host[p].block_hash
        assert table[p] is copies[key][0]
        assert p in st.pinned_clean or p in st.unpinned
    drain(s, w)
    check_drained(s)


def test_s12_start_is_the_common_prefix_of_host_and_indexer(build):
    """S-12, INV-31 (spec 4.14): when the indexer blocks of a prefix were
    evicted but its host blocks survive, the request starts at the common
    prefix (here 0): the host hit alone is never used."""
    s, w = build(num_gpu_blocks=120, num_host_blocks=800, max_num_seqs=2)
    base = prompt(640, 3)
    s.add_request(make_request("a", base, 1))
    drain(s, w)
    # Flood the GPU pool so the cached indexer blocks are evicted.
    for i in range(4):
        s.add_request(make_request(f"f{i}", prompt(1000, 100 + i), 1))
    drain(s, w)
    b = make_request("b", base, 1)
    blocks, hit, _ = coord(s).find_longest_cache_hit(b.block_hashes, len(base) - 1)
    src_only = 0
    for h in b.block_hashes[: (len(base) - 1) // B]:
        if coord(s).host_pool.get_cached_block(h, [0]) is None:
            break
        src_only += 1
    assert src_only > 0 and hit < src_only * B
    assert len(blocks[0]) == hit // B == len(blocks[1])
    assert all(not blk.is_null for blk in blocks[1])
    for g in coord(s).resident_group_ids:
        assert len(blocks[g]) == hit // B and all(b_.is_null for b_ in blocks[g])


def test_s14_zero_token_steps_flow_until_acks_arrive(build):
    """S-14, INV-15: with no request left but acks outstanding, the engine
    keeps stepping (empty steps) and finishes the protocol."""
    s, w = build()
    s.add_request(make_request("r", prompt(200), 1))
    w.hold = set(range(1, 1000))
    step(s, w)
    assert not s.has_unfinished_requests()
    assert s.connector.has_pending_push_work()
    so = step(s, w)
    assert so.total_num_scheduled_tokens == 0
    w.hold = set()
    drain(s, w)
    assert not s.connector.has_pending_push_work()
    check_drained(s)


@pytest.mark.parametrize("ranks", [1, 2])
def test_long_run_matches_the_data_the_model_wrote(build, ranks):
    """INV-1 end to end: eight requests with shared prefixes under a tiny
    GPU pool; every read of every step is checked against what was written."""
    s, w = build(num_gpu_blocks=150, num_host_blocks=500, ranks=ranks,
                 faults=Faults(max_delay=2), max_num_seqs=6)
    shared = prompt(300, 11)
    for i in range(8):
        s.add_request(make_request(f"r{i}", shared + prompt(200 + 50 * i, i), 40))
    steps = drain(s, w)
    assert steps > 50 and w.reads_checked > 1000
    assert hs(s).stats.lost_pages > 0
    check_drained(s)


def test_abort_releases_everything(build):
    s, w = build()
    s.add_request(make_request("a", prompt(500), 100))
    for _ in range(5):
        step(s, w)
    abort(s, ["a"])
    drain(s, w)
    check_drained(s)


def test_only_durable_full_pages_are_published(build):
    """INV-18: the host prefix cache holds exactly the request's full pages."""
    s, w = build()
    r = make_request("r", prompt(128), 1)
    s.add_request(r)
    drain(s, w)
    cached = [b for b in coord(s).host_pool.blocks if b.block_hash is not None]
    assert {get_block_hash(b.block_hash) for b in cached} == set(r.block_hashes[:2])


def test_r30_an_admission_waits_for_the_prefix_a_finished_request_publishes(build):
    """R30 (INV-19's publication, T1's replayability): a follow-up whose
    prefix a finished request is still publishing (its spills landing) is
    not admitted to compute those pages again; it waits, then hits the
    whole published prefix. Admitted at once (soak run 28's u1-3) it would
    recompute them, and two computations of the same tokens would sit in
    the prefix cache for later hits to choose from."""
    s, w = build()
    parent = make_request("parent", prompt(256), 1)
    s.add_request(parent)
    w.hold = set(range(1, 1000))
    step(s, w)
    assert parent.is_finished() and hs(s).states == {}
    follow = make_request("follow", prompt(256) + prompt(100, 7), 4)
    s.add_request(follow)
    for _ in range(3):
        so = step(s, w)
        assert "follow" not in so.num_scheduled_tokens  # waits, no recompute
    assert hs(s).stats.publication_waits == 3
    assert published_pages(s, parent) == 0
    w.hold = set()
    so = step(s, w)  # the spills land; the publication runs before scheduling
    while "follow" not in so.num_scheduled_tokens:
        so = step(s, w)
    assert published_pages(s, parent) == 4
    assert so.num_scheduled_tokens["follow"] == 100  # the 4 pages were hit
    assert hs(s)._publishing == {}
    drain(s, w)
    check_drained(s)


def test_r30_no_wait_without_a_pending_publication(build):
    """R30: with the parent's prefix already published (or none pending),
    a follow-up is admitted at once and nothing waits."""
    s, w = build()
    parent = make_request("parent", prompt(256), 1)
    s.add_request(parent)
    drain(s, w)
    follow = make_request("follow", prompt(256) + prompt(100, 7), 4)
    s.add_request(follow)
    so = step(s, w)
    assert so.num_scheduled_tokens["follow"] == 100
    assert hs(s).stats.publication_waits == 0
    drain(s, w)
    check_drained(s)


def test_r30_a_publication_that_never_lands_holds_an_admission_only_so_long(build):
    """R30, liveness (F20's class): the wait is bounded; when the parent's
    spills never land the follow-up computes the pages itself after
    MAX_PUBLICATION_WAITS attempts, and an abort while waiting leaves no
    count behind."""
    from vllm.v1.hisparse.constants import MAX_PUBLICATION_WAITS

    s, w = build()
    parent = make_request("parent", prompt(256), 1)
    s.add_request(parent)
    w.hold = set(range(1, 1000))  # held for the whole test
    step(s, w)
    follow = make_request("follow", prompt(256) + prompt(100, 7), 4)
    s.add_request(follow)
    for _ in range(MAX_PUBLICATION_WAITS):
        assert "follow" not in step(s, w).num_scheduled_tokens
    so = step(s, w)
    assert so.num_scheduled_tokens["follow"] > 0  # computes the pages itself
    assert hs(s).stats.publication_waits == MAX_PUBLICATION_WAITS
    other = make_request("other", prompt(256) + prompt(50, 8), 4)
    s.add_request(other)
    assert "other" not in step(s, w).num_scheduled_tokens
    abort(s, ["other"])
    assert "other" not in hs(s)._publication_waits
    w.hold = set()
    drain(s, w)
    check_drained(s)


def test_r30_under_async_scheduling_with_late_and_lost_acks(build):
    """R30 under vLLM's default async scheduling (one step in flight) with
    delayed and lost acks: the follow-up waits while its parent's pages are
    still being published, then hits them all; every read the simulated
    worker checks holds what the model wrote."""
    from tests.hisparse.scheduler.harness import AsyncDriver

    s, w = build(async_scheduling=True, faults=Faults(max_delay=2, lose_ack_prob=0.1))
    driver = AsyncDriver(s, w)
    parent = make_request("parent", prompt(256), 1)
    s.add_request(parent)
    w.hold = set(range(1, 1000))
    while not parent.is_finished():
        driver.step()
    follow = make_request("follow", prompt(256) + prompt(100, 7), 4)
    s.add_request(follow)
    for _ in range(3):
        assert "follow" not in driver.step().num_scheduled_tokens
    w.hold = set()
    while "follow" not in (so := driver.step()).num_scheduled_tokens:
        pass
    assert so.num_scheduled_tokens["follow"] == 100  # the 4 pages were hit
    assert hs(s).stats.publication_waits >= 3
    while driver.busy():
        driver.step()
    check_drained(s)
    assert w.reads_checked > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_r31_a_finished_request_caches_the_page_its_last_step_sealed(build, async_scheduling):
    """R31 (INV-18's publication, T1's replayability): a request whose KV
    ends on a page boundary at its last step publishes that page too. vLLM's
    async scheduler caches it after the last output (in every group, and the
    OffloadingConnector stores it); HiSparse's free() used to cancel that
    page's spill as if a preempted pass had planned it, so the host pool
    lacked a page the other caches held, the follow-up computed it again
    (soak runs 28 and 32: u1-3, u2-49) and later hits read the two
    computations mixed across groups. The spill is carried by a step that
    no longer schedules the request; the simulated worker checks the page
    holds the final KV."""
    from tests.hisparse.scheduler.harness import AsyncDriver

    s, w = build(async_scheduling=async_scheduling)
    driver = AsyncDriver(s, w) if async_scheduling else None

    def run():
        so = driver.step() if driver else step(s, w)
        check_invariants(s)
        return so

    def busy():
        return driver.busy() if driver else s.has_requests()

    parent = make_request("parent", prompt(193), 64)  # KV of 256 tokens: 4 pages
    s.add_request(parent)
    while busy():
        run()
    assert len(parent.all_token_ids) == 257
    assert published_pages(s, parent) == 4
    follow = make_request("follow", list(parent.all_token_ids) + prompt(100, 7), 4)
    s.add_request(follow)
    while "follow" not in (so := run()).num_scheduled_tokens:
        pass
    hit = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}["follow"]
    assert hit == 256  # every page, in every group (the indexer's too)
    while busy():
        run()
    check_drained(s)
    assert w.spills_verified > 0
