"""Prompt groups and the parallel accounting: 1, 2, 3 and 4 ranks (oversubscribed) with
G = 1, 2, 3, 4 prompt groups give the same diagnostics, risks, gradient and training
history (and the same particle model); bad group counts and a breakdown in one group end
every rank; summary.json's ``parallel`` section."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import requires_dolfinx, run_cli, write_config
from conftest import ROOT, check_one_line_error


def benchmark(name: str):
    """The script benchmarks/NAME.py as a module (the benchmarks are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = [requires_dolfinx]

PROMPTS = ("a", "b", "c", "d")
CONFIG = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [12, 12]

[discretisation]
limiter = false
steps_per_layer = 6

[model]
layers = 2
heads = 2
seed = 3
init_scale = 0.8

[attention]
backend = "direct"

[objective]
kind = "moments"

[train]
steps = 2
lr = 0.05

[particles]
tokens = 200
steps_per_layer = 4
points = false

[output]
dir = "out"
velocity = false

[[prompts]]
name = "a"
kind = "gaussian_mixture"
means = [[-0.5, 0.0]]
covs = [0.3]
target = { mean = [0.3, -0.2], cov = [[0.4, 0.1], [0.1, 0.3]] }

[[prompts]]
name = "b"
kind = "gaussian_mixture"
means = [[0.5, 0.3]]
covs = [0.25]
target = { mean = [0.0, 0.5], cov = 0.3 }

[[prompts]]
name = "c"
kind = "uniform"
lower = [-1.0, -0.5]
upper = [0.5, 1.0]
target = { mean = [-0.2, 0.1], cov = 0.2 }

[[prompts]]
name = "d"
kind = "gaussian_mixture"
weights = [1.0, 2.0]
means = [[-0.5, 0.5], [0.6, -0.4]]
covs = [0.2, [[0.3, 0.1], [0.1, 0.2]]]
target = { mean = [0.1, 0.1], cov = 0.35 }
"""

# Under mpirun -n P: forward, gradient and train for every G given, one process for all.
DRIVER = r'''
import logging, sys
from mpi4py import MPI
from pdeformer.model.config import load_config
from pdeformer.tools.parallel import setup_logging
from pdeformer.commands import run

config, groups = sys.argv[1], [int(g) for g in sys.argv[2:]]
comm = MPI.COMM_WORLD
setup_logging(comm, logging.WARNING)
for G in groups:
    tag = f"P{comm.size}G{G}"
    for command, fn in (("forward", run.run_forward), ("gradient", run.run_gradient),
                        ("train", run.run_train),
                        ("particles", lambda cfg, comm: run.run_particles(cfg, comm, gradient=True))):
        cfg = load_config(config, [f"output.dir={command}_{tag}", f"parallel.prompt_groups={G}",
                                   "output.plots=false"]
                          + (["output.fields=false"] if command == "train" else []))
        fn(cfg, comm)
    # the laplace tables (plans, panel windows, row shares, signed weights) likewise
    for command, fn in (("forward", run.run_forward), ("gradient", run.run_gradient),
                        ("train", run.run_train)):
        cfg = load_config(config, [f"output.dir=laplace_{command}_{tag}", f"parallel.prompt_groups={G}",
                                   'attention.backend="laplace"', "attention.tol=1e-9",
                                   "output.fields=false", "output.plots=false"])
        fn(cfg, comm)
'''

LAUNCHES = {1: [1], 2: [1, 2], 3: [1, 3], 4: [1, 2, 4]}


def _launch(tmp_path, cfg, P, groups):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    cmd = [sys.executable, str(script), cfg, *map(str, groups)]
    if P > 1:
        from pdeformer.tools.parallel import mpirun_command
        cmd = mpirun_command(P) + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _read(folder):
    from pdeformer.tools.output import read_diagnostics
    out = {}
    with open(folder / "summary.json") as f:
        out["summary"] = json.load(f)
    if (folder / "diagnostics.csv").exists():
        out["diagnostics"] = read_diagnostics(str(folder / "diagnostics.csv"))
    if (folder / "gradient.npz").exists():
        with np.load(folder / "gradient.npz") as g:
            out["gradient"] = {k: g[k] for k in g.files}
    if (folder / "history.csv").exists():
        with open(folder / "history.csv") as f:
            out["history"] = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return out


def _close(a, b, tol=1e-10):
    return abs(a - b) <= tol


@pytest.mark.mpi
def test_ranks_and_prompt_groups_give_the_same_results(tmp_path):
    """forward, gradient, train, particles --gradient on P = 1..4 ranks with G | P groups:
    diagnostics, risks, gradient and history agree with one rank to 1e-10; every output is
    one file per run; the parallel section names the ranks, groups and their prompts."""
    cfg = write_config(tmp_path, CONFIG)
    for P, groups in LAUNCHES.items():
        _launch(tmp_path, cfg, P, groups)
    ref = {c: _read(tmp_path / f"{c}_P1G1") for c in ("forward", "gradient", "train", "particles")}
    rows = ref["forward"]["diagnostics"]
    assert [r["prompt"] for r in rows] == [p for p in PROMPTS for _ in range(3)]
    assert abs(ref["gradient"]["gradient"]["dV"]).max() > 1e-4      # not trivially zero
    assert abs(ref["particles"]["gradient"]["dV"]).max() > 1e-4
    risks = ref["train"]["history"]
    assert len(risks) == 3 and risks[2]["risk"] < risks[0]["risk"]
    for P, groups in LAUNCHES.items():
        for G in groups:
            tag = f"P{P}G{G}"
            fw = _read(tmp_path / f"forward_{tag}")
            assert len(fw["diagnostics"]) == len(rows), tag
            for ra, rb in zip(rows, fw["diagnostics"]):
                assert ra["prompt"] == rb["prompt"] and ra["t"] == rb["t"], tag
                for k in ra:
                    if k != "prompt":
                        assert _close(ra[k], rb[k]), (tag, k, ra, rb)
            s, s1 = fw["summary"], ref["forward"]["summary"]
            assert s["status"] == "completed" and s["ranks"] == P
            assert _close(s["objective"]["risk"], s1["objective"]["risk"])
            for p in PROMPTS:
                assert _close(s["objective"]["risks"][p], s1["objective"]["risks"][p]), (tag, p)
            assert [r["prompt"] for r in s["final_diagnostics"]] == list(PROMPTS)
            assert [p["name"] for p in s["prompts"]] == list(PROMPTS)
            assert [p["steps"] for p in s["prompts"]] == [12] * 4
            assert s["stats"] == s1["stats"], tag                      # summed over groups
            assert s["attention"]["direct"] == s1["attention"]["direct"], tag
            assert s["files"]["fields"] == [f"density_{p}.pvd" for p in PROMPTS], tag
            par = s["parallel"]
            blocks = [list(b) for b in np.array_split(list(PROMPTS), G)]
            assert par["ranks"] == P and par["groups"] == G and par["group_prompts"] == blocks, par
            assert par["group_of_rank"] == [r // (P // G) for r in range(P)]
            for key in ("compute_cpu_s", "comm_s", "comm_bytes"):
                assert len(par[key]) == P, (tag, key)
            assert min(par["compute_cpu_s"]) > 0, par
            if P > 1:
                assert min(par["comm_bytes"]) > 0 and min(par["comm_s"]) > 0, par
            # per phase and rank: inside the run's totals, nested phases inside theirs
            cpu, comm = par["phase_compute_cpu_s"], par["phase_comm_s"]
            assert set(cpu) == set(comm) >= {"forward", "velocity", "transport"}, (tag, cpu)
            for r in range(P):
                assert 0 < cpu["velocity"][r] <= cpu["forward"][r] <= par["compute_cpu_s"][r], (tag, r)
                assert 0 <= comm["velocity"][r] <= comm["forward"][r] <= par["comm_s"][r], (tag, r)
                assert (comm["forward"][r] > 0) == (P // G > 1), (tag, r, comm["forward"])
            # each prompt's field series: written by its group, one piece per rank of it
            from pdeformer.tools.output import read_pvd
            for p in PROMPTS:
                frames = read_pvd(str(tmp_path / f"forward_{tag}" / f"density_{p}.pvd"))
                assert len(frames) == 3, (tag, p)
                pieces = 1 if P == G else open(frames[-1][1]).read().count("<Piece ")
                assert pieces == P // G, (tag, p, pieces)

            gr, g1 = _read(tmp_path / f"gradient_{tag}"), ref["gradient"]
            for k in ("dQ", "dK", "dV", "risk"):
                assert np.abs(gr["gradient"][k] - g1["gradient"][k]).max() <= 1e-10, (tag, k)
            for p in PROMPTS:
                assert _close(gr["summary"]["risks"][p], g1["summary"]["risks"][p]), (tag, p)

            tr = _read(tmp_path / f"train_{tag}")
            assert [r["step"] for r in tr["history"]] == [0, 1, 2]
            for ra, rb in zip(risks, tr["history"]):
                for k in ("risk", "grad_norm", "displacement"):
                    assert _close(ra[k], rb[k]), (tag, k, ra, rb)
            assert tr["summary"]["status"] == "completed" and tr["summary"]["parallel"]["groups"] == G

            pa, p1 = _read(tmp_path / f"particles_{tag}"), ref["particles"]
            assert [r["prompt"] for r in pa["diagnostics"]] == [r["prompt"] for r in rows]
            for ra, rb in zip(p1["diagnostics"], pa["diagnostics"]):
                for k in ra:
                    if k not in ("prompt", "min_rho"):
                        assert _close(ra[k], rb[k]), (tag, k, ra, rb)
            for k in ("dQ", "dK", "dV", "risk"):
                assert np.abs(pa["gradient"][k] - p1["gradient"][k]).max() <= 1e-10, (tag, k)
            assert [p["tokens"] for p in pa["summary"]["prompts"]] == [200] * 4

            # laplace: the same to 1e-10 (round-off of rank-dependent sums, the same sizes)
            lf, lf1 = _read(tmp_path / f"laplace_forward_{tag}"), _read(tmp_path / "laplace_forward_P1G1")
            att = lf["summary"]["attention"]
            assert att["direct"] == 0 and att["laplace"] == lf1["summary"]["attention"]["laplace"] > 0, (tag, att)
            assert att["largest_grid"] == lf1["summary"]["attention"]["largest_grid"], (tag, att)
            for ra, rb in zip(lf1["diagnostics"], lf["diagnostics"]):
                for k in ra:
                    if k != "prompt":
                        assert _close(ra[k], rb[k]), (tag, "laplace", k, ra, rb)
            for ra, rb in zip(rows, lf["diagnostics"]):    # and direct summation to its tol
                for k in ("mean_0", "mean_1", "cov_00", "cov_11"):
                    assert abs(ra[k] - rb[k]) < 1e-7, (tag, k, ra, rb)
            lg, lg1 = _read(tmp_path / f"laplace_gradient_{tag}"), _read(tmp_path / "laplace_gradient_P1G1")
            for k in ("dQ", "dK", "dV", "risk"):
                assert np.abs(lg["gradient"][k] - lg1["gradient"][k]).max() <= 1e-10, (tag, k)
            lt, lt1 = _read(tmp_path / f"laplace_train_{tag}"), _read(tmp_path / "laplace_train_P1G1")
            for ra, rb in zip(lt1["history"], lt["history"]):
                for k in ("risk", "grad_norm", "displacement"):
                    assert _close(ra[k], rb[k]), (tag, "laplace", k, ra, rb)


def test_timer_counts_each_phases_compute_and_communication():
    """A phase's compute CPU is its process time outside metered communication, its comm
    time the wall time inside it: a busy loop counts as compute, a sleep as neither, a
    busy loop inside a metered section as communication; an enclosing phase holds both."""
    import time
    from mpi4py import MPI
    from pdeformer.tools.parallel import Meter, Timer

    def busy(seconds):
        t = time.process_time()
        while time.process_time() - t < seconds:
            pass

    meter = Meter()
    timer = Timer(meter)
    with timer.phase("outer"):
        with timer.phase("busy"):
            busy(0.1)
        with timer.phase("asleep"):
            time.sleep(0.1)
        with timer.phase("waiting"), meter:
            busy(0.1)
    rows = timer.by_rank(MPI.COMM_SELF)
    cpu = {k: v[0] for k, v in rows["phase_compute_cpu_s"].items()}
    comm = {k: v[0] for k, v in rows["phase_comm_s"].items()}
    assert 0.1 <= cpu["busy"] < 0.15 and comm["busy"] == 0.0, (cpu, comm)
    assert cpu["asleep"] < 0.02 and comm["asleep"] == 0.0, (cpu, comm)
    assert cpu["waiting"] < 0.02 and comm["waiting"] >= 0.1, (cpu, comm)
    assert cpu["outer"] == pytest.approx(cpu["busy"] + cpu["asleep"] + cpu["waiting"], abs=0.01)
    assert comm["outer"] == pytest.approx(comm["waiting"], abs=1e-6)


@pytest.mark.mpi
def test_bad_prompt_groups_end_every_rank(tmp_path):
    """G that does not divide the ranks, G above the prompt count, G < 1: one line naming
    parallel.prompt_groups, exit status 2, no rank left behind (the timeout)."""
    cfg = write_config(tmp_path, CONFIG)
    proc = run_cli(["forward", cfg, "--prompt-groups", "2"], nprocs=3, check=False, timeout=120)
    check_one_line_error(proc, "parallel.prompt_groups: 2 groups cannot split 3 rank(s)")
    one = write_config(tmp_path, CONFIG.split("[[prompts]]")[0] + "[[prompts]]"
                       + CONFIG.split("[[prompts]]")[1], "one.toml")
    proc = run_cli(["gradient", one, "--prompt-groups", "2"], nprocs=2, check=False, timeout=120)
    check_one_line_error(proc, "parallel.prompt_groups: 2 groups for 1 prompt(s)")
    for args in (["--prompt-groups", "0"], ["--set", "parallel.prompt_groups=-1"]):
        proc = run_cli(["particles", cfg, *args], check=False, timeout=120)
        check_one_line_error(proc, "parallel.prompt_groups: expected an integer")
    proc = run_cli(["ntk", cfg, "--set", "parallel.prompt_groups=2"], nprocs=2, check=False, timeout=120)
    check_one_line_error(proc, "parallel.prompt_groups: ntk runs as one group")


BREAKDOWN = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [8, 8]

[discretisation]
limiter = false

[model]
layers = 2
heads = 2
seed = 3
query_scale = 0.0
init_scale = 1e5

[attention]
backend = "direct"

[output]
dir = "out"
fields = false

[[prompts]]
name = "centred"
kind = "gaussian_mixture"
means = [[0.0, 0.0]]
covs = [0.3]

[[prompts]]
name = "far"
kind = "gaussian_mixture"
means = [[1.5, 1.5]]
covs = [0.3]
"""


@pytest.mark.mpi
def test_a_failure_in_one_group_ends_every_rank(tmp_path):
    """Uniform attention with huge V: the centred prompt (mean ~ 0) barely moves, the
    off-centre one (group 1) needs more than the allowed CFL steps: every rank ends with
    status 3 and the one line; group 0's diagnostics are still written. A prompt outside
    the mesh in group 1 is bad input found in set-up: status 2 on every rank."""
    cfg = write_config(tmp_path, BREAKDOWN)
    # one layer: in a second the centred prompt's mean, amplified by V ~ 1e5, runs off
    # and its density blows up (a breakdown of group 0 would be the one reported)
    proc = run_cli(["forward", cfg, "--prompt-groups", "2", "--set", "model.layers=1"],
                   nprocs=2, check=False, timeout=120)
    check_one_line_error(proc, "prompt 'far', layer 0, t = 0: velocity too large", status=3)
    with open(tmp_path / "out" / "summary.json") as f:
        summary = json.load(f)
    assert summary["status"] == "breakdown" and summary["parallel"]["groups"] == 2
    from pdeformer.tools.output import read_diagnostics
    rows = read_diagnostics(str(tmp_path / "out" / "diagnostics.csv"))
    assert [(r["prompt"], r["t"]) for r in rows] == [("centred", 0.0), ("centred", 1.0), ("far", 0.0)]
    proc = run_cli(["forward", cfg, "--prompt-groups", "2", "--set", "prompts[1].means=[[9.0, 9.0]]",
                    "prompts[1].covs=[0.01]"], nprocs=2, check=False, timeout=120)
    check_one_line_error(proc, "prompts[1] ('far'): the prompt lies outside the mesh")


@pytest.mark.mpi
def test_walltime_guard_is_agreed_across_groups(tmp_path):
    """The walltime decision is rank 0's, broadcast: with two groups every rank stops
    before the same step, and a restart continues to the uninterrupted history."""
    cfg = write_config(tmp_path, CONFIG)
    args = ["train", cfg, "--prompt-groups", "2", "--set", "output.fields=false", "train.steps=3"]
    proc = run_cli(args + ["--walltime", "0.01"], nprocs=2, check=False, timeout=120)
    assert proc.returncode == 0 and "walltime guard" in proc.stderr, proc.stderr
    with open(tmp_path / "out" / "summary.json") as f:
        assert json.load(f)["status"] == "walltime"
    run_cli(args + ["--restart", "--prompt-groups", "1"], nprocs=2)
    with open(tmp_path / "out" / "history.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [0, 1, 2, 3]


@pytest.mark.mpi
def test_the_shipped_config_gives_the_same_results_on_any_rank_count(tmp_path):
    """runs/default.toml as shipped (auto: laplace tables at tol 1e-5, whose sizes, fine
    grids and tile sums are chosen from sums over all ranks and from check points picked
    the same on any partition) on 32² cells: 1, 2 and 3 ranks give the same diagnostics,
    risk and gradient to 1e-10. (A fine grid of 97 points on one rank and 98 on two,
    from check points hashed with the coordinates' last bits, moved the risk by 6e-9.)"""
    from pdeformer.tools.output import read_diagnostics
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "default.toml")
    found = {}
    for P in (1, 2, 3):
        out = tmp_path / f"P{P}"
        for command in ("forward", "gradient"):
            run_cli([command, config, "--set", f"output.dir={out / command}", "mesh.cells=[32,32]",
                     "output.fields=false"], nprocs=P)
        with open(out / "forward" / "summary.json") as f:
            summary = json.load(f)
        with np.load(out / "gradient" / "gradient.npz") as g:
            gradient = np.concatenate([g[k].ravel() for k in ("dQ", "dK", "dV")])
        found[P] = (read_diagnostics(str(out / "forward" / "diagnostics.csv")), summary, gradient)
    rows, summary, gradient = found[1]
    assert summary["attention"]["laplace"] > 0 and summary["attention"]["direct"] == 0
    for P in (2, 3):
        other_rows, other, other_gradient = found[P]
        for a, b in zip(rows, other_rows):
            for k in a:
                if k != "prompt":
                    assert abs(a[k] - b[k]) <= 1e-10 * max(1.0, abs(a[k])), (P, k, a, b)
        assert abs(other["objective"]["risk"] - summary["objective"]["risk"]) <= 1e-10 * summary["objective"]["risk"]
        assert np.abs(other_gradient - gradient).max() <= 1e-10 * np.abs(gradient).max(), P


SUMS_SCRIPT = r'''
import json, sys
import numpy as np
from mpi4py import MPI
from pdeformer.tools.parallel import (RING_BLOCK_BYTES, RING_TAG, MeteredComm,
                                      allreduce_sum, reduce_scatter_sum)
comm = MeteredComm(MPI.COMM_WORLD)
meter = comm.meter
P, r = comm.size, comm.rank
ring = RING_BLOCK_BYTES * P // 8          # doubles from which the sums go round the ring
out = {"exact": True, "same_bits": True, "close": 0.0, "calls": [], "bytes": [], "isolated": True}
stray = np.empty(1)
pending = MPI.COMM_WORLD.Irecv(stray, source=MPI.ANY_SOURCE, tag=RING_TAG)   # must not see the ring
for n in (5, ring - 1, ring + 3, max(40001, 2 * ring)):       # MPI's sums, then the ring's
    x = np.random.default_rng(1000 * n + r).standard_normal(n) * 10.0 ** (r % 3)
    xs = comm.allgather(x)
    # uneven blocks, one of them empty where P > 2
    cuts = np.sort(np.random.default_rng(n).integers(0, n + 1, P - 1))
    if P > 2:
        cuts[0] = cuts[1]
    counts = np.diff(np.concatenate([[0], cuts, [n]]))
    lo = int(counts[:r].sum())
    before = (meter.comm_calls, meter.comm_bytes)
    mine = reduce_scatter_sum(comm, x, counts)
    out["calls"].append(meter.comm_calls - before[0])
    out["bytes"].append((meter.comm_bytes - before[1]) / (8 * n + 8 * counts[r]))
    block = [v[lo:lo + counts[r]] for v in xs]
    if n >= ring and P > 1:      # summed in the ring's order: ranks r+1, .., P-1, 0, .., r
        expected = block[(r + 1) % P].copy()
        for k in range(2, P + 1):
            expected += block[(r + k) % P]
        out["exact"] &= bool(np.array_equal(mine, expected))
    exact = np.sum(np.array(block, dtype=np.longdouble), axis=0)
    scale = np.abs(np.array(block)).sum(axis=0) + 1e-300
    out["close"] = max(out["close"], float(np.max(np.abs(mine - exact) / scale, initial=0.0)))
    y = x.reshape(-1, 1).copy()
    before = (meter.comm_calls, meter.comm_bytes)
    allreduce_sum(comm, y)
    out["calls"].append(meter.comm_calls - before[0])
    out["bytes"].append((meter.comm_bytes - before[1]) / (16 * n))
    exact = np.sum(np.array(xs, dtype=np.longdouble), axis=0)
    scale = np.abs(np.array(xs)).sum(axis=0)
    out["close"] = max(out["close"], float(np.max(np.abs(y[:, 0] - exact) / scale)))
    ys = comm.allgather(y)
    out["same_bits"] &= all(np.array_equal(ys[0], v) for v in ys)
out["isolated"] = not pending.Test()
pending.Cancel()
pending.Wait()
refused = []
for bad in (np.zeros((4, 4), dtype=np.float32), np.zeros((4, 4), order="F")):
    try:
        allreduce_sum(comm, bad)
    except TypeError:
        refused.append(True)
out["refused"] = refused
# meters belong to runs: another metered view of the world counts apart, a split shares
other = MeteredComm(MPI.COMM_WORLD)
mine, theirs = meter.comm_calls, other.meter.comm_calls
other.allreduce(1)
out["meters"] = [meter.comm_calls - mine, other.meter.comm_calls - theirs, comm.Split(r % 2, r).meter is meter]
results = comm.gather(out)
if r == 0:
    json.dump(results, open(sys.argv[1], "w"))
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_sums_over_ranks(tmp_path, nprocs):
    """reduce_scatter_sum and allreduce_sum (MPI's sums for blocks under RING_BLOCK_BYTES
    per rank, the ring's from there on) against the sums in extended precision, to a few
    roundings of the summands' magnitudes (P <= 4 terms: at most 3 roundings, 2^-52
    each); the ring adds each block in its documented order (bit for bit), on its own
    duplicate of the communicator (a receive posted on the communicator with its tag sees
    nothing), allreduce_sum gives every rank the same bits and refuses arrays it cannot
    sum in place, and each counts as one metered call with the bytes of the MPI call it
    replaces; a second metered view of the world counts into its own meter, a split
    communicator into its parent's."""
    from pdeformer.tools.parallel import mpirun_command
    script, out = tmp_path / "sums.py", tmp_path / "out.json"
    script.write_text(SUMS_SCRIPT)
    subprocess.run(mpirun_command(nprocs) + [sys.executable, str(script), str(out)], check=True,
                   timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    for rank in json.loads(out.read_text()):
        assert rank["exact"] and rank["same_bits"] and rank["isolated"], rank
        assert rank["refused"] == [True, True], rank
        assert rank["close"] <= 4 * 2.0**-52, rank
        if nprocs > 1:
            assert rank["calls"] == [1] * 8 and np.allclose(rank["bytes"], 1.0), rank
        else:
            assert rank["calls"] == [0] * 8, rank
        assert rank["meters"] == [0, int(nprocs > 1), True], rank


# ------------------------------------------------------------------ benchmarks/least_communication.py

@pytest.mark.mpi
def test_least_communication_adds_collectives_and_changes_nothing(tmp_path):
    """benchmarks/least_communication.py on 2 copies of a prompt in 2 one-rank groups
    (laplace tables, 24^2): with the least communication one table sum per velocity
    evaluation and one barrier per right-hand side are added (in a gradient also one
    table sum per reverse evaluation and one barrier per reverse right-hand side), with
    the table pipeline a reduce-scatter, a table sum and a gather per evaluation (the
    laplace backend's own calls, which a one-rank group makes without messages); the
    solve itself is the same to the bit as with nothing added."""
    from pdeformer.tools.parallel import mpirun_command
    scaling = benchmark("scaling")
    copies = scaling.copies_config(str(tmp_path), 2)
    script = os.path.join(ROOT, "benchmarks", "least_communication.py")
    runs = {}
    for command, mode in [("forward", "--none"), ("forward", "--least"), ("forward", "--table-pipeline"),
                          ("gradient", "--none"), ("gradient", "--least")]:
        out = tmp_path / f"{command}-{mode.strip('-')}"
        cmd = mpirun_command(2) + [sys.executable, script, *([mode] if mode != "--least" else []),
                                   command, copies, "-q", "--prompt-groups", "2", "--set",
                                   "mesh.cells=[24,24]", 'attention.backend="laplace"', "output.fields=false",
                                   "output.plots=false", f"output.dir={out}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        added = [line for line in proc.stderr.splitlines() if line.startswith("least_communication")]
        runs[command, mode] = (_read(out), added, out)
    summary = runs["forward", "--none"][0]["summary"]
    per_rank = summary["stats"]["velocity_evaluations"] // 2    # one prompt per rank
    assert summary["attention"]["laplace"] == 2 * per_rank

    def added(command, mode) -> dict:
        (line,) = runs[command, mode][1]
        counts = line.split("added per rank: ")[1]
        return {} if counts == "nothing" else {k: int(n) for n, k in (c.split(" ", 1) for c in counts.split(", "))}

    assert added("forward", "--none") == added("gradient", "--none") == {}
    least, pipeline = added("forward", "--least"), added("forward", "--table-pipeline")
    assert least["table sums"] == per_rank and least["barriers"] >= 1, least
    assert "table cotangent sums" not in least and "reverse barriers" not in least, least
    # every evaluation builds its table through panels and samples a fine grid (searches: more)
    assert min(pipeline[k] for k in ("gathers", "reduce-scatters", "table sums")) >= per_rank, pipeline
    assert pipeline["barriers"] == least["barriers"], (pipeline, least)
    for mode in ("--least", "--table-pipeline"):
        assert runs["forward", mode][0]["diagnostics"] == runs["forward", "--none"][0]["diagnostics"]
        assert runs["forward", mode][0]["summary"]["objective"] == summary["objective"]
    # a gradient: the reverse evaluations (one per forward one) and right-hand sides too
    grad = runs["gradient", "--none"][0]["summary"]
    reverse = added("gradient", "--least")
    per_rank = grad["stats"]["velocity_evaluations"] // 2
    assert reverse["table sums"] == reverse["table cotangent sums"] == per_rank, reverse
    assert reverse["reverse barriers"] >= reverse["barriers"] // 2 >= 1, reverse
    plain, least = (np.load(runs["gradient", m][2] / "gradient.npz") for m in ("--none", "--least"))
    assert sorted(plain.files) == sorted(least.files)
    for key in plain.files:
        assert np.array_equal(plain[key], least[key]), key


# ------------------------------------------------------------------ benchmarks/scaling.py

def test_scaling_rounds_set_speedups_beside_the_phases_without_communication():
    """benchmarks/scaling.py's table per round: the wall, solve and compute speedups of the
    round, and how each phase that no rank communicated in (and that takes 5% of the solve
    or more) divided, C_phase(1) / max_r C_phase,r(P). Left out: phases with any
    communication, the solve itself (even where it communicated nothing), small phases, a
    phase the one-rank run lacks, and every phase where the groups have one rank each
    (nothing inside them is metered)."""
    scaling = benchmark("scaling")
    one = {"wall": 12.0, "phase": 10.0, "compute": [10.0], "solve": "forward", "ranks_per_group": 1,
           "phases": {"forward": [10.0], "limiter": [3.0], "velocity": [4.0], "output": [0.1]},
           "phase_comm": {"forward": [0.0], "limiter": [0.0], "velocity": [0.0], "output": [0.0]}}
    two = {"wall": 7.5, "phase": 6.0, "compute": [5.0, 5.2], "solve": "forward", "ranks_per_group": 2,
           "phases": {"forward": [5.0, 5.2], "limiter": [1.5, 1.6], "velocity": [2.5, 2.0],
                      "output": [0.04, 0.05], "checks": [0.6, 0.5]},
           "phase_comm": {"forward": [0.0, 0.0], "limiter": [0.0, 0.0], "velocity": [0.4, 0.0],
                          "output": [0.0, 0.0], "checks": [0.0, 0.0]}}
    assert scaling.quiet_phases(two) == ["limiter", "checks"]
    (line,) = scaling.round_lines("forward128", 2, [one], [two])
    fields = line.split()
    assert fields[:3] == ["forward128", "2", "1"]
    assert [float(f) for f in fields[3:6]] == [1.60, round(10.0 / 6.0, 2), round(10.0 / 5.2, 2)]
    assert fields[6:] == ["limiter", f"{3.0 / 1.6:.2f}x"]
    groups = dict(two, ranks_per_group=1)
    assert scaling.quiet_phases(groups) == []
    assert scaling.round_lines("prompts16", 2, [one], [groups])[0].split()[6:] == []


# ------------------------------------------------------------------ benchmarks/jitter.py

@pytest.mark.mpi
def test_jitter_measures_the_wait_a_late_rank_causes(tmp_path):
    """benchmarks/jitter.py on 2 ranks with rank 0 made 2 ms late per segment (--skew 2):
    rank 1 waits at the barrier for most of those 2 ms on average (its own products of
    64^2 matrices take microseconds), rank 0 much less, and rank 0's segments hold the
    sleep."""
    import re
    from pdeformer.tools.parallel import mpirun_command
    cmd = mpirun_command(2) + [sys.executable, os.path.join(ROOT, "benchmarks", "jitter.py"),
                               "--size", "64", "--products", "1", "--repeat", "60", "--skew", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {int(r): (float(seg), float(wait)) for r, seg, wait in
            re.findall(r"rank (\d): segment\s+([\d.]+) ms.*wait\s+([\d.]+) ms", proc.stdout)}
    assert sorted(rows) == [0, 1], proc.stdout
    assert rows[0][0] >= 2.0, rows                  # the sleep is in rank 0's segment
    assert rows[1][1] >= 1.0 and rows[0][1] < rows[1][1] / 2, rows
    assert "the slowest rank's segment" in proc.stdout


def test_persistence_is_the_correlation_of_a_lead_over_later_segments(monkeypatch):
    """benchmarks/jitter.persistence: for an AR(1) series x_i = phi x_{i-1} + e_i the
    correlation at lag k is phi^k, for independent draws 0. 20,000 draws: the largest
    standard error is the lag-20 one of the AR(1) series, sqrt((1 + phi^2) / (1 - phi^2)
    / 20000) = 0.015 (Bartlett's formula); the bounds are 0.05 (fixed seed)."""
    import pdeformer.tools.blas
    monkeypatch.setattr(pdeformer.tools.blas, "choose_core", lambda: None)   # numpy is loaded
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    jitter = benchmark("jitter")
    rng = np.random.default_rng(3)
    e = rng.standard_normal(20000)
    x = np.empty_like(e)
    x[0] = e[0]
    for i in range(1, len(e)):
        x[i] = 0.8 * x[i - 1] + e[i]
    for lag, c in jitter.persistence(x, (1, 5, 20)):
        assert abs(c - 0.8 ** lag) < 0.05, (lag, c)
    assert all(abs(c) < 0.05 for _, c in jitter.persistence(e, (1, 5, 20)))
    assert jitter.persistence(e[:10], (1, 5, 20)) and not jitter.persistence(e[:6], (5, 20))


# ------------------------------------------------------------------ benchmarks/instructions.py

CALLGRIND_FILE = """version: 1
creator: callgrind-3.19.0
positions: line
events: Ir
summary: 1030

ob=(1) /usr/bin/python3.11
fl=(1) ???
fn=(1) main
0 100
cob=(2) /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so
cfn=(2) dgemm_kernel
calls=3 0
0 700
+2 50

ob=(2)
fn=(2)
0 700
fn=(3) helper
* 30
"""


def test_instruction_counts_are_exclusive_and_sorted_by_kind(tmp_path):
    """benchmarks/instructions.py reads a callgrind file's exclusive costs: the cost line
    after ``calls=`` is the callee's inclusive cost and is not the caller's (main: 100 +
    50, not + 700); compressed names (``ob=(2)``) resolve to the name given first; an
    object's functions stay with it until the next ``ob=``. Object files map to kinds of
    code (MPI's own apart, and libc's locks with it, since a waiting rank spins there)."""
    instructions = benchmark("instructions")
    path = tmp_path / "cg.0.1"
    path.write_text(CALLGRIND_FILE)
    costs = instructions.exclusive_costs(str(path))
    blas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so"
    assert costs == {("/usr/bin/python3.11", "main"): 150, (blas, "dgemm_kernel"): 700, (blas, "helper"): 30}
    assert instructions.by_kind(costs) == {"interpreter": 150, "BLAS": 730}
    assert instructions.dumps(str(tmp_path), 0) == [str(path)]
    assert instructions.dumps(str(tmp_path), 1) == []
    kinds = {"mca_btl_vader.so": "MPI", "libopen-pal.so.40.30.2": "MPI",
             "MPI.cpython-311-x86_64-linux-gnu.so": "MPI", "fine_493963a14942ce02.so": "compiled loops",
             "libffcx_forms_4ea90c236d6a.so": "forms", "cpp.cpython-311-x86_64-linux-gnu.so": "dolfinx",
             "_multiarray_umath.cpython-311-x86_64-linux-gnu.so": "numpy", "libpetsc_real.so.3.18.5": "PETSc",
             "libc.so.6": "libc", "libffi.so.8.1.2": "ctypes", "libcrypto.so.3": "other"}
    assert {name: instructions.kind("/usr/lib/" + name) for name in kinds} == kinds
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"       # MPI's progress loop takes these locks
    assert [instructions.kind(libc, fn) for fn in ("pthread_mutex_lock@@GLIBC_2.2.5",
            "__pthread_mutex_unlock_usercnt", "__memset_avx2_unaligned_erms")] == ["MPI", "MPI", "libc"]


PERF_SCRIPT = """     7f508379e230 [unknown] (/usr/lib/python3/dist-packages/numpy/core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so)
     7f50836cac1f [unknown] (/usr/lib/python3/dist-packages/numpy/core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so)
 ffffffff8160a987 handle_mm_fault ([kernel.kallsyms])
     7f5083d1a0b0 _PyEval_EvalFrameDefault (/usr/bin/python3.11)
     7f5083d1a0b0 __memset_avx2_unaligned_erms (/usr/lib/x86_64-linux-gnu/libc.so.6)

     7f5083d1a0b0 pthread_mutex_lock@@GLIBC_2.2.5 (/usr/lib/x86_64-linux-gnu/libc.so.6)
     7f507b0ef4b4 std::function<int (std::span<double>)>::operator() (/usr/lib/libdolfinx.so.0.5)
"""


def test_perf_samples_are_counted_per_function_and_kind():
    """benchmarks/instructions.py --sampler perf counts ``perf script -F ip,sym,dso``
    lines per (object, function), blank lines skipped, C++ names with parentheses kept
    whole, and sorts them into the same kinds as callgrind's counts, the kernel's
    samples (page faults, MPI's copies) apart."""
    instructions = benchmark("instructions")
    samples = instructions.parse_perf_script(PERF_SCRIPT)
    numpy = "/usr/lib/python3/dist-packages/numpy/core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so"
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    assert samples == {(numpy, "[unknown]"): 2, ("[kernel.kallsyms]", "handle_mm_fault"): 1,
                       ("/usr/bin/python3.11", "_PyEval_EvalFrameDefault"): 1,
                       (libc, "__memset_avx2_unaligned_erms"): 1, (libc, "pthread_mutex_lock@@GLIBC_2.2.5"): 1,
                       ("/usr/lib/libdolfinx.so.0.5", "std::function<int (std::span<double>)>::operator()"): 1}
    assert instructions.by_kind(samples) == {"numpy": 2, "kernel": 1, "interpreter": 1, "libc": 1, "MPI": 1,
                                             "dolfinx": 1}
