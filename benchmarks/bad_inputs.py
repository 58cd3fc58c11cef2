"""Bad and adversarial inputs, tried as a new user would: how each run ends.

    python benchmarks/bad_inputs.py > table.md      (~2 minutes on 2 cores)

Every case runs the CLI in a fresh folder (serially, or under mpirun -n 2 where the
case is about ranks) and prints one Markdown row: the input, the exit status, whether a
traceback appeared, whether the job ended within the timeout, and the line that tells the
user what happened (the error line, else the first warning). docs/reliability.md keeps
the table of the last run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

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


def pdeformer(*args, nprocs=1):
    cmd = [sys.executable, "-m", "pdeformer", *args]
    if nprocs > 1:
        from pdeformer.tools.parallel import mpirun_command
        cmd = mpirun_command(nprocs) + cmd
    return cmd


def cases(tmp):
    """(input, command, setup) triples; setup prepares files in the case folder."""
    run = os.path.join(tmp, "run.toml")

    def checkpoint(kind):
        def setup(folder):
            subprocess.run(pdeformer("train", run, "--set", f"output.dir={folder}/out",
                                      "train.steps=1"), capture_output=True)
            path = os.path.join(folder, "out", "checkpoint.npz")
            with np.load(path) as f:
                data = {k: np.array(f[k]) for k in f.files}
            if kind == "shape":
                data["Q"] = data["Q"][0]
            else:
                meta = json.loads(str(data["meta"]))
                del meta["fingerprint"]
                data["meta"] = np.array(json.dumps(meta))
            np.savez(path, **data)
        return setup

    def garbage_h5(folder):
        with open(os.path.join(folder, "run.toml"), "w") as f:
            f.write(CONFIG.replace("lower = [-3.0, -3.0]\nupper = [3.0, 3.0]\ncells = [10, 10]",
                                  'file = "m.xdmf"'))
        with open(os.path.join(folder, "m.xdmf"), "w") as f:
            f.write('<?xml version="1.0"?><Xdmf Version="3.0"><Domain><Grid Name="mesh">'
                    '<Topology TopologyType="Triangle" NumberOfElements="2" NodesPerElement="3">'
                    '<DataItem Dimensions="2 3" Format="HDF">m.h5:/Mesh/mesh/topology</DataItem>'
                    '</Topology><Geometry GeometryType="XY"><DataItem Dimensions="4 2" Format="HDF">'
                    'm.h5:/Mesh/mesh/geometry</DataItem></Geometry></Grid></Domain></Xdmf>')
        with open(os.path.join(folder, "m.h5"), "wb") as f:
            f.write(b"not an hdf5 file" * 64)

    def huge_heads(folder):
        rng = np.random.default_rng(0)
        Q = rng.normal(size=(2, 2, 2, 2))
        Q[0, 0, 0, 0] = 1e308
        np.savez(os.path.join(folder, "huge.npz"), Q=Q, K=rng.normal(size=(2, 2, 2, 2)),
                 V=rng.normal(size=(2, 2, 2, 2)))

    def locked(folder):
        os.makedirs(os.path.join(folder, "out"))
        with open(os.path.join(folder, "out", ".pdeformer.lock"), "w") as f:
            json.dump({"pid": os.getpid(), "host": os.uname().nodename, "command": "train",
                       "started": "2026-12-03T00:00:00+00:00"}, f)

    def interval(folder):
        with open(os.path.join(folder, "interval.toml"), "w") as f:
            f.write(INTERVAL)

    out = ["--set", "output.dir=out"]
    return [
        ("`steps_per_layer = 1`, `init_scale = 5` (a blow-up without NaN), forward",
         pdeformer("forward", "runs/default.toml", "--set", "mesh.cells=[16,16]",
                   "discretisation.steps_per_layer=1", "model.init_scale=5", "output.fields=false",
                   "output.dir=out"), None),
        ("the same, `train`", pdeformer("train", "runs/default.toml", "--set", "mesh.cells=[16,16]",
                                         "discretisation.steps_per_layer=1", "model.init_scale=5",
                                         "output.dir=out"), None),
        ("`--restart` with a checkpoint whose Q has one layer's shape",
         pdeformer("train", run, "--restart", *out), checkpoint("shape")),
        ("`--restart` with a checkpoint without its fingerprint",
         pdeformer("train", run, "--restart", *out), checkpoint("fingerprint")),
        ("a second run into a folder in use (live lock)", pdeformer("forward", run, *out), locked),
        ("`mesh.cells = [10000, 10000]`", pdeformer("forward", run, *out, "mesh.cells=[10000,10000]"), None),
        ("`particles.tokens = 1e8`", pdeformer("particles", run, *out, "particles.tokens=100000000"), None),
        ("L·H·key_dim huge (500 × 20000 × 1024)",
         pdeformer("forward", run, *out, "model.layers=500", "model.heads=20000", "model.key_dim=1024"), None),
        ("a 250-character prompt name", pdeformer("forward", run, *out, f'prompts[0].name="{"a" * 250}"'), None),
        ("mmd bandwidth 1e-300", pdeformer("gradient", run, *out, 'objective.kind="mmd"',
                                           "objective.bandwidth=1e-300"), None),
        ("`pdeformer converge <a directory>`", pdeformer("converge", "runs"), None),
        ("a 1-cell 1-D mesh on 2 ranks", pdeformer("forward", "interval.toml", nprocs=2), interval),
        ("a garbage .h5 beside the mesh's .xdmf", pdeformer("forward", "run.toml", *out), garbage_h5),
        ("a very narrow prompt (covariance 1e-8)", pdeformer("forward", run, *out, "prompts[0].covs=[1e-8, 1e-8]"), None),
        ("a mixture weight of 1e308", pdeformer("forward", run, *out, "prompts[0].weights=[1e308, 1.0]"), None),
        ("a head parameter of 1e308 (params file)", pdeformer("forward", run, *out, 'model.params="huge.npz"'),
         huge_heads),
        ("`attention.tol = 1e-30`", pdeformer("forward", run, *out, "attention.tol=1e-30"), None),
        ("`--walltime nan`", pdeformer("train", run, "--walltime", "nan", *out), None),
        ("`--walltime 1-00:00:00` (a day, SLURM's form)",
         pdeformer("train", run, "--walltime", "1-00:00:00", *out, "train.steps=1"), None),
        ("a box that cuts the prompts' tails (outflow)",
         pdeformer("forward", run, *out, "mesh.lower=[-2,-2]", "mesh.upper=[2,2]"), None),
        ("fixed steps past the stability limit (`steps_per_layer = 2`)",
         pdeformer("forward", run, *out, "discretisation.steps_per_layer=2", "model.init_scale=2"), None),
    ]


def main():
    tmp = tempfile.mkdtemp(prefix="pdeformer-bad-")
    with open(os.path.join(tmp, "run.toml"), "w") as f:
        f.write(CONFIG)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print("| input | exit | traceback | ended | what the user reads |")
    print("|---|---|---|---|---|")
    try:
        for i, (what, cmd, setup) in enumerate(cases(tmp)):
            folder = os.path.join(tmp, f"case{i}")
            os.makedirs(folder)
            shutil.copy(os.path.join(tmp, "run.toml"), folder)
            if setup:
                setup(folder)
            cmd = [os.path.join(folder, c) if c in ("interval.toml", "run.toml") else c for c in cmd]
            cmd = [c.replace('"huge.npz"', f'"{folder}/huge.npz"') for c in cmd]
            cwd = ROOT if any(c.startswith("runs") for c in cmd) else folder
            cmd = [c.replace("output.dir=out", f"output.dir={folder}/out") for c in cmd]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
                status, text, ended = p.returncode, p.stdout + p.stderr, "yes"
            except subprocess.TimeoutExpired:
                status, text, ended = None, "", "NO (timeout)"
            lines = [l for l in text.splitlines() if l.startswith("pdeformer: error:")] or \
                [l for l in text.splitlines() if l.startswith("warning:")][-1:] or ["(runs; no warning)"]
            say = lines[0].replace("|", "\\|").replace(tmp, "…").replace("a" * 250, "aaa…(250 a)")
            print(f"| {what} | {status} | {'yes' if 'Traceback' in text else 'no'} | {ended} "
                  f"({time.perf_counter() - t0:.1f} s) | {say} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
