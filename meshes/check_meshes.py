#!/usr/bin/env python3
"""Check that the shipped meshes load in dolfinx (0.5 or 0.9), serially or with MPI.

For each mesh it reads ``<name>.xdmf`` with ``XDMFFile.read_mesh(name="mesh")`` and checks
the global number of cells and vertices (against the HDF5 datasets), gdim == tdim, the
cell type, and the total volume (assembled ``1*dx``, summed over ranks) against the exact
disk/ball volume.

Usage (from the project root):

    python3 meshes/check_meshes.py
    mpirun -n 2 python3 meshes/check_meshes.py
    python3 meshes/check_meshes.py --radius 3 --rtol 2e-2 path/to/disk_fine.xdmf

Exit status 0 when every check passes. Needs dolfinx, mpi4py, ufl, h5py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def check(path: str, radius: float, rtol: float) -> list[str]:
    import h5py
    import numpy as np
    import ufl
    from mpi4py import MPI

    import dolfinx
    import dolfinx.fem
    import dolfinx.io

    comm = MPI.COMM_WORLD
    errors = []
    with dolfinx.io.XDMFFile(comm, path, "r") as f:
        mesh = f.read_mesh(name="mesh")
    tdim = mesh.topology.dim
    gdim = mesh.geometry.dim
    mesh.topology.create_connectivity(0, tdim)
    ncells = mesh.topology.index_map(tdim).size_global
    nverts = mesh.topology.index_map(0).size_global
    one = dolfinx.fem.Constant(mesh, np.float64(1.0))
    local = dolfinx.fem.assemble_scalar(dolfinx.fem.form(one * ufl.dx(domain=mesh)))
    vol = comm.allreduce(local, op=MPI.SUM)
    exact = math.pi * radius**2 if tdim == 2 else 4.0 / 3.0 * math.pi * radius**3
    rel = abs(vol - exact) / exact
    with h5py.File(os.path.splitext(path)[0] + ".h5", "r") as h5:
        ncells_file = h5["/Mesh/mesh/topology"].shape[0]
        nverts_file = h5["/Mesh/mesh/geometry"].shape[0]
    cell = mesh.topology.cell_type.name
    if comm.rank == 0:
        print(f"dolfinx {dolfinx.__version__}, {comm.size} rank(s): {path}: {cell}, "
              f"tdim {tdim}, gdim {gdim}, {ncells} cells, {nverts} vertices, "
              f"volume {vol:.6f} (exact {exact:.6f}, rel. error {rel:.2e})")
    if gdim != tdim:
        errors.append(f"{path}: gdim {gdim} != tdim {tdim}")
    if cell not in ("triangle", "tetrahedron") or tdim not in (2, 3):
        errors.append(f"{path}: unexpected cell type {cell}")
    if ncells != ncells_file:
        errors.append(f"{path}: {ncells} cells read, {ncells_file} in the file")
    if nverts != nverts_file:
        errors.append(f"{path}: {nverts} vertices read, {nverts_file} in the file")
    if not rel < rtol:
        errors.append(f"{path}: volume {vol} vs exact {exact}: rel. error {rel:.2e} >= {rtol}")
    return errors


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", help="XDMF files (default: the shipped disk and ball)")
    p.add_argument("--radius", type=float, default=3.0)
    p.add_argument("--rtol", type=float, default=2e-2,
                   help="allowed relative volume error (default %(default)s)")
    args = p.parse_args(argv)
    paths = args.paths or [os.path.join(here, "disk.xdmf"), os.path.join(here, "ball.xdmf")]
    errors = []
    for path in paths:
        errors += check(path, args.radius, args.rtol)
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        for e in errors:
            print("FAIL:", e)
        print("FAILED" if errors else "OK")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
