/* ---------------------------------------------------------------- fine-grid loops, NC
   The fine-grid loops of laplace_kernels.c, written once for NC interleaved values per
   fine-grid node and included there once with NC = 2 and once with NC = 4 (it supplies
   NP, BLK, VW, vec, INLINE, Block, block_weights, absd and maxd). Each fine-grid node
   holds NC interleaved values: (m_0, m_1) for NC = 2; for signed densities (NC = 4)
   (mu_0, mu_1, zeta, 0), and m = mu / zeta is taken at each point. */
#ifndef NC
#error "define NC (values per fine-grid node) before including fine_loops.h"
#endif
/* the names of this instance carry NC: fine_velocity2, fine_velocity_vjp4, ... (the
   symbols pdeformer.attention.compiled calls) */
#define PASTE_(a, b) a##b
#define PASTE(a, b) PASTE_(a, b)
#define WITH_NC(name) PASTE(name, NC)
#define RV (NC * NP / VW)                      /* vectors per stencil row */
#define GR (NC > VW ? NC / VW : 1)             /* vectors until the lanes repeat */

/* the axis-1 weights of point j, each NC times, for the interleaved layout */
INLINE void WITH_NC(duplicated)(double W[NP][BLK], long j, vec *w)
{
    for (int q = 0; q < RV; ++q)
        for (int e = 0; e < VW; ++e) w[q][e] = W[(q * VW + e) / NC][j];
}

/* sum_a W[a] row_a (6 nodes x NC values per row) */
INLINE void WITH_NC(row_sum)(const double *r, long stride, double W[NP][BLK], long j, vec *acc)
{
    for (int q = 0; q < RV; ++q) acc[q] = W[0][j] * loadv(r + VW * q);
    for (int a = 1; a < NP; ++a) {
        r += stride;
        for (int q = 0; q < RV; ++q) acc[q] += W[a][j] * loadv(r + VW * q);
    }
}

/* the NC values: sum over the 6 axis-1 nodes of acc times the weights w */
INLINE void WITH_NC(contract)(const vec *acc, const vec *w, double *c)
{
    vec s[GR];
    for (int g = 0; g < GR; ++g) s[g] = acc[g] * w[g];
    for (int q = GR; q < RV; ++q) s[q % GR] += acc[q] * w[q];
    for (int k = 0; k < NC; ++k) c[k] = 0.0;
    for (int g = 0; g < GR; ++g)
        for (int e = 0; e < VW; ++e) c[(g * VW + e) % NC] += s[g][e];
}

/* v_i += (1/H) sum_h V_h m(A_h x_i). NC = 4: pairs (h, i) with |zeta| < zmin are left
   out (their m is ill-conditioned: the caller sums them exactly) and listed in skipped
   (h N + i; the first cap of them, *nskip counting all); with stats, stats[0] = max
   1/|zeta| and stats[1] = max |m| over the other points (how well conditioned m is). */
void WITH_NC(fine_velocity)(const double *flat, long nf0, long nf1, const double *lo, const double *h,
                       int p, const double *x, long N, const double *A, const double *V, long H,
                       double *out, double *stats, double zmin, long *skipped, long cap,
                       long *nskip)
{
    double ih0 = 1.0 / h[0], ih1 = 1.0 / h[1], scale = 1.0 / (double)H;
    double kappa = 0.0, mmax = 0.0;
    long stride = NC * nf1;
    Block B;
    (void)p;
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 4 * hd, *Vh = V + 4 * hd;
        for (long i0 = 0; i0 < N; i0 += BLK) {
            long nb = N - i0 < BLK ? N - i0 : BLK;
            block_weights(&B, x + 2 * i0, nb, Ah, lo, ih0, ih1, nf0, nf1, NC, 0);
            for (long j = 0; j < nb; ++j) {
                vec acc[RV], w[RV];
                double c[NC];
                WITH_NC(row_sum)(flat + (long)B.off[j], stride, B.L0, j, acc);
                WITH_NC(duplicated)(B.L1, j, w);
                WITH_NC(contract)(acc, w, c);
                double m0 = c[0], m1 = c[1];
#if NC == 4
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
void WITH_NC(fine_velocity_vjp)(const double *flat, long nf0, long nf1, const double *lo,
                           const double *h, int p, const double *x, long N, const double *A,
                           const double *V, long H, const double *g, double *mbar, double *dA,
                           double *dV, double *xbar, double zmin)
{
    double ih0 = 1.0 / h[0], ih1 = 1.0 / h[1], scale = 1.0 / (double)H;
    long stride = NC * nf1;
    Block B;
    (void)p;
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 4 * hd, *Vh = V + 4 * hd;
        double *dAh = dA + 4 * hd, *dVh = dV + 4 * hd;
        for (long i0 = 0; i0 < N; i0 += BLK) {
            long nb = N - i0 < BLK ? N - i0 : BLK;
            block_weights(&B, x + 2 * i0, nb, Ah, lo, ih0, ih1, nf0, nf1, NC, 1);
            for (long j = 0; j < nb; ++j) {
                long i = i0 + j;
                double x0 = x[2 * i], x1 = x[2 * i + 1], g0 = g[2 * i], g1 = g[2 * i + 1];
                double u0 = (Vh[0] * g0 + Vh[2] * g1) * scale;
                double u1 = (Vh[1] * g0 + Vh[3] * g1) * scale;
                long off = (long)B.off[j];
                vec acc[RV], dacc[RV], w[RV], dw[RV];
                double c[NC], J0[NC], J1[NC], cb[NC];   /* J_a = dc / ds_a */
                WITH_NC(row_sum)(flat + off, stride, B.L0, j, acc);
                WITH_NC(row_sum)(flat + off, stride, B.dL0, j, dacc);
                WITH_NC(duplicated)(B.L1, j, w);
                WITH_NC(duplicated)(B.dL1, j, dw);
                WITH_NC(contract)(acc, w, c);
                WITH_NC(contract)(dacc, w, J0);
                WITH_NC(contract)(acc, dw, J1);
                double m0 = c[0], m1 = c[1];
#if NC == 4
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
                vec wu[RV];
                for (int q = 0; q < RV; ++q)
                    for (int e = 0; e < VW; ++e) wu[q][e] = w[q][e] * cb[(q * VW + e) % NC];
                for (int a = 0; a < NP; ++a) {
                    double *r = mbar + off + a * stride, la = B.L0[a][j];
                    for (int q = 0; q < RV; ++q) storev(r + VW * q, loadv(r + VW * q) + la * wu[q]);
                }
                dVh[0] += g0 * m0 * scale; dVh[1] += g0 * m1 * scale;
                dVh[2] += g1 * m0 * scale; dVh[3] += g1 * m1 * scale;
                double c0 = 0.0, c1 = 0.0;                     /* (dm/db)^T u */
                for (int k = 0; k < NC; ++k) {
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

#undef GR
#undef RV
#undef WITH_NC
#undef PASTE
#undef PASTE_
