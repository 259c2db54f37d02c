# SPDX-License-Identifier: Apache-2.0
"""The worker data plane on the GPU (spec 8.3): the real kernels, streams,
events and a cudaHostRegister'ed pool, checked byte for byte against the
same steps on CPU (reference kernels). Skips without CUDA or the kernels."""

import numpy as np
import pytest
import torch
from test_worker import written_rows
from worker_harness import B, WorkerRig, attn_metadata, fill_pattern, tiny_config

from vllm.v1.hisparse.host_pool import HostPool


@pytest.fixture(scope="module")
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from vllm.v1.hisparse import kernels

    if kernels.missing_op() is not None:
        pytest.skip("hisparse_ops extension not available")
    return kernels


class CudaRig(WorkerRig):
    """WorkerRig on CUDA: GPU slab and tables, real ops (the runtime's
    StepOps, as bind_runtime gives it: docs/worker.md K46), real streams."""

    def __init__(self, kernels, *, freq: int = 1, eager: bool = True,
                 prefetch_followers: bool = False):
        config = tiny_config(freq=freq)
        super().__init__(config=config, eager=eager, device="cuda",
                         ops=kernels.StepOps(),
                         pool=HostPool(config.host_pool), page_copy=None,
                         prefetch_followers=prefetch_followers)

    def run(self, meta, num_decodes=0, num_decode_tokens=0, before_finish=None):
        self.batch.commit()
        md = attn_metadata(self.batch, num_decodes, num_decode_tokens, device="cuda")
        self.worker.start_step(meta, md)
        self.attend(md)
        self.worker.finish_forward()
        torch.cuda.synchronize()


def test_mirror_and_lazy_spill_on_cuda(kernels):
    """W-1/W-2/W-3 on the H200: K5 mirrors exactly the written rows; a lazy
    spill copies whole pages through the copy engines."""
    for eager in (True, False):
        rig = CudaRig(kernels, eager=eager)
        rig.place(0, resident=[3, 4], host=[5, 6])
        rig.batch.schedule(computed=[60], scheduled=[8])
        fill_pattern(rig.slab, 3)
        meta = rig.meta(**rig.spill(7, host_block=6, resident_block=4)) if not eager \
            else rig.meta()
        rig.run(meta)
        for name, lv in rig.rt.layers.items():
            for res, g in written_rows(rig, 0, range(60, 68), lv.pair):
                assert torch.equal(lv.host[g], rig.resident_row(name, res).cpu())
            if not eager:
                block = 50 * lv.pair + 4
                assert torch.equal(lv.host[6 * B:7 * B], lv.resident[block].cpu())
        assert (eager or 7 in rig.worker.take_acks().completed)
        rig.worker.shutdown()


def test_a_captured_decode_mirror_copies_each_replayed_step(kernels):
    """P2, INV-32 on the H200: the pure-decode mirror the last layer's
    attention launches (K5b + K5 on the compute stream) is captured by a
    FULL graph and copies, at each replay, the rows of the step replayed:
    nothing at capture, the new positions' rows after the slot mappings
    moved on, and nothing for a padding token (slot -1)."""
    rig = CudaRig(kernels)
    rig.place(0, resident=[3], host=[5])
    rig.place(1, resident=[7], host=[9])
    for lv in rig.rt.layers.values():
        lv.host.zero_()

    def step(computed, seed, run):
        rig.batch.schedule(computed=computed, scheduled=[1] * len(computed))
        fill_pattern(rig.slab, seed)
        md = attn_metadata(rig.batch, len(computed), len(computed), device="cuda")
        rig.worker.start_step(rig.meta(), md)
        out = run(md)
        rig.worker.finish_forward()
        torch.cuda.synchronize()
        return out

    def check(row, pos, mirrored):
        for name, lv in rig.rt.layers.items():
            (res, g), = written_rows(rig, row, [pos], lv.pair)
            want = rig.resident_row(name, res).cpu() if mirrored else \
                torch.zeros_like(lv.host[g])
            assert torch.equal(lv.host[g], want), (name, row, pos)

    graph = torch.cuda.CUDAGraph()

    def capture(md):
        with torch.cuda.graph(graph):
            rig.attend(md)

    step([10, 20], 1, capture)
    check(0, 10, False)  # captured, not run
    step([11, 21], 2, lambda md: graph.replay())
    check(0, 11, True)
    check(1, 21, True)
    check(0, 10, False)
    kept = {n: lv.host.clone() for n, lv in rig.rt.layers.items()}
    step([12], 3, lambda md: graph.replay())  # one real token, one pad (slot -1)
    check(0, 12, True)
    for name, lv in rig.rt.layers.items():  # row 1's rows: not copied again
        (res, g), = written_rows(rig, 1, [21], lv.pair)
        assert torch.equal(lv.host[g], kept[name][g])
        assert not torch.equal(lv.host[g], rig.resident_row(name, res).cpu())
    rig.worker.shutdown()


def test_steady_decode_steps_copy_their_inputs_once(kernels):
    """P2, F13 on the H200: the resolver's step inputs (row_req, req_state)
    reach the device in a copy only when they changed. A steady decode
    batch copies once and the device keeps them between steps; a dummy
    run's reset leaves padding there, and the next step copies again."""
    rig = CudaRig(kernels)
    rt = rig.rt
    rig.place(0, resident=[3], host=[5])
    rig.place(1, resident=[7], host=[9])
    s = rt.resident_only_slot

    def step(computed):
        rig.batch.schedule(computed=[computed] * 2, scheduled=[1, 1])
        rig.run(rig.meta(), num_decodes=2, num_decode_tokens=2)
        return (rt.step_inputs.copies, rt.row_req[:3].tolist(),
                rt.req_state[:3].tolist())

    first = step(10)
    assert first[1:] == ([0, 1, -1], [s, s, -1])
    assert step(11) == first and step(12) == first
    rt.before_dummy_run()
    torch.cuda.synchronize()
    assert (rt.row_req == -1).all() and (rt.req_state == -1).all()
    assert step(13) == (first[0] + 1,) + first[1:]
    rig.worker.shutdown()


def test_decode_rows_match_the_cpu_reference(kernels):
    """C7 on the H200 equals the same step on the CPU references: rows,
    plan, hot bytes, dgi/lru (T2 through the runtime)."""
    results = []
    for rig in (WorkerRig(freq=2), CudaRig(kernels, freq=2)):
        rt, layers = rig.rt, rig.layout.sparse_layers
        rig.place(0, resident=[0, 4], host=[5, 6], hot=[20, 21])
        for i, name in enumerate(layers):
            fill_pattern(rt.layers[name].host[5 * B:6 * B], seed=i)
        rig.batch.schedule(computed=[100], scheduled=[1])
        rig.batch.commit() if isinstance(rig, CudaRig) else None
        dev = "cuda" if isinstance(rig, CudaRig) else "cpu"
        md = attn_metadata(rig.batch, 1, 1, device=dev)
        rig.worker.start_step(rig.meta(hot_regions_allocated=np.array([20]), hot_region_requests=["r0"]), md)
        topk = torch.full((1, 64), -1, dtype=torch.int32, device=dev)
        topk[0, :5] = torch.tensor([2, 70, 9, 100, 33], dtype=torch.int32)
        out = []
        for name in layers[1:3]:
            rows, counts = rt.decode_rows(name, 1, topk, md.seq_lens, md.block_table)
            out += [rows.cpu().clone(), counts.cpu().clone()]
        rig.worker.finish_forward()
        group = rt.layers[layers[1]].group
        out += [group.dgi.cpu(), group.lru.cpu(),
                rt.layers[layers[2]].resident[70:72].cpu()]
        results.append(out)
    for cpu, gpu in zip(*results):
        assert torch.equal(cpu, gpu)


def _decode_every_layer_eager_and_replayed(kernels, prefetch: bool):
    """r0's page 0 host-only (misses in every group): each sparse layer's
    rows, counts, the slab and the groups' dgi/lru after the layers run in
    model order, eagerly and then as a replay of a CUDA graph captured from
    the same state (restored between)."""
    rig = CudaRig(kernels, freq=2, prefetch_followers=prefetch)
    rt, layers = rig.rt, rig.layout.sparse_layers
    rig.place(0, resident=[0, 4], host=[5, 6], hot=[20, 21])
    for i, name in enumerate(layers):
        fill_pattern(rt.layers[name].host[5 * B:6 * B], seed=i)
    rig.batch.schedule(computed=[100], scheduled=[1])
    rig.batch.commit()
    md = attn_metadata(rig.batch, 1, 1, device="cuda")
    rig.worker.start_step(rig.meta(hot_regions_allocated=np.array([20]),
                                   hot_region_requests=["r0"]), md)
    topk = torch.full((1, 64), -1, dtype=torch.int32, device="cuda")
    topk[0, :5] = torch.tensor([2, 70, 9, 100, 33], dtype=torch.int32)
    state = [rig.slab] + [t for g in rt.groups for t in (g.dgi, g.lru)]
    saved = [t.clone() for t in state]

    def forward():  # each layer's rows, copied before the next layer reuses them
        out = []
        for name in layers:
            rows, counts = rt.decode_rows(name, 1, topk, md.seq_lens, md.block_table)
            out += [rows.clone(), counts.clone()]
        return out

    def snapshot(out):
        torch.cuda.synchronize()
        return [t.cpu().clone() for t in out + state]

    eager = snapshot(forward())
    for t, v in zip(state, saved):
        t.copy_(v)
    rt.workspace.owner = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    for t, v in zip(state, saved):
        t.copy_(v)
    graph.replay()
    replayed = snapshot(captured)
    rig.worker.finish_forward()
    torch.cuda.synchronize()
    rig.worker.shutdown()
    return eager, replayed


def test_prefetched_followers_match_eager_and_captured(kernels):
    """Spec 2.10 step 2.3 on the H200 (prefetch_followers): with the
    followers' gathers on the copy stream, every layer's rows and counts,
    every slab byte and the LRU state equal the gathers on the compute
    stream, eagerly and in a captured graph (the fork and its joins)."""
    off_eager, off_graph = _decode_every_layer_eager_and_replayed(kernels, False)
    on_eager, on_graph = _decode_every_layer_eager_and_replayed(kernels, True)
    for results in (off_graph, on_eager, on_graph):
        for a, b in zip(off_eager, results):
            assert torch.equal(a, b)
