# SPDX-License-Identifier: Apache-2.0
"""The soak's workload and judgement (pure Python: no vLLM, no torch, no
network): seeded users with multi-turn conversations, streaming or not,
some disconnecting; the join of the server's schedule trace with the
client's requests that the off-arm replay follows (TraceJoin); the
server's answers as comparable records and their comparison with the
replay's; the parsers of /metrics, /proc/<pid>/status and the server log;
the verdict.
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import e2e_compare as compare
from schedule_replay import step_keys

BLOCK = 64
LOGPROB_FLOOR = -9999.0
"""The OpenAI layer clamps logprobs to this; the replay does the same."""


@dataclass(frozen=True)
class SoakConfig:
    seed: int = 7
    users: int = 6
    duration_s: float = 360.0
    max_model_len: int = 16384
    min_prompt: int = 100
    max_tokens: tuple[int, int] = (16, 96)
    new_tokens: tuple[int, int] = (16, 512)
    p_continue: float = 0.6
    p_stream: float = 0.5
    p_disconnect_prefill: float = 0.06
    p_disconnect_decode: float = 0.06
    p_cancel_non_stream: float = 0.03
    think_mean_s: float = 2.0
    prefill_disconnect_min_prompt: int = 8000
    """Long enough that the prefill spans several chunks."""
    vocab: int = 8192


@dataclass
class Action:
    id: str
    user: int
    conv: str
    turn: int
    parent: str | None
    """The conversation's previous completed request (its prompt + output
    start this prompt), or None for a first turn."""
    new: list[int]
    prompt: list[int]
    max_tokens: int
    stream: bool
    disconnect: str | None
    """None, "prefill" (close before the first token), "decode" (close after
    ``after`` tokens) or "cancel" (a non-streamed request given up)."""
    after: float
    think_s: float

    def compact(self) -> dict:
        """What the replay needs (the prompt rebuilt from the parent)."""
        return {"id": self.id, "conv": self.conv, "turn": self.turn, "parent": self.parent,
                "new": self.new, "max_tokens": self.max_tokens}


class User:
    """One client: a conversation at a time; a turn continues it (prompt =
    previous prompt + its output + new tokens) or, when it would not fit or
    by chance, a new one starts. A disconnected turn ends its conversation."""

    def __init__(self, cfg: SoakConfig, index: int) -> None:
        self.cfg, self.index = cfg, index
        self.rng = random.Random(f"{cfg.seed}-user-{index}")
        self.seq = 0
        self.conv: str | None = None
        self.turn = 0
        self.parent: str | None = None
        self.history: list[int] = []

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(2, self.cfg.vocab) for _ in range(n)]

    def _new_prompt_len(self, max_tokens: int, at_least: int) -> int:
        lo, hi = max(self.cfg.min_prompt, at_least), self.cfg.max_model_len - max_tokens
        return int(round(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))))

    def next_action(self) -> Action:
        cfg, rng = self.cfg, self.rng
        max_tokens = rng.randint(*cfg.max_tokens)
        stream = rng.random() < cfg.p_stream
        disconnect, after = self._disconnect(stream, max_tokens)
        new_len = rng.randint(*cfg.new_tokens)
        fits = len(self.history) + new_len + max_tokens <= cfg.max_model_len
        continue_ = (self.conv is not None and fits and disconnect != "prefill"
                     and rng.random() < cfg.p_continue)
        if not continue_:
            at_least = cfg.prefill_disconnect_min_prompt if disconnect == "prefill" else 0
            self.conv, self.turn, self.parent, self.history = (
                f"u{self.index}c{self.seq}", 0, None, [])
            new_len = self._new_prompt_len(max_tokens, at_least)
        new = self._ids(new_len)
        action = Action(
            id=f"u{self.index}-{self.seq}", user=self.index, conv=self.conv, turn=self.turn,
            parent=self.parent, new=new, prompt=self.history + new, max_tokens=max_tokens,
            stream=stream, disconnect=disconnect, after=after,
            think_s=rng.expovariate(1.0 / cfg.think_mean_s))
        self.seq += 1
        return action

    def _disconnect(self, stream: bool, max_tokens: int) -> tuple[str | None, float]:
        cfg, r = self.cfg, self.rng.random()
        if stream and r < cfg.p_disconnect_prefill:
            return "prefill", self.rng.uniform(0.002, 0.02)
        if stream and r < cfg.p_disconnect_prefill + cfg.p_disconnect_decode:
            return "decode", float(self.rng.randint(1, max(1, max_tokens // 2)))
        if not stream and r < cfg.p_cancel_non_stream:
            return "cancel", self.rng.uniform(0.005, 0.2)
        return None, 0.0

    def outcome(self, action: Action, completed: bool, tokens: Sequence[int]) -> None:
        """A completed turn extends the conversation; anything else ends it."""
        if completed:
            self.history = action.prompt + list(tokens)
            self.parent, self.turn = action.id, action.turn + 1
        else:
            self.conv = None


def rebuild_prompts(requests: Sequence[dict], outputs: Mapping[str, Sequence[int]],
                    known: Mapping[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Every request's prompt from the compact form: parent prompt + parent
    output + new tokens (a parent precedes its children here or is in
    ``known``)."""
    prompts: dict[str, list[int]] = dict(known or {})
    for r in requests:
        parent = r["parent"]
        base = [] if parent is None else prompts[parent] + list(outputs[parent])
        prompts[r["id"]] = base + list(r["new"])
    return {r["id"]: prompts[r["id"]] for r in requests}


def server_key(action_id: str) -> str:
    """The engine's id of a completion request the client sent with
    ``request_id`` = ``action_id`` (vLLM's completion serving:
    "cmpl-<id>-<choice>"; the server runs with request-id randomization
    off)."""
    return f"cmpl-{action_id}-0"


class TraceJoin:
    """The server's schedule trace (keyed steps, schedule_replay) joined
    with the client's feed (every request before it is sent, every
    completed one's output), for a replay that follows the trace while the
    load still runs.

    A step enters the replay once every request it names can be added
    with its exact prompt (a follow-up's needs its parent's output, which
    the feed has once the parent completed). Steps naming only requests
    the client did not send (the idle probes) ran alone and are skipped;
    a step mixing those with the load's is kept in ``foreign`` and makes
    the replay incomplete."""

    def __init__(self) -> None:
        self.sent: dict[str, dict] = {}
        """Server key -> the request's compact form."""
        self.outputs: dict[str, list[int]] = {}
        """Action id -> the server's output tokens (completed requests)."""
        self.prompts: dict[str, list[int]] = {}
        self.pending: deque[list] = deque()
        self.added: set[str] = set()
        self.kept: list[list] = []
        """The trace's steps the replay follows, in order."""
        self.skipped = 0
        self.foreign: list[list] = []
        self.ended = False

    def feed(self, item: Mapping[str, Any]) -> None:
        if item.get("end"):
            self.ended = True
        elif "sent" in item:
            self.sent[server_key(item["id"])] = item["sent"]
        else:
            self.outputs[item["id"]] = list(item["tokens"])

    def trace(self, step: list) -> None:
        known = [k in self.sent for k in step_keys(step)]
        if not any(known):
            self.skipped += 1
        elif not all(known):
            self.foreign.append(step)
        else:
            self.pending.append(step)

    def ready(self) -> list[tuple[list, list[tuple[str, list[int], int]]]]:
        """The next steps the replay can take, in order, each with the
        requests (key, prompt, max_tokens) to add before it."""
        out = []
        while self.pending:
            step = self.pending[0]
            new = [k for k in dict.fromkeys(step_keys(step)) if k not in self.added]
            if any(self._waiting_for_parent(k) for k in new):
                break
            adds = []
            for k in new:
                r = self.sent[k]
                self.prompts.update(rebuild_prompts([r], self.outputs, self.prompts))
                adds.append((k, self.prompts[r["id"]], r["max_tokens"]))
            self.added.update(new)
            self.kept.append(self.pending.popleft())
            out.append((self.kept[-1], adds))
        return out

    def _waiting_for_parent(self, key: str) -> bool:
        parent = self.sent[key]["parent"]
        return parent is not None and (parent not in self.outputs or parent not in self.prompts)


# ------------------------------------------------------------- records


def token_id(s: str) -> int:
    """'token_id:123' (return_tokens_as_token_ids) -> 123."""
    if not s.startswith("token_id:"):
        raise ValueError(f"not a token-id token: {s!r}")
    return int(s.split(":", 1)[1])


def canonical_position(token: int, sampled: float, entries: Mapping[int, float]) -> list:
    """[sampled logprob, [[id, logprob], ...] by id] with floats as hex: the
    OpenAI API gives no ranks, so both sides are compared as sets."""
    clamp = (lambda v: max(float(v), LOGPROB_FLOOR))
    table = {int(i): clamp(v) for i, v in entries.items()}
    table.setdefault(token, clamp(sampled))
    return [clamp(sampled).hex(), [[i, table[i].hex()] for i in sorted(table)]]


def server_record(tokens: Sequence[str], token_logprobs: Sequence[float],
                  top_logprobs: Sequence[Mapping[str, float]]) -> dict:
    """A completion's logprobs (OpenAI form, token-id tokens) as a record."""
    ids = [token_id(t) for t in tokens]
    positions = [canonical_position(t, lp, {token_id(k): v for k, v in top.items()})
                 for t, lp, top in zip(ids, token_logprobs, top_logprobs)]
    if not len(ids) == len(token_logprobs) == len(top_logprobs):
        raise ValueError("logprobs fields of different lengths")
    return {"tokens": ids, "positions": positions}


def replay_record(token_ids: Sequence[int], logprobs: Iterable[Mapping[int, Any]]) -> dict:
    """vLLM's CompletionOutput (Logprob objects) as the same record."""
    ids = [int(t) for t in token_ids]
    positions = [canonical_position(t, pos[t].logprob,
                                    {int(i): lp.logprob for i, lp in pos.items()})
                 for t, pos in zip(ids, logprobs)]
    return {"tokens": ids, "positions": positions}


# ---------------------------------------------------------- comparison


def compare_records(ref: Mapping[str, dict], got: Mapping[str, dict]) -> dict:
    """Per request id in both: tokens identical, logprobs bitwise; counts,
    the largest logprob difference and a few examples."""
    ids = sorted(set(ref) & set(got))
    diffs = {i: compare.compare_request(ref[i], got[i]) for i in ids}
    tokens = [i for i, d in diffs.items() if not d.identical_tokens]
    bits = [i for i, d in diffs.items() if d.identical_tokens and not d.bitwise_logprobs]
    return {
        "compared": len(ids),
        "missing": sorted(set(ref) - set(got))[:20],
        "token_mismatches": len(tokens),
        "logprob_mismatches": len(bits),
        "max_abs_logprob_diff": max((d.max_abs_logprob_diff for d in diffs.values()),
                                    default=0.0),
        "examples": [{"id": i, **asdict(diffs[i])} for i in (tokens + bits)[:5]],
    }


# ----------------------------------------------------- server evidence

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> sum over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and not line.startswith("#"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def parse_status(text: str) -> dict[str, int]:
    """/proc/<pid>/status -> {VmLck, VmPin, VmRSS, VmHWM} in kB."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmLck", "VmPin", "VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


_PID = re.compile(r"\((EngineCore[^ ]*) pid=(\d+)\)")
LOG_PATTERNS = {
    "tracebacks": "Traceback (most recent call last)",
    "errors": " ERROR ",
    "host_reset_failed": "Failed to reset the HiSparse host prefix cache",
    "audit_mismatch": "HiSparse mirror audit",
}


def scan_log(text: str) -> dict[str, Any]:
    """Engine-core pids seen, in order (a restart shows a second one), and
    counts of what must not appear."""
    out: dict[str, Any] = {k: text.count(v) for k, v in LOG_PATTERNS.items()}
    out["engine_core_pids"] = list(dict.fromkeys(int(m.group(2)) for m in _PID.finditer(text)))
    return out


def fully_resident_blocks(tokens: int, pairs: int = 4, hot_blocks: int = 8) -> int:
    """GPU blocks a request would hold without HiSparse's hybrid regime:
    an indexer page + a page per resident group for every 64 tokens, and its
    hot regions."""
    return -(-tokens // BLOCK) * (1 + pairs) + pairs * hot_blocks


def demand_blocks(inflight_tokens: Iterable[int], max_num_seqs: int = 8) -> int:
    """What the running requests would need fully resident (the largest
    max_num_seqs of the requests in flight)."""
    top = sorted(inflight_tokens, reverse=True)[:max_num_seqs]
    return sum(fully_resident_blocks(t) for t in top)


# ------------------------------------------------------------ verdict


@dataclass
class Traffic:
    completed: int = 0
    streamed: int = 0
    non_streamed: int = 0
    disconnected: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0


OUTCOMES = ("completed", "before_first_token", "during_decode", "cancelled", "error")


def traffic(results: Sequence[dict]) -> Traffic:
    t = Traffic()
    for r in results:
        o = r["outcome"]
        t.generated_tokens += r.get("tokens_received", 0)
        t.prompt_tokens += r.get("prompt_len", 0)
        if o == "completed":
            t.completed += 1
            t.streamed += r["stream"]
            t.non_streamed += not r["stream"]
        elif o == "error":
            t.errors += 1
        else:
            t.disconnected[o] = t.disconnected.get(o, 0) + 1
    return t


PRESSURE_COUNTERS = ("vllm:hisparse_lost_pages_total", "vllm:hisparse_l3_lookups_total")
"""What proves the soak ran under pressure: pages given up, and hot-buffer
misses served from the host pool (docs/worker.md K22)."""


WRAP_UP_S = 45.0
"""What the soak needs after its load: drain, idle checks, the replay's
last steps and the report (run 25, warm: 11 s after the load)."""


def load_seconds(requested: float, seconds_left: float) -> float:
    """How long the load may run so that the report is still written inside
    the budget: a cold device call started the server so late that run 26
    was killed before its report. A cut load is reported (``load_cut_to_s``)
    and fails ``ran_long_enough``, which compares with the request."""
    return max(10.0, min(requested, seconds_left - WRAP_UP_S))


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict:
    """The server's HiSparse counters over the load (``*_total`` series)."""
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith("vllm:hisparse_") and k.endswith("_total")}


def _self_consistent(d: Mapping[str, Any]) -> bool:
    """The twin replay's records equal the replay's, bit for bit, over a
    non-empty set (the off arm is deterministic at the soak's batches)."""
    return (d["compared"] > 0 and d["token_mismatches"] == 0
            and d["logprob_mismatches"] == 0 and d["max_abs_logprob_diff"] == 0.0)


def verdict(report: Mapping[str, Any]) -> dict[str, bool]:
    """The soak's checks (R5); each one can fail."""
    t, m, r = report["requests"], report["mismatches"], report["replay_schedule"]
    return {
        "ran_long_enough": report["load_s"] >= report["config"]["duration_s"],
        "traffic_mix": t["streamed"] > 0 and t["non_streamed"] > 0
        and t["disconnected"].get("before_first_token", 0) > 0
        and t["disconnected"].get("during_decode", 0) > 0,
        "no_request_errors": t["errors"] == 0,
        "under_pressure": report["pressure"]["max_demand_blocks"] > report["pressure"][
            "gpu_blocks"] and all(report["pressure"]["hisparse"].get(n, 0) > 0
                                  for n in PRESSURE_COUNTERS),
        "replay_complete": m["compared"] == t["completed"] > 0,
        "replay_followed_the_schedule": r["followed"],
        "tokens_identical": m["token_mismatches"] == 0,
        "logprobs_bitwise": m["logprob_mismatches"] == 0 and m["max_abs_logprob_diff"] == 0.0,
        "no_restart": report["restarts"] == 0,
        "server_log_clean": all(report.get("log", {}).get(k, 0) == 0
                                for k in ("tracebacks", "errors", "audit_mismatch")),
        "no_leaks": report["leaks"] == 0,
        "sensitive_init": bool(report.get("sensitivity", {}).get("meets")),
        **({"replay_deterministic": _self_consistent(report["replay_determinism"])}
           if "replay_determinism" in report else {}),
        "init_paths_agree": report.get("init_paths_agree") is True,
    }
