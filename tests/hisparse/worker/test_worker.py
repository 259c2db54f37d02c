# SPDX-License-Identifier: Apache-2.0
"""The worker data plane and runtime on CPU (spec 8.1 W-1..W-10).

The real ``HiSparseWorker``/``HiSparseRuntime`` run over a CPU slab and a real
host pool mapping, with the CPU reference kernels (spec 5.6) and the CPU
stream stand-in; every byte the mirror, the spills and the resolver move is
checked against what the "forward" wrote.
"""

import numpy as np
import pytest
import torch
from worker_harness import (
    B,
    ReferenceOps,
    WorkerRig,
    attn_metadata,
    fill_pattern,
    tiny_config,
)

from vllm.v1.hisparse.runtime import ExtendPlan


def written_rows(rig: WorkerRig, row: int, positions, pair: int):
    """(resident physical row, host row) of each position of batch row."""
    res = rig.batch.tables[rig.res_ids[pair]].numpy()[row]
    src = rig.batch.tables[rig.layout.SOURCE_GROUP_ID].numpy()[row]
    return [(int(res[p // B]) * B + p % B, int(src[p // B]) * B + p % B)
            for p in positions]


def fill_slab(rig: WorkerRig, seed: int = 0) -> None:
    fill_pattern(rig.slab, seed)


# ---------------------------------------------------------------- mirror


def test_mirror_copies_exactly_the_rows_written_this_step():
    """W-1/W-2, INV-25: every row the forward wrote (positions 60..67, across
    a page boundary) reaches its host row in every layer; no other host row
    is touched."""
    rig = WorkerRig()
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.batch.schedule(computed=[60], scheduled=[8])
    fill_slab(rig)
    rig.run(rig.meta())
    for name, lv in rig.rt.layers.items():
        pairs = written_rows(rig, 0, range(60, 68), lv.pair)
        for res, g in pairs:
            assert torch.equal(rig.host_row(name, g), rig.resident_row(name, res))
        touched = {g for _, g in pairs}
        host = lv.host.clone()
        host[sorted(touched)] = 0
        assert int(host.count_nonzero()) == 0, name


def test_a_decode_step_mirrors_every_group_in_one_launch():
    """4.10 / issue 16 item 1 (P2): a pure-decode step (every FULL-graph
    step) mirrors all resident groups in the forward, after the last target
    layer's attention: one copy_descriptors launch on the compute stream,
    no ready event, not one of each per group; the bytes are those of the
    per-group submissions. A prefill step still submits per group on the
    DMA stream as each group's last layer is written."""
    rig = WorkerRig()
    calls = []
    copy = rig.rt.ops.copy_descriptors

    class Counting(ReferenceOps):
        @staticmethod
        def copy_descriptors(src, dst, nbytes):
            calls.append(int(src.numel()))
            copy(src, dst, nbytes)

    rig.rt.ops = Counting
    rig.place(0, resident=[3], host=[5])
    rig.place(1, resident=[7], host=[9])
    rig.batch.schedule(computed=[10, 20], scheduled=[1, 1])
    fill_slab(rig)
    log = rig.worker.streams.log
    start = len(log)
    seen_at_finish = []
    finish = rig.worker.finish_forward
    rig.worker.finish_forward = lambda: (seen_at_finish.append(list(calls)), finish())
    rig.run(rig.meta(), num_decodes=2, num_decode_tokens=2)
    del rig.worker.finish_forward
    layers = len(rig.layout.sparse_layers)
    assert len(rig.res_ids) == 4 and calls == [2 * layers]
    assert seen_at_finish == [[2 * layers]]  # copied in the forward
    assert not [e for e in log[start:] if e[0] in ("enter", "wait")
                or (e[0] == "record" and e[1] == "forward_ready")]
    for name, lv in rig.rt.layers.items():
        for row, pos in ((0, 10), (1, 20)):
            (res, g), = written_rows(rig, row, [pos], lv.pair)
            assert torch.equal(rig.host_row(name, g), rig.resident_row(name, res))
    # Prefill: one submission per group, as each one's layers are written.
    calls.clear()
    rig.place(2, resident=[11, 12], host=[13, 14])
    rig.batch.schedule(computed=[11, 21, 0], scheduled=[1, 1, 70])
    md = attn_metadata(rig.batch, 2, 2)
    rig.worker.start_step(rig.meta(), md)
    for name in rig.worker.mirror.layer_order:
        rig.worker.on_kv_written(name)
    rig.worker.finish_forward()
    assert len(calls) == len(rig.res_ids)


def test_lazy_mode_mirrors_prefill_rows_only():
    """Spec 4.10 with eager_host_mirror=false: decode rows are not mirrored,
    prefill rows always are."""
    rig = WorkerRig(eager=False)
    rig.place(0, resident=[3], host=[5])
    rig.place(1, resident=[7, 8], host=[9, 10])
    rig.batch.schedule(computed=[10, 0], scheduled=[1, 70])
    fill_slab(rig)
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=1)
    name = rig.layout.sparse_layers[0]
    (res, g), = written_rows(rig, 0, [10], 0)
    assert int(rig.host_row(name, g).count_nonzero()) == 0
    for res, g in written_rows(rig, 1, range(70), 0):
        assert torch.equal(rig.host_row(name, g), rig.resident_row(name, res))


def test_padding_tokens_are_never_mirrored():
    """Slot -1 (padding) produces no copy (F13)."""
    rig = WorkerRig()
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[0], scheduled=[4])
    for slots in rig.batch.slots:
        slots[2:4] = -1
    fill_slab(rig)
    rig.run(rig.meta())
    name = rig.layout.sparse_layers[0]
    assert int(rig.host_row(name, 5 * B + 1).count_nonzero()) > 0
    assert int(rig.host_row(name, 5 * B + 2).count_nonzero()) == 0


# ----------------------------------------------------------------- spills


def test_eager_spill_is_a_completion_barrier_acked_with_its_step():
    """W-3, 4.3, F17: eager mode copies nothing for a spill; the ack names
    it enqueued and completed with the step after whose forward it was
    submitted, and repeats the completion until the scheduler retires it."""
    rig = WorkerRig()
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.batch.schedule(computed=[127], scheduled=[1])
    fill_slab(rig)
    before = rig.host_row(rig.layout.sparse_layers[0], 5 * B).clone()
    rig.run(rig.meta(**rig.spill(7, host_block=5, resident_block=3)),
            num_decodes=1, num_decode_tokens=1)
    assert torch.equal(rig.host_row(rig.layout.sparse_layers[0], 5 * B), before)
    ack = rig.worker.take_acks()
    assert ack.enqueued == {7: frozenset({0})}
    assert ack.completed == {7: frozenset({0})}
    assert ack.submitted_step == {7: 1}
    rig.batch.schedule(computed=[128], scheduled=[1])
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=1)
    again = rig.worker.take_acks()
    assert again.enqueued == {} and again.completed == {7: frozenset({0})}
    rig.run(rig.meta(retired_transfer_ids=np.array([7])), num_decodes=1,
            num_decode_tokens=1)
    assert 7 not in (rig.worker.take_acks() or type(again)()).completed


def test_lazy_spill_copies_the_whole_page_of_every_layer():
    """W-3 lazy mode: the page of every layer, resident block -> host block."""
    rig = WorkerRig(eager=False)
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.batch.schedule(computed=[127], scheduled=[1])
    fill_slab(rig)
    rig.run(rig.meta(**rig.spill(9, host_block=5, resident_block=3)),
            num_decodes=1, num_decode_tokens=1)
    for name, lv in rig.rt.layers.items():
        res_block = 50 * lv.pair + 3
        assert torch.equal(lv.host[5 * B:6 * B], lv.resident[res_block]), name
    assert 9 in rig.worker.take_acks().completed


def test_restore_copies_the_host_page_of_every_layer_before_the_forward():
    """W-14, 4.13 step 4: a restore copies the host page into the page's
    resident block of every layer in start_step (before the forward reads
    it), on the compute stream, and is acked with its step."""
    rig = WorkerRig()
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[64], scheduled=[1])
    for name, lv in rig.rt.layers.items():
        fill_pattern(lv.host[5 * B:6 * B], seed=len(name) + lv.pair)
    seen = {}

    def before_forward():
        for name, lv in rig.rt.layers.items():
            seen[name] = torch.equal(lv.resident[50 * lv.pair + 3], lv.host[5 * B:6 * B])

    rig.run(rig.meta(**rig.spill(4, host_block=5, resident_block=3, restore=True)),
            num_decodes=1, num_decode_tokens=1, before_finish=before_forward)
    assert seen and all(seen.values()), seen
    assert ("record", "restore", "compute") in rig.worker.streams.log
    ack = rig.worker.take_acks()
    assert ack.enqueued == {4: frozenset({0})} and ack.submitted_step == {4: 1}
    assert 4 in ack.completed


def test_zero_token_step_submits_transfers_and_replays_no_mirror():
    """W-8, INV-15: a step without a forward submits its transfers and acks
    them; it never re-runs the previous step's mirror descriptors."""
    rig = WorkerRig()
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[0], scheduled=[4])
    fill_slab(rig, seed=1)
    rig.run(rig.meta())
    name = rig.layout.sparse_layers[0]
    snapshot = rig.rt.layers[name].host.clone()
    fill_slab(rig, seed=2)  # resident bytes change; nothing may copy them
    rig.worker.start_step(rig.meta(**rig.spill(3, 5, 3)), None)
    rig.worker.finish_forward()
    assert torch.equal(rig.rt.layers[name].host, snapshot)
    ack = rig.worker.take_acks()
    assert ack.enqueued == {3: frozenset({0})} and 3 in ack.completed


# ------------------------------------------------------- events and order


def test_host_write_events_alternate_and_compute_waits_on_the_previous():
    """W-5, INV-27: each step start makes compute wait on the previous
    step's host-write event when that step wrote host memory from the DMA
    stream (a prefill's mirrors); the two events alternate. A step whose
    host writes all ran on the compute stream (a pure decode, mirrored in
    the forward) needs no wait: the next step's compute follows it, and
    with a private pool it records no event either (P2)."""
    rig = WorkerRig()
    rig.place(0, resident=[3], host=[5])
    log = rig.worker.streams.log
    kinds = []
    for scheduled, decodes in ((8, 0), (1, 1), (1, 1), (8, 0), (1, 1)):
        rig.batch.schedule(computed=[0], scheduled=[scheduled])
        start = len(log)
        rig.run(rig.meta(), num_decodes=decodes, num_decode_tokens=decodes)
        kinds.append([e for e in log[start:] if e[0] in ("wait", "record")
                      and e[-1] != "forward_ready" and e[1] != "forward_ready"])
    records = [e[1] for e in log if e[0] == "record" and e[1].startswith("host")]
    assert records == ["host_write1", "host_write0"]
    streams = [[e[2] for e in k if e[0] == "record"] for k in kinds]
    assert streams == [["dma"], [], [], ["dma"], []]
    waits = [[e[2] for e in k if e[0] == "wait" and e[1] == "compute"] for k in kinds]
    assert waits == [[], ["host_write1"], [], [], ["host_write0"]]


def test_a_cpu_wait_after_a_compute_only_step_records_on_compute_first():
    """INV-27, F16: a step whose host writes all ran on the compute stream
    records no event (P2), so a CPU wait for them (CoW, the audit, a P/D
    import) records the deferred one on the compute stream, then waits on
    it; a second wait in the same step records nothing more."""
    rig = WorkerRig()
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[0], scheduled=[1])
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=1)
    log = rig.worker.streams.log
    rig.worker.start_step(rig.meta(), None)
    start = len(log)
    rig.worker.host_write.synchronize_previous()
    rig.worker.host_write.synchronize_previous()
    assert log[start:] == [("record", "host_write1", "compute"),
                           ("synchronize", "host_write1"),
                           ("synchronize", "host_write1")]


def test_copy_on_write_synchronizes_then_copies_every_layer():
    """W-5/W-13, 4.12: a CoW pair copies the host page of every layer after
    a CPU wait on the previous host-write event; its ack is the destination."""
    rig = WorkerRig()
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[0], scheduled=[1])
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=1)
    for name, lv in rig.rt.layers.items():
        fill_pattern(lv.host[8 * B:9 * B], seed=hash(name) % 1000)
    rig.batch.schedule(computed=[1], scheduled=[1])
    rig.run(rig.meta(cow_src=np.array([8], dtype=np.int32),
                     cow_dst=np.array([11], dtype=np.int32)),
            num_decodes=1, num_decode_tokens=1)
    for lv in rig.rt.layers.values():
        assert torch.equal(lv.host[11 * B:12 * B], lv.host[8 * B:9 * B])
    log = rig.worker.streams.log
    assert ("synchronize", "host_write1") in log
    assert rig.worker.take_acks().cow_done == frozenset({11})


# ------------------------------------------------------ per-layer mirrors


def test_per_layer_submission_mirrors_a_group_once_its_layers_wrote():
    """W-4, 4.10: in a prefill batch each resident group's mirror is
    submitted after its last layer's KV write; the rest at finish."""
    rig = WorkerRig(freq=2)  # pairs: [l0], [l1, l2], [l3]
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[0], scheduled=[16])
    fill_slab(rig)
    layers = rig.layout.sparse_layers
    md = attn_metadata(rig.batch, 0, 0)
    rig.worker.start_step(rig.meta(), md)
    rig.worker.on_kv_written(layers[1])
    (res, g), = written_rows(rig, 0, [3], 1)
    assert int(rig.host_row(layers[1], g).count_nonzero()) == 0  # pair incomplete
    rig.worker.on_kv_written(layers[2])
    assert torch.equal(rig.host_row(layers[2], g), rig.resident_row(layers[2], res))
    assert int(rig.host_row(layers[3], g).count_nonzero()) == 0
    with pytest.raises(RuntimeError, match="twice"):
        rig.worker.on_kv_written(layers[2])
    rig.worker.finish_forward()
    assert torch.equal(rig.host_row(layers[3], g), rig.resident_row(layers[3],
                                                                     written_rows(rig, 0, [3], 2)[0][0]))


def test_partial_group_submission_is_rejected():
    rig = WorkerRig(freq=2)
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[0], scheduled=[16])
    rig.worker.start_step(rig.meta(), attn_metadata(rig.batch, 0, 0))
    rig.worker.on_kv_written(rig.layout.sparse_layers[1])
    with pytest.raises(RuntimeError, match="part of resident group"):
        rig.worker.finish_forward()


def test_pure_decode_batches_mirror_after_the_last_layer_attention():
    """P2, INV-32: a pure-decode batch is mirrored from the forward, after
    the attention of the last target layer the forward runs (every layer
    has written its KV): a FULL graph captures it there. Per-layer KV-write
    notices are ignored, earlier layers' attention copies nothing, and
    finish_forward copies nothing more."""
    rig = WorkerRig(freq=2)
    layers = rig.layout.sparse_layers
    assert rig.worker.decode_mirror_layer == layers[-1]
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[5], scheduled=[1])
    fill_slab(rig)
    rig.worker.start_step(rig.meta(), attn_metadata(rig.batch, 1, 1))
    rig.worker.on_kv_written(layers[0])  # ignored: not per-layer mode
    for name in layers[:-1]:
        rig.worker.on_attention(name, True, 1)
    for name in layers:
        pair = rig.rt.layers[name].pair
        (res, g), = written_rows(rig, 0, [5], pair)
        assert int(rig.host_row(name, g).count_nonzero()) == 0
    rig.worker.on_attention(layers[-1], True, 1)
    for name in layers:
        (res, g), = written_rows(rig, 0, [5], rig.rt.layers[name].pair)
        assert torch.equal(rig.host_row(name, g), rig.resident_row(name, res))
    before = {n: lv.host.clone() for n, lv in rig.rt.layers.items()}
    fill_slab(rig, seed=3)  # a copy at finish would now change host rows
    rig.worker.finish_forward()
    assert all(torch.equal(lv.host, before[n]) for n, lv in rig.rt.layers.items())


def test_no_in_forward_mirror_without_a_last_layer_or_with_draft_layers():
    """P2: the forward mirrors only where the worker can name the last
    target layer the forward runs, and not with draft (MTP) layers, whose
    descriptors the drafter's submission reads with the step's token count
    (a FULL graph fixes it at capture); lazy mode mirrors no decode rows."""
    from vllm.v1.hisparse.layout import last_in_forward

    assert last_in_forward(["model.layers.3.attn", "model.layers.10.attn",
                            "model.layers.7.attn"]) == "model.layers.10.attn"
    assert last_in_forward(["model.layers.3.attn", "head.attn"]) is None
    assert last_in_forward([]) is None
    assert WorkerRig(eager=False).worker.decode_mirror_layer is None
    mtp = WorkerRig(config=tiny_config(num_mtp=1))
    assert mtp.layout.draft_layers and mtp.worker.decode_mirror_layer is None


# ----------------------------------------------------- slots and req_state


def test_request_state_follows_hot_regions_and_padding_is_minus_one():
    """W-7, INV-24, F13: a new hot region gets a freshly reset slot;
    req_state maps each real row to its slot (the shared resident-only slot
    without a region, -1 for padding rows); row_req is -1 past the real
    tokens, and all -1 once a run outside a step is next (a dummy run may
    replay a FULL graph); a freed region's slot is released."""
    rig = WorkerRig()
    rt = rig.rt
    rig.place(0, resident=[3], host=[5], hot=[20, 21])
    rig.place(1, resident=[7], host=[9])
    for group in rt.groups:
        group.dgi.fill_(1234)
        group.lru.fill_(7)
    rig.batch.schedule(computed=[5, 5], scheduled=[1, 1])
    md = attn_metadata(rig.batch, 2, 2)
    rig.worker.start_step(rig.meta(hot_regions_allocated=np.array([20]), hot_region_requests=["r0"]), md)
    slot = rt.slots.of_region(20)
    assert rt.req_state[:3].tolist() == [slot, rt.resident_only_slot, -1]
    assert rt.row_req[:4].tolist() == [0, 1, -1, -1]
    for group in rt.groups:
        assert torch.all(group.dgi[slot] == -1)
        assert group.lru[slot].tolist() == list(range(rt.geometry.device_buffer_size))
    rig.worker.finish_forward()
    rt.before_dummy_run()  # the runner's _dummy_run, before any graph replay
    assert torch.all(rt.req_state == -1) and torch.all(rt.row_req == -1)
    rig.worker.start_step(rig.meta(hot_regions_freed=np.array([20])), md)
    assert rt.slots.num_live == 0 and not rt.slots.of_request
    rig.worker.finish_forward()


# ------------------------------------------------------------ decode path


def _start_one_decode(rig, *, resident: list[int], host_pages: int, computed: int):
    """Request r0 on host blocks 5 and 6 (patterned rows in the first
    ``host_pages``), resident blocks ``resident`` (0 = null), hot region
    20-21, one decode token after ``computed``: the step started."""
    rig.place(0, resident=resident, host=[5, 6], hot=[20, 21])
    for name in rig.layout.sparse_layers:
        fill_pattern(rig.rt.layers[name].host[5 * B:(5 + host_pages) * B],
                     seed=len(name) + ord(name[-6]))
    fill_slab(rig)
    rig.batch.schedule(computed=[computed], scheduled=[1])
    md = attn_metadata(rig.batch, 1, 1)
    rig.worker.start_step(rig.meta(hot_regions_allocated=np.array([20]),
                                   hot_region_requests=["r0"]), md)
    return md


def test_decode_rows_resolve_resident_hot_and_host_then_followers_replay():
    """C7/C10 end to end on the references: a request whose page 0 is
    host-only (null resident entry) and page 1 resident. The leader's rows
    for page 1 are resident rows; for page 0, hot slots filled from the host
    rows; the follower replays the plan into its own hot rows (INV-11)."""
    rig = WorkerRig(freq=2)  # index group of l1 leads l2 (pair 1)
    rt, layers = rig.rt, rig.layout.sparse_layers
    md = _start_one_decode(rig, resident=[0, 4], host_pages=1, computed=100)
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    topk[0, :4] = torch.tensor([2, 70, 9, 100], dtype=torch.int32)
    leader, follower = layers[1], layers[2]
    rows, counts = rt.decode_rows(leader, 1, topk, md.seq_lens, md.block_table)
    sa = rt.geometry.attention_block_stride
    res_block = 50 * 1 + 4
    assert rows[0, 1] == res_block * sa + 70 - B
    assert rows[0, 3] == res_block * sa + 100 - B
    assert int(counts[0]) == 4
    for k, pos in ((0, 2), (2, 9)):
        attn_row = int(rows[0, k])
        block, off = divmod(attn_row, sa)
        assert block in (70, 71)
        for name in (leader, follower) if k == 0 else (leader,):
            lv = rt.layers[name]
            if name == follower:
                rt.decode_rows(follower, 1, topk, md.seq_lens, md.block_table)
            assert torch.equal(lv.resident[block, off], lv.host[5 * B + pos])
    rig.worker.finish_forward()
    stats = rt.stats()
    assert stats["misses"] == 2 and stats["live_hot_regions"] == 1


def test_strided_addressing_resolves_and_gathers_through_the_attention_view():
    """Spec 3.2, docs/worker.md K8: at 8 layers the block is not a whole
    number of pages (strided addressing, Sa = B, the attention view is the
    resident view). In every layer the resident page's rows are its rows,
    and the host-only page's rows are hot-region rows that hold the host
    bytes when read through the attention view FlashMLA gets (INV-10)."""
    rig = WorkerRig(config=tiny_config(num_layers=8, num_gpu_blocks=512))
    rt = rig.rt
    assert rig.layout.addressing == "strided"
    assert rt.geometry.attention_block_stride == B
    md = _start_one_decode(rig, resident=[0, 4], host_pages=1, computed=100)
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    topk[0, :4] = torch.tensor([2, 70, 9, 100], dtype=torch.int32)
    for name in rig.layout.sparse_layers:
        lv = rt.layers[name]
        assert lv.attention.stride(0) == rig.layout.bytes_per_block
        rows, counts = rt.decode_rows(name, 1, topk, md.seq_lens, md.block_table)
        res_block = 50 * lv.pair + 4
        assert rows[0, 1] == res_block * B + 70 - B and rows[0, 3] == res_block * B + 100 - B
        assert int(counts[0]) == 4
        for k, pos in ((0, 2), (2, 9)):
            block, off = divmod(int(rows[0, k]), B)
            assert block in (20 + 50 * lv.pair, 21 + 50 * lv.pair)  # its hot region
            assert torch.equal(lv.attention[block, off], lv.host[5 * B + pos])
    rig.worker.finish_forward()
    assert rt.stats()["misses"] == 2 * len(rig.layout.sparse_layers)


def _decode_all_layers(prefetch: bool):
    """One decode step through every sparse layer in model order (index
    groups [l0], [l1 l2], [l3]), request r0's page 0 host-only: the rows
    and counts per layer, the slab after the forward, the stream log with
    each gather and resolve launch in it (the stream it ran on: the last
    ``enter`` not yet exited)."""
    rig = WorkerRig(freq=2, prefetch_followers=prefetch)
    rt, layers = rig.rt, rig.layout.sparse_layers
    log = rig.worker.streams.log

    def logged(name, fn):
        return staticmethod(lambda *a, **k: (log.append(("launch", name)), fn(*a, **k))[1])

    class Logged(ReferenceOps):
        resolve_residency = logged("resolve", ReferenceOps.resolve_residency)
        gather_compact = logged("gather", ReferenceOps.gather_compact)

    rt.ops = Logged
    md = _start_one_decode(rig, resident=[0, 4], host_pages=1, computed=100)
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    topk[0, :5] = torch.tensor([2, 70, 9, 100, 33], dtype=torch.int32)
    start = len(log)
    out = {}
    for name in layers:
        rows, counts = rt.decode_rows(name, 1, topk, md.seq_lens, md.block_table)
        out[name] = (rows.clone(), counts.clone())
    forward_log = log[start:]
    rig.worker.finish_forward()
    return rig, out, rig.slab.clone(), forward_log


def test_prefetched_followers_gather_the_same_bytes_on_the_copy_stream():
    """Spec 2.10 step 2.3 (prefetch_followers): the leader resolves and
    gathers on the compute stream; its follower's gather is enqueued on the
    copy stream behind an event recorded after the leader's gather (fork)
    and the follower's attention waits on its own ready event (join),
    launching nothing itself. Rows, counts and every slab byte equal the
    gathers on the compute stream (INV-11)."""
    rig, out, slab, _ = _decode_all_layers(prefetch=False)
    p_rig, p_out, p_slab, log = _decode_all_layers(prefetch=True)
    layers = rig.layout.sparse_layers
    assert [n for g in rig.rt.groups for n in g.layers[1:]] == [layers[2]]
    for name in layers:
        assert torch.equal(out[name][0], p_out[name][0])
        assert torch.equal(out[name][1], p_out[name][1])
    assert torch.equal(slab, p_slab)
    assert p_rig.rt.stats()["misses"] > 0
    follower = f"ready:{layers[2]}"
    fork = [("launch", "resolve"), ("launch", "gather"),
            ("record", "plan_ready", "compute"), ("enter", "copy"),
            ("wait", "copy", "plan_ready"), ("launch", "gather"),
            ("record", follower, "copy"), ("exit", "copy"),
            ("wait", "compute", follower)]
    launches_and_streams = [e for e in log if e[0] in ("launch", "record", "wait",
                                                       "enter", "exit")]
    # l0 alone: resolve + gather; [l1 l2]: the fork and join; l3 alone.
    assert launches_and_streams == [("launch", "resolve"), ("launch", "gather"),
                                    *fork, ("launch", "resolve"), ("launch", "gather")]
    # Off: the follower gathers on the compute stream, no stream operation.
    _, _, _, off_log = _decode_all_layers(prefetch=False)
    assert [e for e in off_log if e[0] != "launch"] == []
    assert [e[1] for e in off_log].count("gather") == 4


def test_prefetch_needs_followers():
    """prefetch_followers on a model whose every layer has its own indexer
    sets up nothing (no copy stream, no events): the binding warns."""
    rig = WorkerRig(freq=1)
    assert rig.rt.prefetch_followers(rig.worker.streams) is False
    assert rig.rt.prefetch is None
    assert WorkerRig(freq=2, prefetch_followers=True).rt.prefetch is not None


def test_prefetch_is_joined_before_the_next_leader_rewrites_the_plan():
    """INV-9 with prefetch_followers: the next group's resolve (the only
    writer of the shared workspace) is launched after the compute stream
    waited on every prefetched follower of the group before; a new forward
    does not reuse the previous forward's prefetch (end_forward clears it),
    so a follower reached without its leader stays an error."""
    rig, _, _, log = _decode_all_layers(prefetch=True)
    layers = rig.layout.sparse_layers
    join = log.index(("wait", "compute", f"ready:{layers[2]}"))
    resolves = [i for i, e in enumerate(log) if e == ("launch", "resolve")]
    assert resolves[-1] > join and resolves[1] < join
    assert rig.rt.prefetch.group is None
    rig.batch.schedule(computed=[101], scheduled=[1])
    md = attn_metadata(rig.batch, 1, 1)
    rig.worker.start_step(rig.meta(), md)
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="without its leader"):
        rig.rt.decode_rows(layers[2], 1, topk, md.seq_lens, md.block_table)


def test_short_prefill_chunks_on_the_decode_kernel_read_staged_host_pages():
    """K13: a 3-token chunk the backend runs on its decode kernel. Its
    resident page resolves to the resident row, its host-only page to a
    staging block past the pool holding the host bytes; invalid positions
    are -1; no hot state is used."""
    rig = WorkerRig(staging_blocks=4)
    rt, layer = rig.rt, rig.layout.sparse_layers[0]
    rig.place(0, resident=[0, 4], host=[5, 6])
    fill_pattern(rt.layers[layer].host[5 * B:6 * B], seed=5)
    fill_slab(rig, seed=6)
    rig.batch.schedule(computed=[97], scheduled=[3])
    md = attn_metadata(rig.batch, 1, 3)
    rig.worker.start_step(rig.meta(), md)
    rt.plan_extends(1)
    topk = torch.full((3, 64), -1, dtype=torch.int32)
    topk[:, :3] = torch.tensor([[3, 80, 120]] * 3, dtype=torch.int32)
    rows = rt.extend_rows(layer, 3, topk, md.seq_lens)
    sa, n = rt.geometry.attention_block_stride, rig.config.num_blocks
    assert rows[0, :3].tolist() == [n * sa + 3, 4 * sa + 80 - B, -1]
    view = rt.layers[layer].resident
    assert torch.equal(view[n, 3], rt.layers[layer].host[5 * B + 3])
    assert int(rows[0, 3]) == -1
    rig.worker.finish_forward()
    assert rt.stats()["hot_regions_assigned"] == 0


def _extend_rows_in_int64(plan, pair, row_req, topk, seq_lens, b, stride):
    """K13's row translation as it was written first (int64 temporaries):
    the oracle of the int32 one."""
    req = row_req.to(torch.int64).clamp(min=0)
    pos = topk.to(torch.int64)
    page = (pos // b).clamp(0, max(plan.width - 1, 0))
    block = plan.effective[pair].to(torch.int64)[req.unsqueeze(1), page]
    ok = (pos >= 0) & (pos < seq_lens.to(torch.int64)[req].unsqueeze(1)) & (block > 0)
    rows = block * stride + pos % b
    return torch.where(ok, rows, torch.full_like(rows, -1)).to(torch.int32)


@pytest.mark.parametrize("seed", range(5))
def test_extend_rows_in_int32_equal_the_int64_translation(seed):
    """K13 / L17: the extend path translates in int32 (three int32 [nd, K]
    temporaries at most, not int64 ones); every row id equals the int64
    translation's over random plans, positions (-1, past the sequence,
    past the table) and padding rows."""
    rng = np.random.default_rng(seed)
    rig = WorkerRig(staging_blocks=4)
    rt = rig.rt
    n, width, nd, k = 3, 5, 7, 64
    eff = rng.integers(0, 60, size=(n, width)).astype(np.int64)
    eff[rng.random((n, width)) < 0.2] = 0
    for pair in range(len(rig.res_ids)):
        rt.extend_plan = ExtendPlan(
            effective=tuple(torch.from_numpy(eff + 7 * j).to(torch.int32)
                            for j in range(len(rig.res_ids))),
            width=width, host_src_rows=torch.zeros(0, dtype=torch.int64),
            dst_rows=torch.zeros(0, dtype=torch.int64), mask=torch.zeros(0, dtype=torch.bool))
        row_req = torch.from_numpy(rng.integers(-1, n, size=nd).astype(np.int32))
        rt.row_req[:nd] = row_req
        topk = torch.from_numpy(rng.integers(-1, width * B + 40, size=(nd, k)).astype(np.int32))
        seq_lens = torch.from_numpy(rng.integers(1, width * B, size=n).astype(np.int32))
        layer = next(name for name, lv in rt.layers.items() if lv.pair == pair)
        got = rt.extend_rows(layer, nd, topk, seq_lens)
        want = _extend_rows_in_int64(rt.extend_plan, pair, row_req, topk, seq_lens, B,
                                     rt.geometry.attention_block_stride)
        assert got.dtype == torch.int32 and torch.equal(got, want)
        assert (got >= 0).any() and (got == -1).any()


def test_follower_without_its_leaders_plan_is_an_error():
    rig = WorkerRig(freq=2)
    rig.place(0, resident=[3], host=[5], hot=[20, 21])
    rig.batch.schedule(computed=[10], scheduled=[1])
    md = attn_metadata(rig.batch, 1, 1)
    rig.worker.start_step(rig.meta(), md)
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="without its leader"):
        rig.rt.decode_rows(rig.layout.sparse_layers[2], 1, topk, md.seq_lens,
                           md.block_table)


def test_all_resident_requests_touch_no_hot_state():
    """E2E-8 on CPU, INV-34: without null pages every entry resolves to its
    resident row, no slot exists and nothing is loaded."""
    rig = WorkerRig()
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.batch.schedule(computed=[100], scheduled=[1])
    md = attn_metadata(rig.batch, 1, 1)
    rig.worker.start_step(rig.meta(), md)
    topk = torch.arange(64, dtype=torch.int32).unsqueeze(0) + 37
    rows, _ = rig.rt.decode_rows(rig.layout.sparse_layers[0], 1, topk, md.seq_lens,
                                 md.block_table)
    sa = rig.rt.geometry.attention_block_stride
    expect = [(3 if p < B else 4) * sa + p % B for p in range(37, 101)]
    assert rows[0].tolist() == expect
    assert int(rig.rt.workspace.plan_count[0]) == 0
    rig.worker.finish_forward()
    assert rig.rt.stats()["misses"] == 0


# ---------------------------------------------------------- invalidation


def test_rewritten_rows_drop_hot_entries():
    """4.8 trigger 3 (INV-41): after the forward, entries keyed by host rows
    this forward wrote are -1; others stay. (No trigger-2 pass over
    reallocated host blocks: docs/worker.md K27.)"""
    rig = WorkerRig()
    rt = rig.rt
    rig.place(0, resident=[0, 4], host=[5, 6], hot=[20, 21])  # page 0 host-only
    rig.batch.schedule(computed=[70], scheduled=[1])
    md = attn_metadata(rig.batch, 1, 1)
    rig.worker.start_step(rig.meta(hot_regions_allocated=np.array([20]), hot_region_requests=["r0"]), md)
    slot = rt.slots.of_region(20)
    assert rt.slots_with_entries == {slot}
    written_g = 6 * B + 70 - B
    assert len(rt.groups) > 1  # one K4 launch must cover every group
    for group in rt.groups:
        group.dgi[slot, :3] = torch.tensor([9 * B + 1, written_g, 5 * B + 7])
    rig.worker.finish_forward()
    for group in rt.groups:
        assert group.dgi[slot, :3].tolist() == [9 * B + 1, -1, 5 * B + 7]


def test_no_invalidation_while_no_slot_can_hold_an_entry():
    """P2, INV-41: only a resolver miss fills a hot slot, and only a request
    with a host-only context page can miss. A region whose request has every
    page resident (a prefix hit whose pages were all adopted) needs no K4
    launch; the first step with a host-only page makes its slot count, for
    as long as the slot lives (entries outlive a later restore); a fresh
    assignment starts clean again."""
    rig = WorkerRig()
    rt = rig.rt
    calls = []
    k4 = rt.ops.invalidate_written_slots
    rt.ops = type("Ops", (), {k: staticmethod(getattr(rig.rt.ops, k)) for k in (
        "resolve_residency", "gather_compact", "gather_plan", "copy_descriptors",
        "mirror_descriptors")})
    rt.ops.invalidate_written_slots = staticmethod(
        lambda *a: (calls.append(1), k4(*a))[1])

    def step(meta, computed=70):
        rig.batch.schedule(computed=[computed], scheduled=[1])
        rig.worker.start_step(meta, attn_metadata(rig.batch, 1, 1))
        rig.worker.finish_forward()

    rig.place(0, resident=[3, 4], host=[5, 6], hot=[20, 21])
    step(rig.meta(hot_regions_allocated=np.array([20]), hot_region_requests=["r0"]))
    assert rt.slots.num_live == 1 and not rt.slots_with_entries and not calls
    rig.place(0, resident=[0, 4], host=[5, 6], hot=[20, 21])  # page 0 lost
    rt.note_residency_updates()  # as the binding does for the update
    step(rig.meta())
    slot = rt.slots.of_region(20)
    assert rt.slots_with_entries == {slot} and len(calls) == 1  # every group, one launch
    rig.place(0, resident=[3, 4], host=[5, 6], hot=[20, 21])  # restored
    rt.note_residency_updates()
    step(rig.meta())
    assert rt.slots_with_entries == {slot} and len(calls) == 2
    step(rig.meta(hot_regions_freed=np.array([20])))
    assert not rt.slots_with_entries and len(calls) == 2


@pytest.fixture
def checked(monkeypatch) -> list[list[int]]:
    """The batch rows of every host-only-page check the runtime makes
    (``host_backed_rows``, the real one still answers)."""
    from vllm.v1.hisparse import runtime as runtime_module

    calls: list[list[int]] = []
    real = runtime_module.host_backed_rows

    def counted(table, rows, *args):
        calls.append(rows.tolist())
        return real(table, rows, *args)

    monkeypatch.setattr(runtime_module, "host_backed_rows", counted)
    return calls


def test_a_steady_step_checks_no_slot_for_host_only_pages(checked):
    """P2, INV-41: whether a slot's request has a host-only context page is
    checked when its region is assigned, and again only after residency
    updates (the one way a live request's row gains a null entry: new pages
    are resident, new and resumed requests get a new region). A steady
    decode step checks no row."""
    rig = WorkerRig()
    rt = rig.rt
    rig.place(0, resident=[3, 4], host=[5, 6], hot=[20, 21])
    rig.place(1, resident=[7, 8], host=[9, 10], hot=[30, 31])

    def step(meta, computed):
        rig.batch.schedule(computed=[computed] * 2, scheduled=[1, 1])
        rig.run(meta, num_decodes=2, num_decode_tokens=2)

    step(rig.meta(hot_regions_allocated=np.array([20, 30]),
                  hot_region_requests=["r0", "r1"]), 70)
    assert checked == [[0, 1]] and not rt.slots_with_entries
    step(rig.meta(), 71)
    step(rig.meta(), 72)
    assert checked == [[0, 1]]
    rig.place(1, resident=[0, 8], host=[9, 10], hot=[30, 31])  # r1 lost page 0
    rt.note_residency_updates()
    step(rig.meta(), 73)
    assert checked == [[0, 1], [0, 1]]
    assert rt.slots_with_entries == {rt.slots.of_region(30)}
    step(rig.meta(), 74)
    assert len(checked) == 2


def test_a_slot_assigned_outside_the_batch_is_checked_when_its_request_runs(
        checked):
    """P2, INV-41: a steady step skips the slot check only while no slot is
    left unchecked; a region given to a request that is not in this step's
    batch stays unchecked (and the skip off) until that request runs, and
    its host-only page then puts its slot among those K4 resets."""
    rig = WorkerRig()
    rt = rig.rt
    rig.place(0, resident=[3, 4], host=[5, 6], hot=[20, 21])
    rig.place(1, resident=[0, 8], host=[9, 10], hot=[30, 31])  # r1: page 0 on host

    def step(meta, rows):
        rig.batch.schedule(computed=[70] * rows, scheduled=[1] * rows)
        rig.run(meta, num_decodes=rows, num_decode_tokens=rows)

    step(rig.meta(hot_regions_allocated=np.array([20, 30]),
                  hot_region_requests=["r0", "r1"]), rows=1)
    assert checked == [[0]] and not rt.slots_with_entries
    step(rig.meta(), rows=1)
    assert checked == [[0]]  # r0 checked once; r1 not in the batch yet
    step(rig.meta(), rows=2)
    assert checked == [[0], [1]]
    assert rt.slots_with_entries == {rt.slots.of_region(30)}
    step(rig.meta(), rows=2)
    assert len(checked) == 2  # all checked: steady again


def test_step_inputs_are_rebuilt_exactly_when_what_they_derive_from_changes(
        monkeypatch):
    """P2, F22, F13: a steady batch (the same rows, query lengths and slots)
    rebuilds no step input; a change of any of them (rows reordered, query
    lengths, a region freed, a dummy run's reset) rebuilds them, and the
    kernel inputs are right after each."""
    from vllm.v1.hisparse.runtime import StepInputs

    builds = []
    real = StepInputs.host_views

    def counted(self):
        builds.append(1)
        return real(self)

    monkeypatch.setattr(StepInputs, "host_views", counted)
    rig = WorkerRig()
    rt = rig.rt
    rig.place(0, resident=[3, 4], host=[5, 6], hot=[20, 21])
    rig.place(1, resident=[7, 8], host=[9, 10], hot=[30, 31])

    def step(meta, scheduled=(1, 1)):
        rig.batch.schedule(computed=[70, 70], scheduled=list(scheduled))
        rig.run(meta, num_decodes=2, num_decode_tokens=sum(scheduled))
        n = sum(scheduled)
        return rt.row_req[:n].tolist(), rt.req_state[:2].tolist()

    first = step(rig.meta(hot_regions_allocated=np.array([20, 30]),
                          hot_region_requests=["r0", "r1"]))
    s0, s1 = rt.slots.of_region(20), rt.slots.of_region(30)
    assert first == ([0, 1], [s0, s1]) and len(builds) == 1
    assert step(rig.meta()) == first and step(rig.meta()) == first
    assert len(builds) == 1  # steady: nothing rebuilt
    rig.batch.req_ids[:2] = ["r1", "r0"]  # the rows swapped requests
    assert step(rig.meta()) == ([0, 1], [s1, s0]) and len(builds) == 2
    rig.batch.req_ids[:2] = ["r0", "r1"]
    assert step(rig.meta(), scheduled=(2, 1)) == ([0, 0, 1], [s0, s1])
    assert len(builds) == 3
    S = rt.resident_only_slot
    assert step(rig.meta(hot_regions_freed=np.array([30]))) == ([0, 1], [s0, S])
    assert len(builds) == 4
    rt.before_dummy_run()
    assert (rt.step_inputs.tensor == -1).all()  # what a dummy run's graph reads
    assert step(rig.meta()) == ([0, 1], [s0, S]) and len(builds) == 5


def test_the_runner_skips_exactly_the_virtual_groups():
    """P2 (runner hook in _build_attention_metadata): the groups without an
    attention module, the resident and hot ones, by id; not the source and
    indexer groups, whose metadata the sparse-MLA layers read."""
    rig = WorkerRig()
    layout = rig.layout
    assert rig.rt.virtual_group_ids == set(layout.resident_group_ids) | set(
        layout.hot_group_ids)
    assert layout.SOURCE_GROUP_ID not in rig.rt.virtual_group_ids
    assert layout.INDEXER_GROUP_ID not in rig.rt.virtual_group_ids


# ------------------------------------------------------------ debug audit


def test_mirror_audit_checks_every_written_row(monkeypatch):
    """Spec 6.1 / F1: with VLLM_HISPARSE_DEBUG=1 the next step compares every
    host row written last step with its resident row, in every layer."""
    monkeypatch.setenv("VLLM_HISPARSE_DEBUG", "1")
    rig = WorkerRig()
    rig.place(0, resident=[3], host=[5])
    rig.batch.schedule(computed=[0], scheduled=[8])
    fill_slab(rig)
    rig.run(rig.meta())
    rig.batch.schedule(computed=[8], scheduled=[1])
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=1)
    assert rig.worker.audit_rows_checked == 8 * 4
    assert rig.worker.audit_mismatches == 0
    rig.rt.layers[rig.layout.sparse_layers[0]].host[5 * B + 8, 0] ^= 0xFF
    rig.batch.schedule(computed=[9], scheduled=[1])
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=1)
    assert rig.worker.audit_mismatches == 1


def test_workspace_overflow_is_an_error():
    """F12: more decode rows than the workspace holds fail loudly."""
    rig = WorkerRig()
    topk = torch.full((9, 64), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="exceed the resolver workspace"):
        rig.rt.decode_rows(rig.layout.sparse_layers[0], 9, topk,
                           torch.zeros(9, dtype=torch.int32),
                           torch.zeros((9, 4), dtype=torch.int32))


def test_an_optimistic_length_never_stages_a_lookahead_page():
    """docs/mtp.md 3.10 (async scheduling with speculation): the runner's
    ``seq_lens_cpu`` counts unverified drafts, so a short chunk's length
    may reach a lookahead page the scheduler allocated as resident only
    (no host block yet). Only null resident pages are staged (K13): the
    host-only page 0 is, the lookahead page 2 is read at its resident row
    and never needs a host block."""
    rig = WorkerRig(staging_blocks=4)
    rt, layer = rig.rt, rig.layout.sparse_layers[0]
    rig.place(0, resident=[0, 4, 9], host=[5, 6])
    fill_pattern(rt.layers[layer].host[5 * B:6 * B], seed=5)
    fill_slab(rig, seed=6)
    rig.batch.schedule(computed=[126], scheduled=[4])  # reaches position 129
    md = attn_metadata(rig.batch, 1, 4)
    rig.worker.start_step(rig.meta(), md)
    rt.plan_extends(1)
    plan = rt.extend_plan
    assert plan.width == 3 and rt.staging_blocks_peak == 1
    n = rig.config.num_blocks
    assert plan.effective[0][0].tolist() == [n, 4, 9]
    topk = torch.full((4, 64), -1, dtype=torch.int32)
    topk[:, :3] = torch.tensor([[3, 80, 128]] * 4, dtype=torch.int32)
    rows = rt.extend_rows(layer, 4, topk, md.seq_lens)
    sa = rt.geometry.attention_block_stride
    assert rows[3, :3].tolist() == [n * sa + 3, 4 * sa + 80 - B, 9 * sa + 128 - 2 * B]
    rig.worker.finish_forward()


def _decode_with_misses(order_misses: bool):
    rig = WorkerRig(freq=2, order_misses=order_misses)
    rt, layers = rig.rt, rig.layout.sparse_layers
    md = _start_one_decode(rig, resident=[0, 0], host_pages=2, computed=120)
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    topk[0, :6] = torch.tensor([119, 70, 64, 40, 9, 2], dtype=torch.int32)  # descending rows
    leader, follower = layers[1], layers[2]
    rows, counts = rt.decode_rows(leader, 1, topk, md.seq_lens, md.block_table)
    plan = rt.workspace.plan_src[0, :int(rt.workspace.plan_count[0])].tolist()
    rt.decode_rows(follower, 1, topk, md.seq_lens, md.block_table)
    hot = {n: rt.layers[n].resident[20:22].clone() for n in (leader, follower)}
    rig.worker.finish_forward()
    return rows.clone(), counts.clone(), plan, hot


def _decode_two_requests(order_misses):
    """Two decode rows whose host-only page 0 lies on host block 9 (r0) and
    5 (r1): across the step, r1's misses come first in host order. Returns
    the leader's rows and counts, K1's plan after the leader, the slab
    before and after leader + follower, and K7's list (None when off)."""
    rig = WorkerRig(freq=2, order_misses=order_misses)
    rt, layers = rig.rt, rig.layout.sparse_layers
    rig.place(0, resident=[0, 4], host=[9, 6], hot=[20, 21])
    rig.place(1, resident=[0, 8], host=[5, 10], hot=[30, 31])
    for i, lv in enumerate(rt.layers.values()):
        fill_pattern(lv.host, seed=10 + i)
    fill_slab(rig)
    rig.batch.schedule(computed=[100, 90], scheduled=[1, 1])
    md = attn_metadata(rig.batch, 2, 2)
    rig.worker.start_step(rig.meta(hot_regions_allocated=[20, 30],
                                   hot_region_requests=["r0", "r1"]), md)
    topk = torch.full((2, 64), -1, dtype=torch.int32)
    topk[0, :5] = torch.tensor([40, 3, 77, 20, 9], dtype=torch.int32)  # 77: resident
    topk[1, :5] = torch.tensor([2, 50, 11, 80, 33], dtype=torch.int32)  # 80: resident
    leader, follower = layers[1], layers[2]
    before = rig.slab.clone()
    rows, counts = rt.decode_rows(leader, 2, topk, md.seq_lens, md.block_table)
    ws = rt.workspace
    plan = [t[:2].clone() for t in (ws.plan_src, ws.plan_dst, ws.plan_count)]
    rt.decode_rows(follower, 2, topk, md.seq_lens, md.block_table)
    order = ws.step_order
    listed = None if order is None else (order.sorted_cells[:2 * 64].clone(),
                                         int(order.total[0]))
    after = rig.slab.clone()
    rig.worker.finish_forward()
    return rows.clone(), counts.clone(), plan, before, after, listed


def test_k7_step_order_gathers_the_same_bytes_across_requests_in_host_order():
    """P9 / INV-36 (K7, order_misses="step"): the leader's misses of both
    requests are listed as one sequence in ascending host row (r1's block 5
    before r0's block 9, across plan rows), the plan stays as K1 wrote it,
    and the rows the attention reads, their counts and every byte of the
    slab (leader and follower hot rows) equal K1's order through K2."""
    rows, counts, plan, before, after, listed = _decode_two_requests(None)
    s_rows, s_counts, s_plan, _, s_after, (cells, total) = _decode_two_requests("step")
    assert not torch.equal(before, after)  # the misses were gathered
    assert all(torch.equal(a, b) for a, b in zip(plan, s_plan))
    assert plan[2].tolist() == [4, 4] and total == 8
    flat_src = plan[0].reshape(-1)
    hosts = flat_src[cells[:total].long()].tolist()
    assert hosts == sorted(plan[0][:, :4].reshape(-1).tolist())
    assert [int(c) // 64 for c in cells[:total]] == [1] * 4 + [0] * 4
    assert (cells[total:] == -1).all()
    assert torch.equal(rows, s_rows) and torch.equal(counts, s_counts)
    assert torch.equal(after, s_after)


def test_k6_row_order_gathers_the_same_bytes_across_requests():
    """P9 / INV-36 (K6, order_misses="row", also true): each plan row sorted
    in place; rows, counts and every slab byte as in K1's order."""
    rows, counts, plan, _, after, _ = _decode_two_requests(None)
    for mode in ("row", True):
        r_rows, r_counts, r_plan, _, r_after, listed = _decode_two_requests(mode)
        assert listed is None
        assert r_plan[0][0, :4].tolist() == sorted(plan[0][0, :4].tolist())
        assert r_plan[0][1, :4].tolist() == sorted(plan[0][1, :4].tolist())
        assert torch.equal(rows, r_rows) and torch.equal(counts, r_counts)
        assert torch.equal(after, r_after)


def test_ordered_misses_gather_the_same_rows_in_host_order():
    """P9 / INV-36 (K6, hisparse_config.order_misses): with the plan sorted
    by host row, K1's misses are gathered in address order, and the rows the
    attention reads, their counts and every hot byte of leader and follower
    are those of K1's own order."""
    rows, counts, plan, hot = _decode_with_misses(order_misses=False)
    o_rows, o_counts, o_plan, o_hot = _decode_with_misses(order_misses=True)
    assert len(plan) == 6 and plan != sorted(plan)  # K1's order: first reference
    assert o_plan == sorted(plan)
    assert torch.equal(rows, o_rows) and torch.equal(counts, o_counts)
    assert all(torch.equal(hot[n], o_hot[n]) for n in hot)
