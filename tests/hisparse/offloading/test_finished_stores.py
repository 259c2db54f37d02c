# SPDX-License-Identifier: Apache-2.0
"""A finished request's final stores (patch
kv-offload-tiering-store-after-finish; soak run 25, docs/worker.md K34).

Under async scheduling the hash of a page completed by a request's last
decoded tokens exists only once the output that finishes the request is
processed, so the OffloadingConnector stores that page at the next step,
after ``request_finished`` has told the manager of the finish. The tiering
manager (the blog's ``TieringOffloadingSpec``) forgot the request then and
its ``prepare_store`` raised KeyError at the next schedule: the engine core
died. Driven here with the pin's real Scheduler/AsyncScheduler
and the offloader's real halves (sim_offload checks every stored and loaded
byte)."""

import pytest

from tests.hisparse.offloading.test_offloading import offloaded_pages, prompt
from tests.hisparse.scheduler.harness import B, AsyncDriver, make_request

PROMPT, OUTPUT = 2053, 60  # finishes with 2112 computed tokens: 33 full pages


def _run(r, driver, reqs) -> None:
    for q in reqs:
        r.scheduler.add_request(q)
    for _ in range(2_000):
        busy = driver.busy() if driver is not r else (
            r.scheduler.has_unfinished_requests()
            or r.scheduler.connector.has_pending_push_work())
        if not busy:
            break
        driver.step()
    assert all(q.is_finished() for q in reqs)


@pytest.mark.parametrize("prompt_only", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("spec_name", ["CPUOffloadingSpec", "TieringOffloadingSpec"])
def test_the_page_completed_at_the_finish_is_stored(rig, spec_name, async_scheduling,
                                                    prompt_only):
    """INV-31 / R4: the request after a finish runs (no KeyError), the
    finished request's every computed full page reaches the offloader (its
    prompt's pages only with offload_prompt_only), a follow-up loads them
    byte-exact, and the manager forgets the request once its stores end."""
    r = rig(num_gpu_blocks=200, spec_name=spec_name, async_scheduling=async_scheduling,
            offload_extra={"offload_prompt_only": prompt_only})
    driver = AsyncDriver(r.scheduler, r.worker) if async_scheduling else r
    a = make_request("a", prompt(PROMPT, 1), OUTPUT)
    _run(r, driver, [a])
    assert a.num_computed_tokens == (PROMPT + OUTPUT - 1) == 33 * B
    _run(r, driver, [make_request(f"fill{i}", prompt(900, 10 + i), 1) for i in range(3)])
    follow_up = make_request("a2", list(a.all_token_ids) + prompt(100, 2), 4)
    want = PROMPT // B if prompt_only else 33
    assert offloaded_pages(r, follow_up) == want
    before = r.offload.loads_verified
    _run(r, driver, [follow_up])
    assert r.offload.loads_verified == before + 1
    if spec_name == "TieringOffloadingSpec":
        assert not r.offloader.connector_scheduler.manager._req_state
    r.finish()
