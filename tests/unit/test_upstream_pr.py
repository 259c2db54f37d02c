"""scripts/upstream-pr.sh on a local git repository of the pin
(.cache/pin/vllm-0.26.0.git, built by scripts/fetch.sh)."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HISPARSE_CACHE", ROOT / ".cache"))
PIN = CACHE / "pin/vllm-0.26.0.git"
SERIES = [ln for ln in (ROOT / "patches/series").read_text().splitlines() if ln and not ln.startswith("#")]
OVERLAY = {p.relative_to(ROOT / "overlay").as_posix() for p in (ROOT / "overlay").rglob("*")
           if p.is_file() and p.name != "MANIFEST" and "__pycache__" not in p.parts}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, text=True,
                          stdout=subprocess.PIPE).stdout


def pr(args, check=True):
    proc = subprocess.run(["scripts/upstream-pr.sh", *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    subprocess.run([str(ROOT / "scripts/fetch.sh")], check=True, cwd=ROOT, stdout=subprocess.PIPE)
    repo = tmp_path_factory.mktemp("upstream") / "vllm"
    subprocess.run(["git", "clone", "-q", "--local", str(PIN), str(repo)], check=True)
    return repo


def overlay_imports(path: str) -> set[str]:
    """Overlay files a folded Python file imports (absolute imports only)."""
    found = set()
    tree = ast.parse((ROOT / "overlay" / path).read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            stem = n.replace(".", "/")
            for cand in (f"{stem}.py", f"{stem}/__init__.py"):
                if cand in OVERLAY:
                    found.add(cand)
    return found


@pytest.mark.parametrize("name", SERIES)
def test_branch_holds_the_patch_and_the_overlay_it_needs(checkout: Path, tmp_path: Path, name: str):
    out = tmp_path / "pr"
    proc = pr([name, "--repo", str(checkout), "--out", str(out)])
    branch = f"upstream/{name}"
    assert f"branch:  {branch}" in proc.stdout
    pin = git(checkout, "rev-parse", "pin^{commit}").strip()
    assert git(checkout, "rev-list", f"{pin}..{branch}").split() == [git(checkout, "rev-parse", branch).strip()]
    msg = git(checkout, "log", "-1", "--format=%B", branch)
    patch = (ROOT / f"patches/{name}.patch").read_text()
    for t in ("Upstream-Status:", "Drop-When:", "Fork-Test:"):
        assert t in patch and t not in msg
    assert "Signed-off-by: " in msg
    author = next(ln for ln in patch.splitlines() if ln.startswith("From: ")).split(": ", 1)[1]
    assert git(checkout, "log", "-1", "--format=%an", branch).strip() in author
    changed = set(git(checkout, "diff", "--name-only", pin, branch).split())
    touched = {ln.split(" b/", 1)[1] for ln in patch.splitlines() if ln.startswith("diff --git ")}
    folded = changed - touched
    assert touched <= changed and folded <= OVERLAY
    for f in folded:  # folded files are the overlay's, byte for byte
        assert git(checkout, "show", f"{branch}:{f}") == (ROOT / "overlay" / f).read_text()
    for f in folded:  # and the closure is closed under imports
        if f.endswith(".py"):
            assert overlay_imports(f) <= folded, (f, overlay_imports(f) - folded)
    # title and body in vLLM's template
    subject = next(ln for ln in patch.splitlines() if ln.startswith("Subject: "))[9:]
    assert (out / "title.txt").read_text().strip().startswith(subject.strip())
    body = (out / "body.md").read_text()
    template = git(checkout, "show", "pin:.github/PULL_REQUEST_TEMPLATE.md")
    for head in ("## Purpose", "## Test Plan", "## Test Result"):
        after = body.split(head + "\n", 1)[1].lstrip("\n")
        assert not after.startswith("## ") and not after.startswith("---"), f"{head} left empty"
    assert template.split("---", 1)[1] in body  # checklist kept verbatim
    assert "Upstream-Status" not in body and "Drop-When" not in body
    for f in sorted(folded):
        assert f"`{f}`" in body


def test_build_patch_folds_every_kernel_source(checkout: Path, tmp_path: Path):
    pr(["build-hisparse-ext", "--repo", str(checkout), "--out", str(tmp_path)])
    files = set(git(checkout, "ls-tree", "-r", "--name-only", "upstream/build-hisparse-ext", "csrc/hisparse").split())
    want = {f for f in OVERLAY if f.startswith("csrc/hisparse/") and f.endswith((".cu", ".cpp", ".h", ".cuh", ".cmake"))}
    assert want <= files


def test_refusals(checkout: Path, tmp_path: Path):
    assert "no patch 'nope'" in pr(["nope", "--repo", str(checkout)], check=False).stderr
    # a base that is not the pin
    git(checkout, "checkout", "-q", "-B", "elsewhere", "pin")
    (checkout / "README.md").write_text("changed\n")
    subprocess.run(["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qam", "not the pin"], check=True)
    proc = pr([SERIES[0], "--repo", str(checkout), "--base", "elsewhere"], check=False)
    assert proc.returncode != 0 and "is not the pin" in proc.stderr
    # uncommitted work is never overwritten
    (checkout / "README.md").write_text("dirty\n")
    proc = pr([SERIES[0], "--repo", str(checkout)], check=False)
    assert proc.returncode != 0 and "uncommitted changes" in proc.stderr
    git(checkout, "checkout", "-q", "--", "README.md")
