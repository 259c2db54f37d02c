# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C1: the host pool plan (spec 3.3), computed from the layout.

The geometry of the pinned host pool of one DP replica: N_host, the host
block stride (L * P, OS-page rounded when shared), pool and region bytes,
the per-layer array offsets (layer-major) and the registration chunks. A
plan only: the worker allocates, pins and registers the region it
describes in ``host_pool`` (``HiSparseHostPool``).
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

from vllm.utils.math_utils import round_up
from vllm.v1.hisparse.config_checks import HiSparseConfigError, check_host_row_range
from vllm.v1.hisparse.constants import OS_PAGE_BYTES, REGISTRATION_CHUNK_BYTES
from vllm.v1.hisparse.layout import HiSparseLayout, HiSparseParams


@dataclass(frozen=True)
class HostPoolPlan:
    """Geometry of the pinned host pool of one DP replica (3.3).

    Layer-major: sparse layer l's contiguous [N_host * B, W] array starts at
    ``layer_offsets[l] = index(l) * N_host * P``; host row g of that layer is
    at byte ``layer_offsets[l] + g * W``. Host block 0 is the null block. In
    shared mode the stride is rounded up to the OS page and the rounding
    bytes (``N_host * (stride - L * P)``) trail the last layer array.
    """

    num_blocks: int
    block_stride: int
    pool_bytes: int
    region_bytes: int
    """pool_bytes rounded up to the OS page: what is allocated/registered."""
    page_bytes: int
    shared: bool
    layer_offsets: Mapping[str, int]
    registration_chunks: tuple[tuple[int, int], ...]

    @property
    def layer_array_bytes(self) -> int:
        return self.num_blocks * self.page_bytes


def registration_chunks(
    region_bytes: int,
    page_bytes: int,
    chunk_limit: int = REGISTRATION_CHUNK_BYTES,
    os_page_bytes: int = OS_PAGE_BYTES,
) -> tuple[tuple[int, int], ...]:
    """Split [0, region_bytes) into registration chunks (3.3, U-6).

    Every interior boundary is a multiple of the OS page *and* falls on a
    host-block boundary of the layer array it lies in (or between arrays).
    Layer arrays start at multiples of P and are whole blocks long, so the
    valid boundaries are exactly the multiples of lcm(os_page, P); each chunk
    ends at the largest valid boundary <= start + chunk_limit (O(1) per
    chunk). The last chunk ends at the region end.

    Raises:
        HiSparseConfigError: no valid boundary fits in a chunk.
    """
    align = math.lcm(os_page_bytes, page_bytes)
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < region_bytes:
        if region_bytes - start <= chunk_limit:
            end = region_bytes
        else:
            end = (start + chunk_limit) // align * align
            if end <= start:
                raise HiSparseConfigError(
                    "HiSparse cannot register the host pool in chunks of at most "
                    f"{chunk_limit} B: chunk boundaries must be multiples of "
                    f"lcm(OS page {os_page_bytes} B, host block page {page_bytes} B) "
                    f"= {align} B, which exceeds the chunk limit; use a block size "
                    "whose page divides into the OS page more evenly."
                )
        chunks.append((start, end))
        start = end
    return tuple(chunks)


def plan_host_pool(layout: HiSparseLayout, params: HiSparseParams) -> HostPoolPlan:
    """N_host = floor(host_pool_bytes / host_block_stride) and the geometry.

    Raises:
        HiSparseConfigError: host row ids beyond int32 (INV-14) or infeasible
            registration chunks.
    """
    stride = layout.host_block_stride(params.shared_host_pool)
    num_blocks = params.host_pool_bytes // stride
    check_host_row_range(num_blocks, layout.block_size, stride)
    pool_bytes = num_blocks * stride
    region_bytes = round_up(pool_bytes, OS_PAGE_BYTES)
    array_bytes = num_blocks * layout.page_bytes
    return HostPoolPlan(
        num_blocks=num_blocks,
        block_stride=stride,
        pool_bytes=pool_bytes,
        region_bytes=region_bytes,
        page_bytes=layout.page_bytes,
        shared=params.shared_host_pool,
        layer_offsets={
            name: i * array_bytes for i, name in enumerate(layout.sparse_layers)
        },
        registration_chunks=registration_chunks(
            region_bytes, layout.page_bytes, params.registration_chunk_bytes
        ),
    )
