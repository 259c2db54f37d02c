# SPDX-License-Identifier: Apache-2.0
"""bench-tax's pure logic (benchlib.tax): the arms' engine arguments (checked
by vLLM's own EngineArgs on the CPU platform), the no-pressure pool sizes
against the real HiSparse layout, the plan and its duration against the
device budget, summaries, ratios, the fixed + per-layer fit, the profile
breakdown, merging and the verdicts."""

import json
import sys
import time

import pytest
import vllm_graphs
from benchlib import tax, targets
from benchlib.engine_worker import prompts_for, to_configs

DOC_COMMANDS = {  # docs/benchmarks.md: one device call each
    "tax-4": dict(modes=["default", "fdo"], layers=[4],
                  arms=["off", "on", "on_offload", "on_lazy"], profile=True,
                  profile_batches=[16]),
    # P2's split on GLM-5.x's IndexShare geometry (flat at 8..64 layers)
    "tax-split-default": dict(modes=["default"], layers=[8, 32], index_topk_freq=4),
    "tax-split-fdo": dict(modes=["fdo"], layers=[8, 32], index_topk_freq=4),
    "tax-upstream": dict(modes=["default", "fdo"], layers=[4], arms=["u_off", "u_on"],
                         profile=True, profile_batches=[16]),
    "mirror": dict(modes=["default", "fdo"], layers=[4], arms=["on", "on_lazy"], batches=[16]),
}


def cfg(**kw) -> tax.TaxConfig:
    c = tax.TaxConfig(**kw)
    c.validate()
    return c


# --------------------------------------------------------------- config


@pytest.mark.parametrize("bad, match", [
    (dict(arms=["nope"]), "unknown arm"), (dict(modes=["graph"]), "unknown mode"),
    (dict(reps=0), "reps"), (dict(n=0), "new-tokens"),
    (dict(prompt_len=16300), "exceeds max_model_len"), (dict(weights="real"), "weights"),
    (dict(gpu_memory_utilization=1.5), "gpu-memory"), (dict(arms=[]), "no arm"),
    (dict(profile=True, profile_batches=[4]), "profile-batches"),
])
def test_config_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        cfg(**bad)


def test_llm_kwargs_per_arm():
    c = cfg(arms=list(tax.ARMS))
    off = tax.llm_kwargs(c, "off", "default", 4, "/m")
    assert off["attention_config"] == {"sparse_mla_force_mqa": True}
    assert "kv_transfer_config" not in off and "compilation_config" not in off
    on = tax.llm_kwargs(c, "on", "fdo", 4, "/m")
    hs = on["attention_config"]["hisparse_config"]
    assert hs["admission_max_tokens"] == c.max_model_len and hs["eager_host_mirror"] is True
    assert on["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert tax.llm_kwargs(c, "on_lazy", "default", 4, "/m")["attention_config"][
        "hisparse_config"]["eager_host_mirror"] is False
    # K7's zero-miss cost (P9 / P2): the on arm plus order_misses="step"
    step = tax.llm_kwargs(c, "on_step", "default", 4, "/m")["attention_config"]["hisparse_config"]
    assert step == {**tax.llm_kwargs(c, "on", "default", 4, "/m")["attention_config"][
        "hisparse_config"], "order_misses": "step"}
    assert "order_misses" not in hs
    kv = tax.llm_kwargs(c, "on_offload", "default", 4, "/m")["kv_transfer_config"]
    assert kv["kv_connector"] == "OffloadingConnector"
    assert kv["kv_connector_extra_config"]["spec_name"] == "TieringOffloadingSpec"
    u = tax.llm_kwargs(c, "u_on", "default", 4, "/m")
    assert u["kv_transfer_config"]["kv_connector"] == "HiSparseConnector"
    assert u["attention_config"] == {"sparse_mla_force_mqa": True}
    assert tax.llm_kwargs(c, "off", "eager", 4, "/m")["enforce_eager"] is True
    # every arm: the same model, pool, batch limit and prefill path
    for arm in tax.ARMS:
        kw = tax.llm_kwargs(c, arm, "default", 32, "/m")
        assert kw["max_num_seqs"] == 16 and kw["kv_cache_memory_bytes"] == c.kv_bytes(32)
        json.dumps(kw)  # the spec travels as JSON


def test_compilation_extra_reaches_only_its_arms():
    c = cfg(arms=["off", "u_off"], compilation_extra={"cudagraph_capture_sizes": [1, 16]},
            upstream_compilation_extra={"mode": 0})
    assert tax.llm_kwargs(c, "off", "fdo", 4, "/m")["compilation_config"] == {
        "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 16]}
    assert tax.llm_kwargs(c, "u_off", "default", 4, "/m")["compilation_config"] == {"mode": 0}


@pytest.mark.parametrize("arm", ["off", "on", "on_offload", "off_offload", "on_lazy", "on_step"])
@pytest.mark.parametrize("mode", ["default", "fdo"])
def test_vllm_accepts_our_engine_arguments(arm, mode, tmp_path):
    """vLLM's own EngineArgs -> VllmConfig on the CPU platform: the keys,
    the HiSparse config and the composed connector resolve as intended."""
    import cpu_noclean  # noqa: F401  (the CPU platform)
    import subprocess
    import sys

    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    from benchlib import common

    model = tmp_path / "m"
    subprocess.run([sys.executable, str(common.MAKE_MODEL), str(model)], check=True,
                   capture_output=True)
    kw = to_configs(tax.llm_kwargs(cfg(arms=[arm]), arm, mode, 4, str(model)), "ours")
    if "compilation_config" in kw:
        kw["compilation_config"] = CompilationConfig(**kw["compilation_config"])
    vc = EngineArgs(**kw).create_engine_config()
    assert vc.attention_config.sparse_mla_force_mqa is True  # same prefill path everywhere
    hs = vc.attention_config.hisparse_config
    assert (hs is not None) == (arm not in ("off", "off_offload"))
    if hs is not None:
        assert hs.admission_max_tokens == vc.model_config.max_model_len
        assert hs.eager_host_mirror == (arm != "on_lazy")
        assert hs.order_misses == ("step" if arm == "on_step" else None)
    connector = vc.kv_transfer_config.kv_connector if vc.kv_transfer_config else None
    assert connector == {"off": None, "on": "HiSparseConnector", "on_lazy": "HiSparseConnector",
                         "on_step": "HiSparseConnector", "on_offload": "MultiConnector",
                         "off_offload": "OffloadingConnector"}[arm]
    assert vc.cache_config.kv_cache_memory_bytes == kw["kv_cache_memory_bytes"]


@pytest.mark.parametrize("layers, freq", [(4, 1), (32, 1), (8, 4), (32, 4)])
def test_auto_pools_hold_every_prompt_fully_resident(layers, freq):
    """No pressure by construction: the GPU pool holds every batch's prompts
    fully resident (one indexer + every resident group's page per 64
    tokens, the real layout's bytes per block) with room to spare, and the
    startup minimum (one max_model_len request admitted whole); the host
    pool holds every prompt's pages too."""
    from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
    from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config

    c = cfg(layers=[layers], index_topk_freq=freq)
    hf = {**tax.TINY_ATTENTION, "num_hidden_layers": layers, "index_topk_freq": freq}
    params = HiSparseParams(index_topk=256, max_decode_query_len=1, device_buffer_size=512,
                            admission_max_tokens=c.max_model_len, host_pool_bytes=0)
    lay = build_hisparse_layout(kv_cache_specs_from_hf_config(hf, block_size=64), params)
    tokens_per_prompt = c.prompt_len + c.n + c.m
    need = sum(c.batches) * lay.request_blocks(tokens_per_prompt).fully_resident \
        * lay.bytes_per_block
    assert need * 1.5 <= c.kv_bytes(layers)
    assert lay.gpu_bytes_per_request(c.max_model_len) <= c.kv_bytes(layers)
    # the host pool: every prompt's pages (the eager mirror writes them all)
    pages = -(-tokens_per_prompt // 64)
    host_need = sum(c.batches) * pages * lay.host_block_stride(False)
    assert host_need * 1.5 <= c.host_gib(layers) * tax.GIB


def test_prompts_are_the_same_in_every_arm_and_differ_by_batch():
    a, b = prompts_for(8, 100, 0), prompts_for(8, 100, 0)
    assert a == b and len(a) == 8 and all(len(p["prompt_token_ids"]) == 100 for p in a)
    assert prompts_for(16, 100, 0)[:8] != a
    assert all(2 <= t < 8192 for p in a for t in p["prompt_token_ids"])


def test_the_tiny_attention_shapes_are_the_generated_models(tmp_path):
    """The layout check reads TINY_ATTENTION; it must be what
    make_tiny_glm5.py writes (and ensure_model builds with the freq)."""
    from benchlib import common

    path = common.ensure_model(tmp_path / tax.model_dir_name(8, 4), 8, 16384,
                               index_topk_freq=4)
    hf = json.loads((path / "config.json").read_text())
    assert {k: hf[k] for k in tax.TINY_ATTENTION} == tax.TINY_ATTENTION
    assert hf["num_hidden_layers"] == 8 and hf["index_topk_freq"] == 4
    assert tax.model_dir_name(4) == "tiny_glm5_L4" != tax.model_dir_name(4, 2)


def test_merge_refuses_runs_of_different_models():
    base = {"schema": tax.SCHEMA, "samples": [], "runs": [{}]}
    with pytest.raises(ValueError, match="different models"):
        tax.merge([{**base, "config": {"index_topk_freq": 1}},
                   {**base, "config": {"index_topk_freq": 4}}], ["a.json", "b.json"])


# ----------------------------------------------------------------- plan


def test_engines_and_groups():
    c = cfg(modes=["default", "fdo"], layers=[4, 32], arms=["off", "on"])
    assert tax.groups(c) == [("default", 4), ("fdo", 4), ("default", 32), ("fdo", 32)]
    assert len(tax.engines(c)) == 8
    assert tax.engine_key("fdo", 32, "on") == "fdo/L32/on"


@pytest.mark.parametrize("name", sorted(DOC_COMMANDS))
def test_documented_commands_fit_one_device_call(name):
    """The prior says each documented command ends within its budget (the
    run stops sampling at --budget anyway; this keeps the docs honest)."""
    c = cfg(**DOC_COMMANDS[name])
    assert tax.estimate_s(c)["total_s"] <= c.budget_s


def test_estimate_grows_with_the_work():
    small, big = tax.estimate_s(cfg()), tax.estimate_s(cfg(reps=10, layers=[4, 32]))
    assert big["measure_s"] > 2 * small["measure_s"]
    assert big["engine_starts_s"] > small["engine_starts_s"]


# ------------------------------------------------------------ summaries


def samples(step_ms: dict, reps=5, run=0, n=128, m=16, drift=0.0):
    """Synthetic samples: arm -> {(mode, layers, batch): ms per step};
    ``drift`` adds ms per position in time (alternation cancels it)."""
    out, t = [], 0
    from benchlib import stats

    cells = sorted({k for v in step_ms.values() for k in v})
    for mode, L, b in cells:
        arms = [a for a in step_ms if (mode, L, b) in step_ms[a]]
        for rep, order in enumerate(stats.alternation(arms, reps)):
            for pos, arm in enumerate(order):
                ms = step_ms[arm][(mode, L, b)] + drift * t
                t += 1
                short = 0.1 + m * ms / 1e3
                out.append(tax.sample_record(run=run, mode=mode, layers=L, batch=b, rep=rep,
                                             arm=arm, position=pos, t_short_s=short,
                                             t_long_s=short + n * ms / 1e3, n=n))
    return out


def test_summary_ratios_and_tax():
    s = tax.summarize(samples({"off": {("default", 4, 1): 2.0}, "on": {("default", 4, 1): 2.1}}))
    cell = s["default"]["4"]["1"]
    assert cell["arms"]["off"]["median"] == pytest.approx(2.0)
    assert cell["ratios"]["on/off"]["ratio_of_medians"] == pytest.approx(1.05)
    assert cell["ratios"]["on/off"]["pairwise"]["median"] == pytest.approx(1.05)
    assert cell["tax_us"] == pytest.approx(100.0)


def test_alternation_cancels_a_drift_in_the_ratio():
    even = samples({"off": {("fdo", 4, 8): 3.0}, "on": {("fdo", 4, 8): 3.0}}, reps=6,
                   drift=0.01)
    r = tax.summarize(even)["fdo"]["4"]["8"]["ratios"]["on/off"]
    assert r["ratio_of_medians"] == pytest.approx(1.0, abs=1e-3)


def test_fit_recovers_fixed_and_per_layer():
    # tax = 40 us + 3 us x layers at batch 16 in both modes
    step = {"off": {}, "on": {}}
    for mode in ("default", "fdo"):
        for L in (4, 32):
            step["off"][(mode, L, 16)] = 1.0 + 0.3 * L
            step["on"][(mode, L, 16)] = step["off"][(mode, L, 16)] + (40 + 3 * L) / 1e3
    summary = tax.summarize(samples(step))
    fit = tax.fits(summary)
    assert fit["fdo"]["16"]["fixed_us"] == pytest.approx(40.0, abs=1e-6)
    assert fit["fdo"]["16"]["per_layer_us"] == pytest.approx(3.0, abs=1e-6)
    v = tax.evaluate(summary)["P2_split"]
    assert v["pass"] is True and set(v["measured"]) == {"default/batch16", "fdo/batch16"}


def test_fit_needs_two_layer_counts():
    summary = tax.summarize(samples({"off": {("default", 4, 1): 1.0},
                                     "on": {("default", 4, 1): 1.1}}))
    assert tax.fits(summary) == {}
    assert tax.evaluate(summary)["P2_split"]["pass"] is None


def test_p2_is_read_on_the_tiny_model_only():
    s = tax.summarize(samples({"off": {("default", 32, 1): 8.0},
                               "on": {("default", 32, 1): 8.1}}))
    assert tax.evaluate(s)["P2"]["pass"] is None  # a 32-layer run alone says nothing of P2


def test_evaluate_p2_uses_the_tiny_model_and_p6_batch16():
    step = {"off": {}, "on": {}, "on_lazy": {}, "on_offload": {}}
    for mode in ("default", "fdo"):
        for b in (1, 8, 16):
            step["off"][(mode, 4, b)] = 2.0
            step["on"][(mode, 4, b)] = 2.1
            step["off"][(mode, 32, b)] = 8.0
            step["on"][(mode, 32, b)] = 12.0  # at 32 layers the ratio would fail
        step["on_lazy"][(mode, 4, 16)] = 2.05
        step["on_offload"][(mode, 4, 16)] = 2.1
    v = tax.evaluate(tax.summarize(samples(step)))
    assert v["P2"]["pass"] is True
    assert v["P6"]["pass"] is True and v["P6"]["measured"]["fdo"]["ratio"] == pytest.approx(
        2.1 / 2.05, abs=1e-4)
    assert v["offload_adds_nothing"]["pass"] is True
    assert v["P8_tax"]["pass"] is None


def test_offload_verdict_sets_the_connector_beside_hisparse_against_it_alone():
    """issue 16 item 1 ("the OffloadingConnector beside it adds nothing"):
    on_offload/on is the verdict; off_offload/off, where measured, is the
    connector's own cost without HiSparse, and their quotient what the
    composition adds."""
    step = {"off": {("fdo", 4, 1): 2.0}, "on": {("fdo", 4, 1): 2.2},
            "on_offload": {("fdo", 4, 1): 2.42}, "off_offload": {("fdo", 4, 1): 2.2}}
    v = tax.evaluate(tax.summarize(samples(step)))["offload_adds_nothing"]
    cell = v["measured"]["fdo/batch1"]
    assert v["pass"] is False and cell["ratio"] == pytest.approx(1.1, abs=1e-3)
    assert cell["alone"] == pytest.approx(1.1, abs=1e-3)
    assert cell["composition"] == pytest.approx(1.0, abs=1e-3)
    del step["off_offload"]
    cell = tax.evaluate(tax.summarize(samples(step)))["offload_adds_nothing"]["measured"][
        "fdo/batch1"]
    assert "alone" not in cell and "composition" not in cell


def test_p8_tax_from_merged_runs():
    ours = samples({"off": {("fdo", 4, 8): 2.0}, "on": {("fdo", 4, 8): 2.4}}, run=0)
    up = samples({"u_off": {("fdo", 4, 8): 2.5}, "u_on": {("fdo", 4, 8): 4.9}}, run=0)
    reports = [tax.build_report(cfg=None, command="a", samples=ours, engines_info={},
                                profiles={}, runs=[{}], failures=[]),
               tax.build_report(cfg=None, command="b", samples=up, engines_info={"x": {}},
                                profiles={}, runs=[{}], failures=["late"])]
    merged = tax.merge(reports, ["ours.json", "upstream.json"])
    assert merged["targets"]["P8_tax"]["pass"] is True
    assert merged["targets"]["P8_tax"]["measured"]["fdo/batch8"]["ours"] == pytest.approx(1.2)
    assert {s["run"] for s in merged["samples"]} == {0, 1}
    assert merged["failures"] == ["upstream.json: late"] and "run1:x" in merged["engines"]
    with pytest.raises(ValueError, match="not a bench-tax"):
        tax.merge([{"schema": "other"}], ["x.json"])


def test_ratio_pairs_the_same_repetition_of_the_same_run():
    a = samples({"on": {("default", 4, 1): 2.0}}, reps=2, run=0) + \
        samples({"on": {("default", 4, 1): 4.0}}, reps=2, run=1)
    b = samples({"off": {("default", 4, 1): 1.0}}, reps=2, run=0) + \
        samples({"off": {("default", 4, 1): 2.0}}, reps=2, run=1)
    r = tax.ratio(a, b, "p2")
    assert r["pairwise"]["min"] == pytest.approx(2.0) and r["pairwise"]["max"] == pytest.approx(2.0)


def test_ratio_carries_a_bootstrap_interval_over_its_repetitions():
    """P2's resolution: the headline ratio comes with the 90% interval of
    the same statistic over the paired repetitions; P2's verdict and the
    A/A control carry it, and a noisy cell is named unresolved."""
    steady = samples({"off": {("fdo", 4, 16): 2.0}, "on": {("fdo", 4, 16): 2.1},
                      "off_b": {("fdo", 4, 16): 2.0}}, reps=6)
    r = tax.summarize(steady)["fdo"]["4"]["16"]["ratios"]["on/off"]
    assert r["interval90"] == pytest.approx([1.05, 1.05])
    noisy = [dict(s) for s in steady]
    for s in noisy:  # every other repetition of on runs 30% slow
        if s["arm"] == "on" and s["rep"] % 2:
            s["ms_per_step"] *= 1.3
    summary = tax.summarize(noisy)
    lo, hi = summary["fdo"]["4"]["16"]["ratios"]["on/off"]["interval90"]
    assert lo == pytest.approx(1.05) and hi == pytest.approx(1.05 * 1.3)
    v = tax.evaluate(summary)
    cell = v["P2"]["measured"]["fdo/batch16"]
    assert cell["resolved"] is False and v["P2"]["unresolved"] == ["fdo/batch16"]
    assert v["aa_control"]["measured"]["fdo/batch16"]["interval90"] == [1.0, 1.0]
    two = samples({"off": {("fdo", 4, 1): 2.0}, "on": {("fdo", 4, 1): 2.1}}, reps=2)
    assert tax.summarize(two)["fdo"]["4"]["1"]["ratios"]["on/off"]["interval90"] is None


def test_report_schema():
    rep = tax.build_report(cfg=cfg(), command="scripts/bench-tax", samples=samples(
        {"off": {("default", 4, 1): 1.0}, "on": {("default", 4, 1): 1.2}}), engines_info={},
        profiles={}, runs=[{"started": "x"}], failures=[])
    assert rep["schema"] == tax.SCHEMA
    for key in ("command", "config", "arms", "modes", "method", "runs", "engines", "summary",
                "fit", "device_fit", "targets", "profile", "profile_diff", "samples",
                "failures"):
        assert key in rep
    assert set(rep["targets"]) == {"P2", "P2_split", "P6", "P8_tax", "offload_adds_nothing",
                                   "aa_control", "P2_split_device"}
    assert rep["targets"]["P2"]["target"] == targets.TEXT["P2"]
    json.dumps(rep)


def test_the_aa_control_judges_the_method_not_hisparse():
    """off_b is a second off engine with off's arguments; off_b/off is the
    method's floor (run 4 could not tell process effects from HiSparse's):
    within 5% passes, a 1.2x gap between identical engines fails it."""
    c = cfg(arms=["off", "off_b", "on"])
    assert tax.llm_kwargs(c, "off_b", "fdo", 4, "/m") == tax.llm_kwargs(c, "off", "fdo", 4, "/m")
    close = tax.build_report(cfg=c, command="x", samples=samples({
        "off": {("fdo", 4, 1): 2.0, ("fdo", 4, 16): 2.5},
        "off_b": {("fdo", 4, 1): 2.04, ("fdo", 4, 16): 2.45},
        "on": {("fdo", 4, 1): 2.6, ("fdo", 4, 16): 3.0}}),
        engines_info={}, profiles={}, runs=[{}], failures=[])
    aa = close["targets"]["aa_control"]
    assert aa["pass"] is True and aa["measured"]["fdo/batch1"]["ratio"] == pytest.approx(1.02)
    assert close["summary"]["fdo"]["4"]["1"]["ratios"]["off_b/off"]["what"] == "aa_control"
    far = tax.build_report(cfg=c, command="x", samples=samples({
        "off": {("fdo", 4, 1): 2.0}, "off_b": {("fdo", 4, 1): 2.4}}),
        engines_info={}, profiles={}, runs=[{}], failures=[])
    assert far["targets"]["aa_control"]["pass"] is False
    none = tax.build_report(cfg=cfg(), command="x", samples=samples({
        "off": {("fdo", 4, 1): 2.0}, "on": {("fdo", 4, 1): 2.4}}),
        engines_info={}, profiles={}, runs=[{}], failures=[])
    assert none["targets"]["aa_control"]["pass"] is None


def test_the_aa_control_stops_on_its_ratio_or_its_interval():
    """The noise stop's reading of one cell (P2's method): an A/A within
    5% and a tight interval holds; a ratio past 5% fails it (run 20's
    1.20); a ratio within 5% whose 90% interval reaches past ±15% fails it
    too (run 21: 0.995 by the fastest samples, 0.79-1.25); without both
    off arms there is nothing to read."""
    cell = {("fdo", 4, 16): 2.0}
    steady = samples({"off": cell, "off_b": {("fdo", 4, 16): 2.04}}, reps=6)
    assert tax.aa_noise(steady) is None
    far = samples({"off": cell, "off_b": {("fdo", 4, 16): 2.4}}, reps=6)
    assert tax.aa_noise(far) == "off_b/off 1.200 misses the method's floor (±5%)"
    swings = (0.7, 1.3, 0.72, 1.28, 1.0, 1.01)  # off_b's repetitions, off steady
    wide = [dict(s, ms_per_step=s["ms_per_step"] * swings[s["rep"]]) if s["arm"] == "off_b"
            else s for s in steady]
    r = tax.ratio([s for s in wide if s["arm"] == "off_b"], [s for s in wide if s["arm"] == "off"],
                  "aa_control")
    assert abs(r["ratio"] - 1) <= tax.AA_TOLERANCE  # the ratio alone would pass
    why = tax.aa_noise(wide)
    assert why is not None and why.startswith(f"off_b/off {r['ratio']:.3f}, but its 90% interval")
    assert why.endswith("reaches past ±15%")
    assert tax.aa_noise(samples({"off": cell, "on": cell}, reps=6)) is None
    # the report's verdict reads the same cell: its bias passes, it is noisy
    rep = tax.build_report(cfg=cfg(arms=["off", "off_b"]), command="x", samples=wide,
                           engines_info={}, profiles={}, runs=[{}], failures=[])
    aa = rep["targets"]["aa_control"]
    assert aa["pass"] is True and aa["measured"]["fdo/batch16"]["noisy"] is True
    assert aa["why"].endswith("(too noisy to resolve 1.10): fdo/batch16")
    quiet = tax.build_report(cfg=cfg(arms=["off", "off_b"]), command="x", samples=steady,
                             engines_info={}, profiles={}, runs=[{}], failures=[])
    assert quiet["targets"]["aa_control"]["measured"]["fdo/batch16"]["noisy"] is False
    assert quiet["targets"]["aa_control"]["why"] == ""


# -------------------------------------------------------------- profile


def test_profile_per_step_is_the_difference_over_the_extra_steps():
    def ev(k):  # k decode steps: a graph launch, 5 launches, 2 copies and 3 kernels each
        return [{"name": "cudaGraphLaunch", "device": "cpu", "count": k},
                {"name": "cudaLaunchKernel", "device": "cpu", "count": 5 * k + 40},
                {"name": "cudaMemcpyAsync", "device": "cpu", "count": 2 * k + 7},
                {"name": "cudaStreamWaitEvent", "device": "cpu", "count": k,
                 "self_cpu_us": 3.0 * k},
                {"name": "aten::copy_", "device": "cpu", "count": 99 * k},
                {"name": "custom_op_cuda", "device": "cpu", "count": 3},
                {"name": "gather_kernel", "device": "cuda", "count": 2 * k,
                 "self_device_us": 6.0 * k},
                {"name": "attn", "device": "cuda", "count": k, "self_device_us": 20.0 * k + 500},
                {"name": "Memcpy HtoD (Pinned -> Device)", "device": "cuda", "count": k,
                 "self_device_us": 1.5 * k}]
    p = tax.profile_per_step(ev(16), ev(144), 128)
    ps = p["per_step"]
    assert ps["graph_launches"] == pytest.approx(1) and ps["kernel_launches"] == pytest.approx(5)
    assert ps["cuda_memcpy_async"] == pytest.approx(2)
    assert ps["device_kernels"] == pytest.approx(3) and ps["device_kernel_us"] == pytest.approx(26)
    assert ps["device_copies"] == pytest.approx(1) and ps["device_copy_us"] == pytest.approx(1.5)
    assert ps["runtime_calls"]["cudaStreamWaitEvent"] == pytest.approx(1)
    assert ps["runtime_cpu_us"]["cudaStreamWaitEvent"] == pytest.approx(3)
    assert "aten::copy_" not in ps["runtime_calls"] and "custom_op_cuda" not in ps["runtime_calls"]
    assert [k["name"] for k in p["top_kernels"]] == ["attn", "gather_kernel"]
    with pytest.raises(ValueError):
        tax.profile_per_step([], [], 0)


def test_the_short_generation_is_kept_whole():
    """P2 diagnosis (session 13: a prefix hit's admission ~10 ms slower with
    HiSparse on): the per-step figures subtract the M-token generation, so
    the profile also keeps it whole, its host ops and Python functions by
    self time, largest first."""
    short = [{"name": "aten::sort", "device": "cpu", "count": 8, "self_cpu_us": 40000.0},
             {"name": "cudaLaunchKernel", "device": "cpu", "count": 90, "self_cpu_us": 900.0},
             {"name": "attn", "device": "cuda", "count": 16, "self_device_us": 99999.0}]
    py = [{"fn": "staging.py:10(plan)", "calls": 16, "tottime": 0.012, "cumtime": 0.02},
          {"fn": "scheduler.py:1(schedule)", "calls": 17, "tottime": 0.003, "cumtime": 0.05}]
    g = tax.profile_per_step(short, short, 128, python={"short": py, "long": py})[
        "short_generation"]
    assert list(g["ops_self_cpu_ms"].items()) == [("aten::sort", 40.0),
                                                  ("cudaLaunchKernel", 0.9)]
    assert list(g["python_self_ms"]) == ["staging.py:10(plan)", "scheduler.py:1(schedule)"]
    assert g["python_self_ms"]["staging.py:10(plan)"] == pytest.approx(12.0)
    assert "python_self_ms" not in tax.short_generation(short)


def test_profile_diff_names_what_an_arm_adds_per_step():
    """P2 (issue 16 item 1): the profile of each HiSparse arm minus the off
    arm's at the same mode, layers and batch, per kernel name, copy kind
    and eager torch op, so that a run says where each extra launch comes
    from; differences under half a launch per step are left out."""
    def ev(k, fills, mirror):  # k decode steps
        return [{"name": "cudaLaunchKernel", "device": "cpu", "count": (fills + mirror) * k},
                {"name": "cudaMemcpyAsync", "device": "cpu", "count": 2 * k},
                {"name": "aten::fill_", "device": "cpu", "count": fills * k},
                {"name": "hisparse_ops::mirror_descriptors", "device": "cpu",
                 "count": mirror * k},
                {"name": "fill_kernel<" + "x" * 400, "device": "cuda", "count": fills * k},
                {"name": "mirror_descriptors_kernel", "device": "cuda", "count": mirror * k},
                {"name": "rare", "device": "cuda", "count": 16 if mirror else 0},
                {"name": "Memcpy HtoD (Pinned -> Device)", "device": "cuda", "count": 2 * k}]

    def prof(fills, mirror):
        return tax.profile_per_step(ev(16, fills, mirror), ev(144, fills, mirror), 128)

    profiles = {"fdo/L4/off/batch16": prof(6, 0), "fdo/L4/on/batch16": prof(17, 1),
                "fdo/L4/on/batch1": prof(9, 1)}  # no off arm at batch 1
    on = profiles["fdo/L4/on/batch16"]
    assert on["op_counts"]["aten::fill_"] == pytest.approx(17)
    assert len(next(iter(on["kernel_counts"]))) == 160
    diff = tax.profile_diff(profiles)
    assert set(diff) == {"fdo/L4/on/batch16"}
    d = diff["fdo/L4/on/batch16"]
    assert d["kernel_launches"] == pytest.approx(12) and d["cuda_memcpy_async"] == 0
    assert d["op_counts"] == {"aten::fill_": 11, "hisparse_ops::mirror_descriptors": 1}
    assert list(d["kernel_counts"].values()) == [11, 1]  # "rare" (0.125 per step) left out
    assert d["copy_kinds"] == {}
    merged = tax.profile_diff({f"run1:{k}": v for k, v in profiles.items()})
    assert set(merged) == {"run1:fdo/L4/on/batch16"}


def test_the_stage_clock_times_each_target_inclusively_and_restores_it(monkeypatch):
    """P2's unprofiled breakdown (session 14): each target is wrapped on its
    class or module, its inclusive wall time and calls added up (a recursive
    call counts once), targets a build lacks reported absent, and removing
    the clock restores the originals."""
    import types

    from benchlib import engine_worker

    mod = types.ModuleType("stage_clock_probe")

    class Step:
        def start(self, n):
            time.sleep(0.002)
            return self.start(n - 1) if n > 0 else "done"

    def hook(x):
        time.sleep(0.001)
        return x + 1

    mod.Step, mod.hook = Step, hook
    monkeypatch.setitem(sys.modules, "stage_clock_probe", mod)
    original = Step.__dict__["start"]
    clock = engine_worker.StageClock((
        "stage_clock_probe:Step.start", "stage_clock_probe:hook",
        "stage_clock_probe:Step.missing", "no_such_module_here:f"))
    assert clock.absent == ["stage_clock_probe:Step.missing", "no_such_module_here:f"]
    assert Step().start(2) == "done" and mod.hook(1) == 2 and mod.hook(2) == 3
    snap = clock.snapshot()
    assert snap["Step.start"]["calls"] == 1  # the outer call of the recursion
    assert snap["Step.start"]["us"] >= 6000  # three sleeps of 2 ms inside it
    assert snap["hook"]["calls"] == 2 and snap["hook"]["us"] >= 2000
    clock.reset()
    assert clock.snapshot()["hook"] == {"us": 0.0, "calls": 0}
    clock.remove()
    assert Step.__dict__["start"] is original and mod.hook is hook


def test_stages_per_step_and_their_difference_from_off():
    """P2 (issue 16 item 1): the stage clock's M and N + M generations ->
    per decode step, and profile_diff's stage_us names what the on arm's
    step spends beyond off's by call site (a site off lacks counts whole)."""
    def stages(k, start_us):
        long = {"Scheduler.schedule": {"us": 100.0 * k + 900, "calls": k + 3},
                "HiSparseWorker.start_step": {"us": start_us * k + 50, "calls": k}}
        return {"short": {n: {"us": 900.0 if n == "Scheduler.schedule" else 50.0,
                              "calls": 3 if n == "Scheduler.schedule" else 0}
                          for n in long},
                "long": long, "absent": []}

    on = tax.stages_per_step(stages(128, 250.0), 128)
    assert on["per_step"]["HiSparseWorker.start_step"] == {"us": 250.0, "calls": 1.0}
    assert on["per_step"]["Scheduler.schedule"] == {"us": 100.0, "calls": 1.0}
    assert on["short_generation_ms"]["Scheduler.schedule"] == pytest.approx(0.9)
    off_stages = {"short": {"Scheduler.schedule": {"us": 800.0, "calls": 3}},
                  "long": {"Scheduler.schedule": {"us": 800.0 + 90.0 * 128, "calls": 131}},
                  "absent": ["HiSparseWorker.start_step"]}

    def ev(k):
        return [{"name": "cudaGraphLaunch", "device": "cpu", "count": k}]

    profiles = {
        "fdo/L4/off/batch1": tax.profile_per_step(ev(16), ev(144), 128, stages=off_stages),
        "fdo/L4/on/batch1": tax.profile_per_step(ev(16), ev(144), 128,
                                                 stages=stages(128, 250.0)),
    }
    d = tax.profile_diff(profiles)["fdo/L4/on/batch1"]["stage_us"]
    assert d == {"HiSparseWorker.start_step": 250.0, "Scheduler.schedule": 10.0}
    assert "stages" not in tax.profile_per_step(ev(16), ev(144), 128)
    with pytest.raises(ValueError):
        tax.stages_per_step(off_stages, 0)


def test_python_per_step_attributes_host_time_to_stages_and_hisparse():
    """P2's breakdown: cProfile entries of M and N + M steps -> per decode
    step, the runner/scheduler stages (cumulative), HiSparse's own self time
    and the top functions by self time."""
    def ev(k):
        return [
            {"fn": "vllm/v1/core/sched/scheduler.py:300(schedule)", "calls": k,
             "tottime": 20e-6 * k, "cumtime": 50e-6 * k},
            {"fn": "vllm/v1/core/sched/async_scheduler.py:20(_update_after_schedule)",
             "calls": k, "tottime": 1e-6 * k, "cumtime": 1e-6 * k},
            {"fn": "vllm/v1/hisparse/worker.py:397(start_step)", "calls": k,
             "tottime": 30e-6 * k + 0.01, "cumtime": 90e-6 * k + 0.01},
            {"fn": "vllm/v1/hisparse/runtime.py:362(prepare_forward)", "calls": k,
             "tottime": 40e-6 * k, "cumtime": 40e-6 * k},
            {"fn": "vllm/v1/worker/gpu_model_runner.py:3000(execute_model)", "calls": k,
             "tottime": 5e-6 * k, "cumtime": 400e-6 * k},
            {"fn": "vllm/v1/engine/core.py:576(step)", "calls": k,
             "tottime": 0.0, "cumtime": 700e-6 * k},
        ]
    p = tax.python_per_step(ev(16), ev(144), 128)
    st = p["stages_cum_us"]
    assert st["scheduler.schedule"] == pytest.approx(50)
    assert st["hisparse start_step"] == pytest.approx(90)
    assert st["runner.execute_model"] == pytest.approx(400)
    assert st["hisparse finish_forward"] == 0
    assert st["engine step"] == pytest.approx(700)  # the synchronous alternative
    assert p["hisparse_self_us"] == pytest.approx(70)
    assert p["self_us_total"] == pytest.approx(96)
    assert p["top_self"][0]["fn"].endswith("(prepare_forward)")
    assert p["top_self"][0]["calls"] == pytest.approx(1)
    prof = tax.profile_per_step([], [], 128, python={"short": ev(16), "long": ev(144)})
    assert prof["python"]["stages_cum_us"]["scheduler.schedule"] == pytest.approx(50)
    with pytest.raises(ValueError):
        tax.python_per_step([], [], 0)


def test_python_per_step_splits_out_the_connectors_self_time():
    """Issue 16's "the OffloadingConnector adds nothing": the self time of
    the KV connectors and the offloader (kv_connector/, kv_offload/) is
    summed and listed apart from the step's other functions."""
    def ev(k):
        return [
            {"fn": "vllm/v1/core/sched/scheduler.py:300(schedule)", "calls": k,
             "tottime": 20e-6 * k, "cumtime": 80e-6 * k},
            {"fn": "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:"
                   "1153(build_connector_meta)", "calls": k,
             "tottime": 6e-6 * k, "cumtime": 9e-6 * k},
            {"fn": "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py:"
                   "418(build_connector_meta)", "calls": k,
             "tottime": 2e-6 * k, "cumtime": 11e-6 * k},
            {"fn": "vllm/v1/kv_offload/cpu/manager.py:300(get_stats)", "calls": k,
             "tottime": 3e-6 * k, "cumtime": 3e-6 * k},
        ]
    p = tax.python_per_step(ev(16), ev(144), 128)
    assert p["connector_self_us"] == pytest.approx(11)
    assert p["self_us_total"] == pytest.approx(31)
    assert [e["fn"].rsplit("/", 1)[1] for e in p["connector_top_self"]] == [
        "scheduler.py:1153(build_connector_meta)", "manager.py:300(get_stats)",
        "multi_connector.py:418(build_connector_meta)"]
    assert p["top_self"][0]["fn"].endswith("(schedule)")


def test_engines_get_disjoint_equal_core_sets():
    """P2's method: engines started side by side never share a core."""
    sets = tax.cpu_sets(list(range(16)), 4)
    assert sets == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    sets = tax.cpu_sets([3, 1, 2, 0, 7], 2)
    assert sets == [[0, 1], [2, 3]]
    assert tax.cpu_sets([0, 1], 3) == [[], [], []]  # too few cores: no pinning
    assert tax.cpu_sets([0, 1], 0) == []


def test_cpu_time_per_step_and_busy_cores():
    """Run 4 left open whether the on arm's process burns more CPU than its
    steps need (threads spinning beside the stepping one): a sample with the
    engine's CPU seconds gets cpu_ms_per_step by the same (N + M) - M
    difference, and the summary its ratio to the wall time per arm."""
    s = tax.sample_record(run=0, mode="fdo", layers=4, batch=16, rep=0, arm="on",
                          position=0, t_short_s=1.0, t_long_s=1.256, n=128,
                          cpu_short_s=1.5, cpu_long_s=1.884, threads=[4, 61])
    assert s["ms_per_step"] == pytest.approx(2.0)
    assert s["cpu_ms_per_step"] == pytest.approx(3.0) and s["threads"] == [4, 61]
    plain = tax.sample_record(run=0, mode="fdo", layers=4, batch=16, rep=0, arm="off",
                              position=1, t_short_s=1.0, t_long_s=1.256, n=128)
    assert "cpu_ms_per_step" not in plain
    summary = tax.summarize([s, plain])
    cell = summary["fdo"]["4"]["16"]
    assert cell["cpu"]["on"]["busy_cores"] == pytest.approx(1.5)
    assert "off" not in cell["cpu"]  # no CPU figures: not reported


def test_the_engine_measures_its_process_trees_cpu_time():
    """engine_worker's CPU clock covers this process (and any children):
    it advances by about the CPU a busy loop burns."""
    import time

    from benchlib import engine_worker

    c0, t0 = engine_worker.process_tree_cpu_s(), time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        pass
    burned = engine_worker.process_tree_cpu_s() - c0
    assert 0.1 < burned < 2.0
    threads = engine_worker.thread_counts()
    assert threads and threads[0] >= 1


def test_rotated_core_sets_visit_every_set():
    """P2's method: over k repetitions each of k arms runs once on each of
    the k core sets; an arm without a set turns rotation off."""
    sets = [[0, 1], [2, 3], [4, 5]]
    seen = {i: set() for i in range(3)}
    for rep in range(3):
        now = tax.rotated_sets(sets, rep)
        assert sorted(map(tuple, now)) == sorted(map(tuple, sets))  # still disjoint
        for i, s in enumerate(now):
            seen[i].add(tuple(s))
    assert all(len(v) == 3 for v in seen.values())
    assert tax.rotated_sets(sets, 0) == sets and tax.rotated_sets(sets, 3) == sets
    assert tax.rotated_sets([[0], []], 1) == [[0], []]
    assert tax.rotated_sets([], 2) == []
    assert tax.core_label([3, 1, 2]) == "1-3" and tax.core_label([5]) == "5"
    assert tax.core_label([0, 2, 5]) == "0,2,5"


def test_by_core_set_only_where_an_arm_moved():
    def s(arm, cpus, ms):
        return {"arm": arm, "cpus": cpus, "ms_per_step": ms}

    moved = tax.by_core_set({"off": [s("off", "0-3", 2.0), s("off", "4-7", 3.0),
                                     s("off", "4-7", 3.2)],
                             "on": [s("on", "0-3", 2.2)]})
    assert moved == {"off": {"0-3": 2.0, "4-7": 3.1}, "on": {"0-3": 2.2}}
    assert tax.by_core_set({"off": [s("off", "0-3", 2.0)], "on": [s("on", "4-7", 2.0)]}) == {}
    assert tax.by_core_set({"off": [{"arm": "off", "ms_per_step": 1.0}]}) == {}


def test_gc_pauses_per_step():
    """Run 4 left open whether the on arm's process pays more garbage
    collection per step (objects alive outside vLLM's startup freeze): the
    collector's pause seconds get the (N + M) - M difference too."""
    s = tax.sample_record(run=0, mode="fdo", layers=4, batch=16, rep=0, arm="on",
                          position=0, t_short_s=1.0, t_long_s=1.256, n=128,
                          gc_short_s=0.01, gc_long_s=0.0356, gc_collections={"0": 3},
                          busy_threads=[{"thread": "1/2", "name": "pt_main", "cpu_s": 1.2}],
                          cpus=[4, 5, 6, 7])
    assert s["gc_ms_per_step"] == pytest.approx(0.2) and s["cpus"] == "4-7"
    assert s["busy_threads"][0]["name"] == "pt_main" and s["gc_collections"] == {"0": 3}
    assert "gc_ms" in tax.summarize([s])["fdo"]["4"]["16"]


def test_the_engine_names_its_busiest_thread_and_clocks_the_collector():
    """engine_worker's diagnostics on this process: a thread burning CPU
    tops ``busiest`` under its own name; GcClock times a full collection;
    pin_tree moves every thread (restored after)."""
    import gc
    import os
    import threading
    import time

    from benchlib import engine_worker

    stop = threading.Event()

    def burn():
        while not stop.is_set():
            pass

    t = threading.Thread(target=burn, name="burner")
    before = engine_worker.thread_cpu_s()
    t.start()
    time.sleep(0.3)
    after = engine_worker.thread_cpu_s()
    stop.set()
    t.join()
    top = engine_worker.busiest(before, after)
    assert top and top[0]["cpu_s"] > 0.05
    assert top[0]["name"].startswith("burner") or top[0]["name"].startswith("python")
    assert engine_worker.busiest(after, after) == []

    keep = [[object()] for _ in range(20000)]  # something for the collector to walk
    with engine_worker.GcClock() as clock:
        gc.collect()
    assert clock.collections[2] >= 1 and clock.total_s > 0
    del keep

    mine = sorted(os.sched_getaffinity(0))
    try:
        r = engine_worker.pin_tree([mine[0]])
        assert r["cpus"] == [mine[0]] and r["threads_moved"] >= 1
        assert os.sched_getaffinity(0) == {mine[0]}
    finally:
        engine_worker.pin_tree(mine)
    assert sorted(os.sched_getaffinity(0)) == mine


def test_the_engine_stamps_only_steps_that_return_tokens():
    """P2's per-step estimator: the in-process client's get_output is
    stamped when it returns tokens (async scheduling's empty calls are not
    steps), and the median interval ignores one slow step (a prefill)."""
    import types

    from benchlib import engine_worker

    results = iter([[1], [], [2], [3], [4], []])
    client = types.SimpleNamespace(
        get_output=lambda: types.SimpleNamespace(outputs=next(results)))
    engine = engine_worker.Engine.__new__(engine_worker.Engine)
    engine.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=client))
    stamps = engine._clock_steps()
    for _ in range(6):
        client.get_output()
    assert len(stamps) == 4
    ms, n = engine_worker.median_interval_ms([0.0, 0.5, 0.502, 0.504, 0.506])
    assert n == 4 and ms == pytest.approx(2.0)
    assert engine_worker.median_interval_ms([0.0, 1.0]) == (None, None)
    no_client = engine_worker.Engine.__new__(engine_worker.Engine)
    no_client.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace())
    assert no_client._clock_steps() is None


def _clocked(arm, rep, step_ms, L=4, b=1, steady=None):
    return tax.sample_record(run=0, mode="fdo", layers=L, batch=b, rep=rep, arm=arm,
                             position=0, t_short_s=0.1, t_long_s=0.1 + 0.128 * step_ms,
                             n=128, step_ms=step_ms, step_count=143, steady=steady)


def test_two_speed_modes_read_as_one_by_the_fastest_sample():
    """P2/P6's method (the A/A control): run 6 found this VM's samples in
    two speed modes ~1.5x apart, in proportions that differ per arm. Two
    identical engines then read 0.86-1.33 by medians; the fastest sample of
    each arm (the statistic of a step-clock cell) reads them alike, and a
    real 1.3x tax still shows in both."""
    fast, slow = 1.7, 2.6
    modes = {"off": [fast] * 5 + [slow] * 2, "off_b": [fast] * 2 + [slow] * 5,
             "on": [1.3 * fast] * 3 + [1.3 * slow] * 4}
    recs = [_clocked(arm, rep, ms) for arm, v in modes.items() for rep, ms in enumerate(v)]
    cell = tax.summarize(recs)["fdo"]["4"]["1"]
    assert cell["estimator"] == "step_ms" and cell["statistic"] == "min"
    aa = cell["ratios"]["off_b/off"]
    assert aa["ratio_of_medians"] == pytest.approx(slow / fast)  # the medians' A/A fails
    assert aa["ratio"] == aa["ratio_of_minima"] == pytest.approx(1.0)
    assert cell["ratios"]["on/off"]["ratio"] == pytest.approx(1.3)
    assert cell["tax_us"] == pytest.approx(0.3 * fast * 1e3)
    verdict = tax.evaluate(tax.summarize(recs))
    assert verdict["aa_control"]["pass"] is True and verdict["P2"]["pass"] is False
    # without a step clock the cell keeps medians (the totals method's statistic)
    totals = tax.summarize(samples({"off": {("fdo", 4, 1): 2.0},
                                    "on": {("fdo", 4, 1): 2.2}}))["fdo"]["4"]["1"]
    assert totals["statistic"] == "median"
    assert totals["ratios"]["on/off"]["ratio"] == totals["ratios"]["on/off"]["ratio_of_medians"]


def test_the_fit_reads_each_cells_statistic():
    """P2 split: fixed + per layer from the fastest samples where the cells
    are step-clocked (a slow mode in one arm must not bend the fit)."""
    recs = []
    for L, tax_ms in ((8, 0.1), (32, 0.22)):  # 60 us + 5 us x layers
        for rep in range(4):
            slow = 1.5 if rep == 0 else 1.0  # one slow-mode sample in the off arm
            recs += [_clocked("off", rep, 2.0 * slow, L=L, b=16),
                     _clocked("on", rep, 2.0 + tax_ms, L=L, b=16)]
    fit = tax.fits(tax.summarize(recs))["fdo"]["16"]
    assert fit["fixed_us"] == pytest.approx(60.0)
    assert fit["per_layer_us"] == pytest.approx(5.0)


def test_steady_intervals_skip_admission_and_see_bursts():
    """P2's per-step figure: the steady part of the long generation. The
    first ``skip`` stamps (prefill, admission steps) are left out, pairs of
    outputs (async scheduling) keep the mean at the per-token step while the
    median overstates it, and a stall is counted, not averaged in."""
    from benchlib import engine_worker

    admission = [0.0, 0.05, 0.10]  # slow first steps
    t, stamps = 0.10, list(admission)
    for i in range(40):  # bursts: 3.0 ms, then 1.0 ms (mean 2.0)
        t += 0.003 if i % 2 == 0 else 0.001
        stamps.append(t)
    stamps.append(t + 0.050)  # one 50 ms stall
    st = engine_worker.steady_intervals(stamps, skip=2)
    assert st["count"] == 41 and st["stalls"] == 1 and st["stall_ms"] == pytest.approx(50.0)
    assert st["mean_ms"] == pytest.approx(2.0, rel=1e-6)
    assert st["median_ms"] == pytest.approx(3.0, rel=1e-6)
    assert st["short_share"] == pytest.approx(20 / 41)
    assert st["p10_ms"] == pytest.approx(1.0, rel=1e-6)
    assert st["p90_ms"] == pytest.approx(3.0, rel=1e-6)
    few = engine_worker.steady_intervals([0.0, 0.001, 0.003, 0.006], skip=0)
    assert (few["p10_ms"], few["p90_ms"]) == pytest.approx((1.0, 3.0))
    assert engine_worker.steady_intervals(stamps[:5], skip=2) is None
    rec = _clocked("on", 0, 3.0, steady=st)
    assert rec["steady_ms"] == pytest.approx(2.0, rel=1e-6) and rec["steady"]["stalls"] == 1


def test_off_pinned_is_off_plus_the_on_arms_pool():
    """P2 diagnosis (run 4: code HiSparse does not touch ~1.3x slower in the
    on process): ``off_pinned`` starts exactly the off engine and pins, beside
    it, a host region of the on arm's pool size at that layer count."""
    cfg = tax.TaxConfig(arms=["off", "off_pinned", "on"], layers=[4, 32])
    for L in (4, 32):
        off = tax.engine_spec(cfg, "off", "fdo", L, "/m")
        pinned = tax.engine_spec(cfg, "off_pinned", "fdo", L, "/m")
        on = tax.engine_spec(cfg, "on", "fdo", L, "/m")
        assert pinned["kwargs"] == off["kwargs"] and "pin_host_gib" not in off
        assert pinned["pin_host_gib"] == on["kwargs"]["attention_config"][
            "hisparse_config"]["host_pool_gib"] > 0
    from benchlib import engine_worker

    assert engine_worker.pin_host_region(None) == (None, None)


def test_the_process_probe_compares_the_fastest_runs():
    """P2 diagnosis: each sample carries the engine's fixed-work probe;
    the cell compares arms by their fastest probe (the statistic of run 6),
    so one slow-mode sample does not make a process look slow."""
    recs = []
    for rep in range(4):
        for arm, py in (("off", 1000.0), ("off_pinned", 1300.0), ("on", 1300.0)):
            slow = 1.6 if (arm == "off" and rep == 0) else 1.0
            recs.append(tax.sample_record(
                run=0, mode="fdo", layers=4, batch=1, rep=rep, arm=arm, position=0,
                t_short_s=0.1, t_long_s=0.4, n=128, step_ms=2.0, step_count=143,
                probe={"python_us": py * slow, "launch_us": 400.0}))
    probe = tax.summarize(recs)["fdo"]["4"]["1"]["probe"]
    assert probe["ratios"]["on/off"] == pytest.approx({"python_us": 1.3, "launch_us": 1.0})
    assert probe["ratios"]["off_pinned/off"]["python_us"] == pytest.approx(1.3)
    assert probe["arms"]["off"]["python_us"]["max"] == pytest.approx(1600.0)
    # no probe in some sample: no probe figures at all
    recs[0].pop("probe")
    assert "probe" not in tax.summarize(recs)["fdo"]["4"]["1"]


def test_the_probe_runs_without_a_gpu():
    """The probe's Python part runs anywhere; its launches only with CUDA."""
    import torch

    from benchlib import engine_worker

    engine = engine_worker.Engine.__new__(engine_worker.Engine)
    out = engine.probe(tries=2)
    assert out["python_us"] > 0
    assert ("launch_us" in out) == torch.cuda.is_available()


def _profile(device_kernel_us: float, copies_us: float = 5.0) -> dict:
    return {"per_step": {"device_kernel_us": device_kernel_us, "device_copy_us": copies_us}}


def test_the_device_fit_splits_what_scales_with_layers():
    """P2 split (device part): run 6's fit of step times came out negative
    (a host-bound step hides nothing at 4-8 layers, part at 32); the
    profiles' device time per step, on minus off, gives fixed + per layer,
    across runs of a merge too, and P2_split_device judges it."""
    profiles = {}
    for run, L in ((0, 8), (1, 32)):
        for batch in (1, 16):
            off = 600.0 + 20.0 * L
            extra = 10.0 + 2.0 * L + (30.0 if batch == 16 else 0.0)
            profiles[f"run{run}:fdo/L{L}/off/batch{batch}"] = _profile(off)
            profiles[f"run{run}:fdo/L{L}/on/batch{batch}"] = _profile(off + extra)
    fit = tax.device_fits(profiles)
    assert fit["fdo"]["1"]["fixed_us"] == pytest.approx(10.0)
    assert fit["fdo"]["1"]["per_layer_us"] == pytest.approx(2.0)
    assert fit["fdo"]["16"]["fixed_us"] == pytest.approx(40.0)
    assert fit["fdo"]["1"]["device_tax_us"] == pytest.approx([26.0, 74.0])
    v = tax.evaluate({}, profiles)["P2_split_device"]
    assert v["id"] == "P2_split_device" and v["pass"] is True
    # 5 us per layer is over P2's 4: the same split fails
    profiles["run1:fdo/L32/on/batch1"] = _profile(600.0 + 20.0 * 32 + 10.0 + 5.0 * 32 + 24.0)
    assert tax.evaluate({}, profiles)["P2_split_device"]["pass"] is False
    # one layer count: no fit, no verdict
    one = {k: v for k, v in profiles.items() if "/L8/" in k}
    assert tax.device_fits(one) == {}
    assert tax.evaluate({}, one)["P2_split_device"]["pass"] is None


def test_start_plan_keeps_engines_together_only_where_they_fit():
    """Issue 16 run 13: five arms x two modes = ten engines did not fit an
    80 GB H100 (~9.3 GiB each at peak); auto starts them one (mode, layers)
    group at a time there, together where they fit or the size is unknown."""
    cfg = tax.TaxConfig(arms=["off", "off_b", "on", "on_offload", "off_offload"],
                        modes=["default", "fdo"])
    both = [("default", 4), ("fdo", 4)]
    assert tax.start_plan(cfg, 139.8) == [both]
    assert tax.start_plan(cfg, None) == [both]
    assert tax.start_plan(cfg, 79.2) == [[("default", 4)], [("fdo", 4)]]
    cfg.start = "together"
    assert tax.start_plan(cfg, 79.2) == [both]
    cfg.start = "by-group"
    assert tax.start_plan(cfg, 139.8) == [[("default", 4)], [("fdo", 4)]]
    # one start per group: the estimate pays each group's engine start
    by_group = tax.estimate_s(cfg, tax.start_plan(cfg, None))
    together = tax.estimate_s(cfg)
    assert by_group["engine_starts_s"] > together["engine_starts_s"]
    assert by_group["measure_s"] == together["measure_s"]
    cfg.start = "sometimes"
    with pytest.raises(ValueError, match="--start must be one of"):
        cfg.validate()


@pytest.mark.parametrize("batches", [(1, 16), (1, 8, 16), (1, 12), (6,)])
@pytest.mark.parametrize("mode", ["fdo", "default"])
def test_every_measured_batch_decodes_in_a_full_cuda_graph(mode, batches):
    """max_num_seqs is the largest batch, and vLLM captures FULL decode
    graphs only at capture sizes <= max_num_seqs: under the default sizes
    --batches 1,12 would decode its 12 in no graph (FULL_DECODE_ONLY) or
    PIECEWISE. Read through vLLM's own sizing and dispatcher: every batch
    measured dispatches FULL; the usual batches (1, 8, 16) get no sizes of
    ours."""
    c = cfg(batches=list(batches))
    kw = tax.llm_kwargs(c, "on", mode, 4, "/m")
    cc = kw.get("compilation_config")
    modes = vllm_graphs.decode_graph_modes(kw["max_num_seqs"], kw["max_num_batched_tokens"], cc)
    assert {modes[b - 1] for b in batches} == {"FULL"}
    assert ("cudagraph_capture_sizes" in (cc or {})) == (max(batches) in (12, 6))
    assert "compilation_config" not in tax.llm_kwargs(c, "on", "eager", 4, "/m")
