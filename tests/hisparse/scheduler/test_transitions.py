# SPDX-License-Identifier: Apache-2.0
"""When a request becomes hot-required and when it may start unpinning
(spec 4.5 steps 3-5, INV-21, S-8), isolated per trigger, on vLLM's real
scheduler with the simulated worker."""

from tests.hisparse.scheduler.harness import AsyncDriver, make_request
from tests.hisparse.scheduler.helpers import coord, hs, prompt, step
from tests.hisparse.scheduler.invariants import check_invariants


def test_the_watermark_alone_makes_a_request_hot_required(build):
    """Spec 4.5 step 4 (watermark), INV-21, S-8: a request far below its
    admission window (cap_res pages) stays fully resident while the free GPU
    blocks stay at or above max(hot cost, N_gpu // 10); once other requests
    push the free count below it, the request turns hot-required within the
    next pass, its region is allocated on a later pass and only then are its
    pages unpinned. Its table never reaches cap_res, so the watermark is the
    only trigger."""
    s, w = build(num_gpu_blocks=400, num_host_blocks=800, admission_max_tokens=2048,
                 max_num_batched_tokens=512, max_num_seqs=16)
    h = hs(s)
    resident = coord(s).single_type_managers[coord(s).resident_group_ids[0]]
    pool = coord(s).block_pool
    s.add_request(make_request("small", prompt(300, 1), 400))
    for _ in range(2):
        step(s, w)
    st = h.states["small"]
    below_since = None
    i = 0
    for n in range(200):
        if below_since is None:
            s.add_request(make_request(f"f{i}", prompt(450, 10 + i), 400))
            i += 1
        step(s, w)
        assert len(resident.req_to_blocks["small"]) < h.cap_res_pages
        free = pool.get_num_free_blocks()
        if below_since is None:
            if free < h.transition_watermark:
                below_since = n
            else:
                # Free never dropped below the watermark during this pass
                # (allocations only lower it within a pass).
                assert not st.hot_required
        elif n > below_since + 1:
            break
    assert below_since is not None and st.hot_required
    for _ in range(3):
        step(s, w)
    assert h.can_read_from_host("small")
    table = resident.req_to_blocks["small"]
    assert st.unpinned | {p for p, b in enumerate(table) if b.is_null}  # unpinned, or lost


def test_pages_stay_pinned_until_the_region_exists_under_async_scheduling(build):
    """INV-21, spec 4.5 step 5: a decoding request crosses its admission
    window (cap_res pages) under async scheduling. It turns hot-required in
    a scheduling pass; the output of the previous step, processed after that
    pass, caches its tokens (AsyncScheduler -> cache_blocks -> residency)
    before the region exists. No page may be unpinned then; the region comes
    on the next pass, and only then do clean pages unpin."""
    s, w = build(num_gpu_blocks=400, num_host_blocks=400, admission_max_tokens=64,
                 async_scheduling=True)
    s.add_request(make_request("r", prompt(100, 1), 200))
    driver = AsyncDriver(s, w)
    h = hs(s)
    window = 0
    for _ in range(150):
        driver.step()
        check_invariants(s)  # INV-21: no unpinned page without a full region
        st = h.states.get("r")
        if st is not None and st.hot_required and not h.can_read_from_host("r"):
            assert not st.unpinned
            window += bool(st.pinned_clean)
    assert window > 0  # clean pages existed while the region was pending
    assert h.can_read_from_host("r") and h.stats.pages_unpinned > 0
