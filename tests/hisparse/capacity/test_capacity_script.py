# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/hisparse-capacity, run as a program (target P3, spec 3.5/3.6).

The GLM-5.3 preset reproduces the spec's worked example (60 sparse layers,
top_k 2048, fp8 656-B rows, 100K tokens: ~3.9 GB fully resident vs ~155 MiB
hot per request, >= 20x); the DeepSeek-V3.2 preset gives its own numbers.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "hisparse-capacity"
GiB = 1 << 30


def run(*args: str, python: bool = True) -> subprocess.CompletedProcess:
    """Run the script with the vLLM this test imports on PYTHONPATH."""
    env = dict(os.environ)
    tree = str(Path(vllm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        [tree, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    cmd = [sys.executable, str(SCRIPT), *args] if python else [str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_glm_preset_reproduces_worked_example():
    """P3 / spec 3.6: 100,032 * 656 * 60 = 3.94 GB (3.67 GiB) fully resident;
    hot 4096 * 656 * 60 = 161 MB (154 MiB) + tail 5.0 MB; 23.68x >= 20x."""
    report = run_json("--preset", "glm-5.3", "--context", "100000")
    sparse = report["per_request"]["sparse_mla_bytes"]
    assert sparse == {
        "fully_resident": 3_937_259_520,
        "hybrid_hot": 161_218_560,
        "hybrid_tail": 5_038_080,
        "hybrid": 166_256_640,
        "fully_resident_over_hybrid": 23.68,
    }
    assert sparse["fully_resident_over_hybrid"] >= 20
    assert round(sparse["hybrid_hot"] / (1 << 20)) == 154  # "~155 MiB"
    layout = report["layout"]
    assert layout["num_sparse_layers"] == 60
    assert layout["num_indexer_layers"] == 17
    assert layout["pair_sizes"] == [2] + [4] * 14 + [2]
    assert (layout["bytes_per_block"], layout["addressing"]) == (167_936, "flat")
    host = report["host"]
    # Spec 3.6: stride 2,519,040 B, 384 GiB -> 163,680 blocks (163,679
    # usable besides the null block), 2 registration chunks.
    assert (host["host_block_stride"], host["num_host_blocks"]) == (2_519_040, 163_680)
    assert host["registration_chunks"] == 2
    assert host["min_host_pool_gib"] == 3.672  # (1563 + 2) * 2,519,040 B, rounded up
    blocks = report["per_request"]["gpu_blocks"]
    assert (blocks["admission"], blocks["steady"]) == (4667, 2619)
    concurrency = report["concurrency"]
    # 64 GiB // 167,936 = 409,200 blocks: GPU 1 + (409,200 - 4667) / 2619.
    assert concurrency["num_gpu_blocks"] == 409_200
    assert concurrency["hybrid_gpu"] == round(1 + (409_200 - 4667) / 2619, 2)
    assert concurrency["hybrid_host"] == round(163_680 / 1563, 2)
    assert concurrency["hybrid"] == min(
        concurrency["hybrid_gpu"], concurrency["hybrid_host"]
    )


def test_deepseek_v32_preset():
    """DeepSeek-V3.2: 61 leaders, 6 pairs (5 x 12 + 1), 515,328 B/block,
    strided; 64 GiB of GPU KV: 14.29 requests fully resident vs 67.68 hybrid."""
    report = run_json("--preset", "deepseek-v3.2", "--context", "100000")
    sparse = report["per_request"]["sparse_mla_bytes"]
    assert (
        (sparse["fully_resident"], sparse["hybrid_hot"], sparse["hybrid_tail"])
        == (
            1563 * 61 * 41_984,
            64 * 61 * 41_984,
            2 * 61 * 41_984,
        )
        == (4_002_880_512, 163_905_536, 5_122_048)
    )
    assert sparse["fully_resident_over_hybrid"] == 23.68
    layout = report["layout"]
    assert layout["pair_sizes"] == [12] * 5 + [1]
    assert (
        layout["bytes_per_block"],
        layout["addressing"],
        layout["attention_block_stride"],
    ) == (
        515_328,
        "strided",
        64,
    )
    gpu = report["per_request"]["gpu_bytes"]
    assert gpu["fully_resident"] == 1563 * 61 * (41_984 + 8_448)
    assert gpu["hybrid_admission"] == (1563 + 6 * 130 + 6 * 64) * 515_328
    assert gpu["hybrid_steady"] == (1563 + 6 * 2 + 6 * 64) * 515_328
    concurrency = report["concurrency"]
    assert concurrency["fully_resident"] == 14.29  # 22,337 blocks / 1563
    assert concurrency["num_gpu_blocks"] == 133_350
    assert concurrency["hybrid_gpu"] == 67.68
    assert concurrency["hybrid_host"] == 103.0
    assert concurrency["hybrid"] == 67.68
    assert report["host"]["num_host_blocks"] == 160_996


def test_mtp_adds_a_layer_and_widens_the_hot_buffer():
    """q = 1 + 3 with MTP3: H = 5K = 10,240 rows (160 blocks per hot group)
    and the MTP layer joins the sparse layers (L = 61): spec 3.6's MTP row."""
    report = run_json("--preset", "glm-5.3", "--num-speculative-tokens", "3")
    layout = report["layout"]
    assert (layout["device_buffer_size"], layout["hot_blocks_per_group"]) == (
        10_240,
        160,
    )
    assert layout["num_sparse_layers"] == 61
    assert report["per_request"]["sparse_mla_bytes"]["hybrid_hot"] == 10_240 * 656 * 61


def test_config_json_matches_preset(tmp_path):
    """--config reads a checkpoint's config.json the same way."""
    config = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_topk": 2048,
        "index_head_dim": 128,
        "hidden_size": 7168,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_file = run_json("--config", str(tmp_path))
    preset = run_json("--preset", "deepseek-v3.2")
    assert from_file["per_request"] == preset["per_request"]
    assert from_file["concurrency"] == preset["concurrency"]


def test_text_output_and_refusals(tmp_path):
    """Human output via the executable's own shebang; a dense model and an
    impossible host pool fail with the startup checks' wording."""
    result = run("--preset", "glm-5.3", python=False)
    assert result.returncode == 0, result.stderr
    assert "(23.68x smaller)" in result.stdout
    assert "hybrid 104.72 (GPU 155.46, host 104.72)" in result.stdout

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 12}))
    dense = run("--config", str(tmp_path / "config.json"))
    assert dense.returncode == 2
    assert "has no index_topk: not a sparse-MLA model" in dense.stderr

    tiny = run("--preset", "deepseek-v3.2", "--host-pool-gib", "0.001", "--json")
    assert tiny.returncode == 0  # the calculator reports; it does not enforce
    assert json.loads(tiny.stdout)["concurrency"]["hybrid_host"] == 0.0


@pytest.mark.parametrize("bad", [["--context", "0"], ["--gpu-kv-gib", "-1"]])
def test_bad_arguments(bad):
    result = run("--preset", "glm-5.3", *bad)
    assert result.returncode == 2 and "must be > 0" in result.stderr
