# SPDX-License-Identifier: Apache-2.0
"""benchlib.upstream: unpacking the upstream 0.30.0 peer's split bundle
once (and its DeepGEMM swap once), and the environment its processes get
(its site alone, never our stage's, model runner V2)."""

import os

import pytest
from benchlib import common, upstream
from upstream_bundle import make_bundle


def test_stage_unpacks_the_parts_once_and_swaps_deep_gemm(tmp_path):
    bundle, stage = make_bundle(tmp_path / "b"), tmp_path / "stage"
    out = upstream.stage_upstream(bundle, stage)
    assert out == {"site": str(stage / "site"), "unpacked": True, "deep_gemm_026": True}
    dg = stage / "site/vllm/third_party/deep_gemm/__init__.py"
    assert dg.read_text() == "# 0.26.0's\n"
    (stage / "site/vllm/marker").write_text("kept")
    again = upstream.stage_upstream(bundle, stage)
    assert again["unpacked"] is False and (stage / "site/vllm/marker").exists()


def test_stage_without_parts_says_how_to_build_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_bundle_030.sh"):
        upstream.stage_upstream(tmp_path / "none", tmp_path / "stage")


def test_stage_without_deep_gemm_part_says_how_to_build_it(tmp_path):
    """P8: 0.30.0's shipped DeepGEMM fails every call on torch 2.11 (agentic run 4's
    upstream server died at startup on it), so staging refuses without the
    swap and names the command that builds it."""
    bundle, stage = make_bundle(tmp_path / "b", with_dg=False), tmp_path / "stage"
    with pytest.raises(FileNotFoundError, match="make_dg026.sh"):
        upstream.stage_upstream(bundle, stage)


def test_env_has_its_site_alone(tmp_path):
    base = {"PYTHONPATH": "/root/stage/patch/site:/root/stage/base/site", "PATH": "/usr/bin",
            "VLLM_CACHE_ROOT": "/root/stage/cache/vllm", "VLLM_HISPARSE_CANONICAL_TOPK": "1",
            "HISPARSE_GPU_PYTHON": "/usr/bin/python3"}
    env = upstream.env(tmp_path, base, variant="n02", in_process=True)
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(tmp_path / "site")
    assert not [p for p in paths if "/root/stage/" in p]
    assert str(common.PLUGIN) in paths and str(common.SCRIPTS) in paths
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache030" / "vllm")
    assert "VLLM_HISPARSE_CANONICAL_TOPK" not in env and "HISPARSE_GPU_PYTHON" not in env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["HISPARSE_E2E_VARIANT"] == "n02" and env["NCCL_NVLS_ENABLE"] == "0"
    server = upstream.env(tmp_path, base, in_process=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server


def test_our_env_keeps_our_stage_and_drops_the_canonical_order():
    base = {"PYTHONPATH": "/root/stage/patch/site", "VLLM_HISPARSE_CANONICAL_TOPK": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = common.child_env(base, variant="qk2", in_process=False)
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[-1] == "/root/stage/patch/site" and str(common.E2E) in paths
    assert "VLLM_HISPARSE_CANONICAL_TOPK" not in env
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_parse_bytes_and_lists():
    assert common.parse_bytes("128MiB") == 128 << 20
    assert common.parse_bytes("2g") == 2 << 30 and common.parse_bytes("1.5GiB") == 3 << 29
    assert common.parse_bytes("4096") == 4096
    for bad in ("12Q", "-1", "0", "1.5"):
        with pytest.raises(ValueError):
            common.parse_bytes(bad)
    assert common.int_list("4,8,16") == [4, 8, 16]
    for bad in ("4,x", "0", "4,4", ""):
        with pytest.raises(ValueError):
            common.int_list(bad)
    with pytest.raises(ValueError, match="unknown arm"):
        common.name_list("plain,nope", ["plain"], "arm")


def test_env_falls_back_to_our_serving_packages_after_its_site(tmp_path):
    """P8: the peer's server imports uvicorn, which its offline bundle lacks
    (results/agentic run3); our bundle's third-party site (no vLLM) comes
    after the peer's site, never before it, and only when staged."""
    env = upstream.env(tmp_path, {}, in_process=False)
    assert str(tmp_path / "base" / "site") not in env["PYTHONPATH"].split(os.pathsep)
    (tmp_path / "base" / "site").mkdir(parents=True)
    paths = upstream.env(tmp_path, {}, in_process=False)["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(tmp_path / "site")
    assert paths[-1] == str(tmp_path / "base" / "site")
