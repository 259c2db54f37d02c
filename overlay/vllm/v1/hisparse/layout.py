# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C1: the HiSparse layout builder (spec 3): the geometry.

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
- the capacity accounting of 3.5, which counts sparse-MLA history beyond
  ``cap_res`` as reclaimable, and the steady-state concurrency.

The rest of C1 lives beside it: the host pool geometry (3.3) in
``host_pool_plan``, the capacity report and startup log in ``capacity``, and
the vLLM-facing ``HiSparseKVCacheConfig`` with the ``kv_cache_utils`` forks
in ``kv_cache_config``.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv, round_up
from vllm.v1.hisparse.config_checks import (
    GiB,
    HiSparseConfigError,
    check_block_sizes,
    check_device_buffer_size,
    check_row_format,
    max_decode_query_len,
    model_architecture,
    model_index_topk,
    order_mode,
    resolve_host_pool_gib,
    shared_host_pool,
    unsupported_model_error,
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
    KVCacheGroupSpec,
    KVCacheSpec,
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
    num_target_layers: int | None = None
    """hf ``num_hidden_layers``: sparse layers ``layers.<i>`` with i >= it are
    the drafter's (MTP); None: every layer is a target layer."""
    order_misses: str | None = None
    """The miss order (None, "row" or "step"): "step" holds K7's buffers."""

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
            num_target_layers=getattr(
                vllm_config.model_config.hf_text_config, "num_hidden_layers", None
            ),
            order_misses=order_mode(hisparse_config.order_misses),
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


def _layer_index(name: str) -> int | None:
    match = _LAYER_INDEX_RE.search(name)
    return int(match.group(1)) if match else None


def last_in_forward(names: Sequence[str]) -> str | None:
    """The layer of ``names`` (model order) that the forward runs last: the
    last one, when every name has a ``layers.<i>`` index (so model order is
    execution order); None when one has none."""
    if not names or any(_layer_index(n) is None for n in names):
        return None
    return max(names, key=_layer_index)


def _model_order(names: Sequence[str]) -> list[str]:
    """Sort layer names by decoder-layer index, stably.

    Spec dicts come from the runner in module-construction order, which is
    already model order; sorting by the ``layers.<i>`` index makes the layout
    independent of dict order. Names without an index keep their position
    after every indexed name.
    """

    def key(item: tuple[int, str]) -> tuple[int, int]:
        pos, name = item
        index = _layer_index(name)
        return (1 << 62 if index is None else index, pos)

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


def find_draft_layers(
    sparse: Sequence[SparseLayer], num_target_layers: int | None
) -> tuple[str, ...]:
    """The drafter's sparse layers (MTP): ``layers.<i>`` with i >=
    ``num_target_layers`` (0.26.0's DeepSeekMTP builds ``model.layers.<N+j>``).

    Each must lead its own index group (0.26.0 always builds an indexer for
    an MTP layer), so its hot unit holds no target layer (INV-11) and its
    index-group state is its own.
    """
    if num_target_layers is None:
        return ()
    drafts = []
    for layer in sparse:
        index = _layer_index(layer.name)
        if index is None or index < num_target_layers:
            continue
        if not layer.is_leader:
            raise HiSparseConfigError(
                f"HiSparse: draft layer {layer.name} (index >= num_hidden_layers="
                f"{num_target_layers}) shares another layer's top-k; a draft "
                "layer must lead its own index group."
            )
        drafts.append(layer.name)
    return tuple(drafts)


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
    draft_layers: tuple[str, ...] = ()
    """The drafter's (MTP) sparse layers, the last of ``sparse_layers``.
    Packed like any unit (they may share a pair with target layers); the
    worker mirrors them after the drafter (docs/mtp.md 3.2, 3.5)."""
    order_misses: str | None = None
    """``hisparse_config.order_misses`` as a mode (None, "row", "step"):
    the reserve counts K7's buffers when it is "step"."""

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

    def pair_of(self, layer_name: str) -> int:
        """The resident/hot pair holding a sparse layer."""
        return next(i for i, pair in enumerate(self.pairs) if layer_name in pair)

    @property
    def draft_write_group_ids(self) -> tuple[int, ...]:
        """The groups an MTP drafter writes KV with: each draft layer's
        resident group, then the indexer group; () without a drafter
        (docs/mtp.md 3.4)."""
        if not self.draft_layers:
            return ()
        resident = {self.resident_group_ids[self.pair_of(n)] for n in self.draft_layers}
        return (*sorted(resident), self.INDEXER_GROUP_ID)

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
        draft_layers=find_draft_layers(roles.sparse, params.num_target_layers),
        order_misses=params.order_misses,
    )
