# SPDX-License-Identifier: Apache-2.0
"""The scheduler's metrics (spec 2.12 "Scheduler", 6.5) on vLLM's real
scheduler against the simulated worker (tests/hisparse/scheduler/harness.py),
read where vLLM puts them: ``update_from_output``'s ``SchedulerStats``
(``kv_connector_stats``), after the msgspec hop to the front-end, into vLLM's
own ``PrometheusStatLogger`` and ``LoggingStatLogger`` (spec 6.4's line).

Under pressure the counters move and equal the coordinator's own counts;
without pressure the pressure metrics stay 0 (spills and host usage move
anyway: the eager mirror copies every sealed page to host, INV-6). HiSparse
off: no HiSparse series at all."""

from __future__ import annotations

import random
import re
from unittest import mock

import pytest
from prometheus_client import REGISTRY, generate_latest

from tests.hisparse.offloading.conftest import rig  # noqa: F401  (fixture)
from tests.hisparse.scheduler.conftest import build  # noqa: F401  (fixture)
from tests.hisparse.scheduler.harness import (
    Faults,
    baseline_kv_cache_config,
    make_request,
    make_scheduler,
    model_output,
    schedule,
)
from tests.hisparse.scheduler.helpers import add_conversations, hs, prompt
from tests.hisparse.scheduler.invariants import check_invariants
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.metrics import (
    HiSparseConnectorStats,
)
from vllm.v1.hisparse import metrics as m
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

# Copies complete up to two steps after their forward, as on a GPU.
PRESSURE = dict(num_gpu_blocks=100, num_host_blocks=300, max_num_seqs=6,
                faults=Faults(max_delay=2))
# A pool that holds every request whole, and an admission window longer
# than any request (no hybrid transition either way, spec 4.5).
NO_PRESSURE = dict(num_gpu_blocks=1200, num_host_blocks=600, max_num_seqs=6,
                   admission_max_tokens=4096, faults=Faults(max_delay=2))


def to_frontend(stats: SchedulerStats) -> SchedulerStats:
    """The engine core -> front-end hop (msgspec, as EngineCoreOutputs)."""
    return MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(stats))


class Run:
    """Steps the scheduler and simulated worker to idle, collecting every
    step's SchedulerStats as the front-end receives them; ``worker_stats``
    (optional) adds a worker report to a step's connector output, as the
    runner's ``get_kv_connector_stats`` does."""

    def __init__(self, s, w, worker_stats=None, loggers=()):
        self.s, self.w = s, w
        self.worker_stats = worker_stats
        self.loggers = loggers
        self.stats: list[SchedulerStats] = []

    def go(self, max_steps: int = 5000) -> list[SchedulerStats]:
        s = self.s
        while s.has_unfinished_requests() or s.connector.has_pending_push_work():
            so = schedule(s)
            out = self.w.step(so)
            if self.worker_stats is not None:
                out.kv_connector_stats = self.worker_stats(len(self.stats))
            outputs = s.update_from_output(so, model_output(s, so, out))
            check_invariants(s)
            for eco in outputs.values():
                if eco.scheduler_stats is not None:
                    stats = to_frontend(eco.scheduler_stats)
                    self.stats.append(stats)
                    for logger in self.loggers:
                        logger.record(stats, None)
            assert len(self.stats) < max_steps
        return self.stats


def hisparse_data(stats: SchedulerStats) -> dict:
    """HiSparse's report of one step; empty when nothing moved (P2)."""
    data = stats.kv_connector_stats or {}
    return data["HiSparseConnector"]["data"] if "HiSparseConnector" in data else data


def last_report(stats: list[SchedulerStats]) -> dict:
    """The last step's report that carried HiSparse's levels."""
    return next(d for d in map(hisparse_data, reversed(stats)) if d.get(m.GAUGE))


def totals(stats: list[SchedulerStats]) -> tuple[HiSparseConnectorStats, dict]:
    """The interval's aggregate, and each gauge's maximum over the run."""
    total = HiSparseConnectorStats()
    peak: dict[str, float] = {}
    for data in map(hisparse_data, stats):
        if not data:
            continue  # nothing moved that step (P2)
        one = HiSparseConnectorStats(data=data)
        for name, value in one.data[m.GAUGE].items():
            peak[name] = max(peak.get(name, value), value)
        total.aggregate(one)
    return total, peak


def series(name: str) -> float:
    """The value of one unlabelled-by-us series in the default registry
    (vLLM's engine/model_name labels are the only ones)."""
    text = generate_latest(REGISTRY).decode()
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def conversations(s, seed: int = 5) -> None:
    add_conversations(s, random.Random(seed))


def test_under_pressure_the_counters_move_and_match_the_coordinator(build):
    """6.5: lost pages and completed spills are the coordinator's counts
    (deltas summed over every step), pending spills and host pool usage are
    levels that rose during the run; host bytes = blocks x stride."""
    s, w = build(**PRESSURE)
    conversations(s)
    stats = Run(s, w).go()
    total, peak = totals(stats)
    c = total.data[m.COUNTER]
    co = hs(s)
    assert c[m.LOST_PAGES] == co.stats.lost_pages > 0
    assert c[m.SPILLS_COMPLETED] == co.stats.spills_completed > 0
    assert c[m.SCHEDULER_WAITS] == co.stats.waits_for_in_flight
    assert c[m.STAGING_DEFERRALS] == co.stats.staging_deferrals
    assert c[m.PUBLICATION_WAITS] == co.stats.publication_waits
    assert c[m.ADMISSION_BACKOFFS] == co.stats.admission_backoffs > 0
    assert peak[m.PENDING_SPILLS] > 0 and peak[m.HOST_BLOCKS_USED] > 0
    assert 0 < peak[m.HOST_CACHE_USAGE_PERC] <= 1
    last = last_report(stats)[m.GAUGE]
    stride = s.kv_cache_config.host_pool.block_stride
    assert last[m.HOST_POOL_USED_BYTES] == last[m.HOST_BLOCKS_USED] * stride
    assert last[m.HOST_BLOCKS_TOTAL] == co.host_pool.num_gpu_blocks - 1
    assert last[m.PENDING_SPILLS] == 0  # drained
    # Published prefixes stay cached on host, evictable: they count as free.
    assert last[m.HOST_BLOCKS_USED] == 0


def test_without_pressure_the_pressure_metrics_stay_zero(build):
    """6.5: a pool that holds every request: nothing is lost, nobody waits
    or is deferred. Spills and host usage still move: every sealed page is
    copied to host eagerly (the host pool is the source of truth)."""
    s, w = build(**NO_PRESSURE)
    rng = random.Random(3)
    for i in range(10):  # no shared prefix: a host-prefix hit starts hybrid (4.14)
        s.add_request(make_request(f"r{i}", prompt(rng.randint(250, 800), 40 + i),
                                   rng.randint(5, 80)))
    stats = Run(s, w).go()
    total, peak = totals(stats)
    c = total.data[m.COUNTER]
    assert c[m.LOST_PAGES] == 0 and c[m.SCHEDULER_WAITS] == 0
    assert c[m.STAGING_DEFERRALS] == 0 and c[m.PUBLICATION_WAITS] == 0
    assert c[m.ADMISSION_BACKOFFS] == 0
    assert c[m.SPILLS_COMPLETED] > 0 and peak[m.HOST_BLOCKS_USED] > 0
    assert hs(s).stats.pages_unpinned == 0
    # P2: the steady decode steps in between moved nothing and sent nothing.
    assert any(not hisparse_data(st) for st in stats)


def test_a_step_where_nothing_moved_reports_nothing(build):
    """P2, 6.5: the first collect reports the startup levels; a collect
    with no counter or level moved since the last report returns None (vLLM
    merges nothing); the next movement reports its delta, not a sum."""
    s, w = build(**NO_PRESSURE)
    co = hs(s)
    metrics = m.SchedulerMetrics(co, 1)
    first = metrics.collect()
    assert first is not None and first.gauges[m.PENDING_SPILLS] == 0
    assert metrics.collect() is None
    co.stats.lost_pages += 1
    moved = metrics.collect()
    assert moved is not None and moved.counters[m.LOST_PAGES] == 1
    assert metrics.collect() is None
    s.add_request(make_request("r", prompt(300, 7), 4))
    Run(s, w).go()  # pages sealed, spilled, acknowledged
    moved = metrics.collect()
    assert moved.counters[m.SPILLS_COMPLETED] == co.stats.spills_completed > 0
    assert moved.counters[m.LOST_PAGES] == 0
    assert moved.gauges[m.HOST_BLOCKS_USED] == (
        co.host_pool.num_gpu_blocks - 1 - co.host_pool.get_num_free_blocks())
    assert metrics.collect() is None


def test_prometheus_exports_the_named_series(build):
    """6.5 through vLLM's PrometheusStatLogger, the connector's
    ``build_prom_metrics``: every series exists from the start at 0; the
    counters equal the sum of the reports, worker and scheduler, and the
    gauges their last level."""
    s, w = build(**PRESSURE)
    prom = PrometheusStatLogger(s.vllm_config)
    for name in m.METRICS:
        suffix = "_total" if m.METRICS[name].kind == m.COUNTER else ""
        assert series(name + suffix) == 0, name

    def worker_stats(step: int):
        if step % 3:
            return None  # the sampler reports only when a copy landed
        return HiSparseConnectorStats.of(m.MetricsReport(
            counters={m.HITS: 8, m.LOOKUPS: 10, m.L3_LOOKUPS: 2,
                      m.HOST_TO_DEVICE_BYTES: 2 * 656},
            gauges={m.LIVE_HOT_REGIONS: step % 5}, peaks={m.STAGING_BLOCKS_USED: 1}))

    conversations(s)
    stats = Run(s, w, worker_stats, loggers=[prom]).go()
    total, _ = totals(stats)
    c = total.data[m.COUNTER]
    reports = len(range(0, len(stats), 3))
    assert series("vllm:hisparse_hits_total") == 8 * reports
    assert series("vllm:hisparse_lookups_total") == 10 * reports
    assert series("vllm:hisparse_l3_lookups_total") == 2 * reports
    assert series("vllm:hisparse_host_to_device_bytes_total") == 2 * 656 * reports
    assert series("vllm:hisparse_lost_pages_total") == c[m.LOST_PAGES] > 0
    assert series("vllm:hisparse_spills_completed_total") == c[m.SPILLS_COMPLETED]
    assert series("vllm:hisparse_scheduler_waits_total") == c[m.SCHEDULER_WAITS]
    last = last_report(stats)[m.GAUGE]
    for name in (m.PENDING_SPILLS, m.HOST_BLOCKS_USED, m.HOST_BLOCKS_TOTAL,
                 m.HOST_POOL_USED_BYTES, m.HOST_CACHE_USAGE_PERC):
        assert series(name) == pytest.approx(last[name]), name
    assert series("vllm:hisparse_host_blocks_total") == hs(s).host_pool.num_gpu_blocks - 1
    assert series(m.LIVE_HOT_REGIONS) == (reports - 1) * 3 % 5
    assert series(m.STAGING_BLOCKS_USED) == 1


def test_prometheus_with_the_offloading_connector(rig):  # noqa: F811
    """6.2 composition: MultiConnector[HiSparseConnector,
    HiSparseOffloadingConnector]; MultiConnector's prom metrics hold both
    children's, routed by child name after the msgspec hop."""
    r = rig(num_gpu_blocks=100, num_host_blocks=300, max_num_seqs=6)
    prom = PrometheusStatLogger(r.scheduler.vllm_config)
    conversations(r.scheduler)
    stats = Run(r.scheduler, r.worker, loggers=[prom]).go()
    # By child name (a step where HiSparse moved nothing carries only the
    # offloader's, P2).
    carried = [st.kv_connector_stats for st in stats if st.kv_connector_stats]
    assert any("HiSparseConnector" in data for data in carried)
    lost = hs(r.scheduler).stats.lost_pages
    assert series("vllm:hisparse_lost_pages_total") == lost > 0
    assert series("vllm:kv_offload_store_bytes_total") > 0
    assert series("vllm:hisparse_hits_total") == 0


def test_the_cli_stats_line(build):
    """6.4: vLLM's LoggingStatLogger prints the connector's ``reduce()`` as
    its "KV Transfer metrics" line: hot hit rate, H2D GB, host pool used,
    pending spills first."""
    s, w = build(**PRESSURE)
    cli = LoggingStatLogger(s.vllm_config)

    def worker_stats(step: int):
        return HiSparseConnectorStats.of(m.MetricsReport(
            counters={m.HITS: 9, m.LOOKUPS: 10, m.L3_LOOKUPS: 1,
                      m.HOST_TO_DEVICE_BYTES: 10**8}))

    for i in range(3):
        s.add_request(make_request(f"r{i}", [7 + i] * 700, 30))
    run = Run(s, w, worker_stats, loggers=[cli])
    lines = []
    fake = mock.Mock()
    fake.info.side_effect = fake.debug.side_effect = (
        lambda fmt, *args: lines.append(fmt % args))
    with mock.patch("vllm.v1.metrics.loggers.logger", fake):
        run.go()
        cli.log()
    line = next(x for x in lines if x.startswith("KV Transfer metrics:"))
    assert line.startswith(
        "KV Transfer metrics: hot_hit_rate_pct=90.0, h2d_GB=")
    assert ", host_pool_used_pct=" in line and ", pending_spills=" in line
    assert f"h2d_GB={round(len(run.stats) * 0.1, 2)}" in line
    assert "lost_pages=" in line and "live_hot_regions" not in line


def test_hisparse_off_exports_nothing(tmp_path):
    """Every hook is a no-op when HiSparse is off: no connector, no
    connector stats, no HiSparse series."""
    s = make_scheduler(tmp_path, baseline_kv_cache_config(num_gpu_blocks=400))
    PrometheusStatLogger(s.vllm_config)
    s.add_request(make_request("x", [5] * 300, 4))
    seen = []
    while s.has_unfinished_requests():
        so = s.schedule()
        req_ids = list(so.num_scheduled_tokens)
        done = [r for r in req_ids
                if s.requests[r].num_computed_tokens + so.num_scheduled_tokens[r]
                >= s.requests[r].num_prompt_tokens]
        out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[9] if r in done else [] for r in req_ids])
        for eco in s.update_from_output(so, out).values():
            if eco.scheduler_stats is not None:
                seen.append(eco.scheduler_stats.kv_connector_stats)
    assert s.connector is None and seen and set(map(type, seen)) == {type(None)}
    assert "vllm:hisparse_" not in generate_latest(REGISTRY).decode()
