# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Spec 3.5 capacity accounting (target P3): sparse-MLA history beyond
cap_res is reclaimable; indexer/other groups count max_model_len, resident
groups min(pages, cap_res), hot groups cdiv(H, B); the steady-state
concurrency is min(GPU, host)."""

import pytest
from hs_layout_builders import DSV32, GLM, P_FP8, params, specs

from vllm.config import ModelConfig, VllmConfig
from vllm.v1.hisparse.capacity import capacity_report
from vllm.v1.hisparse.layout import build_hisparse_layout
from vllm.v1.hisparse.specs import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    HiSparseSourceSpec,
)

CONTEXT = 100_000
PAGES = 1563  # cdiv(100,000, 64)


def test_request_blocks_glm_100k():
    """3.5: at 100K tokens with 16 pairs, cap_res = cdiv(8192, 64) + 2 = 130:
    admission = 1563 + 16 * 130 + 16 * 64 = 4667 blocks; steady = 1563 +
    16 * 2 + 16 * 64 = 2619 blocks; fully resident 1563 * 17 blocks."""
    layout = build_hisparse_layout(specs(**GLM), params())
    blocks = layout.request_blocks(CONTEXT)
    assert layout.cap_res_pages(CONTEXT) == 130
    assert (blocks.indexer, blocks.resident, blocks.hot, blocks.other, blocks.tail) == (
        PAGES,
        16 * 130,
        16 * 64,
        0,
        16 * 2,
    )
    assert blocks.admission == 4667
    assert blocks.steady == 2619
    assert blocks.fully_resident == PAGES * 17
    assert layout.gpu_bytes_per_request(CONTEXT) == 4667 * 167_936


@pytest.mark.parametrize(
    "max_model_len, admission_tokens, resident_pages",
    [
        (100_000, 8192, 130),  # the in-flight window + 2 tail pages
        (4096, 8192, 64),  # the whole request is smaller than the cap
        (100_000, 142_000, 1563),  # blog's 142K admission limit > context
        (64, 8192, 1),  # one page: the tail is min(pages, 2)
        (8200, 8192, 129),  # 129 pages < cap_res 130: all pages count
    ],
)
def test_cap_res(max_model_len, admission_tokens, resident_pages):
    """Spec 2.4: cap_res = cdiv(min(admission, max_model_len), B) + 2;
    per resident group min(cdiv(max_model_len, B), cap_res)."""
    layout = build_hisparse_layout(
        specs(**DSV32), params(admission_max_tokens=admission_tokens)
    )
    pages = -(-max_model_len // 64)
    cap = -(-min(admission_tokens, max_model_len) // 64) + 2
    assert layout.cap_res_pages(max_model_len) == cap
    assert min(pages, cap) == resident_pages
    blocks = layout.request_blocks(max_model_len)
    assert blocks.resident == 6 * resident_pages
    assert blocks.tail == 6 * min(pages, 2)


def test_steady_state_concurrency_both_branches():
    """3.5: gpu = N / admission below one admission, else 1 + (N - admission)
    / steady; host = N_host / pages; result = min."""
    layout = build_hisparse_layout(specs(**GLM), params())
    small = layout.steady_state_concurrency(2000, 163_680, CONTEXT)
    assert small.gpu == 2000 / 4667
    big = layout.steady_state_concurrency(409_200, 163_680, CONTEXT)
    assert big.gpu == 1 + (409_200 - 4667) / 2619
    assert big.host == 163_680 / PAGES
    assert big.result == big.host < big.gpu


def test_spec_overrides_through_vllm_config():
    """3.5 via vLLM's own interface: the role specs' max_memory_usage_bytes
    with a real VllmConfig (resident min(pages, cap_res) pages, hot
    cdiv(H, B) blocks, source the full host length)."""
    vllm_config = VllmConfig(model_config=ModelConfig(max_model_len=16_384))
    layout = build_hisparse_layout(specs(**DSV32), params())
    resident = layout.kv_cache_groups[2].kv_cache_spec.kv_cache_specs
    hot = layout.kv_cache_groups[8].kv_cache_spec.kv_cache_specs
    source = layout.kv_cache_groups[0].kv_cache_spec.kv_cache_specs
    r = next(iter(resident.values()))
    h = next(iter(hot.values()))
    s = next(iter(source.values()))
    assert isinstance(r, HiSparseResidentSpec) and isinstance(h, HiSparseHotSpec)
    assert isinstance(s, HiSparseSourceSpec)
    assert r.page_size_bytes == h.page_size_bytes == s.page_size_bytes == P_FP8
    assert r.max_memory_usage_bytes(vllm_config) == 130 * P_FP8
    assert h.max_memory_usage_bytes(vllm_config) == 64 * P_FP8
    assert s.max_memory_usage_bytes(vllm_config) == 256 * P_FP8
    # The group-level (UniformType) numbers vLLM would compute agree.
    group = layout.kv_cache_groups[2].kv_cache_spec
    assert group.max_memory_usage_bytes(vllm_config) == 130 * 12 * P_FP8


def test_worked_example_p3():
    """P3 / spec 3.6: 60 sparse layers, top_k 2048, fp8 656-B rows, 100K:
    fully resident 100,032 * 656 * 60 = 3.94 GB vs hot 4096 * 656 * 60 =
    161 MB (154 MiB) + tail 128 * 656 * 60 = 5.0 MB: >= 20x smaller."""
    report = capacity_report(specs(**GLM), params(), CONTEXT, 64 << 30)
    sparse = report["per_request"]["sparse_mla_bytes"]
    assert sparse["fully_resident"] == PAGES * 64 * 656 * 60 == 3_937_259_520
    assert sparse["hybrid_hot"] == 4096 * 656 * 60 == 161_218_560
    assert sparse["hybrid_tail"] == 128 * 656 * 60 == 5_038_080
    assert sparse["hybrid"] == 166_256_640
    assert sparse["fully_resident_over_hybrid"] >= 20
    assert sparse["fully_resident_over_hybrid"] == round(3_937_259_520 / 166_256_640, 2)
