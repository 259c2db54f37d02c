# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C2: the ``unpin_blocks`` block-pool primitive (spec 2.3).

A resident page whose host copy is durable can give its GPU block back to
the shared pool while the request keeps reading it: the block is *unpinned*.
It counts as free (admission and the watermark see the space), but its bytes
stay valid until the pool hands the block to someone else. At that moment the
pool calls the ``on_reuse`` watcher registered at unpin time, before the new
holder receives the block, so the owner can null its table entry and read
the page from host from then on (spec 4.6).

Invariants kept here:

- INV-3: a block returned by ``get_new_blocks`` has had its watcher fire
  exactly once per unpin-then-reallocate cycle, before the caller receives
  it; a block that is never reallocated keeps its bytes and never fires.
- INV-4: an unpinned block (ref_cnt 0) is a free block with readers: it sits
  in the free queue, leased to no group, until reuse ends the old lease
  (watcher) and starts the new one.

NOTE: ``KVCacheBlock`` is ``@dataclass(slots=True)``, so watchers live in a
side table keyed by block id rather than on the block.
"""

from collections.abc import Callable, Iterable, Sequence

from vllm.logger import init_logger
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

logger = init_logger(__name__)

ReuseWatcher = Callable[[KVCacheBlock], None]
"""Called with the block when the pool reallocates an unpinned block.

It runs inside ``get_new_blocks``: the block has already left the free queue,
had its prefix-cache hash evicted and its ref_cnt set to 1 for the new
holder. A watcher must not raise and must not allocate from or free into the
pool (it is a notification; the coordinator's ``on_block_reused`` only
updates its own tables).
"""


class UnpinBlockPool(BlockPool):
    """``BlockPool`` plus ``unpin_blocks`` and reuse watchers.

    Every inherited operation behaves exactly as in ``BlockPool`` for blocks
    that were never unpinned (allocation order, prefix-cache eviction, KV
    events, free counts). For unpinned blocks:

    - ``unpin_blocks(blocks, on_reuse)`` drops one reference per block; a
      block whose count reaches 0 is appended at the free queue's *tail* (last
      to be evicted at that moment), is counted by ``get_num_free_blocks``,
      and keeps its bytes and any prefix-cache hash.
    - ``get_new_blocks`` fires and removes the watcher of every block it hands
      out, before returning (INV-3).
    - ``touch`` (inherited) is a new holder taking a reference, e.g. a
      cross-request adoption of a GPU copy (spec 4.7): the watcher stays, so
      the unpinning owner still learns when the block is finally reused. An
      owner never takes an unpinned page back (a page, once clean and
      unpinned, is read from host or adopted; docs/layout.md B1).
    - ``free_blocks`` of a block that still holds references (an adopter
      releasing it) leaves the watcher in place: the next reallocation still
      notifies. Freeing a block whose count is already 0 (an unpinned block in
      the free queue) is refused: unpinned blocks leave only through reuse.

    One watcher per block: the coordinator registers a single callback and
    tracks the set of owners itself (spec 4.6). Registering a *different*
    callable for a block that is still watched is refused, so a notification
    can never be silently lost.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reuse_watchers: dict[int, ReuseWatcher] = {}

    # ------------------------------------------------------------------ C2 API

    def unpin_blocks(
        self, blocks: Sequence[KVCacheBlock], on_reuse: ReuseWatcher
    ) -> None:
        """Release one reference per block, keeping the blocks readable.

        Blocks that reach ref_cnt 0 are appended at the free-queue tail in
        the given order, so the first block passed is reused first: the
        coordinator passes pages tail-first, keeping a request's prefix
        readable longest (spec 2.3). All blocks are validated before any is
        changed.

        Args:
            blocks: Blocks held by the caller (ref_cnt >= 1), each at most once.
            on_reuse: Called once with the block when ``get_new_blocks``
                hands it out again (see ``ReuseWatcher``).

        Raises:
            ValueError: a null block, a block with no reference to drop, a
                duplicate, or a block already watched by another callable.
        """
        seen: set[int] = set()
        for block in blocks:
            if block.is_null:
                raise ValueError("unpin_blocks: the null block cannot be unpinned")
            if block.ref_cnt < 1:
                raise ValueError(
                    f"unpin_blocks: block {block.block_id} has ref_cnt "
                    f"{block.ref_cnt}; only a held block can be unpinned"
                )
            if block.block_id in seen:
                raise ValueError(
                    f"unpin_blocks: block {block.block_id} is listed twice"
                )
            seen.add(block.block_id)
            current = self._reuse_watchers.get(block.block_id)
            if current is not None and current != on_reuse:
                raise ValueError(
                    f"unpin_blocks: block {block.block_id} already has a "
                    "different reuse watcher; one callback per block"
                )

        released: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        # Tail, not head: unpinned pages are the last-resort eviction
        # candidates, behind every never-used and unhashed free block.
        self.free_block_queue.append_n(released)

    def has_reuse_watcher(self, block: KVCacheBlock) -> bool:
        """True while ``block`` is unpinned and not yet reallocated."""
        return block.block_id in self._reuse_watchers

    @property
    def num_watched_blocks(self) -> int:
        """Blocks unpinned and not yet reallocated (free or adopted)."""
        return len(self._reuse_watchers)

    def next_free_block_ids(self, n: int) -> set[int]:
        """Ids of the first ``n`` blocks of the free queue: those the next
        ``get_new_blocks`` calls of ``n`` blocks in all hand out (and evict
        from the prefix cache), in order. O(n)."""
        queue = self.free_block_queue
        ids: set[int] = set()
        block = queue.fake_free_list_head.next_free_block
        while len(ids) < n and block is not None and block is not queue.fake_free_list_tail:
            ids.add(block.block_id)
            block = block.next_free_block
        return ids

    # ------------------------------------------------------- BlockPool hooks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``BlockPool.get_new_blocks``, firing reuse watchers (INV-3).

        Watchers fire in allocation order, after the hash eviction and the
        ref_cnt update and before the blocks are returned to the caller.
        """
        blocks = super().get_new_blocks(num_blocks)
        if self._reuse_watchers:
            for block in blocks:
                on_reuse = self._reuse_watchers.pop(block.block_id, None)
                if on_reuse is not None:
                    on_reuse(block)
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """``BlockPool.free_blocks``, refusing to free an unpinned block.

        An unpinned block already sits in the free queue with ref_cnt 0;
        freeing it again would drive the count negative (INV-4).
        """
        if self._reuse_watchers:
            ordered_blocks = list(ordered_blocks)
            for block in ordered_blocks:
                if block.ref_cnt == 0 and block.block_id in self._reuse_watchers:
                    raise ValueError(
                        f"free_blocks: block {block.block_id} is unpinned "
                        "(ref_cnt 0, in the free queue); unpinned blocks are "
                        "released by reuse, not by free"
                    )
        super().free_blocks(ordered_blocks)
