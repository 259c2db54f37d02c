# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C1: capacity reporting (spec 3.5, 6.4).

``capacity_report`` backs ``scripts/hisparse-capacity``: per-request GPU
bytes and concurrency, fully resident vs hybrid, and the host pool sizing
advice, from the specs alone (no GPU). ``log_hisparse_layout`` writes the
startup INFO lines of spec 6.4 once the pools are sized.
"""

import math
from collections.abc import Mapping
from typing import Any

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.hisparse.config_checks import GiB
from vllm.v1.hisparse.constants import ACTIVE_TAIL_PAGES
from vllm.v1.hisparse.host_pool_plan import HostPoolPlan, plan_host_pool
from vllm.v1.hisparse.layout import (
    HiSparseLayout,
    HiSparseParams,
    build_hisparse_layout,
)
from vllm.v1.kv_cache_interface import KVCacheSpec

logger = init_logger(__name__)


def capacity_report(
    kv_cache_spec: Mapping[str, KVCacheSpec],
    params: HiSparseParams,
    context_len: int,
    gpu_kv_bytes: int,
) -> dict[str, Any]:
    """Per-request GPU bytes and concurrency, fully resident vs hybrid.

    Fully resident is stock vLLM (HiSparse off): every sparse-MLA and
    indexer layer keeps every page on the GPU, one block of
    sum(layer pages) per page. Hybrid is the HiSparse layout
    (``build_hisparse_layout``): admission and steady-state costs of 3.5 in
    blocks of bytes_per_block, and the steady-state concurrency min(GPU,
    host). The sparse-MLA payload (rows x W x L) is reported separately: it
    is what target P3 compares (hot region + protected tail vs the whole
    history).
    """
    layout = build_hisparse_layout(kv_cache_spec, params)
    host_pool = plan_host_pool(layout, params)
    block_size = layout.block_size
    pages = cdiv(context_len, block_size)
    num_sparse = layout.num_sparse_layers
    page_bytes = layout.page_bytes
    bpb = layout.bytes_per_block
    blocks = layout.request_blocks(context_len)

    sparse_full = pages * num_sparse * page_bytes
    sparse_hot = layout.hot_blocks * num_sparse * page_bytes
    sparse_tail = min(pages, ACTIVE_TAIL_PAGES) * num_sparse * page_bytes
    sparse_hybrid = sparse_hot + sparse_tail

    stock_block_bytes = sum(spec.page_size_bytes for spec in kv_cache_spec.values())
    stock_blocks = gpu_kv_bytes // stock_block_bytes
    num_gpu_blocks = layout.num_gpu_blocks(gpu_kv_bytes, params.num_gpu_blocks_override)
    concurrency = layout.steady_state_concurrency(
        num_gpu_blocks, host_pool.num_blocks, context_len
    )
    min_host_blocks = pages + 2
    match_gpu_blocks = math.ceil(concurrency.gpu * pages)

    def gib(num_bytes: int) -> float:
        return round(num_bytes / GiB, 3)

    def gib_at_least(num_bytes: int) -> float:
        # Rounded up, so that the advice is always enough.
        return math.ceil(num_bytes * 1000 / GiB) / 1000

    return {
        "context_len": context_len,
        "layout": {
            "block_size": block_size,
            "row_bytes": layout.row_bytes,
            "page_bytes": page_bytes,
            "num_sparse_layers": num_sparse,
            "num_indexer_layers": len(layout.indexer_layers),
            "hot_unit_sizes": [len(unit) for unit in layout.hot_units],
            "num_pairs": layout.num_pairs,
            "pair_sizes": [len(pair) for pair in layout.pairs],
            "indexer_page_bytes": layout.indexer_page_bytes,
            "bytes_per_block": bpb,
            "addressing": layout.addressing,
            "attention_block_stride": layout.attention_block_stride,
            "index_topk": layout.index_topk,
            "max_decode_query_len": layout.max_decode_query_len,
            "device_buffer_size": layout.device_buffer_size,
            "hot_blocks_per_group": layout.hot_blocks,
            "cap_res_pages": layout.cap_res_pages(context_len),
        },
        "per_request": {
            "sparse_mla_bytes": {
                "fully_resident": sparse_full,
                "hybrid_hot": sparse_hot,
                "hybrid_tail": sparse_tail,
                "hybrid": sparse_hybrid,
                "fully_resident_over_hybrid": round(sparse_full / sparse_hybrid, 2),
            },
            "gpu_bytes": {
                "fully_resident": pages * stock_block_bytes,
                "hybrid_admission": blocks.admission * bpb,
                "hybrid_steady": blocks.steady * bpb,
                "hisparse_layout_fully_resident": blocks.fully_resident * bpb,
            },
            "gpu_blocks": {
                "indexer": blocks.indexer,
                "resident_admission": blocks.resident,
                "resident_tail": blocks.tail,
                "hot": blocks.hot,
                "other": blocks.other,
                "admission": blocks.admission,
                "steady": blocks.steady,
            },
        },
        "concurrency": {
            "gpu_kv_gib": gib(gpu_kv_bytes),
            "fully_resident": round(stock_blocks / pages, 2),
            "hybrid": round(concurrency.result, 2),
            "hybrid_gpu": round(concurrency.gpu, 2),
            "hybrid_host": round(concurrency.host, 2),
            "num_gpu_blocks": num_gpu_blocks,
        },
        "host": {
            "host_pool_gib": params.host_pool_gib,
            "host_block_stride": host_pool.block_stride,
            "num_host_blocks": host_pool.num_blocks,
            "registration_chunks": len(host_pool.registration_chunks),
            "min_host_pool_gib": gib_at_least(min_host_blocks * host_pool.block_stride),
            "host_pool_gib_to_match_gpu": gib_at_least(
                match_gpu_blocks * host_pool.block_stride
            ),
        },
    }


def log_hisparse_layout(
    layout: HiSparseLayout,
    host_pool: HostPoolPlan,
    num_gpu_blocks: int,
    max_model_len: int,
) -> None:
    """The startup INFO lines of spec 6.4 (layout and steady state)."""
    logger.info(
        "HiSparse: %.1f GiB pinned host pool per DP replica (%d blocks x %d "
        "tokens, stride %d B, %s); shared GPU indexer/resident/hot pool %.1f GiB "
        "(%d blocks, %d resident/hot group pairs, %d B/block, attention "
        "addressing %s).",
        host_pool.pool_bytes / GiB,
        host_pool.num_blocks,
        layout.block_size,
        host_pool.block_stride,
        "shared" if host_pool.shared else "private",
        num_gpu_blocks * layout.bytes_per_block / GiB,
        num_gpu_blocks,
        layout.num_pairs,
        layout.bytes_per_block,
        layout.addressing,
    )
    concurrency = layout.steady_state_concurrency(
        num_gpu_blocks, host_pool.num_blocks, max_model_len
    )
    logger.info(
        "HiSparse steady-state maximum concurrency at max_model_len=%d: %.1f "
        "(GPU %.1f, host %.1f).",
        max_model_len,
        concurrency.result,
        concurrency.gpu,
        concurrency.host,
    )
