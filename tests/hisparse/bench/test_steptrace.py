# SPDX-License-Identifier: Apache-2.0
"""steptrace.py: where a serving step's time goes, from the engine's
torch-profiler trace (bench-agentic --profile-level; issue 16 item 2's
"where the time goes" behind P5)."""

import pytest
from benchlib import steptrace
from fake_trace import serving_steps, step, write_trace


def test_steps_are_classified_and_timed_by_cycle(tmp_path):
    """P5: a decode step's cycle is a running request's time per token; a
    mixed step carries prefill chunks beside the decodes."""
    s = steptrace.summarize(write_trace(tmp_path / "t.pt.trace.json.gz", serving_steps(40)))
    # 40 annotations: the last only closes the window
    assert s["steps"] == 39
    dec, mix = s["by_kind"]["decode"], s["by_kind"]["mixed"]
    assert (dec["steps"], mix["steps"]) == (32, 7)
    assert "prefill" not in s["by_kind"]
    assert dec["cycle_us_mean"] == dec["cycle_us_median"] == 4000.0
    assert mix["cycle_us_mean"] == 9000.0
    assert s["window_ms"] == pytest.approx((32 * 4000 + 7 * 9000) / 1e3)
    assert dec["share_of_window"] == pytest.approx(128000 / 191000, abs=1e-4)
    assert (dec["decode_reqs_mean"], mix["decode_reqs_mean"]) == (7.0, 6.0)
    assert (mix["prefill_reqs_mean"], mix["prefill_tokens_mean"]) == (1.0, 2048.0)
    assert s["generation_tokens_per_s"] == pytest.approx((32 * 7 + 7 * 6) / 0.191, abs=0.1)


def test_gpu_time_goes_to_the_step_that_launched_it(tmp_path):
    """The GPU runs 6 ms behind the host (longer than a decode cycle):
    attribution by launch keeps each step's kernels with it; attribution by
    GPU timestamp would move the mixed steps' 3 ms GEMM into decode steps."""
    s = steptrace.summarize(write_trace(tmp_path / "t.pt.trace.json.gz", serving_steps(40),
                                        gpu_lag_us=6000.0))
    dec, mix = s["by_kind"]["decode"], s["by_kind"]["mixed"]
    assert dec["gpu_us_per_step"] == {"attention": 120.0, "gemm": 200.0, "hisparse": 15.0,
                                      "memcpy_HtoD": 50.0}
    assert mix["gpu_us_per_step"]["gemm"] == 3200.0
    assert dec["kernel_us_per_step"] == 335.0  # copies are not kernels
    assert dec["gpu_busy_share"] == pytest.approx(335 / 4000, abs=1e-4)
    assert dec["copy_bytes_per_step"] == {"memcpy_HtoD": 1 << 20}
    # host side: CUDA API calls per step, the blocking ones' time apart
    assert (dec["cuda_api_calls_per_step"], mix["cuda_api_calls_per_step"]) == (5.0, 7.0)
    assert (dec["host_sync_us_per_step"], mix["host_sync_us_per_step"]) == (0.0, 300.0)
    rt = {r["name"]: r for r in s["top_runtime_calls"]}
    assert rt["cudaStreamSynchronize"]["sync"] and not rt["cudaLaunchKernel"]["sync"]
    assert rt["cudaStreamSynchronize"]["count"] == 8
    # the last annotation's launches fall after every cycle: reported, not spread
    assert s["unattributed_us"]["gemm"] == 3200.0
    top = s["top_kernels"]
    assert top[0]["name"] == "sm90_xmma_gemm" and top[0]["count"] == 8
    assert top[0]["total_us"] == 24000.0 and top[0]["category"] == "gemm"


def test_prefill_only_steps_and_an_empty_trace(tmp_path):
    steps = [step(ctx_reqs=2, ctx_tokens=4096, gen_reqs=0, gen_tokens=0, cycle_us=20000.0,
                  kernels=[("nvjet_gemm", 15000.0)])] * 3
    s = steptrace.summarize(write_trace(tmp_path / "p.pt.trace.json.gz", steps))
    assert list(s["by_kind"]) == ["prefill"] and s["by_kind"]["prefill"]["steps"] == 2
    assert s["generation_tokens_per_s"] == 0.0
    empty = steptrace.summarize(write_trace(tmp_path / "e.pt.trace.json.gz", []))
    assert empty["steps"] == 0 and "by_kind" not in empty


@pytest.mark.parametrize("name,cat", [
    ("void resolve_residency_kernel<4, true>(...)", "hisparse"),
    ("gather_ordered_kernel", "hisparse"),
    ("flash_fwd_splitkv_mla_kernel", "attention"),
    ("deep_gemm::fp8_mqa_logits", "indexer"),
    ("nvjet_tst_192x8_64x4", "gemm"),
    ("triton_poi_fused_add_0", "fused"),
    ("vectorized_elementwise_kernel", "other"),
])
def test_kernel_categories(name, cat):
    assert steptrace.category(name) == cat


def test_find_traces_oldest_first(tmp_path):
    a = write_trace(tmp_path / "x" / "a.pt.trace.json.gz", serving_steps(3))
    b = write_trace(tmp_path / "x" / "b.pt.trace.json.gz", serving_steps(3))
    (tmp_path / "x" / "profiler_out_0.txt").write_text("table")
    import os
    os.utime(a, (1, 1))
    assert steptrace.find_traces(tmp_path) == [a, b]


def test_table_has_a_row_per_arm_and_kind(tmp_path):
    s = steptrace.summarize(write_trace(tmp_path / "t.pt.trace.json.gz", serving_steps(40)))
    rows = steptrace.table({"hisparse": s, "offload": s}).splitlines()
    assert len(rows) == 2 + 4
    assert rows[2].startswith("| hisparse | decode | 32 | 0.67 | 4000 | 7.0 | 0 | 15 | 0 | 120 | 200")
    assert rows[3].endswith("| 0.37 | 7 | 300 |")
    assert rows[3].startswith("| hisparse | mixed | 7 |")
