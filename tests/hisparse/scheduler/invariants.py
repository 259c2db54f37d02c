# SPDX-License-Identifier: Apache-2.0
"""Whole-state invariant checks of the HiSparse scheduler side.

``check_invariants`` recomputes every block's expected reference count from
first principles (request tables, transfer leases, detached publications)
and compares it with the pools, then checks the protocol invariants the
residency coordinator keeps. Tests call it every step.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.hisparse.constants import ACTIVE_TAIL_PAGES
from vllm.v1.hisparse.coordinator import _CLEAN
from vllm.v1.hisparse.kv_cache_coordinator import HiSparseKVCacheCoordinator


def _coord(scheduler: Scheduler) -> HiSparseKVCacheCoordinator:
    coord = scheduler.kv_cache_manager.coordinator
    assert isinstance(coord, HiSparseKVCacheCoordinator)
    return coord


def expected_refs(scheduler: Scheduler) -> tuple[Counter, Counter]:
    """Expected ref counts of GPU and host blocks (block id -> refs)."""
    coord = _coord(scheduler)
    hs = coord.hisparse
    gpu, host = Counter(), Counter()
    for gid, mgr in enumerate(coord.single_type_managers):
        target = host if gid == coord.source_group_id else gpu
        for req_id, blocks in mgr.req_to_blocks.items():
            st = hs.states.get(req_id)
            for page, blk in enumerate(blocks):
                if blk.is_null:
                    continue
                if gid in coord.resident_group_ids and st is not None and page in st.unpinned:
                    continue  # unpinned: the request reads it without a ref
                target[blk.block_id] += 1
    for spill in hs.pending_spills.values():
        host[spill.host_block.block_id] += 1
        for blk in spill.resident_blocks:
            gpu[blk.block_id] += 1
    detached = {id(s.state): s.state for s in hs.pending_spills.values()
                if s.state.detached is not None}
    for st in detached.values():
        for blk in st.detached.host_blocks:
            host[blk.block_id] += 1
    for src, dst in [*hs._cow_pairs, *hs._cow_in_flight.values()]:
        host[src.block_id] += 1
        host[dst.block_id] += 1
    # Frees the scheduler defers while a step that may write the blocks is
    # in flight (async scheduling / batch queue with a kv_both connector:
    # ``pop_blocks_for_free``); GPU blocks only (R7).
    for _, blocks in getattr(scheduler, "deferred_frees", ()):
        for blk in blocks:
            if not blk.is_null:
                gpu[blk.block_id] += 1
    return gpu, host


def check_invariants(scheduler: Scheduler) -> None:
    coord = _coord(scheduler)
    hs = coord.hisparse
    gpu_refs, host_refs = expected_refs(scheduler)
    for pool, refs, name in ((coord.block_pool, gpu_refs, "GPU"),
                             (coord.host_pool, host_refs, "host")):
        free = 0
        for blk in pool.blocks[1:]:
            want = refs.get(blk.block_id, 0)
            assert blk.ref_cnt == want, (
                f"INV-4 ({name}): block {blk.block_id} ref_cnt {blk.ref_cnt}, "
                f"expected {want} from tables and leases"
            )
            free += blk.ref_cnt == 0
        assert pool.get_num_free_blocks() == free, (
            f"INV-4 ({name}): free queue holds {pool.get_num_free_blocks()} "
            f"blocks but {free} have no reference"
        )

    # INV-4: a GPU block is leased to one group at a time.
    owner_group: dict[int, int] = {}
    for gid, mgr in enumerate(coord.single_type_managers):
        if gid == coord.source_group_id:
            continue
        for req_id, blocks in mgr.req_to_blocks.items():
            st = hs.states.get(req_id)
            for page, blk in enumerate(blocks):
                if blk.is_null or (st is not None and page in st.unpinned
                                   and gid in coord.resident_group_ids):
                    continue
                prev = owner_group.setdefault(blk.block_id, gid)
                assert prev == gid, (
                    f"INV-4: GPU block {blk.block_id} leased to groups {prev} and {gid}"
                )

    pending_total = 0
    for req_id, st in hs.states.items():
        tables = [coord.single_type_managers[g].req_to_blocks.get(req_id, [])
                  for g in coord.resident_group_ids]
        host = coord.single_type_managers[coord.source_group_id].req_to_blocks.get(req_id, [])
        n = len(tables[0])
        for p in range(n):
            nulls = {t[p].is_null for t in tables}
            assert len(nulls) == 1, f"INV-7: {req_id} page {p} null in some groups only"
        can_read = hs.can_read_from_host(req_id)
        for p in st.unpinned:
            assert p in st.valid and p not in st.pending, (
                f"INV-20: {req_id} page {p} unpinned while not clean")
            assert p < n - ACTIVE_TAIL_PAGES, (
                f"INV-20: {req_id} tail page {p} of {n} unpinned")
            for t in tables:
                assert coord.block_pool.has_reuse_watcher(t[p]), (
                    f"INV-3: {req_id} unpinned page {p} has no reuse watcher")
                assert (st, p) in hs.owners.get(t[p].block_id, ()), (
                    f"INV-22: {req_id} unpinned page {p} is not an owner")
        if not can_read:
            assert not st.unpinned, f"INV-21: {req_id} unpinned pages without a hot region"
            nulls = sum(t.is_null for t in tables[0]) if tables[0] else 0
            assert nulls == 0 or st.hot_required, (
                f"INV-21: {req_id} reads from host without being hot-required")
        assert (st.dirty_from != _CLEAN) == (st in hs._dirty), (
            f"{req_id}: dirty_from {st.dirty_from} disagrees with the dirty set (R4)")
        for p, tid in st.pending.items():
            # A restore (4.13) copies a valid page back to its resident block.
            assert p not in st.valid or hs.pending_spills[tid].restore, (
                f"INV-16: {req_id} page {p} pending and valid")
        if st.importing is not None:
            imported = set(st.importing.pages)
            assert not imported & (st.valid | set(st.pending)), (
                f"INV-30: {req_id} importing pages valid or in transfer")
        pending_total += len(st.pending)
        num_cached = coord.single_type_managers[coord.source_group_id].num_cached_block.get(req_id, 0)
        assert num_cached <= st.ready_prefix, (
            f"INV-18: {req_id} published {num_cached} pages, durable prefix {st.ready_prefix}")
        for p, blk in enumerate(host):
            assert not blk.is_null, f"INV-6: {req_id} page {p} has no host block"
            if blk.block_hash is not None and p >= num_cached:
                assert p in st.valid, f"INV-18: {req_id} page {p} published but not durable"
    assert all(hs.is_current(st) for st in hs._dirty), "a freed state is still dirty"
    tids = [s.transfer_id for s in hs.pending_spills.values()]
    assert len(tids) == len(set(tids))
    live_pending = sum(1 for s in hs.pending_spills.values() if hs.is_current(s.state))
    assert live_pending == pending_total, "INV-16: pending pages and spills disagree"
    for block_id, owners in hs.owners.items():
        assert owners, f"empty owner set for block {block_id}"
        for st, p in owners:
            assert hs.is_current(st) and p in st.unpinned, (
                f"INV-22: block {block_id} owned by a page that is not unpinned")
    for key, blocks in hs.copies.items():
        for b in blocks:
            assert not b.is_null and hs._copy_of_block.get(b.block_id) == key


def check_drained(scheduler: Scheduler) -> None:
    """R2: after draining, both pools are back to their initial accounting."""
    coord = _coord(scheduler)
    hs = coord.hisparse
    assert not hs.pending_spills and not hs.states and not hs.owners
    assert not getattr(scheduler, "deferred_frees", ()), "deferred frees never returned"
    gpu, host = coord.block_pool, coord.host_pool
    assert gpu.get_num_free_blocks() == gpu.num_gpu_blocks - 1, "GPU blocks leaked"
    assert host.get_num_free_blocks() == host.num_gpu_blocks - 1, "host blocks leaked"
    for pool in (gpu, host):
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def check_published(scheduler: Scheduler, worker) -> int:
    """INV-18 / R2: every host block in the prefix cache holds exactly the
    KV of the tokens its hash names, in every resident group's host layers
    (nothing incomplete, no draft junk, no other group's rows was
    published). Returns how many published blocks were checked."""
    from tests.hisparse.scheduler.harness import B

    expected: dict = {}
    for req_id, request in worker.requests_seen.items():
        tags = worker.tags[req_id].tags
        for p, h in enumerate(request.block_hashes):
            if (p + 1) * B <= len(tags):
                expected[h] = tags[p * B:(p + 1) * B]
    checked = 0
    for blk in _coord(scheduler).host_pool.blocks[1:]:
        if blk.block_hash is None:
            continue
        h = get_block_hash(blk.block_hash)
        assert h in expected, f"host block {blk.block_id} published for unknown tokens"
        rows = worker.host[blk.block_id * B:(blk.block_id + 1) * B]
        assert np.array_equal(rows, worker.expected_host_rows(expected[h])), (
            f"INV-18: published host block {blk.block_id} is not the KV of its tokens")
        checked += 1
    return checked
