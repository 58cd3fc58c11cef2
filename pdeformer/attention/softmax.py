r"""Softmax attention acting on a density: the kernel, pure numpy.

A density is given to the kernel as weighted source points ``(y_j, w_j)`` (quadrature
points of rho with weights ``rho(y_j) |J| w_q``, or particles). For a head with
attention matrix ``A = K^T Q`` and a target point ``x``, with ``b = A x``:

.. math::

    Z(b) = \sum_j w_j e^{\langle b, y_j\rangle}, \qquad
    m(b) = \frac{1}{Z}\sum_j w_j e^{\langle b, y_j\rangle} y_j, \qquad
    C(b) = \frac{1}{Z}\sum_j w_j e^{\langle b, y_j\rangle} (y_j - m)(y_j - m)^T,

i.e. ``log Z`` is the log-Laplace transform Lambda_rho(b), ``m = grad Lambda`` the
mean of the tilted measure and ``C = Hess Lambda`` its covariance. The attention
velocity of a layer is ``v(x) = (1/H) sum_h V_h m_h(x)`` (design §1).

Direct summation, exact to round-off: every target meets every source. Sums are
stabilised in the log domain -- each row is shifted by its largest
``<b, y_j> + log|w_j|`` -- so sharp attention (``|A| diam^2`` in the thousands) neither
overflows nor underflows. Targets are processed in chunks whose working arrays take
about ``chunk_mb`` megabytes (sized to stay in cache), so memory does not grow with
the number of targets. Cost: O(N_targets * N_sources * H).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


_GAINS: dict = {}     # value_gain of the layers seen lately, by their values' bytes


def value_gain(V: np.ndarray) -> float:
    """(1/H) sum_h |V_h|_2 for one layer's values V (H, d, d): |v(x)| <= value_gain * max_h
    |m_h(x)| for v = (1/H) sum_h V_h m_h, and the same for errors of the m_h. Kept per
    values (every evaluation of a layer asks for it; H SVDs each time would not divide
    over ranks)."""
    V = np.ascontiguousarray(V, dtype=float)
    key = (V.shape, V.tobytes())
    gain = _GAINS.get(key)
    if gain is None:
        if len(_GAINS) >= 256:
            _GAINS.clear()
        gain = _GAINS[key] = float(np.mean(np.linalg.norm(V, ord=2, axis=(1, 2))))
    return gain


def attention_matrices(Q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """A_h = K_h^T Q_h for heads stacked along axis 0: (H,k,d), (H,k,d) -> (H,d,d).

    The score of token x (query) against token y (key) is <Q x, K y> = <A x, y>."""
    return np.einsum("hki,hkj->hij", K, Q)


@dataclass(frozen=True)
class Sources:
    """Weighted points representing a (signed) density: ``rho ~ sum_j w_j delta_{y_j}``.

    Points with zero weight are dropped. Negative weights (a DG density that dips
    below zero) are kept with their sign."""

    points: np.ndarray  # (M, d)
    weights: np.ndarray  # (M,)

    @classmethod
    def from_arrays(cls, points, weights) -> "Sources":
        points = np.asarray(points, dtype=float)
        weights = np.asarray(weights, dtype=float).ravel()
        if points.ndim == 1:
            points = points[:, None]
        if points.shape[0] != weights.shape[0]:
            raise ValueError(f"{points.shape[0]} points but {weights.shape[0]} weights")
        keep = weights != 0.0
        return cls(np.ascontiguousarray(points[keep]), np.ascontiguousarray(weights[keep]))

    @property
    def dim(self) -> int:
        return self.points.shape[1]

    @property
    def mass(self) -> float:
        return float(self.weights.sum())

    def __len__(self) -> int:
        return self.weights.shape[0]


@dataclass
class TiltedMoments:
    """Per head and target: log-partition log Z (H,N), mean m (H,N,d), covariance C (H,N,d,d)."""

    log_partition: np.ndarray
    mean: np.ndarray
    cov: np.ndarray | None = None


class _Workspace:
    """Source-side arrays shared by all heads and chunks of one kernel call.

    Both sums are matrix products (BLAS): the shifted scores
    [b, 1] @ [y; log|w|] and the moments exp(scores) @ [1, y_c, y_c y_c^T]."""

    def __init__(self, sources: Sources, order: int, chunk_mb: float, centre=None):
        y = sources.points
        M, d = y.shape
        self.d = d
        w = sources.weights
        with np.errstate(divide="ignore"):
            logw = np.log(np.abs(w))
        self.scores_rhs = np.ascontiguousarray(np.vstack([y.T, logw]))  # (d+1, M)
        sign = np.sign(w)
        # Moment columns are taken about a centre c to limit cancellation in C.
        if centre is not None:
            self.centre = np.asarray(centre, float)
        else:
            self.centre = 0.5 * (y.min(axis=0) + y.max(axis=0)) if M else np.zeros(d)
        yc = y - self.centre
        cols = [sign, *(sign * yc[:, a] for a in range(d))]
        if order >= 2:
            cols += [sign * yc[:, a] * yc[:, b] for a in range(d) for b in range(a, d)]
        self.moment_cols = np.ascontiguousarray(np.array(cols).T)  # (M, ncols)
        blocks = -(-max(M, 1) // self.SOURCE_BLOCK)
        self.block = -(-max(M, 1) // blocks)            # equal blocks of at most SOURCE_BLOCK
        self.rows = max(1, int(chunk_mb * 2**20 / (8 * self.block)))
        self.M = M
        self.S = None

    SOURCE_BLOCK = 16384  # sources per block: a (rows x block) score array stays in cache

    def chunk_sums(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For targets' b (n,d): the row shift s_i = max_j <b_i,y_j> + log|w_j| and the
        shifted sums sum_j sign_j e^{<b_i,y_j> + log|w_j| - s_i} * [1, y_c, y_c y_c]_j,
        over blocks of sources with a running shift (sums rescaled when it grows)."""
        n = b.shape[0]
        if self.S is None or self.S.shape[0] < n:
            self.S = np.empty((n, self.block))
        lhs = np.hstack([b, np.ones((n, 1))])
        shift = np.full(n, -np.inf)
        sums = np.zeros((n, self.moment_cols.shape[1]))
        for j0 in range(0, self.M, self.block):
            j1 = min(self.M, j0 + self.block)
            S = self.S[:n, :j1 - j0]
            np.matmul(lhs, self.scores_rhs[:, j0:j1], out=S)
            new = np.maximum(shift, S.max(axis=1))
            ref = np.where(np.isfinite(new), new, 0.0)    # rows without weight so far
            if j0:
                sums *= np.exp(shift - ref)[:, None]
            S -= ref[:, None]
            np.exp(S, out=S)
            sums += S @ self.moment_cols[j0:j1]
            shift = new
        return shift, sums


def partial_sums(b: np.ndarray, sources: Sources, centre, order: int = 1,
                 chunk_mb: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """The log-domain sums of these sources at points b (P, d): per point the shift
    s = max_j <b, y_j> + log|w_j| (-inf without sources) and
    sum_j sign_j e^{<b, y_j> + log|w_j| - s} [1, y - c, (y - c)(y - c)^T] with the centre c
    given (the same wherever partial sums of a density's parts are combined: shifts by
    their maximum, sums rescaled, then :func:`moments_from_sums`)."""
    ws = _Workspace(sources, order, chunk_mb, centre)
    P = b.shape[0]
    shift = np.full(P, -np.inf)
    sums = np.zeros((P, ws.moment_cols.shape[1]))
    if ws.M:
        for i0 in range(0, P, ws.rows):
            i1 = min(P, i0 + ws.rows)
            shift[i0:i1], sums[i0:i1] = ws.chunk_sums(b[i0:i1])
    return shift, sums


def moments_from_sums(shift, sums, centre, order: int = 1):
    """(log Z, m, C or None) from the shifted sums of :func:`partial_sums` (whole, or
    combined over the parts of a density), taken about ``centre``."""
    d = len(centre)
    z = sums[:, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        log_z = shift + np.log(z)
        first = sums[:, 1:1 + d] / z[:, None]
        mean = centre + first
        cov = None
        if order >= 2:
            cov = np.empty((len(z), d, d))
            c = 1 + d
            for a in range(d):
                for b_ in range(a, d):
                    cov[:, a, b_] = sums[:, c] / z - first[:, a] * first[:, b_]
                    cov[:, b_, a] = cov[:, a, b_]
                    c += 1
    return log_z, mean, cov


def _chunk_moments(x: np.ndarray, sources: Sources, A: np.ndarray, order: int, chunk_mb: float,
                   signed: bool = False):
    """Yield (h, i0, i1, log Z, m, C) for every head h and chunk [i0, i1) of targets; with
    ``signed`` (weights of either sign: Z may be negative) (h, i0, i1, log |Z|, m, C,
    sign Z)."""
    if len(sources) == 0:
        raise ValueError("no sources: the density is zero")
    ws = _Workspace(sources, order, chunk_mb)
    N = x.shape[0]
    rows = min(ws.rows, N)
    for h in range(A.shape[0]):
        for i0 in range(0, N, rows):
            i1 = min(N, i0 + rows)
            shift, sums = ws.chunk_sums(x[i0:i1] @ A[h].T)
            log_z, mean, cov = moments_from_sums(shift, sums, ws.centre, order)
            if not signed:
                yield h, i0, i1, log_z, mean, cov
                continue
            z = sums[:, 0]
            with np.errstate(divide="ignore"):
                yield h, i0, i1, shift + np.log(np.abs(z)), mean, cov, np.sign(z)


def tilted_moments(targets: np.ndarray, sources: Sources, A: np.ndarray, *,
                   order: int = 1, chunk_mb: float = 2.0) -> TiltedMoments:
    """log Z, m (and C if ``order >= 2``) of the tilted measures at b = A_h x, for every
    head h (A: (H,d,d)) and target x (targets: (N,d))."""
    x = np.atleast_2d(np.asarray(targets, dtype=float))
    H, N, d = A.shape[0], x.shape[0], x.shape[1]
    out = TiltedMoments(np.empty((H, N)), np.empty((H, N, d)),
                        np.empty((H, N, d, d)) if order >= 2 else None)
    if N:
        for h, i0, i1, log_z, mean, cov in _chunk_moments(x, sources, A, order, chunk_mb):
            out.log_partition[h, i0:i1] = log_z
            out.mean[h, i0:i1] = mean
            if cov is not None:
                out.cov[h, i0:i1] = cov
    return out


def attention_velocity(targets: np.ndarray, sources: Sources, A: np.ndarray, V: np.ndarray,
                       *, chunk_mb: float = 2.0) -> np.ndarray:
    """v(x) = (1/H) sum_h V_h m_h(x), m_h(x) the tilted mean at b = A_h x.

    targets (N,d), A (H,d,d), V (H,d,d) -> (N,d)."""
    x = np.atleast_2d(np.asarray(targets, dtype=float))
    v = np.zeros_like(x)
    if x.shape[0]:
        for h, i0, i1, _, mean, _ in _chunk_moments(x, sources, A, 1, chunk_mb):
            v[i0:i1] += mean @ V[h].T
    v /= A.shape[0]
    return v


@dataclass
class VelocityCotangent:
    """Reverse-mode derivative of <g, v> for v = attention_velocity(x, (y, w), A, V):
    d/dw_j for every source point (zero weights included), d/dA_h and d/dV_h."""

    weights: np.ndarray  # (M,)
    A: np.ndarray        # (H, d, d)
    V: np.ndarray        # (H, d, d)
    targets: np.ndarray | None = None   # (N, d): d/dx_i, with ``positions``
    points: np.ndarray | None = None    # (M, d): d/dy_j, with ``positions``


def attention_velocity_vjp(targets: np.ndarray, points: np.ndarray, weights: np.ndarray,
                           A: np.ndarray, V: np.ndarray, g: np.ndarray, *,
                           chunk_mb: float = 2.0, positions: bool = False) -> VelocityCotangent:
    r"""Cotangents of the attention velocity for the velocity cotangent g (N, d).

    With p_h(x, y) = e^{<A_h x, y>} / Z_h(x) and u_h(x) = V_h^T g(x) / H:

    .. math::

        \bar w_j = \sum_h \sum_i p_h(x_i, y_j)\, u_h(x_i) \cdot (y_j - m_h(x_i)), \qquad
        \bar V_h = \frac1H \sum_i g_i\, m_h(x_i)^T, \qquad
        \bar A_h = \sum_i C_h(x_i)\, u_h(x_i)\, x_i^T,

    (d m / d w_j = p (y_j - m), d m / d b = C). The w-part is the discrete form of the
    adjoint's nonlocal source term S_t (design §2): every token is also a key and a
    value for the others. With ``positions`` (particles), also the position cotangents
    xbar_i = sum_h A_h^T C_h(x_i) u_h(x_i) (b = A x) and, from
    d m / d y_j = p w_j (I + (y_j - m) b^T),
    ybar_j = w_j sum_h sum_i p_h(x_i, y_j) [u_h(x_i) + (u_h(x_i).(y_j - m_h(x_i))) b_h(x_i)]. Sums over the sources use the exact per-target log Z, so
    e^{<b, y> - log Z} only overflows for points far outside the attended mass under
    very sharp attention (then the result is not finite and the caller stops). Weights of
    either sign may make Z negative: p then carries its sign, e^{<b, y> - log|Z|} sign Z."""
    x = np.atleast_2d(np.asarray(targets, dtype=float))
    y = np.atleast_2d(np.asarray(points, dtype=float))
    g = np.asarray(g, dtype=float).reshape(x.shape)
    H, N, d = A.shape[0], x.shape[0], x.shape[1]
    M = y.shape[0]
    out = VelocityCotangent(np.zeros(M), np.zeros_like(A, dtype=float), np.zeros_like(V, dtype=float),
                            np.zeros((N, d)) if positions else None,
                            np.zeros((M, d)) if positions else None)
    if N == 0 or M == 0:
        return out
    sources = Sources.from_arrays(y, weights)
    y_one = np.ascontiguousarray(np.vstack([y.T, np.ones(M)]))   # (d+1, M)
    # p = sign(Z) e^{<b, y> - log|Z|}: signed weights (DG without the limiter) may make Z < 0
    for h, i0, i1, log_z, mean, cov, sign in _chunk_moments(x, sources, A, 2, chunk_mb / 2, signed=True):
        xs, gs = x[i0:i1], g[i0:i1]
        u = gs @ V[h] / H                                   # rows: V_h^T g_i / H
        out.V[h] += gs.T @ mean / H
        out.A[h] += np.einsum("nab,nb,nc->ac", cov, u, xs)
        E = np.hstack([xs @ A[h].T, -log_z[:, None]]) @ y_one   # <b_i, y_j> - log Z_i
        with np.errstate(over="ignore"):
            np.exp(E, out=E)
        r = np.einsum("na,na->n", u, mean)
        coef = np.hstack([u, -r[:, None]])                                  # (n, d+1)
        if positions:
            b = xs @ A[h].T
            out.targets[i0:i1] += np.einsum("nab,nb,ac->nc", cov, u, A[h])
            coef = np.hstack([coef, -r[:, None] * b, (u[:, :, None] * b[:, None, :]).reshape(-1, d * d)])
        coef *= sign[:, None]
        T = E.T @ coef                                                      # (M, ...)
        out.weights += np.einsum("ja,ja->j", y, T[:, :d]) + T[:, d]
        if positions:
            ub = T[:, 2 * d + 1:].reshape(M, d, d)                          # sum_i p u_a b_c
            out.points += T[:, :d] + T[:, d + 1:2 * d + 1] + np.einsum("ja,jac->jc", y, ub)
    if positions:
        out.points *= np.asarray(weights, float)[:, None]
    return out
