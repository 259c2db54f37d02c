# SPDX-License-Identifier: Apache-2.0
"""scripts/bench-tax end to end on the CPU: the real command (arguments,
engine processes, the JSON-lines protocol, alternation, budget, profiles,
counters, the report, --merge) with a stand-in engine process
(fake_engine.py) whose step times are computed, not measured."""

import json
import sys
from pathlib import Path

import pytest
from benchlib import common, tax

HERE = Path(__file__).resolve().parent


@pytest.fixture
def tax_cmd(bench_tax, monkeypatch, tmp_path):
    monkeypatch.setattr(common, "has_gpu", lambda: True)

    def model(path, layers, max_pos, python=sys.executable, index_topk_freq=1):
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)

    monkeypatch.setattr(common, "ensure_model", model)
    monkeypatch.setattr(bench_tax.Run, "worker_command", [sys.executable, str(HERE / "fake_engine.py")])
    calls = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_ENGINE_LOG", str(calls))

    def run(*args: str) -> tuple[int, dict, list[str]]:
        out = tmp_path / "out"
        rc = bench_tax.main(["--out", str(out), "--work", str(tmp_path / "work"), *args])
        rep = json.loads((out / "bench-tax.json").read_text())
        return rc, rep, calls.read_text().split("\n")[:-1] if calls.exists() else []

    return run


def test_full_run(tax_cmd, tmp_path):
    rc, rep, calls = tax_cmd("--arms", "off,on,on_offload,on_lazy", "--modes", "default,fdo",
                             "--layers", "4,32", "--batches", "1,16", "--reps", "4",
                             "--profile", "--profile-batches", "16")
    assert rc == 0 and rep["failures"] == []
    assert len(rep["samples"]) == 2 * 2 * 2 * 4 * 4
    assert rep["command"].startswith("scripts/bench-tax --out ")
    # the arms alternate: the order of the engines' sample calls rotates
    first = [ln.split()[0].rsplit("/", 1)[1] for ln in calls[:8]]
    assert first == ["off", "on", "on_offload", "on_lazy", "on", "on_offload", "on_lazy", "off"]
    cell = rep["summary"]["fdo"]["4"]["16"]
    assert cell["ratios"]["on/off"]["ratio_of_medians"] == pytest.approx(1.5)
    # the engines' CPU time per step beside the wall time (the stand-in's
    # HiSparse arms burn 1.3 cores per stepping one)
    assert cell["cpu"]["off"]["busy_cores"] == pytest.approx(1.0)
    assert cell["cpu"]["on"]["busy_cores"] == pytest.approx(1.3)
    assert rep["samples"][0]["threads"] == [3, 40]
    assert cell["ratios"]["on_offload/on"]["ratio_of_medians"] == pytest.approx(1.01)
    assert cell["ratios"]["on/on_lazy"]["ratio_of_medians"] == pytest.approx(1.5 / 1.4)
    # fake tax = 0.5 x (0.5 + 0.1 b) x L / 4 ms: no fixed part, 262.5 us per layer at b=16
    fit = rep["fit"]["default"]["16"]
    assert fit["fixed_us"] == pytest.approx(0.0, abs=1e-6)
    assert fit["per_layer_us"] == pytest.approx(262.5)
    t = rep["targets"]
    assert t["P2"]["pass"] is False and t["P2_split"]["pass"] is False
    assert t["P6"]["pass"] is False and t["offload_adds_nothing"]["pass"] is True
    assert t["P2"]["why"] == "not measured: default/batch8, fdo/batch8"
    # profiles per engine at batch 16: the stand-in's per-step launch counts
    prof = rep["profile"]["default/L4/on/batch16"]["per_step"]
    assert prof["kernel_launches"] == pytest.approx(12) and prof["graph_launches"] == 1
    assert rep["profile"]["default/L4/off/batch16"]["per_step"]["kernel_launches"] == 2
    # the stage clock per step, and what the on arm's sites add beyond off's
    assert rep["profile"]["default/L4/on/batch16"]["stages"]["per_step"][
        "HiSparseWorker.start_step"] == {"us": 40.0, "calls": 1.0}
    assert rep["profile_diff"]["default/L4/on/batch16"]["stage_us"] == {
        "HiSparseWorker.start_step": 40.0}
    eng = rep["engines"]["default/L4/on"]
    assert eng["no_pressure"] == {"no_misses": True, "no_lost_pages": True,
                                  "no_pages_given_up": True, "counters_read": True}
    assert eng["versions"]["vllm"] == "fake"
    assert rep["versions"] == {"ours": [{"vllm": "fake", "torch": "x"}]}
    assert "no_pressure" not in rep["engines"]["default/L4/off"]
    logs = (tmp_path / "out" / "bench-tax-logs.txt").read_text()
    assert logs.count("===== ") == 16 and "fdo_L32_on_lazy.log" in logs


def test_an_engine_that_does_not_start_is_reported_and_the_rest_run(tax_cmd, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_FAIL", "fdo/L4/on")
    rc, rep, _ = tax_cmd("--modes", "default,fdo", "--batches", "1", "--reps", "2")
    assert rc == 1
    assert any("fdo/L4/on: engine did not start: RuntimeError: no GPU" in f
               for f in rep["failures"])
    assert "error" in rep["engines"]["fdo/L4/on"]
    assert {s["arm"] for s in rep["samples"] if s["mode"] == "fdo"} == {"off"}
    assert "on/off" in rep["summary"]["default"]["4"]["1"]["ratios"]


def test_pressure_in_the_no_pressure_arm_fails_the_run(tax_cmd, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MISSES", "1")
    rc, rep, _ = tax_cmd("--modes", "default", "--batches", "1", "--reps", "1")
    assert rc == 1
    assert rep["engines"]["default/L4/on"]["no_pressure"]["no_misses"] is False
    assert any("not pressure-free" in f for f in rep["failures"])


def test_budget_stops_sampling_and_keeps_the_report(tax_cmd):
    rc, rep, _ = tax_cmd("--modes", "default", "--batches", "1,8", "--budget", "0")
    assert rc == 1 and rep["samples"] == []
    assert "default/L4/batch1: not measured (budget)" in rep["failures"]


def test_mirror_mode_runs_eager_vs_lazy_at_batch16(tax_cmd):
    rc, rep, _ = tax_cmd("--mirror", "--modes", "default", "--reps", "2")
    assert rc == 0
    assert {(s["arm"], s["batch"]) for s in rep["samples"]} == {("on", 16), ("on_lazy", 16)}
    assert rep["targets"]["P6"]["measured"]["default"]["ratio"] == pytest.approx(1.5 / 1.4,
                                                                                abs=1e-4)


def test_merge_of_two_runs(tax_cmd, bench_tax, tmp_path):
    _, a, _ = tax_cmd("--modes", "fdo", "--layers", "4", "--batches", "8", "--reps", "2")
    (tmp_path / "a.json").write_text(json.dumps(a))
    _, b, _ = tax_cmd("--modes", "fdo", "--layers", "32", "--batches", "8", "--reps", "2")
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert bench_tax.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                           "--out", str(tmp_path / "m")]) == 0
    m = json.loads((tmp_path / "m" / "bench-tax.json").read_text())
    assert m["fit"]["fdo"]["8"]["layers"] == [4, 32]
    assert m["merged_from"] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert len(m["runs"]) == 2


def test_dry_run_starts_nothing(bench_tax, capsys, monkeypatch):
    monkeypatch.setattr(common, "has_gpu", lambda: pytest.fail("dry run looked for a GPU"))
    assert bench_tax.main(["--dry-run", "--layers", "8,32", "--index-topk-freq", "4",
                           "--arms", "off,on,u_on"]) == 0
    out = capsys.readouterr().out
    assert "default/L32/u_on" in out and "HiSparseConnector" in out
    assert "estimate: engine starts" in out


@pytest.mark.parametrize("rotate", [True, False])
def test_core_sets_rotate_so_a_slow_set_weighs_on_every_arm(tax_cmd, monkeypatch, rotate):
    """P2's method (run 4 saw untouched code run ~1.4x slower in the on
    arm's process): engines start on disjoint core sets, and the sets
    rotate across repetitions, so a core set slower for any process (the
    stand-in's cores "1": 1.3x) no longer reads as one arm's tax. The A/A
    control off_b/off shows it: 1.0 with rotation, 1.3x without; by_cpus
    names the slow set for every arm."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("FAKE_ENGINE_SLOW_CPUS", "1")
    args = ["--arms", "off,off_b", "--modes", "fdo", "--batches", "16", "--reps", "4"]
    rc, rep, _ = tax_cmd(*args, *([] if rotate else ["--no-rotate-cores"]))
    assert rc == 0 and rep["failures"] == []
    cell = rep["summary"]["fdo"]["4"]["16"]
    aa = cell["ratios"]["off_b/off"]["ratio_of_medians"]
    ran_on = {s["arm"]: {x["cpus"] for x in rep["samples"] if x["arm"] == s["arm"]}
              for s in rep["samples"]}
    if rotate:
        assert aa == pytest.approx(1.0)
        assert ran_on == {"off": {"0", "1"}, "off_b": {"0", "1"}}
        for arm in ("off", "off_b"):
            assert cell["by_cpus"][arm]["1"] == pytest.approx(1.3 * cell["by_cpus"][arm]["0"])
    else:
        assert aa == pytest.approx(1.3)
        assert ran_on == {"off": {"0"}, "off_b": {"1"}}
        assert "by_cpus" not in cell  # one set per arm: nothing to compare
    # the collector's pauses per decode step, by the same difference
    assert cell["gc_ms"]["off"]["median"] == pytest.approx(0.01 * cell["arms"]["off"]["median"])
    assert rep["samples"][0]["busy_threads"][0]["name"] == "python"


@pytest.mark.parametrize("noise_stop", [True, False])
def test_a_failed_aa_control_ends_the_run(tax_cmd, monkeypatch, noise_stop):
    """P2's method (run 20 spent 340 s of device time after its first
    cell's A/A had read 1.20): the first cell whose
    off_b/off misses the 5% floor ends the run, its failures say why, and
    the later cells are not measured; --no-noise-stop measures them. The
    last cell has nothing after it to save: its failed control is left to
    the aa_control verdict (test_core_sets_rotate_...: rc 0)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("FAKE_ENGINE_SLOW_CPUS", "1")  # off_b's cores: 1.3x
    args = ["--arms", "off,off_b", "--modes", "fdo,default", "--start", "by-group",
            "--batches", "1,16", "--reps", "3", "--no-rotate-cores"]
    rc, rep, _ = tax_cmd(*args, *([] if noise_stop else ["--no-noise-stop"]))
    measured = {(s["mode"], s["batch"]) for s in rep["samples"]}
    assert rep["targets"]["aa_control"]["pass"] is False
    if noise_stop:
        assert rc == 1 and measured == {("fdo", 1)}
        assert len(rep["failures"]) == 1
        assert rep["failures"][0].startswith("fdo/L4/batch1: A/A control off_b/off 1.300 "
                                             "misses the method's floor")
        assert "3 cell(s) unmeasured" in rep["failures"][0]
        assert not any(k.startswith("default/") for k in rep["engines"])  # never started
    else:
        assert rc == 0 and rep["failures"] == []
        assert measured == {(m, b) for m in ("fdo", "default") for b in (1, 16)}


def test_the_step_clock_is_the_estimator_where_every_sample_has_it(tax_cmd, monkeypatch):
    """P2's method (run 5: A/A 0.89-1.05 by the difference of totals, one
    sample's first generation 0.5 s slow): where every sample carries the
    median step-to-step interval, the verdicts read it, and the difference
    method's figures stay beside it under "totals"."""
    monkeypatch.setenv("FAKE_ENGINE_STEP_MS", "1")
    rc, rep, _ = tax_cmd("--arms", "off,on", "--modes", "fdo", "--batches", "16",
                         "--reps", "3", "--no-rotate-cores")
    assert rc == 0 and rep["failures"] == []
    cell = rep["summary"]["fdo"]["4"]["16"]
    assert cell["estimator"] == "step_ms" and cell["statistic"] == "min"
    assert cell["ratios"]["on/off"]["ratio"] == pytest.approx(1.5)
    # the steady intervals' mean rides along, compared by the same statistic
    assert cell["steady"]["ratios"]["on/off"]["ratio"] == pytest.approx(1.5)
    # and the process probe: the fixed Python work ran 1.25x slower in the
    # on engine, its launches alike
    assert cell["probe"]["ratios"]["on/off"] == pytest.approx(
        {"python_us": 1.25, "launch_us": 1.0})
    assert cell["arms"]["off"]["max"] == pytest.approx(0.5 + 0.1 * 16)  # no slow sample
    totals = cell["totals"]
    assert totals["arms"]["off"]["min"] < 0  # the slow first short generation
    assert rep["targets"]["P2"]["measured"]["fdo/batch16"]["ratio"] == pytest.approx(1.5)
    # busy cores divide CPU time by the wall time of the same totals
    assert cell["cpu"]["on"]["busy_cores"] == pytest.approx(
        cell["cpu"]["on"]["median"] / totals["arms"]["on"]["median"])


def test_max_reps_continues_an_unresolved_p2_cell_until_it_resolves(tax_cmd, monkeypatch):
    """P2's resolution (session 16: run 10's cells stayed unresolved at 9
    repetitions): the off engine's samples 0 and 2 run in the VM's slow
    mode (1.5x). After --reps 3 the on/off interval still reaches 1.0
    (a resample without the one fast off sample), so the run goes on; at
    five repetitions three fast off samples resolve it (a fail at 1.5x)
    and it stops, well before --max-reps. Without --max-reps the same
    cell ends unresolved, and the verdict says so."""
    monkeypatch.setenv("FAKE_ENGINE_STEP_MS", "1")
    monkeypatch.setenv("FAKE_ENGINE_SLOW_SAMPLES", "off:0,2")
    base = ["--arms", "off,on", "--modes", "fdo", "--batches", "16", "--reps", "3",
            "--no-rotate-cores"]
    rc, rep, _ = tax_cmd(*base)
    assert rc == 0 and len(rep["samples"]) == 6
    p2 = rep["targets"]["P2"]
    assert p2["measured"]["fdo/batch16"]["interval90"][0] == pytest.approx(1.0)
    assert p2["unresolved"] == ["fdo/batch16"] and "within the run's noise" in p2["why"]
    rc, rep, _ = tax_cmd(*base, "--max-reps", "8")
    assert rc == 0 and rep["failures"] == []
    assert sorted({s["rep"] for s in rep["samples"]}) == [0, 1, 2, 3, 4]
    cell = rep["targets"]["P2"]["measured"]["fdo/batch16"]
    assert cell["resolved"] is True and cell["interval90"] == pytest.approx([1.5, 1.5])
    assert rep["targets"]["P2"]["unresolved"] == []


def test_max_reps_below_reps_is_refused(bench_tax, capsys):
    with pytest.raises(SystemExit):
        bench_tax.main(["--reps", "5", "--max-reps", "3", "--dry-run"])
    assert "--max-reps 3 is below --reps 5" in capsys.readouterr().err


def test_without_a_step_clock_the_totals_are_the_estimator(tax_cmd):
    rc, rep, _ = tax_cmd("--arms", "off,on", "--modes", "fdo", "--batches", "16", "--reps", "2")
    cell = rep["summary"]["fdo"]["4"]["16"]
    assert rc == 0 and cell["estimator"] == "ms_per_step" and "totals" not in cell


def test_by_group_starts_each_groups_engines_after_the_last_stopped(tax_cmd, monkeypatch,
                                                                    tmp_path):
    """Run 13 (issue 16, an 80 GB H100): ten engines side by side ran out of
    GPU memory. By group, only one (mode, layers) group's engines live at
    a time; the arms of a group still alternate sample by sample."""
    starts = tmp_path / "starts.log"
    monkeypatch.setenv("FAKE_ENGINE_STARTS", str(starts))
    rc, rep, calls = tax_cmd("--start", "by-group", "--arms", "off,on", "--modes",
                             "default,fdo", "--batches", "1", "--reps", "2")
    assert rc == 0 and rep["failures"] == []
    events = starts.read_text().split("\n")[:-1]
    first_fdo = min(i for i, e in enumerate(events) if e.startswith("fdo/"))
    assert sorted(events[:first_fdo]) == sorted(
        ["default/L4/off start", "default/L4/on start",
         "default/L4/off stop", "default/L4/on stop"])
    assert rep["runs"][0]["start_plan"] == [["default/L4"], ["fdo/L4"]]
    assert {(s["mode"], s["arm"]) for s in rep["samples"]} == {
        (md, arm) for md in ("default", "fdo") for arm in ("off", "on")}
    assert [ln.split()[0].rsplit("/", 1)[1] for ln in calls[:4]] == ["off", "on", "on", "off"]


def test_auto_starts_by_group_where_the_engines_do_not_fit(tax_cmd, monkeypatch):
    """Four engines x 9.5 GiB exceed a 30 GiB GPU: auto starts by group;
    on a 141 GB H200 they start together (runs 1-12)."""
    monkeypatch.setattr(common, "gpu_memory_gib", lambda: 30.0)
    rc, rep, _ = tax_cmd("--arms", "off,on", "--modes", "default,fdo", "--batches", "1",
                         "--reps", "1")
    assert rc == 0 and rep["runs"][0]["start_plan"] == [["default/L4"], ["fdo/L4"]]
    assert rep["runs"][0]["gpu_memory_gib"] == 30.0
    monkeypatch.setattr(common, "gpu_memory_gib", lambda: 139.8)
    rc, rep, _ = tax_cmd("--arms", "off,on", "--modes", "default,fdo", "--batches", "1",
                         "--reps", "1")
    assert rc == 0 and rep["runs"][0]["start_plan"] == [["default/L4", "fdo/L4"]]


def test_a_group_past_the_budget_starts_no_engine(tax_cmd, monkeypatch, tmp_path):
    starts = tmp_path / "starts.log"
    monkeypatch.setenv("FAKE_ENGINE_STARTS", str(starts))
    rc, rep, _ = tax_cmd("--start", "by-group", "--modes", "default,fdo", "--batches", "1",
                         "--budget", "0")
    assert rc == 1 and rep["samples"] == []
    # the first group's engines start (as together: the budget counts
    # sampling), a later group's would only be stopped again
    assert "default/L4/batch1: not measured (budget)" in rep["failures"]
    assert "fdo/L4: engines not started (budget)" in rep["failures"]
    assert not any(e.startswith("fdo/") for e in starts.read_text().split("\n"))
