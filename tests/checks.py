"""Numerical checks shared by the tests: central differences, Taylor remainders and
reverse modes (vector-Jacobian products), and the checks of the heads' gradient built
on them.

Central differences of a smooth function with step h err by h^2 |f'''| / 6
(truncation) plus about eps |f| / h (rounding), so each caller picks its own step and
tolerance and says why next to the call. The helpers evaluate f in a fixed order
(+h before -h, eps in the order given), so a test that draws no random numbers in f
asserts the same numbers as the expression written out.
"""

from __future__ import annotations

import numpy as np
import pytest

TAYLOR_EPS = (4e-3, 2e-3, 1e-3)


def central_derivative(f, h: float):
    """d/de f(e) at e = 0 by the central difference (f(h) - f(-h)) / (2 h); f may
    return a scalar or an array (then the derivative of each entry)."""
    return (f(h) - f(-h)) / (2 * h)


def directional_difference(f, x, d, h: float):
    """The derivative of f at x along d, (f(x + h d) - f(x - h d)) / (2 h)."""
    return central_derivative(lambda e: f(x + e * d), h)


def central_difference(f, x: np.ndarray, h: float) -> np.ndarray:
    """The gradient of f at x (any shape) by central differences, one entry of x at a
    time. A scalar f gives an array of x's shape; an array-valued f an array of shape
    x.shape + f(x).shape (its Jacobian, the differentiated entry first)."""
    cols = []
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        cols.append((f(x + e) - f(x - e)) / (2 * h))
    return np.array(cols, dtype=x.dtype).reshape(x.shape + np.shape(cols[0]))


def taylor_orders(f, slope, eps=TAYLOR_EPS, f0=None):
    """Observed orders log2(r_k / r_k+1) of the first-order Taylor remainders
    r = |f(e) - f(0) - e slope| at the steps eps (halving), and the remainders. f(0)
    is evaluated first unless given as f0."""
    F0 = f(0.0) if f0 is None else f0
    rem = np.array([abs(f(e) - F0 - e * slope) for e in eps])
    return np.log2(rem[:-1] / rem[1:]), rem


def assert_taylor(f, slope, order: float = 2, tol: float = 0.2, eps=TAYLOR_EPS, f0=None):
    """The Taylor remainders of f about 0 with slope fall with the given order (each
    observed order within tol): slope is the exact derivative of f at 0. Returns the
    orders and the remainders."""
    orders, rem = taylor_orders(f, slope, eps, f0)
    assert np.all(np.abs(orders - order) < tol), (orders, rem)
    return orders, rem


def assert_vjp(f, vjp, x, g, h: float, rtol: float):
    """The reverse mode vjp = J^T g of f at x (f array valued, g its cotangent) against
    the central-difference gradient of <g, f> (step h): the largest error within rtol of
    the largest entry of vjp. Equivalently <g, J d> = <J^T g, d> along every coordinate
    direction d."""
    fd = central_difference(lambda z: np.sum(g * f(z)), x, h)
    assert np.abs(fd - vjp).max() <= rtol * np.abs(vjp).max(), np.abs(fd - vjp).max()


# ------------------------------------------------------------------- the heads' gradient

def perturbed_risk(adj, direction, eps):
    """The risk of an adjoint solver with the heads' Q, K, V moved by eps direction[n]
    (restored afterwards)."""
    heads = adj.forward.problem.heads
    base = {n: getattr(heads, n).copy() for n in "QKV"}
    try:
        for n in "QKV":
            getattr(heads, n)[:] = base[n] + eps * direction[n]
        return adj.risk()[0]
    finally:
        for n in "QKV":
            getattr(heads, n)[:] = base[n]


def heads_direction(g, rng):
    """A random direction over the heads' Q, K, V and the gradient g's slope along it."""
    direction = {n: rng.normal(size=g.params["attention"][n].shape) for n in "QKV"}
    return direction, sum(np.sum(g.params["attention"][n] * direction[n]) for n in "QKV")


def assert_exact_gradient(adj, g, fd_step: float) -> None:
    """Taylor remainders at eps = 4e-3, 2e-3, 1e-3 fall as eps^2 (orders within 0.15 of
    2) and central differences with ``fd_step`` agree to 1e-5 relative, along a random
    direction; the risk of the frozen plan repeats the gradient's to 1e-13."""
    direction, slope = heads_direction(g, np.random.default_rng(1))
    R0 = adj.risk()[0]
    assert R0 == pytest.approx(g.risk, rel=1e-13)
    assert_taylor(lambda e: perturbed_risk(adj, direction, e), slope, tol=0.15, f0=R0)
    fd = central_derivative(lambda e: perturbed_risk(adj, direction, e), fd_step)
    assert abs(fd - slope) < 1e-5 * abs(slope), (fd, slope)


def assert_taylor_order_two(adj, g, heads, rng):
    """|R(theta + eps d) - R - eps <g, d>| falls as eps^2 (g is exact for the risk);
    the heads are left at the last step."""
    d = {n: rng.normal(size=getattr(heads, n).shape) for n in "QKV"}
    slope = sum(np.sum(g.params["attention"][n] * d[n]) for n in "QKV")
    base = {n: getattr(heads, n).copy() for n in "QKV"}

    def R(eps):
        for n in "QKV":
            getattr(heads, n)[:] = base[n] + eps * d[n]
        return adj.risk()[0]

    assert_taylor(R, slope, tol=0.1)
