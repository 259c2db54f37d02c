# SPDX-License-Identifier: Apache-2.0
"""GPU memory budget with HiSparse on (spec 3.5, 2.8, 2.11; docs/layout.md L17).

Runs ON one GPU with the patched vLLM and the hisparse_ops kernels
importable (as tests/e2e/run_e2e.py). Three engines in this process, one
after another, on the tiny GLM-5-architecture model at
``gpu_memory_utilization`` (default 0.9) and a long ``max_model_len``
(default 65536), each running the same long prompts concurrently:

- ``off``: HiSparse off. Its overshoot of util x total (the CUDA context,
  non-torch and allocator memory vLLM's profile does not see) is the
  tolerance the HiSparse engines are held to, plus ``--margin-mib``.
- ``on``: HiSparse on, the pool sized by vLLM's profile. HiSparse's reserve
  (staging blocks, hot-slot state, workspace, staging cache, mirror
  descriptors, block tables) must come out of the budget.
- ``override``: HiSparse on with ``num_gpu_blocks_override`` = the ``on``
  engine's pool less ``--override-slack-mib`` (a near-maximal override that
  still fits beside the reserve), so the override path's budget is checked
  too.
- ``override_excess``: the override vLLM's own arithmetic would allow (the
  ``on`` pool plus the reserve in blocks: available memory // block bytes).
  Before L17 this engine started and took the whole reserve beyond the
  budget; now startup must refuse it, naming the largest override that
  fits. It stops after the profile, so it runs no prompts.

Peak device memory is total - free from ``torch.cuda.mem_get_info``, sampled
before the engine, every 10 ms while it starts and runs, and after; the
torch side is ``torch.cuda.max_memory_reserved``. Each is taken relative to
the memory in use before the engine. The defaults make HiSparse's reserve
(about 200 MiB, mostly the hot-slot state of H = 16384) several times the
margin, so accounting that missed it would fail the ``on`` arm
(``on_check_discriminates``).

usage: python3 tests/e2e/memory_check.py --out DIR [--stage DIR]
           [--max-model-len N] [--utilization U]
           [--arms off,on,override,override_excess]
Writes DIR/memory.json (the figures, the checks and the command). Without a
CUDA GPU it writes the reason, skips and exits 0. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
VOCAB = 8192
SEED = 4321
ARMS = ("off", "on", "override", "override_excess")
RESERVE_LOGGER = "vllm.v1.hisparse.memory"


# ------------------------------------------------------------------ args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Peak GPU memory within gpu_memory_utilization, HiSparse on/off.")
    ap.add_argument("--out", required=True, help="directory for memory.json")
    ap.add_argument("--stage", default=os.environ.get("HISPARSE_STAGE", "/root/stage"),
                    help="where the tiny model is written")
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=65536)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--device-buffer-size", type=int, default=16384,
                    help="H: hot rows per request (sizes the hot-slot state)")
    ap.add_argument("--host-pool-gib", type=float, default=2.0)
    ap.add_argument("--prompts", type=int, default=4, help="long prompts, run together")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--margin-mib", type=float, default=32.0,
                    help="allowed on top of the HiSparse-off overshoot")
    ap.add_argument("--override-slack-mib", type=float, default=64.0,
                    help="the override arm's pool: the on arm's less this")
    ap.add_argument("--override-blocks", type=int, default=None,
                    help="an explicit num_gpu_blocks_override for the override arm")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="comma-separated subset of " + ",".join(ARMS) + " (in order)")
    a = ap.parse_args(argv)
    a.arms = [x for x in a.arms.split(",") if x]
    if not 0 < a.utilization <= 1:
        ap.error("--utilization must be in (0, 1]")
    if unknown := [x for x in a.arms if x not in ARMS]:
        ap.error(f"unknown arm(s) {unknown}; choose among {list(ARMS)}")
    if a.arms != [x for x in ARMS if x in a.arms]:
        ap.error("--arms must keep the order " + ",".join(ARMS))
    if "override" in a.arms and "on" not in a.arms and a.override_blocks is None:
        ap.error("the override arm needs the on arm or --override-blocks")
    if "override_excess" in a.arms and "on" not in a.arms:
        ap.error("the override_excess arm needs the on arm")
    if a.max_tokens < 1 or a.prompts < 1:
        ap.error("--prompts and --max-tokens must be positive")
    if a.max_tokens + 64 >= a.max_model_len:
        ap.error("--max-model-len must leave room for a prompt")
    return a


# ------------------------------------------------------------ measuring


def gpu_unavailable_reason() -> str | None:
    """Why this cannot run here (None when a CUDA GPU is usable)."""
    try:
        import torch
    except ImportError as err:
        return f"torch is not importable: {err}"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


class PeakSampler:
    """Device memory in use (total - free), its maximum over a window."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def used() -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    def sample(self) -> int:
        used = self.used()
        self.peak = max(self.peak, used)
        return used

    def _run(self) -> None:
        import torch

        torch.cuda.set_device(0)
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "PeakSampler":
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


class Records(logging.Handler):
    """HiSparse reserve lines and warnings, from the engine in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


# --------------------------------------------------------------- engines


def make_model(stage: Path, max_model_len: int) -> Path:
    """The tiny GLM-5-architecture model, its positions covering the length."""
    max_pos = max(max_model_len, 16384)
    path = stage / f"tiny_glm5_pos{max_pos}"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_tiny_glm5.py"), str(path),
                        "--max-pos", str(max_pos)], check=True)
    return path


def engine_kwargs(arm: str, a: argparse.Namespace, model: Path,
                  override: int | None) -> dict:
    kw = dict(
        model=str(model), dtype="bfloat16", kv_cache_dtype="fp8",
        max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        gpu_memory_utilization=a.utilization, seed=0, generation_config="vllm",
        enable_prefix_caching=True, load_format="dummy",
    )
    if arm == "off":
        return kw
    from vllm.config import AttentionConfig
    from vllm.config.hisparse import HiSparseConfig

    kw["attention_config"] = AttentionConfig(hisparse_config=HiSparseConfig(
        host_pool_gib=a.host_pool_gib, device_buffer_size=a.device_buffer_size))
    if override is not None:
        kw["num_gpu_blocks_override"] = override
    return kw


def long_prompts(a: argparse.Namespace) -> list[dict]:
    """Seeded prompts near max_model_len (the same in every arm)."""
    rng = random.Random(SEED)
    longest = a.max_model_len - a.max_tokens - 1
    lengths = [longest - 512 * i for i in range(a.prompts)]
    return [{"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(max(n, 64))]}
            for n in lengths]


def worker_figures(worker) -> dict:
    """What the worker's profile measured (absent under kv_cache_memory_bytes)."""
    names = ("available_kv_cache_memory_bytes", "requested_memory",
             "non_torch_memory", "peak_activation_memory", "cudagraph_memory_estimate")
    out = {n: int(getattr(worker, n)) for n in names if hasattr(worker, n)}
    snapshot = getattr(worker, "init_snapshot", None)
    if snapshot is not None:
        out["init_free_memory"] = int(snapshot.free_memory)
    return out


def engine_figures(llm) -> dict:
    from run_e2e import core

    config = core(llm).scheduler.kv_cache_config
    out = {"num_gpu_blocks": int(config.num_blocks),
           "workers": llm.collective_rpc(worker_figures)}
    layout = getattr(config, "layout", None)
    if layout is not None:
        out["bytes_per_block"] = layout.bytes_per_block
        out["staging_blocks"] = config.staging_blocks
        reserve = config.gpu_reserve
        out["reserve"] = asdict(reserve) | {
            "total": reserve.total, "worker_state": reserve.worker_state,
            "staging_bytes": reserve.staging_bytes}
    return out


def run_arm(arm: str, a: argparse.Namespace, model: Path, override: int | None) -> dict:
    """One engine: start, run the prompts, measure, shut down. The
    ``override_excess`` engine must not start: its refusal is recorded."""
    import torch
    from vllm import LLM, SamplingParams

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rec: dict = {"override": override}
    records = Records()
    logging.getLogger(RESERVE_LOGGER).addHandler(records)
    sampler = PeakSampler()
    rec["used_before"] = base = sampler.used()
    torch_before = torch.cuda.memory_reserved()
    kw = engine_kwargs(arm, a, model, override)
    rec["llm_kwargs"] = {k: str(v) for k, v in kw.items()}
    t0 = time.time()
    llm = None
    try:
        with sampler:
            try:
                llm = LLM(**kw)
            except Exception:  # noqa: BLE001 - the refusal, however vLLM wraps it
                if arm != "override_excess":
                    raise
                rec["refused"] = traceback.format_exc()[-6000:]
                return rec
            rec["init_s"] = round(time.time() - t0, 1)
            if arm == "override_excess":
                rec["engine"] = engine_figures(llm)
                return rec
            rec["used_after_init"] = sampler.sample() - base
            rec["engine"] = engine_figures(llm)
            t1 = time.time()
            sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
            outs = llm.generate(long_prompts(a), sp, use_tqdm=False)
            torch.cuda.synchronize()
            rec["generate_s"] = round(time.time() - t1, 1)
            rec["generated_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
            rec["used_after_run"] = sampler.sample() - base
    except Exception:  # noqa: BLE001 - recorded, the next arm still runs
        rec["error"] = traceback.format_exc()[-6000:]
    finally:
        logging.getLogger(RESERVE_LOGGER).removeHandler(records)
        rec["peak_used"] = sampler.peak - base
        rec["torch_peak_reserved"] = torch.cuda.max_memory_reserved() - torch_before
        rec["reserve_lines"] = [
            m for _, m in records.lines if m.startswith("HiSparse: reserved")]
        rec["reserve_warnings"] = [m for lvl, m in records.lines if lvl == "WARNING"]
        release(llm)
        llm = None  # the last reference: the KV cache goes with it
        gc.collect()
        torch.cuda.empty_cache()
        rec["left_after_shutdown"] = sampler.used() - base
    return rec


def release(llm) -> None:
    """Shut the engine down (or clean up after one that failed to start)."""
    if llm is not None:
        from run_e2e import shutdown

        shutdown(llm)
        return
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


# ---------------------------------------------------------------- checks


def arm_override(arm: str, a: argparse.Namespace, on: dict | None) -> int | None:
    if arm == "override":
        return override_blocks(a, on)
    if arm == "override_excess":
        return excess_blocks(on)
    return None


def override_blocks(a: argparse.Namespace, on: dict | None) -> int | None:
    """The override arm's pool: explicit, or the on arm's less the slack."""
    if a.override_blocks is not None:
        return a.override_blocks
    engine = (on or {}).get("engine")
    if not engine:
        return None
    slack = -(-int(a.override_slack_mib * MiB) // engine["bytes_per_block"])
    return max(engine["num_gpu_blocks"] - slack, 1)


def excess_blocks(on: dict | None) -> int | None:
    """vLLM's own maximum override: the on arm's pool plus its reserve in
    blocks, i.e. the available memory // block bytes."""
    engine = (on or {}).get("engine")
    if not engine:
        return None
    reserve_blocks = -(-engine["reserve"]["total"] // engine["bytes_per_block"])
    return engine["num_gpu_blocks"] + reserve_blocks


def missed_by_old_accounting(rec: dict) -> int:
    """What the accounting before docs/layout.md L17 left out of the budget
    of an engine sized by the profile: all of the reserve but the staging
    blocks."""
    reserve = rec.get("engine", {}).get("reserve")
    return reserve["total"] - reserve["staging_bytes"] if reserve else 0


def budget_checks(arm: str, rec: dict, budget: int, tolerance: int) -> dict[str, bool]:
    """A HiSparse engine that ran: its peaks, its reserve line, its worker."""
    rec["overshoot"] = rec.get("peak_used", 0) - budget
    rec["torch_overshoot"] = rec.get("torch_peak_reserved", 0) - budget
    return {
        f"{arm}_peak_within_budget": rec["overshoot"] <= tolerance,
        f"{arm}_torch_peak_within_budget": rec["torch_overshoot"] <= tolerance,
        f"{arm}_reserve_logged_once": len(rec.get("reserve_lines", [])) == 1,
        f"{arm}_worker_within_reserve": not rec.get("reserve_warnings"),
    }


def evaluate(arms: dict, budget: int, margin: int) -> dict:
    """Overshoots of util x total, the tolerance, and the checks."""
    off = arms.get("off", {})
    off_over = max(off.get("peak_used", 0) - budget, 0) if "peak_used" in off else 0
    tolerance = off_over + margin
    checks: dict[str, bool] = {}
    for arm, rec in arms.items():
        if arm == "override_excess":
            refused = rec.get("refused") or ""
            checks["override_excess_refused"] = (
                f"num_gpu_blocks_override={rec['override']} does not fit" in refused)
            continue
        checks[f"{arm}_ran"] = "error" not in rec and rec.get("generated_tokens", 0) > 0
        if arm == "off":
            rec["overshoot"] = rec.get("peak_used", 0) - budget
            continue
        checks.update(budget_checks(arm, rec, budget, tolerance))
        if arm == "on":
            missed = rec["missed_by_old_accounting"] = missed_by_old_accounting(rec)
            checks["on_check_discriminates"] = missed > margin
        else:
            engine = rec.get("engine", {})
            checks["override_is_the_pool"] = engine.get("num_gpu_blocks") == rec["override"]
    return {"off_overshoot": off_over, "tolerance": tolerance, "checks": checks}


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory.json"
    result: dict = {"command": " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
                    "args": {k: v for k, v in vars(a).items()}}
    reason = gpu_unavailable_reason()
    if reason is not None:
        result["skipped"] = reason
        path.write_text(json.dumps(result, indent=1))
        print(f"memory_check: skipped ({reason})")
        return 0
    import torch
    import vllm

    sys.path.insert(0, str(HERE))  # run_e2e's engine helpers
    t0 = time.time()
    free, total = torch.cuda.mem_get_info()  # also creates this process's context
    budget = int(a.utilization * total)
    result.update(vllm_version=vllm.__version__, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name(0), total_bytes=total,
                  free_at_start=free, budget_bytes=budget, arms={})
    model = make_model(Path(a.stage), a.max_model_len)
    for arm in a.arms:
        override = arm_override(arm, a, result["arms"].get("on"))
        print(time.strftime("%H:%M:%S"), "arm", arm, "override", override, flush=True)
        if arm.startswith("override") and override is None:
            result["arms"][arm] = {"override": None,
                                   "error": "the on arm sized no pool to override"}
        else:
            result["arms"][arm] = run_arm(arm, a, model, override)
        path.write_text(json.dumps(result, indent=1))
    result.update(evaluate(result["arms"], budget, int(a.margin_mib * MiB)))
    result["wall_s"] = round(time.time() - t0, 1)
    result["pass"] = all(result["checks"].values())
    path.write_text(json.dumps(result, indent=1))
    for arm, rec in result["arms"].items():
        print(arm, {k: rec.get(k) for k in ("init_s", "peak_used", "overshoot",
                                            "torch_overshoot", "refused", "error")})
    print("checks", result["checks"], "pass", result["pass"])
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
