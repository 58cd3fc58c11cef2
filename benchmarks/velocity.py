"""Attention velocity: direct summation against the laplace table (d = 2 and 3).

    .venv/bin/python benchmarks/velocity.py            # the full table (several minutes)
    .venv/bin/python benchmarks/velocity.py --quick    # N = 1e4 only
    .venv/bin/python benchmarks/velocity.py --dim 3    # d = 3: N = 1e4, 1e5, 1e6 (~15 min)
    .venv/bin/python benchmarks/velocity.py --dim 3 --kind box

In 3-D (``--dim 3``) the sources and targets are N points on the unit sphere with a
mixture of two von Mises-Fisher weights (``--kind sphere``, the LayerNorm geometry) or
uniform in [-1.5, 1.5]^3 with two Gaussian blobs as weights (``--kind box``), heads as
in 2-D (Q, K, V ~ N(0, 1/d)); direct summation is timed on the first 500 targets (200
for N = 1e6) and scaled; only the first table is printed (the H-growth and FMA parts are
2-D).

For sources = targets = N in {1e4, 3e4, 1e5} and H in {1, 16, 64} heads: wall time of
direct summation and of the laplace backend (tol 1e-8; the best of three calls, each
from scratch: b-range, table, fine grid, interpolation), their ratio, and the largest
error of laplace relative to the largest velocity. Direct summation costs exactly
N_targets x N_sources x H, so it is timed on the first 2000 targets and scaled to N
(marked "~"); errors are measured on those targets. Then the laplace time against H for
the first 1, 16 and 64 of 64 heads, with each set's own b-range (the table covers it, so
its size grows with the range) and with the 64 heads' range (the same table: what is left
is the per target-head interpolation), and the interpolation alone. Also: the direct
kernel's rate in target-source-head pairs per second as a fraction of numpy's exp rate
(elements per second), both on one core of this machine. Last, the interpolation's cost
per target-head against this core's arithmetic floor for it: a degree-5 tensor
interpolant of (m_1, m_2) is 6 rows x 12 values plus the contraction, i.e. 6 RV + RV
vector multiply-adds of VW doubles (RV = 12 / VW), timed at the core's measured peak rate
of independent vector FMAs (a small C probe built like the kernels); and the
cost per target-head that "H = 64 within 1.5x of H = 1" would allow, given the table times.
"""

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pdeformer.attention.softmax import Sources, attention_matrices, attention_velocity  # noqa: E402
from pdeformer.attention.compiled import KERNEL_DEGREE, VECTOR_C, _compile  # noqa: E402
from pdeformer.attention.laplace import (N_MAX_FORCED, b_range, choose_table, fine_grid,  # noqa: E402
                                        largest_size)

SUBSET = 2000
REPEAT = 3       # laplace times: the best of three calls (a call takes 0.02-0.5 s)


def best_of(repeat, f, *args, **kwargs):
    """(shortest wall time of ``repeat`` calls, the last result)."""
    best = np.inf
    for _ in range(repeat):
        t = time.perf_counter()
        out = f(*args, **kwargs)
        best = min(best, time.perf_counter() - t)
    return best, out


def problem(N, H, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.uniform(-4, 4, (N, 2))
    w = (np.exp(-np.sum((y - [-1, 0]) ** 2, 1) / 0.3) + np.exp(-np.sum((y - [1, 0.5]) ** 2, 1) / 0.2)) / N
    x = rng.uniform(-4, 4, (N, 2))
    Q = rng.standard_normal((H, 2, 2)) / np.sqrt(2)
    K = rng.standard_normal((H, 2, 2)) / np.sqrt(2)
    V = rng.standard_normal((H, 2, 2)) / np.sqrt(2)
    return x, y, w, attention_matrices(Q, K), V


def problem3(N, H, kind, seed=0):
    """d = 3: sources and targets on the unit sphere (von Mises-Fisher weights) or in a box."""
    rng = np.random.default_rng(seed)
    if kind == "sphere":
        y, x = rng.normal(size=(N, 3)), rng.normal(size=(N, 3))
        y /= np.linalg.norm(y, axis=1)[:, None]
        x /= np.linalg.norm(x, axis=1)[:, None]
        w = np.exp(4.0 * y @ [0.6, 0.0, 0.8]) + 0.5 * np.exp(2.0 * y @ [-1.0, 0.0, 0.0])
    else:
        y, x = rng.uniform(-1.5, 1.5, (N, 3)), rng.uniform(-1.5, 1.5, (N, 3))
        w = np.exp(-np.sum((y - [0.4, 0, 0]) ** 2, 1) / 0.4) + np.exp(-np.sum((y + [0.3, -0.2, 0.4]) ** 2, 1) / 0.3)
    Q, K, V = (rng.standard_normal((H, 3, 3)) / np.sqrt(3) for _ in range(3))
    return x, y, w / w.sum(), attention_matrices(Q, K), V


def laplace_velocity(x, y, w, A, V, tol, comm=MPI.COMM_SELF, box=None):
    """The laplace velocity, its table size, fine grid and estimate; ``box``: the b-range
    to tabulate (default: that of A)."""
    table, est = choose_table(y, w, *(box or b_range(x, A, comm)), comm, tol,
                              n_max=largest_size(y.shape[1], forced=True))
    interp = fine_grid(table, tol) or table
    return interp.velocity(x, A, V), table.n, getattr(interp, "nf", None), est


def growth_with_heads(N, tol):
    """Laplace time for the first 1, 16 and 64 of 64 heads: with each set's own b-range
    (the table grows with the range), and with the table of the 64 heads' range."""
    x, y, w, A, V = problem(N, 64)
    box = b_range(x, A, MPI.COMM_SELF)
    rows = []
    for label, fixed in (("own b-range", False), ("64 heads' b-range", True)):
        times, sizes = [], []
        for h in (1, 16, 64):
            t, (_, n, _, _) = best_of(REPEAT, laplace_velocity, x, y, w, A[:h], V[:h], tol,
                                      box=box if fixed else None)
            times.append(t)
            sizes.append(n)
        rows.append((label, times, sizes))
    # what grows with H at a fixed table: the interpolation alone (b = A_h x included)
    table, _ = choose_table(y, w, *box, MPI.COMM_SELF, tol, n_max=N_MAX_FORCED)
    interp = fine_grid(table, tol) or table
    times = [best_of(REPEAT, interp.velocity, x, A[:h], V[:h])[0] for h in (1, 16, 64)]
    rows.append(("interpolation only", times, [table.n] * 3))
    return rows


def exp_rate():
    a = -np.random.default_rng(0).random(4_000_000)
    out = np.empty_like(a)
    np.exp(a, out=out)
    t = time.perf_counter()
    for _ in range(5):
        np.exp(a, out=out)
    return 5 * a.size / (time.perf_counter() - t)


FMA_PROBE = VECTOR_C + r"""
#include <time.h>
static volatile double sink;           /* keeps the chains live */
int vector_width(void) { return VW; }
/* vector FMAs per second with 12 independent chains (enough to fill the FMA pipes) */
double fma_rate(long n)
{
    vec a[12], m, c;
    for (int e = 0; e < VW; ++e) { m[e] = 1.0 - 1e-12; c[e] = 1e-9; }
    for (int i = 0; i < 12; ++i) for (int e = 0; e < VW; ++e) a[i][e] = i + e;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < n; ++k)
        for (int i = 0; i < 12; ++i) a[i] = a[i] * m + c;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 12; ++i) sink += a[i][0];
    return 12.0 * n / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec));
}
"""


def fma_peak() -> tuple[float, int] | None:
    """(vector FMAs per second on one core, doubles per vector), built like the kernels
    (their compiler, flags and vector type); None without a working C compiler."""
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "probe.so"
        try:
            _compile(lib, FMA_PROBE)
        except (OSError, RuntimeError, subprocess.SubprocessError):
            return None
        probe = ctypes.CDLL(str(lib))
        probe.fma_rate.restype = ctypes.c_double
        probe.fma_rate.argtypes = [ctypes.c_long]
        rate = max(probe.fma_rate(50_000_000) for _ in range(REPEAT))
        return rate, probe.vector_width()


def interpolation_fmas(vw: int) -> int:
    """Vector FMAs of one fine-grid interpolation of (m_1, m_2): NP rows of 2 NP values,
    then the contraction with the axis-1 weights, RV = 2 NP / vw vectors each."""
    nodes = KERNEL_DEGREE + 1
    return (nodes + 1) * (2 * nodes // vw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-8)
    ap.add_argument("--dim", type=int, choices=(2, 3), default=2)
    ap.add_argument("--kind", choices=("sphere", "box"), default="sphere", help="d = 3: the sources")
    args = ap.parse_args()
    if args.dim == 3:
        return main3(args)
    sizes = [10_000] if args.quick else [10_000, 30_000, 100_000]
    print(f"{'N':>7} {'H':>3} {'direct [s]':>11} {'laplace [s]':>11} {'ratio':>8} {'max rel err':>11}  table")
    rates = []
    for N in sizes:
        for H in (1, 16, 64):
            x, y, w, A, V = problem(N, H)
            n_sub = min(N, SUBSET)
            t = time.perf_counter()
            ref = attention_velocity(x[:n_sub], Sources.from_arrays(y, w), A, V)
            t_direct = (time.perf_counter() - t) * N / n_sub
            rates.append(N * N * H / t_direct)
            t_lap, (v, n, nf, est) = best_of(REPEAT, laplace_velocity, x, y, w, A, V, args.tol)
            err = np.abs(v[:n_sub] - ref).max() / np.abs(ref).max()
            approx = "~" if n_sub < N else " "
            grid = f"n={n}" + (f", fine {nf}" if nf else "") + f", estimate {est:.1e}"
            print(f"{N:>7} {H:>3} {approx}{t_direct:>10.2f} {t_lap:>11.3f} {t_direct / t_lap:>8.1f} {err:>11.2e}  {grid}",
                  flush=True)
    print(f"\nlaplace time against H (the first H of 64 heads, N = {sizes[-1]}):")
    print(f"{'table for':>18} {'H=1':>8} {'H=16':>8} {'H=64':>8} {'H=64 / H=1':>11}  sizes n")
    rows = growth_with_heads(sizes[-1], args.tol)
    for label, times, ns in rows:
        print(f"{label:>18} " + " ".join(f"{t:>8.3f}" for t in times)
              + f" {times[-1] / times[0]:>11.2f}  {ns}", flush=True)
    pairs = sizes[-1] * 64
    interp = rows[-1][1]
    peak = fma_peak()
    print(f"\ninterpolation at H = 64: {interp[2] / pairs * 1e9:.1f} ns per target-head", end="")
    if peak is None:
        print(" (no C compiler: the FMA floor is not measured)")
    else:
        rate, vw = peak
        fmas = interpolation_fmas(vw)
        print(f"; its {fmas} vector FMAs ({vw} doubles) at this core's peak of {rate:.3e}/s: "
              f"{fmas / rate * 1e9:.1f} ns")
    for label, times, _ in rows[:2]:            # what "H = 64 within 1.5x of H = 1" leaves
        allowed = (1.5 * times[0] - (times[2] - interp[2])) / pairs
        print(f"H = 64 within 1.5x of H = 1 ({label}) would allow {allowed * 1e9:.1f} ns "
              f"per target-head beside the H = 64 table")
    er = exp_rate()
    print(f"\nnumpy exp: {er:.3e} elements/s; direct kernel: {np.median(rates):.3e} pairs/s "
          f"= {np.median(rates) / er:.2f} of the exp rate (median over the table)")


def main3(args):
    sizes = [10_000] if args.quick else [10_000, 100_000, 1_000_000]
    print(f"d = 3, {args.kind}, tol {args.tol:g}")
    print(f"{'N':>8} {'H':>3} {'direct [s]':>11} {'laplace [s]':>11} {'ratio':>8} {'max rel err':>11}  table")
    for N in sizes:
        for H in (1, 16, 64):
            x, y, w, A, V = problem3(N, H, args.kind)
            n_sub = min(N, 200 if N >= 1_000_000 else 500)
            t = time.perf_counter()
            ref = attention_velocity(x[:n_sub], Sources.from_arrays(y, w), A, V)
            t_direct = (time.perf_counter() - t) * N / n_sub
            t_lap, (v, n, nf, est) = best_of(1 if N >= 1_000_000 else 2, laplace_velocity, x, y, w, A, V, args.tol)
            err = np.abs(v[:n_sub] - ref).max() / np.abs(ref).max()
            grid = f"n={n}" + (f", fine {nf}" if nf else "") + f", estimate {est:.1e}"
            print(f"{N:>8} {H:>3} ~{t_direct:>10.2f} {t_lap:>11.3f} {t_direct / t_lap:>8.1f} {err:>11.2e}  {grid}",
                  flush=True)


if __name__ == "__main__":
    main()
