# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C6: the HiSparse worker data plane (spec 2.7, 4.1, 4.3, 4.9-4.12).

It executes the scheduler's per-step command (INV-8: it never interprets a
request's lifetime) and moves bytes between the device slab and the pinned
host pool:

- **row mirror** (4.9): every row the forward wrote is copied resident ->
  host. The rows are exactly the step's slot mappings: resident group j's
  slot of each token (the row the KV write used) and the source group's slot
  (host row g = host_block * B + offset). Descriptors (one per token and
  layer, W bytes) are built on the GPU from those mappings before the
  forward, so no host sync and no per-token Python is needed, and executed by
  ``copy_descriptors`` (K5) on the DMA stream. A pure-decode batch is
  mirrored inside the forward instead, after the last target layer's
  attention, where a FULL graph captures both launches
  (``mirror_in_forward``, docs/worker.md K39). Decode mirrors are 656-B
  rows: never one copy-engine descriptor per row (4.10).
- **per-layer submission** (4.10): in a batch that is not pure decode (and
  so never a FULL-graph replay), the mirror of a resident group's layers is
  submitted as soon as its last layer has written its KV (``on_kv_written``),
  pipelining long-prefill mirrors with the remaining layers;
  ``finish_forward`` submits whatever is left, once, and rejects a partial
  group.
- **draft layers** (the MTP layer, 4.10, F2): excluded from the target
  mirror and never submitted per layer; their rows (the target tokens'
  rows, rewritten by the drafter's pass 0) are copied in ``finish_forward``
  (``wait_for_save``, after the last draft pass), only if a draft pass ran,
  and before the spills (INV-26).
- **spills** (4.3): with the eager mirror (default) a spill is a completion
  barrier recorded on the DMA stream after this step's mirrors (INV-26);
  with ``eager_host_mirror=false`` decode rows are not mirrored and a spill
  copies the page of every layer with the copy engines (page-sized
  descriptors). Prefill rows are always mirrored.
- **host-write events** (4.11): two events alternate; the compute stream of
  step t+1 waits for every host write of step t (INV-27; in stream order
  when they all ran on the compute stream), which also keeps
  the persistent descriptor buffers and any freed-and-reused GPU block from
  being overwritten under an in-flight copy.
- **acks** (4.3, F17): a transfer is reported enqueued in the step it was
  submitted, and completed (by event query, never a wait) in every ack until
  the scheduler retires it, with the step after whose forward it ran.
- **CoW** (4.12): host-to-host page copies on the CPU after synchronizing the
  previous host-write event (a deliberate host sync; v1 never triggers it,
  prefix hits are block-aligned).
- **shared host pool** (4.12, INV-28): on the TP ranks other than rank 0
  (``host_pool.sharing``) the worker is a reader: no mirrors, no spills, no
  CoW (only its barrier), no audit, no spill acks; it restores and acks its
  own restores, and its compute stream follows rank 0's host-write events
  (``tp_shared``).
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.hisparse import debug_faults
from vllm.v1.hisparse.layout import last_in_forward
from vllm.v1.hisparse.metadata import HiSparseStepMetadata, HiSparseWorkerAck, empty_ids
from vllm.v1.hisparse.runtime import HiSparseRuntime
from vllm.v1.hisparse.tp_shared import HostSharing, ReaderHostWriteEvents, WriterLink

logger = init_logger(__name__)

DEBUG_ENV = "VLLM_HISPARSE_DEBUG"


def debug_enabled() -> bool:
    """``VLLM_HISPARSE_DEBUG=1``: the mirror audit (spec 6.1; tests only)."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


class StreamOps:
    """The data plane's streams and events.

    On CUDA: the current (compute) stream, a DMA stream and CUDA events. On
    CPU (tests) every operation runs in program order, events are always
    complete, and each call is appended to ``log`` so that a test can check
    the order of waits and records (W-5).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.log: list[tuple[str, ...]] = []
        self.dma: Any = self.new_stream("dma")

    def compute(self) -> Any:
        return torch.cuda.current_stream() if self.cuda else "compute"

    def new_stream(self, name: str) -> Any:
        """A further side stream (the followers' gathers, spec 2.10)."""
        return torch.cuda.Stream(device=self.device) if self.cuda else name

    def event(self, name: str = "event", interprocess: bool = False) -> Any:
        if not self.cuda:
            return _CpuEvent(name)
        return torch.cuda.Event(interprocess=interprocess)

    def ipc_handle(self, event: Any) -> bytes:
        """What another process opens ``event`` by (an interprocess event)."""
        return event.ipc_handle() if self.cuda else event.name.encode()

    def open_ipc_event(self, handle: bytes) -> Any:
        if not self.cuda:
            return _CpuEvent(handle.decode(), recorded=True)
        return torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)

    def record(self, event: Any, stream: Any) -> None:
        if self.cuda:
            event.record(stream)
        else:
            event.recorded = True
            self.log.append(("record", event.name, stream))

    def wait(self, stream: Any, event: Any) -> None:
        if self.cuda:
            stream.wait_event(event)
        else:
            self.log.append(("wait", stream, event.name))

    def query(self, event: Any) -> bool:
        return bool(event.query()) if self.cuda else event.recorded

    def synchronize(self, event: Any) -> None:
        if self.cuda:
            event.synchronize()
        else:
            self.log.append(("synchronize", event.name))

    def on(self, stream: Any):
        if self.cuda:
            return torch.cuda.stream(stream)
        return _CpuStreamContext(self.log, stream)


@dataclass
class _CpuEvent:
    name: str
    recorded: bool = False


@dataclass
class _CpuStreamContext:
    log: list
    stream: str

    def __enter__(self) -> None:
        self.log.append(("enter", self.stream))

    def __exit__(self, *exc: object) -> None:
        self.log.append(("exit", self.stream))


class HostWriteEvents:
    """Two alternating host-write events (spec 4.11, INV-27).

    On the writer of a shared pool (``link``) they are interprocess events
    the readers open; each record waits out a reader two steps behind and is
    stamped with its step (``tp_shared.WriterLink``)."""

    def __init__(self, streams: StreamOps, link: WriterLink | None = None) -> None:
        self._streams = streams
        self._link = link
        shared = link is not None
        self._events = [
            streams.event(f"host_write{i}", interprocess=shared) for i in (0, 1)
        ]
        if link is not None and not link.publish(
            lambda: [streams.ipc_handle(e) for e in self._events]
        ):
            self._events = [streams.event(f"host_write{i}") for i in (0, 1)]
        self._recorded = [False, False]
        self._on_compute = [False, False]
        """Recorded on the compute stream: the next step's compute follows
        it in stream order, so ``rotate`` issues no wait for it (P2)."""
        self._deferred = [False, False]
        """A compute-stream record not yet made: without readers in other
        processes only a CPU wait needs the event, and it records one then
        (P2: a steady decode step records none)."""
        self._cur = 0
        self._step = 0
        self._previous_step = 0

    @property
    def current(self) -> Any:
        return self._events[self._cur]

    def rotate(self, step: int = 0) -> None:
        """At each step start: the previous step's event becomes ``prev`` and
        the compute stream waits on it."""
        prev = self._cur
        self._cur ^= 1
        self._recorded[self._cur] = self._deferred[self._cur] = False
        self._previous_step, self._step = self._step, step
        if self._recorded[prev] and not self._on_compute[prev]:
            self._streams.wait(self._streams.compute(), self._events[prev])

    def record(self, stream: Any) -> None:
        """This step's host writes end at ``stream``'s current position."""
        self._record(stream, on_compute=False)

    def record_on_compute(self) -> None:
        """This step's host writes were all issued on the compute stream.
        Private pool: nothing is recorded until ``synchronize_previous``
        needs it (the next step's compute follows in stream order)."""
        if self._link is None:
            self._on_compute[self._cur] = self._deferred[self._cur] = True
            return
        self._record(self._streams.compute(), on_compute=True)

    def _record(self, stream: Any, on_compute: bool) -> None:
        if self._link is not None:
            self._link.before_record(self._previous_step)
        self._streams.record(self._events[self._cur], stream)
        self._recorded[self._cur] = True
        self._on_compute[self._cur] = on_compute
        if self._link is not None:
            self._link.after_record(self._cur, self._step)

    def synchronize_previous(self) -> None:
        """Before a CPU write of host memory (CoW) or a CPU read of it (the
        debug audit): wait for every host write of the previous step."""
        prev = self._cur ^ 1
        if self._deferred[prev]:
            # The previous step's writes are all enqueued on the compute
            # stream by now: its current position covers them (and waits
            # for a little more; the wait is deliberate and rare).
            self._streams.record(self._events[prev], self._streams.compute())
            self._recorded[prev], self._deferred[prev] = True, False
        if self._recorded[prev]:
            self._streams.synchronize(self._events[prev])


def written_slots(
    runtime: HiSparseRuntime, first: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [first, end) of this step: the resident slot of each token per
    resident group (int64 [G, n], the row its KV write used) and its host
    row (int64 [n], the source group's slot), -1 for padding."""
    tables = runtime.tables
    resident = torch.stack(
        [tables.slot_mapping(gid)[first:end] for gid in runtime.resident_group_ids]
    )
    return resident, tables.slot_mapping(runtime.source_group_id)[first:end]


class MirrorPlan:
    """Row-mirror descriptors built on the device from the slot mappings.

    Layers are ordered by (draft, resident group), so a range (the target or
    the draft layers of one resident group) is one contiguous slice
    ``[first_layer * n, (last_layer + 1) * n)`` and the draft ranges follow
    every target range.
    """

    def __init__(
        self,
        runtime: HiSparseRuntime,
        slab_ptr: int,
        layer_order: Sequence[str],
        device: torch.device,
        max_tokens: int | None = None,
    ) -> None:
        g = runtime.geometry
        self.runtime = runtime
        self.layer_order = tuple(layer_order)
        views = [runtime.layers[name] for name in self.layer_order]
        self.pair_ranges: list[tuple[int, int]] = []
        keys: list[tuple[int, bool]] = []
        for lv_index, lv in enumerate(views):
            if not keys or (lv.pair, lv.is_draft) != keys[-1]:
                self.pair_ranges.append((lv_index, lv_index + 1))
                keys.append((lv.pair, lv.is_draft))
            else:
                self.pair_ranges[-1] = (self.pair_ranges[-1][0], lv_index + 1)
        self.pair_of_range = [pair for pair, _ in keys]
        self.range_is_draft = [draft for _, draft in keys]
        if len(set(keys)) != len(keys):
            raise ValueError(
                "HiSparse: mirror layers must be grouped by (draft, resident group)"
            )
        self.num_layers = len(views)
        self._pair_of_layer = torch.tensor(
            [lv.pair for lv in views], dtype=torch.int64, device=device
        )
        self._src_base = torch.tensor(
            [slab_ptr + lv.offset for lv in views], dtype=torch.int64, device=device
        )
        self._dst_base = torch.tensor(
            [lv.host_ptr for lv in views], dtype=torch.int64, device=device
        )
        # A reader of a shared pool builds no descriptors (max_tokens=0).
        tokens = g.max_num_tokens if max_tokens is None else max_tokens
        size = self.num_layers * tokens
        self.src = torch.zeros(size, dtype=torch.int64, device=device)
        self.dst = torch.zeros(size, dtype=torch.int64, device=device)
        self.nbytes = torch.zeros(size, dtype=torch.int64, device=device)
        self.num_rows = 0
        """Tokens covered by the descriptors built this step."""
        self.first_token = 0
        self._spans_cache: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def build(self, first_token: int, num_tokens: int) -> int:
        """Descriptors for tokens [first_token, num_tokens) of this step, on
        the compute stream. Returns the number of rows per layer."""
        rt = self.runtime
        g = rt.geometry
        n = max(num_tokens - first_token, 0)
        self.first_token, self.num_rows = first_token, n
        if n == 0:
            return 0
        tables = rt.tables
        rt.ops.mirror_descriptors(
            [tables.slot_mapping(gid) for gid in rt.resident_group_ids],
            tables.slot_mapping(rt.source_group_id), self._pair_of_layer,
            self._src_base, self._dst_base, self.src, self.dst, self.nbytes,
            first_token, n, g.block_size, g.bytes_per_block, g.row_bytes)
        return n

    def prepare_for_capture(self) -> None:
        """What ``build`` needs that a CUDA graph capture cannot make: the
        device table of the slot-mapping buffers (once, at startup)."""
        from vllm.v1.hisparse import kernels

        rt = self.runtime
        kernels.mirror_slot_table(
            [rt.tables.slot_mapping(gid) for gid in rt.resident_group_ids]
        )

    def spans_of(self, range_indices: list[int]) -> list[slice]:
        """The descriptors of ``range_indices`` (ascending) as contiguous
        slices: consecutive resident groups' slices merge."""
        n = self.num_rows
        return [slice(lo * n, hi * n) for lo, hi in self._layer_spans(range_indices)]

    def descriptors(self, part: slice) -> tuple[torch.Tensor, ...]:
        """(src, dst, nbytes)[part]: views of the persistent buffers, kept
        per span (P2: a steady decode step launches K5 on the same span
        every step, so it makes no tensor views)."""
        key = (part.start, part.stop)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 64:  # the batch size changed often: start over
                self._views.clear()
            views = self._views[key] = (self.src[part], self.dst[part], self.nbytes[part])
        return views

    def _layer_spans(self, range_indices: list[int]) -> tuple[tuple[int, int], ...]:
        """The merged layer ranges of ``range_indices``, computed once per
        index list (P2: a decode step asks for the same one every step)."""
        key = tuple(range_indices)
        spans = self._spans_cache.get(key)
        if spans is None:
            merged: list[tuple[int, int]] = []
            for index in key:
                lo, hi = self.pair_ranges[index]
                if merged and merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            spans = self._spans_cache[key] = tuple(merged)
        return spans


@dataclass
class _InFlight:
    event: Any
    transfer_ids: list[int]
    step: int


@dataclass
class _StepState:
    meta: HiSparseStepMetadata
    has_forward: bool
    per_layer: bool
    pending_spills: np.ndarray  # indices into meta's transfer arrays
    mirrored_ranges: set[int] = field(default_factory=set)
    marked_layers: set[str] = field(default_factory=set)
    draft_written: bool = False
    """A draft pass wrote the draft layers' rows this step (F2, INV-25)."""
    submitted: bool = False
    forward_ready: Any = None
    mirror_in_forward: bool = False
    """A pure-decode step whose target rows the forward mirrors itself
    (``HiSparseWorker.mirror_in_forward``)."""


class HiSparseWorker:
    """Data plane of one worker rank (C6)."""

    def __init__(
        self,
        runtime: HiSparseRuntime,
        host_pool: Any,
        *,
        slab: torch.Tensor,
        rank: int,
        eager_host_mirror: bool,
        streams: StreamOps | None = None,
        page_copy: Any = None,
    ) -> None:
        self.runtime = runtime
        self.host_pool = host_pool
        self.slab = slab
        self.first_layer = next(iter(runtime.layers))
        """The sparse-MLA layer whose attention metadata describes the batch."""
        self.rank = rank
        self.eager_host_mirror = eager_host_mirror
        device = runtime.device
        self.streams = streams if streams is not None else StreamOps(device)
        self._page_copy = page_copy if page_copy is not None else _swap_blocks_batch
        self.sharing: HostSharing | None = getattr(host_pool, "sharing", None)
        self.writer = self.sharing is None or self.sharing.writer
        """Whether this rank writes host memory (INV-28: rank 0 when shared)."""
        self.host_write = _host_write_events(self.streams, self.sharing)
        lvs = runtime.layers
        order = sorted(lvs, key=lambda n: (lvs[n].is_draft, lvs[n].pair, lvs[n].offset))
        self.mirror = MirrorPlan(
            runtime, slab.data_ptr(), order, device, None if self.writer else 0
        )
        self._layer_range = {
            name: i
            for i, (lo, hi) in enumerate(self.mirror.pair_ranges)
            for name in self.mirror.layer_order[lo:hi]
        }
        self._range_layers = [
            set(self.mirror.layer_order[lo:hi]) for lo, hi in self.mirror.pair_ranges
        ]
        is_draft = self.mirror.range_is_draft
        self._target_ranges = [i for i, d in enumerate(is_draft) if not d]
        self._draft_ranges = [i for i, d in enumerate(is_draft) if d]
        self._draft_layers = frozenset(n for n, lv in lvs.items() if lv.is_draft)
        self._in_flight: list[_InFlight] = []
        self._ready_event = self.streams.event("forward_ready")
        self._spare_events: list[Any] = []
        """Transfer completion events whose transfers completed: reused."""
        self._enqueued: dict[int, int] = {}
        self._completed: dict[int, int] = {}
        self._cow_done: set[int] = set()
        self._step: _StepState | None = None
        self._debug = debug_enabled()
        self._audit: tuple[np.ndarray, np.ndarray, tuple[str, ...]] | None = None
        self.audit_rows_checked = 0
        self.audit_mismatches = 0
        self.fault_injector = debug_faults.from_env()
        self._closed = False
        g = runtime.geometry
        self._page_bytes = g.block_size * g.row_bytes
        # Per mirror-ordered layer: its pair, offset in a block and host base
        # (the page descriptors of spills and restores).
        layers = [runtime.layers[n] for n in self.mirror.layer_order]
        self._layer_pair = np.array([lv.pair for lv in layers], dtype=np.int64)
        self._layer_offset = np.array([lv.offset for lv in layers], dtype=np.int64)
        self._layer_host = np.array([lv.host_ptr for lv in layers], dtype=np.int64)
        self.decode_mirror_layer = self._decode_mirror_layer()
        """The target layer whose forward mirrors a pure-decode batch's rows
        (``mirror_in_forward``); None: ``finish_forward`` submits them."""
        _set_current(self)

    def _decode_mirror_layer(self) -> str | None:
        """The last target layer the forward runs, when the writer mirrors
        decode rows eagerly and the model has no draft layers (a draft
        range's descriptors are built with the target's token count, which a
        FULL graph fixes at capture: the drafter keeps the DMA path)."""
        if not (self.writer and self.eager_host_mirror) or self._draft_layers:
            return None
        layer = last_in_forward(list(self.runtime.layers))
        if layer is not None and self.runtime.device.type == "cuda":
            # Its address table now: the forward may first run under capture.
            self.mirror.prepare_for_capture()
        return layer

    # ------------------------------------------------------------ W1

    def start_step(
        self,
        meta: HiSparseStepMetadata,
        attn_metadata: Any | None,
    ) -> None:
        """Everything before the forward (spec 4.1 W1), outside the model.

        ``attn_metadata`` is the sparse-MLA layers' attention metadata, or
        None when the step runs no forward (zero scheduled tokens).
        """
        streams, rt = self.streams, self.runtime
        if self._step is not None and self._step.has_forward:
            # Under async scheduling the engine issues this step before it
            # reads the previous step's sampling: an exception raised there
            # (the drafter included) stays in its future and this is the
            # first error seen.
            raise RuntimeError(
                "HiSparse: a step started before the previous finished (did the "
                "previous step's sampling or drafting raise?)"
            )
        if meta.retired_transfer_ids.size:
            self._retire(meta.retired_transfer_ids)
        self.host_write.rotate(meta.step)
        if self._debug and self.writer:
            self._run_audit()
        if self.fault_injector is not None and attn_metadata is not None:
            self.fault_injector.maybe_fire(self)  # debug only (e2e negative control)
        if meta.cow_src.size:
            self._copy_on_write(meta.cow_src, meta.cow_dst)
        rt.apply_hot_regions(
            meta.hot_regions_freed, meta.hot_regions_allocated, meta.hot_region_requests
        )
        spills = empty_ids(np.int64)  # P2: a steady step has no transfers
        if meta.transfer_restore.size:
            restore = meta.transfer_restore.astype(bool)
            if restore.any():
                self._restore(meta, np.nonzero(restore)[0])
            # INV-28: a reader neither copies nor acks spills.
            if self.writer:
                spills = np.nonzero(~restore)[0]
        has_forward = attn_metadata is not None
        pure_decode = has_forward and attn_metadata.num_prefills == 0
        self._step = _StepState(
            meta=meta,
            has_forward=has_forward,
            per_layer=has_forward and not pure_decode and self.writer,
            pending_spills=spills,
            mirror_in_forward=pure_decode and self.decode_mirror_layer is not None,
        )
        if not has_forward:
            # INV-15: a zero-token step still submits its transfers.
            self._submit_spills(self._step)
            if self._step.submitted:
                self.host_write.record(streams.dma)
            else:
                self.host_write.record_on_compute()
            self._step = None
            return
        rt.prepare_forward(
            (int(attn_metadata.num_decodes), int(attn_metadata.num_decode_tokens))
        )
        if attn_metadata.num_prefills:
            rt.plan_staging(int(attn_metadata.num_decodes))
        if decode_query_len(attn_metadata) > rt.geometry.max_decode_query_len:
            rt.plan_extends(int(attn_metadata.num_decodes))
        if self.writer:
            decode_tokens = int(attn_metadata.num_decode_tokens)
            first = 0 if self.eager_host_mirror else decode_tokens
            if self._step.mirror_in_forward:
                # The forward builds and copies them; what it covers (the
                # debug audit reads it).
                self.mirror.first_token, self.mirror.num_rows = 0, rt.num_tokens
            else:
                self.mirror.build(first, rt.num_tokens)

    def on_attention(self, layer_name: str, pure_decode: bool, num_tokens: int) -> None:
        """A sparse-MLA layer's attention ran (``hisparse_forward_mqa``, in
        the forward, captured by a FULL graph): after the last target
        layer's, a pure-decode batch's rows are mirrored."""
        if pure_decode and layer_name == self.decode_mirror_layer:
            self.mirror_in_forward(num_tokens)

    def mirror_in_forward(self, num_tokens: int) -> None:
        """The row mirror of a pure-decode batch from inside the forward, at
        ``decode_mirror_layer`` (every target layer has written its KV): K5b
        then K5 on the compute stream. Graph-safe (persistent buffers; a
        padding token has slot -1 and copies nothing, as in a dummy run), so
        a FULL graph replays it and the step spends no host time on the
        mirror (P2). No events: the next step's compute follows it in stream
        order (INV-27), and a spill's barrier waits for this forward."""
        m = self.mirror
        if m.build(0, num_tokens):
            for part in m.spans_of(self._target_ranges):
                self.runtime.ops.copy_descriptors(*m.descriptors(part))

    # ------------------------------------------------------------ W2

    def on_kv_written(self, layer_name: str) -> None:
        """A layer wrote this step's KV (per-layer submission, 4.10). A draft
        layer writes once per draft pass and is only noted: its rows are
        copied after the last pass (F2)."""
        step = self._step
        if step is not None and layer_name in self._draft_layers:
            step.draft_written = True
            return
        if step is None or not step.per_layer or layer_name not in self._layer_range:
            return
        if layer_name in step.marked_layers:
            raise RuntimeError(f"HiSparse: layer {layer_name} mirrored twice in a step")
        step.marked_layers.add(layer_name)
        index = self._layer_range[layer_name]
        if self._range_layers[index] <= step.marked_layers:
            self._submit_mirror_range(step, index)

    # ------------------------------------------------------------ W3

    def finish_forward(self) -> None:
        """After the forward (and the drafter): submit the remaining mirrors,
        the spills behind them, invalidate written hot entries (4.1 W3)."""
        step, rt = self._step, self.runtime
        if step is None:
            return
        self._step = None
        if step.per_layer:
            partial = [
                i
                for i, layers in enumerate(self._range_layers)
                if i not in step.mirrored_ranges and layers & step.marked_layers
            ]
            if partial:
                raise RuntimeError(
                    "HiSparse: per-layer mirror submissions covered part of resident "
                    f"group(s) {partial}; a group's layers are submitted together"
                )
        # Target ranges, then draft ranges (indices after every target one),
        # then the spills: one DMA-stream order gives INV-26. A drafter that
        # did not run wrote no draft row, so none is copied (INV-25).
        if step.mirror_in_forward:
            pending = []  # the forward copied them (and there are no draft layers)
        elif step.mirrored_ranges:
            pending = [i for i in self._target_ranges if i not in step.mirrored_ranges]
        else:
            pending = self._target_ranges  # read only (P2: no list per step)
        if step.draft_written:
            pending = pending + self._draft_ranges
        self._submit_mirror_ranges(step, pending)
        self._submit_spills(step)
        if step.submitted:
            self.host_write.record(self.streams.dma)
        else:
            self.host_write.record_on_compute()
        rt.invalidate_written(rt.num_tokens)
        if self._debug and self.writer:
            self._remember_for_audit(step.draft_written)
        rt.end_forward()

    # ----------------------------------------------------------- submit

    def _forward_ready(self, step: _StepState) -> Any:
        """The compute stream's position after the layers written so far.
        One event, re-recorded: a stream wait binds to the record current
        when it is enqueued, so later records never move an earlier wait."""
        self.streams.record(self._ready_event, self.streams.compute())
        step.forward_ready = self._ready_event
        return self._ready_event

    def _submit_mirror_range(self, step: _StepState, index: int) -> None:
        self._submit_mirror_ranges(step, [index])

    def _submit_mirror_ranges(self, step: _StepState, indices: list[int]) -> None:
        """Mirror the rows of resident groups ``indices`` (ascending) behind
        one ready event, one copy_descriptors launch per contiguous span
        (a decode step's whole descriptor array is one span)."""
        step.mirrored_ranges.update(indices)
        if self.mirror.num_rows == 0 or not indices:
            return
        ready = self._forward_ready(step)
        streams, m = self.streams, self.mirror
        with streams.on(streams.dma):
            streams.wait(streams.dma, ready)
            for part in m.spans_of(indices):
                self.runtime.ops.copy_descriptors(*m.descriptors(part))
        step.submitted = True

    def _submit_spills(self, step: _StepState) -> None:
        spills = step.pending_spills
        if spills.size == 0:
            return
        meta, streams = step.meta, self.streams
        if not self.eager_host_mirror:
            ready = step.forward_ready or self._forward_ready(step)
            src, dst, sizes = self._page_descriptors(
                meta.transfer_resident_blocks[spills],
                meta.transfer_host_blocks[spills],
                to_host=True,
            )
            with streams.on(streams.dma):
                streams.wait(streams.dma, ready)
                self._page_copy(src, dst, sizes)
        event = self._completion_event("transfer")
        with streams.on(streams.dma):
            if step.forward_ready is None:
                # A zero-token step or a mirror in the forward: the barrier
                # still follows every earlier host write on the DMA stream
                # and this step's compute.
                streams.wait(streams.dma, self._forward_ready(step))
            streams.record(event, streams.dma)
        step.submitted = True
        self._track(event, meta, spills)

    def _restore(self, meta: HiSparseStepMetadata, indices: np.ndarray) -> None:
        """Host -> resident copies before the forward, on the compute stream,
        for every layer (4.13 step 4); completion recorded there too."""
        src, dst, sizes = self._page_descriptors(
            meta.transfer_resident_blocks[indices],
            meta.transfer_host_blocks[indices],
            to_host=False,
        )
        streams = self.streams
        self._page_copy(src, dst, sizes)
        event = self._completion_event("restore")
        streams.record(event, streams.compute())
        self._track(event, meta, indices)

    def _completion_event(self, name: str) -> Any:
        """An event for a batch of transfers: one whose transfers completed
        (``take_acks`` returns it) or a new one; no event per step."""
        return self._spare_events.pop() if self._spare_events else self.streams.event(name)

    def _track(
        self, event: Any, meta: HiSparseStepMetadata, indices: np.ndarray
    ) -> None:
        """Transfers ``indices`` of ``meta`` were submitted this step and
        complete with ``event`` (acked as enqueued now, completed later)."""
        ids = meta.transfer_ids[indices].tolist()
        for tid in ids:
            self._enqueued[tid] = meta.step
        self._in_flight.append(_InFlight(event, ids, meta.step))

    def _page_descriptors(
        self, resident_blocks: np.ndarray, host_blocks: np.ndarray, to_host: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One page-sized descriptor per (transfer, layer) (4.3 lazy mode)."""
        g = self.runtime.geometry
        gpu = (
            self.slab.data_ptr()
            + resident_blocks.astype(np.int64)[:, self._layer_pair] * g.bytes_per_block
            + self._layer_offset[None, :]
        )
        host = (
            self._layer_host[None, :]
            + host_blocks.astype(np.int64)[:, None] * self._page_bytes
        )
        src, dst = (gpu, host) if to_host else (host, gpu)
        sizes = np.full(src.shape, self._page_bytes, dtype=np.int64)
        return tuple(
            torch.from_numpy(np.ascontiguousarray(a.ravel())) for a in (src, dst, sizes)
        )

    # -------------------------------------------------------------- CoW

    def _copy_on_write(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Host page copies inside the pool, every layer (4.12 step 5); in
        shared mode by rank 0 alone, then a TP barrier before any rank reads
        the destinations. Only the writer acks them."""
        if self.writer:
            # Deliberate host sync: no CPU write may overlap a host write in flight.
            self.host_write.synchronize_previous()
            for name in self.mirror.layer_order:
                pages = self.host_pool.layer_pages(name)
                pages[dst] = pages[src]
            self._cow_done.update(int(d) for d in dst)
        if self.sharing is not None:
            # Deliberate host barrier (rare: v1's prefix hits are block-aligned).
            self.sharing.rendezvous.barrier()

    # ------------------------------------------------------------- acks

    def _retire(self, retired: np.ndarray) -> None:
        for tid in retired.tolist():
            self._completed.pop(int(tid), None)

    def take_acks(self) -> HiSparseWorkerAck | None:
        """This step's enqueued transfers and every completed, unretired one
        (event queries: never a wait)."""
        still: list[_InFlight] = []
        for item in self._in_flight:
            if self.streams.query(item.event):
                for tid in item.transfer_ids:
                    self._completed[tid] = item.step
                self._spare_events.append(item.event)
            else:
                still.append(item)
        self._in_flight = still
        if not (self._enqueued or self._completed or self._cow_done):
            return None
        ranks = frozenset((self.rank,))
        steps = {**self._completed, **self._enqueued}
        ack = HiSparseWorkerAck(
            enqueued={tid: ranks for tid in self._enqueued},
            completed={tid: ranks for tid in self._completed},
            submitted_step=steps,
            cow_done=frozenset(self._cow_done),
        )
        self._enqueued = {}
        self._cow_done = set()
        return ack

    # -------------------------------------------------------- debug audit

    def _remember_for_audit(self, draft_written: bool) -> None:
        first, n = self.mirror.first_token, self.mirror.num_rows
        if n == 0:
            self._audit = None
            return
        resident, host = written_slots(self.runtime, first, first + n)
        # Draft layers only when a draft pass wrote (and so mirrored) them.
        layers = tuple(
            name for name in self.runtime.layers
            if draft_written or name not in self._draft_layers
        )
        # Copies: the slot-mapping buffers are rewritten by the next step.
        self._audit = (resident.cpu().numpy().copy(), host.cpu().numpy().copy(), layers)

    def _run_audit(self) -> None:
        """Host rows written last step equal their resident rows, every layer
        (the mirror audit of spec 6.1; F1). Debug only: it synchronizes."""
        if self._audit is None:
            return
        self.host_write.synchronize_previous()
        resident, host, layers = self._audit
        self._audit = None
        rt, g = self.runtime, self.runtime.geometry
        keep = (host >= 0) & (resident >= 0).all(axis=0)
        if not keep.any():
            return
        host_rows = torch.from_numpy(host[keep])
        for name in layers:
            lv = rt.layers[name]
            rows = torch.from_numpy(resident[lv.pair][keep])
            gpu = lv.resident[rows // g.block_size, rows % g.block_size].cpu()
            cpu = lv.host[host_rows]
            bad = (gpu != cpu).any(dim=1)
            self.audit_rows_checked += int(rows.numel())
            if bad.any():
                self.audit_mismatches += int(bad.sum())
                logger.error(
                    "HiSparse mirror audit: %d host row(s) of %s differ from their "
                    "resident rows (first host row %d)",
                    int(bad.sum()),
                    name,
                    int(host_rows[bad][0]),
                )

    # --------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if _current is self:
            _set_current(None)
        if self.host_pool is not None:
            self.host_pool.shutdown()


def _host_write_events(
    streams: StreamOps, sharing: HostSharing | None
) -> "HostWriteEvents | ReaderHostWriteEvents":
    """Private pool: own events. Shared: rank 0 publishes interprocess events,
    the others open them (collective: every rank builds its worker)."""
    if sharing is None:
        return HostWriteEvents(streams)
    if sharing.writer:
        return HostWriteEvents(streams, WriterLink(sharing))
    return ReaderHostWriteEvents(streams, sharing)


def decode_query_len(attn_metadata: Any) -> int:
    """Query length of the batch's decode rows (FlashMLA sparse's separate
    path; 0 without decodes). More than max_decode_query_len: the decodes are
    short prefill chunks the backend routes through its decode kernel."""
    fp8 = getattr(attn_metadata, "fp8_extra_metadata", None)
    decode = getattr(fp8, "decode", None)
    return int(decode.decode_query_len) if decode is not None else 0


# The worker of this process (one engine, one rank per process), for what
# cannot reach it through vLLM: the debug fault injector and the e2e
# counters (its audit, its host-pool role).
_current: HiSparseWorker | None = None


def _set_current(worker: HiSparseWorker | None) -> None:
    global _current
    _current = worker


def current_worker() -> HiSparseWorker | None:
    return _current


def _swap_blocks_batch(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor
) -> None:
    """Page-sized copies through the copy engines (one batched driver call)."""
    from vllm import _custom_ops as ops

    ops.swap_blocks_batch(src, dst, sizes)


__all__ = [
    "HiSparseWorker",
    "HostWriteEvents",
    "MirrorPlan",
    "StreamOps",
    "current_worker",
    "debug_enabled",
]
