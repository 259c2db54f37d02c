# SPDX-License-Identifier: Apache-2.0
"""A /metrics exposition in the shape vLLM 0.26.0's server writes
(prometheus_client: HELP/TYPE lines, counters with _total and _created,
histograms, the cache_config_info gauge), plus HiSparse's series as the
metrics branch names them (vllm:hisparse_*), for the parser's tests."""


def histogram(name: str, lab: str, cumulative: dict, total: float) -> list[str]:
    """A prometheus_client histogram: cumulative buckets by upper bound
    (``+Inf`` last), count and sum."""
    out = [f"# TYPE {name} histogram"]
    out += [f'{name}_bucket{{{lab},le="{le}"}} {n}' for le, n in cumulative.items()]
    out += [f"{name}_count{{{lab}}} {list(cumulative.values())[-1]}",
            f"{name}_sum{{{lab}}} {total}", f"{name}_created{{{lab}}} 1.7649e+09"]
    return out


def metrics_text(running=3.0, waiting=1.0, preemptions=2.0, generation=1000.0, hits=90.0,
                 lookups=100.0, h2d=65600.0, engines=("0",), steps=None, itl=None) -> str:
    """``steps`` / ``itl``: (cumulative buckets {le: count}, sum) of
    vLLM's iteration-tokens and inter-token-latency histograms."""
    out = []
    for e in engines:
        lab = f'engine="{e}",model_name="tiny"'
        if steps is not None:
            out += histogram("vllm:iteration_tokens_total", lab, *steps)
        if itl is not None:
            out += histogram("vllm:inter_token_latency_seconds", lab, *itl)
        out += [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {running}",
            f"vllm:num_requests_waiting{{{lab}}} {waiting}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{lab}}} {preemptions}",
            f"vllm:num_preemptions_created{{{lab}}} 1.7649e+09",
            f"vllm:generation_tokens_total{{{lab}}} {generation}",
            f"vllm:prompt_tokens_total{{{lab}}} 5000.0",
            f'vllm:prompt_tokens_by_source_total{{{lab},source="local_compute"}} 3000.0',
            f'vllm:prompt_tokens_by_source_total{{{lab},source="local_cache_hit"}} 1500.0',
            f'vllm:prompt_tokens_by_source_total{{{lab},source="external_kv_transfer"}} 500.0',
            f"vllm:kv_cache_usage_perc{{{lab}}} 0.75",
            f"vllm:prefix_cache_queries_total{{{lab}}} 5000.0",
            f"vllm:prefix_cache_hits_total{{{lab}}} 2000.0",
            f"vllm:external_prefix_cache_queries_total{{{lab}}} 3000.0",
            f"vllm:external_prefix_cache_hits_total{{{lab}}} 500.0",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_bucket{{{lab},le="0.001"}} 0.0',
            f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} 12.0',
            f"vllm:time_to_first_token_seconds_count{{{lab}}} 12.0",
            f"vllm:time_to_first_token_seconds_sum{{{lab}}} 3.5",
            f'vllm:cache_config_info{{block_size="64",cache_dtype="fp8",'
            f'enable_prefix_caching="True",{lab},num_gpu_blocks="3196",'
            f'num_cpu_blocks="None"}} 1.0',
            f"vllm:hisparse_hits_total{{{lab}}} {hits}",
            f"vllm:hisparse_hits_created{{{lab}}} 1.7649e+09",
            f"vllm:hisparse_lookups_total{{{lab}}} {lookups}",
            f"vllm:hisparse_l3_lookups_total{{{lab}}} {lookups - hits}",
            f"vllm:hisparse_host_to_device_bytes_total{{{lab}}} {h2d}",
            f"vllm:hisparse_live_hot_regions{{{lab}}} 4.0",
            f"vllm:hisparse_host_cache_usage_perc{{{lab}}} 0.25",
            "# TYPE vllm:hisparse_host_blocks_total gauge",
            f"vllm:hisparse_host_blocks_total{{{lab}}} 1000.0",
        ]
    return "\n".join(out) + "\n"
