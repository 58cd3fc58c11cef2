"""Pictures of a run: what forward, particles and train draw when they end, fields.npz
(the same on 1 and 2 ranks), ``pdeformer plot`` (also without dolfinx and MPI, and its
bad input), the pictures' content, and paraview.py (run by pvbatch where installed)."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT, check_one_line_error, requires_dolfinx, run_cli, write_config

# one test worker makes the module's runs (the fixture below) once
pytestmark = [requires_dolfinx, pytest.mark.xdist_group("test_plot")]

CONFIG_2D = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [12, 12]

[model]
layers = 2
heads = 2
seed = 3

[attention]
backend = "direct"

[objective]
kind = "moments"

[[prompts]]
name = "blob"
kind = "gaussian_mixture"
means = [[0.5, 0.2], [-0.6, 0.1]]
covs = [0.2, 0.3]
target = { mean = [0.3, -0.2], cov = [[0.4, 0.1], [0.1, 0.3]] }

[[prompts]]
name = "box"
kind = "uniform"
lower = [-1.0, -0.5]
upper = [0.5, 1.0]
target = { mean = [0.0, 0.5], cov = 0.3 }
"""

CONFIG_1D = """
[mesh]
lower = [-4.0]
upper = [4.0]
cells = [30]

[discretisation]
degree = 2

[model]
layers = 2
heads = 2

[objective]
kind = "l2"

[[prompts]]
name = "pair"
kind = "gaussian_mixture"
means = [-1.0, 1.2]
covs = [0.1, 0.2]
target = { kind = "gaussian_mixture", means = [0.0], covs = [0.5] }
"""

CONFIG_3D = """
[mesh]
lower = [-2.5, -2.5, -2.5]
upper = [2.5, 2.5, 2.5]
cells = [4, 4, 4]
cell = "tetrahedron"

[model]
layers = 2
heads = 2

[output]
velocity = false

[[prompts]]
name = "ball"
kind = "gaussian_mixture"
means = [[0.3, 0.0, -0.2]]
covs = [0.5]
"""

PARTICLES = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [8, 8]

[model]
layers = 2
heads = 2
seed = 2

[particles]
tokens = 300
seed = 7
points = true

[objective]
kind = "mmd"
bandwidth = 0.5

[[prompts]]
name = "cloud"
kind = "gaussian_mixture"
means = [[0.3, -0.2]]
covs = [0.3]
target = { kind = "gaussian_mixture", means = [[0.0, 0.5]], covs = [0.4] }
"""

TRAIN = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [8, 8]

[discretisation]
limiter = false
steps_per_layer = 4

[model]
layers = 2
heads = 2
seed = 3
init_scale = 0.8

[objective]
kind = "moments"

[train]
steps = 2
lr = 0.05

[output]
fields = false

[[prompts]]
name = "a"
kind = "gaussian_mixture"
means = [[0.5, 0.2], [-0.6, 0.1]]
covs = [0.2, 0.3]
target = { mean = [0.3, -0.2], cov = [[0.4, 0.1], [0.1, 0.3]] }
"""

# run: (config, command and flags, ranks, the pictures it draws)
RUNS = {
    "forward_2d_1": (CONFIG_2D, ["forward"], 1, ["densities", "diagnostics"]),
    "forward_2d_2": (CONFIG_2D, ["forward"], 2, ["densities", "diagnostics"]),
    "forward_1d_1": (CONFIG_1D, ["forward"], 1, ["densities", "diagnostics"]),
    "forward_3d_2": (CONFIG_3D, ["forward"], 2, ["densities", "diagnostics"]),
    "particles_2": (PARTICLES, ["particles", "--gradient"], 2, ["densities", "diagnostics", "gradient"]),
    "train_1": (TRAIN, ["train"], 1, ["densities", "training", "heads"]),
    "train_2": (TRAIN, ["train"], 2, ["densities", "training", "heads"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The output folder of every run of RUNS (made once for this module)."""
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name, (text, command, ranks, _) in RUNS.items():
        cfg = write_config(base, text, f"{name}.toml")
        out[name] = str(base / name)
        run_cli([*command, cfg, "--set", f"output.dir={out[name]}"], nprocs=ranks, plots=True)
    return out


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


def is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(RUNS))
def test_runs_draw_their_pictures_and_plot_draws_them_again(runs, name, tmp_path):
    """The run lists the pictures it drew, fields.npz and paraview.py; each is a small
    PNG; `pdeformer plot` draws the same ones again elsewhere, as SVG on request."""
    folder, expected = runs[name], [f"{p}.png" for p in RUNS[name][3]]
    files = summary(folder)["files"]
    assert files["pictures"] == expected and files["snapshots"] == "fields.npz"
    assert files["paraview"] == "paraview.py"
    for p in expected:
        path = os.path.join(folder, p)
        assert is_png(path) and 2_000 < os.path.getsize(path) < 150_000, (p, os.path.getsize(path))
    proc = run_cli(["plot", folder, "--format", "svg", "--out", str(tmp_path)])
    assert f"pictures in {tmp_path}" in proc.stdout
    drawn = sorted(os.listdir(tmp_path))
    assert drawn == sorted([f"{p}.svg" for p in RUNS[name][3]] + ["paraview.py"]), drawn
    with open(tmp_path / f"{RUNS[name][3][0]}.svg") as f:
        assert "<svg" in f.read(2000)


@pytest.mark.mpi
def test_fields_file_is_the_same_on_one_and_two_ranks(runs):
    """Cells gathered in centroid order: 1 and 2 ranks write the same arrays (1e-12),
    for a forward run and for the densities at a training run's trained heads."""
    for one, two in (("forward_2d_1", "forward_2d_2"), ("train_1", "train_2")):
        a = np.load(os.path.join(runs[one], "fields.npz"))
        b = np.load(os.path.join(runs[two], "fields.npz"))
        assert sorted(a.files) == sorted(b.files)
        assert {"points", "cells", "density_0", "t_0", "mean_0", "target_cov_0"} <= set(a.files)
        for k in a.files:
            if a[k].dtype.kind in "fiu":
                scale = max(1.0, float(np.abs(a[k]).max()))
                np.testing.assert_allclose(a[k], b[k], atol=1e-12 * scale, rtol=0, err_msg=(one, k))
            else:
                assert (a[k] == b[k]).all(), (one, k)
    a = np.load(os.path.join(runs["forward_2d_1"], "fields.npz"))
    assert {"density_1", "mean_1", "target_cov_1"} <= set(a.files)
    assert a["density_0"].shape == (3, 288) and a["cells"].shape == (288, 3)
    # the cell means integrate to the mass of diagnostics.csv
    from pdeformer.tools.output import read_diagnostics
    x = a["points"][a["cells"]]
    e1, e2 = x[:, 1] - x[:, 0], x[:, 2] - x[:, 0]
    area = 0.5 * np.abs(e1[:, 0] * e2[:, 1] - e1[:, 1] * e2[:, 0])
    rows = [r for r in read_diagnostics(os.path.join(runs["forward_2d_1"], "diagnostics.csv"))
            if r["prompt"] == "box"]
    np.testing.assert_allclose(a["density_1"] @ area, [r["mass"] for r in rows], rtol=1e-12)
    np.testing.assert_allclose(a["mean_1"], [[r["mean_0"], r["mean_1"]] for r in rows], atol=1e-14)


def test_density_picture_shows_the_file(runs):
    """Each 2-D row is coloured on the density's range over all frames; the panels'
    cells carry the file's cell means (as triangles); 1-D curves are the node values."""
    from pdeformer.tools.figures import density_figure, snapshot_frames
    from pdeformer.commands.run_files import read_snapshots
    snap = read_snapshots(os.path.join(runs["forward_2d_1"], "fields.npz"))
    fig = density_figure(snap)
    panels = fig.axes[:6]   # 2 prompts x 3 frames (the colour bars come after)
    for row, i in enumerate((0, 1)):
        density = snap[f"density_{i}"]
        for c, k in enumerate(snapshot_frames(len(density))):
            mesh = panels[3 * row + c].collections[0]
            assert mesh.get_clim() == (density.min(), density.max())
            np.testing.assert_array_equal(mesh.get_array(), density[k])
    snap = read_snapshots(os.path.join(runs["forward_1d_1"], "fields.npz"))
    fig = density_figure(snap)
    lines = [ax.collections[0] for ax in fig.axes if ax.collections][:3]
    for k, lc in zip(snapshot_frames(len(snap["t_0"])), lines):
        segments = np.array(lc.get_segments())
        np.testing.assert_array_equal(segments[..., 0], snap["node_x"])
        np.testing.assert_array_equal(segments[..., 1], snap["nodes_0"][k])
    assert "target_density_0" in snap   # l2's target: a dashed curve on the last panel


def test_risk_curve_is_history(runs):
    """The risk, gradient-norm and step-size lines are history.csv's columns."""
    from pdeformer.tools.figures import training_figure
    from pdeformer.commands.run_files import read_table
    path = os.path.join(runs["train_1"], "history.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    fig = training_figure(read_table(path))
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    for label, column in (("risk", "risk"), ("gradient norm", "grad_norm"), ("step size", "step_size")):
        np.testing.assert_array_equal(lines[label].get_xdata(), [float(r["step"]) for r in rows])
        np.testing.assert_array_equal(lines[label].get_ydata(), [float(r[column]) for r in rows])
    assert fig.axes[0].get_yscale() == "log"


def test_diagnostics_picture_is_the_table(runs):
    """Each prompt's lines are diagnostics.csv's columns against t: the mean's
    components, the covariance's entries, the mass change and the outflow."""
    from pdeformer.tools.figures import diagnostics_figure
    from pdeformer.commands.run_files import read_diagnostics_table
    rows = read_diagnostics_table(os.path.join(runs["forward_2d_1"], "diagnostics.csv"))
    mean, cov, mass, outflow = diagnostics_figure(rows).axes[:4]
    for p, name in enumerate(("blob", "box")):
        mine = [r for r in rows if r["prompt"] == name]
        t = [r["t"] for r in mine]
        columns = {mean: ["mean_0", "mean_1"], cov: ["cov_00", "cov_01", "cov_11"],
                   mass: ["mass"], outflow: ["outflow"]}
        for ax, names in columns.items():
            lines = ax.get_lines()[p * len(names):(p + 1) * len(names)]
            for line, column in zip(lines, names):
                y = np.array([r[column] for r in mine])
                np.testing.assert_array_equal(line.get_xdata(), t)
                np.testing.assert_array_equal(line.get_ydata(), y - y[0] if column == "mass" else y)


def test_heads_picture_moves_every_head(runs):
    """One panel per layer; each head's path from the first to the last step has the
    length of its move in the two leading principal directions (all of it here: two
    heads at two steps span at most three directions, and the picture keeps two).
    Weighted heads are drawn with areas in proportion to their weights."""
    from pdeformer.commands.plot import head_vectors, heads_figure, principal_coordinates
    from pdeformer.commands.run_files import read_params
    params = read_params(runs["train_1"])
    assert [s for s, _ in params] == [0, 1, 2]
    weights = np.array([[0.25, 0.75], [1.0, 0.0]])
    for w in (None, weights):
        fig = heads_figure(params, w)
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert [ax.get_title() for ax in panels] == ["layer 0", "layer 1"]
        for layer, ax in enumerate(panels):
            first, last = ax.collections[-2], ax.collections[-1]
            xy = principal_coordinates(np.vstack([head_vectors(params[0][1], layer),
                                                  head_vectors(params[-1][1], layer)]))
            np.testing.assert_allclose(first.get_offsets(), xy[:2])
            np.testing.assert_allclose(last.get_offsets(), xy[2:])
            area = np.broadcast_to(16.0 if w is None else 32.0 * w[layer], (2,))
            np.testing.assert_allclose(last.get_sizes() * np.ones(2), area)


def settings_of(script: str) -> dict:
    with open(script) as f:
        text = f.read()
    return json.loads(text.split('SETTINGS = json.loads(r"""')[1].split('""")')[0])


def test_paraview_script_fixes_the_ranges_of_the_run(runs):
    """paraview.py: one view per prompt with its series, and the range over all frames
    and prompts that fields.npz recorded (the heads' |A| over all steps)."""
    folder = runs["forward_2d_1"]
    settings = settings_of(os.path.join(folder, "paraview.py"))
    data = np.load(os.path.join(folder, "fields.npz"))
    assert [v["name"] for v in settings["views"]] == ["blob", "box"] and settings["dim"] == 2
    density = settings["views"][1]["series"][0]
    assert density["file"] == "./density_box.pvd" and density["kind"] == "density"
    low, high = np.min([data["density_range_0"], data["density_range_1"]], axis=0)[0], \
        np.max([data["density_range_0"], data["density_range_1"]], axis=0)[1]
    assert density["range"] == pytest.approx([0.0 if abs(low) < 1e-9 * high else low, high], rel=1e-15)
    assert settings["views"][0]["series"][1]["kind"] == "velocity"
    heads = settings_of(os.path.join(runs["train_1"], "paraview.py"))["views"]
    assert heads == [{"name": "heads", "time": "step", "series": [
        {"file": "./heads.pvd", "kind": "heads", "array": "norm_A", "range": heads[0]["series"][0]["range"]}]}]
    from pdeformer.tools.output import read_pvd, read_vtu
    norms = np.concatenate([read_vtu(f)["point_data"]["norm_A"]
                            for _, f in read_pvd(os.path.join(runs["train_1"], "heads.pvd"))])
    assert heads[0]["series"][0]["range"] == pytest.approx([norms.min(), norms.max()], rel=1e-12)


def test_views_follow_the_config_and_pictures_are_run_files(runs):
    """paraview.py's views in the config's order (given by the run, which draws before
    it writes summary.json); a new run moves an earlier run's pictures, fields.npz and
    paraview.py aside (pdeformer.tools.outdir.RUN_FILES)."""
    from pdeformer.commands.paraview_session import session
    from pdeformer.commands.plot import PICTURES
    from pdeformer.commands.run_files import FORMATS
    from pdeformer.tools.outdir import RUN_FILES, _matches
    folder = runs["forward_2d_1"]
    assert [v["name"] for v in session(folder, names=["box", "blob"])["views"]] == ["box", "blob"]
    assert [v["name"] for v in session(folder)["views"]] == ["blob", "box"]   # summary.json's
    names = [f"{p}.{f}" for p in PICTURES for f in FORMATS] + ["fields.npz", "paraview.py"]
    assert all(_matches(n, RUN_FILES) for n in names)


def test_plot_needs_neither_dolfinx_nor_mpi(runs, tmp_path):
    """`pdeformer plot` with dolfinx, PETSc, UFL and mpi4py made unimportable (a laptop
    with numpy and matplotlib)."""
    blocked = ("dolfinx", "petsc4py", "ufl", "basix", "ffcx", "mpi4py")
    code = f"""
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(name + " is blocked")
sys.meta_path.insert(0, Blocked())
from pdeformer.commands.cli import main
status = main(["plot", {runs["forward_3d_2"]!r}, "--out", {str(tmp_path)!r}])
assert not [m for m in sys.modules if m.split(".")[0] in {blocked!r}]
sys.exit(status)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["densities.png", "diagnostics.png", "paraview.py"]


def test_plot_bad_input_is_one_line(runs, tmp_path):
    """Not a run folder, a listed file gone, a damaged file: one line naming it, exit 2."""
    check_one_line_error(run_cli(["plot", str(tmp_path / "nowhere")], check=False), "nowhere: no such folder")
    (tmp_path / "empty").mkdir()
    check_one_line_error(run_cli(["plot", str(tmp_path / "empty")], check=False),
                         f"{tmp_path / 'empty' / 'summary.json'}: no such file (not a pdeformer run folder)")
    copy = tmp_path / "copy"
    shutil.copytree(runs["forward_2d_1"], copy)
    os.remove(copy / "fields.npz")
    check_one_line_error(run_cli(["plot", str(copy)], check=False),
                         f"{copy / 'fields.npz'}: no such file (summary.json lists it)")
    with open(copy / "fields.npz", "wb") as f:
        f.write(b"not an npz")
    check_one_line_error(run_cli(["plot", str(copy)], check=False),
                         f"{copy / 'fields.npz'}: not a readable .npz file")
    with open(copy / "diagnostics.csv", "w") as f:
        f.write("prompt,t,mass\nblob,zero,1\n")
    os.remove(copy / "fields.npz")
    with open(copy / "summary.json", "w") as f:
        json.dump({"files": {}}, f)
    check_one_line_error(run_cli(["plot", str(copy)], check=False), f"{copy / 'diagnostics.csv'}: cannot read")
    # files that load but lack what the pictures need
    other = tmp_path / "other"
    shutil.copytree(runs["particles_2"], other)
    with np.load(other / "gradient.npz") as g:
        np.savez(other / "gradient.npz", **{k: g[k] for k in g.files if k != "dQ"})
    check_one_line_error(run_cli(["plot", str(other)], check=False),
                         f"{other / 'gradient.npz'}: not a gradient file (no whole block of derivatives)")
    with open(other / "diagnostics.csv") as f:
        text = f.read()
    with open(other / "diagnostics.csv", "w") as f:
        f.write(text.replace(",outflow", ",outgo", 1))
    check_one_line_error(run_cli(["plot", str(other)], check=False),
                         f"{other / 'diagnostics.csv'}: not as pdeformer writes it (KeyError")


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """TimeoutError inside (run_cli: a traceback, exit 1) where the code blocks, e.g. on a FIFO."""
    def stop(*_):
        raise TimeoutError(f"blocked for {seconds} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


EMPTY = {".npz": "an empty file (0 bytes), not an .npz", ".csv": "cannot read (no rows)",
         ".json": "cannot read (not JSON"}


@pytest.mark.parametrize("damage", ["fifo", "folder", "empty"])
@pytest.mark.parametrize("name", ["summary.json", "fields.npz", "diagnostics.csv", "history.csv",
                                  "gradient.npz", "params_0001.npz"])
def test_plot_unreadable_file_is_one_line(tmp_path, name, damage):
    """A FIFO, a folder or an empty file where `pdeformer plot` reads a run's file: one
    line naming it, exit 2, at once (a FIFO is not waited on)."""
    path = tmp_path / name
    if damage == "fifo":
        os.mkfifo(path)
    elif damage == "folder":
        path.mkdir()
    else:
        path.touch()
    with no_hang():
        proc = run_cli(["plot", str(tmp_path)], check=False)
    expected = {"fifo": "is a FIFO (named pipe), not a file", "folder": "is a folder, not a file",
                "empty": EMPTY[os.path.splitext(name)[1]]}[damage]
    check_one_line_error(proc, f"{path}: {expected}")


def test_plot_non_finite_arrays_are_one_line(tmp_path, caplog):
    """A NaN in the heads (their principal directions' SVD fails on it), an inf in the
    gradient, a NaN in fields.npz's densities: one line naming file and array, exit 2; at
    the end of a run the same check is one warning and no pictures."""
    rng = np.random.default_rng(0)
    theta = {n: rng.normal(size=(2, 3, 2, 2)) for n in ("Q", "K", "V")}
    heads = tmp_path / "heads"
    heads.mkdir()
    np.savez(heads / "params_0000.npz", **theta)
    bad = dict(theta, Q=theta["Q"].copy())
    bad["Q"][1, 2, 0, 1] = np.nan
    np.savez(heads / "params_0002.npz", **bad)
    message = f"{heads / 'params_0002.npz'}: Q has non-finite entries"
    check_one_line_error(run_cli(["plot", str(heads)], check=False), message)
    from pdeformer.commands.run import _draw_quietly
    with caplog.at_level(logging.WARNING, logger="pdeformer"):
        assert _draw_quietly(str(heads), "png", ["a"]) == {}
    assert [r.getMessage() for r in caplog.records if message in r.getMessage()] == \
        [f"warning: the pictures were not drawn (InputError: {message}); "
         f"`pdeformer plot {heads}` tries again"]
    gradient = tmp_path / "gradient"
    gradient.mkdir()
    np.savez(gradient / "gradient.npz", dQ=theta["Q"], dK=np.where(theta["K"] > 1, np.inf, 0.0),
             dV=theta["V"], risk=np.array(0.5))
    check_one_line_error(run_cli(["plot", str(gradient)], check=False),
                         f"{gradient / 'gradient.npz'}: dK has non-finite entries")
    fields = tmp_path / "fields"
    fields.mkdir()
    np.savez(fields / "fields.npz", version=1, prompts=np.array(["a"]), dim=2, cell_type="triangle",
             box=np.array([[0.0, 0.0], [1.0, 1.0]]), points=np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]),
             cells=np.array([[0, 1, 2]]), t_0=np.array([0.0, 1.0]), density_0=np.array([[2.0], [np.nan]]),
             density_range_0=np.array([np.inf, -np.inf]))   # an empty range is allowed
    check_one_line_error(run_cli(["plot", str(fields)], check=False),
                         f"{fields / 'fields.npz'}: density_0 has non-finite entries")


FAKE_PARAVIEW = '''
"""paraview.simple for tests: accepts every call; the time steps, whether SaveScreenshot
writes (an image, an empty file or none) and a record of its import come from
FAKE_TIMES, FAKE_WRITES and FAKE_LOG."""
import os


class _Any:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return _Any()

    def __call__(self, *args, **kwargs):
        return _Any()

    def __getitem__(self, key):
        return 0.0


class _Version:
    major, minor = 5, 11


class _TimeKeeper:
    TimestepValues = [float(t) for t in os.environ["FAKE_TIMES"].split()]


def GetParaViewVersion():
    return _Version()


def GetTimeKeeper():
    return _TimeKeeper()


def SaveScreenshot(path, *args, **kwargs):
    if os.environ["FAKE_WRITES"] != "none":
        with open(path, "wb") as f:
            f.write(b"fake image" if os.environ["FAKE_WRITES"] == "image" else b"")


for _name in ("ADIOS2VTXReader", "PVDReader", "ColorBy", "GetColorTransferFunction",
              "GetOpacityTransferFunction", "GetScalarBar", "Text", "Show", "AnnotateTimeFilter",
              "WarpByScalar", "Slice", "Glyph", "Transform", "CreateLayout", "CreateView",
              "AssignViewToLayout", "GetAnimationScene", "RenderAllViews"):
    globals()[_name] = _Any()
with open(os.environ["FAKE_LOG"], "a") as _f:
    _f.write("imported\\n")
'''


def pvd(path, times):
    """A .pvd collection of these times (the data files it names need not exist)."""
    frames = "".join(f'<DataSet timestep="{t}" part="0" file="f{k}.vtu"/>' for k, t in enumerate(times))
    path.write_text(f'<?xml version="1.0"?><VTKFile type="Collection"><Collection>{frames}'
                    '</Collection></VTKFile>')


@pytest.fixture
def fake_session(tmp_path):
    """run(folder, args, times, writes): paraview.py of ``folder`` run by this Python with
    a fake paraview.simple (a CompletedProcess, and whether it imported ParaView)."""
    fake = tmp_path / "fake" / "paraview"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "simple.py").write_text(textwrap.dedent(FAKE_PARAVIEW))
    log = tmp_path / "imported.log"

    def run(folder, args, times=(0.0, 0.5, 1.0), writes="image"):
        from pdeformer.commands.paraview_session import write_session
        assert write_session(str(folder)) == "paraview.py"
        if log.exists():
            log.unlink()
        env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), FAKE_LOG=str(log),
                   FAKE_TIMES=" ".join(map(str, times)), FAKE_WRITES=writes)
        proc = subprocess.run([sys.executable, str(folder / "paraview.py"), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, env=env)
        return proc, log.exists()
    return run


def test_paraview_script_refuses_bad_arguments_before_paraview(tmp_path, fake_session):
    """A bad --screenshot or --time: one line, exit 2, before ParaView is imported; a
    --time outside the series' times (ParaView would clamp it) names them."""
    run = tmp_path / "run"
    run.mkdir()
    pvd(run / "density_a.pvd", [0.0, 0.5, 1.0])
    pvd(run / "heads.pvd", [0, 1, 2, 3])
    (tmp_path / "shots").mkdir()
    numbers = "--time: expected a number (a depth t or a training step), got "
    outside = " is outside the run's times (depth t: 0 to 1, training step: 0 to 3)"
    images = "--screenshot: expected an image file name (.png, .jpg, .jpeg, .tif, .tiff, .bmp), got "
    cases = [
        (["--screenshot", "nowhere/x.png"], "--screenshot: nowhere: no such folder"),
        (["--screenshot", "/proc/x.png"], "--screenshot: /proc: cannot write into this folder ("),
        (["--screenshot", "shots"], "--screenshot: shots: is a folder, not a file name"),
        (["--screenshot", "shots/x.txt"], "--screenshot: shots/x.txt: not an image file name"),
        (["--screenshot"], images + "nothing"),
        (["--screenshot", ""], images + "''"),
        (["--screenshot", "--time", "0.5"], images + "'--time'"),
        (["--time", "abc"], numbers + "'abc'"),
        (["--time=abc"], numbers + "'abc'"),
        (["--time", "nan"], numbers + "'nan'"),
        (["--time", "inf"], numbers + "'inf'"),
        (["--time", "-inf"], numbers + "'-inf'"),
        (["--time"], numbers + "nothing"),
        (["--time", "7"], "--time: 7" + outside),
        (["--time", "-0.5"], "--time: -0.5" + outside),
    ]
    for args, expected in cases:
        proc, imported = fake_session(run, args)
        check_one_line_error(proc, expected)
        assert not imported, args
    assert os.listdir(tmp_path / "shots") == []   # the folder was tried, and left as it was


def test_paraview_script_screenshot_written_or_exit_3(tmp_path, fake_session):
    """The screenshot is renamed into place; where ParaView wrote none (or an empty
    file): one line `output: ...`, exit 3; a .bp series' times (not in the settings) are
    checked once ParaView has read them. No temporary files are left."""
    run = tmp_path / "run"
    run.mkdir()
    pvd(run / "density_a.pvd", [0.0, 0.5, 1.0])
    png = tmp_path / "shot.png"
    proc, imported = fake_session(run, ["--screenshot", str(png), "--time", "0.5"])
    assert proc.returncode == 0 and imported, proc.stderr
    assert png.read_bytes() == b"fake image"
    png.unlink()
    for writes in ("none", "empty"):
        proc, _ = fake_session(run, ["--screenshot", str(png)], writes=writes)
        check_one_line_error(proc, f"output: cannot write {png} (ParaView wrote no screenshot)", status=3)
        assert not png.exists()
    (run / "density_b.bp").mkdir()   # ADIOS2: times unknown to the settings
    proc, imported = fake_session(run, ["--time", "2"], times=(0.0, 0.5, 1.0))
    check_one_line_error(proc, "--time: 2 is outside the run's times (the series' times: 0 to 1)")
    assert imported
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".pdeformer")]


def test_no_pictures_with_plots_false(tmp_path):
    """[output] plots = false: no pictures, no fields.npz, no paraview.py."""
    cfg = write_config(tmp_path, TRAIN.replace("fields = false", "fields = true"))
    run_cli(["forward", cfg, "--set", "output.dir=out", "output.plots=false"], cwd=str(tmp_path))
    files = os.listdir(tmp_path / "out")
    assert "diagnostics.csv" in files and not [f for f in files if f.endswith(".png") or f in ("fields.npz", "paraview.py")]
    assert not {"pictures", "snapshots", "paraview"} & set(summary(tmp_path / "out")["files"])


def _pvbatch(script, png, cwd, *more):
    """pvbatch script --screenshot png [more] under xvfb-run (where there is no display);
    an X server that fails to start or to answer (xvfb-run -a races other X servers; a
    loaded machine starts it slowly) is tried again, on another display, after a pause."""
    import random
    import time
    cmd = ["pvbatch", script, "--screenshot", png, *more]
    for attempt in range(8):
        full = cmd if os.environ.get("DISPLAY") else \
            ["xvfb-run", "-a", "-n", str(random.randrange(100, 900)), "-s", "-screen 0 1280x1024x24"] + cmd
        proc = subprocess.run(full, cwd=cwd, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0 or "X server" not in proc.stdout + proc.stderr:
            break
        time.sleep(2 + 2 * attempt)     # up to a minute in all: the load that delays X may pass
    return proc


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["forward_2d_2", "train_1"])
def test_paraview_session_renders_without_a_display(runs, name, tmp_path):
    """paraview.py run by pvbatch (under Xvfb without a display) draws a picture of
    every view that is not blank."""
    if shutil.which("pvbatch") is None:
        pytest.skip("pvbatch (ParaView) is not installed (Debian: apt-get install paraview xvfb)")
    if not os.environ.get("DISPLAY") and shutil.which("xvfb-run") is None:
        pytest.skip("no display and no xvfb-run (Debian: apt-get install xvfb)")
    png = str(tmp_path / "session.png")
    proc = _pvbatch(os.path.join(runs[name], "paraview.py"), png, str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from matplotlib.image import imread
    image = imread(png)[..., :3]
    views = len(settings_of(os.path.join(runs[name], "paraview.py"))["views"])
    assert image.shape[1] == 460 * views
    colours = np.unique((image * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50 and image.std() > 0.05, (len(colours), image.std())


def test_pvbatch_passes_on_the_scripts_exit_status(tmp_path):
    """Under pvbatch the bad --screenshot and --time are the same one line and exit 2."""
    if shutil.which("pvbatch") is None:
        pytest.skip("pvbatch (ParaView) is not installed (Debian: apt-get install paraview xvfb)")
    if not os.environ.get("DISPLAY") and shutil.which("xvfb-run") is None:
        pytest.skip("no display and no xvfb-run (Debian: apt-get install xvfb)")
    from pdeformer.commands.paraview_session import write_session
    pvd(tmp_path / "density_a.pvd", [0.0, 1.0])
    write_session(str(tmp_path))
    script = str(tmp_path / "paraview.py")
    check_one_line_error(_pvbatch(script, "nowhere/x.png", str(tmp_path)),
                         "--screenshot: nowhere: no such folder")
    check_one_line_error(_pvbatch(script, "x.png", str(tmp_path), "--time", "abc"),
                         "--time: expected a number (a depth t or a training step), got 'abc'")
