"""pdeformer gram: the Jacobian of the model's outputs (the moments of rho_1) by the
adjoint, against central differences of the outputs and against the gradient of the
risk; the linearised gd prediction against an exact linear model and against a real
training step; a singular Gram where the heads' gauge leaves more outputs than
directions; bad input as one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checks import central_derivative
from conftest import check_one_line_error, requires_dolfinx, run_cli, write_config
from pdeformer.commands.gram import gram_analysis

CONFIG = """
[mesh]
lower = [-4.0, -4.0]
upper = [4.0, 4.0]
cells = [16, 16]

[discretisation]
steps_per_layer = 8
limiter = false       # smooth outputs: central differences do not straddle the limiter's kinks

[model]
layers = 2
heads = 2
seed = 1
init_scale = 0.7

[attention]
backend = "direct"    # exact sums: the outputs have no table switches for differences to straddle

[data]
count = 3
seed = 3
teacher_seed = 9

[objective]
kind = "moments"

[train]
lr = 0.05
steps = 1

[output]
fields = false
"""


def test_the_prediction_is_exact_for_a_linear_model():
    """Y = J theta: gd with theta <- theta - lr L H J^T r / S gives residuals
    (I - a G)^k r_0, a = lr L H / S; the predicted risk curve equals the simulated one,
    the slowest rate is -2 log(1 - a lambda_min) (and that of lambda_max where a larger
    step overshoots it), and a G with a null space keeps the residual's part there (the
    plateau)."""
    rng = np.random.default_rng(0)
    S, m, P, L, H, lr = 3, 5, 40, 2, 3, 0.2
    J = rng.normal(size=(S * m, P)) / (L * H)
    ystar = rng.normal(size=S * m)
    theta0 = rng.normal(size=P)
    risks = []
    theta = theta0.copy()
    for _ in range(30):
        r = J @ theta - ystar
        risks.append(0.5 / S * r @ r)
        theta -= lr * L * H * J.T @ r / S
    out = gram_analysis(J @ theta0, ystar, J, S, L, H, lr, 29, 1e-6)
    np.testing.assert_allclose(out["predicted_risk"], risks, rtol=1e-10)
    lam = np.linalg.eigvalsh(J @ J.T)
    assert out["slowest_rate"] == pytest.approx(-2 * np.log(1 - lr * L * H / S * lam[0]), rel=1e-10)
    assert out["injective"] and out["plateau"] < 1e-25
    lr_big = 1.9 / (L * H / S * lam[-1])          # a lambda_max = 1.9: stable, overshooting
    out = gram_analysis(J @ theta0, ystar, J, S, L, H, lr_big, 5, 1e-6)
    rates = -2 * np.log(np.abs(1 - lr_big * L * H / S * lam))
    assert out["stable"] and out["slowest_rate"] == pytest.approx(rates.min(), rel=1e-12)
    assert rates.argmin() == len(lam) - 1          # the largest eigenvalue is the slowest here
    # a Jacobian of rank 10 < 15 outputs: five lost directions and the risk they keep
    low = J[:, :10] @ np.linalg.qr(rng.normal(size=(10, 10)))[0] @ np.eye(10, P)
    out = gram_analysis(low @ theta0, ystar, low, S, L, H, lr, 2000, 1e-6)
    assert not out["injective"] and out["lost_directions"] == 5
    U = np.linalg.svd(low)[0][:, 10:]
    kept_out = 0.5 / S * np.sum((U.T @ (low @ theta0 - ystar)) ** 2)
    assert out["plateau"] == pytest.approx(kept_out, rel=1e-8)
    assert out["predicted_risk"][-1] == pytest.approx(kept_out, rel=1e-6)


@requires_dolfinx
def test_the_jacobian_is_that_of_the_outputs_and_gives_the_gradient(tmp_path):
    """J d against central differences of the outputs y (moments of rho_1) along a random
    direction d (the step plan is fixed, so y is smooth: agreement to 1e-8 relative);
    (1/S) J^T (y - y*) is the gradient of `pdeformer gradient`, 1/(2S) |y - y*|^2 its risk."""
    from mpi4py import MPI
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from pdeformer.model.config import load_config
    path = write_config(tmp_path, CONFIG)
    p = build_problem(load_config(path), MPI.COMM_WORLD, differentiable=True)
    adj = AdjointSolver(ForwardSolver(p), p.objective, p.targets)
    y, ystar, J = adj.output_jacobian()
    assert y.shape == ystar.shape == (15,) and J.shape == (15, 48)
    heads = p.heads
    theta0 = [heads.Q.copy(), heads.K.copy(), heads.V.copy()]
    d = np.random.default_rng(2).normal(size=48)
    parts = np.split(d, [16, 32])

    def outputs(e):
        for a, a0, da in zip((heads.Q, heads.K, heads.V), theta0, parts):
            a[:] = a0 + e * da.reshape(a0.shape)
        return adj.output_jacobian()[0]

    fd = central_derivative(outputs, 1e-5)
    for a, a0 in zip((heads.Q, heads.K, heads.V), theta0):
        a[:] = a0
    assert np.abs(fd - J @ d).max() <= 1e-8 * np.abs(J @ d).max(), np.abs(fd - J @ d).max()
    run_cli(["gradient", path, "--set", "output.dir=grad"], cwd=str(tmp_path))
    g = np.load(tmp_path / "grad" / "gradient.npz")
    grad = np.concatenate([g[n].ravel() for n in ("dQ", "dK", "dV")])
    np.testing.assert_allclose(J.T @ (y - ystar) / 3, grad, rtol=0, atol=1e-12 * np.abs(grad).max())
    assert 0.5 / 3 * np.sum((y - ystar) ** 2) == pytest.approx(float(g["risk"]), rel=1e-12)


@requires_dolfinx
def test_a_gd_step_changes_the_risk_as_the_gram_predicts(tmp_path):
    """`pdeformer gram` then one gd step of `pdeformer train` at lr 0.05: the risk's change
    is the predicted one, (1/(2S)) (|(I - a G) r|^2 - |r|^2), a = lr L H / S, to the
    linearisation's O(lr) (measured 0.3%; a wrong constant a would be off by
    factors). The heads' gauge (Q -> M Q, K -> M^-T K keep A = K^T Q) leaves 48 - 16
    directions for 15 outputs: the Gram is injective here."""
    path = write_config(tmp_path, CONFIG)
    run_cli(["gram", path, "--set", "output.dir=gram"], cwd=str(tmp_path))
    run_cli(["train", path, "--set", "output.dir=train"], cwd=str(tmp_path))
    gram = json.loads((tmp_path / "gram" / "gram.json").read_text())
    history = json.loads((tmp_path / "train" / "summary.json").read_text())["history"]
    assert gram["risk"] == pytest.approx(history[0]["risk"], rel=1e-12)
    assert gram["step_factor"] == pytest.approx(0.05 * 4 / 3, rel=1e-15) and gram["stable"]
    assert gram["injective"] and gram["lost_directions"] == 0
    predicted = gram["predicted_risk"][1] - gram["predicted_risk"][0]
    actual = history[1]["risk"] - history[0]["risk"]
    assert predicted < 0 and abs(actual - predicted) <= 0.02 * abs(predicted), (actual, predicted)
    assert (tmp_path / "gram" / "gram.png").exists()
    arrays = np.load(tmp_path / "gram" / "gram.npz")
    np.testing.assert_allclose(np.linalg.eigvalsh(arrays["G"])[::-1], gram["eigenvalues"], rtol=1e-10,
                               atol=1e-12 * gram["eigenvalues"][0])


@requires_dolfinx
def test_more_outputs_than_directions_lose_some(tmp_path):
    """Eight prompts (40 outputs) for one layer of two heads (24 parameters, 8 of them
    gauge: Q -> M Q, K -> M^-T K for M in GL(2), per head): 16 directions, so 24 are lost
    (measured: lambda_1 = 2.6, lambda_16 = 4e-7, lambda_17 = 2e-16) and the risk they hold
    is the plateau."""
    path = write_config(tmp_path, CONFIG.replace("count = 3", "count = 8").replace("layers = 2", "layers = 1"))
    run_cli(["gram", path, "--set", "output.dir=gram"], cwd=str(tmp_path))
    gram = json.loads((tmp_path / "gram" / "gram.json").read_text())
    assert gram["outputs"] == 40 and gram["params"] == 24
    assert not gram["injective"] and gram["lost_directions"] == 24
    assert 0 < gram["plateau"] < gram["risk"]


@requires_dolfinx
@pytest.mark.mpi
def test_the_jacobian_on_two_ranks_and_prompt_groups(tmp_path):
    """J, y and y* the same on 1 rank, 2 ranks and 2 ranks in 2 prompt groups (1e-10)."""
    path = write_config(tmp_path, CONFIG)
    for name, n, extra in (("one", 1, []), ("two", 2, []), ("groups", 2, ["--prompt-groups", "2"])):
        run_cli(["gram", path, "--set", f"output.dir={name}", "output.plots=false", *extra], nprocs=n,
                cwd=str(tmp_path))
    ref = np.load(tmp_path / "one" / "gram.npz")
    for name in ("two", "groups"):
        out = np.load(tmp_path / name / "gram.npz")
        for k in ("J", "y", "ystar"):
            np.testing.assert_allclose(out[k], ref[k], rtol=0, atol=1e-10 * np.abs(ref[k]).max())


@requires_dolfinx
def test_gram_needs_moments(tmp_path):
    path = write_config(tmp_path, CONFIG.replace('kind = "moments"', 'kind = "potential"\npotential = "quadratic"')
                        .replace("teacher_seed = 9", ""))
    proc = run_cli(["gram", path, "--set", "output.dir=gram"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "objective.kind: gram needs an objective whose value is 1/2 |y - y*|^2")
