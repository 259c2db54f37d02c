# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the two halves of the HiSparse connector say to each other (spec 2.6).

Scheduler -> worker, once per step: ``HiSparseStepMetadata``. It carries
transfer ids and physical coordinates only (INV-2, INV-8): host block ids and
GPU block ids. Everything is a flat numpy array so that the worker applies a
step without a Python loop per request or per token; only residency updates
name requests (their ids match batch rows).

Worker -> scheduler, once per step, aggregated across ranks by vLLM:
``HiSparseWorkerAck``. With a TP-shared host pool (spec 4.12) only TP rank 0
reports spills and CoW; the other ranks report their restores alone, and the
coordinator counts only rank 0's spill reports (docs/residency.md R23).

NOTE (decisions, docs/worker.md): the scheduler sends no row-mirror envelopes
and no "all context pages resident" flag. The worker mirrors exactly the rows
its forward wrote (the resident and source slot mappings of the step, on the
GPU), and it reads residency from the resident block-table rows that the
attention kernels read, so neither can disagree with a second copy sent by
the scheduler.

NOTE: acks carry the *set of ranks* that enqueued or completed a transfer
rather than a count. Aggregation is a set union, so a duplicated or repeated
report is idempotent, and the worker repeats a completion until the scheduler
retires the transfer id (``retired_transfer_ids``): a lost step output then
delays an ack instead of leaking the transfer's leases.
"""

import functools
from dataclasses import dataclass, field

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@functools.cache
def empty_ids(dtype: type = np.int32, *shape: int) -> np.ndarray:
    """One shared, read-only empty array per (dtype, shape): most steps send
    no transfers, updates or hot regions, so a field left empty costs no
    allocation (P2)."""
    empty = np.zeros((0, *shape), dtype=dtype)
    empty.flags.writeable = False
    return empty


def _ids(dtype: type = np.int32, *shape: int):
    empty = empty_ids(dtype, *shape)
    return field(default_factory=lambda: empty)


_ZERO_INDPTR = np.zeros(1, dtype=np.int64)
_ZERO_INDPTR.flags.writeable = False


@dataclass
class HiSparseStepMetadata(KVConnectorMetadata):
    """The scheduler's per-step command to every HiSparse worker.

    Block id 0 is the null block in both id spaces (host and GPU).
    """

    step: int = 0
    """Scheduler step number (increasing). Acks name the step after whose
    forward a transfer was submitted (F17)."""

    # ---- page transfers (4.3): spills resident -> host, restores host -> resident
    transfer_ids: np.ndarray = _ids(np.int64)
    """int64 [n]: transfer ids."""
    transfer_host_blocks: np.ndarray = _ids(np.int32)
    """int32 [n]: the host block of each transfer."""
    transfer_resident_blocks: np.ndarray = _ids(np.int32, 0)
    """int32 [n, G]: the page's GPU block in each of the G resident groups
    (the same page lives at the same index of every group's table, INV-7)."""
    transfer_restore: np.ndarray = _ids(np.bool_)
    """bool [n]: True = restore (host -> resident, before the forward);
    False = spill (after the forward that seals the page)."""

    # ---- residency updates (4.6 step 4), CSR over requests
    update_req_ids: list[str] = field(default_factory=list)
    """Requests whose resident table rows changed (lost or adopted pages)."""
    update_start_pages: np.ndarray = _ids(np.int32)
    """int32 [m]: first rewritten page of each request."""
    update_indptr: np.ndarray = field(default_factory=lambda: _ZERO_INDPTR)
    """int64 [m + 1]: request i's rows are
    ``update_block_ids[indptr[i]:indptr[i + 1]]``."""
    update_block_ids: np.ndarray = _ids(np.int32, 0)
    """int32 [indptr[-1], G]: block ids from the start page to the end of the
    table, one column per resident group; 0 = null (read from host)."""

    # ---- host pool
    cow_src: np.ndarray = _ids(np.int32)
    """int32 [c]: copy-on-write source host blocks (4.12)."""
    cow_dst: np.ndarray = _ids(np.int32)
    """int32 [c]: copy-on-write destination host blocks."""
    new_source_block_ids: np.ndarray = _ids(np.int32)
    """int32 [k]: host blocks (re)allocated this step; hot entries keyed by
    their rows are stale (4.8, trigger 2)."""

    # ---- hot regions (INV-5, INV-24)
    hot_regions_allocated: np.ndarray = _ids(np.int32)
    """int32 [a]: the first block (in the first hot group) of every hot
    region allocated this step; the worker gives each a fresh state slot."""
    hot_region_requests: list[str] = field(default_factory=list)
    """[a]: the request owning each allocated region, so that a batch row
    finds its slot by request id (never by block-table contents: F22)."""
    hot_regions_freed: np.ndarray = _ids(np.int32)
    """int32 [f]: the first block of every hot region released this step
    (finished or preempted request); its state slot is released. Applied
    before ``hot_regions_allocated``."""

    # ---- acks
    retired_transfer_ids: np.ndarray = _ids(np.int64)
    """int64 [r]: transfers the scheduler has finished with: stop reporting."""

    @property
    def num_transfers(self) -> int:
        return int(self.transfer_ids.shape[0])

    def residency_update(self, i: int) -> tuple[str, int, np.ndarray]:
        """(request id, start page, block ids [pages, G]) of update ``i``."""
        lo, hi = self.update_indptr[i], self.update_indptr[i + 1]
        return (
            self.update_req_ids[i],
            int(self.update_start_pages[i]),
            self.update_block_ids[lo:hi],
        )


@dataclass
class HiSparseWorkerAck(KVConnectorWorkerMetadata):
    """Per-step acks of one worker, or of all of them once aggregated."""

    enqueued: dict[int, frozenset[int]] = field(default_factory=dict)
    """transfer id -> ranks that have submitted it."""
    completed: dict[int, frozenset[int]] = field(default_factory=dict)
    """transfer id -> ranks whose copy (or completion barrier) has finished."""
    submitted_step: dict[int, int] = field(default_factory=dict)
    """transfer id -> the scheduler step after whose forward it was submitted
    (F17: a completion proves the KV was computed only if that forward ran)."""
    cow_done: frozenset[int] = frozenset()
    """Destination host blocks whose copy-on-write has finished."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "HiSparseWorkerAck":
        assert isinstance(other, HiSparseWorkerAck)
        steps = dict(self.submitted_step)
        for tid, step in other.submitted_step.items():
            steps[tid] = min(step, steps.get(tid, step))
        return HiSparseWorkerAck(
            enqueued=_union(self.enqueued, other.enqueued),
            completed=_union(self.completed, other.completed),
            submitted_step=steps,
            cow_done=self.cow_done | other.cow_done,
        )


def _union(
    a: dict[int, frozenset[int]], b: dict[int, frozenset[int]]
) -> dict[int, frozenset[int]]:
    out = dict(a)
    for tid, ranks in b.items():
        out[tid] = out.get(tid, frozenset()) | ranks
    return out


__all__ = ["HiSparseStepMetadata", "HiSparseWorkerAck"]
