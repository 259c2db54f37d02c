# SPDX-License-Identifier: Apache-2.0
"""bench-agentic: multi-turn agentic serving, plain vLLM vs the
OffloadingConnector vs Hybrid HiSparse (+ upstream 0.30.0's HiSparse),
targets P4, P5, P8. Pure logic; the I/O is serving.py and scripts/bench-agentic.

The driver is vLLM's own multi-turn benchmark
(benchmarks/multi_turn/benchmark_serving_multi_turn.py of the pinned tree),
against ``vllm serve``; this module writes its input (a list of
conversations, the tool's ShareGPT-like format), its command line, and
reads its per-request statistics (--stats-json-output) and the server's
/metrics samples.

The workload scales the reference agentic trace (13 turns, a ~74K-token
first turn, ~750-token later turns, ~220 output tokens): ``scale``
multiplies the input lengths (the first turn and the later ones), outputs
stay at the trace's length, every length jittered uniformly by
+-``jitter``. Conversations are token-exact on the tiny model's tokenizer
(one word "wN" per token id N, whitespace-split): the chat template joins
the messages with spaces, so a turn's prompt is exactly the history's
tokens, and each assistant message's length is that turn's max_tokens
(the tool takes it from the dataset). The model folder's tokenizer has no
EOS (the tool's requests cannot ask for ignore_eos), so every turn
generates exactly its max_tokens, as ``vllm bench serve --ignore-eos``
would.

The server also bounds a prompt in characters before tokenizing it (see
SERVER_CHARS_PER_TOKEN), and our words are wider than that bound's 5
characters a token: ``conversation`` trims a first turn until every request
of its conversation passes both bounds, at worst, with MARGIN_TOKENS to spare.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import common, prom, stats, targets

SCHEMA = "bench-agentic/1"
TOOL = "benchmark_serving_multi_turn.py"
VOCAB = 8192  # tests/e2e/make_tiny_glm5.py
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
SERVED_NAME = "tiny"
GIB = 1 << 30
MIB = 1 << 20
# The server's character rule (vllm/renderers/params.py _text_len_check):
# a chat prompt of more than max_chars_per_token x (max_model_len - max_tokens)
# characters gets HTTP 400 before it is tokenized; max_chars_per_token is the
# longest vocabulary entry (vllm/tokenizers/hf.py): "w8191", "<unk>", "<eos>".
WIDEST = f"w{VOCAB - 1}"
SERVER_CHARS_PER_TOKEN = len(WIDEST)
# A token's widest in the prompt text: its characters and a separator (the
# template's space after a message, the decoder's between tokens); ours
# average ~5.87, so a prompt that fits in tokens can fail in characters.
TOKEN_CHARS_MAX = SERVER_CHARS_PER_TOKEN + 1
# Room left below both of the server's limits: the history's answers are the
# server's own outputs (the tool sends them back), bounded here, not known.
MARGIN_TOKENS = 128
# Plain vLLM's KV bytes per token of the 4-layer tiny model (fp8_ds_mla,
# one uniform group: 2 GiB hold ~680K tokens in the e2e engines).
PLAIN_BYTES_PER_TOKEN = 3158
MODEL_LAYERS = 4
PROFILE_S = 25  # a profiled level's extra seconds per arm (a prior, not yet measured)
# The duration prior (estimate_s): output tokens/s an arm sustains
# (ARMS[arm]["prior_tok_s"]: {8: at up to 8 conversations, 16: at more},
# one conversation's own ceiling below that) and a level's fixed seconds
# (the tool's start and end, the cache reset). From runs 1-12 on H200 and
# H100, near the lower figures, so the estimate errs long: plain 848-1,272
# tok/s at 4-8 conversations and 738-1,025 at 16-32 (its preemptions'
# recomputation grows), the offloader 980-1,204 and 685-1,289, HiSparse
# 1,511-2,034 and 1,475-2,193 (1,000-1,350 at --index-topk-freq 2,
# hisparse_pf's setting), upstream 0.30.0 826 and 1,367; 14-18 s beside
# the tokens' time.
TOK_S_PER_CONVERSATION = 250
LEVEL_FIXED_S = 15

ARMS: dict[str, dict] = {
    "plain": {"vllm": "ours", "prior_tok_s": {8: 1000, 16: 740}, "doc": "vLLM 0.26.0 + this series, HiSparse off, no offloading "
                                     "(sparse_mla_force_mqa=true: the bundle has no "
                                     "FlashAttention)"},
    "offload": {"vllm": "ours", "prior_tok_s": {8: 950, 16: 800}, "doc": "the OffloadingConnector alone (TieringOffloadingSpec): "
                                       "the blog's baseline"},
    "hisparse": {"vllm": "ours", "prior_tok_s": {8: 1500, 16: 1500}, "doc": "Hybrid HiSparse + the OffloadingConnector: "
                                        "--attention-config '{\"hisparse_config\": ...}' "
                                        "--kv-transfer-config '{...OffloadingConnector...}'"},
    "hisparse_pf": {"vllm": "ours", "prior_tok_s": {8: 950, 16: 950}, "doc": "as hisparse, with prefetch_followers=true (the "
                                           "followers' gathers on a copy stream; needs "
                                           "--index-topk-freq > 1 to have followers)"},
    "hisparse_nobackoff": {"vllm": "ours", "prior_tok_s": {8: 1500, 16: 1500},
                           "ablate": "admission_backoff",
                           "doc": "as hisparse, with R35's admission back-off off (an "
                                  "ablation: HISPARSE_ABLATE through the bench's plugin): "
                                  "every step retries a failed admission's lookups"},
    "plain_ample": {"vllm": "ours", "prior_tok_s": {8: 1500, 16: 1500}, "ample_kv": True,
                    "doc": "a control: plain vLLM with a GPU KV budget that holds every "
                           "conversation of the highest level at the workload's longest "
                           "context, so it never preempts and every history stays in "
                           "its prefix cache; served @N near HiSparse's running count, "
                           "its TPOT is vLLM's own cost of that batch (P5's batch "
                           "control)"},
    "upstream": {"vllm": "upstream", "prior_tok_s": {8: 820, 16: 820}, "doc": "upstream vLLM 0.30.0's HiSparse "
                                            "(HiSparseConnector, model runner V2)"},
}


# An arm may cap its running requests: ``hisparse@6`` is the hisparse arm
# served with ``--max-num-seqs 6`` (the throughput a lower TPOT costs: the
# levels' other arms keep the run's --max-num-seqs). Our arms only.
CAP_SEP = "@"
# tests/e2e/seeded_weights (the bench's vLLM plugin) reads it.
ABLATE_ENV = "HISPARSE_ABLATE"


def arm_base(arm: str) -> str:
    return arm.partition(CAP_SEP)[0]


def arm_cap(arm: str) -> int | None:
    """The ``@N`` of a capped arm; None for a plain arm name."""
    _, sep, n = arm.partition(CAP_SEP)
    return int(n) if sep and n.isdigit() else None


def arm_error(arm: str) -> str | None:
    """Why ``arm`` names no arm, or None."""
    base, sep, n = arm.partition(CAP_SEP)
    if base not in ARMS:
        return f"unknown arm {arm} (known: {', '.join(ARMS)}, each optionally {CAP_SEP}N)"
    if sep and (not n.isdigit() or int(n) < 1):
        return f"arm {arm}: {CAP_SEP} takes a max_num_seqs >= 1"
    if sep and ARMS[base]["vllm"] != "ours":
        return f"arm {arm}: only our arms take {CAP_SEP}N"
    return None


class ArmNames:
    """``in`` for common.name_list: every arm and capped arm."""

    def __contains__(self, arm: str) -> bool:
        return arm_error(arm) is None

    def __iter__(self):
        return iter([*ARMS, f"ARM{CAP_SEP}N"])


@dataclass(frozen=True)
class Trace:
    """The reference agentic trace (targets.md P4)."""

    turns: int = 13
    first_turn_tokens: int = 74000
    turn_tokens: int = 750
    output_tokens: int = 220


@dataclass(frozen=True)
class Shape:
    turns: int
    first: int
    later: int
    output: int
    jitter: float

    def bounds(self, mean: int) -> tuple[int, int]:
        return max(1, math.floor(mean * (1 - self.jitter))), max(1, math.ceil(mean * (1 + self.jitter)))

    def max_context(self) -> int:
        """The longest a conversation's last request can get (prompt +
        output) in tokens, every length at its upper bound (before
        ``conversation`` trims the first turn to the character rule)."""
        f, later, out = self.bounds(self.first)[1], self.bounds(self.later)[1], \
            self.bounds(self.output)[1]
        return f + (self.turns - 1) * later + self.turns * out

    def mean_context(self) -> float:
        """The mean prompt + output of a conversation's requests."""
        total, acc = 0.0, 0.0
        for t in range(self.turns):
            acc += self.first if t == 0 else self.later
            total += acc + self.output
            acc += self.output
        return total / self.turns


def shape(trace: Trace, scale: float, *, turns: int | None = None, first: int | None = None,
          later: int | None = None, output: int | None = None, jitter: float = 0.2) -> Shape:
    """The trace at ``scale`` (input lengths only); explicit lengths win."""
    if not scale > 0:
        raise ValueError(f"--scale must be > 0, not {scale}")
    if not 0 <= jitter < 1:
        raise ValueError(f"--jitter must be in [0, 1), not {jitter}")
    s = Shape(turns=turns or trace.turns,
              first=first or max(1, round(trace.first_turn_tokens * scale)),
              later=later or max(1, round(trace.turn_tokens * scale)),
              output=output or trace.output_tokens, jitter=jitter)
    if s.turns < 1:
        raise ValueError("--turns must be >= 1")
    return s


def fit_check(s: Shape, max_model_len: int) -> None:
    if s.max_context() > max_model_len:
        raise ValueError(
            f"a conversation can reach {s.max_context()} tokens (first turn {s.first}, "
            f"{s.turns - 1} turns of {s.later}, outputs {s.output}, +-{s.jitter:.0%}) > "
            f"max_model_len {max_model_len}: lower --scale or raise --max-model-len")
    # conversation() trims a first turn down to its lower bound at most: the
    # longest conversation so trimmed, every token at its widest, must pass
    lo, later, out = s.bounds(s.first)[0], s.bounds(s.later)[1], s.bounds(s.output)[1]
    msgs = []
    for t in range(s.turns):
        msgs += [{"role": "user", "content": _widest(lo if t == 0 else later)},
                 {"role": "assistant", "content": _widest(out)}]
    chars, tokens = overflow({"messages": msgs}, max_model_len)
    if chars > 0 or tokens > 0:
        raise ValueError(
            f"the last request of a conversation (first turn {lo} tokens, {s.turns - 1} turns "
            f"of {later}, outputs {out}) can exceed what the server takes at max_model_len "
            f"{max_model_len} by {chars} characters ({SERVER_CHARS_PER_TOKEN} a token, "
            f"{MARGIN_TOKENS} tokens spare): lower --scale or --turns, or raise "
            f"--max-model-len")


def _widest(n: int) -> str:
    return " ".join([WIDEST] * n)


def request_limits(max_tokens: int, max_model_len: int) -> tuple[int, int]:
    """The longest prompt (characters, tokens) we send with ``max_tokens``:
    the server's two bounds less MARGIN_TOKENS."""
    room = max_model_len - MARGIN_TOKENS - max_tokens
    return SERVER_CHARS_PER_TOKEN * room, room


def request_sizes(conv: Mapping) -> list[tuple[int, int, int]]:
    """Each turn's request as the server can see it at worst: (prompt
    characters, prompt tokens, max_tokens). The template renders a message
    as its content and a space; an earlier answer is the server's own
    output of its max_tokens, a leading space and each token at its widest."""
    out, chars, tokens = [], 0, 0
    msgs = conv["messages"]
    for user, answer in zip(msgs[::2], msgs[1::2]):
        n = len(answer["content"].split())
        chars += len(user["content"]) + 1
        tokens += len(user["content"].split())
        out.append((chars, tokens, n))
        chars += TOKEN_CHARS_MAX * n + 1
        tokens += n
    return out


def overflow(conv: Mapping, max_model_len: int) -> tuple[int, int]:
    """By how many (characters, tokens) the conversation's worst request
    exceeds request_limits; <= 0: every request fits."""
    over = [(c - lc, t - lt) for c, t, m in request_sizes(conv)
            for lc, lt in [request_limits(m, max_model_len)]]
    return max(c for c, _ in over), max(t for _, t in over)


def trim(conv: dict, max_model_len: int) -> int:
    """Drops words off the end of the first turn (the agent's big context)
    until every request fits, so the conversation keeps all its turns and
    the rest of its text; returns the tokens dropped."""
    chars, tokens = overflow(conv, max_model_len)
    words = conv["messages"][0]["content"].split()
    freed = dropped = 0
    while freed < chars or dropped < tokens:
        if len(words) < 2:
            raise ValueError(f"{conv['id']}: no first turn is short enough for "
                             f"max_model_len {max_model_len} (fit_check first)")
        freed += len(words.pop()) + 1  # the word and the space before it
        dropped += 1
    conv["messages"][0]["content"] = " ".join(words)
    return dropped


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(n))


def conversation(s: Shape, seed: str, conv_id: str, max_model_len: int | None) -> dict:
    """One conversation; with ``max_model_len``, trimmed to fit it (None:
    as drawn, whatever its length)."""
    rng = random.Random(seed)
    messages = []
    for t in range(s.turns):
        lo, hi = s.bounds(s.first if t == 0 else s.later)
        messages.append({"role": "user", "content": _words(rng, rng.randint(lo, hi))})
        lo, hi = s.bounds(s.output)
        messages.append({"role": "assistant", "content": _words(rng, rng.randint(lo, hi))})
    conv = {"id": conv_id, "messages": messages}
    if max_model_len is not None:
        trim(conv, max_model_len)
    return conv


def conversations(s: Shape, n: int, seed: int, level: int,
                  max_model_len: int | None) -> list[dict]:
    """``n`` conversations, the same for every arm at this level (seeded by
    the run's seed, the level and the index); no two share a prefix."""
    if n < 1:
        raise ValueError("no conversation to generate")
    return [conversation(s, f"agentic-{seed}-{level}-{i}", f"c{level}_{i}", max_model_len)
            for i in range(n)]


def fit_summary(s: Shape, convs: Sequence[Mapping], seed: int, level: int,
                max_model_len: int) -> dict:
    """How a level's conversations fit the server: the first turns trimmed
    (against the same conversations as drawn) and the request nearest its
    character limit, at worst."""
    firsts = [token_lengths(c)[0][1] for c in convs]
    drawn = [token_lengths(c)[0][1] for c in conversations(s, len(convs), seed, level, None)]
    chars, _, m = max((r for c in convs for r in request_sizes(c)),
                      key=lambda r: r[0] - request_limits(r[2], max_model_len)[0])
    return {"trimmed_conversations": sum(a != b for a, b in zip(drawn, firsts)),
            "trimmed_tokens": sum(drawn) - sum(firsts),
            "first_turn_tokens": [min(firsts), max(firsts)],
            "tightest_request": {"prompt_chars_at_worst": chars, "max_tokens": m,
                                 "server_limit_chars": SERVER_CHARS_PER_TOKEN * (
                                     max_model_len - m)}}


def token_lengths(conv: Mapping) -> list[tuple[str, int]]:
    return [(m["role"], len(m["content"].split())) for m in conv["messages"]]


# --------------------------------------------------------------- config


@dataclass
class AgenticConfig:
    arms: list[str] = field(default_factory=lambda: ["plain", "offload", "hisparse"])
    concurrency: list[int] = field(default_factory=lambda: [4, 8, 16])
    scale: float = 0.125
    turns: int | None = None
    first_turn_tokens: int | None = None
    turn_tokens: int | None = None
    output_tokens: int | None = None
    jitter: float = 0.2
    conversations_per_client: int = 1
    rounds: int = 1
    max_model_len: int = 16384
    kv_bytes: int = 128 * MIB
    chunk: int = 2048
    max_num_seqs: int = 64
    host_pool_gib: float = 8.0
    offload_gib: float = 8.0
    weights: str = "seeded"
    variant: str = "n02"
    index_topk_freq: int = 1
    """The tiny model's layers reuse a top-k in groups of this many
    (IndexShare: the first of each group is its leader)."""
    gpu_memory_utilization: float = 0.12
    compilation_config: dict | None = None
    upstream_compilation_config: dict | None = None
    seed: int = 0
    budget_s: float = 540.0
    level_timeout_s: float = 240.0
    min_level_s: float = 40.0
    poll_s: float = 0.5
    request_timeout_s: int = 300
    ready_timeout_s: float = 420.0
    port_base: int = 8300
    parallel_start: bool = True
    profile_level: int | None = None
    """Profile every arm's engine at this concurrency level (torch profiler,
    ``--profiler-config``; steptrace.py summarizes the trace)."""
    profile_steps: int = 300
    profile_delay_s: float = 15.0

    def shape(self) -> Shape:
        return shape(Trace(), self.scale, turns=self.turns, first=self.first_turn_tokens,
                     later=self.turn_tokens, output=self.output_tokens, jitter=self.jitter)

    def validate(self) -> None:
        for a in self.arms:
            err = arm_error(a)
            if err:
                raise ValueError(err)
            if (arm_cap(a) or 0) > self.max_num_seqs:
                raise ValueError(f"arm {a}: caps above --max-num-seqs {self.max_num_seqs}")
        if not self.arms:
            raise ValueError("no arm given")
        fit_check(self.shape(), self.max_model_len)
        if max(self.concurrency) * self.conversations_per_client > self.max_num_seqs:
            raise ValueError(f"the highest concurrency ({max(self.concurrency)}) exceeds "
                             f"--max-num-seqs {self.max_num_seqs}: nothing could run more")
        if self.conversations_per_client < 1 or self.rounds < 1:
            raise ValueError("--conversations-per-client and --rounds must be >= 1")
        if self.weights not in ("seeded", "dummy"):
            raise ValueError(f"--weights must be seeded or dummy, not {self.weights}")
        if not 1 <= self.index_topk_freq <= MODEL_LAYERS:
            raise ValueError(f"--index-topk-freq must be in [1, {MODEL_LAYERS}] (the tiny "
                             f"model's layers), not {self.index_topk_freq}")
        if "hisparse_pf" in self.arms and self.index_topk_freq == 1:
            raise ValueError("arm hisparse_pf needs --index-topk-freq > 1: with one "
                             "indexer per layer there is no follower to prefetch")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1)")
        if self.poll_s <= 0:
            raise ValueError("--poll must be > 0")
        if self.profile_level is not None:
            if self.profile_level not in self.concurrency:
                raise ValueError(f"--profile-level {self.profile_level} is not among "
                                 f"--concurrency {self.concurrency}")
            if self.profile_steps < 1 or self.profile_delay_s < 0:
                raise ValueError("--profile-steps must be >= 1 and --profile-delay >= 0")
        need = self.max_model_len * PLAIN_BYTES_PER_TOKEN
        if self.kv_bytes < need:
            raise ValueError(f"--kv-bytes {self.kv_bytes} cannot hold one max_model_len request "
                             f"of plain vLLM (~{need / MIB:.0f} MiB): vLLM would refuse to start")

    def conversations_at(self, c: int) -> int:
        return c * self.conversations_per_client * self.rounds

    def workload(self, c: int) -> list[dict]:
        """Level ``c``'s conversations, trimmed to fit max_model_len."""
        return conversations(self.shape(), self.conversations_at(c), self.seed, c,
                             self.max_model_len)

    def fit_summary(self, c: int, convs: Sequence[Mapping]) -> dict:
        return fit_summary(self.shape(), convs, self.seed, c, self.max_model_len)

    def port(self, arm: str) -> int:
        """A plain arm's port is fixed; a capped one's follows the arms."""
        if arm_cap(arm) is None:
            return self.port_base + list(ARMS).index(arm)
        return self.port_base + len(ARMS) + self.arms.index(arm)

    def max_num_seqs_of(self, arm: str) -> int:
        return arm_cap(arm) or self.max_num_seqs

    def kv_bytes_of(self, arm: str) -> int:
        """The arm's --kv-cache-memory-bytes: the run's budget, or for an
        ample arm (the batch control) enough for every conversation of the
        highest level at the workload's longest context (never less): the
        waiting conversations' histories must stay in the GPU prefix cache
        too. Run 23's control held only its 12 running requests (718 MiB):
        the 20 waiting histories were evicted, every turn recomputed its
        whole prompt (4.4M tokens of local compute, no cache hit), and its
        TPOT read 11.3 ms against HiSparse's 4.3."""
        if not ARMS[arm_base(arm)].get("ample_kv"):
            return self.kv_bytes
        return max(self.kv_bytes, ample_kv_bytes(self.conversations_at(max(self.concurrency)),
                                                 self.shape().max_context()))


# An ample arm's budget over its requests' rows: PLAIN_BYTES_PER_TOKEN is a
# fit from the e2e engines' pool, not the allocator's arithmetic, and each
# request rounds up to whole blocks; a preemption would spoil the control.
AMPLE_MARGIN = 1.25


def ample_kv_bytes(requests: int, max_context: int) -> int:
    """GPU KV bytes for ``requests`` of ``max_context`` tokens each on
    plain vLLM's pool (4 layers), with AMPLE_MARGIN, in whole MiB."""
    need = requests * max_context * PLAIN_BYTES_PER_TOKEN * AMPLE_MARGIN
    return math.ceil(need / MIB) * MIB


def pressure_hint(cfg: AgenticConfig) -> dict:
    """How far the workload exceeds plain vLLM's pool (rough: 4 layers)."""
    s = cfg.shape()
    capacity = cfg.kv_bytes / PLAIN_BYTES_PER_TOKEN
    return {"plain_pool_tokens_approx": round(capacity),
            "mean_request_tokens": round(s.mean_context()),
            "max_request_tokens": s.max_context(),
            "plain_concurrent_requests_approx": round(capacity / s.mean_context(), 1),
            "demand_tokens": {c: round(c * cfg.conversations_per_client * s.mean_context())
                              for c in cfg.concurrency}}


def level_prior_s(cfg: AgenticConfig, arm: str, c: int) -> int:
    """A level's expected seconds for ``arm``: its output tokens at the
    arm's prior throughput (the baselines' pools cap their running requests,
    so their tokens/s stops growing with the conversations; HiSparse's
    grows further), plus the fixed part."""
    s = cfg.shape()
    tokens = cfg.conversations_at(c) * s.turns * s.output
    sustained = ARMS[arm_base(arm)]["prior_tok_s"][8 if c <= 8 else 16]
    tok_s = min(sustained, TOK_S_PER_CONVERSATION * min(c, cfg.max_num_seqs_of(arm)))
    return round(tokens / tok_s + LEVEL_FIXED_S)


def estimate_s(cfg: AgenticConfig) -> dict:
    """A rough prior: server starts, then every arm's levels one after
    another (level_prior_s). Per arm, not per level: run 12's baselines
    took 73-133 s a level where a per-level prior said 47-74, and the last
    level ran out of budget."""
    starts = (90 + 15 * len(cfg.arms)) if cfg.parallel_start else 75 * len(cfg.arms)
    level = {a: {c: level_prior_s(cfg, a, c) for c in cfg.concurrency} for a in cfg.arms}
    total = starts + sum(sum(v.values()) for v in level.values()) + 20
    profile = 0
    if cfg.profile_level is not None:  # the window's slower steps, the trace's export
        profile = PROFILE_S * sum(is_ours(a) for a in cfg.arms)
    return {"server_starts_s": starts, "level_s": level, "profile_s": profile,
            "total_s": round(total + profile)}


# ------------------------------------------------------ command lines


def offload_config(cfg: AgenticConfig) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                          "cpu_bytes_to_use": int(cfg.offload_gib * GIB)}}


def arm_env(arm: str, env: Mapping[str, str]) -> dict[str, str]:
    """The arm's server environment: ``env``, with the arm's ablation (the
    bench's plugin turns it off in the server's processes) or none."""
    out = {k: v for k, v in env.items() if k != ABLATE_ENV}
    ablate = ARMS[arm_base(arm)].get("ablate")
    if ablate:
        out[ABLATE_ENV] = ablate
    return out


def is_ours(arm: str) -> bool:
    return ARMS[arm_base(arm)]["vllm"] == "ours"


def capped_compilation_config(arm: str, cc: dict | None, chunk: int) -> dict | None:
    """``cc`` for an arm served @N: N among the CUDA-graph capture sizes
    (``common.with_full_decode_graphs``; run 24's plain_ample@12 ran its
    9-12 decode batches PIECEWISE without it)."""
    cap = arm_cap(arm)
    return cc if cap is None else common.with_full_decode_graphs(cc, cap, chunk)


def arm_flags(arm: str, cfg: AgenticConfig) -> list[str]:
    capped, arm = arm, arm_base(arm)  # the cap itself is server_command's --max-num-seqs
    force_mqa = json.dumps({"sparse_mla_force_mqa": True})
    if arm in ("plain", "plain_ample"):  # the same engine; the budget is server_command's
        flags = ["--attention-config", force_mqa]
    elif arm == "offload":
        flags = ["--attention-config", force_mqa,
                 "--kv-transfer-config", json.dumps(offload_config(cfg))]
    elif arm in ("hisparse", "hisparse_pf", "hisparse_nobackoff"):
        hs = {"host_pool_gib": cfg.host_pool_gib}
        if arm == "hisparse_pf":
            hs["prefetch_followers"] = True
        flags = ["--attention-config", json.dumps({"hisparse_config": hs}),
                 "--kv-transfer-config", json.dumps(offload_config(cfg))]
    elif arm == "upstream":
        flags = ["--attention-config", force_mqa, "--kv-transfer-config", json.dumps({
            "kv_connector": "HiSparseConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_pool_gib": cfg.host_pool_gib}})]
    else:
        raise ValueError(f"unknown arm {arm}")
    cc = (cfg.upstream_compilation_config if arm == "upstream"
          else capped_compilation_config(capped, cfg.compilation_config, cfg.chunk))
    if cc:
        flags += ["--compilation-config", json.dumps(cc)]
    return flags


def profiler_config(folder: str, steps: int) -> dict:
    """vLLM's torch profiler, idle until ``POST /start_profile``, stopping
    itself after ``steps`` engine steps; no Python stacks (they would
    multiply the host time it records), no front-end trace."""
    return {"profiler": "torch", "torch_profiler_dir": folder,
            "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True,
            "max_iterations": steps}


# Warm-up prompt sizes (tokens, before the chat template). A step longer
# than the largest CUDA-graph size runs eagerly, and its Triton kernels
# compile on first use of a new specialization: the fused-MoE kernel picks
# its tiles by the step's token count (classes change at 128 and 512) and
# Triton specializes its integer arguments on divisibility by 16 (tokens x
# top-k, i.e. the count mod 4 here). The levels' mixed steps hit these at
# random; an arm that met one first mid-level paid the compile there (run
# 18's offload arm: 0.7 s of its level). Four consecutive sizes per class
# cover every residue; every arm gets the same list before its first level.
WARM_BASES = (160, 400, 1000)
WARM_RESIDUES = 4


def warm_sizes(cfg: AgenticConfig) -> list[int]:
    """The prompt sizes each server is warmed with, in order (at least one,
    however small the chunk)."""
    limit = min(cfg.chunk, cfg.max_model_len) - 96
    bases = [b for b in (*WARM_BASES, limit - WARM_RESIDUES) if 0 < b <= limit - WARM_RESIDUES]
    sizes = [b + r for b in sorted(set(bases)) for r in range(WARM_RESIDUES)]
    return sizes or [max(1, min(cfg.chunk, cfg.max_model_len) // 2)]


def server_command(arm: str, cfg: AgenticConfig, python: str, model_dir: str,
                   profile_dir: str | None = None) -> list[str]:
    """``vllm serve`` (as ``python -m vllm.entrypoints.cli.main serve``: the
    same CLI, on the interpreter whose PYTHONPATH holds the arm's vLLM).
    ``profile_dir``: the engine's profiler writes its traces there (only
    with ``cfg.profile_level``; our arms only, the upstream arm is never
    profiled). vLLM creates the profiler at the first ``/start_profile``:
    until then a step costs nothing more; after the window each step still
    passes an idle annotation."""
    profile = []
    if profile_dir is not None and cfg.profile_level is not None and is_ours(arm):
        profile = ["--profiler-config",
                   json.dumps(profiler_config(profile_dir, cfg.profile_steps))]
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(cfg.port(arm)), "--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
            "--max-model-len", str(cfg.max_model_len),
            "--max-num-batched-tokens", str(cfg.chunk), "--max-num-seqs", str(cfg.max_num_seqs_of(arm)),
            "--kv-cache-memory-bytes", str(cfg.kv_bytes_of(arm)),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            "--seed", str(cfg.seed), "--generation-config", "vllm",
            "--load-format", "hisparse_seeded" if cfg.weights == "seeded" else "dummy",
            *arm_flags(arm, cfg), *profile]


def tool_command(python: str, tool: Path, model_dir: str, url: str, input_file: Path,
                 stats_file: Path, c: int, cfg: AgenticConfig) -> list[str]:
    """vLLM's multi-turn benchmark: ``c`` clients, each with
    conversations_per_client active conversations, no think time (agents
    send their next turn at once), round-robin over a client's
    conversations; it stops when the first client runs out of work."""
    return [python, str(tool), "--model", model_dir, "--served-model-name", SERVED_NAME,
            "--url", url, "--input-file", str(input_file),
            "--num-clients", str(c),
            "--max-active-conversations", str(c * cfg.conversations_per_client),
            "--seed", str(cfg.seed), "--request-timeout-sec", str(cfg.request_timeout_s),
            "--stats-json-output", str(stats_file)]


def prepare_model(path: Path) -> dict:
    """The tiny model folder for serving the tool's chat requests: a chat
    template that joins the messages with spaces, no EOS anywhere (neither
    the tokenizer's nor config.json's, which vLLM's generation config would
    take), no special tokens (every id decodes to a word and back)."""
    path = Path(path)
    cfg_path, tok_path = path / "config.json", path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    removed = {"config.json": [k for k in ("eos_token_id",) if k in cfg]}
    for k in removed["config.json"]:
        del cfg[k]
    cfg_path.write_text(json.dumps(cfg, indent=1))
    tok = json.loads(tok_path.read_text())
    removed["tokenizer_config.json"] = [k for k in ("eos_token", "bos_token", "pad_token",
                                                    "unk_token") if k in tok]
    for k in removed["tokenizer_config.json"]:
        del tok[k]
    tok["chat_template"] = CHAT_TEMPLATE
    tok_path.write_text(json.dumps(tok, indent=1))
    return removed


# ----------------------------------------------------------- summaries

_FAILURES = re.compile(r"num_failures=(\d+)")


def tool_failures(log_text: str) -> int | None:
    """Failed requests, summed over the tool's clients ("Client N is done
    (num_successes=..., num_failures=...)"); None if no client reported."""
    found = _FAILURES.findall(log_text)
    return sum(int(x) for x in found) if found else None


def client_summary(records: Sequence[Mapping], failures: int | None) -> dict:
    """The tool's per-request statistics -> throughput and latencies."""
    out: dict = {"requests": len(records), "failures": failures}
    if not records:
        return out
    start = min(r["start_time_ms"] for r in records)
    end = max(r["start_time_ms"] + r["latency_ms"] for r in records)
    runtime = (end - start) / 1e3
    tokens = sum(r["output_num_tokens"] for r in records)
    out.update(runtime_s=round(runtime, 3), output_tokens=tokens,
               output_tokens_per_s=tokens / runtime if runtime > 0 else None,
               input_tokens_mean=stats.spread([r["input_num_tokens"] for r in records])["median"],
               input_tokens_max=max(r["input_num_tokens"] for r in records),
               input_messages_max=max(r["input_num_turns"] for r in records),
               conversations=len({r["conversation_id"] for r in records}))
    for key, name in (("ttft_ms", "ttft_ms"), ("tpot_ms", "tpot_ms"),
                      ("latency_ms", "latency_ms")):
        vals = [r[key] for r in records if r[key] is not None and r[key] > 0]
        if vals:
            out[f"{name}_p50"] = stats.percentile(vals, 50)
            out[f"{name}_p95"] = stats.percentile(vals, 95)
    return out


def _counter_keys(snap: Mapping) -> list[str]:
    return [k for k in snap if (k.endswith("_total") and k not in prom.GAUGES_NAMED_TOTAL)
            or k.startswith(prom.HIST_PREFIX) or k in (
        "preemptions", "generation_tokens", "prompt_tokens", "prefix_cache_hits",
        "prefix_cache_queries", "external_prefix_cache_hits",
        "external_prefix_cache_queries") or k.startswith("prompt_tokens_by_source:")]


def server_summary(snaps: Sequence[tuple[float, Mapping]], t0: float, t1: float) -> dict:
    """/metrics samples around one level -> running requests (time-weighted
    mean and peak over [t0, t1]), waiting, preemptions and tokens (deltas
    from the last sample at or before t0 to the last one), HiSparse's series
    (deltas of counters, last and peak of gauges) and its hot hit rate."""
    snaps = sorted(snaps, key=lambda x: x[0])
    if not snaps:
        return {}
    base = [s for s in snaps if s[0] <= t0]
    first = base[-1] if base else snaps[0]
    last = snaps[-1]
    inside = [s for s in snaps if t0 <= s[0] <= t1]
    out: dict = {"samples": len(snaps), "window_s": round(t1 - t0, 3)}
    for key in ("running", "waiting", "kv_cache_usage"):
        pts = [(t, s[key]) for t, s in snaps if s.get(key) is not None]
        out[f"mean_{key}"] = stats.time_weighted_mean(pts, t0, t1) if pts else None
        vals = [s[key] for _, s in inside if s.get(key) is not None]
        out[f"peak_{key}"] = max(vals) if vals else None
    deltas = {}
    for k in _counter_keys(last[1]):
        a, b = first[1].get(k), last[1].get(k)
        if b is not None:
            deltas[k] = b - (a or 0.0)
    out["preemptions"] = deltas.get("preemptions")
    dt = last[0] - first[0]
    gen = deltas.get("generation_tokens")
    out["generation_tokens"] = gen
    out["generation_tokens_per_s"] = gen / dt if gen is not None and dt > 0 else None
    out["prompt_tokens"] = deltas.get("prompt_tokens")
    out["prompt_tokens_by_source"] = {k.split(":", 1)[1]: v for k, v in deltas.items()
                                      if k.startswith("prompt_tokens_by_source:")}
    for hit, query in (("prefix_cache_hits", "prefix_cache_queries"),
                       ("external_prefix_cache_hits", "external_prefix_cache_queries")):
        h, q = deltas.get(hit), deltas.get(query)
        out[f"{hit.replace('_hits', '')}_hit_rate"] = h / q if h is not None and q else None
    hs = {k: v for k, v in deltas.items() if k.startswith(prom.HISPARSE_PREFIX)}
    for k in last[1]:
        if k.startswith(prom.HISPARSE_PREFIX) and k not in hs:
            vals = [s.get(k) for _, s in inside if s.get(k) is not None]
            hs[k] = {"last": last[1][k], "peak": max(vals) if vals else last[1][k]}
    out["hisparse"] = hs
    hits = _first(hs, "vllm:hisparse_hits_total", "vllm:hisparse_hits")
    looks = _first(hs, "vllm:hisparse_lookups_total", "vllm:hisparse_lookups")
    out["hot_hit_rate"] = hits / looks if isinstance(hits, float) and isinstance(
        looks, float) and looks > 0 else None
    h2d = _first(hs, "vllm:hisparse_host_to_device_bytes_total",
                 "vllm:hisparse_host_to_device_bytes")
    out["h2d_bytes"] = h2d if isinstance(h2d, float) else None
    out["steps"] = step_figures(deltas, dt)
    return out


# A step of at most this many tokens is a decode step (one token per running
# request: the levels run <= 14 at once under the default budget); a mixed
# step carries a prefill chunk of hundreds beside them.
DECODE_STEP_TOKENS_MAX = 32
# Inter-token latencies above this bound (vLLM's lowest ITL bucket, 10 ms)
# span a mixed step or a stall; a decode step is 2-5 ms on the tiny model.
ITL_FAST_S = 0.01


def _cumulative(deltas: Mapping, key: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count)] of one histogram's deltas."""
    pre = prom.hist_key(key, "le=")
    return sorted((prom.number(k[len(pre):]), v) for k, v in deltas.items()
                  if k.startswith(pre))


def _at(cumulative: Sequence[tuple[float, float]], bound: float) -> float | None:
    return next((n for b, n in cumulative if b == bound), None)


def step_figures(deltas: Mapping, seconds: float) -> dict:
    """The engine's steps over a level, from vLLM's own histograms (no
    profiler): how many, tokens per step, the decode-only share, the mean
    step (the window over the steps: an upper bound, idle time counts), and
    the inter-token latencies (TPOT's parts): how many, their mean, the
    share over 10 ms and the time those take, bounded below and above by
    their buckets' edges, and so the mean of the fast ones (a decode step
    as a running request sees it). Empty where the server exports neither
    histogram."""
    out: dict = {}
    steps = deltas.get(prom.hist_key("iteration_tokens", "count"))
    if steps:
        tokens = deltas.get(prom.hist_key("iteration_tokens", "sum")) or 0.0
        small = _at(_cumulative(deltas, "iteration_tokens"), DECODE_STEP_TOKENS_MAX)
        out.update(engine_steps=steps, tokens_per_step_mean=round(tokens / steps, 2),
                   step_ms_mean_upper=round(seconds * 1e3 / steps, 3) if seconds > 0 else None,
                   decode_step_share=round(small / steps, 4) if small is not None else None)
    count = deltas.get(prom.hist_key("itl", "count"))
    total = deltas.get(prom.hist_key("itl", "sum"))
    cum = _cumulative(deltas, "itl")
    fast = _at(cum, ITL_FAST_S)
    if count and total and fast is not None:
        lo = hi = 0.0
        prev_b, prev_n = ITL_FAST_S, fast
        for b, n in cum:
            if b <= ITL_FAST_S:
                continue
            if n > prev_n:  # (an empty +Inf bucket would add 0 x inf)
                lo += (n - prev_n) * prev_b
                hi += (n - prev_n) * b  # inf past the last finite bucket
            prev_b, prev_n = b, n
        fast_ms = sorted(((total - x) / fast * 1e3) for x in (lo, min(hi, total))) \
            if fast else None
        out["itl"] = {
            "count": count, "mean_ms": round(total / count * 1e3, 3),
            "over_10ms_share": round((count - fast) / count, 4),
            "over_10ms_time_share": [round(lo / total, 4), round(min(hi, total) / total, 4)],
            "fast_mean_ms": [round(x, 3) for x in fast_ms] if fast_ms else None}
    return out


def _first(d: Mapping, *keys: str):
    for k in keys:
        if k in d:
            return d[k]
    return None


def running_series(snaps: Sequence[tuple[float, Mapping]], t0: float,
                   max_points: int = 400) -> list[list[float]]:
    """[[seconds since t0, running, waiting], ...], thinned to max_points."""
    pts = [[round(t - t0, 2), s.get("running"), s.get("waiting")]
           for t, s in sorted(snaps, key=lambda x: x[0]) if s.get("running") is not None]
    if len(pts) > max_points:
        step = len(pts) / max_points
        pts = [pts[int(i * step)] for i in range(max_points)] + [pts[-1]]
    return pts


def cache_info(metrics_text: str) -> dict:
    samples = prom.parse(metrics_text)
    info = [s.labels for s in samples if s.name == "vllm:cache_config_info"]
    keep = ("num_gpu_blocks", "block_size", "cache_dtype", "enable_prefix_caching",
            "kv_cache_memory_bytes", "num_cpu_blocks")
    return {k: v for k, v in (info[0] if info else {}).items() if k in keep}


# -------------------------------------------------------------- report


def level_key(lv: Mapping) -> tuple[str, int]:
    return (lv["arm"], int(lv["concurrency"]))


def host_ms_per_step(level: Mapping, rate_hz: float | None) -> dict | None:
    """The sampled engine's busy host time per engine step, in ms: all of
    it (``busy``) and the part under each of the summary's marks, i.e.
    samples / rate / vLLM's step count over the level. py-spy keeps only
    the samples where the thread was running, so this is host work, not
    waits. The shares alone mislead across arms whose busy time and step
    counts differ (run 18: `_prepare_inputs` 22.8% of the offloader's
    samples and 18.5% of HiSparse's, 0.49 against 0.69 ms per step)."""
    steps = ((level.get("server") or {}).get("steps") or {}).get("engine_steps")
    recs = [r for r in level.get("samples") or [] if (r.get("summary") or {}).get("main_samples")]
    if not steps or not recs:
        return None
    rec = max(recs, key=lambda r: r["summary"]["main_samples"])  # the engine core
    rate = rec.get("rate_hz") or rate_hz
    if not rate:
        return None
    busy = rec["summary"]["main_samples"] / rate * 1e3 / steps
    marks = rec["summary"].get("marks") or {}
    return {"busy": round(busy, 3), **{m: round(share * busy, 3) for m, share in marks.items()}}


def _sample_rate(runs: Iterable[Mapping]) -> float | None:
    """The runs' py-spy rate where they agree (merged files of older runs
    keep it only there)."""
    rates = {(r.get("sample_engines") or {}).get("rate_hz") for r in runs} - {None}
    return rates.pop() if len(rates) == 1 else None


def build_report(*, cfg: AgenticConfig | None, command: str | None, arms: dict,
                 levels: list, runs: list, failures: list, tax: Mapping | None = None,
                 merged_from: list | None = None) -> dict:
    by_key = {}
    rate = _sample_rate(runs)
    for lv in levels:  # a later record of the same arm and level wins
        per_step = host_ms_per_step(lv, rate)
        if per_step is not None:
            lv = {**lv, "host_ms_per_step": per_step}
        active = targets.workload_activity(lv.get("series"))
        if active is not None:
            lv = {**lv, "active": active}  # what P4 reads (the tool's startup left out)
        by_key[level_key(lv)] = lv
    levels = sorted(by_key.values(), key=lambda lv: (int(lv["concurrency"]), lv["arm"]))
    s = cfg.shape() if cfg else None
    return {
        "schema": SCHEMA,
        "command": command,
        "config": asdict(cfg) if cfg else None,
        "workload": {"trace": asdict(Trace()), "shape": asdict(s) if s else None,
                     "max_context": s.max_context() if s else None,
                     "mean_request_tokens": round(s.mean_context()) if s else None,
                     "server_chars_per_token": SERVER_CHARS_PER_TOKEN,
                     "margin_tokens": MARGIN_TOKENS,
                     "pressure_hint": pressure_hint(cfg) if cfg else None},
        "arm_docs": {**{a: ARMS[a]["doc"] for a in ARMS},
                     f"ARM{CAP_SEP}N": "ARM served with --max-num-seqs N"},
        "runs": runs,
        "arms": arms,
        "levels": levels,
        "targets": {"P4": targets.p4(levels), "P5": targets.p5(levels),
                    "P8": targets.p8(levels, tax)},
        "tax": tax,
        "failures": failures,
        "merged_from": merged_from or [],
    }


def merge(reports: Sequence[Mapping], sources: Sequence[str],
          tax: Mapping | None = None) -> dict:
    """Several runs (e.g. our arms in one device call, upstream's in the
    next) as one report: arms and levels united (a later file wins for the
    same arm and level), verdicts recomputed."""
    arms, levels, runs, failures = {}, [], [], []
    cfg = None
    for rep, src in zip(reports, sources):
        if rep.get("schema") != SCHEMA:
            raise ValueError(f"{src}: not a {SCHEMA} report (schema {rep.get('schema')!r})")
        for name, a in rep.get("arms", {}).items():
            arms[name] = {**a, "source": src}
        levels += [{**lv, "source": src} for lv in rep.get("levels", [])]
        runs += [{**r, "source": src} for r in rep.get("runs", [])]
        failures += [f"{src}: {f}" for f in rep.get("failures", [])]
        tax = tax or rep.get("tax")
        cfg = cfg or rep.get("config")
    out = build_report(cfg=None, command=None, arms=arms, levels=levels, runs=runs,
                       failures=failures, tax=tax, merged_from=list(sources))
    out["config"] = cfg
    if reports:
        out["workload"] = reports[0].get("workload", out["workload"])
    return out


def tax_verdict(tax_report: Mapping | None) -> dict | None:
    """bench-tax's P8_tax verdict, for P8 here."""
    if not tax_report:
        return None
    return (tax_report.get("targets") or {}).get("P8_tax")


def arms_in(levels: Iterable[Mapping]) -> list[str]:
    """The levels' arms in ARMS' order, a capped arm after its base by cap."""
    names = {lv["arm"] for lv in levels}
    return sorted(names, key=lambda a: (list(ARMS).index(arm_base(a)), arm_cap(a) or 0))
