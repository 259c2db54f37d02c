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

The order is not all: the same kernels also choose *which* of several
positions with exactly equal indexer logits fill a row's last places by
``atomicAdd`` order (sampler.cu, the threshold bin of the radix select), so
a row whose k-th logit is tied selects different positions from run to run
(measured on the H200: the same 5200-token request, prefilled from nothing
in one engine, took one of two outputs one bf16 ulp apart in its logits,
results/e2e run 17). With the flag, the indexer's rows are selected again
after the pin's kernel (``select_topk_prefill`` / ``select_topk_decode``):
the k largest logits, ties to the lower position, a function of the logits
alone.
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


_NONE = torch.iinfo(torch.int64).min
_LOW = (1 << 31) - 1


def _select(logits: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
            out: torch.Tensor) -> None:
    """Per row ``r``: the columns of the ``k = out.shape[1]`` largest
    logits within [start[r], end[r]), ties to the lower column, written to
    ``out[r]`` relative to start[r], -1 past the row's valid count. One
    int64 key per logit (the float's order, then the inverted column) makes
    every key of a row distinct, so the selected set is unique. Fixed
    shapes, no host sync: capturable in a CUDA graph."""
    rows, cols = logits.shape[0], logits.shape[1]
    k = out.shape[1]
    if rows == 0:
        return
    if cols == 0:
        out.fill_(-1)
        return
    bits = logits.float().contiguous().view(torch.int32).to(torch.int64)
    order = torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)  # float order
    col = torch.arange(cols, device=logits.device, dtype=torch.int64)
    key = order * (1 << 32) + (_LOW - col)
    valid = (col >= start.view(-1, 1).to(torch.int64)) & (col < end.view(-1, 1).to(torch.int64))
    key = torch.where(valid, key, torch.full_like(key, _NONE))
    n = min(k, cols)
    top, where = key.topk(n, dim=-1)
    picked = torch.where(top == _NONE, torch.full_like(where, -1),
                         where - start.view(-1, 1).to(torch.int64))
    out[:, :n].copy_(picked)
    if n < k:
        out[:, n:].fill_(-1)


PREFILL_ROWS_PER_PASS = 1024
"""Prefill rows selected per pass (bounds the int64 keys' memory: 1024 x
the chunk's K length x 8 bytes, plus temporaries)."""


def select_topk_prefill(logits: torch.Tensor, row_starts: torch.Tensor,
                        row_ends: torch.Tensor, out: torch.Tensor) -> None:
    """The deterministic selection of ``top_k_per_row_prefill``: row r
    reads logits[r, row_starts[r]:row_ends[r]] and writes positions
    relative to row_starts[r] (eager: prefill runs outside CUDA graphs)."""
    for lo in range(0, logits.shape[0], PREFILL_ROWS_PER_PASS):
        hi = lo + PREFILL_ROWS_PER_PASS
        _select(logits[lo:hi], row_starts[lo:hi], row_ends[lo:hi], out[lo:hi])


def select_topk_decode(logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int,
                       out: torch.Tensor) -> None:
    """The deterministic selection of the decode top-k kernels
    (``top_k_per_row_decode``, ``persistent_topk``, ``cooperative_topk``):
    row r = b * next_n + j reads logits[r, :end) with end = seq_lens[b, j]
    (2-D seq_lens, as the pin passes them) or seq_lens[b] - next_n + j + 1
    (1-D), positions from 0."""
    rows = logits.shape[0]
    if seq_lens.dim() == 2:
        end = seq_lens.reshape(-1)[:rows]
    else:
        j = torch.arange(rows, device=logits.device) % next_n
        end = seq_lens.repeat_interleave(next_n)[:rows] - next_n + j + 1
    end = end.clamp(min=0)
    _select(logits, torch.zeros_like(end), end, out[:rows])


__all__ = ["CANONICAL_TOPK", "ENV", "canonicalize_topk", "select_topk_decode",
           "select_topk_prefill"]
