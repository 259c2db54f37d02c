# SPDX-License-Identifier: Apache-2.0
"""Liveness (target R4, F20, docs/residency.md R25/R26): every request the
startup check admits finishes, without preemption, at every chunk size and
pool size from the startup minimum up, under sync and async scheduling and
with forwards running one or two steps late, with completions of host
copies arriving late too.

The startup check admits a model when one max_model_len request fits:
``layout.request_blocks(max_model_len).admission`` GPU blocks (the indexer
for the whole length, min(pages, cap_res) per resident group, the hot
region). The pool sizes here start there.

Before R25/R26 a 6000-token request at 2048-token chunks in the e2e pool of
340 blocks preempted itself 299 times in 600 steps under async scheduling
and never finished: its previous chunk's pages were still in flight when the
next chunk was scheduled, it could not unpin them, and the preemption
dropped its unpublished pages (INV-19), so every re-admission started over.
"""

from __future__ import annotations

import random

import pytest

from tests.hisparse.scheduler.harness import (
    AsyncDriver,
    Faults,
    LateDriver,
    SimWorker,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
    run_step,
)
from tests.hisparse.scheduler.helpers import hs, prompt
from tests.hisparse.scheduler.invariants import (
    check_drained,
    check_invariants,
    check_published,
)

MAX_MODEL_LEN = 16384
INDEX_TOPK = 256  # the e2e model's: H = 512 rows, 8 blocks per hot group
CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
MODES = ("sync", "async", "late1", "late2")


class SyncDriver:
    def __init__(self, scheduler, worker) -> None:
        self.scheduler, self.worker = scheduler, worker

    def step(self):
        return run_step(self.scheduler, self.worker)

    def busy(self) -> bool:
        s = self.scheduler
        return s.has_unfinished_requests() or s.connector.has_pending_push_work()


def driver_for(mode: str, s, w):
    if mode == "sync":
        return SyncDriver(s, w)
    if mode == "async":
        return AsyncDriver(s, w)
    return LateDriver(s, w, lag=int(mode[-1]))


def startup_minimum(chunk: int) -> int:
    """GPU blocks the startup check requires (one max_model_len request)."""
    config = hisparse_kv_cache_config(
        num_gpu_blocks=1000, num_host_blocks=1000, index_topk=INDEX_TOPK,
        admission_max_tokens=chunk, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=chunk)
    return config.layout.request_blocks(MAX_MODEL_LEN).admission


def build(tmp_path, chunk: int, num_gpu_blocks: int, mode: str, seed: int = 0,
          num_host_blocks: int = 2000, max_num_seqs: int = 8):
    config = hisparse_kv_cache_config(
        num_gpu_blocks=num_gpu_blocks, num_host_blocks=num_host_blocks,
        index_topk=INDEX_TOPK, admission_max_tokens=chunk,
        max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=chunk)
    s = make_scheduler(
        tmp_path, config, max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
        max_model_len=MAX_MODEL_LEN, async_scheduling=mode != "sync")
    # Completions arrive up to two steps after the forward, as on the GPU
    # (the worker reports a copy only once its event is done).
    w = SimWorker(s, faults=Faults(max_delay=2), seed=seed)
    return s, w


def count_preemptions(s) -> list[str]:
    preempted: list[str] = []
    original = s._preempt_request

    def counted(request, timestamp):
        preempted.append(request.request_id)
        return original(request, timestamp)

    s._preempt_request = counted
    return preempted


def run(s, w, mode: str, max_steps: int) -> int:
    driver = driver_for(mode, s, w)
    steps = 0
    while driver.busy():
        driver.step()
        check_invariants(s)
        steps += 1
        assert steps < max_steps, (
            f"{mode}: not finished after {steps} steps "
            f"({len(s.running)} running, {len(s.waiting)} waiting, {hs(s).stats})")
    if isinstance(driver, LateDriver):
        driver.flush()
    return steps


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("extra", [0, 8, 120])
def test_a_long_request_alone_finishes_without_preemption(tmp_path, chunk, mode, extra):
    """R4/F20: one request of 12000 prompt tokens plus 64 outputs in a pool
    of the startup minimum + ``extra`` blocks."""
    s, w = build(tmp_path, chunk, startup_minimum(chunk) + extra, mode)
    preempted = count_preemptions(s)
    r = make_request("r", prompt(12000, 7), 64)
    s.add_request(r)
    run(s, w, mode, max_steps=2000)
    assert r.is_finished() and r.num_output_tokens == 64
    assert preempted == [], f"preempted {len(preempted)}x ({hs(s).stats})"
    st = hs(s).stats
    # The pool really was short: the request went hybrid on its own.
    assert st.pages_unpinned > 0 and st.lost_pages > 0, st
    check_drained(s)
    assert check_published(s, w) > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", (512, 2048, 8192))
def test_the_issue_request_finishes(tmp_path, chunk, mode):
    """F20 as reported: 6000 tokens in the e2e model's 340-block pool at
    2048-token chunks (and the neighbours), every scheduling mode."""
    blocks = max(340, startup_minimum(chunk))
    s, w = build(tmp_path, chunk, blocks, mode)
    preempted = count_preemptions(s)
    r = make_request("r", prompt(6000, 3), 16)
    s.add_request(r)
    run(s, w, mode, max_steps=1000)
    assert r.is_finished() and preempted == []
    check_drained(s)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", (256, 1024, 2048, 8192))
@pytest.mark.parametrize("seed", (1, 2))
def test_requests_beside_others_all_finish(tmp_path, chunk, mode, seed):
    """R4 beside others: requests of 100 tokens up to max_model_len arrive
    over time (some sharing a prefix, so host hits start zero-resident) in a
    pool of twice the startup minimum. Every one finishes; a running request
    waits for copies in flight rather than preempting (R26), and none is
    preempted: admission counts the region a long prompt will need (R25)."""
    rng = random.Random(seed)
    s, w = build(tmp_path, chunk, 2 * startup_minimum(chunk), mode, seed=seed)
    preempted = count_preemptions(s)
    shared = prompt(3000, 100 + seed)
    arrivals = []
    for i in range(10):
        n = rng.choice([100, 700, 2500, 6000, 11000, MAX_MODEL_LEN - 200])
        head = shared if rng.random() < 0.4 and n > len(shared) else []
        body = prompt(n - len(head), 1000 * seed + i)
        arrivals.append((rng.randint(0, 60), make_request(f"q{i}", head + body,
                                                          rng.randint(1, 150))))
    driver = driver_for(mode, s, w)
    steps = 0
    while arrivals or driver.busy():
        for when, request in [a for a in arrivals if a[0] <= steps]:
            s.add_request(request)
        arrivals = [a for a in arrivals if a[0] > steps]
        driver.step()
        check_invariants(s)
        steps += 1
        assert steps < 4000, f"not finished: {hs(s).stats}"
    if isinstance(driver, LateDriver):
        driver.flush()
    assert not s.has_unfinished_requests()
    assert preempted == [], f"preempted {preempted} ({hs(s).stats})"
    check_drained(s)
    check_published(s, w)
