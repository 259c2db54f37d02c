# SPDX-License-Identifier: Apache-2.0
"""Fault tests (target R2): after draining, GPU and host pool accounting are
back to their initial state and nothing incomplete was published."""

import pytest

from tests.hisparse.scheduler.harness import (
    Faults,
    abort,
    drain,
    make_request,
)
from tests.hisparse.scheduler.helpers import hs, prompt, step
from tests.hisparse.scheduler.invariants import (
    check_drained,
    check_invariants,
    check_published,
)


def finish(s, w):
    w.hold = set()
    drain(s, w)
    check_drained(s)
    return check_published(s, w)


def test_abort_mid_spill(build):
    s, w = build()
    r = make_request("r", prompt(700), 50)
    s.add_request(r)
    step(s, w)
    w.hold = set(range(1, 1000))
    step(s, w)
    assert hs(s).pending_spills
    abort(s, ["r"])
    step(s, w)
    assert hs(s).pending_spills  # leases outlive the request
    assert finish(s, w) >= 4  # durable pages of the aborted request publish


def test_preempt_mid_prefill(build):
    s, w = build()
    r = make_request("r", prompt(900), 20)
    s.add_request(r)
    w.hold = set(range(1, 1000))
    step(s, w)  # first chunk: pages 0-3 in flight
    assert hs(s).states["r"].pending
    s.running.remove(r)
    s._preempt_request(r, 0.0)
    check_invariants(s)
    step(s, w)
    finish(s, w)


def test_finish_with_spills_pending(build):
    s, w = build()
    s.add_request(make_request("r", prompt(400), 1))
    w.hold = set(range(1, 1000))
    step(s, w)
    step(s, w)
    assert not s.has_unfinished_requests() and hs(s).pending_spills
    assert finish(s, w) == 6


def test_host_pool_exhausted(build):
    s, w = build(num_gpu_blocks=300, num_host_blocks=30, max_num_seqs=4)
    for i in range(4):
        s.add_request(make_request(f"r{i}", prompt(700, i), 200))
    for _ in range(4000):
        if not s.has_unfinished_requests():
            break
        step(s, w)
    finish(s, w)


@pytest.mark.parametrize("faults,ranks", [
    (Faults(lose_ack_prob=0.4), 1),
    (Faults(duplicate_prob=0.7), 1),
    (Faults(max_delay=6), 1),
    (Faults(max_delay=2, lagging_rank_delay=4, lose_ack_prob=0.2,
            duplicate_prob=0.3), 4),
], ids=["lost-ack", "duplicated-ack", "late-ack", "4-ranks-lagging"])
def test_unreliable_acks(build, faults, ranks):
    """Lost step outputs, repeated reports, late and lagging ranks: the
    transfer ids are retired exactly once and nothing leaks."""
    s, w = build(num_gpu_blocks=150, faults=faults, ranks=ranks, seed=3,
                 max_num_seqs=5)
    for i in range(6):
        s.add_request(make_request(f"r{i}", prompt(300 + 150 * i, i), 30))
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        step(s, w)
    assert hs(s).stats.spills_completed > 0
    finish(s, w)


def test_block_reused_while_its_copy_is_in_flight(build):
    """The transfer lease keeps a freed request's pending pages allocated:
    new requests cannot take those blocks until the copy completes (the
    simulated worker checks host == resident bytes at completion)."""
    s, w = build(num_gpu_blocks=80, max_num_seqs=4)
    s.add_request(make_request("a", prompt(512, 1), 40))
    step(s, w)
    w.hold = set(range(1, 1000))
    step(s, w)
    held = [b for sp in hs(s).pending_spills.values() for b in sp.resident_blocks]
    assert held
    abort(s, ["a"])
    for i in range(3):
        s.add_request(make_request(f"f{i}", prompt(900, 10 + i), 4))
    for _ in range(20):
        step(s, w)
        assert all(b.ref_cnt >= 1 for b in held)
    finish(s, w)
