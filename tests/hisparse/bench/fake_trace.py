# SPDX-License-Identifier: Apache-2.0
"""A torch-profiler (kineto) chrome trace of the shape a `vllm serve`
engine writes while its profiler runs, built from a list of steps: the
step annotation vLLM's worker adds (``execute_context_..._generation_...``),
each kernel's CUDA launch (``cuda_runtime``, linked by ``correlation``)
inside the step and the kernel itself on the GPU, later (async: a kernel
may run during the next step's cycle), plus host-to-device copies."""

import gzip
import json
from pathlib import Path


def step(ctx_reqs=0, ctx_tokens=0, gen_reqs=1, gen_tokens=1, cycle_us=1000.0,
         kernels=(), h2d_bytes=0, h2d_us=0.0, sync_us=0.0) -> dict:
    return {"ctx": (ctx_reqs, ctx_tokens), "gen": (gen_reqs, gen_tokens),
            "cycle_us": cycle_us, "kernels": list(kernels), "h2d": (h2d_bytes, h2d_us),
            "sync_us": sync_us}


def make_trace(steps: list[dict], gpu_lag_us: float = 600.0) -> dict:
    """Events for ``steps`` (the last step only closes the window). Every
    kernel runs ``gpu_lag_us`` after its launch: past its step's cycle when
    the lag exceeds it."""
    events = [{"ph": "M", "name": "process_name", "args": {"name": "engine"}}]
    corr, ts = 0, 1000.0
    for s in steps:
        ctx, gen = s["ctx"], s["gen"]
        events.append({"ph": "X", "cat": "user_annotation", "ts": ts,
                       "dur": s["cycle_us"] * 0.6, "pid": 1, "tid": 1,
                       "name": f"execute_context_{ctx[0]}({ctx[1]})"
                               f"_generation_{gen[0]}({gen[1]})"})
        launch = ts + 5.0
        gpu_t = launch + gpu_lag_us
        work = [(name, dur, "kernel") for name, dur in s["kernels"]]
        if s["h2d"][0]:
            work.append(("Memcpy HtoD (Pinned -> Device)", s["h2d"][1], "gpu_memcpy"))
        for name, dur, cat in work:
            corr += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                           "ts": launch, "dur": 3.0, "pid": 1, "tid": 1,
                           "args": {"correlation": corr}})
            args = {"correlation": corr}
            if cat == "gpu_memcpy":
                args["bytes"] = s["h2d"][0]
            events.append({"ph": "X", "cat": cat, "name": name, "ts": gpu_t, "dur": dur,
                           "pid": 0, "tid": 7, "args": args})
            launch += 4.0
            gpu_t += dur
        if s["sync_us"]:  # the host waits for the device (no kernel of its own)
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize",
                           "ts": launch, "dur": s["sync_us"], "pid": 1, "tid": 1,
                           "args": {"correlation": 10**6 + corr}})
        ts += s["cycle_us"]
    return {"schemaVersion": 1, "traceEvents": events}


def write_trace(path: Path, steps: list[dict], **kw) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(make_trace(steps, **kw), f)
    return path


def serving_steps(n: int = 40) -> list[dict]:
    """A level's window: decode steps with HiSparse's kernels, every fifth
    step with a prefill chunk beside."""
    out = []
    for i in range(n):
        kernels = [("flash_mla_sparse_fwd_kernel", 120.0), ("nvjet_tst_gemm", 200.0),
                   ("resolve_residency_kernel<4>", 10.0), ("gather_plan_kernel", 5.0)]
        if i % 5 == 4:
            out.append(step(ctx_reqs=1, ctx_tokens=2048, gen_reqs=6, gen_tokens=6,
                            cycle_us=9000.0, kernels=kernels + [("sm90_xmma_gemm", 3000.0)],
                            h2d_bytes=1 << 20, h2d_us=50.0, sync_us=300.0))
        else:
            out.append(step(gen_reqs=7, gen_tokens=7, cycle_us=4000.0, kernels=kernels,
                            h2d_bytes=1 << 20, h2d_us=50.0))
    return out
