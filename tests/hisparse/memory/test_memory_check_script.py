# SPDX-License-Identifier: Apache-2.0
"""tests/e2e/memory_check.py on CPU: it imports nothing GPU-specific at
module level, parses its arguments, skips cleanly (rc 0) without a GPU, and
its pass/fail arithmetic holds the HiSparse engines to the HiSparse-off
overshoot plus the margin (docs/layout.md L17)."""

import ast
import importlib.util
import json
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "e2e" / "memory_check.py"
MiB = 1 << 20


@pytest.fixture(scope="module")
def script():
    """The script as a module; the environment defaults it sets for its own
    process (in-process engines, offline hub) do not leak into this one."""
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location("memory_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def test_module_level_imports_are_cpu_only():
    tree = ast.parse(SCRIPT.read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add((node.module or "").split(".")[0])
    assert not top & {"torch", "vllm", "run_e2e", "numpy"}, top


def test_defaults(script):
    a = script.parse_args(["--out", "x"])
    assert a.utilization == 0.9
    assert a.max_model_len == 65536
    assert a.arms == ["off", "on", "override", "override_excess"]
    assert a.override_blocks is None
    assert a.margin_mib == 32.0


@pytest.mark.parametrize("argv", [
    ["--utilization", "0"], ["--utilization", "1.5"], ["--arms", "on,bogus"],
    ["--arms", "on,off"], ["--arms", "override"], ["--arms", "off,override_excess"],
    ["--max-tokens", "0"],
    ["--max-model-len", "64"],
])
def test_bad_arguments_are_refused(script, argv):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--out", "x", *argv])
    assert exit_info.value.code == 2


def test_an_explicit_override_runs_alone(script):
    a = script.parse_args(["--out", "x", "--arms", "override", "--override-blocks", "9"])
    assert script.override_blocks(a, None) == 9


def test_override_is_the_on_pool_less_the_slack(script):
    a = script.parse_args(["--out", "x"])
    on = {"engine": {"num_gpu_blocks": 10_000, "bytes_per_block": 1 << 20}}
    assert script.override_blocks(a, on) == 10_000 - 64
    assert script.override_blocks(a, {"error": "x"}) is None


def test_skips_without_a_gpu(script, tmp_path, monkeypatch):
    monkeypatch.setattr(script, "gpu_unavailable_reason", lambda: "no CUDA GPU")
    assert script.main(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "memory.json").read_text())
    assert result["skipped"] == "no CUDA GPU"
    assert result["args"]["utilization"] == 0.9


def arm(peak, torch_peak=None, reserve_total=300 * MiB, staging=50 * MiB, **extra):
    return {"peak_used": peak, "torch_peak_reserved": torch_peak or peak,
            "generated_tokens": 64, "reserve_lines": ["HiSparse: reserved ..."],
            "reserve_warnings": [],
            "engine": {"num_gpu_blocks": 5, "reserve": {
                "total": reserve_total, "staging_bytes": staging}}, **extra}


def test_evaluate_holds_hisparse_to_the_off_overshoot(script):
    budget, margin = 1000 * MiB, 32 * MiB
    arms = {"off": {"peak_used": budget + 100 * MiB, "torch_peak_reserved": budget,
                    "generated_tokens": 64},
            "on": arm(budget + 120 * MiB),
            "override": arm(budget + 130 * MiB, override=5)}
    result = script.evaluate(arms, budget, margin)
    assert result["tolerance"] == 132 * MiB
    assert all(result["checks"].values()), result["checks"]
    assert arms["on"]["missed_by_old_accounting"] == 250 * MiB

    arms["on"] = arm(budget + 133 * MiB)
    assert not script.evaluate(arms, budget, margin)["checks"]["on_peak_within_budget"]


def test_evaluate_flags_an_insensitive_run_and_a_wrong_pool(script):
    budget, margin = 1000 * MiB, 32 * MiB
    arms = {"on": arm(budget, reserve_total=60 * MiB, staging=40 * MiB),
            "override": arm(budget, override=6)}
    checks = script.evaluate(arms, budget, margin)["checks"]
    assert not checks["on_check_discriminates"]
    assert not checks["override_is_the_pool"]
    assert checks["on_peak_within_budget"]


def test_the_excess_override_is_vllms_own_maximum(script):
    """The on pool plus the reserve in whole blocks (what stock arithmetic,
    available // block bytes, would allow): it must be refused."""
    on = {"engine": {"num_gpu_blocks": 1000, "bytes_per_block": 1 << 20,
                     "reserve": {"total": 205 * MiB + 1}}}
    assert script.excess_blocks(on) == 1000 + 206
    assert script.arm_override("override_excess", script.parse_args(["--out", "x"]),
                               on) == 1206
    arms = {"override_excess": {"override": 1206, "refused": (
        "HiSparse: num_gpu_blocks_override=1206 does not fit the 0.98 GiB ...")}}
    assert script.evaluate(arms, 1 << 30, 0)["checks"] == {"override_excess_refused": True}
    arms["override_excess"]["refused"] = None
    assert script.evaluate(arms, 1 << 30, 0)["checks"] == {"override_excess_refused": False}
