# SPDX-License-Identifier: Apache-2.0
"""bench-agentic's 32-conversation level on the CPU (P4, R34): vLLM's
scheduler with HiSparse and the composed OffloadingConnector
(TieringOffloadingSpec, as the bench's hisparse arm), async scheduling,
at run 12's geometry scaled by 1/2: 1,302 GPU blocks (the arm had 2,605),
max_model_len 8,192, 1,024-token chunks, index_topk 256, 64 sequences; 32
conversations whose first turns are 3,729-4,975 tokens, whose next turns add
~94 tokens and answer ~220 (+-20%), every turn returning as soon as the
last one finished, as vLLM's multi-turn benchmark sends them. Two turns:
the second turns' host-prefix admissions (zero-resident starts, cheap)
packed the pool to its last block, and without R34 a decode preempted at
step 871. Every row read is checked by the simulated workers."""

from __future__ import annotations

import random

import pytest

from tests.hisparse.offloading import conftest
from tests.hisparse.scheduler.harness import AsyncDriver, make_request
from tests.hisparse.scheduler.invariants import check_invariants
from tests.hisparse.scheduler.test_liveness import count_preemptions

SCALE = 2
MAX_MODEL_LEN = 16384 // SCALE
CHUNK = 2048 // SCALE
TURNS = 2
CONVERSATIONS = 32


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(2, 900) for _ in range(n)]


@pytest.fixture
def agentic_rig(rig, monkeypatch):
    build = conftest.hisparse_kv_cache_config

    def config(**kw):  # the bench model's top-k and the bench's resident window
        return build(**{**kw, "index_topk": 256, "admission_max_tokens": CHUNK})

    monkeypatch.setattr(conftest, "hisparse_kv_cache_config", config)
    return rig(num_gpu_blocks=2605 // SCALE, num_host_blocks=20_000, num_cpu_blocks=20_000,
               max_num_seqs=64, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=CHUNK,
               async_scheduling=True, spec_name="TieringOffloadingSpec")


def test_conversations_return_without_preemption(agentic_rig):
    r = agentic_rig
    s = r.scheduler
    preempted = count_preemptions(s)
    rng = random.Random(0)

    def answer() -> int:
        return int(220 * rng.uniform(0.8, 1.2))

    live = {}
    for c in range(CONVERSATIONS):
        q = make_request(f"c{c}.0", _tokens(int(rng.uniform(7458, 9950) / SCALE), c), answer())
        s.add_request(q)
        live[q.request_id] = q
    driver = AsyncDriver(s, r.worker)
    peak = done = 0
    while live or driver.busy():
        driver.step()
        check_invariants(s)
        peak = max(peak, len(s.running))
        for rid, q in list(live.items()):
            if not q.is_finished():
                continue
            del live[rid]
            done += 1
            c, t = map(int, rid[1:].split("."))
            if t + 1 < TURNS:
                history = list(q.all_token_ids) + _tokens(int(94 * rng.uniform(0.8, 1.2)),
                                                          1000 * c + t)
                nq = make_request(f"c{c}.{t + 1}", history, answer())
                s.add_request(nq)
                live[nq.request_id] = nq
        assert r.worker.step_no < 20_000, r.hisparse.stats
    assert done == CONVERSATIONS * TURNS
    assert preempted == [], f"preempted {preempted} ({r.hisparse.stats})"
    st = r.hisparse.stats
    assert st.lost_pages > 0 and peak >= 8, (peak, st)  # hybrid, many at once
    assert r.offload.loads_verified > 0  # the second turns loaded their indexer prefix
    r.finish()
