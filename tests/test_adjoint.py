"""Objectives, the kernel's reverse mode and the adjoint sweep: finite differences,
Taylor remainders and the closed-form gradient of uniform attention."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from pdeformer.attention.softmax import Sources, attention_matrices, attention_velocity, attention_velocity_vjp
from pdeformer.model.objectives import L2, MMD, Interaction, Moments, Potential
from pdeformer.model.prompts import GaussianMixture, UniformBox

from checks import (assert_exact_gradient, assert_taylor, central_derivative, directional_difference,
                    heads_direction, perturbed_risk)
from conftest import requires_dolfinx

TARGETS = {
    "moments": {"kind": "moments", "mean": np.array([0.3, -0.2]), "cov": np.array([[0.4, 0.1], [0.1, 0.3]])},
    "l2": {"kind": "gaussian_mixture", "density": GaussianMixture([1.0], [[0.2, 0.1]], [np.eye(2) * 0.4])},
    "mmd": {"kind": "uniform", "density": UniformBox([-1.0, -0.5], [0.8, 1.0])},
    "mmd_points": {"kind": "points", "points": np.random.default_rng(9).normal(size=(40, 2)),
                   "weights": np.full(40, 1 / 40)},
    "potential": None,
    "interaction": None,
    "interaction_coulomb": None,
}


def objective(kind):
    return {"moments": Moments(), "l2": L2(), "mmd": MMD(0.7), "mmd_points": MMD(0.5),
            "potential": Potential("quadratic", [0.5, 0.0], 2.0),
            "interaction": Interaction("gaussian", weight=1.5, width=0.8),
            "interaction_coulomb": Interaction("coulomb", weight=-1.0, softening=0.3)}[kind]


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_objective_derivative_by_finite_differences(kind):
    rng = np.random.default_rng(0)
    pts, meas, rho = rng.normal(size=(150, 2)), rng.uniform(0.01, 0.02, 150), rng.uniform(0.1, 1, 150)
    obj, t = objective(kind), TARGETS[kind]
    F, dF = obj.value_and_gradient(pts, meas, rho, t, MPI.COMM_SELF)
    direction = rng.normal(size=150)
    fd = directional_difference(lambda r: obj.value_and_gradient(pts, meas, r, t, MPI.COMM_SELF)[0],
                                rho, direction, 1e-5)
    # central differences: error ~ eps^2 |F'''| ~ 1e-10 here
    assert abs(fd - dF @ direction) < 1e-8 * max(1.0, abs(fd)), (fd, dF @ direction)


def test_moments_objective_is_zero_at_the_target():
    """Points and weights of an exact 2-point rule for a known mean/cov: F = 0, dF = 0."""
    pts = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    w = np.full(4, 0.25)
    t = {"mean": np.zeros(2), "cov": np.diag([0.5, 2.0])}
    F, dF = Moments().value_and_gradient(pts, w, np.ones(4), t, MPI.COMM_SELF)
    assert abs(F) < 1e-30 and np.abs(dF).max() < 1e-15


def test_interaction_energy_of_a_gaussian_density():
    """F = 1/2 iint W(x - y) rho rho for rho = N(m, S) and the Gaussian W of width s:
    X - Y ~ N(0, 2S), so F = weight / (2 sqrt(det(I + 2S/s^2))). The midpoint rule on a
    fine grid (spectrally accurate for Gaussians) reproduces it to 1e-10."""
    S = np.array([[0.3, 0.1], [0.1, 0.2]])
    g = GaussianMixture([1.0], [[0.2, -0.1]], [S])
    n, lo, hi = 90, -3.5, 3.5
    h = (hi - lo) / n
    c = lo + h * (np.arange(n) + 0.5)
    pts = np.stack(np.meshgrid(c, c, indexing="ij"), -1).reshape(-1, 2)
    obj = Interaction("gaussian", weight=1.5, width=0.8)
    F, dF = obj.value_and_gradient(pts, np.full(len(pts), h * h), g.density(pts), None, MPI.COMM_SELF)
    assert F == pytest.approx(0.75 / np.sqrt(np.linalg.det(np.eye(2) + 2 * S / 0.64)), rel=1e-10)
    # dF/drho_q / omega_q = (W * rho)(y_q): at the mean, weight / sqrt(det(I + S/s^2))
    mid = np.argmin(np.sum((pts - [0.2, -0.1]) ** 2, axis=1))
    exact = 1.5 * np.exp(-0.5 * (pts[mid] - [0.2, -0.1]) @ np.linalg.solve(S + 0.64 * np.eye(2), pts[mid] - [0.2, -0.1])) \
        / np.sqrt(np.linalg.det(np.eye(2) + S / 0.64))
    assert dF[mid] / (h * h) == pytest.approx(exact, rel=1e-10)


@pytest.mark.parametrize("kind", ["interaction", "interaction_coulomb"])
def test_interaction_particle_gradient_by_finite_differences(kind):
    """dF/dx_i of the token form F = 1/2 sum_ij w_i w_j W(x_i - x_j) against central
    differences, and F against the double sum written out."""
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(30, 2)), rng.uniform(0.5, 1.5, 30) / 30
    obj = objective(kind)
    F, dF = obj.particle_value_and_gradient(x, w, None, MPI.COMM_SELF)
    r2 = np.sum((x[:, None] - x[None]) ** 2, axis=-1)
    assert F == pytest.approx(0.5 * w @ obj.W(r2) @ w, rel=1e-13)
    d = rng.normal(size=x.shape)
    fd = directional_difference(lambda z: obj.particle_value_and_gradient(z, w, None, MPI.COMM_SELF)[0],
                                x, d, 1e-6)
    assert abs(fd - np.sum(dF * d)) < 1e-8 * abs(fd), (fd, np.sum(dF * d))


def test_velocity_reverse_mode_by_finite_differences():
    """d<g, v>/dw (zero weights too), /dA, /dV against central differences."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 2)), rng.normal(size=(11, 2))
    w = rng.uniform(0.2, 1, 11)
    w[3] = 0.0
    A = attention_matrices(rng.normal(size=(3, 2, 2)), rng.normal(size=(3, 2, 2)))
    V, g = rng.normal(size=(3, 2, 2)), rng.normal(size=(7, 2))

    def f(w, A, V):
        return np.sum(g * attention_velocity(x, Sources.from_arrays(y, w), A, V))

    ct = attention_velocity_vjp(x, y, w, A, V, g, chunk_mb=1e-4)  # several chunks
    for name, cot in (("w", ct.weights), ("A", ct.A), ("V", ct.V)):
        d = rng.normal(size=cot.shape)
        def args(t):
            moved = {"w": w, "A": A, "V": V}
            moved[name] = moved[name] + t * d
            return moved["w"], moved["A"], moved["V"]

        fd = central_derivative(lambda e: f(*args(e)), 1e-6)
        assert abs(fd - np.sum(cot * d)) < 1e-8 * max(1, abs(fd)), (name, fd, np.sum(cot * d))


# ----------------------------------------------------------------------- adjoint sweep

def gradient_problem(tmp_path, kind="moments", cells=8, heads=None, disc=None, means=None, covs=None,
                     attention=None):
    from configs import make_solver
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.model.heads import HeadMeasure
    heads = heads or HeadMeasure.random(2, 2, 2, 2, seed=3, scale=0.8)
    solver = make_solver(tmp_path, lower=[-3.0, -3.0], upper=[3.0, 3.0], cells=[cells, cells],
                         degree=1, heads=heads,
                         prompt={"kind": "gaussian_mixture", "means": means or [[0.5, 0.2], [-0.6, 0.1]],
                                 "covs": covs or [0.2, 0.3]},
                         disc={"limiter": False, **(disc or {"steps_per_layer": 12})},
                         attention=attention)
    return AdjointSolver(solver, objective(kind), [TARGETS[kind]])


@requires_dolfinx
@pytest.mark.parametrize("kind", ["moments", "potential", "l2", "mmd", "mmd_points", "interaction",
                                  "interaction_coulomb"])
def test_gradient_taylor_remainder_falls_as_eps_squared(tmp_path, kind):
    """The adjoint gives the exact derivative of the discrete risk: the first-order
    Taylor remainder |R(theta + eps d) - R - eps <grad, d>| falls as eps^2, and central
    differences agree to 1e-5 relative."""
    adj = gradient_problem(tmp_path, kind)
    assert_exact_gradient(adj, adj.gradient(), fd_step=1e-4)


@requires_dolfinx
def test_gradient_through_the_laplace_table(tmp_path):
    """backend = laplace (tables, fine grid and the compiled loop where it builds): the
    gradient is the exact derivative of the risk computed that way (Taylor remainder of
    order 2, the table plan frozen per evaluation) and within 1e-6 of the gradient of
    direct summation (tol 1e-9 on the velocity)."""
    adj = gradient_problem(tmp_path, "moments", attention={"backend": "laplace", "tol": 1e-9})
    g = adj.gradient()
    assert adj.forward.velocity_field.stats["laplace"] > 0
    assert adj.forward.velocity_field.stats["direct"] == 0
    direction, slope = heads_direction(g, np.random.default_rng(1))
    R0 = adj.risk()[0]
    assert_taylor(lambda e: perturbed_risk(adj, direction, e), slope, tol=0.15, f0=R0)
    exact = gradient_problem(tmp_path, "moments").gradient()
    for n in "QKV":
        a, b = g.params["attention"][n], exact.params["attention"][n]
        assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max(), n


@requires_dolfinx
@pytest.mark.parametrize("tape_mb", [0.0, 5.0])
def test_tables_kept_on_the_tape_give_the_rebuilt_gradient(tmp_path, tape_mb, monkeypatch):
    """The tape keeps laplace tables up to [attention] tape_mb and their plans beyond:
    with the default budget the adjoint builds no table, with 0 it rebuilds each one,
    with 5 MB some of each; the gradient is the same to the last bit (one rank: the
    rebuilt tables are the same arithmetic)."""
    from pdeformer.attention import laplace
    from pdeformer.model.velocity import TableSum
    att = {"backend": "laplace", "tol": 1e-9}
    built = []
    monkeypatch.setattr(laplace.LaplaceTable, "_build", lambda self, f=laplace.LaplaceTable._build:
                        (built.append(1), f(self))[1])

    def gradient_and_builds(adj):
        adj.gradient()                   # plans frozen: later passes replay them
        del built[:]
        tape = []
        adj.forward.solve_prompt(0, tape=tape)
        entries, forward_builds = [p for _, _, st, _ in tape for _, _, p, _ in st], len(built)
        del built[:]
        g = adj.gradient(refreeze=False)
        return g, entries, len(built) - forward_builds     # the adjoint sweep's builds

    g, entries, rebuilt = gradient_and_builds(gradient_problem(tmp_path, "moments", attention=att))
    assert entries and all(isinstance(p, TableSum) for p in entries) and rebuilt == 0
    other, entries, rebuilt = gradient_and_builds(
        gradient_problem(tmp_path, "moments", attention={**att, "tape_mb": tape_mb}))
    kept = sum(isinstance(p, TableSum) for p in entries)
    assert rebuilt == len(entries) - kept
    assert (kept == 0) if tape_mb == 0 else (0 < kept < len(entries)), kept
    for n in "QKV":
        assert np.array_equal(g.params["attention"][n], other.params["attention"][n]), n


@requires_dolfinx
def test_frozen_step_plan_without_steps_per_layer(tmp_path):
    """CFL-chosen step counts are frozen per evaluation, so the risk is smooth and the
    gradient exact for that plan."""
    adj = gradient_problem(tmp_path, "moments", disc={"cfl": 0.5})
    g = adj.gradient()
    counts = {k: [list(s) for s in plan.segments] for k, plan in adj.forward.step_counts.items()}
    assert counts and all(plan.steps >= 1 for plan in adj.forward.step_counts.values())
    direction, slope = heads_direction(g, np.random.default_rng(2))
    fd = central_derivative(lambda e: perturbed_risk(adj, direction, e), 1e-4)
    assert {k: plan.segments for k, plan in adj.forward.step_counts.items()} == counts
    assert abs(fd - slope) < 1e-5 * abs(slope), (fd, slope)


@requires_dolfinx
def test_uniform_attention_closed_form_gradient(tmp_path):
    """Q = 0 with the moments objective: dR/dQ, dR/dV in closed form
    (pdeformer.model.exact). The discrete gradient converges to it at second order."""
    from pdeformer.model.exact import uniform_attention_moments_gradient
    from pdeformer.model.heads import HeadMeasure
    heads = HeadMeasure.random(2, 3, 2, 2, seed=5, scale=0.6)
    heads.Q[:] = 0.0
    m0, C0 = np.array([0.4, -0.2]), np.array([[0.3, 0.05], [0.05, 0.2]])
    t = TARGETS["moments"]
    exact = uniform_attention_moments_gradient(heads, m0, C0, t["mean"], t["cov"])
    errors = []
    for n, spl in ((16, 8), (32, 16)):
        adj = gradient_problem(tmp_path, "moments", cells=n, heads=heads, means=[list(m0)],
                               covs=[C0.tolist()], disc={"steps_per_layer": spl})
        g = adj.gradient()
        assert np.all(g.params["attention"]["K"] == 0)                               # dK = Q dA^T = 0 at Q = 0
        errors.append([np.abs(a - b).max() / np.abs(b).max()
                       for a, b in ((g.params["attention"]["Q"], exact[0]), (g.params["attention"]["V"], exact[2]))])
    errors = np.array(errors)
    assert np.all(errors[1] < 0.02), errors                   # 1.1% (dQ), 4e-5 (dV) at 32^2
    assert np.all(errors[0] / errors[1] > 3.0), errors         # order > 1.6 (2.0 and 1.8 seen)


# ----------------------------------------------------------------------- the limiter

@requires_dolfinx
@pytest.mark.parametrize("degree", [1, 2])
def test_limiter_jacobian_against_finite_differences(tmp_path, degree):
    """DGTransport.limit_vjp is the transpose of the limiter's Jacobian: for a DG
    projection with undershoots (made generic: no ties of a cell's minimum) and one cell
    of negative mean (flattened to its mean), <bar, dLimit(c) d> by central differences
    equals <limit_vjp(bar), d>."""
    from configs import make_solver
    from pdeformer.model.heads import HeadMeasure
    s = make_solver(tmp_path, lower=[-2.0, -2.0], upper=[2.0, 2.0], cells=[10, 10], degree=degree,
                    heads=HeadMeasure.random(1, 2, 2, 2, seed=3),
                    prompt={"kind": "uniform", "lower": [-0.73, -0.61], "upper": [0.52, 0.68]},
                    disc={"limiter": False})
    tr = s.transport
    rng = np.random.default_rng(0)
    c, _ = s.initial_state(0)
    c = c + 1e-3 * rng.normal(size=c.shape)
    c[tr.cell_dofs[37]] = -0.05 + 0.02 * rng.normal(size=tr.cell_dofs.shape[1])
    record = []
    out = tr.limit(c, record)
    limited = record[0]
    assert len(limited.cells) > 20 and np.sum(limited.mean <= 0) >= 1
    flat = tr.cell_dofs[37]
    np.testing.assert_allclose(out[flat], np.full(len(flat), out[flat].mean()), rtol=1e-12)
    bar = rng.normal(size=c.shape)
    for _ in range(3):
        d = rng.normal(size=c.shape)
        fd = directional_difference(lambda z: bar @ tr.limit(z), c, d, 1e-7)
        assert abs(fd - tr.limit_vjp(limited, bar) @ d) < 1e-6 * abs(fd)


@requires_dolfinx
@pytest.mark.parametrize("kind", ["moments", "l2"])
def test_gradient_with_the_limiter_active(tmp_path, kind):
    """limiter = true in a gradient run: the limiter acts in most cells at every stage
    (the Gaussians' tails undershoot on 8x8 cells), and the adjoint through its Jacobian
    is the exact derivative of the discrete risk: Taylor remainders fall as eps^2, and
    central differences with a step small enough not to cross a switching point (1e-5)
    agree to 1e-5 relative."""
    adj = gradient_problem(tmp_path, kind, disc={"limiter": True, "steps_per_layer": 12})
    tape = []
    adj.forward.solve_prompt(0, tape=tape)
    counts = [0 if r is None else len(r.cells) for *_, limits in tape for r in limits]
    assert len(counts) == 2 * 12 * adj.forward.scheme.stages and min(counts) >= 10
    assert_exact_gradient(adj, adj.gradient(), fd_step=1e-5)


@requires_dolfinx
def test_frozen_plans_keep_the_stability_limit_and_replays_say_why_they_do_not(tmp_path, caplog):
    """With cfl = 0.95 (close to the limit) a frozen plan is made again before its step
    passes the stability limit, so the gradient warns of nothing; a risk evaluated for
    faster heads (V doubled) replays the gradient's plan, and its warning says so and
    what to do."""
    from pdeformer.model.heads import HeadMeasure
    adj = gradient_problem(tmp_path, "moments", heads=HeadMeasure.random(2, 2, 2, 2, seed=3, scale=1.5),
                           disc={"cfl": 0.95, "limiter": True})
    with caplog.at_level("WARNING", logger="pdeformer"):
        adj.gradient()
        assert not [r for r in caplog.records if "stability limit" in r.getMessage()]
        assert max(len(p.segments) for p in adj.forward.step_counts.values()) >= 2
        adj.forward.problem.heads.V[:] *= 2
        adj.risk()
    warned = [r.getMessage() for r in caplog.records if "stability limit" in r.getMessage()]
    assert warned and all("replays the step plan that the last gradient evaluation froze" in w
                          and w.endswith("evaluate the gradient again to plan for them") for w in warned)


@requires_dolfinx
def test_gradient_at_a_switching_point_of_the_limiter(tmp_path):
    """Along a direction of head space, bisection finds where the set of limited cells
    changes (one cell at one stage starts or stops being limited) to within 1e-12. The
    risk is continuous there (theta = 1 on both sides), and its derivative jumps: the
    adjoint slopes on the two sides differ by far more than the slope changes over an
    equal step on one side, and by little (5e-8 relative measured; docs/training.md)."""
    adj = gradient_problem(tmp_path, "moments", disc={"limiter": True, "steps_per_layer": 12})
    heads = adj.forward.problem.heads
    base = {n: getattr(heads, n).copy() for n in "QKV"}
    rng = np.random.default_rng(1)
    direction = {n: rng.normal(size=base[n].shape) for n in "QKV"}

    def move(eps):
        for n in "QKV":
            getattr(heads, n)[:] = base[n] + eps * direction[n]

    def limited_cells(eps):
        move(eps)
        tape = []
        adj.forward.solve_prompt(0, tape=tape)
        return [() if r is None else tuple(r.cells) for *_, limits in tape for r in limits]

    def slope(eps):
        move(eps)
        g = adj.gradient()
        return sum(np.sum(g.params["attention"][n] * direction[n]) for n in "QKV"), g.risk

    try:
        lo, hi = 0.0, 1e-3
        first = limited_cells(lo)
        assert limited_cells(hi) != first
        while hi - lo > 1e-12:
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if limited_cells(mid) == first else (lo, mid)
        changed = [set(a) ^ set(b) for a, b in zip(first, limited_cells(hi)) if a != b]
        assert len(changed) == 1 and len(changed[0]) == 1, changed
        (g_left, r_left), (g_right, r_right) = slope(lo), slope(hi)
        g_before = slope(lo - (hi - lo))[0]
    finally:
        move(0.0)
    assert abs(r_right - r_left) < 1e-13, (r_left, r_right)
    jump = abs(g_right - g_left)
    assert jump > 100 * abs(g_left - g_before), (g_before, g_left, g_right)
    assert jump < 1e-6 * abs(g_left), (g_left, g_right)


@requires_dolfinx
def test_frozen_plans_are_made_again_when_the_velocity_grows(tmp_path, caplog):
    """Stronger heads (scale 1.5): the velocity grows inside the first frame, so its
    frozen plan gets a second segment instead of going on past the stability limit (no
    warning); the plan is replayed exactly for perturbed heads, and the gradient is exact
    for it: central differences agree to 1e-5 relative with a step of 1e-6 (the limiter
    acts in many cells here and switches within 1e-5 in some directions: kinks, see
    docs/training.md)."""
    from pdeformer.model.heads import HeadMeasure
    adj = gradient_problem(tmp_path, "moments", heads=HeadMeasure.random(2, 2, 2, 2, seed=3, scale=1.5),
                           disc={"cfl": 0.5, "limiter": True})
    with caplog.at_level("WARNING", logger="pdeformer"):
        g = adj.gradient()
    assert not [r for r in caplog.records if "stability limit" in r.getMessage()]
    plans = {k: [list(s) for s in p.segments] for k, p in adj.forward.step_counts.items()}
    replanned = [s for s in plans.values() if len(s) > 1]
    assert replanned and all(s[-1][0] == s[-1][1] and s[0][1] < s[0][0] for s in replanned), plans
    assert adj.risk()[0] == pytest.approx(g.risk, rel=1e-13)
    for seed in (3, 4):
        direction, slope = heads_direction(g, np.random.default_rng(seed))
        fd = central_derivative(lambda e: perturbed_risk(adj, direction, e), 1e-6)
        assert abs(fd - slope) < 1e-5 * abs(slope), (fd, slope)
    assert {k: p.segments for k, p in adj.forward.step_counts.items()} == plans
