# SPDX-License-Identifier: Apache-2.0
"""Resolution of draft (MTP) passes on the CPU references (docs/mtp.md 3.3):
F3 / INV-36 on the draft layer's own index group, INV-34, INV-33, INV-1,
and the pass-0 split check.

The real runtime on the worker rig (3 target layers + 1 MTP layer, q = 4).
Two requests verify q = 4 tokens each; page 0 of each is host-only, page 1
resident, and each has a hot region. A draft pass calls ``decode_rows``
for the MTP layer with its own ``req_id_per_token``: pass 0 the target's
token rows (q rows per request), passes >= 1 one row per request.
"""

import dataclasses

import pytest
import torch
from worker_harness import B, WorkerRig, attn_metadata, fill_pattern, tiny_config

Q = 4
DRAFT = "model.layers.3.self_attn.attn"
HOST = {0: 5, 1: 9}  # request row -> host block of its page 0 (host-only)
RESIDENT = {0: 4, 1: 8}  # request row -> resident block of page 1 (+50 * pair)


def draft_rig(stale_row: bool = False):
    """``stale_row``: batch row 2 keeps a finished request's table rows, as
    vLLM leaves them (F22), with no request in it this step."""
    rig = WorkerRig(config=tiny_config(num_layers=3, num_mtp=1, q=Q))
    if stale_row:
        rig.place(2, resident=[0, RESIDENT[0]], host=[HOST[0], 6],
                  hot=list(range(40, 45)))
        rig.batch.req_ids[2] = None
    rig.place(0, resident=[0, RESIDENT[0]], host=[HOST[0], 6],
              hot=list(range(20, 25)))
    rig.place(1, resident=[0, RESIDENT[1]], host=[HOST[1], 10],
              hot=list(range(30, 35)))
    for i, (name, lv) in enumerate(rig.rt.layers.items()):
        fill_pattern(lv.host, seed=10 + i)
    fill_pattern(rig.slab, seed=1)
    rig.batch.schedule(computed=[100, 90], scheduled=[Q, Q])
    md = attn_metadata(rig.batch, 2, 2 * Q)
    rig.worker.start_step(rig.meta(hot_regions_allocated=[20, 30],
                                   hot_region_requests=["r0", "r1"]), md)
    return rig, md


def verify_topk() -> torch.Tensor:
    """Pass 0 / target rows: row i of a request reads host-only positions
    i..i+7 (overlapping across the request's rows: 11 distinct) and
    resident position 70 + i; the rest is -1."""
    topk = torch.full((2 * Q, 64), -1, dtype=torch.int32)
    for t in range(2 * Q):
        i = t % Q
        topk[t, :9] = torch.tensor(list(range(i, i + 8)) + [70 + i])
    return topk


def expected_bytes(rig, layer: str, req: int, pos: int) -> torch.Tensor:
    lv = rig.rt.layers[layer]
    if pos < B:
        return lv.host[HOST[req] * B + pos]
    return lv.resident[50 * lv.pair + RESIDENT[req], pos - B]


def assert_served(rig, layer, rows, topk, row_req) -> None:
    """INV-1: every valid row id reads the bytes of the position it stands
    for in its own request; -1 exactly where top-k is -1."""
    lv, sa = rig.rt.layers[layer], rig.rt.geometry.attention_block_stride
    for t in range(topk.shape[0]):
        req = int(row_req[t])
        for k in range(topk.shape[1]):
            pos, row = int(topk[t, k]), int(rows[t, k])
            assert (row < 0) == (pos < 0), (t, k)
            if pos >= 0:
                got = lv.resident[row // sa, row % sa]
                assert torch.equal(got, expected_bytes(rig, layer, req, pos)), (t, k)


def group_state(groups) -> list[torch.Tensor]:
    return [t.clone() for g in groups for t in (g.dgi, g.lru, g.stats.view(torch.int64))]


def misses(group) -> int:
    return int(group.stats.view(torch.int64)[1])


def hits(group) -> int:
    return int(group.stats.view(torch.int64)[0])


def target_forward(rig, md, topk) -> None:
    for name, lv in rig.rt.layers.items():
        if not lv.is_draft:
            rig.rt.decode_rows(name, 2 * Q, topk, md.seq_lens, md.block_table)


def after_target_forward():
    """A rig whose target forward ran this step (verification top-k), the
    target groups and their state then, and the draft layer's group."""
    rig, md = draft_rig()
    topk = verify_topk()
    target_forward(rig, md, topk)
    targets = [g for g in rig.rt.groups if g.leader != DRAFT]
    return rig, md, topk, targets, group_state(targets), rig.rt.layers[DRAFT].group


def test_pass0_resolves_q_rows_per_request_as_one_union():
    """F3 / INV-36 on the draft group: pass 0's req_id_per_token is the
    target's token rows, so each request's q rows are one union group:
    every distinct host row is loaded once per request (11 misses each, no
    host row or hot slot twice in a plan) and every row reads its own
    request's bytes (INV-1); the target groups' state is untouched (INV-34)."""
    rig, md, topk, targets, before, draft = after_target_forward()
    rt = rig.rt
    assert torch.equal(md.req_id_per_token[:2 * Q], rt.row_req[:2 * Q])
    rt.begin_draft_pass(md.num_decodes, md.num_decode_tokens)
    rows, _ = rt.decode_rows(DRAFT, 2 * Q, topk, md.seq_lens, md.block_table,
                             row_req=md.req_id_per_token)
    assert misses(draft) == 2 * 11 and hits(draft) == 0
    ws = rt.workspace
    for req in (0, 1):
        lines = range(req * Q, (req + 1) * Q)
        src = torch.cat([ws.plan_src[t, :int(ws.plan_count[t])] for t in lines])
        dst = torch.cat([ws.plan_dst[t, :int(ws.plan_count[t])] for t in lines])
        assert src.numel() == 11
        assert src.unique().numel() == 11 and dst.unique().numel() == 11
    assert_served(rig, DRAFT, rows, topk, md.req_id_per_token)
    assert all(torch.equal(a, b) for a, b in zip(before, group_state(targets)))
    rig.worker.finish_forward()


def pass1_inputs(rows: int = 2):
    """Pass 1: one row per request (req_id_per_token = arange), seq_lens
    after the pin's -rejected + 1 (all drafts rejected: p + 2), positions 3
    and 5 (loaded in pass 0), 40 (new) and resident 71."""
    row_req = torch.arange(rows, dtype=torch.int32)
    seq_lens = torch.tensor([102, 92, 92][:rows], dtype=torch.int32)
    topk = torch.full((rows, 64), -1, dtype=torch.int32)
    topk[:2, :4] = torch.tensor([3, 5, 40, 71], dtype=torch.int32)
    return row_req, seq_lens, topk


def test_later_passes_resolve_one_row_per_request():
    """docs/mtp.md 3.3, INV-36 across calls: pass 1 has one row per
    request; each row is resolved for its own request (the target's token
    rows would give row 1 to request 0), hits what pass 0 loaded and loads
    only the new position; the target groups are untouched (INV-34)."""
    rig, md, topk, targets, before, draft = after_target_forward()
    rt = rig.rt
    rt.begin_draft_pass(md.num_decodes, md.num_decode_tokens)
    rt.decode_rows(DRAFT, 2 * Q, topk, md.seq_lens, md.block_table,
                   row_req=md.req_id_per_token)
    row_req, seq_lens, topk1 = pass1_inputs()
    rt.begin_draft_pass(2, 2)
    rows, counts = rt.decode_rows(DRAFT, 2, topk1, seq_lens, md.block_table,
                                  row_req=row_req)
    assert hits(draft) == 2 * 2 and misses(draft) == 2 * 11 + 2
    assert counts.tolist() == [4, 4]
    assert_served(rig, DRAFT, rows, topk1, row_req)
    assert all(torch.equal(a, b) for a, b in zip(before, group_state(targets)))
    rig.worker.finish_forward()


def run_pass1(padded: bool):
    """Pass 0 then pass 1, the latter with a padded drafter row (batch row
    2: no request, req_state -1, stale table rows) when ``padded``."""
    rig, md = draft_rig(stale_row=True)
    rt = rig.rt
    rt.decode_rows(DRAFT, 2 * Q, verify_topk(), md.seq_lens, md.block_table,
                   row_req=md.req_id_per_token)
    row_req, seq_lens, topk = pass1_inputs(3 if padded else 2)
    if padded:
        topk[2, :4] = torch.tensor([3, 6, 41, 72], dtype=torch.int32)
    table = rig.batch.device(rig.layout.SOURCE_GROUP_ID)[:row_req.numel()]
    rows, counts = rt.decode_rows(DRAFT, row_req.numel(), topk, seq_lens,
                                  table, row_req=row_req)
    return rows.clone(), counts.clone(), group_state(rt.groups)


def test_padded_draft_rows_are_inert():
    """INV-33 in a draft pass: a padded drafter row (past the batch's
    requests, req_state -1) gets -1 rows and a zero count, and the state of
    every group, outputs of the real rows included, equals a run without it."""
    rows, counts, state = run_pass1(padded=True)
    ref_rows, ref_counts, ref_state = run_pass1(padded=False)
    assert torch.all(rows[2] == -1) and int(counts[2]) == 0
    assert torch.equal(rows[:2], ref_rows) and torch.equal(counts[:2], ref_counts)
    assert all(torch.equal(a, b) for a, b in zip(state, ref_state))


def test_pass0_must_split_the_batch_as_the_target_did():
    """INV-25 / docs/mtp.md 3.3 (risk 5): the drafter's first pass must
    repeat the target's (num_decodes, num_decode_tokens), for which the
    step's staging plans and mirror descriptors (the rows pass 0 writes)
    were made; later passes (one row per request) and runs outside a step
    (dummy runs, capture) are not checked."""
    rig, md = draft_rig()
    rt = rig.rt
    assert rt.decode_split == (2, 2 * Q)
    rt.begin_draft_pass(2, 2 * Q)
    rt.begin_draft_pass(2, 2)
    rig.worker.finish_forward()
    rt.begin_draft_pass(7, 7)  # no step active
    rig.batch.schedule(computed=[104, 94], scheduled=[Q, Q])
    rig.worker.start_step(rig.meta(), attn_metadata(rig.batch, 1, Q))
    with pytest.raises(RuntimeError, match=r"drafter's first pass .* \(2, 8\)") as err:
        rt.begin_draft_pass(2, 2 * Q, torch.tensor([0, Q, 2 * Q]))
    # What the GPU run needs to find the cause (e2e run 22, MTP 1).
    assert f"query lengths are [{Q}, {Q}]" in str(err.value)
    rig.worker.finish_forward()


def test_pass0_is_checked_against_the_real_batch_not_the_graph_padding():
    """E2E-5 run 22 (MTP 1): a FULL graph padded a 3-request decode batch
    to 4 (the target's metadata split (4, 8)); the drafter's metadata is
    unpadded, (3, 6), and must pass. A real difference still fails."""
    rig = WorkerRig(config=tiny_config(num_layers=3, num_mtp=1, q=Q))
    rig.place(0, resident=[0, RESIDENT[0]], host=[HOST[0], 6], hot=list(range(20, 25)))
    rig.place(1, resident=[0, RESIDENT[1]], host=[HOST[1], 10], hot=list(range(30, 35)))
    rig.batch.schedule(computed=[100, 90], scheduled=[Q, Q])
    padded = attn_metadata(rig.batch, 3, 3 * Q)  # one padding request
    rig.worker.start_step(rig.meta(hot_regions_allocated=[20, 30],
                                   hot_region_requests=["r0", "r1"]), padded)
    rt = rig.rt
    assert rt.decode_split == (2, 2 * Q)
    rt.begin_draft_pass(2, 2 * Q)
    rig.worker.finish_forward()
    rig.batch.schedule(computed=[104, 94], scheduled=[Q, Q])
    rig.worker.start_step(rig.meta(), attn_metadata(rig.batch, 3, 3 * Q))
    with pytest.raises(RuntimeError, match="drafter's first pass"):
        rt.begin_draft_pass(1, Q)
    rig.worker.finish_forward()


# ------------------------------------------- through hisparse_forward_mqa


def sparse_impl(rig, name: str, topk: torch.Tensor, seen: list):
    """The real FlashMLASparseImpl with the layer's real binding; only the
    FP8 FlashMLA decode kernel (CUDA) is replaced by a recorder of the row
    ids the resolver handed it."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl
    from vllm.v1.hisparse.index_groups import HiSparseLayerBinding

    impl = object.__new__(FlashMLASparseImpl)
    impl.topk_indices_buffer = topk
    impl.hisparse = HiSparseLayerBinding(rig.rt, rig.worker, None, name)

    def kernel(q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata):
        seen.append(topk_indices.reshape(-1, topk_indices.shape[-1]).clone())
        return q.new_zeros(*q.shape[:3], 512), None

    impl._fp8_flash_mla_kernel = kernel
    return impl


def with_fp8(md, num_decodes: int, num_decode_tokens: int):
    """The FP8 separate prefill/decode metadata of an all-decode batch."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata

    fp8 = FlashMLASparseMetadata.FP8SeparatePrefillDecode(
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens)
    fp8.decode = FlashMLASparseMetadata.FP8SeparatePrefillDecode.Decode(
        seq_lens=md.seq_lens, kernel_metadata=None,
        decode_query_len=num_decode_tokens // num_decodes)
    md.fp8_extra_metadata = fp8
    return md


def test_draft_binding_resolves_each_pass_with_its_own_rows():
    """INV-1 / INV-36, docs/mtp.md 3.3, through the attention entry point:
    the MTP layer's views say is_draft; pass 0 (the target's
    split) and pass 1 (one row per request, its own req_id_per_token)
    resolve on the draft group with each pass's rows, every row reading its
    own request's bytes, counted as two passes; a target layer keeps its
    binding and the persistent row_req."""
    from vllm.v1.hisparse import index_groups

    rig, md = draft_rig()
    target = rig.layout.sparse_layers[0]
    seen: list = []
    topk = verify_topk()
    heads = torch.zeros(2 * Q, 32, 576)
    impl = sparse_impl(rig, target, topk, seen)
    assert not rig.rt.layers[target].is_draft
    index_groups.hisparse_forward_mqa(impl, heads, None, with_fp8(md, 2, 2 * Q), None)
    impl = sparse_impl(rig, DRAFT, topk, seen)
    assert rig.rt.layers[DRAFT].is_draft
    index_groups.hisparse_forward_mqa(impl, heads, None, md, None)
    assert rig.rt.draft_passes == 1
    row_req, seq_lens, topk1 = pass1_inputs()
    md1 = dataclasses.replace(
        md, num_reqs=2, num_actual_tokens=2, max_query_len=1, seq_lens=seq_lens,
        req_id_per_token=row_req, num_decodes=2, num_decode_tokens=2)
    impl = sparse_impl(rig, DRAFT, topk1, seen)
    index_groups.hisparse_forward_mqa(impl, heads[:2], None, with_fp8(md1, 2, 2),
                                      None)
    assert rig.rt.draft_passes == 2
    assert_served(rig, target, seen[0], topk, md.req_id_per_token)
    assert_served(rig, DRAFT, seen[1], topk, md.req_id_per_token)
    assert_served(rig, DRAFT, seen[2], topk1, row_req)
    rig.worker.finish_forward()
