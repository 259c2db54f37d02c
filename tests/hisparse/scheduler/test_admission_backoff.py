# SPDX-License-Identifier: Apache-2.0
"""R35 (target P5: TPOT p50 no worse than the offloader's; docs/residency.md):
an admission that failed for lack of blocks is not looked up again while no
block came free.

bench-agentic at 32 conversations (run 15, H100) kept ~14 requests waiting
for a full pool: vLLM's scheduler tried the waiting head on every step, and
each try repeated its prefix lookups (the GPU groups', the host pool's and
the OffloadingConnector's, ~1 ms a step) to fail the same allocation, which
put a decode step of 8.7 running requests at ~4 ms against ~2.9 ms for 3.3
requests that never tried. Here vLLM's scheduler (async scheduling,
completions up to two steps late) admits 24 requests into pools that hold a
few at once; the control (ADMISSION_RETRY_STEPS = 0: every step tries) shows
what the back-off saves and that it delays no admission."""

from __future__ import annotations

import pytest

from tests.hisparse.scheduler.helpers import hs
from tests.hisparse.scheduler.test_decode_reserve import build, play
from vllm.v1.hisparse import kv_cache_coordinator as kvc
from vllm.v1.hisparse.constants import ADMISSION_RETRY_STEPS


def _counted_play(tmp_path, num_gpu_blocks: int) -> dict:
    s, w = build(tmp_path, num_gpu_blocks)
    manager, calls = s.kv_cache_manager, {"lookups": 0, "steps": 0}
    lookup, step = manager.get_computed_blocks, manager.new_step_starts

    def counted_lookup(request):
        calls["lookups"] += 1
        return lookup(request)

    def counted_step():
        calls["steps"] += 1
        return step()

    manager.get_computed_blocks, manager.new_step_starts = counted_lookup, counted_step
    preempted = play(s, w)  # every request finishes, every row read checked
    return {**calls, "preempted": preempted, "backoffs": hs(s).stats.admission_backoffs}


@pytest.mark.parametrize("num_gpu_blocks", [150, 330])
def test_a_failed_admission_waits_for_free_blocks_not_for_lookups(tmp_path, monkeypatch,
                                                                  num_gpu_blocks):
    """P5 / R35: far fewer lookups, no later admission (the run takes no
    more steps), no preemption."""
    backoff = _counted_play(tmp_path / "backoff", num_gpu_blocks)
    monkeypatch.setattr(kvc, "ADMISSION_RETRY_STEPS", 0)  # the control: always retry
    control = _counted_play(tmp_path / "control", num_gpu_blocks)
    assert backoff["preempted"] == control["preempted"] == []
    assert control["backoffs"] == 0 and backoff["backoffs"] > 0
    assert backoff["lookups"] * 3 < control["lookups"], (backoff, control)
    assert backoff["steps"] <= control["steps"] * 1.02, (backoff, control)


def test_the_back_off_ends_when_blocks_come_free_or_after_its_bound(tmp_path):
    """The decision itself: only the request that failed, only while the
    blocks available to it are no more than at the failure, at most
    ADMISSION_RETRY_STEPS steps; a staging refusal (R28) is no failure."""
    s, _ = build(tmp_path, 330)
    coord = s.kv_cache_manager.coordinator
    pool = coord.block_pool
    req, other = _req("w", 2000), _req("v", 2000)
    # the scheduler's reservation at the failure: in-flight prefills + R34
    reserved = 10 + coord.admission_reserve_blocks(req)
    coord.admission_failed(req, reserved_blocks=reserved)
    assert coord.admission_backs_off(req, inflight_reserved=10)
    assert not coord.admission_backs_off(other, inflight_reserved=10)
    taken = pool.get_new_blocks(5)  # fewer free blocks: still no
    assert coord.admission_backs_off(req, inflight_reserved=10)
    assert not coord.admission_backs_off(req, inflight_reserved=0)  # a reservation ended
    pool.free_blocks(taken)
    one_more = pool.get_new_blocks(1)
    coord.admission_failed(req, reserved_blocks=reserved)
    pool.free_blocks(one_more)  # one block came free: try at once
    assert not coord.admission_backs_off(req, inflight_reserved=10)
    coord.admission_failed(req, reserved_blocks=reserved)
    for _ in range(ADMISSION_RETRY_STEPS - 1):
        coord.new_step_starts()
        assert coord.admission_backs_off(req, inflight_reserved=10)
    coord.new_step_starts()
    assert not coord.admission_backs_off(req, inflight_reserved=10)  # the bound
    coord._admission_failure = None
    coord._staging_full = req.request_id  # R28 refused it this step
    coord.admission_failed(req, reserved_blocks=reserved)
    assert not coord.admission_backs_off(req, inflight_reserved=10)


def _req(rid: str, prompt_tokens: int):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt_tokens, max_tokens=64,
                           num_tokens=prompt_tokens)
