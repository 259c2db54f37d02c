# SPDX-License-Identifier: Apache-2.0
"""tests/e2e/metrics_check.py on CPU (spec 6.5): its parser reads vLLM's
real Prometheus exposition of the HiSparse series, and its pass/fail rules
hold a pressured server to moving counters and a calm one to zeros."""

import importlib.util
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest

from tests.hisparse.scheduler.conftest import build  # noqa: F401  (fixture)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.metrics import (
    HiSparseConnectorStats,
)
from vllm.v1.hisparse import metrics as m
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats

SCRIPT = Path(__file__).resolve().parents[2] / "e2e" / "metrics_check.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("metrics_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_reads_every_series_of_a_real_exposition(build, script):
    s, _ = build()
    prom = PrometheusStatLogger(s.vllm_config, engine_indexes=[0, 1])
    report = HiSparseConnectorStats.of(m.MetricsReport(
        counters={m.HITS: 3, m.LOOKUPS: 4, m.L3_LOOKUPS: 1},
        gauges={m.PENDING_SPILLS: 2}))
    for engine in (0, 1):
        prom.record(SchedulerStats(kv_connector_stats=report.data), None,
                    engine_idx=engine)
    series = script.parse(generate_latest(REGISTRY).decode())
    expected = {name + ("_total" if spec.kind == m.COUNTER else "")
                for name, spec in m.METRICS.items()}
    assert set(series) == expected
    assert series["vllm:hisparse_hits_total"] == 6  # summed over engines
    assert series["vllm:hisparse_pending_spills"] == 4
    assert series["vllm:hisparse_lost_pages_total"] == 0


def arms(pressure_delta: dict, calm_after: dict) -> dict:
    every = {n: 0.0 for n in ("vllm:hisparse_live_hot_regions",
                              "vllm:hisparse_staging_blocks_used",
                              "vllm:hisparse_hits_total",
                              "vllm:hisparse_lookups_total",
                              "vllm:hisparse_l3_lookups_total",
                              "vllm:hisparse_lost_pages_total",
                              "vllm:hisparse_host_to_device_bytes_total",
                              "vllm:hisparse_scheduler_waits_total",
                              "vllm:hisparse_admission_backoffs_total")}
    calm = {**every, **calm_after}
    return {
        "pressure": {"delta": pressure_delta, "after": {**every, **pressure_delta}},
        "calm": {"delta": {"vllm:hisparse_spills_completed_total": 5.0, **calm},
                 "after": calm},
    }


def test_check_passes_and_fails_where_it_should(script):
    moved = {name: 10.0 for name in script.COUNTERS_UNDER_PRESSURE}
    assert script.check(arms(moved, {})) == []
    stuck = {**moved, "vllm:hisparse_lookups_total": 0.0}
    assert any("lookups_total did not move" in f for f in script.check(arms(stuck, {})))
    leaked = script.check(arms(moved, {"vllm:hisparse_l3_lookups_total": 3.0}))
    assert any(f.startswith("calm: vllm:hisparse_l3_lookups_total") for f in leaked)


def test_the_pressure_arm_sends_a_request_the_pool_cannot_hold(script):
    """Issue 17 item 3: on the H200 (results/e2e run 12) the pressure
    server's 5K, 3K and 0.7K prompts each fit its 450-block pool and no
    counter moved. Its first prompt is now the gate's single12k shape,
    which the real scheduler (simulated worker) cannot keep resident at the
    same pool and chunk: pages are lost and rows come from the host."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import serve_check
    import simulate_pressure
    from e2e_workload import scenario

    assert "--num-gpu-blocks-override" in serve_check.HISPARSE_FLAGS
    blocks = int(serve_check.HISPARSE_FLAGS[
        serve_check.HISPARSE_FLAGS.index("--num-gpu-blocks-override") + 1])
    spec = simulate_pressure.engine_specs()["on_c2k"]
    assert (blocks, serve_check.CHUNK) == (spec["blocks"], spec["chunk"])
    (turn,), = scenario("single12k")
    assert script.PROMPT_LENS[0] == len(turn.new)
    got = simulate_pressure.simulate("on_c2k", "single12k", host_blocks=12000)
    assert got["finished"] and got["lost_pages"] > 0
