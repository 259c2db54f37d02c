# SPDX-License-Identifier: Apache-2.0
"""Forwards that run late (``LateDriver``): step t's forward executes after
the scheduler has already emitted step t+1 (lag 1: the GPU behind the CPU
under async scheduling) or t+2 (lag 2: a batch queue of two), in order,
from the metadata and tables it was sent for step t only; step t's output
and acks are processed right after it. Meanwhile the scheduler has unpinned
pages and handed blocks to other requests in the later steps: the reads of
the step in flight must still find the bytes it was sent for (spec 4.6,
INV-22: the new owner writes in a forward stream-ordered after it; F16), and
metadata must not change after it was emitted."""

import random

import pytest

from tests.hisparse.scheduler.harness import Faults, LateDriver
from tests.hisparse.scheduler.helpers import add_conversations, drive, hs
from tests.hisparse.scheduler.invariants import (
    check_drained,
    check_invariants,
    check_published,
)


def run_late(s, w, lag, rng, abort_at=30):
    driver = LateDriver(s, w, lag)
    update = s.update_from_output
    order = []

    def checked(so, out):
        # update_from_output of step t only after step t's forward, and with
        # step t + lag already emitted unless the queue is being flushed.
        meta = so.kv_connector_metadata
        assert w.last_meta is meta, "an output processed before its forward"
        order.append(len(driver.queue))
        return update(so, out)

    s.update_from_output = checked
    add_conversations(s, rng)
    drive(s, driver, abort_at)
    driver.flush()
    check_invariants(s)
    return driver, order


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("lag", [1, 2])
def test_forwards_running_late_read_what_they_were_sent(build, async_scheduling, lag):
    """INV-1, INV-22, INV-17, R2, F16: under GPU pressure with lost pages,
    hot reads, host-prefix hits, an abort and unreliable acks, every forward
    runs ``lag`` steps after it was emitted. Every read of every group is
    exact, some of them read a block that a later step has already handed
    to another request (the race window really occurs), every completed
    spill holds its page's final KV, and the pools drain to their initial
    accounting with only durable pages published."""
    rng = random.Random(5 + lag)
    s, w = build(num_gpu_blocks=100, num_host_blocks=300, async_scheduling=async_scheduling,
                 faults=Faults(max_delay=2, lose_ack_prob=0.1), max_num_seqs=6)
    driver, order = run_late(s, w, lag, rng)
    assert driver.executed == w.step_no and not w._inbox
    assert order.count(lag) > 100  # the steady state: t + lag emitted first
    check_drained(s)
    assert check_published(s, w) > 0
    assert hs(s).stats.lost_pages > 0 and w.reads_checked > 500
    assert w.hot_hits > 0 and w.spills_verified > 0
    assert w.in_flight_reuse_reads > 0
