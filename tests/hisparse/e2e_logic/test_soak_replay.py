# SPDX-License-Identifier: Apache-2.0
"""The soak's replay (R5, tests/e2e/soak.py follow(), docs/worker.md K28)
on vLLM's real schedulers: a "server" (HiSparse's scheduler under
pressure, async, with the simulated worker) records its schedule through
the test plugin's hook while a client feeds requests, a follow-up after its
parent's answer and an abort mid-prefill; the replay (a HiSparse-off
scheduler in an engine stand-in) follows the recorded steps and finishes
every request the server finished with the same tokens."""

import importlib.util
import json
from types import SimpleNamespace

import pytest

import run_e2e
import soak
import soak_logic as sl
from dry_follow import Engine, QueueEngine
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tests.hisparse.scheduler.harness import (  # noqa: I001
    AsyncDriver,
    SimWorker,
    baseline_kv_cache_config,
    hisparse_kv_cache_config,
    make_request,
    make_scheduler,
    model_output,
    sampled_token,
    schedule,
)


# The plugin module by path: its folder on sys.path would let vLLM's entry
# point discovery load it into every later test's process.
_spec = importlib.util.spec_from_file_location(
    "hisparse_e2e_weights", soak.PLUGIN / "hisparse_e2e_weights.py")
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)


def action(rid, prompt, max_tokens, parent=None, new=None):
    return sl.Action(id=rid, user=0, conv=rid, turn=0 if parent is None else 1, parent=parent,
                     new=list(new if new is not None else prompt), prompt=list(prompt),
                     max_tokens=max_tokens, stream=True, disconnect=None, after=0.0, think_s=0.0)


def serve(tmp_path, monkeypatch):
    """The recorded side: a HiSparse scheduler built after the plugin's
    hook, a client that feeds and sends, a follow-up and an abort."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(Scheduler, "__init__", Scheduler.__init__)  # undone after the test
    monkeypatch.setattr(Scheduler, "_hs_traced", False, raising=False)
    plugin.trace_schedulers(str(work / "trace.jsonl"))
    s = make_scheduler(tmp_path / "server", hisparse_kv_cache_config(
        num_gpu_blocks=100, num_host_blocks=400), async_scheduling=True,
        max_num_batched_tokens=256)
    monkeypatch.undo()  # the replay's scheduler must not write the server's trace
    assert isinstance(s._hs_tap, soak.schedule_replay.ScheduleTap)
    d = AsyncDriver(s, SimWorker(s))
    feed = soak.Feed(work / "requests.jsonl")

    def send(act):
        feed.sent(act)
        r = make_request(sl.server_key(act.id), act.prompt, act.max_tokens)
        s.add_request(r)
        return r

    pa, pc, pd = ([(i * k) % 900 + 2 for i in range(n)]
                  for k, n in ((7, 900), (11, 700), (13, 1000)))
    probe = make_request("probe-1", [5, 6, 7], 1)  # idle: not the client's
    s.add_request(probe)
    while d.busy():
        d.step()
    a, c, dd = send(action("a", pa, 20)), send(action("c", pc, 12)), send(action("d", pd, 8))
    steps, b = 0, None
    while d.busy() or b is None:
        if 0 < dd.num_computed_tokens < len(pd) and not dd.is_finished():
            s.finish_requests([dd.request_id], RequestStatus.FINISHED_ABORTED)  # mid-prefill
        if b is None and a.is_finished():
            feed.add({"id": "a", "record": {"tokens": list(a.output_token_ids)}})
            new = [3, 4, 5] * 40
            b = send(action("b", pa + list(a.output_token_ids) + new, 16, parent="a", new=new))
        d.step()
        steps += 1
        assert steps < 5000
    for rid, r in (("b", b), ("c", c)):
        feed.add({"id": rid, "record": {"tokens": list(r.output_token_ids)}})
    feed.end()
    assert s.kv_cache_manager.coordinator.hisparse.stats.lost_pages > 0  # under pressure
    return work, {sl.server_key(k): list(r.output_token_ids)
                  for k, r in (("a", a), ("b", b), ("c", c))}


def test_the_replay_follows_the_server_and_finishes_what_it_finished(tmp_path, monkeypatch):
    work, served = serve(tmp_path, monkeypatch)
    trace = [json.loads(line) for line in (work / "trace.jsonl").read_text().splitlines()]
    assert trace[0] == [["probe-1", 3, 0]]
    assert [e[0] for step in trace for e in step if e[2] == soak.schedule_replay.ABORTED] == [
        sl.server_key("d")]

    b = make_scheduler(tmp_path / "replay", baseline_kv_cache_config(num_gpu_blocks=2000),
                       async_scheduling=True, max_num_batched_tokens=256)
    llm = SimpleNamespace(llm_engine=Engine(b))
    assert run_e2e.core(llm).scheduler is b
    out = soak.follow(llm, work, deadline=soak.time.time() + 60)
    assert out["diverged"] is None and out["skipped_steps"] == 1 and not out["foreign_steps"]
    assert out["followed"] == trace[1:] and out["replayed"] == out["followed"]
    assert {k: r["tokens"] for k, r in out["records"].items()} == served
    assert out["unfinished"] == [sl.server_key("d")]  # aborted, as on the server

    # R5: the soak's controls run on this engine after the replay; their
    # steps are not replayed ones (run 36: the sensitivity control's 55).
    replayed = list(out["replayed"])
    llm.llm_engine.add_request("control", {"prompt_token_ids": [3] * 300},
                               run_e2e.sampling(4))
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert out["replayed"] == replayed
    assert b.schedule.__func__ is Scheduler.schedule  # the tap let go


# ------------------------------------------------- a soak-shaped load


class ServerDriver(AsyncDriver):
    """The server's engine loop; ``inside`` runs between a step's forward
    and the previous step's output, where EngineCore processes the aborts
    that arrived during the forward (_process_aborts_queue)."""

    inside = None

    def step(self):
        so = schedule(self.scheduler)
        out = self.worker.step(so)
        if self.inside is not None:
            self.inside()
        if self.in_flight is not None:
            prev, prev_out = self.in_flight
            self.scheduler.update_from_output(prev, model_output(self.scheduler, prev, prev_out))
        self.in_flight = (so, out)
        return so


def soak_load(tmp_path, monkeypatch, seed: int, conversations: int = 40):
    """A seeded soak on the HiSparse "server" under pressure: five users'
    conversations with follow-ups (prefix hits), client aborts between steps
    and inside them (also at a request's last token), written to the trace
    and the feed as the soak writes them. Returns the work folder and what
    the server completed."""
    import random

    rng = random.Random(seed)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(Scheduler, "__init__", Scheduler.__init__)
    monkeypatch.setattr(Scheduler, "_hs_traced", False, raising=False)
    plugin.trace_schedulers(str(work / "trace.jsonl"))
    s = make_scheduler(tmp_path / "server", hisparse_kv_cache_config(
        num_gpu_blocks=100, num_host_blocks=400), async_scheduling=True,
        max_num_batched_tokens=256)
    monkeypatch.undo()
    d = ServerDriver(s, SimWorker(s))
    feed = soak.Feed(work / "requests.jsonl")
    live: dict[str, tuple] = {}  # user -> (action, request)
    last: dict[str, tuple] = {}  # user -> (completed action id, prompt + output)
    done: dict[str, list[int]] = {}
    aborted: set[str] = set()

    finished_now: list = []  # the API process may abort these late: vLLM ignores it

    def abort_some(last_token_only: bool) -> None:
        while finished_now:
            r = finished_now.pop()
            if rng.random() < 0.5:
                s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
        for act, r in list(live.values()):
            at_end = 0 < act.max_tokens - r.num_output_tokens <= 1
            if rng.random() < (0.3 if at_end else 0.0 if last_token_only else 0.004):
                s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)

    d.inside = lambda: abort_some(last_token_only=True)
    n = 0
    for _ in range(5000):
        for user in (f"u{i}" for i in range(5)):
            if user not in live and n < conversations and rng.random() < 0.2:
                new = [rng.randint(2, 900) for _ in range(rng.randint(20, 400))]
                parent, base = last.get(user, (None, []))
                act = action(f"{user}-{n}", base + new, rng.randint(2, 20),
                             parent=parent, new=new)
                feed.sent(act)
                r = make_request(sl.server_key(act.id), act.prompt, act.max_tokens)
                s.add_request(r)
                live[user], n = (act, r), n + 1
        abort_some(last_token_only=False)
        d.step()
        for user, (act, r) in list(live.items()):
            if not r.is_finished():
                continue
            del live[user]
            finished_now.append(r)
            if r.status == RequestStatus.FINISHED_ABORTED:
                last.pop(user, None)  # a disconnected turn ends its conversation
                aborted.add(r.request_id)
                continue
            toks = list(r.output_token_ids)
            feed.add({"id": act.id, "record": {"tokens": toks}})
            done[sl.server_key(act.id)] = toks
            last[user] = (act.id, act.prompt + toks)
        if n >= conversations and not live and not d.busy():
            break
    feed.end()
    assert s.kv_cache_manager.coordinator.hisparse.stats.lost_pages > 0  # under pressure
    return work, done, aborted


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_a_soak_shaped_load_is_followed_to_the_end(tmp_path, monkeypatch, seed):
    """R5: the replay follows a seeded soak (follow-ups, aborts between and
    inside steps, at last tokens, and late aborts of finished requests) on
    an engine with vLLM's batch queue, and finishes every request the server
    completed with its tokens. Soak runs 13 and 14 on the H200 diverged
    within seconds; this load reproduces a divergence with either run's
    replay (each mishandled one side of the abort-vs-finish race)."""
    work, served, aborted = soak_load(tmp_path, monkeypatch, seed=seed)
    assert len(served) >= 12
    trace = [json.loads(line) for line in (work / "trace.jsonl").read_text().splitlines()]
    aborts = [e for step in trace for e in step if e[2] == soak.schedule_replay.ABORTED]
    assert aborts
    b = make_scheduler(tmp_path / "replay", baseline_kv_cache_config(num_gpu_blocks=2000),
                       async_scheduling=True, max_num_batched_tokens=256)
    llm = SimpleNamespace(llm_engine=QueueEngine(b))
    out = soak.follow(llm, work, deadline=soak.time.time() + 120)
    assert out["diverged"] is None, out["diverged"]
    assert out["replayed"] == out["followed"] and len(out["followed"]) == len(trace)
    got = {k: r["tokens"] for k, r in out["records"].items()}
    assert {k: got.get(k) for k in served} == served
    # The replay also finishes what the server cut at its last token, or
    # aborted after its last recorded step (aborted there, naturally
    # finished here): never compared.
    assert set(got) - set(served) <= aborted


def test_dry_follow_checks_a_saved_soak_on_the_cpu(tmp_path, monkeypatch, capsys):
    """R5's diagnosis path: the inputs a soak keeps beside soak.json
    (gzipped) are followed on a CPU scheduler by tests/e2e/dry_follow.py;
    a schedule it cannot take is reported with exit 1, missing inputs with
    exit 2."""
    import gzip

    import dry_follow

    work, _, _ = soak_load(tmp_path, monkeypatch, seed=6)
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in ("trace.jsonl", "requests.jsonl"):
        with open(work / name, "rb") as src, gzip.open(kept / f"{name}.gz", "wb") as dst:
            dst.write(src.read())
    assert dry_follow.main([str(kept)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["diverged"] is None and out["followed"] == out["replayed"] > 0
    # A step the replay cannot take: a request's prefill chunk doubled.
    lines = (work / "trace.jsonl").read_text().splitlines()
    i, step = next((i, json.loads(s)) for i, s in enumerate(lines)
                   if any(n > 1 for _, n, _ in json.loads(s)))
    k = next(j for j, (_, n, _) in enumerate(step) if n > 1)
    step[k][1] *= 2
    lines[i] = json.dumps(step)
    (work / "trace.jsonl").write_text("\n".join(lines) + "\n")
    assert dry_follow.main([str(work)]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["diverged"] is not None
    assert dry_follow.main([str(tmp_path / "nothing")]) == 2


def test_dry_follow_samples_each_requests_recorded_output(tmp_path):
    """R5's diagnosis path on a real soak: a follow-up's prompt carries its
    parent's output as the server produced it, so the CPU follower must
    sample those tokens, or the follow-up's prefix hit over them (hashed
    blocks) is shorter than the server's and the follow diverges where the
    GPU replay did not (soak run 15 diverged at step 96 before this, and
    followed all 32,263 steps after). Past the recorded tokens (a request
    the client cut), the stand-in model's own tokens."""
    from dry_follow import recorded_outputs

    feed = tmp_path / "requests.jsonl"
    feed.write_text("\n".join(json.dumps(d) for d in (
        {"id": "u0-1", "sent": {"id": "u0-1"}}, {"id": "u0-1", "tokens": [101, 102, 103]},
        {"end": True})) + "\n")
    recorded = recorded_outputs(feed)
    assert recorded == {sl.server_key("u0-1"): [101, 102, 103]}
    s = make_scheduler(tmp_path / "dry", baseline_kv_cache_config(num_gpu_blocks=50),
                       async_scheduling=True, max_num_batched_tokens=256)
    engine = Engine(s, recorded)
    params = run_e2e.sampling(5)
    engine.add_request(sl.server_key("u0-1"), {"prompt_token_ids": list(range(2, 150))}, params)
    engine.add_request("unrecorded", {"prompt_token_ids": list(range(300, 400))}, params)
    done = {}
    for _ in range(50):
        for o in engine.step():
            done[o.request_id] = o.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    got = done[sl.server_key("u0-1")]
    assert got[:3] == [101, 102, 103] and len(got) == 5
    # past the record, and with no record: the stand-in model's tokens
    assert got[3:] == [sampled_token(148 + i) for i in (3, 4)]
    assert done["unrecorded"] == [sampled_token(100 + i) for i in range(5)]
