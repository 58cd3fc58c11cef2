"""Reliability: a blow-up without NaN stops the run, output folders tell the
truth (summary.json whatever ends a run, earlier files moved aside, one run per folder),
temporary files never collide, and a full disk is one line with exit status 3."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, check_one_line_error, run_cli, write_config
from configs import CONFIG

from pdeformer.tools.errors import ConfigError, InputError, OutputError
from pdeformer.tools.outdir import LOCK, PREVIOUS, STALE_AFTER, OutputFolder
from pdeformer.tools.output import atomic_write, read_diagnostics


def summary_of(folder) -> dict:
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ blow-up

BLOWUP = ["mesh.cells=[16,16]", "discretisation.steps_per_layer=1", "model.init_scale=5",
          "train.steps=1", "output.fields=false"]


@pytest.mark.parametrize("command", ["forward", "train"])
def test_a_blowup_without_nan_is_a_breakdown(tmp_path, command):
    """One step per layer with strong heads: the density stays finite but is garbage
    (negative mass 1.85 against mass 1): a breakdown, not "completed" with exit 0."""
    out = tmp_path / "out"
    proc = run_cli([command, "runs/default.toml", "--set", f"output.dir={out}", *BLOWUP], check=False)
    check_one_line_error(proc, "prompt 'two_blobs', layer 0, t = 0.125: the density blew up: "
                               "its negative part has mass", status=3)
    assert "raise discretisation.steps_per_layer" in proc.stderr
    summary = summary_of(out)
    assert summary["status"] == "breakdown" and "blew up" in summary["error"]
    if command == "forward":   # the frame that blew up is in the table
        rows = read_diagnostics(str(out / "diagnostics.csv"))
        assert [r["t"] for r in rows] == [0.0, 0.125] and rows[-1]["min_rho"] < -1


def test_the_shipped_config_passes_the_blowup_bounds(tmp_path):
    """The same run with CFL steps: no breakdown, and its negative mass (diagnostics)
    far below the bound."""
    out = tmp_path / "out"
    run_cli(["forward", "runs/default.toml", "--set", f"output.dir={out}", "mesh.cells=[16,16]",
             "output.fields=false", "model.layers=2"])
    assert summary_of(out)["status"] == "completed"


# ------------------------------------------------------------------ output folders

def test_a_breakdown_still_writes_the_summary_and_moves_earlier_files_aside(tmp_path):
    """gradient into a folder of an earlier gradient run, then breaking down: summary.json
    says "breakdown", and the earlier gradient.npz is not left beside it."""
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["gradient", cfg], cwd=str(tmp_path))
    out = tmp_path / "out"
    assert summary_of(out)["status"] == "completed" and (out / "gradient.npz").exists()
    proc = run_cli(["gradient", cfg, "--set", "discretisation.steps_per_layer=1",
                    "model.init_scale=5"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "the density blew up", status=3)
    assert summary_of(out)["status"] == "breakdown"
    assert not (out / "gradient.npz").exists()
    assert sorted(os.listdir(out / PREVIOUS)) == ["gradient.npz", "pdeformer.log", "summary.json"]
    assert summary_of(out / PREVIOUS)["status"] == "completed"
    assert "moved 3 file(s) of an earlier run" in (out / "pdeformer.log").read_text()


def test_fresh_runs_move_training_files_aside_and_restart_keeps_them(tmp_path):
    cfg = write_config(tmp_path, CONFIG)
    out = tmp_path / "out"
    args = ["train", cfg, "--set", "train.steps=2"]
    run_cli(args, cwd=str(tmp_path))
    trained = sorted(os.listdir(out))
    assert "checkpoint.npz" in trained and "params_0002.npz" in trained
    # a restart continues them: only the stopped run's log and summary are moved
    run_cli(args[:2] + ["--restart", "--set", "train.steps=3"], cwd=str(tmp_path))
    assert sorted(os.listdir(out / PREVIOUS)) == ["pdeformer.log", "summary.json"]
    assert (out / "params_0003.npz").exists()
    with open(out / "history.csv") as f:
        assert len(f.readlines()) == 1 + 4
    # a fresh training (fewer steps) does not leave params_0003 or the old checkpoint
    run_cli(["train", cfg, "--set", "train.steps=1"], cwd=str(tmp_path))
    assert not (out / "params_0003.npz").exists() and (out / PREVIOUS / "params_0003.npz").exists()
    # a forward run into a training folder leaves no checkpoint or history there
    run_cli(["forward", cfg], cwd=str(tmp_path))
    names = set(os.listdir(out))
    assert not names & {"checkpoint.npz", "history.csv", "params_0000.npz", "heads.pvd"}
    assert {"checkpoint.npz", "history.csv"} <= set(os.listdir(out / PREVIOUS))
    assert summary_of(out)["command"] == "forward"


def write_lock(folder, pid: int, host: str, age: float = 0.0) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK)
    with open(path, "w") as f:
        json.dump({"pid": pid, "host": host, "command": "train", "started": "2026-01-01T00:00:00+00:00"}, f)
    if age:
        t = time.time() - age
        os.utime(path, (t, t))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_into_a_folder_in_use_stops(tmp_path):
    """The lock of a live process (this test's) stops a second run with one line, exit 2,
    and leaves the folder as it was; the lock of a dead one is taken over."""
    cfg = write_config(tmp_path, CONFIG)
    out = tmp_path / "out"
    write_lock(out, os.getpid(), socket.gethostname())
    proc = run_cli(["forward", cfg], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"output.dir: {out} is in use by pdeformer train (pid {os.getpid()} on "
                               f"{socket.gethostname()}")
    assert os.listdir(out) == [LOCK]
    write_lock(out, dead_pid(), socket.gethostname())
    proc = run_cli(["forward", cfg], cwd=str(tmp_path))
    assert "took over the stale lock" in proc.stderr
    assert summary_of(out)["status"] == "completed" and not (out / LOCK).exists()


def test_locks_of_other_hosts_are_stale_only_without_heartbeat(tmp_path):
    folder = str(tmp_path / "out")
    write_lock(folder, 1, "elsewhere", age=10.0)
    with pytest.raises(InputError, match="in use by pdeformer train .pid 1 on elsewhere"):
        OutputFolder(folder, "forward").open()
    write_lock(folder, 1, "elsewhere", age=STALE_AFTER + 60)
    f = OutputFolder(folder, "forward")
    f.open()
    assert "not touched for" in f.stale
    with open(os.path.join(folder, LOCK)) as fh:
        assert json.load(fh)["pid"] == os.getpid()
    f.close()
    assert not os.path.exists(os.path.join(folder, LOCK))


def test_files_that_are_not_pdeformer_output_stay(tmp_path):
    """Only what pdeformer writes is moved aside: a user's files in the folder stay."""
    folder = tmp_path / "out"
    folder.mkdir()
    for name in ("summary.json", "density_a.pvd", "density_a_p0_000000.vtu", "params_0001.npz",
                 "run.toml", "density_notes.txt", "my_data.npz"):
        (folder / name).write_text("x")
    f = OutputFolder(str(folder), "forward")
    f.open()
    f.close()
    assert sorted(os.listdir(folder)) == ["density_notes.txt", "my_data.npz", PREVIOUS, "run.toml"]
    assert len(os.listdir(folder / PREVIOUS)) == 4


# ------------------------------------------------------------------ temporary files, full disk

def test_temporary_files_have_unique_names_and_vanish_on_failure(tmp_path):
    target = str(tmp_path / "table.csv")
    with atomic_write(target) as a, atomic_write(target) as b:   # two writers at once
        assert a.name != b.name
        a.write("first\n")
        b.write("second\n")
    assert open(target).read() == "first\n"   # a finishes last: it wins, whole
    with pytest.raises(ZeroDivisionError):
        with atomic_write(target) as f:
            f.write("partial")
            1 / 0
    assert open(target).read() == "first\n" and os.listdir(tmp_path) == ["table.csv"]


@pytest.fixture
def small_disk(tmp_path):
    """A 400 kB tmpfs (root only; skipped where it cannot be mounted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_atomic_write_on_a_full_disk(small_disk):
    target = str(small_disk / "big.bin")
    with pytest.raises(OutputError, match=f"output: cannot write {target} .No space left on device"):
        with atomic_write(target, binary=True) as f:
            f.write(b"x" * 10**6)
    assert os.listdir(small_disk) == []


@pytest.mark.parametrize("nprocs", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_a_full_disk_is_one_line_and_no_cut_files(tmp_path, small_disk, nprocs):
    """Field output that fills the disk: exit 3 on every rank, one line, the cut series
    removed, and summary.json (written once the space is back) says "output_error"."""
    cfg = write_config(tmp_path, CONFIG)
    out = small_disk / "out"
    proc = run_cli(["forward", cfg, "--set", f"output.dir={out}", "output.fields=true",
                    "mesh.cells=[24,24]"], nprocs=nprocs, check=False, timeout=120)
    check_one_line_error(proc, "output: cannot write the fields of prompt 'a' into", status=3)
    assert "no space left on the device" in proc.stderr
    left = os.listdir(out)
    assert not [n for n in left if n.startswith("density_a")], left
    assert summary_of(out)["status"] == "output_error"


# ------------------------------------------------------------------ memory

@pytest.mark.parametrize("args, part", [
    (["forward", "runs/default.toml", "--set", "mesh.cells=[10000,10000]"], "mesh"),
    (["particles", "runs/default.toml", "--set", "particles.tokens=100000000"], "tokens"),
    (["forward", "runs/default.toml", "--set", "model.heads=20000", "model.layers=500",
      "model.key_dim=1024"], "heads")])
def test_runs_that_cannot_fit_stop_before_allocating(tmp_path, args, part):
    """Each of these would grow for half a minute to a MemoryError traceback."""
    proc = run_cli(args + [f"output.dir={tmp_path / 'out'}"], check=False, timeout=60)
    check_one_line_error(proc, "output.max_memory_gb: this run needs about")
    assert f"({part} " in proc.stderr
    assert not (tmp_path / "out").exists()   # refused before the folder was touched


def test_memory_limit_and_estimate_against_the_peak(tmp_path):
    """The estimate bounds the measured peak from above, within a factor 3, and a
    limit below it is refused."""
    cfg = write_config(tmp_path, CONFIG)
    args = ["forward", cfg, "--set", "mesh.cells=[96,96]", "output.fields=false"]
    run_cli(args, cwd=str(tmp_path), isolated=True)    # the peak of a process of its own
    mem = summary_of(tmp_path / "out")["memory"]
    assert mem["peak_per_rank_gb"] <= mem["estimate_per_rank_gb"] <= 3 * mem["peak_per_rank_gb"], mem
    limit = mem["estimate_per_rank_gb"] / 2
    proc = run_cli(args + [f"output.max_memory_gb={limit}"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"times the limit of {limit:g} GB")


def _tape(folder) -> tuple[float, int]:
    """(the estimate's tape part, the largest tape a rank held), in bytes."""
    s = summary_of(folder)
    return s["memory"]["estimate_parts_gb"]["tape"] * 2**30, s["tape_bytes_per_rank"]


TAPE = ["discretisation.steps_per_layer=2", "attention.tape_mb=0"]   # CONFIG: no limiter


@pytest.mark.parametrize("sets", [[], ["discretisation.degree=3"],    # ssprk104: 10 stages
                                  ["mesh.cell=\"quadrilateral\"", "discretisation.degree=2"]])
def test_the_tape_estimate_is_the_tape_on_one_rank(tmp_path, sets):
    """Without the limiter the tape of a fixed-step gradient run is the scheme's stages x
    (owned density coefficients + d values per velocity node) per step: the estimate
    counts exactly that (the old one took 4 stages and 2 values per coefficient: 4.4x
    too little for DG-3)."""
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["gradient", cfg, "--set", *TAPE, *sets], cwd=str(tmp_path))
    estimate, tape = _tape(tmp_path / "out")
    assert estimate == tape


@pytest.mark.parametrize("nprocs, sets, most", [
    (1, ["discretisation.limiter=true"], 2.0),
    pytest.param(3, [], 1.5, marks=pytest.mark.mpi),
    pytest.param(3, ["discretisation.limiter=true", "discretisation.degree=2"], 2.0, marks=pytest.mark.mpi)])
def test_the_tape_estimate_bounds_the_tape(tmp_path, nprocs, sets, most):
    """With the limiter and on 3 ranks the estimate is above the largest tape a rank held.
    The upper factors say how loose it may be: the limiter's records are counted for
    every cell (80 B a stage for DG-1 against 32 B of density and velocity), so 2x
    allows this coarse run to limit as few as a third of its cells (it limits about 80%:
    measured 1.14x, and 1.42x for DG-2 on 3 ranks); on 3 ranks a compact part's whole
    boundary is counted as ghosts where one or two cuts have them (measured 1.28x)."""
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["gradient", cfg, "--set", *TAPE, *sets], nprocs=nprocs, cwd=str(tmp_path))
    estimate, tape = _tape(tmp_path / "out")
    assert tape <= estimate <= most * tape, (estimate, tape)


MESHES = {   # [mesh] sections: boxes and the circle exact, the others bounded from above
    "triangles": {"shape": "box", "file": None, "cells": [6, 5], "cell": "triangle"},
    "quadrilaterals": {"shape": "box", "file": None, "cells": [6, 5], "cell": "quadrilateral"},
    "tetrahedra": {"shape": "box", "file": None, "cells": [3, 4, 2], "cell": "tetrahedron"},
    "hexahedra": {"shape": "box", "file": None, "cells": [3, 4, 2], "cell": "hexahedron"},
    "interval": {"shape": "box", "file": None, "cells": [7], "cell": "interval"},
    "circle": {"shape": "circle", "file": None, "cells": [12], "radius": 1.0},
    "sphere": {"shape": "sphere", "file": None, "refinements": 2, "radius": 1.0},
    "disk": {"shape": "box", "file": os.path.join(ROOT, "meshes", "disk.xdmf"), "name": "mesh"},
    "ball": {"shape": "box", "file": os.path.join(ROOT, "meshes", "ball.xdmf"), "name": "mesh"}}


@pytest.mark.parametrize("name", sorted(MESHES))
def test_velocity_nodes_of_the_estimate_against_dolfinx(name):
    """The estimate's Lagrange node count (degrees 1-3) against the spaces dolfinx builds:
    equal on boxes and the circle; elsewhere from above (Euler's formula with bounds on
    the boundary), by at most 10% (measured: the ball's tetrahedra 1.066, the disk and
    the sphere under 1.004)."""
    from mpi4py import MPI
    from pdeformer.fem import _dolfinx as dfx
    from pdeformer.fem.mesh import box_mesh, circle_mesh, read_mesh, sphere_mesh
    from pdeformer.solvers.budget import lagrange_nodes, mesh_size
    spec = MESHES[name]
    comm = MPI.COMM_SELF
    if spec["file"] is not None:
        mesh = read_mesh(comm, spec["file"], spec["name"])
    elif spec["shape"] == "circle":
        mesh = circle_mesh(comm, spec["cells"][0], spec["radius"])
    elif spec["shape"] == "sphere":
        mesh = sphere_mesh(comm, spec["refinements"], spec["radius"])
    else:
        d = len(spec["cells"])
        mesh = box_mesh(comm, [0.0] * d, [1.0] * d, spec["cells"], spec["cell"])
    cells, tdim, cell = mesh_size(spec)
    exact = spec["shape"] == "circle" or (spec["shape"] == "box" and spec["file"] is None)
    for k in (1, 2, 3):
        nodes = dfx.function_space(mesh, "Lagrange", k).dofmap.index_map.size_global
        estimate = lagrange_nodes(spec, cells, tdim, cell, k)
        if exact or k == 1:       # k = 1: the vertices themselves
            assert estimate == nodes, (k, estimate, nodes)
        else:
            assert nodes <= estimate <= 1.1 * nodes, (k, estimate, nodes)


def test_an_inline_point_cloud_counts_its_own_points():
    """Particles: a prompt of 5 inline points with [particles] tokens = 2 has the largest
    tape, ceil(5 / 2) = 3 tokens on the busier of 2 ranks, x and v (d = 1) per stage."""
    from pdeformer.integrator.schemes import SCHEMES
    from pdeformer.solvers.budget import estimate
    from pdeformer.model.config import load_config
    cfg = load_config(os.path.join(ROOT, "runs", "ntk", "prompts.toml"),
                      ["particles.tokens=2", "particles.steps_per_layer=3",
                       "prompts[0].points=[[-0.5], [0.5], [2.0], [2.5], [3.0]]"])
    stages = SCHEMES[cfg["discretisation"]["scheme"]].stages
    assert estimate(cfg, "particles", 2, True)["tape"] == cfg["model"]["layers"] * 3 * stages * 8 * 3 * 2


def test_a_kept_table_counts_once_on_the_tape():
    """A TableSum whose interpolant is its table (the laplace table itself) holds that
    table once: the tape counts the entry's own nbytes, not its fields."""
    from pdeformer.integrator.march import tape_nbytes
    from pdeformer.model.velocity import TableSum

    class Table:
        nbytes = 1000
    table, fine = Table(), Table()
    stage = (np.zeros(3), TableSum(None, table, table), TableSum(None, table, fine))
    assert tape_nbytes([(0, 0.1, [stage], None)]) == 24 + 1000 + 2000


@pytest.mark.parametrize("nprocs, config", [
    (1, "runs/default.toml"), pytest.param(3, "runs/sphere.toml", marks=pytest.mark.mpi)])
def test_the_particle_tape_estimate_is_the_tape(tmp_path, nprocs, config):
    """A particle gradient keeps per stage its block of positions and velocities (on the
    sphere also the positions before renormalising and the radial parts): exactly what
    the estimate counts. 301 tokens: 3 ranks hold 101, 100 and 100, and the estimate is
    of the largest."""
    out = tmp_path / "out"
    run_cli(["particles", config, "--gradient", "--set", f"output.dir={out}", "particles.tokens=301",
             "particles.points=false", "model.layers=2", "output.plots=false"], nprocs=nprocs)
    estimate, tape = _tape(out)
    assert estimate == tape


# ------------------------------------------------------------------ outflow

def test_outflow_beyond_the_tail_tolerance_is_warned_once_per_prompt(tmp_path):
    """A box that cuts the prompts' tails: mass flows out and moves the moments by more
    than it; the run says so, once per prompt, at the first frame past the tolerance."""
    cfg = write_config(tmp_path, CONFIG)
    proc = run_cli(["forward", cfg, "--set", "mesh.lower=[-2,-2]", "mesh.upper=[2,2]"], cwd=str(tmp_path))
    warned = [l for l in proc.stderr.splitlines() if "of the mass has left the mesh" in l]
    assert [l.split(",")[0] for l in warned] == ["warning: prompt 'a'", "warning: prompt 'b'"]
    rows = read_diagnostics(str(tmp_path / "out" / "diagnostics.csv"))
    first = {}
    for r in rows:
        if abs(r["outflow"]) > 1e-6:
            first.setdefault(r["prompt"], r["t"])
    for line in warned:
        prompt = line.split("'")[1]
        assert f"t = {first[prompt]:.6g}:" in line
    proc = run_cli(["forward", cfg, "--set", "discretisation.tail_tolerance=1"], cwd=str(tmp_path))
    assert "left the mesh" not in proc.stderr
    # training: once per prompt for the run, not once per step
    proc = run_cli(["train", cfg, "--set", "mesh.lower=[-2,-2]", "mesh.upper=[2,2]", "train.steps=2"],
                   cwd=str(tmp_path))
    assert proc.stderr.count("of the mass has left the mesh") == 2, proc.stderr


# ------------------------------------------------------------------ walltime with a slow rank 0

SLOW_RANK_0 = '''
import sys, time
from mpi4py import MPI
from pdeformer.tools import output
from pdeformer.solvers import train
if MPI.COMM_WORLD.rank == 0:   # rank 0's writes take long, as on a busy shared file system
    slow = train.write_checkpoint
    def write_checkpoint(*args, **kwargs):
        time.sleep(1.0)
        return slow(*args, **kwargs)
    train.write_checkpoint = write_checkpoint
    csv = train.write_csv
    def write_csv(*args, **kwargs):
        time.sleep(1.0)
        return csv(*args, **kwargs)
    train.write_csv = write_csv
from pdeformer.commands.cli import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.mpi
def test_walltime_stop_with_a_slow_rank_0(tmp_path):
    """Rank 0 spends a second in every write, so the ranks' clocks disagree on whether a
    step fits; the stop is rank 0's decision for all, so the job ends (this hung when
    each rank decided) and a restart reaches the uninterrupted history."""
    cfg = write_config(tmp_path, CONFIG)
    (tmp_path / "slow.py").write_text(SLOW_RANK_0)
    from pdeformer.tools.parallel import mpirun_command
    cmd = mpirun_command(2) + [sys.executable, str(tmp_path / "slow.py"), "train", cfg,
                               "--set", "train.steps=4", "--walltime", "4"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(tmp_path / "out")
    assert summary["status"] == "walltime", summary["status"]
    run_cli(["train", cfg, "--restart", "--set", "train.steps=4"], nprocs=2, cwd=str(tmp_path))
    with open(tmp_path / "out" / "history.csv") as f:
        assert [int(r.split(",")[0]) for r in f.readlines()[1:]] == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------ summaries of failed runs

def test_a_refused_restart_changes_nothing(tmp_path):
    """A checkpoint of another problem refuses a restart (exit 2) before anything ran:
    twice, and the completed run's files (summary, log, fields.npz, pictures) stay where
    they were, with nothing moved to previous/ and no summary of the refusal."""
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["train", cfg, "--set", "train.steps=1"], cwd=str(tmp_path), plots=True)
    out = tmp_path / "out"
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    assert {"summary.json", "fields.npz", "densities.png"} <= set(before)
    for _ in range(2):
        proc = run_cli(["train", cfg, "--restart", "--set", "model.seed=4"], cwd=str(tmp_path), check=False)
        check_one_line_error(proc, "was made for another problem (different model)")
        assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert summary_of(out)["status"] == "completed"


def test_a_bug_still_leaves_a_summary(tmp_path, monkeypatch):
    """An unexpected exception (here planted in the forward pass) is not bad input: the
    rank it happened on writes summary.json with status "failed" before the job aborts."""
    from pdeformer.commands import run
    from pdeformer.model.config import load_config
    from pdeformer.solvers.forward import ForwardSolver

    def broken(self, trackers=()):
        raise RuntimeError("planted")
    monkeypatch.setattr(ForwardSolver, "run", broken)
    cfg = load_config(write_config(tmp_path, CONFIG), [f"output.dir={tmp_path / 'out'}"])
    with pytest.raises(RuntimeError, match="planted"):
        run.run_forward(cfg)
    summary = summary_of(tmp_path / "out")
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: planted"
    assert not (tmp_path / "out" / LOCK).exists()


def test_coarse_gradient_runs_end_cleanly(tmp_path):
    """runs/default.toml on 16x16 cells, 4 layers: without the limiter the
    undershoot makes the attention's partition function tiny and the velocity runs off;
    that is caught where it happens, with its cause (rather than going on with unstable
    frozen steps to a NaN adjoint). With the limiter (the default) the gradient
    completes, its frozen plans made again where the velocity grew: no unstable step."""
    args = ["gradient", "runs/default.toml", "--set", f"output.dir={tmp_path / 'out'}",
            "mesh.cells=[16,16]", "model.layers=4"]
    proc = run_cli(args + ["discretisation.limiter=false"], check=False)
    check_one_line_error(proc, "times the most a density >= 0 gives", status=3)
    assert "partition function is tiny or negative" in proc.stderr
    assert "set discretisation.limiter = true" in proc.stderr
    proc = run_cli(args)
    assert "stability limit" not in proc.stderr
    assert summary_of(tmp_path / "out")["status"] == "completed"


SPIKE = """
    [mesh]
    lower = [-3.0]
    upper = [3.0]
    cells = [12]
    [discretisation]
    degree = 1
    limiter = false
    [model]
    params = "heads.npz"
    [output]
    dir = "out"
    fields = false
    [[prompts]]
    name = "spike"
    kind = "file"
    path = "spike.npz"
"""


def test_a_density_file_the_mesh_cannot_hold_stops_where_the_partition_function_fails(tmp_path):
    """A user's density (>= 0) with a spike narrower than a cell: its DG-1 projection dips
    to -0.68 in that cell, and one head with A = 3 weights the negative end. The run
    stops where the velocity runs off, with the partition function there against its
    value for |rho| (computed across ranks: 1 and 2 ranks say the same); with the
    limiter the projection is >= 0 and the run completes."""
    import numpy as np
    x = np.linspace(-3, 3, 601)
    np.savez(tmp_path / "spike.npz", points=x[:, None], density=np.maximum(0, 1 - np.abs(x - 0.15) / 0.15))
    np.savez(tmp_path / "heads.npz", Q=np.full((1, 1, 1, 1), 3.0), K=np.ones((1, 1, 1, 1)),
             V=np.ones((1, 1, 1, 1)))
    cfg = write_config(tmp_path, SPIKE)
    errors = []
    for nprocs in (1, 2):
        proc = run_cli(["forward", cfg], nprocs=nprocs, cwd=str(tmp_path), check=False)
        check_one_line_error(proc, "prompt 'spike', layer 0, t = ", status=3)
        line = next(l for l in proc.stderr.splitlines() if l.startswith("pdeformer: error:"))
        assert "partition function is tiny or negative there (head 0: Z = " in line
        assert line.endswith("set discretisation.limiter = true"), line
        ratio = float(line.split("Z = ")[1].split()[0])
        assert abs(ratio) < 0.1, line
        errors.append(line)
        rows = read_diagnostics(str(tmp_path / "out" / "diagnostics.csv"))
        assert rows[0]["min_rho"] < -0.5
        assert summary_of(tmp_path / "out")["status"] == "breakdown"
    assert errors[0] == errors[1]
    run_cli(["forward", cfg, "--set", "discretisation.limiter=true"], cwd=str(tmp_path))
    rows = read_diagnostics(str(tmp_path / "out" / "diagnostics.csv"))
    assert rows[0]["min_rho"] >= 0 and rows[-1]["t"] == 1.0


@pytest.mark.mpi
def test_a_rank_that_dies_ends_the_job(tmp_path):
    """kill -9 of rank 1 in the middle of a training: mpirun ends the job (rank 0 does
    not wait forever in the next collective)."""
    cfg = write_config(tmp_path, CONFIG)
    (tmp_path / "die.py").write_text('''
import os, signal, sys
from mpi4py import MPI
from pdeformer.solvers import adjoint
if MPI.COMM_WORLD.rank == 1:
    gradient = adjoint.AdjointSolver.gradient
    calls = []
    def dying(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return gradient(self, *args, **kwargs)
    adjoint.AdjointSolver.gradient = dying
from pdeformer.commands.cli import main
sys.exit(main(sys.argv[1:]))
''')
    from pdeformer.tools.parallel import mpirun_command
    cmd = mpirun_command(2) + [sys.executable, str(tmp_path / "die.py"), "train", cfg]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert time.perf_counter() - t0 < 60


def test_usage_errors_are_one_line():
    for args in (["train", "x.toml", "--walltime", "nan"], ["frobnicate"], ["forward", "--prompt-groups", "two"]):
        proc = run_cli(args, check=False)
        check_one_line_error(proc, "(see 'pdeformer")
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ------------------------------------------------------------------ nothing lost

def tree(folder) -> dict:
    """{relative path: bytes} of every file below ``folder``."""
    out = {}
    for dp, _, fn in os.walk(folder):
        for f in fn:
            path = os.path.join(dp, f)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


def trained(tmp_path):
    """A config and its training's output folder out/ (2 steps), then a forward run into
    it: out/ holds the forward's files, out/previous/ the training's."""
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["train", cfg, "--set", "train.steps=2"], cwd=str(tmp_path))
    return cfg, tmp_path / "out"


@pytest.mark.parametrize("where", ["out/params_0002.npz", "out/previous/params_0002.npz"])
def test_a_run_never_moves_or_deletes_what_it_reads(tmp_path, where):
    """Heads read from the folder a run writes into (a file it would move to previous/)
    or from its previous/ (which it would replace): refused before anything moves, and
    the training's files are all still there."""
    cfg, out = trained(tmp_path)
    if where.startswith("out/previous"):
        run_cli(["forward", cfg], cwd=str(tmp_path))   # the training now in previous/
    before = tree(out)
    proc = run_cli(["forward", cfg, "--set", f"model.params={tmp_path / where}"], cwd=str(tmp_path),
                   check=False)
    check_one_line_error(proc, f"model.params: {tmp_path / where} ")
    assert ("which this run replaces" if "previous" in where else "which this run moves to previous/") \
        in proc.stderr
    assert tree(out) == before


def test_the_previous_folder_of_a_run_is_not_an_output_folder(tmp_path):
    """Run B into out/previous/ while run A holds out/ (or after it): refused; and A does
    not replace a previous/ that a run holds."""
    cfg, out = trained(tmp_path)
    run_cli(["forward", cfg], cwd=str(tmp_path))
    write_lock(out, os.getpid(), socket.gethostname())         # A holds out/
    before = tree(out)
    proc = run_cli(["forward", cfg, "--set", f"output.dir={out / PREVIOUS}"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"output.dir: {out / PREVIOUS} is where the run in {out} keeps the files")
    assert tree(out) == before
    os.remove(out / LOCK)
    write_lock(out / PREVIOUS, os.getpid(), socket.gethostname())   # B holds out/previous/
    before = tree(out)
    proc = run_cli(["forward", cfg], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"output.dir: {out / PREVIOUS} is in use by pdeformer train")
    assert tree(out) == before


def test_a_refused_run_puts_the_folder_back(tmp_path):
    """Bad input found after the folder was opened (here raised in the session): the
    earlier files, previous/ and all, are as they were, and no summary is written."""
    folder = tmp_path / "out"
    (folder / PREVIOUS).mkdir(parents=True)
    (folder / PREVIOUS / "summary.json").write_text("older")
    for name, text in (("summary.json", "earlier"), ("params_0001.npz", "p"), ("notes.txt", "mine")):
        (folder / name).write_text(text)
    before = tree(folder)
    f = OutputFolder(str(folder), "forward")
    f.open()
    assert f.moved == ["params_0001.npz", "summary.json"]
    (folder / "pdeformer.log").write_text("this run's")
    (folder / "summary.json").write_text("this run's")
    f.close(restore=True)
    assert tree(folder) == before and not (folder / LOCK).exists()
    f = OutputFolder(str(folder), "forward")    # not refused: the older previous/ goes
    f.open()
    f.close()
    assert tree(folder) == {"notes.txt": b"mine", "previous/summary.json": b"earlier",
                            "previous/params_0001.npz": b"p"}
    fresh = tmp_path / "fresh"                 # a folder the refused run made is removed
    f = OutputFolder(str(fresh), "forward")
    f.open()
    f.close(restore=True)
    assert not fresh.exists()


@pytest.mark.parametrize("owner, takes_over", [
    ({"pid": float("inf")}, False), ({"pid": 10**30}, False), ({"pid": 0}, False), ({"pid": -1}, False),
    ({"pid": "12"}, False), ({"host": None}, False)])
def test_a_lock_that_names_no_possible_owner(tmp_path, owner, takes_over):
    """A lock whose pid no process can have (inf, huge, 0, negative, a string) or with a
    field missing is not pdeformer's: fresh, it holds the folder like any lock (one line,
    exit 2, no OverflowError); untouched for STALE_AFTER it is taken over."""
    folder = tmp_path / "out"
    folder.mkdir()
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": "train", "started": "x", **owner}
    (folder / LOCK).write_text(json.dumps(info))
    with pytest.raises(InputError, match="in use by another run .its lock .* cannot be read as pdeformer's"):
        OutputFolder(str(folder), "forward").open()
    old = time.time() - STALE_AFTER - 60
    os.utime(folder / LOCK, (old, old))
    f = OutputFolder(str(folder), "forward")
    f.open()
    assert "not touched for" in f.stale
    f.close()


def test_a_stale_lock_of_a_reused_pid_is_taken_over(tmp_path):
    """The same host, a pid that is alive again (pid 1) but a lock untouched for days:
    its owner would have touched it every minute, so it is stale (the 15-minute rule)."""
    folder = str(tmp_path / "out")
    write_lock(folder, 1, socket.gethostname(), age=3 * 86400)
    f = OutputFolder(folder, "forward")
    f.open()
    assert "pid 1" in f.stale and "not touched for" in f.stale
    f.close()
    write_lock(folder, 1, socket.gethostname(), age=10)     # touched lately: in use
    with pytest.raises(InputError, match="in use by pdeformer train .pid 1 on"):
        OutputFolder(folder, "forward").open()


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_lock_that_is_not_a_file(tmp_path, kind):
    """A folder or a FIFO where the lock should be: one line naming it (not "cannot write
    the folder"; a FIFO is not waited on)."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / LOCK).mkdir() if kind == "folder" else os.mkfifo(folder / LOCK)
    what = "a folder" if kind == "folder" else "a FIFO"
    with pytest.raises(InputError, match=f"output.dir: {folder / LOCK}: is {what}.*not pdeformer's lock file"):
        OutputFolder(str(folder), "forward").open()


# ------------------------------------------------------------------ files read safely

@pytest.mark.parametrize("what", ["fifo", "device", "folder"])
def test_files_are_opened_without_blocking(tmp_path, what, monkeypatch):
    """PDEFORMER_COSTS, the config and a mesh file naming a FIFO, /dev/zero or a folder:
    one line at once (a FIFO would block forever, /dev/zero read until memory ran
    out)."""
    from pdeformer.attention import costs
    path = {"fifo": str(tmp_path / "pipe"), "device": "/dev/zero", "folder": str(tmp_path)}[what]
    if what == "fifo":
        os.mkfifo(path)
    kind = {"fifo": "a FIFO (named pipe)", "device": "a device", "folder": "a folder"}[what]
    cfg = write_config(tmp_path, CONFIG)
    monkeypatch.setenv("PDEFORMER_COSTS", path)
    costs.reset()
    try:
        proc = run_cli(["forward", cfg], cwd=str(tmp_path), check=False, timeout=60)
    finally:
        monkeypatch.undo()
        costs.reset()
    check_one_line_error(proc, f"PDEFORMER_COSTS: {path}: is {kind}, not a file")
    proc = run_cli(["forward", path], check=False)
    check_one_line_error(proc, f"{path}: is {kind}, not a config file")
    mesh = write_config(tmp_path, CONFIG.replace("lower = [-3.0, -3.0]\nupper = [3.0, 3.0]\ncells = [10, 10]",
                                                 f'file = "{path}"'), "mesh.toml")
    proc = run_cli(["forward", mesh], check=False)
    check_one_line_error(proc, "mesh.file: ")


@pytest.mark.mpi
def test_a_cache_folder_that_cannot_be_written(tmp_path):
    """HOME and XDG_CACHE_HOME that cannot be written (a read-only home on a node): the
    JIT forms and pdeformer's builds go to a private temporary folder, with one warning,
    on 1 and on 2 ranks (the second run finds what the first compiled there); the runs
    complete (this was a traceback)."""
    from pdeformer.tools.parallel import mpirun_command
    cfg = write_config(tmp_path, CONFIG)
    env = {"HOME": str(tmp_path / "no" / "home"), "XDG_CACHE_HOME": "/proc/none", "TMPDIR": str(tmp_path)}
    os.makedirs(tmp_path / "no")
    os.chmod(tmp_path / "no", 0o500)
    for launcher in ([], mpirun_command(2)):
        proc = subprocess.run(launcher + [sys.executable, "-m", "pdeformer", "forward", cfg], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **env))
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.count("warning: XDG_CACHE_HOME: /proc/none cannot be written") == 1, proc.stderr
    assert (tmp_path / f"pdeformer-cache-{os.getuid()}" / "fenics").is_dir()


# ------------------------------------------------------------------ studies answer a question

STUDY = """
[study]
run = "run.toml"
parameter = "mesh.cells"
values = [[6, 6], [8, 8]]
reference = "finest"
quantities = ["mean"]
seeds = 2
"""


@pytest.mark.parametrize("sets, message", [
    (["study.set=[\"model.params=\\\"heads.npz\\\"\"]"],
     "study.seed_keys: no seed of ['model.seed', 'particles.seed'] changes the run (model.seed: "
     "model.params is given"),
    (["study.set=[\"model.params=\\\"heads.npz\\\"\"]", "study.seed_keys=[\"model.seed\"]"],
     "study.seed_keys: model.seed changes nothing in these runs (model.params is given"),
    (["study.seed_keys=[\"model.layers\"]"], "study.seed_keys: 'model.layers' is not a seed"),
    (["study.seed_keys=[\"particles.seed\"]"], "study.seed_keys: particles.seed changes nothing in these "
                                               "runs (command forward draws no tokens)"),
    (["study.values=[[8,8],[6,6]]"], "study.values: the last value [6, 6] is the reference"),
    (["study.reference=\"run\"", "study.reference_run=\"run.toml\"",
      "study.reference_set=[\"mesh.cells=[12,12]\",\"prompts[0].name=\\\"c\\\"\"]"],
     "study.reference_run: the reference's prompts are not the study's: prompt 0 ('a' in the study, 'c' "
     "in the reference) differs in name"),
    (["study.reference=\"run\"", "study.reference_run=\"run.toml\"",
      "study.reference_set=[\"mesh.cells=[12,12]\",\"prompts[1].means=[[0.0,0.0]]\"]"],
     "prompt 1 ('b' in the study, 'b' in the reference) differs in means"),
    (["study.reference=\"run\"", "study.reference_run=\"one.toml\"", "study.reference_set=[\"mesh.cells=[12,12]\"]"],
     "study.reference_run: the reference's prompts are not the study's: 1 prompt(s) against the study's 2"),
    (["study.reference=\"run\"", "study.reference_run=\"run.toml\"", "study.reference_set=[\"mesh.cells=[7,7]\"]"],
     "study.reference_run: the reference's mesh.cells = [7, 7] is not beyond the sweep [[6, 6], [8, 8]]"),
    (["study.reference=\"run\"", "study.reference_run=\"run.toml\"",
      "study.reference_set=[\"mesh.cells=[12,12]\",\"model.init_scale=0.5\"]"],
     "study.reference_run: the reference's model.init_scale = 0.5 is not the study's (0.8)"),
    (["study.parameter=\"model.heads\"", "study.values=[2,4]", "study.reference=\"draw\"",
      "study.reference_set=[\"model.heads=4\"]"],
     "study.reference_set: the reference's model.heads = 4 is not beyond the sweep [2, 4]"),
    (["study.quantities=[\"l2\"]", "study.reference=\"run\"", "study.reference_run=\"run.toml\"",
      "study.reference_command=\"particles\"", "study.reference_set=[\"mesh.cells=[12,12]\"]"],
     "study.reference_command: density errors (l2, l1) need a forward reference"),
])
def test_studies_that_answer_no_question_are_refused(tmp_path, sets, message):
    """Ensembles whose seeds change nothing (members that would repeat one run, with
    intervals of zero width), keys that are not seeds, references that are other
    problems (other prompts, another model) or not beyond the sweep: refused before
    anything runs, one line naming the study key."""
    write_config(tmp_path, CONFIG)
    write_config(tmp_path, CONFIG[:CONFIG.index("[[prompts]]\nname = \"b\"")], "one.toml")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "heads.npz", **{n: rng.normal(size=(2, 2, 2, 2)) for n in "QKV"})
    study = write_config(tmp_path, STUDY, "study.toml")
    proc = run_cli(["converge", study, "--set", *sets], check=False)
    check_one_line_error(proc, message)
    assert not (tmp_path / "output").exists()


def test_identical_members_are_an_error():
    """Members whose errors agree to the last bit in every case were not redrawn."""
    from pdeformer.commands.study import check_members_differ
    study = {"seed_keys": ["model.seed"]}
    records = [{"case": i, "member": j, "quantity": "mean", "error": 0.1 * (i + 1) + 0.01 * j}
               for i in range(2) for j in range(3)]
    check_members_differ(study, records)
    records[2]["error"], records[5]["error"] = records[1]["error"], records[4]["error"]   # member 2 = member 1
    with pytest.raises(ConfigError, match="study.seed_keys: members 1 and 2 gave the same errors in every case"):
        check_members_differ(study, records)


def test_a_budget_width_reference_below_its_sweep(tmp_path):
    """A 1-head draw as the H -> infinity reference of a [2, 4] sweep is refused (as a
    layers reference below its sweep was)."""
    from pdeformer.commands.budget import load_budget
    budget = write_config(tmp_path, f"""
        [budget]
        run = "{ROOT}/runs/default.toml"
        set = ["model.depth=\\"smooth\\""]
        transformer = [2, 2, 100]
        layers = [1, 2]
        layers_reference = 4
        heads = [2, 4]
        width_reference = "draw"
        width_reference_heads = 1
        tokens = [50, 100]
        cells = [[4, 4], [8, 8]]
        cells_reference = [16, 16]
        seeds = 2
        """, "budget.toml")
    with pytest.raises(ConfigError, match="budget.width_reference_heads: 1 heads is not above the 4 of the width sweep, transformer and checks"):
        load_budget(budget)


# ------------------------------------------------------------------ passes that break down

TEACHER = (CONFIG.split("[[prompts]]")[0].replace("steps_per_layer = 8", "steps_per_layer = 2")
           + '[data]\ncount = 2\nteacher = "teacher.npz"\n')   # CONFIG's run, its prompts drawn


@pytest.mark.parametrize("nprocs, groups", [(1, 1), pytest.param(2, 2, marks=pytest.mark.mpi)])
def test_a_teacher_pass_that_breaks_down_is_recorded(tmp_path, nprocs, groups):
    """A teacher whose forward pass blows up: exit 3, the message says it was the
    teacher's target pass, and summary.json says "breakdown" (not the earlier run's
    "completed"), under prompt groups too."""
    cfg = write_config(tmp_path, TEACHER)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "teacher.npz", **{n: 5 * rng.normal(size=(2, 2, 2, 2)) for n in "QKV"})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "summary.json").write_text(json.dumps({"status": "completed"}))
    proc = run_cli(["train", cfg, "--prompt-groups", str(groups)], nprocs=nprocs, cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"the teacher's target pass (data.teacher = {tmp_path / 'teacher.npz'}): prompt "
                               "'data0000'", status=3)
    summary = summary_of(tmp_path / "out")
    assert summary["status"] == "breakdown" and summary["error"].startswith("the teacher's target pass")


def test_a_study_says_which_run_broke_down(tmp_path):
    """A case of a study that blows up: the message and the summary name the case."""
    write_config(tmp_path, CONFIG)
    study = write_config(tmp_path, STUDY.replace("seeds = 2", "seeds = 1"), "study.toml")
    proc = run_cli(["converge", study, "--set", "study.set=[\"discretisation.steps_per_layer=1\","
                    "\"model.init_scale=5\"]"], check=False)
    check_one_line_error(proc, "case mesh.cells = [8, 8]: prompt 'a', layer 0", status=3)
    assert summary_of(tmp_path / "output" / "study")["status"] == "breakdown"


@pytest.mark.parametrize("command", ["forward", "train"])
def test_a_run_whose_mass_has_left_the_mesh_breaks_down(tmp_path, command):
    """Uniform attention (Q = 0) with V = 10 I carries the prompt out of the box: once more
    than discretisation.max_outflow (0.5) of the mass has left, exit 3 naming the prompt
    and how much is left (it ended "completed" with moments of 1e-164 of mass, and a
    training fitted them)."""
    cfg = write_config(tmp_path, CONFIG.replace("steps_per_layer = 8\n", ""))
    np.savez(tmp_path / "flee.npz", Q=np.zeros((2, 2, 2, 2)), K=np.ones((2, 2, 2, 2)),
             V=np.tile(10 * np.eye(2), (2, 2, 1, 1)))
    proc = run_cli([command, cfg, "--set", f"model.params={tmp_path / 'flee.npz'}", "discretisation.limiter=true",
                    "train.steps=1"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "prompt 'a', layer 0, t = 0.5: ", status=3)
    assert "of the mass has left the mesh (more than discretisation.max_outflow = 0.5)" in proc.stderr
    assert summary_of(tmp_path / "out")["status"] == "breakdown"


# ------------------------------------------------------------------ hangs

def test_prompt_checks_scale_and_the_estimate_counts_the_prompts():
    """Duplicate names are found with a set (the check was quadratic: minutes at 10^5
    prompts); the memory estimate counts every prompt (10^6 drawn prompts are refused
    by it, on every rank alike: tests/test_reliability's table, benchmarks/bad_inputs.py)."""
    from pdeformer.solvers import budget
    from pdeformer.model import config
    prompts = [{"name": f"p{i}", "kind": "gaussian_mixture", "means": [[0.0]], "covs": [1.0]} for i in range(3)]
    with pytest.raises(ConfigError, match=r"prompts\[2\].name: 'p0' is used twice"):
        config._check_prompts(prompts[:2] + [dict(prompts[2], name="p0")])
    one, many = (budget.estimate(config.load_config(os.path.join(ROOT, "runs", "teacher.toml"),
                                                    [f"data.count={n}", "data.test_fraction=0", "train.batch_size=1"]),
                                 "forward", 1)["prompts"] for n in (1, 1000))
    assert many == 1000 * one and one >= budget.PER_PROMPT


def test_an_update_that_blows_the_heads_up_stops_there(tmp_path):
    """Langevin noise far above the heads' size: the first update makes a velocity whose
    forward pass would crawl (it ran for 10 minutes and 5 GB before): exit 3 at that
    step, naming train.temperature. An unstable weight decay is refused at once."""
    cfg = write_config(tmp_path, CONFIG.replace("steps_per_layer = 8\n", ""))
    proc = run_cli(["train", cfg, "--set", "train.temperature=1e6", "train.steps=2"], cwd=str(tmp_path),
                   check=False)
    check_one_line_error(proc, "train step 0: the update blew the heads up: their velocity may need up to", 3)
    assert "mostly the Langevin noise" in proc.stderr and "lower train.temperature (now 1e+06)" in proc.stderr
    proc = run_cli(["train", cfg, "--set", "train.weight_decay=1e6"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "train.weight_decay: lr x weight_decay = 5e+04 is 2 or more")


def test_a_tape_past_the_memory_limit_breaks_down(tmp_path):
    """A gradient whose steps would take its tape past the room the memory limit leaves
    it stops before taking them (with fast heads it would crawl while memory grew)."""
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from pdeformer.model.config import load_config
    from pdeformer.tools.errors import SolverBreakdown
    from mpi4py import MPI
    cfg = load_config(write_config(tmp_path, CONFIG.replace("steps_per_layer = 8\n", "")))
    problem = build_problem(cfg, MPI.COMM_WORLD, differentiable=True)
    solver = ForwardSolver(problem)
    adjoint = AdjointSolver(solver, problem.objective, problem.targets)
    adjoint.gradient()          # fits
    solver.tape_limit = 20_000 + 256 * 2**20   # bytes: the tables' tape_mb and a few steps' worth
    with pytest.raises(SolverBreakdown, match=r"prompt 'a', layer 0, t = [\d.]+: the velocity \|v\| = .* needs "
                       r"\d+ more steps in this frame, and the tape the gradient keeps"):
        adjoint.gradient()


def test_bad_input_after_the_work_started_keeps_the_files(tmp_path):
    """Refused before its work starts, a command leaves the folder as it was; bad input
    found after (a study's later case) is recorded: summary.json says bad_input and what
    the run wrote stays."""
    from mpi4py import MPI
    from pdeformer.commands.run import output_session
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "summary.json").write_text("earlier")
    before = tree(folder)
    written = []

    def on_error(e):
        (folder / "summary.json").write_text(json.dumps({"status": "bad_input", "error": str(e)}))
        written.append(e)
    with pytest.raises(ConfigError):
        with output_session("converge", str(folder), MPI.COMM_SELF, "a", on_error):
            raise ConfigError("study.values", "refused")
    assert tree(folder) == before and not written
    with pytest.raises(ConfigError):
        with output_session("converge", str(folder), MPI.COMM_SELF, "a", on_error) as begin:
            begin()
            (folder / "ensemble.csv").write_text("rows")
            raise ConfigError("study.seed_keys", "members 0 and 1 gave the same errors")
    assert summary_of(folder)["status"] == "bad_input" and (folder / "ensemble.csv").exists()
    assert (folder / PREVIOUS / "summary.json").read_text() == "earlier"


def test_nothing_below_a_held_previous_folder_is_touched(tmp_path):
    """A folder below out/previous/ is not an output folder either, and a run that
    opens out/ does not replace a previous/ below which a run holds a folder."""
    cfg, out = trained(tmp_path)
    run_cli(["forward", cfg], cwd=str(tmp_path))
    proc = run_cli(["forward", cfg, "--set", f"output.dir={out / PREVIOUS / 'sub'}"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"output.dir: {out / PREVIOUS / 'sub'} lies in {out / PREVIOUS}, where the run")
    write_lock(out / PREVIOUS / "sub", os.getpid(), socket.gethostname())
    before = tree(out)
    proc = run_cli(["forward", cfg], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"output.dir: {out / PREVIOUS / 'sub'} is in use by pdeformer train")
    assert tree(out) == before


def test_inputs_through_links_and_the_config_itself_stay(tmp_path):
    """A heads file reached through a link, and the config file itself, count as what
    the run reads: a link to out/params_0002.npz, or a config in out/previous/, refuse
    the run rather than lose the file."""
    cfg, out = trained(tmp_path)
    os.symlink(out / "params_0002.npz", tmp_path / "heads.npz")
    before = tree(out)
    proc = run_cli(["forward", cfg, "--set", f"model.params={tmp_path / 'heads.npz'}"], cwd=str(tmp_path),
                   check=False)
    check_one_line_error(proc, f"model.params: {tmp_path / 'heads.npz'} is a file of the earlier run")
    run_cli(["forward", cfg], cwd=str(tmp_path))                    # the training into previous/
    (out / PREVIOUS / "run.toml").write_text(open(cfg).read())
    before = tree(out)
    proc = run_cli(["forward", str(out / PREVIOUS / "run.toml"), "--set", f"output.dir={out}"],
                   cwd=str(tmp_path), check=False)
    check_one_line_error(proc, f"the config file: {out / PREVIOUS / 'run.toml'} lies in {out / PREVIOUS}/")
    assert tree(out) == before


def test_a_stale_lock_taken_by_another_run_meanwhile_is_put_back(tmp_path):
    """Two runs judge the same lock stale; the first replaces it with its own: the
    second moves that new lock aside, sees it is not the one it judged, and puts it back."""
    from pdeformer.tools.outdir import _identity, _remove_stale
    lock = tmp_path / LOCK
    lock.write_text("stale")
    os.utime(lock, (time.time() - STALE_AFTER - 60,) * 2)
    judged = _identity(os.stat(lock))
    os.remove(lock)                     # the first run took it over (its inode may be reused) ...
    lock.write_text("fresh lock")       # ... and holds the folder
    _remove_stale(str(lock), judged)
    assert lock.read_text() == "fresh lock" and os.listdir(tmp_path) == [LOCK]
    _remove_stale(str(lock), _identity(os.stat(lock)))
    assert os.listdir(tmp_path) == []


def test_seeds_that_change_the_run_in_less_common_ways(tmp_path):
    """data.teacher_seed redraws the student's start where model.init = 'teacher' (no
    objective needed); data.seed redraws the prompts, which a reference run once cannot
    follow; a budget's drawn width reference must be above the transformer's heads too."""
    from pdeformer.commands.study import unused_seed
    from pdeformer.model.config import load_config
    cfg = load_config(os.path.join(ROOT, "runs", "teacher.toml"),
                      ["objective.kind=\"potential\"", "model.init=\"teacher\"", "model.init_noise=0.1"])
    assert unused_seed("data.teacher_seed", cfg, {"forward"}) is None
    assert unused_seed("model.seed", cfg, {"forward"}) is None      # it draws the noise
    write_config(tmp_path, CONFIG)
    study = write_config(tmp_path, STUDY.replace("quantities", "seed_keys = [\"model.seed\", \"data.seed\"]\n"
                                                 "quantities"), "study.toml")
    drawn = write_config(tmp_path, CONFIG.split("[[prompts]]")[0] + "[data]\ncount = 2\nteacher_seed = 1\n",
                         "drawn.toml")
    proc = run_cli(["converge", study, "--set", f"study.run=\"{drawn}\"", "study.reference=\"run\"",
                    f"study.reference_run=\"{drawn}\"", "study.reference_set=[\"mesh.cells=[12,12]\"]"],
                   check=False)
    check_one_line_error(proc, "study.seed_keys: data.seed redraws the prompts, but a reference = 'run' is run once")
