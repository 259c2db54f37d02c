# SPDX-License-Identifier: Apache-2.0
"""HiSparse's Prometheus series on a running `vllm serve` (spec 6.5, 2.12;
docs/worker.md "Metrics (C12)").

As a library: ``scrape(port)`` returns every ``vllm:hisparse_*`` series of
``http://127.0.0.1:PORT/metrics`` as {name: value} (summed over the
``engine`` label sets, ``_created`` series dropped; counters keep their
``_total`` suffix).

As a script, ON the GPU host (tiny GLM-5-architecture model of
tests/e2e/run_e2e.py, seeded weights), it starts two HiSparse servers side
by side with the blog's flags (serve_check.py's), sends both the same greedy
requests and compares their series before and after:

- ``pressure``: a GPU pool that cannot hold one request
  (``--num-gpu-blocks-override``): lost pages, lookups, host loads and H2D
  bytes must move;
- ``calm``: vLLM's own pool (thousands of blocks) and a resident window of
  the whole context (``admission_max_tokens = max_model_len``): no request
  ever reads from host, so lookups, H2D bytes, lost pages, hot regions and
  scheduler waits must stay 0 while spills and host usage move (the eager
  mirror copies every sealed page: the control that metrics flow at all).

The worker samples its device counters every STATS_INTERVAL_STEPS steps, so
the requests decode long enough for several samples.

usage: python3 tests/e2e/metrics_check.py --out DIR [--model DIR]
       python3 tests/e2e/metrics_check.py --scrape PORT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PREFIX = "vllm:hisparse_"
PROMPT_LENS = (12000, 5000, 700)
"""Sent one at a time. The 12K prompt cannot stay resident in the
pressure pool (run_e2e's single12k at the same 450 blocks and 2048-token
chunks: 132 lost pages, 19K hot misses on the H200, run 10); run 12 sent
5K, 3K and 0.7K prompts, each of which fits, and nothing moved."""
_LINE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def parse(text: str) -> dict[str, float]:
    """The ``vllm:hisparse_*`` samples of a Prometheus text exposition,
    summed over label sets (one per DP engine)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        match = _LINE.match(line)
        if match is None or match["name"].endswith("_created"):
            continue
        out[match["name"]] = out.get(match["name"], 0.0) + float(match["value"])
    return out


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 10) -> dict[str, float]:
    """Every HiSparse series of a running server's /metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        return parse(r.read().decode())


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(after)}


COUNTERS_UNDER_PRESSURE = (
    "vllm:hisparse_lost_pages_total",
    "vllm:hisparse_lookups_total",
    "vllm:hisparse_l3_lookups_total",
    "vllm:hisparse_host_to_device_bytes_total",
    "vllm:hisparse_spills_completed_total",
)
ZERO_WITHOUT_PRESSURE = (
    "vllm:hisparse_lost_pages_total",
    "vllm:hisparse_hits_total",
    "vllm:hisparse_lookups_total",
    "vllm:hisparse_l3_lookups_total",
    "vllm:hisparse_host_to_device_bytes_total",
    "vllm:hisparse_scheduler_waits_total",
    "vllm:hisparse_admission_backoffs_total",
    "vllm:hisparse_live_hot_regions",
    "vllm:hisparse_staging_blocks_used",
)


def check(arms: dict[str, dict]) -> list[str]:
    """What failed (empty: pass)."""
    failed = []
    pressure, calm = arms["pressure"]["delta"], arms["calm"]["delta"]
    for name in COUNTERS_UNDER_PRESSURE:
        if not pressure.get(name, 0) > 0:
            failed.append(f"pressure: {name} did not move")
    if pressure.get("vllm:hisparse_lookups_total", 0) < pressure.get(
            "vllm:hisparse_l3_lookups_total", 0):
        failed.append("pressure: lookups < l3_lookups")
    for name in ZERO_WITHOUT_PRESSURE:
        if arms["calm"]["after"].get(name, 0) != 0:
            failed.append(f"calm: {name} = {arms['calm']['after'][name]}, not 0")
    if not calm.get("vllm:hisparse_spills_completed_total", 0) > 0:
        failed.append("calm: no spill completed (are the metrics flowing at all?)")
    for arm in arms.values():
        missing = [n for n in ZERO_WITHOUT_PRESSURE if n not in arm["after"]]
        if missing:
            failed.append(f"series missing: {missing}")
    return failed


def main() -> int:
    from run_e2e import MAX_MODEL_LEN
    from serve_check import (
        HISPARSE_FLAGS,
        complete,
        server_command,
        stop_servers,
        wait_ready,
    )

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--scrape", type=int, help="print PORT's HiSparse series and exit")
    ap.add_argument("--model", default=os.path.join(
        os.environ.get("HISPARSE_STAGE", "/root/stage"), "tiny_glm5"))
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args()
    if a.scrape:
        print(json.dumps(scrape(a.scrape), indent=1))
        return 0
    if not a.out:
        ap.error("--out is required")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(a.model)
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_tiny_glm5.py"), str(ckpt)],
                       check=True)
    plugin = str(HERE / "seeded_weights")
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(
                   [plugin] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

    def command(port: int, pressure: bool) -> list[str]:
        cmd = server_command(ckpt, port, hisparse=True)
        if pressure:
            return cmd
        i = cmd.index("--num-gpu-blocks-override")
        del cmd[i:i + 2]
        i = cmd.index("--attention-config")
        cmd[i + 1] = json.dumps({"hisparse_config": {
            "host_pool_gib": 2, "admission_max_tokens": MAX_MODEL_LEN}})
        return cmd

    assert "--num-gpu-blocks-override" in HISPARSE_FLAGS
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    result: dict = {"arms": {}}
    try:
        # One at a time: vLLM sizes its KV cache from the memory the
        # device lost while it profiled, so a second server allocating
        # meanwhile counts against the first (session 23, H200: "-0.45 GiB
        # available for the KV cache" when both started together).
        for name, port, pressure in (("pressure", 8111, True), ("calm", 8112, False)):
            log = open(out / f"metrics_{name}.log", "w")
            cmd = command(port, pressure)
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs[name] = (proc, port)
            result["arms"][name] = {"command": " ".join(cmd)}
            wait_ready(port, proc, a.timeout)
        rng = random.Random(11)
        prompts = [[rng.randrange(2, 8192) for _ in range(n)] for n in PROMPT_LENS]
        for name, (_, port) in procs.items():
            arm = result["arms"][name]
            arm["before"] = scrape(port)
            for prompt in prompts:
                complete(port, str(ckpt), prompt, a.max_tokens)
            time.sleep(2)  # the last step's stats reach the front-end
            arm["after"] = scrape(port)
            arm["delta"] = delta(arm["before"], arm["after"])
        result["failed"] = check(result["arms"])
        result["pass"] = not result["failed"]
    except Exception as err:  # noqa: BLE001 - reported in the result file
        result["error"] = repr(err)
        result["pass"] = False
    finally:
        stop_servers(procs)
    (out / "metrics.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"pass": result["pass"], "failed": result.get("failed"),
                      "error": result.get("error"),
                      **{f"{k}_delta": v.get("delta") for k, v in result["arms"].items()}},
                     indent=1), flush=True)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
