# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Launchers for the HiSparse CUDA kernels (spec section 5, component C8).

The kernels live in the standalone ``hisparse_ops`` extension
(``scripts/build-kernels.sh``) and are registered as
``torch.ops.hisparse_ops.<name>``. This module finds and loads it, checks every
tensor argument before a launch (device, dtype, rank, contiguity and the shape
relations of spec 5.0/5.1, with messages that name the argument) and owns the
resolver's shared-memory preflight, which the startup checks (6.3 items 10-11)
and the launcher share.

Where the extension is looked for, in order:

1. ``$HISPARSE_OPS_LIBRARY``: path of ``_hisparse_ops.so``;
2. the importable package ``hisparse_ops`` (what the build script installs);
3. ``vllm/_hisparse_C*.so`` from a full vLLM source build
   (``csrc/hisparse/hisparse.cmake``).

The runtime launches through ``StepOps`` instead (docs/worker.md K46): the
same signatures, straight to the registered ops, whose C++ entry points make
the same checks; a step does not pay for them twice.

Launchers never synchronise with the device and never read device values on
the host, so they are safe inside CUDA-graph capture (INV-32); all checks look
at tensor metadata only. This module imports only torch and the standard
library.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import os

import torch

LIBRARY_ENV = "HISPARSE_OPS_LIBRARY"
REQUIRED_OPS = ("resolve_residency", "gather_compact", "order_plan",
                "order_step", "gather_ordered", "order_step_temp_bytes",
                "gather_plan", "invalidate_written_slots", "copy_descriptors",
                "mirror_descriptors")
# K6 sorts a plan row in one CTA's shared memory (docs/kernels.md P9).
ORDER_PLAN_MAX_CELLS = 2048
# K7 numbers the step's plan cells with int32 ids.
ORDER_STEP_MAX_CELLS = 2**31 - 1
MISSING_MESSAGE = ("HiSparse kernels are missing ({op}); install the "
                   "hisparse_ops extension built for this torch.")
# Slot ids are int16 (lru), so a hot region holds at most 32768 rows.
MAX_HOT_SIZE = 32768
# Counter layout of the optional ``stats`` tensor (uint64, 2 to 4 entries).
# "tripped_misses" counts every trip (docs/kernels.md decision 7): tripped
# misses, and references that resolve to -1 for an invalid GPU block id.
STATS_FIELDS = ("hits", "misses", "tripped_misses", "rejected_rows")


class HiSparseKernelsMissing(RuntimeError):
    """The hisparse_ops extension, or one of its ops, cannot be found."""


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------

def _namespace_has(op: str) -> bool:
    try:
        getattr(torch.ops.hisparse_ops, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def _in_tree_libraries() -> list[str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return []
    found: list[str] = []
    for folder in spec.submodule_search_locations:
        found += sorted(glob.glob(os.path.join(folder, "_hisparse_C*.so")))
    return found


def _try_load() -> list[str]:
    """Load the first extension found; return the reasons of failures."""
    errors: list[str] = []
    path = os.environ.get(LIBRARY_ENV)
    if path:
        try:
            torch.ops.load_library(path)
            return errors
        except (OSError, RuntimeError) as err:  # missing, wrong torch, dup
            errors.append(f"{LIBRARY_ENV}={path}: {err}")
    try:
        importlib.import_module("hisparse_ops")
        return errors
    except ImportError as err:
        errors.append(f"import hisparse_ops: {err}")
    except (OSError, RuntimeError) as err:
        errors.append(f"hisparse_ops library: {err}")
    for lib in _in_tree_libraries():
        try:
            torch.ops.load_library(lib)
            return errors
        except (OSError, RuntimeError) as err:
            errors.append(f"{lib}: {err}")
    return errors


@functools.cache
def _load_errors() -> tuple[str, ...]:
    if all(_namespace_has(op) for op in REQUIRED_OPS):
        return ()
    return tuple(_try_load())


def missing_op() -> str | None:
    """Name of the first required op that cannot be found, loading first."""
    _load_errors()
    for op in REQUIRED_OPS:
        if not _namespace_has(op):
            return op
    return None


def require_ops() -> None:
    """Startup check 6.3 item 2: the extension and all five ops exist."""
    op = missing_op()
    if op is not None:
        detail = "; ".join(_load_errors())
        err = HiSparseKernelsMissing(MISSING_MESSAGE.format(op=op))
        if detail:
            raise err from RuntimeError(detail)
        raise err


def ops_available() -> bool:
    return missing_op() is None


@functools.cache
def _ops():
    require_ops()
    return torch.ops.hisparse_ops


# ---------------------------------------------------------------------------
# Shared-memory preflight (spec 5.1 "Shared memory", 5.7, 6.3 items 10-11)
# ---------------------------------------------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def resolver_smem_bytes(top_k: int, max_query_len: int, hot_size: int) -> int:
    """Bytes of shared memory one resolver CTA needs (normative formula).

    smem = 8*Hs + 6*Umax + 2*H + 8*C + 32 with Umax = q*K,
    Hs = round_up(ceil(1.5*Umax), 32) and C = ceil(max(H, Umax)/32) + 1.
    The extension's ``resolver_smem_bytes`` op computes the same number from
    the layout the kernel actually carves (test K-13).
    """
    union_max = max_query_len * top_k
    hash_size = _cdiv(_cdiv(3 * union_max, 2), 32) * 32
    scan_words = _cdiv(max(hot_size, union_max), 32) + 1
    return (8 * hash_size + 6 * union_max + 2 * hot_size + 8 * scan_words
            + 32)


@functools.cache
def device_smem_limit(device_index: int) -> int:
    """Opt-in maximum dynamic shared memory per block of a CUDA device."""
    props = torch.cuda.get_device_properties(device_index)
    return int(props.shared_memory_per_block_optin)


def check_hot_size(top_k: int, max_query_len: int, hot_size: int) -> None:
    """Startup check 6.3 item 10 (bounds of device_buffer_size)."""
    need = max_query_len * top_k
    if hot_size < need:
        raise ValueError(
            f"HiSparse device_buffer_size={hot_size} must be >= "
            f"max_decode_query_len x index_topk = {need}")
    if hot_size > MAX_HOT_SIZE:
        raise ValueError(
            f"HiSparse device_buffer_size={hot_size} exceeds the int16 slot "
            f"limit {MAX_HOT_SIZE}.")


@functools.cache
def preflight_resolver(top_k: int, max_query_len: int, hot_size: int,
                       smem_limit: int) -> int:
    """Checks 6.3 items 10-11; returns the resolver's shared memory bytes.

    ``smem_limit`` is the device's opt-in maximum (``device_smem_limit``);
    passing it explicitly keeps this function usable before CUDA starts.
    """
    if top_k < 1 or max_query_len < 1:
        raise ValueError(f"HiSparse needs index_topk >= 1 and "
                         f"max_decode_query_len >= 1 (got {top_k}, "
                         f"{max_query_len})")
    check_hot_size(top_k, max_query_len, hot_size)
    need = resolver_smem_bytes(top_k, max_query_len, hot_size)
    if need > smem_limit:
        raise ValueError(
            f"HiSparse resolver needs {need} B of shared memory per block for "
            f"device_buffer_size={hot_size} and {max_query_len}×{top_k} union "
            f"rows; the device allows {smem_limit} B. Lower "
            "device_buffer_size or num_speculative_tokens.")
    return need


# ---------------------------------------------------------------------------
# Argument checks (metadata only: no device reads, graph-capture safe)
# ---------------------------------------------------------------------------

def _check(t: torch.Tensor, name: str, dtype: torch.dtype, dim: int,
           device: torch.device, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not "
                        f"{type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (found {t.device})")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} (found {t.dtype})")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s) (found "
                         f"shape {tuple(t.shape)})")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_dim(t: torch.Tensor, name: str, dim: int, expected: int,
               what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}.shape[{dim}] must equal {what} = "
                         f"{expected} (found {t.shape[dim]})")


def _require_cuda(t: torch.Tensor, name: str) -> torch.device:
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor")
    return t.device


def validate_resolve_args(topk, row_req, seq_lens, req_state, src_bt, res_bt,
                          hot_bt, dgi, lru, host_rows: int, block_size: int,
                          attn_block_stride: int, max_query_len: int,
                          out_rows, valid_counts, plan_src, plan_dst,
                          plan_count, miss_mask=None, resolved_g=None,
                          stats=None, *, num_gpu_blocks: int,
                          device: torch.device) -> None:
    """Every K1 precondition of spec 5.0/5.1 that metadata can show."""
    i32 = torch.int32
    _check(topk, "topk", i32, 2, device)
    rows, top_k = topk.shape
    if top_k < 1:
        raise ValueError("topk.shape[1] (index_topk) must be >= 1")
    _check(row_req, "row_req", i32, 1, device)
    _check_dim(row_req, "row_req", 0, rows, "topk.shape[0]")
    _check(seq_lens, "seq_lens", i32, 1, device)
    reqs = seq_lens.shape[0]
    _check(req_state, "req_state", i32, 1, device)
    _check_dim(req_state, "req_state", 0, reqs, "seq_lens.shape[0]")
    for t, name in ((src_bt, "src_bt"), (res_bt, "res_bt"),
                    (hot_bt, "hot_bt")):
        _check(t, name, i32, 2, device)
        _check_dim(t, name, 0, reqs, "seq_lens.shape[0]")
    _check(dgi, "dgi", i32, 2, device)
    _check(lru, "lru", torch.int16, 2, device)
    _check_dim(lru, "lru", 0, dgi.shape[0], "dgi.shape[0]")
    _check_dim(lru, "lru", 1, dgi.shape[1], "dgi.shape[1]")
    hot_size = dgi.shape[1]
    check_hot_size(top_k, max_query_len, hot_size)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if attn_block_stride < block_size:
        raise ValueError(f"attn_block_stride={attn_block_stride} must be >= "
                         f"block_size={block_size}")
    if not 0 <= host_rows < 2**31:
        raise ValueError(f"host_rows={host_rows} must be in [0, 2^31) "
                         "(INV-14)")
    check_num_gpu_blocks(num_gpu_blocks, block_size, attn_block_stride)
    if hot_bt.shape[1] < _cdiv(hot_size, block_size):
        raise ValueError(f"hot_bt.shape[1] must be >= cdiv(device_buffer_"
                         f"size, block_size) = {_cdiv(hot_size, block_size)} "
                         f"(found {hot_bt.shape[1]})")
    for t, name in ((out_rows, "out_rows"), (plan_src, "plan_src"),
                    (plan_dst, "plan_dst"), (miss_mask, "miss_mask"),
                    (resolved_g, "resolved_g")):
        if t is None and name in ("miss_mask", "resolved_g"):
            continue
        _check(t, name, i32, 2, device)
        _check_dim(t, name, 0, rows, "topk.shape[0]")
        _check_dim(t, name, 1, top_k, "topk.shape[1]")
    for t, name in ((valid_counts, "valid_counts"),
                    (plan_count, "plan_count")):
        _check(t, name, i32, 1, device)
        _check_dim(t, name, 0, rows, "topk.shape[0]")
    if stats is not None:
        _check(stats, "stats", torch.uint64, 1, device)
        if not 2 <= stats.shape[0] <= 4:
            raise ValueError(f"stats must hold 2 to 4 uint64 counters "
                             f"{STATS_FIELDS} (found {stats.shape[0]})")


def check_num_gpu_blocks(num_gpu_blocks: int, block_size: int,
                         attn_block_stride: int) -> None:
    """F18, INV-14: N_gpu >= 1 and every row id of a valid GPU block,
    block * max(Sa, B) + offset, fits int32."""
    if isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks,
                                                          int):
        raise TypeError(f"num_gpu_blocks must be an int (found "
                        f"{type(num_gpu_blocks).__name__})")
    if num_gpu_blocks < 1:
        raise ValueError(f"num_gpu_blocks={num_gpu_blocks} must be >= 1")
    stride = max(attn_block_stride, block_size)
    if num_gpu_blocks * stride >= 2**31:
        raise ValueError(
            f"num_gpu_blocks={num_gpu_blocks} x max(attn_block_stride, "
            f"block_size)={stride} = {num_gpu_blocks * stride} must be "
            "< 2^31 (INV-14)")


def as_byte_rows(t: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    """View a row array as uint8 (the kernels are dtype-agnostic)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions (found shape "
                         f"{tuple(t.shape)})")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} rows must be contiguous (stride(-1) == 1)")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def validate_byte_views(src: torch.Tensor, dst: torch.Tensor, *,
                        device: torch.device) -> None:
    """src: [rows, W] uint8 on ``device`` or host; dst: [N, B, W] uint8."""
    if dst.device != device:
        raise ValueError(f"dst must be on {device} (found {dst.device})")
    if src.device.type != "cpu" and src.device != device:
        raise ValueError(f"src must be on {device} or in pinned host memory "
                         f"(found {src.device})")
    if src.shape[1] != dst.shape[2]:
        raise ValueError(f"src.shape[1] must equal dst.shape[2] (W) = "
                         f"{dst.shape[2]} (found {src.shape[1]})")
    if dst.shape[2] % 16:
        raise ValueError(f"row size W={dst.shape[2]} bytes must be a "
                         "multiple of 16")
    if dst.shape[1] < 1:
        raise ValueError("dst.shape[1] (block_size) must be >= 1")


def validate_plan(plan_src, plan_dst, plan_count, *,
                  device: torch.device) -> tuple[int, int]:
    """K1's miss plan as K2 and K6 take it; returns (rows, K)."""
    _check(plan_src, "plan_src", torch.int32, 2, device)
    rows, top_k = plan_src.shape
    _check(plan_dst, "plan_dst", torch.int32, 2, device)
    _check_dim(plan_dst, "plan_dst", 0, rows, "plan_src.shape[0]")
    _check_dim(plan_dst, "plan_dst", 1, top_k, "plan_src.shape[1]")
    _check(plan_count, "plan_count", torch.int32, 1, device)
    _check_dim(plan_count, "plan_count", 0, rows, "plan_src.shape[0]")
    return rows, top_k


def validate_gather_compact(src, dst, plan_src, plan_dst, plan_count, *,
                            device: torch.device) -> None:
    validate_byte_views(src, dst, device=device)
    validate_plan(plan_src, plan_dst, plan_count, device=device)


def validate_order_plan(plan_src, plan_dst, plan_count, *,
                        device: torch.device) -> None:
    _, top_k = validate_plan(plan_src, plan_dst, plan_count, device=device)
    if top_k > ORDER_PLAN_MAX_CELLS:
        raise ValueError(f"order_plan sorts rows of at most {ORDER_PLAN_MAX_CELLS} "
                         f"cells (plan_src.shape[1] = {top_k})")


def validate_order_step(plan_src, plan_count, host_rows: int, keys, cells,
                        sorted_keys, sorted_cells, total, temp, *,
                        device: torch.device) -> int:
    """K7's plan and flat buffers; returns the plan's cell count."""
    _check(plan_src, "plan_src", torch.int32, 2, device)
    rows, top_k = plan_src.shape
    _check(plan_count, "plan_count", torch.int32, 1, device)
    _check_dim(plan_count, "plan_count", 0, rows, "plan_src.shape[0]")
    check_order_step_size(rows * top_k, host_rows)
    for t, name in ((keys, "keys"), (cells, "cells"),
                    (sorted_keys, "sorted_keys"),
                    (sorted_cells, "sorted_cells")):
        _check(t, name, torch.int32, 1, device)
        _check_dim(t, name, 0, rows * top_k, "plan_src.numel()")
    _check(total, "total", torch.int32, 1, device)
    _check_dim(total, "total", 0, 1, "1")
    _check(temp, "temp", torch.uint8, 1, device)
    return rows * top_k


def check_order_step_size(cells: int, host_rows: int) -> None:
    if not 0 <= cells <= ORDER_STEP_MAX_CELLS:
        raise ValueError(f"order_step numbers plan cells with int32 ids: "
                         f"{cells} cells is too many")
    if not 0 <= host_rows < 2**31:
        raise ValueError(f"host_rows={host_rows} must be in [0, 2^31) "
                         "(INV-14)")


def validate_gather_ordered(src, dst, plan_src, plan_dst, order, total, *,
                            device: torch.device) -> None:
    validate_byte_views(src, dst, device=device)
    _check(plan_src, "plan_src", torch.int32, 2, device)
    _check(plan_dst, "plan_dst", torch.int32, 2, device)
    _check_dim(plan_dst, "plan_dst", 0, plan_src.shape[0], "plan_src.shape[0]")
    _check_dim(plan_dst, "plan_dst", 1, plan_src.shape[1], "plan_src.shape[1]")
    _check(order, "order", torch.int32, 1, device)
    _check_dim(order, "order", 0, plan_src.numel(), "plan_src.numel()")
    _check(total, "total", torch.int32, 1, device)
    _check_dim(total, "total", 0, 1, "1")


def validate_gather_plan(src, dst, src_rows, dst_rows, mask, req_state,
                         out_rows, attn_block_stride: int, *,
                         device: torch.device) -> None:
    validate_byte_views(src, dst, device=device)
    _check(src_rows, "src_rows", torch.int32, 2, device)
    rows, cols = src_rows.shape
    for t, name in ((dst_rows, "dst_rows"), (mask, "mask"),
                    (out_rows, "out_rows")):
        if t is None:
            continue
        _check(t, name, torch.int32, 2, device)
        _check_dim(t, name, 0, rows, "src_rows.shape[0]")
        _check_dim(t, name, 1, cols, "src_rows.shape[1]")
    if req_state is not None:
        _check(req_state, "req_state", torch.int32, 1, device)
        if req_state.shape[0] < rows:
            raise ValueError(f"req_state.shape[0] must be >= "
                             f"src_rows.shape[0] = {rows} (found "
                             f"{req_state.shape[0]})")
    if attn_block_stride < dst.shape[1]:
        raise ValueError(f"attn_block_stride={attn_block_stride} must be >= "
                         f"dst.shape[1]={dst.shape[1]}")


def validate_invalidate(dgi, req_state, token_req, written_g, *,
                        device: torch.device) -> None:
    """dgi: one index group's [S, H] or every group's [G, S, H]."""
    stacked = isinstance(dgi, torch.Tensor) and dgi.dim() == 3
    _check(dgi, "dgi", torch.int32, 3 if stacked else 2, device)
    if dgi.dim() == 3 and dgi.shape[0] > 65535:
        raise ValueError(f"dgi holds {dgi.shape[0]} index groups (at most "
                         "65,535: the launch's grid.y)")
    _check(req_state, "req_state", torch.int32, 1, device)
    _check(token_req, "token_req", torch.int32, 1, device)
    _check(written_g, "written_g", torch.int64, 1, device)
    _check_dim(written_g, "written_g", 0, token_req.shape[0],
               "token_req.shape[0]")


def validate_descriptors(src_ptr, dst_ptr, nbytes, *,
                         device: torch.device) -> None:
    _check(src_ptr, "src_ptr", torch.int64, 1, device)
    for t, name in ((dst_ptr, "dst_ptr"), (nbytes, "nbytes")):
        _check(t, name, torch.int64, 1, device)
        _check_dim(t, name, 0, src_ptr.shape[0], "src_ptr.shape[0]")


# ---------------------------------------------------------------------------
# Launchers: validate, then launch on the current stream of the device.
# ---------------------------------------------------------------------------

def resolve_residency(topk: torch.Tensor, row_req: torch.Tensor,
                      seq_lens: torch.Tensor, req_state: torch.Tensor,
                      src_bt: torch.Tensor, res_bt: torch.Tensor,
                      hot_bt: torch.Tensor, dgi: torch.Tensor,
                      lru: torch.Tensor, host_rows: int, block_size: int,
                      attn_block_stride: int, max_query_len: int,
                      out_rows: torch.Tensor, valid_counts: torch.Tensor,
                      plan_src: torch.Tensor, plan_dst: torch.Tensor,
                      plan_count: torch.Tensor,
                      miss_mask: torch.Tensor | None = None,
                      resolved_g: torch.Tensor | None = None,
                      stats: torch.Tensor | None = None, *,
                      num_gpu_blocks: int) -> None:
    """K1: resolve top-k positions to attention rows, updating the hot LRU.

    Rows with the same ``row_req`` must be consecutive (at most
    ``max_query_len`` of them); they are resolved as one union group.
    ``num_gpu_blocks`` is N_gpu, the block count of the GPU pool that the
    resident and hot tables index: ids outside [1, N_gpu) are tripped (F18).
    """
    device = _require_cuda(topk, "topk")
    validate_resolve_args(topk, row_req, seq_lens, req_state, src_bt, res_bt,
                          hot_bt, dgi, lru, host_rows, block_size,
                          attn_block_stride, max_query_len, out_rows,
                          valid_counts, plan_src, plan_dst, plan_count,
                          miss_mask, resolved_g, stats,
                          num_gpu_blocks=num_gpu_blocks, device=device)
    index = torch.cuda.current_device() if device.index is None \
        else device.index
    preflight_resolver(topk.shape[1], max_query_len, dgi.shape[1],
                       device_smem_limit(index))
    _ops().resolve_residency(topk, row_req, seq_lens, req_state, src_bt,
                             res_bt, hot_bt, dgi, lru, host_rows,
                             num_gpu_blocks, block_size,
                             attn_block_stride, max_query_len, out_rows,
                             valid_counts, plan_src, plan_dst, plan_count,
                             miss_mask, resolved_g, stats)


def order_plan(plan_src: torch.Tensor, plan_dst: torch.Tensor,
               plan_count: torch.Tensor) -> None:
    """K6: sort each row's first ``plan_count`` cells of K1's plan by
    source row (host address) in place, so K2 reads the host pool in
    address order (docs/kernels.md P9)."""
    device = _require_cuda(plan_src, "plan_src")
    validate_order_plan(plan_src, plan_dst, plan_count, device=device)
    _ops().order_plan(plan_src, plan_dst, plan_count)


def order_step_temp_bytes(cells: int, host_rows: int,
                          device: torch.device) -> int:
    """Bytes of CUB temporary storage K7 needs to sort ``cells`` plan cells
    of a pool of ``host_rows`` rows on ``device``: asked once, when the
    workspace is allocated, never during a step (INV-32). A launch for
    fewer cells needs no more."""
    check_order_step_size(cells, host_rows)
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None \
        else device.index
    return int(_ops().order_step_temp_bytes(cells, host_rows, index))


def order_step(plan_src: torch.Tensor, plan_count: torch.Tensor,
               host_rows: int, keys: torch.Tensor, cells: torch.Tensor,
               sorted_keys: torch.Tensor, sorted_cells: torch.Tensor,
               total: torch.Tensor, temp: torch.Tensor) -> None:
    """K7: the step's live plan cells as one list in ascending host-row
    order (docs/kernels.md P9). Writes ``keys``/``cells`` (cell i's sort
    key and id, padding key and -1 past its row's count), their stable
    radix sort ``sorted_keys``/``sorted_cells``, and ``total`` (the live
    cells); ``temp`` holds order_step_temp_bytes(plan_src.numel(),
    host_rows) bytes. The plan itself is not changed
    (reference.ref_order_step states the semantics)."""
    device = _require_cuda(plan_src, "plan_src")
    validate_order_step(plan_src, plan_count, host_rows, keys, cells,
                        sorted_keys, sorted_cells, total, temp, device=device)
    _ops().order_step(plan_src, plan_count, host_rows, keys, cells,
                      sorted_keys, sorted_cells, total, temp)


def gather_ordered(src: torch.Tensor, dst: torch.Tensor,
                   plan_src: torch.Tensor, plan_dst: torch.Tensor,
                   order: torch.Tensor, total: torch.Tensor) -> None:
    """K7's gather: K2's copies, taken in order_step's list order
    (``order`` = its sorted_cells, ``total`` its live count). The same
    (src, dst) pairs as gather_compact on the same plan (INV-36);
    followers replay the leader's list with their own views."""
    device = _require_cuda(dst, "dst")
    src = as_byte_rows(src, "src", 2)
    dst = as_byte_rows(dst, "dst", 3)
    validate_gather_ordered(src, dst, plan_src, plan_dst, order, total,
                            device=device)
    _ops().gather_ordered(src, dst, plan_src, plan_dst, order, total)


def gather_compact(src: torch.Tensor, dst: torch.Tensor,
                   plan_src: torch.Tensor, plan_dst: torch.Tensor,
                   plan_count: torch.Tensor) -> None:
    """K2: copy K1's miss plan from ``src`` rows into ``dst`` (hot view).

    ``src`` is the layer's host view [host_rows, W] (pinned, device-mapped)
    or a device array; ``dst`` the layer's [N_gpu, B, W] view of the slab.
    Followers replay the leader's plan with their own views.
    """
    device = _require_cuda(dst, "dst")
    src = as_byte_rows(src, "src", 2)
    dst = as_byte_rows(dst, "dst", 3)
    validate_gather_compact(src, dst, plan_src, plan_dst, plan_count,
                            device=device)
    _ops().gather_compact(src, dst, plan_src, plan_dst, plan_count)


def gather_plan(src: torch.Tensor, dst: torch.Tensor,
                src_rows: torch.Tensor, dst_rows: torch.Tensor,
                mask: torch.Tensor, req_state: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None,
                attn_block_stride: int | None = None) -> None:
    """K3: per-entry gather where ``mask`` is set; optional hma row ids.

    ``attn_block_stride`` defaults to ``dst.shape[1]`` (strided addressing).
    """
    device = _require_cuda(dst, "dst")
    src = as_byte_rows(src, "src", 2)
    dst = as_byte_rows(dst, "dst", 3)
    stride = dst.shape[1] if attn_block_stride is None else attn_block_stride
    validate_gather_plan(src, dst, src_rows, dst_rows, mask, req_state,
                         out_rows, stride, device=device)
    _ops().gather_plan(src, dst, src_rows, dst_rows, mask, req_state,
                       out_rows, stride)


def invalidate_written_slots(dgi: torch.Tensor, req_state: torch.Tensor,
                             token_req: torch.Tensor,
                             written_g: torch.Tensor) -> None:
    """K4: drop hot entries whose host rows this forward rewrote (INV-41).
    ``dgi`` is one index group's [S, H] or every group's [G, S, H] (one
    launch for all: they share the tokens, slots and written rows)."""
    device = _require_cuda(dgi, "dgi")
    validate_invalidate(dgi, req_state, token_req, written_g, device=device)
    _ops().invalidate_written_slots(dgi, req_state, token_req, written_g)


def copy_descriptors(src_ptr: torch.Tensor, dst_ptr: torch.Tensor,
                     nbytes: torch.Tensor) -> None:
    """K5: one warp per (src, dst, nbytes) descriptor; device-usable
    addresses (host pointers must be device-mapped); destinations must not
    overlap."""
    device = _require_cuda(src_ptr, "src_ptr")
    validate_descriptors(src_ptr, dst_ptr, nbytes, device=device)
    _ops().copy_descriptors(src_ptr, dst_ptr, nbytes)


_SLOT_PTRS: dict[tuple[int, ...], torch.Tensor] = {}
"""(device, buffer addresses) -> the addresses as a device tensor."""


def mirror_slot_table(resident_slots: list[torch.Tensor]) -> torch.Tensor:
    """K5b's device table of the slot-mapping buffers' addresses, made on
    the first call for a set of buffers (the runner allocates them once).
    The worker makes it at startup when the forward launches K5b, whose
    first call may be under CUDA graph capture."""
    device = _require_cuda(resident_slots[0], "resident_slots[0]")
    key = (device.index or 0,) + tuple(t.data_ptr() for t in resident_slots)
    ptrs = _SLOT_PTRS.get(key)
    if ptrs is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "HiSparse: mirror_descriptors' first call for these slot-mapping "
                "buffers cannot run under CUDA graph capture (it copies their "
                "address table); make it first (mirror_slot_table)")
        # Deliberate: one small blocking copy per set of buffers, never on a
        # later step.
        ptrs = torch.tensor(key[1:], dtype=torch.int64, device=device)
        _SLOT_PTRS[key] = ptrs
    return ptrs


def mirror_descriptors(resident_slots: list[torch.Tensor],
                       source_slots: torch.Tensor, pair_of_layer: torch.Tensor,
                       src_base: torch.Tensor, dst_base: torch.Tensor,
                       src: torch.Tensor, dst: torch.Tensor,
                       nbytes: torch.Tensor, first: int, n: int,
                       block_size: int, bytes_per_block: int,
                       row_bytes: int) -> None:
    """K5b: the row mirror's K5 descriptors for tokens [first, first + n)
    of every mirrored layer, in one launch (reference.ref_mirror_descriptors
    states the semantics). ``resident_slots`` are the runner's persistent
    slot-mapping buffers, passed to the kernel by address."""
    _require_cuda(source_slots, "source_slots")
    ptrs = mirror_slot_table(resident_slots)
    slot_len = min(t.shape[0] for t in resident_slots)
    _ops().mirror_descriptors(ptrs, source_slots, pair_of_layer, src_base,
                              dst_base, src, dst, nbytes, first, n, slot_len,
                              block_size, bytes_per_block, row_bytes)


def new_hot_state(num_states: int, hot_size: int,
                  device: torch.device | str) -> tuple[torch.Tensor,
                                                       torch.Tensor]:
    """Fresh (dgi, lru): every slot empty, LRU order 0..H-1 (spec 4.8)."""
    dgi = torch.full((num_states, hot_size), -1, dtype=torch.int32,
                     device=device)
    lru = torch.arange(hot_size, dtype=torch.int16,
                       device=device).repeat(num_states, 1)
    return dgi, lru


# ---------------------------------------------------------------------------
# The runtime's per-step launches (docs/worker.md K46)
# ---------------------------------------------------------------------------

class StepOps:
    """The ops as the runtime launches them every step: straight to the
    extension's registered ops, without this module's Python checks.

    Each op's C++ entry point checks the same preconditions (torch_glue.h
    ``check_cuda``/``check_size``/``check_plan``, the resolver's
    shared-memory and INV-14 bounds, the byte views) and raises with the
    argument's name, so nothing goes unchecked; the Python checks cost
    ~30 us per resolver call and ~8 us per gather on the host, paid for
    every sparse layer of every eager (mixed) step. The public launchers
    above keep them for direct callers. Signatures are the launchers',
    the runtime's ``KernelOps``."""

    def __init__(self, namespace=None) -> None:
        ns = _ops() if namespace is None else namespace
        # OpOverloads bound once: no attribute lookup or overload
        # resolution per launch.
        self._resolve = ns.resolve_residency.default
        self._gather_compact = ns.gather_compact.default
        self._order_plan = ns.order_plan.default
        self._order_step = ns.order_step.default
        self._gather_ordered = ns.gather_ordered.default
        self._gather_plan = ns.gather_plan.default
        self._invalidate = ns.invalidate_written_slots.default
        self._copy_descriptors = ns.copy_descriptors.default

    def resolve_residency(self, topk, row_req, seq_lens, req_state, src_bt,
                          res_bt, hot_bt, dgi, lru, host_rows, block_size,
                          attn_block_stride, max_query_len, out_rows,
                          valid_counts, plan_src, plan_dst, plan_count,
                          miss_mask=None, resolved_g=None, stats=None, *,
                          num_gpu_blocks):
        self._resolve(topk, row_req, seq_lens, req_state, src_bt, res_bt,
                      hot_bt, dgi, lru, host_rows, num_gpu_blocks, block_size,
                      attn_block_stride, max_query_len, out_rows,
                      valid_counts, plan_src, plan_dst, plan_count, miss_mask,
                      resolved_g, stats)

    def gather_compact(self, src, dst, plan_src, plan_dst, plan_count):
        self._gather_compact(src, dst, plan_src, plan_dst, plan_count)

    def order_plan(self, plan_src, plan_dst, plan_count):
        self._order_plan(plan_src, plan_dst, plan_count)

    def order_step(self, plan_src, plan_count, host_rows, keys, cells,
                   sorted_keys, sorted_cells, total, temp):
        self._order_step(plan_src, plan_count, host_rows, keys, cells,
                         sorted_keys, sorted_cells, total, temp)

    def gather_ordered(self, src, dst, plan_src, plan_dst, order, total):
        self._gather_ordered(src, dst, plan_src, plan_dst, order, total)

    def gather_plan(self, src, dst, src_rows, dst_rows, mask, req_state=None,
                    out_rows=None, attn_block_stride=None):
        stride = dst.shape[1] if attn_block_stride is None else attn_block_stride
        self._gather_plan(src, dst, src_rows, dst_rows, mask, req_state,
                          out_rows, stride)

    def invalidate_written_slots(self, dgi, req_state, token_req, written_g):
        self._invalidate(dgi, req_state, token_req, written_g)

    def copy_descriptors(self, src_ptr, dst_ptr, nbytes):
        self._copy_descriptors(src_ptr, dst_ptr, nbytes)

    # Startup-time or already light: the public launchers.
    order_step_temp_bytes = staticmethod(order_step_temp_bytes)
    mirror_descriptors = staticmethod(mirror_descriptors)
