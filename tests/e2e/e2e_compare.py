# SPDX-License-Identifier: Apache-2.0
"""What the e2e gate compares and how it decides (pure Python: no vLLM, no
torch; the GPU drivers feed it plain values).

Per request the gate keeps every sampled token, that token's logprob and
the top-5 (id, logprob) in rank order, logprobs as ``float.hex`` strings so
that equality is equality of bit patterns (a float32 logprob converts to a
Python float exactly). Per scenario it keeps the schedule trace: for every
step that scheduled tokens, the multiset of per-request token counts, in
step order. Where both arms' traces are equal the batches were the same, so
the logprobs must be bitwise equal. Where they differ (HiSparse may wait a
step for in-flight copies, admit fewer prefills under pressure, or hit a
shorter prefix) vLLM's batched kernels give other low bits, and on a
context-sensitive model other greedy tokens too (run 9): that natural
comparison is reported ("schedule differed") and the scenario is judged by
the replay arm instead, a HiSparse-off engine that ran exactly the HiSparse
engine's steps (schedule_replay.py, docs/worker.md K28): there the keyed
schedules (request, token count, prefix hit at admission, per step) must be
equal and every logprob bitwise equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

TOP_LOGPROBS = 5

# ------------------------------------------------------------- records


def position_record(
    token_id: int, entries: Mapping[int, tuple[float, int | None]]
) -> list:
    """One generated position: [sampled logprob, [[id, logprob], ...]] with
    the top entries (rank 1..TOP_LOGPROBS) in rank order, floats as hex.

    ``entries`` maps token id -> (logprob, rank), as vLLM's per-position
    logprobs dict (it holds the top-k and the sampled token)."""
    if token_id not in entries:
        raise ValueError(f"the logprobs of a position lack its sampled token {token_id}")
    top = sorted(
        (rank, tid, lp) for tid, (lp, rank) in entries.items()
        if rank is not None and rank <= TOP_LOGPROBS
    )
    return [float(entries[token_id][0]).hex(),
            [[tid, float(lp).hex()] for _, tid, lp in top]]


def record_from_output(token_ids: Sequence[int], logprobs: Iterable[Any]) -> dict:
    """A request's record from vLLM's CompletionOutput fields (token_ids and
    logprobs: per position a mapping id -> Logprob(logprob, rank))."""
    tokens = [int(t) for t in token_ids]
    positions = [
        position_record(t, {int(i): (lp.logprob, lp.rank) for i, lp in pos.items()})
        for t, pos in zip(tokens, logprobs)
    ]
    if len(positions) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(positions)} logprob positions")
    return {"tokens": tokens, "positions": positions}


# ---------------------------------------------------------- comparison


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class RequestDiff:
    identical_tokens: bool
    first_divergence: int | None
    bitwise_logprobs: bool
    max_abs_logprob_diff: float


def _lp(h: str) -> float:
    return float.fromhex(h)


def _position_diff(ref: list, got: list, same_token: bool) -> tuple[bool, float]:
    """(bitwise equal, max |diff|) of one position's sampled and top-k
    logprobs; top entries are matched by token id."""
    worst = abs(_lp(ref[0]) - _lp(got[0])) if same_token else 0.0
    got_top = dict((tid, h) for tid, h in got[1])
    for tid, h in ref[1]:
        if tid in got_top:
            worst = max(worst, abs(_lp(h) - _lp(got_top[tid])))
    return same_token and ref == got, worst


def compare_request(ref: dict, got: dict) -> RequestDiff:
    """Tokens, then logprobs at every position whose context is shared: up
    to and including the first diverging position (later positions follow
    different tokens and compare nothing)."""
    a, b = ref["tokens"], got["tokens"]
    div = first_divergence(a, b)
    last = min(len(a), len(b)) if div is None else min(div + 1, len(a), len(b))
    bitwise = div is None and len(ref["positions"]) == len(got["positions"])
    worst = 0.0
    for i in range(last):
        same, d = _position_diff(ref["positions"][i], got["positions"][i], a[i] == b[i])
        bitwise &= same
        worst = max(worst, d)
    return RequestDiff(div is None, div, bitwise, worst)


def trace_divergence(a: Sequence, b: Sequence) -> dict | None:
    """Where two schedule traces first differ (for the report)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            return {"step": i, "reference": list(x), "hisparse": list(y)}
    if len(a) != len(b):
        i = min(len(a), len(b))
        return {"step": i, "reference_steps": len(a), "hisparse_steps": len(b)}
    return None


SCHEDULE_DIFFERED = "schedule differed: judged by the replay"
REPLAY_DIVERGED = "the replay did not reproduce the schedule"


def verdict(identical_tokens: bool, bitwise: bool, schedule_equal: bool,
            replay: bool = False) -> tuple[bool, str]:
    """Bitwise wherever the two arms ran the same batches (tokens and
    logprobs). A natural comparison whose schedules differ decides nothing
    (vLLM's kernels are not batch-invariant): it passes here and the replay
    judges the scenario; a replay must have reproduced the schedule."""
    if bitwise:
        return True, "bitwise identical"
    if schedule_equal:
        if not identical_tokens:
            return False, "tokens differ"
        return False, "logprobs differ under an equal schedule"
    if replay:
        return False, REPLAY_DIVERGED
    return True, SCHEDULE_DIFFERED


def compare_scenario(
    ref: Mapping[str, dict], got: Mapping[str, dict],
    ref_trace: Sequence, got_trace: Sequence, replay: bool = False,
) -> dict:
    """Both arms' records of one scenario (same request keys) and traces
    (unkeyed, or with ``replay`` the keyed steps of schedule_replay)."""
    if set(ref) != set(got):
        raise ValueError(f"the arms ran different requests: {sorted(set(ref) ^ set(got))}")
    diffs = {k: compare_request(ref[k], got[k]) for k in ref}
    identical = all(d.identical_tokens for d in diffs.values())
    bitwise = all(d.bitwise_logprobs for d in diffs.values())
    schedule_equal = [list(s) for s in ref_trace] == [list(s) for s in got_trace]
    ok, note = verdict(identical, bitwise, schedule_equal, replay)
    worst = max((d.max_abs_logprob_diff for d in diffs.values()), default=0.0)
    divergence = trace_divergence(ref_trace, got_trace)
    before = {k: d.first_divergence for k, d in diffs.items()
              if d.first_divergence is not None
              and d.first_divergence < sampled_before(got_trace, k, divergence)}
    return {
        "identical_tokens": identical,
        "bitwise_logprobs": bitwise,
        "schedule_equal": schedule_equal,
        "max_abs_logprob_diff": worst,
        "note": note,
        "pass": ok,
        "requests": len(diffs),
        "first_divergence": {k: d.first_divergence for k, d in diffs.items()
                             if d.first_divergence is not None},
        "schedule_divergence": divergence,
        "diverged_under_equal_batches": before,
        "steps": [len(ref_trace), len(got_trace)],
    }


MAX_DECODE_TOKENS = 4
"""Tokens a decode step schedules at most (1 + MTP's 3 drafts)."""


def sampled_before(trace: Sequence, key: str, divergence: dict | None) -> int:
    """A lower bound on the tokens request ``key`` sampled in the steps
    before the schedules split (keyed traces only; 0 when unkeyed). Every
    step after its last prefill-sized step samples at least one token
    (the first of them may end the prompt); one is taken off in case it
    was a prefill remainder that sampled none."""
    end = len(trace) if divergence is None else divergence["step"]
    steps = [n for step in trace[:end] for e in step
             if isinstance(e, (list, tuple)) and len(e) == 3 and e[0] == key
             for n in [e[1]] if n]
    last_big = max((i for i, n in enumerate(steps) if n > MAX_DECODE_TOKENS), default=-1)
    return max(0, len(steps) - last_big - 2)


# ------------------------------------------------ sensitivity control


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None  # None: JSON has no NaN


def sensitivity_figures(
    name: str, base: Sequence[dict], twins: Sequence[dict], steps: int, needed: int
) -> dict:
    """How often replacing the early part of a prompt changes the greedy
    tokens within ``steps`` (the comparison can only see host-resident
    context if the output depends on it)."""
    divs = [first_divergence(b["tokens"][:steps], t["tokens"][:steps])
            for b, t in zip(base, twins)]
    changed = sum(d is not None for d in divs)
    sampled = [_lp(p[0]) for r in base for p in r["positions"]]
    first_pos = [abs(_lp(b["positions"][0][0]) - _lp(t["positions"][0][0]))
                 for b, t in zip(base, twins) if b["tokens"][0] == t["tokens"][0]]
    return {
        "variant": name,
        "changed": changed,
        "of": len(divs),
        "needed": needed,
        "meets": changed >= needed,
        "first_divergence": divs,
        "distinct_tokens": len({t for r in base for t in r["tokens"]}),
        "mean_sampled_logprob": _mean(sampled),
        "mean_first_logprob_shift": _mean(first_pos),
    }


def choose_variant(figures: Sequence[dict]) -> tuple[str, bool]:
    """The first variant meeting the criterion; otherwise the most
    sensitive one, and False (the run fails)."""
    for f in figures:
        if f["meets"]:
            return f["variant"], True
    if not figures:
        raise ValueError("no variant was measured")
    best = max(figures, key=lambda f: f["changed"])
    return best["variant"], False


# ---------------------------------------------------- negative control


def negative_control(comparison: dict | None, fault: Mapping[str, Any],
                     clean_passes: int) -> dict:
    """The fault scenario's comparison must FAIL under equal batches (a
    divergence the replay or an equal schedule shows, or tokens that
    differed before a replay's schedule split, not a schedule the replay
    could not follow), the fault must have fired, and the same
    engine must have passed a clean comparison under pressure in this run
    (``clean_passes``): else a detection would prove nothing (run 8)."""
    fired = int(fault.get("fired", 0))
    # Under MTP the fault's tokens change what the drafter gets accepted,
    # so the schedules split later; tokens that differed before the split
    # differed under equal batches all the same.
    detected = (comparison is not None and not comparison["pass"]
                and (comparison["schedule_equal"]
                     or bool(comparison.get("diverged_under_equal_batches"))))
    return {"fired": fired, "detected": detected,
            "detected_by": comparison["note"] if comparison else "no comparison ran",
            "clean_passes": clean_passes, "target": fault.get("last"),
            "pass": detected and fired > 0 and clean_passes > 0}


def decisive(entry: Mapping[str, Any]) -> dict | None:
    """The comparison that judges a HiSparse scenario: the replay's where it
    ran, else the natural one if both arms ran the same batches (or agree
    bit for bit anyway); None when only a differing natural schedule ran."""
    if entry.get("replay") is not None:
        return entry["replay"]
    cmp = entry.get("comparison")
    if cmp is not None and (cmp["schedule_equal"] or cmp["bitwise_logprobs"]):
        return cmp
    return None


# ------------------------------------------------------ pressure proof

CHECKS = {
    "lost_pages": lambda c: c.get("lost_pages", 0) > 0,
    "hot_misses": lambda c: c.get("misses", 0) > 0,
    "spills_completed": lambda c: c.get("spills_completed", 0) > 0,
    "no_preemption": lambda c: c.get("preemptions", 0) == 0,
    "preempted_on_host_exhaustion": lambda c: c.get("preemptions", 0) > 0,
    "no_misses": lambda c: c.get("misses", 0) == 0,
    "no_hot_region": lambda c: c.get("hot_regions_assigned", 0) == 0
    and c.get("lost_pages", 0) == 0,
    "offloader_loaded_indexer": lambda c: c.get("external_tokens", 0) > 0,
    "mirror_audit_rows": lambda c: c.get("audit_rows_checked", 0) > 0,
    "mirror_audit_clean": lambda c: c.get("audit_mismatches", 0) == 0,
    "fault_fired": lambda c: c.get("fault_fired", 0) > 0,
    "pages_adopted": lambda c: c.get("pages_adopted", 0) > 0,
    "imported_to_device": lambda c: c.get("import_device_pages", 0) > 0,
    "imported_to_host": lambda c: c.get("import_host_pages", 0) > 0,
    "no_import_fallback": lambda c: c.get("import_fallbacks", 0) == 0,
}
PRESSURE = ("lost_pages", "hot_misses", "spills_completed", "no_preemption")
OFFLOADED_HITS = ("host_prefix", "returning")
PD_CONSUMER = ("imported_to_device", "imported_to_host", "no_import_fallback", "hot_misses",
               "no_preemption")
"""A P/D consumer's proof (4.13, INV-30): both landings occurred, every
import landed (none given up or failed), the host-landed pages were read
from host, and no import preempted anyone."""
ZERO_RESIDENT_RETURNS = ("host_prefix",)
"""Its request fits the pool alone: its proof is the zero-resident return
(hot misses on host rows, the offloaded indexer), not lost pages."""


def expected_checks(spec: Mapping[str, Any], scenario: str) -> list[str]:
    """What a HiSparse scenario must prove beyond the comparison.

    ``spec`` keys: kind ("pressure" | "nopressure" | "hostex"), audit,
    offload, pd ("consumer": PD_CONSUMER), and the scenarios exempt from
    pressure by construction (``no_pressure``) or whose host-prefix hits
    are restored to resident pages without pressure (``adopt``).
    """
    pd = spec.get("pd") == "consumer"
    if scenario == "fault_probe":
        # a P/D consumer imports the probe's prompt host-landed: the fault
        # corrupts an imported page
        return ["fault_fired"] + (["imported_to_host", "no_import_fallback"] if pd else [])
    kind = spec.get("kind", "pressure")
    if pd:
        names = list(PD_CONSUMER)
    elif kind == "hostex":
        names = ["preempted_on_host_exhaustion"]
    elif kind == "nopressure":
        names = (["pages_adopted", "no_preemption"] if scenario in spec.get("adopt", ())
                 else ["no_misses", "no_hot_region", "no_preemption"])
    elif scenario in spec.get("no_pressure", ()):
        names = ["no_preemption"]
    elif scenario in ZERO_RESIDENT_RETURNS:
        names = [n for n in PRESSURE if n != "lost_pages"]
    else:
        names = list(PRESSURE)
    if spec.get("audit"):
        names += ["mirror_audit_rows", "mirror_audit_clean"]
    if spec.get("offload") and scenario in OFFLOADED_HITS:
        names.append("offloader_loaded_indexer")
    return names


def evaluate_checks(names: Sequence[str], counters: Mapping[str, Any]) -> dict[str, bool]:
    return {n: bool(CHECKS[n](counters)) for n in names}


WAIT_COUNTERS = ("waits_for_in_flight", "in_flight_waits", "steps_waited")
"""Names the scheduler-side counter of steps HiSparse waited for in-flight
copies may have (the first present is reported; 0 before it exists)."""


def scheduler_waits(stats: Any) -> int:
    for name in WAIT_COUNTERS:
        if hasattr(stats, name):
            return int(getattr(stats, name))
    return 0


def as_dict(diff: RequestDiff) -> dict:
    return asdict(diff)
