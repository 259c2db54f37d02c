# SPDX-License-Identifier: Apache-2.0
"""Spec 3.2 / docs/worker.md K8 on the H200: does FlashMLA sparse's FP8
decode kernel read a block-strided attention view as the rows it holds?

Binding refuses layouts with strided attention addressing (a block that is
not a whole number of 656-B-row pages: DeepSeek-V3.2's 61 layers, the tiny
model at 8 or 32 layers) until this is shown. Each case builds the real
layout, places valid fp8_ds_mla rows in binding's own ``attention_view`` of
a slab whose other bytes are NaN patterns, and compares the kernel's output
and LSE bitwise with the same rows in a contiguous cache. The flat 4-layer
layout (served today) is the control. The kernel test skips without CUDA or
FlashMLA sparse; the placement it relies on is checked on CPU."""

import pytest
import torch
from worker_harness import tiny_config

from vllm.v1.hisparse.binding import attention_view, resident_view

HEADS = 64  # FlashMLA sparse's FP8 decode pads to 64 on Hopper
BATCH = 4


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from vllm.v1.attention.ops.flashmla import is_flashmla_sparse_supported

    ok, why = is_flashmla_sparse_supported()
    if not ok:
        pytest.skip(f"FlashMLA sparse unavailable: {why}")
    return torch.device("cuda")


def layout_of(layers: int, topk: int):
    """The real layout of the tiny GLM-5-architecture model at this depth."""
    return tiny_config(num_layers=layers, index_topk=topk).layout


def fp8_ds_mla_rows(n: int, gen: torch.Generator, device) -> torch.Tensor:
    """n valid 656-B rows: 512 fp8 e4m3 values, 4 fp32 scales, 64 bf16."""
    nope = (torch.randn(n, 512, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand(n, 4, generator=gen) * 0.1 + 0.01
    rope = torch.randn(n, 64, generator=gen).to(torch.bfloat16)
    row = torch.cat([nope.view(torch.uint8), scales.view(torch.uint8),
                     rope.view(torch.uint8)], dim=1)
    return row.to(device)


def decode(q, cache, indices, rows):
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    meta, _ = get_mla_metadata()
    b = q.shape[0]
    return flash_mla_with_kvcache(
        q=q, k_cache=cache.unsqueeze(-2),
        block_table=torch.zeros((b, 1), dtype=torch.int32, device=q.device),
        head_dim_v=512,
        cache_seqlens=torch.full((b,), rows, dtype=torch.int32, device=q.device),
        tile_scheduler_metadata=meta, is_fp8_kvcache=True, indices=indices,
        softmax_scale=576 ** -0.5)


CASES = [
    (4, 256, "flat"),        # the control: the e2e model, served today
    (8, 256, "strided"),     # the tiny model at 8 layers
    (61, 2048, "strided"),   # DeepSeek-V3.2's 61 layers
]


def num_blocks(topk: int) -> int:
    """Enough 64-row blocks that a top-k of distinct rows exists (twice it)."""
    return max(16, 2 * topk // 64)


def placed(layout, topk: int, device, seed: int):
    """A NaN-filled slab with valid rows in the last sparse layer's
    attention view: (slab, the layer's byte offset, attention view, the
    rows by physical row, hma of each physical row, the generator)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = num_blocks(topk)
    slab = torch.full((blocks * layout.bytes_per_block,), 0xFF, dtype=torch.uint8,
                      device=device)  # 0xFF: NaN in fp8 e4m3, fp32 and bf16 alike
    offset = layout.sparse_layer_offset(layout.sparse_layers[-1])  # the largest offset
    view = attention_view(slab, layout, blocks, offset)
    physical = blocks * layout.block_size
    rows = fp8_ds_mla_rows(physical, gen, device)
    # physical row r (block r // B, slot r % B) is attention row hma(r)
    hma = torch.tensor([layout.attention_row(r) for r in range(physical)], device=device)
    if layout.addressing == "flat":
        view.view(-1, layout.row_bytes)[hma] = rows
    else:  # Sa = B: attention rows are physical rows, blocks bytes_per_block apart
        assert torch.equal(hma, torch.arange(physical, device=device))
        view.copy_(rows.view(blocks, layout.block_size, layout.row_bytes))
    return slab, offset, view, rows, hma, gen


@pytest.mark.parametrize("layers, topk, addressing", CASES)
def test_the_rows_sit_where_the_resident_view_reads_them(layers, topk, addressing):
    """The setup on CPU: what the attention view holds at hma(r) is what
    the resident (physical) view holds at r, in both addressing modes, and
    the strided view's blocks are bytes_per_block apart, not contiguous."""
    layout = layout_of(layers, topk)
    assert layout.addressing == addressing
    slab, offset, view, rows, _, _ = placed(layout, topk, "cpu", layers)
    resident = resident_view(slab, layout, num_blocks(topk), offset)
    assert torch.equal(resident.reshape(-1, layout.row_bytes), rows)
    if addressing == "strided":
        assert view.stride(0) == layout.bytes_per_block != view.shape[1] * view.shape[2]


@pytest.mark.parametrize("layers, topk, addressing", CASES)
def test_the_sparse_decode_kernel_reads_the_attention_view_as_its_rows(
        cuda, layers, topk, addressing):
    layout = layout_of(layers, topk)
    _, _, view, rows, hma, gen = placed(layout, topk, cuda, layers)
    physical = rows.shape[0]
    q = torch.randn(BATCH, 1, HEADS, 576, generator=gen).to(torch.bfloat16).to(cuda)
    picked = torch.stack([torch.randperm(physical, generator=gen)[:topk]
                          for _ in range(BATCH)]).to(cuda)
    got, got_lse = decode(q, view, hma[picked].int().unsqueeze(1),
                          view.shape[0] * view.shape[1])
    contiguous = rows.view(-1, layout.block_size, layout.row_bytes).contiguous()
    want, want_lse = decode(q, contiguous, picked.int().unsqueeze(1), physical)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
