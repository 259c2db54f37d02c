# SPDX-License-Identifier: Apache-2.0
"""bench-tax: the no-pressure tax of HiSparse (targets P2, P6, P8's tax).

Pure logic (the run's I/O is scripts/bench-tax + engine_worker/workerproc):
arms and their engine arguments, the plan (one engine per arm, mode and
layer count), the duration estimate, the summaries of the timed samples
(medians, spreads, ratios, the fixed + per-layer fit), the per-step
profile breakdown, the merge of several runs and the target verdicts.

A sample: one arm, one batch, one repetition: the wall time of generating
M new tokens and of N + M new tokens for the same prefix-cached prompts;
decode ms per step = (t(N + M) - t(M)) / N (stats.decode_ms).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from . import common, stats, targets

SCHEMA = "bench-tax/1"

# name -> (vLLM: "ours" | "upstream", HiSparse on?, extra)
ARMS: dict[str, dict] = {
    "off": {"vllm": "ours", "hisparse": False,
            "doc": "HiSparse off, sparse_mla_force_mqa=True (the prefill path HiSparse forces)"},
    "off_b": {"vllm": "ours", "hisparse": False,
              "doc": "a second off engine on its own cores (A/A control: off_b/off is the "
                     "method's floor; a ratio away from 1 is process or core placement, "
                     "not HiSparse)"},
    "off_pinned": {"vllm": "ours", "hisparse": False, "pin_host": True,
                   "doc": "as off, plus a host region of the on arm's pool size registered "
                          "with CUDA as HiSparse registers its pool: whether pinned host "
                          "memory alone slows the process (run 4's cProfile: code HiSparse "
                          "does not touch ran ~1.3x slower in the on process)"},
    "on": {"vllm": "ours", "hisparse": True, "eager_host_mirror": True,
           "doc": "HiSparse on, no pressure: ample GPU pool, resident window = max_model_len"},
    "on_offload": {"vllm": "ours", "hisparse": True, "eager_host_mirror": True, "offload": True,
                   "doc": "as on, with the OffloadingConnector (TieringOffloadingSpec) beside it"},
    "off_offload": {"vllm": "ours", "hisparse": False, "offload": True,
                    "doc": "as off, with the OffloadingConnector alone (TieringOffloadingSpec): "
                           "what the connector costs without HiSparse, the reference that "
                           "on_offload/on is read against"},
    "on_lazy": {"vllm": "ours", "hisparse": True, "eager_host_mirror": False,
                "doc": "as on, eager_host_mirror=false (P6's reference)"},
    "on_step": {"vllm": "ours", "hisparse": True, "eager_host_mirror": True,
                "order_misses": "step",
                "doc": "as on, order_misses='step' (K7): what its sort costs with no miss"},
    "u_off": {"vllm": "upstream", "hisparse": False,
              "doc": "upstream vLLM 0.30.0, HiSparse off (model runner V2, sparse MQA prefill)"},
    "u_on": {"vllm": "upstream", "hisparse": True,
             "doc": "upstream vLLM 0.30.0, HiSparseConnector, no pressure (ample GPU pool)"},
}
# (numerator, denominator, what the ratio is)
RATIOS = (
    ("on", "off", "p2"),
    ("on_offload", "on", "offload"),
    ("off_offload", "off", "offload_alone"),
    ("on", "on_lazy", "p6"),
    ("on_step", "on", "k7_zero_miss"),
    ("u_on", "u_off", "upstream_p2"),
    ("off_b", "off", "aa_control"),
    ("off_pinned", "off", "pinned_pool_only"),
)
MODES = {
    "default": {},  # vLLM's defaults: async scheduling, FULL_AND_PIECEWISE
    "fdo": {"cudagraph_mode": "FULL_DECODE_ONLY"},
    "eager": None,  # enforce_eager
}
MODE_DOC = {"default": "vLLM's default (async scheduling, FULL_AND_PIECEWISE)",
            "fdo": "cudagraph_mode=FULL_DECODE_ONLY", "eager": "enforce_eager"}
# fp8_ds_mla: 656-B MLA rows + the indexer's, per token and layer (the e2e
# engines' 2 GiB hold ~680K tokens at 4 layers: ~790 B per token and layer).
BYTES_PER_TOKEN_LAYER = 800
# IndexShare layouts lease whole slab blocks per group, so fewer layers pay
# more per layer: 8 layers at freq 4 cost ~1,310 B per token and layer
# fully resident (test_tax.py checks the documented shapes on the layout).
BYTES_PER_TOKEN_LAYER_SHARED = 1400
GIB = 1 << 30


@dataclass
class TaxConfig:
    arms: list[str] = field(default_factory=lambda: ["off", "on"])
    modes: list[str] = field(default_factory=lambda: ["default", "fdo"])
    layers: list[int] = field(default_factory=lambda: [4])
    batches: list[int] = field(default_factory=lambda: [1, 8, 16])
    reps: int = 5
    max_reps: int = 0
    """More repetitions, up to this many, while P2's on/off ratio of the
    cell is unresolved (its 90% interval spans 1.10) and the budget holds
    the remaining cells' ``reps``; 0: exactly ``reps``."""
    n: int = 128
    m: int = 16
    prompt_len: int = 4096
    max_model_len: int = 16384
    chunk: int = 2048
    kv_gib: float | None = None  # None: auto_kv_gib
    host_pool_gib: float | None = None  # None: auto_kv_gib
    offload_gib: float = 4.0
    weights: str = "seeded"
    variant: str = "n02"
    gpu_memory_utilization: float = 0.08
    profile: bool = False
    profile_batches: list[int] = field(default_factory=lambda: [1, 16])
    budget_s: float = 540.0
    init_timeout_s: float = 420.0
    compilation_extra: dict = field(default_factory=dict)
    upstream_compilation_extra: dict = field(default_factory=dict)
    seed: int = 0
    index_topk_freq: int = 1  # >1: IndexShare (layers share a top-k in groups)
    rotate_cores: bool = True  # rotated_sets: every arm visits every core set
    noise_stop: bool = True
    """Stop at the first cell whose A/A control (off_b/off) misses the
    method's floor while cells remain (``aa_noise``): every later ratio
    would be read against a failed control, and the device time is better
    spent on another host."""
    start: str = "auto"
    """Engine starts: ``together`` (every engine side by side, the run's
    whole length), ``by-group`` (each (mode, layers) group's engines only
    while it is measured) or ``auto`` (together where they fit the GPU's
    memory, ``start_plan``)."""

    def validate(self) -> None:
        if self.index_topk_freq < 1:
            raise ValueError("--index-topk-freq must be >= 1")
        if not self.arms:
            raise ValueError("no arm given")
        for a in self.arms:
            if a not in ARMS:
                raise ValueError(f"unknown arm {a} (known: {', '.join(ARMS)})")
        for md in self.modes:
            if md not in MODES:
                raise ValueError(f"unknown mode {md} (known: {', '.join(MODES)})")
        if self.reps < 1:
            raise ValueError("--reps must be >= 1")
        if self.max_reps and self.max_reps < self.reps:
            raise ValueError(f"--max-reps {self.max_reps} is below --reps {self.reps}")
        if self.n < 1 or self.m < 1:
            raise ValueError("--new-tokens N and --base-tokens M must be >= 1")
        longest = self.prompt_len + self.n + self.m
        if longest > self.max_model_len:
            raise ValueError(f"prompt {self.prompt_len} + {self.m + self.n} new tokens exceeds "
                             f"max_model_len {self.max_model_len}")
        if self.weights not in ("seeded", "dummy"):
            raise ValueError(f"--weights must be seeded or dummy, not {self.weights}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1)")
        if self.start not in STARTS:
            raise ValueError(f"--start must be one of {', '.join(STARTS)}, not {self.start}")
        if self.profile and not set(self.profile_batches) <= set(self.batches):
            raise ValueError(f"--profile-batches {self.profile_batches} must be among "
                             f"--batches {self.batches}")

    def auto_gib(self, layers: int) -> float:
        """A KV pool (and host pool) twice what every batch's prompts need
        at once, at least 1 GiB, in 0.25 GiB steps: nothing is evicted, no
        page leaves the GPU (no pressure)."""
        tokens = sum(self.batches) * (self.prompt_len + self.n + self.m + 128)
        per_layer = (BYTES_PER_TOKEN_LAYER if self.index_topk_freq == 1
                     else BYTES_PER_TOKEN_LAYER_SHARED)
        need = 2 * tokens * per_layer * layers / GIB
        return max(1.0, math.ceil(need * 4) / 4)

    def kv_bytes(self, layers: int) -> int:
        return int((self.kv_gib or self.auto_gib(layers)) * GIB)

    def host_gib(self, layers: int) -> float:
        return self.host_pool_gib or self.auto_gib(layers)


def mode_kwargs(mode: str, extra: Mapping | None, max_num_seqs: int,
                max_num_batched_tokens: int) -> dict:
    """The mode's engine arguments, ``max_num_seqs`` (the largest batch)
    among the capture sizes so that batch decodes in a FULL CUDA graph
    (``common.with_full_decode_graphs``: --batches 1,12 would otherwise
    decode its 12 in no graph under FULL_DECODE_ONLY)."""
    if MODES[mode] is None:
        return {"enforce_eager": True}
    cc = common.with_full_decode_graphs({**MODES[mode], **(extra or {})}, max_num_seqs,
                                        max_num_batched_tokens)
    return {"compilation_config": cc} if cc else {}


def llm_kwargs(cfg: TaxConfig, arm: str, mode: str, layers: int, model_dir: str) -> dict:
    """LLM(...) keyword arguments, JSON-serialisable (configs as dicts)."""
    a = ARMS[arm]
    kw = dict(model=model_dir, dtype="bfloat16", kv_cache_dtype="fp8",
              max_model_len=cfg.max_model_len, max_num_seqs=max(cfg.batches),
              max_num_batched_tokens=cfg.chunk, seed=cfg.seed, generation_config="vllm",
              enable_prefix_caching=True,
              load_format="hisparse_seeded" if cfg.weights == "seeded" else "dummy",
              kv_cache_memory_bytes=cfg.kv_bytes(layers),
              gpu_memory_utilization=cfg.gpu_memory_utilization)
    extra = cfg.upstream_compilation_extra if a["vllm"] == "upstream" else cfg.compilation_extra
    kw.update(mode_kwargs(mode, extra, max(cfg.batches), cfg.chunk))
    if a["vllm"] == "ours":
        if not a["hisparse"]:
            kw["attention_config"] = {"sparse_mla_force_mqa": True}
        else:
            kw["attention_config"] = {"hisparse_config": {
                "host_pool_gib": cfg.host_gib(layers),
                "admission_max_tokens": cfg.max_model_len,  # the window holds every prompt
                "eager_host_mirror": a["eager_host_mirror"]}}
            if a.get("order_misses"):
                kw["attention_config"]["hisparse_config"]["order_misses"] = a["order_misses"]
        if a.get("offload"):
            kw["kv_transfer_config"] = {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "cpu_bytes_to_use": int(cfg.offload_gib * GIB)}}
    else:
        # the test bundles have no FlashAttention: both upstream arms on the
        # sparse MQA prefill (shared/peers/upstream-0.30/README.md)
        kw["attention_config"] = {"sparse_mla_force_mqa": True}
        if a["hisparse"]:
            kw["kv_transfer_config"] = {
                "kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"host_pool_gib": cfg.host_gib(layers)}}
    return kw


def engine_spec(cfg: TaxConfig, arm: str, mode: str, layers: int, model_dir: str) -> dict:
    """What engine_worker starts: the vLLM flavour, the LLM arguments and,
    for ``off_pinned``, the host region to pin beside the engine (the
    size of the on arm's pool at this layer count)."""
    spec = {"vllm": ARMS[arm]["vllm"], "kwargs": llm_kwargs(cfg, arm, mode, layers, model_dir)}
    if ARMS[arm].get("pin_host"):
        spec["pin_host_gib"] = cfg.host_gib(layers)
    return spec


def model_dir_name(layers: int, index_topk_freq: int = 1) -> str:
    share = f"_f{index_topk_freq}" if index_topk_freq > 1 else ""
    return f"tiny_glm5_L{layers}{share}"


# tests/e2e/make_tiny_glm5.py's attention shapes (GLM-5's), which the layout
# reads; tests/hisparse/bench/test_tax.py checks them against its config.
TINY_ATTENTION = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
                  "index_topk": 256}


def engine_key(mode: str, layers: int, arm: str) -> str:
    return f"{mode}/L{layers}/{arm}"


def groups(cfg: TaxConfig) -> list[tuple[str, int]]:
    """(mode, layers) in run order: layer counts outer."""
    return [(md, L) for L in cfg.layers for md in cfg.modes]


def engines(cfg: TaxConfig, among: Sequence[tuple[str, int]] | None = None
            ) -> list[tuple[str, int, str]]:
    """(mode, layers, arm) of every engine, or of the groups ``among``."""
    return [(md, L, arm) for md, L in (groups(cfg) if among is None else among)
            for arm in cfg.arms]


STARTS = ("auto", "together", "by-group")

ENGINE_GPU_GIB = 9.5
"""GPU memory one engine may hold at its peak (weights, KV pool, graphs,
the profile's buffers): run 13 (H100, 80 GB) saw 5.1-9.3 GiB per engine
and ten engines (five arms, two modes) did not fit; the H200's 141 GB had
held them (run 12)."""


def start_plan(cfg: TaxConfig, gpu_gib: float | None) -> list[list[tuple[str, int]]]:
    """The groups whose engines start together, in run order: all at once
    when ``cfg.start`` says so or when they fit ``gpu_gib`` (unknown: they
    are assumed to fit), else one group at a time. A group's own engines
    always start together: its arms alternate sample by sample."""
    every = groups(cfg)
    fits = gpu_gib is None or len(engines(cfg)) * ENGINE_GPU_GIB <= gpu_gib
    if cfg.start == "together" or (cfg.start == "auto" and fits):
        return [every]
    return [[g] for g in every]


# ------------------------------------------------------------ estimate


def step_ms_guess(arm: str, batch: int, layers: int) -> float:
    """A prior of the decode step (tiny model, H200; e2e run 3: off 1.6 ms
    at batch 1 and 3.9 ms at 16 with 4 layers, on ~1.7-2x)."""
    off = 0.3 + layers * (0.30 + 0.037 * batch)
    return off * (1.9 if ARMS[arm]["hisparse"] else 1.0)


CPUS_ENV = "BENCH_TAX_CPUS"
"""The cores an engine process pins itself to (engine_worker.main)."""


def cpu_sets(cpus: Sequence[int], engines: int) -> list[list[int]]:
    """Disjoint, equal, contiguous core sets, one per engine (the rest of
    the cores stay unassigned): engines started side by side then never
    share a core, so one arm's host work cannot slow another's step (run
    2's profile saw work HiSparse does not change run up to 2x slower in
    the on arm's process). Fewer cores than engines: no pinning ([])."""
    cpus = sorted(cpus)
    per = len(cpus) // engines if engines else 0
    if per < 1:
        return [[] for _ in range(engines)]
    return [cpus[i * per:(i + 1) * per] for i in range(engines)]


def estimate_s(cfg: TaxConfig, plan: Sequence[Sequence[tuple[str, int]]] | None = None
               ) -> dict:
    """Seconds: engine starts (each start of ``plan``, default all at once;
    compile-bound), then every group's warm-ups, samples and profiles in
    turn."""
    init = 0.0
    for among in plan or [groups(cfg)]:
        n_eng = len(engines(cfg, among))
        init += 60 + 20 * math.ceil(n_eng / 4) + 2.5 * max(L for _, L in among)
    measure = 0.0
    for _, L in groups(cfg):
        for b in cfg.batches:
            for arm in cfg.arms:
                steps = 2 * cfg.m + cfg.n
                sample = steps * step_ms_guess(arm, b, L) / 1e3 + 0.3
                # the first warm-up prefills the prompts (~40K tokens/s at 4 layers)
                prefill = b * cfg.prompt_len / 40000 * L / 4
                measure += (cfg.reps + 1) * sample + prefill + 2
                if cfg.profile and b in cfg.profile_batches:
                    measure += 2 * sample + 5
    return {"engine_starts_s": round(init), "measure_s": round(measure),
            "total_s": round(init + measure + 20)}


# ------------------------------------------------------------ summaries


def sample_record(*, run: int, mode: str, layers: int, batch: int, rep: int, arm: str,
                  position: int, t_short_s: float, t_long_s: float, n: int,
                  cpu_short_s: float | None = None, cpu_long_s: float | None = None,
                  threads: list[int] | None = None, gc_short_s: float | None = None,
                  gc_long_s: float | None = None, gc_collections: dict | None = None,
                  busy_threads: list[dict] | None = None,
                  cpus: Sequence[int] | None = None,
                  step_ms: float | None = None, step_count: int | None = None,
                  steady: Mapping | None = None, probe: Mapping | None = None) -> dict:
    """One sample; with the engine's CPU seconds (every process and thread)
    over the same two generations, ``cpu_ms_per_step`` is the CPU time a
    decode step costs, by the same (N + M) - M difference as its wall time;
    ``gc_ms_per_step`` likewise the garbage collector's pauses. ``cpus``:
    the core set the engine ran on (rotated across repetitions);
    ``step_ms``: the median interval between the engine loop's steps that
    returned tokens during the long generation (``step_count`` of them);
    ``steady``: those intervals past the admission steps
    (engine_worker.steady_intervals), whose stall-free mean is
    ``steady_ms``, recorded beside the estimator for comparison."""
    rec = {"run": run, "mode": mode, "layers": layers, "batch": batch, "rep": rep,
           "arm": arm, "position": position, "t_short_s": t_short_s, "t_long_s": t_long_s,
           "n": n, "ms_per_step": stats.decode_ms(t_short_s, t_long_s, n)}
    if cpu_short_s is not None and cpu_long_s is not None:
        rec.update(cpu_short_s=cpu_short_s, cpu_long_s=cpu_long_s,
                   cpu_ms_per_step=stats.decode_ms(cpu_short_s, cpu_long_s, n))
    if gc_short_s is not None and gc_long_s is not None:
        rec.update(gc_short_s=gc_short_s, gc_long_s=gc_long_s,
                   gc_ms_per_step=stats.decode_ms(gc_short_s, gc_long_s, n))
    if gc_collections is not None:
        rec["gc_collections"] = gc_collections
    if busy_threads is not None:
        rec["busy_threads"] = busy_threads
    if threads is not None:
        rec["threads"] = threads
    if cpus:
        rec["cpus"] = core_label(cpus)
    if step_ms:
        rec.update(step_ms=step_ms, step_count=step_count)
    if steady:
        rec.update(steady=dict(steady), steady_ms=steady["mean_ms"])
    if probe:
        rec["probe"] = dict(probe)
    return rec


def core_label(cpus: Sequence[int]) -> str:
    """'0-3' for a contiguous set, '0,2,5' otherwise."""
    c = sorted(int(x) for x in cpus)
    if c == list(range(c[0], c[-1] + 1)) and len(c) > 1:
        return f"{c[0]}-{c[-1]}"
    return ",".join(map(str, c))


def rotated_sets(sets: Sequence[Sequence[int]], rep: int) -> list[list[int]]:
    """Arm i's core set in repetition ``rep``: set (i + rep) mod k. Over k
    repetitions every arm runs once on every set, so a slow core set (an
    SMT sibling's load, a far socket) weighs on every arm alike instead
    of on the arm that started there. Any arm without a set: no rotation."""
    k = len(sets)
    if k == 0 or any(not s for s in sets):
        return [list(s) for s in sets]
    return [list(sets[(i + rep) % k]) for i in range(k)]


def estimator_of(arms: Mapping[str, list[Mapping]]) -> str:
    """"step_ms" (the median step-to-step interval within each sample)
    where every sample of the cell has it, else "ms_per_step" (the
    difference of two generations' totals). Run 5 found this VM's host
    speed swinging ±30% from sample to sample (A/A 0.89-1.05): a total
    over 144 steps carries every swing, a median of 144 intervals few."""
    every = [s for ss in arms.values() for s in ss]
    return "step_ms" if every and all(s.get("step_ms") for s in every) else "ms_per_step"


def statistic_of(estimator: str) -> str:
    """What a cell's arms are compared by: "min" (the fastest sample) for
    the step clock, else "median". Session 13 (results/tax/README.md run
    6) found this VM's samples in two speed modes ~1.5x apart (off at
    batch 1: 1.65-1.9 or 2.4-2.8 ms), in proportions that differ from arm
    to arm: medians of identical engines read 0.84-1.33, the fastest
    samples 0.98-1.05 in all eight A/A cells. Interference only adds
    time, so the fastest sample of each arm is its fast-mode step; the
    A/A control (off_b/off, same statistic) keeps guarding the method."""
    return "min" if estimator == "step_ms" else "median"


def summarize(samples: Iterable[Mapping]) -> dict:
    """summary[mode][layers][batch] = {"arms": {arm: spread of ms/step},
    "ratios": {num/den: {...}}, "estimator": the per-sample field they
    read}; where the estimator is step_ms, "totals" keeps the difference
    method's arms and ratios beside it. Keys are strings (JSON)."""
    samples = [s for s in samples if not s.get("warmup")]
    cells: dict[tuple, dict[str, list]] = {}
    for s in samples:
        cells.setdefault((s["mode"], s["layers"], s["batch"]), {}).setdefault(
            s["arm"], []).append(s)
    out: dict = {}
    for (mode, L, b), arms in sorted(cells.items()):
        est = estimator_of(arms)
        stat = statistic_of(est)
        cell = {"arms": {a: stats.spread([s[est] for s in ss])
                         for a, ss in sorted(arms.items())}, "ratios": {},
                "estimator": est, "statistic": stat}
        if est != "ms_per_step":
            cell["totals"] = {
                "arms": {a: stats.spread([s["ms_per_step"] for s in ss])
                         for a, ss in sorted(arms.items())},
                "ratios": {f"{n}/{d}": ratio(arms[n], arms[d], w)
                           for n, d, w in RATIOS if n in arms and d in arms}}
        if all(s.get("steady_ms") for ss in arms.values() for s in ss):
            cell["steady"] = {
                "arms": {a: stats.spread([s["steady_ms"] for s in ss])
                         for a, ss in sorted(arms.items())},
                "ratios": {f"{n}/{d}": ratio(arms[n], arms[d], w, "steady_ms", "min")
                           for n, d, w in RATIOS if n in arms and d in arms}}
        cpu = {a: stats.spread([s["cpu_ms_per_step"] for s in ss])
               for a, ss in sorted(arms.items()) if all("cpu_ms_per_step" in s for s in ss)}
        gc_ms = {a: stats.spread([s["gc_ms_per_step"] for s in ss])
                 for a, ss in sorted(arms.items()) if all("gc_ms_per_step" in s for s in ss)}
        if gc_ms:
            cell["gc_ms"] = gc_ms
        probe = probe_summary(arms)
        if probe:
            cell["probe"] = probe
        by_cpus = by_core_set(arms, est)
        if by_cpus:
            cell["by_cpus"] = by_cpus
        if cpu:
            # CPU ms per decode step over wall ms: ~1 is one busy thread;
            # well above 1, other threads burn cores beside it.
            cell["cpu"] = {}
            walls = cell.get("totals", cell)["arms"]  # CPU time is a difference of totals
            for a, c in cpu.items():
                wall = walls[a].get("median")
                cell["cpu"][a] = {**c, "busy_cores": (c["median"] / wall
                                                      if c.get("median") and wall else None)}
        for num, den, what in RATIOS:
            if num in arms and den in arms:
                cell["ratios"][f"{num}/{den}"] = ratio(arms[num], arms[den], what, est, stat)
        if "on" in arms and "off" in arms:
            cell["tax_us"] = (cell["arms"]["on"][stat] - cell["arms"]["off"][stat]) * 1e3
        if "u_on" in arms and "u_off" in arms:
            cell["upstream_tax_us"] = (cell["arms"]["u_on"][stat]
                                       - cell["arms"]["u_off"][stat]) * 1e3
        out.setdefault(mode, {}).setdefault(str(L), {})[str(b)] = cell
    return out


PROBES = ("python_us", "launch_us")


def probe_summary(arms: Mapping[str, list[Mapping]]) -> dict:
    """{"arms": {arm: {probe: spread}}, "ratios": {"on/off": {probe: ratio
    of minima}}} of the fixed workloads each engine ran after its sample
    (engine_worker.probe): the same pure-Python work and the same kernel
    launches in every process, so a ratio away from 1 is the process
    running slower, not HiSparse's code (run 4: ``schedule``'s own time
    ~1.3x in the on process). {} unless every sample has them."""
    every = [s for ss in arms.values() for s in ss]
    have = [p for p in PROBES if every and all((s.get("probe") or {}).get(p) for s in every)]
    if not have:
        return {}
    lows = {a: {p: min(s["probe"][p] for s in ss) for p in have} for a, ss in arms.items()}
    out = {"arms": {a: {p: stats.spread([s["probe"][p] for s in ss]) for p in have}
                    for a, ss in sorted(arms.items())}, "ratios": {}}
    for num, den, _ in RATIOS:
        if num in lows and den in lows:
            out["ratios"][f"{num}/{den}"] = {p: lows[num][p] / lows[den][p] for p in have}
    return out


def by_core_set(arms: Mapping[str, list[Mapping]], field: str = "ms_per_step") -> dict:
    """{arm: {core set: median of ``field``}} where samples name their cores
    and some arm ran on more than one set (rotation): a core set slower for
    every arm is the machine's, not HiSparse's."""
    out: dict = {}
    for a, ss in sorted(arms.items()):
        sets: dict[str, list[float]] = {}
        for s in ss:
            if "cpus" in s:
                sets.setdefault(s["cpus"], []).append(s[field])
        if sets:
            out[a] = {c: stats.spread(v)["median"] for c, v in sorted(sets.items())}
    if not any(len(v) > 1 for v in out.values()):
        return {}
    return out


def ratio(num: list[Mapping], den: list[Mapping], what: str,
          field: str = "ms_per_step", statistic: str = "median") -> dict:
    """The ratios of the medians and of the minima of ``field``, ``ratio``
    the one of ``statistic`` (statistic_of), the spread of the
    per-repetition ratios (samples of the same run and repetition paired)
    and ``interval90``: the 90% bootstrap interval of ``ratio`` over those
    repetitions (None below three). Session 16 found run 10's batch-16
    ratio 1.11 with an interval of 1.02-1.42: a verdict at 1.10 needs it."""
    def of(pick):
        n, d = pick([s[field] for s in num]), pick([s[field] for s in den])
        return n / d if d > 0 else None

    by_rep = {(s["run"], s["rep"]): s[field] for s in den}
    paired = [(s[field], by_rep[(s["run"], s["rep"])]) for s in num
              if (s["run"], s["rep"]) in by_rep and by_rep[(s["run"], s["rep"])] > 0]
    medians, minima = of(stats.median), of(min)
    interval = stats.bootstrap_ratio(paired, statistic)
    return {"what": what, "statistic": statistic,
            "ratio": minima if statistic == "min" else medians,
            "ratio_of_medians": medians, "ratio_of_minima": minima,
            "interval90": list(interval) if interval else None,
            "pairwise": stats.spread([n / d for n, d in paired])}


def _cell_arms(samples: Iterable[Mapping]) -> dict[str, list[Mapping]]:
    """One cell's measured samples (warm-ups left out) by arm."""
    arms: dict[str, list[Mapping]] = {}
    for s in samples:
        if not s.get("warmup"):
            arms.setdefault(s["arm"], []).append(s)
    return arms


def p2_resolved(samples: Iterable[Mapping]) -> bool | None:
    """Whether one cell's samples (one mode, layer count and batch)
    resolve P2: the 90% interval of on/off by the cell's statistic lies on
    one side of 1.10. None without both arms or below three repetitions."""
    arms = _cell_arms(samples)
    if "on" not in arms or "off" not in arms:
        return None
    est = estimator_of({a: arms[a] for a in ("on", "off")})
    r = ratio(arms["on"], arms["off"], "p2", est, statistic_of(est))
    return targets.interval_entry(r["interval90"], targets.P2_RATIO).get("resolved")


def aa_noise(samples: Iterable[Mapping]) -> str | None:
    """Why one cell's A/A control (off_b / off, by the cell's estimator and
    statistic, as ``summarize`` reads it) says the host is too noisy, or
    None where it holds or either arm is absent. Two ways: the ratio
    misses the method's floor (``AA_TOLERANCE``; run 20, results/tax/
    README.md, spent 340 s of device time after its first cell's A/A had
    read 1.20), or its 90% interval reaches past ``AA_INTERVAL_TOLERANCE``
    (run 21's A/A read 0.995 by the fastest samples, its interval
    0.79-1.25: no ratio of that run could resolve 1.10)."""
    arms = _cell_arms(samples)
    if "off" not in arms or "off_b" not in arms:
        return None
    est = estimator_of(arms)
    r = ratio(arms["off_b"], arms["off"], "aa_control", est, statistic_of(est))
    if r["ratio"] is None:
        return None
    if abs(r["ratio"] - 1) > AA_TOLERANCE:
        return (f"off_b/off {r['ratio']:.3f} misses the method's floor "
                f"(±{AA_TOLERANCE:.0%})")
    lo, hi = r["interval90"] or (1.0, 1.0)
    if max(1 - lo, hi - 1) > AA_INTERVAL_TOLERANCE:
        return (f"off_b/off {r['ratio']:.3f}, but its 90% interval {lo:.3f}-{hi:.3f} "
                f"reaches past ±{AA_INTERVAL_TOLERANCE:.0%}")
    return None


def fits(summary: Mapping, num: str = "on", den: str = "off") -> dict:
    """fit[mode][batch] = tax (us per step, num - den by each cell's
    statistic) =
    fixed_us + per_layer_us x layers, over the layer counts measured."""
    out: dict = {}
    for mode, by_layers in summary.items():
        batches = {b for cells in by_layers.values() for b in cells}
        for b in sorted(batches, key=int):
            pts = []
            for L, cells in by_layers.items():
                cell = cells.get(b, {})
                arms, stat = cell.get("arms", {}), cell.get("statistic", "median")
                if num in arms and den in arms and arms[num].get("n") and arms[den].get("n"):
                    pts.append((int(L), (arms[num][stat] - arms[den][stat]) * 1e3))
            if len({L for L, _ in pts}) < 2:
                continue
            pts.sort()
            fixed, per_layer = stats.linear_fit([p[0] for p in pts], [p[1] for p in pts])
            out.setdefault(mode, {})[b] = {"fixed_us": fixed, "per_layer_us": per_layer,
                                           "layers": [p[0] for p in pts],
                                           "tax_us": [p[1] for p in pts]}
    return out


def _ratio_map(summary: Mapping, key: str, layers: int | None = None,
               batch: int | None = None, field: str = "ratio") -> dict:
    """(mode, batch) -> the headline ratio (``ratio``: of the cell's
    statistic; ``field`` another entry of it) of ``key`` at ``layers``
    (None: the fewest layers measured)."""
    out = {}
    for mode, by_layers in summary.items():
        have = sorted((int(L) for L, cells in by_layers.items()
                       if any(key in c["ratios"] for c in cells.values())))
        if not have:
            continue
        L = layers if layers is not None else have[0]
        for b, cell in by_layers.get(str(L), {}).items():
            r = cell["ratios"].get(key, {}).get(field)
            if r is not None and (batch is None or int(b) == batch):
                out[(mode, int(b))] = r
    return out


TINY_LAYERS = 4
"""The tiny model of targets.md (tests/e2e/make_tiny_glm5.py's default):
P2's ratios, P6 and P8's tax are read at this layer count; others only
enter the fit."""


def evaluate(summary: Mapping, profiles: Mapping | None = None) -> dict:
    fit = fits(summary)
    device = device_fits(profiles or {})
    split_device = targets.p2_split({(m, int(b)): f for m, fb in device.items()
                                     for b, f in fb.items()})
    p6 = {mode: r for (mode, _), r in _ratio_map(summary, "on/on_lazy", layers=TINY_LAYERS,
                                                   batch=targets.P6_BATCH).items()}
    ours = _ratio_map(summary, "on/off", layers=TINY_LAYERS)
    up = _ratio_map(summary, "u_on/u_off", layers=TINY_LAYERS)
    offload = _ratio_map(summary, "on_offload/on", layers=TINY_LAYERS)
    aa = _ratio_map(summary, "off_b/off")
    return {
        "P2": targets.p2(ours, intervals=_ratio_map(summary, "on/off", layers=TINY_LAYERS,
                                                     field="interval90")),
        "P2_split": targets.p2_split({(m, int(b)): f for m, fb in fit.items()
                                      for b, f in fb.items()}),
        "P6": targets.p6(p6),
        "P8_tax": targets.p8_tax(ours, up),
        "offload_adds_nothing": offload_verdict(
            offload, _ratio_map(summary, "off_offload/off", layers=TINY_LAYERS)),
        "aa_control": aa_verdict(aa, _ratio_map(summary, "off_b/off", field="interval90")),
        "P2_split_device": {**split_device, "id": "P2_split_device",
                            "why": split_device.get("why") or
                            "the device part (profiles' kernel + copy time) of the split"},
    }


OFFLOAD_TOLERANCE = 0.02
AA_TOLERANCE = 0.05
# The widest an A/A interval may reach before the host counts as too noisy
# to resolve P2's 1.10: the quiet runs' (15-17) stayed within ±3.5%, the
# runs that gave no verdict (10, 20, 21) reached ±18-39%.
AA_INTERVAL_TOLERANCE = 0.15


def aa_verdict(ratios: Mapping[tuple[str, int], float],
               intervals: Mapping[tuple[str, int], Sequence[float]] | None = None) -> dict:
    """The method's floor, not a target: two identical off engines on their
    own cores (off_b / off) should agree within 5%. Where they do not, a
    ratio of that size between on and off says nothing about HiSparse.
    ``intervals``: each cell's 90% bootstrap interval (its width is the
    resolution of the run). ``pass`` judges the bias (the ratio) only; a
    cell whose interval reaches past ``AA_INTERVAL_TOLERANCE`` is marked
    ``noisy`` and named in ``why``, as the noise stop (``aa_noise``) reads it,
    so a run stopped for its interval does not read as clean here."""
    intervals = intervals or {}
    measured = {}
    for (m, b), r in sorted(ratios.items()):
        entry = {"ratio": round(r, 4), "pass": abs(r - 1) <= AA_TOLERANCE,
                 **targets.interval_entry(intervals.get((m, b)))}
        if "interval90" in entry:
            lo, hi = entry["interval90"]
            entry["noisy"] = max(1 - lo, hi - 1) > AA_INTERVAL_TOLERANCE
        measured[f"{m}/batch{b}"] = entry
    ok = all(v["pass"] for v in measured.values()) if measured else None
    noisy = [cell for cell, v in measured.items() if v.get("noisy")]
    why = "needs arm off_b" if not measured else ""
    if noisy:
        why = (f"90% interval past ±{AA_INTERVAL_TOLERANCE:.0%} (too noisy to resolve "
               f"1.10): {', '.join(noisy)}")
    return {"id": "aa_control",
            "target": f"|off_b / off - 1| <= {AA_TOLERANCE} (the method's floor)",
            "pass": ok, "measured": measured, "why": why}


def offload_verdict(ratios: Mapping[tuple[str, int], float],
                    alone: Mapping[tuple[str, int], float] | None = None) -> dict:
    """Not a numbered target: with nothing offloaded, the OffloadingConnector
    beside HiSparse should cost nothing (on_offload / on within 2%).
    ``alone``: off_offload / off of the same cells, the connector's own cost
    without HiSparse; where measured, ``composition`` is what is left for
    the composition (on_offload/on over off_offload/off)."""
    alone = alone or {}

    def entry(cell: tuple[str, int], r: float) -> dict:
        e = {"ratio": round(r, 4), "pass": r <= 1 + OFFLOAD_TOLERANCE}
        if cell in alone:
            e["alone"] = round(alone[cell], 4)
            e["composition"] = round(r / alone[cell], 4)
        return e

    measured = {f"{m}/batch{b}": entry((m, b), r) for (m, b), r in sorted(ratios.items())}
    ok = all(v["pass"] for v in measured.values()) if measured else None
    return {"id": "offload_adds_nothing",
            "target": f"on_offload / on <= {1 + OFFLOAD_TOLERANCE} (no numbered target)",
            "pass": ok, "measured": measured,
            "why": "" if measured else "needs arms on and on_offload"}


# ------------------------------------------------------------ profile

LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
               "cudaLaunchCooperativeKernel")
GRAPH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")


def _is_runtime(name: str) -> bool:
    return (name.startswith("cuda") or name.startswith("cu")) and len(name) > 4 and \
        name[4 if name.startswith("cuda") else 2].isupper()


def profile_counts(events: Iterable[Mapping]) -> dict:
    """Aggregated profiler events ({name, device: cpu|cuda, count,
    self_device_us}) -> runtime API counts, device kernel counts and times."""
    runtime: dict[str, float] = {}
    runtime_us: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    copies = {"count": 0.0, "us": 0.0}
    copy_kinds: dict[str, float] = {}
    ops: dict[str, float] = {}
    for e in events:
        name, count = e["name"], float(e.get("count", 0))
        if e.get("device") == "cuda":
            if name.startswith(("Memcpy", "Memset")):
                copies["count"] += count
                copies["us"] += float(e.get("self_device_us", 0))
                copy_kinds[name] = copy_kinds.get(name, 0.0) + count
            else:
                k = kernels.setdefault(name, [0.0, 0.0])
                k[0] += count
                k[1] += float(e.get("self_device_us", 0))
        elif _is_runtime(name):
            runtime[name] = runtime.get(name, 0.0) + count
            runtime_us[name] = runtime_us.get(name, 0.0) + float(e.get("self_cpu_us", 0))
        elif "::" in name:  # a torch op (aten::fill_, a custom op): issued eagerly
            ops[name] = ops.get(name, 0.0) + count
    return {"runtime": runtime, "runtime_us": runtime_us, "kernels": kernels,
            "copies": copies, "copy_kinds": copy_kinds, "ops": ops}


PYTHON_STAGES = (
    # (label, function key suffixes, "|" between alternatives): cumulative
    # host time per decode step (run 2 found no step_with_batch_queue: the
    # in-process engine may step synchronously)
    ("engine step", "core.py:(step_with_batch_queue)|core.py:(step)"),
    ("scheduler.schedule", "scheduler.py:(schedule)"),
    ("scheduler.update_from_output", "scheduler.py:(update_from_output)"),
    ("runner.execute_model", "gpu_model_runner.py:(execute_model)"),
    ("runner._update_states", "gpu_model_runner.py:(_update_states)"),
    ("runner._prepare_inputs", "gpu_model_runner.py:(_prepare_inputs)"),
    ("runner._build_attention_metadata", "gpu_model_runner.py:(_build_attention_metadata)"),
    ("runner.sample_tokens", "gpu_model_runner.py:(sample_tokens)"),
    ("output_processor.process_outputs", "output_processor.py:(process_outputs)"),
    ("hisparse build_step_metadata", "coordinator.py:(build_step_metadata)"),
    ("hisparse start_step", "hisparse/worker.py:(start_step)"),
    ("hisparse finish_forward", "hisparse/worker.py:(finish_forward)"),
    ("hisparse take_acks", "hisparse/worker.py:(take_acks)"),
    ("hisparse apply_residency_updates", "binding.py:(apply_residency_updates)"),
    ("kv connector output", "kv_connector_model_runner_mixin.py:(_get_kv_connector_output)"),
)


def _stage_match(key: str, pattern: str) -> bool:
    """'file.py:(fn)' matches any 'path/file.py:LINE(fn)'."""
    file, fn = pattern.split(":", 1)
    path, _, rest = key.rpartition(":")
    return path.endswith(file) and rest[rest.find("("):] == fn


def python_per_step(short: Iterable[Mapping], long: Iterable[Mapping], steps: int,
                    top: int = 25) -> dict:
    """cProfile entries ({fn, calls, tottime, cumtime} in seconds) of M and
    of N + M new tokens -> per decode step (us): the stages of
    PYTHON_STAGES (cumulative), HiSparse's own functions together (self
    time of every function in a hisparse module), the KV connectors' and
    the offloader's together and their top functions, and the top
    functions by self time."""
    if steps <= 0:
        raise ValueError("steps must be > 0")
    a = {e["fn"]: e for e in short}
    b = {e["fn"]: e for e in long}

    def per_step(field: str) -> dict[str, float]:
        return {k: (b.get(k, {}).get(field, 0.0) - a.get(k, {}).get(field, 0.0)) * 1e6 / steps
                for k in set(a) | set(b)}

    self_us, cum_us = per_step("tottime"), per_step("cumtime")
    calls = per_step("calls")
    stages = {label: round(sum(v for k, v in cum_us.items()
                               if any(_stage_match(k, p) for p in pat.split("|"))), 1)
              for label, pat in PYTHON_STAGES}
    return {
        "note": "cProfile slows Python: shares of the host time, not wall time",
        "self_us_total": round(sum(self_us.values()), 1),
        "hisparse_self_us": round(sum(v for k, v in self_us.items() if "hisparse" in k), 1),
        "connector_self_us": round(sum(v for k, v in self_us.items() if _connector_fn(k)), 1),
        "stages_cum_us": stages,
        "top_self": _top(self_us, calls, self_us, top),
        "connector_top_self": _top(self_us, calls, [k for k in self_us if _connector_fn(k)], top),
    }


def _connector_fn(key: str) -> bool:
    """A function of the KV connectors or the offloader (HiSparse's own
    connector included): what composing the OffloadingConnector adds."""
    return "/kv_connector/" in key or "/kv_offload/" in key


def _top(self_us: Mapping[str, float], calls: Mapping[str, float], keys: Iterable[str],
         top: int) -> list[dict]:
    return [{"fn": k, "self_us": round(self_us[k], 2), "calls": round(calls[k] / 1e6, 3)}
            for k in sorted(keys, key=lambda k: -self_us[k])[:top]]


def stages_per_step(stages: Mapping, steps: int) -> dict:
    """The stage clock ({short, long}: {target: {us, calls}}, engine_worker.
    StageClock) -> per decode step {target: {us, calls}} (long - short) / N,
    the short generation's own totals in ms, and the targets absent here."""
    if steps <= 0:
        raise ValueError("steps must be > 0")
    a, b = stages.get("short", {}), stages.get("long", {})
    zero = {"us": 0.0, "calls": 0}
    per_step = {k: {"us": round((b[k]["us"] - a.get(k, zero)["us"]) / steps, 2),
                    "calls": round((b[k]["calls"] - a.get(k, zero)["calls"]) / steps, 3)}
                for k in b}
    return {"note": "inclusive wall time per call site, no profiler running",
            "per_step": per_step,
            "short_generation_ms": {k: round(v["us"] / 1e3, 3) for k, v in a.items()},
            "absent": list(stages.get("absent", []))}


def profile_per_step(short: Iterable[Mapping], long: Iterable[Mapping], steps: int,
                     top: int = 15, python: Mapping | None = None,
                     stages: Mapping | None = None) -> dict:
    """Per decode step: (profile of N + M new tokens - profile of M) / N;
    ``python`` ({short, long} cProfile entries) adds the host breakdown,
    ``stages`` (the stage clock's {short, long}) the unprofiled one."""
    if steps <= 0:
        raise ValueError("steps must be > 0")
    a, b = profile_counts(short), profile_counts(long)

    def diff(x: Mapping, y: Mapping) -> dict:
        return {k: (y.get(k, 0.0) - x.get(k, 0.0)) / steps for k in set(x) | set(y)}

    rt = diff(a["runtime"], b["runtime"])
    kc = {k: (b["kernels"].get(k, [0, 0])[0] - a["kernels"].get(k, [0, 0])[0]) / steps
          for k in set(a["kernels"]) | set(b["kernels"])}
    kt = {k: (b["kernels"].get(k, [0, 0])[1] - a["kernels"].get(k, [0, 0])[1]) / steps
          for k in set(a["kernels"]) | set(b["kernels"])}
    top_k = sorted(kt, key=lambda k: -kt[k])[:top]
    ops, kinds = diff(a["ops"], b["ops"]), diff(a["copy_kinds"], b["copy_kinds"])
    return {
        "steps": steps,
        "per_step": {
            "kernel_launches": sum(v for k, v in rt.items() if k in LAUNCH_APIS),
            "graph_launches": sum(v for k, v in rt.items() if k in GRAPH_APIS),
            "cuda_memcpy_async": sum(v for k, v in rt.items() if k.startswith(("cudaMemcpy",
                                                                               "cuMemcpy"))),
            "device_kernels": sum(kc.values()),
            "device_kernel_us": sum(kt.values()),
            "device_copies": (b["copies"]["count"] - a["copies"]["count"]) / steps,
            "device_copy_us": (b["copies"]["us"] - a["copies"]["us"]) / steps,
            "runtime_calls": {k: round(v, 3) for k, v in sorted(rt.items()) if abs(v) > 1e-9},
            # host time inside the CUDA runtime calls (a stalled copy or sync shows here)
            "runtime_cpu_us": {k: round(v, 2) for k, v in sorted(
                diff(a["runtime_us"], b["runtime_us"]).items()) if abs(v) > 1e-9},
        },
        "top_kernels": [{"name": k, "us_per_step": round(kt[k], 3),
                         "count_per_step": round(kc[k], 3)} for k in top_k],
        # Where launches come from: every kernel, copy kind and eager torch
        # op per step (profile_diff subtracts the off arm's)
        "kernel_counts": _per_step_counts(kc),
        "copy_kinds": _per_step_counts(kinds),
        "op_counts": _per_step_counts(ops),
        **({"python": python_per_step(python["short"], python["long"], steps)}
           if python else {}),
        **({"stages": stages_per_step(stages, steps)} if stages else {}),
        "short_generation": short_generation(short, python["short"] if python else None),
    }


def short_generation(events: Iterable[Mapping], python: Iterable[Mapping] | None = None,
                     top: int = 15) -> dict:
    """The M-token generation whole (admission, prefill, first steps), which
    the per-step figures subtract: its top host-side ops by self CPU time
    and, with cProfile, its top functions by self time, in ms. Session 13
    saw it ~10 ms per prefix hit slower with HiSparse on (the admission)."""
    cpu: dict[str, float] = {}
    for e in events:
        if e.get("device") != "cuda":
            cpu[e["name"]] = cpu.get(e["name"], 0.0) + float(e.get("self_cpu_us", 0.0))
    out = {"ops_self_cpu_ms": {k[:160]: round(cpu[k] / 1e3, 3)
                               for k in sorted(cpu, key=lambda k: -cpu[k])[:top]}}
    if python is not None:
        py = sorted(python, key=lambda e: -e.get("tottime", 0.0))[:top]
        out["python_self_ms"] = {e["fn"]: round(e.get("tottime", 0.0) * 1e3, 3) for e in py}
    return out


def _per_step_counts(counts: Mapping[str, float], floor: float = 0.05) -> dict[str, float]:
    """Counts per step of at least ``floor``, the most frequent first; names
    cut to 160 characters (templated kernel names run to kilobytes)."""
    out: dict[str, float] = {}
    for name in sorted(counts, key=lambda k: (-counts[k], k)):
        if counts[name] >= floor:
            key = name[:160]
            out[key] = round(out.get(key, 0.0) + counts[name], 3)
    return out


def profile_diff(profiles: Mapping[str, Mapping], floor: float = 0.5) -> dict:
    """Per profile of an arm other than off ("mode/L<n>/arm/batch<b>", as
    bench-tax keys them): its per-step launches, copies, kernels, copy kinds
    and eager torch ops minus the off arm's at the same mode, layers and
    batch, the differences of at least ``floor`` per step, largest first:
    what HiSparse adds to a step, by name."""
    out: dict = {}
    for key, prof in profiles.items():
        parts = key.split("/")
        if len(parts) < 4 or parts[-2] == "off":
            continue
        base = profiles.get("/".join(parts[:-2] + ["off", parts[-1]]))
        if base is None:
            continue
        row: dict = {}
        for field in ("kernel_launches", "cuda_memcpy_async", "graph_launches"):
            row[field] = round(prof["per_step"].get(field, 0.0)
                               - base["per_step"].get(field, 0.0), 3)
        for field in ("kernel_counts", "copy_kinds", "op_counts"):
            mine, theirs = prof.get(field, {}), base.get(field, {})
            delta = {k: round(mine.get(k, 0.0) - theirs.get(k, 0.0), 3)
                     for k in set(mine) | set(theirs)}
            row[field] = {k: v for k, v in sorted(delta.items(), key=lambda kv: (-abs(kv[1]),
                                                                                kv[0]))
                          if abs(v) >= floor}
        if "stages" in prof and "stages" in base:
            row["stage_us"] = _stage_diff(prof["stages"], base["stages"], floor)
        out[key] = row
    return out


def _stage_diff(mine: Mapping, theirs: Mapping, floor: float) -> dict:
    """Per stage-clock target: us per step of this arm minus off's (a target
    off lacks counts whole), the largest first, at least ``floor`` us."""
    a, b = mine.get("per_step", {}), theirs.get("per_step", {})
    delta = {k: round(a.get(k, {}).get("us", 0.0) - b.get(k, {}).get("us", 0.0), 2)
             for k in set(a) | set(b)}
    return {k: v for k, v in sorted(delta.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
            if abs(v) >= floor}


def device_fits(profiles: Mapping[str, Mapping], num: str = "on", den: str = "off") -> dict:
    """fit[mode][batch] of the *device* part of the tax: (kernel + copy us
    per step of ``num``) - (of ``den``) = fixed_us + per_layer_us x layers,
    from the profiles (keys "[run<i>:]mode/L<n>/arm/batch<b>") of two or
    more layer counts. Run 6: on the tiny model the host part does not
    scale with layers (4-8 layers are host-bound, at 32 async scheduling
    hides part of it behind the GPU), so the fit of step times came out
    negative; the device part is what grows with a GLM-5.x's layers, and
    what a GPU-bound step pays in full."""
    def device_us(prof: Mapping) -> float:
        ps = prof.get("per_step", {})
        return ps.get("device_kernel_us", 0.0) + ps.get("device_copy_us", 0.0)

    pts: dict[tuple[str, str], dict[int, list[float]]] = {}
    for key, prof in profiles.items():
        run, _, rest = key.rpartition(":")
        parts = rest.split("/")
        if len(parts) != 4 or parts[2] != num or not parts[1].startswith("L"):
            continue
        base = profiles.get(f"{run}:" * bool(run) + "/".join([parts[0], parts[1], den,
                                                               parts[3]]))
        if base is None:
            continue
        mode, batch = parts[0], parts[3].removeprefix("batch")
        pts.setdefault((mode, batch), {}).setdefault(int(parts[1][1:]), []).append(
            device_us(prof) - device_us(base))
    out: dict = {}
    for (mode, batch), by_l in sorted(pts.items()):
        if len(by_l) < 2:
            continue
        layers = sorted(by_l)
        taxes = [stats.median(by_l[L]) for L in layers]
        fixed, per_layer = stats.linear_fit(layers, taxes)
        out.setdefault(mode, {})[batch] = {"fixed_us": fixed, "per_layer_us": per_layer,
                                           "layers": layers, "device_tax_us": taxes}
    return out


# ------------------------------------------------------------ report


def build_report(*, cfg: TaxConfig | None, command: str | None, samples: list,
                 engines_info: dict, profiles: dict, runs: list, failures: list,
                 merged_from: list | None = None) -> dict:
    summary = summarize(samples)
    return {
        "schema": SCHEMA,
        "command": command,
        "config": asdict(cfg) if cfg is not None else None,
        "arms": {a: ARMS[a]["doc"] for a in sorted({s["arm"] for s in samples} | set(
            cfg.arms if cfg else []))},
        "modes": MODE_DOC,
        "method": "decode ms per step = (time of N+M new tokens - time of M) / N, "
                  "prompts prefix-cached, greedy, ignore_eos; arms alternate within each "
                  "repetition (rotated order); per sample also the median step-to-step "
                  "interval (step_ms); cells compare arms by their fastest sample where "
                  "every sample has step_ms, else by medians (summary...statistic)",
        "runs": runs,
        "versions": versions_of(engines_info),
        "engines": engines_info,
        "summary": summary,
        "fit": {m: {str(b): f for b, f in fb.items()} for m, fb in fits(summary).items()},
        "device_fit": device_fits(profiles),
        "targets": evaluate(summary, profiles),
        "profile": profiles,
        "profile_diff": profile_diff(profiles),
        "samples": samples,
        "failures": failures,
        "merged_from": merged_from or [],
    }


def versions_of(engines_info: Mapping) -> dict:
    """flavor (ours | upstream) -> the versions its engines reported (one
    entry unless engines disagree)."""
    out: dict = {}
    for e in engines_info.values():
        v = e.get("versions")
        if v:
            seen = out.setdefault(e.get("flavor") or ARMS.get(e.get("arm"), {}).get("vllm", "?"),
                                  [])
            if v not in seen:
                seen.append(v)
    return out


def merge(reports: list[Mapping], sources: list[str]) -> dict:
    """One report from several runs (e.g. 4 layers in one device call, 32 in
    another, upstream in a third): samples renumbered by run, engines and
    profiles keyed by run, summaries and verdicts recomputed."""
    samples, engines_info, profiles, runs, failures = [], {}, {}, [], []
    freqs = {(rep.get("config") or {}).get("index_topk_freq", 1) for rep in reports}
    if len(freqs) > 1:
        raise ValueError(f"the runs serve different models (index_topk_freq {sorted(freqs)}): "
                         "their fits cannot be merged")
    for i, (rep, src) in enumerate(zip(reports, sources)):
        if rep.get("schema") != SCHEMA:
            raise ValueError(f"{src}: not a {SCHEMA} report (schema {rep.get('schema')!r})")
        base = len(runs)
        for r in rep.get("runs", []) or [{}]:
            runs.append({**r, "source": src})
        for s in rep["samples"]:
            samples.append({**s, "run": base + s.get("run", 0)})
        for k, v in rep.get("engines", {}).items():
            engines_info[f"run{i}:{k}"] = v
        for k, v in rep.get("profile", {}).items():
            profiles[f"run{i}:{k}"] = v
        failures += [f"{src}: {f}" for f in rep.get("failures", [])]
    return build_report(cfg=None, command=None, samples=samples, engines_info=engines_info,
                        profiles=profiles, runs=runs, failures=failures, merged_from=sources)
