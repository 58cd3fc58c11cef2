r"""Explicit strong-stability-preserving Runge-Kutta schemes in Shu-Osher form.

A scheme with s stages advances u' = L(u) by

.. math::

    Y_0 = u^n, \qquad
    Y_i = \sum_{j<i} \alpha_{ij} Y_j + \Delta t\, \beta_{ij} L(Y_j) \quad (i = 1..s),
    \qquad u^{n+1} = Y_s,

with a limiter applied to every Y_i. All alpha, beta >= 0, so each stage is a convex
combination of forward Euler steps: whatever forward Euler preserves under a step
restriction (positivity of cell means, with the limiter) the scheme preserves under
that restriction times its SSP coefficient. The state is a tuple of numpy arrays
(density coefficients, accumulated outflow, ...): every part is combined alike, which
is what keeps ``mass + outflow`` constant to round-off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..tools.keys import Key, string


@dataclass(frozen=True)
class SSPScheme:
    name: str
    order: int
    alpha: tuple  # alpha[i-1][j], i = 1..s, j = 0..i-1
    beta: tuple
    # Stable step relative to ssprk2/ssprk3 for upwind DG (measured on the translation
    # test: ssprk104 stays stable up to 4-5x the step at which ssprk3 fails on DG-3).
    cfl_factor: float = 1.0

    @property
    def stages(self) -> int:
        return len(self.alpha)

    def stage_times(self) -> np.ndarray:
        """c_j: the stage Y_j approximates u(t + c_j dt), j = 0..s."""
        c = [0.0]
        for a, b in zip(self.alpha, self.beta):
            c.append(sum(aj * c[j] + bj for j, (aj, bj) in enumerate(zip(a, b))))
        return np.array(c)


def _row(n, entries):
    r = [0.0] * n
    for j, v in entries.items():
        r[j] = v
    return tuple(r)


def _ketcheson_10_4() -> SSPScheme:
    """SSPRK(10,4) of Ketcheson (2008), SSP coefficient 6, written out in Shu-Osher form."""
    alpha, beta = [], []
    for i in range(1, 11):
        if i == 5:
            a, b = {0: 3 / 5, 4: 2 / 5}, {4: 1 / 15}
        elif i == 10:
            a, b = {0: 1 / 25, 4: 9 / 25, 9: 3 / 5}, {4: 3 / 50, 9: 1 / 10}
        else:
            a, b = {i - 1: 1.0}, {i - 1: 1 / 6}
        alpha.append(_row(i, a))
        beta.append(_row(i, b))
    return SSPScheme("ssprk104", 4, tuple(alpha), tuple(beta), cfl_factor=3.0)


SCHEMES: dict[str, SSPScheme] = {
    "euler": SSPScheme("euler", 1, ((1.0,),), ((1.0,),)),
    "ssprk2": SSPScheme("ssprk2", 2, ((1.0,), (0.5, 0.5)), ((1.0,), (0.0, 0.5))),
    "ssprk3": SSPScheme("ssprk3", 3, ((1.0,), (0.75, 0.25), (1 / 3, 0.0, 2 / 3)),
                        ((1.0,), (0.0, 0.25), (0.0, 0.0, 2 / 3))),
    "ssprk104": _ketcheson_10_4(),
}

AUTO = "auto"


def auto_scheme(degree: int) -> str:
    """The scheme ``auto`` stands for with DG degree k: the one of order k + 1, the
    order of the space discretisation."""
    return next(name for name, s in SCHEMES.items() if s.order == degree + 1)


# [discretisation] scheme: a scheme of SCHEMES, or auto
SCHEME_KEY = Key(string((AUTO, *SCHEMES)), AUTO, "SSP Runge-Kutta scheme (auto: order degree+1)")

State = Sequence[np.ndarray]


def ssp_step(scheme: SSPScheme, u: State, dt: float, rhs: Callable[[State, int], State],
             limit: Callable[[State], State] | None = None) -> list[np.ndarray]:
    """One step of ``scheme`` from state ``u`` (a sequence of arrays).

    ``rhs(Y, j)`` returns L(Y_j) (same structure as Y; j is the stage index, for
    callers that cache per stage); ``limit(Y)`` post-processes each new stage."""
    Y = [list(u)]
    L = []
    for i in range(1, scheme.stages + 1):
        L.append(rhs(Y[i - 1], i - 1))
        new = []
        for part in range(len(u)):
            acc = None
            for j, (a, b) in enumerate(zip(scheme.alpha[i - 1], scheme.beta[i - 1])):
                if a:
                    acc = a * Y[j][part] if acc is None else acc + a * Y[j][part]
                if b:
                    acc = acc + (b * dt) * L[j][part]
            new.append(acc)
        Y.append(limit(new) if limit is not None else new)
    return Y[-1]


def ssp_step_vjp(scheme: SSPScheme, lam: np.ndarray, dt: float,
                 rate_vjp: Callable[[int, np.ndarray], np.ndarray],
                 limit_vjp: Callable[[int, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Cotangent of a step's start from that of its end ``lam``: the Shu-Osher form of
    :func:`ssp_step` (single-array state) reversed. ``rate_vjp(j, Lbar)`` returns the
    cotangent of stage j's input for the cotangent Lbar of its rate L(Y_j);
    ``limit_vjp(i, Ybar)`` (with a limiter) that of the unlimited stage i from that of
    the limited one, i = 1..s."""
    s = scheme.stages
    Ybar, Lbar = [None] * (s + 1), [None] * s
    Ybar[s] = lam

    def add(lst, j, x):
        lst[j] = x if lst[j] is None else lst[j] + x

    for i in range(s, 0, -1):
        if Ybar[i] is not None:
            if limit_vjp is not None:
                Ybar[i] = limit_vjp(i, Ybar[i])
            for j, (a, b) in enumerate(zip(scheme.alpha[i - 1], scheme.beta[i - 1])):
                if a:
                    add(Ybar, j, a * Ybar[i])
                if b:
                    add(Lbar, j, (dt * b) * Ybar[i])
        j = i - 1  # every stage after j has been visited: Lbar[j] is complete
        if Lbar[j] is not None:
            add(Ybar, j, rate_vjp(j, Lbar[j]))
    return Ybar[0]
