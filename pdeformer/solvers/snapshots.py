"""The compact field file ``fields.npz``: what ``pdeformer plot`` draws densities from.

One file per run, written by world rank 0 whatever the rank count, with arrays in an
order that does not depend on the partition (cells sorted by their centroid), so that
runs on 1 and P ranks write the same numbers up to rounding. It is read without dolfinx
(:func:`pdeformer.commands.run_files.read_snapshots`).

Contents (``i`` the prompt's index in the config; the frames of the first PICTURE_PROMPTS
prompts alone, those the pictures show):

* ``version``, ``caption`` (what the frames are, e.g. "trained heads, step 20"), ``dim``, ``cell_type``, ``prompts`` (names), ``box`` (2, d): the mesh's
  bounding box, ``points`` (n, d) and ``cells`` (cells, vertices per cell): the mesh's
  vertices and cell connectivity (vertices in dolfinx's order: quadrilaterals and
  hexahedra tensor-product, not cyclic); ``chart``: "" for a flat mesh; on a circle
  "circle" and on a sphere "sphere", where ``points``, ``box``, ``node_x`` and ``dim``
  are those of the chart the pictures use (the angle theta in (-pi, pi]; longitude and
  latitude in degrees), each cell's corners unwrapped next to each other (a cell across
  theta = pi ends past it), while ``mean_i`` and the targets stay in R^d;
* ``t_i`` (frames,): depth t of every frame (t = 0 and every frame end), ``mean_i``
  (frames, d): the mean at each frame (diagnostics.csv's);
* Eulerian runs: ``density_i`` (frames, cells): the cell means of rho; in 1-D also
  ``node_x`` (cells, k + 1) and ``nodes_i`` (frames, cells, k + 1): rho at the DG nodes
  of each cell, sorted by x (the DG-k function is linear between them only for k = 1);
  ``density_range_i`` and ``velocity_range_i`` (2,): the range of the DG coefficients
  and of |v| at the velocity nodes over all frames (ParaView's fixed colour range);
* particle runs: ``tokens_i`` (frames, N, d) and ``weights_i`` (N,);
* targets: ``target_mean_i``, ``target_cov_i`` (moments), ``target_density_i`` (cells,):
  a density target at the cell centroids, normalised to mass 1 on R^d;
  ``target_points_i``, ``target_weights_i`` (a point-cloud target); ``objective`` (its
  kind, "" without one) and, for a potential with a centre, ``objective_center``.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..fem import _dolfinx as dfx
from ..integrator.frames import Tracker
from ..tools.output import PICTURE_PROMPTS, write_npz
from ..tools.parallel import on_root
from .trackers import frame_diagnostics

VERSION = 1
VERTICES = {"interval": 2, "triangle": 3, "quadrilateral": 4, "tetrahedron": 4, "hexahedron": 8}


def quantised(x: np.ndarray, lower: np.ndarray, scale: float) -> np.ndarray:
    """Coordinates as integers on a grid 2^-30 of the domain's size: keys that sort and
    compare the same whatever rounding the partition left in the last bits."""
    return np.round((x - lower) / scale * 2.0**30).astype(np.int64)


def sorted_rows(keys: np.ndarray) -> np.ndarray:
    """The permutation that sorts integer rows lexicographically (first column first)."""
    return np.lexsort(keys.T[::-1]) if len(keys) else np.zeros(0, dtype=np.int64)


class MeshCells:
    """The owned cells of a mesh, gathered to rank 0 of ``comm`` in centroid order.

    Rank 0 holds ``points`` (n, d), ``cells`` (m, vertices) and ``centroids`` (m, d);
    :meth:`gather` brings per-cell values of every rank there in the same order.
    ``geometry``: the tokens' space (:mod:`pdeformer.model.geometry`), whose chart the
    cells are drawn in."""

    def __init__(self, mesh, comm, geometry):
        self.comm = comm
        self.dim = mesh.topology.dim
        g = mesh.geometry.dim
        self.geometry = geometry
        self.chart = geometry.chart_name
        self.cell_type = dfx.cell_type_name(mesh)
        nv = VERTICES[self.cell_type]
        owned = dfx.owned_cells(mesh).size
        nodes = dfx.geometry_nodes(mesh)[:owned, :nv].reshape(owned, nv)
        local = mesh.geometry.x[nodes, :g].reshape(owned, nv, g)
        parts = comm.gather(local, root=0)
        self.order = None
        if comm.rank == 0:
            self._arrange(np.concatenate(parts))

    def _arrange(self, ambient: np.ndarray) -> None:
        """Cells sorted by centroid; vertices numbered in sorted order (rank 0). On a
        circle or sphere the cells are drawn in the chart (:meth:`Geometry.chart`) and
        ``centroids`` stay in R^d (where targets are evaluated)."""
        corners = self.geometry.chart(ambient)
        m, nv, d = corners.shape
        flat = corners.reshape(-1, d)
        lower = flat.min(axis=0)
        scale = float(np.max(flat.max(axis=0) - lower)) or 1.0
        self.box = self.geometry.chart_box(flat)
        self.order = sorted_rows(quantised(corners.mean(axis=1), lower, scale))
        corners = corners[self.order]
        keys = quantised(corners.reshape(-1, d), lower, scale)
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        self.points = corners.reshape(-1, d)[first]
        self.cells = np.asarray(inverse).reshape(m, nv)
        self.centroids = ambient[self.order].mean(axis=1)

    def gather(self, values: np.ndarray) -> np.ndarray | None:
        """Per-cell values of this rank's owned cells -> all cells in centroid order on
        rank 0 (None elsewhere)."""
        parts = self.comm.gather(np.asarray(values), root=0)
        return np.concatenate(parts)[self.order] if self.comm.rank == 0 else None

    def arrays(self) -> dict:
        return {"dim": np.array(self.dim), "cell_type": np.array(self.cell_type), "chart": np.array(self.chart),
                "points": self.points, "cells": self.cells, "box": self.box}


class Snapshots(Tracker):
    """What every frame of this group's prompts leaves in ``fields.npz``, gathered to
    the group's rank 0 as the run goes (the mesh's cells once, at the start); then
    :meth:`write` (a combination point) brings all groups' prompts to world rank 0,
    which writes the file."""

    def __init__(self, filename: str, caption: str = ""):
        self.filename = filename
        self.caption = caption
        self.mesh_cells = None
        self.prompts: dict[int, dict] = {}   # index -> {"t": [...], name: [frames]} (group rank 0)
        self.constants: dict[str, np.ndarray] = {}   # arrays of the whole run (group rank 0)

    def start(self, solver):
        if self.mesh_cells is None:
            self.mesh_cells = MeshCells(solver.problem.mesh, solver.comm, solver.problem.geometry)

    def frame(self, solver, frame):
        if frame.prompt_index >= PICTURE_PROMPTS:   # not drawn (the same on every rank of the group)
            return
        mean = frame_diagnostics(solver, frame)["mean"]   # every rank of the group takes part
        arrays = self.frame_arrays(solver, frame)
        if solver.comm.rank != 0:
            return
        record = self.prompts.setdefault(frame.prompt_index, {})
        record.setdefault("t", []).append(frame.t)
        record.setdefault("mean", []).append(np.asarray(mean, float))
        for name, a in arrays.items():
            record.setdefault(name, []).append(a)

    def frame_arrays(self, solver, frame) -> dict:
        """{name: this frame's array (rank 0; None elsewhere)}."""
        return {}

    def finish_arrays(self, index: int, record: dict) -> dict:
        """The prompt's arrays in the file, from its frames' record (rank 0 of its group)."""
        return {f"{name}_{index}": np.array(values) for name, values in record.items()}

    def write(self, problem) -> None:
        """Gather every group's prompts to world rank 0 and write the file there (a
        combination point; a failed write ends every rank)."""
        arrays = self.arrays(problem)
        on_root(problem.groups.world, lambda: write_npz(self.filename, **arrays))

    def arrays(self, problem) -> dict | None:
        """The file's arrays, gathered from every group to world rank 0 (None elsewhere;
        a combination point)."""
        groups = problem.groups
        mine = {i: self.finish_arrays(i, r) for i, r in self.prompts.items()} \
            if groups.lead and self.mesh_cells is not None else None
        parts = groups.world.gather(mine, root=0)
        if groups.world.rank != 0:
            return None
        arrays = {"version": np.array(VERSION), "caption": np.array(self.caption),
                  "prompts": np.array([name for name, _ in problem.prompts])}
        if self.mesh_cells is not None:
            arrays.update(self.mesh_cells.arrays(), **self.constants)
        for part in parts:
            for record in (part or {}).values():
                arrays.update(record)
        arrays.update(target_arrays(problem, self.mesh_cells))
        return arrays


def target_arrays(problem, mesh_cells: MeshCells | None) -> dict:
    """The targets of the objective as arrays (see the module's docstring)."""
    opts = problem.opts.objective
    out = {"objective": np.array(opts.kind or "")}
    if opts.kind == "potential" and opts.center is not None:
        out["objective_center"] = np.asarray(opts.center, float)
    for i, target in enumerate(problem.targets or ()):
        if target is None or problem.objective is None:
            continue
        if target["kind"] == "moments":
            out[f"target_mean_{i}"], out[f"target_cov_{i}"] = target["mean"], target["cov"]
        elif target["kind"] == "points":
            out[f"target_points_{i}"], out[f"target_weights_{i}"] = target["points"], target["weights"]
        elif mesh_cells is not None:
            density = target["density"]
            out[f"target_density_{i}"] = density.density(mesh_cells.centroids) / density.total_mass()
    return out


class FieldSnapshots(Snapshots):
    """The density of every frame as cell means (in 1-D also its values at the DG nodes
    of each cell), and the colour ranges ParaView's session fixes over depth."""

    def start(self, solver):
        first = self.mesh_cells is None
        super().start(solver)
        tr = solver.transport
        self.mean_weights, self.cell_dofs = tr.mean_weights, tr.cell_dofs
        if first and self.mesh_cells.dim == 1:
            geometry = self.mesh_cells.geometry     # (a line or a circle: one chart coordinate)
            x = geometry.chart(tr.V.tabulate_dof_coordinates()[self.cell_dofs, :geometry.dim])[..., 0]
            self.node_order = np.argsort(x, axis=1)
            node_x = self.mesh_cells.gather(np.take_along_axis(x, self.node_order, axis=1))
            if node_x is not None:
                self.constants["node_x"] = node_x

    def frame_arrays(self, solver, frame):
        local = frame.coeffs[self.cell_dofs]
        out = {"density": self.mesh_cells.gather(np.einsum("ck,ck->c", self.mean_weights, local))}
        if self.mesh_cells.dim == 1:
            out["nodes"] = self.mesh_cells.gather(np.take_along_axis(local, self.node_order, axis=1))
        fields = {"density": frame.coeffs}
        if frame.velocity is not None:
            fields["velocity"] = np.linalg.norm(np.reshape(frame.velocity, (len(frame.velocity), -1)), axis=1)
        for name, (low, high) in zip(fields, value_ranges(solver.comm, fields.values())):
            out[f"{name}_range"] = np.array([low, high])
        return out

    def finish_arrays(self, index, record):
        out = super().finish_arrays(index, record)
        for name in ("density_range", "velocity_range"):
            key = f"{name}_{index}"
            if key in out:   # the range over all frames
                out[key] = np.array([out[key][:, 0].min(), out[key][:, 1].max()])
        return out


class TokenSnapshots(Snapshots):
    """The tokens of every frame of a particle run (rank 0 of the group gathers them in
    token order: each rank holds a block of consecutive tokens)."""

    def frame_arrays(self, solver, frame):
        comm = solver.comm
        x = comm.gather(frame.coeffs, root=0)
        w = comm.gather(frame.extra["weights"], root=0) if frame.t == 0 else None
        if comm.rank != 0:
            return {}
        out = {"tokens": np.concatenate(x)}
        if w is not None:
            out["weights"] = np.concatenate(w)
        return out

    def finish_arrays(self, index, record):
        out = super().finish_arrays(index, record)
        out[f"weights_{index}"] = out[f"weights_{index}"][0]
        return out


def value_ranges(comm, arrays) -> list[tuple[float, float]]:
    """(min, max) over all ranks of each array (one Allreduce; (inf, -inf) where every
    rank's part is empty)."""
    local = np.array([v for a in arrays for v in ((-a.min(), a.max()) if a.size else (-np.inf, -np.inf))])
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return [(-local[2 * k], local[2 * k + 1]) for k in range(len(local) // 2)]
