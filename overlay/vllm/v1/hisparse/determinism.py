# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test-only: a canonical order of the sparse-MLA top-k rows.

The pin's indexer top-k kernels (``top_k_per_row_prefill`` / ``_decode``,
csrc/libtorch_stable/sampler.cu) place each selected position at an
``atomicAdd`` index, so the *order* of a row's positions changes from run
to run, and FlashMLA sparse accumulates attention in that order: two runs of
the same engine on the same request differ in the last bits of the
attention output, and on a model with near-ties in its logits, in greedy
tokens (measured on the H200: results/e2e/README.md). A bitwise comparison
of two engines (HiSparse on vs off, target T1) therefore needs one order in
both: with ``VLLM_HISPARSE_CANONICAL_TOPK=1`` at startup, FlashMLA sparse
sorts each row of this forward before attention (patch
attention-flashmla-sparse-canonical-topk), and so does HiSparse's attention
path (``index_groups.hisparse_forward_mqa``). Production leaves it off.
"""

import os

import torch

ENV = "VLLM_HISPARSE_CANONICAL_TOPK"
CANONICAL_TOPK = os.environ.get(ENV) == "1"
"""Read once at import; tests and the e2e gate's determinism control may
flip it at run time (FlashMLA sparse and HiSparse read it per forward)."""


def canonicalize_topk(topk: torch.Tensor) -> None:
    """Sort each row of ``topk`` in place: its positions ascending, the -1
    entries (no position) last, so that a row's valid entries stay a prefix
    (the kernels' valid counts assume it). Fixed shapes, no host sync:
    capturable in a CUDA graph."""
    if topk.numel() == 0:
        return
    last = torch.iinfo(topk.dtype).max
    key = torch.where(topk < 0, torch.full_like(topk, last), topk)
    ordered = key.sort(dim=-1).values
    topk.copy_(torch.where(ordered == last, torch.full_like(topk, -1), ordered))


__all__ = ["CANONICAL_TOPK", "ENV", "canonicalize_topk"]
