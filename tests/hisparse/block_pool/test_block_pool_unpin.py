# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""U-7: ``UnpinBlockPool.unpin_blocks`` and its reuse watchers (spec 2.3, C2).

Invariants checked: INV-3 (a reallocated unpinned block fires its watcher
exactly once, before the caller receives it; a block that is not reallocated
never fires and keeps its hash) and INV-4 (an unpinned block is a free block:
in the free queue, counted free, leased to nobody until reuse).
"""

import pytest

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.hisparse.block_pool import UnpinBlockPool
from vllm.v1.request import Request

BLOCK = 4


@pytest.fixture(autouse=True)
def _none_hash():
    init_none_hash(sha256)


def make_pool(num_blocks: int = 6, cls=UnpinBlockPool, events: bool = False):
    return cls(
        num_gpu_blocks=num_blocks,
        enable_caching=True,
        hash_block_size=BLOCK,
        enable_kv_cache_events=events,
    )


def make_request(request_id: str, num_tokens: int) -> Request:
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(num_tokens)),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def free_ids(pool: BlockPool) -> list[int]:
    """Free queue, head (next to allocate) to tail."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


class Recorder:
    """A watcher that records (block id, ref_cnt, hash, in free queue)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.calls: list[tuple[int, int, bool, bool]] = []

    def __call__(self, block: KVCacheBlock) -> None:
        in_queue = block.block_id in free_ids(self.pool)
        self.calls.append(
            (block.block_id, block.ref_cnt, block.block_hash is not None, in_queue)
        )

    @property
    def fired(self) -> list[int]:
        return [call[0] for call in self.calls]


def test_unpin_drops_ref_and_appends_at_tail():
    """U-7 / INV-4: ref_cnt - 1, block at the free-queue tail, counted free."""
    pool = make_pool()
    held = pool.get_new_blocks(3)  # blocks 1, 2, 3
    assert [b.block_id for b in held] == [1, 2, 3]
    assert free_ids(pool) == [4, 5]
    watcher = Recorder(pool)

    pool.unpin_blocks([held[1]], watcher)

    assert held[1].ref_cnt == 0
    assert free_ids(pool) == [4, 5, 2]
    assert pool.get_num_free_blocks() == 3
    assert pool.has_reuse_watcher(held[1]) and pool.num_watched_blocks == 1
    assert watcher.calls == []


def test_tail_first_unpin_order_is_reuse_order():
    """U-7 / spec 2.3: the first block passed is reused first; never-used
    blocks go before any unpinned one (last-resort eviction)."""
    pool = make_pool(num_blocks=6)
    held = pool.get_new_blocks(4)  # 1, 2, 3, 4; free: 5
    watcher = Recorder(pool)
    # The coordinator unpins tail-first: page 3 (block 4) before page 2 ...
    pool.unpin_blocks([held[3], held[2], held[1]], watcher)
    assert free_ids(pool) == [5, 4, 3, 2]

    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [5, 4]
    assert watcher.fired == [4]
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [3, 2]
    assert watcher.fired == [4, 3, 2]


def test_unhashed_free_goes_before_unpinned():
    """INV-4 / spec 2.3: a block freed later without a hash is prepended, so
    it is still reused before an unpinned block."""
    pool = make_pool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    watcher = Recorder(pool)
    pool.unpin_blocks([b], watcher)
    pool.free_blocks([c])
    assert free_ids(pool) == [3, 2]
    assert [blk.block_id for blk in pool.get_new_blocks(1)] == [3]
    assert watcher.fired == []
    assert [blk.block_id for blk in pool.get_new_blocks(1)] == [2]
    assert watcher.fired == [2]


def test_watcher_fires_once_before_return():
    """INV-3: the watcher runs inside get_new_blocks, after the block left the
    free queue with ref_cnt 1 for the new holder and its hash was evicted,
    before the caller receives it; exactly once per cycle."""
    pool = make_pool(num_blocks=3)
    req = make_request("r", 2 * BLOCK)
    held = pool.get_new_blocks(2)  # 1, 2
    pool.cache_full_blocks(req, held, 0, 2, BLOCK, kv_cache_group_id=0)
    assert held[0].block_hash is not None
    watcher = Recorder(pool)
    order: list[str] = []

    def on_reuse(block: KVCacheBlock) -> None:
        watcher(block)
        order.append(f"fire {block.block_id}")

    pool.unpin_blocks([held[0]], on_reuse)
    assert held[0].block_hash is not None  # still readable, still cached
    got = pool.get_new_blocks(1)
    order.append(f"return {got[0].block_id}")

    assert got[0] is held[0]
    assert order == ["fire 1", "return 1"]
    # (block id, ref_cnt, has hash, in free queue) when the watcher ran
    assert watcher.calls == [(1, 1, False, False)]
    assert not pool.has_reuse_watcher(got[0])

    # The new holder frees it; reallocation does not fire again.
    pool.free_blocks(got)
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert watcher.calls == [(1, 1, False, False)]


def test_not_reallocated_never_fires_and_keeps_hash():
    """INV-3: an unpinned block that the pool does not hand out never fires
    and keeps its prefix-cache entry (bytes and hash untouched)."""
    pool = make_pool(num_blocks=6)
    req = make_request("r", BLOCK)
    held = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, held, 0, 1, BLOCK, kv_cache_group_id=0)
    watcher = Recorder(pool)
    pool.unpin_blocks(held, watcher)
    pool.get_new_blocks(4)  # 2, 3, 4, 5: every never-used block
    assert watcher.fired == []
    assert held[0].block_hash is not None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [held[0]]


def test_touch_keeps_the_watcher():
    """Spec 2.3: a plain touch (cross-request adoption) keeps the watcher,
    so the unpinning owner still learns of the eventual reuse."""
    pool = make_pool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    watcher = Recorder(pool)
    pool.unpin_blocks([a, b], watcher)
    assert free_ids(pool) == [1, 2]

    pool.touch([a])  # adoption by another request
    assert a.ref_cnt == 1 and free_ids(pool) == [2]
    assert pool.has_reuse_watcher(a)

    # The adopter frees it and it is reallocated: the owner is notified.
    pool.free_blocks([a])
    assert sorted(free_ids(pool)) == [1, 2]
    pool.get_new_blocks(2)
    assert sorted(watcher.fired) == [a.block_id, b.block_id]


def test_shared_block_unpin_frees_only_at_zero():
    """U-7: unpinning a block that another holder still references drops one
    reference only; the watcher waits for the final free (ordinary free
    order: an unhashed block goes to the head) and the reuse."""
    pool = make_pool(num_blocks=3)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])  # a second holder
    watcher = Recorder(pool)
    pool.unpin_blocks([blk], watcher)
    assert blk.ref_cnt == 1 and blk.block_id not in free_ids(pool)
    pool.free_blocks([blk])  # the other holder releases it
    assert free_ids(pool) == [1, 2]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert watcher.fired == [1]


def test_reunpin_after_reuse_fires_again():
    """INV-3: once per unpin-then-reallocate cycle: a second cycle fires a
    second time (with the new watcher)."""
    pool = make_pool(num_blocks=2)
    (blk,) = pool.get_new_blocks(1)
    first, second = Recorder(pool), Recorder(pool)
    pool.unpin_blocks([blk], first)
    (again,) = pool.get_new_blocks(1)
    pool.unpin_blocks([again], second)
    pool.get_new_blocks(1)
    assert first.fired == [1] and second.fired == [1]


@pytest.mark.parametrize(
    "case, message",
    [
        ("null", "null block"),
        ("free", "ref_cnt 0"),
        ("duplicate", "listed twice"),
        ("other_watcher", "different reuse watcher"),
    ],
)
def test_unpin_refuses_bad_input_atomically(case, message):
    """U-7: invalid unpins raise before any block is changed (INV-4)."""
    pool = make_pool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    w1, w2 = Recorder(pool), Recorder(pool)
    if case == "null":
        blocks = [a, pool.null_block]
    elif case == "free":
        pool.unpin_blocks([b], w1)
        blocks = [a, b]
    elif case == "duplicate":
        blocks = [a, a]
    else:
        pool.touch([b])
        pool.unpin_blocks([b], w1)  # b still held once
        blocks = [a, b]
    before = (free_ids(pool), a.ref_cnt, b.ref_cnt, pool.num_watched_blocks)
    with pytest.raises(ValueError, match=message):
        pool.unpin_blocks(blocks, w2)
    assert (free_ids(pool), a.ref_cnt, b.ref_cnt, pool.num_watched_blocks) == before


def test_same_watcher_may_unpin_again():
    """One callback per block (spec 4.6: one coordinator callback, its own
    owner sets): unpinning a still-watched block with the same callable is
    allowed."""
    pool = make_pool(num_blocks=3)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    watcher = Recorder(pool)
    pool.unpin_blocks([blk], watcher)
    pool.unpin_blocks([blk], watcher)
    assert blk.ref_cnt == 0 and free_ids(pool) == [2, 1]
    pool.get_new_blocks(2)
    assert watcher.fired == [1]


def test_free_refusal():
    """INV-4: an unpinned block in the free queue cannot be freed again
    (ref_cnt would go < 0); nothing changes when it is refused."""
    pool = make_pool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    pool.unpin_blocks([b], Recorder(pool))
    with pytest.raises(ValueError, match="released by reuse"):
        pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0 and free_ids(pool) == [3, 2]


def _ordinary_trace(cls) -> tuple[list, list[int], int]:
    """Allocate, cache, free, evict and reallocate ordinary blocks."""
    pool = make_pool(num_blocks=6, cls=cls, events=True)
    req = make_request("r", 3 * BLOCK)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 3, BLOCK, kv_cache_group_id=0)
    pool.free_blocks(reversed(blocks))
    pool.evict_blocks({blocks[1].block_id})
    got = pool.get_new_blocks(5)
    events = [
        (type(e).__name__, getattr(e, "block_hashes", None)) for e in pool.take_events()
    ]
    return events, [b.block_id for b in got], pool.get_num_free_blocks()


def test_ordinary_blocks_behave_as_before():
    """C2 leaves ordinary blocks alone: the same allocation order, prefix-cache
    eviction and KV events as vLLM's BlockPool."""
    events, order, free = _ordinary_trace(UnpinBlockPool)
    assert (events, order, free) == _ordinary_trace(BlockPool)
    assert [name for name, _ in events] == [
        BlockStored.__name__,
        BlockRemoved.__name__,
        BlockRemoved.__name__,
        BlockRemoved.__name__,
    ]
    assert order == [4, 5, 3, 2, 1]
    assert free == 0


def test_unpinned_hashed_block_reuse_emits_removed_event():
    """Spec 2.3: "any hash the block carries is evicted as usual" on reuse,
    with the usual BlockRemoved event, and the watcher fires."""
    pool = make_pool(num_blocks=2, events=True)
    req = make_request("r", BLOCK)
    held = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, held, 0, 1, BLOCK, kv_cache_group_id=0)
    pool.take_events()
    watcher = Recorder(pool)
    pool.unpin_blocks(held, watcher)
    assert pool.take_events() == []
    pool.get_new_blocks(1)
    assert [type(e).__name__ for e in pool.take_events()] == [BlockRemoved.__name__]
    assert watcher.calls == [(1, 1, False, False)]
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
