"""The attention kernel against brute force (pure numpy / Python decimals, no dolfinx)."""

from __future__ import annotations

from decimal import Decimal, getcontext

import numpy as np
import pytest

from checks import central_derivative
from pdeformer.attention.softmax import (Sources, attention_matrices, attention_velocity,
                                 tilted_moments)


def brute_force(targets, points, weights, A, V=None):
    """log Z, m, C per head and target by a double loop in 60-digit decimal arithmetic,
    with no stabilisation at all: Decimal's exponent range does not overflow."""
    getcontext().prec = 60
    getcontext().Emax = 10**6
    getcontext().Emin = -10**6
    H, N, d = A.shape[0], targets.shape[0], targets.shape[1]
    logz = np.empty((H, N))
    mean = np.empty((H, N, d))
    cov = np.empty((H, N, d, d))
    for h in range(H):
        for n in range(N):
            b = [sum(Decimal(A[h, i, j]) * Decimal(targets[n, j]) for j in range(d)) for i in range(d)]
            z = Decimal(0)
            s1 = [Decimal(0)] * d
            s2 = [[Decimal(0)] * d for _ in range(d)]
            for y, w in zip(points, weights):
                yd = [Decimal(v) for v in y]
                e = Decimal(w) * sum(bi * yi for bi, yi in zip(b, yd)).exp()
                z += e
                for i in range(d):
                    s1[i] += e * yd[i]
                    for j in range(d):
                        s2[i][j] += e * yd[i] * yd[j]
            logz[h, n] = float(z.ln())
            m = [s / z for s in s1]
            mean[h, n] = [float(v) for v in m]
            cov[h, n] = [[float(s2[i][j] / z - m[i] * m[j]) for j in range(d)] for i in range(d)]
    return logz, mean, cov


def random_case(d, scale, seed, M=7, N=5, H=3, signed=False):
    rng = np.random.default_rng(seed)
    points = rng.uniform(-2, 2, (M, d))
    weights = rng.uniform(0.1, 1.0, M)
    if signed:
        weights[rng.integers(M)] *= -0.05  # a small negative weight, as a DG density can have
    targets = rng.uniform(-2, 2, (N, d))
    Q = scale * rng.standard_normal((H, 2, d))
    K = rng.standard_normal((H, 2, d))
    return targets, points, weights, attention_matrices(Q, K)


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_moments_match_brute_force(d, scale):
    x, y, w, A = random_case(d, scale, seed=d)
    got = tilted_moments(x, Sources.from_arrays(y, w), A, order=2)
    logz, mean, cov = brute_force(x, y, w, A)
    np.testing.assert_allclose(got.log_partition, logz, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.mean, mean, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got.cov, cov, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("d", [1, 2])
def test_sharp_attention_where_naive_exp_overflows(d):
    """|<A x, y>| reaches thousands: exp overflows (and underflows) in float64, the
    log-domain kernel still agrees with the exact decimal sums."""
    x, y, w, A = random_case(d, scale=400.0, seed=10 + d)
    scores = np.einsum("hij,nj,mi->hnm", A, x, y)
    with np.errstate(over="ignore", under="ignore"):
        assert not np.all(np.isfinite(np.exp(scores)))  # the case really is sharp
    got = tilted_moments(x, Sources.from_arrays(y, w), A, order=2)
    logz, mean, cov = brute_force(x, y, w, A)
    assert np.all(np.isfinite(got.mean))
    np.testing.assert_allclose(got.log_partition, logz, rtol=1e-12)
    np.testing.assert_allclose(got.mean, mean, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got.cov, cov, atol=1e-10)


def test_signed_weights():
    x, y, w, A = random_case(2, 1.0, seed=3, signed=True)
    assert np.any(w < 0)
    got = tilted_moments(x, Sources.from_arrays(y, w), A)
    _, mean, _ = brute_force(x, y, w, A)
    np.testing.assert_allclose(got.mean, mean, rtol=1e-11, atol=1e-11)


def test_velocity_is_head_average_of_V_times_mean():
    x, y, w, A = random_case(2, 1.0, seed=4, N=11, H=4)
    V = np.random.default_rng(5).standard_normal((4, 2, 2))
    src = Sources.from_arrays(y, w)
    m = tilted_moments(x, src, A).mean
    expect = np.einsum("hij,hnj->ni", V, m) / 4
    np.testing.assert_allclose(attention_velocity(x, src, A, V), expect, rtol=1e-13, atol=1e-14)


def test_chunking_does_not_change_the_result():
    rng = np.random.default_rng(6)
    y, w = rng.normal(size=(3000, 2)), rng.uniform(size=3000)
    x = rng.normal(size=(257, 2))
    A = rng.normal(size=(3, 2, 2))
    V = rng.normal(size=(3, 2, 2))
    src = Sources.from_arrays(y, w)
    tiny = attention_velocity(x, src, A, V, chunk_mb=1e-6)   # one target per chunk
    big = attention_velocity(x, src, A, V, chunk_mb=512.0)   # all targets at once
    # equal up to the summation order BLAS picks for each matrix shape
    np.testing.assert_allclose(tiny, big, rtol=1e-12, atol=1e-14)


def test_uniform_attention_gives_the_mean():
    """A = 0: every target sees the plain weighted mean and covariance of the sources."""
    rng = np.random.default_rng(7)
    y, w = rng.normal(size=(50, 3)), rng.uniform(0.5, 1, 50)
    got = tilted_moments(rng.normal(size=(4, 3)), Sources.from_arrays(y, w), np.zeros((1, 3, 3)), order=2)
    mean = w @ y / w.sum()
    cov = (w[:, None] * (y - mean)).T @ (y - mean) / w.sum()
    np.testing.assert_allclose(got.mean[0], np.tile(mean, (4, 1)), rtol=1e-13)
    np.testing.assert_allclose(got.cov[0], np.tile(cov, (4, 1, 1)), rtol=1e-12)
    np.testing.assert_allclose(got.log_partition[0], np.log(w.sum()), rtol=1e-14)


def test_attention_matrix_convention():
    """<Q x, K y> = <A x, y> with A = K^T Q."""
    rng = np.random.default_rng(8)
    Q, K = rng.normal(size=(1, 3, 2)), rng.normal(size=(1, 3, 2))
    x, y = rng.normal(size=2), rng.normal(size=2)
    A = attention_matrices(Q, K)[0]
    assert np.isclose((Q[0] @ x) @ (K[0] @ y), (A @ x) @ y, rtol=1e-14)


def test_zero_weights_are_dropped():
    src = Sources.from_arrays(np.arange(6.0).reshape(3, 2), [1.0, 0.0, 2.0])
    assert len(src) == 2 and src.mass == 3.0


def test_reverse_mode_where_signed_weights_make_the_partition_function_negative():
    """Weights of either sign (DG without the limiter) can make Z_h(x) = sum_j w_j
    e^{<b, y_j>} negative for some (head, target): the direct reverse mode then carries
    the sign of Z (it took log Z and gave NaN for every source) and matches central
    differences of the velocity, for weights and positions."""
    from pdeformer.attention.softmax import attention_velocity_vjp
    rng = np.random.default_rng(3)
    y = rng.normal(size=(200, 2))
    w = rng.uniform(0.5, 1.5, 200)
    w[:20] *= -0.3
    x, g = rng.normal(size=(30, 2)), rng.normal(size=(30, 2))
    A, V = rng.normal(size=(2, 2, 2)), rng.normal(size=(2, 2, 2))
    Z = np.exp(np.einsum("hij,nj->hni", A, x) @ y.T) @ w
    assert Z.min() < 0 < Z.max()                      # the case: some Z negative
    ct = attention_velocity_vjp(x, y, w, A, V, g, positions=True)
    f = lambda w, y, x: np.sum(g * attention_velocity(x, Sources.from_arrays(y, w), A, V))
    dw, dy, dx = rng.normal(size=w.shape), rng.normal(size=y.shape), rng.normal(size=x.shape)
    fd = central_derivative(lambda e: f(w + e * dw, y + e * dy, x + e * dx), 1e-6)
    ad = ct.weights @ dw + np.sum(ct.points * dy) + np.sum(ct.targets * dx)
    assert abs(fd - ad) < 1e-6 * max(1.0, abs(fd)), (fd, ad)


def test_the_kernel_is_apart_from_the_summation():
    """What is summed (the kernel) and how (the backend) are two choices: a kernel whose
    sums are no log-Laplace transform is refused by ``laplace`` with one line and summed
    directly by ``auto``, giving the direct sum; softmax's table agrees with it to tol."""
    from mpi4py import MPI
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.model.kernels import Softmax
    from pdeformer.model.velocity import AttentionVelocity
    from pdeformer.model.schema import AttentionOptions
    from pdeformer.tools.errors import ConfigError

    class Untabulated(Softmax):
        name = "untabulated"
        tabulated = False

    rng = np.random.default_rng(0)
    x, y = rng.uniform(-2, 2, (200, 2)), rng.uniform(-2, 2, (300, 2))
    w = rng.uniform(0.5, 1.0, 300) / 300
    heads = HeadMeasure.random(1, 4, 2, 2, seed=2, scale=0.7)

    def field(backend, kernel=None):
        return AttentionVelocity(x, heads, AttentionOptions(backend=backend, tol=1e-9), MPI.COMM_WORLD,
                                 kernel=kernel)
    with pytest.raises(ConfigError, match="attention.backend: 'laplace' tabulates log-Laplace transforms"):
        field("laplace", Untabulated(1.0))
    direct = field("direct")(y, w, 0)
    auto = field("auto", Untabulated(1.0))
    np.testing.assert_array_equal(auto(y, w, 0), direct)
    assert auto.stats["laplace"] == 0 and auto.stats["direct"] == 1
    table = field("laplace")
    np.testing.assert_allclose(table(y, w, 0), direct, rtol=0, atol=1e-7 * np.abs(direct).max())
    assert table.stats["laplace"] == 1
