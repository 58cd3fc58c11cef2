"""Files a run writes and reads back: diagnostics CSV, summary.json, provenance, VTK.

Only rank 0 writes the CSV and JSON files. :func:`read_pvd` and :func:`read_vtu` read
the VTK field output back (serial .vtu and parallel .pvtu pieces, ASCII or base64
binary), for tests and post-processing without ParaView.
"""

from __future__ import annotations

import base64
import csv
import datetime
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from contextlib import contextmanager

import numpy as np

from .. import __version__
from .errors import InputError, OutputError

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # pdeformer/


def diagnostics_header(d: int, extras=()) -> list[str]:
    """The columns of diagnostics.csv; ``extras``: the names of a run's further columns
    (on a circle or sphere: order, fourier_l)."""
    return (["prompt", "t", "mass", "outflow", "min_rho"] + [f"mean_{i}" for i in range(d)]
            + [f"cov_{i}{j}" for i in range(d) for j in range(d)] + list(extras))


def diagnostics_row(diag: dict) -> list:
    return ([diag["prompt"], diag["t"], diag["mass"], diag["outflow"], diag["min_rho"]]
            + list(np.ravel(diag["mean"])) + list(np.ravel(diag["cov"]))
            + list((diag.get("extras") or {}).values()))


@contextmanager
def atomic_write(filename: str, binary: bool = False, sync: bool = False):
    """A file object on a temporary file of a name no other process uses, renamed over
    ``filename`` when the block ends: readers see the old file or the new one, never a
    part. On failure the temporary file is removed, and an OSError (disk full, quota,
    permissions) becomes an :class:`OutputError` naming ``filename``. ``sync``: flushed
    to disk before the rename."""
    folder, base = os.path.split(filename)
    tmp = os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb" if binary else "x", **({} if binary else {"newline": ""})) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, filename)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OutputError(f"output: cannot write {filename} ({e.strerror or e})") from None
        raise


def write_csv(filename: str, header: list[str], rows: list[list]) -> None:
    with atomic_write(filename) as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            w.writerow([repr(float(x)) if isinstance(x, (float, np.floating)) else x for x in r])


def read_diagnostics(filename: str) -> list[dict]:
    """Rows of a diagnostics.csv as dicts (numbers as floats)."""
    with open(filename, newline="") as f:
        return [{k: (v if k == "prompt" else float(v)) for k, v in row.items()}
                for row in csv.DictReader(f)]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def write_json(filename: str, data: dict) -> None:
    with atomic_write(filename) as f:
        json.dump(_jsonable(data), f, indent=2)
        f.write("\n")


def write_npz(filename: str, sync: bool = False, **arrays) -> None:
    """np.savez, atomically (see atomic_write)."""
    with atomic_write(filename, binary=True, sync=sync) as f:
        np.savez(f, **arrays)


# the prompts a run's pictures show (the first ones): rows of the density picture, curves
# of the diagnostics; fields.npz keeps the frames of these alone
PICTURE_PROMPTS = 12


def save_figure(filename: str, fig, **kwargs) -> None:
    """A matplotlib figure, atomically, in the format its extension names (.png, .svg)."""
    fmt = os.path.splitext(filename)[1][1:].lower() or "png"
    with atomic_write(filename, binary=True) as f:
        fig.savefig(f, format=fmt, **kwargs)


def git_commit() -> dict:
    """Commit (and whether the tree has local changes) of the pdeformer source."""
    def git(*args):
        return subprocess.run(["git", "-C", PACKAGE_DIR, *args], capture_output=True,
                              text=True, timeout=20)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip() != ""
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def provenance(comm, versions: dict) -> dict:
    """Who ran what where: versions (pdeformer's, Python's and ``versions``: the
    finite-element stack's), ranks, host, commit, time."""
    from .blas import blas_record
    return {"pdeformer": __version__, "python": sys.version.split()[0], **versions,
            "blas": blas_record(), "ranks": comm.size, "host": socket.gethostname(),
            "platform": platform.platform(),
            "git": git_commit(), "argv": sys.argv,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ------------------------------------------------------------------------- VTK reading

def read_pvd(filename: str) -> list[tuple[float, str]]:
    """(time, absolute data file) for every frame of a .pvd collection."""
    try:
        root = ET.parse(filename).getroot()
    except (OSError, ET.ParseError) as e:
        raise InputError(f"{filename}: cannot read ({e})") from None
    base = os.path.dirname(filename)
    return [(float(ds.get("timestep")), os.path.join(base, ds.get("file")))
            for ds in root.iter("DataSet")]


def _data_array(node, header_type: str, compressed: bool) -> np.ndarray:
    dtype = np.dtype({"Float64": "f8", "Float32": "f4", "Int64": "i8", "Int32": "i4",
                      "UInt8": "u1", "UInt32": "u4", "UInt64": "u8", "Int8": "i1"}[node.get("type")])
    fmt = node.get("format", "ascii")
    text = (node.text or "").strip()
    if fmt == "ascii":
        return np.array(text.split(), dtype=float).astype(dtype)
    if fmt != "binary":
        raise InputError(f"unsupported VTK DataArray format {fmt!r}")
    hdt = np.dtype("u8" if header_type == "UInt64" else "u4")
    raw = base64.b64decode(text)
    if not compressed:
        n = int(np.frombuffer(raw[:hdt.itemsize], hdt)[0])
        return np.frombuffer(raw[hdt.itemsize:hdt.itemsize + n], dtype)
    nblocks = int(np.frombuffer(raw[:hdt.itemsize], hdt)[0])
    hsize = hdt.itemsize * (3 + nblocks)
    header = np.frombuffer(raw[:hsize], hdt)
    sizes = header[3:]
    out, pos = [], hsize
    for s in sizes:
        out.append(zlib.decompress(raw[pos:pos + int(s)]))
        pos += int(s)
    return np.frombuffer(b"".join(out), dtype)


def read_vtu(filename: str) -> dict:
    """Points, cells and point/cell data of a .vtu file, or of all pieces of a .pvtu."""
    root = ET.parse(filename).getroot()
    if root.get("type") == "PUnstructuredGrid":
        base = os.path.dirname(filename)
        pieces = [read_vtu(os.path.join(base, p.get("Source"))) for p in root.iter("Piece")]
        out = {"points": [], "connectivity": [], "offsets": [], "types": [],
               "point_data": {}, "cell_data": {}}
        shift = 0
        for p in pieces:
            out["points"].append(p["points"])
            out["connectivity"].append(p["connectivity"] + shift)
            out["offsets"].append(p["offsets"])
            out["types"].append(p["types"])
            for kind in ("point_data", "cell_data"):
                for k, v in p[kind].items():
                    out[kind].setdefault(k, []).append(v)
            shift += p["points"].shape[0]
        cat = {k: np.concatenate(v) for k, v in out.items() if k not in ("point_data", "cell_data")}
        # offsets of concatenated pieces: rebuild from per-piece cell sizes
        sizes = np.concatenate([np.diff(np.concatenate([[0], o])) for o in out["offsets"]])
        cat["offsets"] = np.cumsum(sizes)
        for kind in ("point_data", "cell_data"):
            cat[kind] = {k: np.concatenate(v) for k, v in out[kind].items()}
        return cat
    header_type = root.get("header_type", "UInt32")
    compressed = root.get("compressor") is not None
    piece = root.find(".//Piece")
    arrays = lambda node: {a.get("Name"): _as_components(a, _data_array(a, header_type, compressed))
                           for a in (node.findall("DataArray") if node is not None else [])}
    pts = arrays(piece.find("Points"))
    cells = arrays(piece.find("Cells"))
    return {"points": next(iter(pts.values())).reshape(-1, 3),
            "connectivity": cells["connectivity"], "offsets": cells["offsets"],
            "types": cells["types"],
            "point_data": arrays(piece.find("PointData")),
            "cell_data": arrays(piece.find("CellData"))}


def _as_components(node, a):
    n = int(node.get("NumberOfComponents", "1"))
    return a.reshape(-1, n) if n > 1 else a


# ------------------------------------------------------------------------- VTK writing

def write_points(filename: str, points: np.ndarray, data: dict) -> None:
    """A VTK point set (.vtu, ASCII, one vertex cell per point) with point data;
    points (n, d <= 3) are padded to 3 coordinates."""
    n = points.shape[0]
    pts = np.zeros((n, 3))
    pts[:, :points.shape[1]] = points

    def array(name, a):
        a = np.asarray(a, float)
        comps = a.shape[1] if a.ndim == 2 else 1
        body = " ".join(repr(float(v)) for v in a.ravel())
        return (f'<DataArray type="Float64" Name="{name}" NumberOfComponents="{comps}" '
                f'format="ascii">{body}</DataArray>')

    xml = ['<?xml version="1.0"?>',
           '<VTKFile type="UnstructuredGrid" version="1.0" byte_order="LittleEndian">',
           "<UnstructuredGrid>", f'<Piece NumberOfPoints="{n}" NumberOfCells="{n}">',
           "<Points>", array("Points", pts), "</Points>", "<Cells>",
           f'<DataArray type="Int64" Name="connectivity" format="ascii">{" ".join(map(str, range(n)))}</DataArray>',
           f'<DataArray type="Int64" Name="offsets" format="ascii">{" ".join(map(str, range(1, n + 1)))}</DataArray>',
           f'<DataArray type="UInt8" Name="types" format="ascii">{" ".join(["1"] * n)}</DataArray>',
           "</Cells>", "<PointData>", *(array(k, v) for k, v in data.items()), "</PointData>",
           "</Piece>", "</UnstructuredGrid>", "</VTKFile>"]
    _atomic_text(filename, "\n".join(xml) + "\n")


def write_pvd(filename: str, entries: list[tuple[float, str]]) -> None:
    """A .pvd collection: (time, file relative to the .pvd) per frame."""
    lines = ['<?xml version="1.0"?>', '<VTKFile type="Collection" version="1.0">', "<Collection>"]
    lines += [f'<DataSet timestep="{t!r}" part="0" file="{f}"/>' for t, f in entries]
    lines += ["</Collection>", "</VTKFile>"]
    _atomic_text(filename, "\n".join(lines) + "\n")


def _atomic_text(filename: str, text: str) -> None:
    with atomic_write(filename) as f:
        f.write(text)
