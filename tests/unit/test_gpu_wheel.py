"""The GPU wheel (scripts/build-wheel.sh), its CPU checks (wheeltool.py) and
the GPU-host check's CPU stages (scripts/check-gpu-wheel.sh).

The wheel is built for real once per session: precompiled mode from the
pinned wheel, torch 2.11.0 (CUDA) from PyPI in the build venv, the kernels
compiled with nvcc for sm_90a + PTX. Needs nvcc; skips without it. Skipped
inside the nested fresh-clone run (test_fresh_clone.py), which the outer
run's copy of these tests already covers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HISPARSE_CACHE", ROOT / ".cache"))
VERSION = (ROOT / "VERSION").read_text().strip()
SO = "vllm/_hisparse_C.abi3.so"

pytestmark = [
    pytest.mark.skipif(bool(os.environ.get("HISPARSE_FRESH_CLONE")),
                       reason="built by the outer run, not again in the fresh clone"),
    pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists()
                       and not os.environ.get("CUDA_HOME"), reason="no nvcc"),
]


def up(key: str) -> str:
    for ln in (ROOT / "UPSTREAM").read_text().splitlines():
        if ln.startswith(key + "="):
            return ln.split("=", 1)[1]
    raise KeyError(key)


PINNED = CACHE / "pin" / up("VLLM_WHEEL_FILE")


def run(cmd, check=True, **kw):
    proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-wheel")
    proc = run([str(ROOT / "scripts/build-wheel.sh"), "--out", str(out)])
    wheels = list(out.glob("vllm-*.whl"))
    assert len(wheels) == 1
    return {"wheel": wheels[0], "out": out, "log": proc.stdout + proc.stderr,
            "info": json.loads((out / "build-info.json").read_text())}


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def cuobjdump() -> str:
    venv = ROOT / "work/wheel/venv"
    found = sorted(venv.glob("lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump"))
    return str(found[0]) if found else shutil.which("cuobjdump")


def test_name_version_and_abi3_tag(built):
    w = built["wheel"]
    # the name build-image.sh and build.sh --tier gpu look for (lib.sh)
    assert w.name == f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(w) as zf:
        di = f"vllm-{VERSION}.dist-info"
        meta = zf.read(f"{di}/METADATA").decode()
        assert f"\nVersion: {VERSION}\n" in meta
        # the CUDA requirements of vLLM 0.26.0 (requirements/cuda.txt), not the CPU build's
        assert re.search(r"^Requires-Dist: torch==2\.11\.0$", meta, re.M)
        assert "+cpu" not in meta
        tag = [ln for ln in zf.read(f"{di}/WHEEL").decode().splitlines() if ln.startswith("Tag: ")]
        assert tag == [f"Tag: {w.name[len(f'vllm-{VERSION}-'):-4]}"]
        assert zf.read("vllm/_version.py").decode().count(VERSION) >= 1


def test_kernels_are_in_the_wheel_for_sm90a_with_ptx(built, tmp_path):
    with zipfile.ZipFile(built["wheel"]) as zf:
        data = zf.read(SO)
        rec = {r.split(",")[0]: r.split(",")[1] for r in zf.read(f"vllm-{VERSION}.dist-info/RECORD").decode().splitlines()}
    assert rec[SO] == record_hash(data)
    so = tmp_path / "k.so"
    so.write_bytes(data)
    dyn = run(["readelf", "-d", str(so)]).stdout
    assert "libtorch_cuda.so" in dyn and "RPATH" not in dyn and "RUNPATH" not in dyn
    tool = cuobjdump()
    assert tool, "cuobjdump was installed into the build venv"
    elf = run([tool, "--list-elf", str(so)]).stdout
    ptx = run([tool, "--list-ptx", str(so)]).stdout
    assert "sm_90a" in elf
    assert re.search(r"(compute|sm)_\d+", ptx), ptx
    # the five ops and the smem helper are registered by this library
    syms = run(["strings", str(so)], check=False).stdout
    for op in ("resolve_residency", "gather_compact", "gather_plan", "invalidate_written_slots", "copy_descriptors"):
        assert op in syms
    assert built["info"]["kernels"]["torch"].startswith("2.11.0")


def test_precompiled_members_are_the_pinned_wheels(built):
    with zipfile.ZipFile(built["wheel"]) as zf, zipfile.ZipFile(PINNED) as pz:
        for name in ("vllm/_C_stable_libtorch.abi3.so", "vllm/_flashmla_C.abi3.so"):
            assert hashlib.sha256(zf.read(name)).digest() == hashlib.sha256(pz.read(name)).digest()
        # our Python, not the pinned one
        ours = (ROOT / "overlay/vllm/v1/hisparse/kernels.py").read_bytes()
        assert zf.read("vllm/v1/hisparse/kernels.py") == ours
        assert b"hisparse_config" in zf.read("vllm/config/attention.py")
        assert b"hisparse_config" not in pz.read("vllm/config/attention.py")


def rewrite(src: Path, dst: Path, drop: set[str] = frozenset(), change: dict | None = None) -> None:
    # stored, not deflated: a rewrite of 300 MB takes seconds
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            if info.filename in drop:
                continue
            data = zi.read(info)
            if change and info.filename in change:
                data = change[info.filename](data)
            info.compress_type = zipfile.ZIP_STORED
            zo.writestr(info, data)


def check(wheel: Path) -> subprocess.CompletedProcess:
    return run(["python3", "scripts/wheeltool.py", "check", "--wheel", str(wheel), "--pinned", str(PINNED),
                "--version", VERSION, "--overlay", str(ROOT / "overlay")], check=False)


def test_check_refuses_a_tampered_or_incomplete_wheel(built, tmp_path):
    good = check(built["wheel"])
    assert good.returncode == 0, good.stderr
    bad = tmp_path / "x" / built["wheel"].name
    bad.parent.mkdir()
    rewrite(built["wheel"], bad, change={"vllm/v1/hisparse/layout.py": lambda d: d + b"\n# edited\n"})
    proc = check(bad)
    assert proc.returncode != 0
    assert "RECORD entry of vllm/v1/hisparse/layout.py does not match" in proc.stderr
    assert "overlay file vllm/v1/hisparse/layout.py differs" in proc.stderr
    rewrite(built["wheel"], bad, drop={SO})
    proc = check(bad)
    assert f"{SO} is missing" in proc.stderr
    rewrite(built["wheel"], bad, drop={"vllm/_moe_C_stable_libtorch.abi3.so"})
    proc = check(bad)
    assert "precompiled vllm/_moe_C_stable_libtorch.abi3.so of the pinned wheel is missing" in proc.stderr


def test_pack_for_the_gpu_host_is_small_and_verifiable(built, tmp_path):
    pack = tmp_path / "carry"
    run(["scripts/check-gpu-wheel.sh", "--pack", str(pack), str(built["wheel"])])
    files = sorted(p.name for p in pack.iterdir())
    assert files == sorted([built["wheel"].name, "carry.json"])
    size = sum(p.stat().st_size for p in pack.iterdir())
    assert size < 48 * 2**20, f"{size} bytes would not leave room in a 64 MiB carry"
    carry = json.loads((pack / "carry.json").read_text())
    assert carry["full_sha256"] == hashlib.sha256(built["wheel"].read_bytes()).hexdigest()
    assert SO not in carry["dropped_as_in_pinned_wheel"]
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in carry["dropped_as_in_pinned_wheel"]
    run(["python3", "scripts/wheeltool.py", "verify-slim", "--dir", str(pack)])
    # a changed member is caught on the host before anything runs
    slim = pack / built["wheel"].name
    rewrite(slim, tmp_path / "t.whl", change={"vllm/v1/hisparse/kernels.py": lambda d: d.replace(b"MAX_HOT_SIZE = 32768", b"MAX_HOT_SIZE = 1")})
    shutil.move(tmp_path / "t.whl", slim)
    proc = run(["scripts/check-gpu-wheel.sh", "--carried", str(pack), "--no-gpu-tests",
                "--python", str(ROOT / ".venv/bin/python")], check=False)
    assert proc.returncode != 0 and "vllm/v1/hisparse/kernels.py differs from the full wheel" in proc.stderr


def test_gpu_check_installs_imports_and_finds_the_kernels(built, tmp_path):
    """The CPU stages of the GPU-host check, for real: a --no-deps install
    into a fresh --target, vllm imported from there, the loader pointed at
    the wheel's _hisparse_C. On this CPU machine the GPU stage then fails
    (it must never pass without running the tests)."""
    pack = tmp_path / "carry"
    run(["scripts/check-gpu-wheel.sh", "--pack", str(pack), str(built["wheel"])])
    py = str(ROOT / ".venv/bin/python")
    proc = run(["scripts/check-gpu-wheel.sh", "--carried", str(pack), "--no-gpu-tests", "--python", py])
    assert f"vllm {VERSION} from /" in proc.stdout and "_hisparse_C.abi3.so" in proc.stdout
    gpu = run(["scripts/check-gpu-wheel.sh", "--carried", str(pack), "--python", py], check=False)
    assert gpu.returncode != 0
    assert "torch 2.13" in gpu.stderr or "no CUDA device" in gpu.stderr
