"""The laplace backend (log-Laplace table) against direct summation, its reverse mode,
numerical safety for sharp attention, and the auto fallback. Pure numpy + MPI."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from pdeformer.attention import Sources, attention_matrices, tilted_moments
from pdeformer.laplace import (LaplaceTable, b_range, barycentric_weights, chebyshev_lobatto,
                               choose_table, differentiation_matrix, grid_box)

COMM = MPI.COMM_SELF


def grid_sources(density, lo=-4.0, hi=4.0, n=80, d=2):
    g = np.linspace(lo, hi, n + 1)[:-1] + (hi - lo) / n / 2
    pts = np.stack(np.meshgrid(*[g] * d), -1).reshape(-1, d)
    return pts, density(pts) * ((hi - lo) / n) ** d


DENSITIES = {
    "two_blobs": lambda y: np.exp(-np.sum((y - [-1, 0]) ** 2, 1) / 0.3) + np.exp(-np.sum((y - [1, 0.5]) ** 2, 1) / 0.2),
    "skewed": lambda y: np.exp(-((y[:, 0] - 0.5 * y[:, 1] ** 2) ** 2) / 0.02 - y[:, 1] ** 2 / 4),   # a thin banana
    "box_edge": lambda y: ((np.abs(y[:, 0] - 0.3) < 1.1) & (np.abs(y[:, 1]) < 2.0)) * (1 + y[:, 0] ** 2),
}


def case(name, scale, seed, heads=6):
    rng = np.random.default_rng(seed)
    y, w = grid_sources(DENSITIES[name])
    x = rng.uniform(-4, 4, (400, 2))
    A = attention_matrices(scale * rng.standard_normal((heads, 2, 2)), rng.standard_normal((heads, 2, 2)))
    return x, y, w, A


@pytest.mark.parametrize("name", sorted(DENSITIES))
@pytest.mark.parametrize("tol", [1e-5, 1e-9])
def test_laplace_meets_tol_against_direct(name, tol):
    x, y, w, A = case(name, 0.6, seed=len(name))
    direct = tilted_moments(x, Sources.from_arrays(y, w), A).mean
    table, est = choose_table(y, w, *b_range(x, A, COMM), COMM, tol, n_max=1025)
    assert est <= tol
    b = np.einsum("hij,nj->hni", A, x).reshape(-1, 2)
    m = table.means(b).reshape(direct.shape)
    err = np.abs(m - direct).max() / np.abs(direct).max()
    assert err <= tol, (err, est, table.n)


def test_one_dimension():
    rng = np.random.default_rng(3)
    y = np.linspace(-3, 3, 301)[:, None]
    w = np.exp(-(y[:, 0] - 0.4) ** 2) * (1 + 0.5 * np.sin(3 * y[:, 0])) * 0.02
    x = rng.uniform(-3, 3, (50, 1))
    A = rng.normal(size=(4, 1, 1))
    direct = tilted_moments(x, Sources.from_arrays(y, w), A).mean
    table, est = choose_table(y, w, *b_range(x, A, COMM), COMM, 1e-10)
    m = table.means(np.einsum("hij,nj->hni", A, x).reshape(-1, 1)).reshape(direct.shape)
    assert np.abs(m - direct).max() / np.abs(direct).max() < 1e-10 and est <= 1e-10


def test_sharp_attention_does_not_overflow():
    """Two clusters far apart, |b| up to 80: <b, y> reaches 1500 and the per-axis factors
    of the two clusters differ by e^1000, so one shift per grid node cannot hold both;
    the tiled, log-domain table still gives the exact tilted means at its nodes."""
    rng = np.random.default_rng(4)
    y = np.vstack([rng.uniform(8.5, 9.5, (300, 2)), rng.uniform(0.0, 1.0, (300, 2))])
    w = rng.uniform(0.5, 1.0, len(y))
    lo, hi = np.array([-80.0, -80.0]), np.array([80.0, 80.0])
    with np.errstate(over="ignore"):
        assert not np.all(np.isfinite(np.exp(hi @ y.T)))
    table = LaplaceTable(y, w, lo, hi, 17, COMM)
    assert len(table.tiles) > 1
    nodes = np.stack(np.meshgrid(table.axes[0][0], table.axes[1][0], indexing="ij"), -1).reshape(-1, 2)
    direct = tilted_moments(nodes, Sources.from_arrays(y, w), np.eye(2)[None]).mean[0]
    at_nodes = table.m.reshape(2, -1).T
    assert np.all(np.isfinite(at_nodes))
    np.testing.assert_allclose(at_nodes, direct, rtol=1e-12, atol=1e-12)


def test_reverse_mode_is_the_derivative_of_the_table_map():
    """With the grid fixed, v = sum_h V_h m(A_h x)/H from the table is a smooth function
    of w and A; the table's reverse mode matches central differences."""
    x, y, w, A = case("two_blobs", 0.5, seed=5, heads=3)
    lo, hi = grid_box(*b_range(x, A, COMM))
    V = np.random.default_rng(6).normal(size=(3, 2, 2))
    g = np.random.default_rng(7).normal(size=x.shape)

    def f(w, A, V):
        t = LaplaceTable(y, w, lo, hi, 33, COMM)
        m = t.means(np.einsum("hij,nj->hni", A, x).reshape(-1, 2)).reshape(3, -1, 2)
        return np.sum(g * np.einsum("hij,hnj->ni", V, m) / 3)

    t = LaplaceTable(y, w, lo, hi, 33, COMM)
    b = np.einsum("hij,nj->hni", A, x).reshape(-1, 2)
    u = np.einsum("nk,hkj->hnj", g, V) / 3
    m, J, mbar = t.reverse(b, u.reshape(-1, 2))
    m, J = m.reshape(3, -1, 2), J.reshape(3, -1, 2, 2)
    np.testing.assert_allclose(m, t.means(b).reshape(3, -1, 2), rtol=1e-14)
    np.testing.assert_allclose(J, t.jacobians(b).reshape(3, -1, 2, 2), rtol=1e-12, atol=1e-14)
    cot = {"w": t.weights_cotangent(mbar),
           "A": np.einsum("hnka,hnk,nc->hac", J, u, x), "V": np.einsum("nk,hnj->hkj", g, m) / 3}
    rng = np.random.default_rng(8)
    for name, arr in (("w", w), ("A", A), ("V", V)):
        d = rng.normal(size=arr.shape) * (w if name == "w" else 1)

        def args(e):
            moved = {"w": w, "A": A, "V": V}
            moved[name] = moved[name] + e * d
            return moved["w"], moved["A"], moved["V"]

        fd = (f(*args(1e-6)) - f(*args(-1e-6))) / 2e-6
        assert abs(fd - np.sum(cot[name] * d)) < 1e-7 * max(1, abs(fd)), (name, fd, np.sum(cot[name] * d))


def test_interpolation_building_blocks():
    nodes, lam = chebyshev_lobatto(12, -2.0, 3.0)
    p = lambda t: 1 - 2 * t + 0.5 * t**5
    x = np.array([-2.0, -1.3, 0.0, nodes[5], 2.99])
    np.testing.assert_allclose(barycentric_weights(x, nodes, lam) @ p(nodes), p(x), rtol=1e-12)
    np.testing.assert_allclose(differentiation_matrix(nodes, lam) @ p(nodes), -2 + 2.5 * nodes**4, rtol=1e-9, atol=1e-9)
    lo, hi = grid_box(np.array([-1.3, 0.2]), np.array([2.7, 0.21]))
    assert np.all(lo < [-1.3, 0.2]) and np.all(hi > [2.7, 0.21])
    lo2, hi2 = grid_box(np.array([-1.3001, 0.2001]), np.array([2.7001, 0.2099]))
    np.testing.assert_array_equal(lo, lo2)            # small changes keep the box
    np.testing.assert_array_equal(hi, hi2)


def test_two_level_interpolation_accuracy_and_reverse_mode():
    """The fine uniform grid with local degree-5 interpolation stays within tol of the
    Chebyshev interpolant, and its reverse mode is the derivative of its own map."""
    from pdeformer.laplace import FineGrid, fine_grid
    x, y, w, A = case("two_blobs", 0.5, seed=9, heads=2)
    lo, hi = grid_box(*b_range(x, A, COMM))
    table = LaplaceTable(y, w, lo, hi, 129, COMM)
    fg = fine_grid(table, 1e-9)
    assert fg is not None and fg.error() <= 5e-10
    b = np.einsum("hij,nj->hni", A, x).reshape(-1, 2)
    assert np.abs(fg.means(b) - table.means(b)).max() <= 1e-9 * np.abs(table.m).max()
    u = np.random.default_rng(1).normal(size=b.shape)
    m, J, mbar = fg.reverse(b, u)
    # d<u, m(b)>/db by central differences of the two-level map (J), and its transpose
    db = 1e-6 * np.random.default_rng(2).normal(size=b.shape)
    fd = (np.sum(u * fg.means(b + db)) - np.sum(u * fg.means(b - db))) / 2
    assert abs(fd - np.einsum("pk,pka,pa->", u, J, db)) < 1e-8 * abs(fd)
    # <mbar, T> = <u, m(T)> for the linear map table -> values (table values perturbed)
    T = np.random.default_rng(3).normal(size=table.m.shape)
    saved = table.m.copy()
    table.m[:] = T
    moved = FineGrid(table, fg.nf).means(b)
    table.m[:] = saved
    assert abs(np.sum(mbar * T) - np.sum(u * moved)) < 1e-10 * abs(np.sum(u * moved))
