# SPDX-License-Identifier: Apache-2.0
"""benchlib.prom: the /metrics text of a vLLM server -> samples, sums over
engines, label values, bench-agentic's snapshot."""

import math

import pytest
from benchlib import prom
from metrics_sample import metrics_text


def test_parse_line_names_labels_values():
    s = prom.parse_line('vllm:num_requests_running{engine="0",model_name="tiny"} 3.0')
    assert s == prom.Sample("vllm:num_requests_running", {"engine": "0", "model_name": "tiny"},
                            3.0)
    assert prom.parse_line("plain_metric 7 1700000000000") == prom.Sample("plain_metric", {}, 7)
    assert prom.parse_line("empty{} 1e3").value == 1000.0
    assert math.isnan(prom.parse_line("x NaN").value)
    assert prom.parse_line('x{le="+Inf"} +Inf').value == math.inf
    assert prom.parse_line("x -Inf").value == -math.inf


def test_parse_line_label_escapes_and_braces_in_values():
    s = prom.parse_line(r'x{a="b}c",d="q\"uote",e="back\\slash",f="new\nline"} 1')
    assert s.labels == {"a": "b}c", "d": 'q"uote', "e": "back\\slash", "f": "new\nline"}
    assert prom.parse_line('x{a="1", b="2" } 5').labels == {"a": "1", "b": "2"}


@pytest.mark.parametrize("line", ["", "   ", "# HELP x y", "# TYPE x counter",
                                  "x{a=1} 2", 'x{a="1" 2', "x", "x notanumber", "{a} 1"])
def test_parse_line_skips_what_is_not_a_sample(line):
    assert prom.parse_line(line) is None


def test_total_sums_engines_and_filters_labels():
    samples = prom.parse(metrics_text(running=2.0, engines=("0", "1")))
    assert prom.total(samples, "vllm:num_requests_running") == 4.0
    assert prom.total(samples, "vllm:num_requests_running", engine="1") == 2.0
    assert prom.total(samples, "vllm:no_such_series") is None
    assert prom.total(samples, "vllm:prompt_tokens_by_source_total",
                      source="local_cache_hit") == 3000.0


def test_label_values_read_the_cache_config_info():
    samples = prom.parse(metrics_text())
    assert prom.label_values(samples, "vllm:cache_config_info", "num_gpu_blocks") == ["3196"]
    assert prom.label_values(samples, "vllm:cache_config_info", "nope") == []


def test_snapshot_has_the_followed_figures_hisparse_series_and_sources():
    snap = prom.snapshot(metrics_text(running=3.0, waiting=1.0, preemptions=2.0,
                                      generation=1000.0, hits=90.0, lookups=100.0))
    assert snap["running"] == 3.0 and snap["waiting"] == 1.0
    assert snap["preemptions"] == 2.0 and snap["generation_tokens"] == 1000.0
    assert snap["kv_cache_usage"] == 0.75
    assert snap["vllm:hisparse_hits_total"] == 90.0
    assert snap["vllm:hisparse_lookups_total"] == 100.0
    assert snap["vllm:hisparse_live_hot_regions"] == 4.0
    assert "vllm:hisparse_hits_created" not in snap  # timestamps are not figures
    assert snap["prompt_tokens_by_source:external_kv_transfer"] == 500.0


def test_snapshot_of_a_server_without_hisparse_or_some_series():
    snap = prom.snapshot('vllm:num_requests_running{engine="0"} 1\n')
    assert snap["running"] == 1.0 and snap["preemptions"] is None
    assert not [k for k in snap if k.startswith(prom.HISPARSE_PREFIX)]


def test_snapshot_keeps_the_step_histograms_buckets_summed_over_engines():
    """bench-agentic's step figures (P5's where the time goes) read vLLM's
    iteration-tokens and inter-token-latency histograms: every cumulative
    bucket, count and sum, per engine summed; ``_created`` is not a part."""
    text = metrics_text(engines=("0", "1"),
                        steps=({"16": 90, "32": 95, "+Inf": 100}, 2400.0),
                        itl=({"0.01": 80, "0.025": 90, "+Inf": 100}, 0.9))
    snap = prom.snapshot(text)
    it, itl = (lambda part: snap[prom.hist_key("iteration_tokens", part)],
               lambda part: snap[prom.hist_key("itl", part)])
    assert (it("le=16"), it("le=32"), it("le=+Inf"), it("count"), it("sum")) == (
        180, 190, 200, 200, 4800.0)
    assert (itl("le=0.01"), itl("count"), itl("sum")) == (160, 200, 1.8)
    assert not [k for k in snap if k.endswith("created")]
    # a series of another histogram (TTFT) stays out
    assert not [k for k in snap if "time_to_first" in k]
