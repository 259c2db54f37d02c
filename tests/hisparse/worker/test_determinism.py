# SPDX-License-Identifier: Apache-2.0
"""T1's bitwise comparison needs one top-k order in both engines: the pin's
indexer top-k kernels emit each row's positions in atomicAdd order, so runs
differ in attention's accumulation order (vllm/v1/hisparse/determinism.py,
patch attention-flashmla-sparse-canonical-topk)."""

import pytest
import torch
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl
from vllm.v1.hisparse import determinism
from vllm.v1.hisparse.determinism import canonicalize_topk


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


def test_pins_forward_mqa_sorts_this_forwards_rows_only_when_asked(monkeypatch):
    """The hook in the real FlashMLASparseImpl.forward_mqa (HiSparse off):
    the rows of this forward's tokens are sorted before the kernels see
    them, the rest of the buffer is untouched, and nothing happens while
    the flag is off."""
    seen = []
    impl = object.__new__(FlashMLASparseImpl)
    impl.hisparse = None
    impl.kv_cache_dtype = "fp8_ds_mla"
    md = type("MD", (), {"fp8_use_mixed_batch": False})()

    def record(q, kv, topk, attn_metadata):
        seen.append(topk.clone())
        return q

    monkeypatch.setattr(impl, "_forward_fp8_kv_separate_prefill_decode", record,
                        raising=False)
    q = torch.zeros(1, 2, 576)
    for flag in (False, True):
        impl.topk_indices_buffer = torch.tensor([[5, 2, -1, 4], [9, 8, 7, 6]],
                                                dtype=torch.int32)
        monkeypatch.setattr(determinism, "CANONICAL_TOPK", flag)
        impl.forward_mqa(q, None, md, None)
        assert impl.topk_indices_buffer[1].tolist() == [9, 8, 7, 6]
    assert seen[0].tolist() == [[5, 2, -1, 4]]
    assert seen[1].tolist() == [[2, 4, 5, -1]]


@pytest.mark.parametrize("flag", [False, True])
def test_hisparse_forward_mqa_sorts_before_resolving(monkeypatch, flag):
    """HiSparse's attention path sorts the same rows the same way before its
    decode rows are resolved, so both arms attend in one order."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata
    from vllm.v1.hisparse import index_groups

    seen = []

    class Runtime:
        geometry = type("G", (), {"max_decode_query_len": 1})()
        layers = {"l": None}

        def decode_rows(self, name, n, topk, seq_lens, block_table):
            seen.append(topk[:n].clone())
            raise StopIteration  # enough: the rows as the resolver got them

    impl = object.__new__(FlashMLASparseImpl)
    impl.topk_indices_buffer = torch.tensor([[5, 2, -1, 4]], dtype=torch.int32)
    impl.hisparse = type("B", (), {"runtime": Runtime(), "layer_name": "l"})()
    fp8 = object.__new__(FlashMLASparseMetadata.FP8SeparatePrefillDecode)
    fp8.num_decode_tokens = 1
    fp8.decode = type("D", (), {"decode_query_len": 1})()
    md = type("MD", (), {"fp8_extra_metadata": fp8, "seq_lens": None,
                         "block_table": None})()
    monkeypatch.setattr(determinism, "CANONICAL_TOPK", flag)
    with pytest.raises(StopIteration):
        index_groups.hisparse_forward_mqa(impl, torch.zeros(1, 2, 576), None, md, None)
    assert seen[0].tolist() == ([[2, 4, 5, -1]] if flag else [[5, 2, -1, 4]])
