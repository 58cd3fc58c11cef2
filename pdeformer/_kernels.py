r"""Compiled loops of the laplace backend (d = 2): fine-grid interpolation and panel sums.

For each head h and target x_i, with b = A_h x_i and m(b) the tensor Lagrange
interpolant of degree p on the uniform fine grid (:class:`pdeformer.laplace.FineGrid`):

* ``fine_velocity``:  v_i = (1/H) sum_h V_h m(A_h x_i)
* ``fine_velocity_vjp``: for cotangents g_i of v_i, with u = V_h^T g_i / H,
  dV_h = (1/H) sum_i g_i m^T,  dA_h = sum_i (dm/db)^T u x_i^T,  the fine-grid
  cotangent mbar_k[node] += L(node; b) u_k (the transposed interpolation) and, for
  moving targets (particles), xbar_i = sum_h A_h^T (dm/db)^T u.

For sources y_j on panels (:class:`pdeformer.laplace.Panels`) with Lagrange weights
L0_j, L1_j on their panels' nodes:

* ``panel_spread``: W[c] = sum_j cols[j, c] L0_j (x) L1_j (the sources on the nodes)
* ``panel_gather``: out[j, i] = <L0_j (x) L1_j, G_i> (its transpose: grids at the sources)

both one pair of panels at a time (a counting sort of the sources, then one
register-blocked product per pair).

The loops are C, compiled once with the system's C compiler for the CPU it runs on
(``-march=native``; without that flag where the compiler refuses it) into
``$PDEFORMER_CACHE`` (default ``$XDG_CACHE_HOME/pdeformer``, ``~/.cache/pdeformer``) and
loaded with ctypes. The file name carries a hash of the source, the flags and the CPU
(its model and instruction-set flags), so a changed source is recompiled and nodes of
different CPUs sharing one cache each get their own build; the compiled file is moved
into place atomically (ranks compiling at once do not clash). Targets are taken in
blocks: stencils and weights are computed across a block (vectorised), then the
fine-grid sums point by point with vectors of 4 (AVX) or 2 doubles. Without a
compiler, or with ``PDEFORMER_NO_KERNEL=1``, :func:`kernels` returns None and the numpy
implementation is used (same maps; the interpolation about 100x slower).
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

# vectors of VW doubles: 4 where AVX is there (the file is compiled for the host CPU),
# else 2 (SSE2, NEON); also what benchmarks/velocity.py times its FMA probe with
VECTOR_C = r"""
#if defined(__AVX__)
#define VW 4
#else
#define VW 2
#endif
typedef double vec __attribute__((vector_size(8 * VW)));
"""

SOURCE = r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* p = 5 (six nodes per axis) is fixed at compile time so that the loops unroll */
#define NP 6
/* targets per block: their stencils and weights are computed first, across the block
   (vectorised), then the fine-grid sums are done point by point */
#define BLK 64
""" + VECTOR_C + r"""
#define INLINE static inline __attribute__((always_inline))

INLINE vec loadv(const double *p) { vec v; memcpy(&v, p, sizeof v); return v; }
INLINE void storev(double *p, vec v) { memcpy(p, &v, sizeof v); }

/* 1 / prod_{c != a} (a - c) for the nodes 0..5 */
static const double INV_DEN[NP] = {-1.0 / 120, 1.0 / 24, -1.0 / 12, 1.0 / 12, -1.0 / 24,
                                   1.0 / 120};

/* Stencil start k (clamped to the grid; a NaN coordinate gives 0) and local coordinate
   t = s - k of the grid coordinate s on one axis. */
INLINE double start(double s, double last, double *t)
{
    double r = (s + 0x1.8p52) - 0x1.8p52;       /* s rounded to an integer (|s| < 2^51) */
    double k = (r > s ? r - 1.0 : r) - (NP - 2) / 2;   /* floor(s) - 2, without a libm call */
    k = k >= 0.0 ? k : 0.0;
    k = k <= last ? k : last;
    *t = s - k;
    return k;
}

/* L_a(t) = prod_{c != a} (t - c) / den_a through prefix and suffix products (exact on
   the nodes), and with dL its derivative (product rule on both). */
INLINE void weights(double t, double *L, double *dL)
{
    double P[NP], S[NP], dP[NP], dS[NP];
    P[0] = 1.0; dP[0] = 0.0;
    for (int a = 1; a < NP; ++a) {
        P[a] = P[a - 1] * (t - (a - 1));
        dP[a] = dP[a - 1] * (t - (a - 1)) + P[a - 1];
    }
    S[NP - 1] = 1.0; dS[NP - 1] = 0.0;
    for (int a = NP - 2; a >= 0; --a) {
        S[a] = S[a + 1] * (t - (a + 1));
        dS[a] = dS[a + 1] * (t - (a + 1)) + S[a + 1];
    }
    for (int a = 0; a < NP; ++a) {
        L[a] = P[a] * S[a] * INV_DEN[a];
        if (dL) dL[a] = (dP[a] * S[a] + P[a] * dS[a]) * INV_DEN[a];
    }
}

/* A block of nb targets for head A_h: b = A_h x in grid coordinates, fine-grid offsets
   of the stencils (nc interleaved values per node) and the weights of both axes; the
   derivatives too when derivatives is set. */
typedef struct {
    double off[BLK], L0[NP][BLK], L1[NP][BLK], dL0[NP][BLK], dL1[NP][BLK];
} Block;

INLINE void block_weights(Block *B, const double *xb, long nb, const double *Ah,
                          const double *lo, double ih0, double ih1, long nf0, long nf1,
                          int nc, int derivatives)
{
    double a00 = Ah[0], a01 = Ah[1], a10 = Ah[2], a11 = Ah[3], lo0 = lo[0], lo1 = lo[1];
    double last0 = (double)(nf0 - NP), last1 = (double)(nf1 - NP);
    for (long j = 0; j < nb; ++j) {
        double s0 = ((a00 * xb[2 * j] + a01 * xb[2 * j + 1]) - lo0) * ih0;
        double s1 = ((a10 * xb[2 * j] + a11 * xb[2 * j + 1]) - lo1) * ih1;
        double t0, t1, k0 = start(s0, last0, &t0), k1 = start(s1, last1, &t1);
        double W0[NP], W1[NP], D0[NP], D1[NP];
        B->off[j] = (double)nc * (k0 * (double)nf1 + k1);
        weights(t0, W0, derivatives ? D0 : 0);
        weights(t1, W1, derivatives ? D1 : 0);
        for (int a = 0; a < NP; ++a) {
            B->L0[a][j] = W0[a];
            B->L1[a][j] = W1[a];
            if (derivatives) {
                B->dL0[a][j] = D0[a];
                B->dL1[a][j] = D1[a];
            }
        }
    }
}

INLINE double absd(double v) { return v < 0.0 ? -v : v; }
INLINE double maxd(double a, double b) { return b > a ? b : a; }   /* a NaN b is ignored */
"""

# the fine-grid loops, written once for NC interleaved values per node (see FINE_LOOPS)
FINE_LOOPS = r"""
/* ---------------------------------------------------------------- fine-grid loops, NC = @NC@
   Each fine-grid node holds NC interleaved values: (m_0, m_1) for NC = 2; for signed
   densities (NC = 4) (mu_0, mu_1, zeta, 0), and m = mu / zeta is taken at each point. */
#define RV@NC@ (@NC@ * NP / VW)                  /* vectors per stencil row */
#define G@NC@ (@NC@ > VW ? @NC@ / VW : 1)        /* vectors until the lanes repeat */

/* the axis-1 weights of point j, each NC times, for the interleaved layout */
INLINE void duplicated@NC@(double W[NP][BLK], long j, vec *w)
{
    for (int q = 0; q < RV@NC@; ++q)
        for (int e = 0; e < VW; ++e) w[q][e] = W[(q * VW + e) / @NC@][j];
}

/* sum_a W[a] row_a (6 nodes x NC values per row) */
INLINE void row_sum@NC@(const double *r, long stride, double W[NP][BLK], long j, vec *acc)
{
    for (int q = 0; q < RV@NC@; ++q) acc[q] = W[0][j] * loadv(r + VW * q);
    for (int a = 1; a < NP; ++a) {
        r += stride;
        for (int q = 0; q < RV@NC@; ++q) acc[q] += W[a][j] * loadv(r + VW * q);
    }
}

/* the NC values: sum over the 6 axis-1 nodes of acc times the weights w */
INLINE void contract@NC@(const vec *acc, const vec *w, double *c)
{
    vec s[G@NC@];
    for (int g = 0; g < G@NC@; ++g) s[g] = acc[g] * w[g];
    for (int q = G@NC@; q < RV@NC@; ++q) s[q % G@NC@] += acc[q] * w[q];
    for (int k = 0; k < @NC@; ++k) c[k] = 0.0;
    for (int g = 0; g < G@NC@; ++g)
        for (int e = 0; e < VW; ++e) c[(g * VW + e) % @NC@] += s[g][e];
}

/* v_i += (1/H) sum_h V_h m(A_h x_i). NC = 4: pairs (h, i) with |zeta| < zmin are left
   out (their m is ill-conditioned: the caller sums them exactly) and listed in skipped
   (h N + i; the first cap of them, *nskip counting all); with stats, stats[0] = max
   1/|zeta| and stats[1] = max |m| over the other points (how well conditioned m is). */
void fine_velocity@NC@(const double *flat, long nf0, long nf1, const double *lo, const double *h,
                       int p, const double *x, long N, const double *A, const double *V, long H,
                       double *out, double *stats, double zmin, long *skipped, long cap,
                       long *nskip)
{
    double ih0 = 1.0 / h[0], ih1 = 1.0 / h[1], scale = 1.0 / (double)H;
    double kappa = 0.0, mmax = 0.0;
    long stride = @NC@ * nf1;
    Block B;
    (void)p;
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 4 * hd, *Vh = V + 4 * hd;
        for (long i0 = 0; i0 < N; i0 += BLK) {
            long nb = N - i0 < BLK ? N - i0 : BLK;
            block_weights(&B, x + 2 * i0, nb, Ah, lo, ih0, ih1, nf0, nf1, @NC@, 0);
            for (long j = 0; j < nb; ++j) {
                vec acc[RV@NC@], w[RV@NC@];
                double c[@NC@];
                row_sum@NC@(flat + (long)B.off[j], stride, B.L0, j, acc);
                duplicated@NC@(B.L1, j, w);
                contract@NC@(acc, w, c);
                double m0 = c[0], m1 = c[1];
#if @NC@ == 4
                if (absd(c[2]) < zmin) {
                    long k = (*nskip)++;
                    if (k < cap) skipped[k] = hd * N + i0 + j;
                    continue;
                }
                double iz = 1.0 / c[2];
                m0 *= iz;
                m1 *= iz;
                kappa = maxd(kappa, absd(iz));
                mmax = maxd(mmax, maxd(absd(m0), absd(m1)));
#else
                (void)zmin; (void)skipped; (void)cap; (void)nskip;
#endif
                double *o = out + 2 * (i0 + j);
                o[0] += (Vh[0] * m0 + Vh[1] * m1) * scale;
                o[1] += (Vh[2] * m0 + Vh[3] * m1) * scale;
            }
        }
    }
    if (stats) {
        stats[0] = maxd(stats[0], kappa);
        stats[1] = maxd(stats[1], mmax);
    }
}

/* mbar: the fine-grid cotangent in the layout of flat (node-major, NC values). With
   u = V_h^T g_i / H the cotangent of m, that of the node values is cb = u (NC = 2) or
   (u / zeta, -(u . m) / zeta, 0) (NC = 4), and (dm/db)^T u = sum_k cb_k dc_k/db. NC = 4:
   the pairs with |zeta| < zmin are left out, as in fine_velocity. */
void fine_velocity_vjp@NC@(const double *flat, long nf0, long nf1, const double *lo,
                           const double *h, int p, const double *x, long N, const double *A,
                           const double *V, long H, const double *g, double *mbar, double *dA,
                           double *dV, double *xbar, double zmin)
{
    double ih0 = 1.0 / h[0], ih1 = 1.0 / h[1], scale = 1.0 / (double)H;
    long stride = @NC@ * nf1;
    Block B;
    (void)p;
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 4 * hd, *Vh = V + 4 * hd;
        double *dAh = dA + 4 * hd, *dVh = dV + 4 * hd;
        for (long i0 = 0; i0 < N; i0 += BLK) {
            long nb = N - i0 < BLK ? N - i0 : BLK;
            block_weights(&B, x + 2 * i0, nb, Ah, lo, ih0, ih1, nf0, nf1, @NC@, 1);
            for (long j = 0; j < nb; ++j) {
                long i = i0 + j;
                double x0 = x[2 * i], x1 = x[2 * i + 1], g0 = g[2 * i], g1 = g[2 * i + 1];
                double u0 = (Vh[0] * g0 + Vh[2] * g1) * scale;
                double u1 = (Vh[1] * g0 + Vh[3] * g1) * scale;
                long off = (long)B.off[j];
                vec acc[RV@NC@], dacc[RV@NC@], w[RV@NC@], dw[RV@NC@];
                double c[@NC@], J0[@NC@], J1[@NC@], cb[@NC@];   /* J_a = dc / ds_a */
                row_sum@NC@(flat + off, stride, B.L0, j, acc);
                row_sum@NC@(flat + off, stride, B.dL0, j, dacc);
                duplicated@NC@(B.L1, j, w);
                duplicated@NC@(B.dL1, j, dw);
                contract@NC@(acc, w, c);
                contract@NC@(dacc, w, J0);
                contract@NC@(acc, dw, J1);
                double m0 = c[0], m1 = c[1];
#if @NC@ == 4
                if (absd(c[2]) < zmin) continue;
                double iz = 1.0 / c[2];
                m0 *= iz;
                m1 *= iz;
                cb[0] = u0 * iz;
                cb[1] = u1 * iz;
                cb[2] = -(u0 * m0 + u1 * m1) * iz;
                cb[3] = 0.0;
#else
                (void)zmin;
                cb[0] = u0;
                cb[1] = u1;
#endif
                /* the transposed interpolation: mbar[row a, node c, k] += L0_a L1_c cb_k */
                vec wu[RV@NC@];
                for (int q = 0; q < RV@NC@; ++q)
                    for (int e = 0; e < VW; ++e) wu[q][e] = w[q][e] * cb[(q * VW + e) % @NC@];
                for (int a = 0; a < NP; ++a) {
                    double *r = mbar + off + a * stride, la = B.L0[a][j];
                    for (int q = 0; q < RV@NC@; ++q) storev(r + VW * q, loadv(r + VW * q) + la * wu[q]);
                }
                dVh[0] += g0 * m0 * scale; dVh[1] += g0 * m1 * scale;
                dVh[2] += g1 * m0 * scale; dVh[3] += g1 * m1 * scale;
                double c0 = 0.0, c1 = 0.0;                     /* (dm/db)^T u */
                for (int k = 0; k < @NC@; ++k) {
                    c0 += cb[k] * J0[k];
                    c1 += cb[k] * J1[k];
                }
                c0 *= ih0;
                c1 *= ih1;
                dAh[0] += c0 * x0; dAh[1] += c0 * x1;
                dAh[2] += c1 * x0; dAh[3] += c1 * x1;
                if (xbar) {                                     /* A_h^T (dm/db)^T u */
                    xbar[2 * i] += Ah[0] * c0 + Ah[2] * c1;
                    xbar[2 * i + 1] += Ah[1] * c0 + Ah[3] * c1;
                }
            }
        }
    }
}
"""

SOURCE += "".join(FINE_LOOPS.replace("@NC@", str(nc)) for nc in (2, 4)) + r"""
/* ---------------------------------------------------------------- panel sums (d = 2)
   Sources y_j on panels: axis a of the tile is cut at edges_a[0..P_a] into P_a panels
   of q Chebyshev-Lobatto nodes (standard nodes std, barycentric weights lam on [-1, 1]).
   A source's panel is the last edge at or below it (clamped), its local coordinate
   t = 2 (y - left) / width - 1 (clamped to [-1, 1]) and its weights the Lagrange
   weights of t (barycentric formula; a source on a node gets that node). */
#define QMAX 64                       /* PANEL_QMAX on the Python side */

INLINE long panel_of(const double *edges, long P, double y)
{
    /* largest p with edges[p] <= y, in [0, P-1] (a NaN gives 0): the equispaced guess,
       then corrected against the edges themselves */
    if (!(y >= edges[0])) return 0;
    if (!(y < edges[P])) return P - 1;
    long p = (long)((y - edges[0]) / (edges[P] - edges[0]) * (double)P);
    p = p < 0 ? 0 : (p > P - 1 ? P - 1 : p);
    while (p > 0 && edges[p] > y) --p;
    while (p < P - 1 && edges[p + 1] <= y) ++p;
    return p;
}

/* the weights L of y on panel k (the one panel_of gives; the loops know it from the
   source's pair) */
INLINE void panel_weights(const double *edges, long k, int q, const double *std,
                          const double *lam, double y, double *L)
{
    double a = edges[k], b = edges[k + 1];
    double t = 2.0 * (y - a) / (b > a ? b - a : 1.0) - 1.0;
    t = t >= -1.0 ? t : -1.0;
    t = t <= 1.0 ? t : 1.0;
    double sum = 0.0, on_node = 0.0;
    for (int i = 0; i < q; ++i) on_node += (t == std[i]);
    if (on_node > 0.0) {
        for (int i = 0; i < q; ++i) L[i] = (t == std[i]);
    } else {
        double part[4] = {0.0, 0.0, 0.0, 0.0};   /* four partial sums: no long chain */
        for (int i = 0; i < q; ++i) L[i] = lam[i] / (t - std[i]);
        for (int i = 0; i < q; ++i) part[i % 4] += L[i];
        sum = (part[0] + part[1]) + (part[2] + part[3]);
        double inv = 1.0 / sum;
        for (int i = 0; i < q; ++i) L[i] *= inv;
    }
}

/* The sources ordered by panel pair: order[start[k] .. start[k+1]) are those of pair
   k = p0 P1 + p1 (a counting sort); returns 0, or -1 when out of memory. */
static int by_panel(long M, const double *y, const double *edges0, long P0,
                    const double *edges1, long P1, long **order, long **start)
{
    long nk = P0 * P1;
    long *key = malloc(sizeof(long) * (M > 0 ? M : 1));
    *order = malloc(sizeof(long) * (M > 0 ? M : 1));
    *start = calloc(nk + 1, sizeof(long));
    if (!key || !*order || !*start) {
        free(key); free(*order); free(*start);
        return -1;
    }
    for (long j = 0; j < M; ++j) {
        key[j] = panel_of(edges0, P0, y[2 * j]) * P1 + panel_of(edges1, P1, y[2 * j + 1]);
        (*start)[key[j] + 1]++;
    }
    for (long k = 0; k < nk; ++k) (*start)[k + 1] += (*start)[k];
    long *fill = malloc(sizeof(long) * (nk > 0 ? nk : 1));
    if (!fill) {
        free(key); free(*order); free(*start);
        return -1;
    }
    memcpy(fill, *start, sizeof(long) * nk);
    for (long j = 0; j < M; ++j) (*order)[fill[key[j]]++] = j;
    free(fill);
    free(key);
    return 0;
}

/* Register-blocked C (r x c) = A^T B over m rows: A (m x ra) and B (m x cb) row-major
   with ra a multiple of 4 and cb of CB; blocks of 4 rows of C x CB columns stay in
   vector registers while the m rows stream by (12 vector FMAs per row and block). */
#define CB (3 * VW)
/* sources of one panel pair handled at a time (bounds the work arrays) */
#define PAIR_CHUNK 4096

INLINE void at_b(long m, const double *A, long ra, const double *B, long cb, double *C)
{
    for (long r0 = 0; r0 < ra; r0 += 4)
        for (long c0 = 0; c0 < cb; c0 += CB) {
            vec acc[4][3];
            for (int i = 0; i < 4; ++i)
                for (int k = 0; k < 3; ++k) acc[i][k] = (vec){0};
            for (long s = 0; s < m; ++s) {
                const double *brow = B + s * cb + c0, *arow = A + s * ra + r0;
                vec b0 = loadv(brow), b1 = loadv(brow + VW), b2 = loadv(brow + 2 * VW);
                for (int i = 0; i < 4; ++i) {
                    double u = arow[i];
                    acc[i][0] += u * b0;
                    acc[i][1] += u * b1;
                    acc[i][2] += u * b2;
                }
            }
            for (int i = 0; i < 4; ++i)
                for (int k = 0; k < 3; ++k) storev(C + (r0 + i) * cb + c0 + k * VW, acc[i][k]);
        }
}

INLINE long round_up(long v, long to) { return (v + to - 1) / to * to; }

/* the largest number of sources of one panel pair */
static long largest(const long *start, long nk)
{
    long m = 0;
    for (long k = 0; k < nk; ++k)
        if (start[k + 1] - start[k] > m) m = start[k + 1] - start[k];
    return m;
}

/* W[c, k0, k1] += sum_j cols[j, c] L0_j[k0] L1_j[k1] (W: (ncols, P0 q, P1 q)), one
   panel pair at a time: with U_j = cols_j (x) L0_j and V_j = L1_j (zero-padded rows of
   the pair's sources), its (ncols q, q) block is U^T V. Returns 0, or -1 (no memory). */
int panel_spread(long M, const double *y, const double *cols, int ncols,
                 const double *edges0, long P0, const double *edges1, long P1, int q,
                 const double *std, const double *lam, double *W)
{
    long K0 = P0 * q, K1 = P1 * q, *order, *start;
    long ra = round_up(ncols * q, 4), cb = round_up(q, CB);
    if (q > QMAX) return -1;
    if (by_panel(M, y, edges0, P0, edges1, P1, &order, &start)) return -1;
    long mmax = largest(start, P0 * P1);
    mmax = mmax < PAIR_CHUNK ? mmax : PAIR_CHUNK;
    double *U = calloc(mmax * ra + 1, sizeof(double)), *V = calloc(mmax * cb + 1, sizeof(double));
    double *local = malloc(sizeof(double) * ra * cb), *part = malloc(sizeof(double) * ra * cb);
    int status = (U && V && local && part) ? 0 : -1;
    double L0[QMAX], L1[QMAX];
    for (long k = 0; k < P0 * P1 && !status; ++k) {
        long p0 = k / P1, p1 = k % P1;
        if (start[k] == start[k + 1]) continue;
        for (long s0 = start[k]; s0 < start[k + 1]; s0 += PAIR_CHUNK) {
            long m = start[k + 1] - s0 < PAIR_CHUNK ? start[k + 1] - s0 : PAIR_CHUNK;
            for (long s = 0; s < m; ++s) {
                long j = order[s0 + s];
                panel_weights(edges0, p0, q, std, lam, y[2 * j], L0);
                panel_weights(edges1, p1, q, std, lam, y[2 * j + 1], L1);
                for (int c = 0; c < ncols; ++c)
                    for (int a = 0; a < q; ++a) U[s * ra + c * q + a] = cols[j * ncols + c] * L0[a];
                for (int b = 0; b < q; ++b) V[s * cb + b] = L1[b];
            }
            if (s0 == start[k]) {
                at_b(m, U, ra, V, cb, local);
            } else {
                at_b(m, U, ra, V, cb, part);
                for (long r = 0; r < ra * cb; ++r) local[r] += part[r];
            }
        }
        for (int c = 0; c < ncols; ++c)
            for (int a = 0; a < q; ++a) {
                double *row = W + c * K0 * K1 + (p0 * q + a) * K1 + p1 * q;
                const double *src = local + (c * q + a) * cb;
                for (int b = 0; b < q; ++b) row[b] += src[b];
            }
    }
    free(U); free(V); free(local); free(part); free(order); free(start);
    return status;
}

/* out[j, i] = sum_{k0, k1} L0_j[k0] L1_j[k1] G[i, k0, k1] (G: (ni, P0 q, P1 q)), one
   panel pair at a time: T = V Gt with V_j = L1_j and Gt[b, i q + a] the pair's block of
   G, then out[j, i] = sum_a T[j, i q + a] L0_j[a]. Returns 0, or -1 (no memory). */
int panel_gather(long M, const double *y, const double *G, int ni,
                 const double *edges0, long P0, const double *edges1, long P1, int q,
                 const double *std, const double *lam, double *out)
{
    long K0 = P0 * q, K1 = P1 * q, *order, *start;
    long cp = round_up(ni * q, CB), qp = round_up(q, 4);
    if (q > QMAX) return -1;
    if (by_panel(M, y, edges0, P0, edges1, P1, &order, &start)) return -1;
    long mmax = largest(start, P0 * P1);
    mmax = round_up(mmax < PAIR_CHUNK ? mmax : PAIR_CHUNK, 4);
    /* V^T (qp x m) as the A of at_b: T^T... computed as at_b(q, Vt, m, Gt, cp) */
    double *Vt = calloc(qp * mmax + 1, sizeof(double)), *L0s = malloc(sizeof(double) * (mmax * q + 1));
    double *Gt = calloc(qp * cp + 1, sizeof(double)), *T = malloc(sizeof(double) * (mmax * cp + 1));
    int status = (Vt && L0s && Gt && T) ? 0 : -1;
    double L1[QMAX];
    for (long k = 0; k < P0 * P1 && !status; ++k) {
        long p0 = k / P1, p1 = k % P1;
        if (start[k] == start[k + 1]) continue;
        for (int b = 0; b < q; ++b)
            for (int i = 0; i < ni; ++i)
                for (int a = 0; a < q; ++a)
                    Gt[b * cp + i * q + a] = G[i * K0 * K1 + (p0 * q + a) * K1 + p1 * q + b];
        for (long s0 = start[k]; s0 < start[k + 1]; s0 += PAIR_CHUNK) {
            long m = start[k + 1] - s0 < PAIR_CHUNK ? start[k + 1] - s0 : PAIR_CHUNK;
            long mp = round_up(m, 4);
            for (long s = 0; s < mp; ++s)
                for (int b = 0; b < q; ++b) Vt[b * mp + s] = 0.0;
            for (long s = 0; s < m; ++s) {
                long j = order[s0 + s];
                panel_weights(edges0, p0, q, std, lam, y[2 * j], L0s + s * q);
                panel_weights(edges1, p1, q, std, lam, y[2 * j + 1], L1);
                for (int b = 0; b < q; ++b) Vt[b * mp + s] = L1[b];
            }
            at_b(q, Vt, mp, Gt, cp, T);              /* T (mp x cp) = Vt^T Gt */
            for (long s = 0; s < m; ++s) {
                long j = order[s0 + s];
                for (int i = 0; i < ni; ++i) {
                    const double *t = T + s * cp + i * q, *l = L0s + s * q;
                    double total = 0.0;
                    for (int a = 0; a < q; ++a) total += t[a] * l[a];
                    out[j * ni + i] = total;
                }
            }
        }
    }
    free(Vt); free(L0s); free(Gt); free(T); free(order); free(start);
    return status;
}
"""

FINE_WIDTHS = (2, 4)  # values per fine-grid node the loops are built for (FINE_LOOPS)
KERNEL_DEGREE = 5    # the local Lagrange degree the loops are compiled for (NP = 6 nodes)
PANEL_QMAX = 64      # the most nodes per panel the panel loops take (QMAX)
# gnu99: vector extensions and fused multiply-adds; -fno-trapping-math lets the
# clamps of the stencil start vectorise (the values are those of IEEE arithmetic)
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu99", "-fno-fast-math", "-fno-trapping-math"]
HOST_FLAGS = ["-march=native"]    # tried first; dropped if the compiler refuses it
_loaded: dict = {}


def cache_dir() -> Path:
    if os.environ.get("PDEFORMER_CACHE"):
        return Path(os.environ["PDEFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdeformer"


def _compile(target: Path, source: str = SOURCE) -> None:
    """``source`` built into the shared library ``target`` with $CC (default cc) and FLAGS,
    HOST_FLAGS where the compiler takes them; RuntimeError if it fails, OSError without cc."""
    target.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "fine.c"
        src.write_text(source)
        lib = Path(tmp) / target.name
        for extra in (HOST_FLAGS, []):
            run = subprocess.run([cc, *FLAGS, *extra, str(src), "-o", str(lib), "-lm"],
                                 capture_output=True, timeout=120)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {run.stderr.decode(errors='replace')[-300:]}")
        os.replace(lib, target)       # atomic: a rank never loads a half-written file


def cpu_identity() -> str:
    """The CPU as far as compiled code cares: model and instruction-set flags (Linux's
    /proc/cpuinfo; elsewhere what platform reports)."""
    keep = ("model name", "flags", "features", "cpu part", "cpu implementer", "isa")
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        return " | ".join(ln for ln in lines if ln.split(":")[0].strip().lower() in keep)
    except OSError:
        return f"{platform.processor()} {platform.machine()}"


def kernels():
    """The compiled kernels (a ctypes library), or None where they cannot be had."""
    if "lib" in _loaded:
        return _loaded["lib"]
    lib = None
    if os.environ.get("PDEFORMER_NO_KERNEL", "") not in ("", "0"):
        _loaded["lib"] = None
        return None
    machine = f"{sys.platform} {platform.machine()} {platform.libc_ver()} {cpu_identity()}"
    key = hashlib.sha256((SOURCE + " ".join(FLAGS + HOST_FLAGS) + machine).encode()).hexdigest()[:16]
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
        for nc in FINE_WIDTHS:
            fv, vjp = getattr(lib, f"fine_velocity{nc}"), getattr(lib, f"fine_velocity_vjp{nc}")
            lp, db = ctypes.POINTER(ctypes.c_long), ctypes.c_double
            fv.argtypes = [dp, lg, lg, dp, dp, it, dp, lg, dp, dp, lg, dp, dp, db, lp, lg, lp]
            vjp.argtypes = [dp, lg, lg, dp, dp, it, dp, lg, dp, dp, lg, dp, dp, dp, dp, dp, db]
            fv.restype = vjp.restype = None
        panel = [lg, dp, dp, it, dp, lg, dp, lg, it, dp, dp, dp]
        lib.panel_spread.argtypes = lib.panel_gather.argtypes = panel
        lib.panel_spread.restype = lib.panel_gather.restype = ctypes.c_int
        if not self_check(lib):
            log.warning("laplace: the compiled loops from %s fail their check (a compiler "
                        "that reorders floating-point sums?); using numpy", os.environ.get("CC", "cc"))
            lib = None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.debug("laplace: compiled interpolation unavailable (%s); using numpy", e)
        lib = None
    _loaded["lib"] = lib
    return lib


def self_check(lib) -> bool:
    """The fine-grid loops reproduce a linear m(b) = b between nodes: from the values m
    (NC = 2), and as mu / zeta with mu = b zeta, zeta = 2 + b_0 - b_1 / 3 (NC = 4).
    Degree-5 Lagrange interpolation is exact for these; a wrong stencil start (e.g. a
    rounding step folded away by the compiler) or lane order is not."""
    nf, h, lo = 12, np.array([0.5, 0.25]), np.array([-1.0, 2.0])
    nodes = np.stack(np.meshgrid(lo[0] + h[0] * np.arange(nf), lo[1] + h[1] * np.arange(nf),
                                 indexing="ij"), axis=-1).reshape(-1, 2)
    zeta = 2.0 + (nodes[:, 0] - nodes[:, 1] / 3) / 20
    signed = np.column_stack([nodes * zeta[:, None], zeta, np.zeros_like(zeta)])
    b = lo + (nf - 1) * h * np.array([[0.137, 0.731], [0.5013, 0.2499], [0.9, 0.05]])
    eye = np.eye(2)[None]
    plain = fine_velocity(lib, nodes, nf, lo, h, KERNEL_DEGREE, b, eye, eye)
    ratio, skipped = fine_velocity(lib, signed, nf, lo, h, KERNEL_DEGREE, b, eye, eye, zmin=1e-3)
    return bool(len(skipped) == 0 and all(np.abs(v - b).max() <= 1e-12 * np.abs(b).max()
                                          for v in (plain, ratio)))


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


def fine_velocity(lib, flat, nf: int, lo, h, p: int, x, A, V, stats=None, zmin: float = 0.0):
    """v (N, 2) = (1/H) sum_h V_h m(A_h x) with the compiled loop; ``flat`` (nf*nf, NC)
    holds m (NC = 2) or (mu, zeta, 0) (NC = 4, m = mu / zeta). With NC = 4: ``stats`` (an
    array of 2) becomes max(stats, (max 1/|zeta|, max |m|)) over the points, and the pairs
    with |zeta| < zmin are left out of v; returns (v, their indices h N + i) then."""
    flat, lo, h, x, A, V = map(_c, (flat, lo, h, x, A, V))
    out = np.zeros_like(x)
    call = getattr(lib, f"fine_velocity{flat.shape[1]}")
    args = (_ptr(flat), nf, nf, _ptr(lo), _ptr(h), p, _ptr(x), len(x), _ptr(A), _ptr(V), len(A),
            _ptr(out), _ptr(stats) if stats is not None else None, zmin)
    if flat.shape[1] == 2:
        call(*args, None, 0, None)
        return out
    cap, count = max(64, len(x) * len(A) // 16), ctypes.c_long(0)
    skipped = np.empty(cap, dtype=np.int64)
    call(*args, _iptr(skipped), cap, ctypes.byref(count))
    if count.value > cap:               # more than expected: again, with room for all
        out[:] = 0.0
        skipped, count = np.empty(count.value, dtype=np.int64), ctypes.c_long(0)
        call(*args, _iptr(skipped), len(skipped), ctypes.byref(count))
    return out, skipped[:count.value].copy()


def fine_velocity_vjp(lib, flat, nf: int, lo, h, p: int, x, A, V, g, positions: bool = False,
                      zmin: float = 0.0):
    """(mbar (NC, nf*nf), dA (H, 2, 2), dV (H, 2, 2), xbar (N, 2) or None) for the
    cotangents g of v; mbar is the cotangent of the NC node values of ``flat``; xbar
    (the targets' cotangent) with ``positions``. NC = 4: without the pairs |zeta| < zmin."""
    flat, lo, h, x, A, V, g = map(_c, (flat, lo, h, x, A, V, g))
    mbar = np.zeros(flat.shape)
    dA, dV = np.zeros_like(A), np.zeros_like(V)
    xbar = np.zeros_like(x) if positions else None
    getattr(lib, f"fine_velocity_vjp{flat.shape[1]}")(
        _ptr(flat), nf, nf, _ptr(lo), _ptr(h), p, _ptr(x), len(x), _ptr(A), _ptr(V), len(A),
        _ptr(g), _ptr(mbar), _ptr(dA), _ptr(dV), _ptr(xbar) if positions else None, zmin)
    return mbar.T, dA, dV, xbar


def _iptr(a: np.ndarray):
    assert a.dtype == np.int64 and a.flags.c_contiguous and ctypes.sizeof(ctypes.c_long) == 8
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_long))


def _panel_args(panels):
    """Edges, counts and the standard nodes of two axes' Panels (laplace.Panels), and the
    arrays behind the pointers (to be kept alive during the call)."""
    e0, e1, std, lam = (_c(a) for a in (panels[0].edges, panels[1].edges, panels[0].std, panels[0].lam))
    return (_ptr(e0), panels[0].count, _ptr(e1), panels[1].count, panels[0].q, _ptr(std),
            _ptr(lam)), (e0, e1, std, lam)


def panel_spread(lib, panels, y, cols) -> np.ndarray:
    """W (ncols, K0, K1) = sum_j cols[j, c] L(y_j0) (x) L(y_j1): sources on panel nodes."""
    y, cols = _c(y), _c(cols)
    W = np.zeros((cols.shape[1], len(panels[0].nodes), len(panels[1].nodes)))
    args, keep = _panel_args(panels)
    if lib.panel_spread(len(y), _ptr(y), _ptr(cols), cols.shape[1], *args, _ptr(W)):
        raise MemoryError("panel_spread: out of memory")
    return W


def panel_gather(lib, panels, y, G) -> np.ndarray:
    """out (M, ni): the panel-node grids G (ni, K0, K1) interpolated at the sources y."""
    y, G = _c(y), _c(G)
    out = np.empty((len(y), G.shape[0]))
    args, keep = _panel_args(panels)
    if lib.panel_gather(len(y), _ptr(y), _ptr(G), G.shape[0], *args, _ptr(out)):
        raise MemoryError("panel_gather: out of memory")
    return out
