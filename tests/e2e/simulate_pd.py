# SPDX-License-Identifier: Apache-2.0
"""The P/D engines' schedules on CPU, before a GPU run (docs/pd-imports.md
"GPU e2e", spec 4.13, INV-30, T1).

``record``: vLLM's real scheduler with HiSparse at an e2e engine's pool,
chunk and async scheduling, configured as ``on_pd`` is (the pin's
ExampleConnector, kv_consumer, composed into the importer), the HiSparse
SimWorker (it checks every row attention reads) and the importer's real
worker half reading real safetensors files (tests/hisparse/imports/
sim_import.py) of every prompt of a scenario; its keyed schedule recorded
by schedule_replay.ScheduleTap, and its counters.

``replay``: the pin's scheduler without HiSparse and a large pool,
configured as ``rep_pd`` is (SparseMLAExampleConnector, kv_consumer, over
the same files: a synchronous load), following that schedule. The import
is asynchronous in the first (an admission step with no forward for the
request) and synchronous in the second; the recorded step that first
names a request is its first forward in both, with the imported tokens as
its hit.

usage (repo root, the CPU venv, PYTHONPATH=ci/cpu_test_harness):
    python -c "import cpu_noclean, runpy, sys; sys.argv[1:] = ['--scenario', 'pd_imports'];
               runpy.run_path('tests/e2e/simulate_pd.py', run_name='__main__')"
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_workload as workload  # noqa: E402
import schedule_replay  # noqa: E402
from run_e2e import MAX_MODEL_LEN, MODELS, PD_CONNECTOR, PD_MODULE, engine_specs  # noqa: E402

from tests.hisparse.imports.sim_import import (  # noqa: E402
    ImportRig,
    RestoringSimWorker,
    SimImportWorker,
    consumer_config,
    write_prefill,
)
from tests.hisparse.scheduler.harness import (  # noqa: E402
    AsyncDriver,
    BaselineAsync,
    baseline_kv_cache_config,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
    run_until_idle,
)

HOST_BLOCKS = 12000  # about host_pool_gib 2 of the 4-layer model


def prompts_of(scenario: str) -> list[list[tuple[str, list[int], int]]]:
    """The scenario's calls as (key, prompt, max_tokens); single-turn
    conversations only (a P/D prompt never extends an output)."""
    histories: dict[str, list[int]] = {}
    calls = []
    for c, call in enumerate(workload.scenario(scenario)):
        calls.append([(f"{c}/{t.conv}", workload.prompt_of(t, histories), t.max_tokens)
                      for t in call])
    return calls


def on_pd_rig(tmp: Path, engine: str = "on_pd") -> ImportRig:
    spec = engine_specs()[engine]
    chunk = spec["chunk"]
    config = hisparse_kv_cache_config(
        num_gpu_blocks=spec["blocks"], num_host_blocks=HOST_BLOCKS,
        index_topk=MODELS[spec["model"]][1], admission_max_tokens=chunk,
        max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=chunk)
    path = tmp / "pd_kv"
    path.mkdir(parents=True, exist_ok=True)
    s = make_scheduler(tmp / "on", config, kv_transfer_config=consumer_config(str(path)),
                       max_num_seqs=8, max_num_batched_tokens=chunk,
                       max_model_len=MAX_MODEL_LEN, async_scheduling=True)
    w = RestoringSimWorker(s)
    importer = SimImportWorker(s, w)
    w.children = [importer]
    return ImportRig(s, w, importer, str(path))


def drive(driver, tap, s, calls, arm: str, before_call=None, limit: int = 50000) -> None:
    """Every call in order, its requests added together (one generate())."""
    for c, call in enumerate(calls):
        if before_call is not None:
            before_call(c, call)
        for key, prompt, n in call:
            r = make_request(f"{key}-{arm}", prompt, n)
            tap.name(r.request_id, key)
            s.add_request(r)
        run_until_idle(driver, limit)


def record(tmp: Path, scenario: str = "pd_imports", produce=None) -> dict:
    """on_pd's schedule and counters. ``produce(rig, key, prompt)`` writes
    a prompt's files (default: every layer's rows, the producer's)."""
    rig = on_pd_rig(tmp)
    s = rig.scheduler
    tap = schedule_replay.ScheduleTap(s)
    tap.start()
    calls = prompts_of(scenario)
    for call in calls:
        for key, prompt, _ in call:
            (produce or (lambda r, k, p: write_prefill(r, p)))(rig, key, prompt)
    drive(AsyncDriver(s, rig.worker), tap, s, calls, "on")
    stats = rig.hisparse.stats
    preempted = [e for step in tap.steps for e in step if e[2] == schedule_replay.PREEMPTED]
    return {"steps": list(tap.steps), "stats": vars(stats).copy(), "path": rig.path,
            "preemptions": len(preempted), "jobs": list(rig.importer.loads),
            "reads_checked": rig.worker.reads_checked, "hot_misses": rig.worker.hot_misses,
            "restores": len(getattr(rig.worker, "restores_seen", [])), "calls": calls}


def off_consumer(tmp: Path, path: str, chunk: int = 2048):
    """rep_pd's scheduler: HiSparse off, SparseMLAExampleConnector
    kv_consumer over ``path`` (loads synchronously), async scheduling."""
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector=PD_CONNECTOR, kv_connector_module_path=PD_MODULE,
                           kv_role="kv_consumer",
                           kv_connector_extra_config={"shared_storage_path": path})
    return make_scheduler(tmp, baseline_kv_cache_config(num_gpu_blocks=20000, index_topk=256),
                          kv_transfer_config=ktc, max_num_seqs=8, max_num_batched_tokens=chunk,
                          max_model_len=MAX_MODEL_LEN, async_scheduling=True)


def replay(tmp: Path, recorded: dict, plan: list | None = None) -> tuple:
    """rep_pd following ``plan`` (default: the recorded steps): its steps,
    where it diverged (None) and its tap."""
    s = off_consumer(tmp, recorded["path"])
    tap = schedule_replay.ScheduleTap(s)
    tap.start(recorded["steps"] if plan is None else plan)
    drive(BaselineAsync(s), tap, s, recorded["calls"], "rep")
    return list(tap.steps), tap.finish(), tap


def natural(tmp: Path, recorded: dict) -> list:
    s = off_consumer(tmp, recorded["path"])
    tap = schedule_replay.ScheduleTap(s)
    tap.start()
    drive(BaselineAsync(s), tap, s, recorded["calls"], "off")
    return list(tap.steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="pd_imports")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = record(Path(tmp), a.scenario)
        steps, diverged, _ = replay(Path(tmp) / "rep", got)
        print({k: v for k, v in got.items() if k in ("stats", "preemptions", "hot_misses",
                                                      "restores")})
        print({"landings": [(j.req_id, j.landing, j.end_token) for j in got["jobs"]],
               "replay_equal": steps == got["steps"], "diverged": diverged})


if __name__ == "__main__":
    main()
