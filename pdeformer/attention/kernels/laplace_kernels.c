#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Compiled by pdeformer._kernels with -DNP=<KERNEL_DEGREE + 1> and -DQMAX=<PANEL_QMAX>
   (defined there, once) and -I<this directory>. */
#ifndef QMAX
#error "QMAX (the most nodes per panel) comes from pdeformer._kernels.PANEL_QMAX: compile with -DQMAX=..."
#endif
/* p = 5 (six nodes per axis) is fixed at compile time so that the loops unroll; INV_DEN
   below is written out for it */
#ifndef NP
#error "NP (nodes per axis of the fine-grid stencil) comes from pdeformer._kernels.KERNEL_DEGREE + 1: compile with -DNP=..."
#elif NP != 6
#error "the fine-grid loops are written for NP = 6 (KERNEL_DEGREE = 5)"
#endif
/* targets per block: their stencils and weights are computed first, across the block
   (vectorised), then the fine-grid sums are done point by point */
#define BLK 64

#include "vector.h"

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

/* the fine-grid loops for NC = 2 and 4 values per node (pdeformer._kernels.FINE_WIDTHS) */
#define NC 2
#include "fine_loops.h"
#undef NC
#define NC 4
#include "fine_loops.h"
#undef NC

/* the fine-grid loops of d = 3 (four values per node) */
#include "fine3_loops.h"

/* ---------------------------------------------------------------- panel sums (d = 2)
   Sources y_j on panels: axis a of the tile is cut at edges_a[0..P_a] into P_a panels
   of q Chebyshev-Lobatto nodes (standard nodes std, barycentric weights lam on [-1, 1]).
   A source's panel is the last edge at or below it (clamped), its local coordinate
   t = 2 (y - left) / width - 1 (clamped to [-1, 1]) and its weights the Lagrange
   weights of t (barycentric formula; a source on a node gets that node). */
/* QMAX: from the compiler's command line (-DQMAX=<pdeformer._kernels.PANEL_QMAX>) */

/* the QMAX this library was built with (pdeformer's test checks it is PANEL_QMAX) */
int panel_qmax(void) { return QMAX; }

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
