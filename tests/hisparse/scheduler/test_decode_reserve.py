# SPDX-License-Identifier: Apache-2.0
"""R34 (target P4: zero preemptions of running requests; docs/residency.md):
an admission keeps free the decode growth of the requests already running.

bench-agentic run 12 (H100, 32 conversations) preempted once: once the pool
held only indexer pages, hot regions and protected tails, a decode crossing
a page boundary needed an indexer block that nothing gives back (a resident
page is given up as the next is allocated, R25; an indexer page never is)
and no transfer in flight would release one (R26). Here vLLM's scheduler
(async scheduling, completions up to two steps late) admits requests whose
prompts and answers outgrow the pool; without the reserve the same
workload preempts, which proves the test can fail."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tests.hisparse.scheduler.harness import (
    B,
    AsyncDriver,
    Faults,
    SimWorker,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
)
from tests.hisparse.scheduler.helpers import hs, prompt
from tests.hisparse.scheduler.invariants import (
    check_drained,
    check_invariants,
    check_published,
)
from tests.hisparse.scheduler.test_liveness import count_preemptions
from vllm.v1.hisparse.constants import DECODE_RESERVE_MAX_PAGES
from vllm.v1.hisparse.kv_cache_coordinator import HiSparseKVCacheCoordinator

MAX_MODEL_LEN = 4096
CHUNK = 256


def build(tmp_path, num_gpu_blocks: int):
    config = hisparse_kv_cache_config(
        num_gpu_blocks=num_gpu_blocks, num_host_blocks=4000, admission_max_tokens=CHUNK,
        max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=CHUNK)
    s = make_scheduler(tmp_path, config, max_num_seqs=64, max_num_batched_tokens=CHUNK,
                       max_model_len=MAX_MODEL_LEN, async_scheduling=True)
    return s, SimWorker(s, faults=Faults(max_delay=2), seed=0)


def play(s, w) -> list[str]:
    """24 requests of 800-1,200 prompt tokens and 300-600 outputs (5-10
    pages of growth each) arrive together; every one finishes, every row
    read checked by the simulated worker."""
    rng = random.Random(0)
    preempted = count_preemptions(s)
    reqs = [make_request(f"r{i}", prompt(rng.randint(800, 1200), i), rng.randint(300, 600))
            for i in range(24)]
    for r in reqs:
        s.add_request(r)
    driver = AsyncDriver(s, w)
    steps = 0
    while driver.busy():
        driver.step()
        check_invariants(s)
        steps += 1
        assert steps < 10_000, hs(s).stats
    assert all(r.is_finished() and r.num_output_tokens == r.max_tokens for r in reqs)
    check_drained(s)
    check_published(s, w)
    return preempted


@pytest.mark.parametrize("num_gpu_blocks", [150, 260, 330])
def test_running_requests_decode_to_the_end_without_preemption(tmp_path, num_gpu_blocks):
    """P4 / R34: no preemption, under pressure (pages lost, several requests
    running hybrid at once)."""
    s, w = build(tmp_path, num_gpu_blocks)
    preempted = play(s, w)
    assert preempted == [], f"preempted {preempted} ({hs(s).stats})"
    assert hs(s).stats.lost_pages > 0


@pytest.mark.parametrize("num_gpu_blocks", [260, 330])
def test_without_the_reserve_the_same_workload_preempts(tmp_path, monkeypatch,
                                                        num_gpu_blocks):
    """The negative control: spec 4.15's admission alone (no reserve)
    packs the pool until a decode's indexer page has nowhere to go."""
    monkeypatch.setattr(HiSparseKVCacheCoordinator, "admission_reserve_blocks",
                        lambda self, request: 0)
    s, w = build(tmp_path, num_gpu_blocks)
    assert len(play(s, w)) > 0


def _request(prompt_tokens: int, max_tokens: int, outputs: int = 0, rid: str = "x"):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt_tokens,
                           max_tokens=max_tokens, num_tokens=prompt_tokens + outputs)


def test_the_reserve_counts_pages_still_to_come_capped(tmp_path):
    """R34's arithmetic: a candidate's own output pages, from its prompt to
    min(prompt + max_tokens, max_model_len), at most DECODE_RESERVE_MAX_PAGES,
    times the GPU-only groups that grow (the tiny model: the indexer)."""
    s, _ = build(tmp_path, 330)
    coord = s.kv_cache_manager.coordinator
    groups = len(coord._growth_group_ids)
    assert groups == 1
    reserve = coord.admission_reserve_blocks
    assert reserve(_request(1000, 200)) == (-(-1200 // B) - (-(-1000 // B))) * groups  # 3
    assert reserve(_request(1024, 64)) == 1  # exactly one page more
    assert reserve(_request(1000, 0)) == 0
    # No max_tokens of its own: the context length bounds it, the cap more.
    assert reserve(_request(100, MAX_MODEL_LEN)) == DECODE_RESERVE_MAX_PAGES
    # Outputs already decoded count as held (the prefill reservation).
    assert reserve(_request(1000, 200, outputs=150)) == 1


def test_the_reserve_adds_every_tracked_request(tmp_path):
    """Running requests count from the pages they hold; the candidate is
    never counted twice."""
    s, w = build(tmp_path, 330)
    a = make_request("a", prompt(700, 1), 300)
    s.add_request(a)
    driver = AsyncDriver(s, w)
    while a.num_output_tokens < 10:
        driver.step()
    coord = s.kv_cache_manager.coordinator
    held = len(coord.single_type_managers[coord._growth_group_ids[0]].req_to_blocks["a"])
    a_rest = -(-1000 // B) - held
    assert a_rest > 0
    assert coord.admission_reserve_blocks(_request(500, 100)) == a_rest + 2
    assert coord.admission_reserve_blocks(a) == a_rest
