"""SSP Runge-Kutta schemes: SSP form and observed order on ODEs with known solutions."""

import numpy as np
import pytest

from pdeformer.integrator.schemes import SCHEMES, ssp_step


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


# ------------------------------------------------------------------ the march through depth

def test_march_lands_on_every_frame_end_and_counts_the_steps():
    """3 layers of 2 frames, 4 fixed steps per frame: 24 steps, frames emitted at t = 0 and
    exactly at (layer + f/F)/L, layer boundaries flagged; the steps cover [0, 1] in order."""
    from pdeformer.integrator.march import FixedSteps, march
    frames, steps = [], []
    n = march(3, 2, FixedSteps(4, 1 / 24), lambda t, dt, layer: steps.append((t, dt, layer)),
              lambda t, layer, boundary: frames.append((t, layer, boundary)))
    assert n == 24 == len(steps)
    assert frames == [(0.0, -1, True)] + [((l + f / 2) / 3, l, f == 2) for l in range(3) for f in (1, 2)]
    assert [layer for _, _, layer in steps] == [l for l in range(3) for _ in range(8)]
    np.testing.assert_allclose([t for t, _, _ in steps], np.arange(24) / 24, atol=1e-15)


def test_march_with_steps_chosen_as_it_goes():
    """A controller whose steps shrink (as CFL steps do when the velocity grows) and whose
    last step of a frame is cut short: every step starts where the last ended, no step
    passes its frame's end, each frame's steps add up to its length and the frames end
    exactly on (layer + 1) / L."""
    from pdeformer.integrator.march import march

    class Shrinking:
        def start_layer(self, layer):
            pass

        def start_frame(self, layer, frame):
            self.dt = 0.3

        def next_step(self, t, t_end):
            self.dt *= 0.7
            last = self.dt >= t_end - t
            return (t_end - t if last else self.dt), last

        def took(self, dt):
            pass

    ends, steps = [], []
    march(2, 1, Shrinking(), lambda t, dt, layer: steps.append((t, dt, layer)),
          lambda t, layer, boundary: ends.append(t))
    assert ends == [0.0, 0.5, 1.0]
    for layer in (0, 1):
        mine = [(t, dt) for t, dt, l in steps if l == layer]
        assert mine[0][0] == layer / 2 and all(t + dt <= (layer + 1) / 2 + 1e-15 for t, dt in mine)
        assert all(abs(a[0] + a[1] - b[0]) < 1e-15 for a, b in zip(mine, mine[1:]))
        assert sum(dt for _, dt in mine) == pytest.approx(0.5, abs=1e-15)
        assert mine[-1][1] < mine[-2][1] * 0.7     # the last one cut short


def test_sweep_back_visits_the_tape_last_first():
    from pdeformer.integrator.march import sweep_back
    seen = []
    out = sweep_back([("a", 1), ("b", 2), ("c", 3)], 0, lambda lam, name, k: seen.append(name) or lam * 10 + k)
    assert seen == ["c", "b", "a"] and out == 321
