# SPDX-License-Identifier: Apache-2.0
"""benchlib/pysample.py (bench-agentic --sample-engines, issue 16 / P5:
where a served step's host time goes without the torch profiler): the
engine-core lookup below a server over a real process tree, the collapsed
stacks' summary, and py-spy itself over a real process where it is
installed (HISPARSE_PY_SPY or py-spy on PATH)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import fake_engine_core
from benchlib import pysample


@pytest.fixture
def server_tree():
    """A server stand-in: a Python parent with fake_engine_core's titled
    engine below it."""
    parent = subprocess.Popen([sys.executable, fake_engine_core.__file__],
                              start_new_session=True)
    try:
        for _ in range(100):
            if pysample.engine_pids(parent.pid):
                break
            time.sleep(0.05)
        yield parent
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()


def test_engine_pids_finds_the_engine_core_below_the_server(server_tree):
    pids = pysample.engine_pids(server_tree.pid)
    assert len(pids) == 1
    assert b"EngineCore" in Path(f"/proc/{pids[0]}/cmdline").read_bytes()
    assert pysample.engine_pids(pids[0]) == []  # nothing below the engine
    assert server_tree.pid not in pids


COLLAPSED = """\
thread (0x1);run_busy_loop (vllm/v1/engine/core.py:1358);step (vllm/v1/engine/core.py:580);schedule (vllm/v1/core/sched/scheduler.py:300) 30
thread (0x1);run_busy_loop (vllm/v1/engine/core.py:1358);step (vllm/v1/engine/core.py:590);execute_model (vllm/v1/worker/gpu_model_runner.py:4150);_model_forward (vllm/v1/worker/gpu_model_runner.py:3850) 50
thread (0x1);run_busy_loop (vllm/v1/engine/core.py:1358);step (vllm/v1/engine/core.py:590);execute_model (vllm/v1/worker/gpu_model_runner.py:4160) 20
thread (0x2);process_input_sockets (vllm/v1/engine/core.py:1500) 7
garbage
"""


def test_summary_shares_of_the_busiest_thread(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text(COLLAPSED)
    s = pysample.summarize(f, marks=("schedule (", "execute_model (", "sample_tokens ("))
    assert s["samples"] == 107 and s["main_thread"] == "thread (0x1)" and s["main_samples"] == 100
    inc = dict(s["inclusive"])
    # a function counts once per stack, its lines add up
    assert inc["step (v1/engine/core.py)"] == 1.0
    assert inc["execute_model (v1/worker/gpu_model_runner.py)"] == 0.7
    assert inc["schedule (core/sched/scheduler.py)"] == 0.3
    own = dict(s["self"])
    assert own["_model_forward (v1/worker/gpu_model_runner.py)"] == 0.5
    assert own["execute_model (v1/worker/gpu_model_runner.py)"] == 0.2
    assert s["marks"] == {"schedule (": 0.3, "execute_model (": 0.7, "sample_tokens (": 0.0}


def test_summary_of_an_empty_file(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("")
    assert pysample.summarize(f) == {"samples": 0}


def py_spy() -> str | None:
    return os.environ.get("HISPARSE_PY_SPY") or shutil.which("py-spy")


@pytest.mark.skipif(py_spy() is None, reason="py-spy not installed (HISPARSE_PY_SPY)")
def test_sampler_records_the_engine_functions(server_tree, tmp_path):
    pid = pysample.engine_pids(server_tree.pid)[0]
    s = pysample.Sampler(py_spy(), pid, tmp_path / "out.txt", rate=200)
    s.start()
    time.sleep(2.0)
    rec = s.stop()
    assert "error" not in rec, rec
    summary = pysample.summarize(s.path, marks=("schedule (", "execute_model ("))
    assert summary["main_samples"] > 100
    marks = summary["marks"]
    # the engine spins SCHEDULE_S in schedule and EXECUTE_S in execute_model per loop
    spin = fake_engine_core.EXECUTE_S / (fake_engine_core.SCHEDULE_S + fake_engine_core.EXECUTE_S)
    share = marks["execute_model ("] / (marks["schedule ("] + marks["execute_model ("])
    assert abs(share - spin) < 0.15, (share, spin)
