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

from .heads import HeadMeasure


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
