"""The README's two commands on a fresh clone (issue 9, item 1).

A clean clone of this checkout's tracked files in a scratch folder, with a
PATH that reaches every tool of the machine except `stg`: the state of a new
machine without Debian's stgit. As root, `scripts/build.sh` installs it with
apt (a no-op where the package already is, which still leaves `stg` off that
PATH, so build.sh must make the binary it installed reachable) and
`scripts/test.sh` then passes every tier. As any other user, build.sh stops
with one error naming the package before it downloads anything.

The scratch clone reuses the pinned downloads (copied into its own
`.cache/pin`, where fetch.sh checks their sha256 again) and the pip cache, so
that it stays within CI's time; nothing else is shared. Inside the nested
run, this module and the GPU-wheel build tests (covered by the outer run)
skip: HISPARSE_FRESH_CLONE is set there. For the same reason the nested
hisparse and upstream tiers collect every module but run only the first
test of each (ci/cpu_test_harness/fresh_clone_sample.py): the outer run
runs them all on a venv built the same way, and they do not depend on the
PATH this test is about. The tooling tier, which drives stg, runs in full.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HISPARSE_CACHE", ROOT / ".cache"))
NESTED = "HISPARSE_FRESH_CLONE"

pytestmark = pytest.mark.skipif(bool(os.environ.get(NESTED)),
                                reason="already inside a fresh-clone run")


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def path_without_stg(tmp: Path, path: str | None = None) -> str:
    """A PATH of links to every executable `path` (default: the current
    PATH) reaches, minus stg."""
    bin_dir = tmp / "bin-without-stg"
    bin_dir.mkdir()
    for d in (path or os.environ["PATH"]).split(os.pathsep):
        if not d or not os.path.isdir(d) or d.endswith("/tools/bin"):
            continue
        for entry in os.scandir(d):
            if entry.name == "stg" or (bin_dir / entry.name).exists():
                continue
            if entry.is_file() and os.access(entry.path, os.X_OK):
                (bin_dir / entry.name).symlink_to(entry.path)
    assert shutil.which("stg", path=str(bin_dir)) is None
    return str(bin_dir)


def clean_clone(dest: Path) -> Path:
    """The tracked files of this checkout (work in progress included) as a
    fresh git repository: what `git clone` of the commit would give."""
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                             stdout=subprocess.PIPE).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        src = ROOT / rel
        if not src.exists():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fresh clone"]):
        subprocess.run(["git", "-C", str(dest), *cmd], check=True, env=env)
    return dest


def up(key: str) -> str:
    for ln in (ROOT / "UPSTREAM").read_text().splitlines():
        if ln.startswith(key + "="):
            return ln.split("=", 1)[1]
    raise KeyError(key)


def scratch_env(clone: Path, path: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HISPARSE_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PATH=path, HOME=str(clone.parent / "home"), **{NESTED: "1"})
    (clone.parent / "home").mkdir(exist_ok=True)
    return env


def test_without_stg_a_non_root_build_stops_before_any_download():
    """One error naming the Debian package; no cache, no venv, no tree."""
    scratch = Path(tempfile.mkdtemp(prefix="hisparse-fresh-"))
    try:
        scratch.chmod(0o755)
        clone = clean_clone(scratch / "repo")
        # The system's tools only: a user's own (root's pyenv) are not theirs.
        path = path_without_stg(scratch, SYSTEM_PATH if os.geteuid() == 0 else None)
        env = scratch_env(clone, path)
        cmd = [str(clone / "scripts/build.sh")]
        if os.geteuid() == 0:
            # Really drop root: the apt path must not be taken.
            subprocess.run(["chmod", "-R", "a+rX", str(scratch)], check=True)
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"] + cmd
        proc = subprocess.run(cmd, cwd=clone, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.returncode != 0
        errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1, proc.stderr
        assert "stgit" in errors[0] and "apt-get install stgit" in errors[0]
        assert not (clone / ".cache").exists(), "something was written or downloaded"
        assert not (clone / ".venv").exists() and not (clone / "work").exists()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="installing Debian's stgit needs root")
def test_fresh_clone_runs_the_two_readme_commands(tmp_path: Path):
    clone = clean_clone(tmp_path / "repo")
    path = path_without_stg(tmp_path)
    env = scratch_env(clone, path)
    env["PIP_CACHE_DIR"] = str(CACHE / "pip")
    # The pinned downloads, re-checked by fetch.sh in the clone.
    (clone / ".cache/pin").mkdir(parents=True)
    for key in ("VLLM_SDIST_FILE", "VLLM_WHEEL_FILE"):
        src = CACHE / "pin" / up(key)
        if src.exists():
            shutil.copy2(src, clone / ".cache/pin" / src.name)
    build = subprocess.run(["scripts/build.sh"], cwd=clone, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert build.returncode == 0, build.stdout[-6000:]
    assert f"vLLM {(ROOT / 'VERSION').read_text().strip()}" in build.stdout
    # build.sh made the stg it installed reachable for every later script.
    assert (clone / ".cache/tools/bin/stg").exists()
    test = subprocess.run(["scripts/test.sh"], cwd=clone, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert test.returncode == 0, test.stdout[-8000:]
    assert "all requested tiers passed: tooling hisparse upstream kernels" in test.stdout
    # the hisparse tier and the upstream tier's runs each sampled, and only those
    samples = re.findall(r"^fresh-clone sample: (\d+) of (\d+) tests ran", test.stdout, re.M)
    upstream_runs = 1 + sum(1 for ln in (ROOT / "ci/upstream-suites.txt").read_text().splitlines()
                            if ln.strip() and not ln.startswith("#") and " " in ln)
    assert len(samples) == 1 + upstream_runs, test.stdout[-8000:]
    assert all(0 < int(kept) <= int(total) for kept, total in samples)


def sample_run(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    """pytest with the fresh-clone sample plugin on two small modules."""
    for name, n in (("test_a.py", 3), ("test_b.py", 2)):
        (tmp_path / name).write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(n)))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "fresh_clone_sample",
                           "-q", "-rA", str(tmp_path)], cwd=tmp_path, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env={**env, "PYTHONPATH": str(ROOT / "ci/cpu_test_harness")})


def test_sample_plugin_runs_the_first_test_of_each_module_only_when_nested(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != NESTED}
    refused = sample_run(tmp_path, env)
    assert refused.returncode != 0 and "nested fresh-clone run only" in refused.stdout
    nested = sample_run(tmp_path, {**env, NESTED: "1"})
    assert nested.returncode == 0, nested.stdout
    ran = sorted(re.findall(r"^PASSED (\S+)", nested.stdout, re.M))
    assert ran == ["test_a.py::test_0", "test_b.py::test_0"], nested.stdout
    assert "fresh-clone sample: 2 of 5 tests ran, the first of each of 2 modules" in nested.stdout
