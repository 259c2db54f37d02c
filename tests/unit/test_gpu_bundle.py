"""The GPU bundle (scripts/bundle.sh, scripts/test-gpu.sh, scripts/gpu_bundle.py).

Fast tests (seconds, always on): the part packer (size limit, standalone and
deterministic .tar.xz, no .pyc), the manifest check, the rule files, and
test-gpu.sh on a machine without a GPU (prints "skipped", exits 0, creates
nothing; --print-env output is valid shell) and on a faked GPU against a
synthetic bundle (unpack once, patch every call, stale-bundle refusal,
--print-env exports, logs under $OUT).

The real bundle (pinned wheel + ~35 MB of dependency wheels, cached under
.cache/; the first base build compresses ~280 MB and takes minutes on two
cores) is built only when HISPARSE_TEST_GPU_BUNDLE=1: parts within the limit,
sha256 as in bundle.json, the expected members, no .pyc/__pycache__.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "scripts/gpu_bundle.py"
CONF = ROOT / "scripts/gpu-bundle"
MIB = 1 << 20
FULL = os.environ.get("HISPARSE_TEST_GPU_BUNDLE") == "1"


def sh(cmd, env=None, cwd=ROOT, check=True):
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def members(part: Path) -> list[str]:
    with tarfile.open(part, "r:xz") as t:
        return t.getnames()


def pack(root: Path, out: Path, part_mib: float, **kw) -> dict:
    args = [sys.executable, str(TOOL), "pack", "--root", str(root), "--out", str(out),
            "--name", kw.get("name", "base"), "--json", str(out / "pack.json"),
            "--part-mib", str(part_mib), "--preset", str(kw.get("preset", 0)),
            "--split-mib", str(kw.get("split_mib", 4)), "--jobs", "2"]
    out.mkdir(parents=True, exist_ok=True)
    sh(args)
    return json.loads((out / "pack.json").read_text())


# --- the packer --------------------------------------------------------------

@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """~1.6 MiB of incompressible files in a few folders, plus junk to drop."""
    r = tmp_path / "tree"
    for i in range(6):
        d = r / f"pkg{i}" / "sub"
        d.mkdir(parents=True)
        (d / "data.bin").write_bytes(os.urandom(256 * 1024 + i))
        (d / "mod.py").write_text(f"X = {i}\n")
        (d / "__pycache__").mkdir()
        (d / "__pycache__" / "mod.cpython-312.pyc").write_bytes(b"junk")
        (d / "stale.pyc").write_bytes(b"junk")
    (r / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (r / "run.sh").chmod(0o755)
    long = r / ("x" * 60) / ("y" * 60)
    long.mkdir(parents=True)
    (long / "long_name.txt").write_text("a path over 100 characters needs pax headers\n")
    return r


def test_pack_splits_under_the_limit_into_standalone_archives(tree: Path, tmp_path: Path):
    summary = pack(tree, tmp_path / "out", part_mib=0.6, split_mib=0.1)
    parts = summary["parts"]
    assert len(parts) >= 3
    names = []
    for p in parts:
        f = tmp_path / "out" / p["file"]
        assert f.stat().st_size == p["bytes"] <= 0.6 * MIB
        assert sha256(f) == p["sha256"]
        names += members(f)  # each part opens alone (Python's lzma + tarfile)
        listing = sh(["tar", "-tJf", str(f)]).stdout.split()  # and with GNU tar
        assert sorted(listing) == sorted(members(f))
    want = sorted(str(p.relative_to(tree)) for p in tree.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    assert sorted(names) == want
    assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]


def test_pack_is_deterministic_and_keeps_modes(tree: Path, tmp_path: Path):
    a = pack(tree, tmp_path / "a", part_mib=4)
    os.utime(tree / "run.sh", (1, 1))  # mtimes never reach the archive
    b = pack(tree, tmp_path / "b", part_mib=4)
    assert [p["sha256"] for p in a["parts"]] == [p["sha256"] for p in b["parts"]]
    dest = tmp_path / "x"
    dest.mkdir()
    sh(["tar", "-xJf", str(tmp_path / "a" / a["parts"][0]["file"]), "-C", str(dest)])
    assert os.access(dest / "run.sh", os.X_OK)
    assert not os.access(dest / "pkg0/sub/mod.py", os.X_OK)
    assert (dest / ("x" * 60) / ("y" * 60) / "long_name.txt").is_file()


def test_pack_refuses_a_unit_over_the_limit(tmp_path: Path):
    r = tmp_path / "big"
    r.mkdir()
    (r / "blob").write_bytes(os.urandom(300 * 1024))
    proc = sh([sys.executable, str(TOOL), "pack", "--root", str(r), "--out", str(tmp_path / "o"),
               "--name", "base", "--json", str(tmp_path / "o.json"), "--part-mib", "0.1",
               "--preset", "0"], check=False)
    assert proc.returncode != 0 and "over the part limit" in proc.stderr


# --- rule files ----------------------------------------------------------------

def rules(name: str) -> list[str]:
    return [ln for ln in (CONF / name).read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def test_every_exclusion_and_trim_has_a_reason():
    for ln in rules("excluded.txt") + rules("trim.txt"):
        assert len(ln.split(None, 1)) == 2, ln
    for ln in rules("precompiled.txt"):
        kind, rest = ln.split(None, 1)
        assert kind in ("exclude", "prune"), ln
        if kind == "exclude":
            assert len(rest.split(None, 1)) == 2, ln


def test_deps_are_pinned_and_disjoint_from_image_and_exclusions():
    norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
    deps = {}
    for ln in rules("deps.txt"):
        spec = ln.split("#", 1)[0].strip()
        name, sep, ver = spec.partition("==")
        assert sep and ver, ln
        deps[norm(name)] = ver
    image = {norm(ln.split("#")[0].strip()) for ln in rules("image-packages.txt")}
    excluded = {norm(ln.split()[0]) for ln in rules("excluded.txt")}
    assert deps and not set(deps) & image and not set(deps) & excluded
    # the OpenAI-compatible server's stack is shipped (the image lacks it)
    for name in ("fastapi", "starlette", "uvicorn", "openai", "pydantic",
                 "prometheus-fastapi-instrumentator", "partial-json-parser"):
        assert name in deps, name


def test_deps_closure_against_cached_wheels():
    """Every requirement of vLLM and of each shipped wheel is shipped, in
    the image or excluded (offline; needs the caches bundle.sh fills)."""
    up = dict(ln.split("=", 1) for ln in (ROOT / "UPSTREAM").read_text().splitlines()
              if "=" in ln and not ln.startswith("#"))
    cache = Path(os.environ.get("HISPARSE_CACHE", ROOT / ".cache"))
    wheel = cache / "pin" / up["VLLM_WHEEL_FILE"]
    wheels = cache / "gpu-bundle/wheels"
    if not wheel.is_file() or not wheels.is_dir():
        pytest.skip("no cached vLLM wheel / dependency wheels (scripts/bundle.sh fills them)")
    sh([sys.executable, str(TOOL), "deps-check", "--wheel", str(wheel), "--cache", str(wheels)])


# --- test-gpu.sh without a GPU -------------------------------------------------

def no_gpu_env(tmp_path: Path) -> dict:
    path = "/usr/bin:/bin"
    if any(Path(d, "nvidia-smi").exists() for d in path.split(":")):
        pytest.skip("nvidia-smi is on this machine")
    return {"PATH": path, "OUT": str(tmp_path / "out")}


def test_test_gpu_skips_without_a_gpu_and_does_nothing_else(tmp_path: Path):
    env = no_gpu_env(tmp_path)
    (tmp_path / "out").mkdir()
    stage = tmp_path / "stage"
    proc = sh(["bash", "scripts/test-gpu.sh", "--stage", str(stage),
               "--bundle", str(tmp_path / "bundle")], env=env)
    assert proc.returncode == 0
    assert proc.stdout.strip().startswith("test-gpu.sh: skipped")
    assert not stage.exists()
    assert not any((tmp_path / "out").iterdir())


def test_print_env_without_a_gpu_is_valid_shell(tmp_path: Path):
    env = no_gpu_env(tmp_path)
    stage = tmp_path / "stage"
    proc = sh(["bash", "scripts/test-gpu.sh", "--print-env", "--stage", str(stage)], env=env)
    assert "skipped" in proc.stderr
    sh(["bash", "-n", "-c", proc.stdout])
    check = sh(["bash", "-euc", f'eval "$(bash scripts/test-gpu.sh --print-env --stage {stage} 2>/dev/null)"; echo evaluated'],
               env=env)
    assert check.stdout.strip() == "evaluated"
    assert not stage.exists()


# --- test-gpu.sh on a faked GPU, against a synthetic bundle ----------------------

FAKE_BUILD_KERNELS = """#!/usr/bin/env bash
# fake build-kernels.sh: writes a package that imports, nothing more
out=""
while [[ $# -gt 0 ]]; do [[ $1 == --out ]] && out=$2; shift; done
mkdir -p "$out/hisparse_ops" && echo 'BUILD_INFO = {"fake": True}' > "$out/hisparse_ops/__init__.py"
echo "fake kernels built"
"""


@pytest.fixture
def fake_gpu(tmp_path: Path):
    """A repo copy (scripts, patches, overlay), a bundle built from small
    trees with the real packer, a fake nvidia-smi and a fake torch."""
    repo = tmp_path / "repo"
    for d in ("scripts", "patches", "overlay"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("__pycache__"))
    bundle = repo / ".gpu/bundle"
    base, patch = tmp_path / "base", tmp_path / "patch"
    (base / "site/fakedep").mkdir(parents=True)
    (base / "site/fakedep/__init__.py").write_text("")
    (base / "site/fakedep-1.0.dist-info").mkdir()
    (base / "site/fakedep-1.0.dist-info/METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakedep\nVersion: 1.0\nRequires-Dist: alsonotthere\n\n")
    (base / "vllm-bin/vllm/third_party").mkdir(parents=True)
    (base / "vllm-bin/vllm/_C_stable_libtorch.abi3.so").write_bytes(b"\x7fELF fake")
    (base / "vllm-bin/vllm/third_party/vendored.py").write_text("VENDORED = 1\n")
    (patch / "site/vllm").mkdir(parents=True)
    (patch / "site/vllm/__init__.py").write_text("__version__ = '0.26.0'\n")
    (patch / "site/vllm/third_party").mkdir()
    (patch / "site/vllm/third_party/__init__.py").write_text("")
    di = patch / "site/vllm-0.26.0+hisparse.1.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0+hisparse.1\n"
                                 "Requires-Dist: fakedep>=1.0\nRequires-Dist: flashinfer-python==0.6.14\n"
                                 "Requires-Dist: notthere>=2\n\n")
    (patch / "kernels/scripts").mkdir(parents=True)
    (patch / "kernels/scripts/build-kernels.sh").write_text(FAKE_BUILD_KERNELS)
    (patch / "kernels/overlay/csrc/hisparse").mkdir(parents=True)
    (patch / "kernels/overlay/csrc/hisparse/gather.cu").write_text("// fake\n")
    pb, pp = pack(base, bundle / "b", 8), pack(patch, bundle / "p", 8, name="patch")
    for sub in ("b", "p"):
        for f in (bundle / sub).glob("*.tar.xz"):
            f.rename(bundle / f.name)
        shutil.rmtree(bundle / sub)
    series_sha = hashlib.sha256(b"".join(
        p.read_bytes() for p in [repo / "patches/series"] + sorted((repo / "patches").glob("*.patch")))
    ).hexdigest()[:16]
    manifest_text = sh([sys.executable, str(repo / "scripts/patchtool.py"), "manifest",
                        "--root", str(repo)]).stdout
    overlay_sha = hashlib.sha256(manifest_text.encode()).hexdigest()[:16]
    cat = lambda parts: hashlib.sha256("".join(p["sha256"] for p in parts).encode()).hexdigest()  # noqa: E731
    (bundle / "bundle.json").write_text(json.dumps({
        "format": 1, "version": "0.26.0+hisparse.1", "git_commit": "0" * 40, "git_dirty": False,
        "series_sha": series_sha, "overlay_sha": overlay_sha, "part_mib": 8,
        "base": {"sha256": cat(pb["parts"]), "part_mib": 8, "parts": pb["parts"],
                 "deps": {"fakedep": "1.0"}},
        "patch": {"sha256": cat(pp["parts"]), "part_mib": 8, "parts": pp["parts"],
                  "kernel_sources_sha": "k", "prebuilt_kernels": None},
        "excluded_packages": {"flashinfer-python": "not shipped"}}))
    fakebin, faketorch = tmp_path / "bin", tmp_path / "faketorch/torch"
    fakebin.mkdir()
    (fakebin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake H200 (UUID: GPU-0)'\n")
    (fakebin / "nvidia-smi").chmod(0o755)
    (fakebin / "python3").symlink_to(sys.executable)
    faketorch.mkdir(parents=True)
    (faketorch / "__init__.py").write_text(
        "__version__ = '2.11.0+fake'\nclass cuda:\n    @staticmethod\n    def is_available():\n        return True\n")
    env = {"PATH": f"{fakebin}:/usr/bin:/bin", "PYTHONPATH": str(faketorch.parent),
           "OUT": str(tmp_path / "out"), "HISPARSE_GPU_PYTHON": sys.executable}
    return repo, tmp_path / "stage", env


def test_test_gpu_unpacks_once_and_reports(fake_gpu):
    repo, stage, env = fake_gpu
    run = lambda *a: sh(["bash", "scripts/test-gpu.sh", "--stage", str(stage), *a],  # noqa: E731
                        env=env, cwd=repo, check=False)
    first = run("--only", "e2e,serve")
    # the fake kernels cannot pass the GPU smoke test: a setup failure, reported
    assert first.returncode == 1, first.stdout + first.stderr
    assert "base: unpacking" in first.stdout and "kernels: building" in first.stdout
    assert "kernels-smoke" in first.stdout
    assert "missing ['notthere>=2']" in first.stdout  # requirement report
    assert "requirements missing ['fakedep: alsonotthere']" in first.stdout
    assert "1 excluded requirement(s) absent" in first.stdout
    site = stage / "patch/site/vllm"
    assert (site / "_C_stable_libtorch.abi3.so").is_file()  # base merged into vllm/
    assert (site / "third_party/vendored.py").is_file() and (site / "third_party/__init__.py").is_file()
    out = Path(env["OUT"])
    summary = json.loads((out / "test-gpu.json").read_text())
    assert summary["status"] == "failed" and summary["setup_failed"] == ["kernels-smoke"]
    assert summary["tiers"]["e2e"]["status"].startswith("skipped")
    assert (out / "test-gpu.log").is_file()
    second = run("--only", "e2e")
    assert "base: already unpacked" in second.stdout and "patch: unpacking" in second.stdout
    assert "kernels: unchanged since the last build" in second.stdout


def test_test_gpu_print_env_exports(fake_gpu):
    repo, stage, env = fake_gpu
    proc = sh(["bash", "scripts/test-gpu.sh", "--print-env", "--stage", str(stage)],
              env=env, cwd=repo, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines and all(ln.startswith(("export ", "#")) for ln in lines), proc.stdout
    sh(["bash", "-n", "-c", proc.stdout])
    shown = sh(["bash", "-c", proc.stdout + '\necho "$PYTHONPATH|$VLLM_USE_FLASHINFER_SAMPLER|'
                '$HF_HUB_OFFLINE|$PYTHONUNBUFFERED|$VLLM_CACHE_ROOT|$PATH"'], env=env).stdout.strip()
    pythonpath, sampler, offline, unbuf, cache, path = shown.split("|")
    parts = pythonpath.split(":")
    assert parts[0] == str(stage / "hisparse_ops_build")
    assert parts[1] == str(stage / "patch/site") and parts[2] == str(stage / "base/site")
    assert (sampler, offline, unbuf) == ("0", "1", "1")
    assert cache.startswith(str(stage))
    assert path.split(":")[0] == str(stage / "bin") and (stage / "bin/vllm").is_file()
    assert "[test-gpu" in proc.stderr  # progress went to stderr


FAKE_CLI_MAIN = """import multiprocessing


def child():
    print("spawned child ran")


def main():
    # what vllm serve does: start a worker with the spawn method
    proc = multiprocessing.get_context("spawn").Process(target=child)
    proc.start()
    proc.join(60)
    return proc.exitcode
"""


def test_vllm_shim_survives_a_spawned_child(fake_gpu, tmp_path: Path):
    """A spawn child re-runs the shim as __mp_main__: without the __main__
    guard it starts the CLI again while bootstrapping and dies."""
    repo, stage, env = fake_gpu
    sh(["bash", "scripts/test-gpu.sh", "--print-env", "--stage", str(stage)],
       env=env, cwd=repo, check=False)
    shim = stage / "bin/vllm"
    assert 'if __name__ == "__main__":' in shim.read_text()
    cli = tmp_path / "fakevllm/vllm/entrypoints/cli"
    cli.mkdir(parents=True)
    for d in (cli, cli.parent, cli.parent.parent):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text(FAKE_CLI_MAIN)
    proc = subprocess.run([str(shim)], env={**os.environ, "PYTHONPATH": str(tmp_path / "fakevllm")},
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "spawned child ran"


def test_test_gpu_refuses_a_stale_bundle(fake_gpu):
    repo, stage, env = fake_gpu
    f = next((repo / "overlay").rglob("*.py"))
    f.write_text(f.read_text() + "# changed after bundling\n")
    proc = sh(["bash", "scripts/test-gpu.sh", "--stage", str(stage), "--only", "e2e"],
              env=env, cwd=repo, check=False)
    assert proc.returncode == 1 and "the bundle is stale" in proc.stdout
    proc = sh(["bash", "scripts/test-gpu.sh", "--stage", str(stage), "--only", "e2e", "--allow-stale"],
              env=env, cwd=repo, check=False)
    assert "WARNING: the bundle is stale" in proc.stdout


def test_test_gpu_refuses_a_damaged_part(fake_gpu):
    repo, stage, env = fake_gpu
    part = next((repo / ".gpu/bundle").glob("patch-*.tar.xz"))
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    proc = sh(["bash", "scripts/test-gpu.sh", "--stage", str(stage), "--only", "e2e"],
              env=env, cwd=repo, check=False)
    assert proc.returncode == 1 and "patch parts missing or damaged" in proc.stdout


# --- the real bundle (HISPARSE_TEST_GPU_BUNDLE=1) --------------------------------

@pytest.fixture(scope="module")
def real_bundle(tmp_path_factory):
    if not FULL:
        pytest.skip("set HISPARSE_TEST_GPU_BUNDLE=1 to build the real bundle (minutes the first time)")
    out = tmp_path_factory.mktemp("bundle")
    sh(["scripts/bundle.sh", "--out", str(out)])
    return out, json.loads((out / "bundle.json").read_text())


def test_real_bundle_parts_and_manifest(real_bundle):
    out, m = real_bundle
    assert m["version"] == (ROOT / "VERSION").read_text().strip()
    assert m["pin"]["vllm_version"] == "0.26.0" and m["git_commit"]
    for kind in ("base", "patch"):
        assert m[kind]["parts"]
        for p in m[kind]["parts"]:
            f = out / p["file"]
            assert f.stat().st_size == p["bytes"] <= m["part_mib"] * MIB
            assert sha256(f) == p["sha256"]
    base_plus_patch = sum(p["bytes"] for k in ("base", "patch") for p in m[k]["parts"])
    assert base_plus_patch < 62 * MIB  # + the working tree: one device call


def test_real_bundle_members(real_bundle):
    out, m = real_bundle
    base = [n for p in m["base"]["parts"] for n in members(out / p["file"])]
    patch = [n for p in m["patch"]["parts"] for n in members(out / p["file"])]
    for n in base + patch:
        assert not n.endswith((".pyc", ".pyo")) and "__pycache__" not in n, n
    assert not [n for n in patch if n.endswith(".so")]
    # compiled extensions of the sparse-MLA path, inside vllm/ on the host
    for so in ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so",
               "_flashmla_C.abi3.so", "_flashmla_extension_C.abi3.so", "cumem_allocator.abi3.so",
               "third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so"):
        assert f"vllm-bin/vllm/{so}" in base, so
    # stand-ins, labelled
    for s in ("site/llguidance/__init__.py", "site/xgrammar/__init__.py",
              "vllm-bin/vllm/vllm_flash_attn/_vllm_fa2_C.py"):
        assert s in base, s
    # every shipped dependency, with its dist-info
    dist = {re.sub(r"[-_.]+", "-", n.split("/")[1][:-len(".dist-info")].rsplit("-", 1)[0]).lower()
            for n in base if re.match(r"site/[^/]+\.dist-info/METADATA$", n)}
    deps = {re.sub(r"[-_.]+", "-", ln.split("==")[0]).lower() for ln in rules("deps.txt")}
    assert deps <= dist
    # the patched tree: every overlay module and every file a patch touches
    for f in (ROOT / "overlay/vllm").rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            assert f"site/{f.relative_to(ROOT / 'overlay')}" in patch, f
    for p in (ROOT / "patches").glob("*.patch"):
        for path in re.findall(r"^diff --git a/(vllm/\S+) b/", p.read_text(), re.M):
            assert f"site/{path}" in patch, (p.name, path)
    for f in (ROOT / "overlay/csrc/hisparse").iterdir():
        if f.is_file():
            assert f"kernels/overlay/csrc/hisparse/{f.name}" in patch, f
    assert "kernels/scripts/build-kernels.sh" in patch
    assert "benchmarks/multi_turn/benchmark_serving_multi_turn.py" in patch  # bench-agentic
    assert f"site/vllm-{m['version']}.dist-info/METADATA" in patch
    # the wheel's precompiled copy of a tree file goes in the base only
    assert "vllm-bin/vllm/third_party/flashmla/__init__.py" in base
    assert "site/vllm/third_party/flashmla/__init__.py" not in patch


def test_test_gpu_tiers_select_gpu_tests_and_fail_gpu_skips(fake_gpu):
    """kernels: the whole folder; a GPU test skipping for want of CUDA
    fails the tier. gpu: every test_*_gpu.py not already run."""
    repo, stage, env = fake_gpu
    k = repo / "tests/hisparse/kernels"
    g = repo / "tests/hisparse/other"
    k.mkdir(parents=True)
    g.mkdir(parents=True)
    (k / "test_k_gpu.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\n"
        "def test_needs_gpu():\n    pytest.skip('no CUDA device')\n")
    (g / "test_other_gpu.py").write_text("def test_gpu_side():\n    pass\n")
    (g / "test_cpu_only.py").write_text("def test_gpu_in_name_but_cpu():\n    raise SystemExit(3)\n")
    proc = sh(["bash", "scripts/test-gpu.sh", "--stage", str(stage), "--only", "kernels,gpu"],
              env=env, cwd=repo, check=False)
    assert proc.returncode == 1
    tiers = json.loads((Path(env["OUT"]) / "test-gpu.json").read_text())["tiers"]
    assert tiers["kernels"]["status"] == "failed(gpu-tests-skipped)", proc.stdout
    assert tiers["gpu"]["status"] == "passed", proc.stdout
    assert "tests/hisparse/kernels/test_k_gpu.py already ran in the kernels tier" in proc.stdout
    assert "test_cpu_only" not in proc.stdout.split("tier gpu:")[1]
