r"""The token velocity as a sum of terms, each with its block of the parameter tree.

    v_t[rho](x) = P_x ( w^att_l[rho](x) + sum_terms w^term_l(x) ),   t in [l/L, (l+1)/L),

P_x the tangent projection of the tokens' geometry (the identity on a flat mesh).
Attention (:class:`~pdeformer.model.velocity.AttentionVelocity`) reads the density
through its sources; a token-wise term (:class:`TokenTerm`, e.g. an MLP per layer) reads
the token alone, w_l(x) = f(theta_l, x). :class:`VelocityField` is the sum the solvers
evaluate: its value at the targets, its reverse mode (cotangents of the sources'
weights and positions, of the targets and of every block), the bound on |v| that sizes
the steps, and the parameter tree of all its terms.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import numpy as np

from ..tools.errors import ConfigError
from .params import NAMES, TERM_MODULES


TERMS: dict[str, type] = {}   # block -> TokenTerm class


def register_term(cls):
    """Make a token-wise term known by its ``block``: its ``model_keys`` join the
    ``[model]`` table and :func:`build_terms` builds it for every run."""
    TERMS[cls.block] = cls
    return cls


def term_classes() -> list[type]:
    """Every registered token-wise term class (the modules of params.TERM_MODULES
    imported: a term's module registers its block and its class), in order."""
    for module in TERM_MODULES:
        importlib.import_module(f"{__package__}.{module}")
    return list(TERMS.values())


def build_terms(model, dim: int, comm, params: dict | None = None) -> list:
    """The token-wise terms of the ``[model]`` options (model/schema.py's ModelOptions)
    for tokens of dimension ``dim``: each registered class's ``from_options``, which
    returns None where the options leave the term out, or its ``from_arrays`` where the
    parameter tree ``params`` (the Python API's model) holds its block."""
    params = params or {}
    built = (cls.from_arrays(params[cls.block], model, dim) if cls.block in params
             else cls.from_options(model, dim, comm) for cls in term_classes())
    return [term for term in built if term is not None]


def checked_arrays(block: str, arrays, key: str, layers: int) -> dict:
    """A block's arrays (copied as floats) with the names it registered, ``layers`` layers
    on axis 0 and one particle count on axis 1, every entry finite; ConfigError naming
    ``key`` otherwise."""
    names = NAMES[block]
    if not isinstance(arrays, dict) or set(arrays) != set(names):
        raise ConfigError(key, f"expected the arrays {', '.join(map(repr, names))}")
    out = {n: np.array(arrays[n], dtype=float) for n in names}
    for n, a in out.items():
        if a.ndim < 2 or a.shape[:2] != (layers, out[names[0]].shape[1]) or 0 in a.shape:
            raise ConfigError(key, f"{n} has shape {a.shape}: expected (layers = {layers}, particles, ...) "
                              f"with the particles of {names[0]} {out[names[0]].shape[1:2]}")
        if not np.all(np.isfinite(a)):
            raise ConfigError(key, f"{n} has non-finite entries")
    return out


class TokenTerm:
    """A token-wise velocity term w_l(x) = f(theta_l, x) of one block of the parameter
    tree (its arrays (L, W, ...): W particles per layer, averaged with weight 1/W).

    Subclasses set :attr:`block` (registered with
    :func:`pdeformer.model.params.register_block`), hold their arrays in
    :attr:`params` (updated in place by training) and implement the three methods."""

    block: str = ""
    params: dict
    model_keys: dict = {}   # its [model] options (pdeformer.tools.keys.Key), beside the heads'

    @classmethod
    def from_options(cls, model, dim: int, comm) -> "TokenTerm | None":
        """The term of the ``[model]`` options (None where they leave it out): its arrays
        read from ``model.params`` or drawn from ``model.seed``, the same on every rank
        of ``comm``."""
        raise NotImplementedError

    @classmethod
    def from_arrays(cls, arrays: dict, model, dim: int) -> "TokenTerm":
        """The term of the given arrays of its block (checked by :func:`checked_arrays`
        and the term's own shapes), its other options from ``model``."""
        raise NotImplementedError

    def velocity(self, x: np.ndarray, layer: int) -> np.ndarray:
        """w_l(x) at the points x (n, d), before any tangent projection."""
        raise NotImplementedError

    def vjp(self, x: np.ndarray, layer: int, g: np.ndarray) -> tuple[np.ndarray, dict]:
        """Cotangents of <g, w_l(x)>: of the points x (n, d), and of layer l's slice
        (W, ...) of every array of the block, {name: array}."""
        raise NotImplementedError

    def bound(self, layer: int, reach: float, params: dict | None = None) -> float:
        """An upper bound on |w_l(x)| over |x| <= reach (``params``: a parameter tree to
        bound instead of the term's own arrays)."""
        raise NotImplementedError


@dataclass
class Cotangent:
    """Cotangents of <g, v> for the sum: of this rank's source weights, of the targets
    and source points (particles; None on the mesh), and ``parts``: each term's own
    (attention's :class:`~pdeformer.attention.softmax.VelocityCotangent`, a token term's
    {name: layer slice})."""

    weights: np.ndarray
    targets: np.ndarray | None
    points: np.ndarray | None
    parts: dict = field(default_factory=dict)


def _sum_radial(a, b):
    """Radial parts of two velocities added (None on a flat geometry)."""
    return None if a is None else a + b


class VelocityField:
    """v = P_x (attention + token-wise terms) at the targets of the attention term (the
    nodes of a velocity space, or the points given per call). How the attention sums,
    its plans, frozen plans and statistics are the attention term's
    (:attr:`attention`)."""

    def __init__(self, attention, terms=()):
        self.attention = attention
        self.terms = list(terms)
        self.geometry = attention.geometry
        self.last_radial = None

    # the attention term's state, which the solvers plan and record with
    targets = property(lambda self: self.attention.targets)
    stats = property(lambda self: self.attention.stats)
    tape_mb = property(lambda self: self.attention.tape_mb)
    last_sum = property(lambda self: self.attention.last_sum)
    last_plan = property(lambda self: self.attention.last_plan)

    @property
    def freeze(self) -> bool:
        return self.attention.freeze

    @freeze.setter
    def freeze(self, value: bool) -> None:
        self.attention.freeze = value

    @property
    def last_finite(self):
        """Whether the last velocity is finite on every rank where already agreed (the
        attention's check, which sees the token terms only when there are none)."""
        return self.attention.last_finite if not self.terms else None

    def refreeze(self) -> None:
        self.attention.refreeze()

    def partition_ratio(self, points, weights, layer, x):
        return self.attention.partition_ratio(points, weights, layer, x)

    # ------------------------------------------------------------------ the sum
    def __call__(self, points: np.ndarray, weights: np.ndarray, layer: int,
                 targets: np.ndarray | None = None, **options) -> np.ndarray:
        """v of ``layer`` at the targets for the density of this rank's source points
        and weights (``options``: the attention's key, step and signed)."""
        v = self.attention(points, weights, layer, targets, **options)
        self.last_radial = self.attention.last_radial
        if not self.terms:
            return v
        x = self.targets if targets is None else targets
        with np.errstate(over="ignore", invalid="ignore"):   # reported by the callers' checks
            w = sum(term.velocity(x, layer) for term in self.terms)
        self.last_radial = _sum_radial(self.last_radial, self.geometry.radial(x, w))
        return v + self.geometry.tangential(x, w)

    def vjp(self, points: np.ndarray, weights: np.ndarray, layer: int, g: np.ndarray, plan=None,
            targets: np.ndarray | None = None, positions: bool = False) -> Cotangent:
        """Cotangents of <g, v> (:class:`Cotangent`); on the sphere the targets' through
        the unprojected velocity only, as the attention's
        (:meth:`~pdeformer.model.velocity.AttentionVelocity.vjp`)."""
        ct = self.attention.vjp(points, weights, layer, g, plan, targets, positions)
        out = Cotangent(ct.weights, ct.targets, ct.points, {self.attention.heads.block: ct})
        if self.terms:
            x = self.targets if targets is None else targets
            gt = self.geometry.tangential_vjp(x, g)
            for term in self.terms:
                xbar, out.parts[term.block] = term.vjp(x, layer, gt)
                if positions:
                    out.targets = out.targets + xbar
        return out

    def bound(self, layer: int, reach: float, params: dict | None = None) -> float:
        """The largest |v| a density >= 0 supported in |y| <= reach can give at tokens
        |x| <= reach: the attention's gain times reach plus each term's bound."""
        return self.attention.gain(layer, params) * reach + \
            sum(term.bound(layer, reach, params) for term in self.terms)

    # ------------------------------------------------------------------ parameters
    @property
    def params(self) -> dict:
        """The parameter tree of every term (the arrays themselves)."""
        return {**self.attention.params, **{term.block: term.params for term in self.terms}}

    def zero_cotangent(self, lead: tuple = ()) -> dict:
        """Accumulators of every term's cotangents, with ``lead`` axes in front."""
        acc = self.attention.zero_cotangent(lead)
        for term in self.terms:
            acc[term.block] = {name: np.zeros(lead + a.shape) for name, a in term.params.items()}
        return acc

    def add_cotangent(self, acc: dict, layer: int, ct: Cotangent, at: tuple = ()) -> None:
        """acc[at][layer] += the parameter cotangents of one :meth:`vjp`."""
        self.attention.add_cotangent(acc, layer, ct.parts[self.attention.heads.block], at)
        for term in self.terms:
            for name, bar in ct.parts[term.block].items():
                acc[term.block][name][at + (layer,)] += bar

    def parameter_gradient(self, acc: dict) -> dict:
        """dR/dtheta of every block from the accumulated cotangents."""
        grads = self.attention.parameter_gradient(acc)
        return {**grads, **{term.block: acc[term.block] for term in self.terms}}
