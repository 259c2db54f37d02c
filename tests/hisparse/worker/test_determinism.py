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
        layers = {"l": type("V", (), {"is_draft": False})()}

        def decode_rows(self, name, n, topk, seq_lens, block_table, row_req=None):
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


# ------------------------------------------- tie-proof selection (run 17)
#
# The pin's top-k kernels pick among positions whose logits tie at a row's
# k-th place by atomicAdd order; with the canonical flag the indexer selects
# again: the k largest, ties to the lower position.


def _reference(row: list[float], start: int, end: int, k: int) -> list[int]:
    cols = sorted(range(start, end), key=lambda c: (-row[c], c))[:k]
    return sorted(c - start for c in cols) + [-1] * (k - len(cols))


def _sorted_rows(out: torch.Tensor) -> list[list[int]]:
    canonicalize_topk(out)
    return out.tolist()


def test_ties_at_the_kth_place_go_to_the_lower_position():
    logits = torch.tensor([[0.5, 0.0, 0.0, 0.0, 2.0, 0.0, -0.0, 0.0]])
    out = torch.full((1, 3), 99, dtype=torch.int32)
    determinism.select_topk_prefill(logits, torch.tensor([0]), torch.tensor([8]), out)
    # 2.0 and 0.5, then the first of the tied zeros (column 1); -0.0 ranks below +0.0
    assert _sorted_rows(out) == [[0, 1, 4]]


def test_prefill_rows_read_their_own_range_relative_to_its_start():
    g = torch.Generator().manual_seed(3)
    # few distinct values: many ties at every k-th place
    logits = torch.randint(-3, 4, (6, 40), generator=g).float()
    logits[:, 30:] = float("nan")  # outside every range (clean_logits=False)
    starts = torch.tensor([0, 5, 10, 0, 20, 3], dtype=torch.int32)
    ends = torch.tensor([30, 12, 30, 2, 20, 30], dtype=torch.int32)
    out = torch.zeros(6, 8, dtype=torch.int32)
    determinism.select_topk_prefill(logits, starts, ends, out)
    rows = _sorted_rows(out)
    for r in range(6):
        assert rows[r] == _reference(logits[r].tolist(), int(starts[r]), int(ends[r]), 8)


def test_prefill_passes_cover_every_row(monkeypatch):
    monkeypatch.setattr(determinism, "PREFILL_ROWS_PER_PASS", 2)
    logits = torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6) % 4
    out = torch.zeros(5, 3, dtype=torch.int32)
    z = torch.zeros(5, dtype=torch.int32)
    determinism.select_topk_prefill(logits, z, torch.full((5,), 6, dtype=torch.int32), out)
    assert _sorted_rows(out) == [_reference(logits[r].tolist(), 0, 6, 3) for r in range(5)]


@pytest.mark.parametrize("two_d", [True, False])
def test_decode_rows_end_at_their_sequence_length(two_d):
    """Row b * next_n + j of a decode with next_n tokens per request ends at
    seq_lens[b, j] (2-D, as the pin passes it) or seq_lens[b] - next_n + j + 1."""
    g = torch.Generator().manual_seed(5)
    next_n = 2
    logits = torch.randint(0, 3, (6, 16), generator=g).float()
    per_row = torch.tensor([[9, 10], [3, 4], [0, 0]], dtype=torch.int32)  # last: padding
    seq_lens = per_row if two_d else per_row[:, -1].contiguous()
    out = torch.zeros(6, 4, dtype=torch.int32)
    determinism.select_topk_decode(logits, seq_lens, next_n, out)
    ends = per_row.reshape(-1).tolist()
    assert _sorted_rows(out) == [_reference(logits[r].tolist(), 0, ends[r], 4) for r in range(6)]


def test_selection_is_a_function_of_the_logits_alone():
    """Any permutation of where the tied values sit gives the positions the
    reference gives: nothing depends on an order of arrival."""
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        logits = torch.randint(0, 2, (3, 64), generator=g).float()
        out = torch.zeros(3, 16, dtype=torch.int32)
        determinism.select_topk_prefill(logits, torch.zeros(3, dtype=torch.int32),
                                        torch.full((3,), 64, dtype=torch.int32), out)
        assert _sorted_rows(out) == [_reference(logits[r].tolist(), 0, 64, 16) for r in range(3)]


def test_a_row_narrower_than_k_fills_minus_one():
    out = torch.zeros(1, 5, dtype=torch.int32)
    determinism.select_topk_decode(torch.tensor([[1.0, 3.0, 2.0]]),
                                   torch.tensor([[3]], dtype=torch.int32), 1, out)
    assert _sorted_rows(out) == [[0, 1, 2, -1, -1]]


def test_the_indexer_selects_again_only_when_asked():
    """The hooks in the pin's sparse_attn_indexer (patch
    attention-flashmla-sparse-canonical-topk): after each top-k kernel, and
    guarded by the flag."""
    import inspect

    from vllm.model_executor.layers import sparse_attn_indexer as indexer

    src = inspect.getsource(indexer)
    for call in ("determinism.select_topk_prefill(", "determinism.select_topk_decode("):
        at = src.index(call)
        assert "if determinism.CANONICAL_TOPK:" in src[src.rindex("\n", 0, at) - 200:at]
