# SPDX-License-Identifier: Apache-2.0
"""The offloader skips requests with nothing new to store (patch
kv-offload-scheduler-skip-settled-requests; issue 16: the
OffloadingConnector beside HiSparse "adds nothing when nothing is
offloaded", bench-tax runs 15 and 17).

The pin's ``OffloadingConnectorScheduler._build_store_jobs`` re-derived
every scheduled request's storable chunks on every step, and
``update_offload_keys`` walked each request's block hashes from the start
to find new ones: per-request Python work on every decode step, also when
``offload_prompt_only`` (the default) leaves nothing to store. The patch
remembers the offloadable-token count a request was settled at and skips it
while that count is unchanged. These tests drive vLLM's real scheduler with
the offloader's real halves (sim_offload checks every stored and loaded
byte) and compare every store job against the pin's behaviour."""

import random

import pytest

from tests.hisparse.offloading.test_offloading import converse, prompt
from tests.hisparse.scheduler.harness import make_request
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    RequestOffloadState,
)


def _record_store_jobs(r, *, settle: bool) -> list:
    """Wrap the offloader's ``_build_store_jobs``: every job it returns, per
    call. ``settle=False`` forgets every request's settled count and seen
    hashes before each call, which is the pin's behaviour (every request
    re-derived, its offload keys looked up from its first hash)."""
    sched = r.offloader.connector_scheduler
    build = sched._build_store_jobs
    calls: list = []

    def recorded(scheduler_output):
        if not settle:
            for status in sched._req_status.values():
                status.settled_offloadable_tokens = -1
                status.num_hashes_seen = 0
        jobs = build(scheduler_output)
        calls.append([
            (job_id, job.req_id, job.src_spec.block_ids.tolist(),
             list(job.src_spec.group_sizes), list(job.src_spec.block_indices),
             sorted(map(bytes, sched._jobs[job_id].keys)))
            for job_id, job in jobs.items()
        ])
        return jobs

    sched._build_store_jobs = recorded
    return calls


@pytest.mark.parametrize("prompt_only", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_settled_requests_store_exactly_what_the_pin_stores(rig, seed, prompt_only):
    """INV-31 / R4 (the offloader's stores stay exact): multi-turn
    conversations under pressure (preemptions, page loss, loads of earlier
    turns) give the same store jobs, step by step, with the skip as with
    every request re-derived; every stored and loaded byte is checked."""
    runs = []
    for settle in (True, False):
        r = rig(num_gpu_blocks=80, num_host_blocks=150, num_cpu_blocks=64,
                max_num_seqs=3, offload_extra={"offload_prompt_only": prompt_only})
        calls = _record_store_jobs(r, settle=settle)
        converse(r, random.Random(seed), prompt_seed=1000 * seed, turns=4)
        r.finish()
        assert r.offload.loads_verified >= 3
        # The offloader's request states still held once drained (the pin
        # keeps the last finished request's until a next step): a skipped
        # finished request would leak its state.
        held = sorted(r.offloader.connector_scheduler._req_status)
        runs.append((calls, r.worker.step_no, r.offload.loads_verified, held))
    (skip, skip_steps, skip_loads, skip_held), (pin, pin_steps, pin_loads, pin_held) = runs
    assert skip_steps == pin_steps and skip_loads == pin_loads
    assert skip_held == pin_held and len(pin_held) <= 1
    assert sum(map(len, pin)) > 0
    assert skip == pin


def test_a_settled_decode_step_plans_no_store(rig, monkeypatch):
    """P2 / issue 16 (the offloader adds nothing when nothing is
    offloaded): with offload_prompt_only, once the prompts are stored a
    decode step derives no request's storable chunks; a request whose
    count moves (a new prompt) is planned again."""
    derived = []
    storable = RequestOffloadState.storable_chunks

    def counted(self, group_config, num_offloadable_tokens):
        derived.append(self.req.request_id)
        return storable(self, group_config, num_offloadable_tokens)

    monkeypatch.setattr(RequestOffloadState, "storable_chunks", counted)
    r = rig(num_gpu_blocks=200, offload_extra={"offload_prompt_only": True})
    reqs = [make_request(f"d{i}", prompt(300, i), 40) for i in range(3)]
    for q in reqs:
        r.scheduler.add_request(q)
    for _ in range(8):  # prefill and the first decode steps
        r.step()
    assert all(q.num_output_tokens > 0 for q in reqs)
    derived.clear()
    for _ in range(10):
        r.step()
    assert not any(q.is_finished() for q in reqs)
    assert derived == []  # three running requests, ten steps, nothing derived
    late = make_request("late", prompt(300, 9), 5)
    r.scheduler.add_request(late)
    r.step()
    assert "late" in derived and not {"d0", "d1", "d2"} & set(derived)
    r.finish()
