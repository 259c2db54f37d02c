# SPDX-License-Identifier: Apache-2.0
"""The worker's device-counter sampler (spec 2.12) on CPU: the real runtime
and worker on the reference kernels and the CPU stream stand-in
(tests/hisparse/worker/worker_harness.py).

Checked: values arrive only after the asynchronous copy's event completed,
never in the step that issued it; they are deltas; H2D bytes are misses x
the row bytes of the group's layers; TP rank 0 alone reports lookups; no
host sync is issued (the stream stand-in records every wait and sync, and
a torch function mode sees every operation on the device counters); the
connector's ``get_kv_connector_stats`` returns them; nothing moves without
pressure."""

from types import SimpleNamespace

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.metrics import (
    HiSparseConnectorStats,
)
from vllm.v1.hisparse import metrics as m
from vllm.v1.hisparse.constants import STATS_INTERVAL_STEPS
from vllm.v1.hisparse.metrics import DeviceCounterSampler
from vllm.v1.hisparse.worker import StreamOps
from worker_harness import W, WorkerRig, attn_metadata, fill_pattern


class GatedStreams(StreamOps):
    """The CPU stand-in, except that an event completes only when the test
    says so (a device copy still in flight)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.done = False

    def query(self, event) -> bool:
        return event.recorded and (self.done or event.name != "hisparse_stats")


class Rig(WorkerRig):
    """A WorkerRig with one request at batch row 0, decoding."""

    def __init__(self, *, freq: int = 1, staging_blocks: int = 0, streams=None):
        super().__init__(freq=freq, staging_blocks=staging_blocks, streams=streams)
        self.topk_seed = 0

    def place(self, row: int, resident: list[int], host: list[int],
              hot: list[int] | None = None) -> None:
        """``WorkerRig.place``, and every layer's host rows filled."""
        super().place(row, resident, host, hot)
        for name in self.layout.sparse_layers:
            fill_pattern(self.rt.layers[name].host, seed=len(name))

    def decode(self, computed: int, meta=None, positions=None) -> None:
        """One decode step of row 0: every layer's attention resolves
        ``positions`` (default: 48 fresh pseudo-random rows of the context)
        through the runtime, in model order."""
        self.batch.schedule(computed=[computed], scheduled=[1])
        md = attn_metadata(self.batch, 1, 1)
        self.worker.start_step(meta or self.meta(), md)
        topk = torch.full((1, self.layout.index_topk), -1, dtype=torch.int32)
        if positions is None:
            g = torch.Generator().manual_seed(self.topk_seed)
            self.topk_seed += 1
            positions = torch.randperm(computed + 1, generator=g)[:48]
        topk[0, : len(positions)] = torch.as_tensor(positions, dtype=torch.int32)
        for name in self.layout.sparse_layers:
            self.rt.decode_rows(name, 1, topk, md.seq_lens, md.block_table)
        self.worker.finish_forward()

    def hybrid(self) -> None:
        """Row 0 under pressure: page 0 lost (null resident entry), read
        from host through its hot region."""
        self.place(0, resident=[0, 4], host=[5, 6], hot=[20, 21])
        self.decode(100, self.meta(hot_regions_allocated=np.array([20]),
                                   hot_region_requests=["r0"]), positions=[])


def resolver_totals(rt) -> np.ndarray:
    """int64 [groups, 4] device counters (a synchronous read: tests only)."""
    return np.stack([g.stats.view(torch.int64).numpy().copy() for g in rt.groups])


def sampler(rig: Rig, interval: int = 1, rank0: bool = True) -> DeviceCounterSampler:
    return DeviceCounterSampler(rig.rt, rig.worker.streams, report_lookups=rank0,
                                interval=interval)


def test_counts_arrive_the_step_after_the_copy_as_deltas():
    """2.12: a copy issued after step t's forward is read on step t+1 (the
    CPU stand-in's events complete at once); each report is the counts up
    to its copy minus those already reported, so the reports add up to the
    device totals exactly."""
    rig = Rig()
    rig.hybrid()
    s = sampler(rig)
    reported = np.zeros(2, dtype=np.int64)
    at_copy = None
    for i in range(6):
        rig.decode(101 + i)
        report = s.sample()
        if i == 0:
            assert report is None  # the first copy was just issued
        else:
            c = report.counters
            assert c[m.LOOKUPS] == c[m.HITS] + c[m.L3_LOOKUPS]
            reported += [c[m.HITS], c[m.L3_LOOKUPS]]
            assert reported.tolist() == at_copy[:2].tolist()
        at_copy = resolver_totals(rig.rt).sum(axis=0)  # what the new copy holds
    assert reported[0] > 0 and reported[1] > 0  # hot hits and host loads both
    assert s.copies_issued == 6 and s.reports == 5


def test_no_value_before_the_copy_completed():
    """2.12: the copy is read only once its event has completed (query,
    never a wait); no second copy is issued while one is in flight."""
    streams = GatedStreams()
    rig = Rig(streams=streams)
    rig.hybrid()
    s = sampler(rig, interval=2)
    for i in range(8):
        rig.decode(101 + i)
        assert s.sample() is None
    assert s.copies_issued == 1
    streams.done = True
    rig.decode(109)
    report = s.sample()
    # The bytes copied at step 2 (after the first two decodes of this test).
    assert report is not None and report.counters[m.LOOKUPS] > 0
    # The interval counts from the previous copy, long past: the next copy
    # is issued at once, and read on the next step.
    assert s.copies_issued == 2
    rig.decode(110)
    assert s.sample() is not None and s.copies_issued == 2
    rig.decode(111)
    assert s.sample() is None and s.copies_issued == 3


class DeviceTouches(TorchFunctionMode):
    """Records every torch function that touches one of ``tensors``."""

    def __init__(self, tensors) -> None:
        super().__init__()
        self.ptrs = {t.data_ptr() for t in tensors}
        self.calls: list[tuple[str, dict]] = []

    def _touches(self, value) -> bool:
        if isinstance(value, torch.Tensor):
            return value.data_ptr() in self.ptrs
        if isinstance(value, (list, tuple)):
            return any(self._touches(v) for v in value)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._touches(args) or self._touches(list(kwargs.values())):
            self.calls.append((getattr(func, "__name__", str(func)), dict(kwargs)))
        return func(*args, **kwargs)


def test_sampling_issues_no_host_sync():
    """2.12 "no host sync": the device counters are only stacked and copied
    with ``non_blocking=True`` (nothing reads them to the host: no .item(),
    .cpu(), .tolist(), .numpy()), and the sampler never waits on or
    synchronizes an event or stream; it records one event on the compute
    stream per copy."""
    rig = Rig()
    rig.hybrid()
    s = sampler(rig)
    device = [g.stats for g in rig.rt.groups] + [s._device]
    log_start = len(rig.worker.streams.log)
    for i in range(4):
        rig.decode(101 + i)
        mark = len(rig.worker.streams.log)
        with DeviceTouches(device) as touches:
            s.sample()
        ours = rig.worker.streams.log[mark:]
        assert ours == [("record", "hisparse_stats", "compute")]
        names = [name for name, _ in touches.calls]
        assert names == ["stack", "copy_"], names
        assert touches.calls[1][1].get("non_blocking") is True
    log = rig.worker.streams.log[log_start:]
    assert not [e for e in log if e[0] == "synchronize"]


def test_h2d_bytes_are_misses_times_the_groups_row_bytes():
    """2.12: H2D bytes = misses x sum of W over the group's layers. With
    IndexShare (freq=2) a leader's miss also loads its follower's row."""
    rig = Rig(freq=2)
    rig.hybrid()
    s = sampler(rig)
    lengths = np.array([len(g.layers) for g in rig.rt.groups])
    assert set(lengths.tolist()) == {1, 2}
    rig.decode(101)
    s.sample()
    copied = resolver_totals(rig.rt)  # the copy just issued: counts since start
    rig.decode(102)
    report = s.sample()
    misses = copied[:, 1]
    assert report.counters[m.L3_LOOKUPS] == int(misses.sum()) > 0
    assert report.counters[m.HOST_TO_DEVICE_BYTES] == int((misses * lengths * W).sum())
    assert report.counters[m.HOST_TO_DEVICE_BYTES] > int(misses.sum()) * W


def test_rank_other_than_zero_reports_its_bytes_but_no_lookups():
    """Every TP rank resolves the same top-k: lookups from rank 0 only (a
    replica's lookups do not scale with TP), H2D bytes from every rank."""
    rig = Rig()
    rig.hybrid()
    s = sampler(rig, rank0=False)
    rig.decode(101)
    s.sample()
    rig.decode(102)
    report = s.sample()
    assert set(report.counters) == {m.HOST_TO_DEVICE_BYTES}
    assert report.counters[m.HOST_TO_DEVICE_BYTES] > 0


def test_gauges_live_hot_regions_and_the_staging_peak():
    """Live hot regions from the slot allocator; the in-slab staging blocks
    used by a short chunk on the decode kernel (K13), the maximum since the
    previous copy, then 0 once read."""
    rig = Rig(staging_blocks=4)
    rig.place(0, resident=[0, 4], host=[5, 6])
    rig.batch.schedule(computed=[97], scheduled=[3])
    rig.worker.start_step(rig.meta(), attn_metadata(rig.batch, 1, 3))
    rig.rt.plan_extends(1)
    rig.worker.finish_forward()
    s = sampler(rig)
    assert s.sample() is None
    rig.hybrid()
    report = s.sample()
    assert report.peaks == {m.STAGING_BLOCKS_USED: 1}
    assert report.gauges == {m.LIVE_HOT_REGIONS: 0}  # taken when the copy was issued
    rig.decode(101)
    report = s.sample()
    assert report.peaks == {m.STAGING_BLOCKS_USED: 0}
    assert report.gauges == {m.LIVE_HOT_REGIONS: 1}


def test_nothing_moves_without_pressure():
    """E2E-8 on CPU: every page resident, so the resolver short-circuits:
    no lookups, no H2D bytes, no hot region."""
    rig = Rig()
    rig.place(0, resident=[3, 4], host=[5, 6])
    s = sampler(rig)
    reports = []
    for i in range(5):
        rig.decode(100 + i)
        reports.append(s.sample())
    for report in reports[1:]:
        assert set(report.counters.values()) == {0}
        assert report.gauges == {m.LIVE_HOT_REGIONS: 0}
        assert report.peaks == {m.STAGING_BLOCKS_USED: 0}


def test_default_interval_is_the_constant():
    rig = Rig()
    s = DeviceCounterSampler(rig.rt, rig.worker.streams, report_lookups=True)
    assert s.interval == STATS_INTERVAL_STEPS
    for _ in range(STATS_INTERVAL_STEPS - 1):
        assert s.sample() is None
    assert s.copies_issued == 0
    s.sample()
    assert s.copies_issued == 1


def test_the_connector_returns_them_through_get_kv_connector_stats():
    """The runner calls the worker connector's ``get_kv_connector_stats``
    every step (outside the forward); without an attached worker it is
    None (HiSparse off: no-op)."""
    vllm_config = SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="HiSparseConnector", kv_role="kv_both"))
    rig = Rig()
    connector = HiSparseConnector(vllm_config, KVConnectorRole.WORKER, rig.config)
    assert connector.get_kv_connector_stats() is None
    connector.attach_worker(rig.worker)
    connector._sampler.interval = 1
    rig.hybrid()
    assert connector.get_kv_connector_stats() is None
    rig.decode(101)
    stats = connector.get_kv_connector_stats()
    assert isinstance(stats, HiSparseConnectorStats)
    assert stats.data[m.COUNTER][m.L3_LOOKUPS] == 0  # the hybrid step loaded nothing
    rig.decode(102)
    stats = connector.get_kv_connector_stats()
    assert stats.data[m.COUNTER][m.LOOKUPS] > 0
    assert stats.data[m.GAUGE][m.LIVE_HOT_REGIONS] == 1
