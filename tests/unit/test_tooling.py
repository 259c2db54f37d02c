"""Tests of the series tooling on the real pin and the real patches (target S1).

Each test works on a private copy of the series repository (scripts, pin
record, patches, overlay) so it can break things on purpose; the pinned
source comes from the shared cache that scripts/fetch.sh fills.
"""

from __future__ import annotations

import hashlib
from email.parser import HeaderParser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HISPARSE_CACHE", ROOT / ".cache"))
FIRST_PATCH = "config-hisparse-subconfig"


def run(cmd: list[str], repo: Path, env: dict | None = None, check: bool = True):
    full_env = {**os.environ, "HISPARSE_CACHE": str(CACHE),
                "HISPARSE_WORK": str(repo / "work"), "HISPARSE_OUT": str(repo / "out"),
                **(env or {})}
    for k in ("HISPARSE_PATCHES", "HISPARSE_OVERLAY"):
        full_env.pop(k, None)
    proc = subprocess.run(cmd, cwd=repo, env=full_env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session", autouse=True)
def pin_in_cache():
    """The pin repository exists (built by fetch.sh from the cached sdist)."""
    run([str(ROOT / "scripts/fetch.sh")], ROOT)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Tracked files only: work in progress of others never leaks in."""
    r = tmp_path / "repo"
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "scripts", "patches", "overlay", "ci",
         "UPSTREAM", "VERSION"], check=True, text=True, stdout=subprocess.PIPE).stdout
    for rel in tracked.splitlines():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, r / rel)
    return r


def series(repo: Path) -> list[str]:
    return [ln for ln in (repo / "patches/series").read_text().splitlines()
            if ln and not ln.startswith("#")]


def subject_of(patch: Path) -> str:
    """The Subject header, unfolded (format-patch folds long subjects)."""
    value = HeaderParser().parsestr(patch.read_text(), headersonly=True)["Subject"]
    return " ".join(value.split())


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, text=True,
                          stdout=subprocess.PIPE).stdout.strip()


# --- apply -----------------------------------------------------------------

def test_apply_builds_pin_overlay_and_series(repo: Path):
    """S1: every patch applies with git am on pin + overlay, one commit each."""
    run(["scripts/apply.sh", "--to", "work/t"], repo)
    tree = repo / "work/t"
    names = series(repo)
    log = git(tree, "log", "--format=%s", "refs/patches/base..HEAD").splitlines()
    assert len(log) == len(names) >= 1
    subjects = [subject_of(repo / f"patches/{n}.patch") for n in names]
    assert log[::-1] == subjects  # subjects kept verbatim, [Category] included
    base_files = git(tree, "diff", "--name-only", "refs/patches/upstream-head", "refs/patches/base")
    overlay = sorted(str(p.relative_to(repo / "overlay")) for p in (repo / "overlay").rglob("*")
                     if p.is_file() and p.name != "MANIFEST")
    assert sorted(base_files.splitlines()) == overlay
    assert "hisparse_config: HiSparseConfig | None = None" in (
        tree / "vllm/config/attention.py").read_text()


def test_apply_is_reproducible(repo: Path):
    """Same pin + overlay + series => the same commit ids (immutable tags)."""
    run(["scripts/apply.sh", "--to", "work/a"], repo)
    run(["scripts/apply.sh", "--to", "work/b"], repo)
    assert git(repo / "work/a", "rev-parse", "HEAD") == git(repo / "work/b", "rev-parse", "HEAD")


def test_context_drift_fails_loudly(repo: Path):
    """S1: a context line that no longer matches fails apply (no fuzz):
    the error names the patch and prints the hunk that did not apply."""
    p = repo / f"patches/{FIRST_PATCH}.patch"
    text = p.read_text()
    drifted = text.replace("\n from vllm.config.utils import config\n",
                           "\n from vllm.config.utils import config  # drifted\n", 1)
    assert drifted != text
    p.write_text(drifted)
    proc = run(["scripts/apply.sh", "--to", "work/t"], repo, check=False)
    assert proc.returncode != 0
    assert f"patch '{FIRST_PATCH}' does not apply" in proc.stderr
    assert "hunk(s) that did not apply" in proc.stderr
    assert "+from vllm.config.hisparse import HiSparseConfig" in proc.stderr
    assert "# drifted" in proc.stderr


def test_dirty_tree_is_not_overwritten(repo: Path):
    run(["scripts/apply.sh", "--to", "work/t"], repo)
    f = repo / "work/t/vllm/config/attention.py"
    f.write_text(f.read_text() + "# local edit\n")
    proc = run(["scripts/apply.sh", "--to", "work/t"], repo, check=False)
    assert proc.returncode != 0 and "uncommitted changes" in proc.stderr
    assert "# local edit" in f.read_text()
    run(["scripts/apply.sh", "--to", "work/t", "--force"], repo)
    assert "# local edit" not in f.read_text()


def test_overlay_path_that_exists_in_the_pin_is_an_error(repo: Path):
    """A3: the overlay is for new files only."""
    target = repo / "overlay/vllm/config/attention.py"
    target.write_text("# shadows an upstream file\n")
    proc = run(["scripts/apply.sh", "--to", "work/t"], repo, check=False)
    assert proc.returncode != 0
    assert "vllm/config/attention.py" in proc.stderr
    assert "already exist in vLLM 0.26.0" in proc.stderr


# --- fetch -----------------------------------------------------------------

def test_tampered_sdist_fails_the_hash_check(repo: Path, tmp_path: Path):
    up = dict(ln.split("=", 1) for ln in (repo / "UPSTREAM").read_text().splitlines()
              if ln and not ln.startswith("#"))
    tampered = tmp_path / up["VLLM_SDIST_FILE"]
    data = bytearray((CACHE / "pin" / up["VLLM_SDIST_FILE"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    proc = run(["scripts/fetch.sh"], repo, check=False,
               env={"HISPARSE_CACHE": str(cache), "HISPARSE_SDIST": str(tampered)})
    assert proc.returncode != 0
    assert "sha256 mismatch" in proc.stderr
    assert up["VLLM_SDIST_SHA256"] in proc.stderr
    assert hashlib.sha256(bytes(data)).hexdigest() in proc.stderr
    assert not (cache / "pin" / up["VLLM_SDIST_FILE"]).exists()
    assert not (cache / "pin" / f"vllm-{up['VLLM_VERSION']}.git").exists()


def test_tampered_cached_sdist_is_refused(repo: Path, tmp_path: Path):
    """A cache that was modified after download is not trusted either."""
    up = dict(ln.split("=", 1) for ln in (repo / "UPSTREAM").read_text().splitlines()
              if ln and not ln.startswith("#"))
    cache = tmp_path / "cache"
    (cache / "pin").mkdir(parents=True)
    (cache / "pin" / up["VLLM_SDIST_FILE"]).write_bytes(b"not the release")
    proc = run(["scripts/fetch.sh"], repo, check=False, env={"HISPARSE_CACHE": str(cache)})
    assert proc.returncode != 0 and "sha256 mismatch" in proc.stderr


def test_git_source_with_the_wrong_commit_is_refused(repo: Path, tmp_path: Path):
    """fetch --git verifies the commit against UPSTREAM's VLLM_COMMIT."""
    src = tmp_path / "mirror"
    src.mkdir()
    (src / "README").write_text("not vllm\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "README"], ["commit", "-qm", "x"], ["tag", "v0.26.0"]):
        subprocess.run(["git", "-C", str(src), *cmd], check=True, env={**os.environ, **env})
    proc = run(["scripts/fetch.sh", "--git", str(src)], repo, check=False,
               env={"HISPARSE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode != 0 and "commit mismatch" in proc.stderr


# --- lint ------------------------------------------------------------------

def lint(repo: Path) -> subprocess.CompletedProcess:
    return run(["scripts/validate.sh", "--lint-only"], repo, check=False)


def test_lint_passes_on_the_real_series(repo: Path):
    proc = lint(repo)
    assert proc.returncode == 0, proc.stderr


def drop_line(repo: Path, prefix: str) -> None:
    p = repo / f"patches/{FIRST_PATCH}.patch"
    lines = p.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.startswith(prefix)]
    assert len(kept) == len(lines) - 1
    p.write_text("".join(kept))


@pytest.mark.parametrize(("prefix", "message"), [
    ("Upstream-Status:", "missing 'Upstream-Status:' trailer"),
    ("Signed-off-by:", "missing 'Signed-off-by:' (DCO)"),
    ("Drop-When:", "missing 'Drop-When:' trailer"),
    ("Fork-Test:", "missing 'Fork-Test:' trailer"),
])
def test_missing_trailer_fails_lint(repo: Path, prefix: str, message: str):
    drop_line(repo, prefix)
    proc = lint(repo)
    assert proc.returncode != 0
    assert message in proc.stderr and FIRST_PATCH in proc.stderr


def test_abbreviated_index_line_fails_lint(repo: Path):
    p = repo / f"patches/{FIRST_PATCH}.patch"
    text = p.read_text()
    p.write_text("\n".join(
        (f"index {ln.split()[1].split('..')[0][:7]}..{ln.split()[1].split('..')[1][:7]} 100644"
         if ln.startswith("index ") else ln) for ln in text.split("\n")))
    proc = lint(repo)
    assert proc.returncode != 0 and "full 40-hex 'index' line" in proc.stderr


def test_series_and_files_must_match(repo: Path):
    shutil.copy2(repo / f"patches/{FIRST_PATCH}.patch", repo / "patches/config-orphan.patch")
    with (repo / "patches/series").open("a") as f:
        f.write("config-missing\n")
    proc = lint(repo)
    assert "patches/config-orphan.patch is not listed in series" in proc.stderr
    assert "series names 'config-missing'" in proc.stderr


def test_patch_touching_an_overlay_path_fails_lint(repo: Path):
    """L5: patches never touch overlay paths."""
    p = repo / f"patches/{FIRST_PATCH}.patch"
    p.write_text(p.read_text().replace("vllm/config/attention.py", "vllm/config/hisparse.py"))
    proc = lint(repo)
    assert proc.returncode != 0 and "touches overlay path vllm/config/hisparse.py" in proc.stderr


def test_stale_manifest_fails_lint(repo: Path):
    (repo / "overlay/vllm/v1/hisparse/new_module.py").write_text("# new\n")
    proc = lint(repo)
    assert proc.returncode != 0 and "MANIFEST does not match" in proc.stderr


# --- stack / export --------------------------------------------------------

def stg(tree: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["stg", *args], cwd=tree, env=env, check=True, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE).stdout.strip()


def test_stack_names_equal_series_and_export_round_trips(repo: Path):
    """S1: stgit patch names are the file names; export is byte-identical."""
    run(["scripts/stack.sh", "--to", "work/s"], repo)
    assert stg(repo / "work/s", "series", "--noprefix").splitlines() == series(repo)
    before = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    run(["scripts/export.sh", "--from", "work/s", "--check"], repo)
    run(["scripts/export.sh", "--from", "work/s"], repo)
    assert {p.name: p.read_bytes() for p in (repo / "patches").iterdir()} == before


def test_export_check_reports_a_changed_patch(repo: Path):
    """A2: an edit in the stack makes --check fail and name the file, with
    the refreshed copy written for the contributor."""
    tree = repo / "work/s"
    run(["scripts/stack.sh", "--to", "work/s"], repo)
    f = tree / "vllm/config/attention.py"
    f.write_text(f.read_text().replace("None disables it.", "Unset disables it."))
    stg(tree, "refresh", "-p", FIRST_PATCH)
    proc = run(["scripts/export.sh", "--from", "work/s", "--check"], repo, check=False)
    assert proc.returncode != 0
    assert f"patches/{FIRST_PATCH}.patch" in proc.stderr
    refreshed = repo / f"out/refreshed-patches/{FIRST_PATCH}.patch"
    assert "Unset disables it." in refreshed.read_text()
    run(["scripts/export.sh", "--from", "work/s"], repo)
    assert "Unset disables it." in (repo / f"patches/{FIRST_PATCH}.patch").read_text()
    run(["scripts/export.sh", "--from", "work/s", "--check"], repo)


def test_export_before_stack_names_the_missing_stack(repo: Path):
    """A newcomer's first --check, before scripts/stack.sh: one line saying
    what to run, not cd's error."""
    for args in (["--check"], []):
        proc = run(["scripts/export.sh", *args], repo, check=False)
        assert proc.returncode != 0
        assert proc.stderr.splitlines() == [
            "[export.sh] error: no stack at work/vllm: run scripts/stack.sh first"]
    assert not (repo / "out/refreshed-patches").exists()


def test_hand_edited_patch_file_fails_the_round_trip(repo: Path):
    """Patch files are generated: a non-canonical file (here one written by
    plain `git format-patch`, which appends a version signature) applies,
    but the round-trip check catches it."""
    p = repo / f"patches/{FIRST_PATCH}.patch"
    p.write_text(p.read_text() + "-- \n2.39.5\n\n")
    run(["scripts/stack.sh", "--to", "work/s"], repo)
    proc = run(["scripts/export.sh", "--from", "work/s", "--check"], repo, check=False)
    assert proc.returncode != 0 and f"patches/{FIRST_PATCH}.patch" in proc.stderr


def add_docs_patch(repo: Path, name: str, subject: str, status: str) -> None:
    """The house workflow on a fresh stack: stg new, edit, refresh, export."""
    tree = repo / "work/s"
    run(["scripts/stack.sh", "--to", "work/s"], repo)
    stg(tree, "new", name, "-m",
        f"[Doc] docs: {subject}\n\nWhy: test.\n\nUpstream-Status: {status}\n"
        "Drop-When: never\nFork-Test: none\nSigned-off-by: t <t@t>")
    (tree / "docs/hisparse-example.md").write_text("example\n")
    subprocess.run(["git", "-C", str(tree), "add", "docs/hisparse-example.md"], check=True)
    stg(tree, "refresh")
    run(["scripts/export.sh", "--from", "work/s"], repo)


def test_new_stg_patch_is_exported_in_order(repo: Path):
    """stg new + refresh + export adds a file and a series line named after
    the stgit patch, not after its subject."""
    add_docs_patch(repo, "docs-example", "example", "Inappropriate [build-infra]")
    assert series(repo)[-1] == "docs-example"
    assert (repo / "patches/docs-example.patch").read_text().startswith(
        "From 0000000000000000000000000000000000000000")
    assert lint(repo).returncode == 0


def test_status_order_is_enforced(repo: Path):
    """Backports first, then pending/submitted, then fork-only patches."""
    add_docs_patch(repo, "docs-late-pending", "pending after fork-only", "Pending")
    proc = lint(repo)
    assert proc.returncode != 0 and "L4 order: docs-late-pending" in proc.stderr


def test_unapplied_patch_blocks_export(repo: Path):
    tree = repo / "work/s"
    run(["scripts/stack.sh", "--to", "work/s"], repo)
    stg(tree, "pop")
    proc = run(["scripts/export.sh", "--from", "work/s"], repo, check=False)
    assert proc.returncode != 0 and "unapplied patches would be lost" in proc.stderr


def test_refresh_base_picks_up_overlay_edits(repo: Path):
    """stack.sh --refresh-base rebases the stack onto pin + current overlay."""
    tree = repo / "work/s"
    run(["scripts/stack.sh", "--to", "work/s"], repo)
    (repo / "overlay/vllm/v1/hisparse/added.py").write_text("# added\n")
    run(["scripts/stack.sh", "--refresh-base", "--to", "work/s"], repo)
    assert (tree / "vllm/v1/hisparse/added.py").read_text() == "# added\n"
    assert stg(tree, "series", "--noprefix").splitlines() == series(repo)
    # The rebuild keeps every patch byte for byte (author dates included)
    # and refreshes the MANIFEST for the new overlay file.
    before = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    run(["scripts/export.sh", "--from", "work/s", "--check"], repo)
    assert {p.name: p.read_bytes() for p in (repo / "patches").iterdir()} == before
    assert "vllm/v1/hisparse/added.py" in (repo / "overlay/MANIFEST").read_text()
    assert lint(repo).returncode == 0


def test_full_validate_passes(repo: Path):
    """The apply tier: stack, export round-trip, nothing already upstream."""
    run(["scripts/validate.sh"], repo)
