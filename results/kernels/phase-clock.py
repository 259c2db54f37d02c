#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where one resolver launch spends its time, per phase (GPU machine).

Needs a build with ``--define HISPARSE_PHASE_CLOCK=1`` loaded through
HISPARSE_OPS_LIBRARY: thread 0 of every CTA then prints the clock64()
cycles between the block barriers (start | classify | scan | reorder |
assign | emit). This script builds the bench's batch-64 layout
(scripts/bench-kernels: top_k 2048, hot 2x), warms each scenario up, runs
one launch and summarises the printed cycles over the CTAs.

usage: phase-clock.py OUT.txt   (repo root; PYTHONPATH as for the bench)
"""

import os
import re
import statistics
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ("start", "classify", "scan", "reorder", "assign", "emit", "total")


def run_child() -> None:
    import torch
    bench = SourceFileLoader("bench_kernels",
                             str(REPO / "scripts/bench-kernels")).load_module()
    args = bench.parse_args(["--batches", "64"])
    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(0)
    n_host_blocks = int(args.pool_gib * 2**30) // (bench.ROW_BYTES
                                                   * bench.BLOCK)
    layout = bench.Layout(64, args, n_host_blocks, device, gen)
    resolve = bench.KERNELS.resolve_residency
    for scenario in ("all_hit", "miss_10"):
        dgi, lru = bench.KERNELS.new_hot_state(64, layout.H, device)
        out = layout.outputs(device)
        topks = layout.topk_steps(scenario, bench.WARM + 2)
        bench.run_steps(resolve, layout, scenario, topks[:bench.WARM + 1],
                        dgi, lru, out)
        torch.cuda.synchronize()
        print(f"=== {scenario}", flush=True)
        resolve(*layout.args(scenario, topks[-1], dgi, lru, out),
                **layout.kwargs())
        torch.cuda.synchronize()
        print("=== end", flush=True)


def summarise(text: str, clock_ghz: float) -> str:
    lines, scenario, rows = [], None, {}
    for line in text.splitlines():
        if line.startswith("=== ") and line != "=== end":
            scenario = line[4:]
            rows[scenario] = []
        elif line == "=== end":
            scenario = None
        elif scenario and line.startswith("phase_clock"):
            vals = dict(re.findall(r"(\w+) (-?\d+)", line))
            rows[scenario].append([int(vals[p]) for p in PHASES])
    lines.append(f"cycles -> us at {clock_ghz} GHz; median / max over CTAs")
    lines.append("scenario  " + " ".join(f"{p:>15s}" for p in PHASES))
    for scenario, data in rows.items():
        if not data:
            continue
        cells = []
        for i in range(len(PHASES)):
            col = [r[i] for r in data]
            cells.append(f"{statistics.median(col) / clock_ghz / 1e3:6.2f}/"
                         f"{max(col) / clock_ghz / 1e3:6.2f}us")
        lines.append(f"{scenario:9s} " + " ".join(f"{c:>15s}" for c in cells)
                     + f"  ({len(data)} CTAs)")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child()
        return
    out = Path(sys.argv[1])
    res = subprocess.run([sys.executable, __file__, "--child"],
                         capture_output=True, text=True, timeout=50,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    text = res.stdout + res.stderr
    ghz = float(os.environ.get("SM_CLOCK_GHZ", "1.98"))
    summary = summarise(res.stdout, ghz)
    out.write_text(summary + "\n\n--- raw (exit %d)\n" % res.returncode
                   + text)
    print(summary)


if __name__ == "__main__":
    main()
