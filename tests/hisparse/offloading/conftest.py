# SPDX-License-Identifier: Apache-2.0
"""A rig: vLLM's real scheduler with MultiConnector[HiSparseConnector,
HiSparseOffloadingConnector] (composed from a plain OffloadingConnector
config, as a user writes it), the HiSparse SimWorker and the offloader's
worker child. Each ``Rig.step`` checks every invariant."""

from __future__ import annotations

import dataclasses

import pytest

from tests.hisparse.offloading.sim_offload import SimOffloadWorker
from tests.hisparse.scheduler.harness import (
    Faults,
    SimWorker,
    drain,
    hisparse_kv_cache_config,
    make_scheduler,
    offloading_config,
    run_step,
)
from tests.hisparse.scheduler.invariants import check_drained, check_invariants
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import PrefixCacheStats

OFFLOADER = "HiSparseOffloadingConnector"


class StatsTap:
    """Collects the scheduler stats each ``update_from_output`` returns
    (the scheduler drains its connector stats every step)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.offload = OffloadingConnectorStats()
        self.external = PrefixCacheStats()
        update = scheduler.update_from_output

        def tapped(*args, **kwargs):
            outputs = update(*args, **kwargs)
            for eco in outputs.values():
                if eco.scheduler_stats is not None:
                    self._add(eco.scheduler_stats)
            return outputs

        scheduler.update_from_output = tapped

    def _add(self, stats) -> None:
        if stats.kv_connector_stats and OFFLOADER in stats.kv_connector_stats:
            self.offload.aggregate(stats.kv_connector_stats[OFFLOADER])
        ext = stats.connector_prefix_cache_stats
        if ext is not None:
            self.external.queries += ext.queries
            self.external.hits += ext.hits

    def counter(self, name: str) -> float:
        return self.offload.reduce().get(name, 0)


@dataclasses.dataclass
class Rig:
    scheduler: Scheduler
    worker: SimWorker
    offload: SimOffloadWorker
    stats: StatsTap

    @property
    def hisparse(self):
        return self.scheduler.kv_cache_manager.coordinator.hisparse

    @property
    def coord(self):
        return self.scheduler.kv_cache_manager.coordinator

    @property
    def offloader(self):
        """The scheduler-side HiSparseOffloadingConnector."""
        return self.scheduler.connector._connectors[1]

    def step(self):
        so = run_step(self.scheduler, self.worker)
        check_invariants(self.scheduler)
        return so

    def drain(self) -> None:
        while self.scheduler.has_unfinished_requests() or (
            self.scheduler.connector.has_pending_push_work()
        ):
            self.step()
            assert self.worker.step_no < 20_000, "did not drain"

    def finish(self) -> None:
        self.drain()
        check_drained(self.scheduler)


@pytest.fixture
def rig(tmp_path):
    """rig(...) -> Rig; every scheduler built is shut down afterwards (the
    tiering spec maps a shared-memory region)."""
    built: list[Scheduler] = []

    def _build(
        *,
        num_gpu_blocks: int = 120,
        num_host_blocks: int = 400,
        spec_name: str = "CPUOffloadingSpec",
        num_cpu_blocks: int = 256,
        copy_delay: int = 0,
        faults: Faults | None = None,
        offload_extra: dict | None = None,
        **scheduler_kwargs,
    ) -> Rig:
        config = hisparse_kv_cache_config(
            num_gpu_blocks=num_gpu_blocks, num_host_blocks=num_host_blocks,
            max_model_len=scheduler_kwargs.get("max_model_len", 4096),
            max_num_batched_tokens=scheduler_kwargs.get("max_num_batched_tokens", 256),
        )
        cpu_bytes = num_cpu_blocks * config.layout.bytes_per_block
        scheduler = make_scheduler(
            tmp_path,
            config,
            kv_transfer_config=offloading_config(spec_name, cpu_bytes, **(offload_extra or {})),
            **scheduler_kwargs,
        )
        built.append(scheduler)
        worker = SimWorker(scheduler, faults=faults)
        offload = SimOffloadWorker(scheduler, worker, copy_delay=copy_delay)
        worker.children = [offload]
        return Rig(scheduler, worker, offload, StatsTap(scheduler))

    yield _build
    for scheduler in built:
        scheduler.shutdown()


__all__ = ["Rig", "drain", "offloading_config"]
