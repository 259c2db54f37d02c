# SPDX-License-Identifier: Apache-2.0
"""T1's bitwise comparison needs one top-k order in both engines: the pin's
indexer top-k kernels emit each row's positions in atomicAdd order, so runs
differ in attention's accumulation order (vllm/v1/hisparse/determinism.py,
patch attention-flashmla-sparse-canonical-topk)."""

import pytest
import torch
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl
from vllm.v1.hisparse.determinism import canonicalize_step_topk, canonicalize_topk


def test_rows_sort_ascending_with_no_position_last():
    topk = torch.tensor([[7, -1, 3, 5, -1], [-1, -1, -1, -1, -1], [4, 2, 9, 1, 0]],
                        dtype=torch.int32)
    canonicalize_topk(topk)
    assert topk.tolist() == [[3, 5, 7, -1, -1], [-1] * 5, [0, 1, 2, 4, 9]]
    again = topk.clone()
    canonicalize_topk(again)
    assert torch.equal(again, topk)  # idempotent: followers sort a sorted row


def test_any_permutation_of_a_row_gives_one_order():
    g = torch.Generator().manual_seed(0)
    row = torch.randperm(4096, generator=g)[:256].to(torch.int32)
    row[200:] = -1
    outs = []
    for _ in range(5):
        perm = row[torch.randperm(256, generator=g)].unsqueeze(0).clone()
        canonicalize_topk(perm)
        outs.append(perm)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert (outs[0][0, :200] >= 0).all() and (outs[0][0, 200:] == -1).all()


def test_only_this_forwards_rows_are_touched():
    buffer = torch.tensor([[3, 1], [2, 0], [9, 8]], dtype=torch.int32)
    canonicalize_step_topk(buffer, (torch.zeros(2, 4), torch.zeros(2, 1)))
    assert buffer.tolist() == [[1, 3], [0, 2], [9, 8]]


@pytest.mark.parametrize("hisparse", [True, False], ids=["on", "off"])
def test_forward_mqa_sorts_before_either_path(monkeypatch, hisparse):
    """The hook in the real FlashMLASparseImpl.forward_mqa sorts the rows
    before the HiSparse path and before the pin's own, and does nothing
    while the flag is off."""
    seen = []
    impl = object.__new__(FlashMLASparseImpl)
    impl.topk_indices_buffer = torch.tensor([[5, 2, -1, 4]], dtype=torch.int32)
    impl.kv_cache_dtype = "fp8_ds_mla"
    q = torch.zeros(1, 2, 576)

    def record(*args, **kwargs):
        seen.append(impl.topk_indices_buffer.clone())
        return q, None

    if hisparse:
        import vllm.v1.hisparse.index_groups as index_groups

        impl.hisparse = object()
        monkeypatch.setattr(index_groups, "hisparse_forward_mqa", record)
    else:
        impl.hisparse = None
        md = type("MD", (), {"fp8_use_mixed_batch": False})()
        monkeypatch.setattr(impl, "_forward_fp8_kv_separate_prefill_decode", record,
                            raising=False)
    monkeypatch.setattr(FlashMLASparseImpl, "canonical_topk", False)
    impl.forward_mqa(q, None, None if hisparse else md, None)
    monkeypatch.setattr(FlashMLASparseImpl, "canonical_topk", True)
    impl.forward_mqa(q, None, None if hisparse else md, None)
    assert seen[0].tolist() == [[5, 2, -1, 4]]
    assert seen[1].tolist() == [[2, 4, 5, -1]]
