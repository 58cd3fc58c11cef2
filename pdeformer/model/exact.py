r"""Closed-form solutions of the model, for verification.

Uniform attention (Q = 0, so A_h = 0): every token attends to all tokens equally, the
tilted mean is the mean m_t of rho_t, and the velocity is the same at every x,
v_t = Vbar_l m_t with Vbar_l = (1/H) sum_h V_{l,h}. The density is translated rigidly,

.. math::

    \rho_t(x) = \rho_0(x - (m_t - m_0)), \qquad
    m_t = e^{(t - l/L) \bar V_l} m_{l/L} \quad \text{on layer } l,

(mass conservation makes m' = v, and v is constant in space).
"""

from __future__ import annotations

import numpy as np

from .heads import HeadMeasure, query_key_derivatives


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
        Vbar = heads.V[l].mean(axis=0)
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
