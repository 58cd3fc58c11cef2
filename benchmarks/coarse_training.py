"""The shipped training config on coarse and fine meshes: does every run train, with
the risk going down?

    python benchmarks/coarse_training.py                      (~10 minutes on 2 cores)
    python benchmarks/coarse_training.py --cells 16 32 --degrees 1 --ranks 1

For every mesh (n x n cells), DG degree and rank count it runs
``pdeformer train runs/default.toml --set mesh.cells=[n,n] discretisation.degree=k
train.steps=5`` and prints one Markdown row: the status, the risk at steps 0..5, whether
it decreased at every step, and the wall time. ``--compare-limiter`` adds, for the
finest mesh, the history with the limiter off next to the one with it on.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(cells: int, degree: int, ranks: int, folder: str, extra=()) -> tuple[dict, list, float]:
    cmd = [sys.executable, "-m", "pdeformer", "train", "runs/default.toml", "-q", "--set",
           f"mesh.cells=[{cells},{cells}]", f"discretisation.degree={degree}", "train.steps=5",
           f"output.dir={folder}", *extra]
    if ranks > 1:
        sys.path.insert(0, ROOT)
        from pdeformer.tools.parallel import mpirun_command
        cmd = mpirun_command(ranks) + cmd
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - t0
    try:
        with open(os.path.join(folder, "summary.json")) as f:
            summary = json.load(f)
    except OSError:
        summary = {"status": f"no summary (exit {proc.returncode})", "error": proc.stderr[-300:]}
    risks = []
    if os.path.exists(os.path.join(folder, "history.csv")):
        with open(os.path.join(folder, "history.csv")) as f:
            risks = [float(r["risk"]) for r in csv.DictReader(f)]
    return summary, risks, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, nargs="+", default=[16, 24, 32, 48, 64])
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--compare-limiter", action="store_true")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdeformer-coarse-")
    print("| cells | DG | ranks | status | risk, steps 0..5 | decreasing | wall |")
    print("|---|---|---|---|---|---|---|")
    for n in args.cells:
        for k in args.degrees:
            for P in args.ranks:
                summary, risks, s = train(n, k, P, os.path.join(tmp, f"{n}_{k}_{P}"))
                down = len(risks) == 6 and all(b < a for a, b in zip(risks, risks[1:]))
                print(f"| {n}² | {k} | {P} | {summary['status']} | "
                      f"{', '.join(f'{r:.6f}' for r in risks) or summary.get('error', '')} | "
                      f"{'yes' if down else 'NO'} | {s:.0f} s |", flush=True)
    if args.compare_limiter:
        n = max(args.cells)
        print(f"\nlimiter on / off, {n}², DG-1, 1 rank:\n")
        print("| step | risk, limiter on | risk, limiter off | relative difference |")
        print("|---|---|---|---|")
        _, on, _ = train(n, 1, 1, os.path.join(tmp, "on"))
        _, off, _ = train(n, 1, 1, os.path.join(tmp, "off"), ["discretisation.limiter=false"])
        for i, (a, b) in enumerate(zip(on, off)):
            print(f"| {i} | {a:.8f} | {b:.8f} | {abs(a - b) / abs(b):.2e} |")
        # the DG error of the risk at n^2: against the same initial heads on (2n)^2 cells
        _, fine, _ = train(2 * n, 1, 1, os.path.join(tmp, "fine"), ["train.steps=0"])
        if fine and off:
            print(f"\nDG error of the initial risk at {n}² (against {2 * n}²): "
                  f"{abs(off[0] - fine[0]) / abs(fine[0]):.2e} relative (limiter off), "
                  f"{abs(on[0] - fine[0]) / abs(fine[0]):.2e} (on)")


if __name__ == "__main__":
    main()
