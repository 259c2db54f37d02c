# SPDX-License-Identifier: Apache-2.0
"""bench-agentic's PNGs, from its JSON (matplotlib is imported on use: the
GPU image has it; elsewhere ``pip install matplotlib``).

  bench-agentic-throughput.png  throughput vs interactivity: per arm, one
                                point per concurrency level, x = output
                                tokens/s per user (1000 / TPOT p50), y =
                                output tokens/s of the server
  bench-agentic-running.png     running requests over time, one panel per
                                concurrency level, one line per arm
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

THROUGHPUT_PNG = "bench-agentic-throughput.png"
RUNNING_PNG = "bench-agentic-running.png"
COLORS = {"plain": "tab:gray", "offload": "tab:blue", "hisparse": "tab:red",
          "hisparse_pf": "tab:orange", "hisparse_nobackoff": "tab:purple",
          "plain_ample": "tab:brown",
          "upstream": "tab:green"}


def throughput_points(report: Mapping) -> dict[str, list[tuple[float, float, int]]]:
    """arm -> [(tokens/s per user, output tokens/s, concurrency)], by
    concurrency; levels without both figures are left out."""
    out: dict[str, list] = {}
    for lv in report.get("levels", []):
        client = lv.get("client") or {}
        tpot, tok_s = client.get("tpot_ms_p50"), client.get("output_tokens_per_s")
        if tpot and tok_s:
            out.setdefault(lv["arm"], []).append((1000.0 / tpot, tok_s, int(lv["concurrency"])))
    return {a: sorted(v, key=lambda p: p[2]) for a, v in out.items()}


def running_panels(report: Mapping) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """concurrency -> arm -> [(seconds, running requests)]."""
    out: dict[int, dict] = {}
    for lv in report.get("levels", []):
        pts = [(p[0], p[1]) for p in lv.get("series") or [] if p[1] is not None]
        if pts:
            out.setdefault(int(lv["concurrency"]), {})[lv["arm"]] = pts
    return dict(sorted(out.items()))


def render(report: Mapping, out_dir: Path) -> list[Path]:
    """Both PNGs into ``out_dir``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    title = _title(report)

    fig, ax = plt.subplots(figsize=(7, 5))
    for arm, pts in throughput_points(report).items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if "@" not in arm else "s--",
                label=arm, color=_color(arm))
        for x, y, c in pts:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xlabel("interactivity: output tokens/s per user (1000 / TPOT p50)")
    ax.set_ylabel("output tokens/s (all users)")
    ax.set_title(f"throughput vs interactivity\n{title}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / THROUGHPUT_PNG
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    panels = running_panels(report)
    n = max(1, len(panels))
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.6 * n), squeeze=False)
    for ax, (c, arms) in zip(axes[:, 0], panels.items()):
        for arm, pts in arms.items():
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=arm,
                    color=_color(arm), linestyle="-" if "@" not in arm else "--")
        ax.axhline(c, color="black", linestyle=":", linewidth=0.8)
        ax.set_ylabel("running")
        ax.set_title(f"concurrency {c}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the level started")
    fig.suptitle(f"running requests over time\n{title}", fontsize=9)
    fig.tight_layout()
    path = out_dir / RUNNING_PNG
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def _color(arm: str) -> str | None:
    """A capped arm (``hisparse@6``) takes its base arm's color."""
    return COLORS.get(arm.partition("@")[0])


def _title(report: Mapping) -> str:
    cfg = report.get("config") or {}
    shape = (report.get("workload") or {}).get("shape") or {}
    parts = []
    if shape:
        parts.append(f"{shape.get('turns')} turns, first {shape.get('first')}, "
                     f"later {shape.get('later')}, out {shape.get('output')} tokens")
    if cfg.get("kv_bytes"):
        parts.append(f"GPU KV {cfg['kv_bytes'] / (1 << 20):.0f} MiB")
    return "; ".join(parts)
