r"""Closed-form solutions of the model, for verification.

Uniform attention (Q = 0, so A_h = 0): every token attends to all tokens equally, the
tilted mean is the mean m_t of rho_t, and the velocity is the same at every x,
v_t = Vbar_l m_t with Vbar_l = (1/H) sum_h V_{l,h}. The density is translated rigidly,

.. math::

    \rho_t(x) = \rho_0(x - (m_t - m_0)), \qquad
    m_t = e^{(t - l/L) \bar V_l} m_{l/L} \quad \text{on layer } l,

(mass conservation makes m' = v, and v is constant in space).

Gaussian prompts (any heads). For rho = N(m, C) the tilted mean of head h is
m + beta C A_h x, so the velocity sum_h w_h V_h (m + beta C A_h x) is affine in x and a
Gaussian stays Gaussian on the whole space, its moments solving

.. math::

    m' = \sum_h w_h V_h (I + \beta C A_h) m, \qquad
    C' = J C + C J^T, \quad J = \beta \sum_h w_h V_h C A_h,

on layer l with that layer's heads and weights w_h (1/H: the mean over the heads).
"""

from __future__ import annotations

import numpy as np

from .heads import HeadMeasure, attention_matrices, query_key_derivatives


def expm(M: np.ndarray) -> np.ndarray:
    """Matrix exponential by scaling and squaring of a Taylor series (small matrices)."""
    M = np.asarray(M, float)
    norm = np.abs(M).sum(axis=1).max() if M.size else 0.0
    s = max(0, int(np.ceil(np.log2(norm))) + 1) if norm > 0.5 else 0
    A = M / 2.0**s
    out = np.eye(M.shape[0])
    term = np.eye(M.shape[0])
    for k in range(1, 30):
        term = term @ A / k
        out = out + term
        if np.abs(term).max() < 1e-18 * np.abs(out).max():
            break
    for _ in range(s):
        out = out @ out
    return out


def uniform_attention_mean(heads: HeadMeasure, m0, t: float) -> np.ndarray:
    """m_t of the uniform-attention flow started from mean m0 (heads' Q, K are ignored)."""
    m = np.asarray(m0, float).copy()
    L = heads.layers
    for l in range(L):
        t0, t1 = l / L, (l + 1) / L
        if t <= t0:
            break
        Vbar = heads.values(l).mean(axis=0)   # sum_h w_h V_h
        m = expm((min(t, t1) - t0) * Vbar) @ m
    return m


def uniform_attention_shift(heads: HeadMeasure, m0, t: float) -> np.ndarray:
    """The rigid displacement m_t - m_0 of rho under uniform attention."""
    return uniform_attention_mean(heads, m0, t) - np.asarray(m0, float)


def expm_frechet(X: np.ndarray, E: np.ndarray) -> np.ndarray:
    """L(X, E) = d/de expm(X + e E) at e = 0 = int_0^1 e^{(1-s)X} E e^{sX} ds (block trick)."""
    d = X.shape[0]
    big = np.zeros((2 * d, 2 * d))
    big[:d, :d] = big[d:, d:] = X
    big[:d, d:] = E
    return expm(big)[:d, d:]


def uniform_attention_moments_gradient(heads: HeadMeasure, m0, C0, mstar, Cstar):
    r"""Closed-form dR/dQ, dR/dK, dR/dV at Q = 0 of the moments objective
    R = 1/2 |m_1 - m*|^2 + 1/2 ||C_1 - C*||_F^2 for one prompt of mean m0, covariance C0.

    At A = 0 the flow translates (C_t = C0, m' = Vbar_l m). To first order in A the tilted
    mean is m + C A x, so a perturbation dA_h of layer l adds dB = V_h C0 dA_h / H to the
    mean's generator and changes the covariance by tau (dB C0 + C0 dB^T), tau = 1/L. With
    r = m_1 - m*, lambda_l = (E_{L-1} ... E_{l+1})^T r, u_l = m(l/L), E_l = e^{tau Vbar_l}
    and Gamma_l = tau L(tau Vbar_l^T, lambda_l u_l^T) (the gradient of r^T m_1 in Vbar_l):

        dR/dV_{l,h} = Gamma_l / H,
        dR/dA_{l,h} = C0 V_h^T (Gamma_l + 2 tau (C0 - C*) C0) / H,

    then dR/dQ = K dR/dA and dR/dK = Q (dR/dA)^T (= 0 at Q = 0)."""
    if heads.weights is not None:
        raise ValueError("the uniform-attention gradient is that of unweighted heads")
    L, H = heads.layers, heads.heads
    tau = 1.0 / L
    C0, Cstar = np.asarray(C0, float), np.asarray(Cstar, float)
    Vbar = heads.V.mean(axis=1)
    E = [expm(tau * Vbar[l]) for l in range(L)]
    u = [np.asarray(m0, float)]
    for l in range(L):
        u.append(E[l] @ u[-1])
    lam = u[L] - np.asarray(mstar, float)
    dA = np.zeros((L, H) + C0.shape)
    dV = np.zeros_like(heads.V)
    G = C0 - Cstar
    for l in reversed(range(L)):
        Gamma = tau * expm_frechet(tau * Vbar[l].T, np.outer(lam, u[l]))
        dV[l] = Gamma / H
        for h in range(H):
            dA[l, h] = C0 @ heads.V[l, h].T @ (Gamma + 2 * tau * G @ C0) / H
        lam = E[l].T @ lam
    return (*query_key_derivatives(heads, dA), dV)


# ------------------------------------------------------------------ Gaussian prompts

def _layer_weights(weights, L: int, H: int) -> np.ndarray:
    w = np.full((L, H), 1.0 / H) if weights is None else np.asarray(weights)
    if w.shape != (L, H):
        raise ValueError(f"weights of shape {w.shape}, expected (L, H) = {(L, H)}")
    return w


def gaussian_moment_rates(m, C, A, V, w, beta: float = 1.0):
    """(m', C') of the moment ODE above for one layer: A (H, d, d) = K_h^T Q_h,
    V (H, d, d), w (H,). Real or complex (a complex step differentiates it)."""
    VW = np.einsum("h,hij->hij", w, V)
    J = beta * np.einsum("hij,jk,hkl->il", VW, C, A)
    return VW.sum(axis=0) @ m + J @ m, J @ C + C @ J.T


def gaussian_moments(Q, K, V, m0, C0, *, beta: float = 1.0, weights=None, times=(1.0,),
                     rtol: float = 1e-13, atol: float = 1e-15):
    """Mean and covariance of the Gaussian prompt N(m0, C0) transported by the heads
    (Q, K: (L, H, k, d), V: (L, H, d, d), ``weights`` (L, H), default 1/H) at each of
    ``times`` (increasing, in [0, 1]): arrays (len(times), d) and (len(times), d, d), to
    about ``rtol`` (scipy's DOP853 layer by layer; complex heads give the complex-step
    derivative)."""
    from scipy.integrate import solve_ivp
    L, H, _, d = np.shape(Q)
    w = _layer_weights(weights, L, H)
    times = [float(t) for t in times]
    state = np.concatenate([np.asarray(m0), np.asarray(C0).ravel()]).astype(
        np.result_type(*map(np.asarray, (Q, K, V, m0, C0, w)), float))
    found = [state] * sum(t <= 0 for t in times)

    def rate(_, y, A, Vl, wl):
        dm, dC = gaussian_moment_rates(y[:d], y[d:].reshape(d, d), A, Vl, wl, beta)
        return np.concatenate([dm, dC.ravel()])

    for l in range(L):
        if len(found) == len(times):
            break
        t0, t1 = l / L, (l + 1) / L
        wanted = [t for t in times[len(found):] if t <= t1]
        sol = solve_ivp(rate, (t0, t1), state, method="DOP853", t_eval=sorted(set(wanted) | {t1}),
                        rtol=rtol, atol=atol, args=(attention_matrices(Q[l], K[l]), np.asarray(V[l]), w[l]))
        if not sol.success:
            raise RuntimeError(f"the Gaussian moment ODE failed on layer {l}: {sol.message}")
        found += [sol.y[:, k] for k in range(len(wanted))]
        state = sol.y[:, -1]
    found = np.array(found)
    return found[:, :d], found[:, d:].reshape(-1, d, d)


def gaussian_moments_risk(Q, K, V, m0, C0, mstar, Cstar, *, beta: float = 1.0, weights=None):
    """R = 1/2 |m_1 - m*|^2 + 1/2 ||C_1 - C*||_F^2 of the Gaussian prompt N(m0, C0)."""
    m, C = gaussian_moments(Q, K, V, m0, C0, beta=beta, weights=weights)
    r, G = m[-1] - np.asarray(mstar), C[-1] - np.asarray(Cstar)
    return 0.5 * np.sum(r * r) + 0.5 * np.sum(G * G)


def gaussian_moments_gradient(Q, K, V, m0, C0, mstar, Cstar, *, beta: float = 1.0, weights=None,
                              step: float = 1e-30):
    """dR/dQ, dR/dK, dR/dV of :func:`gaussian_moments_risk`, entry by entry by the complex
    step R'(theta) e = Im R(theta + i step e) / step: no cancellation, so exact to the
    ODE's tolerance (one complex solve per entry: small models)."""
    arrays = [np.asarray(a, float) for a in (Q, K, V)]
    grads = [np.zeros_like(a) for a in arrays]
    for a, g in enumerate(grads):
        for idx in np.ndindex(arrays[a].shape):
            moved = [x.astype(complex) for x in arrays]
            moved[a][idx] += 1j * step
            g[idx] = gaussian_moments_risk(*moved, m0, C0, mstar, Cstar, beta=beta,
                                           weights=weights).imag / step
    return tuple(grads)



def mean_head_moments(means, layers: int, m0, C0, *, beta: float = 1.0):
    """Final (mean, covariance) of N(m0, C0) in the H -> infinity limit of heads drawn
    i.i.d. with Q, K and V independent, of means ``means`` = (Qbar (k, d), Kbar (k, d),
    Vbar (d, d)), None for zero: the limit velocity is
    E[V (m + beta C K^T Q x)] = Vbar (m + beta C Kbar^T Qbar x) on every layer, that of
    the one mean head."""
    d = len(m0)
    k = next((np.shape(a)[0] for a in means[:2] if a is not None), 1)
    Qbar, Kbar, Vbar = (np.zeros(shape) if a is None else np.asarray(a, float)
                        for a, shape in zip(means, ((k, d), (k, d), (d, d))))
    one = [np.broadcast_to(a, (layers, 1) + a.shape) for a in (Qbar, Kbar, Vbar)]
    m, C = gaussian_moments(*one, m0, C0, beta=beta)
    return m[-1], C[-1]
