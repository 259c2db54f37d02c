# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's KV-cache coordinator when HiSparse is on (spec 2.4-2.5).

``HiSparseKVCacheCoordinator`` is vLLM's hybrid coordinator with two block
pools and two block-id namespaces that never mix:

- the GPU pool (``HiSparseGpuBlockPool``: ``UnpinBlockPool`` plus the host
  pool's events and reset) serves the indexer, resident, hot and other
  groups; it is the pool the KV-cache manager, its usage metrics, its free
  check, ``evict_blocks`` and the KV connectors see;
- the host pool (``HiSparseHostBlockPool``) serves only the source group.
  Its blocks never reach the GPU pool, its KV events are tagged CPU, and it
  is never part of GPU capacity.

It wires the three HiSparse managers to one ``HiSparseCoordinator`` and
forwards the per-step hooks: ``cache_blocks`` (after each request's
allocation) drives materialization and residency, ``free`` /
``pop_blocks_for_free`` let the coordinator turn clean pages into readable
copies before the managers release the rest. It also reports every hot
region it allocates (lockstep allocation of the hot set) and releases
(``free`` / ``pop_blocks_for_free``), by the region's first block in the
first hot group, for the workers' state slots (INV-5, INV-24).
"""

from collections.abc import Sequence

from vllm.distributed.kv_events import MEDIUM_CPU, KVCacheEvent
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.hisparse.block_pool import UnpinBlockPool
from vllm.v1.hisparse.constants import (
    ADMISSION_RETRY_STEPS,
    DECODE_RESERVE_MAX_PAGES,
    HOST_WRITER_RANK,
)
from vllm.v1.hisparse.coordinator import HiSparseCoordinator
from vllm.v1.hisparse.kv_cache_config import HiSparseKVCacheConfig
from vllm.v1.hisparse.managers import (
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
)
from vllm.v1.request import Request

logger = init_logger(__name__)


def output_pages_to_come(
    num_prompt_tokens: int, max_tokens: int, num_tokens: int, held_pages: int,
    max_model_len: int, block_size: int,
) -> int:
    """R34: the pages a request still grows in each GPU-only group, from
    what it holds or has reserved (its tokens so far: the in-flight prefill
    reservation covers them) to min(prompt + max_tokens, max_model_len), at
    most DECODE_RESERVE_MAX_PAGES."""
    end = min(num_prompt_tokens + max_tokens, max_model_len)
    now = max(held_pages, cdiv(num_tokens, block_size))
    return min(max(cdiv(end, block_size) - now, 0), DECODE_RESERVE_MAX_PAGES)


class HiSparseHostBlockPool(BlockPool):
    """The pinned host pool's block accounting (source group only)."""

    def take_events(self) -> list[KVCacheEvent]:
        events = super().take_events()
        for event in events:
            if hasattr(event, "medium"):
                event.medium = MEDIUM_CPU
        return events


class HiSparseGpuBlockPool(UnpinBlockPool):
    """The shared GPU pool. ``KVCacheManager`` drains events and resets the
    prefix cache through this pool only, so it speaks for the host pool too."""

    host_pool: BlockPool | None = None
    hisparse: HiSparseCoordinator | None = None

    def take_events(self) -> list[KVCacheEvent]:
        events = super().take_events()
        if self.host_pool is not None:
            events.extend(self.host_pool.take_events())
        return events

    def reset_prefix_cache(self) -> bool:
        host = self.host_pool
        if host is not None and host.get_num_free_blocks() != host.num_gpu_blocks - 1:
            logger.warning(
                "Failed to reset the HiSparse host prefix cache: %d host blocks "
                "are still in use.",
                host.num_gpu_blocks - 1 - host.get_num_free_blocks(),
            )
            return False
        if not super().reset_prefix_cache():
            return False
        if host is not None:
            host.reset_prefix_cache()
        if self.hisparse is not None:
            self.hisparse.clear_copies()
        return True


class ResidencyClient:
    """A scheduler-side KV connector that works on the residency coordinator
    behind the scheduler's GPU pool (HiSparse's connector, offloader and
    importer): ``bind_gpu_block_pool`` calls ``bind_residency``."""

    NOT_A_HISPARSE_LAYOUT = "this connector needs the HiSparse KV-cache layout"
    """The error for a pool without one (each connector says what to set)."""
    _hisparse: HiSparseCoordinator | None = None

    def bind_residency(self, gpu_block_pool: BlockPool) -> HiSparseCoordinator:
        hisparse = getattr(gpu_block_pool, "hisparse", None)
        if hisparse is None:
            raise ValueError(self.NOT_A_HISPARSE_LAYOUT)
        self._hisparse = hisparse
        return hisparse

    @property
    def hisparse(self) -> HiSparseCoordinator:
        assert self._hisparse is not None, "bind_gpu_block_pool was not called"
        return self._hisparse


class HiSparseKVCacheCoordinator(HybridKVCacheCoordinator):
    """Hybrid coordinator with a host pool for the source group."""

    block_pool_cls = HiSparseGpuBlockPool
    # R26: an admission leaves free what running prefills still need, so a
    # long prefill is never preempted by requests admitted after it.
    reserves_for_inflight_prefills = True

    def __init__(
        self,
        kv_cache_config: HiSparseKVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ):
        if not enable_caching:
            raise ValueError(
                "HiSparse needs prefix caching (the host pool is the prefix "
                "cache of sparse-MLA KV); remove --no-enable-prefix-caching."
            )
        layout = kv_cache_config.layout
        if scheduler_block_size != layout.block_size or hash_block_size != layout.block_size:
            raise ValueError(
                f"HiSparse needs one block size for scheduling, hashing and "
                f"every group; got scheduler {scheduler_block_size}, hash "
                f"{hash_block_size}, layout {layout.block_size}."
            )
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            metrics_collector=metrics_collector,
        )
        gpu_pool = self.block_pool
        assert isinstance(gpu_pool, HiSparseGpuBlockPool)
        self.host_pool = HiSparseHostBlockPool(
            num_gpu_blocks=kv_cache_config.host_num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.layout = layout
        self.source_group_id = layout.SOURCE_GROUP_ID
        self.resident_group_ids = tuple(layout.resident_group_ids)
        self.hot_group_ids = tuple(layout.hot_group_ids)
        self.hisparse = HiSparseCoordinator(
            gpu_pool=gpu_pool,
            host_pool=self.host_pool,
            block_size=layout.block_size,
            max_model_len=max_model_len,
            cap_res_pages=layout.cap_res_pages(max_model_len),
            hot_blocks_per_request=layout.hot_blocks * len(self.hot_group_ids),
            host_writer_rank=HOST_WRITER_RANK
            if kv_cache_config.host_pool.shared
            else None,
            max_in_flight_tokens=max_in_flight_tokens,
        )
        gpu_pool.host_pool = self.host_pool
        gpu_pool.hisparse = self.hisparse
        self._replace_hisparse_managers(kv_cache_config)
        self.verify_and_split_kv_cache_groups()
        # Resident groups (and hot groups) move in lockstep: same page count,
        # same allocation decisions (INV-7, INV-5). The per-step hot path
        # asks the first of each set and applies the answer to all, instead
        # of looping over every group per request.
        self._lockstep = tuple(
            g for g in (self.resident_group_ids, self.hot_group_ids) if g
        )
        # A hot region is named by its first block in the first hot group
        # (the workers key a request-state slot by it, INV-5/INV-24).
        self._hot_lead = self.hot_group_ids[0] if self.hot_group_ids else None
        paired = {*self.resident_group_ids, *self.hot_group_ids}
        self._own_group_ids = tuple(
            g for g in range(len(self.single_type_managers)) if g not in paired
        )
        # The spec groups whose prefix hits come from the GPU prefix cache.
        self._gpu_hit_groups = tuple(
            g for g in self.attention_groups
            if not set(g.group_ids) & {self.source_group_id, *paired}
        )
        # (group asked, how many groups its answer stands for)
        self._lead_groups = tuple((g, 1) for g in self._own_group_ids) + tuple(
            (ids[0], len(ids)) for ids in self._lockstep
        )
        managers = self.single_type_managers
        # Groups whose manager frees blocks outside an attention window; full
        # attention never does, so for it remove_skipped_blocks is skipped.
        self._skipping_group_ids = tuple(
            g for g in self._own_group_ids
            if type(managers[g]).get_num_skipped_tokens
            is not SingleTypeKVCacheManager.get_num_skipped_tokens
        )
        # R34: the GPU groups that grow a block per page and never give one
        # back (the indexer, any other full-attention group); the source
        # group's blocks are host blocks.
        self._growth_group_ids = tuple(
            g for g in self._own_group_ids
            if g != self.source_group_id and isinstance(managers[g], FullAttentionManager)
        )
        # A settled request's "room" (tokens its tables hold without any
        # allocation) is exact when every group holds cdiv(tokens, B) blocks:
        # full attention everywhere but the hot groups (their region is
        # complete once the request is settled).
        self._room_group_ids: tuple[int, ...] | None = None
        if all(isinstance(managers[g], FullAttentionManager) for g in self._own_group_ids):
            self._room_group_ids = (*self._own_group_ids, *self.resident_group_ids[:1])
        # allocate_slots only tests the result with any(): never mutated.
        self._no_new_blocks: tuple[list[KVCacheBlock], ...] = tuple(
            [] for _ in managers
        )
        # This step's last cost computation that exceeded the free blocks
        # (R25/R26): the pages the request may give up to fit, and what it
        # still lacks. allocate_slots asks for the cost, then allocates.
        self._give_up: tuple[str, list[int]] | None = None
        self._shortfall: tuple[str, int, int] | None = None
        # R28 (spec 2.11, F21): chunks FlashMLA sparse runs on its decode
        # kernel stage their host-only context in the slab's staging blocks;
        # the pages this step's such chunks may stage stay within them.
        self._staging_blocks = kv_cache_config.staging_blocks
        self._extend_tokens = range(
            layout.max_decode_query_len + 1, kv_cache_config.decode_kernel_tokens + 1
        )
        self._staged_this_step = 0
        self._staging_claim: tuple[str, int] | None = None
        self._staging_full: str | None = None
        # R35: the last admission that failed for lack of blocks (request
        # id, blocks available to it then, step), and the step count.
        self._admission_failure: tuple[str, int, int] | None = None
        self._steps = 0

    def _replace_hisparse_managers(self, config: HiSparseKVCacheConfig) -> None:
        """Swap the registry's default managers of the HiSparse groups for
        the HiSparse ones (the source one on the host pool)."""
        managers = list(self.single_type_managers)

        def common(gid: int, pool: BlockPool) -> dict:
            return dict(
                kv_cache_spec=config.kv_cache_groups[gid].kv_cache_spec,
                block_pool=pool,
                enable_caching=self.enable_caching,
                kv_cache_group_id=gid,
                scheduler_block_size=self.scheduler_block_size,
            )

        sid = self.source_group_id
        managers[sid] = HiSparseSourceManager(
            **common(sid, self.host_pool),
            hisparse=self.hisparse,
            unsatisfiable_gpu_cost=self.block_pool.num_gpu_blocks + 1,
        )
        for gid in self.resident_group_ids:
            managers[gid] = HiSparseResidentManager(
                **common(gid, self.block_pool),
                max_admission_blocks_per_request=self.hisparse.cap_res_pages,
            )
        for gid in self.hot_group_ids:
            managers[gid] = HiSparseHotManager(
                **common(gid, self.block_pool),
                hisparse=self.hisparse,
                region_blocks=self.layout.hot_blocks,
            )
        self.single_type_managers = tuple(managers)
        self.hisparse.bind_managers(
            managers[sid],
            [managers[g] for g in self.resident_group_ids],
            [managers[g] for g in self.hot_group_ids],
        )

    # ----------------------------------------------------- prefix hits (4.14)

    def find_longest_cache_hit(
        self,
        block_hashes: list[BlockHash],
        max_cache_hit_length: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """The start is min(host hit, indexer/other hits), block-aligned.

        The source group looks up the host pool; the indexer and other groups
        look up the GPU pool, capped at the host hit (INV-31: every page
        below the start has a host copy and a resident indexer block).
        Resident groups start with null entries and hot groups with nothing:
        they never constrain the hit. EAGLE/MTP drop one block of the final
        common hit, as the pin does per group.
        """
        groups = self.kv_cache_config.kv_cache_groups
        b = self.scheduler_block_size
        sid = self.source_group_id
        src_hits, length = HiSparseSourceManager.find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_cache_hit_length,
            kv_cache_group_ids=[sid],
            block_pool=self.host_pool,
            kv_cache_spec=groups[sid].kv_cache_spec,
            drop_eagle_block=False,
            alignment_tokens=b,
        )
        hits: dict[int, list[KVCacheBlock]] = {sid: src_hits[0]}
        while length > 0:
            start = length
            for spec, group_ids, manager_cls, _ in self._gpu_hit_groups:
                blocks, group_len = manager_cls.find_longest_cache_hit(
                    block_hashes=block_hashes,
                    max_length=length,
                    kv_cache_group_ids=group_ids,
                    block_pool=self.block_pool,
                    kv_cache_spec=spec,
                    drop_eagle_block=False,
                    alignment_tokens=b,
                )
                length = min(length, group_len)
                hits.update(zip(group_ids, blocks))
            if length == start:
                break
        if self.eagle_group_ids and length > 0:
            length -= b
        num_pages = length // b
        null = self.block_pool.null_block
        out: list[list[KVCacheBlock]] = []
        for gid in range(len(groups)):
            if gid in self.resident_group_ids:
                out.append([null] * num_pages)
            elif gid in self.hot_group_ids:
                out.append([])
            else:
                out.append(hits.get(gid, [])[:num_pages])
        return tuple(out), length, 0

    def find_longest_cache_hit_per_group(
        self,
        block_hashes: list[BlockHash],
        max_cache_hit_length: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        # The pin uses this for models with mamba layers only; should it be
        # reached, per-group hits must still use the right pool per group.
        blocks, length, _ = self.find_longest_cache_hit(
            block_hashes, max_cache_hit_length
        )
        return blocks, tuple(length for _ in blocks)

    # ----------------------------------------------------- per-step hooks

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        if apply_admission_cap:
            return self._blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                num_local_computed_tokens, num_tokens_main_model, True)
        total = 0 if self._fits(request_id, num_tokens) else self._blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, False)
        if not self._claim_staging(request_id, total_computed_tokens,
                                   num_tokens_main_model, new_computed_blocks, total):
            return self.block_pool.num_gpu_blocks + 1  # not this step (R28)
        return total

    def _blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool,
    ) -> int:
        managers = self.single_type_managers
        total = 0
        for gid, multiplicity in self._lead_groups:
            n = managers[gid].get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks[gid],
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
            )
            total += n * multiplicity
        if apply_admission_cap:
            return total  # the admission gate: nothing is held yet
        return self._net_of_pages_given_up(request_id, num_tokens, total)

    def _net_of_pages_given_up(self, request_id: str, num_tokens: int, total: int) -> int:
        """The cost when the pool is short (R25): a running request with
        clean pinned pages gives them up inside this allocation (its hot
        region is then part of it), so it costs the region minus the blocks
        it frees. Records what it still lacks for the wait decision (R26)."""
        self._give_up = self._shortfall = None
        free = self.block_pool.get_num_free_blocks()
        if total <= free:
            return total
        hs = self.hisparse
        pages = hs.reclaimable_pages(request_id, num_tokens)
        if pages:
            net = (total + hs.missing_region_blocks(request_id)
                   - len(pages) * len(self.resident_group_ids))
            if net < total:
                total = net
                self._give_up = (request_id, pages)
        if total > free:
            self._shortfall = (request_id, num_tokens, total - free)
        return total

    def _claim_staging(
        self, request_id: str, computed: int, end: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...], num_new_blocks: int,
    ) -> bool:
        """R28: may this chunk run now? A chunk FlashMLA sparse runs on its
        decode kernel has its host-only context pages staged in the slab;
        together with this step's earlier such chunks they must fit the
        staging blocks. The first chunk of a step always runs: one
        request's context always fits (C_stage >= cdiv(max_model_len, B)).
        An admission's prefix hits (``new_computed_blocks``) and the
        ``num_new_blocks`` it allocates let a host prefix hit not count the
        pages it adopts (R33)."""
        self._staging_claim = None
        if end - computed not in self._extend_tokens:
            return True
        sid = self.source_group_id
        # The free blocks the allocation may pop: its own, plus the GPU
        # prefix hits its touches take out of the queue (the source group's
        # hits are host blocks).
        popped = num_new_blocks + sum(
            len(b) for gid, b in enumerate(new_computed_blocks) if gid != sid)
        pages = self.hisparse.staged_pages_bound(
            request_id, computed, end, new_computed_blocks[sid], popped)
        if pages and self._staged_this_step + pages > self._staging_blocks \
                and self._staged_this_step:
            self._staging_full = request_id
            self.hisparse.stats.staging_deferrals += 1
            return False
        self._staging_claim = (request_id, pages)
        return True

    def admission_reserve_blocks(self, request: Request) -> int:
        """R34 (P4): blocks an admission leaves free for the output growth of
        the requests HiSparse tracks (running, or loading) and of
        ``request`` itself. The indexer (and any other GPU-only group)
        gains a block per page and never gives one back, while a resident
        page is given up as the next one is allocated (R25); so once the
        pool is full of indexer pages and hot regions, a decode that
        crosses a page boundary had nothing to take and preempted
        (bench-agentic run 12). O(requests) per admission attempt."""
        if not self._growth_group_ids:
            return 0
        rid = request.request_id
        pages = self._output_pages_to_come(request, 0)
        lead = self.single_type_managers[self._growth_group_ids[0]].req_to_blocks
        for st in self.hisparse.states.values():
            other = st.request
            if other is not None and other.request_id != rid:
                pages += self._output_pages_to_come(other, len(lead.get(other.request_id, ())))
        return pages * len(self._growth_group_ids)

    def admission_failed(self, request: Request, reserved_blocks: int) -> None:
        """R35: ``request``'s admission found too few blocks beside
        ``reserved_blocks`` (the scheduler's in-flight reservations and
        R34's). Not for R28's staging refusal: that one clears next step."""
        if self._staging_full == request.request_id:
            return
        available = self.block_pool.get_num_free_blocks() - reserved_blocks
        self._admission_failure = (request.request_id, available, self._steps)

    def admission_backs_off(self, request: Request, inflight_reserved: int) -> bool:
        """R35: skip this step's attempt to admit ``request`` (its prefix
        lookups and allocation) when it failed for lack of blocks within
        the last ADMISSION_RETRY_STEPS steps and the blocks available to it
        (free, less ``inflight_reserved`` and R34's reserve) are no more
        than then: the same lookups would find the same shortage. A block
        released (a request finished, a page given up net of its
        replacement) makes it try at once; the bound covers a need that
        shrank instead (a prefix hit published meanwhile). Safe either way:
        a skipped attempt only waits, as a failed one does."""
        failure = self._admission_failure
        if failure is None or failure[0] != request.request_id:
            return False
        if self._steps - failure[2] >= ADMISSION_RETRY_STEPS:
            return False
        available = (self.block_pool.get_num_free_blocks() - inflight_reserved
                     - self.admission_reserve_blocks(request))
        if available > failure[1]:
            return False
        self.hisparse.stats.admission_backoffs += 1
        return True

    def _output_pages_to_come(self, request: Request, held: int) -> int:
        return output_pages_to_come(
            request.num_prompt_tokens, request.max_tokens or 0, request.num_tokens, held,
            self.max_model_len, self.scheduler_block_size)

    def waits_for_in_flight_blocks(self, request_id: str) -> bool:
        """R26 (F20): the running request's allocation just failed; wait a
        step instead of preempting when the transfers in flight release the
        blocks it lacks (their completions arrive in later steps' output,
        INV-15). Never for a host-pool shortage (INV-6: that preempts)."""
        if self._staging_full == request_id:
            return True  # the staging blocks are this step's; next step (R28)
        short = self._shortfall
        if short is None or short[0] != request_id:
            return False
        _, num_tokens, missing = short
        released = self.hisparse.blocks_released_by_in_flight(request_id, num_tokens)
        if released < missing:
            return False
        self.hisparse.stats.waits_for_in_flight += 1
        return True

    def new_step_starts(self) -> None:
        super().new_step_starts()
        self._steps += 1
        self._give_up = self._shortfall = None
        self._staged_this_step = 0
        self._staging_claim = self._staging_full = None

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        claim, self._staging_claim = self._staging_claim, None
        if claim is not None and claim[0] == request_id:
            self._staged_this_step += claim[1]
        if self._fits(request_id, num_tokens):
            return self._no_new_blocks
        give_up, self._give_up = self._give_up, None
        if give_up is not None and give_up[0] == request_id:
            # Before any pool call, so this allocation can reuse them (R25).
            self.hisparse.give_up_pages(request_id, give_up[1])
        managers = self.single_type_managers
        out: list[list[KVCacheBlock]] = [[] for _ in managers]
        for gid in self._own_group_ids:
            out[gid] = managers[gid].allocate_new_blocks(
                request_id, num_tokens, num_tokens_main_model
            )
        for group_ids in self._lockstep:
            lead = managers[group_ids[0]]
            n = lead.num_new_blocks(request_id, num_tokens)
            if n == 0:
                continue
            new_region = group_ids[0] == self._hot_lead and not lead.req_to_blocks.get(
                request_id
            )
            # One pool call for the whole set; reuse watchers fire inside it.
            blocks = self.block_pool.get_new_blocks(n * len(group_ids))
            for i, gid in enumerate(group_ids):
                out[gid] = blocks[i * n:(i + 1) * n]
                managers[gid].append_blocks(request_id, out[gid])
            if new_region:
                self.hisparse.note_hot_region_allocated(request_id, blocks[0])
        self.hisparse.note_allocated(request_id)
        return tuple(out)

    def _fits(self, request_id: str, num_tokens: int) -> bool:
        """A settled request whose tables already hold ``num_tokens``: no
        group allocates (the per-step decode fast path)."""
        st = self.hisparse.states.get(request_id)
        return st is not None and num_tokens <= st.room

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # Resident and hot groups never skip tokens (full attention).
        for gid in self._skipping_group_ids:
            self.single_type_managers[gid].remove_skipped_blocks(
                request_id, processed_computed_tokens, num_prompt_tokens
            )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the source (publish when durable), indexer and other groups
        (the pin's rule, including the EAGLE lookahead block); resident and
        hot groups are never prefix-cached. Then run the residency step."""
        if self.hisparse.is_settled(request.request_id, num_computed_tokens):
            return  # no new full page, nothing due: nothing to cache or do
        aligned = num_computed_tokens // self.scheduler_block_size * self.scheduler_block_size
        managers = self.single_type_managers
        for gid in self._own_group_ids:
            manager = managers[gid]
            num_tokens = aligned
            if manager.use_eagle and aligned > 0:
                num_tokens = min(num_computed_tokens, aligned + manager.block_size)
            manager.cache_blocks(
                request, num_tokens, retention_interval=self.retention_interval
            )
        # Mark the request running in the lockstep groups too (the pin's
        # managers use num_cached_block to recognise running requests).
        req_id = request.request_id
        for group_ids in self._lockstep:
            if req_id not in managers[group_ids[0]].num_cached_block:
                for gid in group_ids:
                    managers[gid].num_cached_block.setdefault(req_id, 0)
        self.hisparse.advance_scheduled(request, num_computed_tokens)
        self._set_room(req_id)

    def _set_room(self, request_id: str) -> None:
        st = self.hisparse.states.get(request_id)
        if st is None or self._room_group_ids is None or st.settled_pages < 0:
            return
        managers = self.single_type_managers
        st.room = self.scheduler_block_size * min(
            len(managers[g].req_to_blocks.get(request_id, ())) for g in self._room_group_ids
        )

    def _release_hot_region(self, request_id: str) -> None:
        """Report the request's hot region as released; called once, before
        the managers drop the request's tables."""
        if self._hot_lead is not None:
            region = self.single_type_managers[self._hot_lead].req_to_blocks.get(
                request_id
            )
            if region:
                self.hisparse.note_hot_region_freed(region[0])

    def free(self, request_id: str) -> None:
        self.hisparse.free(request_id)
        self._release_hot_region(request_id)
        super().free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """GPU blocks only: the caller returns them to the GPU pool (possibly
        steps later). Host blocks go back to the host pool now; the in-flight
        step's host writes are stream-ordered before any new owner's, and hot
        entries keyed by their rows are invalidated on reallocation (4.8)."""
        self.hisparse.free(request_id)
        self._release_hot_region(request_id)
        blocks: list[KVCacheBlock] = []
        for gid, manager in enumerate(self.single_type_managers):
            popped = manager.pop_blocks_for_free(request_id)
            if gid == self.source_group_id:
                self.host_pool.free_blocks(reversed(popped))
            else:
                blocks.extend(popped)
        return blocks
