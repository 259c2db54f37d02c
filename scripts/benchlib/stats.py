# SPDX-License-Identifier: Apache-2.0
"""The statistics of the benchmarks (standard library only).

percentile       linear interpolation between closest ranks (numpy's
                 default method), q in [0, 100]
spread           median, min, max, quartiles, IQR and IQR / median
decode_ms        (time of N + M new tokens - time of M) / N, in ms per step
linear_fit       least squares y = a + b x (the fixed + per-layer split)
alternation      the order of the arms in each repetition: rotated by one
                 per repetition, so every arm runs first equally often and a
                 linear drift cancels between two arms (A B, B A, ...)
time_weighted_mean  a sampled step function's mean over [t0, t1]
bootstrap_ratio  a percentile interval of stat(num) / stat(den) over paired
                 repetitions, resampled with replacement (fixed seed)
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def _finite(values: Sequence[float]) -> list[float]:
    out = [float(v) for v in values if v is not None]
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"non-finite values: {bad[:3]}")
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), numpy's 'linear' method."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    xs = sorted(_finite(values))
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def spread(values: Sequence[float]) -> dict:
    """A sample's center and spread; rel_iqr is IQR / median."""
    xs = _finite(values)
    if not xs:
        return {"n": 0}
    med = median(xs)
    p25, p75 = percentile(xs, 25), percentile(xs, 75)
    return {"n": len(xs), "median": med, "min": min(xs), "max": max(xs),
            "p25": p25, "p75": p75, "iqr": p75 - p25,
            "rel_iqr": (p75 - p25) / med if med else None}


def decode_ms(t_short_s: float, t_long_s: float, steps: int) -> float:
    """Milliseconds per decode step from two timed generations of the same
    prompts: ``steps`` more new tokens in the long one."""
    if steps <= 0:
        raise ValueError(f"steps must be > 0, not {steps}")
    return (t_long_s - t_short_s) / steps * 1e3


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares (intercept, slope) of y = intercept + slope * x; with
    two distinct x it is the line through both points."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    pts = [(float(x), float(y)) for x, y in zip(xs, ys)]
    if len({x for x, _ in pts}) < 2:
        raise ValueError("a fit needs at least two distinct x values")
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    slope = sxy / sxx
    return my - slope * mx, slope


def alternation(arms: Sequence[str], reps: int) -> list[list[str]]:
    """The arms' order in each of ``reps`` repetitions: the list rotated by
    the repetition's index (two arms: A B, B A, A B, ...)."""
    if reps < 0:
        raise ValueError(f"reps must be >= 0, not {reps}")
    arms = list(arms)
    if len(set(arms)) != len(arms):
        raise ValueError(f"an arm is named twice: {arms}")
    k = len(arms)
    return [arms[r % k:] + arms[:r % k] if k else [] for r in range(reps)]


def time_weighted_mean(series: Sequence[tuple[float, float]], t0: float,
                       t1: float) -> float | None:
    """Mean over [t0, t1] of the step function that holds each sample's
    value until the next sample (the value before the first sample in the
    window is the last one before t0, if any, else the first in it)."""
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1}]")
    pts = sorted((float(t), float(v)) for t, v in series)
    if not pts:
        return None
    before = [p for p in pts if p[0] <= t0]
    inside = [p for p in pts if t0 < p[0] < t1]
    if not before and not inside:
        return None
    start_value = before[-1][1] if before else inside[0][1]
    knots = [(t0, start_value)] + inside
    total = 0.0
    for (ta, va), (tb, _) in zip(knots, knots[1:] + [(t1, 0.0)]):
        total += va * (tb - ta)
    return total / (t1 - t0)


STATISTICS = {"min": min, "median": median}


def bootstrap_ratio(pairs: Sequence[tuple[float, float]], statistic: str = "min",
                    level: float = 0.90, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float] | None:
    """The central ``level`` percentile interval of stat(nums) / stat(dens)
    over ``pairs`` [(num, den)], one pair per repetition (both arms'
    samples of it, so a repetition's shared conditions stay together),
    the repetitions resampled with replacement ``resamples`` times. A
    fixed seed: the same samples give the same interval. None with fewer
    than three pairs (too few to say anything of the spread)."""
    if not 0 < level < 1:
        raise ValueError(f"level {level} outside (0, 1)")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, not {resamples}")
    stat = STATISTICS[statistic]
    pts = [(n, d) for n, d in ((float(a), float(b)) for a, b in pairs)]
    _finite([v for p in pts for v in p])
    if len(pts) < 3:
        return None
    if any(d <= 0 for _, d in pts):
        raise ValueError("a ratio needs positive denominators")
    rng = random.Random(seed)
    k = len(pts)
    ratios = []
    for _ in range(resamples):
        pick = [pts[rng.randrange(k)] for _ in range(k)]
        ratios.append(stat([n for n, _ in pick]) / stat([d for _, d in pick]))
    tail = (1 - level) / 2 * 100
    return percentile(ratios, tail), percentile(ratios, 100 - tail)
