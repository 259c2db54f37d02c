# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C10: sparse-MLA attention through HiSparse (spec 2.10, 2.11).

``FlashMLASparseImpl.forward_mqa`` hands a HiSparse layer's call to
``hisparse_forward_mqa`` (patch ``attention-flashmla-sparse-hisparse``). It
runs the pin's FP8 "separate prefill/decode" path with two substitutions:

- **decode tokens** (the batch's first ``num_decode_tokens``): instead of
  translating top-k through the block table, the index group's leader runs
  ``resolve_residency`` (resident pages short-circuit to their resident row;
  host-only pages are served from the request's hot slots, missing rows
  copied from the host pool by ``gather_compact``) and followers replay the
  leader's plan; the FP8 decode kernel then reads the layer's attention view
  with the resolver's row ids (its block table is a dummy, causality comes
  from the indexer). Fixed shapes and persistent buffers: this is what the
  FULL decode graphs capture (INV-32).
- **prefill tokens**: the context is gathered into the bf16 workspace from
  the resident view through the resident block table; for a request with a
  null resident entry among its context pages, from the staging cache (C11)
  instead. Top-k still indexes the workspace, exactly as in the pin.

KV writes need no substitution here: the layer's ``kv_cache`` is its
resident view and its slot mapping the resident group's (binding, C9).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.v1.hisparse import determinism
from vllm.v1.hisparse.staging import StagingCache

if TYPE_CHECKING:
    from vllm.v1.hisparse.runtime import HiSparseRuntime
    from vllm.v1.hisparse.worker import HiSparseWorker


@dataclass
class HiSparseLayerBinding:
    """What a sparse-MLA attention impl needs to run through HiSparse."""

    runtime: "HiSparseRuntime"
    worker: "HiSparseWorker"
    staging: StagingCache
    layer_name: str


def hisparse_forward_mqa(
    impl: Any,
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_c_and_k_pe_cache: torch.Tensor,
    attn_metadata: Any,
    layer: Any,
) -> tuple[torch.Tensor, None]:
    """``FlashMLASparseImpl.forward_mqa`` for a HiSparse layer."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata

    binding: HiSparseLayerBinding = impl.hisparse
    if isinstance(q, tuple):
        ql_nope, q_pe = q
        q = impl.q_concat_buffer[: ql_nope.shape[0]]
        ops.concat_mla_q(ql_nope, q_pe, q)
    fp8 = attn_metadata.fp8_extra_metadata
    if not isinstance(fp8, FlashMLASparseMetadata.FP8SeparatePrefillDecode):
        raise RuntimeError(
            "HiSparse runs FlashMLA sparse's FP8 separate prefill/decode path only "
            f"(got {type(fp8).__name__}); see the startup checks."
        )
    num_tokens = q.shape[0]
    topk = impl.topk_indices_buffer[:num_tokens]
    if determinism.CANONICAL_TOPK:  # test-only: one order in both arms (T1)
        determinism.canonicalize_topk(topk)
    num_decode_tokens = fp8.num_decode_tokens
    num_prefill_tokens = num_tokens - num_decode_tokens
    rt = binding.runtime
    views = rt.layers[binding.layer_name]
    # A drafter (MTP) layer: each call is one draft pass, resolved with the
    # pass's own rows (passes >= 1: one per request); the drafter runs eager
    # or piecewise, never in a FULL graph (docs/mtp.md 3.3, 3.9).
    row_req = None
    if views.is_draft:
        rt.begin_draft_pass(
            attn_metadata.num_decodes,
            attn_metadata.num_decode_tokens,
            attn_metadata.query_start_loc,
        )
        row_req = attn_metadata.req_id_per_token

    decoded = None
    if num_decode_tokens > 0:
        if fp8.decode.decode_query_len > rt.geometry.max_decode_query_len:
            # Short prefill chunks on the decode kernel (K13).
            rows = rt.extend_rows(
                binding.layer_name, num_decode_tokens, topk, attn_metadata.seq_lens
            )
        else:
            rows, _ = rt.decode_rows(
                binding.layer_name,
                num_decode_tokens,
                topk,
                attn_metadata.seq_lens,
                attn_metadata.block_table,
                row_req=row_req,
            )
        decoded = _decode(impl, q[:num_decode_tokens], rows, fp8, views.attention)
    # After the last target layer, a pure-decode batch's mirror (captured
    # with the layer by a FULL graph: P2).
    binding.worker.on_attention(
        binding.layer_name, attn_metadata.num_prefills == 0, num_tokens
    )
    if decoded is not None and num_prefill_tokens == 0:
        return decoded, None

    out = q.new_empty((num_tokens, impl.num_heads, impl.kv_lora_rank))
    if decoded is not None:
        out[:num_decode_tokens] = decoded
    _prefill(impl, binding, q, topk, attn_metadata, fp8, out)
    return out, None


def _decode(
    impl: Any, q: torch.Tensor, rows: torch.Tensor, fp8: Any, kv: torch.Tensor
) -> torch.Tensor:
    from vllm.v1.attention.backends.utils import (
        reshape_attn_output_for_spec_decode,
        reshape_query_for_spec_decode,
    )

    q = reshape_query_for_spec_decode(q, fp8.num_decodes)
    rows = rows.view(fp8.num_decodes, q.shape[1], -1)
    out, _ = impl._fp8_flash_mla_kernel(
        q=q,
        kv_c_and_k_pe_cache=kv,
        topk_indices=rows,
        kernel_metadata=fp8.decode.kernel_metadata,
    )
    return reshape_attn_output_for_spec_decode(out)


def _prefill(
    impl: Any,
    binding: HiSparseLayerBinding,
    q: torch.Tensor,
    topk: torch.Tensor,
    md: Any,
    fp8: Any,
    out: torch.Tensor,
) -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    prefill = fp8.prefill
    assert prefill is not None
    # Prefill top-k -> workspace offsets, exactly as the pin computes them
    # (decode tokens' outputs of this call are not used).
    ws_indices, ws_lengths = triton_convert_req_index_to_global_index(
        md.req_id_per_token[: topk.shape[0]],
        md.block_table,
        topk,
        BLOCK_SIZE=md.block_size,
        NUM_TOPK_TOKENS=topk.shape[1],
        HAS_PREFILL_WORKSPACE=True,
        prefill_workspace_request_ids=prefill.request_ids,
        prefill_workspace_starts=prefill.workspace_starts,
        return_valid_counts=True,
    )
    rt = binding.runtime
    views = rt.layers[binding.layer_name]
    resident_table = rt.tables.device(rt.resident_group(views))
    staged = rt.staged if rt.step_active else {}
    for chunk in prefill.chunks:
        workspace = impl.prefill_bf16_workspace[: chunk.chunk_tot_seqlen]
        first_row = md.num_decodes + chunk.req_start_idx
        num_rows = len(chunk.block_table)
        ops.cp_gather_and_upconvert_fp8_kv_cache(
            views.resident,
            workspace,
            resident_table[first_row : first_row + num_rows],
            chunk.workspace_starts,
            num_rows,
        )
        rows = [r for r in range(first_row, first_row + num_rows) if r in staged]
        if rows:
            _stage_rows(binding, rows, first_row, num_rows, workspace)
        window = chunk.tokens_slice
        out[window] = impl._bf16_flash_mla_kernel(
            q[window], workspace, ws_indices[window], ws_lengths[window]
        )


def _stage_rows(
    binding: HiSparseLayerBinding,
    rows: list[int],
    first_row: int,
    num_rows: int,
    workspace: torch.Tensor,
) -> None:
    """Overwrite the workspace ranges of host-backed requests with their
    staged context (spec 2.11, per layer after its KV write)."""
    from vllm import _custom_ops as ops

    rt = binding.runtime
    views = rt.layers[binding.layer_name]
    lens = rt.prefill_seq_lens[first_row : first_row + num_rows]
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    for row in rows:
        request = rt.staged[row]
        cache = binding.staging.fill(
            request, views.pair, views.resident, views.host, rt.ops.gather_plan
        )
        start = int(starts[row - first_row])
        ops.cp_gather_and_upconvert_fp8_kv_cache(
            cache,
            workspace[start : start + request.seq_len],
            binding.staging.table_for(request),
            binding.staging.zero_start,
            1,
        )


__all__ = ["HiSparseLayerBinding", "hisparse_forward_mqa"]
