# SPDX-License-Identifier: Apache-2.0
"""Where a serving step's time goes: a summary of one torch-profiler trace
of a ``vllm serve`` engine (bench-agentic ``--profile-level``).

vLLM's worker wraps each step's ``execute_model`` in an annotation named
``execute_context_<reqs>(<tokens>)_generation_<reqs>(<tokens>)`` while its
profiler runs (``Worker.annotate_profile``): the step's prefill (context)
and decode (generation) work. A step's *cycle* is the time from its
annotation's start to the next step's: everything the engine does for one
step (schedule, inputs, forward, sampling, output), i.e. a running
request's time per output token in a decode step. GPU work is attributed
to the step whose cycle holds its *launch* (the CUDA runtime call linked to
the kernel by kineto's correlation id; a CUDA graph's kernels link to the
graph launch), so async scheduling's overlap does not smear it over the
next step. Steps are summarized by kind: ``decode`` (no prefill), ``mixed``
(prefill chunks beside decodes), ``prefill`` (no decode).

Standard library only (the CPU tests import it; the GPU host summarizes
its own trace and keeps the summary, not the tens of MiB of trace).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from statistics import median

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")

# First match wins; lower-cased substrings of the kernel's name.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hisparse", ("resolve_residency", "gather_compact", "gather_ordered", "gather_plan",
                  "invalidate_kernel", "mirror_descriptors", "copy_descriptors",
                  "order_plan", "order_step")),
    ("indexer", ("mqa_logits", "topk", "top_k", "indexer")),
    ("attention", ("flash_mla", "flashmla", "sparse_attn", "fmha", "mla", "attention",
                   "flash_fwd")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
    ("fused", ("triton_",)),
)
COPY_CATS = ("gpu_memcpy", "gpu_memset")
KERNEL_CAT = "kernel"
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
KINDS = ("decode", "mixed", "prefill")


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def load(path: Path) -> list[dict]:
    """The trace's complete ("X") events."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def _copy_name(e: Mapping) -> str:
    """Memcpy direction (kineto: "Memcpy HtoD (Pinned -> Device)")."""
    name = e.get("name", "")
    for d in ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP"):
        if d in name:
            return f"memcpy_{d}"
    return "memset" if e.get("cat") == "gpu_memset" else "memcpy"


def steps_of(events: Iterable[Mapping]) -> list[dict]:
    """The step annotations in start order, each with its cycle (to the
    next step's start; the last step has none and only bounds the window)."""
    steps = []
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        m = STEP.fullmatch(e.get("name", ""))
        if m is None:
            continue
        ctx_reqs, ctx_tokens, gen_reqs, gen_tokens = map(int, m.groups())
        steps.append({"ts": float(e["ts"]), "dur": float(e.get("dur", 0.0)),
                      "ctx_reqs": ctx_reqs, "ctx_tokens": ctx_tokens,
                      "gen_reqs": gen_reqs, "gen_tokens": gen_tokens})
    steps.sort(key=lambda s: s["ts"])
    for a, b in zip(steps, steps[1:]):
        a["cycle_us"] = b["ts"] - a["ts"]
    for s in steps:
        s["kind"] = ("decode" if s["ctx_reqs"] == 0 else
                     "prefill" if s["gen_reqs"] == 0 else "mixed")
    return steps


def _step_index(starts: list[float], ts: float) -> int | None:
    """The step whose cycle holds ``ts`` (None before the first start or
    after the last cycle ends)."""
    lo, hi = 0, len(starts) - 1
    if not starts or ts < starts[0] or ts >= starts[-1]:
        return None
    while lo < hi:  # last start <= ts
        mid = (lo + hi + 1) // 2
        if starts[mid] <= ts:
            lo = mid
        else:
            hi = mid - 1
    return lo


def attribute(events: list[Mapping], steps: list[dict]) -> dict:
    """GPU time (us) and copy bytes per step and category, by launch time.
    Returns the GPU work nobody launched inside a cycle under ``unattributed``."""
    starts = [s["ts"] for s in steps]
    launch_ts: dict[int, float] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch_ts[corr] = float(e["ts"])
    for s in steps:
        s["gpu_us"] = defaultdict(float)
        s["copy_bytes"] = defaultdict(int)
        s["runtime_calls"] = 0
        s["sync_us"] = 0.0
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:  # host side: CUDA API calls per step, the waiting ones apart
        if e.get("cat") not in LAUNCH_CATS:
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0.0))
        r = runtime[name]
        r[0] += dur
        r[1] += 1
        i = _step_index(starts, float(e["ts"]))
        if i is not None:
            steps[i]["runtime_calls"] += 1
            if is_sync(name):
                steps[i]["sync_us"] += dur
    unattributed = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        cat = e.get("cat")
        if cat == KERNEL_CAT:
            key = category(e.get("name", ""))
            k = kernels[e.get("name", "")]
            k[0] += float(e.get("dur", 0.0))
            k[1] += 1
        elif cat in COPY_CATS:
            key = _copy_name(e)
        else:
            continue
        corr = (e.get("args") or {}).get("correlation")
        at = launch_ts.get(corr, float(e["ts"]))
        i = _step_index(starts, at)
        dur = float(e.get("dur", 0.0))
        if i is None:
            unattributed[key] += dur
            continue
        steps[i]["gpu_us"][key] += dur
        if cat in COPY_CATS:
            steps[i]["copy_bytes"][key] += int((e.get("args") or {}).get("bytes", 0))
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    top_rt = sorted(runtime.items(), key=lambda kv: -kv[1][0])[:10]
    return {"unattributed_us": {k: round(v, 1) for k, v in unattributed.items()},
            "top_kernels": [{"name": n[:120], "category": category(n), "total_us": round(t, 1),
                             "count": c} for n, (t, c) in top],
            "top_runtime_calls": [{"name": n, "total_us": round(t, 1), "count": c,
                                   "sync": is_sync(n)} for n, (t, c) in top_rt]}


def is_sync(name: str) -> bool:
    """A CUDA API call that blocks the host on the device (a synchronize,
    or a synchronous memcpy)."""
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpy")


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def summarize_steps(steps: list[dict]) -> dict:
    """Per step kind: count, share of the window, cycle (mean, median),
    batch (decode requests, prefill tokens), GPU time per category, the GPU's
    busy share of the cycle and copy bytes; the whole window's decode tokens/s."""
    timed = [s for s in steps if "cycle_us" in s]
    window = sum(s["cycle_us"] for s in timed)
    out: dict = {"steps": len(timed), "window_ms": round(window / 1e3, 2)}
    if not timed:
        return out
    out["generation_tokens_per_s"] = round(sum(s["gen_tokens"] for s in timed) / window * 1e6, 1)
    kinds = {}
    for kind in KINDS:
        sel = [s for s in timed if s["kind"] == kind]
        if not sel:
            continue
        n = len(sel)
        cats = sorted({c for s in sel for c in s["gpu_us"]})
        gpu = {c: round(sum(s["gpu_us"].get(c, 0.0) for s in sel) / n, 2) for c in cats}
        kernel_us = [sum(v for c, v in s["gpu_us"].items() if not c.startswith("mem"))
                     for s in sel]
        cycles = [s["cycle_us"] for s in sel]
        copy = sorted({c for s in sel for c in s["copy_bytes"]})
        kinds[kind] = {
            "steps": n,
            "share_of_window": round(sum(cycles) / window, 4),
            "cycle_us_mean": _mean(cycles),
            "cycle_us_median": round(median(cycles), 2),
            "execute_model_us_mean": _mean([s["dur"] for s in sel]),
            "decode_reqs_mean": _mean([s["gen_reqs"] for s in sel]),
            "prefill_reqs_mean": _mean([s["ctx_reqs"] for s in sel]),
            "prefill_tokens_mean": _mean([s["ctx_tokens"] for s in sel]),
            "gpu_us_per_step": gpu,
            "kernel_us_per_step": _mean(kernel_us),
            "cuda_api_calls_per_step": _mean([s["runtime_calls"] for s in sel]),
            "host_sync_us_per_step": _mean([s["sync_us"] for s in sel]),
            "gpu_busy_share": round(sum(kernel_us) / sum(cycles), 4) if sum(cycles) else None,
            "copy_bytes_per_step": {c: round(sum(s["copy_bytes"].get(c, 0) for s in sel) / n)
                                    for c in copy},
        }
    out["by_kind"] = kinds
    return out


def summarize(path: Path) -> dict:
    """One trace file's summary (see the module docstring)."""
    events = load(path)
    steps = steps_of(events)
    extra = attribute(events, steps)
    return {"trace": Path(path).name, **summarize_steps(steps), **extra,
            "note": "per step kind: cycle = start to the next step's start (the engine's "
                    "whole step); GPU time by launch; profiler overhead inflates host time"}


def table(summaries: Mapping[str, Mapping]) -> str:
    """Markdown rows, one per (arm, step kind): the figures a reader
    compares across arms (``summaries``: arm -> ``summarize`` output)."""
    cats = ("hisparse", "indexer", "attention", "gemm", "fused", "other", "memcpy_HtoD")
    head = ["arm", "kind", "steps", "share", "cycle us (median)", "decode reqs",
            "prefill tokens", *[f"{c} us" for c in cats], "GPU busy", "CUDA calls", "host sync us"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, s in summaries.items():
        for kind, k in (s.get("by_kind") or {}).items():
            gpu = k["gpu_us_per_step"]
            rows.append("| " + " | ".join(str(x) for x in [
                arm, kind, k["steps"], f"{k['share_of_window']:.2f}",
                f"{k['cycle_us_median']:.0f}", f"{k['decode_reqs_mean']:.1f}",
                f"{k['prefill_tokens_mean']:.0f}",
                *[f"{gpu.get(c, 0.0):.0f}" for c in cats],
                f"{k['gpu_busy_share']:.2f}" if k["gpu_busy_share"] is not None else "-",
                f"{k['cuda_api_calls_per_step']:.0f}", f"{k['host_sync_us_per_step']:.0f}"])
                + " |")
    return "\n".join(rows)


def find_traces(folder: Path) -> list[Path]:
    """The engine's trace files under ``folder`` (the tensorboard handler's
    ``*.pt.trace.json[.gz]``), oldest first."""
    found = [p for p in Path(folder).rglob("*.pt.trace.json*") if p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


__all__ = ["CATEGORIES", "attribute", "category", "find_traces", "is_sync", "load", "steps_of",
           "summarize", "summarize_steps", "table"]
