# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""U-1: the group split, its order and suffixes, hot units and the packing
rule (spec 3.1); INV-11 (a hot unit is never split across groups)."""

import random

import pytest
from hs_layout_builders import (
    DSV32,
    GLM,
    IDX_LAYER_PAGE,
    P_FP8,
    B,
    model_config,
    params,
    specs,
)

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.hisparse.config_checks import HiSparseConfigError
from vllm.v1.hisparse.layout import build_hisparse_layout, classify_layers, pack_units
from vllm.v1.hisparse.specs import (
    mla_spec_fields as mla_fields,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    HiSparseSourceSpec,
    is_hisparse_hot_group,
    is_hisparse_virtual_group,
    is_index_share_follower,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def idx(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


@pytest.mark.parametrize(
    "unit_bytes, capacity, expected",
    [
        # everything fits in one set
        ([1, 1, 1], 3, [[0, 1, 2]]),
        # a unit that does not fit closes the set; exact fit stays
        ([2, 2, 2, 2, 2], 4, [[0, 1], [2, 3], [4]]),
        # an oversized unit forms a set alone, in the middle and at the start
        ([1, 5, 1, 1], 3, [[0], [1], [2, 3]]),
        ([5, 1, 1], 3, [[0], [1, 2]]),
        # oversized units back to back
        ([4, 4, 1], 3, [[0], [1], [2]]),
        # order is kept: a small unit never jumps ahead into an earlier set
        ([2, 2, 1], 3, [[0], [1, 2]]),
        ([], 3, []),
    ],
)
def test_pack_units_rule(unit_bytes, capacity, expected):
    """U-1 / INV-11: greedy in order, never split, oversized unit alone."""
    assert pack_units(unit_bytes, capacity) == expected


def test_dsv32_split_order_and_suffixes():
    """U-1: DeepSeek-V3.2-like, 61 leaders: source, indexer, 6 resident, 6 hot
    (spec 3.1 example: groups of 12 since 12 * P = 503,808 <= 515,328)."""
    layout = build_hisparse_layout(specs(**DSV32), params())
    groups = layout.kv_cache_groups
    assert len(groups) == 2 + 2 * 6
    assert groups[0].layer_names == [attn(i) for i in range(61)]
    assert groups[1].layer_names == [idx(i) for i in range(61)]
    assert layout.indexer_page_bytes == 61 * IDX_LAYER_PAGE == 515_328
    assert [len(pair) for pair in layout.pairs] == [12, 12, 12, 12, 12, 1]
    assert list(layout.resident_group_ids) == [2, 3, 4, 5, 6, 7]
    assert list(layout.hot_group_ids) == [8, 9, 10, 11, 12, 13]
    for k, pair in enumerate(layout.pairs):
        res, hot = groups[2 + k], groups[8 + k]
        assert res.layer_names == [f"{n}.hisparse_resident" for n in pair]
        assert hot.layer_names == [f"{n}.hisparse_hot" for n in pair]
    assert layout.pairs[0] == tuple(attn(i) for i in range(12))
    assert layout.pairs[5] == (attn(60),)
    # Role types per group.
    for gid, role in [
        (0, HiSparseSourceSpec),
        (1, MLAAttentionSpec),
        (2, HiSparseResidentSpec),
        (8, HiSparseHotSpec),
    ]:
        spec = groups[gid].kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        assert all(type(s) is role for s in spec.kv_cache_specs.values())
    assert all(
        s.is_index_group_leader for s in groups[0].kv_cache_spec.kv_cache_specs.values()
    )


def test_only_hot_groups_go_without_slot_mappings():
    """P2 (the runner hook of worker-hisparse-runner-hooks): hot groups get
    SlotMappingMode.NONE, so no slot-mapping kernel runs for them per step;
    resident groups keep theirs (the sparse-MLA KV writes use it), and so
    do the source group (host rows of the mirror) and the indexer."""
    layout = build_hisparse_layout(specs(**DSV32), params())
    groups = layout.kv_cache_groups
    hot = [gid for gid, g in enumerate(groups) if is_hisparse_hot_group(g)]
    assert hot == list(layout.hot_group_ids)
    virtual = [gid for gid, g in enumerate(groups) if is_hisparse_virtual_group(g)]
    assert virtual == list(layout.resident_group_ids) + list(layout.hot_group_ids)


def test_index_share_unit_is_leader_plus_followers():
    """U-1 / INV-11: IndexShare-like, leader + 3 followers (freq 4, offset 1):
    each 4-layer unit (4P = 167,936 B) exceeds the 2-indexer page (16,896 B),
    so every unit is an oversized set of its own."""
    layout = build_hisparse_layout(
        specs(8, index_topk_freq=4, index_skip_topk_offset=1), params()
    )
    assert layout.leaders == (True, False, False, False, True, False, False, False)
    assert layout.hot_units == (
        tuple(attn(i) for i in range(4)),
        tuple(attn(i) for i in range(4, 8)),
    )
    assert layout.pairs == layout.hot_units
    assert layout.indexer_layers == (idx(0), idx(4))
    assert layout.group_page_bytes[1] == 2 * IDX_LAYER_PAGE
    assert layout.bytes_per_block == 4 * P_FP8


def test_index_share_leaders_and_followers_share_one_attention_group():
    """P2 (docs/worker.md K47): the runner keys attention groups by
    (backend class, per-layer KV-cache spec, query heads), so the source
    group's leader and follower specs must be one key: otherwise the runner
    builds the same FlashMLA-sparse metadata twice per step (bench-tax run
    17's profile: two builds with HiSparse on, one off). Each layer keeps its
    own leader flag, and the layout keeps them in ``leaders``."""
    layout = build_hisparse_layout(
        specs(8, index_topk_freq=4, index_skip_topk_offset=1), params()
    )
    source = layout.kv_cache_groups[0].kv_cache_spec
    assert isinstance(source, UniformTypeKVCacheSpecs)
    per_layer = [source.kv_cache_specs[name] for name in layout.sparse_layers]
    flags = tuple(spec.is_index_group_leader for spec in per_layer)
    assert flags == layout.leaders == (True, False, False, False) * 2
    # gpu_model_runner.initialize_attn_backend keys a dict by (backend
    # class name, per-layer spec, heads); backend and heads are the same for
    # every sparse layer, so the specs alone must collapse to one key.
    assert len(set(per_layer)) == 1
    leader, follower = per_layer[0], per_layer[1]
    assert leader == follower and hash(leader) == hash(follower)
    # The flag is still not a page-format difference that merging hides:
    # any real field still separates two specs.
    other = HiSparseSourceSpec.from_mla_spec(
        MLAAttentionSpec(**{**mla_fields(leader), "block_size": 2 * leader.block_size}),
        True,
    )
    assert other != leader


def test_glm_pattern_units_and_pairs():
    """U-1: 0.26.0's GLM IndexShare pattern (leaders 0,1,2,6,...,58): units
    [0], [1], [2..5], ..., [58, 59]; the two single units share a set, every
    4-layer unit is oversized (167,936 > 17 * 8,448 = 143,616) and alone."""
    layout = build_hisparse_layout(specs(**GLM), params())
    leaders = [i for i, lead in enumerate(layout.leaders) if lead]
    assert leaders == [0, 1, 2] + list(range(6, 60, 4))
    assert [len(u) for u in layout.hot_units] == [1, 1] + [4] * 14 + [2]
    assert [len(p) for p in layout.pairs] == [2] + [4] * 14 + [2]
    assert layout.indexer_page_bytes == 17 * IDX_LAYER_PAGE


@pytest.mark.parametrize(
    "num_layers, share",
    [
        (61, {}),
        (60, {"index_topk_freq": 4, "index_skip_topk_offset": 3}),
        (47, {"index_topk_freq": 3}),
        (33, {"index_topk_freq": 5, "index_skip_topk_offset": 1}),
        (20, {"index_topk_pattern": "FFSSSFSFSSSSSSSSFFSS"}),
    ],
)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "bf16"])
def test_units_never_split_and_page_bound(num_layers, share, kv_cache_dtype):
    """INV-11 / U-1: every pair is a concatenation of whole hot units in
    model order; a pair's page is <= the indexer page unless it is one
    oversized unit; bytes_per_block is the max device-group page."""
    layout = build_hisparse_layout(
        specs(num_layers, kv_cache_dtype=kv_cache_dtype, **share), params()
    )
    page = layout.page_bytes
    units = list(layout.hot_units)
    flat_units = [u for u in units]
    rebuilt = []
    for pair in layout.pairs:
        taken = []
        while len(taken) < len(pair):
            taken.extend(flat_units.pop(0))
        assert tuple(taken) == pair  # whole units only
        rebuilt.extend(pair)
        n_units = sum(1 for u in units if u[0] in pair)
        assert len(pair) * page <= layout.indexer_page_bytes or n_units == 1
    assert rebuilt == list(layout.sparse_layers) and not flat_units
    assert layout.bytes_per_block == max(layout.group_page_bytes[1:])
    # Leaders follow 0.26.0's skip_topk rule.
    cfg = model_config(num_layers, **share)
    assert layout.leaders == tuple(
        not is_index_share_follower(cfg, i) for i in range(num_layers)
    )


def test_mtp_layer_is_a_leader_at_the_end():
    """U-1: the MTP layer (layer_id >= num_hidden_layers) always has its own
    indexer and is the last sparse layer (L counts it)."""
    layout = build_hisparse_layout(
        specs(8, num_mtp=1, index_topk_freq=4, index_skip_topk_offset=1), params()
    )
    assert layout.sparse_layers[-1] == attn(8)
    assert layout.leaders[-1] is True
    assert layout.num_sparse_layers == 9
    assert layout.hot_units[-1] == (attn(8),)


def test_layout_is_independent_of_dict_order():
    """C1 is deterministic: shuffling the spec dict gives the same layout."""
    base = specs(**GLM)
    items = list(base.items())
    random.Random(0).shuffle(items)
    assert build_hisparse_layout(dict(items), params()) == build_hisparse_layout(
        base, params()
    )


def test_tagged_source_specs_give_the_same_layout():
    """Worker-tagged HiSparseSourceSpec inputs (leader flag on the spec) give
    the same layout as untagged 0.26.0 specs paired by name."""
    plain = specs(**GLM)
    layout = build_hisparse_layout(plain, params())
    leader = dict(zip(layout.sparse_layers, layout.leaders))
    tagged = {
        name: HiSparseSourceSpec.from_mla_spec(spec, leader[name])
        if name in leader
        else spec
        for name, spec in plain.items()
    }
    assert build_hisparse_layout(tagged, params()) == layout


def test_other_full_attention_group_comes_last():
    """U-1: any other group of the model follows the hot groups and shares
    the slab (its layers packed from offset 0 of a block)."""
    model = specs(**DSV32)
    extra = FullAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=128, dtype=model[attn(0)].dtype
    )
    model["model.extra.0.attn_x"] = extra
    layout = build_hisparse_layout(model, params())
    assert list(layout.other_group_ids) == [14]
    assert layout.kv_cache_groups[14].layer_names == ["model.extra.0.attn_x"]
    assert layout.layer_offsets["model.extra.0.attn_x"] == 0


def test_stock_grouping_unchanged_for_profiling():
    """The worker's profiling path (_init_minimal_kv_cache_for_profiling)
    calls vLLM's get_kv_cache_groups directly: it still sees one stock group
    of real layers, for untagged and tagged specs alike (no virtual names)."""
    vllm_config = VllmConfig()
    plain = specs(4)
    tagged = {
        n: HiSparseSourceSpec.from_mla_spec(s, True) if n.endswith(".attn") else s
        for n, s in plain.items()
    }
    for model in (plain, tagged):
        groups = get_kv_cache_groups(vllm_config, dict(model))
        assert len(groups) == 1
        assert groups[0].layer_names == list(model)
        assert isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)


def test_not_sparse_mla_refused():
    """R1 / spec 6.3 #3: no indexer layers means no sparse-MLA model."""
    model = {n: s for n, s in specs(4).items() if not n.endswith("k_cache")}
    with pytest.raises(HiSparseConfigError, match="no indexer KV-cache layers"):
        classify_layers(model, "DeepseekV3ForCausalLM")


def test_unpairable_indexer_names_refused():
    """Leaders are found by name; a naming scheme that does not pair raises
    rather than building wrong hot units (INV-11)."""
    model = specs(4)
    renamed = {
        (n.replace(".self_attn.indexer", ".indexer") if n.endswith("k_cache") else n): s
        for n, s in model.items()
    }
    with pytest.raises(HiSparseConfigError, match="cannot pair the 4 indexer layers"):
        classify_layers(renamed)
