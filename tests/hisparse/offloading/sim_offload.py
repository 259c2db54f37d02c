# SPDX-License-Identifier: Apache-2.0
"""The OffloadingConnector's worker side, as a MultiConnector child of the
simulated HiSparse worker (``SimWorker.children``).

``SimOffloadWorker`` drives the *real* worker half of
``HiSparseOffloadingConnector`` (vLLM's ``OffloadingConnectorWorker``: job
deferral, flushes, completion reports, finished_recving for loads, transfer
stats) in the order the model runner calls it. Only the data mover is a
test double: ``SimCopyEngine`` stands in for ``CPUOffloadingWorker`` (which
needs CUDA streams) and copies the same bytes on CPU tensors.

The GPU side is one int8 slab shaped like HiSparse's device slab, and every
group writes its real byte footprint into it: indexer rows carry a tag of
the tokens they encode (the same rolling hash the HiSparse SimWorker uses),
resident writes and hot-slot fills overwrite their rows with junk. So a store
that copies anything but the indexer page of the request it names, a load
into the wrong block, or a store racing a resident/hot write to a reused
block is caught as a ``ProtocolError``.

Copies run when the transfer is reported complete (or flushed): the latest
point an asynchronous copy may run, i.e. after the step's forward.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch

from tests.hisparse.scheduler.harness import (
    B,
    ProtocolError,
    RowTags,
    SimWorker,
    final_tokens,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.offloading import (
    HiSparseOffloadingConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.hisparse.kv_cache_config import HiSparseKVCacheConfig
from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

TAG_BYTES = 8
RESIDENT_JUNK = 0x5A
HOT_JUNK = -0x5B


@dataclasses.dataclass
class _Copy:
    job_id: int
    to_cpu: bool
    gpu_spec: GPULoadStoreSpec
    cpu_ids: np.ndarray
    remaining: int


class SimCopyEngine(OffloadingWorker):
    """Test double of ``CPUOffloadingWorker`` (blocks_per_chunk = 1): for
    each group, block i of the GPU spec pairs with block i of the CPU spec,
    and every data reference of the group copies its page bytes."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, num_cpu_blocks: int, blocks_per_chunk: int
    ):
        assert blocks_per_chunk == 1, "the simulated copy engine pairs blocks 1:1"
        self.kv_caches = kv_caches
        self.gpu = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            for t in kv_caches.tensors
        ]
        self.cpu = [
            torch.zeros((num_cpu_blocks, t.page_size_bytes), dtype=torch.int8)
            for t in kv_caches.tensors
        ]
        self.delay = 0
        """get_finished calls a transfer stays in flight after its submit."""
        self.on_copy = lambda copy: None
        """Called before a store's copy and after a load's (verification)."""
        self.flushed: set[int] = set()
        self._queue: list[_Copy] = []  # submitted, not copied yet (FIFO)
        self._completed: list[TransferResult] = []  # copied, not reported yet

    def submit_store(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, True, src_spec, dst_spec)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, False, dst_spec, src_spec)

    def _submit(self, job_id, to_cpu, gpu_spec, cpu_spec) -> bool:
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
        assert len(gpu_spec.group_sizes) == len(self.kv_caches.group_data_refs)
        assert len(gpu_spec.block_ids) == len(cpu_spec.block_ids)
        self._queue.append(
            _Copy(job_id, to_cpu, gpu_spec, cpu_spec.block_ids, self.delay)
        )
        return True

    def _run(self, c: _Copy) -> None:
        if c.to_cpu:
            self.on_copy(c)
        num_bytes = 0
        pos = 0
        for size, refs in zip(c.gpu_spec.group_sizes, self.kv_caches.group_data_refs):
            gpu_ids = torch.from_numpy(
                c.gpu_spec.block_ids[pos : pos + size].astype(np.int64)
            )
            cpu_ids = torch.from_numpy(c.cpu_ids[pos : pos + size].astype(np.int64))
            for ref in refs:
                n = ref.page_size_bytes
                gpu, cpu = self.gpu[ref.tensor_idx], self.cpu[ref.tensor_idx]
                if c.to_cpu:
                    cpu[cpu_ids, :n] = gpu[gpu_ids, :n]
                else:
                    gpu[gpu_ids, :n] = cpu[cpu_ids, :n]
                num_bytes += size * n
            pos += size
        if not c.to_cpu:
            self.on_copy(c)
        # The time of a 25 GB/s link; only its presence matters (stats).
        self._completed.append(
            TransferResult(c.job_id, True, num_bytes, num_bytes / 25e9)
        )

    def get_finished(self) -> list[TransferResult]:
        for c in list(self._queue):
            if c.remaining > 0:
                c.remaining -= 1
                continue
            self._queue.remove(c)
            self._run(c)
        done, self._completed = self._completed, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """A flush: the listed copies run now (before the forward); they are
        reported by the next get_finished, as the real worker does."""
        self.flushed |= job_ids
        for c in [c for c in self._queue if c.job_id in job_ids]:
            self._queue.remove(c)
            self._run(c)

    def shutdown(self) -> None:
        self._queue.clear()


class _SimWorkerSpecMixin:
    """An offloading spec whose worker half is ``SimCopyEngine``; its
    scheduler half (the manager) is the base spec's own."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = SimCopyEngine(
                kv_caches, self.num_blocks, self.blocks_per_chunk
            )
        return self._worker


class SimCPUOffloadingSpec(_SimWorkerSpecMixin, CPUOffloadingSpec):
    pass


class SimTieringOffloadingSpec(_SimWorkerSpecMixin, TieringOffloadingSpec):
    pass


SIM_SPECS = {
    "CPUOffloadingSpec": "SimCPUOffloadingSpec",
    "TieringOffloadingSpec": "SimTieringOffloadingSpec",
}


def worker_kv_cache_config(config: HiSparseKVCacheConfig) -> HiSparseKVCacheConfig:
    """The per-worker config the scheduler's was collapsed from: the layout
    keeps the original groups (per-layer ``UniformTypeKVCacheSpecs``)."""
    return dataclasses.replace(
        config, kv_cache_groups=copy.deepcopy(list(config.layout.kv_cache_groups))
    )


def layer_specs(config: HiSparseKVCacheConfig) -> dict:
    specs = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            is_uniform = isinstance(spec, UniformTypeKVCacheSpecs)
            specs[name] = spec.kv_cache_specs[name] if is_uniform else spec
    return specs


def device_layer_views(config: HiSparseKVCacheConfig, slab: torch.Tensor) -> dict:
    """What the runner binds: one [num_blocks, B, row] view per device layer
    (indexer and the virtual resident/hot layers alike) into the slab."""
    specs = layer_specs(config)
    stride = config.layout.bytes_per_block
    views = {}
    for tensor in config.kv_cache_tensors:
        for name in tensor.shared_by:
            row = specs[name].page_size_bytes // B
            views[name] = torch.as_strided(
                slab, (config.num_blocks, B, row), (stride, row, 1), tensor.offset
            )
    return views


def worker_vllm_config(scheduler: Scheduler, child_index: int):
    """The config MultiConnector gives its child on a worker, with the
    offloading spec's worker half swapped for ``SimCopyEngine``."""
    vllm_config = scheduler.vllm_config
    parent = vllm_config.kv_transfer_config
    child = copy.deepcopy(parent.kv_connector_extra_config["connectors"][child_index])
    extra = child.setdefault("kv_connector_extra_config", {})
    extra["spec_name"] = SIM_SPECS[extra.get("spec_name", "CPUOffloadingSpec")]
    extra["spec_module_path"] = __name__
    worker = copy.copy(vllm_config)
    worker.kv_transfer_config = KVTransferConfig(**child, engine_id=parent.engine_id)
    return worker


class SimOffloadWorker:
    """The HiSparseOffloadingConnector child of ``SimWorker`` (module doc)."""

    def __init__(
        self,
        scheduler: Scheduler,
        sim: SimWorker,
        *,
        child_index: int = 1,
        copy_delay: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.sim = sim
        config = worker_kv_cache_config(scheduler.kv_cache_config)
        layout = self.layout = config.layout
        self.idx_gid = layout.INDEXER_GROUP_ID
        self.res_gids = tuple(layout.resident_group_ids)
        self.hot_gids = tuple(layout.hot_group_ids)
        self.connector = HiSparseOffloadingConnector(
            worker_vllm_config(scheduler, child_index), KVConnectorRole.WORKER, config
        )
        self.slab = torch.zeros(
            config.num_blocks * layout.bytes_per_block, dtype=torch.int8
        )
        self.bytes = self.slab.numpy().view(np.uint8)
        self.connector.register_kv_caches(device_layer_views(config, self.slab))
        engine = self.connector.connector_worker.worker
        assert isinstance(engine, SimCopyEngine)
        self.engine = engine
        engine.delay = copy_delay
        engine.on_copy = self._verify_copy
        specs = layer_specs(config)
        self._footprints = {
            gid: [
                (layout.layer_offsets[n], specs[n].page_size_bytes // B)
                for n in config.kv_cache_groups[gid].layer_names
            ]
            for gid in (self.idx_gid, *self.res_gids, *self.hot_gids)
        }
        self._row_tags: dict[str, RowTags] = {}
        self.tables: dict[str, list[int]] = {}
        """Indexer table of every request the worker has seen (kept after
        it finishes: its last stores are built one step later)."""
        self._jobs: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        self.store_block_ids: list[int] = []
        self.stores_verified = 0
        self.loads_verified = 0
        self.indexer_reads_checked = 0
        self.fenced_flushes = 0

    # ------------------------------------------------------------ step

    def step(self, meta: OffloadingConnectorMetadata, so: SchedulerOutput):
        """The runner's order: handle_preemptions, bind, start_load_kv,
        forward, wait_for_save, get_finished, build_connector_worker_meta."""
        assert isinstance(meta, OffloadingConnectorMetadata)
        for req_id, table in self.sim.tables.items():
            self.tables[req_id] = list(table[self.idx_gid])
        self._record_jobs(meta)
        self._count_fenced_flushes(meta, so)
        c = self.connector
        c.handle_preemptions(meta)
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        self._forward(so)
        c.wait_for_save()
        finished_sending, finished_recving = c.get_finished(set(so.finished_req_ids))
        worker_meta: OffloadingWorkerMetadata | None = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        return worker_meta, finished_recving or set(), finished_sending or set()

    # ------------------------------------------------------- job checks

    def _record_jobs(self, meta: OffloadingConnectorMetadata) -> None:
        """Every store copies blocks of the indexer table of the request it
        names (never a source, resident or hot id); every load fills the
        request's new indexer blocks. Positions are kept for the byte checks."""
        for job_id, job in meta.store_jobs.items():
            spec = job.src_spec
            self._check_groups(spec)
            table = self.tables.get(job.req_id, [])
            ids = spec.block_ids.tolist()
            try:
                pages = [table.index(b) for b in ids]
            except ValueError:
                raise ProtocolError(
                    f"store job {job_id} of {job.req_id} copies blocks {ids}; its "
                    f"indexer table is {table}"
                ) from None
            if pages != sorted(pages) or (pages and pages[0] != spec.block_indices[0]):
                raise ProtocolError(f"store job {job_id}: pages {pages} out of order")
            self.store_block_ids.extend(ids)
            self._jobs[job_id] = (job.req_id, list(zip(ids, pages)))
        for job_id, job in meta.load_jobs.items():
            spec = job.dst_spec
            self._check_groups(spec)
            table = self.scheduler.kv_cache_manager.get_block_ids(job.req_id)[
                self.idx_gid
            ]
            first = spec.block_indices[0]
            ids = spec.block_ids.tolist()
            if ids != list(table[first : first + len(ids)]):
                raise ProtocolError(
                    f"load job {job_id} of {job.req_id} fills {ids}, not its indexer "
                    f"blocks {list(table)} from page {first}"
                )
            self._jobs[job_id] = (
                job.req_id,
                list(zip(ids, range(first, first + len(ids)))),
            )

    def _check_groups(self, spec: GPULoadStoreSpec) -> None:
        if len(spec.group_sizes) != 1 + len(self.layout.other_group_ids):
            raise ProtocolError(
                f"the offloader transfers {len(spec.group_sizes)} groups; it may see "
                "only the indexer and other groups"
            )

    def _count_fenced_flushes(
        self, meta: OffloadingConnectorMetadata, so: SchedulerOutput
    ):
        """Flushes of stores whose source block became a resident/hot lease
        this step (the reallocation HiSparseOffloadingConnector fences)."""
        leased: set[int] = set()
        new = [(r.block_ids) for r in so.scheduled_new_reqs]
        new += [ids for ids in so.scheduled_cached_reqs.new_block_ids if ids]
        for ids in new:
            for gid in (*self.res_gids, *self.hot_gids):
                leased.update(ids[gid])
        for job_id in meta.jobs_to_flush or ():
            job = self._jobs.get(job_id)
            if job is not None and any(b in leased for b, _ in job[1]):
                self.fenced_flushes += 1

    # ------------------------------------------------------ byte model

    def _tags(self, req_id: str, upto: int = 0) -> np.ndarray:
        """Row tags of ``req_id`` through position ``upto`` at least: under
        async scheduling a forward runs a token the scheduler does not know
        yet, which the worker sampled (``final_tokens``)."""
        request = self.scheduler.requests.get(req_id) or self.sim.requests_seen[req_id]
        return self._row_tags.setdefault(req_id, RowTags()).extend_to(
            final_tokens(request, upto)
        )

    def _rows(self, gid: int, block: int, layer: int) -> np.ndarray:
        off, row = self._footprints[gid][layer]
        base = block * self.layout.bytes_per_block + off
        return self.bytes[base : base + B * row].reshape(B, row)

    def _write_indexer(self, block: int, r0: int, tags: np.ndarray) -> None:
        for layer in range(len(self._footprints[self.idx_gid])):
            salted = (tags ^ (layer + 1)).view(np.uint8).reshape(-1, TAG_BYTES)
            self._rows(self.idx_gid, block, layer)[r0 : r0 + len(tags), :TAG_BYTES] = (
                salted
            )

    def _indexer_page_ok(self, block: int, tags: np.ndarray) -> bool:
        for layer in range(len(self._footprints[self.idx_gid])):
            rows = self._rows(self.idx_gid, block, layer)[: len(tags), :TAG_BYTES]
            if not np.array_equal(
                rows.copy().view(np.int64).ravel(), tags ^ (layer + 1)
            ):
                return False
        return True

    def _junk(self, gid: int, block: int, r0: int, r1: int, value: int) -> None:
        for layer in range(len(self._footprints[gid])):
            self._rows(gid, block, layer)[r0:r1] = value & 0xFF

    def _forward(self, so: SchedulerOutput) -> None:
        """Every group writes its footprint; then the indexer is read."""
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in so.num_scheduled_tokens.items():
            table, c, tags = (
                self.sim.tables[req_id],
                computed[req_id],
                self._tags(req_id, computed[req_id] + n),
            )
            for page in range(c // B, (c + n - 1) // B + 1):
                lo, hi = max(c, page * B), min(c + n, (page + 1) * B)
                self._write_indexer(
                    table[self.idx_gid][page], lo - page * B, tags[lo:hi]
                )
                for gid in self.res_gids:
                    self._junk(
                        gid,
                        table[gid][page],
                        lo - page * B,
                        hi - page * B,
                        RESIDENT_JUNK,
                    )
            for gid in self.hot_gids:  # a gather may fill any hot slot
                for block in table[gid]:
                    self._junk(gid, block, 0, B, HOT_JUNK)
        for req_id, n in so.num_scheduled_tokens.items():
            self._read_indexer(req_id, computed[req_id] + n)

    def _read_indexer(self, req_id: str, context: int) -> None:
        table, tags = self.sim.tables[req_id][self.idx_gid], self._tags(req_id, context)
        for page in range((context - 1) // B + 1):
            lo, hi = page * B, min(context, (page + 1) * B)
            if not self._indexer_page_ok(table[page], tags[lo:hi]):
                raise ProtocolError(
                    f"step {self.sim.step_no}: {req_id} indexer page {page} (block "
                    f"{table[page]}) does not hold the KV of its tokens"
                )
            self.indexer_reads_checked += 1

    def _verify_copy(self, copy_: object) -> None:
        """Before a store's copy: its sources hold the request's indexer
        pages. After a load's copy: its targets do."""
        req_id, pages = self._jobs[copy_.job_id]
        tags = self._tags(req_id, (max((p for _, p in pages), default=-1) + 1) * B)
        for block, page in pages:
            if not self._indexer_page_ok(block, tags[page * B : (page + 1) * B]):
                what = "stores" if copy_.to_cpu else "loaded"
                raise ProtocolError(
                    f"step {self.sim.step_no}: job {copy_.job_id} {what} block "
                    f"{block} as {req_id} page {page}, but it does not hold that "
                    "page's indexer KV"
                )
        if copy_.to_cpu:
            self.stores_verified += 1
        else:
            self.loads_verified += 1
