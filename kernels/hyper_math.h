/* hyper_math.h: the row math of mHC's weights (GLM-5.3-Flash's hyper-connections), shared by the
 * CPU and CUDA kernels (LUNAR_HD): the sigmoid, the softmax of the n x n logits and one Sinkhorn
 * division, in f64, so both backends run the same operations in the same order. */
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

#endif
