# SPDX-License-Identifier: Apache-2.0
"""E2E-5's engines and acceptance arithmetic (tests/e2e/run_e2e.py,
docs/mtp.md 4): the 3 + 1 MTP model and its layout, the trios' specs and
plans, the pools against the real layout's startup minimum with
q = 1 + k, and the per-scenario acceptance tally against vLLM's own
SpecDecodingStats and scheduler method."""

import json
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import run_e2e as e2e
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config

SPECS = e2e.engine_specs()
TAGS = sorted(e2e.MTP_TAGS)
MTP_COMMANDS = {  # results/e2e/README.md, the next GPU session's MTP calls
    "default": "off_mtp1,on_mtp1,rep_mtp1,off_mtp3,on_mtp3,on_mtp3_audit,rep_mtp3",
    "fdo": "off_mtp1_fdo,on_mtp1_fdo,rep_mtp1_fdo,off_mtp3_fdo,on_mtp3_fdo,rep_mtp3_fdo",
}


@pytest.fixture(scope="module")
def mtp_config(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("m") / "tiny_glm5_mtp"
    subprocess.run([sys.executable, str(e2e.HERE / "make_tiny_glm5.py"), str(out),
                    "--max-pos", str(e2e.MAX_MODEL_LEN), *e2e.MODELS["glm_mtp"][0]],
                   check=True, capture_output=True)
    return json.loads((out / "config.json").read_text())


def mtp_layout(hf: dict, k: int, layers: int | None = None):
    """The layout the startup check builds for MTP k: q = 1 + k, H = (q + 1) K
    (the default device_buffer_size)."""
    hf = dict(hf, num_hidden_layers=layers or hf["num_hidden_layers"])
    q = 1 + k
    params = HiSparseParams(index_topk=e2e.INDEX_TOPK, max_decode_query_len=q,
                            device_buffer_size=(q + 1) * e2e.INDEX_TOPK,
                            admission_max_tokens=2048, host_pool_bytes=0)
    specs = kv_cache_specs_from_hf_config(
        hf, block_size=64, num_mtp_layers=hf["num_nextn_predict_layers"])
    return build_hisparse_layout(specs, params)


def test_the_mtp_model_is_three_layers_plus_one(mtp_config):
    """docs/mtp.md 4: --layers 3 --mtp 1 sets num_nextn_predict_layers."""
    assert mtp_config["num_hidden_layers"] == 3
    assert mtp_config["num_nextn_predict_layers"] == 1
    assert mtp_config["first_k_dense_replace"] == 1  # the MTP layer is MoE


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_pools_sit_above_the_layouts_minimum_with_q(mtp_config, k):
    """E2E-5 / docs/mtp.md 2, 4: 3 + 1 is flat with 4 pairs (4 + 1 would be
    strided, which binding refuses); the startup minimum with q = 1 + k
    (H = (q + 1) K) is the layout's admission cost, above the q = 1 one,
    and the pressure pool sits a little above it."""
    lay = mtp_layout(mtp_config, k)
    assert lay.num_pairs == e2e.NUM_PAIRS and lay.addressing == "flat"
    assert mtp_layout(mtp_config, k, layers=4).addressing == "strided"
    admission = lay.request_blocks(e2e.MAX_MODEL_LEN).admission
    minimum = e2e.startup_minimum_blocks(e2e.MAX_MODEL_LEN, 2048, lay.num_pairs, q=1 + k)
    assert admission == minimum == {1: 440, 3: 472}[k]
    assert minimum > e2e.startup_minimum_blocks(e2e.MAX_MODEL_LEN, 2048)
    pool = SPECS[f"on_mtp{k}"]["blocks"]
    assert pool == SPECS[f"on_mtp{k}_fdo"]["blocks"] == e2e.MTP_PRESSURE_BLOCKS[k]
    assert minimum < pool <= minimum * 1.1


@pytest.mark.parametrize("tag", TAGS)
def test_an_mtp_trio_differs_only_in_hisparse(tag):
    """E2E-5: off, on and rep of one tag run the same model, mode, chunk, k
    and outputs; rep is the off engine replaying on; llm kwargs carry the
    MTP speculative config in every arm."""
    k, mode = e2e.MTP_TAGS[tag]
    off, on, rep = (SPECS[f"{arm}_{tag}"] for arm in ("off", "on", "rep"))
    assert e2e.REFERENCE[f"on_{tag}"] == f"off_{tag}" == e2e.REPLAYS[f"rep_{tag}"]
    for key in ("model", "mode", "chunk", "tp", "spec", "out_tokens"):
        assert on[key] == off[key] == rep[key], key
    assert (on["model"], on["mode"], on["spec"]) == ("glm_mtp", mode, k)
    dirs = {"glm_mtp": "/m"}
    want = {"method": "mtp", "num_speculative_tokens": k}
    for spec in (off, on, rep):
        assert e2e.llm_kwargs(spec, dirs)["speculative_config"] == want
    assert "speculative_config" not in e2e.llm_kwargs(SPECS["off_c2k"], {"glm": "/g"})
    compiled = e2e.llm_kwargs(on, dirs).get("compilation_config")
    assert compiled == ({"cudagraph_mode": "FULL_DECODE_ONLY"} if mode == "fdo" else None)


def test_the_audit_engine_is_mtp3_with_the_mirror_audit():
    """F2 on the GPU: on_mtp3_audit is on_mtp3 plus the audit (debug env)."""
    audit = dict(SPECS["on_mtp3_audit"])
    assert audit.pop("audit") and not SPECS["on_mtp3"]["audit"]
    assert audit == {k: v for k, v in SPECS["on_mtp3"].items() if k != "audit"}
    assert e2e.REFERENCE["on_mtp3_audit"] == "off_mtp3"
    assert e2e.engine_env(SPECS["on_mtp3_audit"], e2e.ON_PLAN["on_mtp3_audit"]) == {
        e2e.DEBUG_ENV: "1"}
    assert "E2E-5" in e2e.spec_ids("on_mtp3_audit", "host_prefix")


@pytest.mark.parametrize("mode", sorted(MTP_COMMANDS))
def test_the_mtp_commands_parse_and_replay_every_scenario(mode):
    """The README's MTP calls: valid order, a negative control, and each
    rep arm replays every scenario of its on engines."""
    engines = e2e.parse_args(["--out", "x", "--engines", MTP_COMMANDS[mode]]).engines
    assert any("fault_probe" in e2e.ON_PLAN.get(e, ()) for e in engines)
    for e in engines:
        if e in e2e.REFERENCE:
            rep = "rep_" + e2e.REFERENCE[e][len("off_"):]
            assert {f"{e}/{s}" for s in e2e.ON_PLAN[e]} <= set(e2e.plan_for(rep, engines))
    assert e2e.plan_for(engines[0], engines) == [
        "single6k", "concurrent", "host_prefix", "fault_probe"]


def test_mtp_turns_generate_at_least_out_tokens():
    """docs/mtp.md 4: 128 output tokens in every arm (many verify steps);
    longer turns keep theirs; without out_tokens the scenario is as written."""
    plain = e2e.scenario_calls("host_prefix")
    longer = e2e.scenario_calls("host_prefix", e2e.MTP_OUT_TOKENS)
    assert [t.max_tokens for c in plain for t in c] == [48, 16, 16, 48]
    assert [t.max_tokens for c in longer for t in c] == [128] * 4
    assert [t.new for c in plain for t in c] == [t.new for c in longer for t in c]
    assert [t.max_tokens for c in e2e.scenario_calls("long_outputs", 128) for t in c] == [900] * 4
    assert all(SPECS[f"{a}_{t}"]["out_tokens"] == 128 for t in TAGS for a in ("off", "rep"))


# ------------------------------------------------------------ acceptance


STEPS = [(3, 0, None), (3, 3, None), (3, 1, {"r": 1}), (2, 2, None), (0, 0, None),
         (3, 2, {"other": 2})]
"""(num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens) per call."""


def pin_scheduler(k: int, log_stats: bool):
    """An object carrying the pin's Scheduler.make_spec_decoding_stats (the
    method the gate wraps) with the two attributes it reads."""
    from vllm.v1.core.sched.scheduler import Scheduler

    s = SimpleNamespace(log_stats=log_stats, num_spec_tokens=k)
    s.make_spec_decoding_stats = types.MethodType(Scheduler.make_spec_decoding_stats, s)
    return s


def test_the_tally_counts_as_spec_decoding_stats():
    """E2E-5: drafts, accepted tokens and per-position counts equal vLLM's
    own SpecDecodingStats fed by the pin's method (log stats on), invalid
    drafts subtracted per request, zero-draft calls not counted."""
    sched = pin_scheduler(3, log_stats=True)
    e2e.instrument_acceptance(sched)
    stats = None
    for drafts, accepted, invalid in STEPS:
        stats = sched.make_spec_decoding_stats(
            stats, num_draft_tokens=drafts, num_accepted_tokens=accepted,
            num_invalid_spec_tokens=invalid, request_id="r") or stats
    t = sched._hs_spec
    assert t == {"drafts": 5, "draft_tokens": 13, "accepted_tokens": 8,
                 "drafted_per_pos": [5, 5, 3], "accepted_per_pos": [4, 3, 1]}
    assert (t["drafts"], t["draft_tokens"], t["accepted_tokens"]) == (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert t["drafted_per_pos"] == stats.num_draft_tokens_per_pos
    assert t["accepted_per_pos"] == stats.num_accepted_tokens_per_pos


def test_the_tally_counts_with_log_stats_off():
    """The gate runs with stats off: the method returns None, the tally
    still counts; an engine without drafts is left unwrapped."""
    sched = pin_scheduler(3, log_stats=False)
    e2e.instrument_acceptance(sched)
    assert all(sched.make_spec_decoding_stats(None, num_draft_tokens=d, num_accepted_tokens=a,
                                              num_invalid_spec_tokens=i, request_id="r")
               is None for d, a, i in STEPS)
    assert sched._hs_spec["accepted_tokens"] == 8
    plain = pin_scheduler(0, log_stats=False)
    method = plain.make_spec_decoding_stats
    e2e.instrument_acceptance(plain)
    assert plain.make_spec_decoding_stats is method and not hasattr(plain, "_hs_spec")


def test_tally_delta_is_per_scenario():
    before, after = e2e.new_tally(2), e2e.new_tally(2)
    e2e.observe(before, 2, 1, None, "a")
    for _ in range(2):
        e2e.observe(after, 2, 1, None, "a")
    e2e.observe(after, 2, 2, None, "b")
    e2e.observe(after, 2, 1, None, "a")
    assert e2e.tally_delta(after, before) == {
        "drafts": 3, "draft_tokens": 6, "accepted_tokens": 4,
        "drafted_per_pos": [3, 3], "accepted_per_pos": [3, 1]}
    assert e2e.tally_delta(None, before) is None


def tally(accepted: list[int], k: int = 3) -> dict:
    t = e2e.new_tally(k)
    for a in accepted:
        e2e.observe(t, k, a, None, "r")
    return t


def test_acceptance_verdict_on_equals_rep_under_an_equal_schedule():
    """E2E-5: equal acceptance in the replay (equal keyed schedule) passes,
    the off arm reported beside with its rate."""
    on, off = tally([1, 0, 3]), tally([1, 1, 3])
    v = e2e.acceptance_verdict(on, {"schedule_equal": True, "acceptance": tally([1, 0, 3])},
                               "replay", off)
    assert v["pass"] and v["equal"] is True and v["off"] == off
    assert v["rate"] == {"on": 4 / 9, "off": 5 / 9}


def test_acceptance_verdict_fails_when_on_and_rep_differ():
    """E2E-5: one accepted token fewer at position 2 under an equal schedule
    fails; under a differing schedule nothing is compared."""
    on, rep = tally([1, 0, 3]), tally([2, 0, 3])
    v = e2e.acceptance_verdict(on, {"schedule_equal": True, "acceptance": rep}, "replay", None)
    assert not v["pass"] and v["equal"] is False
    v = e2e.acceptance_verdict(on, {"schedule_equal": False, "acceptance": rep}, "replay", None)
    assert v["pass"] and v["equal"] is None


def test_acceptance_verdict_natural_arm_is_the_off_engine():
    """Without a replay, the natural off arm decides when its schedule was
    equal."""
    on = tally([1, 2])
    assert e2e.acceptance_verdict(on, {"schedule_equal": True}, "natural", tally([1, 2]))["equal"]
    assert not e2e.acceptance_verdict(on, {"schedule_equal": True}, "natural",
                                      tally([1, 1]))["pass"]
