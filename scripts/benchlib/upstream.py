# SPDX-License-Identifier: Apache-2.0
"""The upstream vLLM 0.30.0 peer (its own HiSparse) on the GPU host.

Its offline bundle is built here by /work/shared/peers/upstream-0.30/
(build_bundle_030.sh -> .gpu/upstream030/site030.tar.xz.part*, and
make_dg026.sh -> dg026.tar.xz, vLLM 0.26.0's DeepGEMM for torch 2.11). On the
GPU host it unpacks into STAGE/site (beside our bundle's STAGE/base and
STAGE/patch), as that peer's gpu_step030.sh does. Its processes get their own
environment: that site alone on PYTHONPATH (never our stage's), model runner
V2 (its HiSparse needs it), its own compile caches.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from . import common

DEFAULT_BUNDLE = common.REPO / ".gpu" / "upstream030"
PARTS = "site030.tar.xz.part*"
DEEP_GEMM = "dg026.tar.xz"


def site(stage: Path) -> Path:
    return Path(stage) / "site"


def staged(stage: Path) -> bool:
    return (site(stage) / "vllm" / "__init__.py").exists()


def stage_upstream(bundle: Path, stage: Path) -> dict:
    """Unpack the peer's site into STAGE/site unless it is there, then swap
    in 0.26.0's DeepGEMM once (0.30.0's _C is built for torch 2.13)."""
    bundle, stage = Path(bundle), Path(stage)
    out = {"site": str(site(stage)), "unpacked": False, "deep_gemm_026": False}
    if not staged(stage):
        parts = sorted(bundle.glob(PARTS))
        if not parts:
            raise FileNotFoundError(
                f"no {bundle}/{PARTS}: build it here with "
                "bash /work/shared/peers/upstream-0.30/build_bundle_030.sh and carry "
                f"{bundle.name} (or pass --upstream-bundle)")
        stage.mkdir(parents=True, exist_ok=True)
        tar = subprocess.Popen(["tar", "-xJ", "-C", str(stage)], stdin=subprocess.PIPE)
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, tar.stdin)
        tar.stdin.close()
        if tar.wait() != 0 or not staged(stage):
            raise RuntimeError(f"unpacking {bundle}/{PARTS} into {stage} failed")
        out["unpacked"] = True
    dg, marker = bundle / DEEP_GEMM, site(stage) / ".dg026"
    if not dg.exists() and not marker.exists():
        # 0.30.0's own DeepGEMM fails every call on torch 2.11 ("t.is_cuda()"
        # at layout.hpp:45: the upstream server of results/agentic run 4
        # died on it at startup), so the peer cannot run without the swap.
        raise FileNotFoundError(
            f"no {bundle}/{DEEP_GEMM}: build it here with bash "
            "/work/shared/peers/upstream-0.30/make_dg026.sh "
            ".cache/pin/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl and carry it "
            f"with {bundle.name}")
    if dg.exists() and not marker.exists():
        shutil.rmtree(site(stage) / "vllm" / "third_party" / "deep_gemm", ignore_errors=True)
        subprocess.run(["tar", "-xJf", str(dg), "-C", str(site(stage))], check=True)
        marker.touch()
    out["deep_gemm_026"] = marker.exists()
    return out


def serving_deps(stage: Path) -> Path | None:
    """Our bundle's third-party serving packages (STAGE/base/site: uvicorn,
    prometheus-fastapi-instrumentator, ...; no vLLM), after the peer's site
    on its path: the peer's bundle was built for offline LLM runs and lacks
    uvicorn, which ``vllm serve`` imports (bench-agentic's upstream arm
    failed on it, results/agentic run3). What the peer's site has wins."""
    path = Path(stage) / "base" / "site"
    return path if path.is_dir() else None


OUR_KEYS = ("PYTHONPATH", "HISPARSE_GPU_PYTHON", "VLLM_CACHE_ROOT", "DG_JIT_CACHE_DIR",
            "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def env(stage: Path, base: dict | None = None, *, variant: str | None = None,
        in_process: bool) -> dict:
    """The environment of an upstream engine or server."""
    base = dict(os.environ if base is None else base)
    for k in OUR_KEYS:
        base.pop(k, None)
    out = common.child_env(base, variant=variant, in_process=in_process)
    common.prepend_path(out, "PYTHONPATH", site(stage))
    serving = serving_deps(stage)
    if serving is not None:
        out["PYTHONPATH"] = f"{out['PYTHONPATH']}{os.pathsep}{serving}"
    cache = Path(stage) / "cache030"
    out.update({"VLLM_USE_V2_MODEL_RUNNER": "1",
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "DG_JIT_CACHE_DIR": str(cache / "deep_gemm"),
                "TRITON_CACHE_DIR": str(cache / "triton"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})
    if "CUDA_HOME" not in out:
        nvcc = shutil.which("nvcc")
        if nvcc:
            out["CUDA_HOME"] = str(Path(nvcc).resolve().parent.parent)
    return out
