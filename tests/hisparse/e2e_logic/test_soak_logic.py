# SPDX-License-Identifier: Apache-2.0
"""The soak's workload generator, records, comparison and verdict
(tests/e2e/soak_logic.py and the pure parts of tests/e2e/soak.py)."""

import copy
import json
import math
import random
import struct
from dataclasses import dataclass

import pytest
import soak
import soak_logic as sl

CFG = sl.SoakConfig(seed=3, users=4)


def run_users(cfg=CFG, n=60, complete=lambda a: a.disconnect is None, out_tokens=5):
    """Each user's first n actions with fake outcomes."""
    actions = []
    for u in range(cfg.users):
        user = sl.User(cfg, u)
        for _ in range(n):
            a = user.next_action()
            done = complete(a)
            user.outcome(a, done, [9] * out_tokens if done else [])
            actions.append((a, done))
    return actions


def test_users_are_seeded():
    a = [x.prompt for x, _ in run_users()]
    b = [x.prompt for x, _ in run_users()]
    assert a == b
    c = [x.prompt for x, _ in run_users(sl.SoakConfig(seed=4, users=4))]
    assert a != c


def test_requests_fit_and_span_the_lengths():
    actions = run_users(n=150)
    lens = [len(a.prompt) for a, _ in actions]
    assert all(len(a.prompt) + a.max_tokens <= CFG.max_model_len for a, _ in actions)
    assert min(lens) < 300 and max(lens) > 10000
    assert all(CFG.max_tokens[0] <= a.max_tokens <= CFG.max_tokens[1] for a, _ in actions)
    assert all(2 <= t < CFG.vocab for a, _ in actions for t in a.new)


def test_turns_continue_their_conversation_and_disconnects_end_it():
    actions = run_users(n=150)
    by_id = {a.id: (a, done) for a, done in actions}
    continued = [a for a, _ in actions if a.parent is not None]
    assert continued, "no multi-turn conversation"
    for a in continued:
        parent, done = by_id[a.parent]
        assert done and a.conv == parent.conv and a.turn == parent.turn + 1
        assert a.prompt == parent.prompt + [9] * 5 + a.new  # prompt + output + new
    after_fail = {a.id for a, done in actions if not done}
    assert not any(a.parent in after_fail for a in continued)


def test_the_mix_has_every_kind_of_request():
    actions = [a for a, _ in run_users(n=150)]
    kinds = {a.disconnect for a in actions}
    assert kinds == {None, "prefill", "decode", "cancel"}
    assert any(a.stream for a in actions) and any(not a.stream for a in actions)
    for a in actions:
        if a.disconnect == "prefill":
            assert a.stream and a.parent is None
            assert len(a.prompt) >= CFG.prefill_disconnect_min_prompt
        if a.disconnect == "decode":
            assert a.stream and 1 <= a.after <= a.max_tokens


def test_prompts_rebuild_from_the_compact_form():
    actions = run_users(n=80)
    done = [a for a, ok in actions if ok]
    outputs = {a.id: [9] * 5 for a in done}
    prompts = sl.rebuild_prompts([a.compact() for a in done], outputs)
    assert all(prompts[a.id] == a.prompt for a in done)


def compact(rid, parent=None, new=(5, 6), max_tokens=2):
    return {"id": rid, "conv": "c", "turn": 0, "parent": parent, "new": list(new),
            "max_tokens": max_tokens}


def test_the_trace_join_adds_requests_when_their_prompt_is_known():
    """R5's replay follows the server's steps; a step enters only when
    every request it names can be added with the server's exact prompt (a
    follow-up waits for its parent's output); the idle probes' steps are
    skipped; a step mixing them with the load is reported."""
    a, b = sl.server_key("a"), sl.server_key("b")
    j = sl.TraceJoin()
    j.feed({"id": "a", "sent": compact("a")})
    j.trace([["probe-1", 3, 0]])
    j.trace([[a, 2, 0]])
    j.trace([[a, 1, -1]])
    j.feed({"id": "b", "sent": compact("b", parent="a", new=(7,), max_tokens=3)})
    j.trace([[a, 1, -1], [b, 5, 0]])
    j.trace([["probe-2", 1, 0], [b, 1, -1]])
    ready = j.ready()
    assert [adds for _, adds in ready] == [[(a, [5, 6], 2)], []]
    assert j.skipped == 1 and len(j.foreign) == 1 and len(j.pending) == 1
    j.feed({"id": "a", "tokens": [11, 12]})
    (step, adds), = j.ready()
    assert step == [[a, 1, -1], [b, 5, 0]] and adds == [(b, [5, 6, 11, 12, 7], 3)]
    assert j.kept == [[[a, 2, 0]], [[a, 1, -1]], step] and not j.pending
    j.feed({"end": True})
    assert j.ended


@dataclass
class Lp:
    logprob: float
    rank: int | None = None


def both_sides(rng: random.Random, n: int = 6):
    """The same numbers as vLLM's per-position dicts (replay) and as the
    OpenAI JSON a server sends (token-id tokens), through a JSON round trip."""
    tokens, positions, openai = [], [], {"tokens": [], "token_logprobs": [],
                                         "top_logprobs": []}
    for _ in range(n):
        # float32 logprobs, as the sampler returns them
        vals = [struct.unpack("f", struct.pack("f", -rng.random() * 9))[0] for _ in range(6)]
        ids = rng.sample(range(2, 8192), 6)
        tokens.append(ids[0])
        positions.append({i: Lp(v) for i, v in zip(ids, vals)})
        openai["tokens"].append(f"token_id:{ids[0]}")
        openai["token_logprobs"].append(vals[0])
        openai["top_logprobs"].append({f"token_id:{i}": v for i, v in
                                       reversed(list(zip(ids, vals)))})
    openai = json.loads(json.dumps(openai))
    return (sl.replay_record(tokens, positions),
            sl.server_record(openai["tokens"], openai["token_logprobs"],
                             openai["top_logprobs"]))


def test_the_server_and_replay_forms_agree_bit_for_bit():
    replay, server = both_sides(random.Random(1))
    cmp = sl.compare_records({"r": replay}, {"r": server})
    assert cmp["compared"] == 1 and cmp["token_mismatches"] == 0
    assert cmp["logprob_mismatches"] == 0 and cmp["max_abs_logprob_diff"] == 0.0


def test_one_bit_or_one_token_is_a_mismatch():
    replay, server = both_sides(random.Random(2))
    bits = copy.deepcopy(server)
    v = float.fromhex(bits["positions"][3][0])
    nudged = struct.unpack("d", struct.pack("Q", struct.unpack("Q", struct.pack("d", v))[0] ^ 1))[0]
    bits["positions"][3][0] = nudged.hex()
    tok = copy.deepcopy(server)
    tok["tokens"][4] += 1
    cmp = sl.compare_records({"a": replay, "b": replay}, {"a": bits, "b": tok})
    assert cmp["logprob_mismatches"] == 1 and cmp["token_mismatches"] == 1
    assert 0 < cmp["max_abs_logprob_diff"] < 1e-12
    assert [e["id"] for e in cmp["examples"]] == ["b", "a"]


def test_canonical_position_is_a_set_with_the_sampled_token():
    a = sl.canonical_position(5, -1.0, {7: -2.0, 5: -1.0})
    b = sl.canonical_position(5, -1.0, {5: -1.0, 7: -2.0})
    assert a == b
    assert sl.canonical_position(5, -1.0, {7: -2.0})[1][0][0] == 5
    assert float.fromhex(sl.canonical_position(5, -1e6, {})[0]) == sl.LOGPROB_FLOOR
    with pytest.raises(ValueError, match="token-id"):
        sl.token_id("w123")


def test_parsers():
    text = ('# HELP vllm:kv_cache_usage_perc x\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n'
            'vllm:num_preemptions_total{engine="0"} 3.0\n'
            'vllm:num_preemptions_total{engine="1"} 2.0\n')
    m = sl.parse_metrics(text)
    assert m["vllm:kv_cache_usage_perc"] == 0.25 and m["vllm:num_preemptions_total"] == 5.0
    st = sl.parse_status("Name:\tpython\nVmLck:\t  12 kB\nVmPin:\t0 kB\nVmRSS:\t 900 kB\n")
    assert st == {"VmLck": 12, "VmPin": 0, "VmRSS": 900}
    log = ("(EngineCore pid=77) INFO hi\n(APIServer pid=5) ERROR x\n"
           "(EngineCore pid=91) INFO again\n(EngineCore pid=77) INFO\nTraceback (most recent call last)\n")
    scanned = sl.scan_log(log)
    assert scanned["engine_core_pids"] == [77, 91] and scanned["tracebacks"] == 1
    assert scanned["errors"] == 1


def test_demand_counts_the_running_requests_fully_resident():
    assert sl.fully_resident_blocks(6000) == 94 * 5 + 32
    assert sl.demand_blocks([6000, 100, 64], max_num_seqs=2) == 502 + 2 * 5 + 32


def good_run():
    """Fake soak results and replay that pass every check."""
    rng = random.Random(5)
    results, main, steps = [], {}, []
    kinds = [("completed", True), ("completed", False), ("before_first_token", True),
             ("during_decode", True), ("cancelled", False)]
    for i, (outcome, stream) in enumerate(kinds * 2):
        r = {"id": f"r{i}", "outcome": outcome, "stream": stream, "prompt_len": 100,
             "tokens_received": 6, "t_start": i}
        if outcome == "completed":
            replay, server = both_sides(rng)
            r["record"], main[sl.server_key(r["id"])] = server, replay
        steps.append([[sl.server_key(r["id"]), 100, 0]])
        results.append(r)
    idle = {"reset_prefix_cache": True, "kv_cache_usage_perc": 0.0, "running": 0.0,
            "waiting": 0.0, "engine_pid": 42, "proc": {"VmLck": 0, "VmPin": 0},
            "metrics": {"vllm:hisparse_live_hot_regions": 0.0}}
    report = {"config": {"duration_s": 360.0}, "load_s": 361.0,
              "pressure": {"max_demand_blocks": 2000, "gpu_blocks": 550, "hisparse": {
                  "vllm:hisparse_lost_pages_total": 40.0,
                  "vllm:hisparse_l3_lookups_total": 9000.0}},
              "idle_before": idle, "idle_after": copy.deepcopy(idle), "server_alive_at_end": True,
              "log": {"engine_core_pids": [42]},
              "monitor": {"health": {"polls": 100, "failures": 0}},
              "replay": {"records": main, "followed": steps, "replayed": copy.deepcopy(steps),
                         "diverged": None, "sensitivity": {"meets": True},
                         "weights_fingerprint_plugin": "ab",
                         "weights_fingerprint_apply_model": "ab"}}
    return report, results


def test_a_clean_soak_passes():
    report, results = good_run()
    out = soak.finish(report, results)
    assert out["pass"], out["checks"]
    assert out["requests"]["completed"] == 4 and out["requests"]["streamed"] == 2
    assert out["faults_injected"] == {"before_first_token": 2, "during_decode": 2,
                                      "cancelled": 2}
    assert out["leaks"] == 0 and out["restarts"] == 0
    assert not out["leak_checks"]["pinned_accounting_visible"]  # said, not hidden


@pytest.mark.parametrize("break_it,check", [
    (lambda r, x: r["idle_after"].update(reset_prefix_cache=False), "no_leaks"),
    (lambda r, x: r["idle_after"].update(kv_cache_usage_perc=0.01), "no_leaks"),
    (lambda r, x: r["idle_after"]["proc"].update(VmLck=4), "no_leaks"),
    (lambda r, x: r["idle_after"]["metrics"].update(
        {"vllm:hisparse_live_hot_regions": 1.0}), "no_leaks"),
    (lambda r, x: r["idle_after"].update(engine_pid=43), "no_restart"),
    (lambda r, x: r["log"].update(engine_core_pids=[42, 50]), "no_restart"),
    (lambda r, x: r["monitor"]["health"].update(failures=1), "no_restart"),
    (lambda r, x: r.update(server_alive_at_end=False), "no_restart"),
    (lambda r, x: r.update(load_s=300.0), "ran_long_enough"),
    (lambda r, x: r["pressure"].update(max_demand_blocks=100), "under_pressure"),
    (lambda r, x: r["pressure"]["hisparse"].pop("vllm:hisparse_lost_pages_total"),
     "under_pressure"),
    (lambda r, x: r["pressure"]["hisparse"].update({"vllm:hisparse_l3_lookups_total": 0.0}),
     "under_pressure"),
    (lambda r, x: r["replay"]["records"].pop(sl.server_key("r0")), "replay_complete"),
    (lambda r, x: x[0]["record"]["tokens"].__setitem__(0, 1), "tokens_identical"),
    (lambda r, x: x[0]["record"]["positions"][2].__setitem__(0, (-1.0).hex()),
     "logprobs_bitwise"),
    (lambda r, x: r["replay"]["replayed"][1][0].__setitem__(1, 99),
     "replay_followed_the_schedule"),
    (lambda r, x: r["replay"].update(diverged={"step": 3}), "replay_followed_the_schedule"),
    (lambda r, x: r["replay"].update(followed=[], replayed=[]),
     "replay_followed_the_schedule"),
    (lambda r, x: r["replay"].update(sensitivity={"meets": False}), "sensitive_init"),
    (lambda r, x: r["replay"].update(weights_fingerprint_apply_model="cd"), "init_paths_agree"),
    (lambda r, x: x.append({"id": "e", "outcome": "error", "stream": True}),
     "no_request_errors"),
    (lambda r, x: [y.update(outcome="completed") for y in x
                   if y["outcome"] == "during_decode" and y.setdefault("record", x[0]["record"])],
     "traffic_mix"),
])
def test_each_check_can_fail(break_it, check):
    report, results = good_run()
    break_it(report, results)
    out = soak.finish(report, results)
    assert not out["checks"][check] and not out["pass"]


def test_soak_arguments():
    a = soak.parse_args(["--out", "x"])
    assert a.duration == 360 and a.variant == soak.seeded_init.DEFAULT_VARIANT
    with pytest.raises(ValueError, match="unknown weight variant"):
        soak.parse_args(["--out", "x", "--variant", "bogus"])
    cmd = soak.server_command(soak.Path("/m"), 8000)
    flags = dict(zip(cmd, cmd[1:]))
    assert json.loads(flags["--attention-config"])["hisparse_config"]["host_pool_gib"] > 0
    kv = json.loads(flags["--kv-transfer-config"])
    assert kv["kv_connector"] == "OffloadingConnector"
    # R5: the replay reuses a parent's decoded pages as computed while
    # decoding; the server must offload them too (runs 20-23)
    assert kv["kv_connector_extra_config"]["offload_prompt_only"] is False
    assert flags["--load-format"] == "hisparse_seeded"
    assert int(flags["--num-gpu-blocks-override"]) == soak.GPU_BLOCKS
    assert int(flags["--max-num-batched-tokens"]) == soak.CHUNK
    # the server records its schedule under the client's request ids; the
    # replay (same env otherwise) must not write that trace
    server_env = soak.child_env("n02", soak.Path("/w/trace.jsonl"))
    assert server_env[soak.TRACE_ENV] == "/w/trace.jsonl"
    assert server_env["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] == "1"
    assert soak.TRACE_ENV not in soak.child_env("n02")


def test_json_lines_reads_only_complete_lines(tmp_path):
    """The replay reads the server's trace and the client's feed while
    their writers append (a line may be half written)."""
    path = tmp_path / "trace.jsonl"
    lines = soak.JsonLines(path)
    assert lines.read() == []  # not created yet
    with open(path, "w") as f:
        f.write(json.dumps([["a", 1, -1]]) + "\n" + '[["b", 2')
        f.flush()
        assert lines.read() == [[["a", 1, -1]]]
        f.write(', 0]]\n')
        f.flush()
        assert lines.read() == [[["b", 2, 0]]]
        assert lines.read() == []


def test_a_late_server_cuts_the_load_and_the_soak_says_so():
    """R5 (run 26): a cold device call started the server so late that the
    call ended before soak.json; the load is cut to leave the report its
    time, and a cut load fails ran_long_enough (it compares with the 360 s
    asked for, not with the cut)."""
    assert sl.load_seconds(360.0, 600.0) == 360.0
    assert sl.load_seconds(360.0, 300.0) == 300.0 - sl.WRAP_UP_S
    assert sl.load_seconds(360.0, 20.0) == 10.0
    report, results = good_run()
    report["load_s"] = sl.load_seconds(360.0, 300.0) + 1.0
    out = soak.finish(report, results)
    assert not out["checks"]["ran_long_enough"] and not out["pass"]


@pytest.mark.parametrize("line", [
    "(EngineCore pid=7) ERROR 12-02 16:46:08 [core.py:1332] EngineCore encountered a fatal error.",
    "(EngineCore pid=7) ERROR 12-02 [worker.py:703] HiSparse mirror audit: 2 host row(s) of "
    "model.layers.0 differ from their resident rows (first host row 9)",
    "Traceback (most recent call last):",
])
def test_an_error_in_the_server_log_fails_the_soak(line):
    """R5 / F1: a server that logged an error, a traceback or a mirror-audit
    mismatch (``--audit``) fails the soak even if it kept serving."""
    report, results = good_run()
    report["log"] = sl.scan_log(line + "\n")
    out = soak.finish(report, results)
    assert not out["checks"]["server_log_clean"] and not out["pass"]
    report, results = good_run()
    assert soak.finish(report, results)["checks"]["server_log_clean"]


def test_the_audit_reaches_only_the_server():
    """F1: ``--audit`` turns on HiSparse's mirror audit in the server's
    environment; the replay (HiSparse off) never gets it."""
    assert soak.child_env("n02", audit=True)[soak.DEBUG_ENV] == "1"
    assert soak.DEBUG_ENV not in soak.child_env("n02")
    assert soak.parse_args(["--out", "x", "--audit"]).audit


def test_the_twin_replay_is_the_off_arms_determinism_control():
    """R5 / T1: a second off engine follows the same schedule; its records
    must equal the first replay's bit for bit, else the off arm is not
    deterministic at the soak's batches and a HiSparse-vs-off difference
    proves nothing (the check fails and says so). Without the twin
    (--no-twin) there is no such check, rather than one that cannot fail."""
    report, results = good_run()
    report["replay_twin"] = {"records": copy.deepcopy(report["replay"]["records"])}
    out = soak.finish(report, results)
    assert out["checks"]["replay_deterministic"] and out["pass"]
    assert out["replay_determinism"]["compared"] == 4

    report, results = good_run()
    twin = copy.deepcopy(report["replay"]["records"])
    rid = sorted(twin)[0]
    sampled = float.fromhex(twin[rid]["positions"][0][0])
    twin[rid]["positions"][0][0] = math.nextafter(sampled, 0.0).hex()  # one ulp
    report["replay_twin"] = {"records": twin}
    out = soak.finish(report, results)
    assert not out["checks"]["replay_deterministic"] and not out["pass"]

    report, results = good_run()
    report["replay_twin"] = {"records": {}, "error": "boom"}
    assert not soak.finish(report, results)["checks"]["replay_deterministic"]

    report, results = good_run()
    assert "replay_deterministic" not in soak.finish(report, results)["checks"]
    assert soak.parse_args(["--out", "x", "--no-twin"]).no_twin
    cmd = soak.replay_command(soak.parse_args(["--out", "x"]), soak.Path("/w"), twin=True)
    assert cmd[-1] == "--twin" and soak.replay_file(True) == "replay_twin.json"


def test_every_soak_process_compiles_deterministically():
    """R5: the server, the replay and its twin compile with Inductor's
    deterministic mode and without the combo-kernel benchmark (run 28: two
    off replays compiled in two processes disagreed under one schedule), so
    a difference between them is the data path's; --no-deterministic-compile
    turns it off in all three, never in one."""
    a = soak.parse_args(["--out", "x"])
    assert a.deterministic_compile
    cmd = soak.server_command(soak.Path("/m"), 8000)
    inductor = json.loads(dict(zip(cmd, cmd[1:]))["--compilation-config"])[
        "inductor_compile_config"]
    assert inductor == {"combo_kernels": True, "benchmark_combo_kernel": False}
    for env in (soak.child_env("n02", soak.Path("/w/t.jsonl")), soak.child_env("n02")):
        assert env["TORCHINDUCTOR_DETERMINISTIC"] == "1"
    assert soak.compilation_config(True) == {"inductor_compile_config": inductor}
    assert "--no-deterministic-compile" not in soak.replay_command(a, soak.Path("/w"))

    off = soak.parse_args(["--out", "x", "--no-deterministic-compile"])
    assert not off.deterministic_compile
    assert "--compilation-config" not in soak.server_command(soak.Path("/m"), 1, False)
    assert "TORCHINDUCTOR_DETERMINISTIC" not in soak.child_env("n02", deterministic=False)
    assert soak.compilation_config(False) is None
    replay = soak.replay_command(off, soak.Path("/w"), twin=True)
    assert "--no-deterministic-compile" in replay
    assert not soak.parse_args(replay[2:]).deterministic_compile
