/* ---------------------------------------------------------------- fine-grid loops, d = 3
   Included once by laplace_kernels.c (it supplies NP, VW, vec, INLINE, loadv, storev,
   start, weights, absd and maxd). Every node of the nf0 x nf1 x nf2 fine grid holds four
   interleaved values: (m_0, m_1, m_2, 0), or for signed densities (sgn != 0)
   (mu_0, mu_1, mu_2, zeta) with m = mu / zeta taken at each point. A stencil is
   NP x NP x NP nodes; each of its NP x NP rows is NP contiguous nodes. */
#define NV (4 / VW)                            /* vectors per node */

/* Stencil offset (in doubles) and the weights of the three axes for b = A_h x. */
INLINE long stencil3(const double *Ah, const double *x, const double *lo, const double *ih,
                     long nf1, long nf2, const double *last, double L[3][NP], double dL[3][NP])
{
    double k[3];
    for (int a = 0; a < 3; ++a) {
        double s = ((Ah[3 * a] * x[0] + Ah[3 * a + 1] * x[1] + Ah[3 * a + 2] * x[2]) - lo[a]) * ih[a];
        double t;
        k[a] = start(s, last[a], &t);
        weights(t, L[a], dL ? dL[a] : 0);
    }
    return 4 * (((long)k[0] * nf1 + (long)k[1]) * nf2 + (long)k[2]);
}

/* c = sum_abc L0_a L1_b L2_c node(a, b, c); with J (not NULL) also the derivatives
   J[e] of c along axis e (in grid units: dL_e in place of L_e). */
INLINE void gather3(const double *flat, long off, long nf1, long nf2, double L[3][NP],
                    double dL[3][NP], double c[4], double J[3][4])
{
    vec acc[NV] = {0}, j0[NV] = {0}, j1[NV] = {0}, j2[NV] = {0};
    for (int a = 0; a < NP; ++a) {
        vec ra[NV] = {0}, ra1[NV] = {0}, ra2[NV] = {0};
        for (int b = 0; b < NP; ++b) {
            const double *r = flat + off + 4 * ((long)a * nf1 + b) * nf2;
            vec rb[NV] = {0}, drb[NV] = {0};
            for (int q = 0; q < NP; ++q)
                for (int v = 0; v < NV; ++v) {
                    vec node = loadv(r + 4 * q + VW * v);
                    rb[v] += L[2][q] * node;
                    if (J) drb[v] += dL[2][q] * node;
                }
            for (int v = 0; v < NV; ++v) {
                ra[v] += L[1][b] * rb[v];
                if (J) {
                    ra1[v] += dL[1][b] * rb[v];
                    ra2[v] += L[1][b] * drb[v];
                }
            }
        }
        for (int v = 0; v < NV; ++v) {
            acc[v] += L[0][a] * ra[v];
            if (J) {
                j0[v] += dL[0][a] * ra[v];
                j1[v] += L[0][a] * ra1[v];
                j2[v] += L[0][a] * ra2[v];
            }
        }
    }
    for (int v = 0; v < NV; ++v) {
        storev(c + VW * v, acc[v]);
        if (J) {
            storev(J[0] + VW * v, j0[v]);
            storev(J[1] + VW * v, j1[v]);
            storev(J[2] + VW * v, j2[v]);
        }
    }
}

/* v_i += (1/H) sum_h V_h m(A_h x_i) (A, V: H x 3 x 3, row-major). Signed: the pairs with
   |zeta| < zmin are left out and listed in skipped (h N + i; the first cap, *nskip
   counting all); stats[0] = max 1/|zeta|, stats[1] = max |m| over the others. */
void fine3_velocity(const double *flat, long nf0, long nf1, long nf2, const double *lo,
                    const double *h, const double *x, long N, const double *A, const double *V,
                    long H, int sgn, double *out, double *stats, double zmin, long *skipped,
                    long cap, long *nskip)
{
    double ih[3] = {1.0 / h[0], 1.0 / h[1], 1.0 / h[2]}, scale = 1.0 / (double)H;
    double last[3] = {(double)(nf0 - NP), (double)(nf1 - NP), (double)(nf2 - NP)};
    double kappa = 0.0, mmax = 0.0;
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 9 * hd, *Vh = V + 9 * hd;
        for (long i = 0; i < N; ++i) {
            double L[3][NP], c[4];
            long off = stencil3(Ah, x + 3 * i, lo, ih, nf1, nf2, last, L, 0);
            gather3(flat, off, nf1, nf2, L, 0, c, 0);
            double m0 = c[0], m1 = c[1], m2 = c[2];
            if (sgn) {
                if (absd(c[3]) < zmin) {
                    long k = (*nskip)++;
                    if (k < cap) skipped[k] = hd * N + i;
                    continue;
                }
                double iz = 1.0 / c[3];
                m0 *= iz; m1 *= iz; m2 *= iz;
                kappa = maxd(kappa, absd(iz));
                mmax = maxd(mmax, maxd(absd(m0), maxd(absd(m1), absd(m2))));
            }
            double *o = out + 3 * i;
            for (int r = 0; r < 3; ++r)
                o[r] += (Vh[3 * r] * m0 + Vh[3 * r + 1] * m1 + Vh[3 * r + 2] * m2) * scale;
        }
    }
    if (stats) {
        stats[0] = maxd(stats[0], kappa);
        stats[1] = maxd(stats[1], mmax);
    }
}

/* Cotangents of <g, v>: with u = V_h^T g_i / H the cotangent of m and cb that of the
   node values (u, 0; signed: u / zeta, -(u . m) / zeta), the gradient in b is
   gb_a = sum_k cb_k dc_k/db_a; dA_h += gb x_i^T, dV_h += g_i m^T / H, xbar_i += A_h^T gb
   (xbar not NULL) and mbar[node] += L0 L1 L2 cb (mbar in the layout of flat). Signed:
   without the pairs |zeta| < zmin. */
void fine3_velocity_vjp(const double *flat, long nf0, long nf1, long nf2, const double *lo,
                        const double *h, const double *x, long N, const double *A,
                        const double *V, long H, int sgn, const double *g, double *mbar,
                        double *dA, double *dV, double *xbar, double zmin)
{
    double ih[3] = {1.0 / h[0], 1.0 / h[1], 1.0 / h[2]}, scale = 1.0 / (double)H;
    double last[3] = {(double)(nf0 - NP), (double)(nf1 - NP), (double)(nf2 - NP)};
    for (long hd = 0; hd < H; ++hd) {
        const double *Ah = A + 9 * hd, *Vh = V + 9 * hd;
        double *dAh = dA + 9 * hd, *dVh = dV + 9 * hd;
        for (long i = 0; i < N; ++i) {
            const double *xi = x + 3 * i, *gi = g + 3 * i;
            double L[3][NP], dL[3][NP], c[4], J[3][4], cb[4], u[3], m[3];
            long off = stencil3(Ah, xi, lo, ih, nf1, nf2, last, L, dL);
            gather3(flat, off, nf1, nf2, L, dL, c, J);
            for (int k = 0; k < 3; ++k)
                u[k] = (Vh[k] * gi[0] + Vh[3 + k] * gi[1] + Vh[6 + k] * gi[2]) * scale;
            if (sgn) {
                if (absd(c[3]) < zmin) continue;
                double iz = 1.0 / c[3];
                for (int k = 0; k < 3; ++k) m[k] = c[k] * iz;
                for (int k = 0; k < 3; ++k) cb[k] = u[k] * iz;
                cb[3] = -(u[0] * m[0] + u[1] * m[1] + u[2] * m[2]) * iz;
            } else {
                for (int k = 0; k < 3; ++k) { m[k] = c[k]; cb[k] = u[k]; }
                cb[3] = 0.0;
            }
            double gb[3];
            for (int a = 0; a < 3; ++a)
                gb[a] = (cb[0] * J[a][0] + cb[1] * J[a][1] + cb[2] * J[a][2] + cb[3] * J[a][3]) * ih[a];
            for (int a = 0; a < 3; ++a)
                for (int e = 0; e < 3; ++e) {
                    dAh[3 * a + e] += gb[a] * xi[e];
                    dVh[3 * a + e] += gi[a] * m[e] * scale;
                }
            if (xbar)
                for (int e = 0; e < 3; ++e)
                    xbar[3 * i + e] += Ah[e] * gb[0] + Ah[3 + e] * gb[1] + Ah[6 + e] * gb[2];
            /* the transposed interpolation */
            vec cv[NV];
            for (int v = 0; v < NV; ++v) cv[v] = loadv(cb + VW * v);
            for (int a = 0; a < NP; ++a)
                for (int b = 0; b < NP; ++b) {
                    double wab = L[0][a] * L[1][b];
                    double *r = mbar + off + 4 * ((long)a * nf1 + b) * nf2;
                    for (int q = 0; q < NP; ++q)
                        for (int v = 0; v < NV; ++v)
                            storev(r + 4 * q + VW * v, loadv(r + 4 * q + VW * v) + (wab * L[2][q]) * cv[v]);
                }
        }
    }
}
#undef NV
