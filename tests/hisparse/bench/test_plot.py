# SPDX-License-Identifier: Apache-2.0
"""benchlib.plot: what the PNGs show, from a sample bench-agentic JSON;
rendering itself where matplotlib is installed (the GPU image has it)."""

import json

import pytest
from benchlib import plot

REPORT = {
    "config": {"kv_bytes": 128 << 20},
    "workload": {"shape": {"turns": 13, "first": 9250, "later": 94, "output": 220}},
    "levels": [
        {"arm": "plain", "concurrency": 16, "client": {"tpot_ms_p50": 20.0,
                                                       "output_tokens_per_s": 400.0},
         "series": [[0.0, 3, 9], [0.5, 4, 8], [1.0, 2, None]]},
        {"arm": "plain", "concurrency": 4, "client": {"tpot_ms_p50": 5.0,
                                                      "output_tokens_per_s": 300.0},
         "series": [[0.0, 4, 0]]},
        {"arm": "hisparse", "concurrency": 16, "client": {"tpot_ms_p50": 8.0,
                                                          "output_tokens_per_s": 1600.0},
         "series": [[0.0, 16, 0], [0.5, None, 0]]},
        {"arm": "offload", "concurrency": 16, "status": "timeout", "client": {},
         "series": []},
    ],
}


def test_throughput_points_by_arm_and_concurrency():
    pts = plot.throughput_points(REPORT)
    assert pts == {"plain": [(200.0, 300.0, 4), (50.0, 400.0, 16)],
                   "hisparse": [(125.0, 1600.0, 16)]}  # no TPOT: no point


def test_running_panels():
    panels = plot.running_panels(REPORT)
    assert list(panels) == [4, 16]
    assert panels[16] == {"plain": [(0.0, 3), (0.5, 4), (1.0, 2)], "hisparse": [(0.0, 16)]}


def test_render_writes_two_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plot.render(json.loads(json.dumps(REPORT)), tmp_path)
    assert [p.name for p in paths] == [plot.THROUGHPUT_PNG, plot.RUNNING_PNG]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_render_of_an_empty_report(tmp_path):
    pytest.importorskip("matplotlib")
    assert len(plot.render({"levels": []}, tmp_path)) == 2
