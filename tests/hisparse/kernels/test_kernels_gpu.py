# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests (spec 8.2, target T2): every kernel output, the final dgi/lru
and the counters equal the CPU reference bit for bit on fuzzed inputs.

They skip cleanly without CUDA or without the built extension (conftest's
``gpu_kernels`` fixture). ``HISPARSE_K14_STEPS`` raises the multi-step fuzz
(default 300 steps; the spec's full run is 10,000)."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from hisparse_kernel_cases import (
    FuzzSpec,
    ResolveCase,
    ResolveFuzzer,
    assert_same_case,
    assert_same_tensor,
    f18_cases,
    random_plan,
    random_rows,
    run_kernel,
    run_reference,
)
from vllm.v1.hisparse import reference

CUDA = "cuda"
I32 = torch.int32
TOPKS = [1, 31, 32, 33, 63, 64, 65, 128, 2048]


def resolve_and_compare(kernels, fuzz: ResolveFuzzer, steps: int,
                        overlap: float = 0.7, label: str = "") -> None:
    """Each step: same inputs and state to both sides; compare everything;
    continue from the (identical) resulting state."""
    for step in range(steps):
        case = fuzz.step(overlap)
        want = run_reference(case.to("cpu"))
        got = run_kernel(kernels, case.to(CUDA))
        assert_same_case(got, want, label=f"{label}step {step}: ")
        fuzz.adopt_state(want)


def hot_layout(top_k: int, mult: int) -> tuple[int, int]:
    """(H, q) for H = mult x top_k: 1x is the tight q = 1 case, 2x a tight
    two-row union, 5x the MTP3 default ((q + 1) x K with q = 4)."""
    return mult * top_k, {1: 1, 2: 2, 5: 4}[mult]


@pytest.mark.parametrize("mult", [1, 2, 5])
@pytest.mark.parametrize("top_k", TOPKS)
def test_resolve_fuzz_matches_reference(gpu_kernels, top_k, mult):
    """T2, K-1..K-5, K-9, INV-33..38: fuzzed batches with padding rows, -1
    and stale positions, null pages, resident pages, duplicated positions
    and (for H > K) MTP union groups, over warm steps."""
    hot, q = hot_layout(top_k, mult)
    block = 64 if top_k >= 128 else 16
    fuzz = ResolveFuzzer(FuzzSpec(top_k=top_k, hot_size=hot,
                                  block_size=block, max_query_len=q,
                                  num_reqs=5, num_states=7, seed=top_k + mult,
                                  attn_block_stride=block * (mult + 1)))
    resolve_and_compare(gpu_kernels, fuzz, steps=4)


@pytest.mark.parametrize("top_k", [1, 33, 64, 2048])
def test_resolve_corrupted_state(gpu_kernels, top_k):
    """K-4, INV-37: out-of-range LRU slots and garbage or duplicated dgi
    keys resolve exactly as the reference (tripwires), with no fault."""
    hot, q = hot_layout(top_k, 2)
    fuzz = ResolveFuzzer(FuzzSpec(top_k=top_k, hot_size=hot, block_size=16,
                                  max_query_len=q, corrupt=True,
                                  seed=100 + top_k))
    resolve_and_compare(gpu_kernels, fuzz, steps=4, overlap=0.8)
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", sorted(f18_cases()))
def test_resolve_f18_hand_cases(gpu_kernels, name):
    """F18 (test_kernel_reference.py has the hand-computed values): null
    hot table cold and warm, hot block N_gpu (N_gpu - 1 valid), negative hot
    block, hits on an invalid hot block, resident id N_gpu, huge resident
    ids (short-circuit): kernel == reference bit for bit, stats included."""
    case = f18_cases()[name]
    want = run_reference(case.to("cpu"))
    got = run_kernel(gpu_kernels, case.to(CUDA))
    assert_same_case(got, want, label=f"{name}: ")


@pytest.mark.parametrize("top_k", [1, 33, 64, 2048])
def test_resolve_corrupted_tables(gpu_kernels, top_k):
    """F18, INV-37: resident and hot block ids outside [1, N_gpu) (0, N_gpu,
    negative, int32 extremes, null hot tables) on top of corrupted dgi/lru
    state resolve exactly as the reference over warm steps."""
    hot, q = hot_layout(top_k, 2)
    fuzz = ResolveFuzzer(FuzzSpec(top_k=top_k, hot_size=hot, block_size=16,
                                  max_query_len=q, corrupt=True,
                                  corrupt_tables=True, resident_frac=0.3,
                                  seed=180 + top_k))
    resolve_and_compare(gpu_kernels, fuzz, steps=4, overlap=0.8)
    torch.cuda.synchronize()


@pytest.mark.parametrize("hot", [4096, 10240])
@pytest.mark.parametrize("batch", [1, 5, 17, 64, 256])
def test_k6_production_shapes_and_row_independence(gpu_kernels, batch, hot):
    """K-6: K = 2048, H = 2K and 5K (q = 4 unions), batches 1..256 equal the
    reference; a request's rows resolved alone give the same rows and
    state as in the batch (rows are independent)."""
    q = 1 if hot == 4096 else 4
    fuzz = ResolveFuzzer(FuzzSpec(top_k=2048, hot_size=hot, block_size=64,
                                  max_query_len=q, num_reqs=batch,
                                  num_states=batch + 3, groups_full=True,
                                  padding_rows=2, padding_reqs=0,
                                  resident_frac=0.1, seed=batch))
    resolve_and_compare(gpu_kernels, fuzz, steps=1)
    batch_case = fuzz.step(0.7)
    full = batch_case.to(CUDA)
    run_kernel(gpu_kernels, full)
    rows = batch_case.row_req.tolist()
    for req in random.Random(batch).sample(range(batch), min(3, batch)):
        sel = [i for i, r in enumerate(rows) if r == req]
        alone = ResolveCase(**{**batch_case.__dict__,
                               "topk": batch_case.topk[sel],
                               "row_req": batch_case.row_req[sel],
                               "out_rows": None}).to(CUDA)
        run_kernel(gpu_kernels, alone)
        st = int(batch_case.req_state[req])
        for name in ("out_rows", "valid_counts", "plan_src", "plan_dst",
                     "plan_count", "miss_mask", "resolved_g"):
            assert_same_tensor(name, getattr(alone, name),
                               getattr(full, name)[sel], f"req {req}: ")
        assert_same_tensor("dgi", alone.dgi[st], full.dgi[st])
        assert_same_tensor("lru", alone.lru[st], full.lru[st])


def test_resolve_is_deterministic(gpu_kernels):
    """INV-38: identical inputs and state give bit-identical results."""
    fuzz = ResolveFuzzer(FuzzSpec(top_k=2048, hot_size=10240, block_size=64,
                                  max_query_len=4, num_reqs=12, num_states=16,
                                  groups_full=True, corrupt=True, seed=9))
    case = fuzz.step()
    a, b = case.to(CUDA), case.to(CUDA)
    run_kernel(gpu_kernels, a)
    run_kernel(gpu_kernels, b)
    assert_same_case(a, b)


def test_k14_multistep_fuzz(gpu_kernels):
    """K-14: a long random multi-step fuzz (mixed resident tables, MTP
    groups, occasional corruption) stays bit-identical to the reference."""
    steps = int(os.environ.get("HISPARSE_K14_STEPS", "300"))
    rng = random.Random(14)
    done = 0
    while done < steps:
        top_k = rng.choice([1, 7, 32, 33, 100])
        q = rng.choice([1, 2, 4])
        fuzz = ResolveFuzzer(FuzzSpec(
            top_k=top_k, hot_size=top_k * q + rng.randint(0, 2 * top_k),
            block_size=rng.choice([1, 4, 16, 64]), max_query_len=q,
            num_reqs=rng.randint(1, 6), resident_frac=rng.random() * 0.6,
            corrupt=rng.random() < 0.2, seed=rng.randrange(10**6)))
        chunk = min(25, steps - done)
        resolve_and_compare(gpu_kernels, fuzz, steps=chunk,
                            overlap=rng.random(), label=f"after {done}: ")
        done += chunk


def test_k13_smem_preflight_equals_launcher(gpu_kernels):
    """K-13: the extension's layout and the preflight formula agree."""
    op = torch.ops.hisparse_ops.resolver_smem_bytes
    for top_k in (1, 31, 2048):
        for q in (1, 2, 4):
            for extra in (0, 5, top_k):
                hot = q * top_k + extra
                assert op(top_k, q, hot) == gpu_kernels.resolver_smem_bytes(
                    top_k, q, hot)


def test_oversized_resolver_fails_before_launch(gpu_kernels):
    """6.3 item 11: a layout over the device's shared memory is refused by
    the launcher with the spec message."""
    fuzz = ResolveFuzzer(FuzzSpec(top_k=4096, hot_size=32768, block_size=64,
                                  max_query_len=8, num_reqs=1, seed=1))
    case = fuzz.step().to(CUDA)
    with pytest.raises(ValueError, match="HiSparse resolver needs .* B of "
                       "shared memory per block"):
        run_kernel(gpu_kernels, case)


def test_extension_checks_arguments_itself(gpu_kernels):
    """Defence in depth: the C++ op names a bad argument even when called
    without the Python launcher."""
    case = ResolveFuzzer(FuzzSpec(top_k=8, hot_size=16, seed=2)).step()
    case = case.to(CUDA)
    bad = case.to(CUDA)
    bad.lru = bad.lru.to(I32)
    with pytest.raises(RuntimeError, match="lru must be int16"):
        torch.ops.hisparse_ops.resolve_residency(*bad.op_args())
    # F18 / INV-14: N_gpu >= 1 and N_gpu * max(Sa, B) < 2^31.
    stride = max(case.attn_block_stride, case.block_size)
    too_many = (r"num_gpu_blocks x max\(attn_block_stride, block_size\) "
                r"must be < 2\^31")
    for n, message in ((0, "num_gpu_blocks must be >= 1"),
                       (2**31 // stride + 1, too_many)):
        bad = dataclasses.replace(case, num_gpu_blocks=n)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.hisparse_ops.resolve_residency(*bad.op_args())


def test_k46_step_ops_equal_the_reference_and_the_launchers(gpu_kernels):
    """docs/worker.md K46: the runtime's StepOps (no Python checks) resolve
    fuzzed MTP union batches as the reference does, gather the bytes the
    checked launcher gathers, and still get the C++ op's named errors."""
    step_ops = gpu_kernels.StepOps()
    fuzz = ResolveFuzzer(FuzzSpec(top_k=64, hot_size=128, block_size=16,
                                  max_query_len=2, num_reqs=5, num_states=7,
                                  seed=46, attn_block_stride=32))
    resolve_and_compare(step_ops, fuzz, steps=3, label="StepOps ")
    case = fuzz.step()
    gpu = run_kernel(step_ops, case.to(CUDA))
    host = random_rows(case.host_rows, 656,
                       torch.Generator().manual_seed(46)).pin_memory()
    blocks = int(case.hot_bt.max()) + 2
    a = torch.zeros(blocks, 16, 656, dtype=torch.uint8, device=CUDA)
    b = a.clone()
    gpu_kernels.gather_compact(host, a, gpu.plan_src, gpu.plan_dst, gpu.plan_count)
    step_ops.gather_compact(host, b, gpu.plan_src, gpu.plan_dst, gpu.plan_count)
    torch.cuda.synchronize()
    assert int(gpu.plan_count.sum()) > 0
    assert_same_tensor("StepOps gather", b, a)
    bad = case.to(CUDA)
    bad.lru = bad.lru.to(I32)
    with pytest.raises(RuntimeError, match="lru must be int16"):
        run_kernel(step_ops, bad)
    with pytest.raises(RuntimeError, match="dst must be uint8"):
        step_ops.gather_compact(host, b.view(torch.int8), gpu.plan_src,
                                gpu.plan_dst, gpu.plan_count)


# ---------------------------------------------------------------------------
# CUDA graphs (K-12, INV-32)
# ---------------------------------------------------------------------------

def graph_inputs(seed: int):
    """Four resolver steps (K-12's shape), pinned host rows for a leader and
    a follower (its rows differ), and their zeroed hot buffers."""
    fuzz = ResolveFuzzer(FuzzSpec(top_k=2048, hot_size=10240, block_size=64,
                                  max_query_len=4, num_reqs=6,
                                  groups_full=True, seed=seed))
    steps = [fuzz.step(0.7) for _ in range(4)]
    W = 656
    blocks = int(max(s.hot_bt.max() for s in steps[:1])) + 8
    host = random_rows(steps[0].host_rows, W,
                       torch.Generator().manual_seed(seed)).pin_memory()
    host_f = (host.to(torch.int32) ^ 0x5A).to(torch.uint8).pin_memory()
    leader = torch.zeros(blocks, 64, W, dtype=torch.uint8, device=CUDA)
    return steps, host, host_f, leader, torch.zeros_like(leader)


def replay_matches_eager(steps, leader, follower, captured, eager, check=None):
    """``captured(case, lead, foll)`` captured once on step 0 (after a warm-up
    outside capture) and replayed over the later steps' top-k, copied into
    its static inputs, beside eager ``eager`` launches: after every replay
    the same case state (rows, plan, LRU, counters) and hot-buffer bytes.
    ``check(static_case)`` runs after each replay; returns the static case."""
    eager_case, static = steps[0].to(CUDA), steps[0].to(CUDA)
    e_lead, e_foll = leader.clone(), follower.clone()
    s_lead, s_foll = leader.clone(), follower.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside capture
        captured(static, s_lead, s_foll)
    torch.cuda.current_stream().wait_stream(stream)
    eager(eager_case, e_lead, e_foll)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured(static, s_lead, s_foll)
    for i, case in enumerate(steps[1:]):
        static.topk.copy_(case.topk.to(CUDA))
        eager_case.topk.copy_(case.topk.to(CUDA))
        graph.replay()
        eager(eager_case, e_lead, e_foll)
        torch.cuda.synchronize()
        assert_same_case(static, eager_case, label=f"replay {i}: ")
        assert_same_tensor("leader bytes", s_lead, e_lead)
        assert_same_tensor("follower bytes", s_foll, e_foll)
        if check is not None:
            check(static)
    return static


def test_k12_graph_capture_and_replay(gpu_kernels):
    """K-12, INV-32: resolve + leader gather + follower replay captured once
    and replayed over new top-k (copied into the static input) give the same
    bytes, rows, plan, state and counters as eager launches."""
    steps, host, host_f, leader, follower = graph_inputs(12)

    def launch(case, lead, foll):
        run_kernel(gpu_kernels, case)
        gpu_kernels.gather_compact(host, lead, case.plan_src, case.plan_dst,
                                   case.plan_count)
        gpu_kernels.gather_compact(host_f, foll, case.plan_src,
                                   case.plan_dst, case.plan_count)

    static = replay_matches_eager(steps, leader, follower, launch, launch)
    assert static.stat_values[1] > 0 and static.stat_values[0] > 0


# ---------------------------------------------------------------------------
# K2/K3 gathers (K-7, K-8, INV-39, INV-40)
# ---------------------------------------------------------------------------

def strided_slab(blocks: int, block: int, width: int, device, pad: int = 48,
                 shift: int = 0):
    """(backing, view): [blocks, block, W] with block stride > block*W and
    the view starting ``shift`` bytes into the backing (alignment tests)."""
    stride = block * width + pad
    backing = torch.randint(0, 256, (blocks * stride + shift + 64,),
                            dtype=torch.uint8, device=device)
    view = backing[shift:shift + blocks * stride].view(blocks, stride)
    return backing, view[:, :block * width].view(blocks, block, width)


@pytest.mark.parametrize("width, shift", [(656, 0), (16, 0), (1152, 0),
                                          (656, 4), (656, 1)])
@pytest.mark.parametrize("src_kind", ["pinned", "device", "registered"])
def test_k7_gather_compact_matches_reference(gpu_kernels, width, shift,
                                             src_kind):
    """K-7, INV-39: byte-exact copies, zero-fill for g >= source rows, skips
    for negative ids and destinations past N*B, count clamp (negative, 0,
    mid, K, > K); 16/4/1-byte paths (dst shifted by 0/4/1 bytes); sources in
    pinned, cudaHostRegister-ed or device memory."""
    gen = torch.Generator().manual_seed(width + shift)
    src_rows, rows, top_k = 300, 6, 40
    host = random_rows(src_rows, width, gen)
    keep_alive = None
    if src_kind == "pinned":
        src = host.pin_memory()
    elif src_kind == "device":
        src = host.to(CUDA)
    else:
        src = host.clone()
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(src.data_ptr(), src.numel(), 2)  # Mapped
        assert int(err) == 0, f"cudaHostRegister failed: {err}"
        keep_alive = src
    try:
        backing, dst = strided_slab(10, 32, width, CUDA, shift=shift)
        ps, pd, pc = random_plan(rows, top_k, src_rows, 320, gen)
        want_backing = backing.cpu()
        want = want_backing[shift:shift + dst.shape[0] * (32 * width + 48)]
        want = want.view(10, -1)[:, :32 * width].view(10, 32, width)
        reference.ref_gather_compact(host, want, ps, pd, pc)
        gpu_kernels.gather_compact(src, dst, ps.to(CUDA), pd.to(CUDA),
                                   pc.to(CUDA))
        torch.cuda.synchronize()
        assert_same_tensor("slab", backing, want_backing)
    finally:
        if keep_alive is not None:
            torch.cuda.cudart().cudaHostUnregister(keep_alive.data_ptr())


def test_gather_rejects_unpinned_host_source(gpu_kernels):
    """5.0: a host view must be pinned and device-mapped (CUDA pointer
    attributes), or the launch fails with a message naming it."""
    dst = torch.zeros(2, 4, 16, dtype=torch.uint8, device=CUDA)
    plan = torch.zeros(1, 1, dtype=I32, device=CUDA)
    with pytest.raises(RuntimeError, match="src is a CPU tensor that is not "
                       "pinned"):
        gpu_kernels.gather_compact(torch.zeros(4, 16, dtype=torch.uint8),
                                   dst, plan, plan,
                                   torch.ones(1, dtype=I32, device=CUDA))


@pytest.mark.parametrize("use_state, use_out", [(True, True), (False, True),
                                                (True, False)])
def test_gather_plan_matches_reference(gpu_kernels, use_state, use_out):
    """K-7, spec 5.3: per-entry copies where mask is set, padding rows,
    out_rows = hma(d) or -1, zero-fill and skip rules, strided dst."""
    gen = torch.Generator().manual_seed(31)
    width, rows, cols, src_rows = 656, 9, 70, 500
    host = random_rows(src_rows, width, gen)
    backing, dst = strided_slab(24, 32, width, CUDA)
    sr, dr, _ = random_plan(rows, cols, src_rows, 24 * 32, gen)
    mask = (torch.rand(rows, cols, generator=gen) < 0.7).to(I32)
    state = torch.tensor([0, -1, 3, 2, -1, 0, 1, 1, 7], dtype=I32)
    out = torch.full((rows, cols), -9, dtype=I32)
    want_backing = backing.cpu()
    want = want_backing[:24 * (32 * width + 48)].view(24, -1)[:, :32 * width]
    want = want.view(24, 32, width)
    reference.ref_gather_plan(host, want, sr, dr, mask,
                              state if use_state else None,
                              out if use_out else None, 50)
    got_out = torch.full((rows, cols), -9, dtype=I32, device=CUDA)
    gpu_kernels.gather_plan(host.pin_memory(), dst, sr.to(CUDA), dr.to(CUDA),
                            mask.to(CUDA),
                            state.to(CUDA) if use_state else None,
                            got_out if use_out else None, 50)
    torch.cuda.synchronize()
    assert_same_tensor("slab", backing, want_backing)
    assert_same_tensor("out_rows", got_out, out)


@pytest.mark.parametrize("q", [1, 4])
def test_inv40_gather_plan_equals_gather_compact(gpu_kernels, q):
    """INV-40 on the GPU: K3 over K1's per-entry outputs writes the same
    bytes as K2 over K1's plan (leader resolve of a fuzzed batch)."""
    fuzz = ResolveFuzzer(FuzzSpec(top_k=2048, hot_size=2048 * (q + 1),
                                  block_size=64, max_query_len=q,
                                  num_reqs=8, corrupt=True, seed=40 + q))
    case = fuzz.step()
    gpu = run_kernel(gpu_kernels, case.to(CUDA))
    W = 656
    host = random_rows(case.host_rows, W,
                       torch.Generator().manual_seed(q)).pin_memory()
    blocks = int(case.hot_bt.max()) + 2
    a = torch.zeros(blocks, 64, W, dtype=torch.uint8, device=CUDA)
    b = a.clone()
    gpu_kernels.gather_compact(host, a, gpu.plan_src, gpu.plan_dst,
                               gpu.plan_count)
    x = gpu.out_rows.to(torch.int64)
    sa = case.attn_block_stride
    phys = torch.where(x >= 0, x // sa * 64 + x % sa, -1).to(I32)
    gpu_kernels.gather_plan(host, b, gpu.resolved_g, phys, gpu.miss_mask,
                            None, None, sa)
    torch.cuda.synchronize()
    assert int(gpu.plan_count.sum()) > 0
    assert_same_tensor("hot view", b, a)


def test_k8_64bit_byte_offsets(gpu_kernels):
    """K-8, F4, INV-14: source and destination byte offsets past 2^31 (and
    past 2^32) land on the right rows; the 32-bit-wrapped locations stay
    untouched."""
    W, B = 656, 64
    stride = 1 << 20  # 1 MiB per block: block 4100 starts past 2^32
    blocks = 4104
    slab = torch.zeros(blocks * stride, dtype=torch.uint8, device=CUDA)
    dst = slab.view(blocks, stride)[:, :B * W].view(blocks, B, W)
    src_rows = (1 << 32) // W + 64  # rows past 2^32 bytes of source
    src = torch.empty(src_rows * W, dtype=torch.uint8, device=CUDA)
    src.fill_(0)
    far_src = torch.tensor([src_rows - 1, src_rows - 7, (1 << 31) // W + 5],
                           dtype=torch.int64)
    patterns = torch.randint(1, 256, (3, W), dtype=torch.uint8)
    src_view = src.view(src_rows, W)
    src_view[far_src] = patterns.to(CUDA)
    far_dst = [4100 * B + 3, 2100 * B + 63, 4103 * B]
    plan_src = torch.tensor([far_src.tolist()], dtype=I32, device=CUDA)
    plan_dst = torch.tensor([far_dst], dtype=I32, device=CUDA)
    gpu_kernels.gather_compact(src_view, dst, plan_src, plan_dst,
                               torch.tensor([3], dtype=I32, device=CUDA))
    torch.cuda.synchronize()
    for i, d in enumerate(far_dst):
        assert torch.equal(dst[d // B, d % B].cpu(), patterns[i])
        wrapped = (d // B * stride + d % B * W) % (1 << 32)
        if wrapped < (1 << 31):
            assert int(slab[wrapped:wrapped + W].sum()) == 0
    assert int(slab.view(torch.int64).count_nonzero()) <= 3 * W
    del src, slab


# ---------------------------------------------------------------------------
# K4 invalidate (K-10, INV-41) and K5 copy_descriptors (K-11, INV-42)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("hot, shift", [(4096, 0), (4093, 0), (4096, 1),
                                        (31, 2)])
def test_k10_invalidate_matches_reference(gpu_kernels, hot, shift):
    """K-10, INV-41: vector (H % 4 == 0, 16-B aligned rows) and scalar paths
    (odd H, or a dgi view shifted by ``shift`` int32 elements) clear exactly
    the reference's entries; bad requests, slots and rows change nothing."""
    gen = torch.Generator().manual_seed(hot + shift)
    S, reqs, tokens = 9, 6, 700
    full = torch.randint(-1, 300, (S * hot + shift,), dtype=I32,
                         generator=gen)
    dgi = full[shift:].view(S, hot)
    req_state = torch.tensor([3, -1, 0, 8, 12, 5], dtype=I32)
    token_req = torch.randint(-2, reqs + 2, (tokens,), dtype=I32,
                              generator=gen)
    written = torch.randint(-3, 300, (tokens,), dtype=torch.int64,
                            generator=gen)
    written[:5] = 2**31 + 7
    got_full = full.to(CUDA)
    got = got_full[shift:].view(S, hot)
    reference.ref_invalidate(dgi, req_state, token_req, written)
    gpu_kernels.invalidate_written_slots(got, req_state.to(CUDA),
                                         token_req.to(CUDA),
                                         written.to(CUDA))
    assert_same_tensor("dgi", got_full, full)
    gpu_kernels.invalidate_written_slots(got, req_state.to(CUDA),
                                         token_req[:0].to(CUDA),
                                         written[:0].to(CUDA))
    assert_same_tensor("dgi (no tokens)", got_full, full)


def test_k10_invalidate_every_group_in_one_launch(gpu_kernels):
    """K-10, INV-41, P2: one K4 launch over the stacked [G, S, H] hot state
    (the runtime's) clears in each group what the reference clears per
    group, on the vector (H % 4 == 0) and scalar paths."""
    for hot in (512, 37):
        gen = torch.Generator().manual_seed(hot)
        G, S, reqs, tokens = 5, 9, 6, 300
        stacked = torch.randint(-1, 200, (G, S, hot), dtype=I32, generator=gen)
        req_state = torch.tensor([3, -1, 0, 8, 12, 5], dtype=I32)
        token_req = torch.randint(-2, reqs + 2, (tokens,), dtype=I32, generator=gen)
        written = torch.randint(-3, 200, (tokens,), dtype=torch.int64, generator=gen)
        got = stacked.to(CUDA)
        for group in stacked:
            reference.ref_invalidate(group, req_state, token_req, written)
        gpu_kernels.invalidate_written_slots(got, req_state.to(CUDA), token_req.to(CUDA),
                                             written.to(CUDA))
        assert_same_tensor(f"dgi [G, S, {hot}]", got, stacked)


def test_k11_copy_descriptors_equals_copy_engine(gpu_kernels):
    """K-11, INV-42: K5 and cudaMemcpy produce identical bytes for 656 B,
    4 KiB and 42 KB runs, odd sizes and misaligned addresses (16/4/1-byte
    paths), host-to-device, device-to-host and device-to-device."""
    gen = torch.Generator().manual_seed(11)
    n = 1 << 22
    host_src = torch.randint(0, 256, (n,), dtype=torch.uint8,
                             generator=gen).pin_memory()
    dev_src = torch.randint(0, 256, (n,), dtype=torch.uint8,
                            device=CUDA)
    sizes = [656, 4096, 41984, 37, 20, 1, 656, 8192, 3, 100000]
    shifts = [0, 0, 0, 1, 4, 3, 16, 0, 2, 5]
    directions = ["h2d", "d2d", "d2h", "h2d", "d2h", "d2d", "h2d", "d2h",
                  "h2d", "d2d"]
    dev_a = torch.zeros(n, dtype=torch.uint8, device=CUDA)
    dev_b = torch.zeros(n, dtype=torch.uint8, device=CUDA)
    host_a = torch.zeros(n, dtype=torch.uint8).pin_memory()
    host_b = torch.zeros(n, dtype=torch.uint8).pin_memory()
    src_ptr, dst_ptr, nbytes = [], [], []
    cursor = 0
    for size, shift, direction in zip(sizes, shifts, directions):
        so = cursor + shift
        do = cursor + (shift * 7) % 16
        s = host_src if direction == "h2d" else dev_src
        d_a = host_a if direction == "d2h" else dev_a
        d_b = host_b if direction == "d2h" else dev_b
        src_ptr.append(s.data_ptr() + so)
        dst_ptr.append(d_a.data_ptr() + do)
        nbytes.append(size)
        d_b[do:do + size].copy_(s[so:so + size])  # copy engine
        cursor += size + 64
    src_ptr.append(0)
    dst_ptr.append(dev_a.data_ptr())
    nbytes.append(64)  # null source: skipped
    torch.cuda.synchronize()
    as_dev = lambda v: torch.tensor(v, dtype=torch.int64, device=CUDA)
    gpu_kernels.copy_descriptors(as_dev(src_ptr), as_dev(dst_ptr),
                                 as_dev(nbytes))
    torch.cuda.synchronize()
    assert_same_tensor("device bytes", dev_a, dev_b)
    assert_same_tensor("host bytes", host_a, host_b)


@pytest.mark.parametrize("first, n", [(0, 96), (5, 40), (90, 6), (17, 0)])
def test_k5b_mirror_descriptors_match_reference(gpu_kernels, first, n):
    """K5b: the one-launch descriptor build equals the reference bit for bit
    (padding slots, both clamps, every layer's group), twice over the same
    buffers (the address table is cached)."""
    from hisparse_kernel_cases import mirror_case, mirror_case_to

    got = mirror_case_to(mirror_case(seed=0), CUDA)
    for seed in (first + n, first + n + 1):
        want = mirror_case(seed=seed)
        for name, value in want.items():  # new contents, the same buffers
            if isinstance(value, list):
                for t, w in zip(got[name], value):
                    t.copy_(w)
            elif isinstance(value, torch.Tensor):
                got[name].copy_(value)
        reference.ref_mirror_descriptors(**want, first=first, n=n)
        gpu_kernels.mirror_descriptors(**got, first=first, n=n)
        for name in ("src", "dst", "nbytes"):
            assert_same_tensor(name, got[name].cpu(), want[name])


def test_k5b_capture_after_the_first_call_only(gpu_kernels):
    """K5b under CUDA graph capture: the first call for a set of buffers
    (it uploads their address table) refuses capture with a clear error;
    after one eager call the launch is capturable and its replay equals
    the reference."""
    from hisparse_kernel_cases import mirror_case, mirror_case_to

    want = mirror_case(seed=21)
    got = mirror_case_to(want, CUDA)
    # The table cache is keyed by buffer addresses, which the caching
    # allocator reuses across tests (H200 run 18: an earlier test's entry
    # matched, so nothing was uploaded): start from "never seen".
    gpu_kernels._SLOT_PTRS.clear()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gpu_kernels.mirror_descriptors(**got, first=3, n=50)
    torch.cuda.synchronize()
    gpu_kernels.mirror_descriptors(**got, first=0, n=1)  # the eager first call
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu_kernels.mirror_descriptors(**got, first=3, n=50)
    graph.replay()
    torch.cuda.synchronize()
    reference.ref_mirror_descriptors(**want, first=0, n=1)
    reference.ref_mirror_descriptors(**want, first=3, n=50)
    for name in ("src", "dst", "nbytes"):
        assert_same_tensor(name, got[name].cpu(), want[name])


@pytest.mark.parametrize("top_k", [2, 40, 256, 2048])
def test_k6_order_plan_matches_reference(gpu_kernels, top_k):
    """P9 / INV-36: K6 equals the reference bit for bit: each row's first
    clamp(count, 0, K) cells sorted by source row with its destination,
    cells past the count untouched; counts negative, 0, 1, mid, K, > K;
    distinct sources per row as K1 plans them (tripped cells dst -1)."""
    gen = torch.Generator().manual_seed(top_k)
    rows, host_rows = 7, 1 << 20
    ps = torch.stack([torch.randperm(host_rows, generator=gen)[:top_k]
                      for _ in range(rows)]).to(I32)
    pd = torch.randint(-1, 5000, (rows, top_k), generator=gen, dtype=I32)
    pc = torch.tensor([-3, 0, 1, top_k // 2, top_k, top_k + 9, max(top_k - 1, 0)],
                      dtype=I32)
    want_s, want_d = ps.clone(), pd.clone()
    reference.ref_order_plan(want_s, want_d, pc)
    got_s, got_d = ps.to(CUDA), pd.to(CUDA)
    gpu_kernels.order_plan(got_s, got_d, pc.to(CUDA))
    torch.cuda.synchronize()
    assert_same_tensor("plan_src", got_s.cpu(), want_s)
    assert_same_tensor("plan_dst", got_d.cpu(), want_d)


def test_k6_order_plan_refuses_rows_past_its_capacity(gpu_kernels):
    """K6 sorts a row in one CTA's shared memory: rows of more than 2048
    cells are refused with a message, not launched."""
    plan = torch.zeros(1, 4096, dtype=I32, device=CUDA)
    with pytest.raises(ValueError, match="at most 2048"):
        gpu_kernels.order_plan(plan, plan.clone(), torch.ones(1, dtype=I32, device=CUDA))


# ---------------------------------------------------------------------------
# K7 order_step + gather_ordered (docs/kernels.md P9)
# ---------------------------------------------------------------------------

def k7_plan(rows: int, top_k: int, host_rows: int, gen: torch.Generator):
    """A plan with every count kind (negative, 0, 1, mid, K, > K), sources
    repeated across rows (equal keys: the stable order shows), negative and
    past-the-pool sources, tripped cells (dst -1)."""
    ps = torch.randint(0, host_rows, (rows, top_k), generator=gen, dtype=I32)
    ps[1::3, ::5] = ps[0, 0]
    ps[2::4, 1::7] = -1
    ps[3::5, 2::9] = min(host_rows + 3, 2**31 - 1)
    pd = torch.randperm(rows * top_k + 64, generator=gen)[:rows * top_k]
    pd = pd.to(I32).view(rows, top_k)
    pd[::6, 3::11] = -1
    kinds = [-3, 0, 1, top_k // 2, top_k, top_k + 9, max(top_k - 1, 0)]
    pc = torch.tensor([kinds[r % len(kinds)] for r in range(rows)], dtype=I32)
    return ps, pd, pc


def k7_buffers(cells: int, host_rows: int, kernels, device) -> dict:
    bufs = {name: torch.full((cells,), -777, dtype=I32, device=device)
            for name in ("keys", "cells", "sorted_keys", "sorted_cells")}
    bufs["total"] = torch.full((1,), -777, dtype=I32, device=device)
    temp = 1 if device == "cpu" else kernels.order_step_temp_bytes(
        cells, host_rows, torch.device(CUDA))
    bufs["temp"] = torch.empty(max(temp, 1), dtype=torch.uint8, device=device)
    return bufs


@pytest.mark.parametrize("rows, top_k, host_rows", [
    (7, 2, 1 << 20), (7, 40, 100), (9, 256, 1 << 20),
    (64, 2048, 26_197_440), (3, 2048, 2**31 - 1)])
def test_k7_order_step_matches_reference(gpu_kernels, rows, top_k, host_rows):
    """P9 / INV-36: K7 equals the reference bit for bit (keys, cell ids,
    the sorted list, the live total), through CUB's one-tile and
    multi-pass paths (7 to 131,072 cells; 7 to 31 key bits; 26,197,440
    rows is a 16 GiB pool of 656-B rows); the plan is not written."""
    gen = torch.Generator().manual_seed(rows * top_k)
    ps, pd, pc = k7_plan(rows, top_k, host_rows, gen)
    want = k7_buffers(rows * top_k, host_rows, gpu_kernels, "cpu")
    reference.ref_order_step(ps, pc, host_rows, **want)
    got = k7_buffers(rows * top_k, host_rows, gpu_kernels, CUDA)
    g_ps = ps.to(CUDA)
    gpu_kernels.order_step(g_ps, pc.to(CUDA), host_rows, **got)
    torch.cuda.synchronize()
    for name in ("keys", "cells", "sorted_keys", "sorted_cells", "total"):
        assert_same_tensor(name, got[name].cpu(), want[name])
    assert_same_tensor("plan_src", g_ps.cpu(), ps)


@pytest.mark.parametrize("width, src_kind", [(656, "pinned"), (656, "device"),
                                             (16, "pinned")])
def test_k7_gather_ordered_writes_what_k2_writes(gpu_kernels, width,
                                                 src_kind):
    """P9 / INV-36, INV-39: K7's gather over K7's list writes exactly the
    bytes K2 (reference) writes from K1's order: zero-fill past the pool,
    negative sources and dst -1 skipped, nothing else in the slab
    touched."""
    gen = torch.Generator().manual_seed(width)
    rows, top_k, host_rows = 12, 64, 5000
    ps, pd, pc = k7_plan(rows, top_k, host_rows, gen)
    host = random_rows(host_rows, width, gen)
    src = host.pin_memory() if src_kind == "pinned" else host.to(CUDA)
    blocks = (rows * top_k + 64) // 32 + 1
    backing, dst = strided_slab(blocks, 32, width, CUDA)
    want_backing = backing.cpu()
    want = want_backing[:blocks * (32 * width + 48)].view(blocks, -1)
    want = want[:, :32 * width].view(blocks, 32, width)
    reference.ref_gather_compact(host, want, ps, pd, pc)
    bufs = k7_buffers(rows * top_k, host_rows, gpu_kernels, CUDA)
    g_ps, g_pd = ps.to(CUDA), pd.to(CUDA)
    gpu_kernels.order_step(g_ps, pc.to(CUDA), host_rows, **bufs)
    gpu_kernels.gather_ordered(src, dst, g_ps, g_pd, bufs["sorted_cells"],
                               bufs["total"])
    torch.cuda.synchronize()
    assert_same_tensor("slab", backing, want_backing)


def test_k7_graph_capture_and_replay(gpu_kernels):
    """P9 / K-12, INV-32: resolve + K7 (keys, CUB sort) + the leader's and a
    follower's ordered gathers captured once and replayed over new top-k
    give the bytes, rows and plan of eager K2 launches (no allocation, no
    sync inside the step: the CUB scratch was sized once)."""
    steps, host, host_f, leader, follower = graph_inputs(7)
    cells = steps[0].plan_src.numel()
    bufs = k7_buffers(cells, steps[0].host_rows, gpu_kernels, CUDA)

    def ordered(case, lead, foll):
        run_kernel(gpu_kernels, case)
        gpu_kernels.order_step(case.plan_src, case.plan_count, case.host_rows,
                               **bufs)
        for src, view in ((host, lead), (host_f, foll)):
            gpu_kernels.gather_ordered(src, view, case.plan_src,
                                       case.plan_dst, bufs["sorted_cells"],
                                       bufs["total"])

    def compact(case, lead, foll):
        run_kernel(gpu_kernels, case)
        for src, view in ((host, lead), (host_f, foll)):
            gpu_kernels.gather_compact(src, view, case.plan_src,
                                       case.plan_dst, case.plan_count)

    def live_cells_counted(static):
        assert int(bufs["total"][0]) == int(
            static.plan_count.clamp(0, 2048).sum()) > 0

    replay_matches_eager(steps, leader, follower, ordered, compact,
                         check=live_cells_counted)


def test_k7_refuses_a_temp_smaller_than_its_query(gpu_kernels):
    """P9: a CUB scratch smaller than order_step_temp_bytes fails with a
    message naming the query, instead of sorting nothing."""
    ps = torch.zeros(64, 2048, dtype=I32, device=CUDA)
    pc = torch.full((64,), 2048, dtype=I32, device=CUDA)
    bufs = k7_buffers(64 * 2048, 1 << 24, gpu_kernels, CUDA)
    need = bufs["temp"].numel()
    assert need > 1
    bufs["temp"] = bufs["temp"][:1]
    with pytest.raises(RuntimeError, match="order_step_temp_bytes"):
        gpu_kernels.order_step(ps, pc, 1 << 24, **bufs)
