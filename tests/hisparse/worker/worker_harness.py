# SPDX-License-Identifier: Apache-2.0
"""CPU plumbing for the worker-side tests (spec 8.1 W-tests).

The real runtime, worker and binding code run over CPU tensors: a CPU slab
laid out by the real layout builder, a real ``HostPool`` (an anonymous
mapping; only the CUDA registration is replaced by a recorder), the CPU
reference kernels of ``vllm.v1.hisparse.reference`` (the kernels' oracles,
spec 5.6) and the CPU stand-in of the data plane's streams, which runs every
copy in program order and records each wait/record for order checks.

``Batch`` stands in for the runner's persistent batch: vLLM's own per-group
``BlockTable`` driven with ``InputBatch``'s row semantics, request ids per
row, and slot mappings computed the way the runner's kernel does (slot =
table[row, pos // B] * B + pos % B, -1 past the real tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.v1.hisparse import reference
from vllm.v1.hisparse.binding import make_runtime
from vllm.v1.hisparse.host_pool import HostPool, HostRegistrar
from vllm.v1.hisparse.host_pool_plan import plan_host_pool
from vllm.v1.hisparse.kv_cache_config import (
    HiSparseKVCacheConfig,
    build_hisparse_kv_cache_config,
)
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
from vllm.v1.hisparse.metadata import HiSparseStepMetadata
from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config
from vllm.v1.hisparse.worker import HiSparseWorker, StreamOps

B = 64
W = 656


class ReferenceOps:
    """The ops with the launchers' signatures, on the CPU references."""

    resolve_residency = staticmethod(reference.ref_resolve)

    gather_compact = staticmethod(reference.ref_gather_compact)
    order_plan = staticmethod(reference.ref_order_plan)
    order_step = staticmethod(reference.ref_order_step)
    gather_ordered = staticmethod(reference.ref_gather_ordered)
    order_step_temp_bytes = staticmethod(reference.ref_order_step_temp_bytes)

    @staticmethod
    def gather_plan(src, dst, src_rows, dst_rows, mask, req_state=None,
                    out_rows=None, attn_block_stride=None):
        reference.ref_gather_plan(src, dst, src_rows, dst_rows, mask, req_state,
                                  out_rows, attn_block_stride or dst.shape[1])

    invalidate_written_slots = staticmethod(reference.ref_invalidate)
    copy_descriptors = staticmethod(reference.ref_copy_descriptors)
    mirror_descriptors = staticmethod(reference.ref_mirror_descriptors)


@dataclass
class RecordingRegistrar:
    """A HostRegistrar that records calls (and can fail on demand)."""

    fail_register_at: int | None = None
    fail_unregister_at: int | None = None
    sync_raises: bool = False
    calls: list[tuple] = field(default_factory=list)

    def registrar(self) -> HostRegistrar:
        def register(ptr: int, size: int) -> int:
            self.calls.append(("register", ptr, size))
            n = sum(c[0] == "register" for c in self.calls)
            return 1 if self.fail_register_at == n else 0

        def unregister(ptr: int) -> int:
            self.calls.append(("unregister", ptr))
            n = sum(c[0] == "unregister" for c in self.calls)
            return 700 if self.fail_unregister_at == n else 0

        def synchronize() -> None:
            self.calls.append(("synchronize",))
            if self.sync_raises:
                raise RuntimeError("CUDA error: an illegal memory access")

        return HostRegistrar(register, unregister, synchronize)


def tiny_config(*, num_layers: int = 4, freq: int = 1, index_topk: int = 64,
                num_gpu_blocks: int = 256, num_host_blocks: int = 64,
                device_buffer_size: int | None = None,
                registration_chunk_bytes: int | None = None,
                staging_blocks: int = 0,
                shared: bool = False, num_mtp: int = 0, q: int = 1,
                pattern: str | None = None,
                order_misses: str | None = None) -> HiSparseKVCacheConfig:
    """A per-worker HiSparse config of a tiny GLM-5-architecture model (real
    MLA/indexer dims, fp8_ds_mla rows) from the real layout builder;
    ``shared``: the TP-shared host pool's plan (spec 4.12); ``num_mtp``
    drafter (MTP) layers after the target layers, q = 1 + k speculative
    tokens, ``pattern`` an ``index_topk_pattern``."""
    hf = {"num_hidden_layers": num_layers, "kv_lora_rank": 512,
          "qk_rope_head_dim": 64, "index_head_dim": 128,
          "index_topk": index_topk, "index_topk_freq": freq}
    if pattern is not None:
        hf["index_topk_pattern"] = pattern
    specs = kv_cache_specs_from_hf_config(hf, block_size=B,
                                          num_mtp_layers=num_mtp)
    params = HiSparseParams(
        index_topk=index_topk, max_decode_query_len=q,
        device_buffer_size=device_buffer_size or (q + 1) * index_topk,
        admission_max_tokens=256, host_pool_bytes=0, shared_host_pool=shared,
        num_target_layers=num_layers, order_misses=order_misses)
    layout = build_hisparse_layout(specs, params)
    params = dataclasses.replace(
        params, host_pool_bytes=num_host_blocks * layout.host_block_stride(shared))
    if registration_chunk_bytes is not None:
        params = dataclasses.replace(
            params, registration_chunk_bytes=registration_chunk_bytes)
    return build_hisparse_kv_cache_config(
        layout, num_gpu_blocks, plan_host_pool(layout, params), staging_blocks)


class Batch:
    """The runner's persistent batch, as the runtime reads it (BatchState).

    The block tables are vLLM's own ``BlockTable`` (one per KV-cache group,
    CPU buffers with their device copies), driven the way vLLM's
    ``InputBatch`` drives them: ``add_row`` writes a request's blocks and
    leaves the rest of the row as it was, ``clear_row`` zeroes only the
    request's blocks, ``move_row`` (condense) copies a row and leaves the
    source's contents. A double that zeroed rows on add hid F22 (a request
    without a hot region read a stale first hot block)."""

    def __init__(self, num_groups: int, max_reqs: int = 8,
                 max_blocks: int = 32, max_tokens: int = 512,
                 device: str = "cpu") -> None:
        from vllm.v1.worker.block_table import BlockTable

        self.block_tables = [
            BlockTable(B, max_reqs, max_blocks, max_tokens, pin_memory=False,
                       device=torch.device(device), kernel_block_size=B,
                       cp_kv_cache_interleave_size=1)
            for _ in range(num_groups)]
        # CPU tables; ``commit`` copies them to the device, as the runner does.
        self.tables = [bt.block_table.cpu for bt in self.block_tables]
        self.slots = [torch.full((max_tokens,), -1, dtype=torch.int64)
                      for _ in range(num_groups)]
        self.device_tables = [bt.block_table.gpu for bt in self.block_tables]
        self.device_slots = self.slots
        if device != "cpu":
            self.device_slots = [t.to(device) for t in self.slots]
        self.req_ids: list[str | None] = [None] * max_reqs
        self.computed = np.zeros(0, dtype=np.int64)
        self.scheduled = np.zeros(0, dtype=np.int64)

    # BatchState
    def device(self, group_id: int) -> torch.Tensor:
        return self.device_tables[group_id]

    def host(self, group_id: int) -> np.ndarray:
        return self.block_tables[group_id].block_table.np

    def slot_mapping(self, group_id: int) -> torch.Tensor:
        return self.device_slots[group_id]

    def query_start_loc(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.scheduled))).astype(np.int32)

    def req_rows(self) -> dict[str, int]:
        return {r: i for i, r in enumerate(self.req_ids) if r is not None}

    def token_rows(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_reqs(), dtype=np.int32), self.scheduled)

    def commit(self) -> None:
        """The runner's commit: tables and slot mappings to the device."""
        for bt in self.block_tables:
            bt.commit_block_table(len(self.req_ids))
        for src, dst in zip(self.slots, self.device_slots):
            if dst is not src:
                dst.copy_(src)

    def num_reqs(self) -> int:
        return int(self.computed.size)

    def num_tokens(self) -> int:
        return int(self.scheduled.sum())

    def seq_lens_cpu(self) -> np.ndarray:
        return self.computed + self.scheduled

    # test setup, with vLLM's row semantics
    def set_row(self, row: int, group_id: int, blocks: list[int],
                req_id: str | None = None) -> None:
        """``BlockTable.add_row``: the request's blocks from column 0; the
        columns past them keep whatever the row held before."""
        self.block_tables[group_id].add_row(list(blocks), row)
        self.req_ids[row] = req_id if req_id is not None else f"r{row}"

    def remove(self, row: int) -> None:
        """``InputBatch.remove_request``: clear the request's columns."""
        for bt in self.block_tables:
            bt.clear_row(row)
        self.req_ids[row] = None

    def move(self, src: int, dst: int) -> None:
        """``InputBatch.condense``: the request at ``src`` slides to ``dst``;
        ``src`` keeps its contents."""
        for bt in self.block_tables:
            bt.move_row(src, dst)
        self.req_ids[dst], self.req_ids[src] = self.req_ids[src], None

    def schedule(self, computed: list[int], scheduled: list[int]) -> None:
        """This step: row i computes tokens [computed[i], +scheduled[i]);
        the slot mappings as the runner's kernel computes them, then the
        commit."""
        self.computed = np.asarray(computed, dtype=np.int64)
        self.scheduled = np.asarray(scheduled, dtype=np.int64)
        positions = np.concatenate([np.arange(c, c + s) for c, s in
                                    zip(computed, scheduled)]).astype(np.int64)
        rows = np.repeat(np.arange(len(computed)), scheduled)
        for table, slots in zip(self.tables, self.slots):
            slots.fill_(-1)
            blocks = table.numpy()[rows, positions // B].astype(np.int64)
            slots[: positions.size] = torch.from_numpy(blocks * B + positions % B)
        self.commit()

    def req_id_per_token(self) -> torch.Tensor:
        """As the FlashMLA metadata builder fills it: padding -> row 0."""
        out = torch.zeros(self.slots[0].shape[0], dtype=torch.int32)
        rows = np.repeat(np.arange(self.num_reqs()), self.scheduled)
        out[: rows.size] = torch.from_numpy(rows.astype(np.int32))
        return out


def host_pool(config: HiSparseKVCacheConfig,
              recorder: RecordingRegistrar | None = None) -> HostPool:
    recorder = recorder or RecordingRegistrar()
    return HostPool(config.host_pool, recorder.registrar())


def attn_metadata(batch: Batch, num_decodes: int, num_decode_tokens: int,
                  device: str = "cpu"):
    """The sparse-MLA layers' attention metadata fields the worker reads,
    in vLLM's own FlashMLASparseMetadata."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        FlashMLASparseMetadata,
    )

    n = batch.num_reqs()
    return FlashMLASparseMetadata(
        num_reqs=n, max_query_len=int(batch.scheduled.max()),
        max_seq_len=int(batch.seq_lens_cpu().max()),
        num_actual_tokens=batch.num_tokens(),
        query_start_loc=torch.zeros(n + 1, dtype=torch.int32, device=device),
        slot_mapping=batch.device_slots[0], block_table=batch.device_tables[0][:n],
        req_id_per_token=batch.req_id_per_token().to(device),
        seq_lens=torch.from_numpy(batch.seq_lens_cpu().astype(np.int32)).to(device),
        num_decodes=num_decodes, num_prefills=n - num_decodes,
        num_decode_tokens=num_decode_tokens)


def fill_pattern(view: torch.Tensor, seed: int) -> None:
    """Distinct bytes per (view, row): view[..] = f(seed, row, byte)."""
    g = torch.Generator().manual_seed(seed)
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=g))


class WorkerRig:
    """A worker over a slab, a host pool and a batch: the real runtime
    (``make_runtime``) and data plane (``HiSparseWorker``).

    By default all on CPU: ``tiny_config(freq, topk, staging_blocks)``, a
    zeroed CPU slab (pool and staging blocks), a recorded host pool, a
    ``Batch``, the reference ops and page copy. ``config``, ``pool``,
    ``tables`` (what the runtime reads the batch through; ``self.batch``),
    ``ops``, ``page_copy`` and ``device`` replace those parts; ``streams``
    replaces the stream stand-in; ``prefetch_followers`` as the config's."""

    def __init__(self, *, freq: int = 1, eager: bool = True, topk: int = 64,
                 staging_blocks: int = 0, streams: StreamOps | None = None,
                 config: HiSparseKVCacheConfig | None = None,
                 pool: HostPool | None = None, tables=None, ops=ReferenceOps,
                 page_copy=reference.ref_copy_descriptors, rank: int = 0,
                 device: str = "cpu", max_num_seqs: int = 8,
                 max_num_tokens: int = 512, order_misses: bool | str | None = None,
                 prefetch_followers: bool = False) -> None:
        if config is None:
            config = tiny_config(freq=freq, index_topk=topk,
                                 staging_blocks=staging_blocks)
        self.config = config
        self.layout = self.config.layout
        self.slab = torch.zeros(
            (self.config.num_blocks + self.config.staging_blocks)
            * self.layout.bytes_per_block, dtype=torch.uint8, device=device)
        self.pool = host_pool(config) if pool is None else pool
        if tables is None:
            tables = Batch(len(self.layout.kv_cache_groups), device=device)
        self.batch = tables
        self.rt = make_runtime(self.config, self.slab, self.pool, self.batch, ops,
                               max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                               order_misses=order_misses)
        self.worker = HiSparseWorker(
            self.rt, self.pool, slab=self.slab, rank=rank, eager_host_mirror=eager,
            page_copy=page_copy, streams=streams)
        if prefetch_followers:
            self.rt.prefetch_followers(self.worker.streams)
        self.step = 0

    @property
    def res_ids(self):
        return list(self.layout.resident_group_ids)

    @property
    def hot_ids(self):
        return list(self.layout.hot_group_ids)

    def place(self, row: int, resident: list[int], host: list[int],
              hot: list[int] | None = None) -> None:
        """Row ``row``'s tables: resident block b of pair j is 50*j + b
        (0 stays null), host blocks as given, hot region blocks (+50*j)."""
        for j, gid in enumerate(self.res_ids):
            self.batch.set_row(row, gid, [b and 50 * j + b for b in resident])
        self.batch.set_row(row, self.layout.SOURCE_GROUP_ID, host)
        for j, gid in enumerate(self.hot_ids):
            self.batch.set_row(row, gid, [50 * j + b for b in hot or []])

    def meta(self, **fields) -> HiSparseStepMetadata:
        """The next step's metadata (the array fields as numpy arrays)."""
        self.step += 1
        arrays = {k: v if k == "hot_region_requests" else np.asarray(v)
                  for k, v in fields.items()}
        return HiSparseStepMetadata(step=self.step, **arrays)

    def spill(self, tid: int, host_block: int, resident_block: int,
              restore: bool = False) -> dict:
        """``meta`` fields of one transfer between ``host_block`` and
        resident block ``resident_block`` of every pair (+50*j)."""
        g = len(self.res_ids)
        return dict(
            transfer_ids=np.array([tid], dtype=np.int64),
            transfer_host_blocks=np.array([host_block], dtype=np.int32),
            transfer_resident_blocks=np.array(
                [[50 * j + resident_block for j in range(g)]], dtype=np.int32),
            transfer_restore=np.array([restore]),
        )

    def run(self, meta, num_decodes: int = 0, num_decode_tokens: int = 0,
            before_finish=None) -> None:
        """One step: start_step, ``before_finish`` (the forward's writes),
        the attention calls, finish."""
        md = attn_metadata(self.batch, num_decodes, num_decode_tokens)
        self.worker.start_step(meta, md)
        if before_finish is not None:
            before_finish()
        self.attend(md)
        self.worker.finish_forward()

    def attend(self, md) -> None:
        """The forward's attention calls, as ``hisparse_forward_mqa`` makes
        them: every sparse layer in model order (a pure-decode batch is
        mirrored after the last target layer's)."""
        for name in self.layout.sparse_layers:
            self.worker.on_attention(name, md.num_prefills == 0, md.num_actual_tokens)

    def resident_row(self, layer: str, row: int) -> torch.Tensor:
        view = self.rt.layers[layer].resident
        return view[row // B, row % B]

    def host_row(self, layer: str, g: int) -> torch.Tensor:
        return self.rt.layers[layer].host[g]
