"""Prompt groups and the parallel accounting: 1, 2, 3 and 4 ranks (oversubscribed) with
G = 1, 2, 3, 4 prompt groups give the same diagnostics, risks, gradient and training
history (and the same particle model); bad group counts and a breakdown in one group end
every rank; summary.json's ``parallel`` section."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest

from conftest import requires_dolfinx, run_cli, write_config
from conftest import ROOT, check_one_line_error, run_script


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

config, laplace, groups = sys.argv[1], sys.argv[2] == "laplace", [int(g) for g in sys.argv[3:]]
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
                        ("train", run.run_train)) if laplace else ():
        cfg = load_config(config, [f"output.dir=laplace_{command}_{tag}", f"parallel.prompt_groups={G}",
                                   'attention.backend="laplace"', "attention.tol=1e-9",
                                   "output.fields=false", "output.plots=false"])
        fn(cfg, comm)
'''

# one rank; the mesh split over 2; three one-rank groups (4 prompts: 2, 1, 1); two groups
# of two ranks (the mesh split inside each)
LAUNCHES = {1: [1], 2: [1], 3: [3], 4: [2]}
# the laplace runs where their tables' rows are shared: two groups of two ranks (and the
# one-rank reference)
LAPLACE = (1, 4)


def _launch(tmp_path, cfg, P, groups):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = run_script(script, [cfg, "laplace" if P in LAPLACE else "direct", *groups], P, cwd=tmp_path,
                      env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
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
    """forward, gradient, train, particles --gradient on 1-4 ranks in prompt groups (LAUNCHES;
    the laplace backend's forward, gradient and train on LAPLACE):
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

            if P not in LAPLACE:
                continue
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


class FakeClock:
    """time.perf_counter and time.process_time of a process whose work the test says:
    ``busy(s)`` advances both, ``sleep(s)`` the wall clock alone."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def busy(self, seconds):
        self.wall += seconds
        self.cpu += seconds

    def sleep(self, seconds):
        self.wall += seconds


def test_timer_counts_each_phases_compute_and_communication(monkeypatch):
    """A phase's compute CPU is its process time outside metered communication, its comm
    time the wall time inside it: a busy loop counts as compute, a sleep as neither, a
    busy loop inside a metered section as communication; an enclosing phase holds both
    (on a clock the test drives, so the figures are exact)."""
    import time
    from mpi4py import MPI
    from pdeformer.tools.parallel import Meter, Timer
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", lambda: clock.wall)
    monkeypatch.setattr(time, "process_time", lambda: clock.cpu)
    meter = Meter()
    timer = Timer(meter)
    with timer.phase("outer"):
        with timer.phase("busy"):
            clock.busy(0.1)
        with timer.phase("asleep"):
            clock.sleep(0.2)
        with timer.phase("waiting"), meter:
            clock.busy(0.3)
    rows = timer.by_rank(MPI.COMM_SELF)
    cpu = {k: v[0] for k, v in rows["phase_compute_cpu_s"].items()}
    comm = {k: v[0] for k, v in rows["phase_comm_s"].items()}
    expected_cpu = {"outer": 0.1, "busy": 0.1, "asleep": 0.0, "waiting": 0.0}
    expected_comm = {"outer": 0.3, "busy": 0.0, "asleep": 0.0, "waiting": 0.3}
    assert cpu == pytest.approx(expected_cpu, abs=1e-12) and comm == pytest.approx(expected_comm, abs=1e-12)
    assert timer.phases == pytest.approx({"outer": 0.6, "busy": 0.1, "asleep": 0.2, "waiting": 0.3}, abs=1e-12)


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
    the same on any partition) on 32² cells: its gradient run on 1, 2 and 3 ranks takes
    the same steps and tables and gives the same risks and gradient to 1e-10 (a forward
    run takes the gradient's steps: tests/test_cli.py). A fine grid of 97 points on one
    rank and 98 on two would move the risk by about 6e-9."""
    config = os.path.join(ROOT, "runs", "default.toml")
    found = {}
    for P in (1, 2, 3):
        out = tmp_path / f"P{P}"
        run_cli(["gradient", config, "--set", f"output.dir={out}", "mesh.cells=[32,32]",
                 "output.fields=false"], nprocs=P)
        with open(out / "summary.json") as f:
            summary = json.load(f)
        with np.load(out / "gradient.npz") as g:
            gradient = np.concatenate([g[k].ravel() for k in ("dQ", "dK", "dV")])
        found[P] = (summary, gradient)
    summary, gradient = found[1]
    attention = summary["attention"]
    assert attention["laplace"] > 0 and attention["direct"] == 0
    for P in (2, 3):
        other, other_gradient = found[P]
        for key in ("step_counts", "stats"):
            assert other[key] == summary[key], (P, key)
        assert {k: other["attention"][k] for k in ("laplace", "largest_grid", "searches")} == \
            {k: attention[k] for k in ("laplace", "largest_grid", "searches")}, P
        for name, risk in summary["risks"].items():
            assert abs(other["risks"][name] - risk) <= 1e-10 * risk, (P, name)
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
    script, out = tmp_path / "sums.py", tmp_path / "out.json"
    script.write_text(SUMS_SCRIPT)
    proc = run_script(script, [out], nprocs, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in json.loads(out.read_text()):
        assert rank["exact"] and rank["same_bits"] and rank["isolated"], rank
        assert rank["refused"] == [True, True], rank
        assert rank["close"] <= 4 * 2.0**-52, rank
        if nprocs > 1:
            assert rank["calls"] == [1] * 8 and np.allclose(rank["bytes"], 1.0), rank
        else:
            assert rank["calls"] == [0] * 8, rank
        assert rank["meters"] == [0, int(nprocs > 1), True], rank


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
