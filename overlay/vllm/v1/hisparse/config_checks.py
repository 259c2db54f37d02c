# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HiSparse startup checks (spec 6.3, target R1).

Every check fails with a ``HiSparseConfigError`` (a ``ValueError``) before
any HiSparse allocation, with a message that names the setting, its value,
the limit and the fix. Two entry points:

- ``verify_hisparse_config(vllm_config)``: the checks that need only the
  config (model, parallelism, graph mode, hybrid KV-cache manager,
  speculation, device_buffer_size, host pool setting, RAM upper bound). It is
  idempotent; ``get_hisparse_kv_cache_configs`` runs it, and a
  ``VllmConfig.__post_init__`` hook may run it earlier (before model load).
- the per-check functions below, which the layout builder calls with the
  numbers it derives from the model's KV-cache specs (block sizes, row
  format, host pool geometry, row-id ranges).

The checks that need a GPU (compute capability >= 9.0, the resolver's
shared-memory preflight, the ``hisparse_ops`` extension being importable;
spec 6.3 #1, #2, #11) and the KV-layout order check (#9, the worker's view
builder) belong to the worker-side binding and are not implemented here.
"""

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllm.config.hisparse import ORDER_MISSES_MODES, order_misses_error
from vllm.logger import init_logger
from vllm.v1.hisparse.constants import (
    BF16_MLA_ROW_BYTES,
    FP8_DS_MLA_ROW_BYTES,
    HOST_RAM_LIMIT_FRACTION,
    MAX_DEVICE_BUFFER_SIZE,
    MAX_INT32_ROW_ID,
    ROW_ALIGN_BYTES,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

GiB = 1 << 30

SUPPORTED_MODELS = "DeepSeek-V3.2, GLM-5.x"


class HiSparseConfigError(ValueError):
    """A HiSparse configuration that cannot start (spec 6.3)."""


def _gib(num_bytes: int | float) -> float:
    return num_bytes / GiB


# ----------------------------------------------------------------- the model


def unsupported_model_error(architecture: str, reason: str) -> HiSparseConfigError:
    """Spec 6.3 #3: HiSparse on a model without sparse-MLA + indexer caches."""
    return HiSparseConfigError(
        f"HiSparse supports sparse-MLA models with an indexer ({SUPPORTED_MODELS}); "
        f"{architecture} is not supported ({reason}). Remove "
        "attention_config.hisparse_config to serve this model."
    )


def check_model_supported(
    architecture: str, index_topk: int | None, model_type: str | None
) -> None:
    """Spec 6.3 #3: the model has index_topk and is not DeepSeek-V4."""
    if index_topk is None:
        raise unsupported_model_error(
            architecture, "its config has no index_topk: not a sparse-MLA model"
        )
    if "deepseekv4" in architecture.lower() or model_type == "deepseek_v4":
        raise unsupported_model_error(
            architecture, "DeepSeek-V4 compressed caches are a non-goal"
        )


def check_row_format(
    layer_name: str, cache_dtype_str: str | None, dtype_name: str, row_bytes: int
) -> None:
    """Spec 6.3 #4: fp8_ds_mla (656-B rows) or bf16 (1152-B rows), W % 16 == 0."""
    ok = (cache_dtype_str == "fp8_ds_mla" and row_bytes == FP8_DS_MLA_ROW_BYTES) or (
        dtype_name == "bfloat16"
        and cache_dtype_str != "fp8_ds_mla"
        and row_bytes == BF16_MLA_ROW_BYTES
    )
    if not ok or row_bytes % ROW_ALIGN_BYTES != 0:
        raise HiSparseConfigError(
            "HiSparse supports the sparse-MLA KV formats fp8_ds_mla "
            f"({FP8_DS_MLA_ROW_BYTES}-B rows) and bf16 ({BF16_MLA_ROW_BYTES}-B "
            f"rows); layer {layer_name} has kv_cache_dtype={cache_dtype_str} "
            f"(dtype {dtype_name}, {row_bytes}-B rows). Use --kv-cache-dtype fp8 "
            "(stored as fp8_ds_mla by FlashMLA sparse) or auto with a bf16 model."
        )


def check_block_sizes(block_sizes: Mapping[str, int]) -> int:
    """Spec 6.3 #8: one block size across sparse-MLA, indexer and other layers.

    Args:
        block_sizes: layer name -> block size.

    Returns:
        The block size B.
    """
    distinct = sorted(set(block_sizes.values()))
    if len(distinct) != 1:
        examples = ", ".join(
            f"{next(n for n, b in block_sizes.items() if b == size)}={size}"
            for size in distinct
        )
        raise HiSparseConfigError(
            "HiSparse needs one block size across the sparse-MLA, indexer and "
            f"other KV-cache layers (the limit is 1 distinct value); found "
            f"{distinct} (e.g. {examples}). Set one --block-size (64, the "
            "FlashMLA sparse block size)."
        )
    return distinct[0]


# ---------------------------------------------------------------- parallelism


def check_parallelism(
    pipeline_parallel_size: int,
    decode_context_parallel_size: int,
    prefill_context_parallel_size: int,
) -> None:
    """Spec 6.3 #5: PP = DCP = PCP = 1 (non-goals, spec 1.5)."""
    for name, value in (
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("decode_context_parallel_size", decode_context_parallel_size),
        ("prefill_context_parallel_size", prefill_context_parallel_size),
    ):
        if value != 1:
            raise HiSparseConfigError(
                f"HiSparse does not support {name}={value} (the limit is 1); "
                f"set {name}=1 or remove attention_config.hisparse_config."
            )


def check_cudagraph_mode(mode_name: str) -> None:
    """Spec 6.3 #6: the global FULL cudagraph mode is refused."""
    if mode_name == "FULL":
        raise HiSparseConfigError(
            "HiSparse needs per-batch routing; use FULL_AND_PIECEWISE, "
            "FULL_DECODE_ONLY or PIECEWISE instead of FULL "
            "(compilation_config.cudagraph_mode=FULL)."
        )


def check_hybrid_kv_cache_manager(disabled: bool) -> None:
    """Spec 6.3 #7: the layout needs several KV-cache groups (HMA)."""
    if disabled:
        raise HiSparseConfigError(
            "HiSparse needs the hybrid KV-cache manager, but "
            "scheduler_config.disable_hybrid_kv_cache_manager=True (set by "
            "--disable-hybrid-kv-cache-manager, by the platform, or by a KV "
            "connector without HMA support). Enable it or remove "
            "attention_config.hisparse_config."
        )


def check_speculative_method(
    method: str | None,
    *,
    disable_padded_drafter_batch: bool = False,
    parallel_drafting: bool = False,
) -> None:
    """Spec 6.3 #15: no speculation, or MTP with the padded drafter batch
    and without parallel drafting: the drafter's first pass must write the
    target's tokens, which the step's mirror and staging plans were made
    for (docs/mtp.md 3.1)."""
    if method is None:
        return
    if method != "mtp":
        raise HiSparseConfigError(
            f"HiSparse supports speculative decoding with MTP only; "
            f"speculative_config.method={method}. Use method 'mtp' (or no "
            "speculation), or remove attention_config.hisparse_config."
        )
    for name, value in (
        ("disable_padded_drafter_batch", disable_padded_drafter_batch),
        ("parallel_drafting", parallel_drafting),
    ):
        if value:
            raise HiSparseConfigError(
                f"HiSparse runs MTP with the padded drafter batch only; "
                f"speculative_config.{name}=True. Remove it, or remove "
                "attention_config.hisparse_config."
            )


def check_full_isl_reservation(reserve_full_isl: bool) -> None:
    """F15: host admission must reserve the request's full input length.

    Without it, requests admitted against free host blocks can each wait on
    host pages the others hold, and waiting requests are never preempted to
    free them (a deadlock).
    """
    if not reserve_full_isl:
        raise HiSparseConfigError(
            "HiSparse needs scheduler_config.scheduler_reserve_full_isl=True "
            "(got False): admission must reserve each request's full input in "
            "the host pool, or requests can deadlock waiting on each other's "
            "host pages. Remove --no-scheduler-reserve-full-isl."
        )


def check_prefix_caching(enabled: bool | None) -> None:
    """The host pool is the prefix cache of sparse-MLA KV (spec 1.4)."""
    if enabled is False:
        raise HiSparseConfigError(
            "HiSparse needs prefix caching (the host pool is the prefix cache of "
            "the sparse-MLA KV): cache_config.enable_prefix_caching=False. Remove "
            "--no-enable-prefix-caching."
        )


FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla")


def check_attention_path(cache_dtype: str, num_heads_per_rank: int,
                         prefill_padding: int = 64) -> None:
    """The worker path HiSparse drives: FlashMLA sparse's FP8 (fp8_ds_mla)
    cache with separate prefill (BF16 kernel over a gathered workspace,
    which a host-backed context joins through staging) and decode kernels.
    HiSparse keeps that path at every head count (fp8_separate_prefill;
    the pin would send fewer than 32 heads per rank through one mixed FP8
    batch). What remains refused:
    the bf16 cache (its kernels read context by global row id from one KV
    tensor, which host-backed context cannot give them) and head counts the
    kernels cannot pad to (``prefill_padding``: 64 on Hopper, 128 on
    Blackwell)."""
    if cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise HiSparseConfigError(
            f"HiSparse serves the fp8_ds_mla KV cache only for now (the bf16 "
            f"cache's kernels read context by global row id from one KV tensor, "
            f"which a host-backed context cannot join); cache_config.cache_dtype="
            f"{cache_dtype}. Use --kv-cache-dtype fp8, or remove "
            "attention_config.hisparse_config."
        )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    h = num_heads_per_rank
    # The pin's own padding rules: the FP8 decode kernel pads q up to
    # _compute_fp8_decode_padded_heads (64 or 128), the BF16 prefill kernel
    # to a multiple or divisor of its padding (its assert in
    # _bf16_flash_mla_kernel).
    decode_ok = 0 < h <= FlashMLASparseImpl._compute_fp8_decode_padded_heads(h)
    prefill_ok = decode_ok and (h % prefill_padding == 0 or prefill_padding % h == 0)
    if not prefill_ok:
        raise HiSparseConfigError(
            f"HiSparse needs a number of attention heads per rank that FlashMLA "
            f"sparse's FP8 kernels can pad to (a divisor or multiple of "
            f"{prefill_padding}, at most 128); this model has {h} per rank. Choose "
            "another tensor_parallel_size, or remove attention_config.hisparse_config."
        )


def check_micro_batching(enabled: bool) -> None:
    if enabled:
        raise HiSparseConfigError(
            "HiSparse does not support micro-batching (parallel_config.enable_dbo "
            "or ubatch_size > 1); disable it or remove "
            "attention_config.hisparse_config."
        )


FP8_SEPARATE_PREFILL_ENV = "VLLM_HISPARSE_FP8_SEPARATE_PREFILL"
"""Set to 1 at startup, a HiSparse-off engine also keeps the separate FP8
path below 32 heads per rank: the e2e gate's off arms of such models, so
that both arms run the same kernels."""


def fp8_separate_prefill(vllm_config: "VllmConfig") -> bool:
    """Whether FlashMLA sparse keeps its FP8 separate prefill/decode path
    below 32 heads per rank (patch attention-flashmla-sparse-fp8-separate-
    prefill; the pin sends every token of such a batch through the FP8
    decode kernel, which has no prefill workspace for staged context):
    always with HiSparse (check_attention_path, docs/worker.md K31), and
    for a HiSparse-off engine with FP8_SEPARATE_PREFILL_ENV=1."""
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        return True
    return os.environ.get(FP8_SEPARATE_PREFILL_ENV) == "1"


def _prefill_padding() -> int:
    """FlashMLA sparse's BF16 prefill head padding on this platform (the
    pin sets it per impl instance, FlashMLASparseImpl.__init__)."""
    from vllm.platforms import current_platform

    return 128 if current_platform.is_device_capability_family(100) else 64


def apply_hisparse_defaults(vllm_config: "VllmConfig") -> None:
    """Settings HiSparse implies; a no-op when HiSparse is off.

    Sparse-MLA prefill always takes the MQA path: the pin's dense-MHA prefill
    (chosen for prompts no longer than index_topk) gathers context through the
    layer's own block table, which under HiSparse is the source group's (host
    block ids). Prompts longer than index_topk take this path anyway.
    FlashMLA sparse's separate FP8 prefill/decode kernels below 32 heads per
    rank follow from HiSparse being on (fp8_separate_prefill).
    """
    if vllm_config.attention_config.hisparse_config is None:
        return
    vllm_config.attention_config.sparse_mla_force_mqa = True


def check_routed_experts(enabled: bool) -> None:
    """vLLM refuses --enable-return-routed-experts with any KV connector
    (its slot-indexed buffer breaks when KV lives outside the GPU); HiSparse
    always installs one, after that check has run, so refuse it here."""
    if enabled:
        raise HiSparseConfigError(
            "HiSparse keeps KV outside GPU memory through its KV connector, "
            "which --enable-return-routed-experts does not support "
            "(model_config.enable_return_routed_experts=True). Disable one of "
            "the two."
        )


# --------------------------------------------------------- device buffer (H)


def check_device_buffer_size(
    device_buffer_size: int,
    max_decode_query_len: int,
    index_topk: int,
    block_size: int,
    configured: bool,
) -> None:
    """Spec 5.7 / 6.3 #10: q*K <= H <= 32768; warn when H % B != 0."""
    source = (
        "" if configured else " (the default (max_decode_query_len + 1) x index_topk)"
    )
    minimum = max_decode_query_len * index_topk
    if minimum > MAX_DEVICE_BUFFER_SIZE:
        raise HiSparseConfigError(
            "HiSparse needs device_buffer_size >= max_decode_query_len x "
            f"index_topk = {max_decode_query_len} x {index_topk} = {minimum}, "
            f"beyond the int16 slot limit {MAX_DEVICE_BUFFER_SIZE}; lower "
            "num_speculative_tokens to at most "
            f"{MAX_DEVICE_BUFFER_SIZE // index_topk - 1}."
        )
    if device_buffer_size < minimum:
        raise HiSparseConfigError(
            f"hisparse_config.device_buffer_size={device_buffer_size}{source} "
            f"must be >= max_decode_query_len x index_topk = "
            f"{max_decode_query_len} x {index_topk} = {minimum}; raise it to at "
            "least that (every decode row of a step may select index_topk "
            "distinct rows)."
        )
    if device_buffer_size > MAX_DEVICE_BUFFER_SIZE:
        raise HiSparseConfigError(
            f"hisparse_config.device_buffer_size={device_buffer_size}{source} "
            f"exceeds the int16 slot limit {MAX_DEVICE_BUFFER_SIZE}; set "
            f"device_buffer_size between {minimum} and {MAX_DEVICE_BUFFER_SIZE}, "
            "or lower num_speculative_tokens."
        )
    if device_buffer_size % block_size != 0:
        logger.warning_once(
            "HiSparse: device_buffer_size=%d is not a multiple of the block "
            "size %d; the last hot block of every region wastes %d rows.",
            device_buffer_size,
            block_size,
            block_size - device_buffer_size % block_size,
        )


# --------------------------------------------------------------- host pool


def host_pool_unset_error() -> HiSparseConfigError:
    return HiSparseConfigError(
        "hisparse_config.host_pool_gib is not set; HiSparse keeps all "
        "sparse-MLA KV history in a pinned host pool and needs its size (GiB "
        "per DP replica). Set it, e.g. --attention-config "
        '\'{"hisparse_config": {"host_pool_gib": 64}}\'.'
    )


def check_host_pool_holds_one_request(
    num_host_blocks: int,
    max_model_len: int,
    block_size: int,
    host_block_stride: int,
    host_pool_gib: float,
) -> None:
    """Spec 3.3 / 6.3 #12: N_host >= cdiv(max_model_len, B) + 2.

    The two extra blocks are the null block and one copy-on-write tail.
    """
    needed = -(-max_model_len // block_size) + 2
    if num_host_blocks < needed:
        # Round the advice up to the next 0.1 GiB so that it is sufficient.
        min_gib = -(-needed * host_block_stride * 10 // GiB) / 10
        raise HiSparseConfigError(
            f"HiSparse host pool holds {num_host_blocks} blocks but one "
            f"max_model_len={max_model_len} request needs {needed}; raise "
            f"host_pool_gib to at least {min_gib:.1f} "
            f"(hisparse_config.host_pool_gib={host_pool_gib}, "
            f"{host_block_stride} B per host block) or lower max_model_len."
        )


def check_host_row_range(
    num_host_blocks: int, block_size: int, host_block_stride: int
) -> None:
    """INV-14: N_host * B < 2^31, so every host row id g fits in int32."""
    max_blocks = MAX_INT32_ROW_ID // block_size
    if num_host_blocks > max_blocks:
        max_gib = max_blocks * host_block_stride / GiB
        raise HiSparseConfigError(
            f"HiSparse host pool has {num_host_blocks} blocks x {block_size} "
            f"tokens = {num_host_blocks * block_size} host rows; row ids are "
            f"int32, so N_host x B must be < 2^31 (INV-14): at most "
            f"{max_blocks} blocks. Lower hisparse_config.host_pool_gib to at "
            f"most {max_gib:.1f}."
        )


def physical_host_pool_bytes(
    pool_bytes: int, tensor_parallel_size: int, shared: bool
) -> int:
    """Pinned bytes on the node: one pool when shared, one per TP rank otherwise."""
    return pool_bytes if shared else pool_bytes * tensor_parallel_size


def available_host_ram_bytes() -> int:
    """RAM available for new allocations, as psutil reports it now."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_host_ram(
    pool_bytes: int,
    host_pool_gib: float,
    tensor_parallel_size: int,
    shared: bool,
) -> None:
    """Spec 3.3 / 6.3 #13: the pinned pool fits in 95% of available RAM.

    ``pool_bytes`` is the logical pool of one DP replica; in private mode
    every TP rank pins its own copy on the node.
    """
    needed = physical_host_pool_bytes(pool_bytes, tensor_parallel_size, shared)
    available = available_host_ram_bytes()
    if needed > HOST_RAM_LIMIT_FRACTION * available:
        copies = (
            "one pool shared by the TP ranks"
            if shared or tensor_parallel_size == 1
            else f"{tensor_parallel_size} private pools, one per TP rank"
        )
        raise HiSparseConfigError(
            f"HiSparse pinned host pool needs {_gib(needed):.1f} GiB but only "
            f"{_gib(available):.1f} GiB of RAM is available (limit 95%: "
            f"{_gib(HOST_RAM_LIMIT_FRACTION * available):.1f} GiB); lower "
            "host_pool_gib or leave headroom for co-tenants "
            f"(hisparse_config.host_pool_gib={host_pool_gib}, {copies})."
        )


# ------------------------------------------------------------- entry point


def resolve_order_misses(value: bool | str | None, index_topk: int) -> str | None:
    """``hisparse_config.order_misses`` as the runtime's mode: None (off),
    "row" (K6, also true) or "step" (K7). Unset is off (docs/kernels.md
    P9): K6's per-row order reached 0.74x of the sequential ceiling where
    P9 asks 0.8x, K7's whole-step order is not yet measured on the GPU, and
    either adds launches per leader layer inside CUDA graphs that bench-tax
    has not measured. K6 sorts a plan row of at most ORDER_PLAN_MAX_CELLS
    cells; K7 has no top-k limit."""
    from vllm.v1.hisparse.kernels import ORDER_PLAN_MAX_CELLS

    mode = order_mode(value)
    if mode == "row" and index_topk > ORDER_PLAN_MAX_CELLS:
        raise HiSparseConfigError(
            f"hisparse_config.order_misses={value!r} sorts plan rows of at most "
            f"{ORDER_PLAN_MAX_CELLS} entries; this model's index_topk is "
            f'{index_topk}. Use "step", or leave it unset or false.'
        )
    return mode


def order_mode(value: bool | str | None) -> str | None:
    """None/false -> None, true -> "row" (what true meant before "step"
    existed), "row"/"step" as they are; anything else is refused."""
    if value is None or value is False:
        return None
    if value is True:
        return "row"
    if value in ORDER_MISSES_MODES:
        return value
    raise HiSparseConfigError(order_misses_error(value))


def resolve_host_pool_gib(vllm_config: "VllmConfig") -> float:
    """``host_pool_gib`` from hisparse_config, else from an explicitly named
    HiSparseConnector's ``kv_connector_extra_config`` (spec 6.1/6.2)."""
    hisparse_config = vllm_config.attention_config.hisparse_config
    assert hisparse_config is not None
    if hisparse_config.host_pool_gib is not None:
        return hisparse_config.host_pool_gib
    kv_transfer_config = vllm_config.kv_transfer_config
    if (
        kv_transfer_config is not None
        and kv_transfer_config.kv_connector == "HiSparseConnector"
    ):
        value = (kv_transfer_config.kv_connector_extra_config or {}).get(
            "host_pool_gib"
        )
        if value is not None:
            value = float(value)
            if not value > 0:
                raise HiSparseConfigError(
                    f"kv_connector_extra_config.host_pool_gib={value} must be "
                    "> 0 (GiB of pinned host memory per DP replica)."
                )
            return value
    raise host_pool_unset_error()


def model_architecture(vllm_config: "VllmConfig") -> str:
    archs = getattr(vllm_config.model_config, "architectures", None) or []
    return archs[0] if archs else "this model"


def model_index_topk(vllm_config: "VllmConfig") -> int | None:
    return getattr(vllm_config.model_config.hf_text_config, "index_topk", None)


def max_decode_query_len(vllm_config: "VllmConfig") -> int:
    """q = 1 + num_speculative_tokens."""
    return 1 + vllm_config.num_speculative_tokens


def verify_hisparse_config(vllm_config: "VllmConfig") -> None:
    """Run every config-only HiSparse check; a no-op when HiSparse is off.

    Raises:
        HiSparseConfigError: the first failing check, in spec 6.3 order.
    """
    hisparse_config = vllm_config.attention_config.hisparse_config
    model_config = vllm_config.model_config
    if hisparse_config is None or model_config is None:
        return  # off, or no model yet (the layout builder checks again)
    architecture = model_architecture(vllm_config)
    index_topk = model_index_topk(vllm_config)
    check_model_supported(
        architecture,
        index_topk,
        getattr(model_config.hf_text_config, "model_type", None),
    )
    assert index_topk is not None
    parallel_config = vllm_config.parallel_config
    check_parallelism(
        parallel_config.pipeline_parallel_size,
        parallel_config.decode_context_parallel_size,
        parallel_config.prefill_context_parallel_size,
    )
    cudagraph_mode = vllm_config.compilation_config.cudagraph_mode
    check_cudagraph_mode(cudagraph_mode.name if cudagraph_mode is not None else "NONE")
    check_full_isl_reservation(
        bool(vllm_config.scheduler_config.scheduler_reserve_full_isl)
    )
    check_prefix_caching(vllm_config.cache_config.enable_prefix_caching)
    check_micro_batching(bool(parallel_config.use_ubatching))
    check_attention_path(
        str(vllm_config.cache_config.cache_dtype),
        model_config.get_num_attention_heads(parallel_config),
        _prefill_padding(),
    )
    check_hybrid_kv_cache_manager(
        bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
    )
    check_routed_experts(bool(model_config.enable_return_routed_experts))
    speculative_config = vllm_config.speculative_config
    if speculative_config is None:
        check_speculative_method(None)
    else:
        check_speculative_method(
            speculative_config.method,
            disable_padded_drafter_batch=speculative_config.disable_padded_drafter_batch,
            parallel_drafting=speculative_config.parallel_drafting,
        )
    q = max_decode_query_len(vllm_config)
    check_device_buffer_size(
        hisparse_config.default_device_buffer_size(index_topk, q),
        q,
        index_topk,
        vllm_config.cache_config.block_size,
        configured=hisparse_config.device_buffer_size is not None,
    )
    host_pool_gib = resolve_host_pool_gib(vllm_config)
    tp = parallel_config.tensor_parallel_size
    # Upper bound of the pool (N_host * stride <= host_pool_gib); the layout
    # builder repeats the check with the exact pool bytes.
    check_host_ram(
        int(host_pool_gib * GiB), host_pool_gib, tp, shared_host_pool(vllm_config)
    )


def shared_host_pool_ineligibility(
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    prefill_context_parallel_size: int,
    decode_context_parallel_size: int,
    world_size: int,
    executor_backend: str | None,
    nodes_per_replica: int,
    is_cuda: bool,
) -> str | None:
    """Why the TP ranks of a DP replica cannot share one host pool (spec
    4.12 eligibility), or None when they can."""
    if not is_cuda:
        return "the platform is not CUDA"
    if tensor_parallel_size == 1:
        return "tensor_parallel_size=1 (one rank, nothing to share)"
    for name, value in (
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("prefill_context_parallel_size", prefill_context_parallel_size),
        ("decode_context_parallel_size", decode_context_parallel_size),
    ):
        if value != 1:
            return f"{name}={value}"
    if world_size != tensor_parallel_size:
        return (
            f"the world size {world_size} differs from "
            f"tensor_parallel_size={tensor_parallel_size}"
        )
    if executor_backend != "mp":
        return f"distributed_executor_backend={executor_backend!r} is not 'mp'"
    if nodes_per_replica != 1:
        return f"a DP replica spans {nodes_per_replica} nodes"
    return None


def _sharing_facts(vllm_config: "VllmConfig") -> dict:
    from vllm.platforms import current_platform

    pc = vllm_config.parallel_config
    backend = pc.distributed_executor_backend
    return dict(
        tensor_parallel_size=pc.tensor_parallel_size,
        pipeline_parallel_size=pc.pipeline_parallel_size,
        prefill_context_parallel_size=pc.prefill_context_parallel_size,
        decode_context_parallel_size=pc.decode_context_parallel_size,
        world_size=pc.world_size,
        executor_backend=backend
        if isinstance(backend, str) or backend is None
        else getattr(backend, "__name__", str(backend)),
        nodes_per_replica=pc.nnodes_within_dp,
        is_cuda=current_platform.is_cuda(),
    )


def shared_host_pool(vllm_config: "VllmConfig") -> bool:
    """Whether the TP ranks share one host pool (spec 4.12).

    ``shared_host_pool=None`` (automatic) shares whenever the setup is
    eligible; ``True`` refuses an ineligible setup; ``False`` keeps one
    private pool per rank. The answer fixes the host block stride and the
    RAM check (one pool per replica, not per rank), so the engine decides it
    once and the workers read it from ``HostPoolPlan.shared``.

    Raises:
        HiSparseConfigError: ``shared_host_pool=true`` on an ineligible setup.
    """
    hisparse_config = vllm_config.attention_config.hisparse_config
    assert hisparse_config is not None
    setting = hisparse_config.shared_host_pool
    if setting is False:
        return False
    facts = _sharing_facts(vllm_config)
    reason = shared_host_pool_ineligibility(**facts)
    if reason is None:
        return True
    if setting:
        tp = facts["tensor_parallel_size"]
        raise HiSparseConfigError(
            "hisparse_config.shared_host_pool=true needs CUDA, "
            "tensor_parallel_size > 1, PP = PCP = DCP = 1, the 'mp' executor and "
            f"one node per DP replica, but {reason}; set shared_host_pool=false "
            f"(one private pool per TP rank: {tp}x the pinned memory) or omit it."
        )
    if facts["tensor_parallel_size"] > 1:
        logger.info_once(
            "HiSparse: one private host pool per TP rank, not one shared pool: %s.",
            reason,
        )
    return False
