# SPDX-License-Identifier: Apache-2.0
"""The e2e gate's requests: seeded token-id prompts, conversations, and the
sensitivity control's prompts (pure Python: no vLLM, no torch).

A scenario is a list of generate() calls; a call is a list of ``Turn``s. A
turn continues its conversation: its prompt is the conversation's history
(the previous turn's prompt plus that turn's output) followed by ``new``
tokens, so a later turn is a prefix hit on the earlier one, as in a chat.
Both arms build the same prompts as long as their outputs agree; once they
disagree the comparison has already failed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

VOCAB = 8192
SEED = 1234
BLOCK = 64
FIRST_ID = 2
"""Prompt ids start above <unk> (0) and <eos> (1) of the tiny tokenizer."""


@dataclass(frozen=True)
class Turn:
    conv: str
    """Conversation key: the prompt continues this conversation's history."""
    new: tuple[int, ...]
    """Tokens appended to the history."""
    max_tokens: int


Call = list[Turn]
Scenario = list[Call]


def rng_for(name: str) -> random.Random:
    return random.Random(f"{SEED}-{name}")


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, VOCAB) for _ in range(n))


def prompt_of(turn: Turn, histories: dict[str, list[int]]) -> list[int]:
    """The turn's prompt: its conversation's history, then its new tokens."""
    return list(histories.get(turn.conv, ())) + list(turn.new)


def record_turn(
    turn: Turn, prompt: list[int], output: list[int], histories: dict[str, list[int]]
) -> None:
    """After a turn: its conversation's history is its prompt + output."""
    histories[turn.conv] = list(prompt) + list(output)


# ------------------------------------------------------------- scenarios
#
# Lengths that matter (tiny GLM-5, block 64, index_topk 256, max_model_len
# 16384): a prompt longer than top-k reads history through the sparse path;
# a conversation whose first prompt is a multiple of 64 tokens and whose
# first output is 16 tokens is a prefix hit of exactly its prompt on return,
# so every return computes 16 + len(new) tokens: equal short follow-ups
# (<= 256 tokens) run on FlashMLA sparse's uniform decode path (K13).


def _single(n: int, out: int) -> Callable[[random.Random], "Scenario"]:
    def build(rng: random.Random) -> Scenario:
        return [[Turn("a", random_ids(rng, n), out)]]

    return build


def _short_topk(rng: random.Random) -> Scenario:
    """Prompts at or below index_topk (256), alone, then beside a long one
    under pressure."""
    alone = [Turn(f"s{i}", random_ids(rng, n), 32)
             for i, n in enumerate((50, 100, 180, 255, 256, 200))]
    beside = [Turn("big", random_ids(rng, 10000), 32)] + [
        Turn(f"t{i}", random_ids(rng, n), 32) for i, n in enumerate((60, 256, 128, 220))]
    return [alone, beside]


def _concurrent(rng: random.Random) -> Scenario:
    return [[Turn(f"c{i}", random_ids(rng, n), 48)
             for i, n in enumerate((2600, 3100, 3500, 2900))]]


def _host_prefix(rng: random.Random) -> Scenario:
    """A alone, two fillers that push A's GPU pages out, then A's next turn:
    a host-prefix hit that starts zero-resident (E2E-4)."""
    return [[Turn("a", random_ids(rng, 4000), 48)],
            [Turn("f0", random_ids(rng, 5200), 16)],
            [Turn("f1", random_ids(rng, 5200), 16)],
            [Turn("a", random_ids(rng, 700), 48)]]


def _long_outputs(rng: random.Random) -> Scenario:
    """Four long decodes whose pages together outgrow a small host pool
    (E2E-9: host exhaustion preempts by design)."""
    return [[Turn(f"l{i}", random_ids(rng, n), 900)
             for i, n in enumerate((4500, 4600, 4700, 4550))]]


RETURNING_LENGTHS = (2048, 4096, 6016, 8000, 9984, 12032)
EQUAL_FOLLOWUP_LENGTHS = (3008, 3520, 4032, 4544)


def _returning(rng: random.Random) -> Scenario:
    """Many conversations returning together (spec F21): first turns, two
    fillers, then every conversation's next turn in ONE generate() call with
    follow-ups of the same length. Their host-only context pages together
    (about 660) exceed C_stage = cdiv(max_model_len, 64) +
    cdiv(max_num_batched_tokens, 64) (288 at chunk 2048, 384 at 8192)."""
    convs = [f"r{i}" for i in range(len(RETURNING_LENGTHS))]
    first = [Turn(c, random_ids(rng, n), 16) for c, n in zip(convs, RETURNING_LENGTHS)]
    fillers = [[Turn(f"f{i}", random_ids(rng, 12000), 8)] for i in range(2)]
    back = [Turn(c, random_ids(rng, 128), 32) for c in convs]
    return [first, *fillers, back]


def _equal_followups(rng: random.Random) -> Scenario:
    """Two rounds of equal short follow-ups right after the first turns,
    within the staging capacity (about 236 host-only pages)."""
    convs = [f"e{i}" for i in range(len(EQUAL_FOLLOWUP_LENGTHS))]
    first = [Turn(c, random_ids(rng, n), 16) for c, n in zip(convs, EQUAL_FOLLOWUP_LENGTHS)]
    rounds = [[Turn(c, random_ids(rng, 64), 24) for c in convs] for _ in range(2)]
    return [first, *rounds]


CHAT_FIRST_LENGTHS = (4501, 6017, 7633, 9202)


def _chat_chain(rng: random.Random) -> Scenario:
    """Soak run 19's shape (results/e2e/README.md): conversations whose
    follow-ups extend their parents' outputs (80 decoded tokens a turn,
    pages written while decoding), first prompts not block-aligned, three
    rounds of 150-400 new tokens, each after a filler that pushes their
    pages out, so every follow-up is a long prefix hit over pages its
    parent decoded, read back under pressure."""
    convs = [f"h{i}" for i in range(len(CHAT_FIRST_LENGTHS))]
    calls: Scenario = [[Turn(c, random_ids(rng, n), 80)
                        for c, n in zip(convs, CHAT_FIRST_LENGTHS)]]
    for r in range(3):
        calls.append([Turn(f"g{r}", random_ids(rng, 7000), 16)])
        calls.append([Turn(c, random_ids(rng, rng.randint(150, 400)), 80)
                      for c in convs])
    return calls


PD_CALLS = ((2500,), (12000,), (3000, 7000))
"""P/D imports (docs/pd-imports.md, spec 4.13): prompt lengths per call.
Under the gate's pressure pool (450 blocks at chunk 2048) a prompt alone
lands resident up to ~70 pages (DEVICE: 5 blocks a page plus the hot
region, the transition watermark left free), a longer one host-only
(HOST: its indexer pages and P_last); the last call lands one of each side
by side. None is 1 mod 64: the producer keys a prompt's files by its
first ``align(len)`` tokens, the consumer looks them up by ``align(len -
1)`` (the pin's ExampleConnector), which differ exactly then."""


def _pd_imports(rng: random.Random) -> Scenario:
    """Fresh single-turn prompts (a producer's 1-token outputs never enter
    a later prompt), 64 tokens out on the consumers."""
    return [[Turn(f"p{c}_{i}", random_ids(rng, n), 64) for i, n in enumerate(call)]
            for c, call in enumerate(PD_CALLS)]


SCENARIOS = {
    "single6k": _single(6000, 64),
    "single12k": _single(12000, 64),
    "short_topk": _short_topk,
    "concurrent": _concurrent,
    "host_prefix": _host_prefix,
    "long_outputs": _long_outputs,
    "returning": _returning,
    "equal_followups": _equal_followups,
    "chat_chain": _chat_chain,
    "pd_imports": _pd_imports,
    # The negative control's probe: one long request under pressure whose
    # early pages go host-only during its prefill (a fresh prompt, so the
    # fault it gets poisons no other scenario's prefix).
    "fault_probe": _single(8000, 96),
}


def scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[name](rng_for(name))


def max_context(s: Scenario) -> int:
    """An upper bound on any prompt + output of the scenario (histories
    grow by each turn's new tokens and output)."""
    total: dict[str, int] = {}
    worst = 0
    for call in s:
        for t in call:
            total[t.conv] = total.get(t.conv, 0) + len(t.new) + t.max_tokens
            worst = max(worst, total[t.conv])
    return worst


# ---------------------------------------------------- sensitivity control

SENSITIVITY_PROMPTS = 8
SENSITIVITY_LEN = 5000
SENSITIVITY_FRACTION = 0.4
SENSITIVITY_STEPS = 16
SENSITIVITY_NEEDED = 6


def sensitivity_prompts(
    n: int = SENSITIVITY_PROMPTS,
    length: int = SENSITIVITY_LEN,
    fraction: float = SENSITIVITY_FRACTION,
) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` seeded prompts and their twins: the same prompt with its first
    ``fraction`` of tokens replaced by other random tokens (the suffix, and
    so the most recent context, is identical)."""
    rng = rng_for("sensitivity")
    cut = int(length * fraction)
    base, twins = [], []
    for _ in range(n):
        p = list(random_ids(rng, length))
        early = list(random_ids(rng, cut))
        base.append(p)
        twins.append(early + p[cut:])
    return base, twins


__all__ = [
    "BLOCK", "SCENARIOS", "SEED", "Turn", "VOCAB", "max_context", "prompt_of",
    "record_turn", "scenario", "sensitivity_prompts",
]
