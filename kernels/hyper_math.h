/* hyper_math.h: the row math of mHC's weights (GLM-5.3-Flash's hyper-connections), shared by the
 * CPU and CUDA kernels (LUNAR_HD): one row's weights (sigmoid, softmax of the n x n logits, the
 * Sinkhorn divisions) and their backward, in f64, so both backends run the same operations in the
 * same order. */
#ifndef LUNAR_KERNELS_HYPER_MATH_H
#define LUNAR_KERNELS_HYPER_MATH_H

#include <math.h>
#include <stdint.h>

#include "lunar/hd.h"

LUNAR_HD double lunar_hc_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* softmax of each row of the n x n logits z into c, plus eps */
LUNAR_HD void lunar_hc_softmax(double *c, const float *z, int64_t n, double eps) {
    for (int64_t i = 0; i < n; i++) {
        const float *zi = z + i * n;
        double *ci = c + i * n;
        double m = zi[0];
        for (int64_t j = 1; j < n; j++) m = zi[j] > m ? zi[j] : m;
        double s = 0;
        for (int64_t j = 0; j < n; j++) s += ci[j] = exp(zi[j] - m);
        for (int64_t j = 0; j < n; j++) ci[j] = ci[j] / s + eps;
    }
}

/* one Sinkhorn division of c (n x n) in place: columns (sum over the row index) when cols, else
 * rows; the sums + eps into den */
LUNAR_HD void lunar_hc_divide(double *c, double *den, int64_t n, int cols, double eps) {
    for (int64_t a = 0; a < n; a++) {
        double s = 0;
        for (int64_t b = 0; b < n; b++) s += cols ? c[b * n + a] : c[a * n + b];
        den[a] = s + eps;
    }
    for (int64_t a = 0; a < n; a++)
        for (int64_t b = 0; b < n; b++) c[a * n + b] /= cols ? den[b] : den[a];
}

/* division k of the sequence: 0 is a column one, then row, column, ... (2 iters - 1 in all) */
LUNAR_HD int lunar_hc_is_col(int k) { return k % 2 == 0; }

/* the doubles a row of the weights' backward works in: the matrix before each of the `steps`
 * divisions and after the last, the dens of each, dc and dx */
LUNAR_HD int64_t lunar_hc_backward_scratch(int64_t n, int steps) { return (steps + 1) * n * n + steps * n + 2 * n * n; }

/* one row's weights from its pre-activations zr ((2 + n) n): pre, post (n) and comb (n x n);
 * c (n x n) and den (n) its scratch */
LUNAR_HD void lunar_hc_weights_row(float *pre, float *post, float *comb, const float *zr, double *c, double *den,
                                   int64_t n, int steps, double eps) {
    for (int64_t i = 0; i < n; i++) {
        pre[i] = (float)(lunar_hc_sigmoid(zr[i]) + eps);
        post[i] = (float)(2.0 * lunar_hc_sigmoid(zr[n + i]));
    }
    lunar_hc_softmax(c, zr + 2 * n, n, eps);
    for (int k = 0; k < steps; k++) lunar_hc_divide(c, den, n, lunar_hc_is_col(k), eps);
    for (int64_t e = 0; e < n * n; e++) comb[e] = (float)c[e];
}

/* one row's dz ((2 + n) n) from the gradients of its pre, post (n) and comb (n x n): the
 * divisions rebuilt from the softmax into mats (lunar_hc_backward_scratch(n, steps) doubles),
 * then walked back; y = x / den gives dx = dy / den - sum_axis(dy * x) / den^2 */
LUNAR_HD void lunar_hc_weights_backward_row(float *gr, const float *gpre, const float *gpost, const float *gcomb,
                                            const float *zr, double *mats, int64_t n, int steps, double eps) {
    int64_t nn = n * n;
    double *dens = mats + (steps + 1) * nn, *dc = dens + steps * n, *dx = dc + nn;
    for (int64_t i = 0; i < n; i++) {
        double sp = lunar_hc_sigmoid(zr[i]), sq = lunar_hc_sigmoid(zr[n + i]);
        gr[i] = (float)(gpre[i] * sp * (1 - sp));
        gr[n + i] = (float)(gpost[i] * 2.0 * sq * (1 - sq));
    }
    lunar_hc_softmax(mats, zr + 2 * n, n, eps);
    for (int k = 0; k < steps; k++) {
        for (int64_t e = 0; e < nn; e++) mats[(k + 1) * nn + e] = mats[k * nn + e];
        lunar_hc_divide(mats + (k + 1) * nn, dens + k * n, n, lunar_hc_is_col(k), eps);
    }
    for (int64_t e = 0; e < nn; e++) dc[e] = gcomb[e];
    for (int k = steps - 1; k >= 0; k--) {
        const double *x = mats + k * nn, *den = dens + k * n;
        int cols = lunar_hc_is_col(k);
        for (int64_t a = 0; a < n; a++) {
            double s = 0;
            for (int64_t b = 0; b < n; b++) {
                int64_t e = cols ? b * n + a : a * n + b;
                s += dc[e] * x[e];
            }
            double d = den[a], q = s / (d * d);
            for (int64_t b = 0; b < n; b++) {
                int64_t e = cols ? b * n + a : a * n + b;
                dx[e] = dc[e] / d - q;
            }
        }
        for (int64_t e = 0; e < nn; e++) dc[e] = dx[e];
    }
    /* softmax backward per row: dz = p (dc - sum(dc p)), p = c - eps */
    for (int64_t i = 0; i < n; i++) {
        double s = 0;
        for (int64_t j = 0; j < n; j++) s += dc[i * n + j] * (mats[i * n + j] - eps);
        for (int64_t j = 0; j < n; j++) gr[2 * n + i * n + j] = (float)((mats[i * n + j] - eps) * (dc[i * n + j] - s));
    }
}

#endif
