"""The dolfinx version layer: the only module that knows dolfinx 0.5 from 0.9.

Debian 12 ships dolfinx 0.5.2 (pybind11 wrappers, ``FunctionSpace`` class,
``Expression.eval(cells)``, dof lists as AdjacencyList, no ADIOS2); Debian 13 ships
0.9.0 (``functionspace``, ``Expression.eval(mesh, cells)``, dof lists as 2-D arrays,
``VTXWriter``). The helpers below test for the feature, not the version number, and
everything else in pdeformer calls them instead of branching itself. Tested: 0.5, 0.9.
"""

from __future__ import annotations

import inspect
import os
import re

import numpy as np

import dolfinx
import dolfinx.fem
import dolfinx.fem.petsc  # noqa: F401  (registers the PETSc assemblers)
import dolfinx.io
import dolfinx.mesh

VERSION_STRING = dolfinx.__version__
VERSION = tuple(int(p) for p in VERSION_STRING.split(".")[:2])
TESTED = ((0, 5), (0, 9))
_HAS_FUNCTIONSPACE = hasattr(dolfinx.fem, "functionspace")
_EVAL_TAKES_MESH = "mesh" in inspect.signature(dolfinx.fem.Expression.eval).parameters
# 0.5: the mesh constructors take the ghost mode (default shared_facet); 0.9: the partitioner
_MESH_TAKES_GHOST_MODE = "ghost_mode" in inspect.signature(dolfinx.mesh.create_mesh).parameters


def untested_version_warning() -> str | None:
    if VERSION not in TESTED:
        return (f"warning: dolfinx {VERSION_STRING} is untested with pdeformer "
                f"(tested: {', '.join('%d.%d' % v for v in TESTED)})")
    return None


def function_space(mesh, family: str, degree: int, shape: tuple | None = None):
    """A (vector) Lagrange/DG space: ``function_space(mesh, "DG", 1)``,
    ``function_space(mesh, "Lagrange", 2, (d,))``."""
    if _HAS_FUNCTIONSPACE:
        element = (family, degree) if shape is None else (family, degree, shape)
        return dolfinx.fem.functionspace(mesh, element)
    if family == "DG" and cell_type_name(mesh) in ("quadrilateral", "hexahedron"):
        family = "DQ"   # 0.5's UFL name for it (and a warning otherwise)
    if shape is None:
        return dolfinx.fem.FunctionSpace(mesh, (family, degree))
    return dolfinx.fem.VectorFunctionSpace(mesh, (family, degree), dim=shape[0])


def expression(ufl_expr, points: np.ndarray):
    """Compile a UFL expression for evaluation at reference points (num_points, tdim)."""
    return dolfinx.fem.Expression(ufl_expr, points)


def evaluate(expr, mesh, cells: np.ndarray) -> np.ndarray:
    """Values of a compiled expression on the given cells, (num_cells, num_points * size)."""
    cells = np.asarray(cells, dtype=np.int32)
    if _EVAL_TAKES_MESH:
        return expr.eval(mesh, cells)
    return expr.eval(cells)


def cell_dofs(V) -> np.ndarray:
    """Dof indices (local, unblocked) of every local cell, (num_cells, dofs_per_cell)."""
    dl = V.dofmap.list
    if isinstance(dl, np.ndarray):
        return dl
    # the layout's count, not cell 0's: a rank may own no cell (and have no cell 0)
    return dl.array.reshape(-1, V.dofmap.dof_layout.num_dofs)


def owned_node_coordinates(W) -> np.ndarray:
    """Coordinates of the owned nodes of a Lagrange space with d components (or a
    scalar space in 1-D), (n_nodes, d), in the order of its (blocked) dof array."""
    d = W.mesh.geometry.dim
    f = dolfinx.fem.Function(W)
    f.interpolate(lambda x: x[0] if d == 1 else x[:d])
    n = W.dofmap.index_map.size_local * W.dofmap.index_map_bs
    return f.x.array[:n].reshape(-1, d).copy()


def geometry_nodes(mesh) -> np.ndarray:
    """Geometry node indices (rows of ``mesh.geometry.x``) of every local cell,
    (num_cells, nodes_per_cell); (0, 1) on a rank with no cell."""
    g = mesh.geometry.dofmap
    if isinstance(g, np.ndarray):
        if g.size == 0:
            return np.zeros((0, 1), dtype=np.int32)
        return g.reshape(g.shape[0], -1)
    if g.num_nodes == 0:
        return np.zeros((0, 1), dtype=np.int32)
    return g.array.reshape(g.num_nodes, -1)


def manifold_mesh(comm, cells: np.ndarray, x: np.ndarray, cell: str):
    """A mesh of affine ``cell``s (their vertex lists ``cells``) with vertex coordinates
    ``x`` of a larger dimension (a curve in R^2, a surface in R^3), partitioned over
    ``comm``; the data comes from rank 0 (the other ranks pass empty arrays)."""
    import ufl
    gdim = x.shape[1]
    try:
        import basix.ufl          # dolfinx >= 0.7: the coordinate element is a basix one
        domain = ufl.Mesh(basix.ufl.element("Lagrange", cell, 1, shape=(gdim,)))
    except ImportError:
        domain = ufl.Mesh(ufl.VectorElement("Lagrange", ufl.Cell(cell, geometric_dimension=gdim), 1))
    cells, x = np.asarray(cells, dtype=np.int64), np.asarray(x, float)
    return dolfinx.mesh.create_mesh(comm, cells, x, domain, partitioner=balanced_partitioner())


PARTITION_IMBALANCE = 0.001   # SCOTCH's tolerance (its default, 0.025, gave the two ranks of a
                              # 128^2 box 16,526 and 16,242 cells; this 16,383 and 16,385)


def balanced_partitioner():
    """The cell partitioner of pdeformer's meshes: SCOTCH (dolfinx's default graph
    partitioner) with an imbalance of PARTITION_IMBALANCE, every rank's share of the
    cells, and so of the transport and the attention sources, equal to 0.1%; ghosts
    across shared facets (the DG fluxes on facets between ranks need both cells). In
    0.5 the ghost mode is the mesh constructor's (its default, shared_facet), in 0.9
    the partitioner's (create_mesh ghosts nothing unless told)."""
    part = dolfinx.cpp.graph.partitioner_scotch(PARTITION_IMBALANCE, 0)
    if _MESH_TAKES_GHOST_MODE:
        return dolfinx.mesh.create_cell_partitioner(part)
    return dolfinx.mesh.create_cell_partitioner(part, dolfinx.mesh.GhostMode.shared_facet)


def cell_type_name(mesh) -> str:
    return mesh.topology.cell_type.name


def owned_cells(mesh) -> np.ndarray:
    tdim = mesh.topology.dim
    return np.arange(mesh.topology.index_map(tdim).size_local, dtype=np.int32)


def global_cells(mesh) -> int:
    return mesh.topology.index_map(mesh.topology.dim).size_global


def has_vtx() -> bool:
    return bool(getattr(dolfinx, "has_adios2", False)) and hasattr(dolfinx.io, "VTXWriter")


class FieldSeries:
    """A time series of one Function for ParaView: VTK (.pvd + .vtu/.pvtu per frame,
    both versions) or VTX (.bp folder, dolfinx >= 0.8 with ADIOS2).

    dolfinx's VTKFile does not report a failed write of a frame (a full disk leaves
    empty or cut .vtu files), only of the .pvd at :meth:`close`: :meth:`complete`
    checks that this rank's files of the last frame end as VTK files do, and
    :meth:`files` names all files of the series."""

    def __init__(self, comm, filename: str, u, fmt: str):
        self.u = u
        self.fmt = fmt
        self.filename = filename
        self.rank = comm.rank
        self.count = 0
        if fmt == "vtx":
            self._file = dolfinx.io.VTXWriter(comm, filename, [u])
        else:
            self._file = dolfinx.io.VTKFile(comm, filename, "w")

    def write(self, t: float) -> None:
        if self.fmt == "vtx":
            self._file.write(t)
        else:
            self._file.write_function(self.u, t)
        self.count += 1

    def close(self) -> None:
        """Close and drop the writer (its destructor would write the .pvd again)."""
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()
            finally:
                del f

    def _frame_files(self, k: int) -> list[str]:
        """This rank's files of frame k (VTK: the piece; rank 0 also the .pvtu; the .pvd
        is written, and a failure raised, when the series is closed)."""
        stem = os.path.splitext(self.filename)[0]
        own = [f"{stem}_p{self.rank}_{k:06d}.vtu"]
        return own + ([f"{stem}{k:06d}.pvtu"] if self.rank == 0 else [])

    def complete(self) -> bool:
        """Whether this rank's files of the last frame were written in full."""
        if self.fmt == "vtx" or self.count == 0:
            return True   # ADIOS2 raises on failed writes
        for name in self._frame_files(self.count - 1):
            try:
                with open(name, "rb") as f:
                    f.seek(max(0, os.path.getsize(name) - 64))
                    if not f.read().rstrip().endswith(b"</VTKFile>"):
                        return False
            except OSError:
                return False
        return True

    def files(self) -> list[str]:
        """Every file (or .bp folder) of the series that exists, of all ranks."""
        if self.fmt == "vtx":
            return [self.filename] if os.path.exists(self.filename) else []
        folder, stem = os.path.split(os.path.splitext(self.filename)[0])
        pattern = re.compile(re.escape(stem) + r"(\.pvd|\d{6}\.pvtu|_p\d+_\d{6}\.vtu)")
        return [os.path.join(folder, n) for n in os.listdir(folder or ".") if pattern.fullmatch(n)]


def versions() -> dict:
    """Versions of the numerical stack, for summary.json."""
    import mpi4py
    import petsc4py
    from petsc4py import PETSc
    out = {"dolfinx": dolfinx.__version__,
           "petsc": ".".join(str(v) for v in PETSc.Sys.getVersion()),
           "petsc4py": petsc4py.__version__, "mpi4py": mpi4py.__version__,
           "numpy": np.__version__}
    for name in ("ufl", "basix", "ffcx"):
        try:
            out[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            pass
    return out


def evaluate_at_points(u, points: np.ndarray) -> np.ndarray:
    """Values of a scalar Function u at arbitrary points (n, d), the same on every rank
    (each rank evaluates the points in its owned cells; one Allreduce combines them).
    Points outside the mesh give nan."""
    import dolfinx.geometry as geo
    from mpi4py import MPI
    mesh = u.function_space.mesh
    tdim = mesh.topology.dim
    pts = np.zeros((points.shape[0], 3))
    pts[:, :points.shape[1]] = points
    n_owned = mesh.topology.index_map(tdim).size_local
    if hasattr(geo, "bb_tree"):
        tree = geo.bb_tree(mesh, tdim, np.arange(n_owned, dtype=np.int32))
        candidates = geo.compute_collisions_points(tree, pts)
    else:
        tree = geo.BoundingBoxTree(mesh, tdim, np.arange(n_owned, dtype=np.int32))
        candidates = geo.compute_collisions(tree, pts)
    colliding = geo.compute_colliding_cells(mesh, candidates, pts)
    found, cells = [], []
    for i in range(pts.shape[0]):
        links = colliding.links(i)
        if len(links):
            found.append(i)
            cells.append(links[0])
    local = np.zeros(2 * pts.shape[0])
    if found:
        found = np.array(found)
        local[found] = u.eval(pts[found], np.array(cells, dtype=np.int32)).ravel()
        local[pts.shape[0] + found] = 1.0
    total = np.empty_like(local)
    mesh.comm.Allreduce(local, total, op=MPI.SUM)
    count = total[pts.shape[0]:]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total[:pts.shape[0]] / count, np.nan)
