"""The token domain Omega: a built-in box mesh, a circle or sphere, or a mesh file (XDMF).

``[mesh] lower, upper, cells, cell`` builds an interval, a rectangle (triangles or
quadrilaterals) or a box (tetrahedra or hexahedra); ``shape = "circle"`` (``cells =
[n]``: a regular n-gon) and ``shape = "sphere"`` (``refinements = r``: the icosahedron
with every triangle split into 4, r times, 20 * 4^r triangles), both of ``radius``
(default 1) about the origin, build a closed curve in R^2 and a closed surface in R^3;
``[mesh] file`` (and ``name``, the grid name, default "mesh") reads an XDMF mesh as
dolfinx writes it. The token dimension d is the dimension of the mesh's coordinates:
the topological one for a flat mesh, 2 on a circle and 3 on a sphere, whose vertices lie
on the sphere |x| = radius (a mesh file with more coordinates than its cells'
dimension must be such a circle or sphere about the origin).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import xml.etree.ElementTree as ET

import numpy as np
import dolfinx.io
import dolfinx.mesh

from . import _dolfinx as dfx
from ..model.geometry import CELLS, Geometry, geometry_of_points
from ..tools.errors import InputError
from ..tools.files import XDMF_BYTES, open_regular, read_bytes
from ..tools.parallel import on_root

CELL_TYPES = {c: getattr(dolfinx.mesh.CellType, c) for cs in CELLS.values() for c in cs}   # [mesh] cell


def reproducible_partition() -> None:
    """One SCOTCH thread for the partitioner dolfinx calls (unless the user set
    SCOTCH_PTHREAD_NUMBER): with several, the same job partitions the same mesh
    differently from run to run, and the results of P > 1 ranks then differ by
    round-off between runs (and, where a laplace choice sits at its threshold, by
    more). SCOTCH reads the variable at every partitioning."""
    os.environ.setdefault("SCOTCH_PTHREAD_NUMBER", "1")


def box_mesh(comm, lower, upper, cells, cell: str):
    """The built-in mesh of [lower, upper] with ``cells`` cells per direction."""
    reproducible_partition()
    d = len(lower)
    part = dfx.balanced_partitioner()
    if d == 1:
        return dolfinx.mesh.create_interval(comm, cells[0], [lower[0], upper[0]], partitioner=part)
    if d == 2:
        return dolfinx.mesh.create_rectangle(comm, [np.array(lower), np.array(upper)], cells,
                                             cell_type=CELL_TYPES[cell], partitioner=part)
    return dolfinx.mesh.create_box(comm, [np.array(lower), np.array(upper)], cells,
                                   cell_type=CELL_TYPES[cell], partitioner=part)


def icosphere(refinements: int) -> tuple[np.ndarray, np.ndarray]:
    """Vertices (on the unit sphere) and triangles of the icosahedron refined
    ``refinements`` times: each triangle split into 4 at its edges' midpoints, which are
    pushed out onto the sphere. Triangles are counter-clockwise seen from outside."""
    t = (1 + 5 ** 0.5) / 2
    x = np.array([[-1, t, 0], [1, t, 0], [-1, -t, 0], [1, -t, 0], [0, -1, t], [0, 1, t],
                  [0, -1, -t], [0, 1, -t], [t, 0, -1], [t, 0, 1], [-t, 0, -1], [-t, 0, 1]], float)
    x /= np.linalg.norm(x, axis=1)[:, None]
    tri = np.array([[0, 11, 5], [0, 5, 1], [0, 1, 7], [0, 7, 10], [0, 10, 11], [1, 5, 9],
                    [5, 11, 4], [11, 10, 2], [10, 7, 6], [7, 1, 8], [3, 9, 4], [3, 4, 2],
                    [3, 2, 6], [3, 6, 8], [3, 8, 9], [4, 9, 5], [2, 4, 11], [6, 2, 10],
                    [8, 6, 7], [9, 8, 1]])
    for _ in range(refinements):
        edges = np.sort(np.concatenate([tri[:, [0, 1]], tri[:, [1, 2]], tri[:, [2, 0]]]), axis=1)
        unique, index = np.unique(edges, axis=0, return_inverse=True)
        index = index.reshape(3, -1) + len(x)               # midpoint of edge ab, bc, ca
        mid = x[unique[:, 0]] + x[unique[:, 1]]
        x = np.vstack([x, mid / np.linalg.norm(mid, axis=1)[:, None]])
        a, b, c = tri.T
        ab, bc, ca = index
        tri = np.concatenate([np.c_[a, ab, ca], np.c_[b, bc, ab], np.c_[c, ca, bc], np.c_[ab, bc, ca]])
    return x, tri


def circle_mesh(comm, n: int, radius: float):
    """The regular n-gon inscribed in the circle |x| = radius (n intervals in R^2)."""
    reproducible_partition()
    theta = 2 * np.pi * np.arange(n) / n
    x = radius * np.c_[np.cos(theta), np.sin(theta)]
    cells = np.c_[np.arange(n), (np.arange(n) + 1) % n]
    if comm.rank:
        x, cells = x[:0], cells[:0]
    return dfx.manifold_mesh(comm, cells, x, "interval")


def sphere_mesh(comm, refinements: int, radius: float):
    """The icosphere (:func:`icosphere`) of ``radius``: 20 * 4^refinements triangles in R^3."""
    reproducible_partition()
    x, cells = icosphere(refinements)
    x = radius * x
    if comm.rank:
        x, cells = x[:0], cells[:0]
    return dfx.manifold_mesh(comm, cells, x, "triangle")


def mesh_geometry(comm, mesh) -> Geometry | None:
    """The space of the mesh's tokens (:func:`pdeformer.model.geometry.geometry_of_points`):
    flat R^d for a flat mesh; for a curve or surface the sphere about the origin its
    vertices lie on (to 1e-8 relative), None if they lie on none (collective on a
    manifold mesh)."""
    return geometry_of_points(comm, mesh.geometry.x[:, :token_dim(mesh)], is_manifold(mesh))


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _is_hdf5(path: str) -> bool:
    """Whether the file has an HDF5 superblock signature (at 0, 512, 1024, 2048, ...)."""
    with open_regular(path, "mesh.file") as f:
        size = os.fstat(f.fileno()).st_size
        offset = 0
        while offset + len(HDF5_SIGNATURE) <= size:
            f.seek(offset)
            if f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return True
            offset = 512 if offset == 0 else 2 * offset
    return False


def check_hdf5(key: str, h5path: str, datasets: list) -> None:
    """The HDF5 file dolfinx will read: an HDF5 file holding ``datasets`` [(path, shape
    the XDMF gives)], probed with h5py where it is installed (which reports errors as
    exceptions, never on stderr), by its signature otherwise."""
    if not _is_hdf5(h5path):
        raise InputError(f"{key}: {h5path}: not an HDF5 file")
    try:
        import h5py
    except ImportError:
        return
    try:
        with h5py.File(h5path, "r") as f:
            for path, shape in datasets:
                node = f.get(path)
                if not isinstance(node, h5py.Dataset):
                    raise InputError(f"{key}: {h5path}: no dataset {path} (the XDMF file names it)")
                if shape is not None and tuple(node.shape) != shape:
                    raise InputError(f"{key}: {h5path}: dataset {path} has shape {tuple(node.shape)}, "
                                     f"the XDMF file says {shape}")
                if node.dtype.kind not in "iuf":
                    raise InputError(f"{key}: {h5path}: dataset {path} holds {node.dtype}, not numbers")
    except InputError:
        raise
    except Exception as e:   # truncated or damaged files fail in h5py in many ways
        raise InputError(f"{key}: {h5path}: cannot read it as HDF5 ({type(e).__name__}: {e})") from None


@contextlib.contextmanager
def hdf5_quiet():
    """Keep the HDF5 libraries loaded in this process from printing their error stack
    ("HDF5-DIAG: Error detected ...") while inside: dolfinx turns their failures into
    exceptions, which pdeformer reports in one line. The HDF5 dolfinx links (e.g.
    Debian's libhdf5_openmpi) need not be h5py's, so every one mapped is silenced
    (H5Eset_auto2(H5E_DEFAULT, NULL, NULL)) and restored after; nothing where they
    cannot be found (not Linux)."""
    saved = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted(set(re.findall(r"(/\S*/libhdf5(?:_[a-z]+)?\.so[.\d]*)$", f.read(), re.M)))
    except OSError:
        paths = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY)
            get, put = lib.H5Eget_auto2, lib.H5Eset_auto2
        except (OSError, AttributeError):
            continue
        get.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        put.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        func, data = ctypes.c_void_p(), ctypes.c_void_p()
        if get(0, ctypes.byref(func), ctypes.byref(data)) >= 0 and put(0, None, None) >= 0:
            saved.append((put, func, data))       # 0: H5E_DEFAULT, the default stack
    try:
        yield
    finally:
        for put, func, data in saved:
            put(0, func, data)


def check_xdmf(filename: str, name: str) -> None:
    """Check an XDMF mesh file before dolfinx reads it collectively (run on rank 0):
    the file, the grid ``name``, its topology and geometry and their HDF5 file (the one
    dolfinx reads: the XDMF file's own name with .h5)."""
    key = "mesh.file"
    if not os.path.lexists(filename):
        raise InputError(f"{key}: {filename}: no such mesh file")
    if not filename.endswith(".xdmf"):
        raise InputError(f"{key}: {filename}: not an XDMF file (convert it, e.g. with meshes/make_meshes.py or meshio)")
    text = read_bytes(filename, key, XDMF_BYTES)    # not blocking, bounded
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise InputError(f"{key}: {filename}: not valid XDMF ({e})") from None
    grids = root.findall(".//Grid")
    names = [g.get("Name") for g in grids]
    grid = next((g for g in grids if g.get("Name") == name), None)
    if grid is None:
        raise InputError(f"{key}: {filename}: no grid named {name!r} (found {names}; set mesh.name)")
    own = os.path.splitext(filename)[0] + ".h5"     # what dolfinx opens, whatever the XDMF says
    datasets = []
    for part in ("Topology", "Geometry"):
        node = grid.find(part)
        if node is None:
            raise InputError(f"{key}: {filename}: grid {name!r} has no {part}")
        item = node.find("DataItem")
        if item is None:
            raise InputError(f"{key}: {filename}: {part} has no DataItem")
        if item.get("Format", "XML") == "HDF":
            h5, _, dataset = (item.text or "").strip().partition(":")
            h5path = os.path.join(os.path.dirname(filename), h5)
            if not os.path.isfile(h5path):
                raise InputError(f"{key}: {filename}: its data file {h5path} is missing")
            if not os.path.isfile(own) or not os.path.samefile(h5path, own):
                raise InputError(f"{key}: {filename}: its data file is {h5}, but dolfinx reads "
                                 f"{os.path.basename(own)} (the XDMF file's name with .h5): rename one")
            try:
                shape = tuple(int(n) for n in item.get("Dimensions", "").split()) or None
            except ValueError:
                raise InputError(f"{key}: {filename}: {part} has Dimensions "
                                 f"{item.get('Dimensions')!r}, not integers") from None
            datasets.append((dataset, shape))
    if datasets:
        check_hdf5(key, own, datasets)


def read_mesh(comm, filename: str, name: str = "mesh"):
    """The mesh ``name`` of an XDMF file (checked first: one-line errors naming it)."""
    on_root(comm, check_xdmf, filename, name)
    reproducible_partition()
    try:
        with hdf5_quiet(), dolfinx.io.XDMFFile(comm, filename, "r") as f:
            mesh = f.read_mesh(name=name)
    except RuntimeError as e:
        raise InputError(f"mesh.file: {filename}: dolfinx cannot read it ({e})") from None
    return mesh


def make_mesh(comm, opts):
    """The mesh of the ``[mesh]`` options (pdeformer.model.schema.MeshOptions)."""
    if opts.file is not None:
        mesh = read_mesh(comm, opts.file, opts.name)
        where = f"mesh.file: {opts.file}"
    elif opts.shape == "circle":
        return circle_mesh(comm, opts.cells[0], opts.radius)
    elif opts.shape == "sphere":
        return sphere_mesh(comm, opts.refinements, opts.radius)
    else:
        mesh = box_mesh(comm, opts.lower, opts.upper, opts.cells, opts.cell)
        where = "mesh"
    tdim, gdim = mesh.topology.dim, mesh.geometry.dim
    if tdim < 1 or tdim > 3:
        raise InputError(f"{where}: {tdim}-D meshes are not supported")
    if gdim != tdim and (dfx.cell_type_name(mesh) not in ("interval", "triangle") or gdim != tdim + 1
                         or mesh_geometry(comm, mesh) is None):
        raise InputError(f"{where}: geometry has {gdim} coordinates for a {tdim}-D mesh: a flat "
                         f"mesh needs {tdim} coordinates per point, a manifold one must be a "
                         "circle (intervals in 2-D) or sphere (triangles in 3-D) about the origin")
    return mesh


def is_manifold(mesh) -> bool:
    """Whether the mesh is a curve or surface (its coordinates have one more dimension)."""
    return mesh.geometry.dim > mesh.topology.dim


def token_dim(mesh) -> int:
    """The token dimension d: the mesh's coordinates' (ambient on a circle or sphere)."""
    return mesh.geometry.dim if is_manifold(mesh) else mesh.topology.dim


def shortest_edge(comm, mesh) -> float:
    """The shortest distance between two geometry nodes of one cell, over all ranks'
    owned cells: for the linear simplices and boxes pdeformer meshes are made of, the
    shortest cell edge (a box's diagonals are longer). Infinite without cells."""
    from mpi4py import MPI
    from ._dolfinx import geometry_nodes
    d = mesh.topology.dim
    g = token_dim(mesh)
    owned = mesh.topology.index_map(d).size_local
    nodes = geometry_nodes(mesh)[:owned]
    local = np.inf
    if len(nodes):
        x = mesh.geometry.x[:, :g][nodes]                        # (cells, nodes, d)
        k = x.shape[1]
        i, j = np.triu_indices(k, 1)
        local = float(np.sqrt(np.min(np.sum((x[:, i] - x[:, j]) ** 2, axis=2))))
    return comm.allreduce(local, op=MPI.MIN)


def bounding_box(comm, mesh) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper corner of the mesh's bounding box (all ranks)."""
    from mpi4py import MPI
    d = token_dim(mesh)
    x = mesh.geometry.x[:, :d]
    lo = x.min(axis=0) if x.size else np.full(d, np.inf)
    hi = x.max(axis=0) if x.size else np.full(d, -np.inf)
    glo, ghi = np.empty(d), np.empty(d)
    comm.Allreduce(lo, glo, op=MPI.MIN)
    comm.Allreduce(hi, ghi, op=MPI.MAX)
    return glo, ghi
