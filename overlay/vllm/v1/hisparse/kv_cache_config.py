# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C1, vLLM-facing: the HiSparse KV-cache config and the kv_cache_utils forks.

``get_hisparse_kv_cache_configs`` mirrors ``kv_cache_utils.get_kv_cache_configs``
for HiSparse: grouping, the ``num_gpu_blocks_override`` adjustment, auto-fit,
HiSparse's GPU reserve (``memory``), the memory check, the config build and
the capacity log, emitting
``HiSparseKVCacheConfig``s whose host tensors stay outside
``kv_cache_tensors`` (vLLM's allocator and shrink loop never see them).
``get_hisparse_kv_cache_capacity`` is the ``get_kv_cache_capacity`` fork.
"""

import copy
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.hisparse.capacity import log_hisparse_layout
from vllm.v1.hisparse.config_checks import (
    GiB,
    HiSparseConfigError,
    check_host_pool_holds_one_request,
    check_host_ram,
    verify_hisparse_config,
)
from vllm.v1.hisparse.host_pool_plan import HostPoolPlan, plan_host_pool
from vllm.v1.hisparse.layout import (
    HiSparseLayout,
    HiSparseParams,
    build_hisparse_layout,
)
from vllm.v1.hisparse.memory import (
    BatchLimits,
    HiSparseGpuReserve,
    check_override_fits,
    hisparse_gpu_reserve,
    log_hisparse_reserve,
    max_pool_blocks,
    require_pool_room,
    reserved_blocks,
)
from vllm.v1.hisparse.specs import resident_layer_name
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

logger = init_logger(__name__)


# --------------------------------------------------------------------------
# KV-cache config
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HiSparseHostTensor:
    """One sparse layer's host array inside the pinned host region."""

    layer_name: str
    offset: int
    """Byte offset of the layer's [N_host * B, W] array in the region."""
    size: int
    """N_host * P bytes."""


@dataclass(kw_only=True)
class HiSparseKVCacheConfig(KVCacheConfig):
    """A ``KVCacheConfig`` that also describes the host pool.

    ``kv_cache_tensors`` holds only the device slab (every tensor aliases
    one backing of ``num_blocks * bytes_per_block`` bytes, with per-layer
    ``offset`` and ``block_stride = bytes_per_block``), so vLLM's allocator,
    its shrink loop and any connector iterating ``kv_cache_tensors`` never
    see host memory. ``num_blocks`` is N_gpu; the source group's block ids
    are host block ids in [0, host_num_blocks).
    """

    host_num_blocks: int
    host_kv_cache_tensors: list[HiSparseHostTensor] = field(default_factory=list)
    layout: HiSparseLayout
    host_pool: HostPoolPlan
    staging_blocks: int = 0
    """Blocks of the slab past ``num_blocks``, never handed out by the pool:
    the worker stages host-backed context there for attention kernels that
    read one KV tensor by row id (docs/worker.md K13)."""
    decode_kernel_tokens: int = 0
    """The longest per-request query FlashMLA sparse runs on its decode
    kernel (its reorder threshold): the scheduler bounds the staged pages
    of a step's chunks in (max_decode_query_len, this] by ``staging_blocks``
    (spec 2.11, F21, docs/residency.md R28)."""
    gpu_reserve: HiSparseGpuReserve | None = None
    """The GPU bytes outside the pool that the sizing set aside (staging
    blocks, worker state, block tables; docs/layout.md L17): the worker
    checks what it allocates against it."""


def build_hisparse_kv_cache_config(
    layout: HiSparseLayout,
    num_gpu_blocks: int,
    host_pool: HostPoolPlan,
    staging_blocks: int = 0,
    decode_kernel_tokens: int = 0,
    gpu_reserve: HiSparseGpuReserve | None = None,
) -> HiSparseKVCacheConfig:
    """The per-worker config: device tensors by (offset, page) slot.

    Layers of different groups at the same offset and page share a
    ``KVCacheTensor`` (the packed convention of 0.26.0); in particular
    ``<l>.hisparse_resident`` and ``<l>.hisparse_hot`` always share one, so
    the worker builds views with the same data pointer and strides for both
    (INV-13). The sparse-MLA layer ``<l>`` itself (a source-group layer)
    shares that tensor too: the runner's own allocator and reshape then give
    the attention module its resident view as ``kv_cache`` (docs/worker.md),
    while the host copy stays outside ``kv_cache_tensors``.
    """
    slots: dict[tuple[int, int], list[str]] = {}
    for gid in layout.device_group_ids:
        group = layout.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        for name in group.layer_names:
            key = (
                layout.layer_offsets[name],
                spec.kv_cache_specs[name].page_size_bytes,
            )
            slots.setdefault(key, []).append(name)
    for name in layout.sparse_layers:
        resident = resident_layer_name(name)
        key = (layout.layer_offsets[resident], layout.page_bytes)
        slots[key].append(name)
    slab_bytes = (num_gpu_blocks + staging_blocks) * layout.bytes_per_block
    kv_cache_tensors = [
        KVCacheTensor(
            size=slab_bytes,
            shared_by=names,
            offset=offset,
            block_stride=layout.bytes_per_block,
        )
        for (offset, _), names in sorted(slots.items())
    ]
    host_tensors = [
        HiSparseHostTensor(
            layer_name=name,
            offset=host_pool.layer_offsets[name],
            size=host_pool.layer_array_bytes,
        )
        for name in layout.sparse_layers
    ]
    return HiSparseKVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=kv_cache_tensors,
        kv_cache_groups=copy.deepcopy(list(layout.kv_cache_groups)),
        host_num_blocks=host_pool.num_blocks,
        host_kv_cache_tensors=host_tensors,
        layout=layout,
        host_pool=host_pool,
        staging_blocks=staging_blocks,
        decode_kernel_tokens=decode_kernel_tokens,
        gpu_reserve=gpu_reserve,
    )


# --------------------------------------------------------------------------
# vLLM integration: get_kv_cache_configs / get_kv_cache_capacity forks
# --------------------------------------------------------------------------


def _merge_worker_specs(
    kv_cache_specs: Sequence[Mapping[str, KVCacheSpec]],
) -> dict[str, KVCacheSpec]:
    """The whole model's specs. HiSparse runs with PP = 1, so every worker
    (TP rank) holds every layer with the same spec."""
    merged = dict(kv_cache_specs[0])
    for worker_spec in kv_cache_specs[1:]:
        if worker_spec != merged:
            raise HiSparseConfigError(
                "HiSparse needs every worker to hold every KV-cache layer with "
                "the same spec (pipeline_parallel_size must be 1)."
            )
    return merged


def get_hisparse_kv_cache_configs(
    vllm_config: "VllmConfig",
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[KVCacheConfig]:
    """HiSparse's ``get_kv_cache_configs`` (kv_cache_utils forks it here).

    The same steps as vLLM's, on the HiSparse layout: grouping (3.1),
    auto-fit, HiSparse's GPU reserve set aside (L17: without an override it
    comes off the available memory, an override must fit beside it),
    the memory check on the 3.5 accounting, one ``HiSparseKVCacheConfig``
    per worker with the common N_gpu, and the capacity and reserve logs.
    Every startup check of 6.3 that does not need a GPU runs before anything
    is sized.
    """
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    verify_hisparse_config(vllm_config)
    merged = _merge_worker_specs(kv_cache_specs)
    KVCacheSpecRegistry.check_kv_cache_spec_registry(merged)
    params = HiSparseParams.from_vllm_config(vllm_config)
    layout = build_hisparse_layout(merged, params)
    host_pool = plan_host_pool(layout, params)

    limits = BatchLimits.from_vllm_config(vllm_config)
    override = params.num_gpu_blocks_override
    model_config = vllm_config.model_config
    if model_config.original_max_model_len == -1:
        _auto_fit_max_model_len(
            model_config, layout, limits, host_pool, min(available_memory), override
        )
    max_model_len = model_config.max_model_len
    pool_memory = _pool_memory(
        layout, limits, max_model_len, available_memory, override
    )

    check_host_pool_holds_one_request(
        host_pool.num_blocks,
        max_model_len,
        layout.block_size,
        host_pool.block_stride,
        params.host_pool_gib,
    )
    check_host_ram(
        host_pool.pool_bytes,
        params.host_pool_gib,
        params.tensor_parallel_size,
        host_pool.shared,
    )
    for avail in pool_memory:
        _check_enough_kv_cache_memory(
            avail,
            lambda: layout.gpu_bytes_per_request(max_model_len),
            max_model_len,
            lambda mem: layout.estimate_max_model_len(
                mem, host_pool.num_blocks, max_model_len
            ),
        )

    num_gpu_blocks = min(
        layout.num_gpu_blocks(avail, override) for avail in pool_memory
    )
    reserve = hisparse_gpu_reserve(layout, limits, max_model_len)
    decode_tokens = decode_kernel_tokens(vllm_config)
    configs: list[KVCacheConfig] = [
        build_hisparse_kv_cache_config(
            layout, num_gpu_blocks, host_pool, reserve.staging_blocks,
            decode_kernel_tokens=decode_tokens, gpu_reserve=reserve,
        )
        for _ in kv_cache_specs
    ]
    concurrency = layout.steady_state_concurrency(
        num_gpu_blocks, host_pool.num_blocks, max_model_len
    )
    logger.info_once(
        "GPU KV cache size: %s tokens", f"{int(concurrency.result * max_model_len):,}"
    )
    logger.info_once(
        "Maximum concurrency for %s tokens per request: %.2fx",
        f"{max_model_len:,}",
        concurrency.result,
    )
    log_hisparse_layout(layout, host_pool, num_gpu_blocks, max_model_len)
    log_hisparse_reserve(reserve)
    return configs


# FlashMLASparseMetadataBuilder.__init__'s reorder thresholds of the pin
# (vllm/v1/attention/backends/mla/flashmla_sparse.py), by attention heads
# per rank; a test checks these literals against the pinned source.
_DECODE_KERNEL_TOKENS_SM100 = {8: 128, 16: 128, 32: 128, 64: 256, 128: 1024}
_DECODE_KERNEL_TOKENS_SM100_DEFAULT = 1024
_DECODE_KERNEL_TOKENS = {16: 128, 32: 128, 64: 256, 128: 256}
_DECODE_KERNEL_TOKENS_DEFAULT = 256


def decode_kernel_tokens(vllm_config: "VllmConfig") -> int:
    """The longest query FlashMLA sparse treats as a decode (its reorder
    threshold): such prefill chunks run on the decode kernel, over in-slab
    staged context when they have host-only pages (K13)."""
    from vllm.platforms import current_platform

    heads = vllm_config.model_config.get_num_attention_heads(
        vllm_config.parallel_config
    )
    if current_platform.is_device_capability_family(100):
        table = _DECODE_KERNEL_TOKENS_SM100
        default = _DECODE_KERNEL_TOKENS_SM100_DEFAULT
    else:
        table, default = _DECODE_KERNEL_TOKENS, _DECODE_KERNEL_TOKENS_DEFAULT
    threshold = table.get(heads, default)
    spec = vllm_config.speculative_config
    if spec is not None and spec.num_speculative_tokens is not None:
        # supports_spec_as_decode: verification queries are decodes too.
        per_token = 2 if spec.parallel_drafting else 1
        threshold = max(threshold, 1 + per_token * spec.num_speculative_tokens)
    return threshold


def _auto_fit_max_model_len(
    model_config: "ModelConfig",
    layout: HiSparseLayout,
    limits: BatchLimits,
    host_pool: HostPoolPlan,
    budget: int,
    override: int | None,
) -> None:
    """``max_model_len=-1``: the largest length whose admission cost fits the
    pool and whose pages fit the host pool (3.5, L11). Without an override
    the reserve (L17) comes off the same memory; with one the pool is the
    override's and the reserve is checked against the budget afterwards."""
    original = model_config.max_model_len
    if override is None:
        pool_bytes = budget
        reserve = functools.partial(reserved_blocks, layout, limits)
    else:
        pool_bytes, reserve = override * layout.bytes_per_block, None
    fitted = layout.estimate_max_model_len(
        pool_bytes, host_pool.num_blocks, original, reserve
    )
    if fitted <= 0:
        raise ValueError(
            "Cannot auto-fit max_model_len: not enough GPU memory available "
            "to serve even a single token with HiSparse, or host pool too "
            "small. Try increasing `gpu_memory_utilization` or host_pool_gib."
        )
    if fitted < original:
        model_config.max_model_len = fitted
        logger.info_once(
            "Auto-fit max_model_len: reduced from %d to %d to fit the HiSparse "
            "GPU pool (%.2f GiB) and host pool (%d blocks)",
            original,
            fitted,
            pool_bytes / GiB,
            host_pool.num_blocks,
        )


def _pool_memory(
    layout: HiSparseLayout,
    limits: BatchLimits,
    max_model_len: int,
    available_memory: Sequence[int],
    override: int | None,
) -> list[int]:
    """Per worker, the bytes of the pool's blocks once HiSparse's reserve
    (L17) is set aside: the largest pool that fits with it, or the override
    after checking that it fits with it."""
    fits = [
        max_pool_blocks(layout, limits, max_model_len, avail)
        for avail in available_memory
    ]
    if override is None:
        for blocks, avail in zip(fits, available_memory):
            require_pool_room(layout, limits, max_model_len, blocks, avail)
        return [blocks * layout.bytes_per_block for blocks in fits]
    logger.info(
        "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d",
        max(min(fits), 0),
        override,
    )
    # What will be allocated: the override, capped for INV-14 like N_gpu.
    requested = min(override, layout.max_gpu_blocks())
    for blocks, avail in zip(fits, available_memory):
        check_override_fits(layout, limits, max_model_len, requested, blocks, avail)
    return [override * layout.bytes_per_block] * len(available_memory)


def get_hisparse_kv_cache_capacity(
    vllm_config: "VllmConfig", kv_cache_config: KVCacheConfig
) -> tuple[int, float]:
    """HiSparse's ``get_kv_cache_capacity``: the steady-state concurrency
    (3.5) instead of the fully-resident one; tokens = concurrency * length."""
    if not isinstance(kv_cache_config, HiSparseKVCacheConfig):
        raise TypeError(
            "HiSparse is on but the KV-cache config is a "
            f"{type(kv_cache_config).__name__}, not a HiSparseKVCacheConfig"
        )
    max_model_len = vllm_config.model_config.max_model_len
    concurrency = kv_cache_config.layout.steady_state_concurrency(
        kv_cache_config.num_blocks, kv_cache_config.host_num_blocks, max_model_len
    )
    return int(concurrency.result * max_model_len), concurrency.result
