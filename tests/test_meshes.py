"""The shipped meshes (meshes/disk.xdmf, meshes/ball.xdmf) load in dolfinx 0.5 and 0.9.

Volume tolerance. Every boundary vertex lies on the circle/sphere of radius R (gmsh puts
them on the geometry; checked below), so the mesh is an inscribed polygon/polyhedron and
its volume is *smaller* than the exact one, by O(h^2/R^2) relative. To leading order in
h/R the loss can be predicted from the boundary facets of the mesh itself:

* disk: a boundary edge of length e cuts off a circular segment whose depth at distance s
  from the chord's midpoint is (e^2/4 - s^2)/(2R); its area is e^3/(12R). Lost area
  = sum_e e^3/(12R), i.e. relative loss ~ e^2/(6R^2) for equal edges (shipped disk:
  122 boundary edges of 0.154, predicted 4.419e-4, measured 4.420e-4).
* ball: over a boundary triangle with edges a, b, c and area A the gap to the sphere is
  (r^2 - s^2)/(2R) (r circumradius, s distance from the circumcentre), whose mean over the
  triangle is (a^2 + b^2 + c^2)/(24R) for any triangle. Lost volume
  = sum_f A_f (a^2 + b^2 + c^2)/(24R), relative ~ 3 e^2/(8R^2) (shipped ball: predicted
  9.87e-3, measured 9.91e-3).

The neglected terms are relatively O(e^2/R^2) of the prediction (<= 6% with the longest
boundary edge of the ball, 0.75, R = 3; observed 0.02% for the disk and 0.5% for the ball),
so the test requires 0.9 <= loss/prediction <= 1.1, plus the loss below 2e-2 overall. A
mesh that lost or duplicated cells on reading, or a boundary off the circle/sphere, fails.
The dolfinx volume must also equal the sum of the cell volumes in the file (to 1e-10).
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest

MESH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "meshes")
RADIUS = 3.0

# name -> (tdim, cell type, XDMF topology, XDMF geometry type, cells, vertices)
MESHES = {
    "disk": (2, "triangle", "Triangle", "XY", 2784, 1454),
    "ball": (3, "tetrahedron", "Tetrahedron", "XYZ", 4516, 1036),
}


def _exact_volume(tdim: int) -> float:
    return math.pi * RADIUS**2 if tdim == 2 else 4.0 / 3.0 * math.pi * RADIUS**3


def _parse_xdmf(name: str):
    """Return (grid, topology, geometry, {dataset role: (h5 path, dataset)})."""
    tree = ET.parse(os.path.join(MESH_DIR, name + ".xdmf"))
    grids = tree.getroot().findall("./Domain/Grid")
    assert [g.get("Name") for g in grids] == ["mesh"]
    grid = grids[0]
    topo = grid.find("Topology")
    geom = grid.find("Geometry")
    items = {}
    for role, el in (("topology", topo), ("geometry", geom)):
        data = el.find("DataItem")
        assert data.get("Format") == "HDF"
        h5name, dset = data.text.strip().split(":", 1)
        dims = tuple(int(d) for d in data.get("Dimensions").split())
        items[role] = (os.path.join(MESH_DIR, h5name), dset, dims)
    return grid, topo, geom, items


@pytest.mark.parametrize("name", sorted(MESHES))
def test_xdmf_points_to_existing_h5(name):
    tdim, _, topo_type, geom_type, ncells, nverts = MESHES[name]
    grid, topo, geom, items = _parse_xdmf(name)
    assert grid.get("GridType") == "Uniform"
    assert topo.get("TopologyType") == topo_type
    assert int(topo.get("NumberOfElements")) == ncells
    assert int(topo.get("NodesPerElement")) == tdim + 1
    assert geom.get("GeometryType") == geom_type
    expected_shape = {"topology": (ncells, tdim + 1), "geometry": (nverts, tdim)}
    for role, (h5path, dset, dims) in items.items():
        assert os.path.basename(h5path) == name + ".h5"
        assert os.path.isfile(h5path), h5path
        assert dset == f"/Mesh/mesh/{role}"
        assert dims == expected_shape[role]


@pytest.mark.parametrize("name", sorted(MESHES))
def test_h5_datasets(name):
    h5py = pytest.importorskip("h5py")
    nverts = MESHES[name][5]
    items = _parse_xdmf(name)[3]
    for role, (h5path, dset, dims) in items.items():
        with h5py.File(h5path, "r") as f:
            assert dset in f
            data = f[dset][...]
        assert data.shape == dims
        if role == "topology":
            assert data.dtype.kind == "i"
            # every vertex used, no out-of-range index, no repeated vertex in a cell
            assert data.min() == 0 and data.max() == nverts - 1
            assert np.unique(data).size == nverts
            assert np.all(np.diff(np.sort(data, axis=1), axis=1) > 0)
        else:
            assert data.dtype == np.float64
            r = np.linalg.norm(data, axis=1)
            assert r.max() <= RADIUS * (1 + 1e-12)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_xdmf_files_small(name):
    for ext in (".xdmf", ".h5"):
        assert os.path.getsize(os.path.join(MESH_DIR, name + ext)) < 1_000_000


def _read_h5(name: str):
    h5py = pytest.importorskip("h5py")
    with h5py.File(os.path.join(MESH_DIR, name + ".h5"), "r") as f:
        return f["/Mesh/mesh/geometry"][...], f["/Mesh/mesh/topology"][...]


def _volume_from_file(name: str) -> float:
    x, cells = _read_h5(name)
    tdim = cells.shape[1] - 1
    edges = x[cells[:, 1:]] - x[cells[:, :1]]
    return float(np.abs(np.linalg.det(edges)).sum() / math.factorial(tdim))


def _predicted_relative_loss(name: str) -> float:
    """Leading-order volume lost by the inscribed mesh, from its boundary facets."""
    x, cells = _read_h5(name)
    nv = cells.shape[1]
    tdim = nv - 1
    facets = np.sort(np.concatenate([np.delete(cells, i, axis=1) for i in range(nv)]), axis=1)
    uniq, count = np.unique(facets, axis=0, return_counts=True)
    bnd = uniq[count == 1]
    r = np.linalg.norm(x[np.unique(bnd)], axis=1)
    assert np.allclose(r, RADIUS, rtol=0, atol=1e-12), "boundary vertices not on the sphere"
    p = x[bnd]
    if tdim == 2:
        e = np.linalg.norm(p[:, 1] - p[:, 0], axis=1)
        loss = np.sum(e**3) / (12 * RADIUS)
    else:
        e2 = sum(np.sum((p[:, i] - p[:, j]) ** 2, axis=1) for i, j in ((0, 1), (1, 2), (0, 2)))
        area = 0.5 * np.linalg.norm(np.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0]), axis=1)
        loss = np.sum(area * e2) / (24 * RADIUS)
    return float(loss / _exact_volume(tdim))


def test_disk_estimate_matches_regular_polygon():
    # Sanity check of the disk formula against the exact area of a regular N-gon.
    n = 122
    e = 2 * RADIUS * math.sin(math.pi / n)
    exact_rel = 1 - math.sin(2 * math.pi / n) / (2 * math.pi / n)
    predicted = n * e**3 / (12 * RADIUS) / (math.pi * RADIUS**2)
    assert abs(predicted / exact_rel - 1) < 1e-3


@pytest.mark.parametrize("name", sorted(MESHES))
def test_read_mesh_dolfinx(name):
    dolfinx = pytest.importorskip("dolfinx")
    pytest.importorskip("dolfinx.io")
    pytest.importorskip("dolfinx.fem")
    ufl = pytest.importorskip("ufl")
    MPI = pytest.importorskip("mpi4py.MPI")

    tdim, cell_name, _, _, ncells, nverts = MESHES[name]
    comm = MPI.COMM_WORLD
    with dolfinx.io.XDMFFile(comm, os.path.join(MESH_DIR, name + ".xdmf"), "r") as f:
        mesh = f.read_mesh(name="mesh")
    assert mesh.topology.dim == tdim
    assert mesh.geometry.dim == tdim
    assert mesh.topology.cell_type.name == cell_name
    assert mesh.topology.index_map(tdim).size_global == ncells
    mesh.topology.create_connectivity(0, tdim)
    assert mesh.topology.index_map(0).size_global == nverts

    one = dolfinx.fem.Constant(mesh, np.float64(1.0))
    local = dolfinx.fem.assemble_scalar(dolfinx.fem.form(one * ufl.dx(domain=mesh)))
    volume = comm.allreduce(local, op=MPI.SUM)
    exact = _exact_volume(tdim)
    rel_loss = (exact - volume) / exact
    predicted = _predicted_relative_loss(name)
    assert 0.9 * predicted <= rel_loss <= 1.1 * predicted, (volume, exact, rel_loss, predicted)
    assert 0.0 < rel_loss < 2e-2
    assert abs(volume - _volume_from_file(name)) <= 1e-10 * exact


# ------------------------------------------------------------------ damaged mesh files
# (checked before dolfinx reads them: libhdf5 would print its error stack, "HDF5-DIAG:
# Error detected in HDF5 ...", about 10 lines per rank, before the one line)

def _mesh_copy(tmp_path, name="disk", h5=None):
    """meshes/<name>.xdmf copied to tmp_path (its .h5 too, or the bytes ``h5``)."""
    import shutil
    shutil.copy(os.path.join(MESH_DIR, name + ".xdmf"), tmp_path / (name + ".xdmf"))
    target = tmp_path / (name + ".h5")
    if h5 is None:
        shutil.copy(os.path.join(MESH_DIR, name + ".h5"), target)
    else:
        target.write_bytes(h5)
    return str(tmp_path / (name + ".xdmf"))


def test_damaged_h5_is_one_line_naming_the_file(tmp_path):
    pytest.importorskip("dolfinx")
    from pdeformer.tools.errors import InputError
    from pdeformer.fem.mesh import check_xdmf
    good = open(os.path.join(MESH_DIR, "disk.h5"), "rb").read()
    ball = open(os.path.join(MESH_DIR, "ball.h5"), "rb").read()
    cases = [(bytes(range(256)) * 12, "disk.h5: not an HDF5 file"),
             (good[:len(good) // 2], "disk.h5: cannot read it as HDF5"),
             (ball, "disk.h5: dataset /Mesh/mesh/topology has shape (4516, 4), the XDMF file says (2784, 3)")]
    if pytest.importorskip("h5py") is None:
        cases = cases[:1]
    for i, (data, words) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        with pytest.raises(InputError) as e:
            check_xdmf(_mesh_copy(folder, h5=data), "mesh")
        assert str(e.value).startswith("mesh.file: ") and words in str(e.value), str(e.value)
    # dolfinx reads <name>.h5 whatever file the XDMF names: a renamed .xdmf is refused
    os.rename(tmp_path / "0" / "disk.xdmf", tmp_path / "0" / "other.xdmf")
    with pytest.raises(InputError, match="its data file is disk.h5, but dolfinx reads other.h5"):
        check_xdmf(str(tmp_path / "0" / "other.xdmf"), "mesh")


def test_hdf5_error_stack_is_silenced_while_dolfinx_reads(tmp_path, capfd, monkeypatch):
    """Where the file still fails in dolfinx (the probe skipped here), libhdf5's own
    error printing is off during the read and on again after it."""
    pytest.importorskip("dolfinx")
    from mpi4py import MPI
    import pdeformer.fem.mesh as mesh
    from pdeformer.tools.errors import InputError
    path = _mesh_copy(tmp_path, h5=bytes(range(256)) * 12)
    monkeypatch.setattr(mesh, "check_hdf5", lambda *args: None)
    with pytest.raises(InputError, match="dolfinx cannot read it"):
        mesh.read_mesh(MPI.COMM_SELF, path)
    assert "HDF5-DIAG" not in capfd.readouterr().err
    import dolfinx.io
    with pytest.raises(RuntimeError):     # outside, the stack prints as before (restored)
        with dolfinx.io.XDMFFile(MPI.COMM_SELF, path, "r") as f:
            f.read_mesh(name="mesh")
    assert "HDF5-DIAG" in capfd.readouterr().err


def test_damaged_h5_from_the_command_line(tmp_path):
    """`pdeformer forward` on a garbage .h5: the one line, exit status 2, nothing else."""
    pytest.importorskip("dolfinx")
    from conftest import run_cli, write_config
    _mesh_copy(tmp_path, h5=bytes(range(256)) * 12)
    cfg = write_config(tmp_path, """
    [mesh]
    file = "disk.xdmf"
    [model]
    layers = 1
    heads = 1
    [[prompts]]
    kind = "gaussian_mixture"
    means = [[0.0, 0.0]]
    covs = [0.3]
    """)
    proc = run_cli(["forward", cfg], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"pdeformer: error: mesh.file: {tmp_path}/disk.h5: "
                                                "not an HDF5 file"], proc.stderr


# ------------------------------------------------------------------ partitions and sizes

@pytest.mark.mpi
def test_a_rank_without_cells(tmp_path):
    """A 1-cell mesh on 2 ranks (one rank owns no cell, an empty dof list): forward (with
    fields) and gradient run and agree with one rank: diagnostics to round-off, the
    gradient bit for bit (every sum over the empty rank adds nothing)."""
    pytest.importorskip("dolfinx")
    from conftest import ROOT, run_cli
    from pdeformer.tools.output import read_diagnostics
    config = os.path.join(ROOT, "runs", "interval.toml")
    # one cell of width 10 resolves only Gaussians wider than 10/8 (narrower: bad input)
    small = ["mesh.cells=[1]", "model.layers=2", "model.heads=4", "prompts[0].covs=[2.0,3.0]"]
    for n in (1, 2):
        run_cli(["forward", config, "--set", *small, f"output.dir={tmp_path}/f{n}"], nprocs=n)
        run_cli(["gradient", config, "--set", *small, f"output.dir={tmp_path}/g{n}", "output.fields=false",
                 "discretisation.limiter=false", "objective.kind=potential",
                 "model.init_scale=0.3"], nprocs=n)   # mild heads: one DG-3 cell, no limiter
    a, b = (read_diagnostics(str(tmp_path / f"f{n}" / "diagnostics.csv")) for n in (1, 2))
    assert len(a) == len(b) >= 6      # 2 prompts, t = 0 and (at least) the layer boundaries
    for ra, rb in zip(a, b):
        assert ra["prompt"] == rb["prompt"] and ra["t"] == rb["t"]
        for k in ("mass", "outflow", "mean_0", "cov_00"):
            assert abs(ra[k] - rb[k]) <= 1e-12, (k, ra, rb)
    assert os.path.isfile(tmp_path / "f2" / "density_mixture.pvd")
    ga, gb = (np.load(tmp_path / f"g{n}" / "gradient.npz") for n in (1, 2))
    for k in ("dQ", "dK", "dV", "risk"):
        np.testing.assert_array_equal(ga[k], gb[k])
    assert np.abs(ga["dV"]).max() > 0


def test_shortest_edge():
    pytest.importorskip("dolfinx")
    from mpi4py import MPI
    from pdeformer.fem.mesh import make_mesh, shortest_edge
    from pdeformer.model.schema import MeshOptions
    comm = MPI.COMM_WORLD
    for cells, cell, lower, upper, h in (([7], "interval", [0.0], [1.0], 1 / 7),
                                         ([14, 10], "triangle", [-3.5, -3.5], [3.5, 3.5], 0.5),
                                         ([4, 4, 3], "hexahedron", [0, 0, 0], [1, 2, 0.6], 0.2)):
        mesh = make_mesh(comm, MeshOptions(lower=lower, upper=upper, cells=cells, cell=cell))
        assert shortest_edge(comm, mesh) == pytest.approx(h, rel=1e-12)
    disk = make_mesh(comm, MeshOptions(file=os.path.join(MESH_DIR, "disk.xdmf"), name="mesh"))
    x, cells = _read_h5("disk")
    edges = [np.linalg.norm(x[cells[:, i]] - x[cells[:, j]], axis=1).min() for i, j in ((0, 1), (1, 2), (0, 2))]
    assert shortest_edge(comm, disk) == pytest.approx(min(edges), rel=1e-12)


PARTITIONS_SCRIPT = r'''
import hashlib, json, sys
import numpy as np
from mpi4py import MPI
from pdeformer.fem.mesh import box_mesh, read_mesh

def cells_of_this_rank(mesh):
    """A digest of this rank's owned cells (their centroids, in sorted order)."""
    d = mesh.topology.dim
    owned = mesh.topology.index_map(d).size_local
    from pdeformer.fem._dolfinx import geometry_nodes
    centroids = mesh.geometry.x[geometry_nodes(mesh)[:owned]][..., :d].mean(axis=1)
    keys = np.round(centroids * 1e6).astype(np.int64)
    return hashlib.sha256(keys[np.lexsort(keys.T[::-1])].tobytes()).hexdigest()

digests = {"box": [cells_of_this_rank(box_mesh(MPI.COMM_WORLD, [-4.0, -4.0], [4.0, 4.0], [48, 48], "triangle"))
                   for _ in range(4)],
           "disk": [cells_of_this_rank(read_mesh(MPI.COMM_WORLD, sys.argv[2])) for _ in range(3)]}
every = MPI.COMM_WORLD.gather(digests, root=0)
if MPI.COMM_WORLD.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(every, f)
'''


@pytest.mark.mpi
def test_the_partition_is_the_same_every_time(tmp_path):
    """A mesh built (or read) again on the same ranks is partitioned the same way:
    SCOTCH with several threads is not (5 different partitions in 6 builds of a 64²
    mesh on 2 ranks), and P-rank results would differ by round-off from run to run."""
    import json
    import subprocess
    import sys
    pytest.importorskip("dolfinx")
    from pdeformer.tools.parallel import mpirun_command
    script, out = tmp_path / "partitions.py", tmp_path / "out.json"
    script.write_text(PARTITIONS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "SCOTCH_PTHREAD_NUMBER"}
    subprocess.run(mpirun_command(2) + [sys.executable, str(script), str(out),
                                        os.path.join(MESH_DIR, "disk.xdmf")],
                   check=True, timeout=300, env=env, cwd=tmp_path)
    for rank, digests in enumerate(json.loads(out.read_text())):
        for mesh, found in digests.items():
            assert len(set(found)) == 1, (rank, mesh, found)


BALANCE_SCRIPT = r'''
import json, sys
from mpi4py import MPI
from pdeformer.fem.mesh import box_mesh, sphere_mesh

comm = MPI.COMM_WORLD
meshes = {"128^2 triangles": box_mesh(comm, [-4.0, -4.0], [4.0, 4.0], [128, 128], "triangle"),
          "12^3 tetrahedra": box_mesh(comm, [-1.0] * 3, [1.0] * 3, [12, 12, 12], "tetrahedron"),
          "sphere": sphere_mesh(comm, 4, 1.0)}
counts = {name: comm.gather([m.topology.index_map(m.topology.dim).size_local,
                             m.topology.index_map(m.topology.dim).num_ghosts]) for name, m in meshes.items()}
if comm.rank == 0:
    json.dump(counts, open(sys.argv[1], "w"))
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_partition_gives_every_rank_the_same_share(tmp_path, nprocs):
    """pdeformer's meshes (the boxes, the sphere) are partitioned by SCOTCH with an
    imbalance of 0.1% (fem._dolfinx.balanced_partitioner): every rank owns its share of
    the cells to 0.2%, where SCOTCH's default (2.5%) gave the two ranks of the 128^2 box
    16,526 and 16,242; and every rank has ghost cells (the DG fluxes across ranks need
    them)."""
    import json
    from conftest import run_script
    pytest.importorskip("dolfinx")
    script, out = tmp_path / "balance.py", tmp_path / "out.json"
    script.write_text(BALANCE_SCRIPT)
    proc = run_script(script, [out], nprocs, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, ranks in json.loads(out.read_text()).items():
        owned = [o for o, _ in ranks]
        assert len(owned) == nprocs and max(owned) <= 1.002 * sum(owned) / nprocs, (name, ranks)
        assert min(g for _, g in ranks) > 0, (name, ranks)
