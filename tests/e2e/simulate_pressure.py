# SPDX-License-Identifier: Apache-2.0
"""Choose the e2e memory-pressure settings on CPU, before a GPU run.

Drives vLLM's real scheduler with HiSparse on (the scheduler tests' simulated
worker, which checks every KV row it reads) through the scenarios of
tests/e2e/run_e2e.py with an engine's model shape, pool size, chunking and
async scheduling, and prints per scenario: preemptions, lost pages, hot
regions, spills, and the most host-only context pages that requests of one
short query length (<= 256 tokens: FlashMLA sparse's uniform decode path,
K13) brought into one step, against C_stage (spec F21). The GPU run then
proves the same pressure with the real counters. No OffloadingConnector
here: after fillers evict an indexer prefix, the simulated return
recomputes it (on the GPU the offloader loads it back).

usage (repo root, the CPU venv, PYTHONPATH=ci/cpu_test_harness):
    python -c "import cpu_noclean, runpy, sys; sys.argv[1:] = ['--engine', 'on_c2k'];
               runpy.run_path('tests/e2e/simulate_pressure.py', run_name='__main__')"
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_workload as workload  # noqa: E402
from run_e2e import MAX_MODEL_LEN, MODELS, ON_PLAN, engine_specs  # noqa: E402

from tests.hisparse.scheduler.harness import (  # noqa: E402
    AsyncDriver,
    SimWorker,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
)

SHORT_QUERY = 256  # FlashMLA sparse's reorder threshold at 64 heads
B = workload.BLOCK


def staged_pages(so, worker: SimWorker, scheduler) -> int:
    """Max over query lengths 2..256 of the host-only context pages of this
    step's requests with that length (a uniform batch of short chunks on the
    decode kernel, K13; 1-token decodes go through the resolver)."""
    res = worker.res_gids[0]
    per_len: dict[int, int] = {}
    for req_id, n in so.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id)
        if request is None or not 1 < n <= SHORT_QUERY or req_id not in worker.tables:
            continue
        pages = -(-request.num_computed_tokens // B)  # already counts this step
        nulls = sum(1 for b in worker.tables[req_id][res][:pages] if b == 0)
        per_len[n] = per_len.get(n, 0) + nulls
    return max(per_len.values(), default=0)


def simulate(engine: str, scenario: str, host_blocks: int,
             blocks_override: int | None = None) -> dict:
    spec = engine_specs()[engine]
    chunk = spec["chunk"]
    blocks = blocks_override or spec["blocks"] or 50000
    args, topk = MODELS[spec["model"]]
    # The model's shape as make_tiny_glm5.py builds it from these arguments:
    # IndexShare (--index-topk-freq N) has fewer pairs, --layers more.
    def arg(flag: str, default: int) -> int:
        return int(args[args.index(flag) + 1]) if flag in args else default

    config = hisparse_kv_cache_config(
        num_gpu_blocks=blocks, num_host_blocks=host_blocks, index_topk=topk,
        freq=arg("--index-topk-freq", 1), num_layers=arg("--layers", 4),
        admission_max_tokens=spec["hisparse"].get("admission_max_tokens", chunk))
    with tempfile.TemporaryDirectory() as tmp:
        s = make_scheduler(Path(tmp), config, max_num_seqs=8, max_num_batched_tokens=chunk,
                           max_model_len=MAX_MODEL_LEN, async_scheduling=True)
        w = SimWorker(s)
        d = AsyncDriver(s, w)
        histories: dict[str, list[int]] = {}
        reqs, max_running, max_staged = [], 0, 0
        for c, call in enumerate(workload.scenario(scenario)):
            batch = []
            for i, t in enumerate(call):
                prompt = workload.prompt_of(t, histories)
                batch.append((t, prompt, make_request(f"{scenario}-{c}-{i}", prompt,
                                                      t.max_tokens)))
            for _, _, r in batch:
                s.add_request(r)
            steps = 0
            while d.busy() and steps < 50000:
                so = d.step()
                max_staged = max(max_staged, staged_pages(so, w, s))
                steps += 1
                max_running = max(max_running, len(s.running))
            for t, prompt, r in batch:
                workload.record_turn(t, prompt, list(r.output_token_ids), histories)
            reqs += [r for _, _, r in batch]
        stats = s.kv_cache_manager.coordinator.hisparse.stats
        c_stage = -(-MAX_MODEL_LEN // B) + -(-chunk // B)
        return {"engine": engine, "scenario": scenario, "blocks": blocks,
                "finished": all(r.is_finished() for r in reqs),
                "preemptions": sum(r.num_preemptions for r in reqs),
                "max_running": max_running, **vars(stats),
                "max_staged_pages": max_staged, "c_stage": c_stage,
                "reads_checked": w.reads_checked}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="on_c2k")
    ap.add_argument("--host-blocks", type=int, default=12000)
    ap.add_argument("--scenario", default=None, help="default: the engine's plan")
    ap.add_argument("--blocks", type=int, default=None,
                    help="the GPU pool in blocks (default: the engine's)")
    a = ap.parse_args()
    names = a.scenario.split(",") if a.scenario else [
        s for s in ON_PLAN[a.engine] if s != "fault_probe"]
    for scenario in names:
        print(simulate(a.engine, scenario, a.host_blocks, a.blocks), flush=True)


if __name__ == "__main__":
    main()
