# SPDX-License-Identifier: Apache-2.0
"""The e2e gate's comparison and verdicts (tests/e2e/e2e_compare.py)."""

from dataclasses import dataclass

import e2e_compare as cmp
import pytest


@dataclass
class Lp:  # vLLM's Logprob fields the records read
    logprob: float
    rank: int | None


def record(tokens, sampled, tops=None):
    """A record whose position i has sampled token tokens[i] with logprob
    sampled[i] (rank 1) and four more ids below it."""
    positions = []
    for i, (t, lp) in enumerate(zip(tokens, sampled)):
        top = tops[i] if tops else [(t, lp)] + [(1000 + k, lp - k - 1.0) for k in range(4)]
        positions.append({tid: Lp(v, r + 1) for r, (tid, v) in enumerate(top)})
    return cmp.record_from_output(tokens, positions)


def test_position_record_keeps_rank_order_and_bit_patterns():
    entries = {7: (-0.5, 2), 3: (-0.25, 1), 9: (-3.0, 6), 8: (-1.0, 3)}
    lp, top = cmp.position_record(9, entries)
    assert float.fromhex(lp) == -3.0  # the sampled token, even outside the top-5
    assert [t for t, _ in top] == [3, 7, 8]  # ranks 1..5 only, in rank order
    assert cmp.position_record(3, {3: (-0.0, 1)}) != cmp.position_record(3, {3: (0.0, 1)})
    with pytest.raises(ValueError, match="sampled token"):
        cmp.position_record(4, entries)


def test_record_needs_a_logprob_position_per_token():
    with pytest.raises(ValueError, match="logprob positions"):
        cmp.record_from_output([1, 2], [{1: Lp(-1.0, 1)}])


def test_identical_requests_are_bitwise():
    a = record([5, 6, 7], [-1.0, -2.0, -3.0])
    d = cmp.compare_request(a, record([5, 6, 7], [-1.0, -2.0, -3.0]))
    assert d.identical_tokens and d.bitwise_logprobs and d.max_abs_logprob_diff == 0.0


def test_one_ulp_is_not_bitwise():
    x = -1.0
    y = float.fromhex(x.hex().replace("0x1.0000000000000p+0", "0x1.0000000000001p+0"))
    assert x != y
    d = cmp.compare_request(record([5, 6], [-2.0, x]), record([5, 6], [-2.0, y]))
    assert d.identical_tokens and not d.bitwise_logprobs
    assert 0 < d.max_abs_logprob_diff < 1e-15


def test_diff_counts_positions_up_to_the_first_divergence_only():
    ref = record([5, 6, 7, 8], [-1.0, -2.0, -3.0, -4.0])
    got = record([5, 6, 9, 8], [-1.0, -2.5, -3.0, -40.0])
    d = cmp.compare_request(ref, got)
    assert not d.identical_tokens and d.first_divergence == 2 and not d.bitwise_logprobs
    assert d.max_abs_logprob_diff == pytest.approx(0.5)  # position 3 (after) ignored


def test_top_entries_are_matched_by_id():
    tops_a = [[(5, -1.0), (6, -2.0), (7, -2.5)]]
    tops_b = [[(5, -1.0), (7, -2.25), (6, -2.3)]]  # near-tie swap, shifted values
    d = cmp.compare_request(record([5], [-1.0], tops_a), record([5], [-1.0], tops_b))
    assert d.identical_tokens and not d.bitwise_logprobs
    assert d.max_abs_logprob_diff == pytest.approx(0.3)


@pytest.mark.parametrize("same_tokens,same_bits,same_schedule,replay,ok,note", [
    (True, True, True, False, True, "bitwise identical"),
    (True, True, False, False, True, "bitwise identical"),
    (True, False, True, False, False, "logprobs differ under an equal schedule"),
    (False, False, True, False, False, "tokens differ"),
    (True, False, False, False, True, cmp.SCHEDULE_DIFFERED),
    (False, False, False, False, True, cmp.SCHEDULE_DIFFERED),
    (True, False, True, True, False, "logprobs differ under an equal schedule"),
    (False, False, True, True, False, "tokens differ"),
    (True, False, False, True, False, cmp.REPLAY_DIVERGED),
    (True, True, False, True, True, "bitwise identical"),
])
def test_verdict(same_tokens, same_bits, same_schedule, replay, ok, note):
    """T1: nothing is relaxed under equal batches; a natural comparison of
    other batches decides nothing (the replay does); a replay must have
    followed the schedule."""
    assert cmp.verdict(same_tokens, same_bits, same_schedule, replay) == (ok, note)


def test_compare_scenario_reports_schedule_and_diffs():
    ref = {"0/a": record([1, 2], [-1.0, -2.0]), "0/b": record([3], [-1.0])}
    got = {"0/a": record([1, 2], [-1.0, -2.0625]), "0/b": record([3], [-1.0])}
    same = cmp.compare_scenario(ref, got, [[2048], [1, 1]], [[2048], [1, 1]])
    assert not same["pass"] and same["schedule_equal"]
    assert same["note"] == "logprobs differ under an equal schedule"
    differ = cmp.compare_scenario(ref, got, [[2048], [1, 1]], [[1024], [1024], [1, 1]])
    assert differ["pass"] and differ["note"] == cmp.SCHEDULE_DIFFERED
    assert differ["max_abs_logprob_diff"] == pytest.approx(0.0625)
    assert differ["schedule_divergence"] == {"step": 0, "reference": [2048],
                                             "hisparse": [1024]}
    with pytest.raises(ValueError, match="different requests"):
        cmp.compare_scenario(ref, {"0/a": got["0/a"]}, [], [])


def test_a_trace_step_is_the_sorted_multiset_of_token_counts():
    import schedule_replay

    step = [["0/a", 0, schedule_replay.PREEMPTED], ["0/b", 3, -1], ["0/c", 1, 0], ["0/d", 2, -1]]
    assert schedule_replay.step_counts(step) == [1, 2, 3]
    assert cmp.trace_divergence([[1, 2]], [[1, 2], [1]]) == {
        "step": 1, "reference_steps": 1, "hisparse_steps": 2}


def test_sensitivity_counts_changed_prompts_within_the_steps():
    base = [record([1, 2, 3], [-1.0] * 3) for _ in range(4)]
    twins = [record([1, 2, 3], [-1.0] * 3), record([9, 2, 3], [-1.5, -1.0, -1.0]),
             record([1, 9, 3], [-1.0] * 3), record([1, 2, 9], [-1.0] * 3)]
    f = cmp.sensitivity_figures("v", base, twins, steps=2, needed=2)
    assert f["changed"] == 2 and f["meets"]  # the change at step 3 is too late
    assert f["first_divergence"] == [None, 0, 1, None]
    assert f["mean_sampled_logprob"] == -1.0
    assert not cmp.sensitivity_figures("v", base, twins, steps=2, needed=3)["meets"]


def test_choose_variant_takes_the_first_that_meets():
    figs = [{"variant": "a", "changed": 2, "meets": False},
            {"variant": "b", "changed": 7, "meets": True},
            {"variant": "c", "changed": 8, "meets": True}]
    assert cmp.choose_variant(figs) == ("b", True)
    assert cmp.choose_variant([figs[0], {"variant": "d", "changed": 5, "meets": False}]) == (
        "d", False)


def test_negative_control_needs_a_divergence_under_equal_batches_a_fault_and_a_clean_pass():
    failing = {"pass": False, "note": "tokens differ", "schedule_equal": True}
    diverged = {"pass": False, "note": cmp.REPLAY_DIVERGED, "schedule_equal": False}
    passing = {"pass": True, "note": "bitwise identical", "schedule_equal": True}
    assert cmp.negative_control(failing, {"fired": 1, "last": {"page": 3}}, 1)["pass"]
    assert not cmp.negative_control(failing, {"fired": 0}, 1)["pass"]  # not the fault
    assert not cmp.negative_control(failing, {"fired": 1}, 0)["pass"]  # no clean pass (run 8)
    assert not cmp.negative_control(diverged, {"fired": 1}, 1)["detected"]
    assert not cmp.negative_control(None, {"fired": 1}, 1)["detected"]
    missed = cmp.negative_control(passing, {"fired": 1}, 1)
    assert not missed["pass"] and not missed["detected"]


def test_the_decisive_comparison_is_the_replay_or_an_equal_schedule():
    natural_equal = {"schedule_equal": True, "bitwise_logprobs": False}
    natural_other = {"schedule_equal": False, "bitwise_logprobs": False}
    replay = {"schedule_equal": True, "bitwise_logprobs": True}
    assert cmp.decisive({"comparison": natural_equal}) is natural_equal
    assert cmp.decisive({"comparison": natural_other}) is None
    assert cmp.decisive({"comparison": natural_other, "replay": replay}) is replay


SPECS = {
    "pressure": {"kind": "pressure", "offload": True},
    "audit": {"kind": "pressure", "audit": True},
    "c8k": {"kind": "pressure", "no_pressure": ["single6k"]},
    "nopressure": {"kind": "nopressure", "adopt": ["returning"]},
    "hostex": {"kind": "hostex"},
}


@pytest.mark.parametrize("spec,scenario,expected", [
    ("pressure", "single6k", ["lost_pages", "hot_misses", "spills_completed",
                              "no_preemption"]),
    ("pressure", "host_prefix", ["hot_misses", "spills_completed", "no_preemption",
                                 "offloader_loaded_indexer"]),
    ("pressure", "returning", ["lost_pages", "hot_misses", "spills_completed",
                               "no_preemption", "offloader_loaded_indexer"]),
    ("pressure", "fault_probe", ["fault_fired"]),
    ("audit", "concurrent", ["lost_pages", "hot_misses", "spills_completed",
                             "no_preemption", "mirror_audit_rows", "mirror_audit_clean"]),
    ("c8k", "single6k", ["no_preemption"]),
    ("nopressure", "single6k", ["no_misses", "no_hot_region", "no_preemption"]),
    ("nopressure", "returning", ["pages_adopted", "no_preemption"]),
    ("hostex", "long_outputs", ["preempted_on_host_exhaustion"]),
])
def test_expected_checks(spec, scenario, expected):
    assert cmp.expected_checks(SPECS[spec], scenario) == expected


def test_checks_fail_on_missing_pressure():
    names = cmp.expected_checks(SPECS["audit"], "single6k")
    good = {"lost_pages": 3, "misses": 10, "spills_completed": 5, "preemptions": 0,
            "audit_rows_checked": 100, "audit_mismatches": 0}
    assert all(cmp.evaluate_checks(names, good).values())
    for key, bad in (("lost_pages", 0), ("preemptions", 1), ("audit_mismatches", 2),
                     ("audit_rows_checked", 0)):
        assert not all(cmp.evaluate_checks(names, {**good, key: bad}).values()), key


def test_scheduler_waits_reads_the_counter_when_it_exists():
    class Before:
        lost_pages = 1

    class After(Before):
        waits_for_in_flight = 4

    assert cmp.scheduler_waits(Before()) == 0
    assert cmp.scheduler_waits(After()) == 4


def test_a_fault_seen_before_an_mtp_schedule_split_is_detected():
    """T1's negative control under MTP (run 34, mtp_e30): the fault changed
    token 3, so the drafter's acceptances and then the schedule changed near
    the end and the replay could not follow; the tokens differed while both
    arms still ran the same batches, which is a detection. A divergence
    only after the split is not one."""
    n = 40
    ref = {"0/a": record(list(range(n)), [-1.0] * n)}
    early = {"0/a": record([0, 1, 2, 99] + list(range(4, n)), [-1.0] * n)}
    late = {"0/a": record(list(range(38)) + [99, 99], [-1.0] * n)}
    prefill = [[["0/a", 2048, 0]], [["0/a", 1904, -1]]]
    decode = [[["0/a", 2, -1]] for _ in range(30)]
    ref_trace = prefill + decode + [[["0/a", 1, -1]]] * 3
    got_trace = prefill + decode + [[["0/a", 2, -1]]] * 2
    seen = cmp.compare_scenario(ref, early, ref_trace, got_trace, replay=True)
    assert seen["note"] == cmp.REPLAY_DIVERGED and seen["diverged_under_equal_batches"] == {"0/a": 3}
    assert cmp.negative_control(seen, {"fired": 1}, 1)["pass"]
    after = cmp.compare_scenario(ref, late, ref_trace, got_trace, replay=True)
    assert after["diverged_under_equal_batches"] == {}  # 38 > the 31 decode steps' bound
    assert not cmp.negative_control(after, {"fired": 1}, 1)["detected"]
    assert cmp.sampled_before(ref_trace, "0/a", None) == 32
