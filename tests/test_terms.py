"""The velocity as a sum of terms (pdeformer.model.terms) with a token-wise term of its own
block: a linear field w_l(x) = B_l x + c_l beside attention. Exact moments when attention
is switched off (V = 0), exact gradients over the whole parameter tree on the mesh and
for particles, and optimiser steps per block."""

from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

from checks import assert_taylor
from conftest import requires_dolfinx

from pdeformer.model import params as tree
from pdeformer.model.terms import TokenTerm

L, D = 2, 2


def _points(arrays):
    """The linear term's particles as VTK points (one per layer)."""
    B = arrays["B"]
    n = B.shape[0] * B.shape[1]
    return np.zeros((n, 3)), {"norm_B": np.linalg.norm(B.reshape(n, -1), axis=1)}


tree.register_block("linear", ("B", "c"), prefix="linear_", particles="linear", points=_points,
                    colour="norm_B")


class LinearTerm(TokenTerm):
    """w_l(x) = B_l x + c_l, with B_l, c_l the means of W particles (B (L, W, d, d),
    c (L, W, d))."""

    block = "linear"

    def __init__(self, B, c):
        self.params = {"B": B, "c": c}

    @classmethod
    def from_options(cls, model, dim, comm):
        return None        # (only from arrays: pf.Transformer's tree)

    @classmethod
    def from_arrays(cls, arrays, model, dim):
        if arrays["B"].shape[2:] != (dim, dim) or arrays["c"].shape[2:] != (dim,):
            from pdeformer.tools.errors import ConfigError
            raise ConfigError("model.params.linear", f"B {arrays['B'].shape}, c {arrays['c'].shape}: "
                              f"expected (L, W, {dim}, {dim}) and (L, W, {dim})")
        return cls(arrays["B"], arrays["c"])

    def _mean(self, layer, params=None):
        p = (params or {self.block: self.params})[self.block]
        return p["B"][layer].mean(axis=0), p["c"][layer].mean(axis=0)

    def velocity(self, x, layer):
        B, c = self._mean(layer)
        return x @ B.T + c

    def vjp(self, x, layer, g):
        W = self.params["B"].shape[1]
        B, _ = self._mean(layer)
        return g @ B, {"B": np.repeat((g.T @ x)[None], W, axis=0) / W,
                       "c": np.repeat(g.sum(axis=0)[None], W, axis=0) / W}

    def bound(self, layer, reach, params=None):
        B, c = self._mean(layer, params)
        return float(np.linalg.norm(B, 2) * reach + np.linalg.norm(c))


def test_a_registered_term_is_built_for_every_run(monkeypatch):
    """A class registered with register_term is built by build_problem from the [model]
    options (here from model.seed) beside attention, and left out where its
    from_options says so."""
    from pdeformer.model import terms

    class SeededLinear(LinearTerm):
        @classmethod
        def from_options(cls, model, dim, comm):
            drawn = linear_term(seed=model.seed)
            return cls(drawn.params["B"], drawn.params["c"]) if model.seed != 7 else None

    monkeypatch.setitem(terms.TERMS, "linear", SeededLinear)
    problem = problem_with(linear_term(), 8, 1, 4, objective=None)   # (its terms replaced below)
    built = terms.build_terms(problem.opts.model, D, MPI.COMM_WORLD)
    assert [type(t) for t in built] == [SeededLinear]
    np.testing.assert_array_equal(built[0].params["B"], linear_term(seed=problem.opts.model.seed).params["B"])
    from dataclasses import replace
    assert terms.build_terms(replace(problem.opts.model, seed=7), D, MPI.COMM_WORLD) == []


def test_a_model_holds_and_solves_every_registered_block(monkeypatch, tmp_path):
    """pf.Transformer takes a tree with the linear term's block (checked: unknown blocks,
    wrong shapes and non-finite entries are one-line errors naming the key), and
    pf.solve moves the prompt with it exactly as a problem given the term directly; a
    params file may hold the block beside Q, K, V."""
    import pdeformer as pf
    from pdeformer.api.solve import _Frames
    from pdeformer.model import terms
    from pdeformer.model.heads import read_arrays
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.tools.errors import ConfigError
    from pdeformer.tools.output import write_npz
    monkeypatch.setitem(terms.TERMS, "linear", LinearTerm)
    term = linear_term(W=2)
    heads = pf.Transformer.random(layers=L, heads=2, dim=D, seed=1, init_scale=0.8).params
    model = pf.Transformer({**heads, "linear": term.params})
    assert set(model.params) == {"attention", "linear"}
    mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[8, 8])
    prompt = pf.GaussianMixture(means=[[0.3, -0.2]], covs=[[[0.3, 0.05], [0.05, 0.2]]])
    sol = pf.solve(model, prompt, pf.DG(mesh, limiter=False, steps_per_layer=4), backend="direct")
    frames = _Frames()
    ForwardSolver(problem_with(term, 8, 1, 4)).run([frames])
    np.testing.assert_allclose(sol.mean[-1], frames.rows[0][-1]["mean"], rtol=0, atol=1e-14)
    assert np.abs(sol.mean[-1] - pf.solve(pf.Transformer(heads), prompt, pf.DG(mesh, limiter=False, steps_per_layer=4),
                                          backend="direct").mean[-1]).max() > 1e-3
    bad = {"unknown block 'mlp'": {**heads, "mlp": term.params},
           "B has shape": {**heads, "linear": {"B": term.params["B"][:1], "c": term.params["c"]}},
           "expected (L, W, 2, 2)": {**heads, "linear": {"B": term.params["B"][..., :1], "c": term.params["c"]}},
           "non-finite": {**heads, "linear": {"B": term.params["B"] * np.nan, "c": term.params["c"]}}}
    for message, params in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            pf.Transformer(params)
    write_npz(str(tmp_path / "p.npz"), **tree.to_files(model.params))
    np.testing.assert_array_equal(read_arrays(str(tmp_path / "p.npz"), "model.params")["Q"], heads["attention"]["Q"])
    write_npz(str(tmp_path / "q.npz"), **tree.to_files(model.params), mlp_a=np.zeros(2))
    with pytest.raises(Exception, match="array 'mlp_a' is not supported"):
        read_arrays(str(tmp_path / "q.npz"), "model.params")


def linear_term(seed=0, W=1, scale=0.3):
    rng = np.random.default_rng(seed)
    return LinearTerm(scale * rng.normal(size=(L, W, D, D)), 0.7 * scale * rng.normal(size=(L, W, D)))


def exact_moments(term, m, C):
    """Mean and covariance after the layers of dx/dt = B_l x + c_l: per layer
    [m; 1] <- expm([[B, c], [0, 0]] / L) [m; 1] and C <- E C E^T, E = expm(B / L)."""
    from scipy.linalg import expm
    for l in range(L):
        B, c = term._mean(l)
        M = np.zeros((D + 1, D + 1))
        M[:D, :D], M[:D, D] = B, c
        E = expm(M / L)
        m, C = E[:D, :D] @ m + E[:D, D], E[:D, :D] @ C @ E[:D, :D].T
    return m, C


def problem_with(term, cells, degree, steps, zero_values=False, objective=None, particles=False, heads=2):
    """A problem of one Gaussian prompt on [-4, 4]^2 with the term beside attention."""
    import pdeformer as pf
    from pdeformer.api.solve import problem_config
    from pdeformer.solvers.problem import build_problem
    model = pf.Transformer.random(layers=L, heads=heads, dim=D, seed=1, init_scale=0.8)
    if zero_values:
        model.params["attention"]["V"][:] = 0.0
    prompt = pf.GaussianMixture(means=[[0.3, -0.2]], covs=[[[0.3, 0.05], [0.05, 0.2]]])
    mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[cells, cells])
    disc = pf.Particles(tokens=300, seed=2, steps_per_layer=steps, mesh=mesh) if particles else \
        pf.DG(mesh, degree=degree, limiter=False, steps_per_layer=steps)
    cfg = problem_config(model, [prompt], disc, objective, backend="direct")
    problem = build_problem(cfg, MPI.COMM_WORLD, objective is not None and not particles,
                            params=model.params)
    problem.terms = [term]
    return problem


@requires_dolfinx
def test_a_linear_term_moves_a_gaussian_as_its_exact_flow():
    """With attention's values zero the velocity is w = B_l x + c_l: a Gaussian stays
    Gaussian and its moments follow the linear ODE. DG-2 final moments against the
    closed form: errors below 2e-7 on 24^2 and falling at least 4x from 12^2 (measured
    1.7e-6 -> 6.9e-8, the covariance's)."""
    from pdeformer.api.solve import _Frames
    from pdeformer.solvers.forward import ForwardSolver
    term = linear_term()
    m, C = exact_moments(term, np.array([0.3, -0.2]), np.array([[0.3, 0.05], [0.05, 0.2]]))
    errors = []
    for cells, steps in ((12, 10), (24, 20)):
        frames = _Frames()
        ForwardSolver(problem_with(term, cells, 2, steps, zero_values=True, heads=1)).run([frames])
        last = frames.rows[0][-1]
        errors.append(max(np.abs(last["mean"] - m).max(), np.abs(last["cov"] - C).max()))
    assert errors[1] < 2e-7 and errors[0] > 4 * errors[1], errors


def assert_exact_tree_gradient(adjoint, params, g):
    """Along a random direction over every block of the tree the Taylor remainder falls
    as eps^2 (orders within 0.2 of 2): the gradient is that of the discrete risk, for
    the attention's and the linear term's parameters alike."""
    rng = np.random.default_rng(3)
    direction = tree.tree_map(lambda a: rng.normal(size=a.shape), params)
    assert set(g.params) == {"attention", "linear"}
    slope = float(np.dot(g.vector(), tree.flatten(direction)))
    base = tree.copy(params)

    def risk(e):
        for (block, name), a in tree.leaves(params):
            a[:] = base[block][name] + e * direction[block][name]
        try:
            return adjoint.risk()[0]
        finally:
            for (block, name), a in tree.leaves(params):
                a[:] = base[block][name]
    assert_taylor(risk, slope, order=2, tol=0.2)


@requires_dolfinx
def test_the_adjoint_differentiates_every_block_on_the_mesh():
    import pdeformer as pf
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    p = problem_with(linear_term(), 16, 1, 16, objective=pf.Moments(mean=[0, 0], cov=0.5))
    adjoint = AdjointSolver(ForwardSolver(p), p.objective, p.targets)
    g = adjoint.gradient()
    assert g.params["linear"]["B"].shape == (L, 1, D, D) and np.abs(g.params["linear"]["c"]).max() > 1e-3
    assert_exact_tree_gradient(adjoint, adjoint.forward.velocity_field.params, g)


def test_the_particle_adjoint_differentiates_every_block():
    import pdeformer as pf
    from pdeformer.model.particles import ParticleAdjoint, ParticleSolver
    p = problem_with(linear_term(W=3), 10, 1, 6, objective=pf.Moments(mean=[0, 0], cov=0.5), particles=True)
    adjoint = ParticleAdjoint(ParticleSolver(p), p.objective, p.targets)
    g = adjoint.gradient()
    assert g.params["linear"]["B"].shape == (L, 3, D, D)
    assert_exact_tree_gradient(adjoint, adjoint.solver.velocity_field.params, g)


def test_optimisers_step_every_block_with_its_own_mean_field_scale():
    """gd moves each block by lr L W dR/dtheta (W its particles per layer); adam's
    first step moves every entry by lr (up to eps) against its gradient's sign."""
    from pdeformer.solvers.train import Adam, GradientDescent
    rng = np.random.default_rng(0)
    params = {"attention": {"V": rng.normal(size=(2, 3, 2, 2))}, "linear": {"c": rng.normal(size=(2, 5, 2))}}
    grads = tree.tree_map(lambda a: rng.normal(size=a.shape), params)
    moved = tree.copy(params)
    GradientDescent(0.1, moved).step(moved, grads)
    for (block, name), a in tree.leaves(moved):
        LW = {"attention": 6, "linear": 10}[block]
        np.testing.assert_allclose(a, params[block][name] - 0.1 * LW * grads[block][name], rtol=1e-14)
    moved = tree.copy(params)
    Adam(0.01, moved).step(moved, grads)
    for (block, name), a in tree.leaves(moved):
        np.testing.assert_allclose(a, params[block][name] - 0.01 * np.sign(grads[block][name]), rtol=1e-6)


def test_the_tree_writes_and_reads_every_block(tmp_path):
    """Files hold each block under its prefix; reading them back gives the tree."""
    from pdeformer.tools.output import write_npz
    term = linear_term(W=2)
    params = {"linear": term.params}
    write_npz(str(tmp_path / "p.npz"), **tree.to_files(params))
    with np.load(tmp_path / "p.npz") as f:
        assert sorted(f.files) == ["linear_B", "linear_c"]
        back = tree.read_tree(dict(f))
    for (block, name), a in tree.leaves(params):
        np.testing.assert_array_equal(back[block][name], a)
    with pytest.raises(ValueError, match="taken"):
        tree.register_block("other", ("B",), prefix="linear_", particles="x", points=_points, colour="x")


@requires_dolfinx
def test_the_gram_prediction_weights_each_block_by_its_step():
    """One gd step moves block b by lr L_b W_b dR/dtheta, so the outputs move by
    -(lr (L W)_max / S) J D J^T r, D = diag(L_b W_b / (L W)_max) (commands/gram.py): the
    step's change of the outputs matches it up to O(lr^2) -- relative to the change, an
    error that halves with lr (6e-5 at lr = 2e-3) -- and without D (J J^T) it does not."""
    import pdeformer as pf
    from pdeformer.commands.gram import column_weights, gram_matrix
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.train import GradientDescent
    p = problem_with(linear_term(W=3), 10, 1, 16, objective=pf.Moments(mean=[0.1, 0], cov=0.5))
    adjoint = AdjointSolver(ForwardSolver(p), p.objective, p.targets)
    params = adjoint.forward.velocity_field.params
    y0, ystar, J = adjoint.output_jacobian()
    weights, (layers, width) = column_weights(params)
    assert weights is not None and set(weights) == {4 / 6, 1.0} and layers * width == 6
    base, grads = tree.copy(params), adjoint.gradient().params
    errors, unweighted = [], []
    for lr in (2e-3, 1e-3):
        GradientDescent(lr, params).step(params, grads)
        y1 = adjoint.output_jacobian()[0]
        for (block, name), a in tree.leaves(params):
            a[:] = base[block][name]
        a_step = lr * layers * width / 1
        predicted = -a_step * gram_matrix(J, weights) @ (y0 - ystar)
        errors.append(np.abs(y1 - y0 - predicted).max() / np.abs(predicted).max())
        unweighted.append(np.abs(y1 - y0 + a_step * gram_matrix(J) @ (y0 - ystar)).max() / np.abs(predicted).max())
    assert errors[0] < 1e-3 and 1.7 < errors[0] / errors[1] < 2.3, errors
    assert min(unweighted) > 10 * errors[0], (unweighted, errors)
