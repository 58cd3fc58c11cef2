r"""Compiled loops of the laplace backend's fine-grid interpolation (d = 2).

For each head h and target x_i, with b = A_h x_i and m(b) the tensor Lagrange
interpolant of degree p on the uniform fine grid (:class:`pdeformer.laplace.FineGrid`):

* ``fine_velocity``:  v_i = (1/H) sum_h V_h m(A_h x_i)
* ``fine_velocity_vjp``: for cotangents g_i of v_i, with u = V_h^T g_i / H,
  dV_h = (1/H) sum_i g_i m^T,  dA_h = sum_i (dm/db)^T u x_i^T,  the fine-grid
  cotangent mbar_k[node] += L(node; b) u_k (the transposed interpolation) and, for
  moving targets (particles), xbar_i = sum_h A_h^T (dm/db)^T u.

The loops are C, compiled once with the system's C compiler into
``$PDEFORMER_CACHE`` (default ``$XDG_CACHE_HOME/pdeformer``, ``~/.cache/pdeformer``) and
loaded with ctypes; a file name carrying a hash of the source means a changed source is
recompiled, and the compiled file is moved into place atomically (ranks compiling at
once do not clash). Without a compiler, or with ``PDEFORMER_NO_KERNEL=1``, :func:`kernels`
returns None and the numpy implementation is used (same map; about 10x slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("pdeformer")

SOURCE = r"""
#include <math.h>

/* Lagrange weights (and derivatives) of the equispaced nodes 0..p at t. */
static void lagrange(int p, double t, double *L, double *dL)
{
    for (int a = 0; a <= p; ++a) {
        double num = 1.0, den = 1.0, der = 0.0;
        for (int c = 0; c <= p; ++c) {
            if (c == a) continue;
            den *= (double)(a - c);
            /* der = d/dt prod_{c' != a, c' <= c} (t - c') */
            der = der * (t - c) + num;
            num *= (t - c);
        }
        L[a] = num / den;
        if (dL) dL[a] = der / den;
    }
}

/* Lagrange weights only: prefix and suffix products, O(p). */
static void lagrange_values(int p, double t, const double *inv_den, double *L)
{
    double pre[16], suf = 1.0;
    pre[0] = 1.0;
    for (int a = 1; a <= p; ++a) pre[a] = pre[a - 1] * (t - (a - 1));
    for (int a = p; a >= 0; --a) {
        L[a] = pre[a] * suf * inv_den[a];
        suf *= (t - a);
    }
}

static void inverse_denominators(int p, double *inv_den)
{
    for (int a = 0; a <= p; ++a) {
        double den = 1.0;
        for (int c = 0; c <= p; ++c)
            if (c != a) den *= (double)(a - c);
        inv_den[a] = 1.0 / den;
    }
}

/* p = 5 (six nodes per axis) is fixed at compile time so that the loops unroll */
#define NP 6

/* b = A_h x in fine-grid coordinates: stencil starts k (clamped to the grid) and the
   local coordinates t = s - k of both axes */
static void stencil(const double *Ah, double x0, double x1, const double *lo, double ih0,
                    double ih1, long nf0, long nf1, long *k, double *t)
{
    double s[2] = {((Ah[0] * x0 + Ah[1] * x1) - lo[0]) * ih0,
                   ((Ah[2] * x0 + Ah[3] * x1) - lo[1]) * ih1};
    long nf[2] = {nf0, nf1};
    for (int a = 0; a < 2; ++a) {
        k[a] = (long)floor(s[a]) - (NP - 2) / 2;
        if (k[a] < 0) k[a] = 0;
        if (k[a] > nf[a] - NP) k[a] = nf[a] - NP;
        t[a] = s[a] - (double)k[a];
    }
}

void fine_velocity(const double *flat, long nf0, long nf1, const double *lo, const double *h,
                   int p, const double *x, long N, const double *A, const double *V, long H,
                   double *out)
{
    double L0[NP], L1[NP], inv_den[NP], scale = 1.0 / (double)H;
    double ih0 = 1.0 / h[0], ih1 = 1.0 / h[1];
    (void)p;
    inverse_denominators(NP - 1, inv_den);
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 4 * hd, *Vh = V + 4 * hd;
        for (long i = 0; i < N; ++i) {
            double x0 = x[2 * i], x1 = x[2 * i + 1], t[2];
            long k[2];
            stencil(Ah, x0, x1, lo, ih0, ih1, nf0, nf1, k, t);
            long k0 = k[0], k1 = k[1];
            lagrange_values(NP - 1, t[0], inv_den, L0);
            lagrange_values(NP - 1, t[1], inv_den, L1);
            double m0 = 0.0, m1 = 0.0;
            for (int a = 0; a < NP; ++a) {
                const double *row = flat + 2 * ((k0 + a) * nf1 + k1);
                double r0 = 0.0, r1 = 0.0;
                for (int c = 0; c < NP; ++c) {
                    r0 += L1[c] * row[2 * c];
                    r1 += L1[c] * row[2 * c + 1];
                }
                m0 += L0[a] * r0;
                m1 += L0[a] * r1;
            }
            out[2 * i] += (Vh[0] * m0 + Vh[1] * m1) * scale;
            out[2 * i + 1] += (Vh[2] * m0 + Vh[3] * m1) * scale;
        }
    }
}

void fine_velocity_vjp(const double *flat, long nf0, long nf1, const double *lo, const double *h,
                       int p, const double *x, long N, const double *A, const double *V, long H,
                       const double *g, double *mbar, double *dA, double *dV, double *xbar)
{
    double L0[NP], L1[NP], dL0[NP], dL1[NP];
    double ih0 = 1.0 / h[0], ih1 = 1.0 / h[1], scale = 1.0 / (double)H;
    long nn = nf0 * nf1;
    (void)p;
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 4 * hd, *Vh = V + 4 * hd;
        double *dAh = dA + 4 * hd, *dVh = dV + 4 * hd;
        for (long i = 0; i < N; ++i) {
            double x0 = x[2 * i], x1 = x[2 * i + 1], t[2];
            double g0 = g[2 * i], g1 = g[2 * i + 1];
            long k[2];
            stencil(Ah, x0, x1, lo, ih0, ih1, nf0, nf1, k, t);
            long k0 = k[0], k1 = k[1];
            lagrange(NP - 1, t[0], L0, dL0);
            lagrange(NP - 1, t[1], L1, dL1);
            double u0 = (Vh[0] * g0 + Vh[2] * g1) * scale;
            double u1 = (Vh[1] * g0 + Vh[3] * g1) * scale;
            double m0 = 0.0, m1 = 0.0, J00 = 0.0, J10 = 0.0, J01 = 0.0, J11 = 0.0;
            for (int a = 0; a < NP; ++a) {
                long base = (k0 + a) * nf1 + k1;
                const double *row = flat + 2 * base;
                double r0 = 0.0, r1 = 0.0, q0 = 0.0, q1 = 0.0;
                double la0 = L0[a] * u0, la1 = L0[a] * u1;
                for (int c = 0; c < NP; ++c) {
                    r0 += L1[c] * row[2 * c];
                    r1 += L1[c] * row[2 * c + 1];
                    q0 += dL1[c] * row[2 * c];
                    q1 += dL1[c] * row[2 * c + 1];
                    mbar[base + c] += la0 * L1[c];
                    mbar[nn + base + c] += la1 * L1[c];
                }
                m0 += L0[a] * r0;  m1 += L0[a] * r1;
                J00 += dL0[a] * r0; J10 += dL0[a] * r1;   /* d m_k / d b_0 */
                J01 += L0[a] * q0;  J11 += L0[a] * q1;    /* d m_k / d b_1 */
            }
            J00 *= ih0; J10 *= ih0; J01 *= ih1; J11 *= ih1;
            dVh[0] += g0 * m0 * scale; dVh[1] += g0 * m1 * scale;
            dVh[2] += g1 * m0 * scale; dVh[3] += g1 * m1 * scale;
            double c0 = J00 * u0 + J10 * u1, c1 = J01 * u0 + J11 * u1;   /* (dm/db)^T u */
            dAh[0] += c0 * x0; dAh[1] += c0 * x1;
            dAh[2] += c1 * x0; dAh[3] += c1 * x1;
            if (xbar) {                                   /* A_h^T (dm/db)^T u */
                xbar[2 * i] += Ah[0] * c0 + Ah[2] * c1;
                xbar[2 * i + 1] += Ah[1] * c0 + Ah[3] * c1;
            }
        }
    }
}
"""

KERNEL_DEGREE = 5    # the local Lagrange degree the loops are compiled for (NP = 6 nodes)
FLAGS = ["-O3", "-shared", "-fPIC", "-std=c99", "-fno-fast-math"]
_loaded: dict = {}


def cache_dir() -> Path:
    if os.environ.get("PDEFORMER_CACHE"):
        return Path(os.environ["PDEFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdeformer"


def _compile(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "fine.c"
        src.write_text(SOURCE)
        lib = Path(tmp) / target.name
        subprocess.run([cc, *FLAGS, str(src), "-o", str(lib), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, target)       # atomic: a rank never loads a half-written file


def kernels():
    """The compiled kernels (a ctypes library), or None where they cannot be had."""
    if "lib" in _loaded:
        return _loaded["lib"]
    lib = None
    if os.environ.get("PDEFORMER_NO_KERNEL", "") not in ("", "0"):
        _loaded["lib"] = None
        return None
    machine = f"{sys.platform} {platform.machine()} {platform.libc_ver()}"   # shared caches
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + machine).encode()).hexdigest()[:16]
    try:
        target = cache_dir() / f"fine_{key}.so"
        if not target.exists():
            _compile(target)
        try:
            lib = ctypes.CDLL(str(target))
        except OSError:            # a stale or foreign file: build it again, once
            _compile(target)
            lib = ctypes.CDLL(str(target))
        dp, lg, it = ctypes.POINTER(ctypes.c_double), ctypes.c_long, ctypes.c_int
        lib.fine_velocity.argtypes = [dp, lg, lg, dp, dp, it, dp, lg, dp, dp, lg, dp]
        lib.fine_velocity_vjp.argtypes = [dp, lg, lg, dp, dp, it, dp, lg, dp, dp, lg, dp, dp, dp, dp, dp]
        lib.fine_velocity.restype = lib.fine_velocity_vjp.restype = None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.debug("laplace: compiled interpolation unavailable (%s); using numpy", e)
        lib = None
    _loaded["lib"] = lib
    return lib


def kernels_on(comm):
    """The compiled kernels where every rank of ``comm`` has them, else None: the ranks
    of a job must take the same path (a collective call)."""
    from mpi4py import MPI
    lib = kernels()
    return lib if comm.allreduce(lib is not None, op=MPI.LAND) else None


def _ptr(a: np.ndarray):
    assert a.dtype == np.float64 and a.flags.c_contiguous
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_double))


def _c(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64)


def fine_velocity(lib, flat, nf: int, lo, h, p: int, x, A, V) -> np.ndarray:
    """v (N, 2) = (1/H) sum_h V_h m(A_h x) with the compiled loop."""
    flat, lo, h, x, A, V = map(_c, (flat, lo, h, x, A, V))
    out = np.zeros_like(x)
    lib.fine_velocity(_ptr(flat), nf, nf, _ptr(lo), _ptr(h), p, _ptr(x), len(x),
                      _ptr(A), _ptr(V), len(A), _ptr(out))
    return out


def fine_velocity_vjp(lib, flat, nf: int, lo, h, p: int, x, A, V, g, positions: bool = False):
    """(mbar (2, nf*nf), dA (H, 2, 2), dV (H, 2, 2), xbar (N, 2) or None) for the
    cotangents g of v; xbar (the targets' cotangent) with ``positions``."""
    flat, lo, h, x, A, V, g = map(_c, (flat, lo, h, x, A, V, g))
    mbar = np.zeros((2, nf * nf))
    dA, dV = np.zeros_like(A), np.zeros_like(V)
    xbar = np.zeros_like(x) if positions else None
    lib.fine_velocity_vjp(_ptr(flat), nf, nf, _ptr(lo), _ptr(h), p, _ptr(x), len(x),
                          _ptr(A), _ptr(V), len(A), _ptr(g), _ptr(mbar), _ptr(dA), _ptr(dV),
                          _ptr(xbar) if positions else None)
    return mbar, dA, dV, xbar
