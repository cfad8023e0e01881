"""The statistics of ``bpo-megatron compare``: one number per run, paired t-intervals across seeds,
Holm's adjustment of the p-values.

A run's evaluation curve becomes one number (:data:`STATS`): the mean of its last evaluations
(``final-window``, the default: peaks are a maximum over noisy evaluations, biased upward), the
area under the curve per step (``auc``), the best evaluation (``peak``, the paper's checkpoint
rule), the accuracy on held-out questions at the step selected on others (``heldout-peak``,
:func:`heldout_peak`: a peak without the selection's upward bias), or what training added
(``gain``: the final window less the first evaluation).

Methods are compared by seed: every method of one seed starts from the same policy, so the
per-seed differences from the reference method are paired. Their mean gets a Student t-interval
(n − 1 degrees of freedom) and a two-sided p-value; with several contrasts the p-values are
adjusted by Holm's step-down method, which controls the family-wise error rate.

The Student t distribution is computed here, from the regularised incomplete beta function (its
continued fraction, as in Numerical Recipes §6.4), instead of adding SciPy for one quantile.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

STATS = ("final-window", "auc", "peak", "heldout-peak", "gain")

Curve = list[tuple[int, float]]  # (step, accuracy), by step


# ------------------------------------------------------------------------------ Student t
def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 ≤ x ≤ 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x={x} must lie in [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # the continued fraction converges fast for x < (a + 1)/(a + b + 2); beyond, by symmetry
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(1.0 - x, b, a) / b


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b), evaluated by the modified Lentz method."""
    tiny, epsilon = 1e-300, 1e-16
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    value = d
    for m in range(1, 10_000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            value *= c * d
        if abs(c * d - 1.0) < epsilon:
            return value
    raise ArithmeticError(f"the incomplete beta function's continued fraction did not converge (x={x}, a={a}, b={b})")


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| ≥ |t|) for Student's T with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 0.0
    return regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)


def t_cdf(t: float, df: float) -> float:
    tail = t_two_sided_p(t, df) / 2.0
    return 1.0 - tail if t > 0 else tail


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile of Student's T with ``df`` degrees of freedom (bisection on
    the distribution function: it is monotone, and each step costs one incomplete beta)."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"a quantile's probability must lie in (0, 1), got {probability}")
    if probability < 0.5:
        return -t_quantile(1.0 - probability, df)
    if probability == 0.5:
        return 0.0
    target = 2.0 * (1.0 - probability)  # the two-sided tail beyond the quantile
    high = 1.0
    while t_two_sided_p(high, df) > target:
        high *= 2.0
    low = 0.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if t_two_sided_p(middle, df) > target:
            low = middle
        else:
            high = middle
        if high - low <= 1e-13 * high:
            break
    return (low + high) / 2.0


# ------------------------------------------------------------------------------ contrasts
@dataclass(frozen=True)
class PairedDifference:
    """``values − reference`` paired by seed: n pairs, their mean, its t-interval and p-value
    (``low``, ``high`` and ``p`` are None for a single pair: no spread to estimate)."""

    n: int
    mean: float
    low: float | None
    high: float | None
    p: float | None


def paired_t(values: list[float], reference: list[float], *, level: float = 0.95) -> PairedDifference:
    """The mean of the per-seed differences with its Student t-interval at ``level`` (n − 1
    degrees of freedom) and the two-sided paired t-test's p-value of a zero mean."""
    if len(values) != len(reference):
        raise ValueError(f"paired values need as many values ({len(values)}) as references ({len(reference)})")
    if not values:
        raise ValueError("a paired difference needs at least one pair")
    deltas = [v - r for v, r in zip(values, reference)]
    n, mean = len(deltas), statistics.fmean(deltas)
    if n < 2:
        return PairedDifference(n, mean, None, None, None)
    standard_error = statistics.stdev(deltas) / math.sqrt(n)
    if standard_error == 0.0:  # every seed differs by the same amount
        return PairedDifference(n, mean, mean, mean, 1.0 if mean == 0.0 else 0.0)
    half_width = t_quantile(0.5 + level / 2.0, n - 1) * standard_error
    return PairedDifference(n, mean, mean - half_width, mean + half_width,
                            t_two_sided_p(mean / standard_error, n - 1))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment, in the order given: the i-th smallest of m p-values becomes
    max over j ≤ i of min(1, (m − j + 1) · p_(j))."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


# ------------------------------------------------------------------------------ one number per run
def final_window(curve: Curve, window: int) -> float:
    """The mean accuracy of the last ``window`` evaluations."""
    if len(curve) < window:
        raise ValueError(f"{len(curve)} evaluations, fewer than the window of {window}")
    return statistics.fmean(value for _, value in curve[-window:])


def area_under_curve(curve: Curve) -> float:
    """The area under the accuracy-by-step curve (trapezoids between evaluations) divided by the
    steps it spans: the run's mean accuracy over training; one evaluation is its own value."""
    if len(curve) == 1:
        return curve[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2.0 for (s0, v0), (s1, v1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


def gain(curve: Curve, window: int) -> float:
    """What training added: the final window less the first evaluation (the run's start)."""
    return final_window(curve, window) - curve[0][1]


def peak(curve: Curve) -> float:
    return max(value for _, value in curve)


def heldout_peak(selection: Curve, report: Curve) -> tuple[int, float]:
    """The step of the best ``selection`` accuracy (the earlier on ties, as the paper's checkpoint
    rule) and the ``report`` accuracy there: evaluated on questions the choice never saw."""
    best = max(value for _, value in selection)
    step = next(step for step, value in selection if value == best)
    reported = dict(report)
    if step not in reported:
        raise ValueError(f"step {step} has a selection accuracy but no held-out one")
    return step, reported[step]
