# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pinned host pool of one engine (spec 3.3, C9; F6, F14, F19; 4.12).

One page-aligned mapping of ``HostPoolPlan.region_bytes`` (anonymous and
private to the process, or, in shared mode, this rank's view of the
region its DP replica's TP ranks share: ``host_region``),
registered with CUDA (pinned and device-mapped) in the plan's chunks: at most
256 GiB each, every boundary on an OS page and on a host-block boundary, so
no copy descriptor (which never crosses a host block) spans two
registrations. Layer-major: sparse layer l's host rows are the contiguous
``[N_host * B, W]`` byte array at ``plan.layer_offsets[l]``; host row g of
layer l is at byte ``g * W`` of that array.

Teardown is deterministic and bounded (F6): synchronize the device, then
unregister the chunks in reverse order (a failure is logged and stops the
unregistering, leaving the rest to the OS), free the mapping, and log the
time. A second ``shutdown`` is a no-op.

F19: ``acquire_host_pool`` hands out one pool per process and plan. A second
caller with the same plan (a re-initialised KV cache, a drafter's runner)
gets the same pool: nothing is pinned twice, and the log reports the pinned
bytes once.

Shared mode (``plan.shared``, spec 4.12): TP rank 0 creates the region, the
others map it read-only and register it read-only (a reader's GPU cannot
write it either, INV-28); every rank registers its own mapping in the same
chunks. The pages are pinned once per replica (every registration pins the
same physical pages), and the last rank to unmap frees them.
"""

import mmap
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.hisparse.config_checks import GiB
from vllm.v1.hisparse.host_region import SHM_DIR, SharedHostRegion, plan_key
from vllm.v1.hisparse.tp_shared import (
    HostSharing,
    Rendezvous,
    agree,
    share_from_writer,
    tp_rendezvous,
)

logger = init_logger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every context
# and device-mapped, so the kernels read host rows through the host pointer
# (unified addressing).
CUDA_HOST_REGISTER_FLAGS = 1 | 2
# cudaHostRegisterReadOnly: the device may only read (a reader's view of a
# shared pool, which is mapped read-only).
CUDA_HOST_REGISTER_READ_ONLY = 8


class HostRegistrationError(RuntimeError):
    """cudaHostRegister refused a chunk of the host pool."""


@dataclass
class HostRegistrar:
    """How the pool pins and unpins memory; the CUDA runtime by default.

    ``register``/``unregister`` return a CUDA error code (0 = success);
    ``synchronize`` raises if the CUDA context is unusable.
    """

    register: Callable[[int, int], int]
    unregister: Callable[[int], int]
    synchronize: Callable[[], None]

    @classmethod
    def cuda(cls, read_only: bool = False) -> "HostRegistrar":
        cudart = torch.cuda.cudart()
        flags = CUDA_HOST_REGISTER_FLAGS
        if read_only:
            flags |= CUDA_HOST_REGISTER_READ_ONLY

        def register(ptr: int, size: int) -> int:
            return _code(cudart.cudaHostRegister(ptr, size, flags))

        def unregister(ptr: int) -> int:
            return _code(cudart.cudaHostUnregister(ptr))

        return cls(register, unregister, torch.cuda.synchronize)


def _code(result: object) -> int:
    return int(getattr(result, "value", result))


class HostPool:
    """A pinned, device-mapped host region laid out by a ``HostPoolPlan``.

    ``region``/``sharing``: this rank's view of a shared pool (4.12); None
    for a private pool. A reader's view is read-only (``writable``)."""

    def __init__(
        self,
        plan,
        registrar: HostRegistrar | None = None,
        *,
        region: SharedHostRegion | None = None,
        sharing: HostSharing | None = None,
    ) -> None:
        self.plan = plan
        self.region = region
        self.sharing = sharing
        self.writable = region is None or region.writer
        if registrar is None:
            registrar = HostRegistrar.cuda(read_only=not self.writable)
        self._registrar = registrar
        self._map: mmap.mmap | None = (
            region.pool if region is not None else mmap.mmap(-1, plan.region_bytes)
        )
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        with warnings.catch_warnings():
            # A reader's mapping is read-only on purpose: writes fault.
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.from_numpy(self._array)
        """uint8 [region_bytes]: the whole pool (a CPU tensor over the mapping)."""
        self.base_ptr = self.tensor.data_ptr()
        self._registered: list[tuple[int, int]] = []
        self._closed = False
        self._register_chunks()

    # ------------------------------------------------------------- setup

    def _register_chunks(self) -> None:
        start_time = time.perf_counter()
        for start, end in self.plan.registration_chunks:
            code = self._registrar.register(self.base_ptr + start, end - start)
            if code != 0:
                registered = len(self._registered)
                self.shutdown()
                hint = (
                    "lower hisparse_config.host_pool_gib or check the locked-memory "
                    "limit (ulimit -l)."
                    if self.writable
                    else "a TP rank other than 0 registers the shared pool read-only "
                    "(cudaHostRegisterReadOnly); if the platform refuses that, set "
                    "hisparse_config.shared_host_pool=false."
                )
                raise HostRegistrationError(
                    f"HiSparse: cudaHostRegister of host pool bytes [{start}, {end}) "
                    f"failed with CUDA error {code} after {registered} chunk(s); "
                    + hint
                )
            self._registered.append((start, end))
        if self.writable:
            logger.info(
                "HiSparse: registered %.1f GiB host pool in %d chunk(s) in %.1fs%s.",
                self.plan.region_bytes / GiB,
                len(self._registered),
                time.perf_counter() - start_time,
                "" if self.sharing is None
                else f" (shared by {self.sharing.world_size} TP ranks)",
            )
        else:
            # The pages are TP rank 0's: pinned once per replica.
            logger.info(
                "HiSparse: registered TP rank 0's shared host pool read-only in "
                "%d chunk(s) in %.1fs.",
                len(self._registered),
                time.perf_counter() - start_time,
            )

    # ------------------------------------------------------------- views

    def layer_rows(self, layer_name: str, row_bytes: int) -> torch.Tensor:
        """uint8 [N_host * B, W]: the layer's host rows (row g = host row g)."""
        offset = self.plan.layer_offsets[layer_name]
        size = self.plan.layer_array_bytes
        return self.tensor[offset : offset + size].view(-1, row_bytes)

    def layer_pages(self, layer_name: str) -> np.ndarray:
        """uint8 [N_host, P] numpy view of the layer's host pages (CPU copies)."""
        offset = self.plan.layer_offsets[layer_name]
        size = self.plan.layer_array_bytes
        return self._array[offset : offset + size].reshape(-1, self.plan.page_bytes)

    def layer_ptr(self, layer_name: str) -> int:
        return self.base_ptr + self.plan.layer_offsets[layer_name]

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------- teardown

    def shutdown(self) -> None:
        """Synchronize, unregister in reverse, free, log (F6). Idempotent."""
        if self._closed:
            return
        self._closed = True
        start_time = time.perf_counter()
        usable = True
        try:
            self._registrar.synchronize()
        except Exception as err:  # a broken context: leave it to the OS
            usable = False
            logger.warning(
                "HiSparse: the CUDA context is unusable at teardown (%s); leaving "
                "the host pool registered for the kernel to reclaim.",
                err,
            )
        if usable:
            while self._registered:
                start, _ = self._registered[-1]
                code = self._registrar.unregister(self.base_ptr + start)
                if code != 0:
                    logger.warning(
                        "HiSparse: cudaHostUnregister failed (CUDA error %d) for the "
                        "chunk at byte %d; stopping, %d chunk(s) stay registered.",
                        code,
                        start,
                        len(self._registered),
                    )
                    break
                self._registered.pop()
        pinned = self.plan.region_bytes if self.writable else 0
        if self.region is not None:
            self.region.unlink()  # normally gone since the rendezvous
        if not self._registered:
            # Drop every view of the mapping before closing it.
            self.tensor = torch.empty(0, dtype=torch.uint8)
            self._array = np.empty(0, dtype=np.uint8)
            try:
                if self.region is not None:
                    self.region.close()
                elif self._map is not None:
                    self._map.close()
            except BufferError:
                # A caller still holds a view; the OS frees it at exit.
                logger.warning("HiSparse: host pool views outlive shutdown.")
            self._map = None
        logger.info(
            "HiSparse: unpinned %.1f GiB of host pool in %.1fs.",
            pinned / GiB,
            time.perf_counter() - start_time,
        )


_POOLS: dict[tuple, HostPool] = {}
_POOLS_LOCK = threading.Lock()


def acquire_host_pool(
    plan,
    registrar: HostRegistrar | None = None,
    *,
    rendezvous: Rendezvous | None = None,
    host_pool_gib: float | None = None,
    directory: str = SHM_DIR,
) -> HostPool:
    """The process's pool for ``plan``, created (and pinned) once (F19).

    In shared mode this is collective over the TP group (``rendezvous``,
    default vLLM's): every rank of the replica calls it at the same point.
    ``host_pool_gib`` (the configured value) only words rank 0's RAM error.
    """
    key = plan_key(plan)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            if any(not p.closed for p in _POOLS.values()):
                raise RuntimeError(
                    "HiSparse: a host pool with another layout is already pinned in "
                    "this process; one engine pins one pool."
                )
            if plan.shared:
                pool = open_shared_pool(
                    plan,
                    rendezvous if rendezvous is not None else tp_rendezvous(),
                    registrar,
                    host_pool_gib=host_pool_gib,
                    directory=directory,
                )
            else:
                pool = HostPool(plan, registrar)
            _POOLS[key] = pool
        return pool


def open_shared_pool(
    plan,
    rendezvous: Rendezvous,
    registrar: HostRegistrar | None = None,
    *,
    host_pool_gib: float | None = None,
    directory: str = SHM_DIR,
) -> HostPool:
    """This rank's view of its replica's shared pool (4.12), collectively:
    rank 0 creates the region (after the RAM check) and broadcasts its
    ticket; every rank maps and registers it; all agree on the outcome; rank
    0 unlinks the name. A failure on any rank raises on every rank."""
    gib = host_pool_gib if host_pool_gib is not None else plan.pool_bytes / GiB
    created: list[SharedHostRegion] = []

    def create():
        created.append(
            SharedHostRegion.create(
                plan,
                rendezvous.world_size,
                host_pool_gib=gib,
                directory=directory,
            )
        )
        return created[0].ticket

    pools: list[HostPool] = []

    def map_and_register() -> None:
        region = created[0] if created else SharedHostRegion.attach(ticket, plan)
        sharing = HostSharing(rendezvous, region.control)
        pools.append(HostPool(plan, registrar, region=region, sharing=sharing))

    try:
        ticket = share_from_writer(rendezvous, create)
        agree(rendezvous, map_and_register, "mapping the shared host pool")
    except BaseException:
        for pool in pools:
            pool.shutdown()
        for region in created:
            region.close()  # idempotent; the pool may have closed it
        raise
    finally:
        for region in created:
            region.unlink()  # every rank has mapped it (or failed to)
    return pools[0]


def release_host_pools() -> None:
    """Shut down every pool of the process (engine shutdown, tests)."""
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.shutdown()
        _POOLS.clear()


__all__ = [
    "HostPool",
    "HostRegistrar",
    "HostRegistrationError",
    "acquire_host_pool",
    "open_shared_pool",
    "release_host_pools",
]
