# SPDX-License-Identifier: Apache-2.0
"""Prometheus text exposition (a vLLM server's /metrics) -> samples.

parse(text)          every sample: (name, labels, value); comments skipped
total(samples, name, **labels)
                     the sum over the label sets that match (one per engine)
label_values(samples, name, label)
                     the values one label takes in a series (e.g. the
                     ``num_gpu_blocks`` of ``vllm:cache_config_info``)
snapshot(text)       the figures bench-agentic follows over time, one dict
                     (with the cumulative buckets of HISTOGRAMS)

Counters are exposed with a ``_total`` suffix (prometheus_client), so
``vllm:num_preemptions`` reads as ``vllm:num_preemptions_total``.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,)?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(s: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], s)


def number(text: str) -> float:
    special = {"NaN": math.nan, "+Inf": math.inf, "Inf": math.inf, "-Inf": -math.inf}
    return special[text] if text in special else float(text)


def parse_line(line: str) -> Sample | None:
    """One exposition line; None for comments, blanks and lines that are
    not samples."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    m = _NAME.match(line)
    if m is None:
        return None
    name, rest = m.group(0), line[m.end():]
    labels: dict[str, str] = {}
    if rest.startswith("{"):
        body, pos = rest[1:], 0
        while True:
            while body[pos:pos + 1].isspace():
                pos += 1
            if body[pos:pos + 1] == "}":
                break
            lm = _LABEL.match(body, pos)
            if lm is None:
                return None
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
            if lm.group(3) is None:  # no comma: the set must close here
                while body[pos:pos + 1].isspace():
                    pos += 1
                if body[pos:pos + 1] != "}":
                    return None
                break
        rest = body[pos + 1:]
    parts = rest.split()
    if not parts:
        return None
    try:
        return Sample(name, labels, number(parts[0]))
    except ValueError:
        return None


def parse(text: str) -> list[Sample]:
    return [s for s in map(parse_line, text.splitlines()) if s is not None]


def total(samples: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of the series ``name`` over label sets matching ``labels``;
    None when the series is absent."""
    hits = [s.value for s in samples if s.name == name
            and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(hits) if hits else None


def label_values(samples: list[Sample], name: str, label: str) -> list[str]:
    return sorted({s.labels[label] for s in samples if s.name == name and label in s.labels})


HISPARSE_PREFIX = "vllm:hisparse_"
# Gauges whose names end like a counter's (spec 6.5 named the host pool's
# size so): their level is the figure, not a delta.
GAUGES_NAMED_TOTAL = frozenset({"vllm:hisparse_host_blocks_total"})
# bench-agentic's figures: key -> series name
FOLLOWED = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits_total",
    "external_prefix_cache_queries": "vllm:external_prefix_cache_queries_total",
}


# Histograms whose cumulative buckets bench-agentic takes deltas of (key ->
# series): the engine's steps by tokens (count = steps, a decode step has
# one token per running request, a mixed one a prefill chunk beside them)
# and the inter-token latencies the engine stamps (TPOT's parts).
HISTOGRAMS = {
    "iteration_tokens": "vllm:iteration_tokens_total",
    "itl": "vllm:inter_token_latency_seconds",
}
HIST_PREFIX = "hist:"


def hist_key(key: str, part: str) -> str:
    """Snapshot key of one histogram part: ``le=<bound>``, ``count``, ``sum``."""
    return f"{HIST_PREFIX}{key}:{part}"


def _hist_part(s: Sample) -> str | None:
    for key, name in HISTOGRAMS.items():
        if s.name == f"{name}_bucket" and "le" in s.labels:
            return hist_key(key, f"le={s.labels['le']}")
        if s.name in (f"{name}_count", f"{name}_sum"):
            return hist_key(key, s.name.rsplit("_", 1)[1])
    return None


def snapshot(text: str) -> dict[str, float | None]:
    """The followed figures (None where absent) plus every
    ``vllm:hisparse_*`` series (``_created`` timestamps dropped), summed
    over engines, the prompt tokens by source
    (``prompt_tokens_by_source:<source>``) and the HISTOGRAMS' cumulative
    buckets, count and sum (``hist:<key>:<part>``)."""
    samples = parse(text)
    out: dict[str, float | None] = {k: total(samples, n) for k, n in FOLLOWED.items()}
    for s in samples:
        part = _hist_part(s)
        if part is not None:
            out[part] = (out.get(part) or 0.0) + s.value
        elif s.name.startswith(HISPARSE_PREFIX) and not s.name.endswith("_created"):
            out[s.name] = (out.get(s.name) or 0.0) + s.value
        elif s.name == "vllm:prompt_tokens_by_source_total" and "source" in s.labels:
            key = f"prompt_tokens_by_source:{s.labels['source']}"
            out[key] = (out.get(key) or 0.0) + s.value
    return out
