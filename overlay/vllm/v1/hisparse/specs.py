# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV-cache spec subclasses that express the HiSparse group roles (spec 3.1).

vLLM 0.26.0 has no role field on a KV-cache group, so a role is the type of
the group's per-layer specs:

- ``HiSparseSourceSpec``: a sparse-MLA layer's host copy (the source group,
  host_resident; counted against the host pool, never against the GPU).
- ``HiSparseResidentSpec``: a virtual ``<layer>.hisparse_resident`` layer, the
  GPU write-back cache of the layer's pages (resident groups).
- ``HiSparseHotSpec``: a virtual ``<layer>.hisparse_hot`` layer, the layer's
  per-request hot region (hot groups).

All three keep every ``MLAAttentionSpec`` field of the layer they stand for,
so ``page_size_bytes`` is the layer page P = B * W. They subclass
``MLAAttentionSpec``, so the spec registry resolves them through the MRO
(manager ``FullAttentionManager``, uniform base ``FullAttentionSpec``) until
the HiSparse managers are registered; ``isinstance`` is the role test in
every process, because the specs are pickled to the engine core and the
workers. Frozen dataclass equality includes the class, so a resident spec
never equals a hot spec of the same layer (the hybrid coordinator merges
only identical specs into one spec group).

``max_memory_usage_bytes`` overrides carry the capacity accounting of spec
3.5: resident history beyond ``cap_res`` is reclaimable and not counted, a
hot region is a fixed ``cdiv(H, B)`` blocks.
"""

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from vllm.utils.math_utils import cdiv
from vllm.v1.hisparse.constants import ACTIVE_TAIL_PAGES, HOT_SUFFIX, RESIDENT_SUFFIX
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec


def mla_spec_fields(spec: MLAAttentionSpec) -> dict[str, Any]:
    """The init fields of ``MLAAttentionSpec`` as set on ``spec``.

    Used to build a role spec that describes exactly the same bytes as the
    model's own layer spec (same dtype, head size, cache dtype, block size).
    """
    return {f.name: getattr(spec, f.name) for f in fields(MLAAttentionSpec) if f.init}


def _merge_identical(cls: type, specs: list[Any]) -> Any:
    """Merge for role specs: every spec must equal the first one.

    ``MLAAttentionSpec.merge`` rebuilds the spec from the base fields only,
    which would silently drop (or fail on) the role fields below.
    """
    assert all(type(spec) is cls for spec in specs), (
        f"All layers merged into one {cls.__name__} must have that type."
    )
    assert all(spec == specs[0] for spec in specs[1:]), (
        f"All layers merged into one {cls.__name__} must be identical."
    )
    return copy.deepcopy(specs[0])


@dataclass(frozen=True, kw_only=True)
class HiSparseSourceSpec(MLAAttentionSpec):
    """A sparse-MLA layer as seen by the source group (host pool).

    ``is_index_group_leader`` is True for a layer that runs its own indexer
    (in 0.26.0: ``MLAAttention.indexer is not None``, i.e. not ``skip_topk``)
    and False for an IndexShare follower that reuses the previous leader's
    top-k. The source group is a ``UniformTypeKVCacheSpecs`` that keeps each
    layer's flag; vLLM's scheduler-side collapse of such a group keeps its
    first layer's spec, whose flag is then meaningless.

    The flag is left out of equality and hash (``compare=False``): it says
    where the layer's top-k comes from, not what its pages hold, and the
    runner keys its attention groups by (backend, per-layer spec, heads).
    Compared, it split an IndexShare model's sparse layers into a leader
    and a follower attention group, two identical FlashMLA-sparse metadata
    builds per step (~100 us of host time each on the GPU host; P2,
    docs/worker.md K47). The layout keeps the flags in ``leaders``.

    ``max_memory_usage_bytes`` (inherited) is the host footprint of one
    request at max_model_len; the GPU accounting skips the source group.
    """

    is_index_group_leader: bool = field(default=True, compare=False)

    def pages_per_request(self, max_model_len: int) -> int:
        """Host blocks one request of ``max_model_len`` tokens holds."""
        return cdiv(max_model_len, self.block_size)

    @classmethod
    def from_mla_spec(cls, spec: MLAAttentionSpec, is_index_group_leader: bool) -> Self:
        return cls(**mla_spec_fields(spec), is_index_group_leader=is_index_group_leader)

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        # Leaders and followers differ only in the flag; a merged source spec
        # describes the page format, and keeps the first layer's flag.
        assert all(type(spec) is cls for spec in specs)
        base = [mla_spec_fields(spec) for spec in specs]
        assert all(b == base[0] for b in base[1:]), (
            "All sparse-MLA layers of the source group must share one page format."
        )
        return copy.deepcopy(specs[0])


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(MLAAttentionSpec):
    """A virtual ``<layer>.hisparse_resident`` layer (resident groups).

    ``admission_max_tokens`` is the token cap of the resident window before
    the min with max_model_len: ``hisparse_config.admission_max_tokens``, or
    max_num_batched_tokens when unset. A request needs at most
    ``cap_res = cdiv(min(admission_max_tokens, max_model_len), B) + 2``
    resident pages per group (spec 2.4); older pages move to host, so they are
    reclaimable and not counted (spec 3.5).
    """

    admission_max_tokens: int

    def cap_res_pages(self, max_model_len: int) -> int:
        """cap_res: the in-flight window plus the protected tail (INV-20)."""
        window = min(self.admission_max_tokens, max_model_len)
        return cdiv(window, self.block_size) + ACTIVE_TAIL_PAGES

    def pages_per_request(self, max_model_len: int) -> int:
        """min(cdiv(max_model_len, B), cap_res): the admission cost (3.5)."""
        return min(
            cdiv(max_model_len, self.block_size), self.cap_res_pages(max_model_len)
        )

    def max_memory_usage_bytes(self, vllm_config: "VllmConfig") -> int:
        max_model_len = vllm_config.model_config.max_model_len
        return self.pages_per_request(max_model_len) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        return _merge_identical(cls, specs)


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(MLAAttentionSpec):
    """A virtual ``<layer>.hisparse_hot`` layer (hot groups).

    A hot-required request holds a fixed region of ``cdiv(H, B)`` blocks per
    hot group for its lifetime (INV-5), whatever its length: H =
    ``device_buffer_size`` hot rows, each slot one host row.
    """

    device_buffer_size: int

    @property
    def hot_blocks(self) -> int:
        """cdiv(H, B): the hot region of one request in one hot group."""
        return cdiv(self.device_buffer_size, self.block_size)

    def pages_per_request(self, max_model_len: int) -> int:
        del max_model_len  # a hot region does not grow with the context
        return self.hot_blocks

    def max_memory_usage_bytes(self, vllm_config: "VllmConfig") -> int:
        return self.hot_blocks * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        return _merge_identical(cls, specs)


def resident_layer_name(layer_name: str) -> str:
    """``<layer>.hisparse_resident``: the layer's name in a resident group."""
    return layer_name + RESIDENT_SUFFIX


def hot_layer_name(layer_name: str) -> str:
    """``<layer>.hisparse_hot``: the layer's name in a hot group."""
    return layer_name + HOT_SUFFIX


def base_layer_name(layer_name: str) -> str:
    """The model layer a (possibly virtual) HiSparse layer name stands for."""
    for suffix in (RESIDENT_SUFFIX, HOT_SUFFIX):
        if layer_name.endswith(suffix):
            return layer_name[: -len(suffix)]
    return layer_name


def is_hisparse_virtual_layer(layer_name: str) -> bool:
    """True for resident/hot layer names, which have no model module."""
    return layer_name.endswith((RESIDENT_SUFFIX, HOT_SUFFIX))


def is_hisparse_virtual_group(group: "KVCacheGroupSpec") -> bool:
    """A resident or hot group: virtual layers only, no attention module
    (false for every group of a config without HiSparse)."""
    names = group.layer_names
    return bool(names) and all(is_hisparse_virtual_layer(n) for n in names)


def is_hisparse_hot_group(group: "KVCacheGroupSpec") -> bool:
    """A hot group: the runner reads its block table by block id (the
    resolver) and never needs its per-token slot mapping (P2: no slot-mapping
    kernel per hot group per step)."""
    names = group.layer_names
    return bool(names) and all(n.endswith(HOT_SUFFIX) for n in names)


def is_hisparse_spec(spec: KVCacheSpec) -> bool:
    return isinstance(spec, (HiSparseSourceSpec, HiSparseResidentSpec, HiSparseHotSpec))


# --------------------------------------------------------------------------
# The per-layer specs a DeepSeek-V3.2 / GLM-5.x checkpoint registers in 0.26.0
# --------------------------------------------------------------------------


def is_index_share_follower(hf_config: Mapping[str, Any], layer_id: int) -> bool:
    """Whether decoder layer ``layer_id`` reuses the previous layer's top-k.

    The rule of 0.26.0's ``DeepseekV2MLAAttention`` ("IndexCache"):
    ``index_topk_pattern`` ("S" = skip) when given, else
    ``max(layer_id - index_skip_topk_offset + 1, 0) % index_topk_freq != 0``
    (defaults: freq 1, offset 2, i.e. every layer a leader); MTP layers
    (``layer_id >= num_hidden_layers``) always build their own indexer.
    """
    if layer_id >= int(hf_config["num_hidden_layers"]):
        return False
    pattern = hf_config.get("index_topk_pattern")
    if pattern is None:
        freq = int(hf_config.get("index_topk_freq", 1))
        offset = int(hf_config.get("index_skip_topk_offset", 2))
        return max(layer_id - offset + 1, 0) % freq != 0
    return 0 <= layer_id < len(pattern) and pattern[layer_id] == "S"


def kv_cache_specs_from_hf_config(
    hf_config: Mapping[str, Any],
    *,
    block_size: int = 64,
    kv_cache_dtype: str = "fp8_ds_mla",
    num_mtp_layers: int = 0,
) -> dict[str, KVCacheSpec]:
    """The KV-cache specs the 0.26.0 DeepSeek-V2 model code registers.

    For planning without a GPU (``scripts/hisparse-capacity``) and for tests:
    per decoder layer, in construction order, the indexer key cache
    ``model.layers.<i>.self_attn.indexer.k_cache`` (leaders only;
    ``MLAAttentionSpec(head_size=index_head_dim + index_head_dim // 128 * 4,
    dtype=uint8)`` as in ``DeepseekV32IndexerCache``) and the sparse-MLA
    cache ``model.layers.<i>.self_attn.attn`` (as in
    ``MLAAttention.get_kv_cache_spec``: head_size = kv_lora_rank +
    qk_rope_head_dim). MTP layers follow as ``model.layers.<n + j>``.

    Args:
        kv_cache_dtype: "fp8_ds_mla" (656-B rows) or "bf16" (1152-B rows).
        num_mtp_layers: drafter layers present (speculative decoding on).
    """
    import torch

    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    head_size = int(hf_config["kv_lora_rank"]) + int(hf_config["qk_rope_head_dim"])
    if kv_cache_dtype == "fp8_ds_mla":
        mla = MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=head_size,
            dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla",
            kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        )
    elif kv_cache_dtype == "bf16":
        mla = MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=head_size,
            dtype=torch.bfloat16,
            cache_dtype_str="auto",
        )
    else:
        raise ValueError(
            f"kv_cache_dtype must be fp8_ds_mla or bf16, got {kv_cache_dtype}"
        )
    index_head_dim = int(hf_config.get("index_head_dim", 128))
    indexer = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=index_head_dim + index_head_dim // 128 * 4,
        dtype=torch.uint8,
    )
    num_layers = int(hf_config["num_hidden_layers"])
    specs: dict[str, KVCacheSpec] = {}
    for layer_id in range(num_layers + num_mtp_layers):
        # MTP layers: DeepSeekMultiTokenPredictorLayer builds its decoder
        # layer (mtp_block) with its own prefix, model.layers.<i>.
        prefix = f"model.layers.{layer_id}"
        if not is_index_share_follower(hf_config, layer_id):
            specs[f"{prefix}.self_attn.indexer.k_cache"] = indexer
        specs[f"{prefix}.self_attn.attn"] = mla
    return specs
