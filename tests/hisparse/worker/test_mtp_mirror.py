# SPDX-License-Identifier: Apache-2.0
"""The mirror of draft (MTP) rows on the CPU worker rig (spec 4.10, W-10;
docs/mtp.md 3.5): F2, INV-25, INV-26, K12, F17.

A step runs as the pin runs it with MTP: the target forward
(``on_kv_written`` per target layer), ``take_acks`` (the connector's
``build_connector_worker_meta``, before the drafter), 1..3 draft passes (the
draft layer writes its rows, then ``on_kv_written``), ``finish_forward``
(``wait_for_save``). Pass 0 writes the target tokens' rows; pass k >= 1
writes one position per request, here rewriting rows the target wrote
(drafts rejected).
"""

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

from vllm.v1.hisparse.worker import MirrorPlan


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


# 3 target layers + MTP (the E2E gate model): 4 pairs, the MTP layer alone.
DRAFT = attn(3)
# GLM-5.3's shape in small: an IndexShare unit, then single leaders; 11
# indexers hold two layer pages, so MTP layer 13 shares the last pair with
# target layer 12 (as MTP 60 shares GLM-5.3's last pair with 58 and 59).
SHARED = dict(num_layers=13, pattern="FSSS" + "F" * 9, num_mtp=1)
SHARED_DRAFT = attn(13)


def mtp_rig(eager: bool = True, **config) -> WorkerRig:
    config = {"num_layers": 3, "num_mtp": 1, **config}
    rig = WorkerRig(config=tiny_config(q=4, **config), eager=eager)
    rig.copies: list[frozenset[str]] = []
    rig.rt.ops = logging_ops(rig)
    return rig


def logging_ops(rig: WorkerRig):
    """The reference ops; each copy_descriptors launch is logged (in the
    stream log too, for order) as the set of layers whose host rows it
    writes."""
    log, copy = rig.worker.streams.log, ReferenceOps.copy_descriptors
    spans = {n: (lv.host_ptr, lv.host_ptr + lv.host.numel())
             for n, lv in rig.rt.layers.items()}

    def copy_descriptors(src, dst, nbytes):
        live = dst[nbytes > 0].tolist()
        layers = frozenset(n for n, (lo, hi) in spans.items()
                           if any(lo <= d < hi for d in live))
        rig.copies.append(layers)
        log.append(("copy", layers))
        copy(src, dst, nbytes)

    return type("LoggingOps", (ReferenceOps,),
                {"copy_descriptors": staticmethod(copy_descriptors)})


def slot(rig: WorkerRig, layer: str, row: int, pos: int) -> int:
    """The resident row position ``pos`` of batch row ``row`` has in the
    layer's pair (what the drafter's slot mapping gives)."""
    pair = rig.rt.layers[layer].pair
    block = int(rig.batch.tables[rig.res_ids[pair]].numpy()[row, pos // B])
    return block * B + pos % B


def host_row_of(rig: WorkerRig, row: int, pos: int) -> int:
    src = rig.batch.tables[rig.layout.SOURCE_GROUP_ID].numpy()[row]
    return int(src[pos // B]) * B + pos % B


def draft_pass(rig: WorkerRig, layer: str, rows_pos, seed: int) -> None:
    """One draft pass: the draft layer writes new bytes at (row, pos) each,
    then the connector hook runs (once per pass)."""
    view = rig.rt.layers[layer].resident
    for row, pos in rows_pos:
        r = slot(rig, layer, row, pos)
        fill_pattern(view[r // B, r % B], seed + r)
    rig.worker.on_kv_written(layer)


def target_forward(rig: WorkerRig) -> None:
    for name, lv in rig.rt.layers.items():
        if not lv.is_draft:
            rig.worker.on_kv_written(name)


def assert_mirrored(rig: WorkerRig, layer: str, row: int, positions) -> None:
    for pos in positions:
        r, g = slot(rig, layer, row, pos), host_row_of(rig, row, pos)
        assert torch.equal(rig.host_row(layer, g), rig.resident_row(layer, r)), (
            layer, pos)


def decode_step_with_spill(rig: WorkerRig):
    """Row 0 verifies q = 4 tokens at positions 60..63 (across no page
    boundary); transfer 7 spills page 0 (host block 5, resident block 3)."""
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.batch.schedule(computed=[60], scheduled=[4])
    fill_pattern(rig.slab, 0)
    return rig.meta(**rig.spill(7, host_block=5, resident_block=3))


# ------------------------------------------------------------------ F2


@pytest.mark.parametrize("passes", [1, 2, 3])
def test_draft_rows_copied_after_the_last_pass_before_the_spill(passes):
    """W-10 / F2 / INV-26: the draft layer is marked once per pass without
    "mirrored twice"; its rows are copied once, in finish_forward, after the
    target rows and before the spill's completion record on the DMA stream;
    the host holds the bytes of the last pass (pass k rewrote row 60 + k)."""
    rig = mtp_rig()
    meta = decode_step_with_spill(rig)
    log = rig.worker.streams.log

    def forward():
        target_forward(rig)
        draft_pass(rig, DRAFT, [(0, p) for p in range(60, 64)], seed=100)
        for k in range(1, passes):
            draft_pass(rig, DRAFT, [(0, 60 + k)], seed=200 * k)
        assert rig.copies == []  # nothing before wait_for_save

    start = len(log)
    rig.run(meta, num_decodes=1, num_decode_tokens=4, before_finish=forward)
    events = log[start:]
    copies = [i for i, e in enumerate(events) if e[0] == "copy"]
    spill = events.index(("record", "transfer", "dma"))
    assert len(copies) == 1 and DRAFT in events[copies[0]][1]
    assert copies[0] < spill
    assert events.index(("record", "host_write1", "dma")) > spill
    assert_mirrored(rig, DRAFT, 0, range(60, 64))
    for name in rig.layout.sparse_layers[:3]:
        assert_mirrored(rig, name, 0, range(60, 64))


def test_the_spill_is_acked_the_step_after_the_drafter(monkeypatch):
    """F17, INV-15: take_acks runs before the drafter (before finish_forward),
    so the step's spill is not yet enqueued there; the next ack reports it
    enqueued and completed with its step, after the draft copy."""
    rig = mtp_rig()
    meta = decode_step_with_spill(rig)
    early = []

    def forward():
        target_forward(rig)
        early.append(rig.worker.take_acks())
        draft_pass(rig, DRAFT, [(0, p) for p in range(60, 64)], seed=100)

    rig.run(meta, num_decodes=1, num_decode_tokens=4, before_finish=forward)
    assert early == [None]
    ack = rig.worker.take_acks()
    assert ack.enqueued == {7: frozenset({0})} and 7 in ack.completed
    assert ack.submitted_step == {7: meta.step}


def test_mixed_batch_marks_draft_passes_and_copies_them_once():
    """4.10 per-layer mode with a drafter (F2): target layers are submitted
    per resident group as they write; the draft layer's three passes raise
    no "mirrored twice" and submit nothing; finish_forward copies the draft
    rows, prefill rows included, in one launch."""
    rig = mtp_rig()
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.place(1, resident=[7, 8], host=[9, 10])
    rig.batch.schedule(computed=[60, 0], scheduled=[4, 70])
    fill_pattern(rig.slab, 1)
    rig.worker.start_step(rig.meta(), attn_metadata(rig.batch, 1, 4))
    target_forward(rig)
    assert len(rig.copies) == 3 and DRAFT not in frozenset().union(*rig.copies)
    for k in range(3):
        draft_pass(rig, DRAFT, [(0, 60 + k), (1, 69)], seed=300 + k)
    assert len(rig.copies) == 3
    rig.worker.finish_forward()
    assert rig.copies[3:] == [frozenset({DRAFT})]
    assert_mirrored(rig, DRAFT, 0, range(60, 64))
    assert_mirrored(rig, DRAFT, 1, range(70))


def test_shared_pair_mirrors_target_part_per_layer_and_draft_part_once():
    """docs/mtp.md 3.5 (GLM-5.3 shape): the MTP layer shares a pair with
    target layer 12. Mirror ranges are keyed by (draft, pair): in a mixed
    batch layer 12's write submits its range alone (the draft layer of the
    same pair never held it back), the draft part follows once at finish."""
    rig = mtp_rig(**SHARED)
    shared_pair = rig.rt.layers[SHARED_DRAFT].pair
    assert rig.rt.layers[attn(12)].pair == shared_pair
    m = rig.worker.mirror
    assert m.range_is_draft == [False] * 6 + [True]
    assert m.pair_of_range == [0, 1, 2, 3, 4, 5, 5]
    rig.place(0, resident=[3], host=[5])
    rig.place(1, resident=[4], host=[6])
    rig.batch.schedule(computed=[10, 0], scheduled=[4, 20])
    fill_pattern(rig.slab, 2)
    rig.worker.start_step(rig.meta(), attn_metadata(rig.batch, 1, 4))
    rig.worker.on_kv_written(attn(12))
    assert rig.copies == [frozenset({attn(12)})]
    draft_pass(rig, SHARED_DRAFT, [(0, p) for p in range(10, 14)], seed=400)
    draft_pass(rig, SHARED_DRAFT, [(0, 11)], seed=500)
    for i in range(12):
        rig.worker.on_kv_written(attn(i))
    rig.worker.finish_forward()
    assert rig.copies[-1] == frozenset({SHARED_DRAFT})
    assert sum(SHARED_DRAFT in c for c in rig.copies) == 1
    assert_mirrored(rig, SHARED_DRAFT, 0, range(10, 14))
    assert_mirrored(rig, attn(12), 1, range(20))


def test_mirror_layers_must_group_by_draft_and_pair():
    """4.10: a (pair, draft) key that appears in two runs of the layer
    order would split a range's submission; MirrorPlan refuses it."""
    rig = mtp_rig(**SHARED)
    order = [attn(4), SHARED_DRAFT, attn(5)]
    with pytest.raises(ValueError, match=r"grouped by \(draft, resident group\)"):
        MirrorPlan(rig.rt, rig.slab.data_ptr(), order, rig.slab.device)


# ---------------------------------------------------------------- INV-25


def test_drafter_skipped_copies_no_draft_row():
    """INV-25: when the drafter does not run (_input_fits_in_drafter false)
    the draft layer wrote nothing and nothing of it is copied; the target
    rows and the spill barrier are as always."""
    rig = mtp_rig()
    meta = decode_step_with_spill(rig)
    rig.run(meta, num_decodes=1, num_decode_tokens=4,
            before_finish=lambda: target_forward(rig))
    assert rig.copies == [frozenset(rig.layout.sparse_layers[:3])]
    assert int(rig.rt.layers[DRAFT].host.count_nonzero()) == 0
    assert_mirrored(rig, attn(0), 0, range(60, 64))
    assert 7 in rig.worker.take_acks().enqueued


def test_lazy_spill_copies_the_draft_page_after_the_drafter():
    """INV-26 with eager_host_mirror=false (4.3): decode rows are not
    mirrored; the spill copies the page of every layer, the MTP layer
    included, after the last draft pass (pass 1 rewrote row 61 of it)."""
    rig = mtp_rig(eager=False)
    meta = decode_step_with_spill(rig)

    def forward():
        target_forward(rig)
        draft_pass(rig, DRAFT, [(0, p) for p in range(60, 64)], seed=100)
        draft_pass(rig, DRAFT, [(0, 61)], seed=200)

    rig.run(meta, num_decodes=1, num_decode_tokens=4, before_finish=forward)
    assert rig.copies == []  # no row mirror in lazy decode
    for name, lv in rig.rt.layers.items():
        block = 50 * lv.pair + 3
        assert torch.equal(lv.host[5 * B:6 * B], lv.resident[block]), name


def test_zero_draft_layers_change_nothing():
    """4.10 / INV-25 unchanged without MTP: no draft layer, every range is a
    target range, one per resident group, as before."""
    rig = WorkerRig(config=tiny_config())
    m = rig.worker.mirror
    assert not any(m.range_is_draft)
    assert m.pair_of_range == list(range(len(rig.res_ids)))
    assert not any(lv.is_draft for lv in rig.rt.layers.values())


# ------------------------------------------------------------------ K12


def test_audit_is_exact_after_passes_rewrite_rejected_rows(monkeypatch):
    """K12 / F2: passes 1 and 2 rewrite rows 61 and 62, which the step's
    descriptors also cover; copying after the last pass leaves host ==
    resident, so the next step's audit checks every row of every layer with
    no mismatch. A step whose drafter was skipped audits the target layers
    only (the draft rows were neither written nor copied)."""
    monkeypatch.setenv("VLLM_HISPARSE_DEBUG", "1")
    rig = mtp_rig()
    meta = decode_step_with_spill(rig)

    def forward():
        target_forward(rig)
        draft_pass(rig, DRAFT, [(0, p) for p in range(60, 64)], seed=100)
        draft_pass(rig, DRAFT, [(0, 61)], seed=200)
        draft_pass(rig, DRAFT, [(0, 62)], seed=300)

    rig.run(meta, num_decodes=1, num_decode_tokens=4, before_finish=forward)
    rig.batch.schedule(computed=[61], scheduled=[4])
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=4,
            before_finish=lambda: target_forward(rig))
    assert rig.worker.audit_rows_checked == 4 * 4
    assert rig.worker.audit_mismatches == 0
    # The skipped step's draft row 64 was never written nor copied (its
    # resident bytes differ from host): not audited.
    rig.batch.schedule(computed=[62], scheduled=[1])
    rig.run(rig.meta(), num_decodes=1, num_decode_tokens=1)
    assert rig.worker.audit_rows_checked == 4 * 4 + 4 * 3
    assert rig.worker.audit_mismatches == 0


def test_layer_views_mark_the_draft_layer_and_its_own_index_group():
    """Binding (docs/mtp.md 3.2, INV-11): only the MTP layer's views are
    draft; it leads an index group of its own even inside a shared pair."""
    rig = mtp_rig(**SHARED)
    layers = rig.rt.layers
    assert [n for n, lv in layers.items() if lv.is_draft] == [SHARED_DRAFT]
    group = layers[SHARED_DRAFT].group
    assert group.layers == (SHARED_DRAFT,) and group.leader == SHARED_DRAFT
    assert group.pair == layers[attn(12)].pair
    assert layers[attn(12)].group is not group
    assert rig.worker.mirror.layer_order[-1] == SHARED_DRAFT
