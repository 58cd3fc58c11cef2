r"""The model's Gram matrix and the convergence it predicts for gradient descent.

For the moments objective the model's outputs on the S training prompts are finitely
many numbers: per prompt y_s = (mean, cov_ii, sqrt(2) cov_ij for i < j) of rho_1^s, so
that R = (1/(2S)) |Y - Y*|^2 with Y the N = S m outputs stacked. Their Jacobian
J = dY/dtheta (N x P, theta all Q, K, V of the L H heads) comes from the adjoint, one
backward sweep per output (:meth:`AdjointSolver.output_jacobian`), so it is that of the
discrete model the solver computes. With G = J J^T and the gd step
theta <- theta - lr L H dR/dtheta, dR/dtheta = J^T r / S, r = Y - Y*, the residual of
the linearised model moves as

    r_{k+1} = (I - a G) r_k,   a = lr L H / S,

so in the eigenbasis G u_i = lambda_i u_i, with c_i = u_i^T r_0,

    R_k = (1/(2S)) sum_i (1 - a lambda_i)^{2k} c_i^2,

each mode decaying at the rate -2 log|1 - a lambda_i| per step (about 2 a lambda_i for
small steps), stable while a lambda_max < 2. Directions with lambda_i <= tol^2
lambda_max (``[ntk] tol``) are lost: their part of the risk,
(1/(2S)) sum_{lost} c_i^2, stays (the plateau). In the mean-field scaling each head's
derivative is O(1/(L H)), so lambda = O(1/(L H)) and a lambda does not depend on L or H
at a fixed head law: the L H in the step makes the predicted rate width- and
depth-independent (docs/training.md, "The Gram matrix").

With several blocks in the parameter tree gd moves block b by lr L_b W_b dR/dtheta
(W_b its particles per layer): then G = J D J^T with D = diag(L_b W_b / (L W)_max) over
J's columns and a = lr (L W)_max / S (:func:`column_weights`); with the heads alone
D = I.
"""

from __future__ import annotations

import logging

import numpy as np

from ..model import params as tree
from ..tools.errors import ConfigError

log = logging.getLogger("pdeformer")


def check_inputs(cfg: dict) -> None:
    """The Gram matrix needs an objective with finitely many outputs (moments): checked
    on the config, before anything is built (the same on every rank)."""
    from ..model.objectives import OBJECTIVES
    kind = cfg["objective"]["kind"]
    if kind is not None and not hasattr(OBJECTIVES[kind], "outputs"):
        raise ConfigError("objective.kind", f"gram needs an objective whose value is 1/2 |y - y*|^2 of "
                          f"finitely many outputs y: 'moments' (got {kind!r})")


def column_weights(params: dict) -> tuple[np.ndarray | None, tuple[int, int]]:
    """For J's columns (the tree flattened) the weights L_b W_b / (L W)_max of their
    blocks (None where every block has the same L W), and (L, W) of the block with the
    largest L W (module docstring)."""
    scales = {block: tree.layers_width(arrays) for block, arrays in params.items()}
    top = max(scales.values(), key=lambda s: s[0] * s[1])
    if len({s[0] * s[1] for s in scales.values()}) == 1:
        return None, top
    weights = [np.full(a.size, scales[block][0] * scales[block][1] / (top[0] * top[1]))
               for (block, _), a in tree.leaves(params)]
    return np.concatenate(weights), top


def gram_matrix(J: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """G = J D J^T, D = diag(weights) (J J^T without weights)."""
    return J @ J.T if weights is None else (J * weights) @ J.T


def gram_analysis(y: np.ndarray, ystar: np.ndarray, J: np.ndarray, prompts: int, layers: int,
                  heads: int, lr: float, steps: int, tol: float, weights: np.ndarray | None = None) -> dict:
    """The spectrum of G = J D J^T and the linearised gd prediction (module docstring) for
    ``prompts`` training prompts and ``steps`` steps, ``layers`` x ``heads`` the largest
    L W of the blocks and ``weights`` D's diagonal (:func:`column_weights`); numbers and
    lists (JSON)."""
    G = gram_matrix(J, weights)
    lam, U = np.linalg.eigh(G)
    lam, U = lam[::-1].copy(), U[:, ::-1]
    lam_max = max(float(lam[0]), 0.0)
    r = y - ystar
    c = U.T @ r
    a = lr * layers * heads / prompts
    factor = 1.0 - a * lam
    with np.errstate(divide="ignore"):
        rates = -2.0 * np.log(np.abs(factor))
    kept = lam > tol**2 * lam_max
    k = np.arange(steps + 1)[:, None]
    with np.errstate(over="ignore", invalid="ignore"):      # unstable: the curve runs to inf
        curve = 0.5 / prompts * np.sum(c**2 * factor[None, :] ** (2 * k), axis=1)
    # the rate the risk falls at once the fast modes are gone: that of the slowest kept
    # mode the residual has a part in (others are invisible in the risk). The slowest is
    # not always the smallest lambda: past a (lambda_max + lambda_min) = 2 the step
    # overshoots the largest modes, which then decay slowest.
    seen = kept & (c**2 > 1e-24 * max(float(np.sum(c**2)), 1e-300))
    return {
        "outputs": int(len(y)), "params": int(J.shape[1]), "prompts": int(prompts),
        "eigenvalues": lam.tolist(), "ratio": max(float(lam[-1] / lam_max), 0.0) if lam_max > 0 else 0.0,
        "injective": bool(kept.all()), "tol": tol, "lost_directions": int((~kept).sum()),
        "lr": lr, "layers": layers, "heads": heads, "step_factor": a,
        "stable": bool(a * lam_max < 2), "risk": float(0.5 / prompts * r @ r),
        "residual_components": c.tolist(), "mode_rates": rates.tolist(),
        "slowest_rate": float(rates[kept].min()) if kept.any() else 0.0,
        "asymptotic_rate": float(rates[seen].min()) if seen.any() else None,
        "plateau": float(0.5 / prompts * np.sum(c[~kept] ** 2)),
        "predicted_risk": curve.tolist()}


def plot_gram(filename: str, result: dict) -> bool:
    """gram.png: the eigenvalues with the tol^2 lambda_max line, and the predicted risk
    against the gd step (log scales). False where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from ..tools.output import save_figure
    lam = np.asarray(result["eigenvalues"])
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(8, 3), constrained_layout=True)
    i = np.arange(1, len(lam) + 1)
    pos = lam > 0
    ax0.semilogy(i[pos], lam[pos], "o", ms=3)
    ax0.axhline(result["tol"] ** 2 * lam[0], color="C3", ls=":", label="tol² λ_max")
    ax0.set_xlabel("i", fontsize=8)
    ax0.set_title(f"eigenvalues of G = J Jᵀ ({result['outputs']} outputs)", fontsize=9)
    ax0.legend(fontsize=7)
    curve = np.asarray(result["predicted_risk"])
    ax1.semilogy(np.arange(len(curve)), np.maximum(curve, 1e-300), "-")
    ax1.set_xlabel("gd step", fontsize=8)
    ax1.set_title(f"predicted risk (lr {result['lr']:g}, rate {result['asymptotic_rate'] or 0:.3g}/step)",
                  fontsize=9)
    for ax in (ax0, ax1):
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    save_figure(filename, fig, dpi=110)
    plt.close(fig)
    return True
