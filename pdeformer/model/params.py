r"""Parameter trees: a model's parameters as blocks of named arrays.

    params = {"attention": {"Q": (L, H, k, d), "K": (L, H, k, d), "V": (L, H, d, d)}, ...}

One block per velocity term (design §1: the heads of attention are one term), each
array with the layer on axis 0 and the term's particle (a head, a neuron) on axis 1, so
that a block of L layers of W particles is the empirical measure (1/W) sum_w delta_theta_w
of every layer. Gradients, optimiser states and cotangents are trees of the same shape.
The functions here treat every block and array alike, in the tree's order (blocks, then
arrays, as inserted); nothing here knows what a block's arrays mean.

Files (params files, checkpoints, gradient.npz) hold a tree flat: the array ``name`` of
block ``b`` under the key ``prefix(b) + name``, where a term declares its prefix
(:data:`PREFIXES`; the attention term's is empty: its files hold Q, K, V).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

Tree = dict[str, dict[str, np.ndarray]]

# the modules of the velocity's terms: each registers its block of parameters (imported
# before a file is read or written) and, for a token-wise term, its class (model/terms.py)
TERM_MODULES = ("heads",)
# block -> the prefix of its arrays' keys in files (registered by each term's module)
PREFIXES: dict[str, str] = {}
# block -> the names of its arrays, in order
NAMES: dict[str, tuple[str, ...]] = {}
# block -> what its particles are called in file names and pictures ("heads")
PARTICLES: dict[str, str] = {}
# block -> arrays -> (points (n, 3), {name: point data}): its particles as VTK points
POINTS: dict[str, Callable] = {}
# block -> the point data its particles are coloured by (ParaView)
COLOURS: dict[str, str] = {}


def register_block(block: str, names: tuple[str, ...], prefix: str, particles: str,
                   points: Callable, colour: str) -> None:
    """Make a term's block of parameters known to the files and pictures: its arrays
    ``names`` are stored under ``prefix + name``, its particles drawn by ``points``
    into ``{particles}_XXXX.vtu`` and coloured by their point data ``colour``. No two
    blocks may share a key."""
    taken = {PREFIXES[b] + n for b in PREFIXES if b != block for n in NAMES[b]}
    clash = taken & {prefix + n for n in names}
    if clash:
        raise ValueError(f"parameter block {block!r}: file keys {sorted(clash)} are taken")
    PREFIXES[block], NAMES[block] = prefix, tuple(names)
    PARTICLES[block], POINTS[block], COLOURS[block] = particles, points, colour


def leaves(tree: Tree) -> Iterator[tuple[tuple[str, str], np.ndarray]]:
    """((block, name), array) for every array of the tree, in order."""
    for block, arrays in tree.items():
        for name, a in arrays.items():
            yield (block, name), a


def tree_map(f: Callable, tree: Tree, *rest: Tree) -> Tree:
    """The tree of f(a, b, ...) over the arrays of ``tree`` and the same arrays of ``rest``."""
    return {block: {name: f(a, *(r[block][name] for r in rest)) for name, a in arrays.items()}
            for block, arrays in tree.items()}


def zeros_like(tree: Tree, lead: tuple = ()) -> Tree:
    """A tree of zeros of the tree's shapes (with ``lead`` axes in front)."""
    return tree_map(lambda a: np.zeros(lead + np.shape(a)), tree)


def copy(tree: Tree) -> Tree:
    return tree_map(np.array, tree)


def shapes(tree: Tree) -> dict:
    return {block: {n: np.shape(a) for n, a in arrays.items()} for block, arrays in tree.items()}


def sum_squares(tree: Tree) -> float:
    """sum over every entry of the tree of its square."""
    return float(sum(np.sum(np.asarray(a) ** 2) for _, a in leaves(tree)))


def norm(tree: Tree) -> float:
    """The Euclidean norm of every entry of the tree, scaled so that huge entries do not
    overflow (inf or NaN where an entry is)."""
    scale = max((float(np.abs(a).max(initial=0.0)) for _, a in leaves(tree)), default=0.0)
    if not 0 < scale < np.inf:
        return scale
    return scale * float(np.sqrt(sum(np.sum((a / scale) ** 2) for _, a in leaves(tree))))


def size(tree: Tree) -> int:
    return int(sum(np.size(a) for _, a in leaves(tree)))


def flatten(tree: Tree, lead: int = 0) -> np.ndarray:
    """The entries of every array concatenated in the tree's order, keeping the first
    ``lead`` axes (shared by all arrays): shape lead_shape + (entries,)."""
    arrays = [a for _, a in leaves(tree)]
    front = arrays[0].shape[:lead]
    return np.concatenate([a.reshape(front + (-1,)) for a in arrays], axis=-1)


def particle_vectors(arrays: dict, layer: int) -> np.ndarray:
    """Each particle (head, neuron) of one layer of a block as one vector of all its
    entries: (W, entries)."""
    return np.concatenate([a[layer].reshape(a.shape[1], -1) for a in arrays.values()], axis=1)


def layer_slice(arrays: dict, layer: int) -> dict:
    """A block's arrays of one layer: {name: array[layer]} (its particles on axis 0)."""
    return {name: a[layer] for name, a in arrays.items()}


def particle_norms(arrays: dict) -> np.ndarray:
    """|theta_{l,w}| over all arrays of a block, per layer and particle: (L, W)."""
    return np.sqrt(sum(np.sum(a.reshape(a.shape[0], a.shape[1], -1) ** 2, axis=2) for a in arrays.values()))


def layers_width(arrays: dict) -> tuple[int, int]:
    """(L, W) of a block: its layers and its particles per layer."""
    first = next(iter(arrays.values()))
    return int(first.shape[0]), int(first.shape[1])


def mean_field_scale(arrays: dict) -> int:
    """L W of a block (layers x particles per layer): a particle's derivative of the
    risk is O(1/(L W)), so steps are taken on L W dR/dtheta (docs/training.md)."""
    L, W = layers_width(arrays)
    return L * W


@dataclass
class Gradient:
    """R = the mean of F_s over the prompts s it was taken over (``prompts``: all, the
    training prompts or a minibatch) and its derivatives ``params``: dR/dtheta, a tree
    shaped like the model's parameters."""
    risk: float
    risks: list[float]       # per prompt of ``prompts``
    params: Tree             # dR/dtheta
    tape_bytes: int = 0      # largest forward tape held (per rank)
    prompts: list = None     # the prompt indices (None: all)

    def norm(self) -> float:
        """|dR/dtheta| over every entry of the tree."""
        return norm(self.params)

    def vector(self) -> np.ndarray:
        """dR/dtheta flat, in the tree's order."""
        return flatten(self.params)


# ------------------------------------------------------------------ files

def registered() -> dict:
    """{block: file prefix} of every term's block (their modules imported)."""
    for module in TERM_MODULES:
        importlib.import_module(f"{__package__}.{module}")
    return PREFIXES


def file_key(block: str, name: str) -> str:
    return registered()[block] + name


def file_keys() -> dict[str, str]:
    """{file key: block} of every registered block's arrays."""
    return {PREFIXES[b] + n: b for b in registered() for n in NAMES[b]}


def to_files(tree: Tree, prefix: str = "") -> dict:
    """The tree flat, as files hold it: {prefix + file key: array}."""
    return {prefix + file_key(block, name): a for (block, name), a in leaves(tree)}


def from_files(arrays: dict, like: Tree, prefix: str = "") -> Tree:
    """The tree of ``like``'s shape whose arrays are ``arrays[prefix + file key]``."""
    return {block: {name: arrays[prefix + file_key(block, name)] for name in names}
            for block, names in like.items()}


def blocks_in(names) -> Tree:
    """The blocks whose every array key is among ``names`` (a file's keys), as a tree of
    the keys: {block: {name: key}}."""
    have = set(names)
    prefixes = registered()
    return {block: {n: prefixes[block] + n for n in block_names}
            for block, block_names in NAMES.items()
            if all(PREFIXES[block] + n in have for n in block_names)}


def read_tree(arrays: dict) -> Tree:
    """The parameter tree of a file's arrays (every registered block it holds whole)."""
    return {block: {n: arrays[key] for n, key in keys.items()} for block, keys in blocks_in(arrays).items()}
