"""A forward run (default: runs/default.toml) with each attention backend.

    .venv/bin/python benchmarks/forward.py [--ranks 2] [--set key=value ...]
    .venv/bin/python benchmarks/forward.py --config runs/box.toml --ranks 1   # 3-D, 16^3 x 6

Runs `pdeformer forward` under mpirun with backend direct, laplace and auto (the config's
tol), and prints the wall time of each and the largest difference of every diagnostic
column against direct summation.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdeformer.tools.output import read_diagnostics  # noqa: E402
from pdeformer.tools.parallel import mpirun_command  # noqa: E402


def run(backend, ranks, extra, folder, config):
    out = os.path.join(folder, backend)
    cmd = mpirun_command(ranks) + [sys.executable, "-m", "pdeformer", "forward",
                                   os.path.abspath(config), "-q", "--set",
                                   f"attention.backend={backend}", f"output.dir={out}",
                                   "output.fields=false", *extra]
    # env: Python's copy of the environment, without what MPI_Init put into this process's
    # own (a child mpirun would take itself for part of this job)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return summary, read_diagnostics(os.path.join(out, "diagnostics.csv"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--config", default=os.path.join(ROOT, "runs", "default.toml"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = {b: run(b, args.ranks, args.set, folder, args.config) for b in ("direct", "laplace", "auto")}
    ref = results["direct"][1]
    print(f"{os.path.relpath(args.config, ROOT)} forward on {args.ranks} rank(s)")
    print(f"{'backend':>8} {'wall [s]':>9} {'velocity [s]':>12} {'max |diagnostic - direct|':>26}  choices")
    direct_wall = results["direct"][0]["timings"]["total"]
    for b, (summary, rows) in results.items():
        diff = max(abs(r[k] - q[k]) for r, q in zip(rows, ref) for k in r if k != "prompt")
        att = summary["attention"]
        wall = summary['timings']['total']
        print(f"{b:>8} {wall:>9.1f} {summary['timings'].get('velocity', 0):>12.1f} "
              f"{diff:>26.2e}  {direct_wall / wall:5.1f}x direct's; direct {att['direct']}, laplace {att['laplace']}, "
              f"largest grid {att['largest_grid']}, tol {att['tol']:g}")


if __name__ == "__main__":
    main()
