# SPDX-License-Identifier: Apache-2.0
"""The hot buffer as the worker keeps it (spec 4.8, 2.8, INV-5, INV-24), on
vLLM's real scheduler with the simulated worker's per-slot LRU of host rows.

Hot entries are keyed by host row g; a hit is served from the hot slot's
bytes in the request's hot-group blocks, so an entry that outlives the bytes
it names is a wrong read. The scheduler's part of INV-24 is what these tests
check: every region it announces gets a freshly reset slot, which alone
keeps every hit exact across host-block reallocation (docs/worker.md K27:
the worker runs no trigger-2 pass over ``new_source_block_ids``). Each test
also shows that the double would catch the stale entry a missing
invalidation leaves behind (the guard is not vacuous).
"""

import pytest

from tests.hisparse.offloading.conftest import rig  # noqa: F401  (fixture)
from tests.hisparse.scheduler.harness import (
    ProtocolError,
    drain,
    make_request,
    run_step,
)
from tests.hisparse.scheduler.helpers import coord, hs, prompt, step
from tests.hisparse.scheduler.invariants import check_drained, check_published


def publish_without_copies(s, w, base):
    """A request publishes ``base`` on host while every spill is still in
    flight when it finishes, so no GPU copy is indexed (R9): a later hit on
    ``base`` reads it from host through the hot buffer (nothing to adopt)."""
    w.hold = set(range(1, 10_000))
    s.add_request(make_request("seed", base, 1))
    for _ in range(3):
        run_step(s, w)
    w.hold = set()
    drain(s, w)
    assert not hs(s).copies


def prefix_turns(s, w, base, n=3):
    """``n`` requests one after another, each a hit on ``base``: they start
    zero-resident and read ``base`` through their hot buffer; with
    max_num_seqs=2 each takes the state slot the previous one released."""
    for i in range(n):
        s.add_request(make_request(f"r{i}", base + prompt(50, 10 + i), 30))
        drain(s, w)


def test_each_announced_region_gets_a_freshly_reset_slot(build):
    """INV-24 (4.8 trigger 1), INV-5: requests that hit a host prefix read it
    through the hot buffer, each in the state slot its predecessor released;
    every hit is served from the slot's own bytes and is exact because the
    slot was reset when the region was announced. Without the reset the
    next request hits the previous one's entries (same host rows: the shared
    prefix) in hot blocks that no longer hold them, and the double reads a
    wrong row."""
    for reset in (True, False):
        s, w = build(num_gpu_blocks=400, num_host_blocks=400, max_num_seqs=2)
        w.hot_invalidation.reset_on_assign = reset
        base = prompt(640, 5)
        publish_without_copies(s, w, base)
        if reset:
            prefix_turns(s, w, base)
            assert w.regions_allocated >= 3 and w.hot_hits > 100
            assert w.hot_misses > 0 and hs(s).stats.pages_adopted == 0
            check_drained(s)
        else:
            with pytest.raises(ProtocolError, match="hot slot"):
                prefix_turns(s, w, base)


@pytest.mark.parametrize("reset", [True, False])
def test_reallocated_host_blocks_never_serve_a_stale_hot_entry(build, reset):
    """INV-24 (4.8 triggers 1 and 2, docs/worker.md K27): one request at a
    time (max_num_seqs=1, so every region takes slot 0) on a host pool that
    fits about one request, under GPU pressure (pages lost, read from host
    through the hot buffer). Each request gets the host blocks its
    predecessor used, so the predecessor's entries are keyed by exactly
    those rows. The slot reset at each region's assignment drops them: with
    it, and no trigger-2 pass, every hot hit stays exact; without it (and
    still no trigger-2 pass) the double reads a stale row. With the reset
    off, the trigger-2 pass alone would also have caught them: it is the
    redundant one."""

    def run(s, w):
        for i in range(3):
            s.add_request(make_request(f"r{i}", prompt(900, i), 20))
            for _ in range(3000):
                if not s.has_unfinished_requests():
                    break
                step(s, w)
        drain(s, w)

    s, w = build(num_gpu_blocks=60, num_host_blocks=22, max_num_seqs=1,
                 admission_max_tokens=128)
    assert not w.hot_invalidation.new_source_blocks  # as the real worker
    w.hot_invalidation.reset_on_assign = reset
    if reset:
        run(s, w)
        assert hs(s).stats.lost_pages > 0 and w.hot_hits > 100
        assert w.hot_invalidated == 0  # nothing left for trigger 2 to drop
        check_drained(s)
        assert check_published(s, w) > 0
    else:
        with pytest.raises(ProtocolError, match="stale hot entry"):
            run(s, w)
        s, w = build(num_gpu_blocks=60, num_host_blocks=22, max_num_seqs=1,
                     admission_max_tokens=128)
        w.hot_invalidation.reset_on_assign = False
        w.hot_invalidation.new_source_blocks = True
        run(s, w)
        assert w.hot_invalidated > 0


class SlotOverflow(AssertionError):
    """More live hot regions than the worker has request-state slots."""


def test_live_hot_regions_never_exceed_the_worker_slots_with_async_loads(rig):  # noqa: F811
    """INV-5, INV-24 (spec 2.8: one state slot per hot region, max_num_seqs
    slots), 4.14: three conversations continue a turn whose indexer blocks
    were evicted from the GPU pool but are held by the OffloadingConnector,
    with max_num_seqs=2. Each new turn hits the host prefix (zero-resident:
    a hot region) and loads its indexer prefix asynchronously. At no step may
    the live hot regions outnumber the worker's slots: a loading request
    gets its region after its load (docs/residency.md R24)."""
    r = rig(num_gpu_blocks=160, num_host_blocks=400, max_num_seqs=2)
    r.worker.strict_slots = False  # the test states the failure itself
    s = r.scheduler
    bases = [prompt(400, 70 + i) for i in range(3)]
    for i, base in enumerate(bases):
        s.add_request(make_request(f"a{i}", base, 1))
    r.drain()
    for i in range(4):  # evict the indexer blocks from the GPU prefix cache
        s.add_request(make_request(f"flood{i}", prompt(900, 100 + i), 1))
    r.drain()
    for i, base in enumerate(bases):
        s.add_request(make_request(f"b{i}", base + prompt(60, 90 + i), 4))
    hot0 = coord(s).single_type_managers[coord(s).hot_group_ids[0]]
    loading_seen = 0
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        r.step()
        live = {rid for rid, blocks in hot0.req_to_blocks.items() if blocks}
        loading = [rid for rid, req in s.requests.items()
                   if req.status.name == "WAITING_FOR_REMOTE_KVS"]
        loading_seen += bool(loading)
        assert not live & set(loading), "a loading request holds a state slot"
        if len(live) > s.max_num_running_reqs:
            raise SlotOverflow(
                f"{len(live)} live hot regions ({sorted(live)}; loading "
                f"{sorted(loading)}) > max_num_seqs={s.max_num_running_reqs}")
    assert loading_seen  # the scenario really had async loads in flight
    r.finish()
