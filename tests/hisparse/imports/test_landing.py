# SPDX-License-Identifier: Apache-2.0
"""P/D import landing, completion and failure through vLLM's real Scheduler
(spec 4.13, INV-30; target T1: the SimWorker checks every row attention
reads, in every group, so an imported row in the wrong place, or read
before its import completed, fails the step).

The decode instance is configured as a user would (ExampleConnector,
kv_consumer); the prefill files are real safetensors files in the pin's
format (``sim_import.write_prefill``); the importer's worker half is the
real one (``sim_import.SimImportWorker``).
"""

import os

import numpy as np
import pytest

import vllm.v1.hisparse.pd_imports as pd_imports_module
from tests.hisparse.imports.sim_import import build_rig, write_prefill
from tests.hisparse.scheduler.harness import (
    B,
    ProtocolError,
    make_request,
    model_output,
    run_step,
    schedule,
)
from tests.hisparse.scheduler.helpers import prompt
from tests.hisparse.scheduler.invariants import check_drained, check_invariants
from vllm.v1.hisparse.metrics import (
    IMPORT_DEVICE_PAGES,
    IMPORT_FALLBACKS,
    IMPORT_HOST_PAGES,
    IMPORT_WAITS,
    SchedulerMetrics,
)
from vllm.v1.hisparse.pd_imports import ImportLanding, ImportPlan

PROMPT = 700  # T = align(699) = 640 tokens: 10 imported pages, P_last = 9
T_PAGES = 10


def run(rig, max_steps=400, on_step=None):
    """Step until idle, every invariant after every step; no request is
    ever preempted (INV-30 clause 3)."""
    s, w = rig.scheduler, rig.worker
    for i in range(max_steps):
        if not (s.has_unfinished_requests() or s.connector.has_pending_push_work()):
            return i
        so = run_step(s, w)
        assert not so.preempted_req_ids, "INV-30: a request was preempted"
        check_invariants(s)
        if on_step is not None:
            on_step(i, so)
    raise AssertionError("did not drain")


def resident_table(rig, req_id):
    coord = rig.scheduler.kv_cache_manager.coordinator
    return coord.single_type_managers[coord.resident_group_ids[0]].req_to_blocks[req_id]


def test_device_landing_when_the_whole_context_fits(tmp_path):
    """4.13 step 1: resident pages for every imported page; the importer
    writes them (and their host rows); they are valid and clean on
    completion; nothing is restored (INV-30 clause 2)."""
    rig = build_rig(tmp_path, num_gpu_blocks=120)
    s = rig.scheduler
    p = prompt(PROMPT, seed=1)
    write_prefill(rig, p)
    s.add_request(make_request("a", p, 8))
    so = run_step(s, rig.worker)
    assert "a" not in so.num_scheduled_tokens  # loads first, no forward
    (job,) = rig.importer.loads
    assert job.landing == "device" and (job.first_token, job.end_token) == (0, T_PAGES * B)
    assert not any(b.is_null for b in resident_table(rig, "a")[:T_PAGES])
    st = rig.hisparse.states["a"]
    assert st.valid >= set(range(T_PAGES)) and st.importing is None
    run(rig)
    assert rig.hisparse.stats.import_device_pages == T_PAGES
    assert rig.hisparse.stats.import_host_pages == 0
    assert not getattr(rig.worker, "restores_seen", [])
    assert rig.worker.reads_checked > 0 and rig.worker.indexer_reads_checked > 0
    check_drained(s)


def test_host_landing_restores_only_the_last_page(tmp_path):
    """4.13 steps 1-4 and INV-30 clause 2: when only the fixed footprint
    fits, pages 0..P_last-1 stay host-only (null), P_last gets a resident
    block that exactly one restore fills, the request reads the rest
    from host through its hot buffer."""
    rig = build_rig(tmp_path, num_gpu_blocks=40)
    s, w = rig.scheduler, rig.worker
    p = prompt(PROMPT, seed=1)
    write_prefill(rig, p)
    s.add_request(make_request("a", p, 8))
    run_step(s, w)
    (job,) = rig.importer.loads
    assert job.landing == "host" and job.resident_block_ids == []
    table = resident_table(rig, "a")
    assert all(b.is_null for b in table[:T_PAGES - 1]) and not table[T_PAGES - 1].is_null
    restore_host_block = rig.hisparse.source.req_to_blocks["a"][T_PAGES - 1].block_id
    run(rig)
    assert [hb for _, hb in w.restores_seen] == [restore_host_block]
    assert w.hot_misses > 0  # host-only pages were read from host
    assert rig.hisparse.stats.import_host_pages == T_PAGES
    check_drained(s)


def test_imported_pages_are_neither_valid_nor_read_before_completion(tmp_path):
    """INV-30 clause 1: the step that loads runs no forward for the request,
    its pages are importing (not valid, no transfer) until the load is
    reported, and only then is it scheduled."""
    rig = build_rig(tmp_path, num_gpu_blocks=40)
    s, w = rig.scheduler, rig.worker
    p = prompt(PROMPT, seed=1)
    write_prefill(rig, p)
    s.add_request(make_request("a", p, 8))
    so = schedule(s)
    st = rig.hisparse.states["a"]
    assert st.importing is not None and not st.valid and not st.pending
    assert "a" not in so.num_scheduled_tokens
    out = w.step(so)
    assert out.finished_recving == {"a"}
    s.update_from_output(so, model_output(s, so, out))
    assert st.importing is None and st.valid == set(range(T_PAGES))
    assert "a" in run_step(s, w).num_scheduled_tokens
    run(rig)


def test_a_load_reported_before_its_rows_are_written_is_caught(tmp_path):
    """The harness can fail: an importer that reports done without writing
    leaves host-only pages the SimWorker reads as wrong (T1)."""
    rig = build_rig(tmp_path, num_gpu_blocks=40)
    s = rig.scheduler
    p = prompt(PROMPT, seed=1)
    write_prefill(rig, p)
    rig.importer.connector._target.mla = {}  # writes no sparse-MLA row
    s.add_request(make_request("a", p, 8))
    with pytest.raises(ProtocolError, match="does not hold the KV"):
        run(rig)


def behind_a_running_prefill(tmp_path, num_gpu_blocks: int, running: int):
    """A rig whose pool a running prefill of ``running`` tokens holds when
    request "a" (PROMPT tokens, its producer's files written) arrives."""
    rig = build_rig(tmp_path, num_gpu_blocks=num_gpu_blocks,
                    long_prefill_token_threshold=128)
    rig.scheduler.add_request(make_request("b", prompt(running, seed=2), 1))
    run_step(rig.scheduler, rig.worker)
    p = prompt(PROMPT, seed=1)
    write_prefill(rig, p)
    rig.scheduler.add_request(make_request("a", p, 8))
    return rig


def test_not_admissible_waits_without_preempting(tmp_path):
    """4.13 "not admissible" and INV-30 clause 3: while a running prefill
    holds the pool, the import answers None (the scheduler retries), the
    running request is never preempted, and the import lands afterwards."""
    rig = behind_a_running_prefill(tmp_path, 50, 900)
    s = rig.scheduler
    run(rig)
    stats = rig.hisparse.stats
    assert stats.import_waits >= 3 and stats.import_fallbacks == 0
    assert [j.landing for j in rig.importer.loads] == ["host"]
    assert s.requests == {} and rig.worker.reads_checked > 0
    check_drained(s)


def test_a_retry_keeps_the_landing_it_chose(tmp_path):
    """4.13 step 1 ("a retry keeps the choice"): the import chose DEVICE,
    its allocation then waited behind a long prefill's reservation, the
    pool shrank so that only HOST would have fit; it waits (counted) and
    lands on the device as first chosen, without any preemption."""
    rig = behind_a_running_prefill(tmp_path, 100, 2500)
    s, h = rig.scheduler, rig.hisparse
    fits = h.imports._landing_fits
    seen = {"first": None, "only_other_fits": False}

    def watch(i, so):
        plan = h.imports._plans.get("a")
        if plan is None:
            return
        seen["first"] = seen["first"] or plan.landing
        other = ImportPlan(ImportLanding.HOST, plan.first_page, plan.end_page)
        request = s.requests["a"]
        if fits(request, other) and not fits(request, plan):
            seen["only_other_fits"] = True

    run(rig, on_step=watch)
    assert seen["first"] is ImportLanding.DEVICE and seen["only_other_fits"]
    assert h.stats.import_waits > 0
    assert [j.landing for j in rig.importer.loads] == ["device"]
    check_drained(s)


def test_bounded_waits_fall_back_to_recomputation(tmp_path, monkeypatch):
    """R30's bound for imports: after MAX_IMPORT_WAITS attempts the request
    asks for 0 external tokens and computes its prompt itself."""
    monkeypatch.setattr(pd_imports_module, "MAX_IMPORT_WAITS", 2)
    rig = behind_a_running_prefill(tmp_path, 50, 900)
    run(rig)
    assert rig.importer.loads == []
    assert rig.hisparse.stats.import_fallbacks == 1
    assert rig.hisparse.stats.import_waits == 2
    check_drained(rig.scheduler)


@pytest.mark.parametrize("damage", ["short", "missing"])
def test_a_short_or_missing_file_is_recomputed(tmp_path, damage):
    """4.13 step 5 at admission: a file with fewer than T rows, or none,
    imports nothing; the request computes its prompt."""
    rig = build_rig(tmp_path, num_gpu_blocks=120)
    s = rig.scheduler
    p = prompt(PROMPT, seed=1)
    layer = rig.connector._layout.indexer_layers[-1]
    if damage == "short":
        write_prefill(rig, p, rows=T_PAGES * B - 1)
    else:
        write_prefill(rig, p, skip_layers=(layer,))
    s.add_request(make_request("a", p, 8))
    run(rig)
    assert rig.importer.loads == [] and rig.hisparse.stats.import_device_pages == 0
    check_drained(s)


@pytest.mark.parametrize("num_gpu_blocks,landing", [(120, "device"), (66, "host")])
def test_a_load_that_fails_drops_the_marks_and_recomputes(
    tmp_path, num_gpu_blocks, landing
):
    """4.13 step 5 at load time (the files vanish between the admission
    check and the load): no page becomes valid, the host-landed pages get
    resident blocks, the request computes every page (its reads check
    the recomputed rows)."""
    rig = build_rig(tmp_path, num_gpu_blocks=num_gpu_blocks)
    s, w = rig.scheduler, rig.worker
    p = prompt(PROMPT, seed=1)
    folder = write_prefill(rig, p)
    s.add_request(make_request("a", p, 8))
    so = schedule(s)
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    out = w.step(so)
    assert [j.landing for j in rig.importer.loads] == [landing]
    assert rig.importer.reports and "a" in rig.importer.reports[0].failed
    s.update_from_output(so, model_output(s, so, out))
    st = rig.hisparse.states["a"]
    assert st.importing is None and not st.valid
    assert s.requests["a"].num_computed_tokens == 0
    assert not any(b.is_null for b in resident_table(rig, "a")[:T_PAGES])
    run(rig)
    assert rig.hisparse.stats.import_fallbacks == 1
    assert rig.hisparse.stats.import_device_pages == 0
    assert rig.hisparse.stats.import_host_pages == 0
    check_drained(s)


def test_a_local_prefix_hit_imports_only_the_rest(tmp_path):
    """Imported pages start at the host prefix hit: a second request with
    the same first pages hits them on host and imports the remainder."""
    rig = build_rig(tmp_path, num_gpu_blocks=120)
    s = rig.scheduler
    shared = prompt(4 * B, seed=3)
    s.add_request(make_request("warm", shared + prompt(10, seed=4), 2))
    run(rig)
    p = shared + prompt(PROMPT - 4 * B, seed=5)
    write_prefill(rig, p)
    s.add_request(make_request("a", p, 8))
    run(rig)
    (job,) = rig.importer.loads
    assert job.first_token == 4 * B and job.end_token == T_PAGES * B
    check_drained(s)


def test_import_counters_reach_the_scheduler_metrics(tmp_path):
    """The four counters go out with the scheduler's stats, like
    publication_waits (spec 6.5)."""
    rig = build_rig(tmp_path, num_gpu_blocks=40)
    metrics = SchedulerMetrics(rig.hisparse, 1)
    s = rig.scheduler
    p = prompt(PROMPT, seed=1)
    write_prefill(rig, p)
    s.add_request(make_request("a", p, 8))
    run(rig)
    counters = metrics.collect().counters
    assert counters[IMPORT_HOST_PAGES] == T_PAGES
    assert counters[IMPORT_DEVICE_PAGES] == 0
    assert counters[IMPORT_WAITS] == counters[IMPORT_FALLBACKS] == 0
    assert metrics.collect() is None  # deltas: nothing moved since (P2)


def test_files_hold_the_tags_the_worker_expects(tmp_path):
    """Sanity of the rig itself: a file row is the SimWorker's salted tag."""
    rig = build_rig(tmp_path, num_gpu_blocks=120)
    p = prompt(PROMPT, seed=1)
    folder = write_prefill(rig, p)
    names = os.listdir(folder)
    layout = rig.connector._layout
    assert len(names) == len(layout.sparse_layers) + len(layout.indexer_layers)
    assert np.dtype(np.int64).itemsize == 8


def test_a_failed_host_landing_the_pool_cannot_recompute_is_an_error(tmp_path):
    """The one failure not recovered (docs/pd-imports.md): the files vanish
    after admission and the GPU pool cannot give the host-landed pages
    resident blocks for the recomputation; a clear error, not a hang."""
    rig = build_rig(tmp_path, num_gpu_blocks=40)
    s, w = rig.scheduler, rig.worker
    p = prompt(PROMPT, seed=1)
    folder = write_prefill(rig, p)
    s.add_request(make_request("a", p, 8))
    so = schedule(s)
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    out = w.step(so)
    with pytest.raises(RuntimeError, match="cannot back its recomputation"):
        s.update_from_output(so, model_output(s, so, out))
