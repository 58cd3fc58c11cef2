"""The training studies of docs/training.md: a teacher-student study against the Gram
prediction, and SGD against full-batch gradient descent on a data set.

    python runs/studies/training.py teacher-student [--np 2]   # ~25 min on 2 cores
    python runs/studies/training.py sgd [--np 2]               # ~40 min on 2 cores

Parameters: runs/studies/teacher_student.toml (2 prompts, mixtures of 3 Gaussians, a
student at teacher + 0.05 noise, full-batch gd) and runs/studies/sgd.toml (80 prompts,
16 held out). The script runs the pdeformer commands under mpirun (ntk, gram, train),
reads their files, and writes docs/training/<study>.png and <study>.md; the numbers
quoted in docs/training.md come from those tables. Output folders are under
runs/studies/output/.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DOCS = os.path.join(ROOT, "docs", "training")
OUT = os.path.join(HERE, "output")


# ------------------------------------------------------------------ running pdeformer

def pdeformer(np_: int, *args: str) -> None:
    """One pdeformer command under mpirun with np_ ranks (quiet); stops on failure."""
    exe = os.path.join(ROOT, ".venv", "bin", "pdeformer")
    if not os.path.exists(exe):
        exe = shutil.which("pdeformer") or exe
    cmd = ([exe] if np_ == 1 else
           ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(np_), exe]) + list(args) + ["-q"]
    print("$", " ".join(cmd[cmd.index(exe):]), flush=True)
    subprocess.run(cmd, cwd=HERE, check=True)


def load(folder: str, name: str):
    path = os.path.join(OUT, folder, name)
    if name.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]}


def fitted_rate(steps: np.ndarray, risk: np.ndarray) -> float:
    """-slope of log R over the given steps (least squares): the exponential rate per step."""
    return -float(np.polyfit(steps, np.log(risk), 1)[0])


# ------------------------------------------------------------------ teacher-student

PLATEAU = 1e-3   # the Gaussian case: the part of the initial risk put into the lost directions
TITLES = {"mixtures": "mixtures of 3 Gaussians (LSE: independent)",
          "gaussians": f"single Gaussians (LSE: dependent), {PLATEAU:g} of the risk in lost directions"}


def teacher_student(np_: int, steps: int = 300, run: bool = True) -> None:
    """Two cases, each: ntk (the LSE and NTK tests on the prompts), gram at the student's
    start, train, gram at the trained heads; then the table and the figure.

    * mixtures: teacher_student.toml as it is (mixtures of 3 Gaussians);
    * gaussians: single Gaussians, which the LSE test calls dependent: their Gram has 3
      directions below tol^2 lambda_max (tol = 1e-3). A teacher's targets have almost no
      part there (every such transformer's outputs obey the same constraints), so the
      targets are the teacher's plus a part in the lost directions holding PLATEAU of
      the initial risk: written as [[prompts]] with explicit moment targets, the student
      starting from the same heads (its params_0000.npz)."""
    rows = []
    extra = ["data.components=[1,1]", "ntk.tol=1e-3"]
    if not run:   # --replot: the table and figure from the outputs there are
        write_teacher_student([analyse_case(name, TITLES[name], steps) for name in TITLES])
        return
    cases = {"mixtures": ("teacher_student.toml", []), "gaussians": (gaussian_config(np_, extra), ["ntk.tol=1e-3"])}
    for name, (config, sets) in cases.items():
        out = f"output/ts_{name}"
        ntk_sets = sets if name == "mixtures" else extra
        pdeformer(np_, "ntk", "teacher_student.toml", "--set", f"output.dir={out}_ntk", *ntk_sets)
        pdeformer(np_, "gram", config, "--set", f"output.dir={out}_gram", *sets, f"train.steps={steps}")
        pdeformer(np_, "train", config, "--set", f"output.dir={out}", *sets, f"train.steps={steps}")
        trained = os.path.join(OUT, f"ts_{name}", f"params_{steps:04d}.npz")
        end = [f"model.params={trained}"] + (['model.init="random"', "model.init_noise=0.0"] if name == "mixtures" else [])
        pdeformer(np_, "gram", config, "--set", f"output.dir={out}_gram_end", *sets, *end, "train.steps=0")
        rows.append(analyse_case(name, TITLES[name], steps))
    write_teacher_student(rows)


def gaussian_config(np_: int, extra: list[str]) -> str:
    """The Gaussian case's run file (see teacher_student): the student's start heads from a
    0-step training, the Gram there, targets y* + e u with u the lost directions' unit
    vector along the residual's part there (or their first) and e^2 / (2S) = PLATEAU x
    the initial risk."""
    base = "output/ts_gaussians_start"
    pdeformer(np_, "train", "teacher_student.toml", "--set", f"output.dir={base}", *extra, "train.steps=0")
    pdeformer(np_, "gram", "teacher_student.toml", "--set", f"output.dir={base}_gram", *extra, "train.steps=0")
    summary = load("ts_gaussians_start", "summary.json")
    gram = load("ts_gaussians_start_gram", "gram.json")
    arrays = np.load(os.path.join(OUT, "ts_gaussians_start_gram", "gram.npz"))
    lam, U = np.linalg.eigh(arrays["G"])
    lost = U[:, lam <= gram["tol"] ** 2 * lam.max()]
    r = arrays["y"] - arrays["ystar"]
    u = lost @ (lost.T @ r)
    u = u / np.linalg.norm(u) if np.linalg.norm(u) > 0 else lost[:, 0]
    S = len(summary["config"]["prompts"])
    e = math.sqrt(2 * S * PLATEAU * gram["risk"])
    targets = (arrays["ystar"] + e * u).reshape(S, -1)
    cfg = summary["config"]
    d = len(cfg["mesh"]["lower"])
    text = [f"# written by runs/studies/training.py: the Gaussian case of the teacher-student study",
            "[mesh]", *_toml_items(cfg["mesh"], ("lower", "upper", "cells")),
            "[discretisation]", *_toml_items(cfg["discretisation"], ("limiter", "steps_per_layer")),
            "[model]", f'params = "{os.path.join(OUT, "ts_gaussians_start", "params_0000.npz")}"',
            "[attention]", *_toml_items(cfg["attention"], ("tol",)),
            "[objective]", 'kind = "moments"',
            "[train]", *_toml_items(cfg["train"], ("lr", "optimizer", "checkpoint_every", "output_every")),
            "[output]", 'dir = "output/ts_gaussians"', "fields = false"]
    for p, y in zip(cfg["prompts"], targets):
        mean, var, off = y[:d], y[d:2 * d], y[2 * d:] / math.sqrt(2)
        cov = np.diag(var)
        cov[np.triu_indices(d, 1)] = off
        cov = np.triu(cov) + np.triu(cov, 1).T
        text += ["[[prompts]]", f'name = "{p["name"]}"', f'kind = "{p["kind"]}"', f"weights = {p['weights']}",
                 f"means = {p['means']}", f"covs = {p['covs']}",
                 f"target = {{ mean = {mean.tolist()}, cov = {cov.tolist()} }}"]
    path = os.path.join(HERE, "output", "ts_gaussians.toml")
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")
    return path


def _toml_items(table: dict, keys) -> list[str]:
    return [f"{k} = {json.dumps(table[k])}" for k in keys]


def analyse_case(name: str, title: str, steps: int) -> dict:
    ntk = load(f"ts_{name}_ntk", "ntk.json")
    start, end = load(f"ts_{name}_gram", "gram.json"), load(f"ts_{name}_gram_end", "gram.json")
    h = load(f"ts_{name}", "history.csv")
    predicted = np.asarray(start["predicted_risk"])
    plateau = start["plateau"]
    # once the fast modes are gone: from the first step where the predicted approach to
    # the plateau runs within 1% of its asymptotic rate (and at least half way), to the end
    local = -np.diff(np.log(predicted - plateau))
    target = start["asymptotic_rate"]
    late = int(np.argmax(np.abs(local - target) <= 0.01 * target)) if target else steps // 2
    above = h["risk"] - plateau
    window = (h["step"] >= max(late, steps // 2)) & (above > 0)
    observed = fitted_rate(h["step"][window], above[window])
    return {"name": name, "title": title, "lse_ratio": ntk["lse"]["ratio"],
            "lse_independent": ntk["lse"]["independent"], "ntk_ratio": ntk["ntk"]["ratio"],
            "outputs": start["outputs"], "gram_ratio": start["ratio"], "lost": start["lost_directions"],
            "tol": start["tol"], "lr": start["lr"], "a_lambda_max": start["step_factor"] * start["eigenvalues"][0],
            "risk0": float(h["risk"][0]), "risk_end": float(h["risk"][-1]), "fall": float(h["risk"][0] / h["risk"][-1]),
            "window": [int(h["step"][window][0]), int(h["step"][window][-1])],
            "observed_rate": observed, "predicted_rate": target, "predicted_rate_end": end["asymptotic_rate"],
            "plateau": plateau, "plateau_end": end["plateau"], "end_over_plateau": float(h["risk"][-1] / plateau)
            if plateau > 0 else None,
            "steps": h["step"].tolist(), "risk": h["risk"].tolist(), "predicted": predicted.tolist()}


def write_teacher_student(rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(DOCS, exist_ok=True)
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), constrained_layout=True)
    for ax, r in zip(np.atleast_1d(axes), rows):
        k = np.asarray(r["steps"])
        ax.semilogy(k, r["risk"], "o", ms=2, label="observed (train)")
        ax.semilogy(np.arange(len(r["predicted"])), r["predicted"], "-", lw=1,
                    label="Gram prediction (at the start)")
        if r["predicted_rate"]:
            k0, k1 = r["window"]
            ref = r["plateau"] + (r["risk"][k0] - r["plateau"]) * np.exp(-r["predicted_rate"] * (k[k0:] - k0))
            ax.semilogy(k[k0:], ref, "--", lw=1, label=f"rate {r['predicted_rate']:.4g}/step (Gram)")
        if r["lost"]:
            ax.axhline(r["plateau"], color="C3", ls=":", label=f"plateau of {r['lost']} lost directions")
        ax.set_title(r["title"], fontsize=9)
        ax.set_xlabel("gd step", fontsize=8)
        ax.set_ylabel("risk", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(os.path.join(DOCS, "teacher_student.png"), dpi=110)
    plt.close(fig)
    lines = ["| prompts | LSE σ_min/σ_max | Gram λ_min/λ_max | lost (tol) | lr·L·H·λ_max/S | risk: start → end (fall) "
             "| rate observed (steps) | rate predicted: start / end | plateau predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['title']} | {r['lse_ratio']:.2e} | {r['gram_ratio']:.2e} | {r['lost']} ({r['tol']:g}) | "
            f"{r['a_lambda_max']:.3g} | {r['risk0']:.3e} → {r['risk_end']:.3e} ({r['fall']:.3g}×) | "
            f"{r['observed_rate']:.4g} ({r['window'][0]}–{r['window'][1]}) | "
            f"{_num(r['predicted_rate'])} / {_num(r['predicted_rate_end'])} | {r['plateau']:.3e} |")
    with open(os.path.join(DOCS, "teacher_student.md"), "w") as f:
        f.write("# A teacher-student study\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(DOCS, "teacher_student.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k not in ("steps", "risk", "predicted")} for r in rows], f, indent=2)
    print("\n".join(lines))


def _num(x) -> str:
    return "—" if x is None else f"{x:.4g}"


# ------------------------------------------------------------------ SGD vs full batch

SGD_RUNS = {   # name: (label, --set values)
    "full": ("full batch", ["train.test_every=1"]),
    "sgd": ("SGD, batch 8", ["train.batch_size=8"]),
    "sgd_T": ("SGD, T = 1e-6", ["train.batch_size=8", "train.temperature=1e-6"]),
    "sgd_T2": ("SGD, T = 1e-5", ["train.batch_size=8", "train.temperature=1e-5"]),
    "sgd_wd": ("SGD, λ = 1e-3", ["train.batch_size=8", "train.weight_decay=1e-3"]),
    "sgd_wd2": ("SGD, λ = 1e-2", ["train.batch_size=8", "train.weight_decay=1e-2"]),
}


def sgd(np_: int, run: bool = True) -> None:
    """Every run of SGD_RUNS for the same number of epochs (the same number of per-prompt
    gradients), then the table and the figure."""
    rows = []
    for name, (label, extra) in SGD_RUNS.items():
        if run:
            pdeformer(np_, "train", "sgd.toml", "--set", f"output.dir=output/sgd_{name}", *extra,
                      f"parallel.prompt_groups={np_}")
        h = load(f"sgd_{name}", "history.csv")
        s = load(f"sgd_{name}", "summary.json")
        rows.append({"name": name, "label": label, "history": h, "summary": s})
    write_sgd(rows)


def write_sgd(rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(DOCS, exist_ok=True)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    lines = ["| run | steps | train risk: start → end | test risk: start → end | best test risk (epoch) | wall time |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        h, s = r["history"], r["summary"]
        known = np.isfinite(h["test_risk"])
        epoch = (h["epoch"] if "epoch" in h else h["step"])[known]
        train = h["train_risk"][known] if "train_risk" in h else h["risk"][known]
        test = h["test_risk"][known]
        ax0.semilogy(epoch, train, "-", color=f"C{i}", label=r["label"])
        ax1.semilogy(epoch, test, "-", color=f"C{i}", label=r["label"])
        best = int(np.argmin(test))
        lines.append(f"| {r['label']} | {int(h['step'][-1])} | {train[0]:.3e} → {train[-1]:.3e} | "
                     f"{test[0]:.3e} → {test[-1]:.3e} | {test[best]:.3e} ({epoch[best]:.0f}) | "
                     f"{s['timings']['total']:.0f} s |")
    for ax, what in ((ax0, "train risk (all training prompts)"), (ax1, "test risk (held-out prompts)")):
        ax.set_title(what, fontsize=9)
        ax.set_xlabel("epoch", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(os.path.join(DOCS, "sgd.png"), dpi=110)
    plt.close(fig)
    with open(os.path.join(DOCS, "sgd.md"), "w") as f:
        f.write("# Minibatches, noise and weight decay\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", choices=("teacher-student", "sgd", "all"))
    p.add_argument("--np", type=int, default=2, help="MPI ranks (default 2)")
    p.add_argument("--replot", action="store_true", help="only the tables and figures, from the outputs")
    args = p.parse_args(argv)
    if args.study in ("teacher-student", "all"):
        teacher_student(args.np, run=not args.replot)
    if args.study in ("sgd", "all"):
        sgd(args.np, run=not args.replot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
