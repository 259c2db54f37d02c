# SPDX-License-Identifier: Apache-2.0
"""Drive vLLM's real scheduler with HiSparse on, against a simulated worker.

``SimWorker`` is a test double of the HiSparse worker half that behaves the
way the real one does at the protocol level (enqueue, then complete; per TP
rank; possibly late, repeated, or lost; acks name the step after whose
forward a transfer was submitted) and models the bytes of every group:

- KV rows. Every row holds a tag, a rolling hash of the request's tokens up
  to that position, salted per KV-cache group (``tag ^ group_salt(g)``), so a
  row read through another group's block, or another group's host layers,
  never matches. The forward writes each scheduled row into every resident
  group's block and into the indexer's (and any other GPU group's) block;
  the device slab is one array of rows, shared by all groups (a block is
  leased to one group at a time, INV-4, so a double lease shows as a
  clobbered row).
- The host pool, layer-major as the real one: host row g of resident group
  j's layers (one column per resident group). After the forward the worker
  mirrors exactly the rows it wrote, resident -> host, every group into its
  own column (no envelope from the scheduler). A spill's completion checks
  every group's host page against its resident block and against the KV of
  the page's final tokens (a spill of an unsealed page shows).
- Attention. Every step each scheduled request reads every context row of
  every resident group from where its tables say it lives (resident block,
  or host for a null entry) and every indexer row (the indexer stays
  GPU-resident for the whole context). Requests with host-only pages also
  read a pseudo-random top-k subset per group through their hot buffer:
  one LRU of host rows per request-state slot and resident group, capacity
  the hot region's rows, filled from host on a miss, a hit served from the
  hot slot's bytes in the hot-group blocks (so a stale entry shows). Slots
  are assigned when a region is announced and reset then (INV-24), entries
  keyed by ``new_source_block_ids`` rows and by the rows a forward wrote are
  dropped, all as the real worker does (4.8).
- Speculative decoding (sync scheduling): draft tokens are written with
  their own (wrong, if rejected) tags and rewritten after rejection; the
  drafter writes junk at the lookahead positions, which must be backed by
  resident and host blocks and are never published.

It consumes the rest of the step metadata the way the real worker must:
hot regions get a state slot when announced and lose it when freed (each
announced start is a live request's region; none is freed twice or used
after its free; the announced set always equals the live regions).

A step can execute late (``LateDriver``): ``receive`` takes the scheduler
output when it is emitted and records only the scheduler-side truth the
checks compare against; ``execute`` later runs the step from what was sent.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from vllm.config import (
    AttentionConfig,
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.hisparse import HiSparseConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.hisparse.kv_cache_coordinator import HiSparseKVCacheCoordinator
from vllm.v1.hisparse.host_pool_plan import plan_host_pool
from vllm.v1.hisparse.kv_cache_config import (
    HiSparseKVCacheConfig,
    build_hisparse_kv_cache_config,
)
from vllm.v1.hisparse.memory import staging_block_count
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
from vllm.v1.hisparse.metadata import HiSparseStepMetadata, HiSparseWorkerAck
from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

B = 64
EOS = 1
# A tiny GLM-5-architecture model (GlmMoeDsaForCausalLM): the real MLA and
# indexer dimensions, few layers. Only config.json is needed: the scheduler
# never loads weights or a tokenizer.
def glm_config(num_layers: int = 4, index_topk: int = 64, freq: int = 1) -> dict:
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "dtype": "bfloat16", "vocab_size": 8192, "hidden_size": 1024,
        "intermediate_size": 2048, "moe_intermediate_size": 256,
        "num_hidden_layers": num_layers, "first_k_dense_replace": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 512, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "head_dim": 64,
        "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu",
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "rope_interleave": True, "index_topk": index_topk, "index_n_heads": 32,
        "index_head_dim": 128, "index_topk_freq": freq,
        "indexer_rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
        "num_nextn_predict_layers": 0,
    }


def tiny_glm_specs(num_layers: int, index_topk: int, freq: int) -> dict:
    """GLM-5-architecture KV specs (real MLA/indexer dims, few layers)."""
    hf = {
        "num_hidden_layers": num_layers, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "index_head_dim": 128,
        "index_topk": index_topk, "index_topk_freq": freq,
    }
    return kv_cache_specs_from_hf_config(hf, block_size=B)


def hisparse_kv_cache_config(
    *,
    num_gpu_blocks: int,
    num_host_blocks: int,
    num_layers: int = 4,
    index_topk: int = 64,
    freq: int = 1,
    device_buffer_size: int | None = None,
    admission_max_tokens: int = 256,
    max_model_len: int = 4096,
    max_num_batched_tokens: int = 256,
    decode_kernel_tokens: int = 256,
) -> HiSparseKVCacheConfig:
    """The scheduler's view of a HiSparse KV-cache config, built by the
    real layout builder (spec C1) at a chosen pool size, with the in-slab
    staging blocks production sizes for ``max_model_len`` and
    ``max_num_batched_tokens`` and FlashMLA sparse's decode-kernel
    threshold at 64 heads (docs/worker.md K13)."""
    specs = tiny_glm_specs(num_layers, index_topk, freq)
    params = HiSparseParams(
        index_topk=index_topk,
        max_decode_query_len=1,
        device_buffer_size=device_buffer_size or 2 * index_topk,
        admission_max_tokens=admission_max_tokens,
        host_pool_bytes=0,
    )
    layout = build_hisparse_layout(specs, params)
    params = dataclasses.replace(
        params, host_pool_bytes=num_host_blocks * layout.host_block_stride(False)
    )
    worker = build_hisparse_kv_cache_config(
        layout, num_gpu_blocks, plan_host_pool(layout, params),
        staging_block_count(max_model_len, B, max_num_batched_tokens),
        decode_kernel_tokens,
    )
    config = generate_scheduler_kv_cache_config([worker])
    assert isinstance(config, HiSparseKVCacheConfig)
    return config


def baseline_kv_cache_config(*, num_gpu_blocks: int, num_layers: int = 4,
                             index_topk: int = 64, freq: int = 1,
                             with_tensors: bool = False) -> KVCacheConfig:
    """The same model without HiSparse: the pin's single uniform group of
    sparse-MLA and indexer layers (what get_kv_cache_groups returns).
    ``with_tensors``: one tensor per layer, as the worker allocates them
    (what a connector sizes its own cache by)."""
    specs = tiny_glm_specs(num_layers, index_topk, freq)
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    tensors = [
        KVCacheTensor(size=spec.page_size_bytes * num_gpu_blocks, shared_by=[name])
        for name, spec in specs.items()
    ] if with_tensors else []
    worker = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(specs), uniform)],
    )
    return generate_scheduler_kv_cache_config([worker])


def make_scheduler(
    tmp_dir: Path,
    kv_cache_config: KVCacheConfig,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 4096,
    kv_transfer_config: KVTransferConfig | None = None,
    kv_events_config: KVEventsConfig | None = None,
    async_scheduling: bool = False,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    num_speculative_tokens: int = 0,
) -> Scheduler:
    """vLLM's Scheduler over ``kv_cache_config``. With a HiSparse config,
    HiSparse is enabled and the connector defaults to HiSparseConnector
    alone; with any other config, this is the pin's own scheduler.

    ``num_speculative_tokens`` > 0 gives the scheduler MTP's settings
    (``use_eagle``, that many draft and lookahead tokens). HiSparse refuses
    MTP at config time (spec 6.3 #15: the worker does not run the drafter's
    layer yet), so they are installed after the config checks, as
    ``SchedulerSpecConfig``: the scheduler side must be right before the
    worker side lands."""
    hisparse = isinstance(kv_cache_config, HiSparseKVCacheConfig)
    model_dir = tmp_dir / "glm"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(glm_config()))
    model_config = ModelConfig(
        model=str(model_dir), dtype="float16", seed=0, skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        watermark=0.0,
        policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    cache_config = CacheConfig(block_size=B, enable_prefix_caching=True, cache_dtype="fp8")
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        attention_config=AttentionConfig(
            hisparse_config=HiSparseConfig(host_pool_gib=1.0) if hisparse else None
        ),
        kv_transfer_config=kv_transfer_config
        or (KVTransferConfig(kv_connector="HiSparseConnector", kv_role="kv_both")
            if hisparse else None),
        kv_events_config=kv_events_config,
    )
    # vLLM's CPU platform (forced for these tests) disables chunked prefill
    # for MLA models and async scheduling; the CUDA platform that serves
    # HiSparse does neither. Schedule as on the GPU.
    vllm_config.scheduler_config.enable_chunked_prefill = True
    vllm_config.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    if num_speculative_tokens:
        vllm_config.speculative_config = SchedulerSpecConfig(num_speculative_tokens)
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=B,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )
    coordinator = scheduler.kv_cache_manager.coordinator
    assert isinstance(coordinator, HiSparseKVCacheCoordinator) == hisparse
    return scheduler


def offloading_config(spec_name: str, cpu_bytes: int, **extra) -> KVTransferConfig:
    """The blog's form: an OffloadingConnector, no HiSparse connector (with
    a HiSparse config, ``make_scheduler`` composes it, spec 6.2)."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": spec_name,
            "cpu_bytes_to_use": cpu_bytes,
            **extra,
        },
    )


class SchedulerSpecConfig:
    """What vLLM's Scheduler reads of an MTP ``SpeculativeConfig``
    (``method="mtp"``: ``use_eagle()`` is true, so the scheduler allocates
    ``num_speculative_tokens`` lookahead slots and the KV-cache coordinator
    drops the last block of a prefix hit)."""

    method = "mtp"
    num_speculative_tokens_per_batch_size = None

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def use_eagle(self) -> bool:
        return True

    def uses_draft_model(self) -> bool:
        return False

    def use_dflash(self) -> bool:
        return False

    def use_dspark(self) -> bool:
        return False


_hash_ready = False


def make_request(
    req_id: str, prompt: list[int], max_tokens: int, priority: int = 0
) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(B, sha256),
        priority=priority,
    )


_MASK = 0x7FFFFFFFFFFFFFFF


def _roll(h: int, token: int) -> int:
    return ((h ^ (token + 1)) * 1099511628211) & _MASK


class RowTags:
    """Tag of the KV row at each position of one request: a rolling hash of
    its tokens up to and including that position (KV depends on the whole
    prefix). Extended incrementally as *final* tokens are appended (draft
    tokens are hashed separately by ``chain``)."""

    def __init__(self) -> None:
        self.tags = np.empty(0, dtype=np.int64)
        self.h = 1469598103934665603

    def extend_to(self, tokens) -> np.ndarray:
        n = len(self.tags)
        if len(tokens) > n:
            new = np.empty(len(tokens) - n, dtype=np.int64)
            h = self.h
            for i, t in enumerate(tokens[n:]):
                h = _roll(h, t)
                new[i] = h
            self.h = h
            self.tags = np.concatenate([self.tags, new])
        return self.tags

    def chain(self, upto: int, tokens) -> np.ndarray:
        """Tags of ``tokens`` placed after the first ``upto`` final
        positions (speculative drafts: not cached)."""
        h = int(self.tags[upto - 1]) if upto else 1469598103934665603
        out = np.empty(len(tokens), dtype=np.int64)
        for i, t in enumerate(tokens):
            h = _roll(h, t)
            out[i] = h
        return out


def group_salt(group_id: int) -> int:
    """Per-group salt: group g's copy of a row holds ``tag ^ salt(g)``, so a
    read of one group's row through another group's block (or a host array
    of the wrong group) is a mismatch."""
    return ((group_id + 1) * 0x9E3779B97F4A7C15) & _MASK


DRAFT_JUNK = 0x2545F4914F6CDD1D
"""Base of the bytes the simulated drafter writes at lookahead positions:
never a tag, so a lookahead row read or published before the target
rewrites it is a mismatch."""


class ProtocolError(AssertionError):
    """The simulated worker saw something the real one could not survive."""


@dataclasses.dataclass
class Faults:
    """Fault injection of the simulated worker (target R2)."""

    max_delay: int = 0
    """Steps between enqueue and completion, drawn uniformly in [0, max]."""
    lose_ack_prob: float = 0.0
    """Probability that a step's whole ack is lost in transit."""
    duplicate_prob: float = 0.0
    """Probability of reporting an already reported enqueue again."""
    lagging_rank_delay: int = 0
    """Extra completion delay of the last rank."""
    early_submit: set[int] = dataclasses.field(default_factory=set)
    """Transfer ids reported as submitted before the forward of the step
    that carried it (``submitted_step`` one lower: F17)."""


@dataclasses.dataclass
class HotInvalidation:
    """The hot-entry invalidations of the real worker (spec 4.8, INV-24):
    triggers 1 and 3 on, as the real worker runs them; a test turns one off
    only to show the double would catch what it guards against."""

    reset_on_assign: bool = True
    """Trigger 1: a state slot is reset whenever it is given to a region."""
    new_source_blocks: bool = False
    """Trigger 2: entries keyed by rows of ``new_source_block_ids`` drop.
    The real worker does not run it (docs/worker.md K27: trigger 1 leaves
    it nothing to find); the property and scenario tests run without it."""
    written_rows: bool = True
    """Trigger 3: entries keyed by host rows the forward wrote drop."""


class HotLRU:
    """One index group's LRU of one request-state slot (C7 ``dgi``/``lru``
    rows): host row g -> hot slot index, slots in least-recently-used
    order. The bytes of hot slot s live in the request's hot-group blocks,
    row ``hot_table[s // B] * B + s % B`` of the device slab."""

    __slots__ = ("rows", "entry", "row_of", "order", "by_block")

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.reset()

    def reset(self) -> None:
        self.entry: dict[int, int] = {}
        self.row_of: dict[int, int] = {}
        self.order: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.rows))
        self.by_block: dict[int, set[int]] = {}

    def drop(self, g: int) -> bool:
        s = self.entry.pop(g, None)
        if s is None:
            return False
        del self.row_of[s]
        rows = self.by_block.get(g // B)
        if rows is not None:
            rows.discard(g)
            if not rows:
                del self.by_block[g // B]
        return True

    def drop_block(self, host_block: int) -> int:
        rows = self.by_block.pop(host_block, None)
        if not rows:
            return 0
        for g in rows:
            del self.row_of[self.entry.pop(g)]
        return len(rows)

    def claim(self, g: int) -> int:
        """A miss: take the least recently used slot for host row g."""
        s = next(iter(self.order))
        old = self.row_of.get(s)
        if old is not None:
            self.drop(old)
        self.entry[g] = s
        self.row_of[s] = g
        self.by_block.setdefault(g // B, set()).add(g)
        return s


@dataclasses.dataclass
class _Received:
    """What a worker holds for one step between the moment the scheduler
    emitted it and its (possibly late) execution: the scheduler output as
    sent, and the scheduler-side truth at emission time that the checks
    compare against (never used to execute the step)."""

    so: SchedulerOutput
    meta: HiSparseStepMetadata
    child_metas: list
    tables: dict[str, list[list[int]]]
    hot_starts: dict[int, str]
    handed_out_unpinned: set[int]
    requests: dict[str, Request]
    sent: dict[str, object]
    """A copy of every metadata field as emitted: executing a step late
    must see the same command (no buffer the scheduler reuses)."""


def _copy_fields(meta: HiSparseStepMetadata) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        out[f.name] = v.copy() if isinstance(v, np.ndarray) else (
            list(v) if isinstance(v, list) else v)
    return out


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


class SimWorker:
    """The HiSparse worker half, simulated (see module docstring)."""

    TOPK_STABLE = 8
    TOPK_RANDOM = 4
    TOPK_RECENT = 4

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        ranks: int = 1,
        faults: Faults | None = None,
        seed: int = 0,
        check_reads: bool = True,
    ) -> None:
        self.scheduler = scheduler
        coord = scheduler.kv_cache_manager.coordinator
        assert isinstance(coord, HiSparseKVCacheCoordinator)
        self.coord = coord
        self.res_gids = coord.resident_group_ids
        self.hot_gids = coord.hot_group_ids
        self.src_gid = coord.source_group_id
        self.num_groups = len(coord.kv_cache_config.kv_cache_groups)
        paired = {self.src_gid, *self.res_gids, *self.hot_gids}
        # Indexer, then any other GPU group: GPU-resident for the whole
        # context (spec 1.2, INV-31).
        self.gpu_gids = tuple(g for g in range(self.num_groups) if g not in paired)
        self.indexer_gid = coord.layout.INDEXER_GROUP_ID
        # The groups a token's row is written to / read from: resident,
        # source (host rows), indexer and others.
        self.row_gids = (*self.res_gids, self.src_gid, *self.gpu_gids)
        self.salts = {g: group_salt(g) for g in range(self.num_groups)}
        self.res_salts = np.array([self.salts[g] for g in self.res_gids], dtype=np.int64)
        self.ranks = ranks
        self.faults = faults or Faults()
        self.rng = random.Random(seed)
        self.topk_rng = np.random.default_rng(seed + 0x70C)
        self.check_reads = check_reads
        self.hot_invalidation = HotInvalidation()
        self.gpu = np.full(coord.block_pool.num_gpu_blocks * B, -1, dtype=np.int64)
        # Host pool, layer-major as the real one (spec 3.3): host row g of
        # every sparse layer; the layers of resident group j are one column
        # (they are mirrored from group j's blocks, 4.9), tagged with
        # group j's salt. ``host[g]`` is row g of every group.
        self.host = np.full(
            (coord.host_pool.num_gpu_blocks * B, len(self.res_gids)), -1, dtype=np.int64
        )
        # Worker-side block tables, maintained only from what the scheduler
        # sends (new/resumed full tables, appended ids, residency updates).
        self.tables: dict[str, list[list[int]]] = {}
        self.finished_tables: dict[str, list[list[int]]] = {}
        self.tags: dict[str, RowTags] = {}
        self.step_no = 0
        # Per rank: transfer id -> (completion step, host block, resident
        # ids, (request, page) it copies or None).
        self.in_flight: list[dict[int, tuple]] = [{} for _ in range(ranks)]
        self.done: list[set[int]] = [set() for _ in range(ranks)]
        self.enqueue_report: list[set[int]] = [set() for _ in range(ranks)]
        # Transfer id -> the step after whose forward it was submitted.
        self.submitted: dict[int, int] = {}
        self.reads_checked = 0
        self.indexer_reads_checked = 0
        self.rows_mirrored = 0
        self.draft_rows_written = 0
        self.hot_hits = 0
        self.hot_misses = 0
        self.hot_invalidated = 0
        self.spills_verified = 0
        self.in_flight_reuse_reads = 0
        self.max_staged_pages = 0
        # Transfer ids a test wants to keep in flight (per rank: all ranks).
        self.hold: set[int] = set()
        # Simulated workers of the other MultiConnector children, in order;
        # each has step(child_meta, scheduler_output) ->
        # (worker metadata, finished_recving, finished_sending).
        self.children: list = []
        self.requests_seen: dict[str, Request] = {}
        self.cow_done: set[int] = set()
        self.transfers_seen: list[int] = []
        self.last_meta: HiSparseStepMetadata | None = None
        # Hot regions with a state slot: first block (hot group 0) -> request.
        self.regions: dict[int, str] = {}
        self.regions_allocated = 0
        self.regions_freed = 0
        # The worker's own request-state slots (spec 2.8): one per hot
        # region, max_num_seqs of them, reset on assignment (INV-24).
        self.num_slots = scheduler.scheduler_config.max_num_seqs
        if self.hot_gids:
            hot_mgr = coord.single_type_managers[self.hot_gids[0]]
            self.region_blocks = hot_mgr.region_blocks
        else:
            self.region_blocks = 0
        self.hot_rows = self.region_blocks * B
        self.slots = [
            [HotLRU(self.hot_rows) for _ in self.res_gids] for _ in range(self.num_slots)
        ]
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.strict_slots = True
        """More live hot regions than max_num_seqs: the real worker raises,
        and so does the double. False: record it in ``slot_overflows`` and go
        on with an extra slot (a test that states the failure itself)."""
        self.slot_overflows = 0
        self.slot_of_region: dict[int, int] = {}
        self._topk_u: dict[str, np.ndarray] = {}
        # Steps received and not executed yet (oldest first).
        self._inbox: deque[_Received] = deque()
        # Speculative decoding: the scheduler's settings (MTP/EAGLE).
        self.num_spec_tokens = scheduler.num_spec_tokens
        self.num_lookahead_tokens = scheduler.num_lookahead_tokens
        self.max_model_len = scheduler.max_model_len
        self._watch_reuse(coord.block_pool)

    def _watch_reuse(self, pool) -> None:
        """Record, at the GPU pool, every unpinned (watched) block it hands
        out (independently of the coordinator): the blocks a late step may
        still read (F16)."""
        self._handed_out_unpinned: set[int] = set()
        allocate = pool.get_new_blocks

        def observed(num_blocks: int):
            watched = set(pool._reuse_watchers) if pool._reuse_watchers else ()
            blocks = allocate(num_blocks)
            for blk in blocks:
                if blk.block_id in watched:
                    self._handed_out_unpinned.add(blk.block_id)
            return blocks

        pool.get_new_blocks = observed

    # --------------------------------------------------------- receive

    def receive(self, so: SchedulerOutput) -> None:
        """The scheduler emitted ``so``: queue it for execution. Only the
        scheduler-side truth the checks compare against is recorded now;
        the step itself runs later from ``so`` alone (``execute``)."""
        meta = so.kv_connector_metadata
        child_metas: list = []
        if isinstance(meta, MultiKVConnectorMetadata):
            # HiSparseConnector is the first child of a MultiConnector; the
            # others are simulated by ``self.children`` (same order).
            meta, *child_metas = meta.metadata
            so = dataclasses.replace(so, kv_connector_metadata=meta)
        assert isinstance(meta, HiSparseStepMetadata)
        mgr = self.scheduler.kv_cache_manager
        tables = {
            req_id: [list(ids) for ids in mgr.get_block_ids(req_id)]
            for req_id in so.num_scheduled_tokens
        }
        hot_starts = {}
        if self.hot_gids:
            hot_starts = {
                blocks[0].block_id: req_id
                for req_id, blocks in
                self.coord.single_type_managers[self.hot_gids[0]].req_to_blocks.items()
                if blocks
            }
        handed_out, self._handed_out_unpinned = self._handed_out_unpinned, set()
        requests = {r: self.scheduler.requests[r] for r in so.num_scheduled_tokens}
        self._inbox.append(_Received(
            so, meta, child_metas, tables, hot_starts, handed_out, requests,
            _copy_fields(meta)))

    # ----------------------------------------------------------- W0

    def _sync_tables(self, rx: _Received) -> None:
        so, meta = rx.so, rx.meta
        # A finished request's tables stay readable for this step: its final
        # cache_blocks (R31) plans spills of its durable tail, sent with the
        # first step that reports it finished.
        self.finished_tables = {
            r: self.tables[r] for r in so.finished_req_ids if r in self.tables
        }
        for req_id in list(so.finished_req_ids) + list(so.preempted_req_ids or ()):
            self.tables.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_ids is not None
                self.tables[req_id] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for g in range(self.num_groups):
                    self.tables[req_id][g].extend(new_ids[g])
        g = len(self.res_gids)
        m = len(meta.update_req_ids)
        if (meta.update_start_pages.shape != (m,)
                or meta.update_indptr.shape != (m + 1,)
                or meta.update_block_ids.shape != (int(meta.update_indptr[-1]), g)):
            raise ProtocolError("malformed residency-update CSR")
        got = {}
        for i in range(m):
            req_id, start, rows = meta.residency_update(i)
            if req_id in got:
                raise ProtocolError(f"two residency updates for {req_id}")
            got[req_id] = (start, [rows[:, col].tolist() for col in range(g)])
        expected = self._expected_updates(rx)
        if got != expected:
            raise ProtocolError(
                f"step {self.step_no}: residency updates {got}, expected the "
                f"per-request ones {expected} (R4)")
        for req_id, (start, rows) in got.items():
            table = self.tables[req_id]
            for gid, ids in zip(self.res_gids, rows):
                row = table[gid]
                del row[start:]
                row.extend(ids)

    def _expected_updates(self, rx: _Received) -> dict:
        """What the per-request updates of spec 4.6 step 4 (and R4) are:
        for each scheduled request whose resident table differs from the
        worker's (after appending this step's new ids), the scheduler's rows
        (as they were when the step was emitted) from the first differing
        page; nothing for any other request."""
        expected = {}
        for req_id in rx.so.num_scheduled_tokens:
            actual = rx.tables[req_id]
            mine = self.tables[req_id]
            if all(mine[gid] == actual[gid] for gid in self.res_gids):
                continue
            first = min(
                next((p for p, (a, b) in enumerate(zip(mine[gid], actual[gid])) if a != b),
                     min(len(mine[gid]), len(actual[gid])))
                for gid in self.res_gids
            )
            expected[req_id] = (first, [list(actual[gid][first:]) for gid in self.res_gids])
        return expected

    def _check_tables(self, rx: _Received) -> None:
        """INV-22: before the forward, the worker's tables of every group
        equal the scheduler's (as emitted) for every scheduled request."""
        for req_id in rx.so.num_scheduled_tokens:
            actual = rx.tables[req_id]
            mine = self.tables[req_id]
            for gid in range(self.num_groups):
                if mine[gid] != actual[gid]:
                    raise ProtocolError(
                        f"step {self.step_no}: worker table of {req_id} group "
                        f"{gid} is {mine[gid]}, scheduler has {actual[gid]}"
                    )

    # ------------------------------------------------- W1: block events

    def _hot_regions(self, rx: _Received) -> None:
        """INV-5 / INV-24: freed regions release their state slot, then each
        allocated region gets a freshly reset one; every scheduled request
        reads through its own live region."""
        if not self.hot_gids:
            return
        meta, so, starts = rx.meta, rx.so, rx.hot_starts
        hot0 = self.hot_gids[0]
        allocated = meta.hot_regions_allocated.tolist()
        if meta.hot_region_requests != [starts.get(b) for b in allocated]:
            raise ProtocolError(
                f"step {self.step_no}: regions {allocated} announced for requests "
                f"{meta.hot_region_requests}, held by "
                f"{[starts.get(b) for b in allocated]} (F22: the worker finds a "
                "row's slot by its request)")
        for b in meta.hot_regions_freed.tolist():
            if b not in self.regions:
                raise ProtocolError(
                    f"step {self.step_no}: hot region {b} freed twice or never allocated")
            if b in starts and b not in allocated:
                raise ProtocolError(
                    f"step {self.step_no}: hot region {b} freed while "
                    f"{starts[b]} still holds it (INV-5)")
            del self.regions[b]
            self.regions_freed += 1
            self._free_slots.append(self.slot_of_region.pop(b))
        for b in allocated:
            if b in self.regions:
                raise ProtocolError(
                    f"step {self.step_no}: hot region {b} allocated again "
                    f"without a free (it is {self.regions[b]}'s)")
            if b not in starts:
                raise ProtocolError(
                    f"step {self.step_no}: hot region start {b} is not the first "
                    "hot block of a live request")
            self.regions[b] = starts[b]
            self.regions_allocated += 1
            if not self._free_slots:
                self.slot_overflows += 1
                if self.strict_slots:
                    raise ProtocolError(
                        f"step {self.step_no}: more than max_num_seqs="
                        f"{self.num_slots} hot regions live (the real worker's "
                        "SlotAllocator has no state slot left and raises)")
                self.slots.append([HotLRU(self.hot_rows) for _ in self.res_gids])
                self._free_slots.append(len(self.slots) - 1)
            slot = self._free_slots.pop()
            self.slot_of_region[b] = slot
            if self.hot_invalidation.reset_on_assign:
                for lru in self.slots[slot]:
                    lru.reset()
        if self.regions != starts:
            raise ProtocolError(
                f"step {self.step_no}: the announced hot regions {self.regions} "
                f"are not the live ones {starts} (a region never announced, or "
                "a released one never reported)")
        for req_id in so.num_scheduled_tokens:
            hot = self.tables[req_id][hot0]
            if hot and self.regions.get(hot[0]) != req_id:
                raise ProtocolError(
                    f"step {self.step_no}: {req_id} reads hot region {hot[0]}, "
                    "which is not its live region (used after free?)")

    def _invalidate_new_source_blocks(self, meta: HiSparseStepMetadata) -> None:
        """4.8 trigger 2: hot entries keyed by rows of (re)allocated host
        blocks drop, in every slot (as the real worker does)."""
        if not self.hot_invalidation.new_source_blocks or not meta.new_source_block_ids.size:
            return
        blocks = meta.new_source_block_ids.tolist()
        for slot in self.slots:
            for lru in slot:
                if lru.by_block:
                    for hb in blocks:
                        self.hot_invalidated += lru.drop_block(hb)

    # ------------------------------------------------------ W2 forward

    def _sequence(self, rx: _Received, req_id: str, c: int, n: int) -> np.ndarray:
        """Tags of positions [0, c + n) as this forward sees them: final
        tokens (the worker's own samples past what the scheduler knows, under
        async scheduling), then this step's draft tokens (MTP)."""
        request = rx.requests[req_id]
        self.requests_seen[req_id] = request
        spec = rx.so.scheduled_spec_decode_tokens.get(req_id) or ()
        n_final = c + n - len(spec)
        rt = self.tags.setdefault(req_id, RowTags())
        tags = rt.extend_to(final_tokens(request, n_final))
        if not spec:
            return tags
        if any(t < 0 for t in spec):
            raise ProtocolError(f"{req_id}: draft placeholders reached the worker")
        return np.concatenate([tags[:n_final], rt.chain(n_final, spec)])

    def _pages(self, req_id: str, gids, pos: np.ndarray, what: str) -> np.ndarray:
        """Block ids [len(gids), len(pos)] of positions ``pos`` (the slot
        mapping of those groups); a page without a block is an error."""
        table = self.tables[req_id]
        pages = pos // B
        need = int(pages[-1]) + 1 if len(pages) else 0
        rows = []
        for gid in gids:
            ids = table[gid]
            if len(ids) < need:
                raise ProtocolError(
                    f"step {self.step_no}: {req_id} {what} page {need - 1}, but group "
                    f"{gid} has only {len(ids)} blocks (INV-6/INV-12)")
            rows.append(ids[:need])
        return np.asarray(rows, dtype=np.int64).reshape(len(gids), need)[:, pages]

    def _write(self, req_id: str, pos: np.ndarray, tags: np.ndarray, what: str):
        """Write rows ``pos`` (tags ``tags``) into every resident group and
        every GPU group; returns (resident slots [G, n], host rows [n]) for
        the mirror."""
        blocks = self._pages(req_id, self.row_gids, pos, what)
        g = len(self.res_gids)
        res, host = blocks[:g], blocks[g]
        if (res == 0).any():
            j, i = np.argwhere(res == 0)[0]
            raise ProtocolError(
                f"INV-12: {req_id} writes page {pos[i] // B} into a null resident "
                f"entry (group {self.res_gids[j]})")
        if (host == 0).any():
            raise ProtocolError(
                f"INV-6: {req_id} writes page {pos[np.argmax(host == 0)] // B}, "
                "which has no host block")
        off = pos % B
        slots = res * B + off
        self.gpu[slots] = tags[None, :] ^ self.res_salts[:, None]
        for gid, blk in zip(self.gpu_gids, blocks[g + 1:]):
            if (blk == 0).any():
                raise ProtocolError(
                    f"{req_id} writes page {pos[np.argmax(blk == 0)] // B} into a "
                    f"null entry of GPU group {gid}")
            self.gpu[blk * B + off] = tags ^ self.salts[gid]
        return slots, host * B + off

    def _forward(self, rx: _Received) -> None:
        so = rx.so
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        # Every layer writes every token of the batch before any attention
        # reads (as in the real forward), then the mirror runs (W3).
        written: list[tuple[np.ndarray, np.ndarray]] = []
        batch = []
        for req_id, n in so.num_scheduled_tokens.items():
            c = computed[req_id]
            seq = self._sequence(rx, req_id, c, n)
            pos = np.arange(c, c + n)
            written.append(self._write(req_id, pos, seq[c:c + n], "writes"))
            batch.append((req_id, c, n, seq))
        self._check_staging(batch)
        if self.check_reads:
            for req_id, c, n, seq in batch:
                self._attend(req_id, seq, c + n)
        self._invalidate_written(batch, written)
        self._mirror(written)
        # W4/W5: the drafter writes the lookahead rows, mirrored after it.
        if self.num_lookahead_tokens:
            self._mirror([w for w in (self._draft(rx, *b) for b in batch) if w])

    def _check_staging(self, batch) -> None:
        """K13 / spec 2.11: chunks FlashMLA sparse runs on its decode kernel
        (query in (max_decode_query_len, reorder threshold]) stage their
        host-only context pages in the slab's staging blocks; more pages in
        one forward than there are staging blocks and the real worker
        raises (F21). Counted from the worker's own tables."""
        config = self.coord.kv_cache_config
        lo = self.coord.layout.max_decode_query_len
        staged = 0
        for req_id, c, n, _ in batch:
            if lo < n <= config.decode_kernel_tokens:
                table = self.tables[req_id][self.res_gids[0]]
                staged += sum(b == 0 for b in table[:-(-(c + n) // B)])
        self.max_staged_pages = max(self.max_staged_pages, staged)
        if staged > config.staging_blocks:
            raise ProtocolError(
                f"step {self.step_no}: {staged} host-backed pages of short prefill "
                f"chunks exceed the {config.staging_blocks} in-slab staging blocks "
                "(the real worker raises in plan_extends: F21)")

    def _draft(self, rx: _Received, req_id: str, c: int, n: int, seq):
        """The MTP/EAGLE drafter of a request that sampled this step writes
        its KV at the lookahead positions [c + n, c + n + lookahead) (the
        slots the scheduler allocated with ``num_lookahead_tokens``). The
        bytes are junk the target rewrites before any read; they must land
        in resident pages with host blocks (INV-6, INV-12)."""
        request = rx.requests[req_id]
        if c + n < request.num_prompt_tokens:
            return None  # a prefill chunk samples nothing: no draft
        hi = min(c + n + self.num_lookahead_tokens, self.max_model_len)
        if hi <= c + n:
            return None
        pos = np.arange(c + n, hi)
        junk = (DRAFT_JUNK ^ (pos << 24) ^ self.step_no) & _MASK
        self.draft_rows_written += len(pos)
        return self._write(req_id, pos, junk, "drafts at")

    def _mirror(self, written) -> None:
        """W3 (eager mode, 4.9 without envelopes): after the forward, copy
        exactly the rows it wrote, resident -> host, every resident group
        into its own host layers, through the slot mappings of the step."""
        for slots, host_rows in written:
            self.host[host_rows] = self.gpu[slots].T
            self.rows_mirrored += host_rows.size

    def _attend(self, req_id: str, seq: np.ndarray, context_len: int) -> None:
        """Attention of every resident group: first every context row from
        where the tables say it lives (resident block or, for a null entry,
        host), then a top-k subset through the request's hot buffer; the
        indexer (and any other GPU group) reads every context row."""
        table = self.tables[req_id]
        pos = np.arange(context_len)
        blocks = self._pages(req_id, self.row_gids, pos, "reads")
        g = len(self.res_gids)
        res, host_blk = blocks[:g], blocks[g]
        off = pos % B
        resident = res != 0
        host_rows = host_blk * B + off
        if not resident.all() and (host_blk[~resident.all(axis=0)] == 0).any():
            raise ProtocolError(f"INV-6: {req_id} reads a null page with no host block")
        expect = seq[:context_len][None, :] ^ self.res_salts[:, None]
        got = np.where(resident, self.gpu[res * B + off], self.host[host_rows].T)
        bad = got != expect
        if bad.any():
            j, i = np.argwhere(bad)[0]
            page = i // B
            where = (f"resident block {res[j, i]}" if resident[j, i]
                     else f"host block {host_blk[i]}")
            raise ProtocolError(
                f"step {self.step_no}: {req_id} page {page} of group "
                f"{self.res_gids[j]} read from {where} does not hold the KV the "
                "model wrote (INV-1/22/23)")
        num_pages = (context_len - 1) // B + 1
        self.reads_checked += num_pages * len(self.res_gids)
        for gid, blk in zip(self.gpu_gids, blocks[g + 1:]):
            if self.children and gid == self.indexer_gid:
                continue  # the offloader's double models the indexer bytes
            if gid == self.indexer_gid and (blk == 0).any():
                raise ProtocolError(
                    f"INV-31: {req_id} indexer page {int(np.argmax(blk == 0)) // B} "
                    "is not GPU-resident")
            # Other groups may hold null entries (a sliding window): skip them.
            bad = (blk != 0) & (self.gpu[blk * B + off] != (seq[:context_len] ^ self.salts[gid]))
            if bad.any():
                i = int(np.argmax(bad))
                raise ProtocolError(
                    f"step {self.step_no}: {req_id} page {i // B} of GPU group "
                    f"{gid} (block {blk[i]}) does not hold its KV")
            self.indexer_reads_checked += num_pages
        if not resident.all():
            self._attend_hot(req_id, table, resident, host_rows, expect, context_len)

    def _topk(self, req_id: str, context_len: int) -> np.ndarray:
        """Deterministic pseudo-random top-k positions per resident group:
        a stable set that drifts with the context (LRU hits), a few random
        rows (misses, evictions) and the newest rows. [G, k]."""
        g = len(self.res_gids)
        u = self._topk_u.get(req_id)
        if u is None:
            u = self._topk_u[req_id] = self.topk_rng.random((g, self.TOPK_STABLE))
        # The stable set moves only every 32 tokens of context, so decode
        # steps mostly hit what earlier steps loaded.
        stable = (u * max(context_len // 32 * 32, 1)).astype(np.int64)
        rand = self.topk_rng.integers(0, context_len, (g, self.TOPK_RANDOM))
        recent = np.maximum(context_len - 1 - np.arange(self.TOPK_RECENT), 0)
        return np.concatenate(
            [stable, rand, np.broadcast_to(recent, (g, self.TOPK_RECENT))], axis=1)

    def _attend_hot(self, req_id, table, resident, host_rows, expect, context_len):
        """The decode resolver (spec 2.10, 5.1) for the top-k rows: a row of
        a resident page is read in place; a row of a null page is served
        from the request's hot buffer when its host row is cached there (the
        hot slot's bytes, so a stale entry shows), otherwise the LRU victim
        slot is filled from the host row first (INV-1, INV-24)."""
        hot0 = table[self.hot_gids[0]] if self.hot_gids else []
        slot = self.slot_of_region.get(hot0[0]) if hot0 else None
        if slot is None:
            raise ProtocolError(
                f"INV-21: {req_id} reads a host-only page without a hot region")
        topk = self._topk(req_id, context_len)
        for j, lru in enumerate(self.slots[slot]):
            hot = table[self.hot_gids[j]]
            if len(hot) != self.region_blocks:
                raise ProtocolError(
                    f"INV-5: {req_id} hot group {self.hot_gids[j]} holds {len(hot)} "
                    f"blocks, not its region of {self.region_blocks}")
            rows = np.unique(topk[j])
            rows = rows[~resident[j, rows]]
            gpu, entry, order = self.gpu, lru.entry, lru.order
            for p, g, want in zip(rows.tolist(), host_rows[rows].tolist(),
                                  expect[j, rows].tolist()):
                s = entry.get(g)
                if s is None:
                    s = lru.claim(g)
                    r = hot[s // B] * B + s % B
                    gpu[r] = self.host[g, j]
                    self.hot_misses += 1
                else:
                    r = hot[s // B] * B + s % B
                    self.hot_hits += 1
                order.move_to_end(s)
                if gpu[r] != want:
                    raise ProtocolError(
                        f"step {self.step_no}: {req_id} position {p} of group "
                        f"{self.res_gids[j]} read from hot slot {s} (host row {g}) "
                        "does not hold the KV the model wrote (INV-24: stale hot "
                        "entry, or INV-1)")

    def _invalidate_written(self, batch, written) -> None:
        """4.8 trigger 3: after the forward, entries keyed by the host rows
        each request wrote drop from that request's slot."""
        if not self.hot_invalidation.written_rows or not self.slot_of_region:
            return
        hot0 = self.hot_gids[0]
        for (req_id, *_), (_, host_rows) in zip(batch, written):
            hot = self.tables[req_id][hot0]
            slot = self.slot_of_region.get(hot[0]) if hot else None
            if slot is None:
                continue
            for lru in self.slots[slot]:
                if lru.entry:
                    for g in set(host_rows.tolist()) & lru.entry.keys():
                        self.hot_invalidated += lru.drop(g)

    # ----------------------------------------------------------- acks

    def _owners_of(self, host_blocks: list[int], batch) -> dict[int, tuple[str, int]]:
        """(request, page) of each host block, among this step's batch: a
        spill is planned for a page of a request the step schedules, or of
        one this step reports finished (R31's durable tail)."""
        want = set(host_blocks)
        found: dict[int, tuple[str, int]] = {}
        tables = [(r, self.tables[r]) for r in batch]
        tables += list(self.finished_tables.items())
        for req_id, table in tables:
            for page, hb in enumerate(table[self.src_gid]):
                if hb in want:
                    found.setdefault(hb, (req_id, page))
        return found

    def _transfers(self, meta: HiSparseStepMetadata, batch) -> None:
        n = meta.num_transfers
        g = len(self.res_gids)
        if (meta.transfer_host_blocks.shape != (n,)
                or meta.transfer_resident_blocks.shape != (n, g)
                or meta.transfer_restore.shape != (n,)):
            raise ProtocolError("malformed transfer arrays")
        for tid in meta.retired_transfer_ids.tolist():
            for r in range(self.ranks):
                self.done[r].discard(tid)
            self.submitted.pop(tid, None)
        ids = meta.transfer_ids.tolist()
        self.transfers_seen.extend(ids)
        hosts = meta.transfer_host_blocks.tolist()
        residents = [tuple(row) for row in meta.transfer_resident_blocks.tolist()]
        owners = self._owners_of(hosts, batch) if ids else {}
        for tid, hb, res_ids, restore in zip(ids, hosts, residents,
                                             meta.transfer_restore.tolist()):
            owner = None if restore else owners.get(hb)
            if not restore and owner is None:
                raise ProtocolError(
                    f"transfer {tid}: host block {hb} is no page of a request "
                    "in the batch")
            # Spills are submitted after this step's forward (W5).
            self.submitted[tid] = meta.step
            for r in range(self.ranks):
                delay = self.rng.randint(0, self.faults.max_delay)
                if r == self.ranks - 1:
                    delay += self.faults.lagging_rank_delay
                self.in_flight[r][tid] = (self.step_no + delay, hb, res_ids, owner)
                self.enqueue_report[r].add(tid)

    def _complete(self) -> None:
        for r in range(self.ranks):
            for tid, (at, hb, res_ids, owner) in list(self.in_flight[r].items()):
                if at > self.step_no or tid in self.hold:
                    continue
                # The completion barrier: every mirror of the page's rows has
                # landed, so each group's host page equals its resident page
                # (INV-1), and it holds the KV of the page's final tokens: a
                # spill is planned only for a sealed page (INV-16, R2).
                dst = self.host[hb * B:(hb + 1) * B]
                for j, blk in enumerate(res_ids):
                    if not np.array_equal(self.gpu[blk * B:(blk + 1) * B], dst[:, j]):
                        raise ProtocolError(
                            f"INV-1/INV-25: transfer {tid} completes but host block "
                            f"{hb} differs from resident block {blk} (group "
                            f"{self.res_gids[j]})")
                if owner is not None:
                    req_id, page = owner
                    tags = self.tags[req_id].tags[page * B:(page + 1) * B]
                    if len(tags) < B or not np.array_equal(
                            dst, tags[:, None] ^ self.res_salts[None, :]):
                        raise ProtocolError(
                            f"INV-16: transfer {tid} completes page {page} of "
                            f"{req_id}, which does not hold the KV of final tokens "
                            "(a page spilled before it was sealed)")
                    self.spills_verified += 1
                del self.in_flight[r][tid]
                self.done[r].add(tid)

    def _copy_on_write(self, meta: HiSparseStepMetadata) -> None:
        """Host CoW (4.12): copy the block (every layer), report it done."""
        for src, dst in zip(meta.cow_src.tolist(), meta.cow_dst.tolist()):
            self.host[dst * B:(dst + 1) * B] = self.host[src * B:(src + 1) * B]
            self.cow_done.add(dst)

    def _ack(self) -> HiSparseWorkerAck | None:
        ack = HiSparseWorkerAck(cow_done=frozenset(self.cow_done))
        self.cow_done = set()
        early = self.faults.early_submit
        for r in range(self.ranks):
            reported = self.enqueue_report[r] | self.done[r]
            ack = ack.aggregate(HiSparseWorkerAck(
                enqueued={t: frozenset({r}) for t in self.enqueue_report[r]},
                completed={t: frozenset({r}) for t in self.done[r]},
                submitted_step={
                    t: self.submitted[t] - (t in early)
                    for t in reported if t in self.submitted
                },
            ))
        if self.rng.random() < self.faults.lose_ack_prob:
            return None  # lost in transit: completions are repeated later
        for r in range(self.ranks):
            keep = {t for t in self.enqueue_report[r]
                    if self.rng.random() < self.faults.duplicate_prob}
            self.enqueue_report[r] = keep
        return ack

    def _count_in_flight_reuse(self, rx: _Received) -> None:
        """A step executing late can read resident pages whose blocks the
        scheduler has already handed to someone else in a step emitted since
        (observed at the pool): the race window of F16 and 4.6. Count such
        reads; the forward checks they still see the old bytes (the new owner
        writes in a later forward)."""
        later: set[int] = set()
        for other in self._inbox:
            later.update(other.handed_out_unpinned)
        if not later:
            return
        for req_id in rx.so.num_scheduled_tokens:
            table = self.tables[req_id]
            for gid in self.res_gids:
                self.in_flight_reuse_reads += len(later.intersection(table[gid]))

    def expected_host_rows(self, tags: np.ndarray) -> np.ndarray:
        """Host rows [n, G] holding the KV of ``tags`` in every group."""
        return tags[:, None] ^ self.res_salts[None, :]

    # ----------------------------------------------------------- step

    def execute(self, so: SchedulerOutput) -> KVConnectorOutput:
        """W0-W6 of the oldest received step (``so``), from what was sent
        for it only; returns what the workers report back."""
        if not self._inbox or self._inbox[0].so.kv_connector_metadata is not (
                so.kv_connector_metadata.metadata[0]
                if isinstance(so.kv_connector_metadata, MultiKVConnectorMetadata)
                else so.kv_connector_metadata):
            raise AssertionError("execute() out of order with receive()")
        rx = self._inbox.popleft()
        self.step_no += 1
        meta = rx.meta
        if meta.step != (self.last_meta.step + 1 if self.last_meta else 1):
            raise ProtocolError(f"step {meta.step} after {self.last_meta and self.last_meta.step}")
        self.last_meta = meta
        changed = [k for k, v in _copy_fields(meta).items()
                   if not _same(v, rx.sent[k])]
        if changed:
            raise ProtocolError(
                f"step {meta.step}: metadata fields {changed} changed between "
                "emission and execution (a buffer reused by the scheduler)")
        self._sync_tables(rx)
        self._check_tables(rx)
        self._hot_regions(rx)
        self._invalidate_new_source_blocks(meta)
        self._transfers(meta, rx.so.num_scheduled_tokens)
        self._copy_on_write(meta)
        self._count_in_flight_reuse(rx)
        self._forward(rx)
        self._complete()
        ack = self._ack()
        if not rx.child_metas:
            return KVConnectorOutput(kv_connector_worker_meta=ack)
        assert len(rx.child_metas) == len(self.children)
        out = KVConnectorOutput(finished_recving=set(), finished_sending=set())
        metas = [ack]
        for child, child_meta in zip(self.children, rx.child_metas):
            worker_meta, recving, sending = child.step(child_meta, rx.so)
            metas.append(worker_meta)
            out.finished_recving |= recving
            out.finished_sending |= sending
        out.kv_connector_worker_meta = MultiKVConnectorWorkerMetadata(
            metadata=tuple(metas)
        )
        return out

    def step(self, so: SchedulerOutput) -> KVConnectorOutput:
        """W0-W6 of one step, run as soon as it is emitted."""
        self.receive(so)
        return self.execute(so)


def sampled_token(position: int) -> int:
    """The token the simulated model samples for ``position``: a function of
    the position only, so the worker knows it before the scheduler does
    (async scheduling runs the next forward before the previous output is
    processed). Never the EOS id."""
    return position % 997 + 2


def final_tokens(request: Request, upto: int):
    """The request's final tokens through position ``upto`` as a forward
    sees them: what the scheduler knows, then the worker's own samples
    (async scheduling runs a token before its output is processed)."""
    tokens = request.all_token_ids
    if len(tokens) < upto:
        tokens = list(tokens) + [sampled_token(p) for p in range(len(tokens), upto)]
    return tokens


def wrong_token(position: int) -> int:
    """A draft token the target rejects at ``position`` (never EOS)."""
    return sampled_token(position) + 1000


def scheduled_positions(so: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """req id -> (computed tokens before the step, tokens scheduled)."""
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {r: (computed[r], n) for r, n in so.num_scheduled_tokens.items()}


def num_accepted(c: int, drafts) -> int:
    """Leading drafts equal to what the target samples (drafts sit at
    positions c + 1, c + 2, ...)."""
    a = 0
    for i, d in enumerate(drafts):
        if d != sampled_token(c + 1 + i):
            break
        a += 1
    return a


def schedule(scheduler: Scheduler) -> SchedulerOutput:
    """``scheduler.schedule()``, noting which requests the step samples for:
    those whose chunk reaches every token the request had when scheduled
    (the pin's ``is_prefill_chunk``, set by the schedule). A resumed
    request recomputes its prompt and its earlier outputs, and a chunk
    past the prompt but short of those samples nothing (the runner
    discards it, and the async scheduler counted no placeholder for it)."""
    so = scheduler.schedule()
    so.hs_samples = {r: not scheduler.requests[r].is_prefill_chunk
                     for r in so.num_scheduled_tokens}
    return so


def model_output(
    scheduler: Scheduler, so: SchedulerOutput, connector_output: KVConnectorOutput
) -> ModelRunnerOutput:
    """What the model returns for ``so`` (scheduled through ``schedule``):
    a token for every request whose scheduled tokens reach the end of its
    tokens; with draft tokens (speculative decoding), the accepted drafts
    plus the bonus token."""
    req_ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    samples = getattr(so, "hs_samples", None)
    if samples is None:
        raise ProtocolError("model_output needs a SchedulerOutput from harness.schedule()")
    for req_id, (c, n) in scheduled_positions(so).items():
        done = scheduler.requests.get(req_id) is not None and samples[req_id]
        drafts = so.scheduled_spec_decode_tokens.get(req_id)
        if not done:
            sampled.append([])
        elif drafts:
            a = num_accepted(c, drafts)
            sampled.append([sampled_token(c + 1 + i) for i in range(a + 1)])
        else:
            sampled.append([sampled_token(c + n)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=connector_output,
    )


class Drafter:
    """The MTP drafter's proposals (sync scheduling): ``k`` draft tokens per
    decoding request, each the token the target will sample with
    probability ``accept`` and a rejected one otherwise (deterministic)."""

    def __init__(self, accept: float = 0.6, seed: int = 0) -> None:
        self.accept = accept
        self.rng = random.Random(seed)
        self.proposed = 0
        self.wrong = 0

    def propose(self, scheduler: Scheduler, so: SchedulerOutput) -> DraftTokenIds | None:
        k = scheduler.num_spec_tokens
        if not k:
            return None
        req_ids, drafts = [], []
        for req_id in so.num_scheduled_tokens:
            request = scheduler.requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk:
                continue
            base = request.num_tokens  # positions base .. base + k - 1
            d = []
            for p in range(base, base + k):
                ok = self.rng.random() < self.accept
                d.append(sampled_token(p) if ok else wrong_token(p))
                self.wrong += not ok
            self.proposed += k
            req_ids.append(req_id)
            drafts.append(d)
        return DraftTokenIds(req_ids, drafts) if req_ids else None


def run_step(
    scheduler: Scheduler, worker: SimWorker, drafter: Drafter | None = None
) -> SchedulerOutput:
    """One engine step: schedule, simulated forward, sample, update (then
    the drafter's proposals, as EngineCore.post_step)."""
    so = schedule(scheduler)
    connector_output = worker.step(so)
    scheduler.update_from_output(so, model_output(scheduler, so, connector_output))
    if drafter is not None:
        drafts = drafter.propose(scheduler, so)
        if drafts is not None:
            scheduler.update_draft_token_ids(drafts)
    return so


class AsyncDriver:
    """The engine loop of async scheduling: step t+1 is scheduled and its
    forward runs before step t's output is processed (one step in flight)."""

    def __init__(self, scheduler: Scheduler, worker: SimWorker) -> None:
        self.scheduler, self.worker = scheduler, worker
        self.in_flight: tuple[SchedulerOutput, KVConnectorOutput] | None = None

    def step(self) -> SchedulerOutput:
        so = schedule(self.scheduler)
        out = self.worker.step(so)
        if self.in_flight is not None:
            prev, prev_out = self.in_flight
            self.scheduler.update_from_output(
                prev, model_output(self.scheduler, prev, prev_out))
        self.in_flight = (so, out)
        return so

    def busy(self) -> bool:
        s = self.scheduler
        return (self.in_flight is not None and bool(self.in_flight[0].num_scheduled_tokens)) \
            or s.has_unfinished_requests() or s.connector.has_pending_push_work()


class BaselineAsync:
    """vLLM's async engine loop for a scheduler without a worker double (a
    HiSparse-off arm): step t+1 is scheduled before step t's output is
    processed."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s, self.in_flight = scheduler, None

    def step(self) -> None:
        so = schedule(self.s)
        if self.in_flight is not None:
            prev = self.in_flight
            self.s.update_from_output(prev, model_output(self.s, prev, None))
        self.in_flight = so

    def busy(self) -> bool:
        return (self.in_flight is not None and bool(self.in_flight.num_scheduled_tokens)) \
            or self.s.has_unfinished_requests()


class BaselineSync:
    """vLLM's sync engine loop for a scheduler without a worker double."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def step(self) -> None:
        so = schedule(self.s)
        self.s.update_from_output(so, model_output(self.s, so, None))

    def busy(self) -> bool:
        return self.s.has_unfinished_requests()


class LateDriver:
    """Forwards that run ``lag`` steps late (1 or 2): step t's forward runs
    after the scheduler has emitted step t + lag, from the metadata and
    tables it received for step t only, in order; step t's output (and its
    acks) is processed right after that forward, so ``update_from_output``
    of step t still follows its forward. lag 1 under async scheduling is
    the GPU running behind the CPU; lag 2 is a batch queue of two (as with
    pipeline parallelism). Any step still in flight while the scheduler
    reuses or unpins a page must still read the bytes it was sent for."""

    def __init__(self, scheduler: Scheduler, worker: SimWorker, lag: int = 1) -> None:
        assert lag >= 1
        self.scheduler, self.worker, self.lag = scheduler, worker, lag
        self.queue: deque[SchedulerOutput] = deque()
        self.executed = 0

    def step(self) -> SchedulerOutput:
        so = schedule(self.scheduler)
        self.worker.receive(so)
        self.queue.append(so)
        while len(self.queue) > self.lag:
            self._execute_oldest()
        return so

    def _execute_oldest(self) -> None:
        so = self.queue.popleft()
        out = self.worker.execute(so)
        self.executed += 1
        self.scheduler.update_from_output(so, model_output(self.scheduler, so, out))

    def flush(self) -> None:
        """Run every step still in flight."""
        while self.queue:
            self._execute_oldest()

    def busy(self) -> bool:
        s = self.scheduler
        return any(so.num_scheduled_tokens for so in self.queue) \
            or s.has_unfinished_requests() or s.connector.has_pending_push_work()


def run_until_idle(driver, limit: int = 5000) -> int:
    """Step one of the engine loops above until it is idle; returns the
    steps (more than ``limit`` is a failure: it did not drain)."""
    steps = 0
    while driver.busy():
        driver.step()
        steps += 1
        assert steps < limit, "did not drain"
    return steps


def drain(scheduler: Scheduler, worker: SimWorker, max_steps: int = 10_000,
          drafter: Drafter | None = None) -> int:
    """Step until no request is left and no ack is outstanding (INV-15)."""
    steps = 0
    while scheduler.has_unfinished_requests() or scheduler.connector.has_pending_push_work():
        run_step(scheduler, worker, drafter)
        steps += 1
        if steps > max_steps:
            raise AssertionError("scheduler did not drain")
    return steps


def abort(scheduler: Scheduler, req_ids: Iterable[str]) -> None:
    scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)
