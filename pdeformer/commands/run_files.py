"""Reading a run's files for its pictures and ParaView session (numpy only: no MPI, no
dolfinx): every file through pdeformer.tools.files (never blocking, size-checked), its
arrays checked finite, each failure one line naming the file (exit status 2 from
``pdeformer plot``)."""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re

import numpy as np

from ..model import params as tree
from ..tools.errors import InputError
from ..tools.files import TEXT_FILE, load_npz, npz_names, read_text
from ..tools.outdir import PICTURE_FORMATS as FORMATS   # the pictures' formats

# (a run's files are named by their path alone: the readers get no config key, "")


def read_npz(path: str, wanted=None) -> dict:
    """The arrays of an .npz file (those whose names ``wanted`` accepts: each is read
    only if asked for); InputError naming it if it is not a regular file, cannot be
    read or unpacks to more than the memory available."""
    names = None if wanted is None else tuple(n for n in npz_names(path, "") if wanted(n))
    return load_npz(path, "", names)


def check_finite(path: str, data: dict, names) -> None:
    """InputError naming the file where an array of ``names`` is not numbers or has a
    NaN or infinite entry (scales and principal directions need finite numbers)."""
    for name in names:
        a = np.asarray(data[name])
        if a.dtype.kind not in "biufc":
            raise InputError(f"{path}: {name} is not an array of numbers ({a.dtype})")
        if not np.all(np.isfinite(a)):
            raise InputError(f"{path}: {name} has non-finite entries")


UNRECORDED = re.compile(r"(density|velocity)_range_\d+")   # (inf, -inf) where nothing was recorded


def read_snapshots(path: str) -> dict:
    """fields.npz (see pdeformer.solvers.snapshots) as a dict of arrays, checked: its
    arrays of floats finite (the recorded ranges may be empty)."""
    data = read_npz(path)
    missing = [k for k in ("version", "prompts", "box") if k not in data]
    if missing:
        raise InputError(f"{path}: not a pdeformer field file (no {', '.join(missing)})")
    check_finite(path, data, [k for k, a in data.items()
                              if a.dtype.kind in "fc" and not UNRECORDED.fullmatch(k)])
    return data


def _csv_rows(path: str) -> list[dict]:
    """The rows of a CSV file of the run (a regular text file of at most TEXT_FILE
    bytes); InputError naming the file. NaN and inf are numbers here: the pictures
    show them as gaps (history.csv's test risks between evaluations, a blown-up frame)."""
    text = read_text(path, "", TEXT_FILE)
    try:
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise InputError(f"{path}: cannot read ({e})") from None
    if not rows:
        raise InputError(f"{path}: cannot read (no rows)")
    return rows


def read_table(path: str) -> dict:
    """A CSV of numbers (history.csv) as {column: array}; InputError naming the file."""
    rows = _csv_rows(path)
    try:
        return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]}
    except (ValueError, TypeError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None


def read_diagnostics_table(path: str) -> list[dict]:
    """diagnostics.csv rows (numbers as floats, as pdeformer.tools.output.read_diagnostics
    has them); InputError naming the file."""
    try:
        rows = [{k: (v if k == "prompt" else float(v)) for k, v in row.items()} for row in _csv_rows(path)]
    except (ValueError, TypeError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None
    if not rows or "t" not in rows[0] or "mass" not in rows[0]:
        raise InputError(f"{path}: not a diagnostics table (no rows, or no t and mass columns)")
    return rows


def read_params(folder: str) -> list[tuple[int, dict]]:
    """(step, parameter tree) of every params_XXXX.npz of a training run, by step;
    InputError naming a file that is not one (it holds no whole block of parameters),
    or whose parameters are not finite."""
    out = []
    for path in glob.glob(os.path.join(folder, "params_*.npz")):
        m = re.fullmatch(r"params_(\d+)\.npz", os.path.basename(path))
        if m:
            data = read_npz(path)
            keys = tree.blocks_in(data)
            if not keys:
                raise InputError(f"{path}: not a parameter file (no whole block of parameters)")
            check_finite(path, data, [k for block in keys.values() for k in block.values()])
            out.append((int(m[1]), tree.read_tree(data)))
    return sorted(out, key=lambda p: p[0])


def read_gradient(path: str) -> dict:
    """gradient.npz as a tree of dR/dtheta (and ``risk``, where it holds one), finite;
    InputError naming the file."""
    data = read_npz(path)
    keys = tree.blocks_in(k[1:] for k in data if k.startswith("d"))
    if not keys:
        raise InputError(f"{path}: not a gradient file (no whole block of derivatives)")
    check_finite(path, data, ["d" + k for block in keys.values() for k in block.values()]
                 + (["risk"] if "risk" in data else []))
    grads = tree.read_tree({k[1:]: a for k, a in data.items() if k.startswith("d")})
    return {"params": grads, **({"risk": data["risk"]} if "risk" in data else {})}


def run_inputs(folder: str) -> dict:
    """What the folder holds to draw from: {"summary", "fields", "diagnostics",
    "history", "gradient": path} and "params": [paths]. InputError where it is not a
    run folder, or summary.json lists a file that is gone. Whatever has a file's name is
    found (a folder or FIFO of that name too: reading it then names it)."""
    if not os.path.isdir(folder):
        raise InputError(f"{folder}: " + ("not a folder" if os.path.exists(folder) else "no such folder"))
    names = {"summary": "summary.json", "fields": "fields.npz", "diagnostics": "diagnostics.csv",
             "history": "history.csv", "gradient": "gradient.npz"}
    found = {k: os.path.join(folder, n) for k, n in names.items() if os.path.lexists(os.path.join(folder, n))}
    params = sorted(glob.glob(os.path.join(folder, "params_*.npz")))
    if not found and not params:
        raise InputError(f"{os.path.join(folder, 'summary.json')}: no such file "
                         "(not a pdeformer run folder)")
    if "summary" in found:
        listed = _listed_files(found["summary"])
        for key, name in names.items():
            if name in listed and key not in found:
                raise InputError(f"{os.path.join(folder, name)}: no such file (summary.json lists it)")
    if params:
        found["params"] = params
    return found


def _listed_files(path: str) -> set:
    """The file names summary.json's ``files`` lists (strings, or lists of them)."""
    summary = read_summary(path)
    if not isinstance(summary, dict):
        raise InputError(f"{path}: not a pdeformer summary (not a JSON object)")
    files = summary.get("files") or {}
    names = set()
    for v in files.values() if isinstance(files, dict) else ():
        names.update([v] if isinstance(v, str) else [x for x in v if isinstance(x, str)]
                     if isinstance(v, list) else [])
    return names


def read_summary(path: str):
    """summary.json as JSON (a regular text file of at most TEXT_FILE bytes);
    InputError naming the file."""
    text = read_text(path, "", TEXT_FILE)
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputError(f"{path}: cannot read (not JSON: {e})") from None


def summary_format(folder: str) -> str:
    """The run's [output] plot_format (png where summary.json does not say, or cannot
    be read: run_inputs names it then)."""
    try:
        fmt = read_summary(os.path.join(folder, "summary.json"))["config"]["output"]["plot_format"]
        return fmt if fmt in FORMATS else "png"
    except (InputError, KeyError, TypeError):
        return "png"
