# SPDX-License-Identifier: Apache-2.0
"""End-to-end HiSparse tests on a tiny GLM-5-architecture model (spec 8.4).

Runs ON the GPU host (scripts/test-gpu.sh tier ``e2e``) with the patched
vLLM and the hisparse_ops kernels importable. Every engine runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with vLLM's defaults left on
(async scheduling, the default CUDA-graph mode) unless the engine names a
mode. Both arms of a comparison load identical weights (vLLM's dummy
weights re-initialised N(0, 0.02) with a fixed seed) and run the same
requests in the same order, so their greedy tokens must be identical
(target T1). HiSparse-on engines run under real memory pressure (a small GPU
pool), and the same run proves it with counters (lost pages, hot misses,
completed spills) and the mirror audit (VLLM_HISPARSE_DEBUG=1: every host row
a step wrote equals its resident row, every layer).

usage: python3 tests/e2e/run_e2e.py --out DIR [--engines NAME,...] [--quick]
Writes DIR/e2e.json (appended after every engine) and DIR/e2e.log.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

HERE = Path(__file__).resolve().parent
VOCAB = 8192
SEED = 1234
BLOCK = 64

# ---------------------------------------------------------------- engines

MAX_MODEL_LEN = 8192
BATCHED_TOKENS = 512
BASE = dict(
    dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=MAX_MODEL_LEN,
    max_num_seqs=8, max_num_batched_tokens=BATCHED_TOKENS, seed=0,
    generation_config="vllm", enable_prefix_caching=True, load_format="dummy",
)
# HiSparse under pressure: 4 layers of 656-B rows in 4 resident/hot pairs,
# so a page costs 5 blocks fully resident; 340 blocks hold 68 pages (a 6K
# prompt is 94).
PRESSURE_BLOCKS = 340
MODES = {
    "default": {},
    "eager": {"enforce_eager": True},
    "fdo": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
}


def engine_specs() -> dict[str, dict]:
    """name -> {model, mode, hisparse: None | dict, extra kwargs}."""
    offload = {"cpu_bytes_to_use": 1 << 30}
    on = lambda **kw: {"host_pool_gib": 2, **kw}  # noqa: E731
    return {
        "off_default": dict(model="glm", mode="default", hisparse=None),
        "on_default": dict(model="glm", mode="default", hisparse=on(),
                           offload=offload, blocks=PRESSURE_BLOCKS),
        "on_lazy": dict(model="glm", mode="default",
                        hisparse=on(eager_host_mirror=False), blocks=PRESSURE_BLOCKS),
        "on_hostex": dict(model="glm", mode="default", hisparse=on(host_pool_gib=0.0215),
                          blocks=PRESSURE_BLOCKS),
        # No pressure: ample blocks, and a resident window that holds the
        # whole prompt (admission_max_tokens), so no hot region is needed.
        "on_nopressure": dict(model="glm", mode="default",
                              hisparse=on(admission_max_tokens=16384)),
        "off_eager": dict(model="glm", mode="eager", hisparse=None),
        "on_eager": dict(model="glm", mode="eager", hisparse=on(), blocks=PRESSURE_BLOCKS),
        "off_fdo": dict(model="glm", mode="fdo", hisparse=None),
        "on_fdo": dict(model="glm", mode="fdo", hisparse=on(), blocks=PRESSURE_BLOCKS),
        "off_share": dict(model="glm_share", mode="default", hisparse=None),
        "on_share": dict(model="glm_share", mode="default", hisparse=on(),
                         offload=offload, blocks=PRESSURE_BLOCKS),
        # E2E-10, two GPUs: TP = 2 with one host pool shared by both ranks
        # (rank 0 writes, rank 1 reads), against the TP = 2 baseline. Run
        # only when named (--engines off_tp2,on_tp2).
        "off_tp2": dict(model="glm", mode="default", hisparse=None, tp=2),
        "on_tp2": dict(model="glm", mode="default", hisparse=on(), offload=offload,
                       blocks=PRESSURE_BLOCKS, tp=2),
    }


# Scenarios each engine runs, in order (the same order in both arms).
PLAN = {
    "off_default": ["single", "concurrent", "host_prefix", "long_outputs", "p2"],
    "on_default": ["single", "concurrent", "host_prefix"],
    "on_lazy": ["single"],
    "on_hostex": ["long_outputs"],
    "on_nopressure": ["single", "p2"],
    "off_eager": ["single"],
    "on_eager": ["single"],
    "off_fdo": ["single", "concurrent"],
    "on_fdo": ["single", "concurrent"],
    "off_share": ["single", "host_prefix"],
    "on_share": ["single", "host_prefix"],
    "off_tp2": ["single", "concurrent", "host_prefix"],
    "on_tp2": ["single", "concurrent", "host_prefix"],
}
# Which reference each HiSparse engine is compared with (same model, mode).
REFERENCE = {
    "on_default": "off_default", "on_lazy": "off_default", "on_hostex": "off_default",
    "on_nopressure": "off_default", "on_eager": "off_eager", "on_fdo": "off_fdo",
    "on_share": "off_share", "on_tp2": "off_tp2",
}
SPEC_IDS = {
    ("on_default", "single"): "E2E-1", ("on_default", "concurrent"): "E2E-2",
    ("on_default", "host_prefix"): "E2E-4,E2E-7", ("on_fdo", "single"): "E2E-3",
    ("on_fdo", "concurrent"): "E2E-3", ("on_eager", "single"): "E2E-1,E2E-3",
    ("on_lazy", "single"): "E2E-6", ("on_nopressure", "single"): "E2E-8",
    ("on_hostex", "long_outputs"): "E2E-9", ("on_share", "single"): "E2E-1 (IndexShare)",
    ("on_share", "host_prefix"): "E2E-4 (IndexShare)",
    ("on_tp2", "single"): "E2E-10", ("on_tp2", "concurrent"): "E2E-10",
    ("on_tp2", "host_prefix"): "E2E-10,E2E-4",
}


# --------------------------------------------------------------- prompts


def prompts(name: str) -> list[list[list[int]]]:
    """Batches of prompts (token ids) of a scenario; seeded, so both arms
    get the same ones. Each batch is one generate() call."""
    rng = random.Random(f"{SEED}-{name}")

    def ids(n: int) -> list[int]:
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    if name == "single":
        return [[ids(6000)]]
    if name == "concurrent":
        return [[ids(n) for n in (2600, 3100, 3500, 2900)]]
    if name == "long_outputs":
        return [[ids(n) for n in (1900, 2000, 2100, 1950)]]
    if name == "host_prefix":
        a = ids(4000)
        fillers = [ids(5200), ids(5200)]
        # A alone, then two fillers that push A's GPU pages out, then A plus
        # a suffix: a host prefix hit that starts zero-resident.
        return [[a], [fillers[0]], [fillers[1]], [a + ids(700)]]
    raise KeyError(name)


MAX_TOKENS = {"single": 64, "concurrent": 48, "host_prefix": 48, "long_outputs": 900}


# -------------------------------------------------------------- helpers


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def reinit(model) -> int:
    """Every float matrix N(0, 0.02) from one seeded generator (both arms
    iterate the same parameters in the same order)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(SEED)
    n = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dtype in (torch.bfloat16, torch.float16, torch.float32) and p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device,
                                    dtype=torch.float32).mul_(0.02).to(p.dtype))
                n += 1
    return n


def core(llm):
    """The in-process EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    client = llm.llm_engine.engine_core
    return getattr(client, "engine_core", client)


def scheduler_counters(llm) -> dict:
    sched = core(llm).scheduler
    coordinator = sched.kv_cache_manager.coordinator
    stats = getattr(getattr(coordinator, "hisparse", None), "stats", None)
    out = {"preemptions": getattr(sched, "_hs_preemptions", 0)}
    if stats is not None:
        out.update({k: int(v) for k, v in vars(stats).items()})
        out["pending_spills"] = len(coordinator.hisparse.pending_spills)
    connector = getattr(sched, "connector", None)
    out["external_tokens"] = getattr(connector, "_hs_external_tokens", 0)
    return out


def worker_counters(worker) -> dict:
    runtime = worker.model_runner.hisparse_runtime
    if runtime is None:
        return {}
    from vllm.v1.hisparse.worker import current_worker

    out = runtime.stats()
    data_plane = current_worker()
    if data_plane is not None:
        out["audit_rows_checked"] = data_plane.audit_rows_checked
        out["audit_mismatches"] = data_plane.audit_mismatches
        events = data_plane.host_write
        for name in ("exact_waits", "early_steps"):  # a shared pool's reader
            if hasattr(events, name):
                out[f"reader_{name}"] = getattr(events, name)
    return out


def host_pool_role(worker) -> dict:
    """This rank's host pool: shared or private, writer or reader (4.12)."""
    from vllm.v1.hisparse.worker import current_worker

    data_plane = current_worker()
    if data_plane is None:
        return {}
    return {"shared": data_plane.sharing is not None, "writer": data_plane.writer}


def counters(llm) -> dict:
    """Scheduler counters plus the workers', summed over the TP ranks."""
    out = scheduler_counters(llm)
    for part in llm.collective_rpc(worker_counters):
        for k, v in part.items():
            out[k] = out.get(k, 0) + v if isinstance(v, int) else v
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: (v - before.get(k, 0) if isinstance(v, int) else v) for k, v in after.items()}


def instrument(llm) -> None:
    """Count preemptions and external (offloaded) tokens in the scheduler."""
    sched = core(llm).scheduler
    sched._hs_preemptions = 0
    preempt = sched._preempt_request

    def counted(*a, **kw):
        sched._hs_preemptions += 1
        return preempt(*a, **kw)

    sched._preempt_request = counted
    connector = getattr(sched, "connector", None)
    if connector is not None:
        connector._hs_external_tokens = 0
        update = connector.update_state_after_alloc

        def tracked(request, blocks, num_external_tokens):
            connector._hs_external_tokens += int(num_external_tokens)
            return update(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = tracked


def make_llm(spec: dict, model_dirs: dict):
    from vllm import LLM
    from vllm.config import AttentionConfig, KVTransferConfig
    from vllm.config.hisparse import HiSparseConfig

    kw = dict(BASE, model=str(model_dirs[spec["model"]]), **MODES[spec["mode"]])
    if spec.get("tp", 1) > 1:
        kw.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    if spec["hisparse"] is None:
        kw["kv_cache_memory_bytes"] = 2 << 30
    else:
        kw["attention_config"] = AttentionConfig(
            hisparse_config=HiSparseConfig(**spec["hisparse"]))
        if spec.get("blocks"):
            kw["num_gpu_blocks_override"] = spec["blocks"]
        else:
            kw["kv_cache_memory_bytes"] = 2 << 30
        if spec.get("offload"):
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both",
                kv_connector_extra_config={"spec_name": "TieringOffloadingSpec",
                                           **spec["offload"]})
    return LLM(**kw), kw


def resolved_defaults(llm) -> dict:
    vc = llm.llm_engine.vllm_config
    return {
        "async_scheduling": bool(vc.scheduler_config.async_scheduling),
        "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
        "compilation_mode": str(vc.compilation_config.mode),
        "kv_connector": vc.kv_transfer_config.kv_connector if vc.kv_transfer_config else None,
        "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
        "sparse_mla_force_mqa": vc.attention_config.sparse_mla_force_mqa,
    }


def run_scenario(llm, name: str) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[name], ignore_eos=True)
    tokens: list[list[int]] = []
    for batch in prompts(name):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return tokens


def p2(llm) -> dict:
    """Decode ms per step at batch 1 and 16 (P2): (time of 288 new tokens -
    time of 32) / 256, the prompts prefix-cached, best of three."""
    import torch
    from vllm import SamplingParams

    rng = random.Random(f"{SEED}-p2")
    out = {}
    for batch in (1, 16):
        ps = [{"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(1000)]}
              for _ in range(batch)]

        def timed(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        timed(32)  # warm: compile this batch's graphs, cache the prompts
        short = min(timed(32) for _ in range(3))
        long = min(timed(288) for _ in range(3))
        out[f"batch{batch}_decode_ms_per_step"] = round((long - short) / 256 * 1e3, 4)
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def checks_for(engine: str, scenario: str, c: dict) -> dict[str, bool]:
    """What the scenario must prove beyond identical tokens."""
    if engine == "on_nopressure":
        return {"no_misses": c.get("misses", 0) == 0,
                "no_hot_region": c.get("hot_regions_assigned", 0) == 0
                and c.get("lost_pages", 0) == 0,
                "no_preemption": c.get("preemptions", 0) == 0}
    out = {"lost_pages": c.get("lost_pages", 0) > 0,
           "hot_misses": c.get("misses", 0) > 0,
           "spills_completed": c.get("spills_completed", 0) > 0}
    if engine == "on_hostex":
        out = {"preempted_on_host_exhaustion": c.get("preemptions", 0) > 0}
    else:
        out["no_preemption"] = c.get("preemptions", 0) == 0
    if c.get("audit_rows_checked") is not None:
        out["mirror_audit_rows"] = c.get("audit_rows_checked", 0) > 0
        out["mirror_audit_clean"] = c.get("audit_mismatches", 0) == 0
    if scenario == "host_prefix" and engine in ("on_default", "on_share", "on_tp2"):
        out["offloader_loaded_indexer"] = c.get("external_tokens", 0) > 0
    return out


# ------------------------------------------------------------------ main


def make_models(stage: Path) -> dict[str, Path]:
    dirs = {"glm": stage / "tiny_glm5", "glm_share": stage / "tiny_glm5_share"}
    for name, path in dirs.items():
        if not (path / "config.json").exists():
            args = [sys.executable, str(HERE / "make_tiny_glm5.py"), str(path)]
            if name == "glm_share":
                args += ["--index-topk-freq", "2"]
            subprocess.run(args, check=True)
    return dirs


def shutdown(llm) -> None:
    import torch

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:  # noqa: BLE001 - keep going to the next engine
        log("shutdown error", repr(err))
    from vllm.v1.hisparse.host_pool import release_host_pools

    release_host_pools()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as err:  # noqa: BLE001
        log("cleanup error", repr(err))
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", default=os.environ.get("HISPARSE_STAGE", "/root/stage"))
    ap.add_argument("--engines", default=",".join(
        n for n, spec in engine_specs().items() if spec.get("tp", 1) == 1))
    ap.add_argument("--scenarios", default=None, help="limit to these scenarios")
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path = out_dir / "e2e.json"
    R: dict = {"command": " ".join(sys.argv), "engines": {}, "scenarios": [],
               "tokens": {}}
    if result_path.exists():
        R = json.loads(result_path.read_text()) | {"command": " ".join(sys.argv)}
    specs = engine_specs()
    wanted = [e for e in a.engines.split(",") if e]
    only = set(a.scenarios.split(",")) if a.scenarios else None
    model_dirs = make_models(Path(a.stage))
    import torch
    import vllm

    R["vllm_version"] = vllm.__version__
    R["torch"] = torch.__version__
    R["gpu"] = torch.cuda.get_device_name(0)

    def save() -> None:
        result_path.write_text(json.dumps(R, indent=1))

    failures = 0
    for name in wanted:
        spec = specs[name]
        rec = R["engines"].setdefault(name, {})
        rec["spec"] = spec
        # The mirror audit synchronizes every step: on for the engines under
        # pressure, off where decode is timed (P2).
        debug = spec["hisparse"] is not None and "p2" not in PLAN[name]
        if debug:
            os.environ["VLLM_HISPARSE_DEBUG"] = "1"
        log("engine", name, "start")
        t0 = time.time()
        try:
            llm, kw = make_llm(spec, model_dirs)
        except Exception:
            rec["error"] = traceback.format_exc()[-6000:]
            log("engine", name, "FAILED to start\n", rec["error"])
            failures += 1
            save()
            os.environ.pop("VLLM_HISPARSE_DEBUG", None)
            continue
        os.environ.pop("VLLM_HISPARSE_DEBUG", None)
        rec["init_s"] = round(time.time() - t0, 1)
        rec["llm_kwargs"] = {k: str(v) for k, v in kw.items()}
        rec["defaults"] = resolved_defaults(llm)
        try:
            rec["reinit_params"] = llm.apply_model(reinit)[0]
            rec["host_pool_roles"] = llm.collective_rpc(host_pool_role)
            instrument(llm)
        except Exception:
            rec["error"] = traceback.format_exc()[-6000:]
            failures += 1
            shutdown(llm)
            save()
            continue
        log("engine", name, "ready in", rec["init_s"], "s", rec["defaults"])
        for scenario in PLAN[name]:
            if only is not None and scenario not in only:
                continue
            entry = {"engine": name, "scenario": scenario,
                     "spec_ids": SPEC_IDS.get((name, scenario))}
            try:
                if scenario == "p2":
                    entry["p2"] = p2(llm)
                    R.setdefault("p2", {})[name] = entry["p2"]
                else:
                    before = counters(llm)
                    t1 = time.time()
                    toks = run_scenario(llm, scenario)
                    entry["wall_s"] = round(time.time() - t1, 1)
                    entry["counters"] = delta(counters(llm), before)
                    R["tokens"][f"{name}/{scenario}"] = toks
                    entry["distinct_tokens"] = len({t for seq in toks for t in seq})
                    ref = REFERENCE.get(name)
                    ref_toks = R["tokens"].get(f"{ref}/{scenario}") if ref else None
                    if ref:
                        if ref_toks is None:
                            entry["error"] = f"reference {ref}/{scenario} not run"
                        else:
                            entry["identical"] = ref_toks == toks
                            entry["first_divergence"] = [
                                first_divergence(x, y) for x, y in zip(ref_toks, toks)]
                            entry["checks"] = checks_for(name, scenario, entry["counters"])
                            if spec.get("tp", 1) > 1:
                                entry["checks"]["one_shared_pool_one_writer"] = (
                                    rec["host_pool_roles"] == [
                                        {"shared": True, "writer": r == 0}
                                        for r in range(spec["tp"])])
                            entry["pass"] = entry["identical"] and all(
                                entry["checks"].values())
                            failures += not entry["pass"]
            except Exception:
                entry["error"] = traceback.format_exc()[-6000:]
                failures += 1
            log(name, scenario, {k: v for k, v in entry.items() if k != "error"},
                entry.get("error", ""))
            R["scenarios"].append(entry)
            save()
        shutdown(llm)
        save()
    R["failures"] = failures
    save()
    log("done, failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
