# SPDX-License-Identifier: Apache-2.0
"""Choose the e2e memory-pressure settings on CPU, before a GPU run.

Drives vLLM's real scheduler with HiSparse on (the scheduler tests' simulated
worker, which checks every KV row it reads) through the scenarios of
tests/e2e/run_e2e.py with the same model shape, pool sizes, chunking and
async scheduling, and prints, per scenario: preemptions, lost pages, hot
regions and spills. The GPU run then proves the same pressure with the real
counters.

usage (repo root, the CPU venv): python tests/e2e/simulate_pressure.py
    [--blocks 340] [--host-blocks 12000] [--scenario single,...]
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_e2e import BATCHED_TOKENS, MAX_MODEL_LEN, MAX_TOKENS, prompts  # noqa: E402

from tests.hisparse.scheduler.harness import (  # noqa: E402
    AsyncDriver,
    SimWorker,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
)


def simulate(scenario: str, blocks: int, host_blocks: int, topk: int) -> dict:
    config = hisparse_kv_cache_config(
        num_gpu_blocks=blocks, num_host_blocks=host_blocks, index_topk=topk,
        admission_max_tokens=BATCHED_TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        s = make_scheduler(Path(tmp), config, max_num_seqs=8,
                           max_num_batched_tokens=BATCHED_TOKENS,
                           max_model_len=MAX_MODEL_LEN, async_scheduling=True)
        w = SimWorker(s)
        d = AsyncDriver(s, w)
        reqs = []
        max_running = 0
        for b, batch in enumerate(prompts(scenario)):
            batch_reqs = [make_request(f"{scenario}-{b}-{i}", p, MAX_TOKENS[scenario])
                          for i, p in enumerate(batch)]
            for r in batch_reqs:
                s.add_request(r)
            reqs += batch_reqs
            steps = 0
            while d.busy() and steps < 20000:
                d.step()
                steps += 1
                max_running = max(max_running, len(s.running))
        stats = s.kv_cache_manager.coordinator.hisparse.stats
        return {"scenario": scenario, "finished": all(r.is_finished() for r in reqs),
                "preemptions": sum(r.num_preemptions for r in reqs),
                "max_running": max_running, **vars(stats),
                "reads_checked": w.reads_checked}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=340)
    ap.add_argument("--host-blocks", type=int, default=12000)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--scenario", default="single,concurrent,host_prefix")
    a = ap.parse_args()
    for scenario in a.scenario.split(","):
        print(simulate(scenario, a.blocks, a.host_blocks, a.topk), flush=True)


if __name__ == "__main__":
    main()
