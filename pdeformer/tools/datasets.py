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

The drawn prompts are ordinary prompt tables: the checked configuration (summary.json)
records every one of them. Their targets come from a teacher (``data.teacher``, a heads
file, or ``data.teacher_seed``, random heads of the model's sizes): see
:func:`pdeformer.solvers.forward.teacher_targets`.
"""

from __future__ import annotations

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
    """The ``[data]`` options on their own: ranges, family against the mesh, one teacher."""
    if data["count"] == 0:
        given = [k for k in ("teacher", "teacher_seed") if data[k] is not None]
        if given:
            raise ConfigError(f"data.{given[0]}", "given, but data.count is 0 (no data set)")
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
    if data["teacher"] is not None and data["teacher_seed"] is not None:
        raise ConfigError("data.teacher_seed", "give either data.teacher (a file) or data.teacher_seed, not both")


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


def teacher_given(data: dict) -> bool:
    """Whether the data set's targets come from a teacher."""
    return data["count"] > 0 and (data["teacher"] is not None or data["teacher_seed"] is not None)
