"""NTK injectivity (pdeformer.commands.ntk): closed forms against quadrature, the known families,
the Jacobians against finite differences, mesh densities, and `pdeformer ntk`."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from checks import central_difference
from conftest import ROOT, requires_dolfinx, run_cli, write_config
from pdeformer.model.heads import HeadMeasure
from pdeformer.model.params import layer_slice
from pdeformer.commands.ntk import head_jacobians, lse_test, log_laplace, ntk_gram, sample_points
from pdeformer.model.prompt_files import PointCloud
from pdeformer.model.prompts import GaussianMixture, UniformBox

TOL = 1e-6   # the default ntk.tol: LSE ratio > TOL, Gram ratio > TOL^2


def gauss(mean, var):
    mean = np.atleast_1d(np.asarray(mean, float))
    cov = var * np.eye(len(mean)) if np.ndim(var) == 0 else np.asarray(var, float)
    return GaussianMixture([1.0], [mean], [cov])


def mixture(weights, means, variances):
    return GaussianMixture(weights, [[m] for m in means], [[[v]] for v in variances])


# (name, measures, independent?) -- design §3 and the list
FAMILIES = [
    ("three 1-D Gaussians, equal variance", [gauss(-1, .5), gauss(0, .5), gauss(1.5, .5)], False),
    ("two 1-D Gaussians, different variance", [gauss(0, .3), gauss(1, 1.2)], False),
    ("distinct discrete measures", [PointCloud([[-1], [0], [1]], [1, 2, 1]),
                                    PointCloud([[-.5], [.7]], [1, 1]),
                                    PointCloud([[0], [2]], [3, 1])], True),
    ("distinct uniform intervals", [UniformBox([-1], [1]), UniformBox([0], [3]),
                                    UniformBox([-2], [-1.2])], True),
    ("generic Gaussian mixtures", [mixture([1, 1], [-1, 1], [.2, .2]),
                                   mixture([1, 2], [0, 1.5], [.5, .1]),
                                   mixture([1, 1, 1], [-2, 0, 2], [.3, .3, .3])], True),
    ("identical prompts", [mixture([1, 2], [0, 1.5], [.5, .1]),
                           mixture([1, 2], [0, 1.5], [.5, .1])], False),
    ("2-D: three Gaussians, distinct covariances",
     [gauss([0, 0], [[1, 0], [0, .5]]), gauss([1, -.5], [[.4, .2], [.2, .6]]),
      gauss([-.3, .8], [[.7, -.3], [-.3, .9]])], True),
    ("2-D: four Gaussians (covariances span 3 dims)",
     [gauss([0, 0], [[1, 0], [0, .5]]), gauss([1, -.5], [[.4, .2], [.2, .6]]),
      gauss([-.3, .8], [[.7, -.3], [-.3, .9]]), gauss([.5, .5], .3)], False),
    ("2-D: uniform boxes", [UniformBox([-1, -1], [1, 1]), UniformBox([0, -.5], [2, 1]),
                            UniformBox([-2, 0], [-.5, .4])], True),
]


def family_spectra(measures, params="A", heads=256, scale=1.0):
    """Both tests with the ntk defaults: b in [-3, 3]^d (256 points), 256 sampled heads,
    one query (1,...,1)/sqrt(d)."""
    d = measures[0].dim
    b = sample_points(3.0, 256, d, 0)
    h = HeadMeasure.random(1, heads, d, d, seed=0, scale=scale)
    x = np.full((1, d), 1 / math.sqrt(d))
    return lse_test(measures, b), ntk_gram(measures, x, layer_slice(h.params, 0), params)


# ------------------------------------------------------------------ closed forms

def gauss_legendre_moments(density, lo, hi, b, n=400):
    """Lambda, grad, Hess of a 1-D density on [lo, hi] by composite Gauss-Legendre
    (20 panels of n/20 points): an independent computation of the closed forms."""
    t, w = np.polynomial.legendre.leggauss(n // 20)
    edges = np.linspace(lo, hi, 21)
    y = np.concatenate([(e1 - e0) / 2 * t + (e0 + e1) / 2 for e0, e1 in zip(edges, edges[1:])])
    wy = np.concatenate([(e1 - e0) / 2 * w for e0, e1 in zip(edges, edges[1:])]) * density(y)
    e = np.exp(np.outer(b, y))
    Z = e @ wy
    m = (e @ (wy * y)) / Z
    return np.log(Z), m, (e @ (wy * y * y)) / Z - m * m


B1 = np.array([-7.0, -2.5, -1e-2, -1e-3 - 1e-12, -1e-6, 0.0, 1e-9, 1e-3 + 1e-12, 0.3, 4.0, 9.0])


@pytest.mark.parametrize("measure, lo, hi", [
    (mixture([1, 2], [-0.5, 0.8], [0.3, 0.2]), -14.0, 14.0),
    (gauss(0.4, 2.0), -40.0, 40.0),
], ids=["mixture", "gaussian"])
def test_gaussian_mixture_closed_form_matches_quadrature(measure, lo, hi):
    lam, grad, hess = log_laplace(measure, B1[:, None])
    ql, qm, qc = gauss_legendre_moments(lambda y: measure.density(y[:, None]), lo, hi, B1)
    assert np.all(np.abs(lam - ql) < 1e-11 * (1 + np.abs(ql))), lam - ql
    np.testing.assert_allclose(grad[:, 0], qm, rtol=0, atol=1e-10)
    np.testing.assert_allclose(hess[:, 0, 0], qc, rtol=1e-9, atol=0)


@pytest.mark.parametrize("lo, hi", [(-1.0, 1.0), (0.3, 3.3), (-2.0, -1.2)])
def test_uniform_closed_form_matches_quadrature_across_the_series_switch(lo, hi):
    """Includes b = 0 exactly and b on both sides of where the series takes over."""
    box = UniformBox([lo], [hi])
    b = np.concatenate([B1, (1e-2 / (hi - lo)) * np.array([1 - 1e-9, 1 + 1e-9, -1 + 1e-9, -1 - 1e-9]),
                        (1e-3 / (hi - lo)) * np.array([1 - 1e-9, 1 + 1e-9])])
    lam, grad, hess = log_laplace(box, b[:, None])
    ql, qm, qc = gauss_legendre_moments(lambda y: np.full_like(y, 1 / (hi - lo)), lo, hi, b)
    assert np.all(np.abs(lam - ql) < 1e-13 * (1 + np.abs(ql))), lam - ql
    np.testing.assert_allclose(grad[:, 0], qm, rtol=0, atol=1e-12 * (hi - lo))
    np.testing.assert_allclose(hess[:, 0, 0], qc, rtol=1e-10, atol=0)


def test_uniform_box_is_the_product_of_intervals_and_stable_far_out():
    box = UniformBox([-1.0, 0.5], [2.0, 1.0])
    b = np.array([[0.7, -3.0], [1e-8, 2.0], [400.0, -900.0]])
    lam, grad, hess = log_laplace(box, b)
    for a in range(2):
        la, ga, ha = log_laplace(UniformBox([box.lower[a]], [box.upper[a]]), b[:, a:a + 1])
        if a == 0:
            want = la, ga[:, 0], ha[:, 0, 0]
        else:
            want = want[0] + la, np.stack([want[1], ga[:, 0]], 1), np.stack([want[2], ha[:, 0, 0]], 1)
    np.testing.assert_allclose(lam, want[0], rtol=1e-15)
    np.testing.assert_allclose(grad, want[1], rtol=1e-15)
    np.testing.assert_allclose(np.diagonal(hess, axis1=1, axis2=2), want[2], rtol=1e-15)
    assert hess[0, 0, 1] == hess[0, 1, 0] == 0.0
    # far out the tilted measure sits at an end: Lambda = b c - log(b L), variance 1/b^2
    np.testing.assert_allclose(lam[2], 400 * 2.0 - math.log(400 * 3.0) + (-900 * 0.5) - math.log(900 * 0.5),
                               rtol=1e-14)
    np.testing.assert_allclose(hess[2].diagonal(), [1 / 400**2, 1 / 900**2], rtol=1e-12)


def test_discrete_closed_form_is_a_stable_logsumexp():
    rng = np.random.default_rng(4)
    y, w = rng.standard_normal((7, 2)), rng.random(7) + 0.1
    cloud = PointCloud(y, w)
    b = np.vstack([rng.standard_normal((5, 2)), [[800.0, -300.0]]])
    lam, grad, hess = log_laplace(cloud, b)
    s = b @ y.T + np.log(cloud.weights)
    top = s.max(axis=1, keepdims=True)
    p = np.exp(s - top)
    Z = p.sum(axis=1)
    p /= Z[:, None]
    np.testing.assert_allclose(lam, top[:, 0] + np.log(Z), rtol=1e-14)
    m = p @ y
    np.testing.assert_allclose(grad, m, atol=1e-14)
    np.testing.assert_allclose(hess, np.einsum("nj,ja,jb->nab", p, y, y) - np.einsum("na,nb->nab", m, m),
                               atol=1e-13)
    assert np.all(np.isfinite(lam))


# ------------------------------------------------------------------ the families

@pytest.mark.parametrize("name, measures, independent", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_known_families_and_both_tests_agree(name, measures, independent):
    lse, gram = family_spectra(measures)
    assert (lse["ratio"] > TOL) == independent, lse["ratio"]
    assert (gram["ratio"] > TOL**2) == independent, gram["ratio"]
    # not near the threshold: dependence shows at round-off, independence far above it
    if independent:
        assert lse["ratio"] > 1e-4 and gram["ratio"] > 1e-7
    else:
        assert lse["ratio"] < 1e-12 and gram["ratio"] < 1e-24


def test_weakest_combination_names_the_dependence():
    """Three equal-variance Gaussians: Lambda_i = m_i b + s b^2 / 2, so sum c_i Lambda_i is
    affine iff sum c_i = 0 (the quadratic part cancels): c = (1, -1, 0) and so on."""
    lse, _ = family_spectra(FAMILIES[0][1])
    c = lse["weakest"]
    assert abs(c.sum()) < 1e-12 and abs(np.linalg.norm(c) - 1) < 1e-12


def test_training_v_too_separates_gaussian_variances():
    """With V trained the Jacobian also sees grad Lambda: dependence must then hold modulo
    constants only. Gaussians of different variance pass; three equal-variance Gaussians
    (grad Lambda_i = m_i + s b, two constraints on three coefficients) still fail."""
    two, three = FAMILIES[1][1], FAMILIES[0][1]
    for params in ("V", "all"):
        assert family_spectra(two, params)[1]["ratio"] > 1e-4
        assert family_spectra(three, params)[1]["ratio"] < 1e-24


def test_jacobians_match_finite_differences():
    """d Gamma/d theta of Gamma_theta[mu](x) = V grad Lambda_mu(K^T Q x), for Q, K, V (and
    A), against central differences (h = 1e-6: error ~ h^2 |Gamma'''| + eps/h)."""
    rng = np.random.default_rng(2)
    d, k = 2, 3
    mu = mixture([1, 2], [0, 1], [.3, .2]) if d == 1 else \
        GaussianMixture([1, 2], [[0, .4], [1, -.2]], [np.diag([.3, .2]), [[.4, .1], [.1, .3]]])
    Q, K, V = rng.standard_normal((1, k, d)), rng.standard_normal((1, k, d)), rng.standard_normal((1, d, d))
    x = rng.standard_normal((2, d))

    def gamma(Q, K, V, A=None):
        A = np.einsum("ki,kj->ij", K, Q) if A is None else A
        return np.concatenate([V @ log_laplace(mu, (A @ xp)[None])[1][0] for xp in x])

    h = 1e-6
    base = {"Q": Q[0], "K": K[0], "V": V[0]}
    fd = np.concatenate([central_difference(lambda a: gamma(**(base | {arr: a})), base[arr], h)
                         .reshape(base[arr].size, -1) for arr in ("V", "Q", "K")]).T   # (P*d, n_params)
    J = head_jacobians(mu, x, {"Q": Q, "K": K, "V": V}, "all")[0]
    np.testing.assert_allclose(J, fd, atol=1e-8)
    A = np.einsum("ki,kj->ij", K[0], Q[0])
    fdA = central_difference(lambda a: gamma(Q[0], K[0], V[0], a), A, h).reshape(d * d, -1)
    np.testing.assert_allclose(head_jacobians(mu, x, {"Q": Q, "K": K, "V": V}, "A")[0], fdA.T, atol=1e-8)


def test_matched_pairing_and_its_data_degeneracy():
    """Prompt i with query i. With equal queries it is the shared-query Gram. In 1-D,
    Lambda_{s mu}(b) = Lambda_mu(s b) makes (mu, x) and (s mu, x / s) give proportional
    A-Jacobians: a data set the NTK cannot separate, although the two prompts pass the
    LSE test (and the shared query x = 1 separates them)."""
    h = HeadMeasure.random(1, 64, 1, 1, seed=0)
    heads = layer_slice(h.params, 0)
    measures = FAMILIES[2][1]
    shared = ntk_gram(measures, np.array([[0.8]]), heads, "A")
    matched = ntk_gram(measures, np.full((3, 1), 0.8), heads, "A", matched=True)
    np.testing.assert_allclose(matched["eigenvalues"], shared["eigenvalues"], rtol=1e-12)
    pair = [UniformBox([-1], [1]), UniformBox([-2], [2])]
    assert lse_test(pair, sample_points(3.0, 256, 1, 0))["ratio"] > 1e-3
    assert ntk_gram(pair, np.array([[1.0]]), heads, "A")["ratio"] > 1e-4
    assert ntk_gram(pair, np.array([[1.0], [0.5]]), heads, "A", matched=True)["ratio"] < 1e-28


def test_gram_is_the_head_average_of_jacobian_products():
    measures = FAMILIES[2][1]
    h = HeadMeasure.random(1, 5, 1, 1, seed=3)
    x = np.array([[0.7], [-1.1]])
    J = np.concatenate([head_jacobians(m, x, layer_slice(h.params, 0), "all") for m in measures], axis=1)
    G = np.einsum("jap,jbp->ab", J, J) / J.shape[0]
    gram = ntk_gram(measures, x, layer_slice(h.params, 0), "all")
    np.testing.assert_allclose(gram["eigenvalues"], np.sort(np.linalg.eigvalsh(G))[::-1],
                               rtol=1e-10, atol=1e-14 * gram["eigenvalues"][0])
    assert gram["size"] == len(measures) * 2


# ------------------------------------------------------------------ from a run

GM = {"kind": "gaussian_mixture", "means": [[-0.5], [0.8]], "covs": [0.3, 0.2], "weights": [1, 2]}
CLOUD = {"kind": "points", "points": [[-1.0], [0.2], [1.0]], "weights": [1, 2, 1]}


def ntk_problem(tmp_path, cells=100, degree=1, **ntk):
    from mpi4py import MPI
    from pdeformer.model.config import check_config
    from pdeformer.solvers.problem import build_problem
    raw = {"mesh": {"lower": [-8.0], "upper": [8.0], "cells": [cells]},
           "discretisation": {"degree": degree, "limiter": False},
           "model": {"layers": 2, "heads": 3, "seed": 1, "query_scale": 0.0},
           "particles": {"steps_per_layer": ntk.pop("particle_steps", 10)},
           "ntk": ntk, "output": {"fields": False}, "prompts": [GM, CLOUD]}
    return build_problem(check_config(raw, str(tmp_path)), MPI.COMM_WORLD)


def lambda_error(problem, index, exact_measure, shift=None):
    from pdeformer.commands.ntk import prompt_measures
    from pdeformer.tools.parallel import Timer
    measures, how = prompt_measures(problem, Timer())
    b = sample_points(3.0, 64, 1, 0)
    want = log_laplace(exact_measure, b)[0] + (0 if shift is None else b @ shift)
    return np.abs(log_laplace(measures[index], b)[0] - want).max(), how[index]


def exact_gm():
    return mixture([1, 2], [-0.5, 0.8], [0.3, 0.2])


@requires_dolfinx
@pytest.mark.parametrize("degree", [1, 2])
def test_mesh_quadrature_of_projected_prompt_superconverges(tmp_path, degree):
    """Lambda of the DG-k L2 projection: int (rho - P rho) e^{by} = int (rho - P rho)(e^{by} -
    P e^{by}) = O(h^{2k+2}), so the quadrature Lambda converges at order 2k+2."""
    errors = [lambda_error(ntk_problem(tmp_path, c, degree, depth=0.0), 0, exact_gm())[0]
              for c in (50, 100, 200)]
    orders = np.log2(np.array(errors[:-1]) / errors[1:])
    assert np.all(orders > 2 * degree + 2 - 0.3), (errors, orders)


@requires_dolfinx
def test_densities_at_depth_under_uniform_attention_are_translates(tmp_path):
    """Uniform attention translates rho rigidly by m_t - m_0 (pdeformer.model.exact), so
    Lambda_t(b) = Lambda_0(b) + <b, m_t - m_0>: for the mesh density (DG-1 transport,
    converging at about order 2) and for the point cloud (the particle model, SSPRK2:
    order 2 in the step)."""
    from pdeformer.model.exact import uniform_attention_shift
    errs = []
    for cells in (100, 200):
        p = ntk_problem(tmp_path, cells, depth=1.0)
        shift = uniform_attention_shift(p.heads, exact_gm().mean(), 1.0)
        err, how = lambda_error(p, 0, exact_gm(), shift)
        errs.append(err)
        assert how.startswith("DG-1 density at t = 1")
    assert errs[1] < 3e-4 and errs[0] / errs[1] > 3.0, errs
    cloud = PointCloud(CLOUD["points"], CLOUD["weights"])
    perrs = []
    for steps in (10, 20):
        p = ntk_problem(tmp_path, 20, depth=1.0, particle_steps=steps)
        err, how = lambda_error(p, 1, cloud, uniform_attention_shift(p.heads, cloud.mean(), 1.0))
        perrs.append(err)
        assert how.startswith("tokens of the particle model")
    assert perrs[0] / perrs[1] > 3.5, perrs


@requires_dolfinx
def test_run_heads_of_a_layer(tmp_path):
    from pdeformer.commands.ntk import analyse
    p = ntk_problem(tmp_path, 20, heads="run", layer=1, params="all")
    res = analyse(["a", "b"], [exact_gm(), PointCloud(CLOUD["points"], CLOUD["weights"])], p)
    h = p.heads
    gram = ntk_gram([exact_gm(), PointCloud(CLOUD["points"], CLOUD["weights"])], np.array([[1.0]]),
                    layer_slice(h.params, 1), "all")
    np.testing.assert_allclose(res["ntk"]["eigenvalues"], gram["eigenvalues"], rtol=1e-12)
    assert res["ntk"]["layer"] == 1 and res["ntk"]["count"] == 3


# ------------------------------------------------------------------ the command

SHIPPED = os.path.join(ROOT, "runs", "ntk", "prompts.toml")   # a point cloud, an interval, a mixture


@requires_dolfinx
@pytest.mark.mpi
def test_ntk_command_serial_and_two_ranks(tmp_path):
    results = []
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        proc = run_cli(["ntk", SHIPPED, "--set", f"output.dir={out}", "ntk.depth=0.5"], nprocs=n)
        assert "LSE test" in proc.stdout and "NTK Gram" in proc.stdout
        with open(out / "ntk.json") as f:
            res = json.load(f)
        with open(out / "summary.json") as f:
            summary = json.load(f)
        assert summary["status"] == "completed" and summary["ranks"] == n
        assert summary["files"]["plot"] == "ntk.png" and (out / "ntk.png").stat().st_size > 1000
        assert res["provenance"]["ranks"] == n and res["config"]["depth"] == 0.5
        assert [p["measure"].split(" ")[0] for p in res["prompts"]] == ["tokens", "DG-1", "DG-1"]
        assert res["lse"]["independent"] and res["ntk"]["injective"]
        results.append(res)
    for key, field in (("lse", "singular_values"), ("ntk", "eigenvalues")):
        np.testing.assert_allclose(results[0][key][field], results[1][key][field], rtol=1e-9)


@requires_dolfinx
def test_ntk_command_reports_dependence(tmp_path):
    """Identical prompts (here the same mixture twice, as closed forms) are dependent."""
    with open(SHIPPED) as f:
        text = f.read()
    text += text[text.index("[[prompts]]\nname = \"bimodal\""):].replace("bimodal", "again")
    cfg = write_config(tmp_path, text)
    proc = run_cli(["ntk", cfg, "--set", f"output.dir={tmp_path}/out", "ntk.params='V'"])
    assert "DEPENDENT" in proc.stdout and "NOT INJECTIVE" in proc.stdout
    with open(tmp_path / "out" / "ntk.json") as f:
        res = json.load(f)
    c = res["lse"]["weakest_combination"]
    assert abs(c["bimodal"] + c["again"]) < 1e-6 and abs(c["bimodal"]) > 0.7


@requires_dolfinx
def test_ntk_bad_input(tmp_path):
    from conftest import check_one_line_error
    cfg = SHIPPED
    out = f"output.dir={tmp_path}/out"
    check_one_line_error(run_cli(["ntk", cfg, "--set", out, "ntk.depth=0.3"], check=False),
                         "ntk.depth: 0.3 is not a frame time")
    for args, expected in [
            (["ntk.depth=0.5", "ntk.queries=[[1.0, 2.0]]"], "ntk.queries: expected a list of 1-vectors"),
            (["ntk.depth=0.5", "ntk.b_count=5"], "ntk.b_count: 5 sample points cannot separate 3"),
            (["ntk.pairing='matched'"], "ntk.queries: pairing = 'matched' needs one query point per prompt (3), got 1"),
            (["ntk.depth=0.5", "ntk.heads='run'", "ntk.layer=4"], "ntk.layer: 4 is not a layer"),
            (["ntk.depth=0.5", "prompts[0].path='x.npz'"], "prompts[0].path: give either path"),
            (["ntk.depth=0.5", "prompts[0].weights=[1, 2]"], "prompts[0].weights: expected 3 numbers"),
            (["ntk.params='B'"], "ntk.params: ")]:
        check_one_line_error(run_cli(["ntk", cfg, "--set", out, *args], check=False), expected)
    assert not (tmp_path / "out").exists()          # nothing is written for bad input
    check_one_line_error(run_cli(["forward", cfg, "--set", out], check=False),
                         "prompts[0].kind: 'cloud' is a point cloud")


@requires_dolfinx
@pytest.mark.mpi
def test_ntk_bad_input_ends_the_mpi_job(tmp_path):
    from conftest import check_one_line_error
    proc = run_cli(["ntk", SHIPPED, "--set", f"output.dir={tmp_path}/out", "ntk.depth=0.3"],
                   nprocs=2, check=False, timeout=120)
    check_one_line_error(proc, "ntk.depth: 0.3 is not a frame time")


@requires_dolfinx
def test_a_signed_measure_without_log_laplace_is_a_breakdown(tmp_path):
    """A DG density may dip below zero; where its Laplace transform is not positive the
    tests are undefined, and the run says so instead of writing NaN spectra."""
    from pdeformer.tools.errors import SolverBreakdown
    from pdeformer.commands.ntk import analyse
    p = ntk_problem(tmp_path, 20)
    signed = (np.array([[0.0], [1.0]]), np.array([1.0, -0.9]))   # Z(b) = 1 - 0.9 e^b
    with pytest.raises(SolverBreakdown, match="not finite"):
        analyse(["a", "b"], [exact_gm(), signed], p)
