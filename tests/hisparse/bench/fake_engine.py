# SPDX-License-Identifier: Apache-2.0
"""A stand-in for benchlib.engine_worker (bench-tax's engine process) with
the same protocol: the spec line, a ready reply, one reply per command.
Times are computed, not measured: decode step = (0.5 + 0.1 x batch) ms x
layers / 4, x 1.5 with HiSparse (x 1.4 lazy), + 1% with the connector,
upstream x 1.8; each sample's call order is logged to FAKE_ENGINE_LOG.

FAKE_ENGINE_FAIL=<substring of a key>: that engine fails to start.
FAKE_ENGINE_STEP_MS=1: samples carry step_ms (the true step), while the
first sample's short generation of every engine takes 0.5 s longer (run
5's first timed generation after a prefill), which only the totals see.
FAKE_ENGINE_SLOW_CPUS=<core list, e.g. "1">: an engine pinned to exactly
these cores (BENCH_TAX_CPUS at start, then the "pin" op) steps 1.3x slower,
whatever its arm (a slow core set).
FAKE_ENGINE_MISSES=1: HiSparse engines count hot-buffer misses.
FAKE_ENGINE_SLOW_SAMPLES=<arm>:<i,j,...>: that arm's engines (key ending in
/<arm>) step 1.5x slower in their samples i, j, ... (0-based): the VM's
slow mode, sample by sample.
"""

import json
import os
import sys


def step_ms(spec: dict, batch: int) -> float:
    kw = spec["kwargs"]
    layers = int(kw["model"].rsplit("_L", 1)[1])
    ms = (0.5 + 0.1 * batch) * layers / 4
    hs = (kw.get("attention_config") or {}).get("hisparse_config")
    if hs is not None:
        ms *= 1.5 if hs.get("eager_host_mirror", True) else 1.4
    if spec["vllm"] == "upstream" and kw.get("kv_transfer_config"):
        ms *= 1.8
    elif kw.get("kv_transfer_config"):
        ms *= 1.01
    return ms


def _lifecycle(key: str, what: str) -> None:
    """Engine starts and stops, in order, to FAKE_ENGINE_STARTS."""
    if os.environ.get("FAKE_ENGINE_STARTS"):
        with open(os.environ["FAKE_ENGINE_STARTS"], "a") as f:
            f.write(f"{key} {what}\n")


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    key = spec["key"]
    out = sys.stdout
    fail = os.environ.get("FAKE_ENGINE_FAIL")
    if fail and fail in key:
        out.write(json.dumps({"ok": False, "error": "Traceback...\nRuntimeError: no GPU"}) + "\n")
        out.flush()
        return 1
    _lifecycle(key, "start")
    out.write(json.dumps({"ok": True, "init_s": 0.1, "versions": {"vllm": "fake", "torch": "x"},
                          "defaults": {"cudagraph_mode": "fake"}}) + "\n")
    out.flush()
    hisparse = "hisparse_config" in (spec["kwargs"].get("attention_config") or {})
    misses = 0
    samples_done = 0
    cpus = os.environ.get("BENCH_TAX_CPUS", "")
    slow = os.environ.get("FAKE_ENGINE_SLOW_CPUS")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "prepare":
            reply = {"warmup_s": 0.01}
        elif op == "pin":
            cpus = ",".join(map(str, sorted(cmd["cpus"])))
            reply = {"cpus": sorted(cmd["cpus"]), "threads_moved": 3}
        elif op == "sample":
            ms = step_ms(spec, cmd["batch"]) * (1.3 if slow and cpus == slow else 1.0)
            arm, _, which = os.environ.get("FAKE_ENGINE_SLOW_SAMPLES", "").partition(":")
            if arm and key.endswith("/" + arm) and str(samples_done) in which.split(","):
                ms *= 1.5
            t_short = 0.05 + cmd["m"] * ms / 1e3
            t_long = t_short + cmd["n"] * ms / 1e3
            step_clock = os.environ.get("FAKE_ENGINE_STEP_MS") == "1"
            if step_clock and not samples_done:
                t_short += 0.5
            samples_done += 1
            busy = 1.3 if hisparse else 1.0  # CPU seconds per wall second, computed
            gc = 0.02 if hisparse else 0.01  # collector pauses per wall second
            reply = {"t_short_s": t_short, "t_long_s": t_long, "cpu_short_s": busy * t_short,
                     "cpu_long_s": busy * t_long, "threads": [3, 40],
                     "gc_short_s": gc * t_short, "gc_long_s": gc * t_long,
                     "gc_collections": {"0": 5, "1": 0, "2": 0},
                     **({"step_ms": ms, "step_count": cmd["n"],
                         "steady": {"mean_ms": ms, "median_ms": ms, "count": cmd["n"] - 1,
                                    "stalls": 0, "stall_ms": 0.0}} if step_clock else {}),
                     "busy_threads": [{"thread": "1/1", "name": "python", "cpu_s": t_long}],
                     # a process that runs slower: the same fixed work takes longer
                     "probe": {"python_us": 1000.0 * (1.25 if hisparse else 1.0),
                               "launch_us": 400.0}}
            if os.environ.get("FAKE_ENGINE_LOG"):
                with open(os.environ["FAKE_ENGINE_LOG"], "a") as f:
                    f.write(f"{key} {cmd['batch']}\n")
            if hisparse and os.environ.get("FAKE_ENGINE_MISSES"):
                misses += 10
        elif op == "profile":
            ms = step_ms(spec, cmd["batch"])

            def events(k):
                return [{"name": "cudaGraphLaunch", "device": "cpu", "count": k},
                        {"name": "cudaLaunchKernel", "device": "cpu",
                         "count": (12 if hisparse else 2) * k},
                        {"name": "cudaMemcpyAsync", "device": "cpu", "count": 3 * k},
                        {"name": "attn_kernel", "device": "cuda", "count": 4 * k,
                         "self_device_us": k * ms * 1000 * 0.8}]
            def stages(k):  # the stage clock: HiSparse's start_step 40 us a step
                out = {"Scheduler.schedule": {"us": 100.0 * k, "calls": k}}
                if hisparse:
                    out["HiSparseWorker.start_step"] = {"us": 40.0 * k, "calls": k}
                return out

            reply = {"short": events(cmd["m"]), "long": events(cmd["m"] + cmd["n"]),
                     "stages": {"short": stages(cmd["m"]),
                                "long": stages(cmd["m"] + cmd["n"]), "absent": []}}
        elif op == "counters":
            reply = {"misses": misses, "lost_pages": 0, "hot_regions_assigned": 0} \
                if hisparse and spec["vllm"] == "ours" else {}
        elif op == "shutdown":
            _lifecycle(key, "stop")
            out.write(json.dumps({"ok": True}) + "\n")
            out.flush()
            return 0
        else:
            reply = None
        out.write(json.dumps({"ok": True, **reply} if reply is not None else
                             {"ok": False, "error": f"unknown op {op}"}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
