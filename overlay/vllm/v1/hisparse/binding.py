# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C9: binding HiSparse into vLLM 0.26.0's GPU model runner (spec 2.9).

The runner needs no new allocation path: the HiSparse KV-cache config lists
every sparse-MLA layer in the same packed ``KVCacheTensor`` as its
``.hisparse_resident`` / ``.hisparse_hot`` twins, so the runner's own
allocator and reshape give the layer the strided resident view
``[N_gpu, B, W]`` at its offset off_l of the one device slab. That view is
the layer's ``kv_cache``: KV writes land in the resident page (with the
resident slot mapping, below), and prefill reads go through the resident
block table.

The patch ``worker-hisparse-runner-hooks`` calls four functions here, each a
no-op unless the KV-cache config is HiSparse's:

- ``specs.is_hisparse_virtual_group``: resident/hot groups have no
  attention module, so the runner builds no attention backend for them;
- ``bind_runtime`` (after the KV tensors are bound, before the connectors
  register them): allocates and registers the host pool once (F19), builds
  every layer's views and asserts INV-10/INV-13, creates the runtime (C7),
  the worker data plane (C6) and the staging cache (C11), attaches them to
  the sparse-MLA attention impls and to the worker-side HiSparseConnector;
- ``retarget_slot_mappings``: each sparse-MLA layer writes with its resident
  group's slot mapping (the source group's slot mapping holds host rows);
- ``apply_residency_updates`` (end of ``_update_states``, before the block
  tables are committed): rewrites resident block-table rows of lost and
  adopted pages, in the runner's request state and its persistent batch.
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.hisparse.kv_cache_config import HiSparseKVCacheConfig
from vllm.v1.hisparse.layout import HiSparseLayout
from vllm.v1.hisparse.memory import MiB, check_worker_reserve, held_tensor_bytes
from vllm.v1.hisparse.metadata import HiSparseStepMetadata
from vllm.v1.hisparse.runtime import (
    HiSparseRuntime,
    LayerViews,
    RuntimeGeometry,
    build_index_groups,
)
from vllm.v1.hisparse.specs import hot_layer_name, resident_layer_name

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = init_logger(__name__)


# ------------------------------------------------------------- runner view


class RunnerBatchState:
    """``BatchState`` over the GPU model runner's persistent batch."""

    def __init__(self, runner: "GPUModelRunner") -> None:
        self._runner = runner

    def _table(self, group_id: int):
        return self._runner.input_batch.block_table[group_id]

    def device(self, group_id: int) -> torch.Tensor:
        return self._table(group_id).block_table.gpu

    def host(self, group_id: int) -> np.ndarray:
        return self._table(group_id).block_table.np

    def slot_mapping(self, group_id: int) -> torch.Tensor:
        return self._table(group_id).slot_mapping.gpu

    def num_reqs(self) -> int:
        return self._runner.input_batch.num_reqs

    def num_tokens(self) -> int:
        return int(self._runner.query_start_loc.np[self.num_reqs()])

    def seq_lens_cpu(self) -> np.ndarray:
        n = self.num_reqs()
        scheduled = np.diff(self._runner.query_start_loc.np[: n + 1])
        return self._runner.input_batch.num_computed_tokens_cpu[:n] + scheduled

    def query_start_loc(self) -> np.ndarray:
        return self._runner.query_start_loc.np[: self.num_reqs() + 1]

    def req_rows(self) -> Mapping[str, int]:
        return self._runner.input_batch.req_id_to_index

    def token_rows(self) -> np.ndarray:
        n = self.num_reqs()
        return np.repeat(
            np.arange(n, dtype=np.int32), np.diff(self._runner.query_start_loc.np[: n + 1])
        )


# --------------------------------------------------------------- the views


def slab_of(view: torch.Tensor) -> torch.Tensor:
    """The whole packed backing of a runner KV view, as uint8 [bytes]."""
    storage = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(storage)


def resident_view(
    slab: torch.Tensor, layout: HiSparseLayout, num_blocks: int, offset: int
) -> torch.Tensor:
    """uint8 [N_gpu, B, W] at byte ``offset`` of every block (spec 3.2)."""
    return torch.as_strided(
        slab,
        (num_blocks, layout.block_size, layout.row_bytes),
        (layout.bytes_per_block, layout.row_bytes, 1),
        offset,
    )


def attention_view(
    slab: torch.Tensor, layout: HiSparseLayout, num_blocks: int, offset: int
) -> torch.Tensor:
    """The view FlashMLA reads by attention row id hma(r) (spec 3.2).

    Flat mode: the slab from off_l as contiguous W-byte rows, in blocks of B
    rows (row hma(r) is physical row r). Strided mode: the resident view.
    """
    if layout.addressing == "strided":
        return resident_view(slab, layout, num_blocks, offset)
    rows = (num_blocks * layout.bytes_per_block - offset) // layout.row_bytes
    usable = rows // layout.block_size * layout.block_size
    flat = slab[offset : offset + usable * layout.row_bytes]
    return flat.view(-1, layout.block_size, layout.row_bytes)


def tensor_offsets(config: "KVCacheConfig") -> dict[str, int]:
    """Layer name -> byte offset in a block, from the config's tensors."""
    return {
        name: tensor.offset
        for tensor in config.kv_cache_tensors
        for name in tensor.shared_by
    }


def check_aliasing(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """INV-13: two views are the same bytes (storage, pointer, strides)."""
    same = (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and a.shape == b.shape
    )
    if not same:
        raise RuntimeError(
            f"HiSparse: {what} do not alias (ptr {a.data_ptr()} vs {b.data_ptr()}, "
            f"strides {a.stride()} vs {b.stride()}): INV-13"
        )


def build_layer_views(
    config: HiSparseKVCacheConfig,
    slab: torch.Tensor,
    host_pool: Any,
    runner_views: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every sparse layer's resident/hot/attention/host views (spec 2.9
    steps 2-5) with the INV-10/INV-13 checks; index groups are attached by
    the caller. ``runner_views`` (the runner's own kv_cache of each layer)
    must alias the resident view."""
    layout = config.layout
    # The views span the staging blocks past the pool too (K13).
    n = config.num_blocks + config.staging_blocks
    if slab.numel() < n * layout.bytes_per_block:
        raise RuntimeError(
            f"HiSparse: the device slab holds {slab.numel()} B, less than "
            f"{n} blocks x {layout.bytes_per_block} B"
        )
    offsets = tensor_offsets(config)
    drafts = set(layout.draft_layers)
    views: dict[str, dict[str, Any]] = {}
    for name in layout.sparse_layers:
        off = layout.sparse_layer_offset(name)
        res_off = offsets[resident_layer_name(name)]
        hot_off = offsets[hot_layer_name(name)]
        if res_off != off or hot_off != off:
            raise RuntimeError(
                f"HiSparse: {name}'s resident ({res_off}) and hot ({hot_off}) "
                f"offsets differ from its layout offset {off} (INV-10)"
            )
        resident = resident_view(slab, layout, n, res_off)
        check_aliasing(
            resident,
            resident_view(slab, layout, n, hot_off),
            f"{name}'s resident and hot views",
        )
        if runner_views is not None and name in runner_views:
            check_aliasing(
                resident,
                runner_views[name].view(torch.uint8),
                f"{name}'s resident view and the runner's KV view",
            )
        views[name] = dict(
            name=name,
            pair=layout.pair_of(name),
            offset=off,
            resident=resident,
            attention=attention_view(slab, layout, n, off),
            host=host_pool.layer_rows(name, layout.row_bytes),
            host_ptr=host_pool.layer_ptr(name),
            is_draft=name in drafts,
        )
    return views


def make_runtime(
    config: HiSparseKVCacheConfig,
    slab: torch.Tensor,
    host_pool: Any,
    tables: Any,
    ops: Any,
    *,
    max_num_seqs: int,
    max_num_tokens: int,
    runner_views: Mapping[str, torch.Tensor] | None = None,
    order_misses: bool | str | None = None,
) -> HiSparseRuntime:
    """The runtime (C7) over a slab and a host pool (also used by tests)."""
    layout = config.layout
    geometry = RuntimeGeometry(
        block_size=layout.block_size,
        row_bytes=layout.row_bytes,
        bytes_per_block=layout.bytes_per_block,
        attention_block_stride=layout.attention_block_stride,
        num_gpu_blocks=config.num_blocks,
        num_staging_blocks=config.staging_blocks,
        num_host_blocks=config.host_num_blocks,
        index_topk=layout.index_topk,
        max_decode_query_len=layout.max_decode_query_len,
        device_buffer_size=layout.device_buffer_size,
        max_num_seqs=max_num_seqs,
        max_num_tokens=max_num_tokens,
    )
    raw = build_layer_views(config, slab, host_pool, runner_views)
    pair_of = {name: v["pair"] for name, v in raw.items()}
    groups = build_index_groups(
        layout.sparse_layers, layout.leaders, pair_of, geometry, slab.device
    )
    group_of = {name: g for g in groups for name in g.layers}
    layers = [
        LayerViews(**raw[name], group=group_of[name]) for name in layout.sparse_layers
    ]
    return HiSparseRuntime(
        geometry=geometry,
        layers=layers,
        groups=groups,
        resident_group_ids=tuple(layout.resident_group_ids),
        hot_group_ids=tuple(layout.hot_group_ids),
        source_group_id=layout.SOURCE_GROUP_ID,
        tables=tables,
        ops=ops,
        device=slab.device,
        order_misses=order_misses,
    )


# ------------------------------------------------------------ runner hooks


def bind_runtime(
    runner: "GPUModelRunner",
    kv_cache_config: "KVCacheConfig",
    kv_caches: Mapping[str, torch.Tensor],
) -> HiSparseRuntime | None:
    """Create and bind the HiSparse worker state (spec 2.9); None when the
    config is not HiSparse's (HiSparse off, or the profiling KV cache)."""
    if not isinstance(kv_cache_config, HiSparseKVCacheConfig):
        return None
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )
    from vllm.v1.hisparse import kernels
    from vllm.v1.hisparse.config_checks import (
        resolve_host_pool_gib,
        resolve_order_misses,
    )
    from vllm.v1.hisparse.drafter import attach_drafter
    from vllm.v1.hisparse.host_pool import acquire_host_pool
    from vllm.v1.hisparse.index_groups import HiSparseLayerBinding
    from vllm.v1.hisparse.staging import StagingCache
    from vllm.v1.hisparse.worker import HiSparseWorker

    layout = kv_cache_config.layout
    check_attention_impls(runner, layout)
    kernels.require_ops()
    slab = slab_of(kv_caches[layout.sparse_layers[0]])
    # Shared mode (4.12): collective over the TP group, every rank binds here.
    host_pool = acquire_host_pool(
        kv_cache_config.host_pool,
        host_pool_gib=resolve_host_pool_gib(runner.vllm_config),
    )
    scheduler_config = runner.vllm_config.scheduler_config
    hisparse_config = runner.vllm_config.attention_config.hisparse_config
    order_misses = resolve_order_misses(hisparse_config.order_misses, layout.index_topk)
    runtime = make_runtime(
        kv_cache_config,
        slab,
        host_pool,
        RunnerBatchState(runner),
        kernels.StepOps(),  # K46: the C++ ops check what a launch needs
        max_num_seqs=scheduler_config.max_num_seqs,
        max_num_tokens=scheduler_config.max_num_batched_tokens,
        runner_views=kv_caches,
        order_misses=order_misses,
    )
    worker = HiSparseWorker(
        runtime,
        host_pool,
        slab=slab,
        rank=get_tensor_model_parallel_rank(),
        eager_host_mirror=hisparse_config.eager_host_mirror,
    )
    if hisparse_config.prefetch_followers and not runtime.prefetch_followers(
        worker.streams
    ):
        logger.warning(
            "HiSparse: prefetch_followers has no effect on this model: every "
            "sparse-MLA layer computes its own top-k (no index group has a "
            "follower)."
        )
    staging = StagingCache(
        runner.max_model_len, layout.block_size, layout.row_bytes, slab.device
    )
    context = runner.vllm_config.compilation_config.static_forward_context
    for name in layout.sparse_layers:
        context[name].impl.hisparse = HiSparseLayerBinding(
            runtime, worker, staging, name
        )
    if not has_kv_transfer_group():
        raise RuntimeError("HiSparse: no KV connector is installed in this worker")
    hisparse_connector(get_kv_transfer_group()).attach_worker(worker)
    # An MTP drafter writes its KV through its own slot buffers (docs/mtp.md
    # 3.4; counted in the reserve, 3.11).
    drafter = attach_drafter(runner, runtime, scheduler_config.max_num_batched_tokens)
    # What this worker holds beside the slab, against the engine's reserve
    # (docs/layout.md L17); the engine logged the breakdown.
    held = held_tensor_bytes(
        [runtime, worker, staging, drafter], slab.device.type, [slab]
    )
    check_worker_reserve(kv_cache_config.gpu_reserve, held)
    g = runtime.geometry
    logger.info(
        "HiSparse enabled: index_topk=%d, device_buffer_size=%d, "
        "max_decode_query_len=%d, eager_host_mirror=%s, order_misses=%s, "
        "prefetch_followers=%s, %d index group(s), "
        "resolver workspace %d rows, %.1f MiB of worker GPU state.",
        g.index_topk,
        g.device_buffer_size,
        g.max_decode_query_len,
        hisparse_config.eager_host_mirror,
        order_misses,
        runtime.prefetch is not None,
        len(runtime.groups),
        g.workspace_rows,
        held / MiB,
    )
    return runtime


def check_attention_impls(runner: "GPUModelRunner", layout: HiSparseLayout) -> None:
    """Every sparse layer runs FlashMLA sparse (the backend HiSparse drives)."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    context = runner.vllm_config.compilation_config.static_forward_context
    for name in layout.sparse_layers:
        impl = getattr(context.get(name), "impl", None)
        if not isinstance(impl, FlashMLASparseImpl):
            raise RuntimeError(
                f"HiSparse drives the FLASHMLA_SPARSE attention backend; layer {name} "
                f"uses {type(impl).__name__}. Remove --attention-backend or "
                "attention_config.hisparse_config."
            )


def hisparse_connector(connector: Any) -> Any:
    """The HiSparseConnector itself or the MultiConnector child that is one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
        HiSparseConnector,
    )

    if isinstance(connector, HiSparseConnector):
        return connector
    for child in getattr(connector, "_connectors", ()):
        if isinstance(child, HiSparseConnector):
            return child
    raise RuntimeError(
        f"HiSparse: the worker's KV connector {type(connector).__name__} has no "
        "HiSparseConnector (the composition of spec 6.2 did not run)"
    )


def retarget_slot_mappings(
    runner: "GPUModelRunner", slot_mappings: dict[str, torch.Tensor]
) -> None:
    """Sparse-MLA layers write KV with their resident group's slot mapping."""
    runtime = runner.hisparse_runtime
    if runtime is None:
        return
    for name in runtime.layers:
        slot_mappings[name] = slot_mappings[resident_layer_name(name)]


def step_metadata(connector_metadata: Any) -> HiSparseStepMetadata | None:
    """HiSparse's part of a step's connector metadata."""
    if isinstance(connector_metadata, HiSparseStepMetadata):
        return connector_metadata
    for child in getattr(connector_metadata, "metadata", ()):
        if isinstance(child, HiSparseStepMetadata):
            return child
    return None


def apply_residency_updates(runner: "GPUModelRunner", scheduler_output: Any) -> None:
    """Rewrite resident block-table rows from the scheduler's updates
    (spec 4.1 W0), after vLLM appended this step's new block ids and before
    ``_prepare_inputs`` commits the tables. Visits updated requests only."""
    runtime = runner.hisparse_runtime
    if runtime is None:
        return
    meta = step_metadata(scheduler_output.kv_connector_metadata)
    if meta is None or not meta.update_req_ids:
        return
    runtime.note_residency_updates()
    batch = runner.input_batch
    for i in range(len(meta.update_req_ids)):
        req_id, start, block_ids = meta.residency_update(i)
        state = runner.requests.get(req_id)
        row = batch.req_id_to_index.get(req_id)
        end = start + block_ids.shape[0]
        for column, gid in enumerate(runtime.resident_group_ids):
            ids = block_ids[:, column]
            if state is not None:
                table = state.block_ids[gid]
                if len(table) != end:
                    raise RuntimeError(
                        f"HiSparse: residency update of {req_id} covers pages "
                        f"[{start}, {end}) but the worker's table has {len(table)} "
                        f"pages in group {gid}"
                    )
                table[start:end] = ids.tolist()
            if row is not None:
                bt = batch.block_table[gid]
                bt.block_table.np[row, start:end] = ids
                bt.mark_dirty()  # a direct write: the next commit copies


__all__ = [
    "RunnerBatchState",
    "apply_residency_updates",
    "bind_runtime",
    "make_runtime",
    "retarget_slot_mappings",
    "step_metadata",
]
