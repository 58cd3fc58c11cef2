"""Prompt data sets: S prompts drawn from a seeded family (``[data]``).

``[data] count = S`` replaces the ``[[prompts]]`` tables by S prompts ``data0000``,
``data0001``, ... drawn with ``numpy.random.default_rng(seed)`` in order, so that the
data set depends on the seed alone (the same on any number of ranks and after a
restart). Each prompt is a mixture with a number of components uniform in
``components = [min, max]`` and weights uniform in [0.5, 1.5] (normalised by the prompt):

* ``gaussian_mixture`` (flat meshes): means with coordinates uniform in ``mean_range``,
  isotropic covariances s^2 I with s uniform in ``std_range``;
* ``von_mises_fisher`` (circle, sphere): uniformly random mean directions, concentrations
  uniform in ``concentration_range``.

``[data] folder`` instead reads one prompt per .npz/.csv file of a folder (a density or
a point cloud, its target the file of the same name in ``targets/``: :func:`read_folder`).
``test_fraction`` holds out the last prompts of any data set (:func:`split_prompts`).

The drawn prompts are ordinary prompt tables: the checked configuration (summary.json)
records every one of them. Their targets come from a teacher (``data.teacher``, a heads
file, or ``data.teacher_seed``, random heads of the model's sizes): see
:func:`pdeformer.solvers.forward.teacher_targets`.
"""

from __future__ import annotations

import os
import re

import numpy as np

from .errors import ConfigError

FAMILIES = ("gaussian_mixture", "von_mises_fisher")
FLAT_FAMILY, SPHERE_FAMILY = FAMILIES


def data_dimension(mesh: dict) -> int:
    """The token dimension of a built-in ``[mesh]`` (ConfigError for a mesh file: its
    dimension is known only once it is read)."""
    if mesh["file"] is not None:
        raise ConfigError("data.count", "a generated data set needs a built-in mesh (mesh.lower, "
                          "mesh.upper, mesh.cells or mesh.shape), not mesh.file")
    return {"circle": 2, "sphere": 3}.get(mesh["shape"]) or len(mesh["lower"])


def _range(data: dict, key: str, positive: bool = False) -> tuple[float, float]:
    v = data[key]
    if len(v) != 2 or not v[0] <= v[1] or (positive and not v[0] > 0):
        what = "0 < lo <= hi" if positive else "lo <= hi"
        raise ConfigError(f"data.{key}", f"expected [lo, hi] with {what}, got {v}")
    return float(v[0]), float(v[1])


def check_data(data: dict, mesh: dict) -> None:
    """The ``[data]`` options on their own: ranges, family against the mesh, one teacher,
    one source of prompts."""
    if data["teacher"] is not None and data["teacher_seed"] is not None:
        raise ConfigError("data.teacher_seed", "give either data.teacher (a file) or data.teacher_seed, not both")
    if data["folder"] is not None and data["count"]:
        raise ConfigError("data.folder", "give either data.count (a drawn data set) or data.folder, not both")
    if data["count"] == 0:
        return
    data_dimension(mesh)
    sphere = mesh["shape"] in ("circle", "sphere")
    if data["family"] != (SPHERE_FAMILY if sphere else FLAT_FAMILY):
        raise ConfigError("data.family", f"{data['family']!r} does not fit a {mesh['shape']} mesh: use "
                          f"{SPHERE_FAMILY if sphere else FLAT_FAMILY!r}")
    lo, hi = data["components"] if len(data["components"]) == 2 else (0, 0)
    if not 1 <= lo <= hi:
        raise ConfigError("data.components", f"expected [min, max] with 1 <= min <= max, got {data['components']}")
    _range(data, "mean_range")
    _range(data, "std_range", positive=True)
    _range(data, "concentration_range", positive=True)


def draw_prompts(data: dict, mesh: dict) -> list[dict]:
    """The S prompt tables of the data set (unchecked raw tables, as [[prompts]] would be)."""
    d = data_dimension(mesh)
    rng = np.random.default_rng(data["seed"])
    cmin, cmax = data["components"]
    means, stds, kappas = (_range(data, k) for k in ("mean_range", "std_range", "concentration_range"))
    prompts = []
    for i in range(data["count"]):
        c = int(rng.integers(cmin, cmax + 1))
        weights = rng.uniform(0.5, 1.5, c)
        table = {"name": f"data{i:04d}", "kind": data["family"], "weights": weights.tolist()}
        if data["family"] == FLAT_FAMILY:
            table["means"] = rng.uniform(*means, (c, d)).tolist()
            table["covs"] = (rng.uniform(*stds, c) ** 2).tolist()
        else:
            directions = rng.normal(size=(c, d))
            directions /= np.linalg.norm(directions, axis=1)[:, None]
            table["means"] = directions.tolist()
            table["concentrations"] = rng.uniform(*kappas, c).tolist()
        prompts.append(table)
    return prompts


PROMPT_FILES = (".npz", ".csv")
TARGETS = "targets"   # the folder's subfolder of target files


def _file_kind(filename: str) -> str:
    """'file' (a density: arrays points and density, or a csv column density) or
    'points' (a point cloud) -- what the file holds, read from its array names or header."""
    if filename.endswith(".npz"):
        try:
            with np.load(filename, allow_pickle=False) as f:
                names = f.files
        except Exception as e:   # a damaged file
            raise ConfigError("data.folder", f"{filename}: not a readable .npz ({type(e).__name__}: {e})") from None
        return "file" if "density" in names else "points"
    try:
        with open(filename, newline="") as f:
            header = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("data.folder", f"{filename}: not a readable .csv ({type(e).__name__})") from None
    return "file" if "density" in [h.strip() for h in header.split(",")] else "points"


def read_folder(data: dict, base_dir: str, name_pattern: str) -> list[dict]:
    """The prompt tables of ``data.folder``: one per .npz/.csv file, in name order, named
    by the file's stem (which must match ``name_pattern``); its target the file of the
    same name in ``targets/`` where there is one. Paths as given (relative to the config's
    folder, resolved with the config's other paths)."""
    folder = data["folder"]
    where = os.path.join(base_dir, folder)
    if not os.path.isdir(where):
        raise ConfigError("data.folder", f"{where}: no such folder")
    files = sorted(f for f in os.listdir(where) if f.endswith(PROMPT_FILES)
                   and os.path.isfile(os.path.join(where, f)))
    if not files:
        raise ConfigError("data.folder", f"{where}: no prompt files (.npz or .csv)")
    prompts, stems = [], set()
    for f in files:
        stem = os.path.splitext(f)[0]
        if not re.fullmatch(name_pattern, stem) or stem in stems:
            why = "a second file of that name" if stem in stems else \
                "a prompt name must be 1 to 64 letters, digits, '_' or '-'"
            raise ConfigError("data.folder", f"{os.path.join(where, f)}: {why}; rename it")
        stems.add(stem)
        table = {"name": stem, "kind": _file_kind(os.path.join(where, f)), "path": os.path.join(folder, f)}
        target = os.path.join(where, TARGETS, f)
        if os.path.isfile(target):
            table["target"] = {"kind": _file_kind(target), "path": os.path.join(folder, TARGETS, f)}
        prompts.append(table)
    return prompts


def data_set_given(data: dict) -> bool:
    """Whether the prompts come from ``[data]`` (drawn or read from a folder)."""
    return data["count"] > 0 or data["folder"] is not None


def teacher_given(data: dict) -> bool:
    """Whether the prompts' targets come from a teacher."""
    return data["teacher"] is not None or data["teacher_seed"] is not None


def split_prompts(data: dict, count: int) -> tuple[list[int], list[int]]:
    """Training and held-out prompt indices: the last round(test_fraction x S) prompts
    are held out, halves rounded up (drawn prompts are independent, so that is a random
    choice; a folder's are its last files by name). ConfigError
    where a fraction > 0 holds out none, or leaves no training prompt."""
    held = int(np.floor(data["test_fraction"] * count + 0.5))     # halves round up
    if data["test_fraction"] > 0 and held == 0:
        raise ConfigError("data.test_fraction", f"{data['test_fraction']:g} of {count} prompt(s) holds out none")
    if held >= count:
        raise ConfigError("data.test_fraction", f"{data['test_fraction']:g} of {count} prompt(s) leaves "
                          "no training prompt")
    return list(range(count - held)), list(range(count - held, count))


def chosen_prompts(problem, prompts: list[int] | None) -> list[int]:
    """The prompt indices a risk is taken over, sorted: ``prompts``, or the problem's
    training prompts (all but the held-out ones)."""
    chosen = sorted(set(problem.training if prompts is None else prompts))
    if not chosen or not all(0 <= s < len(problem.prompts) for s in chosen):
        raise ValueError(f"prompt indices {prompts} out of 0..{len(problem.prompts) - 1}")
    return chosen
