# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""P/D imports under HiSparse (spec 4.13, INV-30; docs/pd-imports.md).

A prefill instance (HiSparse off) saves each prompt's KV with the pin's
one-machine connector format: one safetensors file per attention layer,
``<shared_storage_path>/<hash of the prompt's first T tokens>/<layer>.safetensors``
holding ``kv_cache``, the layer's T rows in token order (T =
``align_to_block_size(len(prompt) - 1)``). A decode instance with HiSparse on
imports them through ``HiSparseImportingConnector``, the pin's
``ExampleConnector`` adapted to HiSparse's groups the way the offloader is
(compose.py installs it for a user's ExampleConnector):

- scheduler side: ``get_num_new_matched_tokens`` checks that every layer's
  file holds the T rows (a missing or short file: 0 tokens, the request
  computes its prompt), then asks the residency coordinator for the landing
  (device, host, or not admissible: None, "not known yet", so the scheduler
  retries without preempting anyone, bounded by MAX_IMPORT_WAITS). The
  import loads asynchronously (``load_async``): the scheduler allocates at
  admission and runs no forward for the request until the load reports done,
  which is when the coordinator marks the pages valid and plans the one
  restore of a host landing (``update_connector_output``).
- worker side: ``start_load_kv`` writes each job's rows where HiSparse keeps
  them: indexer layers into the indexer group's blocks, sparse-MLA layers
  into the host pool at the source group's host rows (a CPU copy), and, for
  a device landing, into the resident group's blocks too. The restore of a
  host landing's last page is the HiSparse worker's ``start_step``.

The pin's ``ExampleConnector`` cannot produce or consume these files for a
sparse-MLA model (docs/pd-imports.md "What the pin's connector does"): it
keys row extraction on ``MLACommonMetadata``, which the sparse-MLA backends'
metadata is not, and the indexer cache never reaches ``save_kv_layer``.
``SparseMLAExampleConnector`` (``kv_connector_module_path`` = this module)
is that connector with both fixed, for the prefill instance and for a
HiSparse-off decode instance (the reference arm).
"""

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import safetensors
import safetensors.torch
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)
from vllm.logger import init_logger
from vllm.v1.hisparse.constants import INDEXER_CACHE_SUFFIX, MLA_ATTN_SUFFIX
from vllm.v1.hisparse.kv_cache_config import HiSparseKVCacheConfig
from vllm.v1.hisparse.kv_cache_coordinator import ResidencyClient
from vllm.v1.hisparse.pd_imports import ImportLanding

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

KV_KEY = "kv_cache"  # the tensor name in every file (the pin's format)

NOT_A_HISPARSE_LAYOUT = (
    "HiSparseImportingConnector imports P/D KV into a HiSparse layout and "
    "needs --attention-config '{\"hisparse_config\": {...}}'; without HiSparse "
    "use ExampleConnector (SparseMLAExampleConnector for a sparse-MLA model)."
)


# ------------------------------------------------------------ file format


def file_tokens(prompt_len: int, block_size: int) -> int:
    """T: the rows a consumer imports for a prompt of ``prompt_len`` tokens,
    and the length of the token prefix its folder is keyed by (the pin's
    ``get_num_new_matched_tokens``: ``align_to_block_size(len - 1)``)."""
    return max(align_to_block_size(prompt_len - 1, block_size), 0)


def layer_file(folder: str, layer_name: str) -> str:
    return os.path.join(folder, f"{layer_name}.safetensors")


def file_rows(path: str) -> int:
    """Rows of the file's ``kv_cache`` from its header alone (no data read);
    0 when the file is missing or unreadable."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            return int(f.get_slice(KV_KEY).get_shape()[0])
    except (OSError, KeyError, safetensors.SafetensorError):
        return 0


def read_rows(path: str, num_rows: int) -> torch.Tensor | None:
    """uint8 [num_rows, W]: the file's first ``num_rows`` rows as bytes; None
    when the file is missing, unreadable or short (4.13 step 5)."""
    try:
        kv = safetensors.torch.load_file(path, device="cpu")[KV_KEY]
    except (OSError, KeyError, safetensors.SafetensorError):
        return None
    kv = kv.reshape(kv.shape[0], -1)
    if kv.shape[0] < num_rows:
        return None
    return kv[:num_rows].contiguous().view(torch.uint8)


def slots_of(block_ids: Iterable[int], block_size: int, first: int, num: int):
    """(block index, offset) tensors of token positions [first, first + num)
    of a table whose entries from page ``first // block_size`` on are
    ``block_ids``."""
    pos = torch.arange(num) + first % block_size
    blocks = torch.tensor(list(block_ids), dtype=torch.long)
    return blocks[pos // block_size], pos % block_size


# ------------------------------------------------------- scheduler -> worker


@dataclasses.dataclass
class ImportJob:
    """Load tokens [first_token, end_token) of one request (block ids of
    pages [first_token // B, end_token // B) per group)."""

    req_id: str
    folder: str
    first_token: int
    end_token: int
    landing: str
    host_block_ids: list[int]
    indexer_block_ids: list[int]
    resident_block_ids: list[list[int]]
    """One list per resident group (device landing); empty otherwise."""


@dataclasses.dataclass
class HiSparseImportMetadata(KVConnectorMetadata):
    jobs: list[ImportJob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ImportWorkerReport(KVConnectorWorkerMetadata):
    """Imports whose load failed on some rank (a union over ranks)."""

    failed: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "ImportWorkerReport":
        assert isinstance(other, ImportWorkerReport)
        return ImportWorkerReport(self.failed | other.failed)


# ---------------------------------------------------------------- worker


@dataclasses.dataclass
class MLATarget:
    """Where a sparse-MLA layer's rows live under HiSparse."""

    resident_group: int
    """Index of the resident group holding this layer (its ``pair``)."""
    resident: torch.Tensor
    """uint8 [N_gpu, B, W]: the layer's resident view of the slab."""
    host: torch.Tensor
    """uint8 [N_host * B, W]: the layer's host rows."""


@dataclasses.dataclass
class ImportTarget:
    """A worker's destinations: every sparse-MLA layer and indexer cache."""

    block_size: int
    mla: dict[str, MLATarget]
    indexer: dict[str, torch.Tensor]
    """Indexer layer -> its KV cache [N_gpu, B, W_idx] (any dtype)."""
    writes_host: bool = True
    """False on a reader rank of a shared host pool (INV-28)."""

    @classmethod
    def from_worker(
        cls, worker: Any, kv_caches: Mapping[str, torch.Tensor], indexer_layers
    ) -> "ImportTarget":
        rt = worker.runtime
        mla = {
            name: MLATarget(lv.pair, lv.resident, lv.host)
            for name, lv in rt.layers.items()
            if not lv.is_draft
        }
        indexer = {name: kv_caches[name] for name in indexer_layers}
        return cls(rt.geometry.block_size, mla, indexer, writes_host=worker.writer)


def load_job(
    job: ImportJob, read: Callable[[str, int], torch.Tensor | None], target: ImportTarget
) -> bool:
    """Write one import's rows to HiSparse's places (4.13 "worker").

    Every file is read before anything is written, so a failed import
    leaves no page half-written (step 5). Indexer and resident rows are
    written on the current (compute) stream; host rows by a CPU copy into
    pinned memory that no stream reads before the coordinator marks the
    pages valid (after this step). Returns False on a missing, short or
    mismatched file."""
    b, n = target.block_size, job.end_token
    rows: dict[str, torch.Tensor] = {}
    for name in (*target.mla, *target.indexer):
        data = read(layer_file(job.folder, name), n)
        if data is None:
            logger.warning(
                "HiSparse: P/D import of %s: %s has fewer than %d rows or is "
                "missing; the request recomputes its prompt.", job.req_id, name, n,
            )
            return False
        rows[name] = data[job.first_token:n]
    count = n - job.first_token
    for name, view in target.indexer.items():
        if not _fits(job, name, rows[name], view.view(torch.uint8).shape[-1]):
            return False
    for name, t in target.mla.items():
        if not _fits(job, name, rows[name], t.host.shape[-1]):
            return False
    for name, view in target.indexer.items():
        raw = view.view(torch.uint8)
        blk, off = slots_of(job.indexer_block_ids, b, job.first_token, count)
        raw[blk.to(raw.device), off.to(raw.device)] = rows[name].to(raw.device)
    if target.writes_host:
        blk, off = slots_of(job.host_block_ids, b, job.first_token, count)
        host_rows = blk * b + off
        for name, t in target.mla.items():
            t.host[host_rows] = rows[name]
    if job.landing == ImportLanding.DEVICE.value:
        for name, t in target.mla.items():
            ids = job.resident_block_ids[t.resident_group]
            blk, off = slots_of(ids, b, job.first_token, count)
            dev = t.resident.device
            t.resident[blk.to(dev), off.to(dev)] = rows[name].to(dev)
    return True


def _fits(job: ImportJob, name: str, rows: torch.Tensor, width: int) -> bool:
    if rows.shape[-1] == width:
        return True
    logger.warning(
        "HiSparse: P/D import of %s: %s rows are %d bytes, this instance's are "
        "%d (another model or KV-cache dtype); the request recomputes.",
        job.req_id, name, rows.shape[-1], width,
    )
    return False


# ------------------------------------------------------------- connector


class HiSparseImportingConnector(ResidencyClient, ExampleConnector, SupportsHMA):
    """The pin's ExampleConnector on the consumer side of P/D, over a
    HiSparse layout (see the module docstring). It exports nothing: the
    prefill instance runs HiSparse off (a kv_both role imports only)."""

    NOT_A_HISPARSE_LAYOUT = NOT_A_HISPARSE_LAYOUT

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ):
        if not isinstance(kv_cache_config, HiSparseKVCacheConfig):
            raise ValueError(NOT_A_HISPARSE_LAYOUT)
        super().__init__(vllm_config, role, kv_cache_config)
        layout = kv_cache_config.layout
        self._layout = layout
        self._draft_layers = frozenset(layout.draft_layers)
        self._layer_names = tuple(
            name for name in (*layout.sparse_layers, *layout.indexer_layers)
            if name not in self._draft_layers
        )
        # Scheduler side: T per request (files checked), jobs of this step,
        # requests loading (admitted, not reported done).
        self._importable: dict[str, int] = {}
        self._jobs: list[ImportJob] = []
        self._loading: dict[str, "Request"] = {}
        # Worker side.
        self._kv_caches: Mapping[str, torch.Tensor] = {}
        self._target: ImportTarget | None = None
        self._done: set[str] = set()
        self._failed: set[str] = set()

    # ----------------------------------------------------------- binding

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        hisparse = self.bind_residency(gpu_block_pool)
        # Every GPU group but the resident and hot ones takes a block per
        # page (the indexer, any other group): the landing's footprint.
        hisparse.imports.gpu_blocks_per_page = 1 + len(
            self._layout.other_group_ids
        )

    # ----------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to import beyond the local (host prefix) hit, loaded
        asynchronously; None while the import is not admissible (INV-30)."""
        end = self._importable_tokens(request)
        imports = self.hisparse.imports
        if end <= num_computed_tokens:
            imports.forget_import(request.request_id)
            return 0, False
        landing = imports.import_landing(request, num_computed_tokens, end)
        if landing is None:
            return None, False
        if landing is ImportLanding.RECOMPUTE:
            return 0, False
        return end - num_computed_tokens, True

    def _importable_tokens(self, request: "Request") -> int:
        """T when the folder and every layer's file hold T rows, else 0 (a
        missing or short file: the request computes its prompt). Read from
        the files' headers, once per request while it waits (a file that
        is not there yet is looked for again on the next attempt)."""
        req_id = request.request_id
        known = self._importable.get(req_id)
        if known is not None:
            return known
        prompt = list(request.prompt_token_ids or [])
        t = file_tokens(len(prompt), self._block_size)
        if t <= 0:
            return 0
        folder = self._folder(prompt[:t], request)
        if not os.path.isdir(folder) or any(
            file_rows(layer_file(folder, name)) < t for name in self._layer_names
        ):
            return 0
        self._importable[req_id] = t
        return t

    def _folder(self, token_ids: list[int], request: "Request") -> str:
        mm_hashes = [f.identifier for f in request.mm_features]
        return self._generate_foldername_debug(
            torch.tensor(token_ids), mm_hashes, create_folder=False
        )

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        plan = self.hisparse.imports.begin_import(request)
        req_id = request.request_id
        end = self._importable.pop(req_id)
        first, last = plan.first_page, plan.end_page
        resident: list[list[int]] = []
        if plan.landing is ImportLanding.DEVICE:
            resident = [
                [b.block_id for b in m.req_to_blocks[req_id][first:last]]
                for m in self.hisparse.residents
            ]
        indexer = blocks.blocks[self._layout.INDEXER_GROUP_ID]
        host = self.hisparse.source.req_to_blocks[req_id]
        prompt = list(request.prompt_token_ids or [])
        self._jobs.append(ImportJob(
            req_id=req_id,
            folder=self._folder(prompt[:end], request),
            first_token=first * self._block_size,
            end_token=end,
            landing=plan.landing.value,
            host_block_ids=[b.block_id for b in host[first:last]],
            indexer_block_ids=[b.block_id for b in indexer[first:last]],
            resident_block_ids=resident,
        ))
        self._loading[req_id] = request

    def build_connector_meta(
        self, scheduler_output: "SchedulerOutput"
    ) -> KVConnectorMetadata:
        jobs, self._jobs = self._jobs, []
        return HiSparseImportMetadata(jobs=jobs)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Import completions (4.1 step 4, 4.13 steps 3 and 5), applied
        before the scheduler acts on ``finished_recving``. A failed load is
        rewound here: the pin's invalid-block path reads a single KV-cache
        group and cannot serve HiSparse's layout."""
        report = connector_output.kv_connector_worker_meta
        failed = report.failed if isinstance(report, ImportWorkerReport) else ()
        for req_id in connector_output.finished_recving or ():
            request = self._loading.pop(req_id, None)
            if request is None or request.is_finished():
                continue  # not ours, or aborted while loading (freed next)
            if req_id in failed:
                request.num_computed_tokens = self.hisparse.imports.fail_import(req_id)
                if request.num_computed_tokens == 0:
                    # The retry must not look the prefix cache up again: the
                    # request already holds every block of its prompt.
                    request.skip_reading_prefix_cache = True
            else:
                self.hisparse.imports.complete_import(req_id)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """A request finished while its load is in flight keeps its blocks
        until the worker reports the load done (its rows are being written)."""
        req_id = request.request_id
        self._importable.pop(req_id, None)
        return req_id in self._loading, None

    # ------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def _import_target(self) -> ImportTarget:
        if self._target is None:
            from vllm.v1.hisparse.worker import current_worker

            worker = current_worker()
            if worker is None:
                raise RuntimeError(
                    "HiSparseImportingConnector: no HiSparse worker is bound in "
                    "this process (is HiSparseConnector composed first?)"
                )
            self._target = ImportTarget.from_worker(
                worker, self._kv_caches, self._layout.indexer_layers
            )
        return self._target

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Load this step's imports, whether or not the step runs a forward
        (an importing request runs none until its load is reported)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiSparseImportMetadata) or not meta.jobs:
            return
        target = self._import_target()
        _fence_host_writes(target)
        for job in meta.jobs:
            if not load_job(job, read_rows, target):
                self._failed.add(job.req_id)
            self._done.add(job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # every import is loaded before the step's forward

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        return None  # HiSparse exports nothing (the producer runs it off)

    def wait_for_save(self) -> None:
        return None

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        done, self._done = self._done, set()
        return None, done or None

    def build_connector_worker_meta(self) -> ImportWorkerReport | None:
        if not self._failed:
            return None
        failed, self._failed = frozenset(self._failed), set()
        return ImportWorkerReport(failed)


def _fence_host_writes(target: ImportTarget) -> None:
    """Before the CPU writes host rows: every host write already submitted
    (spills, mirrors, of requests whose host blocks were just freed) and
    every read of the step in flight (its gathers of freed blocks) must be
    done. A deliberate host sync, once per step that loads an import, as
    for the host CoW (4.12) and the offloader's loads (F16)."""
    if not target.writes_host or not torch.cuda.is_available():
        return
    from vllm.v1.hisparse.worker import current_worker

    worker = current_worker()
    if worker is not None:
        worker.host_write.synchronize_previous()
    torch.cuda.current_stream().synchronize()


# ----------------------------------------------- producer / reference side


class SparseMLAExampleConnector(ExampleConnector):
    """The pin's ExampleConnector, made to carry a sparse-MLA model's KV (for
    HiSparse off: the prefill instance and the reference consumer).

    The pin extracts and injects MLA rows only under ``MLACommonMetadata``;
    the sparse-MLA backends' metadata is not one, so it moved one byte
    column per token instead of the row. And the indexer cache, written
    inside the attention layer, never passes through ``save_kv_layer``.
    Here every 3-D cache [blocks, B, W] moves whole rows, and saving a
    sparse-MLA layer saves its indexer cache (``<prefix>.indexer.k_cache``)
    too: the indexer writes it before that layer's attention runs.

    A prompt is saved in the step that schedules it, as the pin does, so
    the producer must not split prompts into chunks (the later chunks'
    rows would not exist yet): a chunked prompt is refused.
    """

    def build_connector_meta(
        self, scheduler_output: "SchedulerOutput"
    ) -> KVConnectorMetadata:
        loads = set(self._requests_need_load)
        for new_req in scheduler_output.scheduled_new_reqs:
            prompt = list(new_req.prompt_token_ids or [])
            if new_req.req_id in loads or self._found_match_for_prompt(
                prompt, [f.identifier for f in new_req.mm_features]
            ):
                continue  # loaded, or saved already: nothing is stored
            done = new_req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(
                new_req.req_id, 0
            )
            if done < align_to_block_size(len(prompt), self._block_size):
                raise ValueError(
                    f"SparseMLAExampleConnector saves a prompt in the step that "
                    f"schedules it; request {new_req.req_id} was split into "
                    "chunks. Raise --max-num-batched-tokens above the longest "
                    "prompt on the prefill instance."
                )
        return super().build_connector_meta(scheduler_output)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        stores = [r for r in meta.requests if r.is_store]
        if not stores:
            return
        layers = {layer_name: kv_layer}
        indexer = _indexer_cache_of(layer_name)
        if indexer is not None:
            layers[indexer[0]] = indexer[1]
        for request in stores:
            for name, cache in layers.items():
                rows = _gather_rows(cache, request.slot_mapping, self._block_size)
                filename = self._generate_filename_debug(
                    name, request.token_ids, request.mm_hashes
                )
                safetensors.torch.save_file({KV_KEY: rows.cpu()}, filename)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        loads = [r for r in meta.requests if not r.is_store]
        if not loads:
            return
        for layer_name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            if not isinstance(cache, torch.Tensor) or cache.dim() != 3:
                continue
            for request in loads:
                filename = self._generate_filename_debug(
                    layer_name, request.token_ids, request.mm_hashes
                )
                rows = safetensors.torch.load_file(filename)[KV_KEY]
                _scatter_rows(cache, request.slot_mapping, rows, self._block_size)


def _indexer_cache_of(layer_name: str) -> tuple[str, torch.Tensor] | None:
    """The indexer cache that belongs to sparse-MLA layer ``layer_name``."""
    if not layer_name.endswith(MLA_ATTN_SUFFIX):
        return None
    from vllm.forward_context import get_forward_context

    name = layer_name.removesuffix(MLA_ATTN_SUFFIX) + INDEXER_CACHE_SUFFIX
    layer = get_forward_context().no_compile_layers.get(name)
    cache = getattr(layer, "kv_cache", None)
    return (name, cache) if isinstance(cache, torch.Tensor) else None


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor, b: int) -> torch.Tensor:
    slots = slots.to(cache.device)
    return cache[slots // b, slots % b]


def _scatter_rows(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, b: int
) -> None:
    slots = slots.to(cache.device)
    cache[slots // b, slots % b] = rows.to(cache.device, cache.dtype)


__all__ = [
    "HiSparseImportMetadata",
    "HiSparseImportingConnector",
    "ImportJob",
    "ImportTarget",
    "ImportWorkerReport",
    "MLATarget",
    "SparseMLAExampleConnector",
    "file_tokens",
    "load_job",
]
