# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pinned host pool of one engine (spec 3.3, C9; F6, F14, F19).

One page-aligned anonymous mapping of ``HostPoolPlan.region_bytes``,
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
"""

import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.hisparse.config_checks import GiB

logger = init_logger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every context
# and device-mapped, so the kernels read host rows through the host pointer
# (unified addressing).
CUDA_HOST_REGISTER_FLAGS = 1 | 2


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
    def cuda(cls) -> "HostRegistrar":
        cudart = torch.cuda.cudart()

        def register(ptr: int, size: int) -> int:
            return _code(cudart.cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_FLAGS))

        def unregister(ptr: int) -> int:
            return _code(cudart.cudaHostUnregister(ptr))

        return cls(register, unregister, torch.cuda.synchronize)


def _code(result: object) -> int:
    return int(getattr(result, "value", result))


class HostPool:
    """A pinned, device-mapped host region laid out by a ``HostPoolPlan``."""

    def __init__(self, plan, registrar: HostRegistrar | None = None) -> None:
        self.plan = plan
        self._registrar = registrar if registrar is not None else HostRegistrar.cuda()
        self._map: mmap.mmap | None = mmap.mmap(-1, plan.region_bytes)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
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
                raise HostRegistrationError(
                    f"HiSparse: cudaHostRegister of host pool bytes [{start}, {end}) "
                    f"failed with CUDA error {code} after {registered} chunk(s); "
                    "lower hisparse_config.host_pool_gib or check the locked-memory "
                    "limit (ulimit -l)."
                )
            self._registered.append((start, end))
        logger.info(
            "HiSparse: registered %.1f GiB host pool in %d chunk(s) in %.1fs.",
            self.plan.region_bytes / GiB,
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
        pinned = self.plan.region_bytes
        if not self._registered:
            # Drop every view of the mapping before closing it.
            self.tensor = torch.empty(0, dtype=torch.uint8)
            self._array = np.empty(0, dtype=np.uint8)
            if self._map is not None:
                try:
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


def _plan_key(plan) -> tuple:
    return (
        plan.num_blocks,
        plan.block_stride,
        plan.region_bytes,
        plan.page_bytes,
        tuple(sorted(plan.layer_offsets.items())),
    )


def acquire_host_pool(plan, registrar: HostRegistrar | None = None) -> HostPool:
    """The process's pool for ``plan``, created (and pinned) once (F19)."""
    key = _plan_key(plan)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            if any(not p.closed for p in _POOLS.values()):
                raise RuntimeError(
                    "HiSparse: a host pool with another layout is already pinned in "
                    "this process; one engine pins one pool."
                )
            pool = _POOLS[key] = HostPool(plan, registrar)
        return pool


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
    "release_host_pools",
]
