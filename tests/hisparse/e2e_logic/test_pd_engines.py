# SPDX-License-Identifier: Apache-2.0
"""The P/D engines of the e2e gate (tests/e2e/run_e2e.py: off_pd,
pd_prefill, on_pd, rep_pd; docs/pd-imports.md "GPU e2e"; spec 4.13,
INV-30, target T1) on CPU: their configuration and plans, and their
schedules on vLLM's real schedulers (tests/e2e/simulate_pd.py): on_pd
(HiSparse, the gate's pressure pool, asynchronous imports of real files
through the importer's real worker half, the SimWorker checking every row
read) lands imports on the device and on the host without preempting
anyone, and rep_pd (HiSparse off, SparseMLAExampleConnector: synchronous
loads of the same files) reproduces its keyed schedule exactly."""

from pathlib import Path

import e2e_compare as compare
import e2e_workload as wl
import pytest
import run_e2e as e2e
import schedule_replay as replay
import simulate_pd as sim

import vllm.v1.hisparse.pd_imports as pd_imports_module
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    align_to_block_size,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.importing import file_tokens

SPECS = e2e.engine_specs()
PD_COMMAND = "off_pd,pd_prefill,on_pd,rep_pd"  # docs/pd-imports.md, the H200 call


# ------------------------------------------------------------- configuration


def test_the_pd_command_parses_and_plans_every_arm():
    """4.13 / T1: the producer writes every prompt its consumer runs, the
    off engine computes the same prompts (tokens beside on_pd), and rep_pd
    replays each of on_pd's scenarios."""
    engines = PD_COMMAND.split(",")
    assert e2e.parse_args(["--out", "x", "--engines", PD_COMMAND]).engines == engines
    plan = e2e.ON_PLAN["on_pd"]
    assert e2e.plan_for("pd_prefill", engines) == plan
    assert e2e.plan_for("off_pd", engines) == plan
    assert e2e.plan_for("rep_pd", engines) == [f"on_pd/{s}" for s in plan]
    assert plan[-1] == "fault_probe"  # the negative control comes last


@pytest.mark.parametrize("engines,match", [
    ("off_pd,on_pd,pd_prefill,rep_pd", "imports what pd_prefill writes"),
    ("off_pd,on_pd,rep_pd", "imports what pd_prefill writes"),
    ("off_pd,pd_prefill", "writes files for a P/D consumer"),
    ("pd_prefill,on_pd", "needs its reference off_pd"),
])
def test_pd_engine_order_is_validated(engines, match):
    with pytest.raises(ValueError, match=match):
        e2e.parse_args(["--out", "x", "--engines", engines])


def test_the_pd_engines_connectors_share_one_folder(tmp_path):
    """4.13: the producer and the HiSparse-off consumer run
    SparseMLAExampleConnector (the pin's ExampleConnector moves no
    sparse-MLA row), on_pd the pin's ExampleConnector as a user writes it,
    which HiSparse composes into its importer; all over the run's folder."""
    from vllm.config.hisparse import HiSparseConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import compose

    dirs = {m: "/m" for m in e2e.MODEL_DIRS}
    kw = {e: e2e.llm_kwargs(SPECS[e], dirs, tmp_path) for e in ("pd_prefill", "on_pd", "rep_pd")}
    ktc = {e: k["kv_transfer_config"] for e, k in kw.items()}
    for e in ktc:
        assert ktc[e].kv_connector_extra_config == {"shared_storage_path": str(tmp_path)}
    assert (ktc["pd_prefill"].kv_connector, ktc["pd_prefill"].kv_role) == (
        e2e.PD_CONNECTOR, "kv_producer")
    assert (ktc["rep_pd"].kv_connector, ktc["rep_pd"].kv_role) == (
        e2e.PD_CONNECTOR, "kv_consumer")
    assert ktc["pd_prefill"].kv_connector_module_path == e2e.PD_MODULE
    assert (ktc["on_pd"].kv_connector, ktc["on_pd"].kv_role) == ("ExampleConnector",
                                                                 "kv_consumer")
    composed, _ = compose._compose(ktc["on_pd"], HiSparseConfig(host_pool_gib=2))
    children = composed.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in children] == ["HiSparseConnector",
                                                     "HiSparseImportingConnector"]
    assert "kv_transfer_config" not in e2e.llm_kwargs(SPECS["off_pd"], dirs, tmp_path)
    assert kw["on_pd"]["num_gpu_blocks_override"] == e2e.PRESSURE_BLOCKS[2048]
    with pytest.raises(ValueError, match="pd_dir"):
        e2e.llm_kwargs(SPECS["on_pd"], dirs)


def test_the_producer_never_splits_a_prompt_and_writes_one_token():
    """SparseMLAExampleConnector refuses a prompt split into chunks: every
    call of every P/D scenario fits one producer step (its prompts are
    admitted together); its turns generate 1 token, the consumers' 64+."""
    producer = SPECS["pd_prefill"]
    assert producer["chunk"] == e2e.PD_PRODUCER_CHUNK >= e2e.MAX_MODEL_LEN
    for scenario in e2e.ON_PLAN["on_pd"]:
        for call in e2e.scenario_calls(scenario, 0, producer["max_out_tokens"]):
            assert sum(len(t.new) for t in call) <= producer["chunk"]
            assert {t.max_tokens for t in call} == {1}
        consumer = e2e.scenario_calls(scenario, SPECS["on_pd"].get("out_tokens", 0))
        assert min(t.max_tokens for call in consumer for t in call) >= 64


def test_pd_prompts_are_found_where_the_producer_saved_them():
    """4.13 (the pin's file format): the producer keys a prompt's folder by
    its first align(len) tokens, a consumer looks it up by align(len - 1);
    they agree unless len = 1 mod 64, which no P/D prompt is. Every prompt
    is single-turn (the producer's 1-token outputs enter no prompt)."""
    def same_folder(n: int) -> bool:
        return align_to_block_size(n, wl.BLOCK) == align_to_block_size(n - 1, wl.BLOCK)

    assert not same_folder(6401)  # the case this guards against
    for scenario in e2e.ON_PLAN["on_pd"]:
        turns = [t for call in wl.scenario(scenario) for t in call]
        assert len({t.conv for t in turns}) == len(turns)
        for t in turns:
            assert same_folder(len(t.new)) and 2000 <= len(t.new) <= 12000
            assert file_tokens(len(t.new), wl.BLOCK) == align_to_block_size(len(t.new),
                                                                             wl.BLOCK)


def test_on_pd_must_prove_both_landings():
    """4.13 / INV-30: the consumer's checks, and the fault probe's (its
    prompt is imported host-landed); each fails without its counter."""
    spec = SPECS["on_pd"]
    names = compare.expected_checks(spec, "pd_imports")
    assert names == list(compare.PD_CONSUMER)
    good = {"import_device_pages": 3, "import_host_pages": 9, "misses": 4, "preemptions": 0,
            "import_fallbacks": 0}
    assert all(compare.evaluate_checks(names, good).values())
    for key, bad in (("import_device_pages", 0), ("import_host_pages", 0),
                     ("import_fallbacks", 1), ("preemptions", 1), ("misses", 0)):
        assert not all(compare.evaluate_checks(names, dict(good, **{key: bad})).values()), key
    assert compare.expected_checks(spec, "fault_probe") == [
        "fault_fired", "imported_to_host", "no_import_fallback"]
    assert e2e.engine_env(spec, e2e.ON_PLAN["on_pd"]) == {e2e.FAULTS_ENV: "1"}
    assert e2e.engine_env(SPECS["rep_pd"], []) == {}


# ------------------------------------------------- schedules (real schedulers)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    return sim.record(tmp_path_factory.mktemp("pd"))


def test_on_pd_lands_imports_on_the_device_and_on_the_host(recorded):
    """4.13 steps 1-4, INV-30 at the gate's pool (450 blocks, chunk 2048):
    the short prompts alone and beside a long one land resident, the long
    ones host-only (one restore each, of P_last); nothing waits past its
    bound, nothing is preempted, every read row is checked."""
    landings = {j.req_id.rsplit("-", 1)[0]: j.landing for j in recorded["jobs"]}
    assert landings == {"0/p0_0": "device", "1/p1_0": "host", "2/p2_0": "device",
                        "2/p2_1": "host"}
    stats = recorded["stats"]
    assert stats["import_device_pages"] > 0 and stats["import_host_pages"] > 0
    assert stats["import_fallbacks"] == 0 and recorded["preemptions"] == 0
    assert recorded["restores"] == 2 and recorded["hot_misses"] > 0
    assert recorded["reads_checked"] > 0


def test_rep_pd_replays_on_pd_asynchronous_imports(recorded, tmp_path):
    """T1 for P/D: on_pd's import admissions ran no forward (asynchronous
    load); its trace first names each request at its first forward with
    the imported tokens as its hit. rep_pd, loading the same files
    synchronously, is admitted at exactly those steps with the same hits,
    spending no short-hit wait (its connector's tokens count). Here its own
    schedule is the same too: the asynchronous admission step scheduled
    no token, so it leaves no step in the trace."""
    steps, diverged, tap = sim.replay(tmp_path / "rep", recorded)
    assert diverged is None and steps == recorded["steps"]
    assert tap.waited == 0
    hits = {k: c for step in recorded["steps"] for k, _, c in step if c >= 0}
    lengths = {k: len(p) for call in recorded["calls"] for k, p, _ in call}
    assert hits == {k: file_tokens(n, wl.BLOCK) for k, n in lengths.items()}
    assert sim.natural(tmp_path / "off", recorded) == recorded["steps"]


def test_a_short_hit_wait_would_stall_every_import(recorded, tmp_path, monkeypatch):
    """What counting the connector's tokens avoids (the previous test's
    ``waited == 0`` can fail): with the local hit alone, every import looks
    short of its recorded hit and the replay idles before it."""
    monkeypatch.setattr(replay.ScheduleTap, "_hit",
                        lambda self, request: self._computed(request)[1])
    steps, diverged, tap = sim.replay(tmp_path / "rep", recorded)
    assert steps == recorded["steps"]
    assert tap.waited == replay.ScheduleTap.SHORT_HIT_WAITS * len(recorded["calls"])


def test_the_fault_probe_is_imported_host_landed(tmp_path):
    """T1's negative control on on_pd: fault_probe's prompt (125 pages) is
    imported host-landed, so the fault (the first host-only page of the
    batch) corrupts an imported page."""
    got = sim.record(tmp_path, "fault_probe")
    assert [j.landing for j in got["jobs"]] == ["host"]
    (turn,) = wl.scenario("fault_probe")[0]
    assert got["stats"]["import_host_pages"] == file_tokens(len(turn.new), wl.BLOCK) // wl.BLOCK


@pytest.fixture
def given_up(tmp_path, monkeypatch) -> dict:
    """Four 6K prompts at once: three land host-only, the fourth finds no
    room and, with a bound of 1 wait, gives its import up (4.13
    "recompute"): it computes its prompt, although its files exist."""
    monkeypatch.setattr(wl, "PD_CALLS", ((6000, 6004, 6008, 6012),))
    monkeypatch.setattr(pd_imports_module, "MAX_IMPORT_WAITS", 1)
    got = sim.record(tmp_path, "pd_imports")
    assert got["stats"]["import_fallbacks"] == 1 and len(got["jobs"]) == 3
    return got


def test_a_given_up_import_is_computed_by_the_replay_too(given_up, tmp_path):
    """T1: the recorded hit of a given-up import is its local hit (0); the
    replay caps its connector's external tokens there, so it computes the
    prompt as on_pd did."""
    steps, diverged, _ = sim.replay(tmp_path / "rep", given_up)
    assert diverged is None and steps == given_up["steps"]
    assert 0 in {c for step in given_up["steps"] for _, _, c in step}


def test_without_the_external_cap_the_given_up_import_diverges(given_up, tmp_path,
                                                                monkeypatch):
    """The cap is what makes the previous test pass (it can fail): a replay
    that takes every external token the files offer loads the prompt
    on_pd computed."""
    monkeypatch.setattr(replay.ScheduleTap, "get_num_new_matched_tokens",
                        lambda self, r, n: self._external(r, n))
    _, diverged, _ = sim.replay(tmp_path / "rep", given_up)
    assert diverged is not None


def test_simulation_uses_the_gate_engine(recorded):
    """The simulation is the gate's on_pd: its pool and chunk."""
    rig = sim.on_pd_rig(Path(recorded["path"]).parent / "again")
    assert rig.scheduler.kv_cache_manager.coordinator.hisparse.num_gpu_blocks == (
        SPECS["on_pd"]["blocks"])
    assert rig.scheduler.max_num_scheduled_tokens == SPECS["on_pd"]["chunk"]
