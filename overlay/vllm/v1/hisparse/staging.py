# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""C11: prefill over host-backed context through staging (spec 2.11).

A prefill request whose resident table has a null entry among its context
pages (a host prefix hit, or pages lost under pressure) cannot let the
pin's prefill path read the resident view. Its pages are gathered, per
layer, into a staging cache with the *same row format* (``[C, B, W]``):
pages with a resident block device-to-device, null pages from the host view
with ``gather_plan``. The pin's unmodified gather-and-upconvert then reads the
staging cache through a remapped block table (page p -> staging block p + 1;
staging block 0 is null).

NOTE (a decision, docs/worker.md): staging is planned *per request*, so its
capacity is one request's pages, cdiv(max_model_len, B) + 1 blocks, and no
scheduler gate is needed: the pin's FlashMLA path already splits a step's
prefills into workspace-sized chunks, and HiSparse stages the host-backed
requests of a chunk one after another. The plan is built once per forward on
the CPU from the CPU block tables (prefill is never graph-captured) and shared
by every layer; only the device-to-device block list is per resident group.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils.math_utils import cdiv


@dataclass
class StagedRequest:
    """One host-backed prefill request's staging plan."""

    row: int
    """Batch row (its row in every block table)."""
    seq_len: int
    """Tokens of context including this step's, all gathered for attention."""
    num_pages: int
    d2d_dst: torch.Tensor
    """int64 [n_res]: staging blocks filled from resident pages."""
    d2d_src: tuple[torch.Tensor, ...]
    """Per resident group: int64 [n_res] GPU blocks of those pages."""
    host_src_rows: torch.Tensor
    """int32 [n_null, B]: host rows of the null pages."""
    host_dst_rows: torch.Tensor
    """int32 [n_null, B]: their staging rows."""
    host_mask: torch.Tensor
    """int32 [n_null, B]: all ones (every row of a null page is copied)."""


def to_device(
    values: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """A host array on ``device`` (an asynchronous copy where it can be)."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(
        device=device, dtype=dtype, non_blocking=True
    )


def context_pages(seq_lens: np.ndarray, width: int, block_size: int) -> np.ndarray:
    """bool [n, width]: page p of row i is among its cdiv(seq_len, B) pages."""
    pages = -(-np.asarray(seq_lens, dtype=np.int64) // block_size)
    return np.arange(width)[None, :] < pages[:, None]


def require_host_blocks(host_blocks: np.ndarray, what: str) -> None:
    """INV-6: every page read from host has a host block."""
    if host_blocks.size and (host_blocks <= 0).any():
        raise RuntimeError(f"HiSparse: {what} read from host without a host block (INV-6)")


def page_copy_rows(
    src_blocks: np.ndarray, dst_blocks: np.ndarray, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gather_plan`` inputs copying whole pages: int32 [n, B] source rows
    (src block * B + offset), destination rows, and an all-ones mask."""
    offsets = np.arange(block_size, dtype=np.int64)
    src = src_blocks.astype(np.int64)[:, None] * block_size + offsets
    dst = dst_blocks.astype(np.int64)[:, None] * block_size + offsets
    return (
        to_device(src, device, torch.int32),
        to_device(dst, device, torch.int32),
        torch.ones(src.shape, dtype=torch.int32, device=device),
    )


def host_backed_rows(
    resident_table: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> np.ndarray:
    """The rows among ``rows`` with a null resident entry among their first
    cdiv(seq_len, B) pages (vectorised: no Python loop over requests)."""
    if rows.size == 0:
        return rows
    table = resident_table[rows]
    null = (table == 0) & context_pages(seq_lens, table.shape[1], block_size)
    return rows[null.any(axis=1)]


def plan_staged_request(
    row: int,
    seq_len: int,
    resident_tables: Sequence[np.ndarray],
    source_table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> StagedRequest:
    """Staging plan of one host-backed prefill request (spec 2.11 steps 1-3).

    Page p goes to staging block p + 1. Pages resident in the first resident
    group are resident in all of them (INV-7); the others are read from the
    request's host blocks, which are never null (INV-6).
    """
    num_pages = cdiv(seq_len, block_size)
    first = resident_tables[0][row, :num_pages]
    resident = np.nonzero(first != 0)[0]
    null = np.nonzero(first == 0)[0]
    host_blocks = source_table[row, null]
    require_host_blocks(
        host_blocks, f"batch row {row}'s page(s) {null[host_blocks <= 0].tolist()}"
    )
    host_src, host_dst, host_mask = page_copy_rows(
        host_blocks, null + 1, block_size, device
    )
    return StagedRequest(
        row=row,
        seq_len=seq_len,
        num_pages=num_pages,
        d2d_dst=to_device(resident + 1, device),
        d2d_src=tuple(to_device(table[row, resident], device) for table in resident_tables),
        host_src_rows=host_src,
        host_dst_rows=host_dst,
        host_mask=host_mask,
    )


class StagingCache:
    """One staging buffer reused by every layer, in stream order."""

    def __init__(
        self, max_model_len: int, block_size: int, row_bytes: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.num_blocks = cdiv(max_model_len, block_size) + 1
        self.cache = torch.zeros(
            (self.num_blocks, block_size, row_bytes), dtype=torch.uint8, device=device
        )
        self.block_table = torch.arange(
            1, self.num_blocks, dtype=torch.int32, device=device
        ).unsqueeze(0)
        """int32 [1, C - 1]: page p -> staging block p + 1."""
        self.zero_start = torch.zeros(1, dtype=torch.int32, device=device)

    def fill(
        self,
        request: StagedRequest,
        pair: int,
        resident_view: torch.Tensor,
        host_rows: torch.Tensor,
        gather_plan,
    ) -> torch.Tensor:
        """Gather one layer's context pages of ``request`` into the cache
        (spec 2.11 per-layer steps 1-2); returns the cache."""
        if request.d2d_dst.numel():
            self.cache.index_copy_(
                0, request.d2d_dst, resident_view.index_select(0, request.d2d_src[pair])
            )
        if request.host_src_rows.numel():
            gather_plan(
                host_rows,
                self.cache,
                request.host_src_rows,
                request.host_dst_rows,
                request.host_mask,
            )
        return self.cache

    def table_for(self, request: StagedRequest) -> torch.Tensor:
        return self.block_table[:, : request.num_pages]


__all__ = [
    "StagedRequest",
    "StagingCache",
    "context_pages",
    "host_backed_rows",
    "page_copy_rows",
    "plan_staged_request",
    "require_host_blocks",
    "to_device",
]
