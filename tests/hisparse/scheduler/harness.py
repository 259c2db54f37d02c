# SPDX-License-Identifier: Apache-2.0
"""Drive vLLM's real scheduler with HiSparse on, against a simulated worker.

``SimWorker`` is a test double of the HiSparse worker half that behaves the
way the real one will at the protocol level (enqueue, then complete; per TP
rank; possibly late, repeated, or lost; acks name the step after whose
forward a transfer was submitted) and models the bytes as well: every KV row
holds a tag equal to a rolling hash of the request's tokens up to that
position, written into the resident blocks by the "forward", mirrored to
host after the forward exactly as the real worker does (the rows the forward
wrote, through the request's resident and source tables: no envelope from
the scheduler), and read back by "attention" from the resident page or, for
a null entry, from the host. Any protocol bug that would make real
attention read stale or missing KV shows up as a tag mismatch.

It consumes the rest of the step metadata the way the real worker must:
hot regions get a state slot when announced and lose it when freed (each
announced start is a live request's region; none is freed twice or used
after its free; the announced set always equals the live regions), and
``reused_block_ids`` must be exactly the unpinned blocks the GPU pool handed
out since the previous step (observed at the pool, independently of the
coordinator).
"""

from __future__ import annotations

import dataclasses
import json
import random
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
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
from vllm.v1.hisparse.metadata import HiSparseStepMetadata, HiSparseWorkerAck
from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
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
) -> HiSparseKVCacheConfig:
    """The scheduler's view of a HiSparse KV-cache config, built by the
    real layout builder (spec C1) at a chosen pool size."""
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
        layout, num_gpu_blocks, plan_host_pool(layout, params)
    )
    config = generate_scheduler_kv_cache_config([worker])
    assert isinstance(config, HiSparseKVCacheConfig)
    return config


def baseline_kv_cache_config(*, num_gpu_blocks: int, num_layers: int = 4,
                             index_topk: int = 64, freq: int = 1) -> KVCacheConfig:
    """The same model without HiSparse: the pin's single uniform group of
    sparse-MLA and indexer layers (what get_kv_cache_groups returns)."""
    specs = tiny_glm_specs(num_layers, index_topk, freq)
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    worker = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[],
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
) -> Scheduler:
    """vLLM's Scheduler over ``kv_cache_config``. With a HiSparse config,
    HiSparse is enabled and the connector defaults to HiSparseConnector
    alone; with any other config, this is the pin's own scheduler."""
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


class RowTags:
    """Tag of the KV row at each position of one request: a rolling hash of
    its tokens up to and including that position (KV depends on the whole
    prefix). Extended incrementally as tokens are appended."""

    def __init__(self) -> None:
        self.tags = np.empty(0, dtype=np.int64)
        self.h = 1469598103934665603

    def extend_to(self, tokens) -> np.ndarray:
        n = len(self.tags)
        if len(tokens) > n:
            new = np.empty(len(tokens) - n, dtype=np.int64)
            h = self.h
            for i, t in enumerate(tokens[n:]):
                h = ((h ^ (t + 1)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
                new[i] = h
            self.h = h
            self.tags = np.concatenate([self.tags, new])
        return self.tags


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
    that carried them (``submitted_step`` one lower: F17)."""


class SimWorker:
    """The HiSparse worker half, simulated (see module docstring)."""

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
        self.ranks = ranks
        self.faults = faults or Faults()
        self.rng = random.Random(seed)
        self.check_reads = check_reads
        self.gpu = np.full(coord.block_pool.num_gpu_blocks * B, -1, dtype=np.int64)
        self.host = np.full(coord.host_pool.num_gpu_blocks * B, -1, dtype=np.int64)
        # Worker-side block tables, maintained only from what the scheduler
        # sends (new/resumed full tables, appended ids, residency updates).
        self.tables: dict[str, list[list[int]]] = {}
        self.tags: dict[str, RowTags] = {}
        self.step_no = 0
        # Per rank: transfer id -> (completion step, host block, resident ids).
        self.in_flight: list[dict[int, tuple[int, int, tuple[int, ...]]]] = [
            {} for _ in range(ranks)
        ]
        self.done: list[set[int]] = [set() for _ in range(ranks)]
        self.enqueue_report: list[set[int]] = [set() for _ in range(ranks)]
        # Transfer id -> the step after whose forward it was submitted.
        self.submitted: dict[int, int] = {}
        self.reads_checked = 0
        self.rows_mirrored = 0
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
        self.reused_seen = 0
        self._watch_reuse(coord.block_pool)

    def _watch_reuse(self, pool) -> None:
        """Record, at the GPU pool, every unpinned (watched) block it hands
        out: what ``reused_block_ids`` must list (F16)."""
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

    # ----------------------------------------------------------- W0

    def _sync_tables(self, so: SchedulerOutput) -> None:
        n_groups = len(self.coord.kv_cache_config.kv_cache_groups)
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
                for g in range(n_groups):
                    self.tables[req_id][g].extend(new_ids[g])
        meta = so.kv_connector_metadata
        assert isinstance(meta, HiSparseStepMetadata)
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
        expected = self._expected_updates(so)
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

    def _expected_updates(self, so: SchedulerOutput) -> dict:
        """What the per-request updates of spec 4.6 step 4 (and R4) are:
        for each scheduled request whose resident table differs from the
        worker's (after appending this step's new ids), the scheduler's rows
        from the first differing page; nothing for any other request."""
        mgr = self.scheduler.kv_cache_manager
        expected = {}
        for req_id in so.num_scheduled_tokens:
            actual = mgr.get_block_ids(req_id)
            mine = self.tables[req_id]
            if all(mine[gid] == list(actual[gid]) for gid in self.res_gids):
                continue
            first = min(
                next((p for p, (a, b) in enumerate(zip(mine[gid], actual[gid])) if a != b),
                     min(len(mine[gid]), len(actual[gid])))
                for gid in self.res_gids
            )
            expected[req_id] = (first, [list(actual[gid][first:]) for gid in self.res_gids])
        return expected

    def _check_tables(self, so: SchedulerOutput) -> None:
        """INV-22: before the forward, the worker's resident tables equal
        the scheduler's for every scheduled request."""
        mgr = self.scheduler.kv_cache_manager
        for req_id in so.num_scheduled_tokens:
            actual = mgr.get_block_ids(req_id)
            mine = self.tables[req_id]
            for gid in (*self.res_gids, *self.hot_gids, self.src_gid):
                if mine[gid] != list(actual[gid]):
                    raise ProtocolError(
                        f"step {self.step_no}: worker table of {req_id} group "
                        f"{gid} is {mine[gid]}, scheduler has {list(actual[gid])}"
                    )

    # ------------------------------------------------- W1: block events

    def _hot_regions(self, meta: HiSparseStepMetadata, so: SchedulerOutput) -> None:
        """INV-5 / INV-24: freed regions release their state slot, then each
        allocated region gets a fresh one; every scheduled request reads
        through its own live region."""
        if not self.hot_gids:
            return
        hot0 = self.hot_gids[0]
        starts = {
            blocks[0].block_id: req_id
            for req_id, blocks in self.coord.single_type_managers[hot0].req_to_blocks.items()
            if blocks
        }
        allocated = meta.hot_regions_allocated.tolist()
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

    def _reused(self, meta: HiSparseStepMetadata) -> None:
        """F16: the reused blocks listed are exactly the unpinned blocks the
        pool handed out since the previous step."""
        listed = meta.reused_block_ids.tolist()
        if len(listed) != len(set(listed)) or set(listed) != self._handed_out_unpinned:
            raise ProtocolError(
                f"step {self.step_no}: reused_block_ids {sorted(listed)}, but the "
                f"pool handed out unpinned blocks {sorted(self._handed_out_unpinned)}")
        self.reused_seen += len(listed)
        self._handed_out_unpinned = set()

    # ------------------------------------------------------ W2 forward

    def _forward(self, so: SchedulerOutput) -> None:
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        # (resident row, host row, rows) of every run this forward writes.
        written: list[tuple[int, int, int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            self.requests_seen[req_id] = request
            c = computed[req_id]
            # Under async scheduling the worker is ahead of the scheduler: it
            # feeds the tokens it sampled itself (sampled_token).
            tokens = list(request.all_token_ids)
            tokens += [sampled_token(p) for p in range(len(tokens), c + n)]
            tags = self.tags.setdefault(req_id, RowTags()).extend_to(tokens)
            table = self.tables[req_id]
            for page in range(c // B, (c + n - 1) // B + 1):
                lo, hi = max(c, page * B), min(c + n, (page + 1) * B)
                for gid in self.res_gids:
                    blk = table[gid][page]
                    if blk == 0:
                        raise ProtocolError(
                            f"INV-12: {req_id} writes page {page} into a null "
                            f"resident entry (group {gid})"
                        )
                    base = blk * B - page * B
                    self.gpu[base + lo:base + hi] = tags[lo:hi]
                host_block = table[self.src_gid][page]
                if host_block == 0:
                    raise ProtocolError(
                        f"INV-6: {req_id} writes page {page}, which has no host block")
                off = lo - page * B
                written.append((table[self.res_gids[0]][page] * B + off,
                                host_block * B + off, hi - lo))
            if self.check_reads:
                self._attend(req_id, table, tags, c + n)
        self._mirror(written)

    def _mirror(self, written: list[tuple[int, int, int]]) -> None:
        """W3 (eager mode, 4.9 without envelopes): after the forward, copy
        exactly the rows it wrote, resident -> host, through the slot
        mappings of the step (the resident and source tables)."""
        for src, dst, n in written:
            self.host[dst:dst + n] = self.gpu[src:src + n]
            self.rows_mirrored += n

    def _attend(self, req_id, table, tags, context_len) -> None:
        """Read every context row from where the tables say it lives."""
        res, src = table[self.res_gids[0]], table[self.src_gid]
        for page in range(0, (context_len - 1) // B + 1):
            lo, hi = page * B, min(context_len, (page + 1) * B)
            blk = res[page]
            if blk != 0:
                got = self.gpu[blk * B:blk * B + (hi - lo)]
                where = f"resident block {blk}"
            else:
                hb = src[page]
                got = self.host[hb * B:hb * B + (hi - lo)]
                where = f"host block {hb}"
            if not np.array_equal(got, tags[lo:hi]):
                raise ProtocolError(
                    f"step {self.step_no}: {req_id} page {page} read from "
                    f"{where} does not hold the KV the model wrote (INV-1/22/23)"
                )
            self.reads_checked += 1

    # ----------------------------------------------------------- acks

    def _transfers(self, meta: HiSparseStepMetadata) -> None:
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
        for tid, hb, res_ids in zip(ids, hosts, residents):
            # Spills are submitted after this step's forward (W5).
            self.submitted[tid] = meta.step
            for r in range(self.ranks):
                delay = self.rng.randint(0, self.faults.max_delay)
                if r == self.ranks - 1:
                    delay += self.faults.lagging_rank_delay
                self.in_flight[r][tid] = (self.step_no + delay, hb, res_ids)
                self.enqueue_report[r].add(tid)

    def _complete(self) -> None:
        for r in range(self.ranks):
            for tid, (at, hb, res_ids) in list(self.in_flight[r].items()):
                if at > self.step_no or tid in self.hold:
                    continue
                # The completion barrier: every mirror of the page's rows has
                # landed, so the host page equals the resident page (INV-1).
                src = self.gpu[res_ids[0] * B:(res_ids[0] + 1) * B]
                dst = self.host[hb * B:(hb + 1) * B]
                if not np.array_equal(src, dst):
                    raise ProtocolError(
                        f"INV-1/INV-25: transfer {tid} completes but host block "
                        f"{hb} differs from resident block {res_ids[0]}"
                    )
                del self.in_flight[r][tid]
                self.done[r].add(tid)

    def _copy_on_write(self, meta: HiSparseStepMetadata) -> None:
        """Host CoW (4.12): copy the block, report the destination done."""
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

    # ----------------------------------------------------------- step

    def step(self, so: SchedulerOutput) -> KVConnectorOutput:
        """W0-W6 of one step; returns what the workers report back."""
        self.step_no += 1
        meta = so.kv_connector_metadata
        child_metas: list = []
        if isinstance(meta, MultiKVConnectorMetadata):
            # HiSparseConnector is the first child of a MultiConnector; the
            # others are simulated by ``self.children`` (same order).
            meta, *child_metas = meta.metadata
            so = dataclasses.replace(so, kv_connector_metadata=meta)
        assert isinstance(meta, HiSparseStepMetadata)
        if meta.step != (self.last_meta.step + 1 if self.last_meta else 1):
            raise ProtocolError(f"step {meta.step} after {self.last_meta and self.last_meta.step}")
        self.last_meta = meta
        self._sync_tables(so)
        self._check_tables(so)
        self._hot_regions(meta, so)
        self._reused(meta)
        self._transfers(meta)
        self._copy_on_write(meta)
        self._forward(so)
        self._complete()
        ack = self._ack()
        if not child_metas:
            return KVConnectorOutput(kv_connector_worker_meta=ack)
        assert len(child_metas) == len(self.children)
        out = KVConnectorOutput(finished_recving=set(), finished_sending=set())
        metas = [ack]
        for child, child_meta in zip(self.children, child_metas):
            worker_meta, recving, sending = child.step(child_meta, so)
            metas.append(worker_meta)
            out.finished_recving |= recving
            out.finished_sending |= sending
        out.kv_connector_worker_meta = MultiKVConnectorWorkerMetadata(
            metadata=tuple(metas)
        )
        return out


def sampled_token(position: int) -> int:
    """The token the simulated model samples for ``position``: a function of
    the position only, so the worker knows it before the scheduler does
    (async scheduling runs the next forward before the previous output is
    processed). Never the EOS id."""
    return position % 997 + 2


def scheduled_positions(so: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """req id -> (computed tokens before the step, tokens scheduled)."""
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {r: (computed[r], n) for r, n in so.num_scheduled_tokens.items()}


def model_output(
    scheduler: Scheduler, so: SchedulerOutput, connector_output: KVConnectorOutput
) -> ModelRunnerOutput:
    """What the model returns for ``so``: a token for every request whose
    scheduled tokens reach the end of its prompt."""
    req_ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id, (c, n) in scheduled_positions(so).items():
        request = scheduler.requests.get(req_id)
        done = request is not None and c + n >= request.num_prompt_tokens
        sampled.append([sampled_token(c + n)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=connector_output,
    )


def run_step(scheduler: Scheduler, worker: SimWorker) -> SchedulerOutput:
    """One engine step: schedule, simulated forward, sample, update."""
    so = scheduler.schedule()
    connector_output = worker.step(so)
    scheduler.update_from_output(so, model_output(scheduler, so, connector_output))
    return so


class AsyncDriver:
    """The engine loop of async scheduling: step t+1 is scheduled and its
    forward runs before step t's output is processed (one step in flight)."""

    def __init__(self, scheduler: Scheduler, worker: SimWorker) -> None:
        self.scheduler, self.worker = scheduler, worker
        self.in_flight: tuple[SchedulerOutput, KVConnectorOutput] | None = None

    def step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
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


def drain(scheduler: Scheduler, worker: SimWorker, max_steps: int = 10_000) -> int:
    """Step until no request is left and no ack is outstanding (INV-15)."""
    steps = 0
    while scheduler.has_unfinished_requests() or scheduler.connector.has_pending_push_work():
        run_step(scheduler, worker)
        steps += 1
        if steps > max_steps:
            raise AssertionError("scheduler did not drain")
    return steps


def abort(scheduler: Scheduler, req_ids: Iterable[str]) -> None:
    scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)
