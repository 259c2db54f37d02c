# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""U-1 / INV-11 with an MTP drafter layer (docs/mtp.md 2, 3.2).

The layout marks the drafter's sparse layers (``layers.<i>``, i >= hf
``num_hidden_layers``) as ``draft_layers`` and packs them like any hot unit:
the MTP layer leads its own unit, which is never split (INV-11), and lands in
a pair of its own or beside target layers as the packing rule gives.
"""

import hs_layout_builders
import pytest
from hs_layout_builders import (
    DSV32,
    GLM,
    IDX_LAYER_PAGE,
    P_FP8,
    B,
    params,
    specs,
    write_sparse_mla_config,
)

from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig
from vllm.config.hisparse import HiSparseConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.hisparse.config_checks import HiSparseConfigError
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout

W = P_FP8 // B


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def mtp_layout(num_layers: int, **share):
    return build_hisparse_layout(
        specs(num_layers, num_mtp=1, **share), params(num_target_layers=num_layers)
    )


def assert_draft_unit_whole(layout, draft: str) -> None:
    """INV-11: the draft layer leads a unit of its own, inside one pair."""
    assert layout.hot_units[-1] == (draft,)
    assert layout.leaders[layout.sparse_layers.index(draft)] is True
    holding = [pair for pair in layout.pairs if draft in pair]
    assert len(holding) == 1 and holding[0][-1] == draft


def test_tiny_three_plus_mtp_is_flat_with_the_mtp_pair_alone():
    """U-1 / INV-11, docs/mtp.md 2 (the E2E gate model): 3 target layers + 1
    MTP, all leaders: 4 indexers (33,792 B) < P, every unit oversized, so 4
    pairs, the MTP layer alone in the last; bytes_per_block = P, flat."""
    layout = mtp_layout(3)
    assert layout.draft_layers == (attn(3),)
    assert layout.pairs == tuple((attn(i),) for i in range(4))
    assert layout.bytes_per_block == P_FP8 == 41_984
    assert layout.addressing == "flat"
    assert layout.attention_block_stride == P_FP8 // W
    assert_draft_unit_whole(layout, attn(3))


def test_tiny_four_plus_mtp_is_strided():
    """U-1, docs/mtp.md 2: 4 + 1 MTP makes five indexer pages (42,240 B),
    larger than one layer page: 5 single-layer pairs, strided, Sa = B."""
    layout = mtp_layout(4)
    assert layout.draft_layers == (attn(4),)
    assert len(layout.pairs) == 5 and layout.pairs[-1] == (attn(4),)
    assert layout.bytes_per_block == 5 * IDX_LAYER_PAGE == 42_240
    assert layout.addressing == "strided"
    assert layout.attention_block_stride == B
    assert_draft_unit_whole(layout, attn(4))


def test_glm53_mtp_shares_the_last_pair_with_target_layers():
    """U-1 / INV-11, docs/mtp.md 2: GLM-5.3 preset (60 layers, IndexShare)
    + MTP: 18 indexers (152,064 B) hold units [58, 59] and [MTP 60] in one
    set (3P = 125,952 B), so the MTP layer shares the last of 16 pairs at
    offset 2P; bytes_per_block stays 4P (flat), the layout of the other 15
    pairs is the one without MTP."""
    layout = mtp_layout(**GLM)
    base = build_hisparse_layout(specs(**GLM), params(num_target_layers=60))
    assert base.draft_layers == ()
    assert layout.draft_layers == (attn(60),)
    assert len(layout.pairs) == 16
    assert layout.pairs[-1] == (attn(58), attn(59), attn(60))
    assert layout.pairs[:-1] == base.pairs[:-1]
    assert layout.hot_units[-2:] == ((attn(58), attn(59)), (attn(60),))
    assert layout.sparse_layer_offset(attn(60)) == 2 * P_FP8
    assert layout.bytes_per_block == 4 * P_FP8 == 167_936
    assert layout.addressing == "flat"
    assert_draft_unit_whole(layout, attn(60))


def test_dsv32_mtp_packs_into_the_last_pair_strided():
    """U-1 / INV-11, docs/mtp.md 2: DeepSeek-V3.2 (61 leaders) + MTP: 62
    indexers (523,776 B) pack 12 layers a set, so 6 pairs, the last [60,
    MTP 61]; bytes_per_block = the indexer page, strided."""
    layout = mtp_layout(DSV32["num_layers"])
    assert layout.draft_layers == (attn(61),)
    assert [len(p) for p in layout.pairs] == [12] * 5 + [2]
    assert layout.pairs[-1] == (attn(60), attn(61))
    assert layout.bytes_per_block == 62 * IDX_LAYER_PAGE == 523_776
    assert layout.addressing == "strided"
    assert_draft_unit_whole(layout, attn(61))


def test_without_num_target_layers_no_layer_is_a_draft():
    """U-1, docs/mtp.md 3.2: params without the target count (every caller
    before MTP) mark nothing; the geometry does not depend on the marking."""
    unmarked = build_hisparse_layout(specs(3, num_mtp=1), params())
    marked = mtp_layout(3)
    assert unmarked.draft_layers == ()
    assert unmarked.pairs == marked.pairs
    assert unmarked.layer_offsets == marked.layer_offsets
    assert unmarked.bytes_per_block == marked.bytes_per_block


def test_a_draft_layer_that_shares_top_k_is_refused():
    """INV-11: a draft layer must lead its own index group (0.26.0's MTP
    layers always build an indexer); a follower past num_hidden_layers
    would put draft and target layers in one unit and is refused."""
    model = specs(4, index_topk_pattern="FFFS")
    with pytest.raises(HiSparseConfigError, match="must lead its own index group"):
        build_hisparse_layout(model, params(num_target_layers=3))


def _vllm_config(model_dir) -> VllmConfig:
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, max_model_len=8192, skip_tokenizer_init=True
        ),
        attention_config=AttentionConfig(
            hisparse_config=HiSparseConfig(host_pool_gib=1.0)
        ),
        cache_config=CacheConfig(cache_dtype="fp8"),
    )
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.scheduler_config.max_num_batched_tokens = 8192
    return vllm_config


def test_engine_layout_marks_the_mtp_layer(tmp_path, monkeypatch):
    """U-1, docs/mtp.md 3.2: HiSparseParams.from_vllm_config takes hf
    num_hidden_layers, so the layout the engine builds through vLLM's
    get_kv_cache_configs (with the drafter's specs present) marks exactly
    the MTP layer; without them it marks none."""
    hs_layout_builders.plenty_of_ram(monkeypatch)
    vllm_config = _vllm_config(write_sparse_mla_config(tmp_path / "m", 3))
    assert HiSparseParams.from_vllm_config(vllm_config).num_target_layers == 3
    memory = [64 * 1024 * 1024 * 1024]
    (with_mtp,) = get_kv_cache_configs(vllm_config, [specs(3, num_mtp=1)], memory)
    assert with_mtp.layout.draft_layers == (attn(3),)
    assert with_mtp.layout.num_sparse_layers == 4
    (without,) = get_kv_cache_configs(vllm_config, [specs(3)], memory)
    assert without.layout.draft_layers == ()
