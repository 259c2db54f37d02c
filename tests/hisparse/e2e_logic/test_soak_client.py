# SPDX-License-Identifier: Apache-2.0
"""The soak's client (tests/e2e/soak.py Load, drain, idle_state, Feed) with
the real OpenAI client against a stand-in of vLLM's server: every kind of
request and disconnect happens, completed answers parse into records that
equal a replay of the same prompts, and the feed rebuilds every prompt."""

import asyncio
import json
import socket
from dataclasses import dataclass

import httpx
import openai
import pytest
import soak
import soak_logic as sl
from fake_server import FakeServer, fake_model


@dataclass
class Lp:
    logprob: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CFG = sl.SoakConfig(seed=2, users=4, duration_s=3.0, max_model_len=2048, min_prompt=50,
                    max_tokens=(4, 12), new_tokens=(4, 20), think_mean_s=0.05,
                    p_continue=0.7, p_disconnect_prefill=0.2, p_disconnect_decode=0.2,
                    p_cancel_non_stream=0.25, prefill_disconnect_min_prompt=100)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    server = FakeServer(free_port())
    feed_path = tmp_path_factory.mktemp("soak") / "requests.jsonl"

    async def go():
        async with httpx.AsyncClient(timeout=30) as http:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY",
                                        max_retries=0, timeout=30)
            feed = soak.Feed(feed_path)
            load = soak.Load(CFG, server, client, http, feed)
            load_s = await load.run()
            await soak.drain(server, http)
            idle = await soak.idle_state(server, http)
            feed.end()
            return load, load_s, idle

    try:
        load, load_s, idle = asyncio.run(go())
    finally:
        server.stop()
    return load, load_s, idle, feed_path, server.state


def test_every_kind_of_request_ran(run):
    load, load_s, _, _, state = run
    t = sl.traffic(load.results)
    assert load_s >= CFG.duration_s
    assert t.errors == 0, [r.get("error") for r in load.results if r["outcome"] == "error"]
    assert t.completed > 5 and t.streamed > 0 and t.non_streamed > 0
    assert set(t.disconnected) == {"before_first_token", "during_decode", "cancelled"}
    assert state["disconnects"] > 0  # the server saw streams close
    assert any(r["compact"]["parent"] for r in load.results if r["outcome"] == "completed")
    assert load.max_demand > 0 and load.health["polls"] > 0 and load.health["failures"] == 0


def test_completed_answers_equal_a_replay_of_their_prompts(run):
    """The feed announces every request before it is sent and gives every
    completed one's output; from it the replay rebuilds the server's exact
    prompts (R5)."""
    load, _, _, feed_path, state = run
    items = [json.loads(line) for line in feed_path.read_text().splitlines()]
    assert items[-1] == {"end": True}
    sent = {i["id"]: i["sent"] for i in items[:-1] if "sent" in i}
    outputs = {i["id"]: i["tokens"] for i in items[:-1] if "tokens" in i}
    assert set(sent) == {r["id"] for r in load.results}
    done = [r for r in load.results if r["outcome"] == "completed"]
    assert set(outputs) == {r["id"] for r in done}
    # every answered request reached the server under the id the client gave it
    assert {r["id"] for r in done} <= set(state["request_ids"])
    prompts = sl.rebuild_prompts([sent[r["id"]] for r in done], outputs)
    replay = {}
    for r in done:
        positions = fake_model(prompts[r["id"]], sent[r["id"]]["max_tokens"])
        replay[r["id"]] = sl.replay_record(
            [t for t, _ in positions], [{k: Lp(v) for k, v in lps.items()}
                                        for _, lps in positions])
    server = {r["id"]: r["record"] for r in done}
    cmp = sl.compare_records(replay, server)
    assert cmp["compared"] == len(done)
    assert cmp["token_mismatches"] == 0 and cmp["logprob_mismatches"] == 0


def test_idle_state_after_the_drain(run):
    _, _, idle, _, state = run
    assert idle["probe_status"] == 200 and state["probes"] == 1
    assert idle["reset_prefix_cache"] and idle["kv_cache_usage_perc"] == 0.0
    assert idle["running"] == 0.0 and idle["engine_pid"] == 1
