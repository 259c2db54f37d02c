# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C5 + C6 hooks: ``HiSparseConnector`` (spec 2.6, 2.7, 4.1).

Scheduler half: each step it turns the residency coordinator's decisions into
one ``HiSparseStepMetadata`` for the workers (transfers, residency updates,
CoW pairs, newly allocated host blocks, hot regions, reused GPU blocks), and
feeds the aggregated ``HiSparseWorkerAck`` back to the coordinator. It keeps
the engine stepping while acks are outstanding (INV-15).

Worker half: vLLM's connector lifecycle drives the data plane
(``vllm.v1.hisparse.worker``), which the runner's binding attaches
(``attach_worker``): ``start_load_kv`` is the step start (W1, before every
forward, zero-token steps included), ``save_kv_layer`` the per-layer mirror
submission (W2), ``wait_for_save`` the step end (W3/W5, after the drafter),
``build_connector_worker_meta`` the acks (W6).

Metrics (C12) take vLLM's KV-connector stats path: ``get_kv_connector_stats``
returns the scheduler's counters and gauges every step on the scheduler side,
and on a worker the resolver's device counters whenever an asynchronous copy
of them has landed (``vllm.v1.hisparse.metrics``); ``build_kv_connector_stats``
and ``build_prom_metrics`` give vLLM's loggers HiSparse's stats class and
Prometheus series.

Host prefix hits are local (the source group's prefix cache lives in the
host pool), so this connector reports no external tokens. Under a
MultiConnector it composes with the OffloadingConnector, which keeps the
indexer KV on its own offload path.
"""

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.metrics import (
    HiSparseConnectorStats,
    HiSparsePromMetrics,
)
from vllm.logger import init_logger
from vllm.v1.hisparse.kv_cache_coordinator import ResidencyClient
from vllm.v1.hisparse.metadata import HiSparseStepMetadata, HiSparseWorkerAck
from vllm.v1.hisparse.metrics import DeviceCounterSampler, SchedulerMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.hisparse.worker import HiSparseWorker
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

NOT_BOUND = (
    "HiSparseConnector's worker half is not bound to a HiSparse runtime: the "
    "GPU model runner binds it when it initialises a HiSparse KV cache (is "
    "this the V1 GPU model runner with the HiSparse series applied?)"
)


class HiSparseConnector(ResidencyClient, KVConnectorBase_V1, SupportsHMA):
    """Both halves of the HiSparse connector."""

    NOT_A_HISPARSE_LAYOUT = (
        "HiSparseConnector needs the HiSparse KV-cache layout: set "
        '--attention-config \'{"hisparse_config": {"host_pool_gib": ...}}\' '
        "on a sparse-MLA model."
    )

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self._worker: HiSparseWorker | None = None
        self._scheduler_metrics: SchedulerMetrics | None = None
        self._sampler: DeviceCounterSampler | None = None

    # ----------------------------------------------------------- binding

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        """The scheduler hands over its GPU pool; a HiSparse KV-cache
        coordinator's pool carries the residency coordinator."""
        hisparse = self.bind_residency(gpu_block_pool)
        host_pool = getattr(self._kv_cache_config, "host_pool", None)
        self._scheduler_metrics = SchedulerMetrics(
            hisparse, host_pool.block_stride if host_pool is not None else 0
        )

    # ----------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # Host hits are local prefix-cache hits. None ("not known yet") makes
        # the scheduler retry the request next step: its hit stops at a page
        # a finished request is about to publish (R30).
        if self.hisparse.waits_for_publication(request, num_computed_tokens):
            return None, False
        return 0, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        return None  # residency work runs in the coordinator's cache_blocks

    def build_connector_meta(
        self, scheduler_output: "SchedulerOutput"
    ) -> KVConnectorMetadata:
        return self.hisparse.build_step_metadata(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        ack = connector_output.kv_connector_worker_meta
        if ack is None:
            return
        if not isinstance(ack, HiSparseWorkerAck):
            raise TypeError(
                f"HiSparseConnector got worker metadata of type "
                f"{type(ack).__name__}; expected HiSparseWorkerAck"
            )
        self.hisparse.update_spills(ack)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Blocks are freed normally: pending spills hold their own leases and
        # a detached publication keeps the host prefix (spec 4.4).
        return False, None

    def has_pending_push_work(self) -> bool:
        return self._hisparse is not None and self.hisparse.has_pending_work()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # The decode path is captured in FULL graphs, a pure-decode batch's
        # mirror with it (docs/worker.md K39); other mirrors are submitted
        # outside the model (spec 4.10, INV-32).
        return False

    # ------------------------------------------------------- worker side

    def attach_worker(self, worker: "HiSparseWorker") -> None:
        """The runner's binding hands over the data plane (spec 2.9)."""
        self._worker = worker
        # Every rank resolves the same top-k: rank 0 alone reports lookups.
        self._sampler = DeviceCounterSampler(
            worker.runtime, worker.streams, report_lookups=worker.rank == 0
        )

    @property
    def worker(self) -> "HiSparseWorker":
        if self._worker is None:
            raise RuntimeError(NOT_BOUND)
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None  # the binding builds HiSparse's own views of the slab

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiSparseStepMetadata)
        worker = self.worker
        attn_metadata = forward_context.attn_metadata
        if attn_metadata is not None:
            if not isinstance(attn_metadata, dict):
                raise RuntimeError(
                    "HiSparse needs per-layer attention metadata (micro-batching "
                    "is not supported)"
                )
            attn_metadata = attn_metadata.get(worker.first_layer)
        worker.start_step(meta, attn_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # HiSparse loads nothing per layer

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: Any,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        if self._worker is not None:
            self._worker.on_kv_written(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.finish_forward()

    def build_connector_worker_meta(self) -> "HiSparseWorkerAck | None":
        return self._worker.take_acks() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ------------------------------------------------------ metrics (C12)

    def get_kv_connector_stats(self) -> HiSparseConnectorStats | None:
        """Scheduler side: the coordinator's counters (deltas) and gauges,
        on every step where one moved (else None: P2). Worker side: the
        resolver's device counters when a copy issued on an earlier step has
        landed (event query, no host sync), else None. None when HiSparse is
        not bound."""
        if self._sampler is not None:
            report = self._sampler.sample()
        elif self._scheduler_metrics is not None:
            report = self._scheduler_metrics.collect()
        else:
            return None
        return HiSparseConnectorStats.of(report) if report is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> HiSparseConnectorStats:
        return HiSparseConnectorStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type["PromMetric"], type["PromMetricT"]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HiSparsePromMetrics:
        return HiSparsePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )


__all__ = ["HiSparseConnector", "HiSparseStepMetadata", "HiSparseWorkerAck"]
