# SPDX-License-Identifier: Apache-2.0
"""The e2e gate's replay arm (tests/e2e/schedule_replay.py, docs/worker.md
K28) on vLLM's real schedulers: a HiSparse-off scheduler made to follow a
HiSparse scheduler's recorded steps reproduces them exactly (requests, their
order, token counts, prefix-hit lengths at admission), sync and async,
where its own schedule differs; and a replay that cannot be reproduced is
reported, not hidden. T1's bitwise comparison rests on it: with the same
batches, HiSparse on and off must give the same logprobs."""

import random

import pytest
import schedule_replay as replay
from vllm.v1.request import RequestStatus

from tests.hisparse.scheduler.harness import (
    AsyncDriver,
    BaselineAsync,
    BaselineSync,
    SimWorker,
    baseline_kv_cache_config,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
    run_step,
    run_until_idle,
)


class HiSparseSync:
    def __init__(self, s, w) -> None:
        self.s, self.w = s, w

    def step(self) -> None:
        run_step(self.s, self.w)

    def busy(self) -> bool:
        return self.s.has_unfinished_requests() or self.s.connector.has_pending_push_work()


def scenario(seed: int = 3) -> list[list[tuple[str, list[int], int]]]:
    """Conversations as the gate's: long first turns beside each other,
    then short follow-ups of two of them (prefix hits), in two calls."""
    rng = random.Random(seed)
    first = {f"c{i}": [rng.randint(2, 900) for _ in range(n)]
             for i, n in enumerate((1100, 900, 1300, 700))}
    calls = [[(k, p, 24) for k, p in first.items()]]
    calls.append([(k, first[k] + [rng.randint(2, 900) for _ in range(150)], 16)
                  for k in ("c0", "c2")])
    return calls


def run(s, driver, tap, calls, arm: str, plan=None) -> list:
    tap.start(plan)
    for c, call in enumerate(calls):
        for key, prompt, max_tokens in call:
            req = make_request(f"{c}/{key}-{arm}", prompt, max_tokens)
            tap.name(req.request_id, f"{c}/{key}")
            s.add_request(req)
        run_until_idle(driver)
    tap.finish()
    return tap.steps


@pytest.fixture
def arms(tmp_path):
    def make(async_scheduling: bool):
        s = make_scheduler(tmp_path / "on", hisparse_kv_cache_config(
            num_gpu_blocks=100, num_host_blocks=400),
            async_scheduling=async_scheduling, max_num_batched_tokens=256)
        w = SimWorker(s)
        hs_driver = AsyncDriver(s, w) if async_scheduling else HiSparseSync(s, w)

        def baseline():
            b = make_scheduler(tmp_path / "off", baseline_kv_cache_config(num_gpu_blocks=2000),
                               async_scheduling=async_scheduling, max_num_batched_tokens=256)
            return b, (BaselineAsync(b) if async_scheduling else BaselineSync(b))

        return (s, hs_driver), baseline

    return make


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_replay_reproduces_the_hisparse_schedule(arms, async_scheduling):
    """T1: the off arm follows HiSparse's steps exactly, although its own
    schedule under no pressure differs (HiSparse deferred admissions and
    hit shorter prefixes here)."""
    (s, d), baseline = arms(async_scheduling)
    calls = scenario()
    recorded = run(s, d, replay.ScheduleTap(s), calls, "on")
    assert s.kv_cache_manager.coordinator.hisparse.stats.lost_pages > 0  # under pressure

    b, bd = baseline()
    natural = run(b, bd, replay.ScheduleTap(b), calls, "off")
    assert natural != recorded  # the comparison this replaces could not be bitwise

    b2, bd2 = baseline()
    tap = replay.ScheduleTap(b2)
    replayed = run(b2, bd2, tap, calls, "rep", plan=recorded)
    assert tap.diverged is None
    assert replayed == recorded


def test_replay_caps_a_prefix_hit_at_the_recorded_length(arms):
    """A follow-up HiSparse admitted with a shorter prefix hit than the off
    arm's cache holds is recomputed from the same point in the replay."""
    (s, d), baseline = arms(False)
    calls = scenario()
    recorded = run(s, d, replay.ScheduleTap(s), calls, "on")
    admitted = {k: c for step in recorded for k, _, c in step if c >= 0}
    b, bd = baseline()
    natural = run(b, bd, replay.ScheduleTap(b), calls, "off")
    natural_admitted = {k: c for step in natural for k, _, c in step if c >= 0}
    shorter = [k for k in admitted if admitted[k] < natural_admitted[k]]
    assert shorter  # the cap is exercised: HiSparse hit less than the off arm
    b2, bd2 = baseline()
    tap = replay.ScheduleTap(b2)
    replayed = run(b2, bd2, tap, calls, "rep", plan=recorded)
    assert {k: c for step in replayed for k, _, c in step if c >= 0} == admitted
    assert tap.diverged is None


def test_a_schedule_the_replay_cannot_follow_is_reported(arms):
    """A recorded step asking for more tokens than a request has left (here
    a doctored trace) diverges: the tap says where and falls back to the
    engine's own schedule, so the scenario still finishes."""
    (s, d), baseline = arms(False)
    calls = scenario()
    recorded = run(s, d, replay.ScheduleTap(s), calls, "on")
    doctored = [list(map(list, step)) for step in recorded]
    doctored[2][0][1] += 5000
    b, bd = baseline()
    tap = replay.ScheduleTap(b)
    run(b, bd, tap, calls, "rep", plan=doctored)
    assert tap.diverged is not None and tap.diverged["step"] == 2
    assert tap.diverged["wanted"] == doctored[2]


def test_a_replay_left_unfinished_is_reported(arms):
    (s, d), baseline = arms(False)
    calls = scenario()
    recorded = run(s, d, replay.ScheduleTap(s), calls, "on")
    b, bd = baseline()
    tap = replay.ScheduleTap(b)
    run(b, bd, tap, calls[:1], "rep", plan=recorded)  # the second call never comes
    assert tap.diverged is not None and tap.diverged["left_over"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_replay_preempts_what_host_exhaustion_preempted(tmp_path, async_scheduling):
    """E2E-9 / F8: HiSparse preempts on host exhaustion and recomputes; the
    replay arm, which has no host pool to run out of, preempts the same
    requests before the same steps and resumes them from the same point."""
    s = make_scheduler(tmp_path / "on", hisparse_kv_cache_config(
        num_gpu_blocks=400, num_host_blocks=36, max_num_batched_tokens=512),
        async_scheduling=async_scheduling, max_num_batched_tokens=512, max_num_seqs=4)
    d = AsyncDriver(s, SimWorker(s)) if async_scheduling else HiSparseSync(s, SimWorker(s))
    rng = random.Random(0)
    calls = [[(f"r{i}", [rng.randint(2, 900) for _ in range(900)], 300) for i in range(3)]]
    recorded = run(s, d, replay.ScheduleTap(s), calls, "on")
    preempted = [e for step in recorded for e in step if e[2] == replay.PREEMPTED]
    assert preempted and all(e[1] == 0 for e in preempted)

    b = make_scheduler(tmp_path / "off", baseline_kv_cache_config(num_gpu_blocks=2000),
                       async_scheduling=async_scheduling, max_num_batched_tokens=512,
                       max_num_seqs=4)
    tap = replay.ScheduleTap(b)
    replayed = run(b, BaselineAsync(b) if async_scheduling else BaselineSync(b), tap,
                   calls, "rep", plan=recorded)
    assert tap.diverged is None
    assert replayed == recorded


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_streamed_replay_follows_a_schedule_with_client_aborts(arms, async_scheduling):
    """The soak's replay (R5): the server's schedule arrives a few steps at
    a time while the replay runs, and clients abort requests mid-prefill and
    mid-decode (the abort is recorded at the next step and replayed there);
    a request aborted before it ever ran changes no batch and is not
    recorded."""
    (s, d), baseline = arms(async_scheduling)
    sink: list = []
    tap = replay.ScheduleTap(s, sink=sink.append)
    tap.start()
    rng = random.Random(9)
    reqs = {f"q{i}": [rng.randint(2, 900) for _ in range(n)]
            for i, n in enumerate((1200, 700, 900, 400, 300))}
    for key, prompt in reqs.items():
        r = make_request(f"{key}-on", prompt, 40)
        tap.name(r.request_id, key)
        s.add_request(r)
    aborts = {3: "q0-on", 12: "q1-on", 0: "q4-on"}  # mid-prefill, mid-decode, never ran
    steps, late = 0, set()
    while d.busy():
        if steps in aborts:
            s.finish_requests([aborts[steps]], RequestStatus.FINISHED_ABORTED)
        # A server's abort that raced the request's own finish (the API
        # process had not seen its last output): vLLM ignores it, and it
        # must not enter the trace (soak run 1 diverged on such a step).
        for rid in [f"{k}-on" for k in reqs if f"{k}-on" not in s.requests]:
            if rid not in late:
                late.add(rid)
                s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        d.step()
        steps += 1
        assert steps < 5000
    recorded = list(tap.steps)
    assert sink == recorded
    events = [e for step in recorded for e in step if e[2] == replay.ABORTED]
    assert [e[0] for e in events] == ["q0", "q1"]
    assert "q2-on" in late  # finished, then aborted late: no event

    b, bd = baseline()
    rtap = replay.ScheduleTap(b)
    rtap.start([], streaming=True)
    for key in dict.fromkeys(k for step in recorded for k in replay.step_keys(step)):
        # as the soak's driver: a request enters the replay once the trace
        # names it (q4, aborted before it ran, never does)
        r = make_request(f"{key}-rep", reqs[key], 40)
        rtap.name(r.request_id, key)
        b.add_request(r)
    fed, steps = 0, 0
    while fed < len(recorded) or rtap.plan:
        if steps % 4 == 0:
            rtap.extend(recorded[fed:fed + 3])  # the trace arrives in pieces
            fed += 3
        bd.step()
        steps += 1
        assert steps < 5000
    rtap.streaming = False
    run_until_idle(bd)
    assert rtap.finish() is None
    assert rtap.steps == recorded
    assert "q4-rep" not in b.requests and not b.requests


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_that_cut_a_request_at_its_last_token_is_followed(arms, async_scheduling):
    """R5: a server processes client aborts between a step's forward and its
    output (EngineCore._process_aborts_queue), the replay before its next
    schedule. A request the server cut at its last token has finished
    naturally in the replay by then: the recorded abort is followed, not
    reported as a divergence (soak runs 13-14 diverged within seconds)."""
    _, baseline = arms(async_scheduling)
    b, bd = baseline()
    calls = scenario()
    recorded = run(b, bd, replay.ScheduleTap(b), calls, "rec")
    last = max(i for i, step in enumerate(recorded) for k, n, _ in step if k == "0/c1" and n)
    assert last + 1 < len(recorded)
    cut = [list(step) for step in recorded]
    cut[last + 1] = [["0/c1", 0, replay.ABORTED]] + cut[last + 1]
    r, rd = baseline()
    tap = replay.ScheduleTap(r)
    replayed = run(r, rd, tap, calls, "rep", plan=cut)
    assert tap.diverged is None
    assert replayed == cut


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_admissions_follow_the_recorded_order_not_arrival(arms, async_scheduling):
    """R5 / T1: the recorded engine may admit a younger request before an
    older one in the same step (it deferred the older one, or the older
    one's offloaded prefix was still loading); a step's order is its
    batch's row order, so the replay admits in the recorded order."""
    _, baseline = arms(async_scheduling)
    b, bd = baseline()
    calls = [[("a", list(range(2, 42)), 4), ("b", list(range(50, 90)), 4)]]
    recorded = run(b, bd, replay.ScheduleTap(b), calls, "rec")
    first = recorded[0]
    assert [k for k, _, _ in first] == ["0/a", "0/b"] and all(c == 0 for _, _, c in first)
    plan = [list(step) for step in recorded]
    plan[0] = [first[1], first[0]]  # b admitted before a
    r, rd = baseline()
    tap = replay.ScheduleTap(r)
    replayed = run(r, rd, tap, calls, "rep", plan=plan)
    assert tap.diverged is None
    assert replayed == plan


def test_an_admission_after_an_idle_gap_waits_for_the_last_output(arms):
    """T1's replay under async scheduling (soak run 35's twin, `u2-47`): the
    server admitted a follow-up only after its parent's last output (the
    client sent it then), and that output cached the parent's last page
    (the pin's async scheduler caches after each output; R31 publishes it).
    The recorded trace has no step in between (the server scheduled nothing
    while it waited). A replay that already holds the follow-up would
    schedule it right after the parent's last step, before that step's
    output is processed, and hit one page short; the replay instead waits a
    call for the in-flight output when a wanted admission's hit is short of
    its recorded length."""
    from tests.hisparse.scheduler.harness import sampled_token

    (s, d), baseline = arms(True)
    tap = replay.ScheduleTap(s)
    tap.start()
    parent_prompt = [random.Random(5).randint(2, 900) for _ in range(193)]
    follow_prompt = (parent_prompt + [sampled_token(p) for p in range(193, 257)]
                     + [7] * 100)
    parent = make_request("p-on", parent_prompt, 64)  # KV of 256 tokens: 4 full pages
    tap.name(parent.request_id, "p")
    s.add_request(parent)
    run_until_idle(d)
    follow = make_request("f-on", follow_prompt, 4)
    tap.name(follow.request_id, "f")
    s.add_request(follow)
    run_until_idle(d)
    recorded = list(tap.steps)
    assert [c for step in recorded for k, _, c in step if k == "f"][0] == 256

    b, bd = baseline()
    rtap = replay.ScheduleTap(b)
    rtap.start(recorded)
    for key, prompt, n in (("p", parent_prompt, 64), ("f", follow_prompt, 4)):
        r = make_request(f"{key}-rep", prompt, n)  # both held from the start
        rtap.name(r.request_id, key)
        b.add_request(r)
    run_until_idle(bd)
    assert rtap.finish() is None
    assert rtap.steps == recorded
