# SPDX-License-Identifier: Apache-2.0
"""Does a request's output depend on what an engine held before it?

Run 16 of the gate (results/e2e/README.md) found the HiSparse-off replay
engine's output for one request (host_prefix's filler ``2/f1``: 5200 fresh
tokens in three chunks, prefilled from nothing) one bf16 ulp away from the
same request in the off and on engines and in run 10's replay, under the
same schedule, while every other request of the run matched. A bitwise gate
holds only if a request's output is a function of its own tokens and batch;
this probe asks the engine directly. One engine (a gate engine's
configuration, default ``off_c2k``), the gate's weights, then the same
request (16 greedy tokens with logprobs) after:

- ``again``: nothing (determinism: must equal ``base``);
- ``kv_noise`` / ``kv_zero``: every KV-cache tensor filled with random
  bytes / zeros (stale KV contents in the blocks it will be given);
- ``indexer_noise`` / ``mla_noise``: only the indexer's / only MLA's
  caches (which of the two, if ``kv_noise`` differs);
- ``alloc_noise``: 8 GiB of the caching allocator filled with random bytes
  and freed (uninitialised intermediates);
- ``history``: the scenario's earlier calls run first (the gate's order).

The prefix cache is reset before each case, so the request is prefilled
from scratch every time. Writes ``stale_probe.json`` (per case: equal to
``base``, first divergence, largest logprob difference).

usage: python tests/e2e/stale_probe.py --out DIR [--engine off_c2k]
           [--scenario host_prefix] [--key 2/f1] [--variant n02]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import run_e2e as gate  # sets the env (canonical top-k, offline) first
import e2e_compare as compare  # noqa: E402
import e2e_workload as workload  # noqa: E402

MLA_ROW_BYTES = 656
"""A fp8_ds_mla KV row (512 fp8 + 4 scales + 64 bf16 rope); the indexer's
cache rows are narrower (128 fp8 + a scale)."""


def fill_kv(worker, which: str, how: str) -> list[list[int]]:
    """Fill the worker's KV-cache tensors (``which``: all, mla, indexer)
    with random bytes or zeros; returns the shapes touched."""
    import torch

    touched = []
    gen = torch.Generator(device="cuda").manual_seed(1234)
    for t in worker.model_runner.kv_caches:
        is_mla = t.shape[-1] == MLA_ROW_BYTES
        if which == "mla" and not is_mla or which == "indexer" and is_mla:
            continue
        raw = t.view(torch.uint8)
        if how == "zero":
            raw.zero_()
        else:
            raw.random_(0, 256, generator=gen)
        touched.append(list(t.shape))
    torch.cuda.synchronize()
    return touched


def dirty_allocator(worker) -> int:
    """Fill 8 GiB of the caching allocator with random bytes and free it."""
    import torch

    blocks = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(8)]
    for b in blocks:
        b.random_(0, 256)
    torch.cuda.synchronize()
    del blocks
    return 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", default=gate.os.environ.get("HISPARSE_STAGE", "/root/stage"))
    ap.add_argument("--engine", default="off_c2k")
    ap.add_argument("--scenario", default="host_prefix")
    ap.add_argument("--key", default="2/f1", help="call/conversation of the probed request")
    ap.add_argument("--variant", default="n02")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from vllm import LLM
    from vllm.v1.hisparse import determinism

    determinism.CANONICAL_TOPK = True
    spec = gate.engine_specs()[a.engine]
    dirs = gate.make_models(Path(a.stage))
    with gate.scoped_env(gate.engine_env(spec, [])):
        llm = LLM(**gate.llm_kwargs(spec, dirs))
    gate.apply_variant(llm, a.variant)

    calls = workload.scenario(a.scenario)
    histories: dict[str, list[int]] = {}
    earlier: list[list[int]] = []
    probe = None
    for c, call in enumerate(calls):
        for t in call:
            prompt = workload.prompt_of(t, histories)
            if f"{c}/{t.conv}" == a.key:
                probe = prompt
            elif probe is None:
                earlier.append(prompt)
            histories[t.conv] = prompt  # outputs unknown here: prompts only
        if probe is not None:
            break
    if probe is None:
        raise SystemExit(f"no request {a.key!r} in scenario {a.scenario!r}")

    def run(prompts: list[list[int]]) -> dict:
        llm.reset_prefix_cache()
        rec = None
        for p in prompts:
            rec = gate.generate_records(llm, [p], [a.tokens], time.time() + 120)[0]
        return rec

    result = {"engine": a.engine, "scenario": a.scenario, "key": a.key,
              "probe_tokens": len(probe), "variant": a.variant, "cases": {}}
    base = run([probe])
    cases = {
        "again": lambda: None,
        "kv_zero": lambda: llm.collective_rpc(fill_kv, args=("all", "zero")),
        "kv_noise": lambda: llm.collective_rpc(fill_kv, args=("all", "noise")),
        "indexer_noise": lambda: llm.collective_rpc(fill_kv, args=("indexer", "noise")),
        "mla_noise": lambda: llm.collective_rpc(fill_kv, args=("mla", "noise")),
        "alloc_noise": lambda: llm.collective_rpc(dirty_allocator),
    }
    for name, prepare in cases.items():
        detail = prepare()
        got = run([probe])
        diff = compare.as_dict(compare.compare_request(base, got))
        result["cases"][name] = {"equal": got == base, **diff, "prepared": detail}
        gate.log("stale_probe", name, result["cases"][name]["equal"], diff)
    got = run(earlier + [probe])
    result["cases"]["history"] = {"equal": got == base,
                                  **compare.as_dict(compare.compare_request(base, got)),
                                  "earlier_requests": len(earlier)}
    gate.log("stale_probe history", result["cases"]["history"])
    result["depends_on_stale_state"] = not all(c["equal"] for c in result["cases"].values())
    (out / "stale_probe.json").write_text(json.dumps(result, indent=1))
    gate.shutdown(llm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
