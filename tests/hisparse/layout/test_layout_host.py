# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""U-3 (host sizing) and U-6 (registration chunks) of spec 3.3."""

import math

import pytest
from hs_layout_builders import DSV32, GLM, P_FP8, GiB, params, specs

from vllm.v1.hisparse.config_checks import HiSparseConfigError
from vllm.v1.hisparse.host_pool_plan import plan_host_pool, registration_chunks
from vllm.v1.hisparse.layout import build_hisparse_layout


@pytest.mark.parametrize(
    "model, shared, stride, num_blocks",
    [
        # Spec 3.6: 60 layers, 384 GiB -> stride 60 * 41,984 = 2,519,040 B and
        # floor(384 GiB / stride) = 163,680 blocks (163,679 usable besides the
        # null block; the spec's "163,679").
        (GLM, False, 2_519_040, 163_680),
        # 2,519,040 = 615 * 4 KiB: shared rounding changes nothing.
        (GLM, True, 2_519_040, 163_680),
        # 61 * 41,984 = 2,561,024 B; shared rounds up to 626 * 4 KiB.
        (DSV32, False, 2_561_024, 160_996),
        (DSV32, True, 2_564_096, 160_803),
    ],
)
def test_host_sizing(model, shared, stride, num_blocks):
    """U-3: host_block_stride = L * P (4 KiB-rounded when shared), N_host =
    floor(pool / stride), pool bytes = N_host * stride, layer-major arrays."""
    layout = build_hisparse_layout(specs(**model), params())
    host = plan_host_pool(layout, params(shared_host_pool=shared))
    assert host.block_stride == stride
    assert host.num_blocks == num_blocks == 384 * GiB // stride
    assert host.pool_bytes == num_blocks * stride <= 384 * GiB
    assert host.region_bytes == math.ceil(host.pool_bytes / 4096) * 4096
    array = num_blocks * P_FP8
    assert host.layer_array_bytes == array
    assert [host.layer_offsets[n] for n in layout.sparse_layers] == [
        i * array for i in range(layout.num_sparse_layers)
    ]
    # The last layer array ends inside the pool (shared padding trails it).
    assert layout.num_sparse_layers * array <= host.pool_bytes


def test_worked_example_registers_in_two_chunks():
    """U-6 / spec 3.6: the 384 GiB pool registers in 2 chunks."""
    layout = build_hisparse_layout(specs(**GLM), params())
    host = plan_host_pool(layout, params())
    assert len(host.registration_chunks) == 2
    first_end = host.registration_chunks[0][1]
    # The largest multiple of lcm(4096, 41,984) = 167,936 <= 256 GiB.
    assert first_end == (256 * GiB) // 167_936 * 167_936 == 274_877_812_736


def _layer_array_start(boundary: int, array_bytes: int) -> int:
    return boundary // array_bytes * array_bytes


@pytest.mark.parametrize(
    "num_layers, num_blocks, page, limit",
    [
        (60, 163_680, P_FP8, 256 * GiB),  # the worked example
        (61, 400_000, P_FP8, 256 * GiB),  # > 512 GiB: 4 chunks
        (61, 4_000, P_FP8, 64 << 20),  # many small chunks
        (5, 1_000, 64 * 1152, 3 << 20),  # bf16 page, 73,728 B
        (3, 50, 64 * 656, 200_000),  # exactly one lcm step per chunk
    ],
)
def test_registration_chunk_boundaries(num_layers, num_blocks, page, limit):
    """U-6: every interior boundary is a multiple of the 4 KiB OS page and on
    a host-block boundary of the layer array it lies in; every chunk is at
    most the limit; chunks tile the region; each chunk is maximal."""
    array = num_blocks * page
    region = math.ceil(num_layers * array / 4096) * 4096
    chunks = registration_chunks(region, page, limit)
    assert chunks[0][0] == 0 and chunks[-1][1] == region
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    align = math.lcm(4096, page)
    for start, end in chunks:
        assert 0 < end - start <= limit
        if end != region:
            assert end % 4096 == 0
            assert (end - _layer_array_start(end, array)) % page == 0
            # Maximal: the next valid boundary would exceed the limit.
            assert end + align > start + limit
    assert len(chunks) >= math.ceil(region / limit)


def test_registration_chunk_infeasible():
    """U-6: a chunk limit below lcm(OS page, P) has no valid boundary."""
    with pytest.raises(
        HiSparseConfigError,
        match="lcm\\(OS page 4096 B, host block page 41984 B\\) = 167936 B",
    ):
        registration_chunks(10 * 167_936, P_FP8, 100_000)
    # A region that fits in one chunk needs no interior boundary.
    assert registration_chunks(90_000, P_FP8, 100_000) == ((0, 90_000),)


def test_host_row_range_refused():
    """INV-14: N_host * B must stay below 2^31 (int32 host row ids)."""
    layout = build_hisparse_layout(specs(1), params())
    limit = (2**31 - 1) // 64  # 33,554,431 blocks: N_host * B < 2^31
    ok = plan_host_pool(layout, params(host_pool_bytes=limit * P_FP8))
    assert ok.num_blocks == limit and limit * 64 < 2**31
    with pytest.raises(HiSparseConfigError, match="at most 33554431 blocks"):
        plan_host_pool(layout, params(host_pool_bytes=(limit + 1) * P_FP8))
