# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Debug-only fault injection for the e2e negative control (docs/worker.md K26).

An e2e comparison must show it can fail (targets T1): with
``VLLM_HISPARSE_DEBUG_FAULTS=1`` in the environment when the worker starts,
a test arms a one-shot fault through ``collective_rpc(arm_host_row_fault)``.
At the start of the next step that runs a forward and has a request whose
context includes a host-only page (a null resident entry), the writer rank
flips the sign bit of every fp8 NoPE byte of that page's host rows in every
sparse layer, after synchronizing the previous step's host writes (so no
in-flight mirror overwrites it). The values stay finite, the attention that
reads them changes; ``fault_status`` reports whether and where it fired.

Separate from ``VLLM_HISPARSE_DEBUG`` (the mirror audit): the audit must be
able to run without faults, and a fault must never be armable in a
deployment that did not ask for it at startup. Unset: ``from_env`` returns
None and the worker's hook is one attribute test per step.
"""

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.logger import init_logger
from vllm.v1.hisparse.staging import context_pages

if TYPE_CHECKING:
    from vllm.v1.hisparse.runtime import HiSparseRuntime
    from vllm.v1.hisparse.worker import HiSparseWorker

logger = init_logger(__name__)

FAULTS_ENV = "VLLM_HISPARSE_DEBUG_FAULTS"
NOPE_BYTES = 512
"""fp8_ds_mla row: 512 fp8 NoPE bytes, then scales and bf16 RoPE. XOR 0x80
negates an e4m3 value and never makes a NaN out of a finite one."""


@dataclass(frozen=True)
class HostPage:
    row: int
    """Batch row of the request."""
    page: int
    host_block: int


def find_host_only_page(runtime: "HiSparseRuntime") -> HostPage | None:
    """The first (lowest row, then page) context page of this step's batch
    with a null resident entry and a host block, from the committed tables."""
    tables = runtime.tables
    n = tables.num_reqs()
    if n == 0:
        return None
    resident = tables.host(runtime.resident_group_ids[0])[:n]
    source = tables.host(runtime.source_group_id)[:n]
    seq = np.asarray(tables.seq_lens_cpu()[:n], dtype=np.int64)
    live = context_pages(seq, resident.shape[1], runtime.block_size)
    rows, pages = np.nonzero((resident == 0) & live & (source > 0))
    if rows.size == 0:
        return None
    row, page = int(rows[0]), int(pages[0])
    return HostPage(row, page, int(source[row, page]))


def corrupt_host_page(runtime: "HiSparseRuntime", host_block: int) -> None:
    """Flip the NoPE sign bits of the page's host rows, every sparse layer."""
    b = runtime.block_size
    width = min(NOPE_BYTES, runtime.geometry.row_bytes)
    rows = slice(host_block * b, (host_block + 1) * b)
    for lv in runtime.layers.values():
        lv.host[rows, :width].bitwise_xor_(0x80)


class HostRowFault:
    """A one-shot corruption of one host-only page (armed, then fired)."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = 0
        self.last: HostPage | None = None

    def maybe_fire(self, worker: "HiSparseWorker") -> bool:
        """At a step start (before any read of host rows this step)."""
        if not self.armed or not worker.writer:
            return False
        target = find_host_only_page(worker.runtime)
        if target is None:
            return False
        # Deliberate host sync (debug only): no in-flight host write may
        # land on the page after the corruption.
        worker.host_write.synchronize_previous()
        corrupt_host_page(worker.runtime, target.host_block)
        self.armed = False
        self.fired += 1
        self.last = target
        logger.warning("HiSparse debug fault: corrupted host block %d (batch row %d, "
                       "page %d) in every sparse layer", target.host_block,
                       target.row, target.page)
        return True

    def status(self) -> dict[str, Any]:
        return {"armed": self.armed, "fired": self.fired,
                "last": asdict(self.last) if self.last else None}


def from_env() -> HostRowFault | None:
    """The worker's injector when the env var was set at startup."""
    return HostRowFault() if os.environ.get(FAULTS_ENV, "0") not in ("", "0") else None


def _injector() -> HostRowFault:
    from vllm.v1.hisparse.worker import current_worker

    worker = current_worker()
    injector = getattr(worker, "fault_injector", None)
    if injector is None:
        raise RuntimeError(
            f"HiSparse debug faults are off in this worker: set {FAULTS_ENV}=1 in "
            "the environment before the engine starts (debug and tests only)")
    return injector


def arm_host_row_fault(_worker: Any = None) -> dict[str, Any]:
    """``collective_rpc`` target: arm the one-shot fault of this rank."""
    injector = _injector()
    injector.armed = True
    return injector.status()


def fault_status(_worker: Any = None) -> dict[str, Any]:
    """``collective_rpc`` target: {"enabled", "armed", "fired", "last"}."""
    from vllm.v1.hisparse.worker import current_worker

    injector = getattr(current_worker(), "fault_injector", None)
    if injector is None:
        return {"enabled": False, "armed": False, "fired": 0, "last": None}
    return {"enabled": True, **injector.status()}


__all__ = [
    "FAULTS_ENV",
    "HostPage",
    "HostRowFault",
    "arm_host_row_fault",
    "corrupt_host_page",
    "fault_status",
    "find_host_only_page",
    "from_env",
]
