# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of vllm.v1.hisparse.kernels: the shared-memory preflight (K-13,
5.1, 6.3 items 10-11), the missing-extension error (6.3 item 2) and the
argument checks (5.0 launch-time checks) run before every launch."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from hisparse_kernel_cases import FuzzSpec, ResolveFuzzer
from vllm.v1.hisparse import kernels

CPU = torch.device("cpu")


def test_k13_smem_formula_matches_spec_examples():
    """K-13, spec 5.1: K=2048 q=1 H=4096 -> 46,120 B (fits 48 KiB);
    K=2048 q=4 H=10,240 -> 170,536 B (needs the opt-in maximum)."""
    assert kernels.resolver_smem_bytes(2048, 1, 4096) == 46_120
    assert kernels.resolver_smem_bytes(2048, 4, 10_240) == 170_536
    # Hs rounds 1.5*Umax up to a multiple of 32; C covers max(H, Umax).
    assert kernels.resolver_smem_bytes(1, 1, 1) == 8 * 32 + 6 + 2 + 8 * 2 + 32


def test_preflight_rejects_oversized_resolver_with_spec_message():
    """6.3 item 11: the exact message, naming need, H, q x K and the limit."""
    need = kernels.resolver_smem_bytes(2048, 8, 32768)
    with pytest.raises(ValueError) as err:
        kernels.preflight_resolver(2048, 8, 32768, 232_448)
    assert str(err.value) == (
        f"HiSparse resolver needs {need} B of shared memory per block for "
        "device_buffer_size=32768 and 8×2048 union rows; the device allows "
        "232448 B. Lower device_buffer_size or num_speculative_tokens.")
    assert kernels.preflight_resolver(2048, 4, 10_240, 232_448) == 170_536


def test_hot_size_bounds():
    """6.3 item 10, 5.7: H >= q*K and H <= 32768 (int16 slot ids)."""
    with pytest.raises(ValueError, match=r"must be >= max_decode_query_len x "
                       r"index_topk = 8192"):
        kernels.check_hot_size(2048, 4, 8191)
    with pytest.raises(ValueError, match="exceeds the int16 slot limit 32768"):
        kernels.check_hot_size(2048, 1, 32769)
    kernels.check_hot_size(2048, 4, 8192)


def test_missing_op_message(monkeypatch):
    """6.3 item 2: the exact text, naming the first op that is missing."""
    monkeypatch.setattr(kernels, "_namespace_has",
                        lambda op: op != "gather_plan")
    kernels._load_errors.cache_clear()
    try:
        assert kernels.missing_op() == "gather_plan"
        with pytest.raises(kernels.HiSparseKernelsMissing) as err:
            kernels.require_ops()
        assert str(err.value) == (
            "HiSparse kernels are missing (gather_plan); install the "
            "hisparse_ops extension built for this torch.")
    finally:
        kernels._load_errors.cache_clear()


def test_missing_library_reports_where_it_looked(monkeypatch, tmp_path):
    """6.3 item 2: a bad HISPARSE_OPS_LIBRARY path is named in the cause."""
    monkeypatch.setattr(kernels, "_namespace_has", lambda op: False)
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(tmp_path / "nope.so"))
    kernels._load_errors.cache_clear()
    try:
        with pytest.raises(kernels.HiSparseKernelsMissing) as err:
            kernels.require_ops()
        assert "resolve_residency" in str(err.value)
        assert "nope.so" in str(err.value.__cause__)
    finally:
        kernels._load_errors.cache_clear()


def _resolve_kwargs(**override):
    case = ResolveFuzzer(FuzzSpec(top_k=8, hot_size=16, block_size=4,
                                  max_query_len=2, seed=3)).step()
    kw = dict(zip(
        ("topk", "row_req", "seq_lens", "req_state", "src_bt", "res_bt",
         "hot_bt", "dgi", "lru", "host_rows", "block_size",
         "attn_block_stride", "max_query_len", "out_rows", "valid_counts",
         "plan_src", "plan_dst", "plan_count", "miss_mask", "resolved_g",
         "stats"), case.args()))
    kw.update(case.kwargs())
    kw.update(override)
    return kw


def test_valid_arguments_pass():
    kernels.validate_resolve_args(**_resolve_kwargs(), device=CPU)


@pytest.mark.parametrize("name, bad, message", [
    ("lru", lambda kw: kw["lru"].to(torch.int32), "lru must be torch.int16"),
    ("topk", lambda kw: kw["topk"].t(), "topk must be contiguous"),
    ("plan_src", lambda kw: kw["plan_src"][:, :3].contiguous(),
     r"plan_src.shape\[1\] must equal topk.shape\[1\] = 8"),
    ("row_req", lambda kw: kw["row_req"][:2],
     r"row_req.shape\[0\] must equal topk.shape\[0\]"),
    ("res_bt", lambda kw: kw["res_bt"][:1],
     r"res_bt.shape\[0\] must equal seq_lens.shape\[0\]"),
    ("hot_bt", lambda kw: kw["hot_bt"][:, :3].contiguous(),
     r"hot_bt.shape\[1\] must be >= cdiv\(device_buffer_size, block_size\) "
     r"= 4"),
    ("dgi", lambda kw: kw["dgi"][:, :15].contiguous(),
     r"lru.shape\[1\] must equal dgi.shape\[1\]"),
    ("stats", lambda kw: torch.zeros(5, dtype=torch.uint64),
     "stats must hold 2 to 4 uint64 counters"),
    ("miss_mask", lambda kw: kw["miss_mask"].to(torch.int64),
     "miss_mask must be torch.int32"),
    ("attn_block_stride", lambda kw: 3, "attn_block_stride=3 must be >= "
     "block_size=4"),
    ("host_rows", lambda kw: 2**31, r"host_rows=2147483648 must be in \[0, "
     r"2\^31\)"),
    ("max_query_len", lambda kw: 3, "device_buffer_size=16 must be >= "
     "max_decode_query_len x index_topk = 24"),
    ("num_gpu_blocks", lambda kw: 0, "num_gpu_blocks=0 must be >= 1"),
    ("num_gpu_blocks", lambda kw: 2**31 // 12 + 1,
     (r"num_gpu_blocks=178956971 x max\(attn_block_stride, block_size\)=12 "
      r"= 2147483652 must be < 2\^31 \(INV-14\)")),
])
def test_resolve_arguments_named_in_errors(name, bad, message):
    """5.0 launch-time checks: dtype, contiguity, shape relations, hot table
    width, H >= q*K, Sa >= B, INV-14 host row range, counters; the message
    names the argument."""
    kw = _resolve_kwargs()
    kw[name] = bad(kw)
    with pytest.raises(ValueError, match=message):
        kernels.validate_resolve_args(**kw, device=CPU)


def test_num_gpu_blocks_is_required_keyword_and_bounded():
    """F18: the launcher takes N_gpu keyword-only (no positional slot, no
    default); the largest N_gpu with N_gpu * max(Sa, B) < 2^31 passes."""
    kw = _resolve_kwargs()
    assert kw["attn_block_stride"] == 12  # FuzzSpec default 3 * B
    n = kw.pop("num_gpu_blocks")
    assert n >= 1
    with pytest.raises(TypeError, match="num_gpu_blocks"):
        kernels.validate_resolve_args(**kw, device=CPU)
    with pytest.raises(TypeError, match="num_gpu_blocks"):
        kernels.resolve_residency(*kw.values())
    kernels.validate_resolve_args(**kw, num_gpu_blocks=2**31 // 12,
                                  device=CPU)
    with pytest.raises(TypeError, match="num_gpu_blocks must be an int"):
        kernels.validate_resolve_args(**kw, num_gpu_blocks=64.0, device=CPU)


def test_launchers_require_cuda_tensors():
    with pytest.raises(ValueError, match="topk must be a CUDA tensor"):
        kernels.resolve_residency(**_resolve_kwargs())
    with pytest.raises(ValueError, match="dst must be a CUDA tensor"):
        kernels.gather_compact(torch.zeros(4, 16, dtype=torch.uint8),
                               torch.zeros(1, 4, 16, dtype=torch.uint8),
                               torch.zeros(1, 2, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32))


def test_byte_views():
    """5.0: rows are W-byte multiples of 16; src and dst agree on W; any
    dtype with contiguous rows is viewed as bytes."""
    src = torch.zeros(4, 32, dtype=torch.uint8)
    kernels.validate_byte_views(src, torch.zeros(2, 4, 32, dtype=torch.uint8),
                                device=CPU)
    with pytest.raises(ValueError, match=r"src.shape\[1\] must equal "
                       r"dst.shape\[2\] \(W\) = 48"):
        kernels.validate_byte_views(src, torch.zeros(2, 4, 48,
                                                     dtype=torch.uint8),
                                    device=CPU)
    with pytest.raises(ValueError, match="W=40 bytes must be a multiple of "
                       "16"):
        kernels.validate_byte_views(torch.zeros(4, 40, dtype=torch.uint8),
                                    torch.zeros(2, 4, 40, dtype=torch.uint8),
                                    device=CPU)
    bf16 = torch.zeros(3, 4, 576, dtype=torch.bfloat16)[:, :, :576]
    assert kernels.as_byte_rows(bf16, "dst", 3).shape == (3, 4, 1152)
    with pytest.raises(ValueError, match="dst rows must be contiguous"):
        kernels.as_byte_rows(torch.zeros(3, 8, 4)[:, :, ::2], "dst", 3)


def test_plan_and_descriptor_checks():
    i32 = torch.int32
    src = torch.zeros(4, 16, dtype=torch.uint8)
    dst = torch.zeros(2, 4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"plan_count.shape\[0\] must equal "
                       r"plan_src.shape\[0\] = 2"):
        kernels.validate_gather_compact(
            src, dst, torch.zeros(2, 3, dtype=i32),
            torch.zeros(2, 3, dtype=i32), torch.zeros(3, dtype=i32),
            device=CPU)
    with pytest.raises(ValueError, match=r"req_state.shape\[0\] must be >= "
                       r"src_rows.shape\[0\] = 2"):
        kernels.validate_gather_plan(
            src, dst, torch.zeros(2, 3, dtype=i32),
            torch.zeros(2, 3, dtype=i32), torch.zeros(2, 3, dtype=i32),
            torch.zeros(1, dtype=i32), None, 4, device=CPU)
    with pytest.raises(ValueError, match="written_g must be torch.int64"):
        kernels.validate_invalidate(
            torch.zeros(2, 8, dtype=i32), torch.zeros(2, dtype=i32),
            torch.zeros(3, dtype=i32), torch.zeros(3, dtype=i32), device=CPU)
    # K4 takes one group's [S, H] or every group's [G, S, H], nothing else
    for dgi in (torch.zeros(2, 8, dtype=i32), torch.zeros(3, 2, 8, dtype=i32)):
        kernels.validate_invalidate(
            dgi, torch.zeros(2, dtype=i32), torch.zeros(3, dtype=i32),
            torch.zeros(3, dtype=torch.int64), device=CPU)
    with pytest.raises(ValueError, match=r"dgi must have 2 dimension\(s\)"):
        kernels.validate_invalidate(
            torch.zeros(2, 2, 2, 8, dtype=i32), torch.zeros(2, dtype=i32),
            torch.zeros(3, dtype=i32), torch.zeros(3, dtype=torch.int64), device=CPU)
    with pytest.raises(ValueError, match=r"nbytes.shape\[0\] must equal "
                       r"src_ptr.shape\[0\] = 3"):
        kernels.validate_descriptors(
            torch.zeros(3, dtype=torch.int64), torch.zeros(3,
                                                           dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64), device=CPU)


def test_k7_argument_checks():
    """P9, 5.0 launch-time checks for K7: the flat buffers hold exactly the
    plan's cells, total is one int32, the scratch is uint8, cell ids and
    host rows fit int32 (INV-14); messages name the argument."""
    i32 = torch.int32
    plan = torch.zeros(3, 4, dtype=i32)
    flat = {n: torch.zeros(12, dtype=i32)
            for n in ("keys", "cells", "sorted_keys", "sorted_cells")}
    ok = dict(plan_src=plan, plan_count=torch.zeros(3, dtype=i32),
              host_rows=100, **flat, total=torch.zeros(1, dtype=i32),
              temp=torch.zeros(8, dtype=torch.uint8), device=CPU)
    assert kernels.validate_order_step(**ok) == 12
    for name, bad, message in (
            ("sorted_cells", torch.zeros(11, dtype=i32),
             r"sorted_cells.shape\[0\] must equal plan_src.numel\(\) = 12"),
            ("total", torch.zeros(2, dtype=i32), r"total.shape\[0\] must equal"),
            ("temp", torch.zeros(8, dtype=i32), "temp must be torch.uint8"),
            ("plan_count", torch.zeros(2, dtype=i32),
             r"plan_count.shape\[0\] must equal plan_src.shape\[0\] = 3"),
            ("host_rows", 2**31, r"host_rows=2147483648 must be in \[0, 2\^31\)")):
        with pytest.raises(ValueError, match=message):
            kernels.validate_order_step(**{**ok, name: bad})
    with pytest.raises(ValueError, match="int32 ids"):
        kernels.check_order_step_size(2**31, 100)
    src = torch.zeros(4, 16, dtype=torch.uint8)
    dst = torch.zeros(2, 4, 16, dtype=torch.uint8)
    kernels.validate_gather_ordered(src, dst, plan, plan, flat["cells"],
                                    ok["total"], device=CPU)
    with pytest.raises(ValueError, match=r"order.shape\[0\] must equal "
                       r"plan_src.numel\(\) = 12"):
        kernels.validate_gather_ordered(src, dst, plan, plan,
                                        torch.zeros(3, dtype=i32),
                                        ok["total"], device=CPU)
    with pytest.raises(ValueError, match="dst must be a CUDA tensor"):
        kernels.gather_ordered(src, dst, plan, plan, flat["cells"],
                               ok["total"])
    with pytest.raises(ValueError, match="plan_src must be a CUDA tensor"):
        kernels.order_step(plan, ok["plan_count"], 100, *flat.values(),
                           ok["total"], ok["temp"])


def test_new_hot_state_is_empty_and_ordered():
    """4.8 step 1 format: dgi all -1, every lru row 0..H-1 as int16."""
    dgi, lru = kernels.new_hot_state(3, 32768, CPU)
    assert dgi.dtype == torch.int32 and bool((dgi == -1).all())
    assert lru.dtype == torch.int16 and lru.shape == (3, 32768)
    assert torch.equal(lru[2].to(torch.int64), torch.arange(32768))


# --------------------------------------------------------------------------
# K46: the runtime's per-step launches go straight to the registered ops
# --------------------------------------------------------------------------

BINDINGS = (Path(__file__).resolve().parents[3] / "overlay" / "csrc" / "hisparse"
            / "bindings.cpp")
STEP_OPS = ("resolve_residency", "gather_compact", "order_plan", "order_step",
            "gather_ordered", "gather_plan", "invalidate_written_slots",
            "copy_descriptors")


def _schemas() -> dict[str, list[str]]:
    """Op name -> its argument names, from the extension's registration."""
    out = {}
    for block in re.findall(r"m\.def\((.*?)\);", BINDINGS.read_text(), re.S):
        schema = "".join(re.findall(r'"([^"]*)"', block))
        name, _, rest = schema.partition("(")
        args = rest.rpartition(") ->")[0]
        out[name] = [a.split("=")[0].split()[-1] for a in args.split(",")]
    return out


class _Recorder:
    """A stand-in for torch.ops.hisparse_ops: each op's .default records
    the positional arguments it is called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        recorder = self

        class _Op:
            def __init__(self, name: str) -> None:
                self.default = lambda *args: recorder.calls.append((name, args))

        for name in STEP_OPS:
            setattr(self, name, _Op(name))


@pytest.mark.parametrize("op", STEP_OPS)
def test_k46_step_ops_pass_every_argument_in_schema_order(op):
    """docs/worker.md K46 (P2): StepOps skips the Python checks and calls
    the registered op, whose C++ entry point checks the arguments; each
    argument must land in its schema position (resolve_residency's
    num_gpu_blocks sits mid-schema, gather_plan's stride is last)."""
    schema = _schemas()[op]
    ns = _Recorder()
    step_ops = kernels.StepOps(ns)
    params = inspect.signature(getattr(step_ops, op)).parameters
    assert sorted(params) == sorted(schema), (op, list(params), schema)
    sentinels = {name: f"<{name}>" for name in params}
    getattr(step_ops, op)(**sentinels)
    assert ns.calls == [(op, tuple(sentinels[name] for name in schema))]


def test_k46_gather_plan_stride_defaults_to_the_block_size():
    """The launcher's default (strided addressing): dst.shape[1]."""
    ns = _Recorder()
    dst = torch.zeros(3, 16, 32, dtype=torch.uint8)
    kernels.StepOps(ns).gather_plan("src", dst, "rows", "dst_rows", "mask")
    assert ns.calls[0][1][-1] == 16


def test_k46_step_ops_cover_every_launch_the_runtime_makes():
    """Every KernelOps member the runtime calls exists on StepOps with the
    launcher's parameters (the CPU rigs use the references, so a missing
    or misnamed one would first fail on the GPU)."""
    from vllm.v1.hisparse.runtime import KernelOps

    for name in KernelOps.__annotations__:
        mine = getattr(kernels.StepOps, name)
        public = getattr(kernels, name)
        assert list(inspect.signature(mine).parameters)[-len(
            inspect.signature(public).parameters):] == list(
                inspect.signature(public).parameters), name
