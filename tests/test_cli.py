"""The `pdeformer forward` command end to end: outputs read back, serial vs mpirun -n 2,
1-D / 2-D / 3-D and mesh files, and the one-line errors of bad input."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from conftest import ROOT, assert_same_diagnostics, check_one_line_error, requires_dolfinx, run_cli, write_config

pytestmark = [requires_dolfinx]

CONFIG_2D = """
[mesh]
lower = [-3.5, -3.5]
upper = [3.5, 3.5]
cells = [14, 14]

[model]
layers = 2
heads = 3
seed = 4

[output]
dir = "out"

[[prompts]]
name = "blob"
kind = "gaussian_mixture"
weights = [1.0, 2.0]
means = [[-0.5, 0.0], [0.6, 0.4]]
covs = [0.2, [[0.3, 0.1], [0.1, 0.2]]]

[[prompts]]
name = "box"
kind = "uniform"
lower = [-1.0, -0.5]
upper = [0.5, 1.0]
"""


def outputs(folder):
    from pdeformer.tools.output import read_diagnostics
    out = os.path.join(str(folder), "out")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return out, read_diagnostics(os.path.join(out, "diagnostics.csv")), summary


def vtu_integral(data, field):
    """int field dx over the owned linear cells (triangles, tets, intervals) of a VTK
    piece set: the cell mean of a P1 field times the cell volume."""
    pts, conn, offs = data["points"], data["connectivity"], data["offsets"]
    ghost = data["cell_data"].get("vtkGhostType", np.zeros(len(offs)))
    sizes = np.diff(np.concatenate([[0], offs]))
    assert len(set(sizes)) == 1
    cells = conn.reshape(-1, sizes[0])[ghost == 0]
    x = pts[cells]                                  # (cells, nodes, 3)
    edges = x[:, 1:] - x[:, :1]
    k = edges.shape[1]
    if k == 1:
        vol = np.linalg.norm(edges[:, 0], axis=1)
    elif k == 2:
        vol = 0.5 * np.linalg.norm(np.cross(edges[:, 0], edges[:, 1]), axis=1)
    else:
        vol = np.abs(np.einsum("ci,ci->c", edges[:, 0], np.cross(edges[:, 1], edges[:, 2]))) / 6
    return float(np.sum(vol * data["point_data"][field][cells].mean(axis=1)))


def test_help():
    for args in (["--help"], ["forward", "--help"], ["info", "--help"]):
        proc = run_cli(args)
        assert "usage: pdeformer" in proc.stdout
    assert "dolfinx" in run_cli(["info"]).stdout


def test_forward_2d_outputs_read_back(tmp_path):
    cfg = write_config(tmp_path, CONFIG_2D)
    proc = run_cli(["forward", cfg])
    out, rows, summary = outputs(tmp_path)
    assert f"output in {out}" in proc.stdout
    # rank 0's progress: layer, t, steps, step size, mass, outflow, min rho, wall time
    progress = [l for l in proc.stderr.splitlines() if " layer " in l]
    assert len(progress) == 6, proc.stderr
    pattern = (r"(blob|box) +layer +[0-2]/2 +t=[01]\.\d{4} +steps +\d+ +dt=(nan|\d\.\d{3}e[+-]\d\d) +"
               r"mass=[01]\.\d{12} +outflow=\S+ +min rho= ?\S+ +\d+\.\d s")
    assert all(re.fullmatch(pattern, l) for l in progress), progress
    # diagnostics.csv: one row per prompt at t = 0 and each layer boundary
    with open(os.path.join(out, "diagnostics.csv")) as f:
        header = f.readline().strip()
    assert header == ("prompt,t,mass,outflow,min_rho,mean_0,mean_1,"
                      "cov_00,cov_01,cov_10,cov_11")
    assert [(r["prompt"], r["t"]) for r in rows] == [
        (p, t) for p in ("blob", "box") for t in (0.0, 0.5, 1.0)]
    for r in rows:
        assert abs(r["mass"] + r["outflow"] - 1.0) < 1e-12
        assert r["cov_01"] == pytest.approx(r["cov_10"], abs=1e-14)
        assert r["min_rho"] > -1e-12                  # limiter on by default
    blob0, box0 = rows[0], rows[3]
    # t = 0 moments: the prompts' own, up to the projection error on this coarse mesh
    assert np.allclose([blob0["mean_0"], blob0["mean_1"]], [0.2333333, 0.2666667], atol=2e-3)
    assert np.allclose([box0["mean_0"], box0["mean_1"], box0["cov_00"]], [-0.25, 0.25, 0.1875], atol=2e-2)
    # summary.json: config, provenance, timings, final diagnostics
    assert summary["ranks"] == 1 and summary["command"] == "forward"
    prov = summary["provenance"]
    for key in ("pdeformer", "dolfinx", "petsc", "petsc4py", "mpi4py", "numpy"):
        assert re.fullmatch(r"\d+\.\d+.*", prov[key]), (key, prov[key])
    assert set(prov["blas"]) == {"library", "core", "detected", "coretype_set_by"}, prov["blas"]
    assert (prov["blas"]["library"] is None) == (prov["blas"]["core"] is None), prov["blas"]
    if os.path.isdir(os.path.join(ROOT, ".git")):
        assert re.fullmatch(r"[0-9a-f]{40}", prov["git"]["commit"]), prov["git"]
        assert prov["git"]["dirty"] in (True, False)
    assert summary["status"] == "completed" and summary["error"] is None
    assert summary["config"]["mesh"]["cells"] == [14, 14]
    assert summary["config"]["discretisation"]["scheme"] == "ssprk2"
    assert summary["timings"]["total"] > 0 and "velocity" in summary["timings"]
    final = {r["prompt"]: r for r in summary["final_diagnostics"]}
    assert final["box"]["mass"] == pytest.approx(rows[-1]["mass"], rel=1e-15)
    assert summary["prompts"][1]["truncated_mass"] == 0.0
    # field series: frames at t = 0, 0.5, 1, and the density integrates to the mass
    from pdeformer.tools.output import read_pvd, read_vtu
    for name in ("blob", "box"):
        frames = read_pvd(os.path.join(out, f"density_{name}.pvd"))
        assert [t for t, _ in frames] == [0.0, 0.5, 1.0]
        masses = [r["mass"] for r in rows if r["prompt"] == name]
        for (t, path), m in zip(frames, masses):
            assert vtu_integral(read_vtu(path), "density") == pytest.approx(m, abs=1e-12)
        vframes = read_pvd(os.path.join(out, f"velocity_{name}.pvd"))
        assert len(vframes) == 3
        v = read_vtu(vframes[0][1])["point_data"]["velocity"]
        assert v.shape[1] == 3 and np.all(np.isfinite(v)) and np.abs(v).max() > 0


def test_uniform_attention_velocity_read_back(tmp_path):
    """Q = 0: the written velocity is Vbar m at every point, m the mean in
    diagnostics.csv (exact once the source quadrature integrates rho * y exactly)."""
    rng = np.random.default_rng(1)
    V = rng.normal(size=(2, 2, 2, 2)) * 0.5
    np.savez(tmp_path / "heads.npz", Q=np.zeros((2, 2, 1, 2)), K=rng.normal(size=(2, 2, 1, 2)), V=V)
    cfg = write_config(tmp_path, CONFIG_2D.replace("layers = 2\nheads = 3", 'params = "heads.npz"'))
    run_cli(["forward", cfg, "--set", "output.frames_per_layer=2", "discretisation.quadrature_degree=2"])
    out, rows, summary = outputs(tmp_path)
    from pdeformer.tools.output import read_pvd, read_vtu
    frames = read_pvd(os.path.join(out, "velocity_blob.pvd"))
    assert [t for t, _ in frames] == [0.0, 0.25, 0.5, 0.75, 1.0]
    means = {r["t"]: [r["mean_0"], r["mean_1"]] for r in rows if r["prompt"] == "blob"}
    assert sorted(means) == [0.0, 0.25, 0.5, 0.75, 1.0]   # a diagnostics row at every frame
    from pdeformer.model.exact import expm
    for t, path in frames:
        layer = min(int(np.floor(t * 2 + 1e-9)), 1)       # the layer holding t (t = 1: the last)
        v = read_vtu(path)["point_data"]["velocity"][:, :2]
        np.testing.assert_allclose(v, np.tile(v[0], (len(v), 1)), atol=1e-13)   # uniform in x
        Vbar = V[layer].mean(axis=0)
        np.testing.assert_allclose(v[0], Vbar @ means[t], atol=1e-12)
        if t in (0.25, 0.75):   # inside a layer m(t) = e^{(t - t_l) Vbar} m(t_l), t_l its start
            t_l = layer / 2
            np.testing.assert_allclose(means[t], expm((t - t_l) * Vbar) @ means[t_l], rtol=1e-3)


@requires_dolfinx
def test_forward_and_gradient_take_one_step_plan(tmp_path):
    """With CFL steps (no steps_per_layer) ``forward`` takes the steps ``gradient`` takes,
    a plan frozen per frame: the risk it reports is the gradient's, to round-off."""
    cfg = write_config(tmp_path, CONFIG_2D.replace("[output]", "[objective]\nkind = \"moments\"\n\n[output]")
                       .replace('name = "box"', 'name = "box"\ntarget = { mean = [0.0, 0.0], cov = 0.5 }')
                       .replace('name = "blob"', 'name = "blob"\ntarget = { mean = [0.2, 0.0], cov = 0.4 }'))
    run_cli(["forward", cfg, "--set", "output.dir=f", "output.fields=false"], cwd=str(tmp_path))
    run_cli(["gradient", cfg, "--set", "output.dir=g"], cwd=str(tmp_path))
    forward = json.loads((tmp_path / "f" / "summary.json").read_text())["objective"]["risk"]
    gradient = float(np.load(tmp_path / "g" / "gradient.npz")["risk"])
    assert forward == pytest.approx(gradient, rel=1e-13, abs=0)


def test_petsc_options_reach_the_mass_solver(tmp_path):
    """An iterative mass solve (CG + Jacobi to 1e-14) gives the default direct solve's
    diagnostics; the options are recorded in summary.json."""
    cfg = write_config(tmp_path, CONFIG_2D)
    common = ["output.fields=false"]
    run_cli(["forward", cfg, "--set", "output.dir=lu", *common], cwd=str(tmp_path))
    run_cli(["forward", cfg, "--set", "output.dir=cg", "petsc.ksp_type=cg", "petsc.pc_type=jacobi",
             "petsc.ksp_rtol=1e-14", *common], cwd=str(tmp_path))
    assert_same_diagnostics(tmp_path / "lu" / "diagnostics.csv", tmp_path / "cg" / "diagnostics.csv")
    with open(tmp_path / "cg" / "summary.json") as f:
        assert json.load(f)["config"]["petsc"] == {"ksp_type": "cg", "pc_type": "jacobi", "ksp_rtol": "1e-14"}


@pytest.mark.mpi
def test_serial_and_two_ranks_agree(tmp_path):
    cfg = write_config(tmp_path, CONFIG_2D)
    run_cli(["forward", cfg, "--set", "output.dir=serial", "output.fields=false"], cwd=str(tmp_path))
    run_cli(["forward", cfg, "--set", "output.dir=par"], nprocs=2, cwd=str(tmp_path))
    a, b = assert_same_diagnostics(tmp_path / "serial" / "diagnostics.csv",
                                   tmp_path / "par" / "diagnostics.csv")
    assert len(a) == 6
    with open(tmp_path / "par" / "summary.json") as f:
        assert json.load(f)["ranks"] == 2
    # the parallel VTK output (.pvtu pieces) still integrates to the mass
    from pdeformer.tools.output import read_pvd, read_vtu
    t, path = read_pvd(str(tmp_path / "par" / "density_blob.pvd"))[-1]
    assert path.endswith(".pvtu")
    assert vtu_integral(read_vtu(path), "density") == pytest.approx(b[2]["mass"], abs=1e-12)


CONFIG_1D = """
[mesh]
lower = [-4.0]
upper = [4.0]
cells = [40]

[discretisation]
degree = 2

[model]
layers = 3
heads = 4

[output]
dir = "out"

[[prompts]]
name = "pair"
kind = "gaussian_mixture"
means = [-1.0, 1.2]
covs = [0.1, 0.2]

[[prompts]]
name = "data"
kind = "file"
path = "density.csv"
"""


def test_forward_1d_with_file_prompt(tmp_path):
    x = np.linspace(-2, 2, 41)
    with open(tmp_path / "density.csv", "w") as f:
        f.write("x0,density\n")
        for xi in x:
            f.write(f"{xi},{np.exp(-xi**2) * (1 + 0.5 * np.sin(3 * xi))}\n")
    run_cli(["forward", write_config(tmp_path, CONFIG_1D)])
    out, rows, summary = outputs(tmp_path)
    assert len(rows) == 8 and set(rows[0]) >= {"mean_0", "cov_00"}
    assert summary["config"]["discretisation"]["scheme"] == "ssprk3"
    # the file's data integrate to about sqrt(pi), all inside the mesh: nothing truncated
    assert abs(summary["prompts"][1]["truncated_mass"]) < 1e-3
    assert abs(summary["prompts"][1]["mass_on_mesh"] - np.sqrt(np.pi)) < 1e-2
    for r in rows:
        assert abs(r["mass"] + r["outflow"] - 1.0) < 1e-12
    from pdeformer.tools.output import read_pvd, read_vtu
    t, path = read_pvd(os.path.join(out, "density_data.pvd"))[0]
    assert read_vtu(path)["point_data"]["density"].size > 0


CONFIG_3D = """
[mesh]
lower = [-2.5, -2.5, -2.5]
upper = [2.5, 2.5, 2.5]
cells = [5, 5, 5]
cell = "hexahedron"

[model]
layers = 2
heads = 2

[output]
dir = "out"
velocity = false

[[prompts]]
kind = "gaussian_mixture"
means = [[0.3, 0.0, -0.2]]
covs = [0.4]
"""


@pytest.mark.mpi
def test_forward_3d_hexahedra_two_ranks(tmp_path):
    run_cli(["forward", write_config(tmp_path, CONFIG_3D)], nprocs=2)
    out, rows, summary = outputs(tmp_path)
    assert len(rows) == 3 and "cov_22" in rows[0]
    assert summary["mesh"]["cells"] == 125 and summary["mesh"]["cell_type"] == "hexahedron"
    assert not any("velocity" in f for f in summary["files"]["fields"])
    for r in rows:
        assert abs(r["mass"] + r["outflow"] - 1.0) < 1e-12


@pytest.mark.mpi
@pytest.mark.parametrize("mesh, dim", [("disk", 2), ("ball", 3)])
def test_shipped_meshes_serial_and_parallel(tmp_path, mesh, dim):
    mean = [0.2, -0.1, 0.1][:dim]
    text = f"""
    [mesh]
    file = "{ROOT}/meshes/{mesh}.xdmf"

    [model]
    layers = 2
    heads = 2
    init_scale = 0.3      # slow heads: few CFL steps (the partitioned mesh is the point)

    [output]
    fields = false

    [[prompts]]
    kind = "gaussian_mixture"
    means = [{mean}]
    covs = [0.3]
    """
    cfg = write_config(tmp_path, text)
    run_cli(["forward", cfg, "--set", "output.dir=s"], cwd=str(tmp_path))
    run_cli(["forward", cfg, "--set", "output.dir=p"], nprocs=2, cwd=str(tmp_path))
    a, _ = assert_same_diagnostics(tmp_path / "s" / "diagnostics.csv", tmp_path / "p" / "diagnostics.csv")
    assert len(a) == 3
    assert abs(a[-1]["mass"] + a[-1]["outflow"] - 1) < 1e-12


REDUCED = {  # every config in runs/, at a size a test can afford
    "default.toml": ["mesh.cells=[16,16]", "model.layers=2"],
    "disk.toml": ["discretisation.degree=1", "model.layers=1", "model.heads=2"],
    "ball.toml": ["model.layers=1", "model.heads=2"],
    "box.toml": ["mesh.cells=[6,6,6]", "model.layers=1", "model.heads=2"],
    "teacher.toml": ["data.count=4", "train.batch_size=2", "mesh.cells=[12,12]", "model.layers=1"],
    "interval.toml": ["mesh.cells=[50]", "model.layers=2", "model.heads=4"],
    "circle.toml": ["mesh.cells=[48]", "model.layers=2"],       # also in test_sphere.py
    "sphere.toml": ["mesh.refinements=1", "model.layers=1"],
}


@pytest.mark.mpi
@requires_dolfinx
def test_box_forward_through_3d_tables_matches_direct_and_two_ranks(tmp_path):
    """runs/box.toml (8^3 x 6 tetrahedra, 2 layers): auto sums every velocity through the
    3-D table; its diagnostics equal those of direct summation to 1e-6 (the velocity's
    relative tol is 1e-6 and |v| <= 5 moves means and covariances by less over t <= 1/2)
    and are the same on 2 ranks to 1e-10."""
    box = os.path.join(ROOT, "runs", "box.toml")
    size = ["mesh.cells=[8,8,8]", "model.layers=2"]
    for backend, nprocs in (("auto", 1), ("auto", 2), ("direct", 1)):
        run_cli(["forward", box, "--set", *size, f"attention.backend={backend}",
                 f"output.dir={tmp_path}/{backend}{nprocs}"], nprocs=nprocs)
    stats = json.loads((tmp_path / "auto1" / "summary.json").read_text())["attention"]
    assert stats["laplace"] > 0 and stats["direct"] == 0, stats
    assert_same_diagnostics(tmp_path / "auto1" / "diagnostics.csv", tmp_path / "auto2" / "diagnostics.csv")
    assert_same_diagnostics(tmp_path / "auto1" / "diagnostics.csv", tmp_path / "direct1" / "diagnostics.csv",
                            tol=1e-6)


def test_every_run_config_is_exercised():
    assert sorted(REDUCED) == sorted(f for f in os.listdir(os.path.join(ROOT, "runs"))
                                     if f.endswith(".toml"))


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(REDUCED))
def test_shipped_run_configs_at_reduced_size(tmp_path, name):
    run_cli(["forward", os.path.join(ROOT, "runs", name), "--set", *REDUCED[name],
             f"output.dir={tmp_path}/out"], nprocs=2)
    out, rows, summary = outputs(tmp_path)
    assert summary["ranks"] == 2 and summary["status"] == "completed"
    assert len(summary["final_diagnostics"]) == len(summary["config"]["prompts"])
    for r in rows:
        assert abs(r["mass"] + r["outflow"] - 1.0) < 1e-12


# ------------------------------------------------------------------------ bad input

def bad_input_cases(tmp_path):
    np.savez(tmp_path / "wrong.npz", Q=np.zeros((3, 3, 2, 2)), K=np.zeros((3, 3, 2, 2)),
             V=np.zeros((3, 3, 2, 2)))
    return [
        (["--set", "mesh.cels=[4,4]"], "mesh.cels: unknown key (did you mean 'cells'?)"),
        (["--set", "model.heads=two"], "model.heads: expected an integer"),
        (["--set", "mesh.cells=[0,12]"], "mesh.cells: expected positive integers"),
        (["--set", "prompts[0].covs=[0.2,[[0.3,0.5],[0.5,0.2]]]"], "prompts[0].covs[1]: covariance is not positive definite"),
        (["--set", "prompts[0].covs=[0.2,[[0.3,0.1],[0.2,0.2]]]"], "prompts[0].covs[1]: covariance is not symmetric"),
        (["--set", f"model.params={tmp_path}/wrong.npz", "model.layers=2"], "model.params: "),
        (["--set", f"model.params={tmp_path}/none.npz"], "model.params: "),
        (["--set", f"mesh.file={tmp_path}/none.xdmf", "mesh.lower=[]"], "mesh.lower: "),
        (["--set", "prompts[1].lower=[5.0,5.0]", "prompts[1].upper=[6.0,6.0]"], "prompts[1] ('box'): the prompt lies outside the mesh"),
        (["--set", "prompts[0].means=[[0.0,0.0,0.0],[1.0,1.0,1.0]]"], "prompts[0].means: expected a list of 2-vectors"),
        (["--set", "petsc.ksp_type=nonsense"], "petsc: PETSc rejected the mass solver options"),
        (["--set", "prompts[0].covs=[1e-4,[[0.3,0.1],[0.1,0.2]]]"],   # cells of 0.5: unresolved
         "prompts[0].covs[0]: standard deviation 0.01"),
        (["--set", "output.format=vtx"] if not _has_vtx() else ["--set", "discretisation.degree=0"],
         "output.format: 'vtx' needs" if not _has_vtx() else "discretisation.degree: "),
    ]


def _has_vtx():
    from pdeformer.fem._dolfinx import has_vtx
    return has_vtx()


def test_bad_input_gives_one_line(tmp_path):
    cfg = write_config(tmp_path, CONFIG_2D)
    for args, expected in bad_input_cases(tmp_path):
        proc = run_cli(["forward", cfg, *args], check=False, timeout=120)
        check_one_line_error(proc, expected)
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        assert len(lines) == 1, proc.stderr               # nothing else on a serial run


def test_missing_mesh_file(tmp_path):
    box = "lower = [-3.5, -3.5]\nupper = [3.5, 3.5]\ncells = [14, 14]"
    assert box in CONFIG_2D
    cfg = write_config(tmp_path, CONFIG_2D.replace(box, 'file = "nowhere.xdmf"'))
    check_one_line_error(run_cli(["forward", cfg], check=False), "mesh.file: ")
    with open(tmp_path / "broken.xdmf", "w") as f:
        f.write("<Xdmf><Domain><Grid Name='other'/></Domain></Xdmf>")
    cfg = write_config(tmp_path, CONFIG_2D.replace(box, 'file = "broken.xdmf"'), "b.toml")
    check_one_line_error(run_cli(["forward", cfg], check=False), "no grid named 'mesh'")


@pytest.mark.mpi
def test_bad_input_ends_the_mpi_job(tmp_path):
    """Under mpirun -n 2, bad input found at each stage of a run's set-up (the keys, a
    file rank 0 reads, a prompt against the partitioned mesh, PETSc's options) ends both
    ranks with the one line and exit status 2."""
    cfg = write_config(tmp_path, CONFIG_2D)
    cases = bad_input_cases(tmp_path)
    for args, expected in (cases[0], cases[6], cases[8], cases[10]):
        proc = run_cli(["forward", cfg, *args], nprocs=2, check=False, timeout=120)
        check_one_line_error(proc, expected)


@pytest.mark.mpi
def test_overflow_stops_the_run_naming_prompt_layer_and_t(tmp_path):
    """Absurd heads make the velocity overflow: exit status 3, one line naming where.
    (Heads whose scores cannot be finite on the mesh, e.g. init_scale = 1e160, are
    refused before the run: tests/test_bad_messages.py.)"""
    cfg = write_config(tmp_path, CONFIG_2D)
    for n in (1, 2):
        proc = run_cli(["forward", cfg, "--set", "model.init_scale=1e140"], nprocs=n,
                       check=False, timeout=120)
        check_one_line_error(proc, "prompt 'blob', layer 0, t = 0: ", status=3)
        assert "NaN or overflows" in proc.stderr or "too large" in proc.stderr, proc.stderr
    out, rows, summary = outputs(tmp_path)        # what was done is still written
    assert summary["status"] == "breakdown" and "prompt 'blob'" in summary["error"]
    assert rows[0]["t"] == 0.0


def test_vtx_output(tmp_path):
    if not _has_vtx():
        pytest.skip("VTX output needs dolfinx >= 0.8 built with ADIOS2")
    cfg = write_config(tmp_path, CONFIG_2D)
    run_cli(["forward", cfg, "--set", "output.format=vtx"])
    out, rows, summary = outputs(tmp_path)
    for name in ("density_blob.bp", "velocity_box.bp"):
        path = os.path.join(out, name)
        assert os.path.isdir(path) and os.listdir(path), name
    assert "density_blob.bp" in summary["files"]["fields"]


# ------------------------------------------------ bad input found by its consequence
@pytest.mark.parametrize("args, expected", [
    # passed the checks, then ZeroDivisionError in the kernel (1e200: OverflowError)
    (["objective.kind=mmd", "objective.bandwidth=1e-300"], "objective.bandwidth: 1e-300 is out of [1e-150, 1e+150]"),
    # no table reaches it: was exit 3 ("cannot reach tol") with backend laplace
    (["attention.backend=laplace", "attention.tol=1e-30"], "attention.tol: expected a number in [1e-13, 0.1]"),
    # U overflows: was "the adjoint is NaN or overflows (attention too sharp?)" (gradient)
    # and a risk of inf, "completed" (forward, particles)
    (["objective.kind=potential", "objective.weight=1e308"], "objective.weight: 1e+308 is too large: the "
                                                             "quadratic potential overflows double precision"),
])
def test_degenerate_numbers_are_bad_input(tmp_path, args, expected):
    cfg = write_config(tmp_path, CONFIG_2D.replace('dir = "out"', 'dir = "out"\nfields = false'))
    proc = run_cli(["forward", cfg, "--set", *args], check=False, timeout=120)
    check_one_line_error(proc, expected)
    assert "Warning" not in proc.stderr, proc.stderr


@pytest.mark.mpi
def test_overflowing_objective_ends_every_rank(tmp_path):
    """The objective's overflow is found after the forward pass, on every rank at once."""
    cfg = write_config(tmp_path, CONFIG_2D.replace('dir = "out"', 'dir = "out"\nfields = false'))
    proc = run_cli(["forward", cfg, "--set", "objective.kind=potential", "objective.weight=1e308"],
                   nprocs=2, check=False, timeout=120)
    check_one_line_error(proc, "objective.weight: 1e+308 is too large")
