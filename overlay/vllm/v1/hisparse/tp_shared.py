# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TP-shared host pool: roles, rendezvous and the host-write hand-off (4.12).

In shared mode one host region per DP replica (``host_region``) is mapped by
every TP rank. TP rank 0 (``HOST_WRITER_RANK``) is its only writer: it alone
has mirrors, spill copies and CoW, and it alone acks spills. The other ranks
read it (hot-buffer fills, staging, restores) and keep their own resident
and hot state.

**Rendezvous.** Setup is collective over the TP group's CPU (gloo) group:
rank 0 creates and broadcasts, every rank maps and registers, all ranks
agree on the outcome, so a failure on one rank raises on all of them instead
of leaving the others waiting. ``Rendezvous`` is injectable: vLLM's TP group
in production, any CPU process group in tests.

**Host-write hand-off (4.11, INV-27, INV-29).** Rank 0 records its two
ping-pong host-write events as CUDA interprocess events and broadcasts their
handles; the readers open them. At each step start a reader makes its
compute stream wait (stream-ordered, no host sync) on the event rank 0
recorded in the previous step. A CUDA event wait binds to the event's most
recent record when it is issued, so two cases need care:

- *the reader is ahead* (rank 0 has not recorded the previous step yet): the
  event still holds an older, unrelated record. Rank 0 stamps each record
  with its step in the control page; the reader waits only on a record
  stamped with the step it expects, and otherwise counts the step ``early``.
  Correctness never depends on the wait (INV-29): a rank reads host rows
  only of pages whose spill rank 0 completed and the scheduler acked, which
  is after rank 0's host observed the copy done.
- *the reader is two steps behind*: rank 0 would re-record the event it is
  about to wait on, and a wait on rank 0's *later* step would deadlock (that
  step's collectives need this reader's later work). So rank 0 re-records an
  event only once every reader has started the step after its last record
  (``ControlPage.wait_started``): a deliberate host wait of rank 0 that only
  a reader two steps behind can cause.

NOTE: the guard relies on a reader's wait being issued before it publishes
its started step, and on rank 0 reading that step before it records: plain
stores and loads of the control page around the driver's event calls
(ordered on x86-64; on weaker memory models the driver's record and wait
are assumed to order like a release and an acquire).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from vllm.logger import init_logger
from vllm.v1.hisparse.constants import HOST_WRITER_RANK
from vllm.v1.hisparse.host_region import ControlPage, SharedRegionError

logger = init_logger(__name__)

T = TypeVar("T")

GUARD_TIMEOUT_S = 300.0
"""How long rank 0 waits for a reader two steps behind before giving up."""


class Rendezvous(Protocol):
    """The collectives the shared pool's setup and CoW barrier need."""

    rank: int
    world_size: int

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""

    def barrier(self) -> None: ...


class ProcessGroupRendezvous:
    """A ``Rendezvous`` over a torch.distributed CPU (gloo) process group."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, HOST_WRITER_RANK)

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


def tp_rendezvous() -> ProcessGroupRendezvous:
    """The TP group of this worker (vLLM's CPU group for it)."""
    from vllm.distributed.parallel_state import get_tp_group

    return ProcessGroupRendezvous(get_tp_group().cpu_group)


@dataclass(frozen=True)
class _Failure:
    message: str


def share_from_writer(
    rdv: Rendezvous, produce: Callable[[], T] | None = None
) -> T:
    """Rank 0 produces a value and every rank gets it (the other ranks pass
    no ``produce``). A failure on rank 0 raises there and, as
    ``SharedRegionError``, on every other rank."""
    if rdv.rank == HOST_WRITER_RANK:
        assert produce is not None
        try:
            value = produce()
        except Exception as err:
            rdv.broadcast(_Failure(f"{type(err).__name__}: {err}"))
            raise
        rdv.broadcast(value)
        return value
    value = rdv.broadcast(None)
    if isinstance(value, _Failure):
        raise SharedRegionError(
            f"HiSparse: TP rank 0 could not set up the shared host pool: "
            f"{value.message}"
        )
    return value


def agree(rdv: Rendezvous, step: Callable[[], None], what: str) -> None:
    """Run ``step`` on every rank; if it failed on any rank, raise on all
    (the failing rank re-raises its own error)."""
    error: Exception | None = None
    try:
        step()
    except Exception as err:
        error = err
    mine = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = rdv.all_gather(mine)
    if error is not None:
        raise error
    failed = {rank: msg for rank, msg in enumerate(outcomes) if msg is not None}
    if failed:
        details = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise SharedRegionError(
            f"HiSparse: {what} failed on TP rank(s) {sorted(failed)}: {details}"
        )


@dataclass
class HostSharing:
    """This rank's place in a shared host pool."""

    rendezvous: Rendezvous
    control: ControlPage

    @property
    def rank(self) -> int:
        return self.rendezvous.rank

    @property
    def world_size(self) -> int:
        return self.rendezvous.world_size

    @property
    def writer(self) -> bool:
        return self.rank == HOST_WRITER_RANK


class WriterLink:
    """Rank 0's half of the host-write hand-off (plugs into the worker's
    ``HostWriteEvents``): publish the events, guard and stamp each record."""

    def __init__(self, sharing: HostSharing, timeout_s: float = GUARD_TIMEOUT_S):
        self.sharing = sharing
        self.timeout_s = timeout_s
        self.guard_waits = 0
        """Records that had to wait for a reader two steps behind."""

    def publish(self, handles: Callable[[], list[bytes]]) -> bool:
        """Broadcast the events' IPC handles; False (and None to the
        readers) when the platform has no interprocess events: the readers
        then do not wait, and INV-29 alone keeps their reads correct."""

        def produce() -> list[bytes] | None:
            try:
                return handles()
            except RuntimeError as err:
                logger.warning(
                    "HiSparse: no interprocess CUDA events here (%s); the other "
                    "TP ranks will not wait on TP rank 0's host writes (their "
                    "host reads stay correct: INV-29).",
                    err,
                )
                return None

        return share_from_writer(self.sharing.rendezvous, produce) is not None

    def before_record(self, previous_step: int) -> None:
        """The event about to be re-recorded was last waited on by the
        readers at the start of ``previous_step``."""
        if self.sharing.control.wait_started(previous_step, self.timeout_s):
            self.guard_waits += 1

    def after_record(self, index: int, step: int) -> None:
        self.sharing.control.stamp(index, step)


class ReaderHostWriteEvents:
    """A non-writer rank's view of rank 0's host-write events (4.11, 4.12).

    The same interface as the worker's ``HostWriteEvents``; ``record`` is a
    no-op (a reader writes no host memory, nothing waits on it) and a reader
    never touches host memory from the CPU, so it never synchronizes."""

    def __init__(self, streams: Any, sharing: HostSharing) -> None:
        self._streams = streams
        self._control = sharing.control
        self._rank = sharing.rank
        handles = share_from_writer(sharing.rendezvous)
        self._events = [streams.open_ipc_event(h) for h in handles or ()]
        self._previous = 0
        self.exact_waits = 0
        """Steps whose compute waited on rank 0's previous-step record."""
        self.early_steps = 0
        """Steps started before rank 0 recorded the previous one (INV-29)."""

    def rotate(self, step: int = 0) -> None:
        expected = self._previous
        if expected and self._events:
            for index, event in enumerate(self._events):
                if self._control.stamped(index) == expected:
                    self._streams.wait(self._streams.compute(), event)
                    self.exact_waits += 1
                    break
            else:
                self.early_steps += 1
        # After the wait is issued: rank 0 may now re-record that event.
        self._control.mark_started(self._rank, step)
        self._previous = step

    def record(self, stream: Any) -> None:
        return None

    def record_on_compute(self) -> None:
        return None

    def synchronize_previous(self) -> None:
        raise RuntimeError(
            "HiSparse: a non-writer rank never accesses host memory from the "
            "CPU (no CoW, no audit); only TP rank 0 synchronizes host writes"
        )


__all__ = [
    "HostSharing",
    "ProcessGroupRendezvous",
    "ReaderHostWriteEvents",
    "Rendezvous",
    "WriterLink",
    "agree",
    "share_from_writer",
    "tp_rendezvous",
]
