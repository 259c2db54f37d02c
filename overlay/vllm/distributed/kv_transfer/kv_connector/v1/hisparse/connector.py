# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C5: the scheduler half of ``HiSparseConnector`` (spec 2.6, 4.1).

Each step it turns the residency coordinator's decisions into one
``HiSparseStepMetadata`` for the workers (transfers, residency updates, CoW
pairs, newly allocated host blocks, row-mirror envelopes), and feeds the
aggregated ``HiSparseWorkerAck`` back to the coordinator. It keeps the engine
stepping while acks are outstanding (INV-15).

Host prefix hits are local (the source group's prefix cache lives in the
host pool), so this connector reports no external tokens. Under a
MultiConnector it composes with the OffloadingConnector, which keeps the
indexer KV on its own offload path.

The worker half (the DMA/mirror data plane, C6) is a separate component; a
worker-role instance is refused with a clear error until it is installed.
"""

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.hisparse.metadata import HiSparseStepMetadata, HiSparseWorkerAck

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

WORKER_HALF_MISSING = (
    "HiSparseConnector's worker half (the host-mirror/DMA data plane) is not "
    "installed in this build; HiSparse can run its scheduler side only "
    "(simulation and tests). Remove hisparse_config / HiSparseConnector to "
    "serve."
)


class HiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler half of the HiSparse connector."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ):
        if role == KVConnectorRole.WORKER:
            raise RuntimeError(WORKER_HALF_MISSING)
        super().__init__(vllm_config, role, kv_cache_config)
        spec = vllm_config.speculative_config
        self._num_lookahead_tokens = spec.num_speculative_tokens if spec else 0
        self._hisparse: HiSparseCoordinator | None = None

    # ----------------------------------------------------------- binding

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        """The scheduler hands over its GPU pool; a HiSparse KV-cache
        coordinator's pool carries the residency coordinator."""
        from vllm.v1.hisparse.kv_cache_coordinator import residency_of

        self._hisparse = residency_of(
            gpu_block_pool,
            "HiSparseConnector needs the HiSparse KV-cache layout: set "
            "--attention-config '{\"hisparse_config\": {\"host_pool_gib\": ...}}' "
            "on a sparse-MLA model.",
        )

    @property
    def hisparse(self) -> "HiSparseCoordinator":
        assert self._hisparse is not None, "bind_gpu_block_pool was not called"
        return self._hisparse

    # ----------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # host hits are local prefix-cache hits

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        return None  # residency work runs in the coordinator's cache_blocks

    def build_connector_meta(
        self, scheduler_output: "SchedulerOutput"
    ) -> KVConnectorMetadata:
        return self.hisparse.build_step_metadata(
            scheduler_output, self._num_lookahead_tokens
        )

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
        # The decode path is captured in FULL graphs; mirrors are submitted
        # outside the model (spec 4.10, INV-32).
        return False

    # ------------------------------------------------------- worker side
    # A worker-role instance is refused in __init__, so these never run.

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        raise RuntimeError(WORKER_HALF_MISSING)

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise RuntimeError(WORKER_HALF_MISSING)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: Any,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        raise RuntimeError(WORKER_HALF_MISSING)

    def wait_for_save(self) -> None:
        raise RuntimeError(WORKER_HALF_MISSING)


__all__ = ["HiSparseConnector", "HiSparseStepMetadata", "HiSparseWorkerAck"]
