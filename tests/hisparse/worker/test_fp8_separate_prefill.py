# SPDX-License-Identifier: Apache-2.0
"""Issue 17 item 2 (docs/worker.md K8): fewer than 32 attention heads per
rank. HiSparse serves FlashMLA sparse's FP8 separate prefill/decode path;
patch attention-flashmla-sparse-fp8-separate-prefill keeps that path below
32 heads when config_checks.fp8_separate_prefill says so (HiSparse on, or
a comparison's off arm), where the pin otherwise builds one mixed FP8
batch. These tests drive the real metadata builder's ``build``."""

import inspect
from types import SimpleNamespace

import pytest
from vllm.v1.attention.backends.mla import flashmla_sparse
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseMetadataBuilder,
)


def _built_path(monkeypatch, heads: int, separate: bool) -> str:
    """Which FP8 metadata the real build() makes for ``heads`` per rank."""
    b = object.__new__(FlashMLASparseMetadataBuilder)
    b.num_heads, b.fp8_separate_prefill, b.use_fp8_kv_cache = heads, separate, True
    parent = flashmla_sparse.FlashMLASparseMetadataBuilder.__mro__[1]
    monkeypatch.setattr(parent, "build", lambda self, *a, **k: SimpleNamespace(),
                        raising=False)
    monkeypatch.setattr(b, "_build_fp8_mixed_decode_prefill",
                        lambda cm: "mixed", raising=False)
    monkeypatch.setattr(b, "_build_fp8_separate_prefill_decode",
                        lambda cm, md: "separate", raising=False)
    md = FlashMLASparseMetadataBuilder.build(b, 0, SimpleNamespace())
    assert md.fp8_use_mixed_batch == (md.fp8_extra_metadata == "mixed")
    return md.fp8_extra_metadata


@pytest.mark.parametrize("heads", [8, 16])
def test_below_32_heads_the_switch_keeps_the_separate_path(monkeypatch, heads):
    assert _built_path(monkeypatch, heads, separate=False) == "mixed"  # the pin
    assert _built_path(monkeypatch, heads, separate=True) == "separate"


@pytest.mark.parametrize("heads", [32, 64, 128])
def test_at_32_heads_and_more_nothing_changes(monkeypatch, heads):
    assert _built_path(monkeypatch, heads, separate=False) == "separate"
    assert _built_path(monkeypatch, heads, separate=True) == "separate"


def test_the_builder_asks_hisparse_once_at_construction():
    src = inspect.getsource(FlashMLASparseMetadataBuilder.__init__)
    assert "self.fp8_separate_prefill = fp8_separate_prefill(vllm_config)" in src
