r"""NTK injectivity: is the neural tangent kernel of attention injective for these prompts?

The criterion (design §3): the NTK is injective iff the log-Laplace transforms
Lambda_i(b) = log int e^{<b,y>} d mu_i(y) of the prompts are linearly independent modulo
affine functions of b. Two numerical checks:

1. **LSE test.** Lambda_i at n sample points b_s of [-R, R]^d, the affine part projected
   out (the component along span{1, b_1, ..., b_d}), then the singular values of the
   (n x S) matrix: sigma_min / sigma_max > tol means independent.
2. **NTK Gram.** For data points (mu_i, x_p) -- every prompt with the same query points
   x_p, or prompt i with query i -- and a head measure (sampled heads, or the run's heads at a layer), the Gram
   matrix G = (1/J) sum_j J_j J_j^T (sum_j w_j J_j J_j^T for weighted heads) of the
   Jacobians of Gamma_theta[mu_i](x_p) = V m(A x_p) with respect to the trained
   parameters (A only, V only, or all of Q, K, V); its eigenvalues and lambda_min /
   lambda_max > tol^2 means injective on these data.
   With A trained, the Jacobian only sees Hess Lambda (the affine part drops out), which is
   why the two checks agree; training V also sees grad Lambda.

Log-Laplace transforms, their gradients (tilted means) and Hessians (tilted covariances),
stable in closed form:

* discrete  sum_j w_j delta_{y_j}: Lambda = logsumexp_j(log w_j + <b, y_j>);
* uniform on a box: the sum over coordinates of log((e^{b c} - e^{b a}) / (b (c - a))),
  written as b a + log(expm1(t)/t), t = b (c - a), with series near t = 0;
* Gaussian mixture: logsumexp_k(log pi_k + <m_k, b> + b^T Sigma_k b / 2);
* anything else (a density file, a mesh density of a forward run at depth t): quadrature
  points and weights, i.e. the discrete formula.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from ..attention.softmax import Sources, tilted_moments
from ..tools.errors import ConfigError, SolverBreakdown
from ..integrator.frames import Tracker
from ..model.heads import HeadMeasure, ntk_jacobians
from ..model.params import layer_slice
from ..tools.parallel import allgather_rows, on_root
from ..model.prompt_files import PointCloud
from ..model.prompts import GaussianMixture, UniformBox

log = logging.getLogger("pdeformer")


# --------------------------------------------------------------------------- Lambda

def _log_expm1_over(t: np.ndarray) -> np.ndarray:
    """log((e^t - 1)/t), stable for all t (series near 0, t + log1p(-e^-t) - log t far)."""
    t = np.asarray(t, float)
    out = np.empty_like(t)
    small = np.abs(t) < 1e-3
    ts = t[small]
    out[small] = ts / 2 + ts**2 / 24 - ts**4 / 2880
    tl = t[~small]
    pos = tl > 0
    big = np.empty_like(tl)
    big[pos] = tl[pos] + np.log(-np.expm1(-tl[pos])) - np.log(tl[pos])
    big[~pos] = np.log(-np.expm1(tl[~pos])) - np.log(-tl[~pos])
    out[~small] = big
    return out


def _uniform_moments(t: np.ndarray):
    """Mean and variance (in units of the interval) of e^{t s} ds on [0, 1]:
    1/(1 - e^{-t}) - 1/t and 1/t^2 - 1/(4 sinh^2(t/2)), with series near t = 0."""
    t = np.asarray(t, float)
    mean, var = np.empty_like(t), np.empty_like(t)
    small = np.abs(t) < 1e-2
    ts = t[small]
    mean[small] = 0.5 + ts / 12 - ts**3 / 720
    var[small] = 1 / 12 - ts**2 / 240 + ts**4 / 6048
    tl = t[~small]
    mean[~small] = -1 / np.expm1(-tl) - 1 / tl
    with np.errstate(over="ignore"):
        sh = np.sinh(tl / 2)
        var[~small] = 1 / tl**2 - 1 / (4 * sh * sh)
    return mean, var


def log_laplace(measure, b: np.ndarray):
    """Lambda(b) (n,), grad Lambda (n, d) and Hess Lambda (n, d, d) of a measure at points
    b (n, d): a GaussianMixture, UniformBox, PointCloud or a (points, weights) pair."""
    b = np.atleast_2d(np.asarray(b, float))
    n, d = b.shape
    if isinstance(measure, GaussianMixture):
        lin = b @ measure.means.T                                       # (n, K)
        quad = 0.5 * np.einsum("ni,kij,nj->nk", b, measure.covs, b)
        logits = np.log(measure.weights) + lin + quad
        top = logits.max(axis=1, keepdims=True)
        r = np.exp(logits - top)
        lam = top[:, 0] + np.log(r.sum(axis=1))
        r /= r.sum(axis=1, keepdims=True)
        mk = measure.means[None] + np.einsum("kij,nj->nki", measure.covs, b)   # (n, K, d)
        grad = np.einsum("nk,nki->ni", r, mk)
        second = np.einsum("nk,kij->nij", r, measure.covs) + np.einsum("nk,nki,nkj->nij", r, mk, mk)
        return lam, grad, second - np.einsum("ni,nj->nij", grad, grad)
    if isinstance(measure, UniformBox):
        L = measure.upper - measure.lower
        t = b * L
        lam = (b * measure.lower).sum(axis=1) + _log_expm1_over(t).sum(axis=1)
        mean, var = _uniform_moments(t)
        hess = np.zeros((n, d, d))
        hess[:, np.arange(d), np.arange(d)] = var * L**2
        return lam, measure.lower + mean * L, hess
    points, weights = (measure.points, measure.weights) if isinstance(measure, PointCloud) else measure
    tm = tilted_moments(b, Sources.from_arrays(points, weights), np.eye(d)[None], order=2)
    return tm.log_partition[0], tm.mean[0], tm.cov[0]


# --------------------------------------------------------------------------- the tests

def affine_projection(b: np.ndarray) -> np.ndarray:
    """Orthogonal projector onto the complement of span{1, b_1, ..., b_d} (n x n)."""
    B = np.hstack([np.ones((b.shape[0], 1)), b])
    Qb, _ = np.linalg.qr(B)
    return np.eye(b.shape[0]) - Qb @ Qb.T


def lse_test(measures: list, b: np.ndarray) -> dict:
    """Singular values of the Lambda_i(b_s) matrix with the affine part projected out,
    their ratio, and ``weakest``: the unit coefficients c of the combination
    sum_i c_i Lambda_i closest to an affine function (the last right singular vector)."""
    M = np.stack([log_laplace(m, b)[0] for m in measures], axis=1)     # (n, S)
    if not np.all(np.isfinite(M)):
        return {"singular_values": np.full(M.shape[1], np.nan), "ratio": math.nan,
                "weakest": np.full(M.shape[1], np.nan)}
    _, s, vt = np.linalg.svd(affine_projection(b) @ M, full_matrices=False)
    weakest = vt[-1] * np.sign(vt[-1][np.argmax(np.abs(vt[-1]))])
    return {"singular_values": s, "ratio": float(s[-1] / s[0]) if s[0] > 0 else 0.0,
            "weakest": weakest}


def head_jacobians(measure, x: np.ndarray, heads: dict, params: str, beta: float = 1.0) -> np.ndarray:
    """d Gamma_theta[mu](x_p) / d theta of every head of ``heads`` (one layer's slice of
    the attention block) at every point: (J, P*d, n_params)
    (:func:`pdeformer.model.heads.ntk_jacobians` with mu's tilted moments)."""
    return ntk_jacobians(lambda b: log_laplace(measure, b), x, heads, beta, params)


def ntk_gram(measures: list, x: np.ndarray, heads: dict, params: str = "A",
             matched: bool = False, beta: float = 1.0) -> dict:
    """Spectrum of the NTK Gram matrix G = (1/J) sum_j J_j J_j^T on the data (mu_i, x_p)
    (G = sum_j w_j J_j J_j^T for heads with ``weights``): every prompt with every query
    point, (S*P*d) x (S*P*d), or with ``matched`` prompt i with query i only, (S*d) x
    (S*d). Its eigenvalues are the squared singular values of the stacked Jacobians
    [J_1 ... J_J] / sqrt(J) (sqrt(w_j) J_j), computed by an SVD of those (accurate far
    below the round-off level of G itself)."""
    J = np.concatenate([head_jacobians(m, x[i:i + 1] if matched else x, heads, params, beta)
                        for i, m in enumerate(measures)], axis=1)
    if not np.all(np.isfinite(J)):
        n = J.shape[1]
        return {"eigenvalues": np.full(n, np.nan), "ratio": math.nan, "size": n}
    w = heads.get("weights")
    scale = np.full(J.shape[0], 1 / np.sqrt(J.shape[0])) if w is None else np.sqrt(np.asarray(w, float))
    stacked = np.concatenate([s * Jj for s, Jj in zip(scale, J)], axis=1)    # (S*P*d, J*n_params)
    sv = np.linalg.svd(stacked, compute_uv=False)
    lam = np.zeros(stacked.shape[0])
    lam[:len(sv)] = sv**2
    return {"eigenvalues": lam, "ratio": float(lam[-1] / lam[0]) if lam[0] > 0 else 0.0,
            "size": int(stacked.shape[0])}


def sample_points(b_range: float, count: int, d: int, seed: int) -> np.ndarray:
    """count points of [-b_range, b_range]^d: a seeded uniform sample."""
    return b_range * (2 * np.random.default_rng(seed).random((count, d)) - 1)




# --------------------------------------------------------------------------- from a run

class _DepthReached(Exception):
    """Ends a forward/particle solve at the depth the NTK test looks at."""

    def __init__(self, state, weights=None):
        self.state, self.weights = state, weights


class _StopAtDepth(Tracker):
    """At the frame at depth t, hand over the state and stop the solve."""

    def __init__(self, t: float):
        self.t = t

    def frame(self, solver, frame):
        if abs(frame.t - self.t) < 1e-12:
            raise _DepthReached(frame.coeffs, frame.extra.get("weights"))


def _solve_to(solver, index: int, t: float):
    """The state of prompt ``index`` at depth t (a frame time) of a solver."""
    try:
        solver.solve_prompt(index, [_StopAtDepth(t)])
    except _DepthReached as reached:
        return reached.state, reached.weights
    raise AssertionError(f"depth {t} is not a frame time")  # excluded by check_depth


def check_depth(t: float, layers: int, frames_per_layer: int) -> None:
    n = layers * frames_per_layer
    if abs(t * n - round(t * n)) > 1e-9:
        raise ConfigError("ntk.depth", f"{t} is not a frame time: with {layers} layer(s) and "
                          f"{frames_per_layer} frame(s) per layer use a multiple of 1/{n}")


def check_inputs(problem) -> None:
    """Everything in [ntk] that can be wrong for this problem, before anything runs."""
    ntk, d, S = problem.opts.ntk, problem.dim, len(problem.prompts)
    if ntk.depth is not None:
        check_depth(ntk.depth, problem.heads.layers, problem.opts.output.frames_per_layer)
    if ntk.b_count <= S + d + 1:
        raise ConfigError("ntk.b_count", f"{ntk.b_count} sample points cannot separate {S} "
                          f"prompt(s) from the {d + 1} affine functions: use more than {S + d + 1}")
    query_points(ntk, d, S)
    ntk_heads(problem)


def prompt_measures(problem, timer) -> tuple[list, list]:
    """The measures the test looks at, one per prompt, and how each was obtained.

    Without ``ntk.depth``: the prompts themselves -- closed forms for Gaussian mixtures,
    uniform boxes and point clouds; a density file or a density on a circle or sphere
    through the quadrature of its DG projection. With a depth t: the state of a forward run at t -- mesh densities by
    quadrature (DG, ``ntk.quadrature_degree``), point clouds as tokens of the particle
    model."""
    from ..solvers.forward import ForwardSolver
    from ..model.particles import ParticleSolver
    from ..fem.transport import CellQuadrature
    opts, comm = problem.opts, problem.comm
    t = opts.ntk.depth
    disc = opts.discretisation
    qdeg = opts.ntk.quadrature_degree or 2 * disc.degree + 2
    prompts = problem.prompts
    measures: list = [m for _, m in prompts]
    how = ["closed form"] * len(prompts)
    on_mesh = [i for i, (_, m) in enumerate(prompts)   # no closed form: a file, a sphere's density
               if m.kind != "points" and (t is not None or not isinstance(m, (GaussianMixture, UniformBox)))]
    as_tokens = [i for i, (_, m) in enumerate(prompts) if m.kind == "points" and t]
    if on_mesh:
        sub = dataclasses.replace(problem, prompts=[prompts[i] for i in on_mesh], groups=None)
        solver = ForwardSolver(sub, timer)
        tr = solver.transport
        quad = CellQuadrature(problem.mesh, qdeg, tr.u)
        for j, i in enumerate(on_mesh):
            with timer.phase("forward"):
                coeffs = solver.initial_coeffs[j] if not t else _solve_to(solver, j, t)[0]
            tr.set_state(coeffs)
            measures[i] = (allgather_rows(comm, quad.points), allgather_rows(comm, quad.weights()))
            how[i] = f"DG-{disc.degree} density at t = {t or 0:g}, quadrature degree {qdeg}"
    if as_tokens:
        sub = dataclasses.replace(problem, prompts=[prompts[i] for i in as_tokens], groups=None)
        solver = ParticleSolver(sub, timer)
        for j, i in enumerate(as_tokens):
            with timer.phase("particles"):
                x, w = _solve_to(solver, j, t)
            measures[i] = (allgather_rows(comm, x), allgather_rows(comm, w))
            how[i] = f"tokens of the particle model at t = {t:g}"
    return measures, how


def ntk_heads(problem) -> tuple[dict, dict]:
    """The head measure in the Gram matrix (one layer's slice of the attention block:
    sampled heads, or the run's at a layer) and a description of it. The scores are
    those of ``[attention] beta``."""
    ntk = problem.opts.ntk
    heads, d = problem.heads, problem.dim
    beta = problem.opts.attention.beta
    if ntk.heads == "sampled":
        h = HeadMeasure.random(1, ntk.head_count, heads.key_dim, d, seed=ntk.seed,
                               scale=ntk.head_scale)
        return layer_slice(h.params, 0), {"heads": "sampled", "count": ntk.head_count,
                                          "scale": ntk.head_scale, "seed": ntk.seed, "beta": beta}
    layer = ntk.layer
    if layer is None:
        layer = heads.layer_of(ntk.depth) if ntk.depth is not None else 0
    if layer >= heads.layers:
        raise ConfigError("ntk.layer", f"{layer} is not a layer of the model (0..{heads.layers - 1})")
    block = layer_slice(heads.params, layer)
    if heads.weights is not None:       # G = sum_j w_j J_j J_j^T
        block["weights"] = heads.weights[layer]
    return block, {"heads": "run", "layer": layer, "count": heads.heads, "beta": beta,
                   "weighted": heads.weights is not None}


def query_points(ntk, d: int, prompts: int) -> np.ndarray:
    """The query points x_p (P, d); with ``pairing = "matched"`` one per prompt."""
    from ..model.prompts import vector_list
    if ntk.queries is None:
        x = np.full((1, d), 1 / math.sqrt(d))
        return np.repeat(x, prompts, axis=0) if ntk.pairing == "matched" else x
    x = vector_list("ntk.queries", ntk.queries, d)
    if ntk.pairing == "matched" and len(x) != prompts:
        raise ConfigError("ntk.queries", f"pairing = 'matched' needs one query point per prompt "
                                         f"({prompts}), got {len(x)}")
    return x


def analyse(names: list, measures: list, problem) -> dict:
    """Both tests on the measures of a run: what ntk.json holds."""
    ntk = problem.opts.ntk
    check_inputs(problem)
    x = query_points(ntk, problem.dim, len(measures))
    heads, head_info = ntk_heads(problem)
    b = sample_points(ntk.b_range, ntk.b_count, problem.dim, ntk.seed)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):   # checked below
        lse = lse_test(measures, b)
        gram = ntk_gram(measures, x, heads, ntk.params, ntk.pairing == "matched", head_info["beta"])
    for what, values in (("Lambda", lse["singular_values"]), ("NTK Gram", gram["eigenvalues"])):
        if not np.all(np.isfinite(values)):
            raise not_finite(what, measures, problem, x, heads)
    tol = ntk.tol
    return {
        "tol": tol,
        "lse": {"b_range": ntk.b_range, "b_count": ntk.b_count, "seed": ntk.seed,
                "singular_values": lse["singular_values"], "ratio": lse["ratio"],
                "independent": bool(lse["ratio"] > tol),
                "weakest_combination": dict(zip(names, lse["weakest"]))},
        "ntk": {**head_info, "params": ntk.params, "queries": x, "pairing": ntk.pairing,
                "size": gram["size"],
                "eigenvalues": gram["eigenvalues"], "ratio": gram["ratio"],
                "injective": bool(gram["ratio"] > tol * tol)},
    }


def not_finite(what: str, measures: list, problem, x, heads: dict) -> Exception:
    """The error for a test whose values came out NaN or infinite, naming its cause: a
    density with negative values (a breakdown: it has no log-Laplace transform), else
    the input that took Lambda's argument b past what doubles hold -- for the LSE test
    ntk.b_range; for the Gram matrix whichever of ntk.queries, the heads' scale and
    attention.beta contributes most to the scores b = beta A x (bad input)."""
    if any(isinstance(m, tuple) and np.any(np.asarray(m[1]) < 0) for m in measures):
        return SolverBreakdown(f"ntk: {what} is not finite: a density with negative values has no "
                               "log-Laplace transform at some b; set discretisation.limiter = true")
    ntk = problem.opts.ntk
    if what == "Lambda":
        return ConfigError("ntk.b_range", f"{ntk.b_range:g}: the prompts' log-Laplace transforms "
                           "overflow at such b (Lambda(b) grows like |b| x their extent, or "
                           "|b|^2 x their covariances); lower ntk.b_range")
    beta = problem.opts.attention.beta
    sampled = ntk.heads == "sampled"
    head = ntk.head_scale if sampled else max(float(np.abs(a).max()) for a in heads.values())
    params = problem.opts.model.params
    head_key = "ntk.head_scale" if sampled else ("model.params" if params is not None else "model.init_scale")
    # each input's share of log10 |b| = log10 |beta A x| (A = K^T Q: the heads' scale squared)
    shares = {"ntk.queries": math.log10(max(float(np.abs(x).max()), 1.0)),
              head_key: 2 * math.log10(max(head, 1.0)), "attention.beta": math.log10(max(beta, 1.0))}
    key = max(shares, key=shares.get)
    todo = {"ntk.queries": "use query points of the prompts' scale",
            "ntk.head_scale": "lower ntk.head_scale",
            "model.params": "the run's heads are too large for this test; use ntk.heads = 'sampled'",
            "model.init_scale": "the run's heads are too large for this test; use ntk.heads = 'sampled'",
            "attention.beta": "lower attention.beta"}[key]
    return ConfigError(key, f"the NTK Gram matrix overflows: its scores b = beta A x reach "
                       f"~1e{sum(shares.values()):.0f} (queries up to |x| = {float(np.abs(x).max()):.3g}, "
                       f"head entries ~{head:.3g}, beta = {beta:g}); {todo}")


def plot_spectra(filename: str, result: dict) -> bool:
    """Both spectra, normalised by the largest value, with the tolerance lines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("warning: matplotlib is missing: no ntk.png (Debian: python3-matplotlib)")
        return False
    tiny = 1e-300
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    tol = result["tol"]
    for ax, key, values, line, label in (
            (axes[0], "lse", result["lse"]["singular_values"], tol, r"$\sigma_k / \sigma_1$"),
            (axes[1], "ntk", result["ntk"]["eigenvalues"], tol * tol, r"$\lambda_k / \lambda_1$")):
        v = np.asarray(values, float)
        rel = np.maximum(v / v[0] if v[0] > 0 else v, tiny)
        ax.semilogy(np.arange(1, len(v) + 1), rel, "o-")
        ax.axhline(line, color="k", ls="--", lw=0.8, label="tol" if key == "lse" else "tol$^2$")
        ax.legend(loc="lower left", fontsize=8)
        ok = result[key]["independent" if key == "lse" else "injective"]
        verdict = ("independent" if ok else "dependent") if key == "lse" else \
            ("injective" if ok else "not injective")
        ax.set_title(("LSE test" if key == "lse" else f"NTK Gram ({result['ntk']['params']})")
                     + f": {verdict}", fontsize=10)
        ax.set_xlabel("k")
        ax.set_ylabel(label)
        ax.set_xticks(np.arange(1, len(v) + 1) if len(v) <= 12 else ax.get_xticks())
    fig.tight_layout()
    from ..tools.output import save_figure
    save_figure(filename, fig, dpi=120)
    plt.close(fig)
    return True


def run_analysis(names: list, measures: list, problem) -> dict:
    """:func:`analyse` on rank 0, its result on every rank."""
    return on_root(problem.comm, analyse, names, measures, problem)
