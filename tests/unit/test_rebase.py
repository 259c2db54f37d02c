"""scripts/rebase.sh: fetch + hash-check another release, replay the series,
range-diff, and the report (categories, unmatched pairs, seams, collisions).

Offline, on a synthetic release "9.9.9" made from the pinned sdist with
edits chosen from the patches themselves: a changed outer context line of
the first patch (git am fails, -3 merges: "needed work"), a changed line
that a later patch removes (conflict), an upstream file at an overlay path
defining a class of ours, an upstream registration of one of our connector
names and an upstream field of the name one of our patches adds. Online,
the real 0.27.1 from PyPI (hash-checked against the index's digest).
In every case the pin does not move.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HISPARSE_CACHE", ROOT / ".cache"))
SERIES = [ln for ln in (ROOT / "patches/series").read_text().splitlines() if ln and not ln.startswith("#")]


def pinned_state() -> str:
    h = hashlib.sha256()
    for p in sorted([ROOT / "UPSTREAM", ROOT / "VERSION", *(ROOT / "patches").iterdir()]):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def rebase(args, env=None, check=True):
    proc = subprocess.run(["scripts/rebase.sh", *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-3000:] + proc.stderr[-6000:])
    return proc


def first_hunk(name: str) -> tuple[str, int, list[str]]:
    """(file, old start line, old-side lines) of a patch's first hunk."""
    text = (ROOT / f"patches/{name}.patch").read_text().splitlines()
    path = next(ln.split(" b/", 1)[1] for ln in text if ln.startswith("diff --git "))
    i = next(i for i, ln in enumerate(text) if ln.startswith("@@ "))
    start = int(re.match(r"@@ -(\d+)", text[i])[1])
    old = []
    for ln in text[i + 1:]:
        if ln.startswith(("@@", "diff --git")):
            break
        if ln[:1] in (" ", "-"):
            old.append(ln)
    return path, start, old


def hunks(name: str):
    """(file, old-side lines, index of each removed line among them) of
    every hunk of a patch, its message skipped."""
    cur, old, removed, in_hunk = None, [], [], False
    for ln in (ROOT / f"patches/{name}.patch").read_text().splitlines() + ["@@ end"]:
        if ln.startswith(("diff --git ", "@@")):
            if in_hunk:
                yield cur, old, removed
            old, removed, in_hunk = [], [], ln.startswith("@@") and cur is not None
            if ln.startswith("diff --git "):
                cur = ln.split(" b/", 1)[1]
        elif in_hunk and ln.startswith(("-", " ")):
            if ln.startswith("-"):
                removed.append(len(old))
            old.append(ln[1:])


def removed_line(name: str) -> tuple[str, list[str], int]:
    """(file, old-side lines of the hunk, index in them) of the patch's
    first removed line. The fixture finds the hunk in the pinned file by
    its lines, not by the removed line alone (a common line, a `for`
    header or a bracket, can occur earlier in the file) nor by the hunk's
    line number (earlier patches of the series may shift it)."""
    for path, old, removed in hunks(name):
        if removed:
            return path, old, removed[0]
    raise AssertionError(f"{name} removes no line")


def removes_a_line(name: str) -> bool:
    return any(removed for _, _, removed in hunks(name))


# The patch the synthetic release conflicts with: the first after SERIES[0]
# (whose context it shifts) that removes a line, in another file's hunk.
CONFLICTED = next(n for n in SERIES[1:] if removes_a_line(n))


def patch_files(name: str) -> set[str]:
    return {path for path, _, _ in hunks(name)}


# A patch the synthetic release leaves alone (neither the shifted context of
# SERIES[0] nor CONFLICTED's file): its seams must read unchanged.
UNTOUCHED = next(n for n in SERIES[1:] if n != CONFLICTED
                 and not patch_files(n) & (patch_files(SERIES[0]) | patch_files(CONFLICTED)))

# Patches that conflict at 0.27.1 and are to be redone there, each with its
# reason (docs/workflow.md "Move to a new pin"): a new conflict still fails it.
REDO_AT_0_27_1 = {
    # 0.27.1 rewrote OffloadingConnectorScheduler._build_store_jobs
    # (storable_chunks, the eagle tail) and still re-derives every request's
    # stores every step: the settled-request skip is to be rewritten there.
    "kv-offload-scheduler-skip-settled-requests",
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    subprocess.run([str(ROOT / "scripts/fetch.sh")], check=True, cwd=ROOT, stdout=subprocess.PIPE)
    tmp = tmp_path_factory.mktemp("release")
    up = dict(ln.split("=", 1) for ln in (ROOT / "UPSTREAM").read_text().splitlines() if "=" in ln and not ln.startswith("#"))
    with tarfile.open(CACHE / "pin" / up["VLLM_SDIST_FILE"]) as tf:
        tf.extractall(tmp, filter="data")
    src = tmp / f"vllm-{up['VLLM_VERSION']}"
    tree = tmp / "vllm-9.9.9"
    src.rename(tree)
    # 1. the first patch's outermost context line changes (far from its edit)
    path, start, old = first_hunk(SERIES[0])
    lines = (tree / path).read_text().splitlines(keepends=True)
    assert lines[start - 1].rstrip("\n") == old[0][1:]
    lines[start - 1] = lines[start - 1].rstrip("\n") + "  # 9.9.9\n"
    (tree / path).write_text("".join(lines))
    # 2. a line a later patch removes changes upstream: a real conflict
    cpath, hunk, index = removed_line(CONFLICTED)
    lines = (tree / cpath).read_text().splitlines(keepends=True)
    plain = [ln.rstrip("\n") for ln in lines]
    found = [i for i in range(len(plain) - len(hunk) + 1) if plain[i:i + len(hunk)] == hunk]
    assert len(found) == 1, f"{CONFLICTED}'s hunk occurs {len(found)} times in {cpath}"
    at = found[0] + index
    lines[at] = lines[at].rstrip("\n") + "  # changed in 9.9.9\n"
    (tree / cpath).write_text("".join(lines))
    # 3. upstream ships files at overlay paths, a connector of our name, a field of ours
    (tree / "vllm/v1/hisparse").mkdir()
    (tree / "vllm/v1/hisparse/__init__.py").write_text("")
    (tree / "vllm/v1/hisparse/layout.py").write_text("class HiSparseLayout:\n    pass\n")
    (tree / "vllm/v1/hisparse/upstream_only_module.py").write_text("")
    factory = tree / "vllm/distributed/kv_transfer/kv_connector/factory.py"
    text = factory.read_text()
    at = text.index("KVConnectorFactory.register_connector(")  # the first one, far from ours at the end
    factory.write_text(text[:at] + 'KVConnectorFactory.register_connector(\n    "HiSparseConnector",\n'
                       '    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector",\n    "HiSparseConnector",\n)\n\n'
                       + text[at:])
    vllm_cfg = tree / "vllm/config/cache.py"
    text = vllm_cfg.read_text()
    m = re.search(r"^class CacheConfig:\n(    \"\"\".*?\"\"\"\n)?", text, re.M | re.S)
    vllm_cfg.write_text(text[:m.end()] + "\n    hisparse_config: int | None = None\n" + text[m.end():])
    sdist = tmp / "vllm-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz", compresslevel=1) as tf:
        tf.add(tree, arcname="vllm-9.9.9")
    shutil.rmtree(tree)
    return sdist


def test_synthetic_release_report(synthetic: Path, tmp_path: Path):
    before = pinned_state()
    sha = hashlib.sha256(synthetic.read_bytes()).hexdigest()
    report = tmp_path / "report"
    rebase(["9.9.9", "--sha256", sha, "--report", str(report)], env={"HISPARSE_REBASE_SDIST": str(synthetic)})
    assert pinned_state() == before, "the pin moved"
    d = json.loads((report / "summary.json").read_text())
    cat = {p["patch"]: p for p in d["patches"]}
    assert cat[SERIES[0]]["git_am"] == "3way" and cat[SERIES[0]]["category"] == "needed work"
    assert cat[CONFLICTED]["category"] == "conflict"
    assert cat[CONFLICTED]["conflict_files"] == [removed_line(CONFLICTED)[0]]
    for n in SERIES:
        if n not in (SERIES[0], CONFLICTED):
            assert cat[n]["category"] == "unchanged", cat[n]
    # range-diff: one entry per old commit; the conflict is '<' and listed explicitly
    rd = (report / "range-diff.txt").read_text()
    assert len(re.findall(r"^\s*\d+:\s+[0-9a-f]+ [=!<]", rd, re.M)) == len(SERIES)
    assert [u["subject"] for u in d["unmatched"]] == [cat[CONFLICTED]["subject"]]
    # seams
    s = [r for r in d["seams"] if r["patch"] == SERIES[0]][0]
    # A hunk inside a function is judged by that function's source, one at
    # module level or in a class body by its own context lines.
    in_def = not (s["anchor"].startswith("module level") or s["anchor"].endswith("(class body)"))
    assert s["status"] == ("changed" if in_def else "context changed"), s
    assert all(r["status"] in ("same", "context same") for r in d["seams"] if r["patch"] == UNTOUCHED)
    # collisions, computed from overlay/MANIFEST and the patches
    c = d["collisions"]
    assert c["files"] == ["vllm/v1/hisparse/__init__.py", "vllm/v1/hisparse/layout.py"]
    pkg = {p["package"]: p for p in c["packages"]}["vllm/v1/hisparse"]
    assert pkg["upstream_only"] == ["vllm/v1/hisparse/upstream_only_module.py"]
    assert {x["file"]: x["both"] for x in c["classes"]}["vllm/v1/hisparse/layout.py"] == ["HiSparseLayout"]
    conn = {x["name"]: x["upstream"] for x in c["connectors"]}
    assert conn["HiSparseConnector"] and conn["HiSparseOffloadingConnector"] == []
    fields = {(x["class"], x["field"]): x["upstream"] for x in c["config_fields"]}
    assert fields[("AttentionConfig", "hisparse_config")] is None  # 9.9.9 has it on CacheConfig only
    md = (report / "summary.md").read_text()
    assert "`vllm/v1/hisparse/layout.py`" in md and "registered at 9.9.9 too" in md
    assert (report / "UPSTREAM.candidate").read_text().count(f"VLLM_SDIST_SHA256={sha}") == 1


def test_wrong_digest_is_refused(synthetic: Path, tmp_path: Path):
    proc = rebase(["9.9.9", "--sha256", "0" * 64, "--report", str(tmp_path)],
                  env={"HISPARSE_REBASE_SDIST": str(synthetic)}, check=False)
    assert proc.returncode != 0 and "sha256 mismatch for vllm-9.9.9.tar.gz" in proc.stderr
    assert not (tmp_path / "summary.md").exists()
    assert "is the pin already" in rebase(["0.26.0"], check=False).stderr


def test_real_release_from_pypi(tmp_path: Path):
    """0.27.1, the next pin: fetched from PyPI and checked against the
    digest the index publishes; the seams our hook patches sit in."""
    before = pinned_state()
    report = tmp_path / "r"
    rebase(["0.27.1", "--report", str(report)])
    assert pinned_state() == before
    d = json.loads((report / "summary.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{64}", d["sdist_sha256"])
    conflicts = {p["patch"] for p in d["patches"] if p["category"] == "conflict"}
    assert conflicts == REDO_AT_0_27_1
    assert {p["category"] for p in d["patches"] if p["patch"] not in conflicts} <= {"unchanged", "needed work"}
    seams = {(r["file"], r["anchor"]): r["status"] for r in d["seams"]}
    assert seams[("vllm/v1/core/kv_cache_utils.py", "get_kv_cache_configs")] == "same"
    assert seams[("vllm/v1/core/kv_cache_coordinator.py", "get_kv_cache_coordinator")] == "same"
    assert d["collisions"]["files"] == []
