# SPDX-License-Identifier: Apache-2.0
"""Spill acks with a TP-shared host pool (spec 4.12, 4.3; INV-17, INV-28;
docs/residency.md R23), on vLLM's real scheduler and the real coordinator.

In shared mode TP rank 0 is the only rank that copies a spill to host, so a
spill completes exactly when rank 0 has completed it: other ranks report no
spills, and a report from one (a protocol bug) neither completes a spill
nor holds one back. Restores are per rank (each fills its own resident
block) and need every rank that enqueued them."""

import dataclasses

from vllm.v1.hisparse.metadata import HiSparseWorkerAck

from tests.hisparse.scheduler.harness import (
    Faults,
    SimWorker,
    drain,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
)
from tests.hisparse.scheduler.helpers import hs, prompt, published_pages, step
from tests.hisparse.scheduler.invariants import check_drained, check_published


def build(tmp_path, *, shared: bool, ranks: int, faults: Faults | None = None):
    config = hisparse_kv_cache_config(num_gpu_blocks=120, num_host_blocks=400)
    config.host_pool = dataclasses.replace(config.host_pool, shared=shared)
    scheduler = make_scheduler(tmp_path, config)
    return scheduler, SimWorker(scheduler, ranks=ranks, faults=faults)


def held_spill(s, w):
    """A request with its first page's spill enqueued by rank 0 and held."""
    w.hold = set(range(1, 1000))
    r = make_request("r", prompt(128), 100)
    s.add_request(r)
    for _ in range(3):
        step(s, w)
    st = hs(s).states["r"]
    tid = st.pending[0]
    return r, st, tid, hs(s).pending_spills[tid]


def ack(tid, *, enqueued=(), completed=(), step_no):
    return HiSparseWorkerAck(
        enqueued={tid: frozenset(enqueued)} if enqueued else {},
        completed={tid: frozenset(completed)} if completed else {},
        submitted_step={tid: step_no},
    )


def test_shared_spill_completes_exactly_when_rank0_completes_it(tmp_path):
    """INV-28, INV-17: with a shared pool a non-writer's report of a spill
    (enqueued and completed) is ignored, so it cannot complete the spill;
    rank 0's completion alone does."""
    s, w = build(tmp_path, shared=True, ranks=1)  # rank 0, the writer
    r, st, tid, spill = held_spill(s, w)
    assert spill.enqueued == frozenset({0}) and not spill.completed
    planned = spill.planned_step
    hs(s).update_spills(ack(tid, enqueued={1}, completed={1}, step_no=planned))
    assert tid in hs(s).pending_spills and 0 not in st.valid
    assert spill.enqueued == frozenset({0}) and not spill.completed
    assert hs(s).stats.reader_reports_ignored == 2
    hs(s).update_spills(ack(tid, completed={0}, step_no=planned))
    assert tid not in hs(s).pending_spills and 0 in st.valid
    w.hold = set()
    drain(s, w)
    check_drained(s)
    assert check_published(s, w) >= 2 and published_pages(s, r) >= 2


def test_private_pools_need_every_rank_that_enqueued(tmp_path):
    """4.3, INV-17 in private mode (contrast): each rank copies its own
    pool, so rank 0's completion is not enough while rank 1 enqueued."""
    s, w = build(tmp_path, shared=False, ranks=2)
    _, st, tid, spill = held_spill(s, w)
    assert spill.enqueued == frozenset({0, 1})
    hs(s).update_spills(ack(tid, completed={0}, step_no=spill.planned_step))
    assert tid in hs(s).pending_spills and 0 not in st.valid
    hs(s).update_spills(ack(tid, completed={1}, step_no=spill.planned_step))
    assert tid not in hs(s).pending_spills and 0 in st.valid
    assert hs(s).stats.reader_reports_ignored == 0


def test_shared_spills_do_not_wait_for_a_lagging_reader(tmp_path):
    """R23: even if every rank reported (as with private pools), a shared
    pool's spills complete with rank 0, never held back by another rank;
    the run drains and publishes only durable pages."""
    s, w = build(tmp_path, shared=True, ranks=2,
                 faults=Faults(lagging_rank_delay=1000))
    r = make_request("r", prompt(300), 40)
    s.add_request(r)
    drain(s, w)
    check_drained(s)
    assert hs(s).stats.spills_completed >= 4
    assert hs(s).stats.reader_reports_ignored > 0
    assert check_published(s, w) >= 4


def test_restores_need_every_rank_in_shared_mode(tmp_path):
    """4.12 step 4: every rank restores into its own resident block, so a
    restore completes only when every rank that enqueued it completed."""
    s, w = build(tmp_path, shared=True, ranks=1)
    _, _, tid, spill = held_spill(s, w)
    spill.restore = True  # the restore path of the same transfer record
    spill.enqueued = frozenset()
    hs(s).update_spills(ack(tid, enqueued={0, 1}, completed={0},
                            step_no=spill.planned_step))
    assert tid in hs(s).pending_spills and spill.enqueued == frozenset({0, 1})
    hs(s).update_spills(ack(tid, completed={1}, step_no=spill.planned_step))
    assert tid not in hs(s).pending_spills
