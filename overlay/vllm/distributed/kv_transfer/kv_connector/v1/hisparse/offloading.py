# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The OffloadingConnector, restricted to what it may offload under HiSparse
(spec 1.5, 4.14, 6.2; INV-31).

HiSparse splits the sparse-MLA model's KV into source, indexer, resident, hot
and other groups (spec 3.1). Only the indexer and other groups are ordinary
prefix-cacheable GPU KV: the source group's block ids are *host* block ids
(another id namespace), and resident/hot leases are GPU caches of host data.
The indexer KV therefore keeps the generic offloader, while the sparse-MLA KV
lives in HiSparse's host pool.

``HiSparseOffloadingConnector`` runs the unmodified OffloadingConnector over a
*filtered view*: a ``KVCacheConfig`` holding only the offloadable groups and
their tensors, with group indices remapped at every boundary:

- scheduler side: ``update_state_after_alloc`` (``KVCacheBlocks`` subset),
  ``build_connector_meta`` (a shallow copy of the ``SchedulerOutput`` whose
  per-group block-id tuples keep only the offloadable groups),
  ``request_finished_all_groups``, and ``take_events`` (event ``group_idx``
  mapped back to the real group id);
- worker side: ``register_kv_caches`` gets only the offloadable layers.

Two HiSparse rules are added on top:

- the external (offloaded) hit is capped at the host prefix (spec 4.14), so
  every page below the start has a host copy and an indexer block (INV-31);
  the source and resident managers then take the cached host blocks and null
  resident entries for those pages;
- a step that starts offloader loads waits for the compute stream, since
  their GPU blocks may have been freed after the step in flight was
  scheduled (F16);
- GPU blocks newly leased to resident or hot groups are reported to the
  offloader as reallocated, so a deferred store of a freed indexer block
  that the pool has just handed to a resident/hot lease is flushed before
  this step's forward overwrites it (the pin's reallocation fence, which
  would otherwise see only the groups in its view).
"""

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.hisparse.kv_cache_config import HiSparseKVCacheConfig
from vllm.v1.hisparse.kv_cache_coordinator import ResidencyClient
from vllm.v1.hisparse.layout import HiSparseLayout
from vllm.v1.kv_cache_interface import KVCacheConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

# The pin's set of GPU block ids (re)allocated in the current step; a
# pending store whose source block is in it is flushed before the forward.
_REALLOCATED = "_current_batch_allocated_block_ids"
# The pin's per-request offload state (block ids seen, store limit).
_REQ_STATUS = "_req_status"

_T = TypeVar("_T")

NOT_A_HISPARSE_LAYOUT = (
    "HiSparseOffloadingConnector offloads the indexer KV of a HiSparse layout "
    "and needs --attention-config '{\"hisparse_config\": {...}}'; without "
    "HiSparse use OffloadingConnector."
)


@dataclasses.dataclass(frozen=True)
class OffloadableGroups:
    """Which KV-cache groups the offloader sees, and in which order.

    ``ids[i]`` is the real group id of the offloader's group ``i``.
    ``fenced_ids`` are the GPU groups it must not copy but whose new block
    leases it must see (resident and hot share the GPU pool with the
    indexer). The source group is in neither: its ids are host block ids.
    """

    ids: tuple[int, ...]
    fenced_ids: tuple[int, ...]

    @classmethod
    def from_layout(cls, layout: HiSparseLayout) -> "OffloadableGroups":
        return cls(
            ids=(layout.INDEXER_GROUP_ID, *layout.other_group_ids),
            fenced_ids=(*layout.resident_group_ids, *layout.hot_group_ids),
        )

    def select(self, per_group: Sequence[Any]) -> tuple[Any, ...]:
        """The offloader's view of a per-group sequence."""
        return tuple(per_group[g] for g in self.ids)

    def select_optional(self, per_group: Sequence[Any] | None) -> tuple | None:
        return None if per_group is None else self.select(per_group)

    def fenced_block_ids(self, per_group: Sequence[Sequence[int]]) -> Iterator[int]:
        for g in self.fenced_ids:
            yield from (b for b in per_group[g] if b)  # 0 is the null block


def offloadable_kv_cache_config(
    config: HiSparseKVCacheConfig, groups: OffloadableGroups
) -> KVCacheConfig:
    """A plain ``KVCacheConfig`` with the offloadable groups and only their
    layers' tensors. Tensors shared with resident/hot layers keep only the
    offloadable names; tensors left without one are dropped, so the
    offloader's worker never looks up a virtual or host layer."""
    kept = {name for g in groups.ids for name in config.kv_cache_groups[g].layer_names}
    tensors = []
    for tensor in config.kv_cache_tensors:
        names = [n for n in tensor.shared_by if n in kept]
        if names:
            tensors.append(dataclasses.replace(tensor, shared_by=names))
    return KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[config.kv_cache_groups[g] for g in groups.ids],
    )


def scheduler_output_view(
    scheduler_output: SchedulerOutput, groups: OffloadableGroups
) -> SchedulerOutput:
    """A shallow copy whose per-group fields keep only the offloadable
    groups (the request data objects are copied, never mutated).

    Once per step, so a plain attribute copy (``dataclasses.replace``
    re-runs ``__init__``: ~4x the time), and the cached requests' data is
    shared as is on the usual decode step where none got a new block
    (issue 16: the composed offloader adds nothing HiSparse can avoid)."""
    view = _shallow_copy(scheduler_output)
    if scheduler_output.scheduled_new_reqs:
        view.scheduled_new_reqs = [
            dataclasses.replace(req, block_ids=groups.select(req.block_ids))
            for req in scheduler_output.scheduled_new_reqs
        ]
    cached = scheduler_output.scheduled_cached_reqs
    if any(ids is not None for ids in cached.new_block_ids):
        view.scheduled_cached_reqs = _shallow_copy(cached)
        view.scheduled_cached_reqs.new_block_ids = [
            groups.select_optional(ids) for ids in cached.new_block_ids
        ]
    common = scheduler_output.num_common_prefix_blocks
    if common:
        view.num_common_prefix_blocks = list(groups.select(common))
    return view


class HiSparseOffloadingConnector(ResidencyClient, OffloadingConnector):
    """OffloadingConnector over the indexer and other groups of a HiSparse
    layout (see the module docstring)."""

    NOT_A_HISPARSE_LAYOUT = NOT_A_HISPARSE_LAYOUT

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        if not isinstance(kv_cache_config, HiSparseKVCacheConfig):
            raise ValueError(NOT_A_HISPARSE_LAYOUT)
        layout = kv_cache_config.layout
        self._groups = OffloadableGroups.from_layout(layout)
        self._block_size = layout.block_size
        self._offloadable_layers = frozenset(
            name
            for g in self._groups.ids
            for name in kv_cache_config.kv_cache_groups[g].layer_names
        )
        super().__init__(
            vllm_config,
            role,
            offloadable_kv_cache_config(kv_cache_config, self._groups),
        )
        sched = self.connector_scheduler
        if sched is not None and not (
            isinstance(getattr(sched, _REALLOCATED, None), set)
            and isinstance(getattr(sched, _REQ_STATUS, None), dict)
        ):
            # Fail at startup, not silently at run time, if the pin's
            # reallocation fence (see _fence) or its request state
            # (see _cap_finished_stores) moves.
            raise RuntimeError(
                f"OffloadingConnectorScheduler.{_REALLOCATED} or {_REQ_STATUS} is "
                "gone; HiSparseOffloadingConnector cannot fence resident/hot "
                "leases or bound the stores of finished requests."
            )

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        # HiSparse's layout builder packs its own device slab (several
        # groups); the runner's single-group cross-layer tensor never applies.
        return False

    # ----------------------------------------------------------- binding

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        """The HiSparse GPU pool carries the residency coordinator, which
        knows the host prefix (MultiConnector forwards this to every child)."""
        self.bind_residency(gpu_block_pool)
        super().bind_gpu_block_pool(gpu_block_pool)

    # ----------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The offloader's indexer hit, capped at the host prefix (4.14)."""
        num_tokens, load_async = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if num_tokens:
            num_tokens = min(
                num_tokens, self._external_end(request) - num_computed_tokens
            )
            if num_tokens <= 0:
                num_tokens, load_async = 0, False
        if not num_tokens:
            # None: lookup pending; 0: no hit (forget an earlier attempt's).
            self.hisparse.no_external(request.request_id)
            return num_tokens, load_async
        # The source manager takes the cached host blocks of these pages; an
        # async load defers the hot region until the load ends.
        self.hisparse.expect_external(request, load_async=load_async)
        return num_tokens, load_async

    def _external_end(self, request: "Request") -> int:
        """Where loaded indexer KV must stop (block-aligned).

        At the host prefix h_s: every page below the start needs a host copy
        (INV-31). And, as for a local hit (``max_cache_hit_length =
        num_tokens - 1``), before the last token, which is recomputed to
        sample: its page would have a null resident entry (nowhere to write)
        and a published host block shared with other requests (which must
        not be rewritten).
        """
        b = self._block_size
        before_last = (request.num_tokens - 1) // b * b
        return min(self.hisparse.host_prefix_tokens(request), before_last)

    def update_state_after_alloc(
        self, request: "Request", blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            # A request starting an async load is not in this step's output,
            # so the pin records its (view's) new blocks here; add the
            # resident/hot ones.
            self._fence(
                b.block_id
                for g in self._groups.fenced_ids
                for b in blocks.blocks[g]
                if not b.is_null
            )
        super().update_state_after_alloc(
            request,
            KVCacheBlocks(self._groups.select(blocks.blocks)),
            num_external_tokens,
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        for new_block_ids in _new_block_ids(scheduler_output):
            self._fence(self._groups.fenced_block_ids(new_block_ids))
        self._cap_finished_stores(scheduler_output.finished_req_ids or ())
        return super().build_connector_meta(
            scheduler_output_view(scheduler_output, self._groups)
        )

    def _cap_finished_stores(self, finished_req_ids: Iterable[str]) -> None:
        """A finished request stores only chunks whose GPU blocks it held.

        The pin stores a finished request's chunks up to ``num_tokens`` and
        asserts that it saw a GPU block for each, which a request aborted
        while it waited (never scheduled, preempted, or during an async
        load: its blocks reach the pin only through a scheduled step) did
        not: the engine core died on such a client disconnect (soak run 2).
        It would also store a chunk whose KV was never computed (a request
        aborted mid-prefill holds blocks for tokens it never ran). Capping
        ``max_offload_tokens`` at the blocks seen and at the computed tokens
        stores exactly the KV that exists on the GPU, and nothing for a
        request that held none."""
        status = getattr(self.connector_scheduler, _REQ_STATUS)
        for req_id in finished_req_ids:
            st = status.get(req_id)
            if st is None or not st.req.is_finished():
                continue
            held = min(
                st.req.num_computed_tokens,
                *(
                    len(gs.block_ids) * gc.tokens_per_block
                    for gc, gs in zip(st.config.kv_group_configs, st.group_states)
                ),
            )
            if st.max_offload_tokens is None or st.max_offload_tokens > held:
                st.max_offload_tokens = held

    def _fence(self, block_ids: Iterable[int]) -> None:
        """Report GPU blocks newly leased to resident/hot groups as
        reallocated this step.

        The pin flushes a pending store (of a finished request's block, or a
        preempted one's) before the forward when one of its source blocks is
        reallocated in the same step, but it learns reallocations only from
        the groups in its view. Resident and hot leases come from the same
        GPU pool and overwrite the same bytes, so they must reach the same
        set (``OffloadingConnectorScheduler._current_batch_allocated_block_ids``,
        a private attribute: checked at construction).
        """
        assert self.connector_scheduler is not None
        getattr(self.connector_scheduler, _REALLOCATED).update(block_ids)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return super().request_finished_all_groups(
            request, self._groups.select(block_ids)
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Offload events carry the real group id (the view's index is
        meaningless to a KV-event consumer)."""
        for event in super().take_events():
            group_idx = getattr(event, "group_idx", None)
            if group_idx is not None:
                event.group_idx = self._groups.ids[group_idx]
            yield event

    # ------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._fence_loads()
        super().start_load_kv(forward_context, **kwargs)

    def _fence_loads(self) -> None:
        """F16: the pin's CPU -> GPU loads do not wait on the compute stream,
        and a load's destination blocks may have been freed after the step
        still in flight was scheduled: a finished request's last block, which
        that step still writes (async scheduling runs a finished request's
        last placeholder token), a preempted request's blocks, or an unpinned
        resident page it still reads. A load copied before that step ran
        would be clobbered (no run has shown it: run 23's fence did not
        change run 20's chat_chain difference, which had another cause).
        So a step that starts loads first waits for the compute stream: a
        deliberate host sync, once per step that admits an offloaded hit,
        not per token or per layer."""
        meta = self._connector_metadata
        if meta is not None and getattr(meta, "load_jobs", None):
            _synchronize_compute()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Only the offloadable layers: the runner's dict may also hold the
        resident/hot views and must never lead to host memory."""
        super().register_kv_caches(
            {n: t for n, t in kv_caches.items() if n in self._offloadable_layers}
        )


def _shallow_copy(obj: _T) -> _T:
    """``copy.copy`` of a plain (``__dict__``, no ``__copy__``) dataclass,
    without the pickle protocol's detour."""
    clone = object.__new__(type(obj))
    clone.__dict__.update(obj.__dict__)
    return clone


def _new_block_ids(
    scheduler_output: SchedulerOutput,
) -> Iterator[Sequence[Sequence[int]]]:
    """Each scheduled request's new block ids per group, where it has any
    (``yield_req_data`` less the preemption flag, which costs a membership
    test per request)."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.block_ids
    yield from filter(None, scheduler_output.scheduled_cached_reqs.new_block_ids)


def _synchronize_compute() -> None:
    """Wait for every step enqueued on the compute stream (F16). Without a
    CUDA device (the CPU simulation) nothing runs asynchronously."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


__all__ = [
    "HiSparseOffloadingConnector",
    "OffloadableGroups",
    "offloadable_kv_cache_config",
    "scheduler_output_view",
]
