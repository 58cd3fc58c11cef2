"""Bad and adversarial inputs, tried as a careless or hostile user would: how each run ends.

    python benchmarks/bad_inputs.py > table.md                (~10 minutes on 2 cores)
    python benchmarks/bad_inputs.py --ranks 1 --only lost     (one class, serially)

Every case runs the CLI in a fresh folder, serially and under ``mpirun -n 2`` (cases
without MPI, such as ``pdeformer plot`` and ParaView's script, once), and prints one
Markdown row: the class of defect it probes, the input, per rank count the exit status,
whether a traceback appeared and whether the job ended within the timeout (with its
seconds), and the line that tells the user what happened (the error line, else the
first warning), with what a case's own check found (a folder left as it was, the
summary's status). docs/reliability.md keeps the table of the last run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_train import CONFIG  # noqa: E402  (a small 2-D training problem)

INTERVAL = """
[mesh]
lower = [-3.0]
upper = [3.0]
cells = [1]
[model]
layers = 1
heads = 1
[output]
dir = "out"
fields = false
[[prompts]]
name = "a"
kind = "gaussian_mixture"
means = [[0.0]]
covs = [2.0]
"""

FILES = ("run.toml", "interval.toml", "drawn.toml", "study.toml", "budget.toml", "teacher.toml", "cfl.toml",
         "mixture.toml")


@dataclass
class Case:
    """One input: its class, what it is, the command (words; ``pdeformer`` for the CLI),
    a set-up of the case folder, environment variables, a check of what the run left
    (folder -> a note), and whether it runs without MPI (once) or only under mpirun."""

    kind: str
    what: str
    args: list
    setup: Callable | None = None
    env: dict = field(default_factory=dict)
    check: Callable | None = None
    serial: bool = False
    parallel: bool = False   # only under mpirun (prompt groups)
    expect: str = ""         # the warning to show (the first one holding this), if no error


def pdeformer(*args) -> list:
    return ["pdeformer", *args]


def snapshot(folder: str) -> dict:
    """{path: bytes} below ``folder`` (without the lock)."""
    out = {}
    for dp, _, fn in os.walk(folder):
        for f in fn:
            if f != ".pdeformer.lock":
                with open(os.path.join(dp, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(dp, f), folder)] = fh.read()
    return out


def unchanged(sub: str = "out"):
    """A set-up's companion check: the folder ``sub`` is as the set-up left it."""
    def check(folder, kept):
        return "out/ left as it was" if snapshot(os.path.join(folder, sub)) == kept else "out/ CHANGED"
    return check


def status(folder, _kept) -> str:
    try:
        with open(os.path.join(folder, "out", "summary.json")) as f:
            return f"summary.json: {json.load(f)['status']}"
    except (OSError, ValueError, KeyError):
        return "no summary.json"


def run_quietly(*words, cwd):
    cmd = [sys.executable, "-m", "pdeformer", *words]
    subprocess.run(cmd, cwd=cwd, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def cases(tmp: str) -> list[Case]:
    out = ["--set", "output.dir=out"]
    run = "run.toml"
    rng = np.random.default_rng(0)

    def heads(name, scale=1.0, **extra):
        def setup(folder):
            np.savez(os.path.join(folder, name), **{n: scale * rng.normal(size=(2, 2, 2, 2)) for n in "QKV"}, **extra)
        return setup

    def checkpoint(kind):
        def setup(folder):
            run_quietly("train", "run.toml", "--set", "train.steps=1", cwd=folder)
            path = os.path.join(folder, "out", "checkpoint.npz")
            with np.load(path) as f:
                data = {k: np.array(f[k]) for k in f.files}
            meta = json.loads(str(data["meta"]))
            if kind == "shape":
                data["Q"] = data["Q"][0]
            elif kind == "fingerprint":
                del meta["fingerprint"]
            elif kind == "rng":
                meta["rng"]["state"]["state"] = "damaged"
            elif kind == "history":
                meta["history"][0]["risk"] = "damaged"
            data["meta"] = np.array(json.dumps(meta))
            np.savez(path, **data)
            return snapshot(os.path.join(folder, "out"))
        return setup

    def trained(then=None):
        """A training in out/ (then a forward run: the training in out/previous/)."""
        def setup(folder):
            run_quietly("train", "run.toml", "--set", "train.steps=2", cwd=folder)
            if then:
                run_quietly(*then, cwd=folder)
            return snapshot(os.path.join(folder, "out"))
        return setup

    def trained_and_held(folder):
        trained(("forward", "run.toml"))(folder)
        lock(os.path.join(folder, "out"), os.getpid())
        return snapshot(os.path.join(folder, "out"))

    def refused_once(folder):
        kept = trained()(folder)
        run_quietly("train", "run.toml", "--restart", "--set", "model.seed=4", cwd=folder)
        return kept

    def lock(where, pid, age=0.0, text=None):
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, ".pdeformer.lock")
        with open(path, "w") as f:
            f.write(text if text is not None else json.dumps(
                {"pid": pid, "host": os.uname().nodename, "command": "train", "started": "2026-12-03T00:00:00+00:00"}))
        if age:
            os.utime(path, (time.time() - age, time.time() - age))

    def locked(folder):
        lock(os.path.join(folder, "out"), os.getpid())

    def write(name, text):
        def setup(folder):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        return setup

    def both(*setups):
        def setup(folder):
            kept = None
            for s in setups:
                kept = s(folder) or kept
            return kept
        return setup

    def garbage_h5(folder):
        write("run.toml", CONFIG.replace("lower = [-3.0, -3.0]\nupper = [3.0, 3.0]\ncells = [10, 10]",
                                         'file = "m.xdmf"'))(folder)
        write("m.xdmf", '<?xml version="1.0"?><Xdmf Version="3.0"><Domain><Grid Name="mesh">'
                        '<Topology TopologyType="Triangle" NumberOfElements="2" NodesPerElement="3">'
                        '<DataItem Dimensions="2 3" Format="HDF">m.h5:/Mesh/mesh/topology</DataItem>'
                        '</Topology><Geometry GeometryType="XY"><DataItem Dimensions="4 2" Format="HDF">'
                        'm.h5:/Mesh/mesh/geometry</DataItem></Geometry></Grid></Domain></Xdmf>')(folder)
        with open(os.path.join(folder, "m.h5"), "wb") as f:
            f.write(b"not an hdf5 file" * 64)

    drawn = write("drawn.toml", CONFIG.split("[[prompts]]")[0] + "[data]\ncount = 3\nteacher_seed = 1\n")

    def empty_data_file(folder):
        drawn(folder)
        os.makedirs(os.path.join(folder, "data"))
        x = np.linspace(-2, 2, 7)
        points = np.stack(np.meshgrid(x, x), -1).reshape(-1, 2)
        np.savez(os.path.join(folder, "data", "a.npz"), points=points, density=np.exp(-np.sum(points**2, axis=1)))
        open(os.path.join(folder, "data", "b.csv"), "w").close()

    study = "[study]\nrun = \"run.toml\"\nparameter = \"mesh.cells\"\nvalues = [[6, 6], [8, 8]]\n" \
            "reference = \"finest\"\nquantities = [\"mean\"]\nseeds = 2\n"
    budget = (f"[budget]\nrun = \"{ROOT}/runs/default.toml\"\nset = [\"model.depth=\\\"smooth\\\"\"]\n"
              "transformer = [2, 2, 100]\nlayers = [1, 2]\nlayers_reference = 4\nheads = [2, 4]\n"
              "width_reference = \"draw\"\nwidth_reference_heads = 1\ntokens = [50, 100]\n"
              "cells = [[4, 4], [8, 8]]\ncells_reference = [16, 16]\nseeds = 2\n")
    teacher = (CONFIG.split("[[prompts]]")[0].replace("steps_per_layer = 8", "steps_per_layer = 2")
               + "[data]\ncount = 2\nteacher = \"teacher.npz\"\n")
    cfl = write("cfl.toml", CONFIG.replace("steps_per_layer = 8\n", ""))

    def flee(folder):
        cfl(folder)
        np.savez(os.path.join(folder, "flee.npz"), Q=np.zeros((2, 2, 2, 2)), K=np.ones((2, 2, 2, 2)),
                 V=np.tile(10 * np.eye(2), (2, 2, 1, 1)))

    def fifo(folder):
        os.mkfifo(os.path.join(folder, "pipe"))

    def nan_params(folder):
        trained()(folder)
        path = os.path.join(folder, "out", "params_0002.npz")
        with np.load(path) as f:
            data = {k: np.array(f[k]) for k in f.files}
        data["Q"][0, 0, 0, 0] = np.nan
        np.savez(path, **data)

    def paraview_run(folder):
        run_quietly("forward", "run.toml", "--set", "output.fields=true", cwd=folder)

    home = {"HOME": "/proc/none", "XDG_CACHE_HOME": "/proc/none"}
    pv = shutil.which("pvbatch") is not None and shutil.which("xvfb-run") is not None
    pvbatch = ["xvfb-run", "-a", "-s", "-screen 0 1280x1024x24", "pvbatch", "out/paraview.py"]
    flee_set = ["model.params=\"flee.npz\"", "discretisation.limiter=true", "train.steps=1"]
    seeds = "study.set=[\"model.params=\\\"heads.npz\\\"\"]"
    return [
        # runs lost: a run never deletes or moves what it reads, nor another run's files;
        # a refused command changes nothing
        Case("lost", "heads file `out/previous/params_0002.npz` of the folder the run writes into",
             pdeformer("forward", run, *out, "model.params=out/previous/params_0002.npz"),
             trained(("forward", "run.toml")), check=unchanged()),
        Case("lost", "heads file `out/params_0002.npz` (a file the run would move aside)",
             pdeformer("forward", run, *out, "model.params=out/params_0002.npz"), trained(), check=unchanged()),
        Case("lost", "a run into `out/previous/` while another run holds `out/`",
             pdeformer("forward", run, "--set", "output.dir=out/previous"), trained_and_held, check=unchanged()),
        Case("lost", "a second refused `train --restart` (checkpoint of another problem)",
             pdeformer("train", run, "--restart", "--set", "model.seed=4"), refused_once, check=unchanged()),
        Case("lost", "`--restart` with a checkpoint whose Q has one layer's shape",
             pdeformer("train", run, "--restart", *out), checkpoint("shape"), check=unchanged()),
        Case("lost", "`--restart` with a checkpoint without its fingerprint",
             pdeformer("train", run, "--restart", *out), checkpoint("fingerprint"), check=unchanged()),
        Case("lost", "a second run into a folder in use (live lock)", pdeformer("forward", run, *out), locked),
        # silent results: members that differ, references that answer the same question
        Case("silent", "`converge` ensemble, `model.seed` redrawn with `model.params` given",
             pdeformer("converge", "study.toml", "--set", seeds, "study.seed_keys=[\"model.seed\"]"),
             both(write("study.toml", study), heads("heads.npz"))),
        Case("silent", "`converge` ensemble, default seed keys with `model.params` given",
             pdeformer("converge", "study.toml", "--set", seeds), both(write("study.toml", study), heads("heads.npz"))),
        Case("silent", "`converge`, `model.layers` as a seed key",
             pdeformer("converge", "study.toml", "--set", "study.seed_keys=[\"model.layers\"]"),
             write("study.toml", study)),
        Case("silent", "`reference_run` with another prompt name",
             pdeformer("converge", "study.toml", "--set", "study.reference=\"run\"", "study.reference_run=\"run.toml\"",
                       "study.reference_set=[\"mesh.cells=[12,12]\",\"prompts[0].name=\\\"c\\\"\"]"),
             write("study.toml", study)),
        Case("silent", "`reference_run` with another prompt mean",
             pdeformer("converge", "study.toml", "--set", "study.reference=\"run\"", "study.reference_run=\"run.toml\"",
                       "study.reference_set=[\"mesh.cells=[12,12]\",\"prompts[1].means=[[0.0,0.0]]\"]"),
             write("study.toml", study)),
        Case("silent", "`reference_run` coarser than the sweep",
             pdeformer("converge", "study.toml", "--set", "study.reference=\"run\"", "study.reference_run=\"run.toml\"",
                       "study.reference_set=[\"mesh.cells=[7,7]\"]"), write("study.toml", study)),
        Case("silent", "`budget`: a 1-head draw as the H → ∞ reference of a [2, 4] sweep",
             pdeformer("budget", "budget.toml"), write("budget.toml", budget)),
        Case("silent", "a teacher whose target pass blows up (`train`)",
             pdeformer("train", "teacher.toml", *out), both(write("teacher.toml", teacher), heads("teacher.npz", 5.0)),
             check=status),
        Case("silent", "the same, `--prompt-groups 2`",
             pdeformer("train", "teacher.toml", *out, "--prompt-groups", "2"),
             both(write("teacher.toml", teacher), heads("teacher.npz", 5.0)), check=status, parallel=True),
        Case("silent", "`paraview.py --screenshot DIR/x.png` into a missing folder" + ("" if pv else " (no pvbatch here)"),
             pvbatch + ["--screenshot", "nowhere/x.png"] if pv else ["true"], paraview_run, serial=True),
        Case("silent", "a forward run whose whole prompt leaves the box",
             pdeformer("forward", "cfl.toml", *out, *flee_set), flee, check=status),
        Case("silent", "a training on such a prompt", pdeformer("train", "cfl.toml", *out, *flee_set), flee,
             check=status),
        # hangs: files opened without blocking, checks in O(n log n), blow-ups caught
        Case("hang", "`[data] count = 1000000` (one component each)",
             pdeformer("forward", "runs/teacher.toml", *out, "data.count=1000000", "data.components=[1,1]")),
        Case("hang", "`PDEFORMER_COSTS` naming a FIFO", pdeformer("forward", run, *out), fifo,
             env={"PDEFORMER_COSTS": "pipe"}),
        Case("hang", "`PDEFORMER_COSTS=/dev/zero`", pdeformer("forward", run, *out), env={"PDEFORMER_COSTS": "/dev/zero"}),
        Case("hang", "a config file that is a FIFO", pdeformer("forward", "pipe"), fifo),
        Case("hang", "`train.temperature = 1e6` on 16² cells",
             pdeformer("train", "cfl.toml", *out, "train.temperature=1e6", "mesh.cells=[16,16]"), cfl),
        Case("hang", "`train.weight_decay = 1e6`", pdeformer("train", "cfl.toml", *out, "train.weight_decay=1e6"), cfl),
        # tracebacks
        Case("traceback", "a mixture of 10000 components", pdeformer("forward", "mixture.toml", *out),
             write("mixture.toml", CONFIG.split("[[prompts]]")[0] + "[[prompts]]\nname = \"many\"\n"
                   "kind = \"gaussian_mixture\"\n" + f"means = {[[0.0, 0.5]] * 10000}\ncovs = {[0.25] * 10000}\n"
                   "target = { mean = [0.0, 0.5], cov = 0.3 }\n")),
        Case("traceback", "a checkpoint whose RNG state is damaged (fingerprint intact)",
             pdeformer("train", run, "--restart", *out, "train.steps=3"), checkpoint("rng"), check=unchanged()),
        Case("traceback", "a checkpoint whose history row is damaged",
             pdeformer("train", run, "--restart", *out, "train.steps=3"), checkpoint("history"), check=unchanged()),
        Case("traceback", "a lock whose pid is `inf`", pdeformer("forward", run, *out),
             lambda f: lock(os.path.join(f, "out"), 0, text='{"pid": Infinity, "host": "x", "command": "train", '
                                                            '"started": "y"}')),
        Case("traceback", "a lock whose pid is 10^30", pdeformer("forward", run, *out),
             lambda f: lock(os.path.join(f, "out"), 10**30)),
        Case("traceback", "`study.bandwidth = 1e-300`", pdeformer("converge", "study.toml"),
             write("study.toml", '[study]\nrun = "run.toml"\ncommand = "particles"\nparameter = "particles.tokens"\n'
                                 'values = [100, 200]\nquantities = ["mmd"]\nbandwidth = 1e-300\n')),
        Case("traceback", "`pdeformer plot` of a run whose params file holds NaN",
             pdeformer("plot", "out"), nan_params, serial=True),
        Case("traceback", "`paraview.py --time abc`" + ("" if pv else " (no pvbatch here)"),
             pvbatch + ["--time", "abc"] if pv else ["true"], paraview_run, serial=True),
        Case("traceback", "HOME and XDG_CACHE_HOME that cannot be written", pdeformer("forward", run, *out), env=home,
             expect="XDG_CACHE_HOME"),
        # messages that name the wrong thing
        Case("message", "drawn data set, `std_range` far below the cell size",
             pdeformer("forward", "drawn.toml", *out, "data.std_range=[1e-4,2e-4]"), drawn),
        Case("message", "drawn data set, `mean_range` off the mesh",
             pdeformer("forward", "drawn.toml", *out, "data.mean_range=[50.0,60.0]"), drawn),
        Case("message", "drawn data set, `components = [100000, 100000]`, `count = 20`",
             pdeformer("forward", "drawn.toml", *out, "data.components=[100000,100000]", "data.count=20"), drawn),
        Case("message", "a 0-byte file in a data folder",
             pdeformer("forward", "drawn.toml", *out, "data.count=0", 'data.folder="data"'), empty_data_file),
        Case("message", "ntk, `b_range = 1e200`", pdeformer("ntk", "runs/ntk/prompts.toml", *out, "ntk.b_range=1e200")),
        Case("message", "ntk, `head_scale = 1e100`",
             pdeformer("ntk", "runs/ntk/prompts.toml", *out, "ntk.head_scale=1e100")),
        Case("message", "a sphere of radius 1e-9",
             pdeformer("forward", "runs/sphere.toml", *out, "mesh.radius=1e-9", "mesh.refinements=2",
                       "output.fields=false")),
        Case("message", "`attention.beta = 1e308`", pdeformer("forward", run, *out, "attention.beta=1e308")),
        Case("message", "a lock of this host, pid 1, untouched for 3 days", pdeformer("forward", run, *out),
             lambda f: lock(os.path.join(f, "out"), 1, age=3 * 86400), expect="stale lock"),
        Case("message", "a lock that is a folder", pdeformer("forward", run, *out),
             lambda f: os.makedirs(os.path.join(f, "out", ".pdeformer.lock"))),
        Case("message", "a params file with an array `weights`", pdeformer("forward", run, *out, "model.params=w.npz"),
             heads("w.npz", weights=np.full((2, 2), 0.5))),
        # general bad inputs
        Case("general", "`steps_per_layer = 1`, `init_scale = 5` (a blow-up without NaN), forward",
             pdeformer("forward", "runs/default.toml", *out, "mesh.cells=[16,16]", "discretisation.steps_per_layer=1",
                       "model.init_scale=5", "output.fields=false")),
        Case("general", "`mesh.cells = [10000, 10000]`", pdeformer("forward", run, *out, "mesh.cells=[10000,10000]")),
        Case("general", "`particles.tokens = 1e8`", pdeformer("particles", run, *out, "particles.tokens=100000000")),
        Case("general", "a 250-character prompt name", pdeformer("forward", run, *out, f'prompts[0].name="{"a" * 250}"')),
        Case("general", "mmd bandwidth 1e-300",
             pdeformer("gradient", run, *out, 'objective.kind="mmd"', "objective.bandwidth=1e-300")),
        Case("general", "`pdeformer converge <a directory>`", pdeformer("converge", "runs")),
        Case("general", "a 1-cell 1-D mesh", pdeformer("forward", "interval.toml"), write("interval.toml", INTERVAL)),
        Case("general", "a garbage .h5 beside the mesh's .xdmf", pdeformer("forward", run, *out), garbage_h5),
        Case("general", "a very narrow prompt (covariance 1e-8)",
             pdeformer("forward", run, *out, "prompts[0].covs=[1e-8, 1e-8]")),
        Case("general", "a mixture weight of 1e308", pdeformer("forward", run, *out, "prompts[0].weights=[1e308, 1.0]")),
        Case("general", "`attention.tol = 1e-30`", pdeformer("forward", run, *out, "attention.tol=1e-30")),
        Case("general", "`--walltime nan`", pdeformer("train", run, "--walltime", "nan", *out)),
        Case("general", "a box that cuts the prompts' tails (outflow)",
             pdeformer("forward", run, *out, "mesh.lower=[-2,-2]", "mesh.upper=[2,2]")),
    ]


def command(case: Case, folder: str, ranks: int) -> list:
    """The words to run: the CLI through this Python (under mpirun for ranks > 1), the
    case's files made absolute."""
    words = [os.path.join(folder, w) if w in FILES or w == "pipe" else w for w in case.args]
    if words and words[0] == "pdeformer":
        words = [sys.executable, "-m", "pdeformer", *words[1:]]
        if ranks > 1:
            sys.path.insert(0, ROOT)
            from pdeformer.tools.parallel import mpirun_command
            words = mpirun_command(ranks) + words
    return words


def run_case(case: Case, folder: str, ranks: int, timeout: float) -> tuple[str, str]:
    """(status cell, what the user reads) of one case in a fresh ``folder``."""
    os.makedirs(folder)
    with open(os.path.join(folder, "run.toml"), "w") as f:
        f.write(CONFIG)
    kept = case.setup(folder) if case.setup else None
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: os.path.join(folder, v) if v == "pipe" else v for k, v in case.env.items()})
    words = command(case, folder, ranks)
    cwd = ROOT if any(w.startswith("runs") for w in words) else folder
    words = [w.replace("output.dir=out", f"output.dir={folder}/out") for w in words]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(words, cwd=cwd if words[0] != "xvfb-run" else folder, capture_output=True,
                           text=True, timeout=timeout, env=env)
        code, text, ended = p.returncode, p.stdout + p.stderr, True
    except subprocess.TimeoutExpired:
        code, text, ended = None, "", False
    seconds = time.perf_counter() - t0
    lines = [ln for ln in text.splitlines() if ln.startswith("pdeformer: error:")] or \
        [ln for ln in text.splitlines() if ln.startswith("warning:") and case.expect in ln][:1] or \
        ["(runs; no warning)"]
    say = lines[0].replace("|", "\\|").replace(folder, "…").replace("a" * 250, "aaa…(250 a)")
    if case.check is not None:
        say += f" [{case.check(folder, kept)}]"
    cell = (f"{code}{', traceback' if 'Traceback' in text else ''}, "
            + (f"ended ({seconds:.1f} s)" if ended else f"NOT ENDED ({timeout:.0f} s)"))
    return cell, say


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--only", nargs="+", default=None, help="classes: lost silent hang traceback message general")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdeformer-bad-")
    heads = " | ".join(f"{r} rank{'s' if r > 1 else ''}" for r in args.ranks)
    print(f"| class | input | {heads} | what the user reads |")
    print("|---" * (3 + len(args.ranks)) + "|")
    try:
        for i, case in enumerate(cases(tmp)):
            if args.only and case.kind not in args.only:
                continue
            cells, say = [], None
            for ranks in args.ranks:
                if (case.serial and ranks > 1) or (case.parallel and ranks == 1):
                    cells.append("—")
                    continue
                cell, line = run_case(case, os.path.join(tmp, f"case{i}-{ranks}"), ranks, args.timeout)
                cells.append(cell)
                say = say or line
            print(f"| {case.kind} | {case.what} | {' | '.join(cells)} | {say} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
