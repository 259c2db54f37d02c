# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HiSparse's metrics on vLLM's KV-connector stats path (spec 2.12, 6.4, 6.5).

``HiSparseConnectorStats`` carries one or more ``MetricsReport``s of
``vllm.v1.hisparse.metrics``: worker reports (one per TP rank, aggregated by
vLLM's ``KVOutputAggregator``), then the scheduler's (aggregated by the
scheduler's ``update_from_output``), then, in the front-end, every step of a
logging interval (``KVConnectorLogging``). Its ``data`` is self-describing
plain dicts (``{"counter": {name: n}, "gauge": {...}, "peak": {...}}``), so it
survives the msgspec hop to the front-end and MultiConnector's rebuild by
connector name. ``HiSparsePromMetrics`` exports it to Prometheus; the CLI
stats logger prints ``reduce()`` as its "KV Transfer metrics" line.
"""

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.hisparse.metrics import (
    COUNTER,
    GAUGE,
    HITS,
    HOST_CACHE_USAGE_PERC,
    HOST_TO_DEVICE_BYTES,
    KINDS,
    LOOKUPS,
    METRICS,
    PEAK,
    PENDING_SPILLS,
    MetricsReport,
)


@dataclass
class HiSparseConnectorStats(KVConnectorStats):
    """HiSparse metrics of an interval: counters summed, gauges the latest
    level, peaks the maximum (spec 6.5).

    Aggregating two TP ranks' reports sums their counters (rank 0 alone
    reports lookups, every rank its H2D bytes) and keeps one value of their
    gauges (the ranks hold the same state); aggregating successive steps
    sums the deltas and keeps the newest gauges."""

    def __post_init__(self) -> None:
        if not all(kind in self.data for kind in KINDS):
            self.data = {kind: dict(self.data.get(kind, {})) for kind in KINDS}

    @classmethod
    def of(cls, report: MetricsReport) -> "HiSparseConnectorStats":
        return cls(data={k: dict(v) for k, v in report.as_data().items()})

    def reset(self) -> None:
        self.data = {kind: {} for kind in KINDS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        assert isinstance(other, HiSparseConnectorStats), type(other)
        counters = self.data[COUNTER]
        for name, value in other.data[COUNTER].items():
            counters[name] = counters.get(name, 0) + value
        self.data[GAUGE].update(other.data[GAUGE])
        peaks = self.data[PEAK]
        for name, value in other.data[PEAK].items():
            peaks[name] = max(peaks.get(name, value), value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The CLI stats line (spec 6.4): hot hit rate (%, when there were
        lookups), H2D GB, host pool used (%) and pending spills first, then
        every other metric by its short name."""
        counters, gauges = self.data[COUNTER], self.data[GAUGE]
        out: dict[str, int | float] = {}
        lookups = counters.get(LOOKUPS, 0)
        if lookups:
            out["hot_hit_rate_pct"] = round(100 * counters.get(HITS, 0) / lookups, 1)
        if HOST_TO_DEVICE_BYTES in counters:
            out["h2d_GB"] = round(counters[HOST_TO_DEVICE_BYTES] / 1e9, 2)
        if HOST_CACHE_USAGE_PERC in gauges:
            out["host_pool_used_pct"] = round(100 * gauges[HOST_CACHE_USAGE_PERC], 1)
        if PENDING_SPILLS in gauges:
            out["pending_spills"] = gauges[PENDING_SPILLS]
        summarized = {HOST_TO_DEVICE_BYTES, HOST_CACHE_USAGE_PERC, PENDING_SPILLS}
        for kind in KINDS:
            for name, value in self.data[kind].items():
                if name not in summarized:
                    out[METRICS[name].short_name] = value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(kind) for kind in KINDS)


class HiSparsePromMetrics(KVConnectorPromMetrics):
    """One Prometheus series per metric of ``METRICS`` and engine: counters
    as Counters (exposed with vLLM's ``_total`` suffix), gauges and peaks as
    Gauges. Every series exists, at 0, from the start."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics: dict[str, dict[int, PromMetric]] = {}
        for spec in METRICS.values():
            if spec.kind == COUNTER:
                metric = self._counter_cls(
                    name=spec.name,
                    documentation=spec.documentation,
                    labelnames=labelnames,
                )
            else:
                metric = self._gauge_cls(
                    name=spec.name,
                    documentation=spec.documentation,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            self.metrics[spec.name] = {
                idx: metric.labels(*values)
                for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, value in transfer_stats_data.get(COUNTER, {}).items():
            if value:
                self.metrics[name][engine_idx].inc(value)
        for kind in (GAUGE, PEAK):
            for name, value in transfer_stats_data.get(kind, {}).items():
                self.metrics[name][engine_idx].set(value)


__all__ = ["HiSparseConnectorStats", "HiSparsePromMetrics"]
