# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C12: HiSparse metrics, collected on both sides (spec 2.12, 6.4, 6.5).

What is measured, and where (docs/worker.md "Metrics (C12)", K21-K25):

- worker (``DeviceCounterSampler``): the resolver's device counters of every
  index group (``IndexGroup.stats``: hits, misses, tripped, rejected), read
  *asynchronously*: every ``STATS_INTERVAL_STEPS`` steps, outside CUDA-graph
  capture, one stack of the groups' counters on the compute stream, one
  non-blocking copy into pinned host memory and one event record; a later
  step reads the copy once ``event.query()`` says it is done (never a wait,
  never ``.item()``), turns the cumulative values into deltas and reports
  them with the gauges taken when the copy was issued (live hot regions,
  the in-slab staging blocks' peak). Nothing on the decode path changes:
  the kernels keep incrementing the same counters, which are never reset.
- scheduler (``SchedulerMetrics``): the coordinator's counters as deltas
  since the last report, the pending spills and the host pool's occupancy
  as levels, every step (plain Python, no torch).

Both produce a ``MetricsReport``: counters (deltas, summed when reports are
combined), gauges (levels, the latest wins) and peaks (maxima over an
interval, the largest wins). The connector carries them through vLLM's own
KV-connector stats path (``HiSparseConnectorStats``: aggregated across TP
workers and with the scheduler's, logged by the CLI stats logger, exported
by ``HiSparsePromMetrics``).

NOTE: every rank resolves the same top-k against its own copy of the same
state, so only TP rank 0 reports the lookup counters (a replica's lookups do
not grow with TP); every rank reports its own H2D bytes (each copies them).
"""

from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.v1.hisparse.constants import STATS_INTERVAL_STEPS

if TYPE_CHECKING:
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator
    from vllm.v1.hisparse.runtime import HiSparseRuntime

COUNTER = "counter"
GAUGE = "gauge"
PEAK = "peak"
"""A gauge that holds the maximum over an interval."""

KINDS = (COUNTER, GAUGE, PEAK)


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its Prometheus name, kind and meaning."""

    name: str
    kind: str
    documentation: str
    side: str
    """"worker" or "scheduler": who reports it."""

    @property
    def short_name(self) -> str:
        """The name without ``vllm:hisparse_`` (the CLI stats line's key)."""
        return self.name.removeprefix("vllm:hisparse_")


# Upstream vLLM's HiSparse names, kept so that dashboards carry over.
HITS = "vllm:hisparse_hits"
LOOKUPS = "vllm:hisparse_lookups"
L3_LOOKUPS = "vllm:hisparse_l3_lookups"
# Spec 6.5's names.
HOST_TO_DEVICE_BYTES = "vllm:hisparse_host_to_device_bytes"
HOST_CACHE_USAGE_PERC = "vllm:hisparse_host_cache_usage_perc"
HOST_BLOCKS_USED = "vllm:hisparse_host_blocks_used"
HOST_BLOCKS_TOTAL = "vllm:hisparse_host_blocks_total"
PENDING_SPILLS = "vllm:hisparse_pending_spills"
LOST_PAGES = "vllm:hisparse_lost_pages"
# Ours.
HOST_POOL_USED_BYTES = "vllm:hisparse_host_pool_used_bytes"
SPILLS_COMPLETED = "vllm:hisparse_spills_completed"
LIVE_HOT_REGIONS = "vllm:hisparse_live_hot_regions"
STAGING_BLOCKS_USED = "vllm:hisparse_staging_blocks_used"
SCHEDULER_WAITS = "vllm:hisparse_scheduler_waits"
STAGING_DEFERRALS = "vllm:hisparse_staging_deferrals"
PUBLICATION_WAITS = "vllm:hisparse_publication_waits"
ADMISSION_BACKOFFS = "vllm:hisparse_admission_backoffs"
IMPORT_DEVICE_PAGES = "vllm:hisparse_import_device_pages"
IMPORT_HOST_PAGES = "vllm:hisparse_import_host_pages"
IMPORT_WAITS = "vllm:hisparse_import_waits"
IMPORT_FALLBACKS = "vllm:hisparse_import_fallbacks"

METRICS: dict[str, MetricSpec] = {
    m.name: m
    for m in (
        MetricSpec(
            HITS, COUNTER,
            "Host-backed KV rows the sparse-MLA resolver found in a request's "
            "GPU hot buffer (distinct rows per request and step, summed over "
            "index groups; TP rank 0).",
            "worker",
        ),
        MetricSpec(
            LOOKUPS, COUNTER,
            "Host-backed KV rows the resolver looked up in the hot buffer: "
            "hits + rows copied from the host pool (rows of GPU-resident "
            "pages are not lookups; TP rank 0).",
            "worker",
        ),
        MetricSpec(
            L3_LOOKUPS, COUNTER,
            "Lookups served from the pinned host pool: hot-buffer misses, each "
            "one row copied host to device (TP rank 0).",
            "worker",
        ),
        MetricSpec(
            HOST_TO_DEVICE_BYTES, COUNTER,
            "Bytes the resolver's misses copied from the host pool to the GPU: "
            "misses x the row bytes of every layer of their index group, "
            "summed over TP ranks.",
            "worker",
        ),
        MetricSpec(
            LIVE_HOT_REGIONS, GAUGE,
            "Requests holding a GPU hot region (request-state slots in use), "
            "as of the last device-counter sample.",
            "worker",
        ),
        MetricSpec(
            STAGING_BLOCKS_USED, PEAK,
            "Most in-slab staging blocks one step used for short prefill "
            "chunks on the decode kernel, over the last sampling interval.",
            "worker",
        ),
        MetricSpec(
            LOST_PAGES, COUNTER,
            "Unpinned resident pages whose GPU blocks the pool reused (the "
            "page is then read from host through the hot buffer).",
            "scheduler",
        ),
        MetricSpec(
            SPILLS_COMPLETED, COUNTER,
            "Page spills (GPU to host copies) acknowledged complete.",
            "scheduler",
        ),
        MetricSpec(
            PENDING_SPILLS, GAUGE,
            "Page spills planned or in flight, not yet acknowledged.",
            "scheduler",
        ),
        MetricSpec(
            HOST_BLOCKS_USED, GAUGE,
            "Host pool blocks in use (evictable prefix-cached blocks count "
            "as free).",
            "scheduler",
        ),
        MetricSpec(
            HOST_BLOCKS_TOTAL, GAUGE,
            "Host pool blocks (per DP replica, without the null block).",
            "scheduler",
        ),
        MetricSpec(
            HOST_POOL_USED_BYTES, GAUGE,
            "Host pool bytes in use: used blocks x the host block stride "
            "(per DP replica).",
            "scheduler",
        ),
        MetricSpec(
            HOST_CACHE_USAGE_PERC, GAUGE,
            "Host pool usage, 0 to 1 (1 = full; evictable cached blocks "
            "count as free).",
            "scheduler",
        ),
        MetricSpec(
            SCHEDULER_WAITS, COUNTER,
            "Scheduling attempts in which a running request waited for "
            "in-flight copies instead of being preempted.",
            "scheduler",
        ),
        MetricSpec(
            STAGING_DEFERRALS, COUNTER,
            "Short prefill chunks deferred a step because the step's staged "
            "pages would exceed the in-slab staging blocks.",
            "scheduler",
        ),
        MetricSpec(
            PUBLICATION_WAITS, COUNTER,
            "Admissions deferred a step because the request's prefix hit "
            "stopped at a page a finished request was still publishing.",
            "scheduler",
        ),
        MetricSpec(
            ADMISSION_BACKOFFS, COUNTER,
            "Steps on which the waiting head's admission was not attempted: "
            "it failed for lack of GPU blocks and no more blocks were "
            "available to it since (R35).",
            "scheduler",
        ),
        MetricSpec(
            IMPORT_DEVICE_PAGES, COUNTER,
            "P/D-imported pages that landed in resident GPU pages (spec 4.13).",
            "scheduler",
        ),
        MetricSpec(
            IMPORT_HOST_PAGES, COUNTER,
            "P/D-imported pages that landed in the host pool (spec 4.13).",
            "scheduler",
        ),
        MetricSpec(
            IMPORT_WAITS, COUNTER,
            "Admissions deferred a step because neither landing of their P/D "
            "import fitted (never a preemption, INV-30).",
            "scheduler",
        ),
        MetricSpec(
            IMPORT_FALLBACKS, COUNTER,
            "P/D imports given up for recomputation (bounded waits exhausted, "
            "or the load failed).",
            "scheduler",
        ),
    )
}


@dataclass
class MetricsReport:
    """Values of one report, by Prometheus name and kind."""

    counters: dict[str, int] = field(default_factory=dict)
    """Deltas since the previous report of the same source."""
    gauges: dict[str, int | float] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)

    def as_data(self) -> dict[str, dict[str, Any]]:
        return {COUNTER: self.counters, GAUGE: self.gauges, PEAK: self.peaks}


# ----------------------------------------------------------------- worker


class DeviceCounterSampler:
    """Reads the resolver's device counters without a host sync (2.12).

    ``sample()`` is called once per step, after the forward (the connector's
    ``get_kv_connector_stats``, which the runner calls outside any CUDA
    graph). It first reads a finished copy, if one is in flight and its event
    has completed, then, every ``interval`` steps and when no copy is in
    flight, issues the next one. A copy is therefore read at the earliest one
    step after it was issued, and only once its event says the bytes landed.

    NOTE: the counters are cumulative and never reset (``runtime.stats()``
    and the tests read the same tensors); deltas are taken on the host
    against the previous copy. The resolver runs on the compute stream
    (docs/worker.md K6), so a copy issued on it after the forward sees every
    count of that forward.
    """

    def __init__(
        self,
        runtime: "HiSparseRuntime",
        streams: Any,
        *,
        report_lookups: bool,
        interval: int = STATS_INTERVAL_STEPS,
    ) -> None:
        if interval < 1:
            raise ValueError(f"HiSparse stats interval must be >= 1 (got {interval})")
        self.runtime = runtime
        self.streams = streams
        self.interval = interval
        self.report_lookups = report_lookups
        groups = runtime.groups
        device = runtime.device
        self._cuda = device.type == "cuda"
        # uint64 counters read as int64 (same bits; counts stay < 2**63).
        self._counters = [g.stats.view(torch.int64) for g in groups]
        n = len(groups)
        self._device = torch.zeros((n, 4), dtype=torch.int64, device=device)
        self._host = torch.zeros((n, 4), dtype=torch.int64, pin_memory=self._cuda)
        self._last = np.zeros((n, 4), dtype=np.int64)
        row_bytes = runtime.geometry.row_bytes
        self._bytes_per_miss = np.array(
            [len(g.layers) * row_bytes for g in groups], dtype=np.int64
        )
        self._event = streams.event("hisparse_stats")
        self._in_flight: dict[str, int] | None = None
        """The gauges taken when the copy in flight was issued."""
        self._steps = 0
        self.copies_issued = 0
        self.reports = 0

    def sample(self) -> MetricsReport | None:
        """This step's report, if a copy finished; never blocks."""
        self._steps += 1
        report = None
        if self._in_flight is not None and self.streams.query(self._event):
            report = self._read()
        if (
            self._in_flight is None
            and self._steps >= self.interval
            and not self._capturing()
        ):
            self._issue()
        return report

    def _capturing(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def _issue(self) -> None:
        rt = self.runtime
        if self._counters:
            torch.stack(self._counters, out=self._device)
            self._host.copy_(self._device, non_blocking=True)
        self.streams.record(self._event, self.streams.compute())
        self._in_flight = {
            LIVE_HOT_REGIONS: rt.slots.num_live,
            STAGING_BLOCKS_USED: rt.staging_blocks_peak,
        }
        rt.staging_blocks_peak = 0
        self._steps = 0
        self.copies_issued += 1

    def _read(self) -> MetricsReport:
        assert self._in_flight is not None
        values = self._host.numpy().copy()
        delta = values - self._last
        self._last = values
        gauges, self._in_flight = self._in_flight, None
        misses = delta[:, 1]
        counters = {HOST_TO_DEVICE_BYTES: int((misses * self._bytes_per_miss).sum())}
        if self.report_lookups:
            hits, num_misses = int(delta[:, 0].sum()), int(misses.sum())
            counters.update(
                {HITS: hits, LOOKUPS: hits + num_misses, L3_LOOKUPS: num_misses}
            )
        self.reports += 1
        return MetricsReport(
            counters=counters,
            gauges={LIVE_HOT_REGIONS: gauges[LIVE_HOT_REGIONS]},
            peaks={STAGING_BLOCKS_USED: gauges[STAGING_BLOCKS_USED]},
        )


# -------------------------------------------------------------- scheduler

_SCHEDULER_COUNTERS: tuple[tuple[str, str], ...] = (
    (LOST_PAGES, "lost_pages"),
    (SPILLS_COMPLETED, "spills_completed"),
    (SCHEDULER_WAITS, "waits_for_in_flight"),
    (STAGING_DEFERRALS, "staging_deferrals"),
    (PUBLICATION_WAITS, "publication_waits"),
    (ADMISSION_BACKOFFS, "admission_backoffs"),
    (IMPORT_DEVICE_PAGES, "import_device_pages"),
    (IMPORT_HOST_PAGES, "import_host_pages"),
    (IMPORT_WAITS, "import_waits"),
    (IMPORT_FALLBACKS, "import_fallbacks"),
)
"""Metric name -> ``HiSparseSchedulerStats`` field."""


class SchedulerMetrics:
    """The scheduler's share of C12, reported every step something moved (6.5).

    Counters are deltas of the coordinator's ``HiSparseSchedulerStats``
    since the previous report; the gauges are levels: pending spills
    (``len(pending_spills)``, planned and in flight) and the host pool's
    occupancy. Used host blocks exclude free ones, and the pool's free queue
    holds the evictable prefix-cached blocks too, so those count as free.

    A step on which no counter and no level moved reports nothing (P2: a
    steady decode step builds no report, and vLLM merges none): deltas of
    zero add nothing and the levels stand where the last report left them,
    which is what a Prometheus gauge keeps anyway."""

    def __init__(self, coordinator: "HiSparseCoordinator", host_block_bytes: int) -> None:
        self.coordinator = coordinator
        self.host_block_bytes = host_block_bytes
        self._read_counters = attrgetter(*(attr for _, attr in _SCHEDULER_COUNTERS))
        self._last: tuple[int, ...] = (0,) * len(_SCHEDULER_COUNTERS)
        self._last_levels: tuple[int, int] | None = None
        """(pending spills, free host blocks) at the last report; None
        before the first, which always reports (the levels at startup)."""

    def collect(self) -> MetricsReport | None:
        co = self.coordinator
        values = self._read_counters(co.stats)
        pool = co.host_pool
        levels = (len(co.pending_spills), pool.get_num_free_blocks())
        if values == self._last and levels == self._last_levels:
            return None
        counters = {
            name: value - last
            for (name, _), value, last in zip(_SCHEDULER_COUNTERS, values, self._last)
        }
        self._last, self._last_levels = values, levels
        pending, free = levels
        total = pool.num_gpu_blocks - 1  # block 0 is the null block
        used = total - free
        return MetricsReport(
            counters=counters,
            gauges={
                PENDING_SPILLS: pending,
                HOST_BLOCKS_USED: used,
                HOST_BLOCKS_TOTAL: total,
                HOST_POOL_USED_BYTES: used * self.host_block_bytes,
                HOST_CACHE_USAGE_PERC: used / total if total > 0 else 0.0,
            },
        )


__all__ = [
    "COUNTER",
    "DeviceCounterSampler",
    "GAUGE",
    "KINDS",
    "METRICS",
    "MetricSpec",
    "MetricsReport",
    "PEAK",
    "SchedulerMetrics",
]
