# SPDX-License-Identifier: Apache-2.0
"""bench-agentic's pure logic (benchlib.agentic): the scaled trace and its
conversations, the model folder, the server commands (parsed by vLLM's own
`vllm serve` parser on the CPU platform), the tool's command line and
imports (against the pinned tree's benchmark and the GPU image), the
per-level summaries from the tool's statistics and /metrics samples, the
report and its merge."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchlib import agentic, common, prom
import vllm_graphs
from metrics_sample import metrics_text

ROOT = Path(__file__).resolve().parents[3]
TOOL_DIR = ROOT / "work" / "build" / "vllm" / "benchmarks" / "multi_turn"


def cfg(**kw) -> agentic.AgenticConfig:
    c = agentic.AgenticConfig(**kw)
    c.validate()
    return c


# ------------------------------------------------------------ workload


def test_scale_multiplies_input_lengths_and_keeps_outputs():
    s = agentic.shape(agentic.Trace(), 0.1)
    assert (s.turns, s.first, s.later, s.output) == (13, 7400, 75, 220)
    s = agentic.shape(agentic.Trace(), 0.5, output=100, turns=5, later=300)
    assert (s.turns, s.first, s.later, s.output) == (5, 37000, 300, 100)
    with pytest.raises(ValueError):
        agentic.shape(agentic.Trace(), 0)
    with pytest.raises(ValueError):
        agentic.shape(agentic.Trace(), 0.1, jitter=1.0)


def test_max_context_is_every_length_at_its_upper_bound():
    s = agentic.Shape(turns=3, first=100, later=10, output=5, jitter=0.2)
    assert s.bounds(100) == (80, 120)
    assert s.max_context() == 120 + 2 * 12 + 3 * 6
    with pytest.raises(ValueError, match="lower --scale"):
        agentic.fit_check(s, 161)
    # and in characters, the first turn trimmed to its lower bound: the last
    # prompt is 80 + 2 * 12 words of 6 characters (5 and a space) and two
    # answers of 6 * 6 + 1, sent with max_tokens 6, MARGIN_TOKENS spare
    worst = 6 * (80 + 2 * 12) + 2 * (6 * 6 + 1)
    fits = -(-worst // agentic.SERVER_CHARS_PER_TOKEN) + 6 + agentic.MARGIN_TOKENS
    agentic.fit_check(s, fits)
    with pytest.raises(ValueError, match="characters"):
        agentic.fit_check(s, fits - 1)
    # mean request: turn t's prompt is all earlier turns + outputs, plus its output
    s0 = agentic.Shape(turns=2, first=100, later=10, output=5, jitter=0.0)
    assert s0.mean_context() == ((100 + 5) + (100 + 5 + 10 + 5)) / 2


def test_conversations_are_token_exact_alternating_and_within_bounds():
    s = agentic.shape(agentic.Trace(), 0.05, jitter=0.2)
    convs = agentic.conversations(s, 6, seed=0, level=8, max_model_len=16384)
    assert len(convs) == 6 and len({c["id"] for c in convs}) == 6
    for c in convs:
        roles = [r for r, _ in agentic.token_lengths(c)]
        assert roles == ["user", "assistant"] * s.turns  # every user turn has its answer
        lengths = agentic.token_lengths(c)
        lo, hi = s.bounds(s.first)
        assert lo <= lengths[0][1] <= hi
        for i, (role, n) in enumerate(lengths[1:], 1):
            lo, hi = s.bounds(s.output if role == "assistant" else s.later)
            assert lo <= n <= hi
        words = " ".join(m["content"] for m in c["messages"]).split()
        assert all(re.fullmatch(r"w\d+", w) and 2 <= int(w[1:]) < agentic.VOCAB for w in words)
        assert sum(n for _, n in lengths) <= s.max_context()
    # no two conversations share a prefix (the first 32 tokens differ)
    heads = {tuple(c["messages"][0]["content"].split()[:32]) for c in convs}
    assert len(heads) == 6


def test_conversations_are_the_same_for_every_arm_and_differ_per_level():
    s = agentic.shape(agentic.Trace(), 0.02)
    assert agentic.conversations(s, 3, 0, 4, 16384) == agentic.conversations(s, 3, 0, 4, 16384)
    assert agentic.conversations(s, 3, 0, 4, 16384) != agentic.conversations(s, 3, 0, 8, 16384)
    assert agentic.conversations(s, 3, 0, 4, 16384) != agentic.conversations(s, 3, 1, 4, 16384)


def test_jitter_averages_out_to_the_target():
    s = agentic.shape(agentic.Trace(), 0.05, jitter=0.2)
    convs = agentic.conversations(s, 40, 0, 1, 16384)
    outs = [n for c in convs for r, n in agentic.token_lengths(c) if r == "assistant"]
    assert abs(sum(outs) / len(outs) - 220) < 5


@pytest.mark.parametrize("bad, match", [
    (dict(arms=["vanilla"]), "unknown arm"), (dict(scale=0.3), "max_model_len"),
    (dict(concurrency=[128]), "max-num-seqs"), (dict(weights="x"), "weights"),
    (dict(conversations_per_client=0), "conversations-per-client"), (dict(poll_s=0), "poll"),
    (dict(kv_bytes=32 * agentic.MIB), "cannot hold one max_model_len request"),
    (dict(index_topk_freq=0), "index-topk-freq"), (dict(index_topk_freq=5), "index-topk-freq"),
    (dict(arms=["hisparse", "hisparse_pf"]), "hisparse_pf needs --index-topk-freq > 1"),
    (dict(arms=["upstream@4"]), "only our arms"), (dict(arms=["hisparse@0"]), "max_num_seqs >= 1"),
    (dict(arms=["hisparse@x"]), "max_num_seqs >= 1"), (dict(arms=["nope@4"]), "unknown arm"),
    (dict(arms=["hisparse@65"]), "caps above --max-num-seqs 64"),
])
def test_config_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        cfg(**bad)


def test_default_workload_pressures_plain_vllm_at_the_top_level():
    """The defaults make sense: plain vLLM's pool holds a few conversations,
    the top level asks for several times that."""
    h = agentic.pressure_hint(cfg())
    assert h["plain_concurrent_requests_approx"] < 8
    assert h["demand_tokens"][16] > 3 * h["plain_pool_tokens_approx"]


def test_hisparse_admits_a_max_model_len_request_in_the_default_budget():
    """The HiSparse arm starts at all (its startup minimum: one
    max_model_len request admitted) with the default budget and with the
    documented 65536-token configuration; the real layout's arithmetic."""
    from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
    from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config

    hf = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
          "index_head_dim": 128, "index_topk": 256, "index_topk_freq": 1}
    for c in (cfg(), cfg(max_model_len=65536, scale=0.5, kv_bytes=512 * agentic.MIB)):
        params = HiSparseParams(index_topk=256, max_decode_query_len=1, device_buffer_size=512,
                                admission_max_tokens=c.chunk, host_pool_bytes=0)
        lay = build_hisparse_layout(kv_cache_specs_from_hf_config(hf, block_size=64), params)
        assert lay.gpu_bytes_per_request(c.max_model_len) < c.kv_bytes / 2
        # plain vLLM's own startup check: one max_model_len request fits the pool
        assert c.max_model_len * agentic.PLAIN_BYTES_PER_TOKEN < c.kv_bytes


def test_documented_our_arms_command_fits_one_device_call():
    c = cfg()
    assert agentic.estimate_s(c)["total_s"] <= c.budget_s
    assert agentic.estimate_s(cfg(arms=["upstream", "hisparse"]))["total_s"] <= c.budget_s


def test_the_duration_prior_is_per_arm_and_errs_long():
    """P4/P5's runs: run 12 (H100) measured the c32 levels at 62 s
    (hisparse), 109 s (offload), 133 s (plain) and the c16 levels at 39, 73,
    75 s. The prior orders the arms alike, is never short by more than 10%,
    and says that run 12's first call (three arms at 16 and 32, where the
    last level was lost) did not fit its 520 s budget while the second did."""
    measured = {("hisparse", 32): 62.3, ("offload", 32): 109.4, ("plain", 32): 133.2,
                ("hisparse", 16): 39.2, ("offload", 16): 72.8, ("plain", 16): 74.5}
    c = cfg(arms=["plain", "offload", "hisparse"], concurrency=[16, 32])
    for (arm, level), seconds in measured.items():
        prior = agentic.level_prior_s(c, arm, level)
        assert 0.9 * seconds <= prior <= 1.4 * seconds, (arm, level, prior)
    est = agentic.estimate_s(c)
    assert est["level_s"]["plain"][32] > est["level_s"]["offload"][32] > est["level_s"]["hisparse"][32]
    assert est["total_s"] > 520
    assert agentic.estimate_s(cfg(arms=["plain", "hisparse"], concurrency=[32]))["total_s"] <= 540


# ------------------------------------------------------- model folder


def test_prepare_model_removes_eos_and_special_tokens_and_adds_a_template(tmp_path):
    subprocess.run([sys.executable, str(common.MAKE_MODEL), str(tmp_path)], check=True,
                   capture_output=True)
    removed = agentic.prepare_model(tmp_path)
    assert removed["config.json"] == ["eos_token_id"]
    assert set(removed["tokenizer_config.json"]) == {"eos_token", "bos_token", "pad_token",
                                                     "unk_token"}
    assert agentic.prepare_model(tmp_path) == {"config.json": [], "tokenizer_config.json": []}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_id is None
    msgs = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
            {"role": "user", "content": "w8"}]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert list(ids) == [5, 6, 7, 8]  # the prompt is exactly the history's tokens
    assert tok.decode([5, 0, 1]).split() == ["w5", "<unk>", "<eos>"]  # nothing skipped


# ------------------------------------------------------ command lines


def test_warm_sizes_cover_every_eager_size_class_and_residue():
    """P5 (a fair baseline): the warm-up prompts reach both fused-MoE tile
    classes of eager steps (129-512 and 513+ tokens), each with four
    consecutive sizes (every count mod 4: Triton's divisibility-by-16
    specialization of tokens x top-k 4), all inside one prefill chunk."""
    cfg = agentic.AgenticConfig()
    sizes = agentic.warm_sizes(cfg)
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert max(sizes) < cfg.chunk and min(sizes) > 128
    for lo, hi in ((129, 512), (513, cfg.chunk)):
        klass = [n for n in sizes if lo <= n <= hi]
        assert {n % 4 for n in klass} == {0, 1, 2, 3}, (lo, hi, klass)
    assert max(sizes) >= cfg.chunk - 128  # the chunk's own size class
    small = agentic.AgenticConfig(chunk=512, max_model_len=16384)
    assert agentic.warm_sizes(small) and max(agentic.warm_sizes(small)) < 512 - 64
    short = agentic.AgenticConfig(max_model_len=600)
    assert max(agentic.warm_sizes(short)) < 600 - 64
    assert agentic.warm_sizes(agentic.AgenticConfig(chunk=64)) == [32]  # still warmed


@pytest.mark.parametrize("arm", ["plain", "offload", "hisparse", "hisparse_pf", "hisparse@6",
                                 "hisparse_nobackoff", "plain_ample@12"])
def test_vllm_serve_accepts_our_server_commands(arm, tmp_path):
    """`vllm serve`'s own parser and EngineArgs -> VllmConfig (CPU
    platform): same budget and limits everywhere; the connector and
    HiSparse where the arm says."""
    import cpu_noclean  # noqa: F401
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    subprocess.run([sys.executable, str(common.MAKE_MODEL), str(tmp_path)], check=True,
                   capture_output=True)
    c = cfg(compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
            arms=[arm], index_topk_freq=2 if arm == "hisparse_pf" else 1,
            profile_level=4, profile_steps=250)
    cmd = agentic.server_command(arm, c, "python3", str(tmp_path), str(tmp_path / "prof"))
    assert cmd[:5] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(cmd[3:])
    args.model = args.model_tag
    ea = AsyncEngineArgs.from_cli_args(args)
    assert ea.compilation_config.cudagraph_capture_sizes == [1, 2, 4]  # before the CPU's reset
    vc = ea.create_engine_config()
    assert args.port == c.port(arm) and args.served_model_name == [agentic.SERVED_NAME]
    assert vc.cache_config.kv_cache_memory_bytes == c.kv_bytes_of(arm)
    assert (c.kv_bytes_of(arm) > c.kv_bytes) == (arm == "plain_ample@12")
    assert vc.scheduler_config.max_num_seqs == (agentic.arm_cap(arm) or c.max_num_seqs)
    assert args.max_num_batched_tokens == c.chunk  # the CPU platform resizes it in vc
    assert vc.attention_config.sparse_mla_force_mqa is True
    hs = vc.attention_config.hisparse_config
    assert (hs is not None) == arm.startswith("hisparse")
    connector = vc.kv_transfer_config.kv_connector if vc.kv_transfer_config else None
    assert connector == {"plain": None, "offload": "OffloadingConnector",
                         "hisparse": "MultiConnector", "hisparse_pf": "MultiConnector",
                         "hisparse@6": "MultiConnector",
                         "hisparse_nobackoff": "MultiConnector", "plain_ample@12": None}[arm]
    if hs is not None:
        assert hs.host_pool_gib == c.host_pool_gib
        assert hs.prefetch_followers == (arm == "hisparse_pf")
    # --profile-level: the engine's torch profiler, armed, stopping itself
    prof = vc.profiler_config
    assert (prof.profiler, prof.torch_profiler_dir) == ("torch", str(tmp_path / "prof"))
    assert (prof.max_iterations, prof.torch_profiler_with_stack, prof.ignore_frontend) == (
        250, False, True)


def test_profile_level_is_checked_and_off_by_default():
    assert "--profiler-config" not in agentic.server_command("hisparse", cfg(), "p", "/m", "/d")
    c = cfg(arms=["upstream", "hisparse"], profile_level=4)
    assert "--profiler-config" not in agentic.server_command("upstream", c, "p", "/m", "/d")
    plain, profiled = (agentic.estimate_s(cfg(arms=["upstream", "hisparse", "offload"],
                                              profile_level=p)) for p in (None, 4))
    assert plain["profile_s"] == 0  # the profiled level's extra time, our two arms only
    assert profiled["total_s"] - plain["total_s"] == profiled["profile_s"] == 2 * agentic.PROFILE_S
    with pytest.raises(ValueError, match="not among"):
        cfg(profile_level=5).validate()
    with pytest.raises(ValueError, match="--profile-steps"):
        cfg(profile_level=4, profile_steps=0).validate()


def test_ensure_model_writes_the_index_share_it_is_asked_for(tmp_path):
    """--index-topk-freq N: the tiny model's layers share a top-k in groups
    of N (the followers hisparse_pf prefetches); a folder of another share
    is rewritten, one of the same is kept."""
    path = common.ensure_model(tmp_path / "m", 4, 4096, index_topk_freq=2)
    config = json.loads((path / "config.json").read_text())
    assert config["index_topk_freq"] == 2 and config["num_hidden_layers"] == 4
    stamp = (path / "config.json").stat().st_mtime_ns
    assert common.ensure_model(path, 4, 4096, index_topk_freq=2) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp
    common.ensure_model(path, 4, 4096)
    assert "index_topk_freq" not in json.loads((path / "config.json").read_text())


def test_upstream_arm_uses_its_own_surface():
    c = cfg(arms=["upstream"], upstream_compilation_config={"mode": 0})
    cmd = agentic.server_command("upstream", c, "python3", "/m")
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"host_pool_gib": c.host_pool_gib}}
    assert json.loads(cmd[cmd.index("--attention-config") + 1]) == {"sparse_mla_force_mqa": True}
    assert json.loads(cmd[cmd.index("--compilation-config") + 1]) == {"mode": 0}
    assert c.port("upstream") != c.port("hisparse")


def tool_source() -> Path:
    path = TOOL_DIR / agentic.TOOL
    if not path.exists():
        pytest.skip(f"no {path} (scripts/build.sh generates the pinned tree)")
    return path


def test_tool_command_uses_only_flags_the_tool_has():
    tree = ast.parse(tool_source().read_text())
    flags = {a.value for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "attr", "") == "add_argument"
             for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    assert "--stats-json-output" in flags and "--num-clients" in flags
    cmd = agentic.tool_command("python3", Path("t.py"), "/m", "http://x", Path("in.json"),
                               Path("s.json"), 8, cfg(conversations_per_client=2))
    used = {x for x in cmd if x.startswith("--")}
    assert used <= flags, used - flags
    assert cmd[cmd.index("--max-active-conversations") + 1] == "16"


def test_tool_imports_are_on_the_gpu_machine():
    """Every third-party module the multi-turn tool imports is in the GPU
    image (scripts/gpu-bundle/image-packages.txt) or shipped by the bundle
    (deps.txt): it runs there without network."""
    tool_source()
    local = {p.stem for p in TOOL_DIR.glob("*.py")}
    mods = set()
    for p in TOOL_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods.add(node.module.split(".")[0])
    third = {m for m in mods - local if m not in sys.stdlib_module_names}
    assert third >= {"aiohttp", "numpy", "pandas", "transformers"}

    def names(f):
        return {re.split(r"[=\s#]", ln.strip())[0].lower().replace("_", "-")
                for ln in (ROOT / "scripts/gpu-bundle" / f).read_text().splitlines()
                if ln.strip() and not ln.startswith("#")}

    shipped = names("image-packages.txt") | names("deps.txt")
    missing = {m for m in third if m.lower().replace("_", "-") not in shipped}
    assert not missing, f"the multi-turn tool imports {missing}: not on the GPU machine"


def test_tool_reads_our_conversation_list():
    """The tool's own loader takes our file (needs pandas, as the tool)."""
    tool_source()
    pytest.importorskip("pandas")
    sys.path.insert(0, str(TOOL_DIR))
    try:
        import bench_dataset
    finally:
        sys.path.remove(str(TOOL_DIR))
    convs = agentic.conversations(agentic.shape(agentic.Trace(), 0.01), 4, 0, 4, 16384)
    d = bench_dataset.conversations_list_to_dict(json.loads(json.dumps(convs)))
    assert len(d) == 4 and all(len(m) == 26 for m in d.values())


# ---------------------------------------------------------- summaries


def record(start, ttft, tpot, out=100, inp=1000, conv="a", turns=1):
    return {"ttft_ms": ttft, "tpot_ms": tpot, "latency_ms": ttft + tpot * (out - 1),
            "start_time_ms": start, "input_num_turns": turns, "input_num_tokens": inp,
            "output_num_tokens": out, "output_num_chunks": out - 1,
            "output_num_first_chunk_tokens": 1, "approx_cached_percent": 50.0,
            "conversation_id": conv, "client_id": 0}


def test_client_summary():
    recs = [record(0, 100, 10, conv="a"), record(500, 300, 20, conv="b", turns=3),
            record(1000, 200, 0.0, conv="a")]
    s = agentic.client_summary(recs, failures=0)
    # the last request ends at 1000 + 200 + 0 = 1200 ms; the second at 500 + 300 + 1980
    assert s["runtime_s"] == pytest.approx(2.78)
    assert s["output_tokens"] == 300 and s["output_tokens_per_s"] == pytest.approx(300 / 2.78)
    assert s["ttft_ms_p50"] == 200 and s["ttft_ms_p95"] == pytest.approx(290)
    assert s["tpot_ms_p50"] == pytest.approx(15)  # a 0 TPOT (one chunk) is left out
    assert s["conversations"] == 2 and s["input_messages_max"] == 3 and s["failures"] == 0
    assert agentic.client_summary([], None) == {"requests": 0, "failures": None}


def test_tool_failures_sum_the_clients():
    log = ("... Client 0 is done (num_successes=12, num_failures=0)\n"
           "... Client 1 is done (num_successes=10, num_failures=2)\n")
    assert agentic.tool_failures(log) == 2
    assert agentic.tool_failures("nothing") is None


def snaps_of(points):
    """(t, kwargs of metrics_text) -> [(t, prom.snapshot)]."""
    return [(t, prom.snapshot(metrics_text(**kw))) for t, kw in points]


def test_server_summary_time_weights_running_and_takes_deltas():
    snaps = snaps_of([
        (0.0, dict(running=0, preemptions=5, generation=1000, hits=10, lookups=10, h2d=0)),
        (1.0, dict(running=4, preemptions=5, generation=1100, hits=20, lookups=30, h2d=656)),
        (3.0, dict(running=8, preemptions=7, generation=1500, hits=60, lookups=90, h2d=6560)),
        (5.0, dict(running=0, preemptions=7, generation=1900, hits=70, lookups=110, h2d=6560)),
    ])
    s = agentic.server_summary(snaps, 0.5, 4.5)
    # [0.5, 1): 0; [1, 3): 4; [3, 4.5): 8 -> (0 + 8 + 12) / 4
    assert s["mean_running"] == pytest.approx(5.0) and s["peak_running"] == 8
    assert s["preemptions"] == 2 and s["generation_tokens"] == 900
    assert s["generation_tokens_per_s"] == pytest.approx(900 / 5.0)
    assert s["hot_hit_rate"] == pytest.approx(60 / 100) and s["h2d_bytes"] == 6560
    assert s["hisparse"]["vllm:hisparse_live_hot_regions"] == {"last": 4.0, "peak": 4.0}
    # the host pool's size: a gauge despite its _total (run 10 read 0.0, a delta)
    assert s["hisparse"]["vllm:hisparse_host_blocks_total"] == {"last": 1000.0, "peak": 1000.0}
    assert s["prefix_cache_hit_rate"] is None  # no query between the samples
    assert s["prompt_tokens_by_source"]["local_compute"] == 0.0
    assert agentic.server_summary([], 0, 1) == {}


def test_server_summary_splits_the_steps_and_the_inter_token_latencies():
    """P5's where the time goes without a profiler: vLLM's step and ITL
    histograms over the level give the steps, the decode-only share, and
    the fast intervals' mean bounded by the slow buckets' edges."""
    zero_steps, zero_itl = ({"16": 0, "32": 0, "64": 0, "+Inf": 0}, 0.0), \
        ({"0.01": 0, "0.025": 0, "0.05": 0, "+Inf": 0}, 0.0)
    # 100 steps over 0.5 s: 90 decode steps of 8 tokens, 10 mixed of 400
    steps = ({"16": 90, "32": 90, "64": 90, "+Inf": 100}, 90 * 8 + 10 * 400)
    # ITL: 90 at 3 ms, 8 at 20 ms, 2 at 40 ms
    itl = ({"0.01": 90, "0.025": 98, "0.05": 100, "+Inf": 100}, 90 * 0.003 + 8 * 0.02 + 2 * 0.04)
    snaps = snaps_of([(0.0, dict(steps=zero_steps, itl=zero_itl)),
                      (0.5, dict(steps=steps, itl=itl))])
    st = agentic.server_summary(snaps, 0.0, 0.5)["steps"]
    assert st["engine_steps"] == 100 and st["tokens_per_step_mean"] == pytest.approx(47.2)
    assert st["decode_step_share"] == pytest.approx(0.9)
    assert st["step_ms_mean_upper"] == pytest.approx(5.0)
    i = st["itl"]
    assert i["count"] == 100 and i["mean_ms"] == pytest.approx(5.1)
    assert i["over_10ms_share"] == pytest.approx(0.1)
    lo, hi = (8 * 0.01 + 2 * 0.025) / 0.51, (8 * 0.025 + 2 * 0.05) / 0.51
    assert i["over_10ms_time_share"] == pytest.approx([lo, hi], abs=1e-4)
    fast_lo, fast_hi = i["fast_mean_ms"]
    assert fast_lo < 3.0 < fast_hi  # the true 3 ms lies within the bounds
    assert fast_lo == pytest.approx((0.51 - 0.3) / 90 * 1e3, abs=1e-3)
    # a server without the histograms: no step figures, nothing invented
    plain = snaps_of([(0.0, {}), (1.0, {})])
    assert agentic.server_summary(plain, 0.0, 1.0)["steps"] == {}


def test_a_capped_arm_is_its_base_arm_with_fewer_running_requests():
    """``hisparse@6``: the hisparse arm's flags, its own port, --max-num-seqs
    6 (the other arms keep the run's), ordered after its base in reports."""
    c = cfg(arms=["offload", "hisparse", "hisparse@6", "hisparse@3"], concurrency=[32])
    capped = agentic.server_command("hisparse@6", c, "p", "/m")
    base = agentic.server_command("hisparse", c, "p", "/m")
    seqs = lambda cmd: cmd[cmd.index("--max-num-seqs") + 1]  # noqa: E731
    assert (seqs(capped), seqs(base)) == ("6", str(c.max_num_seqs))
    # its flags are hisparse's, less the capture sizes its cap needs (below)
    assert agentic.arm_flags("hisparse@6", c)[:4] == agentic.arm_flags("hisparse", c)
    assert len({c.port(a) for a in c.arms}) == len(c.arms)
    levels = [{"arm": a, "concurrency": 32} for a in ("hisparse@6", "offload", "hisparse@3",
                                                       "hisparse")]
    assert agentic.arms_in(levels) == ["offload", "hisparse", "hisparse@3", "hisparse@6"]
    # a capped arm's prior counts its own cap: fewer tokens/s, a longer level
    assert agentic.level_prior_s(c, "hisparse@3", 32) > agentic.level_prior_s(c, "hisparse", 32)
    assert "hisparse@6" in agentic.ArmNames() and "upstream@6" not in agentic.ArmNames()


def _decode_graph_modes(cmd: list[str], drop_config: bool = False) -> list[str]:
    """vllm_graphs.decode_graph_modes for a server command (its
    --max-num-seqs, --max-num-batched-tokens and --compilation-config, none
    with ``drop_config``)."""
    def arg(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    given = (None if drop_config or "--compilation-config" not in cmd
             else json.loads(arg("--compilation-config")))
    return vllm_graphs.decode_graph_modes(int(arg("--max-num-seqs")),
                                          int(arg("--max-num-batched-tokens")), given)


@pytest.mark.parametrize("seqs,chunk", [(1, 2048), (4, 2048), (6, 2048), (12, 2048),
                                        (64, 2048), (200, 2048), (300, 2048), (64, 48)])
def test_the_default_capture_sizes_are_vllms(seqs, chunk):
    """common.default_capture_sizes (which decides whether a cap is already
    a size) is vLLM 0.26.0's own `_set_cudagraph_sizes` default: small caps,
    the 8-step and 16-step ranges, the 512 bound and a chunk below them."""
    vc, _ = vllm_graphs.sized_config(seqs, chunk, None)
    assert common.default_capture_sizes(seqs, chunk) == vc.compilation_config.cudagraph_capture_sizes


@pytest.mark.parametrize("arm", ["plain_ample@12", "hisparse@6", "hisparse@4", "hisparse"])
def test_a_capped_arm_decodes_its_fullest_batches_in_full_cuda_graphs(arm):
    """vLLM captures FULL decode graphs only at capture sizes <= max_num_seqs;
    under the default sizes a cap that is not one of them ran its fullest
    decode batches PIECEWISE (run 24's plain_ample@12, 9-12 running: every
    decode step through Python, TPOT 9.09 ms against HiSparse's 6.01 at the
    same batch). Read by vLLM's own sizing and dispatcher: every decode
    batch of every arm replays a FULL graph; an arm whose cap is already a
    size (or that has none) gets no compilation config of ours; sizes the
    user gave are kept."""
    c = cfg(arms=[arm], concurrency=[32])
    cmd = agentic.server_command(arm, c, "p", "/m")
    assert set(_decode_graph_modes(cmd)) == {"FULL"}
    added = arm in ("plain_ample@12", "hisparse@6")
    assert ("--compilation-config" in cmd) == added
    # under the defaults alone, the fullest batches would fall back
    assert (_decode_graph_modes(cmd, drop_config=True)[-1] == "PIECEWISE") == added
    mine = {"cudagraph_capture_sizes": [1, 2, 4]}
    assert agentic.capped_compilation_config(arm, mine, c.chunk) == mine


def test_the_ablation_arm_turns_r35_off_through_vllms_plugin_loading():
    """hisparse_nobackoff: the hisparse arm's flags, its servers' processes
    with HISPARSE_ABLATE set (no other arm's), and vLLM's own general-plugin
    loading in a fresh process (as the engine core's) then runs every
    admission attempt (ADMISSION_RETRY_STEPS 0); unknown names refuse."""
    c = cfg(arms=["hisparse", "hisparse_nobackoff"])
    assert agentic.arm_flags("hisparse_nobackoff", c) == agentic.arm_flags("hisparse", c)
    base = {"PATH": "/bin", agentic.ABLATE_ENV: "left over"}
    assert agentic.arm_env("hisparse", base) == {"PATH": "/bin"}
    assert agentic.arm_env("hisparse_nobackoff", base)[agentic.ABLATE_ENV] == "admission_backoff"
    probe = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
             "from vllm.v1.hisparse import kv_cache_coordinator as k; "
             "print('steps', k.ADMISSION_RETRY_STEPS)")

    def run(env_extra):
        env = common.child_env(variant="n02", in_process=True)
        env.pop(agentic.ABLATE_ENV, None)
        env.update(env_extra)
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=300)

    on, off = run({}), run(agentic.arm_env("hisparse_nobackoff", {}))
    assert "steps 8" in on.stdout, on.stderr[-2000:]
    assert "steps 0" in off.stdout, off.stderr[-2000:]
    bad = run({agentic.ABLATE_ENV: "nonsense"})
    assert bad.returncode != 0 and "unknown ablation" in bad.stderr


def test_server_summary_without_hisparse_series():
    snaps = [(0.0, prom.snapshot('vllm:num_requests_running{engine="0"} 2\n')),
             (2.0, prom.snapshot('vllm:num_requests_running{engine="0"} 2\n'))]
    s = agentic.server_summary(snaps, 0.0, 2.0)
    assert s["mean_running"] == 2 and s["hot_hit_rate"] is None and s["h2d_bytes"] is None
    assert s["preemptions"] is None and s["hisparse"] == {}


def test_running_series_is_relative_and_thinned():
    snaps = snaps_of([(10.0 + i, dict(running=i % 5, waiting=1)) for i in range(1000)])
    pts = agentic.running_series(snaps, 10.0, max_points=100)
    assert pts[0] == [0.0, 0.0, 1.0] and pts[-1] == [999.0, 4.0, 1.0]
    assert len(pts) <= 101


def test_cache_info_reads_the_gpu_blocks():
    info = agentic.cache_info(metrics_text())
    assert info == {"num_gpu_blocks": "3196", "block_size": "64", "cache_dtype": "fp8",
                    "enable_prefix_caching": "True", "num_cpu_blocks": "None"}
    assert agentic.cache_info("") == {}


# -------------------------------------------------------------- report


def level(arm, c, running, tok_s, tpot, **extra):
    return {"arm": arm, "concurrency": c, "status": "ok",
            "client": {"output_tokens_per_s": tok_s, "tpot_ms_p50": tpot, "failures": 0,
                       "requests": 10},
            "server": {"mean_running": running, "preemptions": 0}, **extra}


def test_report_schema_and_verdicts():
    levels = [level("plain", 16, 3, 100, 10), level("offload", 16, 4, 120, 10),
              level("hisparse", 16, 15, 300, 9)]
    rep = agentic.build_report(cfg=cfg(), command="scripts/bench-agentic", arms={"plain": {}},
                               levels=levels, runs=[{}], failures=[])
    assert rep["schema"] == agentic.SCHEMA
    for key in ("command", "config", "workload", "arm_docs", "runs", "arms", "levels",
                "targets", "failures"):
        assert key in rep
    assert rep["workload"]["shape"]["first"] == 9250
    assert rep["targets"]["P4"]["pass"] is True and rep["targets"]["P5"]["pass"] is True
    assert rep["targets"]["P8"]["pass"] is None
    json.dumps(rep)


def test_merge_unites_runs_and_a_later_level_wins():
    ours = agentic.build_report(cfg=cfg(), command="a", arms={"hisparse": {"version": "ours"}},
                                levels=[level("hisparse", 8, 8, 300, 7),
                                        level("hisparse", 4, 4, 200, 5)], runs=[{}], failures=[])
    up = agentic.build_report(cfg=None, command="b", arms={"upstream": {"version": "0.30.0"}},
                              levels=[level("upstream", 8, 8, 250, 8),
                                      level("upstream", 4, 4, 150, 6)], runs=[{}],
                              failures=["x"])
    m = agentic.merge([ours, up], ["ours.json", "up.json"], tax={"pass": True})
    assert set(m["arms"]) == {"hisparse", "upstream"} and m["config"] == ours["config"]
    assert m["targets"]["P8"]["pass"] is True and m["failures"] == ["up.json: x"]
    again = agentic.merge([m, agentic.build_report(
        cfg=None, command="c", arms={}, levels=[level("upstream", 8, 8, 350, 8)], runs=[],
        failures=[])], ["m.json", "rerun.json"], tax={"pass": True})
    assert again["targets"]["P8"]["pass"] is False
    assert [lv["source"] for lv in again["levels"] if lv["arm"] == "upstream" and
            lv["concurrency"] == 8] == ["rerun.json"]
    with pytest.raises(ValueError):
        agentic.merge([{"schema": "bench-tax/1"}], ["t.json"])


def test_host_ms_per_step_converts_the_engine_samples_by_vllms_step_count():
    """P5 analysis (docs/benchmarks.md "bench-agentic"): busy host ms per
    engine step = main-thread samples / rate / steps, and a mark's part =
    its share of that; from the busiest sampled process, at the record's
    own rate or, for an older file, the runs' one rate; none without
    steps, samples or a rate."""
    lv = {"server": {"steps": {"engine_steps": 500}},
          "samples": [{"summary": {"main_samples": 40, "marks": {"x": 0.5}}},
                      {"summary": {"main_samples": 1000,
                                   "marks": {"schedule (": 0.25, "hisparse/": 0.1}}}]}
    assert agentic.host_ms_per_step(lv, 100) == {"busy": 20.0, "schedule (": 5.0,
                                                 "hisparse/": 2.0}
    lv["samples"][1]["rate_hz"] = 200
    assert agentic.host_ms_per_step(lv, 100)["busy"] == 10.0
    del lv["samples"][1]["rate_hz"]
    assert agentic.host_ms_per_step(lv, None) is None
    assert agentic.host_ms_per_step({**lv, "server": {}}, 100) is None
    assert agentic.host_ms_per_step({**lv, "samples": [{"error": "x"}]}, 100) is None
    sampled = {**level("hisparse", 16, 15, 300, 9), **lv}
    rep = agentic.build_report(cfg=None, command="c", arms={}, levels=[sampled],
                               runs=[{"sample_engines": {"rate_hz": 100}}], failures=[])
    assert rep["levels"][0]["host_ms_per_step"]["busy"] == 20.0
    two_rates = [{"sample_engines": {"rate_hz": 100}}, {"sample_engines": {"rate_hz": 50}}]
    rep = agentic.build_report(cfg=None, command="c", arms={}, levels=[sampled],
                               runs=two_rates, failures=[])
    assert "host_ms_per_step" not in rep["levels"][0]


def test_tax_verdict_comes_from_bench_tax():
    assert agentic.tax_verdict({"targets": {"P8_tax": {"pass": False}}}) == {"pass": False}
    assert agentic.tax_verdict(None) is None


def test_the_batch_control_holds_every_conversation_of_the_highest_level():
    """plain_ample (P5's batch control): the only arm whose budget is not
    the run's; it holds every conversation of the highest level at the
    workload's longest context with a margin, in whole MiB, never below
    --kv-bytes, whatever its cap: the waiting conversations' histories
    must stay in its prefix cache (run 23's control held its 12 running
    requests only and recomputed every prompt); it runs plain's engine."""
    c = cfg(arms=["offload", "hisparse", "plain_ample@12"], concurrency=[8, 32])
    longest = c.shape().max_context()
    ample = c.kv_bytes_of("plain_ample@12")
    need = 32 * longest * agentic.PLAIN_BYTES_PER_TOKEN * agentic.AMPLE_MARGIN
    assert ample % agentic.MIB == 0 and need <= ample < need + agentic.MIB
    assert c.kv_bytes_of("plain_ample") == c.kv_bytes_of("plain_ample@4") == ample
    two = cfg(arms=["plain_ample@12"], concurrency=[16], conversations_per_client=2)
    assert two.kv_bytes_of("plain_ample@12") == agentic.ample_kv_bytes(32, longest)
    assert {a: c.kv_bytes_of(a) for a in ("plain", "offload", "hisparse", "hisparse@6")} == \
        dict.fromkeys(("plain", "offload", "hisparse", "hisparse@6"), c.kv_bytes)
    assert agentic.arm_flags("plain_ample@12", c)[:2] == agentic.arm_flags("plain", c)
    big = cfg(kv_bytes=64 << 30)
    assert big.kv_bytes_of("plain_ample@2") == big.kv_bytes  # never less than the run's
    cmd = agentic.server_command("plain_ample@12", c, "py", "/m")
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(ample)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "12"


def test_the_log_digest_keeps_the_lines_that_say_why_a_request_failed(tmp_path):
    """Run 24's offloader lost one request and the digest (each log's last
    150 lines) no longer held why: the lines before the tail that say why
    something failed (the tool's refusal and timeout lines, the server's
    4xx/5xx access lines, errors, tracebacks) come first, numbered; a log
    without any, or with them only in its tail, is its tail alone."""
    logs = tmp_path / "logs"
    logs.mkdir()
    tool = [f"INFO - Client {i % 32} sent a turn" for i in range(300)]
    tool[9] = "WARNING - Received HTTP status 400 (Bad Request): prompt too long"
    tool[20] = "ERROR - Client 21 - Timeout during conversation ID 7 (turn: 3)"
    tool[290] = "ERROR - in the tail"
    (logs / "tool_offload_c32.log").write_text("\n".join(tool) + "\n")
    server = ['INFO: 127.0.0.1 - "POST /v1/chat/completions HTTP/1.1" 200 OK'] * 200
    server[5] = 'INFO: 127.0.0.1 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error'
    (logs / "server_offload.log").write_text("\n".join(server) + "\n")
    (logs / "server_hisparse.log").write_text("\n".join(["INFO ok"] * 200) + "\n")
    out = common.log_digest(logs, tmp_path / "digest.txt", lines=150)
    text = out.read_text()
    assert "===== tool_offload_c32.log (failure lines before the tail: 2 of 2)\n" \
           "10: WARNING - Received HTTP status 400 (Bad Request): prompt too long\n" \
           "21: ERROR - Client 21 - Timeout during conversation ID 7 (turn: 3)\n" in text
    assert "6: INFO: 127.0.0.1 - \"POST /v1/chat/completions HTTP/1.1\" 500" in text
    assert text.count("ERROR - in the tail") == 1
    assert "server_hisparse.log (failure lines" not in text
    assert "===== server_hisparse.log (last 150 of 200 lines)" in text
