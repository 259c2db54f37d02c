# SPDX-License-Identifier: Apache-2.0
"""Two block-id namespaces never mix (spec 2.4, integration 8.3 item 2), and
the watermark / admission-window transitions (spec 4.5, S-8)."""

import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockStored

from tests.hisparse.scheduler.harness import drain, make_request, run_step
from tests.hisparse.scheduler.helpers import coord, prompt
from tests.hisparse.scheduler.invariants import check_drained, check_invariants


def test_host_events_are_tagged_cpu_and_gpu_events_gpu(build):
    """KV events of the host pool reach the same queue, medium CPU; the
    source group (0) never emits a GPU-medium event."""
    s, w = build(kv_events_config=KVEventsConfig(enable_kv_cache_events=True,
                                                 publisher="null"))
    events = []
    take = s.kv_cache_manager.take_events

    def record():  # observe what the scheduler publishes each step
        out = take()
        events.extend(out)
        return out

    s.kv_cache_manager.take_events = record
    s.add_request(make_request("r", prompt(300), 4))
    drain(s, w)
    stored = [e for e in events if isinstance(e, BlockStored)]
    host = [e for e in stored if e.group_idx == coord(s).source_group_id]
    gpu = [e for e in stored if e.group_idx != coord(s).source_group_id]
    assert host and all(e.medium == MEDIUM_CPU for e in host)
    assert gpu and all(e.medium == MEDIUM_GPU for e in gpu)
    assert sum(len(e.block_hashes) for e in host) == 4  # 4 durable full pages


def test_usage_and_free_counts_are_gpu_only(build):
    """The host pool is never part of GPU capacity or usage."""
    s, w = build(num_gpu_blocks=200, num_host_blocks=1000)
    s.add_request(make_request("r", prompt(640), 20))
    for _ in range(3):
        run_step(s, w)
    pool = coord(s).block_pool
    used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    assert s.kv_cache_manager.usage == pytest.approx(used / (pool.num_gpu_blocks - 1))
    assert coord(s).host_pool.get_num_free_blocks() < 1000 - 1


def test_reset_prefix_cache_covers_both_pools(build):
    """reset_prefix_cache refuses while host blocks are in use, and when idle
    clears the host prefix cache and the GPU copies table too."""
    s, w = build()
    r = make_request("r", prompt(400), 30)
    s.add_request(r)
    for _ in range(3):
        run_step(s, w)
    assert not s.kv_cache_manager.reset_prefix_cache()
    drain(s, w)
    hs = coord(s).hisparse
    assert hs.copies and any(b.block_hash for b in coord(s).host_pool.blocks)
    assert s.kv_cache_manager.reset_prefix_cache()
    assert not hs.copies
    assert not any(b.block_hash for b in coord(s).host_pool.blocks)
    check_drained(s)


def test_new_source_blocks_are_announced_for_hot_invalidation(build):
    """INV-24 trigger 2: every host block allocated in a step is listed in
    that step's metadata, so workers can drop hot entries keyed by its rows."""
    s, w = build()
    s.add_request(make_request("a", prompt(300, 1), 70))
    s.add_request(make_request("b", prompt(100, 2), 70))
    src = coord(s).single_type_managers[coord(s).source_group_id]
    seen: dict[str, int] = {}
    for _ in range(80):
        before = {r: list(src.req_to_blocks.get(r, [])) for r in ("a", "b")}
        so = run_step(s, w)
        announced = set(so.kv_connector_metadata.new_source_block_ids.tolist())
        for req_id in ("a", "b"):
            after = src.req_to_blocks.get(req_id, [])
            new = {b.block_id for b in after[len(before[req_id]):]}
            assert new <= announced
            seen[req_id] = seen.get(req_id, 0) + len(new)
        check_invariants(s)
    assert seen["a"] >= 6 and seen["b"] >= 3


def test_watermark_and_admission_window_transitions(build):
    """S-8, INV-21: a request turns hot-required when free GPU blocks drop
    below max(hot cost, N_gpu // 10) or its resident table reaches cap_res;
    the region is allocated on a later pass and its pages stay pinned until
    then."""
    s, w = build(num_gpu_blocks=400, admission_max_tokens=512,
                 max_num_batched_tokens=512)
    hs = coord(s).hisparse
    assert hs.transition_watermark == max(hs.hot_blocks_per_request, 400 // 10)
    assert hs.cap_res_pages == 512 // 64 + 2
    # Below the window and the watermark: stays fully resident.
    s.add_request(make_request("small", prompt(200, 1), 3000))
    for _ in range(3):
        run_step(s, w)
    assert not hs.states["small"].hot_required
    assert not hs.can_read_from_host("small")
    # Admission window: a prompt of cap_res pages turns hot-required at once.
    s.add_request(make_request("long", prompt(1000, 2), 3000))
    resident = coord(s).single_type_managers[coord(s).resident_group_ids[0]]
    while len(resident.req_to_blocks.get("long", ())) < hs.cap_res_pages:
        assert not hs.is_hot_required("long")
        run_step(s, w)
    st = hs.states["long"]
    assert st.hot_required and not hs.can_read_from_host("long")
    assert not st.unpinned  # INV-21: pinned until the region exists
    run_step(s, w)
    assert hs.can_read_from_host("long") and st.unpinned
    # Watermark: fill the pool until free < watermark; "small" turns hot.
    i = 0
    while coord(s).block_pool.get_num_free_blocks() >= hs.transition_watermark:
        s.add_request(make_request(f"f{i}", prompt(500, 10 + i), 100))
        run_step(s, w)
        i += 1
    run_step(s, w)
    assert hs.states["small"].hot_required
    check_invariants(s)


def test_host_copy_on_write_is_sent_and_released_on_ack(build):
    """Spec 4.12 (CoW, injected: v1 prefix hits are block-aligned so the pin
    never produces one): the pair reaches the workers as host block ids, both
    endpoints stay leased until cow_done, then return to the host pool."""
    s, w = build()
    r = make_request("r", prompt(200), 40)
    s.add_request(r)
    run_step(s, w)
    hs = coord(s).hisparse
    host = coord(s).host_pool
    source = coord(s).single_type_managers[coord(s).source_group_id].req_to_blocks["r"][0]
    destination = host.get_new_blocks(1)[0]
    host.touch([source])  # the caller hands one reference per endpoint over
    hs.note_cow(source, destination)
    check_invariants(s)
    assert s.connector.has_pending_push_work()
    so = run_step(s, w)
    meta = so.kv_connector_metadata
    assert meta.cow_src.tolist() == [source.block_id]
    assert meta.cow_dst.tolist() == [destination.block_id]
    assert destination.ref_cnt == 0 and source.ref_cnt == 1  # released on the ack
    assert (w.host[destination.block_id * 64:(destination.block_id + 1) * 64]
            == w.host[source.block_id * 64:(source.block_id + 1) * 64]).all()
    check_invariants(s)
    drain(s, w)
    check_drained(s)
