# SPDX-License-Identifier: Apache-2.0
"""`vllm serve` with the blog's two flags answers /v1/completions identically
to HiSparse off (issue: the user's command; spec 6.2).

Runs ON the GPU host on the tiny GLM-5-architecture model directory that
tests/e2e/run_e2e.py writes, with seeded weights (the test-only load format
``hisparse_seeded`` of tests/e2e/seeded_weights, variant ``--variant``: the
one the gate chose). Starts two
OpenAI-compatible servers side by side on one GPU, vLLM's defaults left on:
HiSparse off, and HiSparse on with

    --attention-config '{"hisparse_config": {"host_pool_gib": G}}'
    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role":
        "kv_both", "kv_connector_extra_config": {"spec_name":
        "TieringOffloadingSpec", "cpu_bytes_to_use": N}}'

and a GPU pool small enough to force spills (HiSparse off with
``--attention-config '{"sparse_mla_force_mqa": true}'``, the prefill path
HiSparse forces), then sends the same greedy completion requests to both
and compares the answers.

usage: python3 tests/e2e/serve_check.py --out DIR [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import seeded_init  # noqa: E402
from run_e2e import MAX_MODEL_LEN, PRESSURE_BLOCKS  # noqa: E402

CHUNK = 2048
HISPARSE_FLAGS = [
    "--attention-config", json.dumps({"hisparse_config": {"host_pool_gib": 2}}),
    "--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                      "cpu_bytes_to_use": 1 << 30}}),
    "--num-gpu-blocks-override", str(PRESSURE_BLOCKS[CHUNK]),
]
# HiSparse off on the prefill path HiSparse forces (docs/worker.md K9).
OFF_FLAGS = ["--attention-config", json.dumps({"sparse_mla_force_mqa": True}),
             "--kv-cache-memory-bytes", str(2 << 30)]


def server_command(model: Path, port: int, hisparse: bool) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model), "--load-format", "hisparse_seeded",
           "--port", str(port), "--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
           "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-batched-tokens", str(CHUNK),
           "--max-num-seqs", "8", "--seed", "0", "--generation-config", "vllm",
           "--gpu-memory-utilization", "0.3"]
    return cmd + (HISPARSE_FLAGS if hisparse else OFF_FLAGS)


def stop_servers(procs: dict) -> None:
    """Terminate every server (``procs``: name -> (process, log)), then
    kill any that has not exited within a minute."""
    for proc, _ in procs.values():
        proc.terminate()
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise TimeoutError(f"server on port {port} not ready after {timeout}s")


def complete(port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=os.path.join(
        os.environ.get("HISPARSE_STAGE", "/root/stage"), "tiny_glm5"))
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--variant", default=seeded_init.DEFAULT_VARIANT,
                    help="the weight variant the e2e gate chose (its e2e.json 'variant')")
    a = ap.parse_args()
    seeded_init.variant(a.variant)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(a.model)
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_tiny_glm5.py"), str(ckpt)],
                       check=True)
    plugin = str(HERE / "seeded_weights")
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               VLLM_HISPARSE_CANONICAL_TOPK="1",  # one top-k order in both arms
               PYTHONPATH=os.pathsep.join(
                   [plugin] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               **{seeded_init.VARIANT_ENV: a.variant})
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default
    procs = {}
    result: dict = {"flags": HISPARSE_FLAGS, "off_flags": OFF_FLAGS, "variant": a.variant,
                    "requests": []}
    try:
        for name, port, hisparse in (("off", 8101, False), ("on", 8102, True)):
            log = open(out / f"serve_{name}.log", "w")
            procs[name] = (subprocess.Popen(server_command(ckpt, port, hisparse),
                                            env=env, stdout=log, stderr=subprocess.STDOUT),
                           port)
            result[f"{name}_command"] = " ".join(server_command(ckpt, port, hisparse))
        t0 = time.time()
        for name, (proc, port) in procs.items():
            wait_ready(port, proc, a.timeout)
        result["ready_s"] = round(time.time() - t0, 1)
        rng = random.Random(7)
        prompts = [[rng.randrange(2, 8192) for _ in range(n)] for n in (5000, 3000, 700)]
        identical = True
        for prompt in prompts:
            answers = {name: complete(port, str(ckpt), prompt, 48)
                       for name, (_, port) in procs.items()}
            texts = {name: ans["choices"][0]["text"] for name, ans in answers.items()}
            same = texts["off"] == texts["on"]
            identical &= same
            result["requests"].append({"prompt_len": len(prompt), "identical": same,
                                       "off": texts["off"][:200], "on": texts["on"][:200]})
        result["identical"] = identical
        result["pass"] = identical
    except Exception as err:  # noqa: BLE001 - reported in the result file
        result["error"] = repr(err)
        result["pass"] = False
    finally:
        stop_servers(procs)
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}), flush=True)
    return 0 if result.get("pass") else 1


if __name__ == "__main__":
    sys.exit(main())
