# SPDX-License-Identifier: Apache-2.0
"""benchlib.engine_worker's protocol, with its Engine replaced (no vLLM
engine on the CPU): replies are the only thing on stdout although the
engine prints there (vLLM logs to stdout), an unknown op and a failing op
are error replies and the process goes on, a failed start is one error
reply; and the parent's handle (workerproc) over the same pipes."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from benchlib import common
from benchlib.workerproc import EngineError, EngineProcess

DRIVER = textwrap.dedent("""
    import sys
    import benchlib.engine_worker as w

    class Engine:
        def __init__(self, spec):
            print("INFO vllm says hello on stdout", flush=True)
            if spec.get("fail"):
                raise RuntimeError("CUDA unavailable")
            self.info = {"init_s": 0.0, "versions": {"vllm": "x"}}

        def sample(self, batch, n, m):
            print("noise", flush=True)
            return {"t_short_s": 0.1 * batch, "t_long_s": 0.1 * batch + n * 0.001}

        def prepare(self, **kw):
            raise ValueError("bad prompt")

        def counters(self):
            return {}

        def shutdown(self):
            return {}

    w.Engine = Engine
    sys.exit(w.main())
""")


def driver_cmd(tmp_path: Path) -> list[str]:
    p = tmp_path / "driver.py"
    p.write_text(DRIVER)
    return [sys.executable, str(p)]


def env() -> dict:
    return common.child_env(in_process=True)


def test_protocol_over_stdin_stdout(tmp_path):
    lines = [{"key": "k", "vllm": "ours", "kwargs": {}},
             {"op": "sample", "batch": 2, "n": 100, "m": 10},
             {"op": "timed", "batch": 1, "n": 1},  # not a command
             {"op": "prepare", "batch": 1},
             {"op": "shutdown"}]
    p = subprocess.run(driver_cmd(tmp_path), input="\n".join(map(json.dumps, lines)) + "\n",
                       capture_output=True, text=True, env=env(), cwd=common.SCRIPTS, timeout=60)
    replies = [json.loads(x) for x in p.stdout.splitlines()]
    assert "hello on stdout" in p.stderr and "noise" in p.stderr
    assert replies[0]["ok"] and replies[0]["versions"] == {"vllm": "x"}
    assert replies[1] == {"ok": True, "t_short_s": 0.2, "t_long_s": pytest.approx(0.3)}
    assert not replies[2]["ok"] and "unknown op 'timed'" in replies[2]["error"]
    assert not replies[3]["ok"] and "ValueError: bad prompt" in replies[3]["error"]
    assert replies[4] == {"ok": True} and len(replies) == 5 and p.returncode == 0


def test_failed_start_is_one_error_reply(tmp_path):
    p = subprocess.run(driver_cmd(tmp_path), input=json.dumps({"fail": True}) + "\n",
                       capture_output=True, text=True, env=env(), cwd=common.SCRIPTS, timeout=60)
    (reply,) = [json.loads(x) for x in p.stdout.splitlines()]
    assert not reply["ok"] and "RuntimeError: CUDA unavailable" in reply["error"]
    assert p.returncode == 1


def test_engine_process_handle(tmp_path):
    proc = EngineProcess("default/L4/on", {"vllm": "ours", "kwargs": {}}, env(),
                         tmp_path / "log" / "e.log", command=driver_cmd(tmp_path),
                         cwd=common.SCRIPTS)
    assert proc.wait_ready(60)["init_s"] == 0.0
    assert proc.call("sample", batch=1, n=10, m=1)["t_short_s"] == pytest.approx(0.1)
    with pytest.raises(EngineError, match="prepare failed: ValueError: bad prompt"):
        proc.call("prepare", batch=1)
    proc.close()
    assert proc.proc.returncode == 0
    assert "hello" in (tmp_path / "log" / "e.log").read_text()


def test_engine_process_that_dies_says_so_with_its_log(tmp_path):
    proc = EngineProcess("k", {"vllm": "ours"}, env(), tmp_path / "e.log",
                         command=[sys.executable, "-c",
                                  "import sys; sys.stdin.readline(); "
                                  "print('boom: out of memory', file=sys.stderr); sys.exit(7)"])
    with pytest.raises(EngineError, match=r"exited \(7\).*out of memory"):
        proc.wait_ready(60)
    proc.close()


def test_engine_process_that_hangs_times_out(tmp_path):
    proc = EngineProcess("k", {"vllm": "ours"}, env(), tmp_path / "e.log",
                         command=[sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(EngineError, match="no answer within 1 s"):
        proc.wait_ready(1.0)
    proc.proc.kill()
    proc.close(timeout=5)


def test_every_stage_clock_target_exists_in_the_patched_vllm():
    """P2: the stage clock's targets name real call sites of the patched
    vLLM (a renamed hook would silently leave the breakdown without it):
    installed over the CPU build, none is absent, and removing the clock
    restores each original."""
    pytest.importorskip("vllm.v1.hisparse.worker")
    from benchlib import engine_worker

    clock = engine_worker.StageClock()
    try:
        assert clock.absent == []
        assert set(clock.snapshot()) == {t.partition(":")[2]
                                         for t in engine_worker.STAGE_TARGETS}
    finally:
        saved = list(clock._saved)
        clock.remove()
    assert all(owner.__dict__[name] is original for owner, name, original in saved)
