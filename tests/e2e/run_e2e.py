# SPDX-License-Identifier: Apache-2.0
"""End-to-end HiSparse gate on a tiny GLM-5-architecture model (spec 8.4, T1).

Runs ON the GPU host (scripts/test-gpu.sh tier ``e2e``) with the patched
vLLM and the hisparse_ops kernels importable. Every engine runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with vLLM's defaults left on
(async scheduling, the default CUDA-graph mode) unless the engine names a
mode. HiSparse-on engines (under real memory pressure: a small GPU pool)
are compared with HiSparse off on the same prefill path
(``sparse_mla_force_mqa=True``, which HiSparse forces), the same mode, the
same seeded weights and the same requests:

- every sampled token and its logprob and the top-5 bitwise equal wherever
  both arms ran the same batches: the natural off arm where its schedule
  (the multiset of per-request token counts of every step) equals the
  HiSparse engine's, and always the replay arm (``rep_*``: a HiSparse-off
  engine that runs exactly the HiSparse engines' recorded steps, requests,
  token counts and prefix hits; schedule_replay.py), which judges every
  scenario whose natural schedule differed (vLLM's kernels are not
  batch-invariant, e2e_compare.py);
- controls that show the comparison can fail, recorded beside the results:
  the sensitivity control (replacing the early 40% of a prompt changes the
  greedy tokens of most prompts on the chosen seeded init, measured in the
  run's first HiSparse-off engine) and the negative control (a debug-only
  corruption of one host-only page, armed as a pressure engine's last
  scenario, is reported as a divergence);
- pressure proven per scenario with counters (lost pages, hot misses,
  completed spills, 0 preemptions, the scheduler's in-flight waits).

Pressure engines run without the mirror audit (it synchronizes every step,
so no copy would overlap a forward); ``on_c2k_audit`` runs it.

E2E-5 (docs/mtp.md 4): MTP speculative decoding (k = 1, 3; default mode and
FULL_DECODE_ONLY) on a 3-layer + 1-MTP model, the drafter seeded and
fingerprinted with the target; each scenario's drafts and accepted tokens
(per position) are summed from the scheduler, and HiSparse's must equal the
replay's wherever the keyed schedules are equal (the off arm's reported).

usage: python3 tests/e2e/run_e2e.py --out DIR [--engines NAME,...]
           [--scenarios NAME,...] [--variant NAME] [--p2]
Writes DIR/e2e.json and DIR/e2e_records.json (rewritten after every
scenario) and the log to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Workers of a TP engine import seeded_init by name (apply_model pickles it
# by reference).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# One order of every top-k row in every engine (both arms): the pin's top-k
# kernels emit rows in atomic order, so two runs of one engine differ in the
# low bits of attention (vllm/v1/hisparse/determinism.py). Read at import.
os.environ.setdefault("VLLM_HISPARSE_CANONICAL_TOPK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import e2e_compare as compare  # noqa: E402
import e2e_workload as workload  # noqa: E402
import schedule_replay  # noqa: E402
import seeded_init  # noqa: E402

DEBUG_ENV = "VLLM_HISPARSE_DEBUG"
FAULTS_ENV = "VLLM_HISPARSE_DEBUG_FAULTS"

# ---------------------------------------------------------------- engines

MAX_MODEL_LEN = 16384  # the tiny model's max_position_embeddings
CHUNKS = (2048, 8192)  # max_num_batched_tokens; 8192 is vLLM's default
BASE = dict(
    dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=MAX_MODEL_LEN,
    max_num_seqs=8, seed=0, generation_config="vllm",
    enable_prefix_caching=True, load_format="dummy",
)
OFF_KV_BYTES = 2 << 30  # HiSparse off: ~680K tokens, nothing preempted
NUM_PAIRS = 4  # resident/hot group pairs of the 4-layer model (656-B rows)
INDEX_TOPK = 256
MODELS = {  # name -> make_tiny_glm5.py arguments, index_topk
    "glm": ([], INDEX_TOPK),
    "glm_share": (["--index-topk-freq", "2"], INDEX_TOPK),
    # DeepSeek-V3.2 (issue 17 item 4): the second DSA architecture, top-k 2048
    "dsv32": (["--arch", "dsv32"], 2048),
    # Issue 17 item 2: GLM-5's per-rank shapes at TP 4 and 8 (64 heads / TP)
    "glm_h16": (["--heads", "16"], INDEX_TOPK),
    # docs/worker.md K8: 8 layers make a strided layout (Sa = B); its
    # passing this gate (run 40) lifted binding's refusal of strided layouts
    "glm_l8": (["--layers", "8"], INDEX_TOPK),
    "glm_h8": (["--heads", "8"], INDEX_TOPK),
    # E2E-5 (docs/mtp.md 4): 3 layers + 1 MTP layer, flat addressing with 4
    # pairs (4 layers + MTP would be strided)
    "glm_mtp": (["--layers", "3", "--mtp", "1"], INDEX_TOPK),
}
FEW_HEADS = ("glm_h16", "glm_h8")
"""Models below 32 heads per rank: their off arms keep FlashMLA sparse's
separate FP8 prefill/decode path (the one HiSparse serves), as HiSparse
sets it, so the two arms run the same kernels."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def startup_minimum_blocks(max_model_len: int, chunk: int, pairs: int = NUM_PAIRS,
                           topk: int = INDEX_TOPK, block: int = 64, q: int = 1) -> int:
    """The smallest GPU pool the startup check admits: one max_model_len
    request's admission cost (layout.RequestBlocks.admission): its indexer
    pages, min(pages, cap_res) per resident group (cap_res = the window
    min(admission_max_tokens = chunk, max_model_len) in pages + the 2-page
    tail) and a hot region per hot group (H = (q + 1) x top-k rows, the
    default device_buffer_size; q = 1 + num_speculative_tokens)."""
    pages = cdiv(max_model_len, block)
    cap_res = cdiv(min(chunk, max_model_len), block) + 2
    return pages + pairs * min(pages, cap_res) + pairs * cdiv((q + 1) * topk, block)


# A little above the minimum (424 at 2048, 808 at 8192): a 6K prompt
# fully resident costs 94 x 5 = 470 blocks, a 12K one 940.
PRESSURE_BLOCKS = {2048: 450, 8192: 840}
# DeepSeek-V3.2's top-k 2048 makes each hot region 64 blocks: minimum 648
# at chunk 2048; a 6K prompt fully resident with its regions costs 726.
DSV32_PRESSURE_BLOCKS = 680
# The IndexShare model (glm_share, --index-topk-freq 2) has 3 pairs: minimum
# 382 at chunk 2048, and a 6K prompt fully resident with its regions costs
# 94 x 4 + 3 x 8 = 400, so PRESSURE_BLOCKS[2048] put it under no pressure
# (run 39: single6k lost no page). At 392 the CPU simulation
# (simulate_pressure.py --engine on_share --blocks 392) loses 5 pages in
# single6k and 140 in concurrent, with no preemption.
SHARE_PRESSURE_BLOCKS = 392
# The 8-layer model (glm_l8, strided): 8 pairs, minimum 592 at chunk 2048;
# a 6K prompt fully resident with its regions costs 94 x 9 + 8 x 8 = 910.
# At 620 the CPU simulation (simulate_pressure.py --engine on_l8) loses
# pages in single6k and concurrent, with no preemption.
L8_PRESSURE_BLOCKS = 620
# E2E-5, MTP k at chunk 2048 (glm_mtp: 4 pairs as the 4-layer model): the
# minimum with q = 1 + k (440 for k = 1, 472 for k = 3) + 26, the margin of
# PRESSURE_BLOCKS[2048]. Needs GPU tuning: lower until single6k loses pages.
MTP_PRESSURE_BLOCKS = {1: 466, 3: 498}
MTP_OUT_TOKENS = 128
"""Every turn of an MTP engine generates at least this many tokens (both
arms): many verify steps, each reading host pages."""
MTP_TAGS = {f"mtp{k}{suffix}": (k, mode) for k in MTP_PRESSURE_BLOCKS
            for suffix, mode in (("", "default"), ("_fdo", "fdo"))}
"""E2E-5's trios off_/on_/rep_<tag>: tag -> (num_speculative_tokens, mode)."""
# E2E-9: 320 host blocks of 4 x 64 x 656 B (>= one 16K request's 256); the
# long_outputs requests together need ~344.
HOSTEX_GIB = 320 * NUM_PAIRS * 64 * 656 / (1 << 30)
MODES = {
    "default": {},
    "eager": {"enforce_eager": True},
    "fdo": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
}
# offload_prompt_only (the pin's default: True) would keep a parent's decoded
# pages out of the offloader: its follow-up recomputes them as prompt, the
# offloader stores that version, and the next follow-up loads it, while the
# off arm reuses the parent's decode-computed version of the same tokens.
# vLLM's kernels are not batch invariant (K28), so the two arms would then
# hold different, equally valid indexer KV (runs 20-23: chat_chain's rounds 2
# and 3). Offloading decoded pages too gives the on arm the first version.
OFFLOAD = {"cpu_bytes_to_use": 1 << 30, "offload_prompt_only": False}
# P/D imports (docs/pd-imports.md "GPU e2e", spec 4.13, INV-30): the prefill
# instance and the HiSparse-off consumer run the pin's file format through
# SparseMLAExampleConnector (the pin's ExampleConnector moves no sparse-MLA
# row and never saves the indexer cache); the HiSparse consumer names the
# pin's connector, as a user would, and HiSparse composes its importer.
PD_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.importing"
PD_CONNECTOR = "SparseMLAExampleConnector"
PD_DIR = "pd_kv"
"""The files' folder under --out (shared_storage_path of every P/D engine),
emptied when the producer starts: a stale file would be imported."""
PD_PRODUCER_CHUNK = MAX_MODEL_LEN
"""The producer saves a prompt in the step that schedules it and refuses a
split one: every prompt (and each call's prompts together) fits a step."""


def engine_specs() -> dict[str, dict]:
    """name -> {model, mode, chunk, hisparse: None | dict, blocks, offload,
    audit, kind, no_pressure, hot, tp, spec (MTP k), out_tokens, pd (None |
    "producer" | "consumer"), max_out_tokens}."""
    def off(model="glm", mode="default", chunk=2048, tp=1, spec=0):
        return with_spec(dict(model=model, mode=mode, chunk=chunk, hisparse=None, tp=tp,
                              separate_prefill=model in FEW_HEADS), spec)

    specs_off = {"off_c2k": off(), "off_c8k": off(chunk=8192), "off_eager": off(mode="eager"),
                 "off_fdo": off(mode="fdo"), "off_share": off(model="glm_share"),
                 "off_tp2": off(tp=2), "off_dsv32": off(model="dsv32"),
                 "off_h16": off(model="glm_h16"), "off_h8": off(model="glm_h8"),
                 "off_l8": off(model="glm_l8"),
                 **{f"off_{t}": off(model="glm_mtp", mode=m, spec=k)
                    for t, (k, m) in MTP_TAGS.items()},
                 # P/D: computes the prompts itself (tokens beside on_pd; its
                 # replay arm imports the producer's files, as on_pd does)
                 "off_pd": off()}

    def on(model="glm", mode="default", chunk=2048, blocks="pressure", offload=False,
           audit=False, kind="pressure", tp=1, spec=0, pd=None, **hisparse):
        if blocks == "pressure":
            blocks = (MTP_PRESSURE_BLOCKS[spec] if spec else
                      DSV32_PRESSURE_BLOCKS if model == "dsv32" else
                      SHARE_PRESSURE_BLOCKS if model == "glm_share" else
                      L8_PRESSURE_BLOCKS if model == "glm_l8" else PRESSURE_BLOCKS[chunk])
        return with_spec(dict(model=model, mode=mode, chunk=chunk,
                              hisparse={"host_pool_gib": 2, **hisparse}, blocks=blocks,
                              offload=offload, audit=audit, kind=kind, tp=tp,
                              **({"pd": pd} if pd else {})), spec)

    def on_mtp(tag: str, **kw):
        k, mode = MTP_TAGS[tag]
        return on(model="glm_mtp", mode=mode, spec=k, **kw)

    return {
        "off_c2k": off(),
        "on_c2k": on(offload=True),
        "on_c2k_audit": on(offload=True, audit=True),
        # chat_chain without the OffloadingConnector: its follow-ups' indexer
        # KV is recomputed or prefix-cached on the GPU, never loaded
        "on_nooff": on(),
        "on_lazy": on(eager_host_mirror=False),
        # K6 (docs/kernels.md P9): the miss plan sorted by host row before
        # the gathers; auto-on only for host arrays >= 2 GiB, forced here.
        "on_ordered": on(offload=True, order_misses=True),
        # E2E-9: ample GPU blocks, so that all four requests run at once and
        # their decode outgrows the host pool (under GPU pressure HiSparse
        # admits them a few at a time and the host never runs out: run 9).
        "on_hostex": on(kind="hostex", blocks=None, host_pool_gib=HOSTEX_GIB),
        # No pressure: ample blocks and a resident window holding any prompt.
        # Host-prefix hits (returning) start zero-resident; with room to
        # spare their pages are restored to resident blocks (adopted).
        "on_nopressure": dict(on(blocks=None, kind="nopressure",
                                 admission_max_tokens=MAX_MODEL_LEN), adopt=["returning"]),
        "off_c8k": off(chunk=8192),
        # At chunk 8192 the startup minimum (808) exceeds a fully resident
        # 6K request (502 with its hot region): no pressure by construction.
        # concurrent (4 x ~3K) neither: its admission waits for the fourth
        # request instead of giving up pages (run 10: 0 lost, 0 misses).
        "on_c8k": dict(on(chunk=8192, offload=True), no_pressure=["single6k", "concurrent"]),
        "off_eager": off(mode="eager"),
        "on_eager": on(mode="eager"),
        "off_fdo": off(mode="fdo"),
        "on_fdo": on(mode="fdo"),
        "off_share": off(model="glm_share"),
        "on_share": on(model="glm_share", offload=True),
        # Spec 2.10: followers' gathers on the copy stream (captured with a
        # fork and joins in the FULL decode graphs of the default mode)
        "on_share_pf": on(model="glm_share", offload=True, prefetch_followers=True),
        "off_dsv32": off(model="dsv32"),
        "on_dsv32": on(model="dsv32", offload=True),
        # Issue 17 item 2: 16 and 8 heads per rank (GLM-5 at TP 4 and 8)
        "off_h16": off(model="glm_h16"),
        "on_h16": on(model="glm_h16", offload=True),
        "off_l8": off(model="glm_l8"),
        "on_l8": on(model="glm_l8", offload=True),
        "off_h8": off(model="glm_h8"),
        "on_h8": on(model="glm_h8", offload=True),
        # E2E-10, two GPUs: one host pool shared by both ranks (rank 0 writes).
        "off_tp2": off(tp=2),
        "on_tp2": on(offload=True, tp=2),
        # E2E-5: MTP k = 1, 3 in the default mode and FULL_DECODE_ONLY,
        # without the offloader (the MTP path alone); F2 on the GPU: the
        # mirror audit covers the draft layer's rows.
        **{name: spec for t in MTP_TAGS
           for name, spec in ((f"off_{t}", specs_off[f"off_{t}"]), (f"on_{t}", on_mtp(t)))},
        "on_mtp3_audit": on_mtp("mtp3", audit=True),
        # P/D (4.13, INV-30): the prefill instance writes every prompt's KV
        # (1 token out), the HiSparse consumer imports it under the pressure
        # pool, its replay arm (below) imports the same files.
        "off_pd": specs_off["off_pd"],
        "pd_prefill": dict(off(chunk=PD_PRODUCER_CHUNK), pd="producer", max_out_tokens=1),
        "on_pd": on(pd="consumer"),
        # Replay arms: the off engine's configuration, following the
        # recorded schedules of the HiSparse engines run before them; a P/D
        # consumer's arm consumes the same files (only it can be bitwise).
        **{rep: dict(specs_off[ref], replay_of=ref, **PD_REPLAYS.get(rep, {}))
           for rep, ref in REPLAYS.items()},
    }


def with_spec(spec: dict, k: int) -> dict:
    """An engine spec with MTP k (E2E-5): ``spec`` (num_speculative_tokens)
    and the longer outputs; unchanged for k = 0."""
    return dict(spec, spec=k, out_tokens=MTP_OUT_TOKENS) if k else spec


REPLAYS = {
    "rep_c2k": "off_c2k", "rep_c8k": "off_c8k", "rep_eager": "off_eager",
    "rep_fdo": "off_fdo", "rep_share": "off_share", "rep_tp2": "off_tp2",
    "rep_dsv32": "off_dsv32", "rep_h16": "off_h16", "rep_h8": "off_h8", "rep_l8": "off_l8",
    **{f"rep_{t}": f"off_{t}" for t in MTP_TAGS}, "rep_pd": "off_pd",
}
"""Replay engine -> the off engine whose configuration it has; it replays
every HiSparse engine of that reference that ran before it."""
PD_REPLAYS = {"rep_pd": {"pd": "consumer"}}
"""What a replay arm has beyond its off engine: rep_pd imports the files
(synchronously: schedule_replay.py follows on_pd's asynchronous imports)."""
PRODUCERS = {"on_pd": "pd_prefill", "rep_pd": "pd_prefill"}
"""P/D consumer -> the engine that writes its files (earlier in --engines)."""
REFERENCE = {
    "on_c2k": "off_c2k", "on_c2k_audit": "off_c2k", "on_nooff": "off_c2k",
    "on_lazy": "off_c2k", "on_ordered": "off_c2k",
    "on_hostex": "off_c2k", "on_nopressure": "off_c2k", "on_c8k": "off_c8k",
    "on_eager": "off_eager", "on_fdo": "off_fdo", "on_share": "off_share",
    "on_share_pf": "off_share",
    "on_tp2": "off_tp2", "on_dsv32": "off_dsv32", "on_h16": "off_h16", "on_h8": "off_h8",
    "on_l8": "off_l8",
    **{f"on_{t}": f"off_{t}" for t in MTP_TAGS}, "on_mtp3_audit": "off_mtp3",
    "on_pd": "off_pd",
}
SCENARIO_ORDER = ("single6k", "single12k", "short_topk", "concurrent", "host_prefix",
                  "equal_followups", "chat_chain", "long_outputs", "returning",
                  "pd_imports", "fault_probe")
# HiSparse engines' scenarios. "returning" may hit F21 (staging capacity) and
# "fault_probe" poisons the host prefix cache: each comes last where it runs.
ON_PLAN = {
    # returning without the mirror audit (its per-step synchronization
    # removes every copy/forward overlap); on_c2k_audit runs it with it
    "on_c2k": ["single6k", "single12k", "short_topk", "concurrent", "host_prefix",
               "equal_followups", "chat_chain", "returning", "fault_probe"],
    "on_c2k_audit": ["single6k", "concurrent", "host_prefix", "chat_chain", "returning"],
    "on_nooff": ["chat_chain"],
    "on_lazy": ["single6k", "concurrent"],
    "on_ordered": ["single6k", "concurrent", "host_prefix", "returning"],
    "on_hostex": ["long_outputs"],
    "on_nopressure": ["single6k", "returning"],
    "on_c8k": ["single6k", "single12k", "concurrent", "equal_followups", "returning"],
    "on_eager": ["single6k"],
    "on_fdo": ["single6k", "concurrent", "fault_probe"],
    "on_share": ["single6k", "host_prefix"],
    "on_share_pf": ["single6k", "concurrent", "host_prefix", "fault_probe"],
    "on_tp2": ["single6k", "concurrent", "host_prefix"],
    "on_dsv32": ["single6k", "single12k", "concurrent", "host_prefix", "fault_probe"],
    # mixed prefill/decode batches (concurrent, equal_followups) on the
    # separate FP8 path with padded heads
    "on_h16": ["single6k", "concurrent", "equal_followups", "fault_probe"],
    "on_l8": ["single6k", "concurrent", "host_prefix", "fault_probe"],
    "on_h8": ["single6k", "concurrent", "equal_followups", "fault_probe"],
    # E2E-5: host_prefix drops the common hit's last token under MTP (R8)
    **{f"on_{t}": ["single6k", "concurrent", "host_prefix", "fault_probe"] for t in MTP_TAGS},
    "on_mtp3_audit": ["single6k", "concurrent", "host_prefix"],
    # P/D (4.13): on_pd's fault_probe prompt is imported too, host-landed
    # (125 pages do not fit resident), so the negative control corrupts an
    # imported host-only page and the replay over the clean files sees it.
    "on_pd": ["pd_imports", "fault_probe"],
}
SCENARIO_IDS = {
    "single6k": "E2E-1", "single12k": "E2E-1", "short_topk": "K9 (prompts <= top-k)",
    "concurrent": "E2E-2", "host_prefix": "E2E-4,E2E-7", "long_outputs": "E2E-9",
    "equal_followups": "K13 (uniform short chunks)", "returning": "F21, 4.13 (many returns)",
    "chat_chain": "R5 (soak run 19: follow-ups over their parents' decoded pages)",
    "pd_imports": "4.13, INV-30 (P/D imports: device and host landings)",
    "fault_probe": "T1 negative control",
}
ENGINE_IDS = {
    "on_c2k_audit": "F1 (mirror audit)", "on_nooff": "without the offloader",
    "on_lazy": "E2E-6", "on_nopressure": "E2E-8", "on_ordered": "P9 (K6 miss order)",
    "on_c8k": "chunk 8192", "on_eager": "E2E-3 (eager)", "on_fdo": "E2E-3",
    "on_share": "IndexShare", "on_share_pf": "IndexShare, 2.10 (followers prefetched)",
    "on_tp2": "E2E-10", "on_dsv32": "DeepSeek-V3.2",
    "on_h16": "16 heads per rank", "on_h8": "8 heads per rank",
    "on_l8": "8 layers, strided addressing (K8)",
    **{f"on_{t}": f"E2E-5 (MTP {k}{', E2E-3' if m == 'fdo' else ''})"
       for t, (k, m) in MTP_TAGS.items()},
    "on_mtp3_audit": "E2E-5, F2 (mirror audit, MTP 3)",
    "on_pd": "4.13 P/D consumer",
}
DEFAULT_ENGINES = ("off_c2k", "on_c2k", "on_c2k_audit", "on_lazy", "on_hostex", "rep_c2k",
                   "off_c8k", "on_c8k", "rep_c8k")


def spec_ids(engine: str, scenario: str) -> str:
    tag = ENGINE_IDS.get(engine)
    return SCENARIO_IDS[scenario] + (f" [{tag}]" if tag else "")


def plan_for(engine: str, wanted: list[str]) -> list[str]:
    """An ON engine's own plan; an OFF engine runs every scenario its
    wanted dependents compare with, in SCENARIO_ORDER; a replay engine
    replays "on_engine/scenario" for every HiSparse engine of its
    reference before it in ``wanted``."""
    if engine in ON_PLAN:
        return list(ON_PLAN[engine])
    if engine in set(PRODUCERS.values()):
        need = {s for e in wanted if PRODUCERS.get(e) == engine and e in ON_PLAN
                for s in ON_PLAN[e]}
        return [s for s in SCENARIO_ORDER if s in need]
    if engine in REPLAYS:
        before = wanted[:wanted.index(engine)]
        return [f"{e}/{s}" for e in before if REFERENCE.get(e) == REPLAYS[engine]
                for s in ON_PLAN[e]]
    need = {s for e in wanted if REFERENCE.get(e) == engine for s in ON_PLAN[e]}
    return [s for s in SCENARIO_ORDER if s in need]


def validate_engines(wanted: list[str], specs: dict) -> None:
    """Known names; the first one is a HiSparse-off engine (it measures the
    sensitivity control and fixes the weights of the run); every HiSparse
    engine's reference comes before it."""
    unknown = [e for e in wanted if e not in specs]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; known: {', '.join(specs)}")
    if not wanted:
        raise ValueError("no engine to run")
    if specs[wanted[0]]["hisparse"] is not None:
        raise ValueError(f"the first engine ({wanted[0]}) must be a HiSparse-off engine: "
                         "it measures the sensitivity control")
    for i, e in enumerate(wanted):
        ref = REFERENCE.get(e)
        if ref is not None and ref not in wanted[:i]:
            raise ValueError(f"{e} needs its reference {ref} earlier in --engines")
        if e in REPLAYS and not plan_for(e, wanted):
            raise ValueError(f"{e} replays the HiSparse engines of {REPLAYS[e]}: "
                             "name at least one of them earlier in --engines")
        producer = PRODUCERS.get(e)
        if producer is not None and producer not in wanted[:i]:
            raise ValueError(f"{e} imports what {producer} writes: name it earlier "
                             "in --engines")
        if specs[e].get("pd") == "producer" and not plan_for(e, wanted):
            raise ValueError(f"{e} writes files for a P/D consumer: name one after it")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", default=os.environ.get("HISPARSE_STAGE", "/root/stage"))
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES))
    ap.add_argument("--scenarios", default=None, help="limit to these scenarios")
    ap.add_argument("--variant", default=None,
                    help="measure only this weight variant (default: all, in order)")
    ap.add_argument("--p2", action="store_true",
                    help="also time decode (P2) in off_c2k and on_nopressure")
    ap.add_argument("--scenario-timeout", type=float, default=90.0,
                    help="seconds before a scenario's requests are aborted")
    a = ap.parse_args(argv)
    a.engines = [e for e in a.engines.split(",") if e]
    a.scenarios = set(a.scenarios.split(",")) if a.scenarios else None
    validate_engines(a.engines, engine_specs())
    if a.variant is not None:
        seeded_init.variant(a.variant)
    if a.scenarios is not None and a.scenarios - set(SCENARIO_ORDER):
        raise ValueError(f"unknown scenario(s) {sorted(a.scenarios - set(SCENARIO_ORDER))}")
    return a


# -------------------------------------------------------------- helpers


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def core(llm):
    """The in-process EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    client = llm.llm_engine.engine_core
    return getattr(client, "engine_core", client)


def instrument(llm) -> None:
    """Count preemptions and external (offloaded) tokens in the scheduler,
    and record (or, in a replay engine, follow) its keyed schedule
    (schedule_replay.ScheduleTap)."""
    sched = core(llm).scheduler
    sched._hs_preemptions = 0
    sched._hs_tap = schedule_replay.ScheduleTap(sched)
    preempt = sched._preempt_request

    def counted(*a, **kw):
        sched._hs_preemptions += 1
        return preempt(*a, **kw)

    sched._preempt_request = counted
    connector = getattr(sched, "connector", None)
    if connector is not None:
        connector._hs_external_tokens = 0
        update = connector.update_state_after_alloc

        def tracked(request, blocks, num_external_tokens):
            connector._hs_external_tokens += int(num_external_tokens)
            return update(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = tracked
    instrument_acceptance(sched)


# ------------------------------------------------------------- acceptance


def new_tally(k: int) -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
            "drafted_per_pos": [0] * k, "accepted_per_pos": [0] * k}


def observe(tally: dict, num_draft_tokens: int, num_accepted_tokens: int,
            num_invalid_spec_tokens: dict | None, request_id: str) -> None:
    """One request-step's drafts, counted by the pin's own
    Scheduler.make_spec_decoding_stats with log stats forced on (its
    invalid-draft rule and SpecDecodingStats.observe_draft), whether or not
    the engine logs stats."""
    from vllm.v1.core.sched.scheduler import Scheduler

    k = len(tally["drafted_per_pos"])
    stats = Scheduler.make_spec_decoding_stats(
        SimpleNamespace(log_stats=True, num_spec_tokens=k), None,
        num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens,
        num_invalid_spec_tokens=num_invalid_spec_tokens, request_id=request_id)
    if stats is None:
        return
    tally["drafts"] += stats.num_drafts
    tally["draft_tokens"] += stats.num_draft_tokens
    tally["accepted_tokens"] += stats.num_accepted_tokens
    for name, per_pos in (("drafted_per_pos", stats.num_draft_tokens_per_pos),
                          ("accepted_per_pos", stats.num_accepted_tokens_per_pos)):
        tally[name] = [a + b for a, b in zip(tally[name], per_pos)]


def instrument_acceptance(sched) -> None:
    """E2E-5: sum every request's drafts and accepted tokens (the scheduler
    calls make_spec_decoding_stats per request and step even with stats
    off, when it then returns None). Engines without drafts: nothing."""
    k = getattr(sched, "num_spec_tokens", 0)
    if not k:
        return
    sched._hs_spec = new_tally(k)
    make = sched.make_spec_decoding_stats

    def counted(stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                request_id):
        observe(sched._hs_spec, num_draft_tokens, num_accepted_tokens,
                num_invalid_spec_tokens, request_id)
        return make(stats, num_draft_tokens=num_draft_tokens,
                    num_accepted_tokens=num_accepted_tokens,
                    num_invalid_spec_tokens=num_invalid_spec_tokens, request_id=request_id)

    sched.make_spec_decoding_stats = counted


def acceptance(llm) -> dict | None:
    """A copy of the engine's tally so far (None: no drafts configured)."""
    tally = getattr(core(llm).scheduler, "_hs_spec", None)
    return json.loads(json.dumps(tally)) if tally is not None else None


def tally_delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None or before is None:
        return None
    return {k: ([x - y for x, y in zip(v, before[k])] if isinstance(v, list)
                else v - before[k]) for k, v in after.items()}


def acceptance_verdict(on: dict, decisive: dict | None, decided_by: str | None,
                       off: dict | None) -> dict:
    """E2E-5: HiSparse's acceptance equals the decisive arm's (the replay,
    or the natural off arm) wherever that arm ran the same keyed schedule:
    same batches, so the same drafts; the off arm reported beside. No
    equal-schedule arm: nothing to compare (the scenario fails anyway)."""
    arm = {"replay": (decisive or {}).get("acceptance"), "natural": off}.get(decided_by)
    comparable = decisive is not None and decisive.get("schedule_equal") and arm is not None
    equal = on == arm if comparable else None
    return {"on": on, "decisive": arm, "decided_by": decided_by, "off": off,
            "equal": equal, "pass": equal is not False,
            "rate": {n: (t["accepted_tokens"] / t["draft_tokens"]
                         if t and t["draft_tokens"] else None)
                     for n, t in (("on", on), ("off", off))}}


def scheduler_counters(llm) -> dict:
    sched = core(llm).scheduler
    coordinator = sched.kv_cache_manager.coordinator
    stats = getattr(getattr(coordinator, "hisparse", None), "stats", None)
    out = {"preemptions": getattr(sched, "_hs_preemptions", 0)}
    if stats is not None:
        out.update({k: int(v) for k, v in vars(stats).items()})
        out["scheduler_waits"] = compare.scheduler_waits(stats)
        out["pending_spills"] = len(coordinator.hisparse.pending_spills)
    connector = getattr(sched, "connector", None)
    out["external_tokens"] = getattr(connector, "_hs_external_tokens", 0)
    return out


def worker_counters(worker) -> dict:
    runtime = worker.model_runner.hisparse_runtime
    if runtime is None:
        return {}
    from vllm.v1.hisparse.debug_faults import fault_status
    from vllm.v1.hisparse.worker import current_worker

    out = runtime.stats()
    data_plane = current_worker()
    if data_plane is not None:
        out["audit_rows_checked"] = data_plane.audit_rows_checked
        out["audit_mismatches"] = data_plane.audit_mismatches
        out["fault_fired"] = fault_status()["fired"]
        events = data_plane.host_write
        for name in ("exact_waits", "early_steps"):  # a shared pool's reader
            if hasattr(events, name):
                out[f"reader_{name}"] = getattr(events, name)
    return out


def host_pool_role(worker) -> dict:
    """This rank's host pool: shared or private, writer or reader (4.12)."""
    from vllm.v1.hisparse.worker import current_worker

    data_plane = current_worker()
    if data_plane is None:
        return {}
    return {"shared": data_plane.sharing is not None, "writer": data_plane.writer}


def counters(llm) -> dict:
    """Scheduler counters plus the workers', summed over the TP ranks."""
    out = scheduler_counters(llm)
    for part in llm.collective_rpc(worker_counters):
        for k, v in part.items():
            out[k] = out.get(k, 0) + v if isinstance(v, int) else v
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: (v - before.get(k, 0) if isinstance(v, int) else v) for k, v in after.items()}


@contextlib.contextmanager
def scoped_env(values: dict[str, str]):
    """Env vars read at engine startup (the worker reads the debug flags in
    its constructor), removed again afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_env(spec: dict, plan: list[str]) -> dict[str, str]:
    env = {}
    if spec.get("separate_prefill"):
        # Below 32 heads per rank: the FP8 path HiSparse serves (K31).
        from vllm.v1.hisparse.config_checks import FP8_SEPARATE_PREFILL_ENV

        env[FP8_SEPARATE_PREFILL_ENV] = "1"
    if spec["hisparse"] is not None and spec.get("audit"):
        env[DEBUG_ENV] = "1"
    if spec["hisparse"] is not None and "fault_probe" in plan:
        env[FAULTS_ENV] = "1"
    return env


def llm_kwargs(spec: dict, model_dirs: dict, pd_dir: Path | None = None) -> dict:
    """LLM(...) keyword arguments of an engine (plain values and configs);
    ``pd_dir``: the P/D engines' shared_storage_path."""
    from vllm.config import AttentionConfig, KVTransferConfig
    from vllm.config.hisparse import HiSparseConfig

    kw = dict(BASE, model=str(model_dirs[spec["model"]]),
              max_num_batched_tokens=spec["chunk"], **MODES[spec["mode"]])
    if spec.get("tp", 1) > 1:
        kw.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    if spec.get("spec"):
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec["spec"]}
    if spec["hisparse"] is None:
        # The prefill path HiSparse forces (K9), set explicitly in the off arm.
        kw["attention_config"] = AttentionConfig(sparse_mla_force_mqa=True)
        kw["kv_cache_memory_bytes"] = OFF_KV_BYTES
        if spec.get("pd"):
            kw["kv_transfer_config"] = pd_transfer_config(spec, pd_dir)
        return kw
    kw["attention_config"] = AttentionConfig(
        hisparse_config=HiSparseConfig(**spec["hisparse"]))
    if spec.get("blocks"):
        kw["num_gpu_blocks_override"] = spec["blocks"]
    else:
        kw["kv_cache_memory_bytes"] = OFF_KV_BYTES
    if spec.get("offload"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", **OFFLOAD})
    if spec.get("pd"):
        kw["kv_transfer_config"] = pd_transfer_config(spec, pd_dir)
    return kw


def pd_transfer_config(spec: dict, pd_dir: Path | None):
    """A P/D engine's kv_transfer_config over ``pd_dir``: the producer and
    the HiSparse-off consumer with SparseMLAExampleConnector (synchronous
    loads), the HiSparse consumer with the pin's ExampleConnector, which
    HiSparse composes into its importer (asynchronous loads)."""
    from vllm.config import KVTransferConfig

    if pd_dir is None:
        raise ValueError("a P/D engine needs the files' folder (pd_dir)")
    role = "kv_producer" if spec["pd"] == "producer" else "kv_consumer"
    extra = {"shared_storage_path": str(pd_dir)}
    if spec["hisparse"] is not None:
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role=role,
                                kv_connector_extra_config=extra)
    return KVTransferConfig(kv_connector=PD_CONNECTOR, kv_connector_module_path=PD_MODULE,
                            kv_role=role, kv_connector_extra_config=extra)


def pd_folders(pd_dir: Path) -> set[str]:
    """The prompts' folders the producer wrote so far."""
    return {p.name for p in pd_dir.iterdir() if p.is_dir()} if pd_dir.is_dir() else set()


def reset_pd_dir(pd_dir: Path) -> None:
    """An empty folder for the producer: files of another run (other
    weights) would be imported by the consumers, and by the producer itself
    (the pin's connector loads whatever it finds)."""
    import shutil

    shutil.rmtree(pd_dir, ignore_errors=True)
    pd_dir.mkdir(parents=True)


def queued_failures(llm) -> list[str]:
    """Exceptions held by the engine core's batch queue. Under async
    scheduling the engine issues step t+1's execute_model before it reads
    step t's sample_tokens future, so an exception in step t's sampling or
    drafting surfaces as whatever step t+1 then trips over; the original
    stays in the queued future (in-process engine core only)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    # (sample future, scheduler output, execute future); a step that samples
    # nothing queues its execute future in both places
    futures = {id(f): f for item in list(getattr(core, "batch_queue", None) or ())
               for f in (item[0], item[2])}
    return ["".join(traceback.format_exception(f.exception()))[-4000:]
            for f in futures.values() if f.done() and f.exception() is not None]


def resolved_defaults(llm) -> dict:
    vc = llm.llm_engine.vllm_config
    return {
        "async_scheduling": bool(vc.scheduler_config.async_scheduling),
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "max_model_len": vc.model_config.max_model_len,
        "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
        "compilation_mode": str(vc.compilation_config.mode),
        "kv_connector": vc.kv_transfer_config.kv_connector if vc.kv_transfer_config else None,
        "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
        "sparse_mla_force_mqa": vc.attention_config.sparse_mla_force_mqa,
    }


def sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=compare.TOP_LOGPROBS, detokenize=False)


class ScenarioAborted(Exception):
    """The scenario's requests were aborted (the engine stays usable)."""


PREEMPTION_STORM = 200
"""Preemptions within one scenario that mean a livelock (a healthy run has
0; host exhaustion a few): its requests are aborted."""


def generate_records(llm, prompts: list[list[int]], max_tokens: list[int],
                     deadline: float, keys: list[str] | None = None) -> list[dict]:
    """One generate() call; a record (tokens + logprob bits) per prompt.

    LLM.generate's loop (enqueue, then step until done) with two exits: past
    ``deadline``, or after PREEMPTION_STORM preemptions, the unfinished
    requests are aborted through the engine (output processor and
    scheduler), so the engine stays usable for the next scenario."""
    engine, sched = llm.llm_engine, core(llm).scheduler
    internal = llm.enqueue([{"prompt_token_ids": p} for p in prompts],
                           [sampling(n) for n in max_tokens], use_tqdm=False)
    # enqueue returns internal ids (LLM's counter + "-" + 8 random chars,
    # InputProcessor.assign_request_id); outputs and aborts use the counter.
    ids = [i.split("-", 1)[0] for i in internal]
    tap = getattr(sched, "_hs_tap", None)
    if keys is not None and tap is not None:
        for rid, key in zip(internal, keys):
            tap.name(rid, key)
    preempted_before = getattr(sched, "_hs_preemptions", 0)
    done: dict[str, object] = {}
    why = None
    while engine.has_unfinished_requests():
        storm = getattr(sched, "_hs_preemptions", 0) - preempted_before >= PREEMPTION_STORM
        if why is None and (storm or time.time() > deadline):
            why = f"{PREEMPTION_STORM} preemptions (livelock)" if storm else "deadline"
            engine.abort_request([i for i in ids if i not in done])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    if why is not None or len(done) != len(ids):
        raise ScenarioAborted(f"aborted: {why or 'requests lost'}; "
                              f"{len(done)} of {len(ids)} finished")
    return [compare.record_from_output(done[i].outputs[0].token_ids,
                                       done[i].outputs[0].logprobs) for i in ids]


def scenario_calls(name: str, out_tokens: int = 0, max_out: int | None = None) -> list:
    """The scenario's calls, every turn generating at least ``out_tokens``
    and, with ``max_out`` (a P/D producer: 1), at most that many."""
    def n(t) -> int:
        m = max(t.max_tokens, out_tokens)
        return m if max_out is None else min(m, max_out)

    return [[dataclasses.replace(t, max_tokens=n(t)) for t in call]
            for call in workload.scenario(name)]


def settle(llm, deadline: float) -> None:
    """Step the engine until its scheduler holds no work: generate() returns
    once every output is final, while a finished request's last spills may
    still be landing (zero-token steps carry them, INV-15) and keep host
    blocks leased, which a prefix-cache reset refuses."""
    sched = core(llm).scheduler
    while sched.has_requests() and time.time() < deadline:
        llm.llm_engine.step()


def run_scenario(llm, name: str, deadline: float, plan: list | None = None,
                 out_tokens: int = 0, max_out: int | None = None
                 ) -> tuple[dict[str, dict], list, dict | None]:
    """Every call of the scenario in order, from an empty prefix cache, on
    the engine's own schedule or following ``plan`` (another engine's keyed
    steps); the records by request key ("call/conversation"), the keyed
    steps and where a replay diverged (None)."""
    # Every scenario starts from an empty prefix cache. A replay engine
    # replays one scenario once per HiSparse engine, and vLLM's block pool
    # serves a prefix hit from the FIRST block cached for a hash: a
    # follow-up would read the previous replay's KV of the same tokens,
    # computed under another schedule (run 27's `returning` failure).
    settle(llm, deadline)
    if not llm.reset_prefix_cache():
        raise ScenarioAborted("aborted: the prefix cache could not be reset before it")
    tap = core(llm).scheduler._hs_tap
    tap.start(plan)
    histories: dict[str, list[int]] = {}
    records: dict[str, dict] = {}
    for c, call in enumerate(scenario_calls(name, out_tokens, max_out)):
        prompts = [workload.prompt_of(t, histories) for t in call]
        keys = [f"{c}/{t.conv}" for t in call]
        recs = generate_records(llm, prompts, [t.max_tokens for t in call], deadline, keys)
        for t, p, r, k in zip(call, prompts, recs, keys):
            workload.record_turn(t, p, r["tokens"], histories)
            records[k] = r
    diverged = tap.finish()
    return records, list(tap.steps), diverged


def apply_variant(llm, name: str) -> dict:
    """Re-initialise the weights in place, then drop every cached prefix
    (its KV came from other weights)."""
    summary = llm.apply_model(functools.partial(seeded_init.apply, variant_name=name))[0]
    # The MTP drafter is not reached by apply_model (worker_base.apply_model
    # passes get_model() only); its aliases of the target are skipped.
    drafter = llm.collective_rpc(functools.partial(seeded_init.apply_drafter,
                                                   variant_name=name))[0]
    if drafter is not None:
        summary["drafter"] = drafter
    summary["prefix_cache_reset"] = bool(llm.reset_prefix_cache())
    return summary


def measure_sensitivity(llm, names: list[str]) -> dict:
    """The sensitivity control: per variant, 8 prompts and their twins with
    the early 40% replaced, 16 greedy tokens each, in one engine."""
    base, twins = workload.sensitivity_prompts()
    steps, needed = workload.SENSITIVITY_STEPS, workload.SENSITIVITY_NEEDED
    figures = []
    for name in names:
        t0 = time.time()
        apply_variant(llm, name)
        recs = generate_records(llm, base + twins, [steps] * (2 * len(base)),
                                time.time() + 120)
        fig = compare.sensitivity_figures(name, recs[:len(base)], recs[len(base):],
                                          steps, needed)
        fig["wall_s"] = round(time.time() - t0, 1)
        figures.append(fig)
        log("sensitivity", fig)
    chosen, ok = compare.choose_variant(figures)
    return {"criterion": f"replacing the first {workload.SENSITIVITY_FRACTION:.0%} of "
                         f"{len(base)} prompts of {workload.SENSITIVITY_LEN} tokens changes "
                         f"the greedy tokens within {steps} steps for >= {needed}",
            "variants": figures, "chosen": chosen, "meets": ok}


def measure_determinism(llm, name: str) -> dict:
    """The precondition of a bitwise gate, measured in the run's first
    engine: one request (single6k's prompt, 8 tokens, prefilled from scratch
    each time) run twice gives bitwise-identical tokens and logprobs with
    the canonical top-k order; run twice with the pin's native order (the
    flag off for prefill; decode graphs keep what they captured) it may
    not."""
    from vllm.v1.hisparse import determinism

    (turn,) = workload.scenario("single6k")[0]
    prompt = workload.prompt_of(turn, {})

    def twice() -> bool:
        runs = []
        for _ in range(2):
            llm.reset_prefix_cache()
            runs.append(generate_records(llm, [prompt], [8], time.time() + 60)[0])
        return runs[0] == runs[1]

    canonical = determinism.CANONICAL_TOPK
    out = {"engine": name, "canonical_topk": canonical,
           "identical_with_canonical_order": twice() if canonical else None}
    determinism.CANONICAL_TOPK = False
    try:
        out["identical_with_native_order"] = twice()
    finally:
        determinism.CANONICAL_TOPK = canonical
    llm.reset_prefix_cache()
    return out


def p2(llm) -> dict:
    """Decode ms per step at batch 1 and 16 (P2): (time of 288 new tokens -
    time of 32) / 256, the prompts prefix-cached, best of three."""
    import torch
    from vllm import SamplingParams

    rng = random.Random(f"{workload.SEED}-p2")
    out = {}
    for batch in (1, 16):
        ps = [{"prompt_token_ids": [rng.randrange(2, workload.VOCAB) for _ in range(1000)]}
              for _ in range(batch)]

        def timed(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        timed(32)  # warm: compile this batch's graphs, cache the prompts
        short = min(timed(32) for _ in range(3))
        long = min(timed(288) for _ in range(3))
        out[f"batch{batch}_decode_ms_per_step"] = round((long - short) / 256 * 1e3, 4)
    return out


# ------------------------------------------------------------------ main


MODEL_DIRS = {"glm": "tiny_glm5", "glm_share": "tiny_glm5_share", "dsv32": "tiny_dsv32",
              "glm_h16": "tiny_glm5_h16", "glm_h8": "tiny_glm5_h8", "glm_mtp": "tiny_glm5_mtp",
              "glm_l8": "tiny_glm5_l8"}


def make_models(stage: Path) -> dict[str, Path]:
    dirs = {name: stage / MODEL_DIRS[name] for name in MODELS}
    for name, path in dirs.items():
        if not (path / "config.json").exists():
            subprocess.run([sys.executable, str(HERE / "make_tiny_glm5.py"), str(path),
                            "--max-pos", str(MAX_MODEL_LEN), *MODELS[name][0]], check=True)
    return dirs


def shutdown(llm) -> None:
    import torch

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:  # noqa: BLE001 - keep going to the next engine
        log("shutdown error", repr(err))
    from vllm.v1.hisparse.host_pool import release_host_pools

    release_host_pools()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as err:  # noqa: BLE001
        log("cleanup error", repr(err))
    del llm
    gc.collect()
    torch.cuda.empty_cache()


class Gate:
    """The run: engines in order, the shared weights, results in R."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "e2e.json"
        self.specs = engine_specs()
        self.R: dict = {"command": " ".join(sys.argv), "engines": {}, "scenarios": [],
                        "records": {}, "traces": {}, "sensitivity": None,
                        "negative_control": [], "startup_minimum_blocks": {
                            **{c: startup_minimum_blocks(MAX_MODEL_LEN, c) for c in CHUNKS},
                            **{f"mtp{k}": startup_minimum_blocks(MAX_MODEL_LEN, 2048, q=1 + k)
                               for k in MTP_PRESSURE_BLOCKS}}}
        self.variant: str | None = None
        self.pd_dir = self.out / PD_DIR
        self.fingerprints: dict[str, dict] = {}
        self.failures: list[str] = []

    def save(self) -> None:
        """e2e.json (readable) and e2e_records.json (every request's tokens,
        logprob bits and schedule trace, compact)."""
        self.R["failures"] = self.failures
        bulky = ("records", "traces")
        self.path.write_text(json.dumps({k: v for k, v in self.R.items() if k not in bulky},
                                        indent=1))
        (self.out / "e2e_records.json").write_text(
            json.dumps({k: self.R[k] for k in bulky}, separators=(",", ":")))

    def fail(self, what: str) -> None:
        self.failures.append(what)
        log("FAIL", what)

    # ------------------------------------------------------------ engine

    def run(self) -> int:
        import torch
        import vllm
        from vllm.v1.hisparse import determinism

        # In-process engines read the flag per forward; whatever imported
        # the module first, every engine of the gate sorts (the env var set
        # above reaches TP workers' processes).
        determinism.CANONICAL_TOPK = True

        self.R.update(vllm_version=vllm.__version__, torch=torch.__version__,
                      gpu=torch.cuda.get_device_name(0))
        self.model_dirs = make_models(Path(self.a.stage))
        for name in self.a.engines:
            self.run_engine(name)
        self.finish()
        return 1 if self.failures else 0

    def run_engine(self, name: str) -> None:
        spec = self.specs[name]
        if self.variant is None and spec["hisparse"] is not None:
            self.fail(f"{name}: not run, the first (HiSparse-off) engine fixed no weights")
            return
        plan = [s for s in plan_for(name, self.a.engines)
                if self.a.scenarios is None or s.split("/")[-1] in self.a.scenarios]
        if self.a.p2 and name in ("off_c2k", "on_nopressure"):
            plan.append("p2")
        rec = self.R["engines"].setdefault(name, {"spec": spec, "plan": plan})
        log("engine", name, "start", plan)
        t0 = time.time()
        try:
            if spec.get("pd") == "producer":
                reset_pd_dir(self.pd_dir)
            kw = llm_kwargs(spec, self.model_dirs, self.pd_dir)
            rec["llm_kwargs"] = {k: str(v) for k, v in kw.items()}
            from vllm import LLM

            with scoped_env(engine_env(spec, plan)):
                llm = LLM(**kw)
        except Exception:
            rec["error"] = traceback.format_exc()[-6000:]
            self.fail(f"{name}: engine did not start")
            self.save()
            return
        rec["init_s"] = round(time.time() - t0, 1)
        try:
            rec["defaults"] = resolved_defaults(llm)
            self.prepare(llm, name, spec, rec)
            for scenario in plan:
                if not self.run_one(llm, name, spec, scenario):
                    rec["stopped_after"] = scenario  # an engine error: skip the rest
                    break
        except Exception:
            rec["error"] = traceback.format_exc()[-6000:]
            self.fail(f"{name}: {rec['error'].splitlines()[-1]}")
        finally:
            shutdown(llm)
            self.save()

    def prepare(self, llm, name: str, spec: dict, rec: dict) -> None:
        """The run's weights (the sensitivity control in its first engine),
        their fingerprint, the host pool roles, the instrumentation."""
        if self.variant is None:
            names = [self.a.variant] if self.a.variant else [v.name for v in seeded_init.VARIANTS]
            sens = measure_sensitivity(llm, names)
            sens["engine"] = name
            self.R["sensitivity"] = sens
            self.variant = sens["chosen"]
            if not sens["meets"]:
                self.fail(f"sensitivity control: no variant meets it ({sens['criterion']})")
            rec["weights"] = apply_variant(llm, self.variant)
            det = self.R["determinism"] = measure_determinism(llm, name)
            log("determinism", det)
            if not det["identical_with_canonical_order"]:
                self.fail("determinism control: one engine, one request, two runs "
                          f"differ even with the canonical top-k order ({det})")
        rec["weights"] = apply_variant(llm, self.variant)
        prints = llm.collective_rpc(seeded_init.worker_fingerprint)  # target + drafter
        rec["weights_fingerprint"] = [p["digest"] for p in prints]
        self.fingerprints[name] = {"key": (spec["model"], spec.get("tp", 1)), "prints": prints}
        rec["host_pool_roles"] = llm.collective_rpc(host_pool_role)
        instrument(llm)
        log("engine", name, "ready in", rec["init_s"], "s", rec["defaults"],
            "variant", self.variant)

    # ---------------------------------------------------------- scenario

    def run_one(self, llm, name: str, spec: dict, scenario: str) -> bool:
        """Run and judge one scenario; False if the engine is unusable. A
        replay engine's scenario is "on_engine/scenario"."""
        if name in REPLAYS:
            return self.replay_one(llm, name, scenario)
        entry = {"engine": name, "scenario": scenario,
                 "spec_ids": spec_ids(name, scenario) if scenario != "p2" else "P2"}
        ok = True
        try:
            if scenario == "p2":
                entry["p2"] = p2(llm)
            else:
                self.measure(llm, name, scenario, entry)
        except ScenarioAborted as err:
            entry["error"] = str(err)  # aborted cleanly: the engine goes on
            self.fail(f"{name}/{scenario}: {err}")
        except Exception:
            entry["error"] = traceback.format_exc()[-6000:]
            masked = queued_failures(llm)
            if masked:
                entry["masked_errors"] = masked
            self.fail(f"{name}/{scenario}: {entry['error'].splitlines()[-1]}")
            ok = False
        if name in REFERENCE and "error" not in entry and scenario != "p2":
            self.judge(name, spec, scenario, entry)
        log(name, scenario, {k: v for k, v in entry.items() if k != "error"},
            entry.get("error", ""))
        self.R["scenarios"].append(entry)
        self.save()
        return ok

    def measure(self, llm, name: str, scenario: str, entry: dict) -> None:
        fault = self.specs[name]["hisparse"] is not None and scenario == "fault_probe"
        if fault:
            from vllm.v1.hisparse.debug_faults import arm_host_row_fault

            entry["armed"] = llm.collective_rpc(arm_host_row_fault)
        t0 = time.time()
        before, spec_before = counters(llm), acceptance(llm)
        folders = pd_folders(self.pd_dir)
        records, trace, _ = run_scenario(llm, scenario, t0 + self.a.scenario_timeout,
                                         out_tokens=self.specs[name].get("out_tokens", 0),
                                         max_out=self.specs[name].get("max_out_tokens"))
        if self.specs[name].get("pd") == "producer":
            self.check_saved(name, scenario, entry, len(records),
                             pd_folders(self.pd_dir) - folders)
        entry["wall_s"] = round(time.time() - t0, 1)
        entry["counters"] = delta(counters(llm), before)
        if spec_before is not None:
            entry["acceptance"] = tally_delta(acceptance(llm), spec_before)
        if fault:
            from vllm.v1.hisparse.debug_faults import fault_status

            entry["fault"] = llm.collective_rpc(fault_status)[0]
        key = f"{name}/{scenario}"
        self.R["records"][key], self.R["traces"][key] = records, trace
        entry["distinct_tokens"] = len({t for r in records.values() for t in r["tokens"]})
        entry["steps"] = len(trace)

    def check_saved(self, name: str, scenario: str, entry: dict, requests: int,
                    new: set[str]) -> None:
        """The producer wrote a folder for every prompt of the scenario (a
        prompt's files are what its consumers import)."""
        files = sorted({len(list((self.pd_dir / f).iterdir())) for f in new})
        entry["pd_saved"] = {"folders": len(new), "requests": requests,
                             "files_per_folder": files}
        if len(new) != requests or len(files) != 1:
            self.fail(f"{name}/{scenario}: the producer saved {entry['pd_saved']}")

    def judge(self, name: str, spec: dict, scenario: str, entry: dict) -> None:
        ref = f"{REFERENCE[name]}/{scenario}"
        if ref not in self.R["records"]:
            entry["error"] = f"reference {ref} not run"
            self.fail(f"{name}/{scenario}: reference not run")
            return
        key = f"{name}/{scenario}"
        cmp = compare.compare_scenario(self.R["records"][ref], self.R["records"][key],
                                       unkeyed(self.R["traces"][ref]),
                                       unkeyed(self.R["traces"][key]))
        entry["comparison"] = cmp
        checks = compare.evaluate_checks(compare.expected_checks(spec, scenario),
                                         entry["counters"])
        if spec.get("tp", 1) > 1:
            checks["one_shared_pool_one_writer"] = self.R["engines"][name][
                "host_pool_roles"] == [{"shared": True, "writer": r == 0}
                                       for r in range(spec["tp"])]
        entry["checks"] = checks
        # Provisional (finish() decides): a differing natural schedule waits
        # for the replay; the negative control needs the engine's clean runs.
        entry["pass"] = cmp["pass"] and all(checks.values())

    def replay_one(self, llm, name: str, item: str) -> bool:
        """Replay a HiSparse engine's scenario with its recorded steps and
        compare: keyed schedules equal, logprobs bitwise."""
        engine, scenario = item.split("/", 1)
        key = f"{engine}/{scenario}"
        entry = self.entry_of(engine, scenario)
        if key not in self.R["records"] or entry is None or "error" in entry:
            return True  # the HiSparse engine did not finish it: nothing to replay
        t0 = time.time()
        rec: dict = {"engine": name}
        ok = True
        spec_before = acceptance(llm)
        try:
            records, steps, diverged = run_scenario(
                llm, scenario, t0 + self.a.scenario_timeout, plan=self.R["traces"][key],
                out_tokens=self.specs[name].get("out_tokens", 0))
            if spec_before is not None:
                rec["acceptance"] = tally_delta(acceptance(llm), spec_before)
            self.R["records"][f"{name}/{key}"] = records
            self.R["traces"][f"{name}/{key}"] = steps
            rec.update(compare.compare_scenario(records, self.R["records"][key],
                                                steps, self.R["traces"][key], replay=True),
                       diverged=diverged)
        except ScenarioAborted as err:  # the engine stays usable
            rec.update({"error": str(err)})
        except Exception:
            rec.update({"error": traceback.format_exc()[-6000:]})
            ok = False
        if "error" in rec:
            rec.update({"pass": False, "schedule_equal": False,
                        "note": rec["error"].strip().splitlines()[-1]})
        rec["wall_s"] = round(time.time() - t0, 1)
        entry["replay"] = rec
        log(name, key, {k: v for k, v in rec.items() if k != "error"}, rec.get("error", ""))
        self.save()
        return ok

    def entry_of(self, engine: str, scenario: str) -> dict | None:
        return next((e for e in self.R["scenarios"]
                     if e["engine"] == engine and e["scenario"] == scenario), None)

    # ------------------------------------------------------------ finish

    def verdicts(self) -> None:
        """Every HiSparse scenario's final verdict: its decisive comparison
        (the replay's, or the natural one under equal batches) passed and
        its checks held; the negative control was detected under equal
        batches after a clean pass of the same engine under pressure."""
        judged = [e for e in self.R["scenarios"] if "checks" in e]
        clean = {}
        for e in judged:
            cmp = compare.decisive(e)
            e["decided_by"] = ("replay" if e.get("replay") is not None else
                               "natural" if cmp is not None else None)
            if e["scenario"] != "fault_probe":
                acc = self.acceptance_check(e, cmp)
                e["pass"] = (cmp is not None and cmp["pass"] and acc["pass"]
                             and e["comparison"]["pass"] and all(e["checks"].values()))
                if e["pass"] and e["counters"].get("misses", 0) > 0:
                    clean[e["engine"]] = clean.get(e["engine"], 0) + 1
        for e in judged:
            cmp = compare.decisive(e)
            if e["scenario"] == "fault_probe":
                nc = compare.negative_control(cmp, e.get("fault", {}), clean.get(e["engine"], 0))
                nc["engine"] = e["engine"]
                e["negative_control"] = nc
                self.R["negative_control"].append(nc)
                e["pass"] = nc["pass"] and all(e["checks"].values())
            if not e["pass"]:
                why = cmp["note"] if cmp is not None else "schedule differed and no replay ran"
                if not e.get("acceptance_check", {}).get("pass", True):
                    why = f"MTP acceptance differs from the {e['decided_by']} arm's"
                self.fail(f"{e['engine']}/{e['scenario']}: {why}, checks "
                          f"{[k for k, v in e['checks'].items() if not v]}")

    def acceptance_check(self, e: dict, cmp: dict | None) -> dict:
        """E2E-5's acceptance verdict of a HiSparse scenario with drafts
        (recorded in the entry); a pass for engines without them."""
        if "acceptance" not in e:
            return {"pass": True}
        off = self.entry_of(REFERENCE[e["engine"]], e["scenario"]) or {}
        e["acceptance_check"] = acceptance_verdict(e["acceptance"], cmp, e["decided_by"],
                                                   off.get("acceptance"))
        return e["acceptance_check"]

    def finish(self) -> None:
        """Run-level verdicts: every scenario's (verdicts()); the weights
        were identical in every engine of a model; the negative controls
        that ran were detected."""
        self.verdicts()
        groups: dict = {}
        for name, fp in self.fingerprints.items():
            groups.setdefault(str(fp["key"]), []).append((name, fp["prints"]))
        same = {}
        for key, members in groups.items():
            first_name, first = members[0]
            differ = {n: seeded_init.differing_params(first, p) for n, p in members[1:]}
            differ = {n: d for n, d in differ.items() if d}
            same[key] = not differ
            if differ:
                self.fail(f"weights of {key} differ from {first_name}'s: {differ}")
        self.R["weights_identical"] = same
        self.drop_pd_files()
        ncs = self.R["negative_control"]
        self.R["negative_control_detected"] = all(nc["pass"] for nc in ncs) if ncs else None
        self.R["variant"] = self.variant
        self.save()
        log("done, failures:", len(self.failures), self.failures)


    def drop_pd_files(self) -> None:
        """The P/D files (~100 MB a run) are not results: their size is
        recorded and they are removed, so that --out stays small."""
        if not self.pd_dir.is_dir():
            return
        import shutil

        files = [f for f in self.pd_dir.rglob("*") if f.is_file()]
        self.R["pd_files"] = {"folders": len(pd_folders(self.pd_dir)), "files": len(files),
                              "bytes": sum(f.stat().st_size for f in files)}
        shutil.rmtree(self.pd_dir, ignore_errors=True)


def unkeyed(steps: list) -> list[list[int]]:
    """Keyed steps (schedule_replay) as the natural comparison's trace: the
    sorted token counts of each step."""
    return [schedule_replay.step_counts(s) for s in steps]


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
    except ValueError as err:
        print(f"run_e2e.py: {err}", file=sys.stderr)
        return 2
    return Gate(a).run()


if __name__ == "__main__":
    sys.exit(main())
