"""What a synchronisation costs on this machine when every rank does the same work.

    mpirun -n 2 .venv/bin/python benchmarks/jitter.py [--size 300] [--products 3] [--repeat 1500]

Every rank repeats the same segment of work (``--products`` products of two ``--size``
square matrices, about 2.6 ms on one core of the 2-core VM at the defaults: the size of a
laplace evaluation's work between two of its collectives in the 64^2 gradient), each
segment between two barriers. It prints, per rank and over all, the segment's time (mean,
standard deviation, 90th and 99th percentile) and the time a rank waits at the barrier
after it. The work is identical, so the wait is the machine's jitter alone: what any
division of a solve over ranks pays at each synchronisation, however evenly it divides
the work. Rank 0's lead over rank 1 per segment is printed with its correlation a
few segments later: where it stays high, each core has slow stretches longer than a
segment, which no shorter or fewer segments would average away. On one rank only the
segment's spread is printed. ``--skew MS`` makes rank 0's
segment MS milliseconds longer (a sleep after its products): the others then wait about
that much at each barrier, which checks what the wait measures.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdeformer.tools.blas import choose_core  # noqa: E402

choose_core()      # the BLAS kernels the pdeformer command takes, before numpy loads
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402


def segments(comm, size: int, products: int, repeat: int, warmup: int = 100, skew: float = 0.0):
    """(segment seconds, wait seconds) per repetition: the products (on rank 0 followed by
    a sleep of ``skew`` seconds), then a barrier."""
    rng = np.random.default_rng(comm.rank)
    a, b = rng.random((size, size)), rng.random((size, size))
    work, wait = np.empty(repeat), np.empty(repeat)
    for i in range(warmup + repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(products):
            a @ b
        if skew and comm.rank == 0:
            time.sleep(skew)
        t1 = time.perf_counter()
        comm.Barrier()
        t2 = time.perf_counter()
        if i >= warmup:
            work[i - warmup], wait[i - warmup] = t1 - t0, t2 - t1
    return work, wait


def describe(work: np.ndarray, wait: np.ndarray) -> str:
    ms = 1e3
    return (f"segment {work.mean() * ms:6.3f} ms (std {work.std() * ms:5.3f}, p90 "
            f"{np.percentile(work, 90) * ms:6.3f}, p99 {np.percentile(work, 99) * ms:6.3f})"
            f"   wait {wait.mean() * ms:6.3f} ms = {wait.mean() / work.mean():5.1%} of it")


LAGS = (1, 5, 20)


def persistence(x: np.ndarray, lags=LAGS) -> list:
    """(lag, correlation of x_i with x_{i+lag}) for each lag shorter than x: near 0 where
    the ranks' differences are independent from one segment to the next; near 1 where a
    core stays slow (or fast) for stretches of several segments."""
    return [(k, float(np.corrcoef(x[:-k], x[k:])[0, 1])) for k in lags if len(x) > k + 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=300)
    ap.add_argument("--products", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1500)
    ap.add_argument("--skew", type=float, default=0.0, metavar="MS",
                    help="rank 0's segment this many ms longer (a sleep)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    work, wait = segments(comm, args.size, args.products, args.repeat, skew=args.skew * 1e-3)
    rows = comm.gather((work, wait), root=0)
    if comm.rank != 0:
        return
    print(f"{comm.size} rank(s) on {os.cpu_count()} core(s): {args.repeat} segments of "
          f"{args.products} products of {args.size}^2 matrices, each followed by a barrier")
    for r, (wk, wt) in enumerate(rows):
        print(f"  rank {r}: {describe(wk, wt)}")
    if comm.size > 1:
        print(f"  all:    {describe(np.concatenate([w for w, _ in rows]), np.concatenate([w for _, w in rows]))}")
        # a round's time is set by its slowest rank: the loss against the mean segment
        slowest = np.max([w for w, _ in rows], axis=0)
        mean = np.mean([w.mean() for w, _ in rows])
        print(f"  the slowest rank's segment: {slowest.mean() * 1e3:.3f} ms, "
              f"{slowest.mean() / mean - 1:.1%} above the mean segment")
        lead = rows[0][0] - rows[1][0]
        lags = persistence(lead)
        print(f"  rank 0's lead over rank 1: std {lead.std() / mean:.1%} of a segment; its "
              f"correlation with the lead {', '.join(str(k) for k, _ in lags)} segment(s) later: "
              f"{', '.join(f'{c:.2f}' for _, c in lags)}")


if __name__ == "__main__":
    main()
