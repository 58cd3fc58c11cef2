"""The token domain Omega: a built-in box mesh or a mesh file (XDMF).

``[mesh] lower, upper, cells, cell`` builds an interval, a rectangle (triangles or
quadrilaterals) or a box (tetrahedra or hexahedra); ``[mesh] file`` (and ``name``, the
grid name, default "mesh") reads an XDMF mesh as dolfinx writes it. The token
dimension d is the mesh's topological dimension, and the geometry must have the
same dimension (a 2-D mesh stored with XY coordinates).
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import numpy as np
import dolfinx.io
import dolfinx.mesh

from .errors import InputError
from .parallel import on_root

CELL_TYPES = {
    "interval": dolfinx.mesh.CellType.interval,
    "triangle": dolfinx.mesh.CellType.triangle,
    "quadrilateral": dolfinx.mesh.CellType.quadrilateral,
    "tetrahedron": dolfinx.mesh.CellType.tetrahedron,
    "hexahedron": dolfinx.mesh.CellType.hexahedron,
}


def box_mesh(comm, lower, upper, cells, cell: str):
    """The built-in mesh of [lower, upper] with ``cells`` cells per direction."""
    d = len(lower)
    if d == 1:
        return dolfinx.mesh.create_interval(comm, cells[0], [lower[0], upper[0]])
    if d == 2:
        return dolfinx.mesh.create_rectangle(comm, [np.array(lower), np.array(upper)], cells,
                                             cell_type=CELL_TYPES[cell])
    return dolfinx.mesh.create_box(comm, [np.array(lower), np.array(upper)], cells,
                                   cell_type=CELL_TYPES[cell])


def check_xdmf(filename: str, name: str) -> None:
    """Check an XDMF mesh file before dolfinx reads it collectively (run on rank 0):
    the file, the grid ``name``, its topology and geometry and their HDF5 file."""
    key = "mesh.file"
    if not os.path.isfile(filename):
        raise InputError(f"{key}: {filename}: no such mesh file")
    if not filename.endswith(".xdmf"):
        raise InputError(f"{key}: {filename}: not an XDMF file (convert it, e.g. with meshes/make_meshes.py or meshio)")
    try:
        root = ET.parse(filename).getroot()
    except ET.ParseError as e:
        raise InputError(f"{key}: {filename}: not valid XDMF ({e})") from None
    grids = root.findall(".//Grid")
    names = [g.get("Name") for g in grids]
    grid = next((g for g in grids if g.get("Name") == name), None)
    if grid is None:
        raise InputError(f"{key}: {filename}: no grid named {name!r} (found {names}; set mesh.name)")
    for part in ("Topology", "Geometry"):
        node = grid.find(part)
        if node is None:
            raise InputError(f"{key}: {filename}: grid {name!r} has no {part}")
        item = node.find("DataItem")
        if item is None:
            raise InputError(f"{key}: {filename}: {part} has no DataItem")
        if item.get("Format", "XML") == "HDF":
            h5 = (item.text or "").strip().split(":")[0]
            h5path = os.path.join(os.path.dirname(filename), h5)
            if not os.path.isfile(h5path):
                raise InputError(f"{key}: {filename}: its data file {h5path} is missing")


def read_mesh(comm, filename: str, name: str = "mesh"):
    on_root(comm, check_xdmf, filename, name)
    try:
        with dolfinx.io.XDMFFile(comm, filename, "r") as f:
            mesh = f.read_mesh(name=name)
    except RuntimeError as e:
        raise InputError(f"mesh.file: {filename}: dolfinx cannot read it ({e})") from None
    return mesh


def make_mesh(comm, cfg: dict):
    """The mesh of a checked ``[mesh]`` table."""
    if cfg["file"] is not None:
        mesh = read_mesh(comm, cfg["file"], cfg["name"])
        where = f"mesh.file: {cfg['file']}"
    else:
        mesh = box_mesh(comm, cfg["lower"], cfg["upper"], cfg["cells"], cfg["cell"])
        where = "mesh"
    tdim, gdim = mesh.topology.dim, mesh.geometry.dim
    if gdim != tdim:
        raise InputError(f"{where}: geometry has {gdim} coordinates for a {tdim}-D mesh; "
                         f"store it with {tdim} coordinates per point")
    if tdim < 1 or tdim > 3:
        raise InputError(f"{where}: {tdim}-D meshes are not supported")
    return mesh


def bounding_box(comm, mesh) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper corner of the mesh's bounding box (all ranks)."""
    from mpi4py import MPI
    d = mesh.topology.dim
    x = mesh.geometry.x[:, :d]
    lo = x.min(axis=0) if x.size else np.full(d, np.inf)
    hi = x.max(axis=0) if x.size else np.full(d, -np.inf)
    glo, ghi = np.empty(d), np.empty(d)
    comm.Allreduce(lo, glo, op=MPI.MIN)
    comm.Allreduce(hi, ghi, op=MPI.MAX)
    return glo, ghi
