"""Record the numbers of every shipped config and study file, and compare two records.

    python benchmarks/compare_runs.py record OUTDIR [--repo PATH] [--cases NAME ...]
    python benchmarks/compare_runs.py compare DIR_A DIR_B [--rtol 1e-12] [--floor 1e-15]

``record`` runs a fixed list of cases (:data:`CASES`) with the pdeformer package of the
checkout at PATH (default: this repository): each run is ``python -m pdeformer ...`` with
``cwd=PATH``, ``PYTHONPATH=PATH`` and one BLAS/OpenMP thread per rank (it refuses to
record if that would import another checkout's pdeformer). The cases cover every config
in ``runs/*.toml`` and ``runs/ntk/*.toml`` and every file in ``runs/studies/`` (run
configs with ``forward``, study files with ``converge``), shrunk with ``--set`` so that
the whole record takes a minute or two; the config with an [objective] also runs
``gradient``, ``train`` and ``particles --gradient``, and its gradient with direct
summation and with the other objectives. Two cases run under ``mpirun -n 2``, each
PARALLEL_REPEATS times: a distributed mesh is numbered in the order MPI messages arrive,
so such runs are reproducible only to round-off, and the repeats measure by how much.
Run k of a case writes into ``OUTDIR/<case>/<k>/run/`` (the run's own files:
diagnostics.csv, summary.json, gradient.npz, history.csv, params_XXXX.npz,
checkpoint.npz, ntk.json, convergence.csv, ...), with ``case.json`` (command line, exit
status, seconds, stderr tail), stdout.txt and stderr.txt beside it; ``OUTDIR/record.json``
names the checkout (commit, dirty), the package imported and the exit statuses. A case
that fails is recorded as failed; the record goes on.

``compare`` matches the cases of two records and, in each, every ``.csv``, ``.json`` and
``.npz`` file of A's run folder with B's:

* CSV: every numeric column (timing columns such as wall_time and seconds left out) and
  the row count; text columns (prompt names, study values) must be equal;
* JSON (summary.json: risks, final diagnostics, step counts, training history, study
  rows; ntk.json): every number, list of numbers and string, except provenance, the
  config, study and budget echoes, file lists, timings, the parallel accounting and
  memory measurements;
* NPZ (gradient.npz, params_XXXX.npz, checkpoint.npz): every numeric array.

The difference of two arrays is max|a - b| / max(max|a|, max|b|, floor): relative to the
array's largest magnitude, with an absolute floor so that arrays of exact zeros (or of
round-off near zero) compare absolutely. NaN equals NaN; a shape or text mismatch is an
infinite difference. With repeated runs, each quantity's difference is the smallest over
the pairs (A_i, B_j), and its run-to-run spread the largest between two runs of one
record. It prints a Markdown table (case, runs, files compared, largest difference and
where, spread, verdict) and each item beyond rtol. Verdicts: same (all within rtol);
noise (beyond rtol, but only where runs of one checkout differ as much among
themselves); DIFFERENT; missing (a case, file, column, array or key of A that B lacks;
what only B has is listed as added); failed (a run exited non-zero). Exit status 1 when
any case is DIFFERENT, missing or failed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------- the cases

SMALL_2D = ("mesh.cells=[16,16]", "model.layers=2", "output.fields=false")
TARGET = '{kind="gaussian_mixture",means=[[0.3,-0.2]],covs=[0.6]}'   # density target
CIRCLE = ("mesh.cells=[64]", "model.layers=2")
SPHERE = ("mesh.refinements=2", "model.layers=2")
BUDGET = ("budget.seeds=3", "budget.groups=1", "budget.layers=[2,4]", "budget.layers_reference=8",
          "budget.heads=[4,16]", "budget.tokens=[100,400]", "budget.checks=[[4,16,400]]",
          "budget.cells=[[6,6],[8,8]]", "budget.cells_reference=[16,16]",
          'budget.set=["model.depth=\\"smooth\\"","mesh.cells=[12,12]","output.fields=false",'
          '"particles.steps_per_layer=2","discretisation.tail_tolerance=1"]')


@dataclass(frozen=True)
class Case:
    """One run: ``pdeformer COMMAND CONFIG [FLAGS] --set SETS`` on RANKS ranks."""
    name: str
    command: str
    config: str                      # relative to the checkout
    sets: tuple = ()
    flags: tuple = ()
    ranks: int = 1


CASES = (
    # runs/default.toml: the one config with an [objective] and a [train] section
    Case("default-forward", "forward", "runs/default.toml", SMALL_2D),
    Case("default-gradient", "gradient", "runs/default.toml", SMALL_2D),
    Case("default-train", "train", "runs/default.toml", SMALL_2D + ("train.steps=3",)),
    Case("default-particles", "particles", "runs/default.toml",
         SMALL_2D + ("particles.tokens=500", "particles.points=false"), ("--gradient",)),
    Case("default-gradient-np2", "gradient", "runs/default.toml", SMALL_2D, ranks=2),
    # the same problem with the direct summation and the other objectives
    Case("default-gradient-direct", "gradient", "runs/default.toml", SMALL_2D + ("attention.backend=direct",)),
    Case("default-gradient-potential", "gradient", "runs/default.toml",
         SMALL_2D + ("objective.kind=potential", "objective.potential=gaussian", "objective.center=[0.5,0.0]")),
    Case("default-gradient-l2", "gradient", "runs/default.toml",
         SMALL_2D + ("objective.kind=l2", f"prompts[0].target={TARGET}", f"prompts[1].target={TARGET}")),
    Case("default-gradient-mmd", "gradient", "runs/default.toml",
         SMALL_2D + ("objective.kind=mmd", "objective.bandwidth=0.7",
                     f"prompts[0].target={TARGET}", f"prompts[1].target={TARGET}")),
    # the other shipped forward configs (reduced as in tests/test_cli.py, DG-2 kept on the disk)
    Case("disk-forward", "forward", "runs/disk.toml", ("model.layers=1", "model.heads=2", "output.fields=false")),
    Case("ball-forward", "forward", "runs/ball.toml", ("model.layers=1", "model.heads=2", "output.fields=false")),
    Case("interval-forward", "forward", "runs/interval.toml",
         ("mesh.cells=[50]", "model.layers=2", "model.heads=4", "output.fields=false")),
    # runs/circle.toml and runs/sphere.toml (reduced): tokens on S^1 and S^2, the mesh
    # model with fields.npz (the charts), its gradient, and the particles' gradient
    Case("circle-forward", "forward", "runs/circle.toml", CIRCLE),
    Case("circle-gradient", "gradient", "runs/circle.toml", CIRCLE + ("output.fields=false",)),
    Case("circle-particles", "particles", "runs/circle.toml",
         CIRCLE + ("output.fields=false", "particles.tokens=400"), ("--gradient",)),
    Case("sphere-forward", "forward", "runs/sphere.toml", SPHERE),
    Case("sphere-gradient", "gradient", "runs/sphere.toml", SPHERE + ("output.fields=false",)),
    Case("sphere-particles", "particles", "runs/sphere.toml",
         SPHERE + ("output.fields=false", "particles.tokens=400"), ("--gradient",)),
    Case("sphere-gradient-np2", "gradient", "runs/sphere.toml", SPHERE + ("output.fields=false",), ranks=2),
    # runs/box.toml (3-D tables) and runs/teacher.toml (a drawn data set, a teacher, SGD)
    Case("box-forward", "forward", "runs/box.toml", ("mesh.cells=[6,6,6]", "model.layers=1", "model.heads=2",
                                                     "output.fields=false")),
    Case("teacher-train", "train", "runs/teacher.toml",
         ("data.count=4", "train.batch_size=2", "mesh.cells=[12,12]", "model.layers=1", "train.epochs=1")),
    Case("teacher-gram", "gram", "runs/teacher.toml",
         ("data.count=4", "train.batch_size=2", "mesh.cells=[12,12]", "model.layers=1")),
    # runs/ntk/prompts.toml: closed forms, and after half the layers (mesh + particles)
    Case("ntk-prompts", "ntk", "runs/ntk/prompts.toml"),
    Case("ntk-prompts-depth-np2", "ntk", "runs/ntk/prompts.toml", ("ntk.depth=0.5",), ranks=2),
    # runs/studies/: the two base run configs, and the studies with fewer/smaller cases
    Case("studies-translation-forward", "forward", "runs/studies/translation.toml"),
    Case("studies-depth-forward", "forward", "runs/studies/depth.toml", ("mesh.cells=[16,16]", "model.layers=4")),
    Case("studies-sgd-train", "train", "runs/studies/sgd.toml",
         ("data.count=6", "train.batch_size=2", "mesh.cells=[12,12]", "model.layers=1", "train.epochs=1")),
    Case("studies-teacher-student-train", "train", "runs/studies/teacher_student.toml",
         ("mesh.cells=[12,12]", "model.layers=2", "train.steps=2")),
    Case("study-budget", "budget", "runs/studies/budget.toml", BUDGET),
    Case("study-mesh", "converge", "runs/studies/mesh.toml", ("study.values=[[8,8],[16,16],[32,32]]",)),
    Case("study-degree", "converge", "runs/studies/degree.toml", ("study.values=[1,2,3]",)),
    Case("study-layers", "converge", "runs/studies/layers.toml",
         ("study.values=[2,4,8]", 'study.set=["mesh.cells=[16,16]"]')),
    Case("study-heads", "converge", "runs/studies/heads.toml",
         ("study.values=[2,8,32]", """study.set=["model.layers=2", 'model.depth="iid"', "mesh.cells=[16,16]"]""")),
    Case("study-particles", "converge", "runs/studies/particles.toml",
         ("study.values=[250,1000,4000]", 'study.set=["model.layers=2", "particles.steps_per_layer=8"]',
          'study.reference_set=["mesh.cells=[24,24]", "model.layers=2"]')),
)

PARALLEL_REPEATS = 3     # multi-rank cases run this often: their run-to-run spread
CASE_TIMEOUT_S = 600
TAIL_CHARS = 2000

# ------------------------------------------------------------------------- record


def mpirun_prefix(ranks: int) -> list[str]:
    """mpirun -n RANKS, with Open MPI's flags for root and more ranks than cores."""
    if ranks == 1:
        return []
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    flags = []
    if "Open MPI" in version:
        flags = ["--oversubscribe"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    return ["mpirun", *flags, "-n", str(ranks)]


def run_env(repo: str) -> dict:
    """The environment of every run: the checkout's package first, one thread per rank."""
    env = dict(os.environ)
    env.update(PYTHONPATH=repo, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def case_argv(case: Case, python: str, outdir: str) -> list[str]:
    """The command line of a case, writing into outdir."""
    return mpirun_prefix(case.ranks) + [python, "-m", "pdeformer", case.command, case.config, "-q",
                                        *case.flags, "--set", *case.sets, f"output.dir={outdir}"]


def text_of(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def run_once(case: Case, repo: str, python: str, folder: str) -> dict:
    """One run of a case into folder/run; case.json, stdout.txt and stderr.txt beside it."""
    os.makedirs(folder)
    argv = case_argv(case, python, os.path.join(folder, "run"))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=repo, env=run_env(repo), capture_output=True, text=True,
                              timeout=CASE_TIMEOUT_S)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", text_of(e.stdout)
        err = text_of(e.stderr) + f"\n(timed out after {CASE_TIMEOUT_S} s)"
    info = {"name": case.name, "argv": argv, "rc": rc, "seconds": round(time.perf_counter() - t0, 3),
            "stderr_tail": err[-TAIL_CHARS:]}
    for name, text in (("stdout.txt", out), ("stderr.txt", err)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "case.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def run_case(case: Case, repo: str, python: str, folder: str) -> dict:
    """All runs of a case (PARALLEL_REPEATS on several ranks) into folder/1, folder/2, ..."""
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    repeats = PARALLEL_REPEATS if case.ranks > 1 else 1
    runs = [run_once(case, repo, python, os.path.join(folder, str(k))) for k in range(1, repeats + 1)]
    return {"ranks": case.ranks, "runs": [{"rc": r["rc"], "seconds": r["seconds"]} for r in runs]}


def checkout_info(repo: str, python: str) -> dict:
    """Commit and dirtiness of the checkout, and which pdeformer a run imports."""
    def git(*args):
        p = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=no")
    imported = subprocess.run([python, "-c", "import pdeformer; print(pdeformer.__file__)"], cwd=repo,
                              env=run_env(repo), capture_output=True, text=True).stdout.strip()
    return {"repo": repo, "commit": git("rev-parse", "HEAD"),
            "dirty": None if status is None else bool(status), "python": python, "pdeformer": imported}


def prepare_outdir(outdir: str) -> None:
    """OUTDIR must be new, empty or an earlier record (whose cases are replaced)."""
    if os.path.isdir(outdir) and os.listdir(outdir) and not os.path.isfile(os.path.join(outdir, "record.json")):
        sys.exit(f"compare_runs: {outdir} is not empty and holds no record.json; choose another folder")
    os.makedirs(outdir, exist_ok=True)


def uncovered(repo: str) -> list[str]:
    """Configs and study files of the checkout that no case runs."""
    shipped = [os.path.relpath(p, repo) for pattern in ("runs/*.toml", "runs/ntk/*.toml", "runs/studies/*.toml")
               for p in glob.glob(os.path.join(repo, pattern))]
    return sorted(set(shipped) - {c.config for c in CASES})


def record(outdir: str, repo: str, names: list[str] | None, python: str) -> int:
    repo, outdir = os.path.abspath(repo), os.path.abspath(outdir)
    unknown = sorted(set(names or ()) - {c.name for c in CASES})
    if unknown:
        sys.exit(f"compare_runs: unknown case(s) {', '.join(unknown)}")
    cases = [c for c in CASES if not names or c.name in names]
    prepare_outdir(outdir)
    info = checkout_info(repo, python)
    if not info["pdeformer"].startswith(repo + os.sep):
        sys.exit(f"compare_runs: the runs would import {info['pdeformer'] or 'no pdeformer'}, not {repo}'s")
    info["started"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"recording {len(cases)} case(s) of {repo} ({info['commit']}, dirty: {info['dirty']}) into {outdir}")
    for config in uncovered(repo):
        print(f"  warning: {config} is in no case: add it to CASES in {os.path.relpath(__file__, ROOT)}")
    t0, results = time.perf_counter(), {}
    for case in cases:
        r = results[case.name] = run_case(case, repo, python, os.path.join(outdir, case.name))
        codes = [run["rc"] for run in r["runs"]]
        state = "ok" if all(rc == 0 for rc in codes) else f"FAILED {codes}"
        print(f"  {case.name:30s} {state:12s} {sum(run['seconds'] for run in r['runs']):7.1f} s"
              f"{f' ({len(codes)} runs)' if len(codes) > 1 else ''}", flush=True)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["cases"] = results
    with open(os.path.join(outdir, "record.json"), "w") as f:
        json.dump(info, f, indent=1)
    failed = [n for n, r in results.items() if any(run["rc"] != 0 for run in r["runs"])]
    print(f"recorded in {info['seconds']} s; {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    return 0

# ------------------------------------------------------------------------- compare


SKIP_KEYS = {"provenance", "config", "files", "study", "budget", "parallel", "memory", "timings", "started", "host", "argv"}
TIMING = {"wall_time", "seconds", "elapsed"}     # CSV columns and JSON keys left out
COMPARED = (".csv", ".json", ".npz")


def array_diff(a, b, floor: float) -> float:
    """max|a - b| / max(max|a|, max|b|, floor); NaN == NaN; shape mismatch -> inf."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        return math.inf
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if np.any(nan_a != nan_b):
        return math.inf
    a, b = np.where(nan_a, 0.0, a), np.where(nan_b, 0.0, b)
    if a.size == 0:
        return 0.0
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return 0.0 if np.array_equal(a, b) else math.inf
    scale = max(np.max(np.abs(a)), np.max(np.abs(b)), floor)
    return float(np.max(np.abs(a - b)) / scale)


def as_float(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def csv_items(path: str) -> dict:
    """{column: values}: numeric columns as float lists, text columns as strings; timing left out."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return {}
    header, body = rows[0], rows[1:]
    items = {"(rows)": [float(len(body))]}
    for i, col in enumerate(header):
        if col in TIMING:
            continue
        values = [r[i] if i < len(r) else "" for r in body]
        numbers = [as_float(v) for v in values]
        items[col] = numbers if all(x is not None for x in numbers) else values
    return items


def numeric_array(value):
    """A (nested) list of numbers as a float array, else None."""
    if not isinstance(value, list) or not value:
        return None
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        return None
    return arr if arr.ndim >= 1 else None


def flatten_json(value, path: str = "") -> dict:
    """{path: leaf}: numbers, strings, None and numeric lists (kept whole); SKIP_KEYS and TIMING left out."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k not in SKIP_KEYS and k not in TIMING:
                out.update(flatten_json(v, f"{path}.{k}" if path else k))
        return out
    if isinstance(value, list) and value and numeric_array(value) is None:
        out = {}
        for i, v in enumerate(value):
            out.update(flatten_json(v, f"{path}[{i}]"))
        return out
    return {path: value}


def json_items(path: str) -> dict:
    with open(path) as f:
        return flatten_json(json.load(f))


def npz_items(path: str) -> dict:
    """Every numeric array (string arrays such as a checkpoint's meta left out)."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files if z[k].dtype.kind in "biuf"}


READERS = {".csv": csv_items, ".json": json_items, ".npz": npz_items}
FILE = object()          # the value of a file's own key in run_items


def leaf_diff(a, b, floor: float) -> float:
    """array_diff for numbers and numeric lists/arrays; anything else must be equal."""
    def numeric(x):
        if isinstance(x, np.ndarray):
            return x
        if isinstance(x, (int, float)):        # bool included: True == 1
            return np.array([x], dtype=float)
        return numeric_array(x) if isinstance(x, list) and all(not isinstance(v, str) for v in x) else None
    na, nb = numeric(a), numeric(b)
    if na is not None and nb is not None:
        return array_diff(na, nb, floor)
    return 0.0 if a == b else math.inf


def run_items(folder: str) -> dict:
    """{"file: item": value} over the compared files of a run folder (previous/ left out)."""
    items = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "previous")
        for name in sorted(filenames):
            ext = os.path.splitext(name)[1]
            if ext in READERS:
                rel = os.path.relpath(os.path.join(dirpath, name), folder)
                items[rel] = FILE        # the file itself: a missing file is reported as such
                items.update({f"{rel}: {k}": v for k, v in READERS[ext](os.path.join(dirpath, name)).items()})
    return items


def pair_diffs(items_a: dict, items_b: dict, floor: float) -> dict:
    """{key: difference} for the keys of A; inf where B lacks the key."""
    return {k: (leaf_diff(v, items_b[k], floor) if k in items_b else math.inf) for k, v in items_a.items()}


def largest(diffs: dict) -> tuple[float, str]:
    key = max(diffs, key=diffs.get, default="")
    return (diffs[key], key) if key and diffs[key] > 0 else (0.0, "")


@dataclass
class CaseResult:
    name: str
    verdict: str
    runs: str = "-"
    files: int = 0
    largest: float = 0.0
    where: str = ""
    spread: float = 0.0
    details: list = field(default_factory=list)


def case_runs(folder: str, name: str, rec: dict) -> list[str]:
    return [os.path.join(folder, name, str(k), "run") for k in range(1, len(rec["cases"][name]["runs"]) + 1)]


def spread_of(runs: list[dict], floor: float) -> dict:
    """{key: largest difference between two runs of one record} (run-to-run noise)."""
    spread = {}
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            for k, d in pair_diffs(runs[i], runs[j], floor).items():
                spread[k] = max(spread.get(k, 0.0), d)
    return spread


def compare_case(name: str, rec_a: dict, rec_b: dict, dir_a: str, dir_b: str, rtol: float,
                 floor: float) -> CaseResult:
    """Each key's difference is the smallest over pairs of runs (A_i, B_j); a difference
    above rtol that the runs of one record also show among themselves is noise."""
    if name not in rec_a["cases"] or name not in rec_b["cases"]:
        return CaseResult(name, "missing", details=[f"case not recorded in {'A' if name not in rec_a['cases'] else 'B'}"])
    failures = failure_details(name, rec_a, rec_b, dir_a, dir_b)
    if failures:
        return CaseResult(name, "failed", details=failures)
    runs_a = [run_items(f) for f in case_runs(dir_a, name, rec_a)]
    runs_b = [run_items(f) for f in case_runs(dir_b, name, rec_b)]
    pairs = [pair_diffs(a, b, floor) for a in runs_a for b in runs_b]
    diffs = {k: min(p[k] for p in pairs) for k in pairs[0]}
    spread_a, spread_b = spread_of(runs_a, floor), spread_of(runs_b, floor)
    spread = {k: max(spread_a.get(k, 0.0), spread_b.get(k, 0.0)) for k in diffs}
    res = CaseResult(name, "same", runs=f"{len(runs_a)}/{len(runs_b)}",
                     files=sum(1 for k, v in runs_a[0].items() if v is FILE and k in runs_b[0]))
    res.largest, res.where = largest({k: d for k, d in diffs.items() if k in runs_b[0]})
    res.spread = largest(spread)[0]
    missing = [k for k in diffs if k not in runs_b[0]]
    gone = {k for k in missing if runs_a[0][k] is FILE}
    added = [k for k in runs_b[0] if k not in runs_a[0]]
    res.details += [f"{k}: missing in B" for k in missing if k in gone or k.split(": ")[0] not in gone]
    res.details += [f"{k}: only in B (added)" for k in added]
    beyond = {k: d for k, d in diffs.items() if d > rtol and k in runs_b[0]}
    res.details += [f"{k} differs by {d:.3g} (run-to-run spread {spread.get(k, 0.0):.3g})" for k, d in beyond.items()]
    if any(d > max(rtol, spread.get(k, 0.0)) for k, d in beyond.items()):
        res.verdict = "DIFFERENT"
    elif missing:
        res.verdict = "missing"
    elif beyond:
        res.verdict = "noise"
    return res


def failure_details(name: str, rec_a: dict, rec_b: dict, dir_a: str, dir_b: str) -> list[str]:
    details = []
    for side, rec, folder in (("A", rec_a, dir_a), ("B", rec_b, dir_b)):
        for k, run in enumerate(rec["cases"][name]["runs"], start=1):
            if run["rc"] != 0:
                with open(os.path.join(folder, name, str(k), "case.json")) as f:
                    last = json.load(f)["stderr_tail"].strip().splitlines()[-3:]
                details.append(f"run {k} failed in {side} (exit {run['rc']}): " + " | ".join(last))
    return details


def load_record(folder: str) -> dict:
    path = os.path.join(folder, "record.json")
    if not os.path.isfile(path):
        sys.exit(f"compare_runs: {folder} holds no record.json (make it with 'record')")
    with open(path) as f:
        return json.load(f)


def markdown_table(results: list[CaseResult], rtol: float) -> str:
    lines = [f"| case | runs A/B | files compared | largest relative difference | where | run-to-run spread "
             f"| verdict (rtol {rtol:g}) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        compared = r.verdict not in ("failed",) and r.runs != "-"
        numbers = (f"{r.largest:.3g}", f"{r.spread:.3g}") if compared else ("-", "-")
        lines.append(f"| {r.name} | {r.runs} | {r.files} | {numbers[0]} | {r.where or '-'} | {numbers[1]} | {r.verdict} |")
    return "\n".join(lines)


def compare(dir_a: str, dir_b: str, rtol: float, floor: float) -> int:
    rec_a, rec_b = load_record(dir_a), load_record(dir_b)
    names = list(rec_a["cases"]) + [n for n in rec_b["cases"] if n not in rec_a["cases"]]
    results = [compare_case(n, rec_a, rec_b, dir_a, dir_b, rtol, floor) for n in names]
    for side, rec in (("A", rec_a), ("B", rec_b)):
        print(f"{side}: {rec['repo']} at {rec['commit']} (dirty: {rec['dirty']}), "
              f"recorded {rec['started']} in {rec['seconds']} s")
    print()
    print(markdown_table(results, rtol))
    for r in results:
        if r.details:
            print(f"\n{r.name}:")
            print("\n".join(f"  - {d}" for d in r.details))
    counts = {v: sum(r.verdict == v for r in results) for v in ("same", "noise", "DIFFERENT", "missing", "failed")}
    print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" (of {len(results)} cases, rtol {rtol:g})")
    return 1 if counts["DIFFERENT"] or counts["missing"] or counts["failed"] else 0

# ------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("record", help="run the cases and keep their numbers in OUTDIR")
    r.add_argument("outdir")
    r.add_argument("--repo", default=ROOT, help="the checkout whose pdeformer runs (default: this one)")
    r.add_argument("--cases", nargs="+", metavar="NAME", help="only these cases")
    r.add_argument("--python", default=sys.executable, help="the Python that runs pdeformer")
    c = sub.add_parser("compare", help="compare two records (A: reference, B: new)")
    c.add_argument("dir_a")
    c.add_argument("dir_b")
    c.add_argument("--rtol", type=float, default=1e-12, help="relative tolerance (default 1e-12)")
    c.add_argument("--floor", type=float, default=1e-15,
                   help="smallest scale of a difference: arrays below it compare absolutely (default 1e-15)")
    args = p.parse_args(argv)
    if args.mode == "record":
        return record(args.outdir, args.repo, args.cases, args.python)
    return compare(args.dir_a, args.dir_b, args.rtol, args.floor)


if __name__ == "__main__":
    sys.exit(main())
