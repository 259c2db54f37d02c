# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host region the TP ranks of one DP replica share (spec 4.12, 3.3).

MLA KV is identical on every TP rank, so in shared mode one host pool per DP
replica backs them all. It is one file in ``/dev/shm``::

    [0, region_bytes)                  the pool, laid out by HostPoolPlan
    [control_offset, +CONTROL_BYTES)   the control page (int64 slots)

- **Create (TP rank 0).** The RAM check counts the pool once per replica
  (spec 6.3 #13), the tmpfs must have room for it, and ``posix_fallocate``
  reserves every page: a full ``/dev/shm`` fails here with a clear error
  instead of with SIGBUS at a later page fault. The control page holds the
  region's identity: a magic, the creator's random nonce, the plan's
  fingerprint.
- **Attach (every other rank).** Open by name; refuse a file of the wrong
  size, or whose identity differs from the ticket rank 0 broadcast (a stale
  name, another engine's region, another layout). The pool is mapped
  read-only: a non-writer rank cannot write host KV (INV-28).
- **Unlink.** Rank 0 removes the name once every rank has mapped the file
  (or failed to). The pages live until the last mapping closes, so the
  region dies with its last view and no name outlives the startup
  rendezvous. A crash inside that window can leave a name behind; the next
  creator on the node removes names whose creator is gone (``sweep_stale``).

Non-writers write only the control page: each publishes the last step it
started, and the writer stamps every host-write event record with its step
(``vllm.v1.hisparse.tp_shared``).
"""

import errno
import hashlib
import mmap
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vllm.logger import init_logger
from vllm.v1.hisparse.config_checks import GiB, HiSparseConfigError, check_host_ram

logger = init_logger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "vllm-hisparse-"
CONTROL_BYTES = max(mmap.PAGESIZE, 4096)
STALE_AFTER_S = 600.0
"""A name older than this whose creator is gone cannot be in a rendezvous."""
POLL_S = 50e-6

_MAGIC = 0x6573726170536948  # b"HiSparse", little-endian
_VERSION = 1


class SharedRegionError(RuntimeError):
    """A rank could not create, map or follow the shared host region."""


def plan_key(plan) -> tuple:
    """What makes two ``HostPoolPlan``s the same pool."""
    return (
        plan.num_blocks,
        plan.block_stride,
        plan.region_bytes,
        plan.page_bytes,
        tuple(sorted(plan.layer_offsets.items())),
    )


def plan_fingerprint(plan) -> int:
    """A 63-bit digest of ``plan_key``: every rank derives the same plan."""
    digest = hashlib.blake2b(repr(plan_key(plan)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def control_offset(plan) -> int:
    """The control page's file offset: the pool end, mmap-aligned."""
    align = mmap.ALLOCATIONGRANULARITY
    return -(-plan.region_bytes // align) * align


@dataclass(frozen=True)
class RegionTicket:
    """What TP rank 0 tells the other ranks about the region it created."""

    path: str
    file_bytes: int
    nonce: int
    fingerprint: int


class ControlPage:
    """The int64 slots the ranks of one region share.

    Slots: identity (magic, version, nonce, fingerprint, region bytes, world
    size); ``STAMPS``: the writer's step at each host-write event's last
    record; ``STARTED + r``: the last step rank r started.
    """

    MAGIC, VERSION, NONCE, FINGERPRINT, REGION_BYTES, WORLD = range(6)
    STAMPS = 8
    STARTED = 16
    MAX_RANKS = CONTROL_BYTES // 8 - STARTED

    def __init__(self, buffer: mmap.mmap) -> None:
        self._slots: np.ndarray | None = np.frombuffer(buffer, dtype=np.int64)

    @property
    def slots(self) -> np.ndarray:
        if self._slots is None:
            raise SharedRegionError("HiSparse: the shared host region is closed")
        return self._slots

    def initialize(self, ticket: RegionTicket, region_bytes: int, world: int) -> None:
        slots = self.slots
        slots[:] = 0
        slots[self.VERSION] = _VERSION
        slots[self.NONCE] = ticket.nonce
        slots[self.FINGERPRINT] = ticket.fingerprint
        slots[self.REGION_BYTES] = region_bytes
        slots[self.WORLD] = world
        slots[self.MAGIC] = _MAGIC  # last: the page is complete

    def identity(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.slots[: self.WORLD + 1])

    @property
    def world_size(self) -> int:
        return int(self.slots[self.WORLD])

    def stamp(self, index: int, step: int) -> None:
        self.slots[self.STAMPS + index] = step

    def stamped(self, index: int) -> int:
        return int(self.slots[self.STAMPS + index])

    def mark_started(self, rank: int, step: int) -> None:
        self.slots[self.STARTED + rank] = step

    def started(self, rank: int) -> int:
        return int(self.slots[self.STARTED + rank])

    def wait_started(
        self, step: int, timeout_s: float, first_rank: int = 1
    ) -> bool:
        """Until every rank from ``first_rank`` on has started ``step``.
        Returns whether it had to wait (a deliberate host wait; the caller
        only needs it when a rank is two steps behind)."""
        slots = self.slots
        lo, hi = self.STARTED + first_rank, self.STARTED + self.world_size
        if bool((slots[lo:hi] >= step).all()):
            return False
        deadline = time.monotonic() + timeout_s
        while not bool((slots[lo:hi] >= step).all()):
            if time.monotonic() > deadline:
                behind = [
                    r + first_rank for r, v in enumerate(slots[lo:hi]) if v < step
                ]
                raise SharedRegionError(
                    f"HiSparse: TP rank(s) {behind} have not started step {step} "
                    f"within {timeout_s:.0f} s of TP rank 0 (the host writer); "
                    "a rank is stuck or gone."
                )
            time.sleep(POLL_S)
        return True

    def release(self) -> None:
        self._slots = None


class SharedHostRegion:
    """This process's mapping of the shared region (pool + control page)."""

    def __init__(
        self,
        ticket: RegionTicket,
        pool: mmap.mmap,
        control: mmap.mmap,
        *,
        writer: bool,
    ) -> None:
        self.ticket = ticket
        self.pool: mmap.mmap | None = pool
        """The pool bytes: read-write on the writer, read-only elsewhere."""
        self._control_map: mmap.mmap | None = control
        self.control = ControlPage(control)
        self.writer = writer

    # ------------------------------------------------------------ setup

    @classmethod
    def create(
        cls,
        plan,
        world_size: int,
        *,
        host_pool_gib: float,
        directory: str = SHM_DIR,
    ) -> "SharedHostRegion":
        """TP rank 0: check RAM and tmpfs room, create, reserve, identify.

        Raises:
            HiSparseConfigError: not enough RAM or tmpfs room.
        """
        if world_size > ControlPage.MAX_RANKS:
            raise HiSparseConfigError(
                f"HiSparse's shared host pool supports at most "
                f"{ControlPage.MAX_RANKS} TP ranks; tensor_parallel_size="
                f"{world_size}."
            )
        offset = control_offset(plan)
        file_bytes = offset + CONTROL_BYTES
        check_host_ram(file_bytes, host_pool_gib, world_size, shared=True)
        sweep_stale(directory)
        _check_room(directory, file_bytes)
        nonce = secrets.randbits(62) + 1
        path = os.path.join(directory, f"{NAME_PREFIX}{os.getpid()}-{nonce:016x}")
        ticket = RegionTicket(path, file_bytes, nonce, plan_fingerprint(plan))
        start = time.perf_counter()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _reserve(fd, file_bytes, directory)
            pool, control = _map(fd, plan.region_bytes, offset, writable=True)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)  # the mappings keep the file open
        region = cls(ticket, pool, control, writer=True)
        region.control.initialize(ticket, plan.region_bytes, world_size)
        logger.info(
            "HiSparse: created the shared host region %s (%.1f GiB, %d TP ranks) "
            "in %.1fs.",
            path,
            file_bytes / GiB,
            world_size,
            time.perf_counter() - start,
        )
        return region

    @classmethod
    def attach(cls, ticket: RegionTicket, plan) -> "SharedHostRegion":
        """A non-writer rank: map rank 0's region, after checking it is the
        one described by ``ticket`` and laid out by this rank's ``plan``.

        Raises:
            SharedRegionError: a missing or stale name, the wrong size, another
                region's identity, or a layout that differs from rank 0's.
        """
        if plan_fingerprint(plan) != ticket.fingerprint:
            raise SharedRegionError(
                "HiSparse: this rank's host pool layout differs from TP rank 0's "
                f"(plan fingerprint {plan_fingerprint(plan):#x} vs "
                f"{ticket.fingerprint:#x}); every rank must build the same plan."
            )
        try:
            fd = os.open(ticket.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SharedRegionError(
                f"HiSparse: the shared host region {ticket.path} does not exist "
                "(a stale name: its creator unlinked it or is gone)."
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size != ticket.file_bytes:
                raise SharedRegionError(
                    f"HiSparse: the shared host region {ticket.path} is {size} B; "
                    f"TP rank 0 created {ticket.file_bytes} B (a stale name or "
                    "another layout)."
                )
            pool, control = _map(fd, plan.region_bytes, control_offset(plan), False)
        finally:
            os.close(fd)
        region = cls(ticket, pool, control, writer=False)
        expected = (
            _MAGIC,
            _VERSION,
            ticket.nonce,
            ticket.fingerprint,
            plan.region_bytes,
        )
        if region.control.identity()[: len(expected)] != expected:
            region.close()
            raise SharedRegionError(
                f"HiSparse: {ticket.path} is not the host region TP rank 0 created "
                "for this engine (identity mismatch: a stale name)."
            )
        return region

    # ---------------------------------------------------------- teardown

    def unlink(self) -> None:
        """Remove the name (the creator, once every rank has mapped it, and
        again at teardown). Idempotent; mappings stay valid."""
        if not self.writer:
            return
        try:
            os.unlink(self.ticket.path)
        except FileNotFoundError:
            return
        logger.debug("HiSparse: unlinked %s", self.ticket.path)

    def close(self) -> None:
        """Unmap this rank's view. The pages are freed with the last view.

        Raises:
            BufferError: a view of the pool is still alive (the mapping stays
                until the process exits).
        """
        self.unlink()
        self.control.release()
        if self._control_map is not None:
            self._control_map.close()
            self._control_map = None
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.close()


def _map(
    fd: int, pool_bytes: int, offset: int, writable: bool
) -> tuple[mmap.mmap, mmap.mmap]:
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    pool = mmap.mmap(
        fd,
        pool_bytes,
        flags=mmap.MAP_SHARED,
        prot=rw if writable else mmap.PROT_READ,
    )
    try:
        control = mmap.mmap(
            fd, CONTROL_BYTES, flags=mmap.MAP_SHARED, prot=rw, offset=offset
        )
    except BaseException:
        pool.close()
        raise
    return pool, control


def _check_room(directory: str, file_bytes: int) -> None:
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if free < file_bytes:
        raise HiSparseConfigError(
            f"HiSparse's shared host pool needs {file_bytes / GiB:.1f} GiB in "
            f"{directory} but it has {free / GiB:.1f} GiB free; enlarge it "
            "(docker run --ipc=host or --shm-size), lower "
            "hisparse_config.host_pool_gib, or set shared_host_pool=false."
        )


def _reserve(fd: int, file_bytes: int, directory: str) -> None:
    """Size the file and reserve its pages now (no SIGBUS later)."""
    os.ftruncate(fd, file_bytes)
    try:
        os.posix_fallocate(fd, 0, file_bytes)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise HiSparseConfigError(
                f"HiSparse's shared host pool: {directory} ran out of room "
                f"reserving {file_bytes / GiB:.1f} GiB; enlarge it (docker run "
                "--ipc=host or --shm-size) or lower hisparse_config.host_pool_gib."
            ) from None
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        logger.warning(
            "HiSparse: %s cannot reserve pages (%s); a full tmpfs will fault "
            "at first touch.",
            directory,
            err,
        )


def _creator_pid(name: str) -> int | None:
    head = name[len(NAME_PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(
    directory: str = SHM_DIR,
    *,
    stale_after_s: float = STALE_AFTER_S,
    alive: Callable[[int], bool] = _alive,
) -> list[str]:
    """Remove region names a creator left behind by dying inside its
    rendezvous: the creator's pid is gone and the name is older than any
    rendezvous. Returns the removed paths.

    NOTE: the pid check is of this pid namespace; the age guard keeps a
    live rendezvous of another namespace sharing the tmpfs safe."""
    removed = []
    now = time.time()
    with os.scandir(directory) as entries:
        for entry in entries:
            ours = entry.name.startswith(NAME_PREFIX)
            pid = _creator_pid(entry.name) if ours else None
            if pid is None or alive(pid):
                continue
            try:
                if now - entry.stat().st_mtime < stale_after_s:
                    continue
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(entry.path)
            logger.warning(
                "HiSparse: removed the stale host region %s (creator pid %d is gone).",
                entry.path,
                pid,
            )
    return removed


__all__ = [
    "CONTROL_BYTES",
    "ControlPage",
    "RegionTicket",
    "SHM_DIR",
    "SharedHostRegion",
    "SharedRegionError",
    "plan_fingerprint",
    "plan_key",
    "sweep_stale",
]
