# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C1: the GPU memory HiSparse takes outside the KV pool (spec 2.8, 2.11, 3.5).

vLLM sizes the KV cache from a profiling run on the stock single-group KV
cache (docs/layout.md L4), so nothing HiSparse allocates when it binds (after
the KV tensors exist) is in that profile. ``hisparse_gpu_reserve`` gives the
bytes of each such allocation, from the layout and the batch limits, with
the shapes the worker allocates them with; ``get_hisparse_kv_cache_configs``
takes them off the available memory before it sizes the pool, and refuses a
``num_gpu_blocks_override`` that would not leave room for them
(docs/layout.md L17).

What it counts, per worker:

- in-slab staging: C_stage blocks of ``bytes_per_block`` past the pool (K13);
- hot-slot state: per index group ``dgi`` int32 + ``lru`` int16 [S + 1, H]
  and ``stats`` uint64 [4] (6·(S+1)·H + 32 B), plus ``req_state`` int32
  [S], ``row_req`` int32 [T] and the LRU reset row int16 [H];
- the resolver workspace: out_rows, plan_src, plan_dst int32 [R_ws, K] and
  valid_counts, plan_count int32 [R_ws] (2.8);
- the prefill staging cache: [cdiv(max_model_len, B) + 1, B, W] bytes, its
  block table and start (2.11, K4);
- the mirror descriptors: src, dst, nbytes int64 [L·T] and three int64 [L]
  bases (K2; the writer rank's, the larger);
- the runner's block tables and slot mappings of the groups HiSparse adds to
  vLLM's one (int32 [S, cdiv(max_model_len, B)] + int64 [T] each).

S = max_num_seqs, T = max_num_batched_tokens, H = device_buffer_size,
K = index_topk, L = sparse-MLA layers. Per-step temporaries (staging plans,
extend rows, descriptor arithmetic) come and go in the caching allocator and
are not counted here.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.utils.mem_constants import MiB_bytes as MiB
from vllm.v1.hisparse.config_checks import GiB, HiSparseConfigError
from vllm.v1.hisparse.layout import HiSparseLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# Element sizes of the dtypes the worker allocates its buffers with.
INT16 = torch.int16.itemsize
INT32 = torch.int32.itemsize
INT64 = torch.int64.itemsize
UINT64 = torch.uint64.itemsize
STATS_COUNTERS = 4
"""hits, misses, tripped misses, rejected rows (runtime.build_index_groups)."""


@dataclass(frozen=True)
class BatchLimits:
    """The scheduler limits the worker sizes its buffers with."""

    max_num_seqs: int
    """S: request-state slots, rows of dgi/lru, block-table rows."""
    max_num_batched_tokens: int
    """T: tokens of one step (row_req, mirror descriptors, slot mappings)."""

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig") -> "BatchLimits":
        scheduler_config = vllm_config.scheduler_config
        return cls(
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        )


# --------------------------------------------------------------------------
# Per-item sizes (each mirrors one allocation site)
# --------------------------------------------------------------------------


def staging_block_count(max_model_len: int, block_size: int, max_tokens: int) -> int:
    """C_stage of spec 2.11: cdiv(max_model_len, B) + cdiv(T, B) (K13)."""
    return cdiv(max_model_len, block_size) + cdiv(max_tokens, block_size)


def num_index_groups(leaders: Sequence[bool]) -> int:
    """``runtime.build_index_groups``: one group per leader; the first layer
    starts one even when it is not a leader."""
    if not leaders:
        return 0
    return sum(leaders) + (0 if leaders[0] else 1)


def hot_slot_state_bytes(
    num_groups: int, limits: BatchLimits, device_buffer_size: int
) -> int:
    """dgi/lru/stats per index group (6·(S+1)·H + 32 B, spec 3.5) and the
    runtime's shared per-step inputs (``HiSparseRuntime.__init__``)."""
    s, h = limits.max_num_seqs, device_buffer_size
    per_group = (s + 1) * h * (INT32 + INT16) + STATS_COUNTERS * UINT64
    shared = (
        s * INT32  # req_state
        + limits.max_num_batched_tokens * INT32  # row_req
        + h * INT16  # the LRU reset row 0..H-1
    )
    return num_groups * per_group + shared


def workspace_rows(limits: BatchLimits, max_decode_query_len: int) -> int:
    """R_ws = min(max_num_batched_tokens, max_num_seqs · q) (spec 2.8)."""
    return min(limits.max_num_batched_tokens, limits.max_num_seqs * max_decode_query_len)


def workspace_bytes(rows: int, top_k: int) -> int:
    """``Workspace.allocate``: three int32 [R, K] and two int32 [R]."""
    return 3 * rows * top_k * INT32 + 2 * rows * INT32


def step_order_bytes(rows: int, top_k: int) -> int:
    """K7's ``StepOrder`` (order_misses="step"): four int32 [R * K] lists, the
    int32 total, and CUB's radix-sort scratch, estimated as its alternate
    key and value buffers plus 1 MiB for the passes' histograms (the exact
    size is asked of CUB on the GPU; check_worker_reserve reports a miss)."""
    cells = rows * top_k
    return 4 * cells * INT32 + INT32 + 2 * cells * INT32 + MiB


def prefill_staging_bytes(max_model_len: int, block_size: int, row_bytes: int) -> int:
    """``StagingCache``: the [C, B, W] cache (C = pages + 1, block 0 null),
    its int32 [1, C - 1] block table and its int32 [1] start."""
    pages = cdiv(max_model_len, block_size)
    return (pages + 1) * block_size * row_bytes + pages * INT32 + INT32


def mirror_bytes(num_layers: int, max_tokens: int) -> int:
    """``MirrorPlan`` of the writer rank: src/dst/nbytes int64 [L·T] and the
    per-layer pair, source and destination bases int64 [L]."""
    return 3 * num_layers * max_tokens * INT64 + 3 * num_layers * INT64


def drafter_slot_bytes(layout: HiSparseLayout, max_tokens: int) -> int:
    """``drafter.DraftBinding``: one int64 [T] slot buffer per group an MTP
    layer writes with (``layout.draft_write_group_ids``)."""
    return len(layout.draft_write_group_ids) * max_tokens * INT64


def block_table_bytes(
    num_groups: int, limits: BatchLimits, max_model_len: int, block_size: int
) -> int:
    """The device half of vLLM's ``BlockTable`` for ``num_groups`` groups:
    int32 [S, cdiv(max_model_len, B)] and an int64 [T] slot mapping each
    (DCP = 1 under HiSparse, so one entry per page)."""
    per_group = (
        limits.max_num_seqs * cdiv(max_model_len, block_size) * INT32
        + limits.max_num_batched_tokens * INT64
    )
    return num_groups * per_group


# --------------------------------------------------------------------------
# The reserve
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HiSparseGpuReserve:
    """GPU bytes HiSparse takes per worker outside the pool's N_gpu blocks."""

    bytes_per_block: int
    staging_blocks: int
    """In-slab staging blocks (K13), past the pool in the KV slab."""
    hot_slot_state: int
    workspace: int
    prefill_staging: int
    mirror: int
    block_tables: int
    drafter_slots: int = 0
    """The MTP drafter's slot buffers (docs/mtp.md 3.11); 0 without one."""

    @property
    def staging_bytes(self) -> int:
        return self.staging_blocks * self.bytes_per_block

    @property
    def worker_state(self) -> int:
        """What the HiSparse worker itself allocates when it binds (the
        runtime, the data plane and the staging cache)."""
        return (
            self.hot_slot_state
            + self.workspace
            + self.prefill_staging
            + self.mirror
            + self.drafter_slots
        )

    @property
    def total(self) -> int:
        return self.staging_bytes + self.worker_state + self.block_tables

    def describe(self) -> str:
        """The startup line (one message for the engine and the docs)."""
        return (
            f"HiSparse: reserved {self.total / MiB:.1f} MiB of GPU memory per worker "
            "outside the KV pool, counted before KV sizing (in-slab staging "
            f"{self.staging_blocks} blocks {self.staging_bytes / MiB:.1f} MiB, "
            f"hot-slot state {self.hot_slot_state / MiB:.1f} MiB, resolver "
            f"workspace {self.workspace / MiB:.1f} MiB, prefill staging cache "
            f"{self.prefill_staging / MiB:.1f} MiB, mirror descriptors "
            f"{self.mirror / MiB:.1f} MiB, block tables of the HiSparse groups "
            f"{self.block_tables / MiB:.1f} MiB"
            + (
                f", MTP drafter slots {self.drafter_slots / MiB:.1f} MiB)."
                if self.drafter_slots
                else ")."
            )
        )


def hisparse_gpu_reserve(
    layout: HiSparseLayout, limits: BatchLimits, max_model_len: int
) -> HiSparseGpuReserve:
    """HiSparse's GPU bytes per worker beyond the pool's blocks (pure:
    layout + limits + length, independent of the pool size; spec 2.8, 2.11,
    3.5)."""
    b, t = layout.block_size, limits.max_num_batched_tokens
    # vLLM profiles and would allocate one group's block table; HiSparse's
    # split adds the others (source, indexer, resident and hot groups).
    extra_groups = max(len(layout.kv_cache_groups) - 1, 0)
    rows = workspace_rows(limits, layout.max_decode_query_len)
    return HiSparseGpuReserve(
        bytes_per_block=layout.bytes_per_block,
        staging_blocks=staging_block_count(max_model_len, b, t),
        hot_slot_state=hot_slot_state_bytes(
            num_index_groups(layout.leaders),
            limits,
            layout.device_buffer_size,
        ),
        workspace=workspace_bytes(rows, layout.index_topk)
        + (step_order_bytes(rows, layout.index_topk)
           if layout.order_misses == "step" else 0),
        prefill_staging=prefill_staging_bytes(max_model_len, b, layout.row_bytes),
        mirror=mirror_bytes(layout.num_sparse_layers, t),
        block_tables=block_table_bytes(extra_groups, limits, max_model_len, b),
        drafter_slots=drafter_slot_bytes(layout, t),
    )


def max_pool_blocks(
    layout: HiSparseLayout, limits: BatchLimits, max_model_len: int, budget: int
) -> int:
    """The largest N_gpu whose pool and reserve fit ``budget`` bytes
    (negative when the reserve alone does not)."""
    fixed = hisparse_gpu_reserve(layout, limits, max_model_len).total
    return (budget - fixed) // layout.bytes_per_block


def reserved_blocks(
    layout: HiSparseLayout, limits: BatchLimits, max_model_len: int
) -> int:
    """The reserve in whole blocks, for auto-fit's search."""
    reserve = hisparse_gpu_reserve(layout, limits, max_model_len)
    return cdiv(reserve.total, layout.bytes_per_block)


def require_pool_room(
    layout: HiSparseLayout,
    limits: BatchLimits,
    max_model_len: int,
    pool_blocks: int,
    budget: int,
) -> None:
    """The reserve must leave room for at least one pool block (vLLM's own
    memory check then asks for one request's admission cost)."""
    if pool_blocks > 0:
        return
    reserve = hisparse_gpu_reserve(layout, limits, max_model_len)
    raise HiSparseConfigError(
        f"HiSparse needs {reserve.total / MiB:.1f} MiB of GPU memory outside the KV "
        f"pool at max_model_len={max_model_len}, max_num_seqs={limits.max_num_seqs}, "
        f"max_num_batched_tokens={limits.max_num_batched_tokens}, which leaves no "
        f"room for the pool in the {budget / GiB:.2f} GiB available for the KV "
        "cache. Raise gpu_memory_utilization, or lower max_model_len, "
        "max_num_seqs or hisparse_config.device_buffer_size. "
        + reserve.describe()
    )


def check_override_fits(
    layout: HiSparseLayout,
    limits: BatchLimits,
    max_model_len: int,
    override: int,
    max_blocks: int,
    budget: int,
) -> None:
    """``num_gpu_blocks_override`` sets the pool; HiSparse's reserve comes on
    top of it and the two must fit the memory vLLM measured for the KV cache
    (``gpu_memory_utilization`` or ``kv_cache_memory_bytes``), else startup
    fails naming the largest override that fits (L17)."""
    if override <= max_blocks:
        return
    reserve = hisparse_gpu_reserve(layout, limits, max_model_len)
    needed = override * layout.bytes_per_block + reserve.total
    fix = (
        f"Set num_gpu_blocks_override <= {max_blocks}"
        if max_blocks > 0
        else "Lower max_model_len, max_num_seqs or hisparse_config.device_buffer_size"
    )
    raise HiSparseConfigError(
        f"HiSparse: num_gpu_blocks_override={override} does not fit the "
        f"{budget / GiB:.2f} GiB available for the KV cache: {override} pool blocks "
        f"x {layout.bytes_per_block} B plus {reserve.total / MiB:.1f} MiB outside the "
        f"pool need {needed / GiB:.2f} GiB. {fix}, or raise "
        "gpu_memory_utilization. " + reserve.describe()
    )


def log_hisparse_reserve(reserve: HiSparseGpuReserve) -> None:
    logger.info(reserve.describe())


# --------------------------------------------------------------------------
# What the worker actually holds (binding's check, the tests' oracle)
# --------------------------------------------------------------------------


def _is_hisparse_object(value: object) -> bool:
    return type(value).__module__.startswith("vllm.v1.hisparse.")


def _children(value: object) -> Iterable[object]:
    if isinstance(value, dict):
        return value.values()
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if _is_hisparse_object(value) and hasattr(value, "__dict__"):
        return vars(value).values()
    if is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name) for f in fields(value)]
    return ()


def held_tensor_bytes(
    roots: Iterable[object],
    device_type: str,
    exclude: Iterable[torch.Tensor] = (),
) -> int:
    """Bytes of the distinct ``device_type`` tensor storages reachable from
    ``roots`` through HiSparse objects, containers and dataclasses, less the
    storages of ``exclude`` (the KV slab, the host pool). Generic on purpose:
    a buffer added to the runtime or the worker shows up here without being
    listed, so binding's check and the tests catch it."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            ptr = storage.data_ptr()
            if value.device.type == device_type and ptr not in skip:
                storages[ptr] = storage.nbytes()
            continue
        stack.extend(_children(value))
    return sum(storages.values())


def check_worker_reserve(
    reserve: HiSparseGpuReserve | None, allocated: int
) -> None:
    """Warn when the worker holds more than the engine reserved for it: the
    excess is outside ``gpu_memory_utilization`` (docs/layout.md L17)."""
    if reserve is None or allocated <= reserve.worker_state:
        return
    logger.warning(
        "HiSparse: the worker holds %.1f MiB of GPU state, %.1f MiB more than the "
        "%.1f MiB reserved before KV sizing; the excess is outside "
        "gpu_memory_utilization (update vllm/v1/hisparse/memory.py).",
        allocated / MiB,
        (allocated - reserve.worker_state) / MiB,
        reserve.worker_state / MiB,
    )


__all__ = [
    "BatchLimits",
    "HiSparseGpuReserve",
    "MiB",
    "check_override_fits",
    "check_worker_reserve",
    "held_tensor_bytes",
    "hisparse_gpu_reserve",
    "log_hisparse_reserve",
    "max_pool_blocks",
    "num_index_groups",
    "require_pool_room",
    "reserved_blocks",
    "staging_block_count",
]
