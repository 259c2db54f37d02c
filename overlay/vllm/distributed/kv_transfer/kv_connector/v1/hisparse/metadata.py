# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the HiSparse connector's two halves say to each other (spec 2.6).

Scheduler -> worker, once per step: ``HiSparseStepMetadata``. It carries
transfer ids and physical coordinates only (INV-2, INV-8): host block ids,
GPU block ids, host/GPU row starts. Residency updates and row mirrors are
keyed by request id only so the worker can match them to batch rows.

Worker -> scheduler, once per step and aggregated across TP ranks by vLLM:
``HiSparseWorkerAck``.

NOTE (a decision, see docs/residency.md): acks carry the *set of ranks* that
enqueued or completed a transfer rather than a count. Aggregation is a set
union, so a duplicated or repeated report is idempotent, and the worker can
repeat a completion until the scheduler retires the transfer id
(``retired_transfer_ids``): a lost step output then delays an ack instead of
leaking the transfer's leases forever.
"""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class PageTransfer:
    """One page spill (resident -> host), or a restore (host -> resident).

    ``resident_block_ids`` has one GPU block per resident group: the same page
    lives at the same block index of every group's table (INV-7).
    """

    transfer_id: int
    host_block_id: int
    resident_block_ids: tuple[int, ...]
    after_forward: bool
    """Submit after this step's forward (a spill of a page the forward seals);
    False: before it (a restore the forward reads)."""
    restore: bool = False


@dataclass(frozen=True)
class RowMirror:
    """A run of rows written this step, mirrored resident -> host (4.9).

    Runs never cross a page, hence never a host block or a GPU block.
    """

    src_row_start: tuple[int, ...]
    """Per resident group: GPU physical row gpu_block * B + offset."""
    host_row_start: int
    """Host global row host_block * B + offset."""
    num_rows: int


@dataclass(frozen=True)
class ResidencyUpdate:
    """Overwrite a request's resident block-table rows from ``start_page``.

    ``block_ids[g]`` are resident group g's block ids from ``start_page`` to
    the end of the table; 0 (the null block) means "read from host" (4.6).
    """

    start_page: int
    block_ids: tuple[tuple[int, ...], ...]


@dataclass
class HiSparseStepMetadata(KVConnectorMetadata):
    """The scheduler's per-step command to every HiSparse worker."""

    residency_updates: dict[str, ResidencyUpdate] = field(default_factory=dict)
    page_transfers: list[PageTransfer] = field(default_factory=list)
    cow_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source host block, destination host block) pairs."""
    new_source_block_ids: list[int] = field(default_factory=list)
    """Host blocks (re)allocated this step: hot entries keyed by their rows
    are stale (4.8, trigger 2)."""
    row_mirrors: dict[str, list[RowMirror]] = field(default_factory=dict)
    all_context_pages_resident: bool = True
    retired_transfer_ids: list[int] = field(default_factory=list)
    """Transfers the scheduler has finished with: stop reporting them."""

    def is_empty(self) -> bool:
        return not (
            self.residency_updates or self.page_transfers or self.cow_copies
            or self.new_source_block_ids or self.row_mirrors
            or self.retired_transfer_ids
        )


@dataclass
class HiSparseWorkerAck(KVConnectorWorkerMetadata):
    """Per-step acks of one worker, or of all of them once aggregated."""

    enqueued: dict[int, frozenset[int]] = field(default_factory=dict)
    """transfer id -> ranks that have submitted it."""
    completed: dict[int, frozenset[int]] = field(default_factory=dict)
    """transfer id -> ranks whose copy (or completion barrier) has finished."""
    cow_done: frozenset[int] = frozenset()
    """Destination host blocks whose copy-on-write has finished."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "HiSparseWorkerAck":
        assert isinstance(other, HiSparseWorkerAck)
        return HiSparseWorkerAck(
            enqueued=_union(self.enqueued, other.enqueued),
            completed=_union(self.completed, other.completed),
            cow_done=self.cow_done | other.cow_done,
        )


def _union(
    a: dict[int, frozenset[int]], b: dict[int, frozenset[int]]
) -> dict[int, frozenset[int]]:
    out = dict(a)
    for tid, ranks in b.items():
        out[tid] = out.get(tid, frozenset()) | ranks
    return out
