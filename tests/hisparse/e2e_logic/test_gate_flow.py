# SPDX-License-Identifier: Apache-2.0
"""The gate's control flow (tests/e2e/run_e2e.py Gate) end to end on CPU,
with a stand-in for vllm.LLM: the real argument parsing, plans, weights
init and fingerprints (on a small torch model), generate loop, schedule
instrumentation, comparisons, checks, negative control and e2e.json. The
stand-in's arms agree unless told otherwise, so each verdict is shown to
pass and to fail."""

import json
from types import SimpleNamespace

import pytest
import run_e2e as e2e
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(torch.zeros(8, 4), requires_grad=False)


class Drafter(nn.Module):
    """An MTP drafter after the proposer's load_model: a parameter of its
    own, the target's lm_head shared (the same module)."""

    def __init__(self, target: Model) -> None:
        super().__init__()
        self.eh_proj = nn.Module()
        self.eh_proj.weight = nn.Parameter(torch.zeros(4, 8), requires_grad=False)
        self.lm_head = target.lm_head


class Queue(list):
    """vLLM's FCFS request queue, as much of it as the replay tap uses."""

    def add_request(self, r) -> None:
        self.append(r)

    def remove_requests(self, rs) -> None:
        for r in list(rs):
            self.remove(r)


class Scheduler:
    """What the gate touches of vLLM's scheduler: running and waiting
    requests in order, a token budget per step, a request finishing once its
    prompt is computed. With ``skew["schedule"]`` the HiSparse arm admits
    one waiting request per step and computes at most 1000 tokens a step
    (as HiSparse deferring admissions and waiting for copies under
    pressure): other batches than the off arm's."""

    def __init__(self, owner) -> None:
        self.owner = owner
        # an engine with the offloader reports its hit as external tokens
        self.connector = (SimpleNamespace(update_state_after_alloc=lambda r, b, n: None)
                          if owner.kw.get("kv_transfer_config") else None)
        self.running: list = []
        self.waiting = Queue()
        self.block_size = 64
        self.num_spec_tokens = owner.k
        self.max_num_scheduled_tokens = owner.kw["max_num_batched_tokens"]
        stats = SimpleNamespace(lost_pages=0, spills_completed=0, waits_for_in_flight=0,
                                pages_adopted=0)
        self.kv_cache_manager = SimpleNamespace(coordinator=SimpleNamespace(
            hisparse=SimpleNamespace(stats=stats, pending_spills={})
            if owner.hisparse else None))

    def _preempt_request(self, *a) -> None:
        pass

    def has_requests(self) -> bool:
        return bool(self.running or self.waiting) or self.owner.push_work > 0

    def make_spec_decoding_stats(self, stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        return None  # log stats off, as in the gate

    def finish_requests(self, *a) -> list:
        return []

    def schedule(self, *a):
        split = self.owner.hisparse and self.owner.skew.get("schedule")
        budget = self.max_num_scheduled_tokens
        if self.owner.skew.get("no_budget") and not self.owner.hisparse:
            budget = 1 << 30  # a scheduler the replay cannot pace
        if split:
            # a HiSparse engine without pressure computes more a step
            budget = min(budget, 1500 if self.owner.no_pressure else 1000)
        out = {}
        admissible = list(self.waiting)[:1] if split else list(self.waiting)
        for r in self.running + admissible:
            n = min(r.left, budget)
            if n > 0:
                out[r.request_id], budget = n, budget - n
                r.chunks += 1
        for r in list(self.waiting):
            if r.request_id in out:
                self.waiting.remove(r)
                self.running.append(r)
                if self.connector is not None and r.hit_tokens:
                    self.connector.update_state_after_alloc(r, None, r.hit_tokens)
        return SimpleNamespace(num_scheduled_tokens=out, scheduled_new_reqs=[])


class Lp(SimpleNamespace):
    pass


class FakeLLM:
    """What the gate touches of vllm.LLM. Tokens and logprobs are a function
    of the prompt (and of the weights' norm, so the sensitivity control
    sees its re-init); ``skew`` alters the HiSparse arm's output. A prefix
    cache as vLLM's: a prompt extending a finished request's prompt reads
    that computation (the first one cached wins, like the block pool's
    first block per hash), whose chunking shows in the low bits."""

    skew: dict = {}

    def __init__(self, **kw) -> None:
        self.kw = kw
        hs = kw["attention_config"].hisparse_config
        self.hisparse = hs is not None
        self.no_pressure = self.hisparse and hs.admission_max_tokens is not None
        self.cache: dict[tuple, int] = {}  # cached prompt -> its chunks
        # HiSparse's last spills after generate() returns: zero-token steps
        # land them, and a reset before they land fails (as the real pool)
        self.push_work = 0
        self.k = (kw.get("speculative_config") or {}).get("num_speculative_tokens", 0)
        self.model = Model()
        self.drafter = Drafter(self.model) if self.k else None
        self.pending: dict[str, tuple] = {}
        self.counter = 0
        self.fault_armed = False
        self.fired = 0
        self.steps = 0
        sched = Scheduler(self)
        self.llm_engine = SimpleNamespace(
            engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=sched),
                                        shutdown=lambda: None),
            vllm_config=SimpleNamespace(
                scheduler_config=SimpleNamespace(async_scheduling=True,
                                                 max_num_batched_tokens=kw[
                                                     "max_num_batched_tokens"]),
                model_config=SimpleNamespace(max_model_len=kw["max_model_len"]),
                compilation_config=SimpleNamespace(cudagraph_mode="FULL_AND_PIECEWISE",
                                                   mode=3),
                kv_transfer_config=None,
                cache_config=SimpleNamespace(num_gpu_blocks=kw.get("num_gpu_blocks_override")),
                attention_config=SimpleNamespace(sparse_mla_force_mqa=True)),
            has_unfinished_requests=lambda: bool(self.pending),
            step=self.step, abort_request=self.abort)

    # ----------------------------------------------------------- engine
    def enqueue(self, prompts, params, use_tqdm=False):
        """Returns internal ids, as vLLM 0.26 (the external id + "-" + 8
        random characters); outputs and aborts use the external ones."""
        ids = []
        for p, sp in zip(prompts, params):
            rid = str(self.counter)
            self.counter += 1
            self.pending[rid] = (p["prompt_token_ids"], sp)
            ids.append(f"{rid}-1a2b3c4d")
            hit = self.cached_prefix(p["prompt_token_ids"])
            self.scheduler().waiting.add_request(SimpleNamespace(
                request_id=ids[-1], arrival_time=self.counter, left=len(p["prompt_token_ids"]),
                chunks=0, hit_tokens=len(hit) if hit else 0))
        return ids

    def scheduler(self):
        return self.llm_engine.engine_core.engine_core.scheduler

    def cached_prefix(self, prompt) -> tuple | None:
        """The longest cached prompt that ``prompt`` extends, if any."""
        return max((k for k in self.cache if len(k) < len(prompt)
                    and tuple(prompt[:len(k)]) == k), key=len, default=None)

    def step(self):
        sched = self.scheduler()
        scheduled = sched.schedule().num_scheduled_tokens
        outs = []
        for r in list(sched.running):
            r.left -= scheduled.get(r.request_id, 0)
            if r.left == 0:
                sched.running.remove(r)
                rid = r.request_id.split("-")[0]
                p, sp = self.pending.pop(rid)
                outs.append(self.output(rid, p, sp, r.chunks))
                if self.k:
                    sched.make_spec_decoding_stats(
                        None, num_draft_tokens=self.k, num_accepted_tokens=self.accepted(p),
                        num_invalid_spec_tokens=None, request_id=r.request_id)
        self.steps += 1
        if self.push_work:
            self.push_work -= 1
        elif self.hisparse and outs and not sched.running and not sched.waiting:
            self.push_work = 2  # the finished requests' spills still landing
        if self.hisparse:
            self.stats().lost_pages += 3 * (not self.no_pressure)
            self.stats().pages_adopted += self.no_pressure
            self.stats().spills_completed += 2
        return outs

    def output(self, rid, prompt, sp, chunks=1):
        scale = float(self.model.norm.weight.sum())
        early = sum(prompt[: len(prompt) // 2]) if scale > 1 else 0
        corrupt = self.fault_armed and len(prompt) > 6000
        if corrupt:
            self.fault_armed, self.fired = False, self.fired + 1
        base = (sum(prompt[-8:]) + early + 7 * corrupt) % 8000
        bits = self.skew.get("bits", 0.0) if self.hisparse else 0.0
        toks = [(base + i) % 8000 + 2 for i in range(sp.max_tokens)]
        hit = self.cached_prefix(prompt)
        cached_chunks = self.cache[hit] if hit is not None else 0
        self.cache.setdefault(tuple(prompt), chunks)
        # Batch variance: the low bits depend on how the prompt was chunked,
        # its cached prefix's included.
        lp = -1.5 - bits - chunks * 2 ** -30 - cached_chunks * 2 ** -28
        lps = [{t: Lp(logprob=lp, rank=1), t + 1: Lp(logprob=-2.5, rank=2)}
               for t in toks]
        return SimpleNamespace(request_id=rid, finished=True, outputs=[
            SimpleNamespace(token_ids=toks, logprobs=lps)])

    def accepted(self, prompt) -> int:
        """Drafts accepted: a function of the prompt; ``skew["accept"]``
        shifts the HiSparse arm's."""
        n = len(prompt) + (self.hisparse and bool(self.skew.get("accept")))
        return n % (self.k + 1)

    def abort(self, ids):
        sched = self.scheduler()
        for i in ids:
            self.pending.pop(i, None)
            for q in (sched.running, sched.waiting):
                for r in [r for r in q if r.request_id.split("-")[0] == i]:
                    q.remove(r)

    def stats(self):
        return self.scheduler().kv_cache_manager.coordinator.hisparse.stats

    # --------------------------------------------------------- control
    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self):
        if self.push_work:
            return False  # host blocks still leased by spills in flight
        self.cache.clear()
        return not self.skew.get("reset_fails")

    def collective_rpc(self, fn):
        if getattr(fn, "func", fn).__module__ == "seeded_init":  # the worker's models
            return [fn(SimpleNamespace(get_model=lambda: self.model,
                                       get_draft_model=lambda: self.drafter))]
        name = getattr(fn, "__name__", "")
        if name == "arm_host_row_fault":
            self.fault_armed = True
            return [{"armed": True}]
        if name == "fault_status":
            return [{"fired": self.fired, "last": {"page": 0}}]
        if name == "worker_counters":
            # cumulative, as the worker's counters
            return [{"misses": 5 * self.steps * self.hisparse, "fault_fired": self.fired}]
        return [{}]


@pytest.fixture
def gate(tmp_path, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "cpu")
    monkeypatch.setattr(e2e, "make_models", lambda stage: {
        "glm": stage / "g", "glm_share": stage / "s", "glm_mtp": stage / "m"})
    monkeypatch.setattr(e2e, "shutdown", lambda llm: None)

    def run(engines, scenarios="single6k,concurrent,fault_probe", **skew):
        FakeLLM.skew = skew
        out = tmp_path / "out"
        args = e2e.parse_args(["--out", str(out), "--stage", str(tmp_path),
                               "--engines", engines, "--scenarios", scenarios])
        rc = e2e.Gate(args).run()
        R = json.loads((out / "e2e.json").read_text())
        assert "records" not in R
        R.update(json.loads((out / "e2e_records.json").read_text()))
        return rc, R

    return run


def entry(R, engine, scenario):
    return next(e for e in R["scenarios"] if e["engine"] == engine and e["scenario"] == scenario)


def test_a_clean_run_passes_with_both_controls(gate):
    rc, R = gate("off_c2k,on_c2k")
    assert rc == 0, R["failures"]
    assert R["sensitivity"]["meets"] and R["sensitivity"]["chosen"] == "n02"
    assert len(R["sensitivity"]["variants"]) == len(e2e.seeded_init.VARIANTS)
    assert R["negative_control_detected"] is True
    assert R["weights_identical"] == {"('glm', 1)": True}
    single = entry(R, "on_c2k", "single6k")
    assert single["comparison"]["bitwise_logprobs"] and single["comparison"]["schedule_equal"]
    assert single["pass"] and single["checks"]["lost_pages"]
    probe = entry(R, "on_c2k", "fault_probe")
    assert probe["negative_control"]["detected"] and probe["negative_control"]["fired"] == 1
    assert R["engines"]["off_c2k"]["plan"] == ["single6k", "concurrent", "fault_probe"]


def test_logprob_bits_under_an_equal_schedule_fail(gate):
    rc, R = gate("off_c2k,on_c2k", scenarios="single6k", bits=2 ** -20)
    cmp = entry(R, "on_c2k", "single6k")["comparison"]
    assert rc == 1 and cmp["identical_tokens"] and not cmp["bitwise_logprobs"]
    assert cmp["note"] == "logprobs differ under an equal schedule"


def test_a_different_schedule_is_judged_by_the_replay(gate):
    """T1 under pressure: HiSparse ran other batches than the off arm (its
    natural comparison decides nothing); the replay arm ran HiSparse's
    steps and is bitwise equal."""
    rc, R = gate("off_c2k,on_c2k,rep_c2k", scenarios="single6k,concurrent", schedule=True)
    assert rc == 0, R["failures"]
    for scenario in ("single6k", "concurrent"):
        e = entry(R, "on_c2k", scenario)
        assert not e["comparison"]["schedule_equal"] and not e["comparison"]["bitwise_logprobs"]
        assert e["decided_by"] == "replay" and e["replay"]["bitwise_logprobs"]
    assert R["engines"]["rep_c2k"]["plan"] == ["on_c2k/single6k", "on_c2k/concurrent"]


def test_the_replay_reproduces_a_skewed_schedule(gate):
    rc, R = gate("off_c2k,on_c2k,rep_c2k", scenarios="single6k", schedule=True)
    e = entry(R, "on_c2k", "single6k")
    assert rc == 0, R["failures"]
    assert not e["comparison"]["schedule_equal"]
    assert e["comparison"]["note"] == e2e.compare.SCHEDULE_DIFFERED
    assert e["replay"]["schedule_equal"] and e["replay"]["bitwise_logprobs"]
    assert e["replay"]["diverged"] is None and e["decided_by"] == "replay"
    assert e["replay"]["steps"] == [6, 6]  # 1000-token chunks in both arms


def test_bits_under_a_replayed_schedule_fail(gate):
    """What the natural comparison could not see (other batches) the replay
    does: a logprob one ulp off under HiSparse's own schedule."""
    rc, R = gate("off_c2k,on_c2k,rep_c2k", scenarios="single6k", bits=2 ** -20,
                 schedule=True)
    e = entry(R, "on_c2k", "single6k")
    assert rc == 1 and e["comparison"]["pass"] and not e["pass"]
    assert e["replay"]["note"] == "logprobs differ under an equal schedule"


def test_a_differing_schedule_without_a_replay_fails(gate):
    rc, R = gate("off_c2k,on_c2k", scenarios="single6k", schedule=True)
    assert rc == 1 and not entry(R, "on_c2k", "single6k")["pass"]
    assert any("no replay ran" in f for f in R["failures"])


def test_a_replay_that_cannot_follow_fails(gate):
    rc, R = gate("off_c2k,on_c2k,rep_c2k", scenarios="single6k", schedule=True,
                 no_budget=True)
    e = entry(R, "on_c2k", "single6k")
    assert rc == 1 and e["replay"]["note"] == e2e.compare.REPLAY_DIVERGED
    assert e["replay"]["diverged"]["step"] == 0


def test_missing_pressure_fails_the_checks(gate, monkeypatch):
    rpc = FakeLLM.collective_rpc  # the weights (seeded_init) still reach the models

    def no_worker_counters(self, fn):
        return rpc(self, fn) if getattr(fn, "func", fn).__module__ == "seeded_init" else [{}]

    monkeypatch.setattr(FakeLLM, "collective_rpc", no_worker_counters)
    rc, R = gate("off_c2k,on_c2k", scenarios="single6k")
    e = entry(R, "on_c2k", "single6k")
    assert rc == 1 and e["comparison"]["pass"] and not e["checks"]["hot_misses"]


def test_a_fault_the_comparison_misses_fails_the_run(gate, monkeypatch):
    """The fault "fires" but changes nothing the comparison sees."""
    rpc = FakeLLM.collective_rpc

    def fires_harmlessly(self, fn):
        if getattr(fn, "__name__", "") == "arm_host_row_fault":
            self.fired = 1
            return [{"armed": True}]
        return rpc(self, fn)

    monkeypatch.setattr(FakeLLM, "collective_rpc", fires_harmlessly)
    rc, R = gate("off_c2k,on_c2k", scenarios="fault_probe")
    nc = entry(R, "on_c2k", "fault_probe")["negative_control"]
    assert rc == 1 and nc["fired"] == 1 and not nc["detected"]
    assert R["negative_control_detected"] is False


def test_an_insensitive_init_fails_the_run(gate, monkeypatch):
    monkeypatch.setattr(e2e.workload, "SENSITIVITY_NEEDED", 9)  # of 8 prompts
    rc, R = gate("off_c2k,on_c2k", scenarios="single6k")
    assert rc == 1 and not R["sensitivity"]["meets"]
    assert any("sensitivity" in f for f in R["failures"])


def test_an_mtp_trio_tallies_acceptance_and_passes(gate):
    """E2E-5: every arm sums its drafts per scenario; HiSparse's equals the
    replay's (equal keyed schedules), the off arm's reported beside; the
    drafter's own weights are seeded (the shared lm_head skipped) and
    fingerprinted in every engine; turns run 128 tokens."""
    rc, R = gate("off_mtp1,on_mtp1,rep_mtp1", scenarios="single6k")
    assert rc == 0, R["failures"]
    e = entry(R, "on_mtp1", "single6k")
    acc = e["acceptance_check"]
    assert acc["equal"] is True and acc["decided_by"] == e["decided_by"] == "replay"
    assert acc["on"] == acc["decisive"] == acc["off"] == e["acceptance"]
    assert e["acceptance"]["drafts"] == 1 and e["acceptance"]["draft_tokens"] == 1
    drafter = R["engines"]["on_mtp1"]["weights"]["drafter"]
    assert drafter["aliased"] == ["lm_head.weight"] and drafter["counts"]["normal"] == 1
    assert R["weights_identical"] == {"('glm_mtp', 1)": True}
    assert len(R["records"]["on_mtp1/single6k"]["0/a"]["tokens"]) == e2e.MTP_OUT_TOKENS


def test_mtp_acceptance_differing_from_the_replay_fails(gate):
    """E2E-5: bitwise-equal tokens but other accepted counts under the
    replayed schedule fail the scenario, named as such."""
    rc, R = gate("off_mtp1,on_mtp1,rep_mtp1", scenarios="single6k", accept=True)
    e = entry(R, "on_mtp1", "single6k")
    assert rc == 1 and e["replay"]["bitwise_logprobs"] and not e["pass"]
    assert e["acceptance_check"]["equal"] is False
    assert any("MTP acceptance differs from the replay arm" in f for f in R["failures"])


def test_every_scenario_starts_from_an_empty_prefix_cache(gate, monkeypatch):
    """T1 (run 27): the replay engine replays `returning` for two HiSparse
    engines with two schedules; without a reset before each scenario the
    second replay's follow-ups read the first replay's computation of their
    first turns (other chunks, other low bits) and the gate reports a
    difference HiSparse did not make. With it both replays pass; a reset
    that fails aborts the scenario."""
    rc, R = gate("off_c2k,on_nopressure,on_c2k,rep_c2k", scenarios="returning",
                 schedule=True)
    assert rc == 0, R["failures"]
    for engine in ("on_nopressure", "on_c2k"):
        e = entry(R, engine, "returning")
        assert e["decided_by"] == "replay" and e["replay"]["bitwise_logprobs"], e["replay"]
    assert R["engines"]["rep_c2k"]["plan"] == ["on_nopressure/returning", "on_c2k/returning"]

    rc, R = gate("off_c2k,on_c2k", scenarios="single6k", reset_fails=True)
    assert rc == 1 and any("prefix cache could not be reset" in f for f in R["failures"])

    monkeypatch.setattr(e2e, "run_scenario", _without_reset(e2e.run_scenario))
    rc, R = gate("off_c2k,on_nopressure,on_c2k,rep_c2k", scenarios="returning",
                 schedule=True)
    assert rc == 1
    assert entry(R, "on_nopressure", "returning")["replay"]["bitwise_logprobs"]
    second = entry(R, "on_c2k", "returning")["replay"]
    assert second["schedule_equal"] and not second["bitwise_logprobs"]


def _without_reset(run_scenario):
    """run_scenario as before run 27's fix: the engine's prefix cache kept."""
    def run(llm, *args, **kwargs):
        reset = llm.reset_prefix_cache
        llm.reset_prefix_cache = lambda: True
        try:
            return run_scenario(llm, *args, **kwargs)
        finally:
            llm.reset_prefix_cache = reset
    return run
