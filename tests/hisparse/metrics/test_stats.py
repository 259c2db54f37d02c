# SPDX-License-Identifier: Apache-2.0
"""``HiSparseConnectorStats`` (spec 6.4, 6.5): what vLLM's KV-connector stats
path does with it. Worker reports are aggregated across TP ranks by vLLM's
own ``KVOutputAggregator``, the scheduler's report is aggregated into them,
the front-end rebuilds them by connector name (HiSparse alone, or first
child of a MultiConnector) after a msgspec round trip, and the CLI stats
logger prints ``reduce()``."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.metrics import (
    HiSparseConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorStats,
)
from vllm.v1.hisparse import metrics as m
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput


def worker_report(rank: int, hits: int, misses: int, h2d: int) -> HiSparseConnectorStats:
    """A worker's report as the sampler builds it: rank 0 alone has the
    lookup counters (spec 2.12: one replica's lookups, not TP x)."""
    counters = {m.HOST_TO_DEVICE_BYTES: h2d}
    if rank == 0:
        counters |= {m.HITS: hits, m.LOOKUPS: hits + misses, m.L3_LOOKUPS: misses}
    return HiSparseConnectorStats.of(m.MetricsReport(
        counters=counters, gauges={m.LIVE_HOT_REGIONS: 3},
        peaks={m.STAGING_BLOCKS_USED: 4 + rank}))


def scheduler_report(lost: int = 2, pending: int = 5, usage: float = 0.25):
    return HiSparseConnectorStats.of(m.MetricsReport(
        counters={m.LOST_PAGES: lost, m.SPILLS_COMPLETED: 7, m.SCHEDULER_WAITS: 0,
                  m.STAGING_DEFERRALS: 0, m.PUBLICATION_WAITS: 0},
        gauges={m.PENDING_SPILLS: pending, m.HOST_BLOCKS_USED: 25,
                m.HOST_BLOCKS_TOTAL: 100, m.HOST_POOL_USED_BYTES: 25 * 4096,
                m.HOST_CACHE_USAGE_PERC: usage}))


def runner_output(stats) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[], req_id_to_index={},
        kv_connector_output=KVConnectorOutput(kv_connector_stats=stats))


def test_tp_ranks_aggregate_through_vllms_output_aggregator():
    """Spec 2.12: H2D bytes add up over TP ranks (each copies its rows),
    lookups come from rank 0 only, gauges are one value, peaks the max."""
    agg = KVOutputAggregator(expected_finished_count=2)
    out = agg.aggregate([runner_output(worker_report(0, 90, 10, 6560)),
                         runner_output(worker_report(1, 90, 10, 6560))])
    stats = out.kv_connector_output.kv_connector_stats
    assert isinstance(stats, HiSparseConnectorStats)
    assert stats.data[m.COUNTER] == {
        m.HOST_TO_DEVICE_BYTES: 13120, m.HITS: 90, m.LOOKUPS: 100, m.L3_LOOKUPS: 10}
    assert stats.data[m.GAUGE] == {m.LIVE_HOT_REGIONS: 3}
    assert stats.data[m.PEAK] == {m.STAGING_BLOCKS_USED: 5}


def test_a_rank_without_a_report_this_step_is_skipped():
    """Ranks sample on their own schedule: a rank whose copy has not landed
    reports None and the others' values pass through unchanged."""
    agg = KVOutputAggregator(expected_finished_count=2)
    out = agg.aggregate([runner_output(None), runner_output(worker_report(0, 1, 1, 656))])
    stats = out.kv_connector_output.kv_connector_stats
    assert stats.data[m.COUNTER][m.LOOKUPS] == 2


def test_successive_steps_sum_counters_and_keep_the_latest_gauge():
    """Spec 6.5 over a logging interval: counters are deltas (summed),
    gauges levels (the newest), peaks maxima."""
    total = HiSparseConnectorStats()
    assert total.is_empty()
    for lost, pending, peak in ((1, 9, 2), (2, 4, 6), (0, 3, 1)):
        step = scheduler_report(lost=lost, pending=pending)
        step.data[m.PEAK][m.STAGING_BLOCKS_USED] = peak
        total = total.aggregate(step)
    assert total.data[m.COUNTER][m.LOST_PAGES] == 3
    assert total.data[m.COUNTER][m.SPILLS_COMPLETED] == 21
    assert total.data[m.GAUGE][m.PENDING_SPILLS] == 3
    assert total.data[m.PEAK][m.STAGING_BLOCKS_USED] == 6
    assert not total.is_empty()
    assert total.aggregate(HiSparseConnectorStats()) is total
    total.reset()
    assert total.is_empty()


def test_reduce_leads_with_the_spec_line_values():
    """Spec 6.4's periodic line, as vLLM's connector logging prints it:
    hot hit rate, H2D GB, host pool used, pending spills, then the rest."""
    stats = worker_report(0, hits=930, misses=70, h2d=1_234_000_000)
    stats.aggregate(scheduler_report(pending=3, usage=0.4567))
    out = stats.reduce()
    assert list(out)[:4] == ["hot_hit_rate_pct", "h2d_GB", "host_pool_used_pct",
                             "pending_spills"]
    assert out["hot_hit_rate_pct"] == 93.0
    assert out["h2d_GB"] == 1.23
    assert out["host_pool_used_pct"] == 45.7
    assert out["pending_spills"] == 3
    assert out["lookups"] == 1000 and out["l3_lookups"] == 70
    assert out["lost_pages"] == 2 and out["live_hot_regions"] == 3
    assert out["staging_blocks_used"] == 4
    assert "host_to_device_bytes" not in out  # shown as h2d_GB


def test_reduce_has_no_hit_rate_without_lookups():
    """No pressure: every row resident, nothing looked up; a 0% rate would
    misreport an idle hot buffer."""
    stats = worker_report(0, hits=0, misses=0, h2d=0)
    assert "hot_hit_rate_pct" not in stats.reduce()
    assert stats.reduce()["h2d_GB"] == 0


def test_msgspec_round_trip_and_rebuild_by_connector_name():
    """SchedulerStats carry ``stats.data`` to the front-end over msgspec;
    KVConnectorLogging/PrometheusStatLogger rebuild it with the configured
    connector's ``build_kv_connector_stats`` (HiSparse alone), or
    MultiConnector's by child class name (HiSparse first, spec 6.2)."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = worker_report(0, 9, 1, 656).aggregate(scheduler_report())
    wire = MsgpackDecoder(dict).decode(MsgpackEncoder().encode(stats.data))
    alone = HiSparseConnector.build_kv_connector_stats(data=wire)
    assert isinstance(alone, HiSparseConnectorStats)
    assert alone.reduce() == stats.reduce()

    multi = MultiKVConnectorStats(data={"HiSparseConnector": stats})
    wire = MsgpackDecoder(dict).decode(MsgpackEncoder().encode(multi.data))
    rebuilt = MultiConnector.build_kv_connector_stats(data=wire)
    assert isinstance(rebuilt["HiSparseConnector"], HiSparseConnectorStats)
    assert rebuilt.reduce()["HiSparseConnector"] == stats.reduce()


def test_empty_build_is_an_empty_stats_object():
    assert HiSparseConnector.build_kv_connector_stats().is_empty()
    assert HiSparseConnector.build_kv_connector_stats(data={}).is_empty()


@pytest.mark.parametrize("name", ["vllm:hisparse_hits", "vllm:hisparse_lookups",
                                  "vllm:hisparse_l3_lookups"])
def test_upstream_names_are_kept_exactly(name):
    """Target: upstream vLLM's HiSparse series, so dashboards carry over.
    The names are literals: a renamed constant fails here."""
    assert name in m.METRICS and m.METRICS[name].kind == m.COUNTER


def test_spec_6_5_names_are_exported():
    """Spec 6.5's table, where it names a metric (hits/misses take
    upstream's names, docs/worker.md K22)."""
    for name in ("vllm:hisparse_host_to_device_bytes",
                 "vllm:hisparse_host_cache_usage_perc",
                 "vllm:hisparse_host_blocks_used", "vllm:hisparse_host_blocks_total",
                 "vllm:hisparse_pending_spills", "vllm:hisparse_lost_pages"):
        assert name in m.METRICS, name
    assert m.METRICS[m.LOST_PAGES].kind == m.COUNTER
    assert m.METRICS[m.PENDING_SPILLS].kind == m.GAUGE
