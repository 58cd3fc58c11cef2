r"""Statistics of ensembles: means with confidence intervals, orders fitted by weighted
least squares, power-law constants.

An ensemble is n independent draws (members) of a study: member j runs every case with
the seeds base + j. Its mean error ē_i of case i estimates E[e_i] with the standard
error s_i/√n; the 95% interval is ē_i ± t_{0.975, n-1} s_i/√n (Student's t: exact for
normal draws, close for n ≥ 8 otherwise).

An order is fitted to E[e](h) = C h^p over all cases at once: y_i = log ē_i against
x_i = log h_i, by weighted least squares with weights 1/σ_i², σ_i = (s_i/√n)/ē_i (the
delta method), so precise cases count more. The cases of one member are not independent
(they share its draw: the first H heads of a larger draw, the member's own reference),
so the fit's interval comes from the members, which are: the leave-one-member-out
jackknife of the whole fit, SE² = (n-1)/n Σ_j (p_(j) - p̄)², and p ± t_{n-1} SE. The
constant at a fixed order is the mean over the cases of ē_i / h_i^p (unweighted: weights
estimated from the same draws bias it), with the same jackknife. One draw per case (n =
1) has neither: then ordinary least squares, and intervals from the cases' scatter about
the power law. tests/test_stats.py measures the coverage on synthetic laws with
independent, nested and shared-reference cases.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95


@functools.lru_cache(maxsize=256)
def t_quantile(dof: float, level: float = LEVEL) -> float:
    """The two-sided Student-t quantile t_{(1+level)/2, dof} (normal for dof = inf);
    kept per (dof, level): scipy takes half a millisecond for one."""
    from scipy import stats
    if dof <= 0:
        return math.nan
    if math.isinf(dof):
        return float(stats.norm.ppf(0.5 + level / 2))
    return float(stats.t.ppf(0.5 + level / 2, dof))


@dataclass
class Interval:
    """A mean with its standard error and two-sided interval at ``level``."""
    mean: float
    sem: float
    low: float
    high: float
    n: int


def mean_interval(values, level: float = LEVEL) -> Interval:
    """ē ± t_{n-1} s/√n of the draws ``values`` (no interval for one draw)."""
    x = np.asarray(values, dtype=float)
    n = x.size
    m = float(x.mean())
    if n < 2:
        return Interval(m, math.nan, math.nan, math.nan, n)
    sem = float(x.std(ddof=1) / math.sqrt(n))
    half = t_quantile(n - 1, level) * sem
    return Interval(m, sem, m - half, m + half, n)


@dataclass
class OrderFit:
    """E[e] ≈ constant · size^order, with the order's interval at ``level``."""
    order: float
    low: float
    high: float
    constant: float
    cases: int
    members: int


def _power_law(h: np.ndarray, errors: np.ndarray) -> tuple[float, float]:
    """(p, C) of log ē = log C + p log h, weighted by the members' standard errors
    (unweighted for one member, or where a standard error vanishes)."""
    e = errors.mean(axis=1)
    n = errors.shape[1]
    X = np.column_stack([np.ones(h.size), np.log(h)])
    w = np.ones(h.size)
    if n > 1:
        sem = errors.std(axis=1, ddof=1) / math.sqrt(n)
        if np.all(sem > 0):
            w = (e / sem) ** 2
    coef = np.linalg.solve((X.T * w) @ X, (X.T * w) @ np.log(e))
    return float(coef[1]), float(math.exp(coef[0]))


def _usable(sizes, errors, signed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The cases with a positive size and positive errors (``signed``: a positive mean
    of errors that may have either sign): (h, errors (cases, members))."""
    h = np.asarray(sizes, dtype=float)
    E = np.asarray(errors, dtype=float).reshape(h.size, -1)
    positive = E.mean(axis=1) > 0 if signed else np.all(E > 0, axis=1)
    ok = (h > 0) & np.isfinite(h) & positive & np.all(np.isfinite(E), axis=1)
    return h[ok], E[ok]


def jackknife_se(estimate, errors: np.ndarray) -> float:
    """The leave-one-member-out standard error of ``estimate(errors)`` (errors: cases x
    members), sqrt((n-1)/n sum_j (theta_(j) - mean)^2); nan for fewer than 3 members, or
    where a replicate has a case without a positive mean error."""
    n = errors.shape[1]
    if n < 3:
        return math.nan
    if np.any(errors.sum(axis=1, keepdims=True) - errors <= 0):
        return math.nan
    reps = np.array([estimate(np.delete(errors, j, axis=1)) for j in range(n)])
    return math.sqrt((n - 1) / n * float(((reps - reps.mean()) ** 2).sum()))


def fit_order(sizes, errors, level: float = LEVEL, signed: bool = False) -> OrderFit:
    """Fit E[e] = C h^p to ``errors`` (cases x members: every member's error in every case)
    by weighted least squares on the log means; the interval by the members' jackknife,
    or for one member from the residuals (see the module docstring). ``signed``: the
    members' errors may have either sign (a bias's deviations), their means are fitted
    where positive."""
    h, E = _usable(sizes, errors, signed)
    m, n = E.shape
    if m < 2 or np.ptp(np.log(h)) == 0:
        return OrderFit(math.nan, math.nan, math.nan, math.nan, m, n)
    p, C = _power_law(h, E)
    if n > 1:
        half = t_quantile(n - 1, level) * jackknife_se(lambda sub: _power_law(h, sub)[0], E)
        low, high = p - half, p + half
    elif m > 2:
        X = np.column_stack([np.ones(m), np.log(h)])
        r = np.log(E[:, 0]) - X @ np.array([math.log(C), p])
        se = math.sqrt(float(r @ r) / (m - 2) * np.linalg.inv(X.T @ X)[1, 1])
        q = t_quantile(m - 2, level)
        low, high = p - q * se, p + q * se
    else:
        low = high = math.nan
    return OrderFit(p, low, high, C, m, n)


def fit_constant(sizes, errors, order: float, level: float = LEVEL) -> Interval:
    """C of E[e] = C h^order at a fixed order: the mean over the cases of ē_i / h_i^order,
    its interval by the members' jackknife (one member: from the cases' scatter)."""
    h, E = _usable(sizes, errors)
    m, n = E.shape
    scaled = lambda sub: float(np.mean(sub.mean(axis=1) / h ** order))
    C = scaled(E)
    if n > 1:
        se = jackknife_se(scaled, E)
        half = t_quantile(n - 1, level) * se
        return Interval(C, se, C - half, C + half, n)
    iv = mean_interval(E[:, 0] / h ** order, level)
    return Interval(C, iv.sem, iv.low, iv.high, n)
