# SPDX-License-Identifier: Apache-2.0
"""Spec 2.11's scheduler-side staging bound (F21, docs/residency.md R28).

FlashMLA sparse runs every prefill chunk no longer than its reorder
threshold (256 tokens at 64 heads per rank) on its FP8 decode kernel, which
reads one KV tensor by row id; HiSparse stages such a chunk's host-only
context pages in the slab's C_stage = cdiv(max_model_len, B) +
cdiv(max_num_batched_tokens, B) staging blocks (docs/worker.md K13). Before
R28 nothing bounded a step's total: conversations whose earlier turns are
host-only (published on host, their GPU copies reused, their indexer KV
offloaded by the OffloadingConnector: the user's command) returning together
with equal short turns made the worker raise inside ``start_step``, killing
the engine.

The simulated worker counts the staged pages of every forward from its own
block tables and raises as the real one would (``SimWorker._check_staging``),
so these tests fail without the bound; with it every request finishes, the
bound was really reached (deferrals counted), and nothing is preempted.
"""

from __future__ import annotations

import pytest

from tests.hisparse.offloading.test_offloading import (
    gpu_indexer_cached,
    host_blocks,
    prompt,
)
from tests.hisparse.scheduler.harness import B, make_request
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.hisparse.memory import staging_block_count

SUFFIX = 100  # <= the decode-kernel threshold (256); 5 of them fit one 512-token step


def flood_until_host_only(r, conversations, flood_len: int) -> None:
    """Unrelated traffic until no conversation page has a GPU copy or a
    GPU-cached indexer block: their next turns load the indexer from the
    offloader and read every sparse-MLA row from host."""
    hashes = {h for c in conversations for h in c.block_hashes}
    for i in range(200):
        copies = hashes & {get_block_hash(k) for k in r.hisparse.copies}
        indexed = any(gpu_indexer_cached(r, c, p) for c in conversations
                      for p in range(len(c.block_hashes)))
        if not copies and not indexed:
            return
        r.scheduler.add_request(make_request(f"flood{i}", prompt(flood_len, 900 + i), 1))
        r.drain()
    raise AssertionError("the conversations kept GPU copies or indexer blocks")


def return_together(r, pages_each, *, suffix=SUFFIX, flood_len=4096):
    first = [make_request(f"c{i}", prompt(pages * B, 10 + i), 1)
             for i, pages in enumerate(pages_each)]
    for c in first:
        r.scheduler.add_request(c)
        r.drain()
    flood_until_host_only(r, first, flood_len)
    follow = [make_request(f"t{i}", list(c.prompt_token_ids) + prompt(suffix, 500 + i), 4)
              for i, c in enumerate(first)]
    for t in follow:
        r.scheduler.add_request(t)
    preempted = 0
    for _ in range(1000):
        if not r.scheduler.has_unfinished_requests():
            break
        so = r.step()
        preempted += len(so.preempted_req_ids)
    assert all(t.is_finished() for t in follow)
    assert preempted == 0
    assert r.offload.loads_verified >= len(follow)  # their indexer came from CPU
    r.finish()
    return r


@pytest.mark.parametrize("num_requests", [2, 3, 5])
def test_host_only_turns_returning_together_never_overflow_staging(rig, num_requests):
    """F21 at the e2e config (max_model_len 8192, 512-token batches: C_stage
    136): ``num_requests`` host-only conversations of C_stage + 1 pages in
    total return in one step with the same 100-token turn."""
    c_stage = staging_block_count(8192, B, 512)
    assert c_stage == 136
    total = c_stage + 1
    pages = [total // num_requests + (i < total % num_requests)
             for i in range(num_requests)]
    r = return_together(
        rig(num_gpu_blocks=800, num_host_blocks=20_000, num_cpu_blocks=4000,
            max_num_seqs=8, max_model_len=8192, max_num_batched_tokens=512), pages)
    assert r.hisparse.stats.staging_deferrals > 0, r.hisparse.stats
    assert max(pages) <= r.worker.max_staged_pages <= c_stage


def test_two_4416_token_conversations_with_the_same_short_turn(rig):
    """The issue's e2e numbers: two host-prefix hits of 4,416 tokens (69
    pages each, 138 > 136) with the same <= 256-token suffix."""
    r = return_together(
        rig(num_gpu_blocks=800, num_host_blocks=20_000, num_cpu_blocks=4000,
            max_num_seqs=8, max_model_len=8192, max_num_batched_tokens=512),
        [4416 // B] * 2)
    assert r.hisparse.stats.staging_deferrals > 0
    assert r.worker.max_staged_pages == 4416 // B


@pytest.mark.parametrize("pages_each", [[1094, 1094], [735, 735, 735]],
                         ids=["two-70K", "three-47K"])
def test_production_numbers(rig, monkeypatch, pages_each):
    """max_model_len 128K, 8192-token batches (C_stage 2176): two hits of
    ~70K tokens or three of ~47K."""
    # The tiny model's config says 64K positions; only the scheduler runs.
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    c_stage = staging_block_count(131072, B, 8192)
    assert c_stage == 2176 < sum(pages_each)
    r = return_together(
        rig(num_gpu_blocks=5000, num_host_blocks=20_000, num_cpu_blocks=6000,
            max_num_seqs=8, max_model_len=131072, max_num_batched_tokens=8192),
        pages_each, flood_len=60_000)
    assert r.hisparse.stats.staging_deferrals > 0
    assert max(pages_each) <= r.worker.max_staged_pages <= c_stage


def test_running_requests_short_of_staging_wait_instead_of_preempting(rig):
    """R28 for running requests: two host-only conversations (70 pages each,
    C_stage 138 at 600-token batches) return with 1000-token turns chunked
    at 300 tokens, so both are running when their last 100-token chunks (on
    the decode kernel) land in the same step. The second waits a step (the
    scheduler's wait path: never a preemption), and the staging blocks are
    never exceeded."""
    c_stage = staging_block_count(8192, B, 600)
    assert c_stage == 138 < 140
    r = return_together(
        rig(num_gpu_blocks=800, num_host_blocks=20_000, num_cpu_blocks=4000,
            max_num_seqs=8, max_model_len=8192, max_num_batched_tokens=600,
            long_prefill_token_threshold=300),
        [70, 70], suffix=1000)
    assert r.hisparse.stats.staging_deferrals > 0
    assert r.worker.max_staged_pages == 70


# ------------------------------------------------------------- R33


def returning_with_copies(r, pages_each, suffix=SUFFIX):
    """Conversations served and finished (their pages published on host,
    their GPU copies surviving: nothing else ran), then their next turns."""
    first = [make_request(f"c{i}", prompt(pages * B, 10 + i), 1)
             for i, pages in enumerate(pages_each)]
    for c in first:
        r.scheduler.add_request(c)
        r.drain()
    follow = [make_request(f"t{i}", list(c.prompt_token_ids) + prompt(suffix, 500 + i), 4)
              for i, c in enumerate(first)]
    return first, follow


def test_prefix_hits_that_adopt_every_page_are_admitted_together(rig):
    """R33 (issue 16, bench-tax run 7: 69 staging deferrals with nothing
    under pressure): three conversations of 60 pages (180 > C_stage 136)
    return with the same 100-token turn while every GPU copy survives.
    Each adopts its pages, so none of those is staged: all three run in the
    first step (before R33 each claimed its whole prefix and two waited),
    only the pages without a copy are staged and nothing is preempted."""
    assert staging_block_count(8192, B, 512) == 136
    r = rig(num_gpu_blocks=4000, num_host_blocks=20_000, num_cpu_blocks=4000,
            max_num_seqs=8, max_model_len=8192, max_num_batched_tokens=512)
    _, follow = returning_with_copies(r, [60, 60, 60])
    adopted = r.hisparse.stats.pages_adopted
    for t in follow:
        r.scheduler.add_request(t)
    so = r.step()
    assert {n.req_id for n in so.scheduled_new_reqs} == {t.request_id for t in follow}
    assert r.hisparse.stats.staging_deferrals == 0
    assert all(t.num_computed_tokens == 60 * B + SUFFIX for t in follow)
    adopted = r.hisparse.stats.pages_adopted - adopted
    assert adopted >= 150  # the pages without a recorded copy are staged
    preempted = len(so.preempted_req_ids)
    while r.scheduler.has_unfinished_requests():
        preempted += len(r.step().preempted_req_ids)
    assert all(t.is_finished() for t in follow) and preempted == 0
    assert r.worker.max_staged_pages == 180 - adopted
    r.finish()


def test_the_bound_counts_a_copy_the_admitting_allocation_may_evict(rig):
    """R33's safety: a copy counts as adopted only if none of its blocks is
    among the free blocks the admitting allocation takes (it evicts them
    before adoption). Against the real pool: with nothing taken every page
    with a copy is adopted (the bound is the pages without one); taking
    the whole free queue risks every copy (bound = the prefix); taking the
    first k free blocks risks exactly the pages with a copy block there."""
    r = rig(num_gpu_blocks=4000, num_host_blocks=20_000, num_cpu_blocks=4000,
            max_num_seqs=8, max_model_len=8192, max_num_batched_tokens=512)
    (first,), _ = returning_with_copies(r, [20])
    hs, pool = r.hisparse, r.coord.block_pool
    hit = host_blocks(r, first, 20)
    copied = [h for h in hit if h.block_hash in hs.copies]
    uncopied = 20 - len(copied)  # pages published after their blocks left (no copy)
    assert len(copied) >= 12
    tokens = 20 * B

    def bound(popped):
        return hs.staged_pages_bound("new", tokens, tokens + SUFFIX, hit, popped)

    assert bound(0) == uncopied
    free = pool.get_num_free_blocks()
    assert bound(free) == 20
    # the position in the free queue of each copied page's blocks
    order = {}
    block = pool.free_block_queue.fake_free_list_head.next_free_block
    for i in range(free):
        order[block.block_id] = i
        block = block.next_free_block
    first_risk = sorted(min(order[b.block_id] for b in hs.copies[h.block_hash])
                        for h in copied)
    k = first_risk[5] + 1  # 6 copied pages have a block among the first k
    risked = sum(any(order[b.block_id] < k for b in hs.copies[h.block_hash])
                 for h in copied)
    assert 6 <= risked < len(copied)
    assert bound(k) == uncopied + risked
    assert pool.next_free_block_ids(k) == {i for i, pos in order.items() if pos < k}
    r.finish()
