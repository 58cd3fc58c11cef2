"""Tokens on the circle and the sphere: meshes, prompts, the projected attention
velocity, and exact answers (docs/sphere.md): the linear growth rate of a mode of the
uniform density, mass conservation, tangency, exact gradients, rank independence."""

from __future__ import annotations

import csv
import math
import os

import numpy as np
import pytest

from pdeformer.model.geometry import Sphere
from pdeformer.model.sphere_prompts import fourier_mode, real_harmonic
from pdeformer.model.config import check_config
from pdeformer.tools.errors import ConfigError

from conftest import ROOT, requires_dolfinx, run_cli


# ------------------------------------------------------------------ quadrature on S^1, S^2

def sphere_rule(n: int = 48):
    """Points u (N, 3) and weights of a rule on the unit sphere exact for polynomials of
    degree < 2n in z (Gauss-Legendre) and < 2n in phi (trapezoid)."""
    z, wz = np.polynomial.legendre.leggauss(n)
    phi = 2 * np.pi * np.arange(2 * n) / (2 * n)
    Z, P = np.meshgrid(z, phi, indexing="ij")
    r = np.sqrt(1 - Z ** 2)
    u = np.stack([r * np.cos(P), r * np.sin(P), Z], -1).reshape(-1, 3)
    w = (wz[:, None] * np.full(2 * n, 2 * np.pi / (2 * n))[None, :]).ravel()
    return u, w


def circle_rule(n: int = 512):
    theta = 2 * np.pi * np.arange(n) / n
    return np.stack([np.cos(theta), np.sin(theta)], -1), np.full(n, 2 * np.pi / n)


def bessel_i(l: int, beta: float) -> float:
    """I_l(beta) = (1/pi) int_0^pi e^{beta cos t} cos(l t) dt (midpoint rule: spectral)."""
    t = np.pi * (np.arange(4096) + 0.5) / 4096
    return float(np.mean(np.exp(beta * np.cos(t)) * np.cos(l * t)))


def legendre_moment(l: int, beta: float) -> float:
    """int_{-1}^{1} e^{beta t} P_l(t) dt (= 2 i_l(beta), Gauss-Legendre)."""
    t, w = np.polynomial.legendre.leggauss(80)
    return float(np.sum(w * np.exp(beta * t) * np.polynomial.legendre.Legendre.basis(l)(t)))


def circle_rate(l: int, beta: float) -> float:
    """Growth rate of cos(l theta) about the uniform density on S^1 (V = I, A = I):
    l^2 I_l(beta) / (beta I_0(beta)) (docs/sphere.md)."""
    return l * l * bessel_i(l, beta) / (beta * bessel_i(0, beta))


def sphere_rate(l: int, beta: float) -> float:
    """Growth rate of Y_lm about the uniform density on S^2 (V = I, A = I):
    l (l + 1) mu_l / (beta mu_0), mu_l = int e^{beta t} P_l(t) dt (docs/sphere.md)."""
    return l * (l + 1) * legendre_moment(l, beta) / (beta * legendre_moment(0, beta))


# ------------------------------------------------------------------ meshes (numpy part)

def test_icosphere_counts_orientation_and_radius():
    from pdeformer.fem.mesh import icosphere
    for r in range(4):
        x, tri = icosphere(r)
        assert len(tri) == 20 * 4 ** r and len(x) == 10 * 4 ** r + 2
        assert np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-15)
        edges = {tuple(sorted(e)) for t in tri for e in ((t[0], t[1]), (t[1], t[2]), (t[2], t[0]))}
        assert len(x) - len(edges) + len(tri) == 2                       # Euler: a sphere
        n = np.cross(x[tri[:, 1]] - x[tri[:, 0]], x[tri[:, 2]] - x[tri[:, 0]])
        assert np.all(np.einsum("ij,ij->i", n, x[tri].mean(axis=1)) > 0)  # outward, counter-clockwise


# ------------------------------------------------------------------ prompts on the sphere

def test_real_spherical_harmonics_are_orthonormal():
    u, w = sphere_rule()
    modes = [(l, m) for l in range(5) for m in range(-l, l + 1)]
    Y = np.array([real_harmonic(l, m, u.T) if l else np.full(len(u), 1 / math.sqrt(4 * math.pi))
                  for l, m in modes])
    gram = (Y * w) @ Y.T
    assert np.abs(gram - np.eye(len(modes))).max() < 1e-12
    # Y_1m are sqrt(3 / 4 pi) times the coordinates (m = 1: x, -1: y, 0: z)
    for m, a in ((1, 0), (-1, 1), (0, 2)):
        assert np.allclose(real_harmonic(1, m, u.T), math.sqrt(3 / (4 * math.pi)) * u[:, a], atol=1e-14)


def sphere_prompt(kind: str, d: int, radius: float = 1.0, **keys):
    from pdeformer.model.prompts import make_prompt
    return make_prompt({"kind": kind, "weights": None, "lower": None, "upper": None, **keys}, d, 0,
                       geometry=Sphere(d, radius))


@pytest.mark.parametrize("d", [2, 3])
def test_sphere_prompts_have_mass_one_and_the_stated_mean(d):
    """von Mises-Fisher mixtures, harmonics and the uniform density integrate to 1 over
    the sphere of radius 1.5 (quadrature), and the vMF mean is sum w A(kappa) R mu."""
    R = 1.5
    u, w = sphere_rule() if d == 3 else circle_rule()
    x, w = R * u, w * R ** (d - 1)
    means = [[1.0, 0.5, -0.2][:d], [-0.3, 1.0, 0.4][:d]]
    vmf = sphere_prompt("von_mises_fisher", d, R, means=means, concentrations=[7.0, 0.0],
                        weights=[0.7, 0.3])
    harm = sphere_prompt("harmonics", d, R, coefficients=[[2, 2, 0.4], [3, -3, 0.2]] if d == 2
                         else [[2, -1, 0.4], [3, 2, 0.2]])
    uniform = sphere_prompt("uniform", d, R)
    for p in (vmf, harm, uniform):
        assert w @ p.density(x) == pytest.approx(1.0, abs=1e-12)
    assert np.allclose((w * vmf.density(x)) @ x, vmf.mean(), atol=1e-12)
    # large concentrations neither overflow nor lose the normalisation
    sharp = sphere_prompt("von_mises_fisher", d, 1.0, means=[[0.0] * (d - 1) + [1.0]], concentrations=[800.0])
    top = sharp.density(np.eye(d)[-1:])[0]
    t = np.pi * (np.arange(8192) + 0.5) / 8192          # e^{-800} I_0(800) by the midpoint rule
    exact = 800 / (2 * np.pi) if d == 3 else 1 / (2 * np.pi * np.mean(np.exp(800 * (np.cos(t) - 1))))
    assert top == pytest.approx(exact, rel=1e-10)


@pytest.mark.parametrize("spec, d, key", [
    ({"kind": "harmonics", "coefficients": [[1, 2, 0.1]]}, 3, "coefficients[0]"),
    ({"kind": "harmonics", "coefficients": [[2, 1, 0.1]]}, 2, "coefficients[0]"),
    ({"kind": "harmonics", "coefficients": [[1.5, 1, 0.1]]}, 3, "coefficients[0]"),
    ({"kind": "von_mises_fisher", "means": [[0.0, 0.0, 0.0]], "concentrations": [1.0]}, 3, "means"),
    ({"kind": "von_mises_fisher", "means": [[1.0, 0.0, 0.0]], "concentrations": [-1.0]}, 3, "concentrations"),
    ({"kind": "von_mises_fisher", "means": [[1.0, 0.0]], "concentrations": [1.0, 2.0]}, 2, "concentrations"),
    ({"kind": "uniform", "lower": [0, 0, 0], "upper": [1, 1, 1]}, 3, "lower"),
])
def test_bad_sphere_prompts_name_their_key(spec, d, key):
    import re
    with pytest.raises(ConfigError, match="^" + re.escape(f"prompts[0].{key}")):
        sphere_prompt(spec.pop("kind"), d, **spec)


def test_sphere_prompts_need_a_sphere_and_flat_ones_a_flat_mesh():
    from pdeformer.model.prompts import make_prompt
    with pytest.raises(ConfigError, match=r"^prompts\[0\]\.kind: 'von_mises_fisher' is a density on a circle"):
        make_prompt({"kind": "von_mises_fisher", "means": [[1.0, 0.0]], "concentrations": [1.0],
                     "weights": None}, 2, 0)
    with pytest.raises(ConfigError, match=r"^prompts\[0\]\.kind: 'gaussian_mixture' is a density on R\^d"):
        make_prompt({"kind": "gaussian_mixture", "means": [[1.0, 0.0]], "covs": [0.1], "weights": None},
                    2, 0, geometry=Sphere(2, 1.0))


@pytest.mark.parametrize("d", [2, 3])
def test_a_density_file_on_the_sphere_interpolates_on_the_sphere(tmp_path, d):
    """Values of a vMF density at 2,000 (S^2) or 400 (S^1) points on the sphere of radius
    2 (file prompt): the interpolant on the sphere's triangulation matches the density at
    random directions to the linear interpolation error (2e-2 relative on S^2, 5e-3 on
    S^1), draws have the vMF mean, and points on a hemisphere are refused."""
    from pdeformer.model.prompts import make_prompt
    from pdeformer.tools.errors import InputError
    rng = np.random.default_rng(4)
    R = 2.0
    vmf = sphere_prompt("von_mises_fisher", d, R, means=[[0.3, 1.0, 0.2][:d]], concentrations=[3.0])
    pts = R * sphere_prompt("uniform", d, 1.0).sample(2000 if d == 3 else 400, rng)
    np.savez(tmp_path / "rho.npz", points=pts, density=vmf.density(pts))
    f = make_prompt({"kind": "file", "path": str(tmp_path / "rho.npz")}, d, 0, geometry=Sphere(d, R))
    x = R * sphere_prompt("uniform", d, 1.0).sample(500, rng)
    top = vmf.density(x).max()
    assert np.abs(f.density(x) - vmf.density(x)).max() < (2e-2 if d == 3 else 5e-3) * top
    assert f.total_mass() == pytest.approx(1.0, rel=2e-2)     # vMF values: mass 1 on the sphere
    draws = f.sample(40000, rng)
    assert np.allclose(np.linalg.norm(draws, axis=1), R, rtol=1e-14)
    assert np.abs(draws.mean(axis=0) - vmf.mean()).max() < 3e-2 * R
    if d == 3:
        np.savez(tmp_path / "half.npz", points=pts[pts[:, 2] > 0], density=vmf.density(pts[pts[:, 2] > 0]))
        with pytest.raises(InputError, match=r"^prompts\[0\]\.path: .*half.npz: the points do not surround"):
            make_prompt({"kind": "file", "path": str(tmp_path / "half.npz")}, d, 0, geometry=Sphere(d, R))


@pytest.mark.parametrize("mesh, key", [
    ({"shape": "circle"}, "mesh.cells"),
    ({"shape": "circle", "cells": [2]}, "mesh.cells"),
    ({"shape": "circle", "cells": [8, 8]}, "mesh.cells"),
    ({"shape": "circle", "cells": [8], "refinements": 2}, "mesh.refinements"),
    ({"shape": "sphere"}, "mesh.refinements"),
    ({"shape": "sphere", "refinements": 2, "cells": [4]}, "mesh.cells"),
    ({"shape": "sphere", "refinements": 2, "lower": [0, 0]}, "mesh.lower"),
    ({"shape": "sphere", "refinements": 2, "radius": 0}, "mesh.radius"),
    ({"shape": "torus", "refinements": 2}, "mesh.shape"),
    ({"lower": [0, 0], "upper": [1, 1], "cells": [2, 2], "radius": 2.0}, "mesh.radius"),
    ({"file": "m.xdmf", "shape": "sphere"}, "mesh.shape"),
])
def test_bad_manifold_meshes_name_their_key(mesh, key):
    raw = {"mesh": mesh, "model": {"layers": 1, "heads": 1},
           "prompts": [{"kind": "uniform"}]}
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        check_config(raw, ".")


# ------------------------------------------------------------------ solver helpers

def manifold_config(shape: str, size: int, prompt: dict, **sections) -> dict:
    mesh = {"shape": shape, **({"cells": [size]} if shape == "circle" else {"refinements": size})}
    raw = {"mesh": mesh, "discretisation": {"degree": 1, "limiter": False, "steps_per_layer": 40},
           "model": {"layers": 4, "heads": 1}, "attention": {"backend": "direct"},
           "output": {"fields": False}, "prompts": [prompt]}
    for name, table in sections.items():   # a key given as None is left out
        raw[name] = {k: v for k, v in {**raw.get(name, {}), **table}.items() if v is not None}
    return raw


def identity_heads(layers: int, d: int):
    """Q = K = V = I in every layer (one head): A = I."""
    from pdeformer.model.heads import HeadMeasure
    h = HeadMeasure.random(layers, 1, d, d, seed=0)
    h.Q[:], h.K[:], h.V[:] = np.eye(d), np.eye(d), np.eye(d)
    return h


def solve(raw: dict, tmp_path, heads=None):
    """(forward solver, its frames' diagnostics) of a config (in this process)."""
    from mpi4py import MPI
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from pdeformer.solvers.trackers import DiagnosticsTable
    cfg = check_config(raw, str(tmp_path))
    problem = build_problem(cfg, MPI.COMM_WORLD)
    if heads is not None:
        problem.heads = heads
    solver = ForwardSolver(problem)
    table = DiagnosticsTable(str(tmp_path / "diagnostics.csv"))
    solver.solve_prompt(0, [table])
    return solver, table.rows


def mode_amplitude(row: dict, d: int, l: int) -> float:
    """A diagnostic proportional to the amplitude of the mode started: l = 1 the mean
    along its axis (x on S^1, z on S^2), l = 2 the covariance's anisotropy."""
    mean, cov = row["mean"], row["cov"]
    if l == 1:
        return mean[0] if d == 2 else mean[2]
    return cov[0, 0] - cov[1, 1] if d == 2 else cov[2, 2] - 0.5 * (cov[0, 0] + cov[1, 1])


# ------------------------------------------------------------------ exact answers

@requires_dolfinx
@pytest.mark.parametrize("shape, sizes, l, beta", [
    ("circle", (32, 64, 128), 1, 1.0),
    ("circle", (32, 64, 128), 2, 4.0),
    ("sphere", (2, 3), 1, 1.0),
])
def test_a_mode_of_the_uniform_density_grows_at_the_linear_rate(tmp_path, shape, sizes, l, beta):
    """rho_0 = (1 + eps Y_l) / |S| with V = Q = K = I: the amplitude grows as e^{lambda t},
    lambda = l^2 I_l(beta) / (beta I_0(beta)) on S^1 and l (l+1) mu_l / (beta mu_0) on S^2
    (docs/sphere.md). eps = 1e-4 makes the nonlinear part ~1e-4 of the growth; the
    discrete growth converges to e^lambda at order 2 (P1 geometry, DG-1, 40 RK2 steps
    per layer: time error ~1e-6)."""
    d = 2 if shape == "circle" else 3
    eps = 1e-4
    exact = math.exp(circle_rate(l, beta) if d == 2 else sphere_rate(l, beta))
    errors = []
    for size in sizes:
        raw = manifold_config(shape, size, {"kind": "harmonics", "coefficients": [[l, l if d == 2 else 0, eps]]},
                              attention={"beta": beta})
        _, rows = solve(raw, tmp_path, identity_heads(4, d))
        growth = mode_amplitude(rows[-1], d, l) / mode_amplitude(rows[0], d, l)
        errors.append(abs(growth / exact - 1))
    orders = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    assert np.all(np.abs(orders - 2) < 0.3), (errors, orders)
    assert errors[-1] < (1e-3 if d == 2 else 5e-3), errors


@requires_dolfinx
def test_mass_is_conserved_and_the_velocity_is_tangent_on_the_sphere(tmp_path):
    """Random heads at beta = 2 on an icosphere, limiter on: mass + outflow stays 1 to
    round-off with no outflow, the velocity at every node is tangent to the sphere, and
    the density does move (its mean and covariance)."""
    raw = manifold_config("sphere", 2, {"kind": "von_mises_fisher", "means": [[1.0, 0.0, 0.2], [0.0, -1.0, -0.5]],
                                        "concentrations": [5.0, 3.0]},
                          discretisation={"limiter": True, "steps_per_layer": None},
                          model={"layers": 2, "heads": 3, "seed": 5, "init_scale": 1.5},
                          attention={"beta": 2.0})
    solver, rows = solve(raw, tmp_path)
    for r in rows:
        assert abs(r["mass"] - 1) < 1e-12 and r["outflow"] == 0.0, r
    moved = np.linalg.norm(rows[-1]["mean"] - rows[0]["mean"]) + np.linalg.norm(rows[-1]["cov"] - rows[0]["cov"])
    assert moved > 1e-2, moved
    v = solver.velocity(solver.initial_coeffs[0], 0)
    x = solver.velocity_field.targets
    assert np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-14)
    radial = np.abs(np.einsum("nd,nd->n", v, x))
    assert radial.max() < 1e-13 * np.abs(v).max()


@requires_dolfinx
def test_uniform_density_is_stationary_up_to_the_mesh_error(tmp_path):
    """With A = I the uniform density on S^2 has zero velocity (by symmetry); the discrete
    velocity of the projected uniform density vanishes at order 2 under refinement."""
    top = []
    for r in (2, 3):
        raw = manifold_config("sphere", r, {"kind": "uniform"}, attention={"beta": 3.0})
        from mpi4py import MPI
        from pdeformer.solvers.forward import ForwardSolver
        from pdeformer.solvers.problem import build_problem
        problem = build_problem(check_config(raw, str(tmp_path)), MPI.COMM_WORLD)
        problem.heads = identity_heads(4, 3)
        solver = ForwardSolver(problem)
        top.append(np.abs(solver.velocity(solver.initial_coeffs[0], 0)).max())
    assert top[0] < 1e-2 and math.log2(top[0] / top[1]) > 1.7, top


@requires_dolfinx
@pytest.mark.parametrize("backend", ["direct", "laplace"])
def test_gradient_on_the_sphere_is_exact(tmp_path, backend):
    """The adjoint on the sphere (projected velocity, manifold DG, beta = 1.7): Taylor
    remainders of order 2 and central differences (tests/test_adjoint.py), with direct
    summation and through the 3-D laplace table (plans frozen per evaluation)."""
    from mpi4py import MPI
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from checks import assert_exact_gradient
    raw = manifold_config("sphere", 2, {"kind": "von_mises_fisher", "means": [[1, 0.2, 0], [0, 0, -1]],
                                        "concentrations": [3, 2],
                                        "target": {"mean": [0.1, 0.2, 0.3], "cov": 0.1}},
                          discretisation={"steps_per_layer": 12},
                          model={"layers": 2, "heads": 2, "seed": 4, "init_scale": 1.5},
                          attention={"beta": 1.7, "backend": backend, "tol": 1e-10},
                          objective={"kind": "moments"})
    problem = build_problem(check_config(raw, str(tmp_path)), MPI.COMM_WORLD, differentiable=True)
    adj = AdjointSolver(ForwardSolver(problem), problem.objective, problem.targets)
    assert_exact_gradient(adj, adj.gradient(), fd_step=1e-4)
    stats = adj.forward.velocity_field.stats
    assert stats["laplace" if backend == "laplace" else "direct"] > 0 and stats["direct" if backend == "laplace" else "laplace"] == 0


@requires_dolfinx
def test_beta_scales_the_scores(tmp_path):
    """beta = 2 with heads (Q, K, V) is the model with (2Q, K, V) at beta = 1: the same
    velocity, and d/dA twice the other's (A = K^T Q doubles)."""
    from mpi4py import MPI
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.model.velocity import AttentionVelocity
    from pdeformer.model.schema import options
    rng = np.random.default_rng(2)
    heads = HeadMeasure.random(1, 3, 2, 2, seed=1)
    doubled = HeadMeasure.random(1, 3, 2, 2, seed=1)
    doubled.Q[:] *= 2
    y, w, x, g = rng.normal(size=(50, 2)), rng.uniform(0.1, 1, 50), rng.normal(size=(20, 2)), rng.normal(size=(20, 2))
    out = []
    for h, beta in ((heads, 2.0), (doubled, 1.0)):
        cfg = check_config({"mesh": {"lower": [0, 0], "upper": [1, 1], "cells": [1, 1]},
                            "model": {"layers": 1, "heads": 3}, "attention": {"backend": "direct", "beta": beta},
                            "prompts": [{"kind": "uniform", "lower": [0, 0], "upper": [1, 1]}]}, str(tmp_path))
        field = AttentionVelocity(x, h, options(cfg).attention, MPI.COMM_SELF)
        out.append((field(y, w, 0), field.vjp(y, w, 0, g)))
    (v1, ct1), (v2, ct2) = out
    assert np.allclose(v1, v2, rtol=1e-13, atol=1e-15)
    assert np.allclose(ct1.A, 2 * ct2.A, rtol=1e-12, atol=1e-15)
    assert np.allclose(ct1.V, ct2.V, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------ meshes in dolfinx

@requires_dolfinx
def test_circle_and_sphere_meshes_converge_to_their_length_and_area(tmp_path):
    """The n-gon and the icosphere of radius 1.5: cells as stated, every vertex on the
    sphere, length and area within O(h^2) of 2 pi R and 4 pi R^2 (ratio 4 per halving)."""
    from mpi4py import MPI
    import dolfinx.fem
    import ufl
    from pdeformer.fem.mesh import circle_mesh, sphere_mesh
    from pdeformer.fem import _dolfinx as dfx
    R, comm = 1.5, MPI.COMM_WORLD
    errors = {"circle": [], "sphere": []}
    for k in range(3):
        for shape, mesh, exact in (("circle", circle_mesh(comm, 16 * 2 ** k, R), 2 * np.pi * R),
                                   ("sphere", sphere_mesh(comm, k + 1, R), 4 * np.pi * R ** 2)):
            assert dfx.global_cells(mesh) == (16 * 2 ** k if shape == "circle" else 20 * 4 ** (k + 1))
            assert np.allclose(np.linalg.norm(mesh.geometry.x[:, :mesh.geometry.dim], axis=1), R, rtol=1e-14)
            one = dolfinx.fem.Constant(mesh, 1.0)
            size = comm.allreduce(dolfinx.fem.assemble_scalar(dolfinx.fem.form(one * ufl.dx(domain=mesh))))
            errors[shape].append(exact - size)
    for shape, e in errors.items():
        ratios = np.array(e[:-1]) / np.array(e[1:])
        assert np.all(np.array(e) > 0) and np.all(np.abs(ratios - 4) < 0.2), (shape, e)


@requires_dolfinx
def test_a_manifold_mesh_file_must_be_a_sphere(tmp_path):
    """An icosphere written as XDMF is read as a sphere (d = 3); the same mesh stretched
    along z is refused in one line naming the file."""
    from mpi4py import MPI
    import dolfinx.io
    from pdeformer.fem.mesh import make_mesh, sphere_mesh, token_dim
    from pdeformer.model.schema import options
    from pdeformer.tools.errors import InputError
    comm = MPI.COMM_WORLD
    for name, stretch in (("round", 1.0), ("stretched", 1.1)):
        mesh = sphere_mesh(comm, 1, 1.0)
        mesh.geometry.x[:, 2] *= stretch
        with dolfinx.io.XDMFFile(comm, str(tmp_path / f"{name}.xdmf"), "w") as f:
            f.write_mesh(mesh)
    raw = {"mesh": {"file": str(tmp_path / "round.xdmf")}, "model": {"layers": 1, "heads": 1},
           "prompts": [{"kind": "uniform"}]}
    mesh = make_mesh(comm, options(check_config(raw, str(tmp_path))).mesh)
    assert token_dim(mesh) == 3 and mesh.topology.dim == 2
    from pdeformer.solvers.budget import mesh_size, token_dimension
    cells, tdim, _ = mesh_size(check_config(raw, str(tmp_path))["mesh"])
    assert (cells, tdim, token_dimension(check_config(raw, str(tmp_path))["mesh"], tdim)) == (80, 2, 3)
    raw["mesh"]["file"] = str(tmp_path / "stretched.xdmf")
    with pytest.raises(InputError, match=r"^mesh.file: .*stretched.xdmf: geometry has 3 coordinates for a 2-D mesh"):
        make_mesh(comm, options(check_config(raw, str(tmp_path))).mesh)


# ------------------------------------------------------------------ shipped configs, ranks

def _diagnostics(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@requires_dolfinx
@pytest.mark.parametrize("name, sets", [
    ("circle", ["mesh.cells=[64]", "model.layers=3"]),
    ("sphere", ["mesh.refinements=2", "model.layers=2"]),
])
def test_shipped_manifold_configs_on_one_and_two_ranks(tmp_path, name, sets):
    """runs/circle.toml and runs/sphere.toml (made smaller): forward, gradient and
    particles run on 1 and 2 ranks with the same diagnostics (order parameter, Fourier
    amplitudes included) and gradient to 1e-10; the pictures use the circle's or
    sphere's chart."""
    config = os.path.join(ROOT, "runs", f"{name}.toml")
    found = {}
    for P in (1, 2):
        out = tmp_path / f"P{P}"
        for command in ("forward", "gradient", "particles"):
            run_cli([command, config, "--set", f"output.dir={out / command}", *sets, "particles.tokens=300"],
                    nprocs=P, plots=(P == 1 and command != "gradient"))
        with np.load(out / "gradient" / "gradient.npz") as g:
            gradient = np.concatenate([g[k].ravel() for k in ("dQ", "dK", "dV")])
        found[P] = (_diagnostics(out / "forward" / "diagnostics.csv"), gradient,
                    _diagnostics(out / "particles" / "diagnostics.csv"))
    rows, gradient, tokens = found[1]
    for table in (rows, tokens):
        assert "order" in table[0] and (("fourier_3" in table[0]) == (name == "circle"))
    for one, two in ((rows, found[2][0]), (tokens, found[2][2])):
        for a, b in zip(one, two, strict=True):
            for k in a:
                if k not in ("prompt", "min_rho"):
                    assert abs(float(a[k]) - float(b[k])) <= 1e-10 * max(1.0, abs(float(a[k]))), (k, a, b)
    assert np.abs(found[2][1] - gradient).max() <= 1e-10 * np.abs(gradient).max()
    with np.load(tmp_path / "P1" / "forward" / "fields.npz") as f:
        assert str(f["chart"]) == name
        assert f["box"].tolist() == ([[-np.pi], [np.pi]] if name == "circle" else [[-180, -90], [180, 90]])
    for command in ("forward", "particles"):
        assert (tmp_path / "P1" / command / "densities.png").stat().st_size > 2000
    # the tokens are drawn on the chart: their angles (longitudes) spread over it
    from pdeformer.tools.figures import density_figure
    from pdeformer.commands.run_files import read_snapshots
    fig = density_figure(read_snapshots(str(tmp_path / "P1" / "particles" / "fields.npz")))
    ax = fig.axes[0]
    if name == "circle":     # a histogram over theta
        edges = [p.get_x() for p in ax.patches]
        assert min(edges) >= -np.pi - 1e-9 and max(edges) > 2.0
    else:
        lon_lat = ax.collections[0].get_offsets()
        assert np.all(np.abs(lon_lat[:, 0]) <= 180) and np.all(np.abs(lon_lat[:, 1]) <= 90)
        assert np.ptp(lon_lat[:, 0]) > 180


# ------------------------------------------------------------------ particles on the sphere

@pytest.mark.parametrize("d", [2, 3])
def test_sphere_samplers_draw_the_stated_densities(d):
    """Seeded draws lie on the sphere (radius 1.5) and have the moments of the density:
    the vMF mixture's mean (sum w A(kappa) R mu) and, for harmonics, E[Y(u)] =
    c / |S^{d-1}| for the unit sphere's measure (4 pi: orthonormal Y; S^1: c / 2 for cos
    l theta), to 5 standard errors; the uniform density has mean 0."""
    rng = np.random.default_rng(11)
    R, n = 1.5, 40000
    means = [[1.0, 0.5, -0.2][:d], [-0.3, 1.0, 0.4][:d]]
    vmf = sphere_prompt("von_mises_fisher", d, R, means=means, concentrations=[7.0, 2.0], weights=[0.7, 0.3])
    l, m, c = (3, -3, 0.6) if d == 2 else (2, 1, 1.5)
    harm = sphere_prompt("harmonics", d, R, coefficients=[[l, m, c]])
    uniform = sphere_prompt("uniform", d, R)
    for p in (vmf, harm, uniform):
        x = p.sample(n, rng)
        assert np.allclose(np.linalg.norm(x, axis=1), R, rtol=1e-14)
        if p is vmf:
            assert np.all(np.abs(x.mean(axis=0) - vmf.mean()) < 5 * x.std(axis=0) / math.sqrt(n))
        elif p is uniform:
            assert np.all(np.abs(x.mean(axis=0)) < 5 * R / math.sqrt(n))
        else:
            u = (x / R).T
            y = fourier_mode(l, m, u) if d == 2 else real_harmonic(l, m, u)
            expected = c / 2 if d == 2 else c / (4 * math.pi)
            assert abs(y.mean() - expected) < 5 * y.std() / math.sqrt(n), (y.mean(), expected)


def test_a_von_mises_fisher_narrower_than_the_mesh_is_refused():
    """Width R/sqrt(kappa) below 1/8 of the shortest edge: one error naming the
    concentrations and the kappa that would do; a resolvable one passes."""
    vmf = sphere_prompt("von_mises_fisher", 3, 2.0, means=[[1.0, 0.0, 0.0]] * 2, concentrations=[10.0, 1e6])
    error = vmf.unresolved(0.1, "prompts[0]")
    assert isinstance(error, ConfigError) and str(error).startswith("prompts[0].concentrations: component 1")
    assert "kappa <= 2.56e+04" in str(error)
    assert sphere_prompt("von_mises_fisher", 3, 2.0, means=[[1.0, 0.0, 0.0]],
                         concentrations=[2.5e4]).unresolved(0.1, "prompts[0]") is None


def test_a_harmonics_prompt_must_not_be_negative():
    """1 + 5 Y_10 < 0 near the south pole: refused naming the coefficients (the mesh
    model would project a signed density, the particle model could not sample it)."""
    with pytest.raises(ConfigError, match=r"^prompts\[0\]\.coefficients: 1 \+ sum c Y_lm is negative somewhere \(down to -1.4"):
        sphere_prompt("harmonics", 3, coefficients=[[1, 0, 5.0]])
    sphere_prompt("harmonics", 3, coefficients=[[1, 0, 0.99 * math.sqrt(4 * math.pi / 3)]])   # min 0.01


@requires_dolfinx
@pytest.mark.parametrize("shape, backend", [("sphere", "direct"), ("circle", "laplace"), ("sphere", "laplace")])
def test_particle_gradient_on_the_sphere_is_exact(tmp_path, shape, backend):
    """Tokens renormalised after every SSP-RK3 stage, velocity projected: the particle
    gradient (renormalisation and the moving projection differentiated) has Taylor
    remainders of order 2; tokens stay on the sphere to rounding."""
    from mpi4py import MPI
    from pdeformer.model.particles import ParticleAdjoint, ParticleSolver
    from pdeformer.solvers.problem import build_problem
    from checks import assert_taylor_order_two
    d = 3 if shape == "sphere" else 2
    raw = manifold_config(shape, 1 if d == 3 else 16,
                          {"kind": "von_mises_fisher", "means": [[1, 0.2, 0][:d], [0, -1, -1][:d]],
                           "concentrations": [3, 2], "target": {"mean": [0.1, 0.2, 0.3][:d], "cov": 0.1}},
                          discretisation={"scheme": "ssprk3", "steps_per_layer": None},
                          model={"layers": 2, "heads": 2, "seed": 4, "init_scale": 1.5},
                          attention={"backend": backend, "beta": 1.7, "tol": 1e-10},
                          particles={"tokens": 60, "steps_per_layer": 5}, objective={"kind": "moments"})
    problem = build_problem(check_config(raw, str(tmp_path)), MPI.COMM_WORLD, differentiable=True)
    solver = ParticleSolver(problem)
    x, _ = solver.solve_prompt(0)
    assert np.abs(np.linalg.norm(x, axis=1) - 1).max() < 1e-14
    adj = ParticleAdjoint(solver, problem.objective, problem.targets)
    assert_taylor_order_two(adj, adj.gradient(), problem.heads, np.random.default_rng(1))
    if backend == "laplace":
        assert solver.velocity_field.stats["laplace"] > 0 and solver.velocity_field.stats["direct"] == 0


@requires_dolfinx
def test_particles_and_mesh_agree_on_the_sphere(tmp_path):
    """The same vMF prompt and random heads (beta = 2) on an icosphere of 1,280 triangles
    and with 4,000 tokens: the means move alike (the change of the mean to 1e-2, a fifth
    of it and about four sampling standard errors: over token seeds 0-9 it was 1.6e-3 to
    6.6e-3; the means to 3e-2, four sampling standard errors) and the order parameters
    agree to 2e-2. The tokens take 3 steps per layer: their time error in the mean (about
    1e-4 against 10 steps) is far below the sampling error, and each step costs a
    direct sum over 4,000^2 pairs and 3 heads."""
    from pdeformer.model.particles import ParticleSolver
    from pdeformer.solvers.trackers import DiagnosticsTable
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from mpi4py import MPI
    raw = manifold_config("sphere", 3, {"kind": "von_mises_fisher", "means": [[1.0, 0.0, 0.2], [0.0, -1.0, -0.5]],
                                        "concentrations": [5.0, 3.0]},
                          discretisation={"limiter": True, "steps_per_layer": None},
                          model={"layers": 3, "heads": 3, "seed": 5, "init_scale": 1.5},
                          attention={"beta": 2.0}, particles={"tokens": 4000, "steps_per_layer": 3, "seed": 3})
    problem = build_problem(check_config(raw, str(tmp_path)), MPI.COMM_WORLD)
    rows = {}
    for solver in (ForwardSolver(problem), ParticleSolver(problem)):
        table = DiagnosticsTable(str(tmp_path / "d.csv"))
        solver.solve_prompt(0, [table])
        rows[type(solver).__name__] = table.rows
    mesh, part = rows["ForwardSolver"], rows["ParticleSolver"]
    moved = mesh[-1]["mean"] - mesh[0]["mean"]
    assert np.linalg.norm(moved) > 0.05
    assert np.abs((part[-1]["mean"] - part[0]["mean"]) - moved).max() < 1e-2
    assert np.abs(part[-1]["mean"] - mesh[-1]["mean"]).max() < 3e-2
    assert abs(part[-1]["extras"]["order"] - mesh[-1]["extras"]["order"]) < 2e-2


# ------------------------------------------------------------------ the peer particle code

def peer_euler(x0: np.ndarray, beta: float, T: float, dt: float) -> np.ndarray:
    """The integrator of the peer code (github:borjanG/2023-transformers-rotf, sphere.py,
    with A = V = I and the softmax denominator): explicit Euler of the unprojected
    attention velocity z_i' = sum_j softmax_j(beta <z_i, z_j>) z_j with step dt to time
    T, every token renormalised after each step (written here from that description)."""
    z = x0.copy()
    for _ in range(int(round(T / dt))):
        s = beta * z @ z.T
        s -= s.max(axis=1, keepdims=True)
        weights = np.exp(s)
        weights /= weights.sum(axis=1, keepdims=True)
        z = z + dt * weights @ z
        z /= np.linalg.norm(z, axis=1)[:, None]
    return z


@requires_dolfinx
@pytest.mark.parametrize("d", [2, 3])
def test_particles_agree_with_the_peer_code_to_its_time_step_error(tmp_path, d):
    """64 random tokens on S^{d-1}, beta = 1, A = V = I, the peer's time T = 3: our
    particle model (points prompt, L = 6 layers of V = T I, so depth t is the peer's time
    / T; SSP-RK3, 40 steps per layer: converged) against the peer's Euler steps dt = 0.1,
    0.05, 0.025. The largest token distance falls as dt (ratios within 0.2 of 2) and is
    below 0.1 at dt = 0.1: the positions agree within the peer's time-step error."""
    from mpi4py import MPI
    from pdeformer.model.particles import ParticleSolver
    from pdeformer.solvers.problem import build_problem
    rng = np.random.default_rng(0)
    T, L = 3.0, 6
    x0 = rng.normal(size=(64, d))
    x0 /= np.linalg.norm(x0, axis=1)[:, None]
    raw = manifold_config("sphere" if d == 3 else "circle", 0 if d == 3 else 8,
                          {"kind": "points", "points": x0.tolist()},
                          discretisation={"scheme": "ssprk3", "steps_per_layer": None},
                          model={"layers": L}, particles={"steps_per_layer": 40})
    problem = build_problem(check_config(raw, str(tmp_path)), MPI.COMM_WORLD)
    problem.heads = identity_heads(L, d)
    problem.heads.V[:] *= T
    x, _ = ParticleSolver(problem).solve_prompt(0)
    errors = np.array([np.abs(peer_euler(x0, 1.0, T, dt) - x).max() for dt in (0.1, 0.05, 0.025)])
    ratios = errors[:-1] / errors[1:]
    assert np.all(np.abs(ratios - 2) < 0.2) and errors[0] < 0.1, (errors, ratios)


@requires_dolfinx
def test_ntk_takes_sphere_prompts_by_quadrature(tmp_path):
    """The NTK test on the circle's and sphere's prompts (no closed form: the quadrature
    of their DG projections) runs and finds the shipped prompts independent."""
    for name, sets in (("circle", ["mesh.cells=[32]"]), ("sphere", ["mesh.refinements=2"])):
        out = tmp_path / name
        run_cli(["ntk", os.path.join(ROOT, "runs", f"{name}.toml"), "--set", f"output.dir={out}", *sets])
        import json
        with open(out / "ntk.json") as f:
            result = json.load(f)
        assert all("quadrature" in p["measure"] for p in result["prompts"]), result["prompts"]
        assert result["lse"]["independent"] and result["lse"]["ratio"] > 1e-2


@requires_dolfinx
def test_a_density_file_on_the_sphere_runs_like_its_density(tmp_path):
    """The mesh model started from a file of vMF values at 3,000 points of the sphere and
    from the vMF prompt itself (320 triangles, random heads): the means agree at t = 0
    and t = 1 to 1e-2 (the interpolation error of the file)."""
    rng = np.random.default_rng(4)
    vmf = {"kind": "von_mises_fisher", "means": [[0.3, 1.0, 0.2]], "concentrations": [3.0]}
    pts = sphere_prompt("uniform", 3, 1.0).sample(3000, rng)
    np.savez(tmp_path / "rho.npz", points=pts, density=sphere_prompt(**vmf, d=3).density(pts))
    means = []
    for prompt in (vmf, {"kind": "file", "path": str(tmp_path / "rho.npz")}):
        raw = manifold_config("sphere", 2, prompt, discretisation={"limiter": True, "steps_per_layer": None},
                              model={"layers": 2, "heads": 2, "seed": 5})
        _, rows = solve(raw, tmp_path)
        means.append(np.array([rows[0]["mean"], rows[-1]["mean"]]))
    assert np.abs(means[0] - means[1]).max() < 1e-2, means


@requires_dolfinx
def test_gradient_with_the_limiter_does_not_hang_where_a_rank_limits_nothing(tmp_path):
    """A 12-gon on 3 ranks: at the first limited stage one rank has no cell to limit. The
    limiter's Jacobian basis is a JIT compilation (collective): compiled on some ranks
    only it hung the gradient (found on this circle; a flat mesh can meet it too). Now it
    ends, with the gradient of one rank to 1e-10."""
    config = os.path.join(ROOT, "runs", "circle.toml")
    grads = []
    for P in (1, 3):
        out = tmp_path / f"P{P}"
        run_cli(["gradient", config, "--set", f"output.dir={out}", "mesh.cells=[12]", "model.layers=2"],
                nprocs=P, timeout=240)
        with np.load(out / "gradient.npz") as g:
            grads.append(np.concatenate([g[k].ravel() for k in ("dQ", "dK", "dV")]))
    assert np.abs(grads[1] - grads[0]).max() <= 1e-10 * np.abs(grads[0]).max()


@pytest.mark.parametrize("mesh, prompt, key", [
    ({"file": "m.xdmf", "radius": 2.0}, {"kind": "uniform"}, "mesh.radius"),
    ({"shape": "sphere", "refinements": 1}, {"kind": "harmonics", "coefficients": [[[1], 0, 0.1]]},
     "prompts[0].coefficients[0]"),
    ({"shape": "sphere", "refinements": 1}, {"kind": "points", "points": [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]},
     "prompts[0].points"),
    ({"shape": "circle", "cells": [8]}, {"kind": "gaussian_mixture", "means": [[1.0, 0.0]], "covs": [0.1]},
     "prompts[0].kind"),
])
def test_bad_manifold_inputs_are_one_line_errors(tmp_path, mesh, prompt, key):
    """Through the command line: exit status 2 and one line naming the key."""
    raw = {"mesh": mesh, "model": {"layers": 1, "heads": 1}, "prompts": [prompt]}
    path = tmp_path / "bad.toml"
    path.write_text(toml_dumps(raw))
    proc = run_cli(["forward", str(path), "--set", f"output.dir={tmp_path / 'out'}"], check=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def toml_dumps(raw: dict) -> str:
    """A small TOML writer for these tables (numbers, strings, nested lists)."""
    import json
    out = []
    for section, table in raw.items():
        if section == "prompts":
            for p in table:
                out.append("[[prompts]]")
                out += [f"{k} = {json.dumps(v)}" for k, v in p.items()]
        else:
            out.append(f"[{section}]")
            out += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("r", [1, 2, 3])
def test_the_sphere_chart_tiles_the_longitude_latitude_rectangle(r):
    """The icosphere's cells on the chart (tools/charts.py), polar triangles made
    quadrilaterals (plot.polar_quads): their areas add up to 360 x 180 exactly (no gap,
    no overlap; a cell across +-180 counts once); without the quadrilaterals the polar
    wedges are missing. (r >= 1: the poles are vertices; a cell with a pole inside, as
    on the bare icosahedron, has no place on the chart.)"""
    from pdeformer.tools.figures import polar_quads
    from pdeformer.fem.mesh import icosphere
    from pdeformer.tools.charts import chart
    x, tri = icosphere(r)
    points = chart(x[tri], "sphere").reshape(-1, 2)           # every cell's corners
    cells = np.arange(3 * len(tri)).reshape(-1, 3)

    def area(points, cells):
        p = points[cells]
        return 0.5 * np.abs((p[:, 1, 0] - p[:, 0, 0]) * (p[:, 2, 1] - p[:, 0, 1])
                            - (p[:, 2, 0] - p[:, 0, 0]) * (p[:, 1, 1] - p[:, 0, 1])).sum()
    assert area(points, cells) < 0.97 * 360 * 180
    points, cells, _ = polar_quads(points, cells, np.arange(len(tri)))
    assert area(points, cells) == pytest.approx(360.0 * 180.0, rel=1e-12)
