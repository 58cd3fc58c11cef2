"""The head measure: H head particles theta = (Q, K, V) in each of L layers.

Layer l covers depth t in [l/L, (l+1)/L); its velocity averages its H heads with
weight 1/H (design §1), or with fixed weights w_{l,h} >= 0 summing to 1 over each layer,
sum_h w_h Gamma_h. Parameters are stored as arrays ``Q (L,H,k,d)``, ``K (L,H,k,d)``,
``V (L,H,d,d)`` and, where the heads are weighted, ``weights (L,H)``: the layout of the
``.npz`` files. The weights are not trained.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ..attention.softmax import attention_matrices
from ..tools.errors import ConfigError, InputError
from ..tools.files import load_npz, npz_names
from ..tools.keys import Key, array, integer, number, path, string
from .params import file_keys, register_block

BLOCK = "attention"         # the heads' block of the model's parameter tree
ARRAYS = ("Q", "K", "V")    # what a parameter file (model.params, data.teacher) holds
WEIGHTS = "weights"         # and may hold: the heads' fixed weights (L, H)
DEPTHS = ("iid", "smooth")  # how random heads vary with depth (HeadMeasure.random)
LAWS = ("gaussian", "atoms")  # what random heads are drawn from
GAUSSIAN_MEANS = ("query_mean", "key_mean", "value_mean")   # the gaussian law's means of Q, K, V

# The [model] table: the head measure's sizes, and its parameters read from a file or
# drawn (HeadMeasure.random), or the data set's teacher's
MODEL_KEYS = {
    "layers": Key(integer(1, 10**5), None, "number of layers L"),
    "heads": Key(integer(1, 10**5), None, "heads per layer H"),
    "key_dim": Key(integer(1, 1024), None, "key dimension k (default: d)"),
    "params": Key(path, None, "head parameters .npz with Q (L,H,k,d), K (L,H,k,d), V (L,H,d,d) "
                  "and optionally the heads' fixed weights (L,H), >= 0, summing to 1 per layer"),
    "seed": Key(integer(0, 2**63 - 1), 0, "seed of the random heads"),
    "init_scale": Key(number(positive=True), 1.0, "Q, K, V entries ~ N(0, init_scale^2 / d)"),
    "query_scale": Key(number(nonnegative=True), None,
                       "scale of Q (default init_scale; 0: uniform attention)"),
    "depth": Key(string(DEPTHS), "iid",
                 "random heads independent per layer, or linear in depth per head"),
    "law": Key(string(LAWS), "gaussian",
               "law of the random heads: gaussian (init_scale, query_scale and the *_mean keys), or "
               "i.i.d. draws from weighted atoms (model.atoms)"),
    "query_mean": Key(array, None, "law = 'gaussian': the mean of every Q (k x d; default 0)"),
    "key_mean": Key(array, None, "law = 'gaussian': the mean of every K (k x d; default 0)"),
    "value_mean": Key(array, None, "law = 'gaussian': the mean of every V (d x d; default 0)"),
    "atoms": Key(path, None, "law = 'atoms': .npz of the atoms, Q (L,K,k,d), K (L,K,k,d), V (L,K,d,d) "
                 "and weights (L,K) (default equal); head (l, h) is atom j of layer l with probability "
                 "weights[l, j]"),
    "init": Key(string(("random", "teacher")), "random",
                "the heads at the start: drawn (or model.params), or the data set's teacher's "
                "plus init_noise (a student near the teacher)"),
    "init_noise": Key(number(nonnegative=True), 0.0,
                      "init = 'teacher': every entry of Q, K, V moves by init_noise N(0, 1)"),
}


@dataclass
class HeadMeasure:
    Q: np.ndarray  # (L, H, k, d)
    K: np.ndarray  # (L, H, k, d)
    V: np.ndarray  # (L, H, d, d)
    weights: np.ndarray | None = None  # (L, H), each layer summing to 1; None: 1/H

    block = BLOCK

    @property
    def params(self) -> dict:
        """{"Q": Q, "K": K, "V": V}: the heads' block of the parameter tree (the arrays
        themselves: an update in place moves the heads)."""
        return {"Q": self.Q, "K": self.K, "V": self.V}

    @classmethod
    def from_params(cls, arrays: dict) -> "HeadMeasure":
        """The heads of a block {"Q", "K", "V"} and, where weighted, "weights"."""
        return cls(arrays["Q"], arrays["K"], arrays["V"], arrays.get(WEIGHTS))

    @classmethod
    def checked_block(cls, block, key: str) -> "HeadMeasure":
        """The heads of a block {"Q", "K", "V"} (and optionally "weights") of arrays
        (copied as floats); ConfigError naming ``key`` where the block lacks one, their
        shapes disagree or an entry is not finite, or the weights are not weights."""
        if not isinstance(block, dict) or not set(ARRAYS) <= set(block) <= {*ARRAYS, WEIGHTS}:
            raise ConfigError(key, f"expected the arrays {', '.join(map(repr, ARRAYS))} "
                              f"(and optionally {WEIGHTS!r})")
        arrays = {n: np.array(block[n], dtype=float) for n in ARRAYS}
        Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
        if Q.ndim != 4 or K.shape != Q.shape or V.shape != Q.shape[:2] + (Q.shape[3],) * 2 or 0 in Q.shape:
            raise ConfigError(key, f"Q {Q.shape}, K {K.shape}, V {V.shape}: expected Q and K "
                              "(L, H, k, d) and V (L, H, d, d)")
        for n, a in arrays.items():
            if not np.all(np.isfinite(a)):
                raise ConfigError(key, f"{n} has non-finite entries")
        if block.get(WEIGHTS) is not None:
            try:
                arrays[WEIGHTS] = checked_weights(block[WEIGHTS], Q.shape[:2])
            except ValueError as e:
                raise ConfigError(f"{key}.{WEIGHTS}", str(e)) from None
        return cls.from_params(arrays)

    def uniform(self) -> bool:
        """Whether every head attends uniformly (Q = 0, so A_h = 0)."""
        return not np.any(self.Q != 0)

    @property
    def layers(self) -> int:
        return self.Q.shape[0]

    @property
    def heads(self) -> int:
        return self.Q.shape[1]

    @property
    def key_dim(self) -> int:
        return self.Q.shape[2]

    @property
    def dim(self) -> int:
        return self.Q.shape[3]

    def layer_of(self, t: float) -> int:
        """The layer whose interval [l/L, (l+1)/L) holds depth t (t = 1 -> last layer)."""
        return min(self.layers - 1, max(0, int(math.floor(t * self.layers + 1e-12))))

    def attention_matrices(self, layer: int) -> np.ndarray:
        """A_h = K_h^T Q_h of one layer, (H, d, d)."""
        return attention_matrices(self.Q[layer], self.K[layer])

    def values(self, layer: int) -> np.ndarray:
        """The values the velocity's 1/H mean sums, (H, d, d): V_h, or H w_h V_h where
        the heads are weighted (so that (1/H) sum_h of them is sum_h w_h V_h)."""
        scale = self.value_scale(layer)
        return self.V[layer] if scale is None else scale[:, None, None] * self.V[layer]

    def value_scale(self, layer: int) -> np.ndarray | None:
        """H w_h of ``layer`` (H,), None for unweighted heads: d/dV_h of the velocity is
        this times its derivative in :meth:`values`."""
        return None if self.weights is None else self.heads * self.weights[layer]

    @classmethod
    def random(cls, layers: int, heads: int, key_dim: int, dim: int, *, seed: int = 0,
               scale: float = 1.0, query_scale: float | None = None,
               depth: str = "iid", means: tuple | None = None) -> "HeadMeasure":
        """Random heads: entries of K, V ~ N(0, scale^2 / d), of Q ~ N(0, query_scale^2 / d)
        (query_scale = 0: uniform attention, every token attends to all equally).

        ``depth = "iid"``: head (l, h) is drawn from its own stream (seed, l, h).
        ``depth = "smooth"``: theta_{l,h} = theta0_h + (t_l - 1/2) theta1_h at the layer
        centre t_l = (l + 1/2)/L, theta0_h, theta1_h from the stream (seed, h): a head
        measure that is a smooth function of depth, so L -> infinity is a real limit.
        Either way a head's value depends neither on the number of ranks nor on H (the
        first H heads of a larger draw are the same heads: H -> infinity is a real
        mean-field sequence). ``means``: the law's means of Q, K and V ((k, d), (k, d),
        (d, d); None for a centred one), added to every head."""
        qs = scale if query_scale is None else query_scale
        sd = np.array([qs, scale, scale]) / math.sqrt(dim)
        shapes = [(key_dim, dim), (key_dim, dim), (dim, dim)]
        out = [np.empty((layers, heads) + sh) for sh in shapes]
        with np.errstate(over="ignore", invalid="ignore"):   # too large a scale: inf, refused on the mesh
            cls._draw(out, sd, shapes, layers, heads, seed, depth)
            for arr, mean in zip(out, means or (None,) * 3):
                if mean is not None:
                    arr += np.asarray(mean, dtype=float)
        return cls(*out)

    @classmethod
    def from_atoms(cls, atoms: "HeadMeasure", heads: int, seed: int = 0) -> "HeadMeasure":
        """H heads per layer drawn i.i.d. from a layer's atoms (the K heads of ``atoms``,
        atom j with probability its weight w_{l,j}, 1/K unweighted): head (l, h) from its
        own stream (seed, l, h), so the first H of a larger draw are the same heads."""
        L, K = atoms.layers, atoms.heads
        p = np.full((L, K), 1.0 / K) if atoms.weights is None else atoms.weights
        pick = np.array([[np.random.default_rng([seed, l, h, 1]).choice(K, p=p[l]) for h in range(heads)]
                         for l in range(L)])
        layer = np.arange(L)[:, None]
        return cls(atoms.Q[layer, pick], atoms.K[layer, pick], atoms.V[layer, pick])

    @staticmethod
    def _draw(out, sd, shapes, layers, heads, seed, depth) -> None:
        """Fill ``out`` (Q, K, V) with the draws :meth:`random` describes."""
        for h in range(heads):
            if depth == "smooth":
                rng = np.random.default_rng([seed, 1 << 20, h])
                base = [s * rng.standard_normal(sh) for s, sh in zip(sd, shapes)]
                slope = [s * rng.standard_normal(sh) for s, sh in zip(sd, shapes)]
            for l in range(layers):
                if depth == "smooth":
                    t = (l + 0.5) / layers - 0.5
                    for arr, b, m in zip(out, base, slope):
                        arr[l, h] = b + t * m
                else:
                    rng = np.random.default_rng([seed, l, h])
                    for arr, s, sh in zip(out, sd, shapes):
                        arr[l, h] = s * rng.standard_normal(sh)

    @classmethod
    def load(cls, filename: str, dim: int, layers: int | None = None, heads: int | None = None,
             key_dim: int | None = None, key: str = "model.params") -> "HeadMeasure":
        """Read Q, K, V from an .npz file and check their shapes against the model
        (errors name ``key`` and the file)."""
        arrays = read_arrays(filename, key)
        try:
            return cls._checked(arrays, filename, dim, layers, heads, key_dim)
        except InputError as e:
            raise InputError(f"{key}: {e}") from None

    @classmethod
    def _checked(cls, arrays, filename, dim, layers, heads, key_dim) -> "HeadMeasure":
        """The heads of Q, K, V read from ``filename``, their shapes checked against the model."""
        Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
        if Q.ndim != 4:
            raise InputError(f"{filename}: Q has shape {Q.shape}, expected (L,H,k,d)")
        L, H, k, d = Q.shape
        if min(L, H, k) < 1:
            raise InputError(f"{filename}: Q has shape {Q.shape}: no layers, heads or key dimensions")
        want = {"Q": (L, H, k, dim), "K": (L, H, k, dim), "V": (L, H, dim, dim)}
        if layers is not None:
            want = {n: (layers,) + s[1:] for n, s in want.items()}
        if heads is not None:
            want = {n: s[:1] + (heads,) + s[2:] for n, s in want.items()}
        if key_dim is not None:
            want["Q"] = want["Q"][:2] + (key_dim, dim)
            want["K"] = want["K"][:2] + (key_dim, dim)
        for n, a in arrays.items():
            if n == WEIGHTS:
                continue
            if a.shape != want[n]:
                raise InputError(
                    f"{filename}: {n} has shape {a.shape}, expected {want[n]} "
                    f"(model: layers={want['V'][0]}, heads={want['V'][1]}, "
                    f"key_dim={want['Q'][2]}, d={dim})")
            if not np.all(np.isfinite(a)):
                raise InputError(f"{filename}: {n} has non-finite entries")
        weights = arrays.get(WEIGHTS)
        if weights is not None:
            try:
                weights = checked_weights(weights, want["V"][:2])
            except ValueError as e:
                raise InputError(f"{filename}: {WEIGHTS}: {e}") from None
        return cls(Q, K, V, weights)

    def files(self) -> dict:
        """What a parameter file of these heads holds beside the trained arrays: the
        weights, where the heads are weighted."""
        return {} if self.weights is None else {WEIGHTS: self.weights}

    def save(self, filename: str) -> None:
        from ..tools.output import write_npz
        write_npz(filename, Q=self.Q, K=self.K, V=self.V, **self.files())


def checked_weights(weights, shape: tuple) -> np.ndarray:
    """``weights`` as a float array of ``shape`` (L, H), finite, non-negative and summing
    to 1 over each layer (to 1e-12); ValueError saying which it is not."""
    try:
        w = np.array(weights, dtype=float)
    except (TypeError, ValueError):
        raise ValueError("expected numbers") from None
    if w.shape != tuple(shape):
        raise ValueError(f"shape {w.shape}, expected (L, H) = {tuple(shape)}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("expected finite weights >= 0")
    sums = w.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1) > 1e-12)
    if len(bad):
        raise ValueError(f"layer {bad[0]}'s weights sum to {sums[bad[0]]:.15g}, not 1")
    return w


def read_arrays(filename: str, key: str) -> dict:
    """Q, K, V (as floats) of a parameter file (or of a training's checkpoint); InputError
    naming ``key`` and the file where it is not a readable .npz, lacks one of them or
    holds an array of no registered block (which would otherwise be ignored without a
    word). The arrays of the other blocks are their terms' to read."""
    if not os.path.lexists(filename):
        raise InputError(f"{key}: {filename}: no such parameter file")
    names = npz_names(filename, key)
    checkpoint = "meta" in names     # a training's checkpoint: its heads, and its optimiser's state
    known = file_keys()
    for n in names:
        if n not in known and n != WEIGHTS and not (checkpoint and (n == "meta" or n.startswith("adam_"))):
            raise InputError(f"{key}: {filename}: array {n!r} is not supported: a parameter file holds "
                             f"the model's arrays ({', '.join([*known, WEIGHTS])}) only; remove it")
    for n in ARRAYS:
        if n not in names:
            raise InputError(f"{key}: {filename}: array {n!r} missing (need Q, K, V)")
    try:
        wanted = ARRAYS + ((WEIGHTS,) if WEIGHTS in names else ())
        return {n: np.asarray(a, dtype=float) for n, a in load_npz(filename, key, wanted).items()}
    except (TypeError, ValueError) as e:   # not numbers (strings, structured arrays)
        raise InputError(f"{key}: {filename}: an array is not numeric ({e})") from None


def ntk_jacobians(tilted, x: np.ndarray, heads: dict, beta: float, params: str) -> np.ndarray:
    """d Gamma_theta[mu](x_p) / d theta of one layer's heads ({"Q": (J, k, d), "K", "V"})
    at the points x (P, d): (J, P*d, n_params), the parameters those of ``params``
    ("A": A = K^T Q, "V", or "all": V, Q, K), the scores those of (beta Q, K):

        Gamma = V m(A x),  A = K^T (beta Q),  dGamma/dV_bc = e_b m_c,
        dGamma/dA_bc = V C e_b x_c,  dGamma/dQ_kc = V C K_k x_c,  dGamma/dK_kc = V C e_c (Q x)_k,

    m and C the tilted mean and covariance of mu at b = A x, ``tilted(b)`` -> (Lambda,
    m, C) for b (n, d) (the NTK test of pdeformer.commands.ntk)."""
    Q, K, V = beta * heads["Q"], heads["K"], heads["V"]
    Jh, k, d = Q.shape
    P = x.shape[0]
    A = np.einsum("hki,hkj->hij", K, Q)
    b = np.einsum("hij,pj->hpi", A, x).reshape(-1, d)
    _, m, C = tilted(b)
    m, C = m.reshape(Jh, P, d), C.reshape(Jh, P, d, d)
    VC = np.einsum("hab,hpbc->hpac", V, C)                               # (J, P, d, d)
    blocks = []
    if params in ("V", "all"):
        blocks.append(np.einsum("ab,hpc->hpabc", np.eye(d), m).reshape(Jh, P, d, d * d))
    if params == "A":
        blocks.append(np.einsum("hpab,pc->hpabc", VC, x).reshape(Jh, P, d, d * d))
    if params == "all":
        blocks.append(np.einsum("hpab,hkb,pc->hpakc", VC, K, x).reshape(Jh, P, d, k * d))
        Qx = np.einsum("hkj,pj->hpk", Q, x)
        blocks.append(np.einsum("hpac,hpk->hpakc", VC, Qx).reshape(Jh, P, d, k * d))
    return np.concatenate(blocks, axis=-1).reshape(Jh, P * d, -1)


def query_key_derivatives(heads: "HeadMeasure", dA: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dR/dQ, dR/dK from dR/dA (..., L, H, d, d; leading axes: one derivative per output):
    A = K^T Q, so dR/dQ = K dR/dA and dR/dK = Q (dR/dA)^T."""
    return (np.einsum("lhki,...lhij->...lhkj", heads.K, dA), np.einsum("lhki,...lhji->...lhkj", heads.Q, dA))


def head_points(arrays: dict) -> tuple[np.ndarray, dict]:
    """The head measure as VTK points: one point per head at (t_l, tr(V)/d, tr(A)/d),
    t_l the centre of its layer, with point data layer, head, Q, K, V, A (flattened
    row-major) and their Frobenius norms."""
    Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
    L, H, k, d = Q.shape
    A = np.stack([attention_matrices(Q[l], K[l]) for l in range(L)])
    t = (np.arange(L) + 0.5) / L
    n = L * H
    pts = np.stack([np.repeat(t, H), np.trace(V, axis1=2, axis2=3).ravel() / d,
                    np.trace(A, axis1=2, axis2=3).ravel() / d], axis=1)
    data = {"layer": np.repeat(np.arange(L), H).astype(float), "head": np.tile(np.arange(H), L).astype(float)}
    for name, arr in (("Q", Q), ("K", K), ("V", V), ("A", A)):
        flat = arr.reshape(n, -1)
        data[name] = flat
        data[f"norm_{name}"] = np.linalg.norm(flat, axis=1)
    return pts, data


register_block(BLOCK, ARRAYS, prefix="", particles="heads", points=head_points, colour="norm_A")


def law_means(model, key_dim: int, dim: int) -> tuple | None:
    """The gaussian law's means of Q, K, V of ``[model]`` (options) as arrays, None where
    centred; ConfigError naming the key whose shape is not (k, d) or (d, d)."""
    if all(getattr(model, k) is None for k in GAUSSIAN_MEANS):
        return None
    out = []
    for k, shape in zip(GAUSSIAN_MEANS, ((key_dim, dim), (key_dim, dim), (dim, dim))):
        value = getattr(model, k)
        a = None if value is None else np.array(value, dtype=float)
        if a is not None and a.shape != shape:
            raise ConfigError(f"model.{k}", f"shape {a.shape}, expected {shape} (k = {key_dim}, d = {dim})")
        out.append(a)
    return tuple(out)


def draw_heads(model, dim: int, atoms: HeadMeasure | None = None) -> HeadMeasure:
    """Heads drawn from ``[model]``'s law (its options): ``atoms`` (read from
    ``model.atoms`` where not given) or gaussian, with k = d where ``key_dim`` is not
    given."""
    if model.law == "atoms":
        if atoms is None:
            if model.atoms is None:
                raise ConfigError("model.atoms", "missing: law = 'atoms' draws the heads from the atoms of this file")
            atoms = HeadMeasure.load(model.atoms, dim, model.layers, None, model.key_dim, key="model.atoms")
        return HeadMeasure.from_atoms(atoms, model.heads, model.seed)
    k = model.key_dim or dim
    return HeadMeasure.random(model.layers, model.heads, k, dim, seed=model.seed, scale=model.init_scale,
                              query_scale=model.query_scale, depth=model.depth, means=law_means(model, k, dim))


def gauge(arrays: dict) -> np.ndarray:
    """G_h = Q_h Q_h^T - K_h K_h^T of every head (L, H, k, k). A = K^T Q is unchanged by
    (Q, K) -> (M Q, M^{-T} K), and the gradient flow of any risk of A keeps G_h fixed
    (dG/dt = -(K dA Q^T + Q dA^T K^T) + (Q dA^T K^T + K dA Q^T) = 0): its drift
    measures how far a discrete training strays from the flow."""
    Q, K = arrays["Q"], arrays["K"]
    return np.einsum("lhia,lhja->lhij", Q, Q) - np.einsum("lhia,lhja->lhij", K, K)
