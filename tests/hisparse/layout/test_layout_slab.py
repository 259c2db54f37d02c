# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""U-2 and U-4: the device slab (spec 3.2).

bytes_per_block, per-layer offsets, flat vs strided addressing and Sa, the
INV-14 row-id cap; and, with CPU tensors standing in for the slab, INV-13
(resident view == hot view for every sparse layer) and INV-10 (every layer
of a group at its own offset: a per-layer byte pattern written through each
view reads back intact through every view).
"""

import pytest
import torch
from hs_layout_builders import DSV32, GLM, IDX_LAYER_PAGE, P_FP8, params, specs

from vllm.v1.hisparse.host_pool_plan import plan_host_pool
from vllm.v1.hisparse.kv_cache_config import build_hisparse_kv_cache_config
from vllm.v1.hisparse.layout import build_hisparse_layout
from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

NUM_BLOCKS = 5


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def build(model_kwargs, num_blocks=NUM_BLOCKS, **param_overrides):
    layout = build_hisparse_layout(specs(**model_kwargs), params(**param_overrides))
    host = plan_host_pool(layout, params(host_pool_bytes=1 << 30))
    return layout, build_hisparse_kv_cache_config(layout, num_blocks, host)


@pytest.mark.parametrize(
    "model, bpb, addressing, sa",
    [
        # 61 * 8,448 indexer page; 12 * P = 503,808 does not divide it.
        (DSV32, 515_328, "strided", 64),
        # 4 * P = 167,936 (oversized 4-layer unit) > 17 * 8,448 = 143,616.
        (GLM, 167_936, "flat", 167_936 // 656),
        # bf16: 6 * 73,728 = 442,368 <= 515,328 < 7 * 73,728.
        ({**DSV32, "kv_cache_dtype": "bf16"}, 515_328, "strided", 64),
    ],
)
def test_bytes_per_block_and_addressing(model, bpb, addressing, sa):
    """U-2: bytes_per_block = max device-group page; flat iff it is a whole
    number of pages (Sa = bpb / W), else strided (Sa = B); never padded."""
    layout, _ = build(model)
    assert layout.bytes_per_block == bpb
    assert layout.addressing == addressing
    assert layout.attention_block_stride == sa


def test_flat_when_indexer_page_is_whole_pages():
    """U-2: with 8 leaders and bf16 rows the indexer page (8 * 8,448 =
    67,584 B) is smaller than one sparse page (73,728 B): every unit is
    oversized, a block is exactly one page, so flat mode with Sa = B."""
    layout, _ = build({"num_layers": 8, "kv_cache_dtype": "bf16"})
    assert layout.bytes_per_block == 73_728 == layout.page_bytes
    assert (layout.addressing, layout.attention_block_stride) == ("flat", 64)


def test_offsets_and_tensors_dsv32():
    """U-2 / INV-10 / INV-13: a pair's i-th layer sits at i * P in resident and
    hot blocks; indexer layer j at j * 8,448; one KVCacheTensor per (offset,
    page) slot, shared by the resident and hot names of the same layers."""
    layout, config = build(DSV32)
    assert layout.sparse_layer_offset(attn(0)) == 0
    assert layout.sparse_layer_offset(attn(13)) == P_FP8
    assert layout.sparse_layer_offset(attn(60)) == 0
    for name in layout.sparse_layers:
        res, hot = f"{name}.hisparse_resident", f"{name}.hisparse_hot"
        assert layout.layer_offsets[res] == layout.layer_offsets[hot]
    assert layout.layer_offsets["model.layers.7.self_attn.indexer.k_cache"] == (
        7 * IDX_LAYER_PAGE
    )

    tensors = config.kv_cache_tensors
    assert len(tensors) == 61 + 12
    assert {t.block_stride for t in tensors} == {515_328}
    assert {t.size for t in tensors} == {NUM_BLOCKS * 515_328}
    first_sparse = next(
        t for t in tensors if "hisparse" in t.shared_by[0] and t.offset == 0
    )
    assert first_sparse.shared_by == (
        [f"{attn(i)}.hisparse_resident" for i in (0, 12, 24, 36, 48, 60)]
        + [f"{attn(i)}.hisparse_hot" for i in (0, 12, 24, 36, 48, 60)]
        + [attn(i) for i in (0, 12, 24, 36, 48, 60)]
    )
    for t in tensors:
        names = set(t.shared_by)
        for name in layout.sparse_layers:
            # The layer, its resident and its hot twin share one tensor: the
            # runner's view of the layer is its resident view (INV-13).
            assert (f"{name}.hisparse_resident" in names) == (
                f"{name}.hisparse_hot" in names
            ) == (name in names)
    # Every sparse layer appears in exactly one device tensor; its host copy
    # is outside kv_cache_tensors (vLLM's allocator never sees host memory).
    for name in layout.sparse_layers:
        assert sum(name in t.shared_by for t in tensors) == 1
    assert all(t.size == NUM_BLOCKS * 515_328 for t in tensors)
    assert [h.layer_name for h in config.host_kv_cache_tensors] == list(
        layout.sparse_layers
    )


def _views(layout, config, raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer views built by vLLM's own packed-layout reshape."""
    packing = {
        name: (t.offset, t.block_stride)
        for t in config.kv_cache_tensors
        for name in t.shared_by
    }
    views = {}
    for gid in layout.device_group_ids:
        group = layout.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        for name in group.layer_names:
            layer_spec = spec.kv_cache_specs[name]
            row = layer_spec.page_size_bytes // layer_spec.block_size
            views[name] = _reshape_attention_kv_cache(
                raw,
                layer_spec,
                (config.num_blocks, layer_spec.block_size, row),
                (0, 1, 2),
                config.num_blocks,
                packing[name],
            )
    return views


@pytest.mark.parametrize("model", [DSV32, GLM])
def test_resident_and_hot_views_alias(model):
    """U-4 / INV-13: for every sparse layer the resident and hot views have
    the same storage, data pointer, shape and strides, at off_l (INV-10)."""
    layout, config = build(model)
    raw = torch.zeros(config.num_blocks * layout.bytes_per_block, dtype=torch.int8)
    views = _views(layout, config, raw)
    base = raw.untyped_storage().data_ptr()
    for name in layout.sparse_layers:
        res = views[f"{name}.hisparse_resident"]
        hot = views[f"{name}.hisparse_hot"]
        assert (
            res.untyped_storage().data_ptr() == hot.untyped_storage().data_ptr() == base
        )
        assert (
            res.data_ptr() == hot.data_ptr() == base + layout.sparse_layer_offset(name)
        )
        assert (
            res.stride()
            == hot.stride()
            == (layout.bytes_per_block, layout.row_bytes, 1)
        )
        assert res.shape == hot.shape == (config.num_blocks, 64, layout.row_bytes)


@pytest.mark.parametrize("model", [DSV32, GLM])
def test_per_layer_patterns_do_not_overlap(model):
    """U-4 / INV-10: lease one block to each device group in turn, write a
    distinct byte pattern through every layer's view of that block, and read
    every view back: each layer sees only its own pattern, and nothing
    outside the group's pages of that block changed."""
    layout, config = build(model)
    raw = torch.zeros(config.num_blocks * layout.bytes_per_block, dtype=torch.int8)
    views = _views(layout, config, raw)
    for gid in layout.device_group_ids:
        raw.zero_()
        block = gid % config.num_blocks
        names = layout.kv_cache_groups[gid].layer_names
        for k, name in enumerate(names):
            views[name][block].view(torch.int8).fill_(k % 120 + 1)
        for k, name in enumerate(names):
            got = views[name][block].view(torch.int8)
            assert bool((got == k % 120 + 1).all()), (gid, name)
        used = layout.group_page_bytes[gid]
        row = raw.view(config.num_blocks, layout.bytes_per_block)
        assert int(row[block, used:].abs().sum()) == 0
        others = torch.cat([row[:block], row[block + 1 :]])
        assert int(others.abs().sum()) == 0


@pytest.mark.parametrize("model", [DSV32, GLM])
def test_attention_rows_address_physical_rows(model):
    """U-2 / spec 3.2: attention row hma(r) = (r div B) * Sa + (r mod B) of the
    attention view is physical row r of the strided view: flat mode reads the
    slab from off_l as contiguous W-byte rows, strided mode is the view."""
    layout, config = build(model)
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(
        -128,
        127,
        (config.num_blocks * layout.bytes_per_block,),
        dtype=torch.int8,
        generator=generator,
    )
    views = _views(layout, config, raw)
    for name in (layout.sparse_layers[0], layout.sparse_layers[-1]):
        strided = views[f"{name}.hisparse_resident"]
        rows = layout.attention_view_rows(name, config.num_blocks)
        if layout.addressing == "flat":
            off = layout.sparse_layer_offset(name)
            flat = raw[off : off + rows * layout.row_bytes].view(rows, layout.row_bytes)

            def attention_row(hma: int, flat=flat) -> torch.Tensor:
                return flat[hma]
        else:
            # Strided: the attention view is the strided view, Sa = B.
            assert rows == config.num_blocks * 64

            def attention_row(hma: int, strided=strided) -> torch.Tensor:
                return strided[hma // 64, hma % 64]

        for r in range(config.num_blocks * 64):
            hma = layout.attention_row(r)
            assert hma < rows
            got, want = attention_row(hma), strided[r // 64, r % 64]
            assert got.data_ptr() == want.data_ptr()
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(
    "model, limit",
    [(DSV32, (2**31 - 1) // 64), (GLM, (2**31 - 1) // 256)],
)
def test_row_id_cap(model, limit):
    """U-2 / INV-14: N_gpu * max(Sa, B) < 2^31: a larger pool (by memory or by
    num_gpu_blocks_override) is capped with a warning; a smaller one is not."""
    layout, _ = build(model)
    assert layout.max_gpu_blocks() == limit
    assert limit * max(layout.attention_block_stride, 64) < 2**31
    assert (limit + 1) * max(layout.attention_block_stride, 64) >= 2**31
    huge = (limit + 10) * layout.bytes_per_block
    assert layout.num_gpu_blocks(huge) == limit
    assert layout.num_gpu_blocks(0, num_gpu_blocks_override=limit + 1) == limit
    assert layout.num_gpu_blocks(100 * layout.bytes_per_block + 7) == 100
    assert layout.num_gpu_blocks(10**12, num_gpu_blocks_override=42) == 42
