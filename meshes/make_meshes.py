#!/usr/bin/env python3
"""Make the shipped unstructured meshes: a 2-D disk and a 3-D ball.

Both are centred at the origin with radius 3.0 (by default) and meshed with gmsh:

* ``disk``: linear triangles (``disk.xdmf`` + ``disk.h5``), geometric dimension 2;
* ``ball``: linear tetrahedra (``ball.xdmf`` + ``ball.h5``), geometric dimension 3.

Each mesh is written as XDMF + HDF5 in the layout that dolfinx's ``XDMFFile.write_mesh``
produces (one uniform Grid named "mesh", datasets ``/Mesh/mesh/topology`` (int64) and
``/Mesh/mesh/geometry`` (float64), GeometryType "XY" for the disk and "XYZ" for the ball),
so that

    from mpi4py import MPI
    import dolfinx.io
    with dolfinx.io.XDMFFile(MPI.COMM_WORLD, "meshes/disk.xdmf", "r") as f:
        mesh = f.read_mesh(name="mesh")

works with dolfinx 0.5 and 0.9, serially and in parallel. Only the top-dimensional
cells are kept (no boundary/edge/point elements) and nodes that no cell uses (such as
gmsh's centre point of the disk) are dropped; the nodes are numbered 0..n-1 in
increasing gmsh node tag.

The meshing is deterministic: a single thread (General.NumThreads = 1), fixed 2-D and 3-D
algorithms (Frontal-Delaunay / Delaunay), the default random factor, and HDF5 datasets
written without timestamps, so rerunning the script with the same gmsh version gives
byte-identical files. Other gmsh versions may produce a slightly different mesh: Debian
13's gmsh 4.13.1 gives a byte-identical ball but a disk with 2780 instead of 2784 cells.

Requirements (no dolfinx needed): the gmsh Python API (with the OpenCASCADE kernel),
numpy and h5py. On Debian 12/13: ``apt-get install python3-gmsh python3-h5py``
(the shipped files were made with Debian 12's python3-gmsh 4.8.4); or a venv:
``python3 -m venv /tmp/gmshenv && /tmp/gmshenv/bin/pip install gmsh h5py numpy``
(not tried here; the PyPI wheel may need libglu1-mesa libxcursor1 libxft2 libxinerama1).

Usage (from the project root):

    python3 meshes/make_meshes.py                       # both meshes, defaults, into meshes/
    python3 meshes/make_meshes.py disk --h-disk 0.08 --outdir /tmp/fine   # a finer disk
    python3 meshes/make_meshes.py --help

Options: which meshes (``disk``, ``ball``; default both), ``--radius``, ``--h-disk`` and
``--h-ball`` (gmsh characteristic length, i.e. target edge length), ``--outdir``
(default: the folder of this script) and ``--name-suffix`` (e.g. ``_fine`` gives
``disk_fine.xdmf``).
"""

from __future__ import annotations

import argparse
import os
import sys
from xml.sax.saxutils import escape, quoteattr

import numpy as np

# Defaults for the shipped meshes (radius 3): about 2800 triangles / 4500 tetrahedra.
DEFAULT_RADIUS = 3.0
DEFAULT_H_DISK = 0.155
DEFAULT_H_BALL = 0.5

# gmsh element type ids of the linear simplices.
_GMSH_TRIANGLE = 2
_GMSH_TETRAHEDRON = 4

_XDMF_TOPOLOGY = {2: ("Triangle", 3), 3: ("Tetrahedron", 4)}
_XDMF_GEOMETRY = {2: "XY", 3: "XYZ"}


def _gmsh_mesh(kind: str, radius: float, h: float, verbose: bool = False):
    """Mesh a disk (kind 'disk') or ball (kind 'ball') with gmsh.

    Returns (points, cells): points (n, gdim) float64, cells (m, tdim+1) int64 indices
    into points, only the top-dimensional cells and only the nodes they use.
    """
    import gmsh

    tdim = {"disk": 2, "ball": 3}[kind]
    # No config/option files from the user's home: the result depends only on this script.
    gmsh.initialize([], readConfigFiles=False)
    try:
        gmsh.option.setNumber("General.Terminal", 1 if verbose else 0)
        gmsh.option.setNumber("General.Verbosity", 5 if verbose else 1)
        gmsh.option.setNumber("General.NumThreads", 1)
        gmsh.option.setNumber("Mesh.MaxNumThreads1D", 1)
        gmsh.option.setNumber("Mesh.MaxNumThreads2D", 1)
        gmsh.option.setNumber("Mesh.MaxNumThreads3D", 1)
        gmsh.option.setNumber("Mesh.Algorithm", 6)  # Frontal-Delaunay (2-D)
        gmsh.option.setNumber("Mesh.Algorithm3D", 1)  # Delaunay (3-D)
        gmsh.option.setNumber("Mesh.ElementOrder", 1)
        gmsh.option.setNumber("Mesh.Optimize", 1)
        gmsh.option.setNumber("Mesh.OptimizeNetgen", 0)
        gmsh.option.setNumber("Mesh.RecombineAll", 0)
        gmsh.option.setNumber("Mesh.CharacteristicLengthFromPoints", 0)
        gmsh.option.setNumber("Mesh.CharacteristicLengthFromCurvature", 0)
        gmsh.option.setNumber("Mesh.CharacteristicLengthExtendFromBoundary", 1)
        gmsh.option.setNumber("Mesh.CharacteristicLengthMin", h)
        gmsh.option.setNumber("Mesh.CharacteristicLengthMax", h)
        gmsh.model.add(kind)
        if kind == "disk":
            gmsh.model.occ.addDisk(0.0, 0.0, 0.0, radius, radius)
        else:
            gmsh.model.occ.addSphere(0.0, 0.0, 0.0, radius)
        gmsh.model.occ.synchronize()
        gmsh.model.mesh.generate(tdim)

        node_tags, coords, _ = gmsh.model.mesh.getNodes()
        node_tags = np.asarray(node_tags, dtype=np.int64)
        coords = np.asarray(coords, dtype=np.float64).reshape(-1, 3)
        etype = _GMSH_TRIANGLE if tdim == 2 else _GMSH_TETRAHEDRON
        elem_tags, elem_nodes = gmsh.model.mesh.getElementsByType(etype)
        cells_tags = np.asarray(elem_nodes, dtype=np.int64).reshape(-1, tdim + 1)
        if len(elem_tags) == 0:
            raise RuntimeError(f"gmsh produced no {kind} cells")
    finally:
        gmsh.finalize()

    # Keep only the nodes the cells use, numbered by increasing gmsh tag.
    order = np.argsort(node_tags)
    node_tags, coords = node_tags[order], coords[order]
    used_tags = np.unique(cells_tags)
    pos = np.searchsorted(node_tags, used_tags)
    if np.any(pos >= len(node_tags)) or np.any(node_tags[pos] != used_tags):
        raise RuntimeError("gmsh cells refer to unknown nodes")
    points = coords[pos, :tdim].copy()
    cells = np.searchsorted(used_tags, cells_tags).astype(np.int64)
    if tdim == 2 and np.abs(coords[pos, 2]).max() > 1e-12:
        raise RuntimeError("disk mesh is not planar")
    return points, cells


def cell_sizes(points: np.ndarray, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-cell diameter (longest edge, as dolfinx's h) and (unsigned) volume."""
    nv = cells.shape[1]
    x = points[cells]  # (m, nv, gdim)
    diam = np.zeros(len(cells))
    for i in range(nv):
        for j in range(i + 1, nv):
            diam = np.maximum(diam, np.linalg.norm(x[:, i] - x[:, j], axis=1))
    edges = x[:, 1:] - x[:, :1]  # (m, tdim, gdim), square since gdim == tdim
    fact = 2.0 if nv == 3 else 6.0
    vol = np.abs(np.linalg.det(edges)) / fact
    return diam, vol


def write_xdmf(path_xdmf: str, points: np.ndarray, cells: np.ndarray) -> str:
    """Write an XDMF + HDF5 pair as dolfinx's XDMFFile.write_mesh does (grid "mesh")."""
    import h5py

    tdim = cells.shape[1] - 1
    gdim = points.shape[1]
    assert gdim == tdim and tdim in (2, 3)
    stem, _ = os.path.splitext(path_xdmf)
    path_h5 = stem + ".h5"
    h5_name = os.path.basename(path_h5)
    if os.path.exists(path_h5):
        os.remove(path_h5)
    with h5py.File(path_h5, "w", track_order=False) as f:
        g = f.create_group("Mesh").create_group("mesh")
        g.create_dataset("topology", data=np.ascontiguousarray(cells, dtype=np.int64),
                         track_times=False)
        g.create_dataset("geometry", data=np.ascontiguousarray(points, dtype=np.float64),
                         track_times=False)
    topo_type, npe = _XDMF_TOPOLOGY[tdim]
    m, n = len(cells), len(points)
    xml = f"""<?xml version="1.0"?>
<!DOCTYPE Xdmf SYSTEM "Xdmf.dtd" []>
<Xdmf Version="3.0" xmlns:xi="http://www.w3.org/2001/XInclude">
  <Domain>
    <Grid Name="mesh" GridType="Uniform">
      <Topology TopologyType="{topo_type}" NumberOfElements="{m}" NodesPerElement="{npe}">
        <DataItem Dimensions="{m} {npe}" NumberType="Int" Format="HDF">{escape(h5_name)}:/Mesh/mesh/topology</DataItem>
      </Topology>
      <Geometry GeometryType={quoteattr(_XDMF_GEOMETRY[gdim])}>
        <DataItem Dimensions="{n} {gdim}" Format="HDF">{escape(h5_name)}:/Mesh/mesh/geometry</DataItem>
      </Geometry>
    </Grid>
  </Domain>
</Xdmf>
"""
    with open(path_xdmf, "w", encoding="ascii", newline="\n") as f:
        f.write(xml)
    return path_h5


def make(kind: str, radius: float, h: float, outdir: str, suffix: str = "",
         verbose: bool = False) -> dict:
    points, cells = _gmsh_mesh(kind, radius, h, verbose=verbose)
    path = os.path.join(outdir, f"{kind}{suffix}.xdmf")
    path_h5 = write_xdmf(path, points, cells)
    diam, vol = cell_sizes(points, cells)
    exact = np.pi * radius**2 if kind == "disk" else 4.0 / 3.0 * np.pi * radius**3
    info = dict(kind=kind, xdmf=path, h5=path_h5, radius=radius, h=h,
                cells=len(cells), vertices=len(points), hmin=float(diam.min()),
                hmax=float(diam.max()), volume=float(vol.sum()), exact=exact,
                relerr=float(abs(vol.sum() - exact) / exact),
                max_radius=float(np.linalg.norm(points, axis=1).max()))
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs the gmsh Python API, numpy and h5py (not dolfinx).")
    # (no choices= here: argparse rejects an empty default list for nargs="*" with choices)
    p.add_argument("meshes", nargs="*", metavar="MESH",
                   help="which meshes to make: disk, ball (default: both)")
    p.add_argument("--radius", type=float, default=DEFAULT_RADIUS,
                   help="radius of the disk/ball (default %(default)s)")
    p.add_argument("--h-disk", type=float, default=DEFAULT_H_DISK,
                   help="characteristic length (target edge length) of the disk mesh "
                        "(default %(default)s: about 2800 triangles at radius 3)")
    p.add_argument("--h-ball", type=float, default=DEFAULT_H_BALL,
                   help="characteristic length (target edge length) of the ball mesh "
                        "(default %(default)s: about 4500 tetrahedra at radius 3)")
    p.add_argument("--outdir", default=os.path.dirname(os.path.abspath(__file__)),
                   help="output folder (default: the folder of this script)")
    p.add_argument("--name-suffix", default="",
                   help="appended to the file names, e.g. _fine -> disk_fine.xdmf")
    p.add_argument("-v", "--verbose", action="store_true", help="show gmsh's output")
    args = p.parse_args(argv)
    kinds = args.meshes or ["disk", "ball"]
    bad = [k for k in kinds if k not in ("disk", "ball")]
    if bad:
        p.error(f"unknown mesh {bad[0]!r} (choose from disk, ball)")
    os.makedirs(args.outdir, exist_ok=True)
    for kind in dict.fromkeys(kinds):
        h = args.h_disk if kind == "disk" else args.h_ball
        info = make(kind, args.radius, h, args.outdir, args.name_suffix, args.verbose)
        print(f"{info['xdmf']}: {info['cells']} cells, {info['vertices']} vertices, "
              f"cell diameter {info['hmin']:.4f}..{info['hmax']:.4f}, "
              f"volume {info['volume']:.6f} (exact {info['exact']:.6f}, "
              f"rel. error {info['relerr']:.2e}), max |x| {info['max_radius']:.12f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
