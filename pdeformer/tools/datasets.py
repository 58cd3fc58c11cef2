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
:func:`pdeformer.solvers.problem.teacher_targets`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from contextlib import contextmanager

import numpy as np

from .errors import ConfigError, InputError
from .keys import Key, integer, number, number_list, path, returns, string

FAMILIES = ("gaussian_mixture", "von_mises_fisher")
FLAT_FAMILY, SPHERE_FAMILY = FAMILIES


def data_dimension(mesh: dict) -> int:
    """The token dimension of a built-in ``[mesh]`` (ConfigError for a mesh file: its
    dimension is known only once it is read)."""
    if mesh["file"] is not None:
        raise ConfigError("data.count", "a generated data set needs a built-in mesh (mesh.lower, "
                          "mesh.upper, mesh.cells or mesh.shape), not mesh.file")
    return {"circle": 2, "sphere": 3}.get(mesh["shape"]) or len(mesh["lower"])


# Standard deviations s whose covariances s^2 are positive finite doubles (and the same
# for 1/s^2), whatever the mesh; a mesh resolves a narrower range (prompts.unresolved).
STD_LIMITS = (1e-150, 1e150)
# Components drawn in all (count x the most per prompt): every drawn table is kept in the
# checked configuration (summary.json), 1e6 components being some 100 MB of it.
MAX_DRAWN_COMPONENTS = 10**6


def _range(data: dict, key: str, positive: bool = False) -> tuple[float, float]:
    v = data[key]
    if len(v) != 2 or not v[0] <= v[1] or (positive and not v[0] > 0):
        what = "0 < lo <= hi" if positive else "lo <= hi"
        raise ConfigError(f"data.{key}", f"expected [lo, hi] with {what}, got {v}")
    return float(v[0]), float(v[1])


@returns(list[int])
def component_range(key: str, v) -> list[int]:
    """``data.components``: [min, max], integers with 1 <= min <= max."""
    if not (isinstance(v, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v)):
        raise ConfigError(key, f"expected positive integers [min, max], got {v!r}")
    if len(v) != 2 or v[0] > v[1]:
        raise ConfigError(key, f"expected [min, max] with 1 <= min <= max, got {v}")
    return list(v)


# The [data] table: a drawn data set (its family a name of FAMILIES), a folder, a teacher
DATA_KEYS = {
    "count": Key(integer(0, 10**6), 0, "draw this many prompts from a seeded family instead of "
                 "[[prompts]] (pdeformer.tools.datasets)"),
    "family": Key(string(FAMILIES), FLAT_FAMILY,
                  "gaussian_mixture (flat meshes) or von_mises_fisher (circle, sphere)"),
    "components": Key(component_range, [1, 3], "fewest and most mixture components, [min, max]"),
    "mean_range": Key(number_list((2, 2)), [-1.0, 1.0],
                      "gaussian_mixture: every coordinate of a mean uniform in [lo, hi]"),
    "std_range": Key(number_list((2, 2)), [0.3, 0.6],
                     "gaussian_mixture: each component's standard deviation uniform in [lo, hi]"),
    "concentration_range": Key(number_list((2, 2)), [2.0, 10.0],
                               "von_mises_fisher: each concentration uniform in [lo, hi]"),
    "seed": Key(integer(0, 2**63 - 1), 0, "seed of the data set"),
    "teacher": Key(path, None, "targets from a teacher: its heads (.npz, as model.params); "
                   "each prompt's target is the teacher's output for it"),
    "teacher_seed": Key(integer(0, 2**63 - 1), None,
                        "targets from a random teacher of the model's sizes drawn with this seed"),
    "folder": Key(path, None, "a data set read from files: every .npz or .csv file of this "
                  "folder is a prompt (a density, or a point cloud), in name order; a file of "
                  "the same name in its subfolder targets/ is that prompt's target"),
    "test_fraction": Key(number(nonnegative=True, hi=0.9), 0.0,
                         "hold out the last round(fraction x S) prompts: a test risk, not trained on"),
}


def _check_flat_ranges(data: dict, mesh: dict) -> None:
    """std_range within STD_LIMITS; mean_range meeting a built-in box in every coordinate
    (else every drawn mean lies off the mesh)."""
    lo, hi = _range(data, "std_range")
    if lo < STD_LIMITS[0] or hi > STD_LIMITS[1]:
        raise ConfigError("data.std_range", f"{data['std_range']} is not within [{STD_LIMITS[0]:g}, "
                          f"{STD_LIMITS[1]:g}]: the covariances s^2 must be positive finite doubles")
    lo, hi = _range(data, "mean_range")
    if mesh["shape"] != "box":
        return
    for a, (low, up) in enumerate(zip(mesh["lower"], mesh["upper"])):
        if hi < low or lo > up:
            raise ConfigError("data.mean_range", f"{data['mean_range']} lies off the mesh in coordinate {a} "
                              f"(mesh.lower[{a}] = {low:g}, mesh.upper[{a}] = {up:g}): every drawn mean "
                              f"would be off the mesh; use a range within [{low:g}, {up:g}]")


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
    component_range("data.components", data["components"])
    most = data["count"] * data["components"][1]
    if most > MAX_DRAWN_COMPONENTS:
        raise ConfigError("data.components", f"{data['count']} prompts (data.count) of up to "
                          f"{data['components'][1]} components draw {most:.3g} components, more than "
                          f"{MAX_DRAWN_COMPONENTS:g} (the run's record keeps every drawn table): "
                          "draw fewer prompts or components")
    _range(data, "mean_range")
    _range(data, "std_range", positive=True)
    _range(data, "concentration_range", positive=True)
    if not sphere:
        _check_flat_ranges(data, mesh)


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
MAX_HEADER = 64 * 1024     # bytes of a csv line read to tell a density from a point cloud
TARGETS = "targets"   # the folder's subfolder of target files


def _file_kind(filename: str) -> str:
    """'file' (a density: arrays points and density, or a csv column density) or
    'points' (a point cloud) -- what the file holds, read from its array names or header
    (an .npz's zip directory, a csv's first lines). InputError naming data.folder and the
    file where it is not a regular file, is empty, not an .npz, or a csv without a row."""
    from .files import npz_names, open_regular
    if filename.endswith(".npz"):
        return "file" if "density" in npz_names(filename, "data.folder") else "points"
    with open_regular(filename, "data.folder") as f:
        try:
            head = f.read(MAX_HEADER)
            more = bool(f.read(1))
            # (a chunk that stops short of the end may cut a character in two)
            lines = head.decode("utf-8", errors="strict" if not more else "ignore").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"data.folder: {filename}: not a readable .csv ({type(e).__name__})") from None
    if not head:
        raise InputError(f"data.folder: {filename}: an empty file (0 bytes), not a .csv with a header")
    if not more and not any(line.strip() for line in lines[1:]):
        raise InputError(f"data.folder: {filename}: a header and no rows: a prompt file needs one "
                         "row per point")
    return "file" if "density" in [h.strip() for h in lines[0].split(",")] else "points"


def read_folder(data: dict, base_dir: str, name_pattern: str) -> list[dict]:
    """The prompt tables of ``data.folder``: one per .npz/.csv file, in name order, named
    by the file's stem (which must match ``name_pattern``); its target the file of the
    same name in ``targets/`` where there is one. Paths as given (relative to the config's
    folder, resolved with the config's other paths)."""
    folder = data["folder"]
    where = os.path.join(base_dir, folder)
    if not os.path.isdir(where):
        raise ConfigError("data.folder", f"{where}: no such folder")
    # every name a prompt file would have: one that is not a regular file (a FIFO, a
    # folder) is refused by name rather than skipped without a word
    files = sorted(f for f in os.listdir(where) if f.endswith(PROMPT_FILES))
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
        if os.path.lexists(target):     # (not a regular file: refused by _file_kind)
            table["target"] = {"kind": _file_kind(target), "path": os.path.join(folder, TARGETS, f)}
        prompts.append(table)
    return prompts


# ------------------------------------------------------------------ errors about its prompts

# the [data] key that draws each part of a drawn prompt
DRAWN_KEYS = {"means": "mean_range", "covs": "std_range", "concentrations": "concentration_range",
              "weights": "components", "kind": "family"}
PROMPT_ERROR = re.compile(r"prompts\[(\d+)\](?:\.(\w+))?")


def _table(data):
    """The ``[data]`` options as a dict (solvers hold them as a frozen dataclass)."""
    return dataclasses.asdict(data) if dataclasses.is_dataclass(data) else data


@contextmanager
def data_errors(data, tables: list, name: str | None = None, part: str | None = None):
    """Bad-input errors raised inside about a prompt (their message starting
    ``prompts[i]``) re-raised, where ``[data]`` made that prompt, naming what the user
    can change: the data.* key that drew it (``data.std_range: ... (drawn prompt
    data0003: covs[1]: ...)``) or data.folder and its file. ``tables``: the prompt
    tables; ``name``: the prompt's (else the index in the message picks its table);
    ``part``: the prompt's part at fault where the message names none (``means``)."""
    try:
        yield
    except (ConfigError, InputError) as e:
        raise readdressed(e, data, tables, name, part) from None


def readdressed(error, data, tables: list, name: str | None = None, part: str | None = None):
    """``error`` naming the [data] key that made its prompt (see :func:`data_errors`),
    or ``error`` itself (not about a prompt of a data set)."""
    text = str(error)
    m = PROMPT_ERROR.match(text)
    data = _table(data)
    if data is None or not data_set_given(data) or m is None:
        return error
    index = int(m.group(1))
    table = next((t for t in tables if t["name"] == name), None) if name is not None else \
        tables[index] if index < len(tables) else None
    if table is None:
        return error
    detail = re.sub(r"^ \('[^']*'\)", "", text[len(f"prompts[{index}]"):]).lstrip(".:").strip()
    if data["folder"] is not None:
        # a table's part (kind, path, target.path) means nothing to a folder's user; a
        # reader's error names the file itself (the prompt's or its target's)
        part_key = re.match(r"[\w.\[\]]+: ", detail) if m.group(2) else None
        named = part_key is not None and part_key.group(0).endswith("path: ")
        detail = detail[part_key.end():] if part_key else detail
        source = table["target"]["path"] if m.group(2) == "target" and table.get("target") else table["path"]
        key, message = "data.folder", detail if named else f"{source}: {detail}"
    else:
        flat = data["family"] == FLAT_FAMILY
        key = DRAWN_KEYS.get(m.group(2) or part, "mean_range" if flat else "concentration_range")
        message = (f"{data[key]} draws prompts this run cannot take; change it "
                   f"(drawn prompt {table['name']}: {detail})")
        key = f"data.{key}"
    return ConfigError(key, message)    # (a ConfigError leads with its key in any pass)


def prompt_label(data, tables: list, name: str, index: int) -> str:
    """How a warning names prompt ``name`` (index ``index``): ``prompts[i] ('a')``, or by
    the [data] keys or the file that made it."""
    table = tables[index] if index < len(tables) and tables[index]["name"] == name else None
    data = _table(data)
    if data is None or table is None or not data_set_given(data):
        return f"prompts[{index}] ({name!r})"
    if data["folder"] is not None:
        return f"data.folder: {table['path']}"
    keys = ("mean_range", "std_range") if data["family"] == FLAT_FAMILY else ("concentration_range",)
    return f"{', '.join(f'data.{k}' for k in keys)}: drawn prompt {name}"


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
