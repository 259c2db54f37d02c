# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C3: per-group allocation rules of the HiSparse groups (spec 2.4).

Three ``FullAttentionManager`` subclasses, one per role. Each keeps vLLM's own
table (``req_to_blocks``) as the single record of a request's blocks, so the
scheduler, the KV events and the worker see ordinary groups; the residency
logic lives in ``HiSparseCoordinator`` and runs through the hooks below.

- Source: host blocks from the host pool, prefix-cached on host. Its GPU
  admission cost is 0; when the host pool cannot back the request (INV-6) it
  reports an unsatisfiable cost, so the scheduler keeps a new request waiting
  and preempts to make room for a running one (spec 4.15). It publishes only
  durable pages (4.4).
- Resident: GPU pages with null holes ("read from host"); never
  prefix-cached; admission capped at cap_res pages (the in-flight window plus
  the protected tail), since older pages are expected to move to host.
- Hot: a fixed region of cdiv(H, B) blocks, allocated only once the request is
  hot-required, held until the request is freed or preempted (INV-5).
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator


class HiSparseSourceManager(FullAttentionManager):
    """The source group: every page a request computes gets a host block
    (INV-6); prefix caching runs on host blocks."""

    def __init__(
        self,
        *args,
        hisparse: "HiSparseCoordinator",
        unsatisfiable_gpu_cost: int,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.hisparse = hisparse
        # Larger than any GPU free count: "this request cannot be backed".
        self._unsatisfiable = unsatisfiable_gpu_cost

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        host_blocks = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
        )
        if apply_admission_cap:
            host_blocks += 1  # spec 4.15: the prompt plus one tail block
        if host_blocks > self.block_pool.get_num_free_blocks():
            return self._unsatisfiable
        return 0  # host blocks never count against the GPU pool

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        super().add_local_computed_blocks(
            request_id,
            new_computed_blocks,
            num_local_computed_tokens,
            num_external_computed_tokens,
        )
        if new_computed_blocks:
            self.hisparse.commit_host_prefix(request_id, len(new_computed_blocks))

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """External tokens come from an offloader that loads the *indexer*
        KV of a host prefix (spec 4.14): their sparse-MLA KV is already in
        the host pool, so take the cached host blocks, never fresh ones."""
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        first = len(req_blocks)
        last = cdiv(num_local_computed_tokens + num_external_computed_tokens, self.block_size)
        hashes = self.hisparse.external_block_hashes(request_id, first, last)
        blocks = []
        for page, block_hash in enumerate(hashes, start=first):
            cached = self.block_pool.get_cached_block(block_hash, [self.kv_cache_group_id])
            if cached is None:
                raise RuntimeError(
                    f"HiSparse: request {request_id} got external tokens for page "
                    f"{page}, whose host copy is not in the host pool; external "
                    "KV must be capped at the host prefix (spec 4.14)."
                )
            blocks.append(cached[0])
        self.block_pool.touch(blocks)
        req_blocks.extend(blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        self.hisparse.commit_host_prefix(request_id, len(req_blocks))

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        blocks = super().allocate_new_blocks(
            request_id, num_tokens, num_tokens_main_model
        )
        self.hisparse.note_new_source_blocks(blocks)
        return blocks

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
    ) -> None:
        """Publication waits for durability (4.4): the coordinator calls
        ``publish_prefix`` for the part whose host copy is complete."""
        self.num_cached_block.setdefault(request.request_id, 0)
        self.hisparse.publish_when_ready(request, num_tokens)

    def publish_prefix(self, request: Request, num_tokens: int) -> None:
        """Put the first ``num_tokens`` tokens' host blocks in the prefix
        cache (the pin's own hash publication)."""
        FullAttentionManager.cache_blocks(self, request, num_tokens)

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        # Host CoW pairs are host block ids: they go to the HiSparse workers,
        # never to the runner's GPU block copies (two id namespaces).
        # The pin's CoW keeps one reference on each end for its release
        # path; the coordinator takes those over until the copy is done.
        for source, destination in super().take_pending_cow_copies():
            self.hisparse.note_cow(source, destination)
        return []


class HiSparseLockstepManager(FullAttentionManager):
    """A group of a lockstep set (the resident groups, the hot groups): the
    KV-cache coordinator sizes one allocation for the whole set from the
    first group's ``num_new_blocks`` and hands each group its share."""

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        raise NotImplementedError

    def append_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> None:
        """This group's share of a lockstep allocation."""
        self.req_to_blocks[request_id].extend(blocks)


class HiSparseResidentManager(HiSparseLockstepManager):
    """A resident group: the GPU write-back cache of a set of sparse layers.

    A null entry means "read this page from host". Pages are never prefix
    cached; published copies are found through the coordinator's copies
    table instead (4.7). Prefix hits are decided by the HiSparse KV-cache
    coordinator, which starts a hit with null entries here.
    """

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Pages needing a GPU block: every page of ``num_tokens`` except
        those already held and the computed prefix, which is host-only (null
        entries for local and external hits alike), capped at cap_res on
        admission (spec 2.4)."""
        pages = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # Running: its table covers its history (null entries included).
            new = pages - held
        else:
            computed = max(held + len(new_computed_blocks),
                           total_computed_tokens // self.block_size)
            new = pages - computed
        cap = self._max_admission_blocks_per_request
        if apply_admission_cap and cap is not None:
            # The cap bounds the pages still to compute, not the context: a
            # long host-prefix hit still costs up to cap_res new pages.
            new = min(new, cap)
        return max(new, 0)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Pages the lockstep allocation adds for ``num_tokens``."""
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(cdiv(num_tokens, self.block_size) - held, 0)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        # The hit is null placeholders: nothing to touch, nothing cached.
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks and all(b.is_null for b in new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """External (offloaded-indexer) pages are host-only: null entries."""
        req_blocks = self.req_to_blocks[request_id]
        total = cdiv(
            num_local_computed_tokens + num_external_computed_tokens, self.block_size
        )
        req_blocks.extend([self._null_block] * max(total - len(req_blocks), 0))

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
    ) -> None:
        self.num_cached_block.setdefault(request.request_id, 0)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0

    # The residency coordinator changes a table only through these two, so
    # the manager stays the only writer of its ``req_to_blocks``.

    def drop_page(self, request_id: str, page: int) -> KVCacheBlock:
        """Make ``page`` host-only (null entry) and return the block it held;
        the caller owns that block's reference from now on (it is unpinned,
        lost, or handed to the pool as an anonymous copy)."""
        table = self.req_to_blocks[request_id]
        block, table[page] = table[page], self._null_block
        return block

    def adopt_page(self, request_id: str, page: int, block: KVCacheBlock) -> None:
        """Put a surviving GPU copy (the caller touched it) into a null entry
        (INV-23: adoption never replaces a resident block)."""
        self.adopt_pages(request_id, (page,), (block,))

    def adopt_pages(
        self, request_id: str, pages: Sequence[int], blocks: Sequence[KVCacheBlock]
    ) -> None:
        """``adopt_page`` for ``pages[i]`` and ``blocks[i]``, all checked
        before any is written (INV-23)."""
        table = self.req_to_blocks[request_id]
        for page, block in zip(pages, blocks):
            if not table[page].is_null:
                raise AssertionError(
                    f"HiSparse: adopting block {block.block_id} into page {page} of "
                    f"{request_id}, which holds block {table[page].block_id} (INV-23)"
                )
        for page, block in zip(pages, blocks):
            table[page] = block


class HiSparseHotManager(HiSparseLockstepManager):
    """A hot group: a request's fixed region of hot slots (spec 2.4)."""

    def __init__(
        self, *args, hisparse: "HiSparseCoordinator", region_blocks: int, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.hisparse = hisparse
        self.region_blocks = region_blocks

    def _wants_region(
        self, request_id: str, num_tokens: int, total_computed_tokens: int,
        admission: bool,
    ) -> bool:
        # Counted at admission even while an async load defers the region
        # itself (num_new_blocks): spec 4.15 admits a zero-resident request
        # only with room for its region.
        if self.hisparse.is_hot_required(request_id):
            return True
        if request_id in self.num_cached_block:
            return False  # running: its region comes when it is required
        # A new request with computed history starts zero-resident (1.3):
        # its history is on host, so it reads from host from the first step.
        if total_computed_tokens > 0:
            return True
        # A prompt longer than the resident window will give pages up under
        # pressure, inside one of its own allocations (R25): admit it only
        # with room for the region that needs. Counted, not allocated.
        return admission and cdiv(num_tokens, self.block_size) > self.hisparse.cap_res_pages

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        if not self._wants_region(
            request_id, num_tokens, total_computed_tokens, apply_admission_cap
        ):
            return 0
        return max(self.region_blocks - len(self.req_to_blocks.get(request_id, ())), 0)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        assert not new_computed_blocks
        self.num_cached_block[request_id] = 0
        if num_local_computed_tokens + num_external_computed_tokens > 0:
            self.hisparse.require_hot(request_id)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        return None  # a hot region is not context

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the coordinator's lockstep allocation adds for this group:
        the rest of the region, once the request is hot-required."""
        if self.hisparse.is_loading(request_id):
            return 0  # no forward, so no state slot, until the load ends (R24)
        if not self.hisparse.is_hot_required(request_id):
            return 0
        return max(self.region_blocks - len(self.req_to_blocks.get(request_id, ())), 0)

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
    ) -> None:
        self.num_cached_block.setdefault(request.request_id, 0)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0
