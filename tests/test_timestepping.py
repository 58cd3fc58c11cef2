"""SSP Runge-Kutta schemes: SSP form and observed order on ODEs with known solutions."""

import numpy as np
import pytest

from pdeformer.timestepping import SCHEMES, ssp_step


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_shu_osher_form_is_ssp(name):
    s = SCHEMES[name]
    for a, b in zip(s.alpha, s.beta):
        assert np.isclose(sum(a), 1.0)                 # consistent
        assert min(a) >= 0 and min(b) >= 0            # convex combination of Euler steps
        assert all(aj > 0 for aj, bj in zip(a, b) if bj > 0)
    assert np.isclose(s.stage_times()[-1], 1.0)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_observed_order(name):
    """y' = y^2/2, y(0) = 1: y(1) = 2 (nonlinear, so order conditions beyond linear
    ones are exercised), and a linear 2x2 system with a rotation."""
    s = SCHEMES[name]
    R = np.array([[0.0, -2.0], [2.0, -0.5]])
    w, U = np.linalg.eig(R)
    exact_lin = (U @ np.diag(np.exp(w)) @ np.linalg.solve(U, [1.0, 0.0])).real
    errors = []
    for n in (10, 20, 40):
        u = [np.array([1.0]), np.array([1.0, 0.0])]
        for _ in range(n):
            u = ssp_step(s, u, 1.0 / n, lambda Y, j: [0.5 * Y[0] ** 2, R @ Y[1]])
        errors.append(abs(u[0][0] - 2.0) + np.abs(u[1] - exact_lin).max())
    rates = np.log2(np.array(errors[:-1]) / errors[1:])
    assert abs(rates[-1] - s.order) < 0.15, rates


def test_limiter_applied_to_every_stage():
    calls = []
    ssp_step(SCHEMES["ssprk3"], [np.zeros(1)], 0.1, lambda Y, j: [np.ones(1)],
             lambda Y: calls.append(1) or Y)
    assert len(calls) == 3
