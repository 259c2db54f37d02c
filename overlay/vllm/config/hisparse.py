# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""User-facing configuration of Hybrid HiSparse.

Set through ``--attention-config '{"hisparse_config": {...}}'`` (or the dotted
form ``--attention-config.hisparse_config '{...}'``). Leaving it unset keeps
vLLM's behaviour unchanged: every HiSparse hook checks for ``None`` first.

Only the knobs a deployment needs are user-settable. Protocol constants (the
protected tail of two pages, the transition watermark, the 256 GiB
registration chunk, the 95% RAM threshold) are fixed by the design and live
in ``vllm.v1.hisparse``; making them tunable would let a config break the
invariants the implementation relies on.
"""

from typing import Any, Literal

from pydantic import field_validator

from vllm.config.utils import config

# Hot-buffer slot ids are int16 in the resolver's LRU state.
MAX_DEVICE_BUFFER_SIZE = 32768
# order_misses' string values: per plan row (K6), per step (K7).
ORDER_MISSES_MODES = ("row", "step")


def order_misses_error(value: Any) -> str:
    return (f"hisparse_config.order_misses={value!r} must be true, false, "
            '"row" or "step" (or left out)')


@config
class HiSparseConfig:
    """Configuration for Hybrid HiSparse (host-offloaded sparse-MLA KV)."""

    host_pool_gib: float | None = None
    """Pinned host pool per DP replica, in GiB: the source of truth for all
    sparse-MLA KV history. Required here or, when HiSparseConnector is named
    explicitly in --kv-transfer-config, in its kv_connector_extra_config."""

    device_buffer_size: int | None = None
    """Hot rows per request per hot group (H). None selects the default
    (max_decode_query_len + 1) * index_topk: 2 * top_k without speculation.
    Must be at least max_decode_query_len * index_topk and at most 32768."""

    eager_host_mirror: bool = True
    """Mirror decode rows to host in the step that wrote them, so a spill is
    only a completion barrier. When False, decode rows are not mirrored and
    spills copy whole pages; prefill rows are always mirrored."""

    admission_max_tokens: int | None = None
    """Cap, in tokens, on the resident (GPU) pages a request must hold to be
    admitted and while it runs: older pages are expected to move to host.
    None selects min(max_num_batched_tokens, max_model_len). The two
    protected tail pages are always added on top."""

    shared_host_pool: bool | None = None
    """Share one host pool across TP ranks (rank 0 writes). None decides
    automatically from the parallel setup; True fails at startup when the
    setup is not eligible; False forces a private pool per rank."""

    order_misses: bool | Literal["row", "step"] | None = None
    """Gather each step's host misses in host-address order (random reads
    of a large pinned pool run far below the link; docs/kernels.md P9).
    "row" (or true) sorts each plan row (K6; index_topk at most 2048),
    "step" sorts all the step's misses as one list (K7). None or false is
    off: the GPU measurements that would pick a default are not in yet."""

    prefetch_followers: bool = False
    """Gather the misses of an index group's followers (layers that reuse
    their leader's top-k) on a copy stream as soon as the leader has planned
    them, so they run during the leader's attention (spec 2.10). Off by
    default until the H200 has measured it; no effect on a model whose every
    sparse layer has its own indexer."""

    @field_validator("host_pool_gib")
    @classmethod
    def _check_host_pool_gib(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError(
                f"hisparse_config.host_pool_gib={value} must be > 0 "
                "(GiB of pinned host memory per DP replica)"
            )
        return value

    @field_validator("device_buffer_size")
    @classmethod
    def _check_device_buffer_size(cls, value: int | None) -> int | None:
        if value is None:
            return value
        if value <= 0:
            raise ValueError(
                f"hisparse_config.device_buffer_size={value} must be > 0 "
                "(hot rows per request; omit it for the default)"
            )
        if value > MAX_DEVICE_BUFFER_SIZE:
            raise ValueError(
                f"hisparse_config.device_buffer_size={value} exceeds the "
                f"int16 slot limit {MAX_DEVICE_BUFFER_SIZE}"
            )
        return value

    @field_validator("admission_max_tokens")
    @classmethod
    def _check_admission_max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(
                f"hisparse_config.admission_max_tokens={value} must be > 0 "
                "(omit it for min(max_num_batched_tokens, max_model_len))"
            )
        return value

    @field_validator("order_misses", mode="before")
    @classmethod
    def _check_order_misses(cls, value: Any) -> Any:
        # Before pydantic's own coercion, which would read 1 or "yes" as true.
        if value is None or isinstance(value, bool) or value in ORDER_MISSES_MODES:
            return value
        raise ValueError(order_misses_error(value))

    def default_device_buffer_size(
        self, index_topk: int, max_decode_query_len: int
    ) -> int:
        """H: the configured value, else (q + 1) * K (spec 5.7)."""
        if self.device_buffer_size is not None:
            return self.device_buffer_size
        return (max_decode_query_len + 1) * index_topk

    def compute_hash(self) -> str:
        """The factors of this config that belong in vLLM's compile-cache hash.

        ``AttentionConfig.compute_hash`` takes this hash (not the raw fields)
        when HiSparse is on; HiSparse being on at all is already a factor
        there. A field is a factor only if it changes the compiled graph or
        the per-request shape of what the attention path reads. Pool sizes
        and scheduler/runtime knobs are left out, as ``CacheConfig`` leaves
        out ``num_gpu_blocks`` and ``gpu_memory_utilization``, so resizing the
        host pool reuses the torch.compile cache. Per field:

        - ``device_buffer_size`` (included): H is the per-request width of
          the hot buffer the HiSparse attention path reads: the hot-slot map
          and LRU of each index group are ``[max_num_seqs + 1, H]`` tensors,
          the hot region is cdiv(H, B) blocks per request. None (the default,
          (q + 1) * K) hashes as None: q and K are factors of the speculative
          and model configs already.
        - ``host_pool_gib`` (left out): a pool size (N_host host blocks),
          like ``num_gpu_blocks``; no per-request shape depends on it.
        - ``eager_host_mirror`` (left out): when the worker submits its host
          copies on the DMA stream (every step or at spill time); nothing in
          the forward changes.
        - ``admission_max_tokens`` (left out): the scheduler's resident
          window (cap_res), i.e. how many GPU blocks a request holds.
        - ``shared_host_pool`` (left out): host pool topology (which TP rank
          writes, the OS-page rounded stride), outside the forward.
        - ``order_misses`` (left out): launches inside the sparse attention
          op that change the order of the same copies (K6, or K7's key
          build and sort); no shape changes.
        - ``prefetch_followers`` (left out): the stream the followers' copies
          are launched on, inside the sparse attention op; no shape changes.
        """
        from vllm.config.utils import hash_factors

        # Graph/attention-shape factors only: see the docstring per field.
        return hash_factors({"device_buffer_size": self.device_buffer_size})
