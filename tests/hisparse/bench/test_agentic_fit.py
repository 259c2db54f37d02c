# SPDX-License-Identifier: Apache-2.0
"""Every request of bench-agentic's workload fits the server, by the
server's own rules: vLLM's TokenizeParams (the character bound checked
before tokenizing, then the tokens) on the text the model folder's chat
template renders, with vLLM's cached tokenizer of the tiny model."""

import json
import subprocess
import sys

import pytest
from benchlib import agentic, common

L = agentic.AgenticConfig().max_model_len
HEADROOM = 64  # tokens: every request must still pass at max_model_len L - HEADROOM


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    subprocess.run([sys.executable, str(common.MAKE_MODEL), str(path)], check=True,
                   capture_output=True)
    agentic.prepare_model(path)
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    return get_cached_tokenizer(AutoTokenizer.from_pretrained(str(path)))


def server_check(tok, messages, max_tokens, max_model_len=L) -> None:
    """What `vllm serve` does with the tool's chat request before running
    it: raises VLLMValidationError (its HTTP 400) where it would."""
    from vllm.renderers.params import TokenizeParams

    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params = TokenizeParams(max_total_tokens=max_model_len, max_output_tokens=max_tokens,
                            max_total_tokens_param="max_model_len",
                            max_output_tokens_param="max_tokens")
    params.apply_pre_tokenization(tok, {"prompt": text})
    n = len(tok.encode(text, add_special_tokens=False))
    assert n <= params.max_input_tokens, (n, max_tokens)


def requests(conv, widest=None):
    """The tool's requests, (messages, max_tokens) per turn: the history so
    far, the next user turn, max_tokens the dataset's answer. The history's
    answers are the server's outputs: with ``widest``, each of its tokens
    that widest and a leading space (the most the detokenizer can send);
    else the dataset's text."""
    msgs = conv["messages"]
    for t in range(0, len(msgs), 2):
        hist = [m if widest is None or m["role"] == "user" else
                {"role": "assistant",
                 "content": " " + " ".join([widest] * len(m["content"].split()))}
                for m in msgs[:t]]
        yield hist + [msgs[t]], len(msgs[t + 1]["content"].split())


def test_every_request_of_the_default_workload_fits(bench_agentic, tok, tmp_path):
    """Target P5: its verdict needs levels with no failed request, and run1
    (results/agentic/run1) lost one request per arm and level to HTTP 400.
    The files `--write-workload` writes for every default level (the same
    conversations a run sends): every request, with the history's answers
    at their widest, passes vLLM's checks even at max_model_len - 64."""
    assert tok.max_chars_per_token == agentic.SERVER_CHARS_PER_TOKEN == 5  # vLLM's, ours
    widest = max(tok.get_vocab(), key=len)
    assert len(widest) == agentic.SERVER_CHARS_PER_TOKEN
    assert bench_agentic.main(["--write-workload", str(tmp_path)]) == 0
    cfg = agentic.AgenticConfig()
    checked = 0
    for c in cfg.concurrency:
        convs = (tmp_path / f"conversations_c{c}.json").read_text()
        assert convs == json.dumps(cfg.workload(c))
        for conv in json.loads(convs):
            assert len(conv["messages"]) == 2 * cfg.shape().turns  # no turn dropped
            for messages, max_tokens in requests(conv, widest):
                server_check(tok, messages, max_tokens, L - HEADROOM)
                checked += 1
    assert checked == sum(cfg.conversations_at(c) for c in cfg.concurrency) * 13


def test_run1s_overflow_is_trimmed_away(tok):
    """Target P5: run1's failure, reproduced and gone. As drawn (before
    this fix), c16's conversation 1 sends at its 10th turn 81320
    characters with max_tokens 191: vLLM's 400 of run1 (81300 with the
    server's answers). Its token count was within max_model_len, so the
    old token-only fit check passed the shape. Now its first turn is
    trimmed, by the least that fits, and the rest is the same text."""
    from vllm.exceptions import VLLMValidationError

    s = agentic.AgenticConfig().shape()
    assert s.max_context() <= L
    drawn = agentic.conversations(s, 16, 0, 16, None)[1]
    messages, max_tokens = list(requests(drawn))[9]
    assert max_tokens == 191
    with pytest.raises(VLLMValidationError, match="more than 80965 characters, which is the "
                                                  "upper bound for 16193 input tokens"):
        server_check(tok, messages, max_tokens)
    fixed = agentic.conversations(s, 16, 0, 16, L)[1]
    for messages, max_tokens in requests(fixed, max(tok.get_vocab(), key=len)):
        server_check(tok, messages, max_tokens, L - HEADROOM)
    assert fixed["messages"][1:] == drawn["messages"][1:]
    kept, words = len(fixed["messages"][0]["content"].split()), \
        drawn["messages"][0]["content"].split()
    assert fixed["messages"][0]["content"] == " ".join(words[:kept])
    assert s.bounds(s.first)[0] <= kept < len(words)
    one_more = {**fixed, "messages": [{"role": "user", "content": " ".join(words[:kept + 1])},
                                      *fixed["messages"][1:]]}
    assert max(agentic.overflow(one_more, L)) > 0  # the least trimming that fits


def test_conversations_that_fit_are_not_touched():
    s = agentic.AgenticConfig().shape()
    drawn = agentic.conversations(s, 16, 0, 16, None)
    fixed = agentic.conversations(s, 16, 0, 16, L)
    same = [a == b for a, b in zip(drawn, fixed)]
    assert 0 < sum(same) < 16
    assert all(max(agentic.overflow(a, L)) <= 0 for a, ok in zip(drawn, same) if ok)
    fit = agentic.fit_summary(s, fixed, 0, 16, L)
    assert fit["trimmed_conversations"] == 16 - sum(same) and fit["trimmed_tokens"] > 0
    t = fit["tightest_request"]
    assert t["prompt_chars_at_worst"] <= t["server_limit_chars"] - 5 * agentic.MARGIN_TOKENS


def test_a_shape_that_cannot_fit_is_refused(bench_agentic, capsys):
    """Target P5: later turns too long for the character bound even with
    the first turn at its shortest are refused up front (their token count
    passes), rather than sent to fail."""
    c = agentic.AgenticConfig(first_turn_tokens=2000, turn_tokens=700)
    assert c.shape().max_context() <= c.max_model_len
    with pytest.raises(ValueError, match="characters"):
        c.validate()
    with pytest.raises(SystemExit):
        bench_agentic.main(["--dry-run", "--first-turn-tokens", "2000", "--turn-tokens", "700"])
    assert "characters" in capsys.readouterr().err
