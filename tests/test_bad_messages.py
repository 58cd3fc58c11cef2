"""Messages that name what the user can change: errors about drawn prompts name
the data.* key that drew them, junk in a data folder names its file, mixtures of many
components project without deep recursion (and exactly), ntk overflows name b_range,
queries or head_scale, a sphere of radius 1e-9 runs, attention that cannot be finite
is refused by the key that makes it so (without numpy warnings), study.bandwidth has
objective.bandwidth's range, and parameter files with arrays besides Q, K, V are
refused. Each bad input ends with one line, exit 2, on 1 and 2 ranks."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest

from conftest import ROOT, check_one_line_error, requires_dolfinx, run_cli, write_config

pytestmark = [requires_dolfinx]

RUN = """
[discretisation]
steps_per_layer = 4

[model]
layers = 1
heads = 2
seed = 3

[output]
dir = "out"
fields = false
"""

BOX = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [10, 10]
""" + RUN

DRAWN = BOX + """
[data]
count = 2
"""

SPHERE = """
[mesh]
shape = "{shape}"
{size}
""" + RUN


def quiet(proc) -> None:
    """No numpy warning reached the user (in-process runs show every warning, so a first
    JIT compilation's ResourceWarnings from ffcx are not counted)."""
    assert "RuntimeWarning" not in proc.stdout + proc.stderr, proc.stderr


def diagnostics(folder) -> dict:
    """{prompt: [rows of numbers]} of a run's diagnostics.csv."""
    out: dict = {}
    with open(os.path.join(folder, "diagnostics.csv"), newline="") as f:
        for row in csv.DictReader(f):
            out.setdefault(row.pop("prompt"), []).append([float(v) for v in row.values()])
    return out


# ---------------------------------------------------------------- a) drawn data sets

@pytest.mark.parametrize("setting, key, words", [
    # unresolvable Gaussians (not prompts[0].covs[1], "use cells of at most ...")
    ("data.std_range=[1e-4,2e-4]", "data.std_range: [0.0001, 0.0002] draws prompts", "(drawn prompt data0000: covs["),
    # means at the edge: most of the mass off the mesh (not prompts[0] ('data0000'))
    ("data.mean_range=[2.9,3.5]", "data.mean_range: [2.9, 3.5] draws prompts", "lies outside the mesh"),
    # means inside, Gaussians far wider than the mesh: the widths are at fault
    ("data.std_range=[3.0,5.0]", "data.std_range: [3.0, 5.0] draws prompts", "lies outside the mesh"),
    # every mean off the mesh: refused with the config (not prompts[0] at the projection)
    ("data.mean_range=[50.0,60.0]", "data.mean_range: [50.0, 60.0] lies off the mesh in coordinate 0", "within [-3, 3]"),
    ("data.mean_range=[1e300,1e300]", "data.mean_range: [1e+300, 1e+300] lies off the mesh", "within [-3, 3]"),
    # s^2 overflows / underflows (not prompts[0].covs[0]: expected a finite number / positive)
    ("data.std_range=[1e300,1e300]", "data.std_range: [1e+300, 1e+300] is not within", "positive finite doubles"),
    ("data.std_range=[1e-300,1e-300]", "data.std_range: [1e-300, 1e-300] is not within", "positive finite doubles"),
    # (not "1e+10 cells is more than pdeformer allows")
    ("data.components=[100000,100000] data.count=20", "data.components: 20 prompts (data.count) of up to 100000",
     "draw fewer"),
])
def test_drawn_prompts_are_reported_against_the_data_key(tmp_path, setting, key, words):
    cfg = write_config(tmp_path, DRAWN)
    proc = run_cli(["forward", cfg, "--set", *setting.split()], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, key)
    line = next(l for l in proc.stderr.splitlines() if l.startswith("pdeformer: error:"))
    assert words in line and "prompts[" not in line and "cells is more" not in line, line
    quiet(proc)


@pytest.mark.parametrize("shape, size, kappa, words", [
    # (not a ValueError traceback from the circle's normalisation, n = 16 sqrt(kappa) points)
    ("circle", "cells = [32]", "[1e300,1e300]", "width radius/sqrt(kappa) = 1e-150"),
    ("sphere", "refinements = 1", "[1e6,1e7]", "the mesh cannot resolve it"),
])
def test_drawn_concentrations_are_reported_against_the_data_key(tmp_path, shape, size, kappa, words):
    cfg = write_config(tmp_path, SPHERE.format(shape=shape, size=size)
                       + '\n[data]\ncount = 2\nfamily = "von_mises_fisher"\n')
    proc = run_cli(["forward", cfg, "--set", f"data.concentration_range={kappa}"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "data.concentration_range: ")
    assert words in proc.stderr and "(drawn prompt data000" in proc.stderr, proc.stderr


def test_a_drawn_prompt_cut_by_the_mesh_is_warned_about_by_its_data_keys(tmp_path):
    """The cut-off warning of a drawn prompt names the keys that drew it, not prompts[i]."""
    cfg = write_config(tmp_path, DRAWN)
    proc = run_cli(["forward", cfg, "--set", "data.mean_range=[1.8,2.0]", "model.query_scale=0", "model.init_scale=0.1"],
                   cwd=str(tmp_path))
    cut = [l for l in proc.stderr.splitlines() if "lies outside the mesh and is cut off" in l]
    assert cut and all(l.startswith("warning: data.mean_range, data.std_range: drawn prompt data000")
                       for l in cut), proc.stderr


# ---------------------------------------------------------------- b) junk in a data folder

def _empty(path):
    open(path, "w").close()


@pytest.mark.parametrize("name, make, words", [
    # (not "not a readable .npz (ValueError: ... pickled data ...)")
    ("b.npz", _empty, "an empty file (0 bytes), not an .npz"),
    # (not taken for a point cloud, then "data.teacher_seed: prompt 'b' is a point cloud")
    ("b.csv", _empty, "an empty file (0 bytes), not a .csv"),
    ("b.csv", lambda p: open(p, "w").write("x0,x1\n"), "a header and no rows"),
    ("b.csv", lambda p: open(p, "w").write("x0,x1,density\n"), "a header and no rows"),
    # (not skipped without a word)
    ("b.npz", os.mkfifo, "is a FIFO (named pipe), not a file"),
    ("b.npz", os.mkdir, "is a folder, not a file"),
    ("b.npz", lambda p: open(p, "w").write("not a zip\n"), "not a readable .npz file (BadZipFile"),
    ("targets/a.npz", _empty, "an empty file (0 bytes), not an .npz"),
])
def test_junk_in_a_data_folder_is_named_by_its_file(tmp_path, name, make, words):
    folder = tmp_path / "data"
    (folder / "targets").mkdir(parents=True)
    x = np.linspace(-2, 2, 7)
    points = np.stack(np.meshgrid(x, x), -1).reshape(-1, 2)
    np.savez(folder / "a.npz", points=points, density=np.exp(-np.sum(points**2, axis=1)))
    make(str(folder / name))
    cfg = write_config(tmp_path, BOX + '\n[data]\nfolder = "data"\nteacher_seed = 1\n[objective]\nkind = "moments"\n')
    proc = run_cli(["forward", cfg], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"data.folder: {folder / name}: {words}")


# ---------------------------------------------------------------- c) many components

def _mixtures(tmp_path, means, covs) -> str:
    """A config of two Gaussian-mixture prompts, 'one' and 'many'."""
    prompts = "".join(f'\n[[prompts]]\nname = "{name}"\nkind = "gaussian_mixture"\n'
                      f"means = {m}\ncovs = {c}\n" for name, m, c in zip(("one", "many"), means, covs))
    return write_config(tmp_path, BOX + prompts)


def test_a_mixture_of_thousands_of_identical_components_is_the_one_component(tmp_path):
    """1000 and 10000 copies of one Gaussian project to that Gaussian (no RecursionError
    from a nested UFL sum, and no form of all terms, which takes 41 s to compile at
    1000): the whole forward pass agrees with the single component's to
    round-off."""
    for n in (1000, 10000):
        cfg = _mixtures(tmp_path, ["[[0.3, -0.2]]", "[" + ", ".join(["[0.3, -0.2]"] * n) + "]"],
                              ["[0.3]", "[" + ", ".join(["0.3"] * n) + "]"])
        run_cli(["forward", cfg, "--set", f"output.dir=out{n}"], cwd=str(tmp_path))
        rows = diagnostics(tmp_path / f"out{n}")
        assert len(rows["many"]) == len(rows["one"]) == 2
        assert np.abs(np.array(rows["many"]) - np.array(rows["one"])).max() < 1e-12, n


def test_a_mixture_in_parts_is_the_mixture_in_one_expression(tmp_path, monkeypatch):
    """70 distinct components (parts of 32, 32 and 6 padded with zero weights) project to
    what one expression of all 70 projects to."""
    from pdeformer.model import prompts
    rng = np.random.default_rng(1)
    means = np.round(rng.uniform(-1, 1, (70, 2)), 3).tolist()
    covs = np.round(rng.uniform(0.2, 0.4, 70), 3).tolist()
    weights = np.round(rng.uniform(0.5, 1.5, 70), 3).tolist()
    cfg = write_config(tmp_path, BOX + f'\n[[prompts]]\nname = "m"\nkind = "gaussian_mixture"\n'
                                       f"means = {means}\ncovs = {covs}\nweights = {weights}\n")
    run_cli(["forward", cfg, "--set", "output.dir=parts"], cwd=str(tmp_path))
    monkeypatch.setattr(prompts, "UFL_CHUNK", 100)
    run_cli(["forward", cfg, "--set", "output.dir=whole"], cwd=str(tmp_path))
    parts, whole = diagnostics(tmp_path / "parts")["m"], diagnostics(tmp_path / "whole")["m"]
    assert np.abs(np.array(parts) - np.array(whole)).max() < 1e-12


def test_a_von_mises_fisher_mixture_of_a_thousand_components(tmp_path):
    """On the sphere as on flat meshes: 1000 copies of one component are that component."""
    one, many = "[[0.0, 0.6, 0.8]]", "[" + ", ".join(["[0.0, 0.6, 0.8]"] * 1000) + "]"
    prompts = "".join(f'\n[[prompts]]\nname = "{name}"\nkind = "von_mises_fisher"\nmeans = {m}\n'
                      f"concentrations = [{', '.join(['5.0'] * n)}]\n"
                      for name, m, n in (("one", one, 1), ("many", many, 1000)))
    cfg = write_config(tmp_path, SPHERE.format(shape="sphere", size="refinements = 1") + prompts)
    run_cli(["forward", cfg], cwd=str(tmp_path))
    rows = diagnostics(tmp_path / "out")
    assert np.abs(np.array(rows["many"]) - np.array(rows["one"])).max() < 1e-12


# ---------------------------------------------------------------- d) ntk overflows

@pytest.mark.parametrize("setting, key", [
    ("ntk.b_range=1e200", "ntk.b_range: 1e+200: the prompts' log-Laplace transforms overflow"),
    ("ntk.queries=[[1e200]]", "ntk.queries: the NTK Gram matrix overflows"),
    ("ntk.head_scale=1e100", "ntk.head_scale: the NTK Gram matrix overflows"),
])
def test_ntk_overflows_name_the_key_responsible(tmp_path, setting, key):
    """Not exit 3 with numpy warnings and "turn on discretisation.limiter" (which is on)."""
    proc = run_cli(["ntk", os.path.join(ROOT, "runs", "ntk", "prompts.toml"), "--set", setting,
                    f"output.dir={tmp_path / 'out'}"], check=False)
    check_one_line_error(proc, key)
    assert "limiter" not in proc.stderr, proc.stderr
    quiet(proc)


# ---------------------------------------------------------------- e) tiny and huge spheres

def test_a_sphere_of_radius_1e_9_runs_like_any_other(tmp_path):
    """Not "the DG mass solve failed (PETSc KSP reason -11); check the [petsc] options",
    which PETSc's absolute zero-pivot tolerance 2.2e-14 against mass entries of 1e-21
    would give."""
    prompt = '\n[[prompts]]\nname = "cap"\nkind = "von_mises_fisher"\nmeans = [[0.0, 0.0, 1.0]]\nconcentrations = [4.0]\n'
    cfg = write_config(tmp_path, SPHERE.format(shape="sphere", size="refinements = 2\nradius = 1e-9") + prompt)
    proc = run_cli(["forward", cfg], cwd=str(tmp_path))
    quiet(proc)
    rows = diagnostics(tmp_path / "out")["cap"]
    assert all(abs(r[1] - 1.0) < 1e-12 for r in rows)           # mass 1 at every frame
    proc = run_cli(["forward", cfg, "--set", "mesh.radius=1e-60"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "mesh.radius: expected a number in [1e-50, 1e+50], got 1e-60")


# ---------------------------------------------------------------- f) attention that cannot be finite

@pytest.mark.parametrize("command", ["forward", "particles"])
@pytest.mark.parametrize("setting, key", [
    ("attention.beta=1e308", "attention.beta: the attention scores beta <A x, y> reach past 1e308"),
    ("model.init_scale=1e154", "model.init_scale: the attention scores"),
])
def test_attention_that_cannot_be_finite_is_refused_by_its_key(tmp_path, command, setting, key):
    """Not numpy RuntimeWarnings with their source lines, then exit 3 "the velocity is
    NaN or overflows"."""
    prompt = '\n[[prompts]]\nname = "a"\nkind = "gaussian_mixture"\nmeans = [[0.5, 0.2]]\ncovs = [0.3]\n'
    cfg = write_config(tmp_path, BOX + prompt)
    proc = run_cli([command, cfg, "--set", setting, "particles.tokens=50"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, key)
    quiet(proc)


# ---------------------------------------------------------------- g) study.bandwidth

@pytest.mark.parametrize("bandwidth", ["1e-300", "1e200"])
def test_study_bandwidth_has_the_range_of_objective_bandwidth(tmp_path, bandwidth):
    """Not ZeroDivisionError / OverflowError tracebacks once the mmd is measured."""
    write_config(tmp_path, BOX + '\n[[prompts]]\nkind = "gaussian_mixture"\nmeans = [[0.0, 0.0]]\ncovs = [0.3]\n')
    study = write_config(tmp_path, '[study]\nrun = "run.toml"\ncommand = "particles"\n'
                                   'parameter = "particles.tokens"\nvalues = [50, 100]\nquantities = ["mmd"]\n'
                                   f'bandwidth = {bandwidth}\n', name="study.toml")
    proc = run_cli(["converge", study], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"study.bandwidth: {float(bandwidth):g} is out of [1e-150, 1e+150]")


# ---------------------------------------------------------------- h) arrays besides Q, K, V

@pytest.mark.parametrize("key, extra", [
    ("model.params", ""),
    ("data.teacher", '\n[data]\ncount = 2\nteacher = "heads.npz"\n[objective]\nkind = "moments"\n'),
])
def test_a_parameter_file_with_an_unknown_array_is_refused(tmp_path, key, extra):
    """An array that no block holds ('bias') is not ignored without a word: one line
    naming it and the arrays a parameter file may hold (the heads' weights among them)."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "heads.npz", Q=rng.normal(size=(1, 2, 2, 2)), K=rng.normal(size=(1, 2, 2, 2)),
             V=rng.normal(size=(1, 2, 2, 2)), bias=np.full((1, 2), 0.5))
    prompt = '\n[[prompts]]\nkind = "gaussian_mixture"\nmeans = [[0.0, 0.0]]\ncovs = [0.3]\n' if not extra else ""
    cfg = write_config(tmp_path, BOX + prompt + extra)
    args = ["forward", cfg] + (["--set", "model.params=heads.npz"] if key == "model.params" else [])
    proc = run_cli(args, cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"{key}: {tmp_path / 'heads.npz'}: array 'bias' is not supported: a parameter "
                               "file holds the model's arrays (")
    listed = proc.stderr.split("arrays (")[1].split(") only; remove it")[0].split(", ")
    assert {"Q", "K", "V", "weights"} <= set(listed), proc.stderr   # and those of registered terms


# ---------------------------------------------------------------- on 2 ranks

@pytest.mark.mpi
def test_the_same_lines_on_two_ranks(tmp_path):
    """Every rank ends, with one error line (rank 0's) and status 2."""
    drawn = write_config(tmp_path, DRAWN, name="drawn.toml")
    proc = run_cli(["forward", drawn, "--set", "data.std_range=[1e-4,2e-4]"], nprocs=2, cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "data.std_range: [0.0001, 0.0002] draws prompts")
    proc = run_cli(["forward", drawn, "--set", "attention.beta=1e308"], nprocs=2, cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "attention.beta: the attention scores")
    quiet(proc)
    (tmp_path / "data").mkdir()
    open(tmp_path / "data" / "b.csv", "w").close()
    folder = write_config(tmp_path, BOX + '\n[data]\nfolder = "data"\nteacher_seed = 1\n[objective]\nkind = "moments"\n',
                          name="folder.toml")
    proc = run_cli(["forward", folder], nprocs=2, cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"data.folder: {tmp_path / 'data' / 'b.csv'}: an empty file (0 bytes)")
