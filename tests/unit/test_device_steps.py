"""scripts/device-steps.sh, the driver of a device call with several steps
(docs/benchmarks.md, "Device commands"): each step under its own limit, its
own OUT folder packed into the call's OUT, a line per step in steps.txt,
every argument checked before the first step runs."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device-steps.sh"


def run(tmp_path: Path, *steps: str, kill: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"),
           "DEVICE_STEPS_WORK": str(tmp_path / "work"), "DEVICE_STEPS_KILL": kill}
    return subprocess.run([str(SCRIPT), *steps], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=120)


def test_each_step_runs_under_its_own_limit_into_its_own_folder(tmp_path):
    proc = run(tmp_path, "first:30=echo one; echo kept > $OUT/result.json",
               "hangs:1=sleep 30", "fails:30=echo two; exit 3", "last:30=echo three")
    assert proc.returncode == 1  # a step failed; the later ones still ran
    lines = (tmp_path / "out" / "steps.txt").read_text().splitlines()
    assert [ln.split()[1:3] for ln in lines] == [
        ["first", "rc=0"], ["hangs", "rc=124"], ["fails", "rc=3"], ["last", "rc=0"]]
    assert int(lines[1].split()[3].rstrip("s")) < 15  # stopped at its limit, not at 30 s
    with tarfile.open(tmp_path / "out" / "first.tar.xz") as tar:
        assert sorted(tar.getnames()) == ["first", "first/log.txt", "first/result.json"]
        assert tar.extractfile("first/result.json").read() == b"kept\n"
        assert tar.extractfile("first/log.txt").read() == b"one\n"
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "steps.txt", "first.tar.xz", "hangs.tar.xz", "fails.tar.xz", "last.tar.xz"}
    assert "two" in proc.stdout  # each step's log tail is printed


def test_all_steps_pass(tmp_path):
    assert run(tmp_path, "a:5=true", "b:5m=true").returncode == 0


def test_what_a_step_leaves_running_is_killed_after_it(tmp_path):
    """The kill pattern runs after every step (the default: vLLM's engine
    processes, which a killed benchmark can leave holding the GPU)."""
    pid = os.getpid()
    marker = f"device-steps-probe-{pid}"  # spelled apart below: as the
    # default pattern is bracketed, no command line may contain it whole
    proc = run(tmp_path, f"leaves:30=n={pid}; (exec -a device-steps-probe-$n sleep 60) & "
               "disown; echo started",
               f"after:30=n={pid}; pgrep -f device-steps-probe-$n && exit 1 || exit 0",
               kill=marker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1


def test_bad_steps_are_refused_before_anything_runs(tmp_path):
    for bad in ("nolimit=true", "name:abc=true", "we ird:5=true", "a:5=",
                "..:5=true", ".hidden:5=true"):  # never a folder outside the work dir
        proc = run(tmp_path, "ok:5=touch $OUT/ran", bad)
        assert proc.returncode == 1 and "not NAME:LIMIT=COMMAND" in proc.stderr, bad
        assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    proc = run(tmp_path, "same:5=touch $OUT/ran", "other:5=true", "same:5=true")
    assert proc.returncode == 1 and "step name used twice: same" in proc.stderr
    assert not (tmp_path / "out").exists()
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([str(SCRIPT), "a:5=true"], env=env, text=True, capture_output=True)
    assert proc.returncode == 1 and "OUT is not set" in proc.stderr
