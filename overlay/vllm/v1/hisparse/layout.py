# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C1: the HiSparse layout builder (spec 3).

A pure, deterministic function of the model's per-layer KV-cache specs and
the HiSparse parameters; the engine core and every worker compute the same
layout from the same inputs. It produces:

- the group split (3.1), in this order: **source** (all sparse-MLA layers,
  host pool), **indexer** (all indexer layers), **resident_1..n**,
  **hot_1..n** (virtual layers ``<layer>.hisparse_resident`` /
  ``<layer>.hisparse_hot``), then any **other** group of the model;
- the hot units (leader + its IndexShare followers) and their packing into
  resident/hot pairs: units are never split (INV-11), a set's page is at
  most the indexer page unless one oversized unit stands alone (U-1);
- one device slab, block-outermost: ``bytes_per_block`` = max over device
  groups of the sum of their layer pages; a group's i-th layer sits at
  byte ``sum(pages of layers 0..i-1)`` of the block; a resident group and its
  hot twin list the same layers, so each sparse layer has one offset off_l
  in both (INV-10, INV-13); flat or strided attention addressing and Sa
  (3.2); the INV-14 int32 row-id cap;
- the host pool geometry (3.3): N_host, host_block_stride = L * P, pool
  bytes, per-layer array offsets (layer-major), registration chunks;
- the capacity accounting of 3.5, which counts sparse-MLA history beyond
  ``cap_res`` as reclaimable, and the steady-state concurrency.

The vLLM-facing part (bottom of this file) mirrors
``kv_cache_utils.get_kv_cache_configs`` for HiSparse: grouping, the
``num_gpu_blocks_override`` adjustment, auto-fit, the memory check, the
config build and the capacity log, emitting ``HiSparseKVCacheConfig``s whose
host tensors stay outside ``kv_cache_tensors`` (vLLM's allocator and shrink
loop never see them).
"""

import copy
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv, round_up
from vllm.v1.hisparse.config_checks import (
    GiB,
    HiSparseConfigError,
    check_block_sizes,
    check_device_buffer_size,
    check_host_pool_holds_one_request,
    check_host_ram,
    check_host_row_range,
    check_row_format,
    max_decode_query_len,
    model_architecture,
    model_index_topk,
    resolve_host_pool_gib,
    shared_host_pool,
    unsupported_model_error,
    verify_hisparse_config,
)
from vllm.v1.hisparse.constants import (
    ACTIVE_TAIL_PAGES,
    INDEXER_CACHE_SUFFIX,
    MAX_INT32_ROW_ID,
    MLA_ATTN_SUFFIX,
    OS_PAGE_BYTES,
    REGISTRATION_CHUNK_BYTES,
)
from vllm.v1.hisparse.specs import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    HiSparseSourceSpec,
    hot_layer_name,
    mla_spec_fields,
    resident_layer_name,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

AddressingMode = Literal["flat", "strided"]


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HiSparseParams:
    """Everything the layout needs besides the specs (and max_model_len).

    ``max_model_len`` is passed to the accounting functions instead, because
    auto-fit searches over it.
    """

    index_topk: int
    """K: top-k rows per query token per index group."""
    max_decode_query_len: int
    """q = 1 + num_speculative_tokens."""
    device_buffer_size: int
    """H, resolved (configured value or (q + 1) * K)."""
    admission_max_tokens: int
    """Resident window in tokens before the min with max_model_len:
    hisparse_config.admission_max_tokens or max_num_batched_tokens."""
    host_pool_bytes: int
    """Logical host pool per DP replica (host_pool_gib * 2^30)."""
    host_pool_gib: float = 0.0
    """The configured value, for messages."""
    device_buffer_size_configured: bool = False
    tensor_parallel_size: int = 1
    shared_host_pool: bool = False
    num_gpu_blocks_override: int | None = None
    registration_chunk_bytes: int = REGISTRATION_CHUNK_BYTES
    architecture: str = "this model"

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig") -> "HiSparseParams":
        hisparse_config = vllm_config.attention_config.hisparse_config
        assert hisparse_config is not None, "HiSparse is off"
        index_topk = model_index_topk(vllm_config)
        architecture = model_architecture(vllm_config)
        if index_topk is None:
            raise unsupported_model_error(architecture, "no index_topk")
        q = max_decode_query_len(vllm_config)
        host_pool_gib = resolve_host_pool_gib(vllm_config)
        admission = hisparse_config.admission_max_tokens
        if admission is None:
            admission = vllm_config.scheduler_config.max_num_batched_tokens
        return cls(
            index_topk=index_topk,
            max_decode_query_len=q,
            device_buffer_size=hisparse_config.default_device_buffer_size(
                index_topk, q
            ),
            admission_max_tokens=admission,
            host_pool_bytes=int(host_pool_gib * GiB),
            host_pool_gib=host_pool_gib,
            device_buffer_size_configured=hisparse_config.device_buffer_size
            is not None,
            tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            shared_host_pool=shared_host_pool(vllm_config),
            num_gpu_blocks_override=vllm_config.cache_config.num_gpu_blocks_override,
            architecture=architecture,
        )


# --------------------------------------------------------------------------
# Roles: which layers are sparse-MLA, indexer, other; leaders and followers
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseLayer:
    """One sparse-MLA layer in model order."""

    name: str
    spec: MLAAttentionSpec
    is_leader: bool


@dataclass(frozen=True)
class LayerRoles:
    sparse: tuple[SparseLayer, ...]
    indexer: tuple[tuple[str, MLAAttentionSpec], ...]
    other: tuple[tuple[str, KVCacheSpec], ...]


_LAYER_INDEX_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _model_order(names: Sequence[str]) -> list[str]:
    """Sort layer names by decoder-layer index, stably.

    Spec dicts come from the runner in module-construction order, which is
    already model order; sorting by the ``layers.<i>`` index makes the layout
    independent of dict order. Names without an index keep their position
    after every indexed name.
    """

    def key(item: tuple[int, str]) -> tuple[int, int]:
        pos, name = item
        match = _LAYER_INDEX_RE.search(name)
        return (int(match.group(1)) if match else 1 << 62, pos)

    return [name for _, name in sorted(enumerate(names), key=key)]


def classify_layers(
    kv_cache_spec: Mapping[str, KVCacheSpec], architecture: str = "this model"
) -> LayerRoles:
    """Split the model's layers into sparse-MLA, indexer and other layers.

    0.26.0 has no role on a spec (integration map 1.3), so roles come from
    the layer names the DeepSeek-V2/V3.2 model code registers:

    - ``<prefix>.indexer.k_cache`` (an ``MLAAttentionSpec``, 132-B uint8 rows
      for DeepSeek-V3.2/GLM-5) is an indexer layer;
    - ``<prefix>.attn`` with an ``MLAAttentionSpec`` is a sparse-MLA layer;
      it is an index-group *leader* iff ``<prefix>.indexer.k_cache`` exists
      (0.26.0 builds an ``Indexer`` exactly for layers that do not
      ``skip_topk``: index_topk_freq / index_topk_pattern /
      index_skip_topk_offset, MTP layers always), else an IndexShare
      follower;
    - a spec that is already a ``HiSparseSourceSpec`` (tagged by the worker)
      carries its own leader flag;
    - anything else is an "other" layer.

    Raises:
        HiSparseConfigError: not a sparse-MLA model with an indexer, a
            DeepSeek-V4 layer, or leaders that cannot be paired 1:1 with
            indexer layers.
    """
    sparse_specs: dict[str, tuple[MLAAttentionSpec, bool | None]] = {}
    indexer_specs: dict[str, MLAAttentionSpec] = {}
    other_specs: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, (HiSparseResidentSpec, HiSparseHotSpec)):
            raise ValueError(
                f"layer {name}: the layout builder takes the model's own specs, "
                f"not a {type(spec).__name__}"
            )
        if isinstance(spec, SlidingWindowMLASpec) or (
            isinstance(spec, MLAAttentionSpec) and spec.model_version == "deepseek_v4"
        ):
            raise unsupported_model_error(
                architecture, f"layer {name} is a DeepSeek-V4 compressed cache"
            )
        if isinstance(spec, HiSparseSourceSpec):
            sparse_specs[name] = (spec, spec.is_index_group_leader)
        elif isinstance(spec, MLAAttentionSpec) and name.endswith(INDEXER_CACHE_SUFFIX):
            indexer_specs[name] = spec
        elif (
            isinstance(spec, MLAAttentionSpec)
            and not isinstance(spec, HiddenStateCacheSpec)
            and name.endswith(MLA_ATTN_SUFFIX)
        ):
            sparse_specs[name] = (spec, None)
        else:
            other_specs[name] = spec

    if not indexer_specs:
        raise unsupported_model_error(architecture, "no indexer KV-cache layers")
    if not sparse_specs:
        raise unsupported_model_error(architecture, "no sparse-MLA KV-cache layers")

    sparse: list[SparseLayer] = []
    paired: set[str] = set()
    for name in _model_order(list(sparse_specs)):
        spec, flag = sparse_specs[name]
        sibling = name[: -len(MLA_ATTN_SUFFIX)] + INDEXER_CACHE_SUFFIX
        has_indexer = sibling in indexer_specs
        if has_indexer:
            paired.add(sibling)
        sparse.append(SparseLayer(name, spec, has_indexer if flag is None else flag))
    num_leaders = sum(layer.is_leader for layer in sparse)
    unpaired = sorted(set(indexer_specs) - paired)
    if num_leaders != len(indexer_specs) or (
        unpaired and any(flag is None for _, flag in sparse_specs.values())
    ):
        raise HiSparseConfigError(
            f"HiSparse cannot pair the {len(indexer_specs)} indexer layers with "
            f"the {num_leaders} index-group leaders among {len(sparse)} sparse-MLA "
            f"layers of {architecture} (unpaired indexer layers: "
            f"{unpaired[:4]}). Leaders are found by name: '<prefix>"
            f"{MLA_ATTN_SUFFIX}' leads when '<prefix>{INDEXER_CACHE_SUFFIX}' "
            "exists; this model uses another naming scheme."
        )
    indexer = tuple((n, indexer_specs[n]) for n in _model_order(list(indexer_specs)))
    return LayerRoles(tuple(sparse), indexer, tuple(other_specs.items()))


def hot_units(sparse: Sequence[SparseLayer]) -> list[list[str]]:
    """Hot units (3.1 step 3): a unit starts at each leader, and the first
    sparse layer always starts one; each follower joins the current unit."""
    units: list[list[str]] = []
    for layer in sparse:
        if layer.is_leader or not units:
            units.append([])
        units[-1].append(layer.name)
    return units


def pack_units(unit_bytes: Sequence[int], capacity: int) -> list[list[int]]:
    """The packing rule (3.1 step 4, INV-11, U-1).

    Walk the units in order, adding each to the current set while the set's
    bytes stay <= ``capacity`` (the indexer page). A unit that does not fit
    closes the set; a unit is never split; a unit larger than ``capacity``
    forms a set on its own.

    Returns:
        The sets, each a list of unit indices in order.
    """
    sets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, size in enumerate(unit_bytes):
        if current and used + size > capacity:
            sets.append(current)
            current, used = [], 0
        current.append(index)
        used += size
        if used > capacity:  # an oversized unit, alone
            sets.append(current)
            current, used = [], 0
    if current:
        sets.append(current)
    return sets


# --------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestBlocks:
    """GPU blocks one request of a given length costs, per group kind (3.5)."""

    indexer: int
    resident: int
    """Sum over resident groups of min(pages, cap_res): the admission cost."""
    hot: int
    """Sum over hot groups of cdiv(H, B)."""
    other: int
    tail: int
    """Sum over resident groups of the protected tail (min(pages, 2))."""
    resident_full: int
    """Sum over resident groups of every page (a fully resident request)."""

    @property
    def admission(self) -> int:
        """What a request must be able to hold: the memory-check cost."""
        return self.indexer + self.resident + self.hot + self.other

    @property
    def steady(self) -> int:
        """What a hybrid request holds once its history moved to host."""
        return self.indexer + self.tail + self.hot + self.other

    @property
    def fully_resident(self) -> int:
        """A request with every page resident and no hot region."""
        return self.indexer + self.resident_full + self.other


@dataclass(frozen=True)
class Concurrency:
    """Steady-state concurrency at max_model_len (3.5)."""

    gpu: float
    host: float

    @property
    def result(self) -> float:
        return min(self.gpu, self.host)


@dataclass(frozen=True)
class HiSparseLayout:
    """The block-count-independent HiSparse geometry (3.1, 3.2).

    Group ids index ``kv_cache_groups``: 0 = source, 1 = indexer, then the
    resident groups, the hot groups and the other groups. ``layer_offsets``
    maps every *device* layer name (indexer, virtual resident/hot, other)
    to its byte offset inside a block of the shared slab.
    """

    block_size: int
    row_bytes: int
    """W: bytes per sparse-MLA row (656 fp8_ds_mla, 1152 bf16)."""
    index_topk: int
    max_decode_query_len: int
    device_buffer_size: int
    sparse_layers: tuple[str, ...]
    leaders: tuple[bool, ...]
    indexer_layers: tuple[str, ...]
    other_layers: tuple[str, ...]
    hot_units: tuple[tuple[str, ...], ...]
    pairs: tuple[tuple[str, ...], ...]
    """Layer lists of the resident/hot pairs (the packed sets of units)."""
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    group_page_bytes: tuple[int, ...]
    """Per group: the sum of its layer pages (for the source group, the bytes
    one host block holds across all sparse layers: L * P)."""
    bytes_per_block: int
    layer_offsets: Mapping[str, int]
    addressing: AddressingMode
    attention_block_stride: int
    """Sa: rows per block of the attention-facing view (3.2)."""

    SOURCE_GROUP_ID = 0
    INDEXER_GROUP_ID = 1

    @property
    def page_bytes(self) -> int:
        """P = B * W: one sparse-layer page."""
        return self.block_size * self.row_bytes

    @property
    def num_sparse_layers(self) -> int:
        """L (counts the MTP layer when the drafter's specs are present)."""
        return len(self.sparse_layers)

    @property
    def num_pairs(self) -> int:
        return len(self.pairs)

    @property
    def resident_group_ids(self) -> range:
        return range(2, 2 + self.num_pairs)

    @property
    def hot_group_ids(self) -> range:
        return range(2 + self.num_pairs, 2 + 2 * self.num_pairs)

    @property
    def other_group_ids(self) -> range:
        return range(2 + 2 * self.num_pairs, len(self.kv_cache_groups))

    @property
    def device_group_ids(self) -> range:
        return range(1, len(self.kv_cache_groups))

    @property
    def indexer_page_bytes(self) -> int:
        return self.group_page_bytes[self.INDEXER_GROUP_ID]

    @property
    def hot_blocks(self) -> int:
        """cdiv(H, B): one request's hot region in one hot group."""
        return cdiv(self.device_buffer_size, self.block_size)

    def sparse_layer_offset(self, layer_name: str) -> int:
        """off_l: the sparse layer's byte offset in resident and hot blocks."""
        return self.layer_offsets[resident_layer_name(layer_name)]

    def cap_res_pages(self, max_model_len: int) -> int:
        spec = self._resident_spec()
        return spec.cap_res_pages(max_model_len)

    def _resident_spec(self) -> HiSparseResidentSpec:
        group = self.kv_cache_groups[self.resident_group_ids[0]]
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        resident = next(iter(spec.kv_cache_specs.values()))
        assert isinstance(resident, HiSparseResidentSpec)
        return resident

    def host_block_stride(self, shared: bool) -> int:
        """L * P; rounded up to the OS page in shared mode (3.3)."""
        stride = self.num_sparse_layers * self.page_bytes
        return round_up(stride, OS_PAGE_BYTES) if shared else stride

    # ---------------------------------------------------------- accounting

    def request_blocks(self, max_model_len: int) -> RequestBlocks:
        """Per-request GPU blocks at ``max_model_len`` tokens (3.5).

        Indexer and other groups count the full length; each resident group
        min(pages, cap_res) (the resident spec's ``pages_per_request``); each
        hot group cdiv(H, B). Every page of any device group costs one block
        of ``bytes_per_block``.
        """
        pages = cdiv(max_model_len, self.block_size)
        resident = hot = other = tail = 0
        for gid in self.resident_group_ids:
            spec = self._group_layer_spec(gid)
            assert isinstance(spec, HiSparseResidentSpec)
            resident += spec.pages_per_request(max_model_len)
            tail += min(pages, ACTIVE_TAIL_PAGES)
        for gid in self.hot_group_ids:
            spec = self._group_layer_spec(gid)
            assert isinstance(spec, HiSparseHotSpec)
            hot += spec.pages_per_request(max_model_len)
        other = pages * len(self.other_group_ids)
        return RequestBlocks(
            indexer=pages,
            resident=resident,
            hot=hot,
            other=other,
            tail=tail,
            resident_full=pages * self.num_pairs,
        )

    def _group_layer_spec(self, group_id: int) -> KVCacheSpec:
        spec = self.kv_cache_groups[group_id].kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        return next(iter(spec.kv_cache_specs.values()))

    def gpu_bytes_per_request(self, max_model_len: int) -> int:
        """The memory-check cost: admission blocks * bytes_per_block."""
        return self.request_blocks(max_model_len).admission * self.bytes_per_block

    def steady_state_concurrency(
        self, num_gpu_blocks: int, num_host_blocks: int, max_model_len: int
    ) -> Concurrency:
        """min(gpu_conc, host_conc) at max_model_len (3.5).

        gpu_conc = N_gpu / admission if N_gpu < admission, else
        1 + (N_gpu - admission) / steady: one request may be admitted at its
        full admission cost, every further one settles at the steady cost.
        host_conc = N_host / cdiv(max_model_len, B).
        """
        blocks = self.request_blocks(max_model_len)
        if num_gpu_blocks < blocks.admission:
            gpu = num_gpu_blocks / blocks.admission
        else:
            gpu = 1 + (num_gpu_blocks - blocks.admission) / blocks.steady
        host = num_host_blocks / cdiv(max_model_len, self.block_size)
        return Concurrency(gpu=gpu, host=host)

    # ------------------------------------------------------- device sizing

    def max_gpu_blocks(self) -> int:
        """INV-14: N_gpu * max(Sa, B) < 2^31 keeps every row id in int32."""
        return MAX_INT32_ROW_ID // max(self.attention_block_stride, self.block_size)

    def num_gpu_blocks(
        self, available_memory: int, num_gpu_blocks_override: int | None = None
    ) -> int:
        """N_gpu: available bytes // bytes_per_block (or the override),
        capped for the int32 row-id range with a warning (INV-14)."""
        num_blocks = available_memory // self.bytes_per_block
        if num_gpu_blocks_override is not None:
            num_blocks = num_gpu_blocks_override
        limit = self.max_gpu_blocks()
        if num_blocks > limit:
            logger.warning(
                "HiSparse: capping the GPU pool at %d blocks (from %d) so that "
                "every row id fits in int32 (N_gpu x max(Sa=%d, B=%d) < 2^31, "
                "INV-14).",
                limit,
                num_blocks,
                self.attention_block_stride,
                self.block_size,
            )
            num_blocks = limit
        return max(num_blocks, 0)

    def attention_view_rows(self, layer_name: str, num_gpu_blocks: int) -> int:
        """Rows of the sparse layer's attention view over N_gpu blocks.

        Flat: the slab from off_l as contiguous W-byte rows; strided: N_gpu*B.
        """
        if self.addressing == "strided":
            return num_gpu_blocks * self.block_size
        slab = num_gpu_blocks * self.bytes_per_block
        return (slab - self.sparse_layer_offset(layer_name)) // self.row_bytes

    def attention_row(self, physical_row: int) -> int:
        """hma(r) = (r div B) * Sa + (r mod B)."""
        block, offset = divmod(physical_row, self.block_size)
        return block * self.attention_block_stride + offset

    def estimate_max_model_len(
        self,
        available_memory: int,
        num_host_blocks: int,
        max_model_len: int,
        reserved_blocks: Callable[[int], int] | None = None,
    ) -> int:
        """Largest length <= ``max_model_len`` whose admission cost (plus
        ``reserved_blocks(length)`` blocks set aside, if given) fits
        ``available_memory`` and whose pages (+2) fit the host pool; 0 if even
        one token does not fit. All costs are monotone in the length."""

        def fits(length: int) -> bool:
            reserved = reserved_blocks(length) if reserved_blocks else 0
            return (
                self.gpu_bytes_per_request(length) + reserved * self.bytes_per_block
                <= available_memory
                and num_host_blocks >= cdiv(length, self.block_size) + 2
            )

        if not fits(1):
            return 0
        low, high, best = 1, max_model_len, 1
        while low <= high:
            mid = (low + high) // 2
            if fits(mid):
                best, low = mid, mid + 1
            else:
                high = mid - 1
        return best


def _uniform_group(
    specs: Mapping[str, KVCacheSpec], block_size: int
) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(
        list(specs),
        UniformTypeKVCacheSpecs(block_size=block_size, kv_cache_specs=dict(specs)),
    )


def build_hisparse_layout(
    kv_cache_spec: Mapping[str, KVCacheSpec], params: HiSparseParams
) -> HiSparseLayout:
    """Build the HiSparse layout from the model's per-layer specs (C1).

    Deterministic: the result depends only on the specs (names, order by
    layer index, fields) and ``params``.

    Raises:
        HiSparseConfigError: the startup checks of spec 6.3 that depend on
            the specs (model, block size, row format, device_buffer_size).
    """
    roles = classify_layers(kv_cache_spec, params.architecture)
    block_size = check_block_sizes(
        {name: spec.block_size for name, spec in kv_cache_spec.items()}
    )

    first = roles.sparse[0]
    page_format = mla_spec_fields(first.spec)
    for layer in roles.sparse:
        if mla_spec_fields(layer.spec) != page_format:
            raise HiSparseConfigError(
                f"HiSparse needs one page format across the sparse-MLA layers; "
                f"{layer.name} differs from {first.name}."
            )
    page_bytes = first.spec.page_size_bytes
    row_bytes = page_bytes // block_size
    check_row_format(
        first.name,
        first.spec.cache_dtype_str,
        str(first.spec.dtype).removeprefix("torch."),
        row_bytes if row_bytes * block_size == page_bytes else -page_bytes,
    )
    check_device_buffer_size(
        params.device_buffer_size,
        params.max_decode_query_len,
        params.index_topk,
        block_size,
        params.device_buffer_size_configured,
    )
    other = dict(roles.other)
    if other and UniformTypeKVCacheSpecs.from_specs(other) is None:
        raise HiSparseConfigError(
            "HiSparse supports at most one extra KV-cache group of full-attention "
            f"layers besides the sparse-MLA and indexer layers; found {sorted(other)}."
        )
    for name, spec in other.items():
        if not isinstance(spec, FullAttentionSpec) or (
            spec.sliding_window is not None or spec.attention_chunk_size is not None
        ):
            raise HiSparseConfigError(
                "HiSparse supports extra full-attention layers only; layer "
                f"{name} is a {type(spec).__name__}."
            )

    # Source group: every sparse layer, host resident, with its leader flag.
    source = {
        layer.name: HiSparseSourceSpec.from_mla_spec(layer.spec, layer.is_leader)
        for layer in roles.sparse
    }
    indexer = dict(roles.indexer)
    groups: list[KVCacheGroupSpec] = [
        _uniform_group(source, block_size),
        _uniform_group(indexer, block_size),
    ]
    idx_page = sum(spec.page_size_bytes for spec in indexer.values())

    units = hot_units(roles.sparse)
    sets = pack_units([len(unit) * page_bytes for unit in units], idx_page)
    pairs = [[name for u in unit_ids for name in units[u]] for unit_ids in sets]

    resident_spec = HiSparseResidentSpec(
        **page_format, admission_max_tokens=params.admission_max_tokens
    )
    hot_spec = HiSparseHotSpec(
        **page_format, device_buffer_size=params.device_buffer_size
    )
    resident_groups = [
        _uniform_group(
            {resident_layer_name(n): resident_spec for n in pair}, block_size
        )
        for pair in pairs
    ]
    hot_groups = [
        _uniform_group({hot_layer_name(n): hot_spec for n in pair}, block_size)
        for pair in pairs
    ]
    groups += resident_groups + hot_groups
    if other:
        groups.append(_uniform_group(other, block_size))

    # One slab: a group's i-th layer at the sum of the earlier layers' pages.
    layer_offsets: dict[str, int] = {}
    group_page_bytes = [len(roles.sparse) * page_bytes]
    for group in groups[1:]:
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        offset = 0
        for name in group.layer_names:
            layer_offsets[name] = offset
            offset += spec.kv_cache_specs[name].page_size_bytes
        group_page_bytes.append(offset)
    bytes_per_block = max(group_page_bytes[1:])

    # 3.2: flat when the block is a whole number of pages, else strided; the
    # layout is never padded to reach flat mode.
    if bytes_per_block % page_bytes == 0:
        addressing: AddressingMode = "flat"
        attention_block_stride = bytes_per_block // row_bytes
    else:
        addressing = "strided"
        attention_block_stride = block_size

    return HiSparseLayout(
        block_size=block_size,
        row_bytes=row_bytes,
        index_topk=params.index_topk,
        max_decode_query_len=params.max_decode_query_len,
        device_buffer_size=params.device_buffer_size,
        sparse_layers=tuple(layer.name for layer in roles.sparse),
        leaders=tuple(layer.is_leader for layer in roles.sparse),
        indexer_layers=tuple(indexer),
        other_layers=tuple(other),
        hot_units=tuple(tuple(unit) for unit in units),
        pairs=tuple(tuple(pair) for pair in pairs),
        kv_cache_groups=tuple(groups),
        group_page_bytes=tuple(group_page_bytes),
        bytes_per_block=bytes_per_block,
        layer_offsets=layer_offsets,
        addressing=addressing,
        attention_block_stride=attention_block_stride,
    )


# --------------------------------------------------------------------------
# Host pool (3.3)
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Capacity report (scripts/hisparse-capacity)
# --------------------------------------------------------------------------


def capacity_report(
    kv_cache_spec: Mapping[str, KVCacheSpec],
    params: HiSparseParams,
    context_len: int,
    gpu_kv_bytes: int,
) -> dict[str, Any]:
    """Per-request GPU bytes and concurrency, fully resident vs hybrid.

    Fully resident is stock vLLM (HiSparse off): every sparse-MLA and
    indexer layer keeps every page on the GPU, one block of
    sum(layer pages) per page. Hybrid is the HiSparse layout of this module:
    admission and steady-state costs of 3.5 in blocks of bytes_per_block,
    and the steady-state concurrency min(GPU, host). The sparse-MLA payload
    (rows x W x L) is reported separately: it is what target P3 compares
    (hot region + protected tail vs the whole history).
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


def build_hisparse_kv_cache_config(
    layout: HiSparseLayout,
    num_gpu_blocks: int,
    host_pool: HostPoolPlan,
    staging_blocks: int = 0,
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
    ``num_gpu_blocks_override``, auto-fit and the memory check on the 3.5
    accounting, one ``HiSparseKVCacheConfig`` per worker with the common
    N_gpu, and the capacity log. Every startup check of 6.3 that does not
    need a GPU runs before anything is sized.
    """
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    verify_hisparse_config(vllm_config)
    merged = _merge_worker_specs(kv_cache_specs)
    KVCacheSpecRegistry.check_kv_cache_spec_registry(merged)
    params = HiSparseParams.from_vllm_config(vllm_config)
    layout = build_hisparse_layout(merged, params)
    host_pool = plan_host_pool(layout, params)
    bytes_per_block = layout.bytes_per_block

    override = params.num_gpu_blocks_override
    if override is not None:
        logger.info(
            "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d",
            min(available_memory) // bytes_per_block,
            override,
        )
        available_memory = [override * bytes_per_block] * len(available_memory)

    model_config = vllm_config.model_config

    def staging_for(length: int) -> int:
        # In-slab staging blocks (K13) come off the pool's memory.
        return staging_blocks(layout, length, vllm_config) if override is None else 0

    if model_config.original_max_model_len == -1:
        original = model_config.max_model_len
        fitted = layout.estimate_max_model_len(
            min(available_memory), host_pool.num_blocks, original, staging_for
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
                min(available_memory) / GiB,
                host_pool.num_blocks,
            )
    max_model_len = model_config.max_model_len
    staging = staging_blocks(layout, max_model_len, vllm_config)
    reserved = staging_for(max_model_len) * bytes_per_block
    available_memory = [max(avail - reserved, 0) for avail in available_memory]

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
    for avail in available_memory:
        _check_enough_kv_cache_memory(
            avail,
            lambda: layout.gpu_bytes_per_request(max_model_len),
            max_model_len,
            lambda mem: layout.estimate_max_model_len(
                mem, host_pool.num_blocks, max_model_len
            ),
        )

    num_gpu_blocks = min(
        layout.num_gpu_blocks(avail, override) for avail in available_memory
    )
    configs: list[KVCacheConfig] = [
        build_hisparse_kv_cache_config(layout, num_gpu_blocks, host_pool, staging)
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
    return configs


def staging_blocks(
    layout: HiSparseLayout, max_model_len: int, vllm_config: "VllmConfig"
) -> int:
    """Slab blocks reserved for in-slab staging: C_stage of spec 2.11,
    cdiv(max_model_len, B) + cdiv(max_num_batched_tokens, B)."""
    batched = vllm_config.scheduler_config.max_num_batched_tokens
    return cdiv(max_model_len, layout.block_size) + cdiv(batched, layout.block_size)


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
