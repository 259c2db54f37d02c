# SPDX-License-Identifier: Apache-2.0
"""The e2e gate's requests (tests/e2e/e2e_workload.py): seeded, within
max_model_len, and shaped as each scenario claims."""

import e2e_workload as wl
import pytest

MAX_MODEL_LEN = 16384
B = wl.BLOCK


def cdiv(a, b):
    return -(-a // b)


def replay(name, output=lambda t: [7] * t.max_tokens):
    """(call index, turn, prompt) of every turn, with fake outputs."""
    histories, out = {}, []
    for c, call in enumerate(wl.scenario(name)):
        for t in call:
            p = wl.prompt_of(t, histories)
            wl.record_turn(t, p, output(t), histories)
            out.append((c, t, p))
    return out


@pytest.mark.parametrize("name", sorted(wl.SCENARIOS))
def test_scenarios_are_seeded_valid_and_fit(name):
    assert wl.scenario(name) == wl.scenario(name)
    turns = replay(name)
    for _, t, p in turns:
        assert all(wl.FIRST_ID <= x < wl.VOCAB for x in p)
        assert len(p) + t.max_tokens <= MAX_MODEL_LEN
    assert wl.max_context(wl.scenario(name)) <= MAX_MODEL_LEN


def test_scenarios_share_no_prefix():
    """No scenario can hit another's prefix cache (or the negative control's
    poisoned host page): their first blocks all differ."""
    firsts = [tuple(p[:B]) for name in wl.SCENARIOS for _, _, p in replay(name)
              if len(p) >= B]
    by_scenario = {}
    for name in wl.SCENARIOS:
        by_scenario[name] = {tuple(p[:B]) for _, _, p in replay(name) if len(p) >= B}
    for a in by_scenario:
        for b in by_scenario:
            if a < b:
                assert not by_scenario[a] & by_scenario[b], (a, b)
    assert firsts


def test_a_later_turn_continues_the_conversation():
    histories = {}
    t1 = wl.Turn("c", (5, 6), 2)
    p1 = wl.prompt_of(t1, histories)
    wl.record_turn(t1, p1, [8, 9], histories)
    assert wl.prompt_of(wl.Turn("c", (3,), 1), histories) == [5, 6, 8, 9, 3]
    assert wl.prompt_of(wl.Turn("d", (3,), 1), histories) == [3]


@pytest.mark.parametrize("chunk", [2048, 8192])
def test_returning_conversations_exceed_the_staging_capacity(chunk):
    """F21: the returns are one call of equal follow-ups whose host-only
    context (the block-aligned first turns) exceeds C_stage."""
    calls = wl.scenario("returning")
    back = calls[-1]
    assert len({len(t.new) for t in back}) == 1 and len(back) == len(wl.RETURNING_LENGTHS)
    c_stage = cdiv(MAX_MODEL_LEN, B) + cdiv(chunk, B)
    assert sum(n // B for n in wl.RETURNING_LENGTHS) > c_stage
    assert all(n % B == 0 for n in wl.RETURNING_LENGTHS)
    assert all(2 <= n // 1024 <= 12 for n in wl.RETURNING_LENGTHS)


def test_equal_followups_compute_the_same_short_length_within_capacity():
    """Block-aligned first prompts with 16-token outputs: every follow-up
    of a round is a prefix hit leaving the same number (<= 256) of tokens
    to compute, so they form a uniform decode-kernel batch (K13); their
    host-only pages fit C_stage at chunk 2048."""
    turns = replay("equal_followups")
    for c in (1, 2):
        computed = set()
        for call, t, p in turns:
            if call == c:
                computed_before = len(p) - len(t.new) - 1  # the last output has no KV
                hit = computed_before // B * B
                computed.add(len(p) - hit)
        assert len(computed) == 1 and 1 < computed.pop() <= 256
    assert sum(n // B for n in wl.EQUAL_FOLLOWUP_LENGTHS) <= cdiv(MAX_MODEL_LEN, B) + 2048 // B


def test_short_topk_prompts_are_at_or_below_topk():
    alone, beside = wl.scenario("short_topk")
    assert all(50 <= len(t.new) <= 256 for t in alone)
    assert max(len(t.new) for t in beside) > 256 >= sorted(len(t.new) for t in beside)[-2]


def test_host_prefix_returns_after_two_fillers():
    calls = wl.scenario("host_prefix")
    assert [c[0].conv for c in calls] == ["a", "f0", "f1", "a"]


def test_sensitivity_twins_replace_only_the_early_part():
    base, twins = wl.sensitivity_prompts()
    assert len(base) == len(twins) == wl.SENSITIVITY_PROMPTS
    cut = int(wl.SENSITIVITY_LEN * wl.SENSITIVITY_FRACTION)
    for b, t in zip(base, twins):
        assert len(b) == len(t) == wl.SENSITIVITY_LEN
        assert b[cut:] == t[cut:]
        assert sum(x != y for x, y in zip(b[:cut], t[:cut])) > cut * 0.99
    assert base == wl.sensitivity_prompts()[0]


def test_unknown_scenario_names_the_known_ones():
    with pytest.raises(KeyError, match="single6k"):
        wl.scenario("nope")


def test_chat_chain_follow_ups_extend_their_parents_decoded_pages():
    """R5 (soak run 19): every follow-up's prompt is its parent's prompt +
    its 80 decoded tokens + new tokens, a prefix hit over pages written
    while decoding; each round comes after a filler, and the conversations
    together outgrow a pressure pool of the gate (~466 blocks at chunk
    2048), so their pages are read back from host."""
    turns = replay("chat_chain", output=lambda t: list(range(100, 100 + t.max_tokens)))
    history = {}
    rounds = 0
    for call, t, p in turns:
        if t.conv.startswith("h"):
            if t.conv in history:
                parent_prompt, parent_out = history[t.conv]
                assert p[: len(parent_prompt) + len(parent_out)] == parent_prompt + parent_out
                assert len(parent_out) == 80 and 150 <= len(t.new) <= 400
                rounds += 1
            history[t.conv] = (p, list(range(100, 100 + t.max_tokens)))
    assert rounds == 3 * len(wl.CHAT_FIRST_LENGTHS)
    assert all(n % B for n in wl.CHAT_FIRST_LENGTHS)  # parents' output pages are partial
    calls = wl.scenario("chat_chain")
    assert [c[0].conv for c in calls[1::2]] == ["g0", "g1", "g2"]
    last = sum(cdiv(len(p) + t.max_tokens, B) for call, t, p in turns if call == len(calls) - 1)
    assert last > 466
