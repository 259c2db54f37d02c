# SPDX-License-Identifier: Apache-2.0
"""benchlib.stats: percentiles, spreads, the decode-step formula, the fixed +
per-layer fit, the arms' alternation order, time-weighted means."""

import itertools
import math

import pytest
from benchlib import stats


def test_percentile_is_numpys_linear_method():
    xs = [15, 20, 35, 40, 50]
    # numpy.percentile(xs, q) for these q (method="linear")
    for q, want in [(0, 15), (25, 20), (40, 29), (50, 35), (75, 40), (90, 46), (100, 50)]:
        assert stats.percentile(xs, q) == pytest.approx(want)
    assert stats.percentile([3, 1, 2], 50) == 2  # order does not matter
    assert stats.percentile([7.5], 95) == 7.5
    assert stats.median([1, 2, 3, 4]) == 2.5


@pytest.mark.parametrize("bad", [[], [1.0, math.nan], [math.inf]])
def test_percentile_refuses_nothing_and_non_finite(bad):
    with pytest.raises(ValueError):
        stats.percentile(bad, 50)


def test_percentile_range_is_checked():
    with pytest.raises(ValueError, match="outside"):
        stats.percentile([1, 2], 101)


def test_spread():
    s = stats.spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert s == {"n": 5, "median": 3.0, "min": 1.0, "max": 5.0, "p25": 2.0, "p75": 4.0,
                 "iqr": 2.0, "rel_iqr": pytest.approx(2 / 3)}
    assert stats.spread([]) == {"n": 0}


def test_decode_ms_is_the_difference_over_the_extra_steps():
    # 288 new tokens in 1.0 s, 32 in 0.2 s: 0.8 s over 256 steps
    assert stats.decode_ms(0.2, 1.0, 256) == pytest.approx(3.125)
    with pytest.raises(ValueError):
        stats.decode_ms(0.2, 1.0, 0)


def test_linear_fit_through_two_points_and_least_squares():
    # tax = 50 us + 3 us per layer, measured at 4 and 32 layers
    assert stats.linear_fit([4, 32], [62, 146]) == pytest.approx((50.0, 3.0))
    a, b = stats.linear_fit([0, 1, 2, 3], [1.0, 3.1, 4.9, 7.0])
    assert (a, b) == (pytest.approx(1.03), pytest.approx(1.98))
    with pytest.raises(ValueError, match="distinct"):
        stats.linear_fit([4, 4], [1, 2])
    with pytest.raises(ValueError):
        stats.linear_fit([1, 2], [1])


def test_alternation_two_arms_is_abba():
    assert stats.alternation(["off", "on"], 4) == [["off", "on"], ["on", "off"],
                                                    ["off", "on"], ["on", "off"]]


@pytest.mark.parametrize("arms", [["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]])
@pytest.mark.parametrize("reps", [1, 2, 5, 6, 12])
def test_alternation_runs_every_arm_once_per_rep_and_first_equally_often(arms, reps):
    orders = stats.alternation(arms, reps)
    assert len(orders) == reps
    for o in orders:
        assert sorted(o) == sorted(arms)
    firsts = [o[0] for o in orders]
    counts = [firsts.count(a) for a in arms]
    assert max(counts) - min(counts) <= 1
    # a drift linear in time: every arm's mean position differs by < one slot
    positions = {a: [o.index(a) for o in orders] for a in arms}
    if reps % len(arms) == 0:
        means = {a: sum(p) / reps for a, p in positions.items()}
        assert len(set(means.values())) == 1


def test_alternation_refuses_a_repeated_arm():
    with pytest.raises(ValueError):
        stats.alternation(["on", "on"], 2)


def test_time_weighted_mean_holds_each_value_until_the_next_sample():
    series = [(0.0, 2.0), (1.0, 4.0), (3.0, 0.0)]
    # over [0, 4]: 2 for 1 s, 4 for 2 s, 0 for 1 s
    assert stats.time_weighted_mean(series, 0.0, 4.0) == pytest.approx(10 / 4)
    # the window starts between samples: the value in force is the last one before it
    assert stats.time_weighted_mean(series, 2.0, 3.0) == pytest.approx(4.0)
    # no sample before the window: its first sample's value from the start
    assert stats.time_weighted_mean([(1.0, 5.0)], 0.0, 2.0) == pytest.approx(5.0)
    assert stats.time_weighted_mean([], 0.0, 1.0) is None
    with pytest.raises(ValueError):
        stats.time_weighted_mean(series, 1.0, 1.0)


def test_time_weighted_mean_is_a_plain_mean_for_even_sampling():
    vals = [3, 1, 4, 1, 5, 9, 2, 6]
    series = list(zip(itertools.count(0.0, 0.5), vals))
    assert stats.time_weighted_mean(series, 0.0, 4.0) == pytest.approx(sum(vals) / len(vals))


def test_bootstrap_ratio_collapses_on_a_constant_ratio_and_widens_with_noise():
    """P2's resolution: a constant per-repetition ratio has a point
    interval; noise widens it around the ratio of the statistic."""
    exact = [(2.2 * k, 2.0 * k) for k in (1.0, 1.1, 1.3, 0.9, 1.2)]
    lo, hi = stats.bootstrap_ratio(exact, "median")
    assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    noisy = [(2.2, 2.0), (3.3, 2.0), (2.2, 3.0), (2.4, 2.1), (2.3, 2.6), (3.0, 2.0)]
    lo, hi = stats.bootstrap_ratio(noisy, "median")
    assert lo < stats.median([n for n, _ in noisy]) / stats.median([d for _, d in noisy]) < hi
    assert hi - lo > 0.3


def test_bootstrap_ratio_is_reproducible_and_needs_three_pairs():
    pairs = [(1.0 + 0.1 * i, 1.0 + 0.07 * (i % 4)) for i in range(9)]
    assert stats.bootstrap_ratio(pairs) == stats.bootstrap_ratio(pairs)  # fixed seed
    a = stats.bootstrap_ratio(pairs, "median", seed=1, resamples=50)
    assert a != stats.bootstrap_ratio(pairs, "median", seed=2, resamples=50)
    assert stats.bootstrap_ratio(pairs[:2]) is None
    with pytest.raises(ValueError):
        stats.bootstrap_ratio(pairs, level=1.0)
    with pytest.raises(ValueError):
        stats.bootstrap_ratio([(1.0, 0.0)] * 3)
    with pytest.raises(KeyError):
        stats.bootstrap_ratio(pairs, "mean")
