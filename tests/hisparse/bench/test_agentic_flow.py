# SPDX-License-Identifier: Apache-2.0
"""scripts/bench-agentic end to end on the CPU: the real command (setup,
servers side by side, levels with the arms rotated, the /metrics poller,
the tool's run, summaries, verdicts, the JSON, --merge-with, --plot,
--merge, --budget) against stand-ins of `vllm serve` (fake_vllm.py) and of
vLLM's multi-turn tool (fake_multi_turn.py)."""

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
from benchlib import agentic, common, plot
from upstream_bundle import make_bundle

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SMALL = ["--scale", "0.002", "--turns", "3", "--output-tokens", "20", "--concurrency", "2,3",
         "--poll", "0.05", "--level-timeout", "60"]


def free_base(n: int = 4) -> int:
    for base in range(23000, 60000, 97):
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


@pytest.fixture
def agentic_cmd(bench_agentic, monkeypatch, tmp_path):
    monkeypatch.setattr(common, "has_gpu", lambda: True)
    monkeypatch.setattr(bench_agentic, "vllm_probe", lambda env: {"version": "fake"})

    def model(path, layers, max_pos, python=sys.executable, index_topk_freq=1):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"eos_token_id": 1,
                                                      "num_hidden_layers": layers}))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
        return path

    monkeypatch.setattr(common, "ensure_model", model)
    real_command = agentic.server_command

    def server_command(arm, cfg, python, model_dir, profile_dir=None):
        real = real_command(arm, cfg, python, model_dir, profile_dir)
        profiler = real[real.index("--profiler-config"):][:2] if "--profiler-config" in real \
            else []
        return [sys.executable, str(HERE / "fake_vllm.py"), "--port", str(cfg.port(arm)),
                "--arm", arm, "--version", "0.30.0" if arm == "upstream" else "0.26.0+hisparse.1",
                *profiler]

    monkeypatch.setattr(agentic, "server_command", server_command)
    tool = tmp_path / "tool"
    tool.mkdir()
    shutil.copy(HERE / "fake_multi_turn.py", tool / agentic.TOOL)
    bundle = make_bundle(tmp_path / "upstream030")

    def run(*args: str, out: str = "out") -> tuple[int, dict, Path]:
        o = tmp_path / out
        rc = bench_agentic.main(["--out", str(o), "--work", str(tmp_path / "work"),
                                 "--tool", str(tool), "--stage", str(tmp_path / "stage"),
                                 "--upstream-bundle", str(bundle),
                                 "--port-base", str(free_base()), *args])
        return rc, json.loads((o / "bench-agentic.json").read_text()), o

    return run


def test_all_arms_every_level(agentic_cmd, tmp_path):
    rc, rep, out = agentic_cmd("--arms", "plain,offload,hisparse,upstream", *SMALL)
    assert rc == 0, rep["failures"]
    assert [(lv["concurrency"], lv["arm"]) for lv in rep["levels"]] == [
        (c, a) for c in (2, 3) for a in sorted(("plain", "offload", "hisparse", "upstream"))]
    for lv in rep["levels"]:
        assert lv["status"] == "ok", lv
        c = lv["concurrency"]
        assert lv["client"]["requests"] == lv["requests_planned"] == c * 3
        assert lv["client"]["failures"] == 0 and lv["client"]["output_tokens"] > 0
        assert 0 < lv["server"]["mean_running"] <= c and lv["server"]["peak_running"] <= c
        assert lv["server"]["generation_tokens"] == lv["client"]["output_tokens"]
        assert lv["client_vs_server_tokens"] == 1.0
        assert lv["reset"]["reset"] is True and lv["series"]
        # P4's figure: the mean over the span a request was in the server
        assert 0 < lv["active"]["mean_running"] <= c
        assert lv["active"]["window_s"] <= lv["server"]["window_s"] + 1.0
        assert "--num-clients" in lv["tool_command"]
        assert lv["workload_fit"]["trimmed_conversations"] == 0  # short ones: nothing to trim
    by = {(lv["arm"], lv["concurrency"]): lv for lv in rep["levels"]}
    assert by[("plain", 3)]["server"]["preemptions"] > 0
    assert by[("offload", 3)]["server"]["preemptions"] == 0
    assert by[("hisparse", 3)]["server"]["hot_hit_rate"] == pytest.approx(0.9)
    assert by[("plain", 3)]["server"]["hot_hit_rate"] is None
    assert rep["arms"]["upstream"]["version"] == "0.30.0"
    assert rep["arms"]["hisparse"]["cache"]["num_gpu_blocks"] == "3196"
    assert rep["runs"][0]["upstream_stage"]["unpacked"] is True
    assert rep["runs"][0]["model_changes"]["config.json"] == ["eos_token_id"]
    assert set(rep["targets"]) == {"P4", "P5", "P8"}
    assert rep["targets"]["P4"]["measured"]["at_concurrency"] == 3
    p8 = rep["targets"]["P8"]  # no --tax-json: never a pass
    assert p8["pass"] in (None, False) and p8["measured"]["tax"] is None
    assert "the tax comparison" in p8["why"] or p8["pass"] is False
    assert (out / "bench-agentic-command.txt").read_text().startswith("scripts/bench-agentic ")
    logs = (out / "bench-agentic-logs.txt").read_text()
    assert "===== server_upstream.log" in logs and "===== tool_plain_c3.log" in logs
    assert "num_failures=0" in logs
    # the same conversations for every arm of a level, other ones per level
    work = tmp_path / "work" / "workload"
    c2, c3 = (json.loads((work / f"conversations_c{c}.json").read_text()) for c in (2, 3))
    assert len(c2) == 2 and len(c3) == 3 and c2[0] != c3[0]
    if plot_ok():
        assert (out / plot.THROUGHPUT_PNG).read_bytes()[:4] == b"\x89PNG"


def plot_ok() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def test_a_server_that_does_not_start_fails_its_arm_only(agentic_cmd, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_EXIT", "offload")
    rc, rep, _ = agentic_cmd("--arms", "plain,offload", *SMALL)
    assert rc == 1
    assert any("offload: server exited with 3" in f for f in rep["failures"])
    assert {lv["arm"]: lv["status"] for lv in rep["levels"] if lv["concurrency"] == 2} == {
        "plain": "ok", "offload": "error"}


def test_every_arm_is_warmed_alike_before_its_first_level(agentic_cmd, monkeypatch, tmp_path):
    """P5 (a fair baseline): each server gets the same warm-up prompts, one
    after another and unstreamed, before any level's streamed requests, so
    no arm compiles a step's kernels inside its measurement."""
    record = tmp_path / "prompts"
    record.mkdir()
    monkeypatch.setenv("FAKE_VLLM_PROMPTS", str(record))
    rc, rep, _ = agentic_cmd("--arms", "offload,hisparse", *SMALL)
    assert rc == 0, rep["failures"]
    sizes = rep["arms"]["offload"]["warm_sizes"]
    assert sizes == rep["arms"]["hisparse"]["warm_sizes"] == agentic.warm_sizes(
        agentic.AgenticConfig())
    for arm in ("offload", "hisparse"):
        assert rep["arms"][arm]["warm_status"] == [200] * len(sizes)
        seen = [tuple(map(int, ln.split())) for ln in (record / f"{arm}.txt").read_text()
                .splitlines()]
        first_streamed = next(i for i, (_, streamed) in enumerate(seen) if streamed)
        assert [n for n, _ in seen[:first_streamed]] == sizes
        assert all(streamed for _, streamed in seen[first_streamed:])


def test_a_failed_warm_up_fails_its_arm_with_the_statuses(agentic_cmd, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_UNSTREAMED", "offload")
    rc, rep, _ = agentic_cmd("--arms", "plain,offload", *SMALL)
    assert rc == 1
    (failure,) = [f for f in rep["failures"] if f.startswith("offload:")]
    assert "warm-up requests failed" in failure and ": 500" in failure
    assert rep["arms"]["offload"]["error"] == "warm-up failed"
    assert {lv["arm"]: lv["status"] for lv in rep["levels"] if lv["concurrency"] == 2} == {
        "plain": "ok", "offload": "error"}


def test_sequential_start_and_budget(agentic_cmd):
    rc, rep, _ = agentic_cmd("--arms", "plain", "--sequential-start", *SMALL)
    assert rc == 0 and {lv["status"] for lv in rep["levels"]} == {"ok"}
    rc, rep, _ = agentic_cmd("--arms", "plain", "--budget", "0", *SMALL, out="b")
    assert rc == 1 and {lv["status"] for lv in rep["levels"]} == {"skipped"}
    # A level its arm's prior says the budget cannot finish is skipped, not
    # started to time out: 2 clients x 2 conversations x 6 turns x 2,500
    # tokens at the prior's 500 tok/s (2 clients) need ~135 s, 0.8 of it
    # 108 s; 95 s of budget leaves more than the 40 s floor but less than
    # that, however long the servers take to start (up to ~55 s).
    long = ["--scale", "0.002", "--turns", "6", "--output-tokens", "2500", "--concurrency", "2",
            "--conversations-per-client", "2", "--max-model-len", "32768", "--poll", "0.05"]
    rc, rep, _ = agentic_cmd("--arms", "plain", "--budget", "95", *long, out="c")
    (level,) = rep["levels"]
    assert rc == 1 and level["status"] == "skipped", level
    left = float(level["error"].split("budget: ")[1].split(" s left")[0])
    assert 40 <= left < 108 and "needs ~108 s" in level["error"], level["error"]


def test_merge_with_an_earlier_run_and_the_tax(agentic_cmd, tmp_path):
    rc, ours, _ = agentic_cmd("--arms", "hisparse", *SMALL, out="ours")
    assert rc == 0
    tax = tmp_path / "tax.json"
    tax.write_text(json.dumps({"schema": "bench-tax/1", "targets": {"P8_tax": {"pass": True}}}))
    rc, rep, _ = agentic_cmd("--arms", "upstream", *SMALL, "--merge-with",
                             str(tmp_path / "ours" / "bench-agentic.json"), "--tax-json", str(tax),
                             out="up")
    assert rc == 0
    assert agentic.arms_in(rep["levels"]) == ["hisparse", "upstream"]
    p8 = rep["targets"]["P8"]
    assert set(p8["measured"]["levels"]) == {"2", "3"} and p8["measured"]["tax"] == {"pass": True}
    assert p8["pass"] in (True, False)  # measured: the stand-ins' figures decide


def test_merge_and_plot_commands(agentic_cmd, bench_agentic, tmp_path, capsys):
    agentic_cmd("--arms", "plain", *SMALL, out="a")
    agentic_cmd("--arms", "offload", *SMALL, out="b")
    files = [str(tmp_path / x / "bench-agentic.json") for x in ("a", "b")]
    assert bench_agentic.main(["--merge", *files, "--out", str(tmp_path / "m")]) == 0
    m = json.loads((tmp_path / "m" / "bench-agentic.json").read_text())
    assert m["merged_from"] == files and agentic.arms_in(m["levels"]) == ["plain", "offload"]
    if plot_ok():
        assert bench_agentic.main(["--plot", files[0], "--out", str(tmp_path / "p")]) == 0
        assert (tmp_path / "p" / plot.RUNNING_PNG).exists()
    else:
        with pytest.raises(SystemExit, match="needs matplotlib"):
            bench_agentic.main(["--plot", files[0], "--out", str(tmp_path / "p")])


def test_dry_run_and_write_workload(bench_agentic, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "has_gpu", lambda: pytest.fail("dry run looked for a GPU"))
    assert bench_agentic.main(["--dry-run", "--arms", "plain,hisparse,upstream"]) == 0
    out = capsys.readouterr().out
    assert "hisparse_config" in out and "HiSparseConnector" in out and "estimate" in out
    assert "c=16: " in out and "first turns trimmed" in out  # the default levels' fit
    assert bench_agentic.main(["--write-workload", str(tmp_path / "w"),
                               "--concurrency", "4,8"]) == 0
    convs = json.loads((tmp_path / "w" / "conversations_c8.json").read_text())
    assert len(convs) == 8 and len(convs[0]["messages"]) == 26


def test_with_vllms_own_multi_turn_tool(agentic_cmd, monkeypatch, tmp_path):
    """The pinned tree's benchmark_serving_multi_turn.py itself (where its
    pandas is importable) on our conversation files and a real tiny model
    folder: it parses our streams, counts our tokens and writes the records
    the summaries read."""
    tool = ROOT / "work" / "build" / "vllm" / "benchmarks" / "multi_turn"
    if not (tool / agentic.TOOL).exists():
        pytest.skip("no pinned tree (scripts/build.sh)")
    pytest.importorskip("pandas")
    import subprocess

    def model(path, layers, max_pos, python=sys.executable, index_topk_freq=1):
        subprocess.run([sys.executable, str(common.MAKE_MODEL), str(path), "--max-pos",
                        str(max_pos)], check=True, capture_output=True)
        return Path(path)

    monkeypatch.setattr(common, "ensure_model", model)
    rc, rep, _ = agentic_cmd("--arms", "hisparse", *SMALL, "--tool", str(tool))
    assert rc == 0, rep["failures"]
    for lv in rep["levels"]:
        cl = lv["client"]
        assert lv["status"] == "ok" and cl["failures"] == 0
        # it stops once its first client is done: the others' last turns may not run
        assert 0 < cl["requests"] <= lv["requests_planned"]
        assert cl["conversations"] == lv["concurrency"]
        assert cl["output_tokens"] == lv["server"]["generation_tokens"]
        assert cl["tpot_ms_p50"] > 0 and cl["ttft_ms_p50"] > 0


def test_profile_level_summarizes_the_engines_trace(agentic_cmd, tmp_path):
    """--profile-level: the profiler runs over part of that level of each of
    our arms (POST /start_profile after --profile-delay, /stop_profile at
    its end); the trace's step summary lands in the level; the level is
    marked and no verdict reads its figures (they carry the profiler); the
    other levels are untouched."""
    rc, rep, out = agentic_cmd("--arms", "offload,hisparse,upstream", *SMALL,
                               "--profile-level", "3", "--profile-delay", "0.05")
    assert rc == 0, rep["failures"]
    by = {(lv["arm"], lv["concurrency"]): lv for lv in rep["levels"]}
    for arm in ("offload", "hisparse"):
        lv = by[(arm, 3)]
        assert lv["status"] == "ok" and lv["profiled"] is True
        prof = lv["profile"]
        assert (prof["start_status"], prof["stop_status"]) == (200, 200), prof
        summary = prof["summary"]
        assert summary["by_kind"]["decode"]["gpu_us_per_step"]["hisparse"] == 15.0
        assert (out / prof["trace_file"]).exists()
        assert "profile" not in by[(arm, 2)] and not by[(arm, 2)].get("profiled")
    assert "profile" not in by[("upstream", 3)]  # never profiled (its own vLLM)
    assert rep["targets"]["P5"]["measured"]["at_concurrency"] == 2  # level 3 is profiled
    assert set(rep["targets"]["P4"]["measured"]["levels"]["3"]) == {"upstream"}
    assert "--profiler-config" in rep["arms"]["hisparse"]["command"]


def test_sample_engines_needs_py_spy(agentic_cmd, tmp_path):
    """--sample-engines with no py-spy there: a clear error before any
    server starts, not a run without samples."""
    with pytest.raises(SystemExit) as e:
        agentic_cmd("--arms", "hisparse", *SMALL, "--sample-engines", str(tmp_path / "none"))
    assert "no py-spy at" in str(e.value)


PY_SPY = os.environ.get("HISPARSE_PY_SPY") or shutil.which("py-spy")


@pytest.mark.skipif(PY_SPY is None, reason="py-spy not installed (HISPARSE_PY_SPY)")
def test_sample_engines_summarizes_each_level(agentic_cmd, bench_agentic, monkeypatch):
    """--sample-engines (P5 diagnostics): every level of every arm samples
    the engine core below its server (found by its title), its summary and
    collapsed stacks land beside the JSON; the levels stay in the verdicts
    (the sampler does not pause the engine)."""
    monkeypatch.setenv("FAKE_VLLM_ENGINE", "1")
    rc, rep, out = agentic_cmd("--arms", "offload,hisparse", *SMALL,
                               "--sample-engines", PY_SPY, "--sample-rate", "200")
    assert rc == 0, rep["failures"]
    assert rep["runs"][0]["sample_engines"]["rate_hz"] == 200
    for lv in rep["levels"]:
        (rec,) = lv["samples"]
        assert "error" not in rec and (out / rec["file"]).exists(), rec
        s = rec["summary"]
        assert s["main_samples"] > 0
        # the fake engine's own frames (its short levels give too few
        # samples for the marks' ratio: test_pysample.py checks that)
        assert any("<string>" in k for k, _ in s["inclusive"]), s["inclusive"]
        assert set(s["marks"]) == set(bench_agentic.SAMPLE_MARKS)
    assert rep["targets"]["P5"]["measured"]["at_concurrency"] == 3


def test_the_batch_control_runs_beside_the_arms_and_enters_p5(agentic_cmd):
    """P5's batch control end to end: plain_ample@N is served and measured
    at every level like any arm; P5's measured.batch_control carries HiSparse's TPOT and
    running over it at P5's level; the verdict is still HiSparse against
    the offloader."""
    rc, rep, _ = agentic_cmd("--arms", "offload,hisparse,plain_ample@2", *SMALL)
    assert rc == 0, rep["failures"]
    assert {(lv["concurrency"], lv["arm"]) for lv in rep["levels"]} == {
        (c, a) for c in (2, 3) for a in ("offload", "hisparse", "plain_ample@2")}
    assert all(lv["status"] == "ok" for lv in rep["levels"])
    p5 = rep["targets"]["P5"]["measured"]
    assert p5["at_concurrency"] == 3
    ctl = p5["batch_control"]["plain_ample@2"]
    by = {(lv["arm"], lv["concurrency"]): lv for lv in rep["levels"]}
    h, c = by[("hisparse", 3)], by[("plain_ample@2", 3)]
    assert ctl["tpot_ms_p50"] == c["client"]["tpot_ms_p50"]
    assert ctl["hisparse_tpot_ratio"] == pytest.approx(
        h["client"]["tpot_ms_p50"] / c["client"]["tpot_ms_p50"], abs=1e-3)
    assert 0 < ctl["mean_running"] <= 3
