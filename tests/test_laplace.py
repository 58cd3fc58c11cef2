"""The laplace backend (log-Laplace table) against direct summation, its reverse mode,
numerical safety for sharp attention, and the auto fallback. Pure numpy + MPI."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from checks import central_derivative
from pdeformer.model.schema import AttentionOptions
from pdeformer.attention.softmax import Sources, attention_matrices, tilted_moments
from pdeformer.attention.laplace import (LaplaceTable, b_range, barycentric_weights, chebyshev_lobatto,
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


SIZES = {2: dict(heads=6, sources=80**2, targets=400), 3: dict(heads=4, sources=4000, targets=300)}


def case(d, kind, seed, scale=0.8, heads=None, sources=None, targets=None):
    """Targets x, sources y with weights w and random heads A (attention_matrices) and V
    (H, d, d) of a d-dimensional case; heads, sources and targets default to SIZES[d].
    d = 2: the density DENSITIES[kind] at the centres of a square grid of cells over
    [-4, 4]^2, times the cell area, uniform targets there. d = 3: sources and targets on
    the unit sphere (kind "sphere", a von Mises-Fisher-like density) or in [-1.5, 1.5]^3
    (kind "box", two Gaussian blobs), the weights summing to 1."""
    heads, sources, targets = (SIZES[d][k] if v is None else v
                               for k, v in (("heads", heads), ("sources", sources), ("targets", targets)))
    rng = np.random.default_rng(seed)
    if d == 2:
        y, w = grid_sources(DENSITIES[kind], n=int(round(np.sqrt(sources))))
        x = rng.uniform(-4, 4, (targets, 2))
    elif kind == "sphere":
        y = rng.normal(size=(sources, 3))
        y /= np.linalg.norm(y, axis=1)[:, None]
        w = np.exp(2.0 * y @ [0.6, 0.0, 0.8]) + 0.5 * np.exp(3.0 * y @ [-1.0, 0.0, 0.0])
        x = rng.normal(size=(targets, 3))
        x /= np.linalg.norm(x, axis=1)[:, None]
    else:
        y = rng.uniform(-1.5, 1.5, (sources, 3))
        w = np.exp(-np.sum((y - [0.4, 0, 0]) ** 2, 1) / 0.4) + np.exp(-np.sum((y + [0.3, -0.2, 0.4]) ** 2, 1) / 0.3)
        x = rng.uniform(-1.5, 1.5, (targets, 3))
    if d == 3:
        w = w / w.sum()
    A = attention_matrices(scale * rng.standard_normal((heads, 2, d)), rng.standard_normal((heads, 2, d)))
    V = rng.normal(size=(heads, d, d))
    return x, y, w, A, V


@pytest.mark.parametrize("d, kind", [(2, name) for name in sorted(DENSITIES)] + [(3, "sphere"), (3, "box")])
@pytest.mark.parametrize("tol", [1e-5, 1e-9])
def test_table_and_fine_grid_meet_tol_against_direct(d, kind, tol):
    """The table of the size choose_table picks (n^d Chebyshev nodes, up to 1025 in 2-D
    and 97 in 3-D) gives the tilted means m(A_h x) to tol of their largest value against
    direct summation, and with its fine grid (6^d-node stencils) the velocity
    v = sum_h V_h m(A_h x) / H to tol of its largest value."""
    from pdeformer.attention.laplace import fine_grid
    x, y, w, A, V = case(d, kind, seed=len(kind), scale={2: 0.6, 3: 0.8}[d])
    table, est = choose_table(y, w, *b_range(x, A, COMM), COMM, tol, n_max={2: 1025, 3: 97}[d])
    assert est <= tol and table.d == d
    direct = tilted_moments(x, Sources.from_arrays(y, w), A).mean
    m = table.means(np.einsum("hij,nj->hni", A, x).reshape(-1, d)).reshape(direct.shape)
    err = np.abs(m - direct).max() / np.abs(direct).max()
    assert err <= tol, (err, est, table.n)
    interp = fine_grid(table, tol) or table
    # direct summation's velocity from its tilted means (softmax.attention_velocity)
    v, direct = interp.velocity(x, A, V), np.einsum("hij,hnj->ni", V, direct) / len(A)
    err = np.abs(v - direct).max() / np.abs(direct).max()
    assert err <= tol, (err, est, table.n, getattr(interp, "nf", None))


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
    assert len(table.layout.tiles) > 1
    nodes = np.stack(np.meshgrid(table.axes[0][0], table.axes[1][0], indexing="ij"), -1).reshape(-1, 2)
    direct = tilted_moments(nodes, Sources.from_arrays(y, w), np.eye(2)[None]).mean[0]
    at_nodes = table.m.reshape(2, -1).T
    assert np.all(np.isfinite(at_nodes))
    np.testing.assert_allclose(at_nodes, direct, rtol=1e-12, atol=1e-12)
    # what the table keeps for its reverse: one grid of partition sums per tile, which
    # give log Z and the weights' cotangent across the tiles
    assert table.nbytes == table.values.nbytes + len(table.layout.tiles) * 8 * 17**2
    logs = nodes @ y.T + np.log(w)
    top = logs.max(axis=1)
    log_z = top + np.log(np.exp(logs - top[:, None]).sum(axis=1))
    np.testing.assert_allclose(table.log_z.ravel(), log_z, rtol=1e-13)
    mbar = np.random.default_rng(5).normal(size=table.values.shape)
    wbar = table.weights_cotangent(mbar)
    d = np.random.default_rng(6).normal(size=w.shape) * w

    def pairing(e):
        return np.sum(mbar * LaplaceTable(y, w + e * d, lo, hi, 17, COMM).values)

    fd = central_derivative(pairing, 1e-6)
    assert abs(fd - wbar @ d) < 1e-7 * max(1.0, abs(fd)), (fd, wbar @ d)


@pytest.mark.parametrize("d", [2, 3])
def test_reverse_mode_is_the_derivative_of_the_table_map(d):
    """With the grid fixed, <g, v> for v = sum_h V_h m(A_h x) / H is a smooth function
    of w, A, V (through the table's Chebyshev interpolant) and of w, y, A, V, x (through
    its fine grid); each reverse mode matches central differences, reverse() repeats
    means() and jacobians(), and the compiled loop gives numpy's map and cotangents."""
    from pdeformer.attention.laplace import FineGrid, HeadSums
    kind, seed, scale, sources, targets, n, nf = {2: ("two_blobs", 5, 0.5, 80**2, 400, 33, 132),
                                                  3: ("box", 3, 0.8, 600, 80, 25, 60)}[d]
    x, y, w, A, V = case(d, kind, seed, scale, heads=3, sources=sources, targets=targets)
    H = len(A)
    g = np.random.default_rng(4).normal(size=x.shape)
    lo, hi = grid_box(*b_range(x, A, COMM))
    lo, hi = lo - 0.5, hi + 0.5                     # room for the moved targets
    rng = np.random.default_rng(5)

    # the table's interpolant: v from means(), its reverse through reverse()
    def f(w, A, V):
        m = LaplaceTable(y, w, lo, hi, n, COMM).means(np.einsum("hij,nj->hni", A, x).reshape(-1, d))
        return np.sum(g * np.einsum("hij,hnj->ni", V, m.reshape(H, -1, d)) / H)

    t = LaplaceTable(y, w, lo, hi, n, COMM)
    b = np.einsum("hij,nj->hni", A, x).reshape(-1, d)
    u = np.einsum("nk,hkj->hnj", g, V) / H
    m, J, mbar = t.reverse(b, u.reshape(-1, d))
    m, J = m.reshape(H, -1, d), J.reshape(H, -1, d, d)
    # the same interpolant, through products of other shapes: round-off of the largest value
    np.testing.assert_allclose(m, t.means(b).reshape(H, -1, d), rtol=0, atol=1e-14 * np.abs(m).max())
    np.testing.assert_allclose(J, t.jacobians(b).reshape(H, -1, d, d), rtol=1e-12, atol=1e-14)
    cot = {"w": t.weights_cotangent(mbar),
           "A": np.einsum("hnka,hnk,nc->hac", J, u, x), "V": np.einsum("nk,hnj->hkj", g, m) / H}
    for name, arr in (("w", w), ("A", A), ("V", V)):
        dn = rng.normal(size=arr.shape) * (w if name == "w" else 1)
        moved = lambda e: {"w": w, "A": A, "V": V} | {name: arr + e * dn}
        fd = central_derivative(lambda e: f(*moved(e).values()), 1e-6)
        assert abs(fd - np.sum(cot[name] * dn)) < 1e-7 * max(1, abs(fd)), (name, fd, np.sum(cot[name] * dn))

    # the fine grid: v from velocity(), its reverse through velocity_vjp()
    def interp(y, w):
        return FineGrid(LaplaceTable(y, w, lo, hi, n, COMM), nf)

    fg = FineGrid(t, nf)
    mbar, dA, dV, xbar = fg.velocity_vjp(x, A, V, g, positions=True)
    if fg.lib is not None:                           # compiled against numpy
        ref = HeadSums.velocity_vjp(fg, x, A, V, g, True)
        for a, b in zip((mbar, dA, dV, xbar), ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * np.abs(b).max())
        v = HeadSums.velocity(fg, x, A, V)
        np.testing.assert_allclose(fg.velocity(x, A, V), v, rtol=0, atol=1e-13 * np.abs(v).max())
    wbar, ybar = fg.table.source_cotangents(mbar, positions=True)
    dw, dy, dx = rng.normal(size=w.shape) * w, rng.normal(size=y.shape), rng.normal(size=x.shape)
    dAd, dVd = rng.normal(size=A.shape), rng.normal(size=V.shape)
    shifted = lambda e: interp(y + e * dy, w + e * dw).velocity(x + e * dx, A + e * dAd, V + e * dVd)
    fd = central_derivative(lambda e: np.sum(g * shifted(e)), 1e-6)
    ad = sum(np.sum(a * b) for a, b in ((wbar, dw), (ybar, dy), (xbar, dx), (dA, dAd), (dV, dVd)))
    assert abs(fd - ad) < 1e-7 * max(1.0, abs(fd)), (fd, ad)


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
    """The fine uniform grid with local degree-5 interpolation stays within tol/2 of the
    Chebyshev interpolant at every target (its sampled check within tol/4), and its
    reverse mode is the derivative of its own map."""
    from pdeformer.attention.laplace import FineGrid, fine_grid
    x, y, w, A, _ = case(2, "two_blobs", seed=9, scale=0.5, heads=2)
    lo, hi = grid_box(*b_range(x, A, COMM))
    table = LaplaceTable(y, w, lo, hi, 129, COMM)
    fg = fine_grid(table, 1e-9)
    assert fg is not None and fg.error() <= 2.5e-10
    b = np.einsum("hij,nj->hni", A, x).reshape(-1, 2)
    assert np.abs(fg.means(b) - table.means(b)).max() <= 5e-10 * np.abs(table.m).max()
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


# ---------------------------------------------------------------- compiled fine-grid loop
def test_panel_node_limit_is_the_compiled_one():
    """The C files lie in the package directory and pyproject's package-data ships them;
    PANEL_QMAX (what LaplaceTable checks before using the panel loops) is defined once,
    in Python: the C file has no QMAX of its own, the library built with -DQMAX reports
    PANEL_QMAX, and its panel loops take q = PANEL_QMAX nodes per panel, not one more."""
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    import pdeformer
    from pdeformer.attention import compiled
    from pdeformer.attention.laplace import Panels
    package = Path(pdeformer.__file__).resolve().parent / "attention"
    files = compiled.kernel_files()
    assert {f.name for f in files} >= {"laplace_kernels.c", "fine_loops.h", "vector.h"}
    assert all(f.parent == package / "kernels" for f in files)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["pdeformer.attention"]
    assert all(any(fnmatch(f.relative_to(package).as_posix(), g) for g in shipped) for f in files)
    assert "#define QMAX" not in compiled.KERNEL_SOURCE.read_text()
    if NO_COMPILED:
        pytest.skip("no C compiler, or PDEFORMER_NO_KERNEL set")
    lib = compiled.kernels()
    assert lib is not None, "the C loops did not compile here"
    assert lib.panel_qmax() == compiled.PANEL_QMAX
    rng = np.random.default_rng(2)
    y, cols = rng.uniform(0.0, 1.0, (50, 2)), rng.normal(size=(50, 2))
    for q in (compiled.PANEL_QMAX, compiled.PANEL_QMAX + 1):
        panels = [Panels(0.0, 1.0, 1.0, q) for a in range(2)]
        if q > compiled.PANEL_QMAX:
            with pytest.raises(MemoryError):       # the loops' refusal (status -1)
                compiled.panel_spread(lib, panels, y, cols)
        else:                                     # Lagrange weights sum to 1
            W = compiled.panel_spread(lib, panels, y, cols)
            np.testing.assert_allclose(W.sum(axis=(1, 2)), cols.sum(axis=0), rtol=1e-10)


NO_COMPILED = (shutil.which(os.environ.get("CC", "cc")) is None
               or os.environ.get("PDEFORMER_NO_KERNEL", "") not in ("", "0"))
needs_compiled = pytest.mark.skipif(NO_COMPILED, reason="no C compiler, or PDEFORMER_NO_KERNEL set")

def _fine_case(heads=5, seed=11):
    from pdeformer.attention.laplace import FineGrid
    x, y, w, A, _ = case(2, "skewed", seed=seed, scale=0.5, heads=heads)
    lo, hi = grid_box(*b_range(x, A, COMM))
    table = LaplaceTable(y, w, lo, hi, 65, COMM)
    V = np.random.default_rng(seed + 1).normal(size=(heads, 2, 2))
    return x, y, w, A, V, lo, hi, FineGrid(table, 260)


@pytest.fixture(params=["host", "portable"])
def kernel_build(request, tmp_path, monkeypatch):
    """The C loop built for this CPU (-march=native: AVX vectors where there are) and
    without CPU-specific flags (two-double vectors on x86-64), each fresh."""
    from pdeformer.attention import compiled
    saved = dict(compiled._loaded)
    monkeypatch.setenv("PDEFORMER_CACHE", str(tmp_path / "cache"))
    if request.param == "portable":
        monkeypatch.setattr(compiled, "HOST_FLAGS", [])
    compiled._loaded.clear()
    yield request.param
    compiled._loaded.clear()
    compiled._loaded.update(saved)


@needs_compiled
def test_compiled_fine_grid_loop_is_the_numpy_map_and_its_exact_reverse(kernel_build):
    """The compiled loop gives the numpy two-level map (to round-off), also for targets
    whose b lies outside the grid (the clamped stencil extrapolates) and without a crash
    for a NaN target; its reverse mode -- dA, dV and the table cotangent -- is the
    derivative of that map."""
    from pdeformer.attention.compiled import kernels
    from pdeformer.attention.laplace import FineGrid, HeadSums
    assert kernels() is not None, "the C loop did not compile here"
    x, y, w, A, V, lo, hi, fg = _fine_case()
    v = fg.velocity(x, A, V)
    np.testing.assert_allclose(v, HeadSums.velocity(fg, x, A, V), rtol=0, atol=1e-13 * np.abs(v).max())
    outside = 1.05 * x                            # some b just beyond the box
    assert np.any(np.abs(np.einsum("hij,nj->hni", A, outside)) > np.maximum(-lo, hi))
    v_out = fg.velocity(outside, A, V)
    np.testing.assert_allclose(v_out, HeadSums.velocity(fg, outside, A, V), rtol=0,
                               atol=1e-12 * np.abs(v_out).max())
    bad = x[:5].copy()
    bad[2] = np.nan
    v_bad = fg.velocity(bad, A, V)
    assert np.isnan(v_bad[2]).all() and np.isfinite(np.delete(v_bad, 2, axis=0)).all()
    g = np.random.default_rng(3).normal(size=x.shape)
    mbar, dA, dV, _ = fg.velocity_vjp(x, A, V, g)
    for got, want in zip((mbar, dA, dV), HeadSums.velocity_vjp(fg, x, A, V, g)[:3]):
        # same products in another order: round-off (1e-14 measured) over ~100 terms
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())

    rng = np.random.default_rng(4)
    for name, arr, ct in (("A", A, dA), ("V", V, dV)):
        d = rng.normal(size=arr.shape)
        fd = central_derivative(lambda e: np.sum(g * fg.velocity(x, A + e * d if name == "A" else A,
                                                                  V + e * d if name == "V" else V)), 1e-6)
        assert abs(fd - np.sum(ct * d)) < 1e-7 * max(1.0, abs(fd)), (name, fd, np.sum(ct * d))
    # v is linear in the table's m: <mbar, T> = <g, v with m replaced by T>
    T = rng.normal(size=fg.table.m.shape)
    saved = fg.table.m.copy()
    fg.table.m[:] = T
    moved = FineGrid(fg.table, fg.nf).velocity(x, A, V)
    fg.table.m[:] = saved
    assert abs(np.sum(mbar * T) - np.sum(g * moved)) < 1e-11 * np.abs(g * moved).sum()


def test_without_a_compiler_the_numpy_loop_is_used(tmp_path, monkeypatch, caplog):
    """No compiler (and an empty kernel cache): kernels() is None, the fine grid still
    gives the same velocities through numpy, and the user is told once why it is slow."""
    from pdeformer.attention import compiled
    from pdeformer.attention.laplace import FineGrid
    x, y, w, A, V, lo, hi, fg = _fine_case(heads=2)
    saved = dict(compiled._loaded)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PDEFORMER_CACHE", str(tmp_path / "cache"))
    try:
        compiled._loaded.clear()
        assert compiled.kernels() is None
        with caplog.at_level("WARNING", logger="pdeformer"):
            numpy_fg = FineGrid(fg.table, fg.nf)
            FineGrid(fg.table, fg.nf)
        assert numpy_fg.lib is None
        assert caplog.text.count("the compiled loops cannot be built or loaded (FileNotFoundError") == 1
        v = numpy_fg.velocity(x, A, V)
        empty = numpy_fg.velocity(x[:0], A, V)
    finally:
        compiled._loaded.clear()
        compiled._loaded.update(saved)
    np.testing.assert_allclose(v, fg.velocity(x, A, V), rtol=0, atol=1e-13 * np.abs(v).max())
    assert empty.shape == (0, 2) and fg.velocity(x[:0], A, V).shape == (0, 2)


@needs_compiled
def test_compiled_loops_that_fail_their_check_are_not_used(tmp_path, monkeypatch, caplog):
    """A library whose fine-grid loop does not reproduce a linear m (here: one that
    writes nothing) fails self_check; kernels() then warns and returns None."""
    from pdeformer.attention import compiled

    class Broken:
        def fine_velocity2(self, *args):
            pass

        fine_velocity4 = fine_velocity2

    assert not compiled.self_check(Broken())

    class Broken3:                     # 2-D loops that work, 3-D ones that write nothing
        def __init__(self):
            self.lib = compiled.kernels()

        def __getattr__(self, name):
            return (lambda *args: None) if name.startswith("fine3") else getattr(self.lib, name)

    if not NO_COMPILED:
        assert compiled.self_check(compiled.kernels()) and not compiled.self_check(Broken3())
    saved = dict(compiled._loaded)
    monkeypatch.setenv("PDEFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "self_check", lambda lib: False)
    try:
        compiled._loaded.clear()
        with caplog.at_level("WARNING", logger="pdeformer"):
            assert compiled.kernels() is None
    finally:
        compiled._loaded.clear()
        compiled._loaded.update(saved)
    assert "fail their check" in caplog.text


def test_a_rank_without_targets_takes_part():
    """No targets here (a rank may own no velocity nodes): empty velocities, zero head
    cotangents, and the table cotangent of the others (the collective is reached)."""
    x, y, w, A, V, lo, hi, fg = _fine_case(heads=2)
    mbar, dA, dV, _ = fg.velocity_vjp(x[:0], A, V, np.zeros((0, 2)))
    assert mbar.shape == fg.table.m.shape and not mbar.any() and not dA.any() and not dV.any()


def test_fine_grid_refuses_fewer_points_than_its_stencil():
    from pdeformer.attention.laplace import FineGrid
    x, y, w, A, V, lo, hi, fg = _fine_case(heads=1)
    with pytest.raises(ValueError, match="stencil needs 6"):
        FineGrid(fg.table, 5)


def test_fine_grid_derivative_is_exact_on_grid_nodes():
    """b exactly on a fine-grid node: the Lagrange derivative weights are products, so
    the Jacobian is that of the stencil the node belongs to (one-sided differences into
    its cell: the interpolant is only continuous across cells) -- no 1/(t - c)
    cancellation as with a nudged 1/(t - c) formula."""
    x, y, w, A, V, lo, hi, fg = _fine_case(heads=1)
    b = fg.table.lo + fg.h * np.array([[7.0, 11.0], [fg.nf - 1.0, 0.0], [20.0, 33.0]])
    _, J, _ = fg.reverse(b, np.ones_like(b))
    t = (b - fg.table.lo) / fg.h                 # on a node up to round-off: which cell?
    side = np.where(t - np.floor(t) < 0.5, 1.0, -1.0)
    for a in range(2):
        e = np.zeros_like(b)
        e[:, a] = side[:, a] * 1e-4 * fg.h[a]
        fd = (-3 * fg.means(b) + 4 * fg.means(b + e) - fg.means(b + 2 * e)) / (2e-4 * side[:, a:a + 1] * fg.h[a])
        np.testing.assert_allclose(J[:, :, a], fd, rtol=1e-6, atol=1e-8 * np.abs(fg.table.m).max())


# ---------------------------------------------------------------- the backends of AttentionVelocity
def _field(backend, tol, d=2, heads=4, scale=0.4, seed=0):
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.model.velocity import AttentionVelocity
    hm = HeadMeasure.random(1, heads, d, d, seed=seed, scale=scale)
    rng = np.random.default_rng(seed)
    return AttentionVelocity(rng.uniform(-2, 2, (300, d)), hm, AttentionOptions(backend=backend, tol=tol), COMM), hm


def attention_velocity_direct(x, y, w, hm):
    from pdeformer.attention.softmax import attention_velocity
    return attention_velocity(x, Sources.from_arrays(y, w), hm.attention_matrices(0), hm.values(0))


def test_partition_ratio_is_the_signed_over_the_absolute_sum():
    """Z_h(x) / Z_h^|w|(x) against the sums written out (exponents small enough for a
    plain sum); 1 for weights >= 0; a shift of all scores by 700 (e^700 near overflow)
    leaves it unchanged."""
    field, hm = _field("direct", 1e-8, heads=3, scale=0.8)
    rng = np.random.default_rng(5)
    y = rng.uniform(-2, 2, (400, 2))
    w = rng.uniform(-0.3, 1.0, 400)
    x = np.array([1.2, -0.7])
    A = hm.attention_matrices(0)
    e = np.exp(y @ (A @ x).T)                                   # (400, H)
    ratio = (w @ e) / (np.abs(w) @ e)
    np.testing.assert_allclose(field.partition_ratio(y, w, 0, x), ratio, rtol=1e-12)
    np.testing.assert_allclose(field.partition_ratio(y, np.abs(w), 0, x), 1.0, rtol=1e-14)
    b0 = A[0] @ x
    far = y + 700 * b0 / (b0 @ b0)                              # head 0's scores + 700
    np.testing.assert_allclose(field.partition_ratio(far, w, 0, x)[0], ratio[0], rtol=1e-10)


def test_auto_uses_the_table_where_it_pays_and_meets_tol():
    y, w = grid_sources(DENSITIES["two_blobs"], n=100)       # 10^4 sources
    field, hm = _field("auto", 1e-7, heads=8)
    v = field(y, w, 0)
    assert field.stats["laplace"] == 1 and field.stats["direct"] == 0
    assert field.last_plan is not None
    ref = attention_velocity_direct(field.targets, y, w, hm)
    err = np.abs(v - ref).max() / np.abs(ref).max()
    # the reported estimate bounds the velocity's error relative to its largest value
    # (tol is the table's accuracy relative to its values: heads' V and cancellation between
    # them scale it, see test_reported_estimate_bounds_the_velocity_error)
    assert err <= 1e-7 and err <= field.stats["largest_estimate"] <= 1e-6, (err, field.stats)


@pytest.mark.parametrize("kind", ["tokens", "signed", "1-D"])
def test_reported_estimate_bounds_the_velocity_error(kind):
    """The particle model's velocity through 'auto' at tol 1e-8 (2000 tokens of a
    mixture, sources and targets, 8 heads) differs from direct summation by up to 5e-9
    of its largest value -- mostly the fine grid's interpolation, within tol/4 of the
    table's values but scaled by |V_h| |m| / max |v| -- where the table's coefficient
    tail alone says 1.7e-13. The reported estimate (stats["largest_estimate"]) bounds the
    error of every evaluation: also for signed weights (mu / zeta) and in 1-D
    (barycentric, no fine grid)."""
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.model.prompts import GaussianMixture
    from pdeformer.model.velocity import AttentionVelocity
    d = 1 if kind == "1-D" else 2
    rng = np.random.default_rng(0)
    g = GaussianMixture([1, 1], [[0.5, 0.2][:d], [-0.6, 0.1][:d]], [np.eye(d) * 0.2, np.eye(d) * 0.3])
    x = g.sample(2000, rng)
    w = np.full(len(x), 1 / len(x))
    if kind == "signed":
        w[rng.random(len(x)) < 0.1] *= -0.05
    heads = HeadMeasure.random(2, 8, d, d, seed=3)
    field = AttentionVelocity(None, heads, AttentionOptions(backend="auto", tol=1e-8), COMM)
    for layer in range(2):
        before = field.stats["largest_estimate"]
        v = field(x, w, layer, targets=x)
        ref = attention_velocity_direct(x, x, w, HeadLayer(heads, layer))
        err = np.abs(v - ref).max() / np.abs(ref).max()
        assert field.last_plan is not None
        assert err <= field.stats["largest_estimate"], (layer, err, field.stats)
        assert field.stats["largest_estimate"] >= before
    assert field.stats["largest_estimate"] < 1e-6, field.stats    # and not vacuous


class HeadLayer:
    """One layer of a HeadMeasure seen as layer 0 (for attention_velocity_direct)."""

    def __init__(self, heads, layer):
        self.heads, self.layer = heads, layer

    def attention_matrices(self, _):
        return self.heads.attention_matrices(self.layer)

    def values(self, _):
        return self.heads.values(self.layer)


@pytest.mark.parametrize("why", ["d = 4", "sharp attention", "sharp attention, d = 3", "absurd heads",
                                 "tol out of reach", "tol out of reach, d = 3", "many tiles, d = 3"])
def test_auto_falls_back_to_direct_and_laplace_refuses(why, monkeypatch):
    """auto sums directly where the table cannot serve (d = 4; |b| x extent so large that
    the tiles would exceed MAX_TILES, or in 3-D their sums TILE_SUMS3_BYTES; tol below
    what the largest table reaches) and
    gives the direct result; backend 'laplace' raises a SolverBreakdown (a ConfigError
    for d = 4, at once) that names the reason instead of returning a less accurate
    velocity. The forced search stops at auto's largest size here: its sizes beyond
    (up to 1025, 10 s of tables) would only repeat the refusal."""
    from pdeformer.attention.laplace import chebyshev
    from pdeformer.tools.errors import ConfigError, SolverBreakdown
    monkeypatch.setattr(chebyshev, "N_MAX_FORCED", chebyshev.N_MAX)
    d = 4 if why == "d = 4" else 3 if why.endswith("d = 3") else 2
    rng = np.random.default_rng(5)
    y = rng.uniform(-3, 3, (2000, d))
    w = np.exp(-np.sum(y**2, 1)) / 2000
    scale, tol = {"d = 4": (0.4, 1e-6), "sharp attention": (4e3, 1e-6), "absurd heads": (1e80, 1e-6),
                  "tol out of reach": (1.5, 1e-17), "many tiles": (7.0, 1e-6)}[why.split(",")[0]]
    field, hm = _field("auto", tol, d=d, scale=scale)
    field.tol = tol
    with np.errstate(all="ignore"):           # absurd heads overflow on the way
        v = field(y, w, 0)
        assert field.stats == dict(field.stats, direct=1, laplace=0)
        np.testing.assert_allclose(v, attention_velocity_direct(field.targets, y, w, hm),
                                   rtol=1e-12, atol=1e-12)
        if d == 4:                            # bad input, before anything runs
            with pytest.raises(ConfigError, match="^attention.backend: 'laplace' is implemented "
                               "for d = 1, 2 and 3, these tokens have d = 4"):
                _field("laplace", tol, d=d, scale=scale)
            return
        strict, _ = _field("laplace", tol, d=d, scale=scale)
        with pytest.raises(SolverBreakdown):
            strict(y, w, 0)


PARTITION_SCRIPT = '''
import json, sys
import numpy as np
from mpi4py import MPI
from pdeformer.model.heads import HeadMeasure
from pdeformer.model.schema import AttentionOptions
from pdeformer.model.velocity import AttentionVelocity

world = MPI.COMM_WORLD
rng = np.random.default_rng(0)
d = int(sys.argv[2])
c = np.array([-1, 0, 0.5][:d]) / (d - 1)
y = rng.uniform(-3, 3, (9000, d)) / (d - 1)
w = (np.exp(-np.sum((y - c) ** 2, 1) / 0.3) + 0.5 * np.exp(-np.sum((y + c) ** 2, 1))) / 9000
x = rng.uniform(-2.5, 2.5, (700, d)) / (d - 1)
g = rng.normal(size=x.shape)
heads = HeadMeasure.random(1, 6, 2, d, seed=3, scale=1.2 if d == 2 else 0.7)


def run(comm, ys, ws, xs, gs):
    field = AttentionVelocity(xs, heads, AttentionOptions(backend="laplace", tol=1e-9), comm)
    v = field(ys, ws, 0)
    ct = field.vjp(ys, ws, 0, gs, field.last_plan)
    dA, dV = comm.allreduce(ct.A), comm.allreduce(ct.V)
    return v, ct.weights, dA, dV, field.last_plan


def gather(part, n):
    """Rows of rank r are rows r, r + size, ... of the whole."""
    out = np.empty((n,) + part.shape[1:])
    for r, rows in enumerate(world.allgather(part)):
        out[r::world.size] = rows
    return out


r, P = world.rank, world.size
v, wbar, dA, dV, plan = run(world, y[r::P], w[r::P], x[r::P], g[r::P])
v, wbar = gather(v, len(x)), gather(wbar, len(y))
v1, wbar1, dA1, dV1, plan1 = run(MPI.COMM_SELF, y, w, x, g)
rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
from pdeformer.attention.laplace import LaplaceTable
panels = all(t[1] is not None for t in LaplaceTable(y[r::P], w[r::P], plan.lo, plan.hi, plan.n, world).tile_data)
if r == 0:
    json.dump({"n": [plan.n, plan1.n], "nf": [plan.nf, plan1.nf], "panels": panels,
               "v": rel(v, v1), "w": rel(wbar, wbar1), "A": rel(dA, dA1), "V": rel(dV, dV1)},
              open(sys.argv[1], "w"))
'''


@pytest.mark.parametrize("d", [2, 3])
def test_two_ranks_give_the_serial_velocity_and_cotangents(tmp_path, d):
    """Sources and targets dealt to 2 ranks: the same table (size, fine grid) and the
    same velocity and reverse-mode cotangents as one rank, to 1e-10, the table built
    through panel nodes (pairs in 2-D, triples in 3-D), each rank spreading its own
    sources."""
    import json
    from conftest import run_script
    script, out = tmp_path / "partition.py", tmp_path / "out.json"
    script.write_text(PARTITION_SCRIPT)
    proc = run_script(script, [out, d], nprocs=2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["n"][0] == res["n"][1] and res["nf"][0] == res["nf"][1] is not None, res
    assert res["panels"] or NO_COMPILED, res
    for key in ("v", "w", "A", "V"):
        assert res[key] <= 1e-10, res


def test_size_search_survives_a_subsample_without_positive_mass():
    """Signed weights (DG undershoots) near a corner whose one positive source the
    coordinate-hash subsample leaves out: the trial tables' Z vanishes there, the search
    falls back to the full sources and still finds a size that meets tol."""
    from pdeformer.attention.laplace import SUBSAMPLE, coordinate_scale, subsample
    rng = np.random.default_rng(2)
    y = rng.random((20000, 2))
    w = np.where(y.sum(axis=1) > 1.8, -0.02, 1.0)
    c = 1.0 + 1e-6                      # the sources' scale: 2
    while subsample(np.array([[c, c]]), SUBSAMPLE / 20001, 2.0)[0]:
        c += 1e-6
    y, w = np.vstack([y, [[c, c]]]), np.append(w, 1.0)
    assert coordinate_scale(y, COMM) == 2.0 and not subsample(y, SUBSAMPLE / len(y), 2.0)[-1]
    table, est = choose_table(y, w, np.array([-50.0, -50.0]), np.array([50.0, 50.0]), COMM, 1e-4)
    assert est <= 1e-4 and np.all(np.isfinite(table.m))


def test_subsample_is_a_uniform_draw_the_same_on_any_rank():
    """The trial tables' subsample keeps each point with probability ``fraction``,
    independently of where it lies (binomial counts within 5 sigma, overall and per
    quadrant, on random points and on a regular grid like quadrature points), and keeps
    the same points whatever their order, the rank that holds them, or the round-off
    in their coordinates: last bits, and 1e-17 or -0 where another partition has 0
    (the velocity nodes of a 32^2 mesh on 1 and 3 ranks, dolfinx 0.9)."""
    from pdeformer.attention.laplace import coordinate_scale, subsample
    rng = np.random.default_rng(5)
    side = np.linspace(-4, 4, 400)
    grid = np.stack(np.meshgrid(side, side), -1).reshape(-1, 2)
    lattice = np.stack(np.meshgrid(np.arange(-16, 17) / 4, np.arange(-16, 17) / 4), -1).reshape(-1, 2)
    for pts in (rng.normal(size=(160000, 2)), grid, rng.normal(size=(50000, 1)), lattice):
        scale = coordinate_scale(pts, MPI.COMM_SELF)
        for f in (0.02, 0.3):
            keep = subsample(pts, f, scale)
            quadrants = [np.all(pts >= 0, 1), np.all(pts < 0, 1), pts[:, 0] >= 0]
            for part in [np.ones(len(pts), bool)] + quadrants:
                n = part.sum()
                assert abs(keep[part].sum() - f * n) <= 5 * np.sqrt(n * f * (1 - f)), (f, n)
            order = rng.permutation(len(pts))
            assert np.array_equal(subsample(pts[order], f, scale), keep[order])
            # the same nodes computed on another partition
            ulp = np.nextafter(pts, np.where(rng.random(pts.shape) < 0.5, np.inf, -np.inf))
            assert np.array_equal(subsample(ulp, f, scale), keep)
            noisy = np.where(pts == 0, rng.choice([-1e-17, -0.0, 4e-17], size=pts.shape), pts)
            assert np.array_equal(subsample(noisy, f, scale), keep)
    assert coordinate_scale(lattice, MPI.COMM_SELF) == 4.0
    assert coordinate_scale(np.nextafter(lattice, np.inf), MPI.COMM_SELF) == 4.0   # a corner at 4 + 1 ulp
    assert subsample(grid, 1.0, 4.0).all()


@pytest.mark.parametrize("compiled", [True, False])
def test_position_cotangents_are_the_derivative_of_the_table_map(compiled):
    """Particles move sources and targets: with the grid fixed, d<g, v>/dx (targets,
    through the interpolant) and d<g, v>/dy (sources, through the table sums) match
    central differences, with the compiled loop and with numpy."""
    from pdeformer.attention.laplace import FineGrid, HeadSums
    rng = np.random.default_rng(21)
    y = rng.normal(size=(300, 2)) * [1.0, 0.6]
    w = rng.uniform(0.5, 1.5, 300) / 300
    x = rng.normal(size=(120, 2))
    A = attention_matrices(0.8 * rng.normal(size=(3, 2, 2)), rng.normal(size=(3, 2, 2)))
    V, g = rng.normal(size=(3, 2, 2)), rng.normal(size=x.shape)
    lo, hi = grid_box(*b_range(x, A, COMM))
    lo, hi = lo - 1.0, hi + 1.0                  # room for the moved targets

    def interp(y):
        fg = FineGrid(LaplaceTable(y, w, lo, hi, 49, COMM), 196)
        if not compiled:
            fg.lib = None
        return fg

    fg = interp(y)
    if compiled and fg.lib is None:
        pytest.skip("no compiled loop here")
    mbar, dA, dV, xbar = fg.velocity_vjp(x, A, V, g, positions=True)
    ybar = fg.table.points_cotangent(mbar)
    if compiled:
        np.testing.assert_allclose(xbar, HeadSums.velocity_vjp(fg, x, A, V, g, True)[3],
                                   rtol=0, atol=1e-12 * np.abs(xbar).max())
    dx, dy = rng.normal(size=x.shape), rng.normal(size=y.shape)
    f = lambda e: np.sum(g * interp(y + e * dy).velocity(x + e * dx, A, V))
    fd = central_derivative(f, 1e-6)
    assert abs(fd - np.sum(xbar * dx) - np.sum(ybar * dy)) < 1e-7 * max(1.0, abs(fd)), \
        (fd, np.sum(xbar * dx), np.sum(ybar * dy))


@pytest.mark.parametrize("d, loops, extent", [(1, "numpy", [3]), (2, "numpy", [3, 3]),
                                              (2, "compiled", [3, 3]), (2, "compiled", [3, 1.5]),
                                              (2, "numpy", [1.5, 3]), (3, "numpy", [1, 0.8, 1])])
def test_panel_tables_are_the_direct_sums(d, loops, extent, monkeypatch):
    """Sums through the panel nodes (sources spread onto narrow Chebyshev panels: q^d
    nodes for each, then d products) give the tables and reverse-mode sums (weights and
    positions) of the direct sums over the sources to 1e-12, with the spread and gather
    done by numpy and (d = 2) by the compiled loops, the products keeping either axis
    between their steps (d = 2: the one with fewer panel nodes, axis 1 for sources wider
    along axis 0; axis 0 otherwise)."""
    from pdeformer.attention import compiled
    if loops == "numpy":
        monkeypatch.setattr(compiled, "kernels_on", lambda comm: None)
    elif NO_COMPILED:
        pytest.skip("no C compiler, or PDEFORMER_NO_KERNEL set")
    rng = np.random.default_rng(31)
    M, n = {1: (200000, 257), 2: (40000, 129), 3: (60000, 33)}[d]
    y = rng.uniform(-1, 1, (M, d)) * extent
    w = np.exp(-np.sum((y - 0.5) ** 2, 1)) * (1 + 0.5 * np.sin(2 * y[:, 0])) / M
    lo, hi = np.full(d, -9.0), np.full(d, 11.0)
    panel = LaplaceTable(y, w, lo, hi, n, COMM)
    assert (panel.lib is not None) == (loops == "compiled")
    assert all(t[1] is not None for t in panel.tile_data), "the panel path was not taken"
    assert {t.lead for t in panel.layout.tiles} == {int(extent[0] > extent[-1])}
    assert len(panel.tile_data[0][1][0].nodes) < M
    monkeypatch.setattr(LaplaceTable, "_panels", lambda self, *args: None)
    direct = LaplaceTable(y, w, lo, hi, n, COMM)
    scale = np.abs(direct.m).max()
    np.testing.assert_allclose(panel.m, direct.m, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(panel.log_z, direct.log_z, rtol=0, atol=1e-12 * np.abs(direct.log_z).max())
    mbar = rng.normal(size=direct.m.shape)
    # the weights' and the positions' cotangents, in one pass
    for a, b in zip(panel.source_cotangents(mbar, positions=True), direct.source_cotangents(mbar, positions=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-11 * np.abs(b).max())


@pytest.mark.parametrize("d", [2, 3])
def test_shell_maxima_and_chebyshev_coefficients(d):
    """shell_maxima(c)[k] = max of c over the indices whose largest entry is k; the
    maxima of row blocks (as each rank computes them) combine by max into those of the
    whole. The DCT-I matrix gives the Chebyshev coefficients of the interpolant on the
    Lobatto nodes x_j = cos(pi j / (n - 1)) (the first and last halved in the sum; the
    grid's increasing order flips the odd ones' signs, which the decay does not see), in
    1-D and as a d-tensor; a table's own shells are those of its coefficients."""
    from pdeformer.attention.laplace import chebyshev_coefficients, shell_maxima
    rng = np.random.default_rng(d)
    n = {2: 11, 3: 7}[d]
    c = rng.random((n,) * d)
    k = np.indices(c.shape).max(axis=0)
    expected = [c[k == s].max() for s in range(n)]
    assert np.array_equal(shell_maxima(c), expected)
    blocks = [shell_maxima(c[r0:r1], r0) for r0, r1 in ((0, 2), (2, 3), (3, 5), (5, n), (n, n))]
    assert np.array_equal(np.max(blocks, axis=0), expected)

    n = 13
    T = np.cos(np.outer(np.pi * np.arange(n) / (n - 1), np.arange(n)))   # T_k(x_j)
    T[:, [0, -1]] /= 2
    t1 = rng.normal(size=n)
    np.testing.assert_allclose(T @ chebyshev_coefficients(t1), t1, atol=1e-13)
    t = rng.normal(size=(n,) * d)
    back = chebyshev_coefficients(t)
    for a in range(d):                               # T along each axis
        back = np.moveaxis(np.tensordot(T, back, axes=(1, a)), 0, a)
    np.testing.assert_allclose(back, t, atol=1e-12)

    x, y, w, A, _ = case(d, {2: "two_blobs", 3: "sphere"}[d], seed=1, sources={2: 40**2, 3: 500}[d], targets=50)
    table = LaplaceTable(y, w, *grid_box(*b_range(x, A, COMM)), 17, COMM)
    top = np.abs(table.values).max()
    coef = np.abs(chebyshev_coefficients(table.values[0]))
    assert np.isclose(table.local_shells()[0].max(), coef.max() / top, rtol=1e-12)
    np.testing.assert_allclose(table.local_shells()[0] * top,
                               np.maximum.reduce([shell_maxima(np.abs(chebyshev_coefficients(v))) for v in table.values]),
                               rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("kind", ["uniform", "gaussian", "disc", "grid", "collinear", "duplicates", "few"])
def test_hull_candidates_keep_every_extreme_of_every_linear_map(kind):
    """min and max of A x over the candidates equal those over all points (the same
    floating-point values: the extreme points themselves are kept), for 400 random A;
    and b_range with many heads equals the brute-force range."""
    from pdeformer.attention.laplace import hull_candidates
    rng = np.random.default_rng(7)
    n = 20000
    if kind == "uniform":
        x = rng.uniform(-4, 4, (n, 2))
    elif kind == "gaussian":
        x = rng.standard_normal((n, 2)) * [3.0, 0.01]
    elif kind == "disc":
        r, t = np.sqrt(rng.random(n)), 2 * np.pi * rng.random(n)
        x = np.c_[r * np.cos(t), r * np.sin(t)]
    elif kind == "grid":
        x = np.stack(np.meshgrid(np.linspace(-1, 1, 120), np.linspace(0, 2, 150)), -1).reshape(-1, 2)
    elif kind == "collinear":
        s = rng.random(n)
        x = np.c_[1 + s, 2 - 3 * s]
    elif kind == "duplicates":
        x = np.repeat(rng.uniform(-1, 1, (50, 2)), 400, axis=0)
    else:
        x = rng.uniform(-1, 1, (10, 2))
    cand = hull_candidates(x)
    assert len(cand) <= len(x) + 8
    A = rng.standard_normal((400, 2, 2))
    full, kept = np.einsum("hij,nj->hni", A, x), np.einsum("hij,nj->hni", A, cand)
    assert np.array_equal(full.min(axis=1), kept.min(axis=1))
    assert np.array_equal(full.max(axis=1), kept.max(axis=1))
    lo, hi = b_range(x, A, COMM)
    assert np.allclose(lo, full.min(axis=(0, 1)), rtol=1e-14, atol=0)
    assert np.allclose(hi, full.max(axis=(0, 1)), rtol=1e-14, atol=0)
    if kind == "uniform":                    # and it does discard the interior
        assert len(cand) < len(x) // 10


@needs_compiled
def test_compiled_panel_loops_match_numpy_on_edges_nodes_and_repeats():
    """Sources on panel edges, on Chebyshev nodes, repeated, at the ends of the tile and
    in a tile of zero width: the compiled spread and gather equal the numpy ones."""
    from pdeformer.attention import compiled
    from pdeformer.attention.laplace import Panels, panel_degree
    rng = np.random.default_rng(5)
    q = panel_degree()
    # the last: one panel pair holding more sources than the loops take at a time
    for lo, hi, bmax, M in (((-2.0, 0.0), (3.0, 1.0), 5.0, 300), ((1.0, 1.0), (1.0, 4.0), 5.0, 300),
                            ((0.0, 0.0), (1.0, 1.0), 0.5, 9000)):
        panels = [Panels(lo[a], hi[a], bmax, q) for a in range(2)]
        pts = [rng.uniform(lo[a], hi[a], M) for a in range(2)]
        for a in range(2):                   # edges, nodes, ends, repeats
            special = np.concatenate([panels[a].edges, panels[a].nodes[::7], [lo[a], hi[a]] * 3])
            pts[a] = np.concatenate([pts[a], rng.permutation(np.resize(special, 60))])
        y = np.stack(pts, axis=1)
        cols = rng.normal(size=(len(y), 3))
        table = LaplaceTable(y, np.ones(len(y)), [-1.0, -1.0], [1.0, 1.0], 17, COMM)
        table.lib = None
        want = table._spread(panels, y, cols)
        got = compiled.panel_spread(compiled.kernels(), panels, y, cols)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13 * np.abs(want).max())
        G = rng.normal(size=(2,) + want.shape[1:])
        gathered = compiled.panel_gather(compiled.kernels(), panels, y, G)
        # the gather is the transpose of the spread: <G_i, spread(cols)> = sum_j cols_j . gathered_j
        for i in range(2):
            spread_i = compiled.panel_spread(compiled.kernels(), panels, y, cols[:, i:i + 1])[0]
            assert abs(np.sum(G[i] * spread_i) - np.sum(cols[:, i] * gathered[:, i])) \
                < 1e-12 * np.abs(G[i]).sum() * np.abs(cols).max()


# ---------------------------------------------------------------- signed weights
def signed_case(d=2, delta=1e-7, scale=0.8, n=40, seed=0):
    """Targets x, sources y, weights w of either sign and heads. d = 2: cell-centre
    sources of two Gaussian blobs plus a checkerboard of +-delta, as a DG density
    without the limiter has in its tails: where the tilt e^{<b, y>} reaches the corners
    of the source box, the negative cells outweigh the blobs and Z(b) < 0 there (corners
    of the b-box no target reaches), while at the targets' b it stays positive. d = 3:
    the box case with a tenth of its weights times -0.2 (delta, n, seed unused)."""
    from pdeformer.model.heads import HeadMeasure
    if d == 3:
        x, y, w, _, _ = case(3, "box", seed=8, sources=3000, targets=200)
        w = w * np.where(np.random.default_rng(9).random(len(w)) < 0.1, -0.2, 1.0)
        return x, y, w, HeadMeasure.random(1, 4, 2, 3, seed=2, scale=scale)
    g = np.linspace(-4, 4, n + 1)[:-1] + 4 / n
    y = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    w = (DENSITIES["two_blobs"](y) + delta * np.where((i + j).ravel() % 2, 1.0, -1.0)) * (8 / n) ** 2
    heads = HeadMeasure.random(1, 6, 2, 2, seed=seed, scale=scale)
    x = np.random.default_rng(seed).uniform(-3, 3, (600, 2))
    return x, y, w, heads


@pytest.mark.parametrize("loops", ["compiled", "numpy"])
@pytest.mark.parametrize("d, tol", [(2, 1e-5), (2, 1e-8), (2, 1e-9), (3, 1e-7)])
def test_signed_weights_meet_tol_and_reverse_mode(d, tol, loops, monkeypatch):
    """Negative weights: where Z <= 0 at some grid nodes (the 2-D case) a table of m
    itself is refused; the table of mu = S_y/N and zeta = Z/N (N = sum |w| e^{<b,y>})
    with m = mu/zeta taken at each point gives the velocity to tol against direct
    summation, with the compiled loops and numpy. The cotangents of <g, v> through it --
    weights (the nonlocal source term), A and V -- are the derivative of the table's map
    (central differences, plan fixed) and agree with those of direct summation to about
    tol."""
    from pdeformer.attention import compiled
    from pdeformer.attention.softmax import attention_velocity_vjp
    from pdeformer.model.velocity import AttentionVelocity
    if loops == "numpy":
        monkeypatch.setattr(compiled, "kernels_on", lambda comm: None)
    elif NO_COMPILED:
        pytest.skip("no C compiler, or PDEFORMER_NO_KERNEL set")
    x, y, w, heads = signed_case(d)
    A, V = heads.attention_matrices(0), heads.values(0)
    assert np.any(w < 0)
    # the 2-D case makes Z <= 0 at corners of the b-box and zeta small at some targets; in
    # the 3-D one Z stays positive (zeta >= 0.9 at the targets), so these checks are 2-D's
    if d == 2:     # a table of m itself is refused (Z <= 0 at some grid nodes)
        with pytest.raises(FloatingPointError, match="partition function vanishes"):
            LaplaceTable(y, w, *grid_box(*b_range(x, A, COMM)), 65, COMM, signed=False)
        b = np.einsum("hij,nj->hni", A, x).reshape(-1, 2)
        s = b @ y.T
        e = np.exp(s - s.max(axis=1, keepdims=True))
        zeta = (e @ w) / (e @ np.abs(w))
        assert 0.2 < zeta.min() < 0.5            # well away from zero where it is needed
    field = AttentionVelocity(x, heads, AttentionOptions(backend="laplace", tol=tol), COMM)
    v = field(y, w, 0)
    plan = field.last_plan
    assert plan is not None and plan.signed and field.stats["laplace"] == 1
    ref = attention_velocity_direct(x, y, w, heads)
    assert np.abs(v - ref).max() <= tol * np.abs(ref).max()
    if d == 2:     # the pairs with |zeta| < ZETA_MIN were left to exact sums
        _, interp = field.planner.replay(y, w, plan)
        interp.velocity(x, A, V)
        assert 0 < len(interp.skipped) < 0.1 * len(A) * len(x)
    g = np.random.default_rng(7).normal(size=x.shape)
    ct = field.vjp(y, w, 0, g, plan)
    exact = attention_velocity_vjp(x, y, w, A, V, g)
    # the values' cotangents are as accurate as the values (tol; 5e-2 tol measured), the
    # heads' through dm/db, the interpolant's derivative (6.5 tol measured): 10 and 100 tol
    for got, want, k in ((ct.weights, exact.weights, 10), (ct.A, exact.A, 100), (ct.V, exact.V, 10)):
        assert np.abs(got - want).max() <= k * tol * np.abs(want).max()

    def f(w_, A_, V_):
        return np.sum(g * field.planner.velocity_of(y, w_, x, A_, V_, plan))

    rng = np.random.default_rng(8)
    for name, arr, got in (("w", w, ct.weights), ("A", A, ct.A), ("V", V, ct.V)):
        dn = rng.normal(size=arr.shape) * (np.abs(w) if name == "w" else 1)
        moved = lambda e: {"w": w, "A": A, "V": V} | {name: arr + e * dn}
        fd = central_derivative(lambda e: f(*moved(e).values()), 1e-6)
        assert abs(fd - np.sum(got * dn)) < 1e-7 * max(1.0, abs(fd)), (name, fd, np.sum(got * dn))


def test_signed_weights_with_zeta_through_zero_at_targets():
    """Larger negative parts: Z(b) changes sign at some targets (m has poles there). The
    pairs near them are summed exactly, so the velocity is still direct summation's."""
    from pdeformer.model.velocity import AttentionVelocity
    x, y, w, heads = signed_case(delta=1e-6)
    b = np.einsum("hij,nj->hni", heads.attention_matrices(0), x).reshape(-1, 2)
    s = b @ y.T
    e = np.exp(s - s.max(axis=1, keepdims=True))
    assert (e @ w).min() < 0 < (e @ w).max()
    field = AttentionVelocity(x, heads, AttentionOptions(backend="laplace", tol=1e-8), COMM)
    v = field(y, w, 0)
    ref = attention_velocity_direct(x, y, w, heads)
    assert field.stats["laplace"] == 1 and np.abs(v - ref).max() <= 1e-8 * np.abs(ref).max()


@needs_compiled
def test_compiled_signed_loop_is_the_numpy_map(kernel_build):
    """The 4-wide compiled loops (mu_0, mu_1, zeta, 0 per node; m = mu/zeta per point)
    give the numpy two-level map and its reverse mode to round-off, and report the
    conditioning (largest 1/|zeta| and |m|) the numpy map sees."""
    from pdeformer.attention.compiled import kernels
    from pdeformer.attention.laplace import FineGrid, HeadSums
    assert kernels() is not None
    x, y, w, heads = signed_case()
    A, V = heads.attention_matrices(0), heads.values(0)
    table = LaplaceTable(y, w, *grid_box(*b_range(x, A, COMM)), 97, COMM)
    assert table.signed
    fg = FineGrid(table, 300)
    v = fg.velocity(x, A, V)
    compiled_stats = fg.conditioning.copy()
    np.testing.assert_allclose(v, HeadSums.velocity(fg, x, A, V), rtol=0, atol=1e-13 * np.abs(v).max())
    np.testing.assert_allclose(compiled_stats, fg.conditioning, rtol=1e-12)
    g = np.random.default_rng(3).normal(size=x.shape)
    got, want = fg.velocity_vjp(x, A, V, g, positions=True), HeadSums.velocity_vjp(fg, x, A, V, g, True)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * np.abs(b).max())


def test_plans_are_reused_grown_and_frozen():
    """Evaluations of one key reuse the table plan while the box fits (one search for a
    slowly changing density), a rougher density grows it, a frozen step replays exactly
    the plan (and velocity) it recorded, and refreeze plans anew."""
    y, w = grid_sources(lambda p: np.exp(-np.sum((p - [0.5, 0.5]) ** 2, 1) / 0.05), n=60)
    field, hm = _field("laplace", 1e-8, heads=6, scale=1.2)
    vs = [field(y, w * (1 + 0.01 * k * y[:, 0]), 0, key="k") for k in range(4)]
    assert field.stats["searches"] == 1 and field.stats["reused"] == 3, field.stats
    n0 = field.last_plan.n
    rough = grid_sources(DENSITIES["box_edge"], n=60)[1]
    v = field(y, rough, 0, key="k")
    assert field.last_plan.n > n0 and field.stats["searches"] + field.stats["rebuilt"] == 2, field.stats
    ref = attention_velocity_direct(field.targets, y, rough, hm)
    assert np.abs(v - ref).max() <= 1e-8 * np.abs(ref).max()
    field.freeze = True
    first = field(y, w, 0, key="k", step=("k", 0))
    plan = field.last_plan
    again = field(y, w, 0, key="k", step=("k", 0))
    assert field.last_plan == plan and np.array_equal(first, again)
    searches = field.stats["searches"]
    field.refreeze()
    field(y, w, 0, key="k", step=("k", 0))
    assert field.stats["searches"] == searches + 1
    np.testing.assert_allclose(vs[0], attention_velocity_direct(field.targets, y, w, hm),
                               rtol=0, atol=1e-8 * np.abs(vs[0]).max())


def test_auto_backs_off_after_a_table_misses_tol():
    """After a key's table misses tol, auto sums that key's next 1, 3, 7 evaluations
    directly (a failed search costs about what the direct sum does), then searches
    again; another key is not held back, and refreeze forgets the misses."""
    rng = np.random.default_rng(5)
    y = rng.uniform(-3, 3, (2000, 2))
    w = np.exp(-np.sum(y**2, 1)) / 2000
    field, _ = _field("auto", 1e-17, d=2, scale=1.5)
    field.tol = field.planner.tol = 1e-17               # out of reach: every search misses
    searched = []
    for _ in range(15):
        before = field.stats["searches"]
        field(y, w, 0)
        searched.append(field.stats["searches"] > before)
    assert field.stats["laplace"] == 0 and field.stats["direct"] == 15
    assert [i for i, s in enumerate(searched) if s] == [0, 2, 6, 14], searched
    before = field.stats["searches"]
    field(y, w, 0, key="other")
    assert field.stats["searches"] > before                # a key of its own searches
    field.refreeze()
    before = field.stats["searches"]
    field(y, w, 0)
    assert field.stats["searches"] > before
