"""Clustering on the circle and the sphere: the study of docs/sphere.md.

    .venv/bin/python benchmarks/clustering.py                 # both spheres, beta = 1, 4, 9
    .venv/bin/python benchmarks/clustering.py --shapes circle --betas 4 --out /tmp/c

Tokens on S^1 or S^2 under one attention head per layer with Q = K = V = I (A = I) at
inverse temperature beta, run to time T (L layers of V = T I: depth t in [0, 1] is the
time t T of Geshkovski et al.). The prompt is the uniform density with a small seeded
perturbation (``harmonics``, modes l = 1..4 with coefficients 0.2 on S^1 and 0.1 on S^2, random signs: above the sampling noise 1/sqrt(N) of the particle runs): the uniform density
is stationary but unstable (every mode grows, docs/sphere.md), so clusters form, and
then merge. For every (shape, beta) it runs the mesh model (``pdeformer forward``, with
field series) and the particle model at several N (``pdeformer particles``, tokens drawn
from the same prompt), and reports

* the order parameter |int u rho| over time (mesh and particles),
* the time at which one cluster has formed: the first frame with order >= ORDER_ONE,
* density snapshots (the run's own densities.png) and a ParaView screenshot of the
  last frame of the sphere (``paraview.py --screenshot``, where pvbatch and xvfb-run are
  installed).

It writes ``clustering.md`` (the table), ``clustering.png`` (order against time) and the
runs' folders under ``--out`` (default runs/output/clustering).
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdeformer.tools.parallel import mpirun_command  # noqa: E402

ORDER_ONE = 0.9          # order parameter at which one cluster counts as formed
LAYERS = 20              # layers of V = T I (frames at every layer end)
SETTINGS = {   # shape: (mesh keys, time T, particle counts, d)
    "circle": ({"shape": "circle", "cells": [256]}, 40.0, [100, 1000, 10000], 2),
    "sphere": ({"shape": "sphere", "refinements": 3}, 20.0, [100, 1000, 4000], 3),
}
PERTURBATION = {   # small random-signed modes l = 1..4 of the uniform density
    2: [[l, s * l, 0.2] for l in range(1, 5) for s in (1, -1)],
    3: [[l, m, 0.1] for l in range(1, 5) for m in (-1, 0, 1)],
}


def heads_file(folder: str, d: int, T: float) -> str:
    """Q = K = I, V = T I in every layer, one head."""
    eye = np.broadcast_to(np.eye(d), (LAYERS, 1, d, d))
    path = os.path.join(folder, f"heads_d{d}.npz")
    np.savez(path, Q=eye, K=eye, V=T * eye)
    return path


def config(folder: str, shape: str, beta: float) -> str:
    mesh, T, _, d = SETTINGS[shape]
    rng = np.random.default_rng(7)
    coefficients = [[l, m, c * float(rng.choice([-1, 1]))] for l, m, c in PERTURBATION[d]]
    mesh_lines = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in mesh.items())
    text = f"""[mesh]
{mesh_lines}

[model]
params = "{heads_file(folder, d, T)}"

[attention]
beta = {beta}

[particles]
seed = 1

[output]
frames_per_layer = 1

[[prompts]]
name = "perturbed_uniform"
kind = "harmonics"
coefficients = {coefficients}
"""
    path = os.path.join(folder, f"{shape}_beta{beta:g}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def run(command: str, cfg: str, out: str, ranks: int, *sets: str) -> list[dict]:
    cmd = mpirun_command(ranks) + [sys.executable, "-m", "pdeformer", command, cfg, "-q",
                                   "--set", f"output.dir={out}", *sets]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    with open(os.path.join(out, "diagnostics.csv")) as f:
        return [{k: (v if k == "prompt" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]


def one_cluster_time(rows: list[dict], T: float) -> float:
    """The first time t T with order >= ORDER_ONE (nan if none)."""
    for r in rows:
        if r["order"] >= ORDER_ONE:
            return r["t"] * T
    return float("nan")


def screenshot(folder: str) -> str | None:
    """paraview.py's last frame as PNG, where pvbatch and xvfb-run exist."""
    if not (shutil.which("pvbatch") and shutil.which("xvfb-run")):
        return None
    png = os.path.join(folder, "paraview.png")
    subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x1024x24", "pvbatch", "paraview.py",
                    "--screenshot", png], cwd=folder, capture_output=True, timeout=600)
    return png if os.path.exists(png) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["circle", "sphere"])
    ap.add_argument("--betas", nargs="+", type=float, default=[1.0, 4.0, 9.0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "output", "clustering"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    table = ["| domain | beta | T | model | one cluster at t T (order >= %g) | final order |" % ORDER_ONE,
             "|---|---|---|---|---|---|"]
    curves = {}
    for shape in args.shapes:
        _, T, counts, _ = SETTINGS[shape]
        for beta in args.betas:
            cfg = config(args.out, shape, beta)
            case = f"{shape}_beta{beta:g}"
            runs = {"mesh": run("forward", cfg, os.path.join(args.out, case, "mesh"), args.ranks)}
            for n in counts:
                runs[f"N = {n}"] = run("particles", cfg, os.path.join(args.out, case, f"tokens{n}"), args.ranks,
                                       f"particles.tokens={n}", "particles.steps_per_layer=20")
            for model, rows in runs.items():
                table.append(f"| {shape} | {beta:g} | {T:g} | {model} | {one_cluster_time(rows, T):.3g} "
                             f"| {rows[-1]['order']:.3f} |")
                curves[(shape, beta, model)] = (np.array([r["t"] * T for r in rows]),
                                                np.array([r["order"] for r in rows]))
            print("\n".join(table[-len(runs):]), flush=True)
            if shape == "sphere":
                screenshot(os.path.join(args.out, case, "mesh"))
    with open(os.path.join(args.out, "clustering.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    draw(curves, args.shapes, args.betas, os.path.join(args.out, "clustering.png"))
    for shape in args.shapes:
        draw_snapshots(args.out, shape, args.betas, os.path.join(args.out, f"{shape}-snapshots.png"))
    print(f"clustering.md, clustering.png, <shape>-snapshots.png in {args.out}")


def draw(curves: dict, shapes: list, betas: list, path: str) -> None:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(3.2 * len(betas), 2.6 * len(shapes)), layout="constrained")
    axes = fig.subplots(len(shapes), len(betas), squeeze=False)
    for i, shape in enumerate(shapes):
        for j, beta in enumerate(betas):
            ax = axes[i, j]
            for (s, b, model), (t, order) in curves.items():
                if s == shape and b == beta:
                    ax.plot(t, order, "k-" if model == "mesh" else "--", lw=1.5 if model == "mesh" else 1,
                            label=model)
            ax.axhline(ORDER_ONE, color="0.7", lw=0.8)
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{shape}, β = {beta:g}", fontsize=9)
            ax.set_xlabel("time t T", fontsize=8)
            ax.set_ylabel("order |∫ u ρ|", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7)
    fig.savefig(path, dpi=90)


def draw_snapshots(folder: str, shape: str, betas: list, path: str, frames: int = 5) -> None:
    """The mesh densities of every beta at ``frames`` times, on a log scale (clusters are
    orders of magnitude above the rest): the circle against its angle, the sphere on its
    longitude-latitude chart (fields.npz of each run)."""
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from pdeformer.tools.figures import snapshot_frames, sphere_chart_triangles
    from pdeformer.commands.run_files import read_snapshots
    _, T, _, _ = SETTINGS[shape]
    fig = Figure(figsize=(2.4 * frames + 0.8, 1.9 * len(betas)), layout="constrained")
    axes = fig.subplots(len(betas), frames, squeeze=False)
    for i, beta in enumerate(betas):
        snap = read_snapshots(os.path.join(folder, f"{shape}_beta{beta:g}", "mesh", "fields.npz"))
        t = snap["t_0"]
        top = float(np.max(snap["density_0"]))
        norm = LogNorm(vmin=1e-4 * top, vmax=top)
        for j, k in enumerate(snapshot_frames(len(t), frames)):
            ax = axes[i, j]
            if shape == "circle":
                x, y = snap["node_x"].ravel(), snap["nodes_0"][k].ravel()
                order = np.argsort(x)
                ax.semilogy(x[order], np.maximum(y[order], 1e-4 * top), lw=1)
                ax.set_ylim(1e-4 * top, 2 * top)
            else:
                x, tri, cell = sphere_chart_triangles(snap["points"], snap["cells"], np.arange(len(snap["cells"])))
                values = np.maximum(snap["density_0"][k][cell], 1e-4 * top)
                mappable = ax.tripcolor(x[:, 0], x[:, 1], tri, facecolors=values, norm=norm, cmap="viridis",
                                        shading="flat", rasterized=True)
                ax.set_xlim(-180, 180)
                ax.set_ylim(-90, 90)
                ax.set_aspect("equal")
            ax.set_title(f"β = {beta:g}, t T = {t[k] * T:.3g}", fontsize=8)
            ax.tick_params(labelsize=6)
        if shape == "sphere":
            fig.colorbar(mappable, ax=list(axes[i]), shrink=0.9, label="ρ")
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
