/* conv1d.c: the depthwise causal convolution of KDA's short conv on the CPU, f32 (contract in
 * lunar/ops.h, lunar_conv1d_causal_forward / _backward).
 *
 * Rows are token rows in segments (documents); a row reads the K - 1 rows before it in its own
 * segment, and before the segment's first row the segment's history (the conv state of a cache)
 * or zeros. Threads split the channels into blocks and walk every segment in order, so each
 * output element, dw included, is summed by one thread in a fixed order.
 */
#include "cpu.h"

#define CONV_BLOCK 64   /* channels per work item */

typedef struct conv_args {
    const float   *x, *w, *hist, *dy;
    const int64_t *seg;
    int64_t        nseg, C, K;
} conv_args;

/* input of segment s at row offset t from its first row (t may be negative: the history) */
static inline float conv_in(const conv_args *a, int64_t s, int64_t first, int64_t t, int64_t c) {
    if (t >= 0) return a->x[(first + t) * a->C + c];
    if (!a->hist || t < -(a->K - 1)) return 0.0f;
    return a->hist[(s * (a->K - 1) + (a->K - 1) + t) * a->C + c];
}

lunar_status lunar_cpu_conv1d_causal_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x,
                                             const lunar_tensor *w, const lunar_tensor *seg,
                                             const lunar_tensor *hist) {
    (void)ctx;
    conv_args a = {.x = lunar_tensor_data(x), .w = lunar_tensor_data(w), .hist = hist ? lunar_tensor_data(hist) : NULL,
                   .seg = lunar_tensor_data(seg), .nseg = seg->shape[0] - 1, .C = x->shape[1], .K = w->shape[1]};
    float *out = lunar_tensor_data(y);
    int64_t nblk = (a.C + CONV_BLOCK - 1) / CONV_BLOCK, N = x->shape[0];
#pragma omp parallel for schedule(static) if (N * a.C * a.K >= LUNAR_CPU_PAR_MIN && nblk > 1)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t c0 = b * CONV_BLOCK, c1 = c0 + CONV_BLOCK < a.C ? c0 + CONV_BLOCK : a.C;
        for (int64_t s = 0; s < a.nseg; s++) {
            int64_t first = a.seg[s], n = a.seg[s + 1] - first;
            for (int64_t t = 0; t < n; t++)
                for (int64_t c = c0; c < c1; c++) {
                    const float *wc = a.w + c * a.K;
                    float acc = 0;
                    for (int64_t j = 0; j < a.K; j++) acc += wc[j] * conv_in(&a, s, first, t - a.K + 1 + j, c);
                    out[(first + t) * a.C + c] = acc;
                }
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_conv1d_causal_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dw,
                                              const lunar_tensor *dy, const lunar_tensor *x, const lunar_tensor *w,
                                              const lunar_tensor *seg, const lunar_tensor *hist) {
    (void)ctx;
    conv_args a = {.x = lunar_tensor_data(x), .w = lunar_tensor_data(w), .hist = hist ? lunar_tensor_data(hist) : NULL,
                   .dy = lunar_tensor_data(dy), .seg = lunar_tensor_data(seg), .nseg = seg->shape[0] - 1,
                   .C = x->shape[1], .K = w->shape[1]};
    float *gx = lunar_tensor_data(dx), *gw = dw ? lunar_tensor_data(dw) : NULL;
    int64_t nblk = (a.C + CONV_BLOCK - 1) / CONV_BLOCK, N = x->shape[0];
#pragma omp parallel for schedule(static) if (N * a.C * a.K >= LUNAR_CPU_PAR_MIN && nblk > 1)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t c0 = b * CONV_BLOCK, c1 = c0 + CONV_BLOCK < a.C ? c0 + CONV_BLOCK : a.C;
        for (int64_t s = 0; s < a.nseg; s++) {
            int64_t first = a.seg[s], n = a.seg[s + 1] - first;
            /* dx[t] = sum_j w[j] dy[t + K - 1 - j] over the rows of the segment */
            for (int64_t t = 0; t < n; t++)
                for (int64_t c = c0; c < c1; c++) {
                    const float *wc = a.w + c * a.K;
                    float acc = 0;
                    for (int64_t j = 0; j < a.K; j++) {
                        int64_t o = t + a.K - 1 - j;
                        if (o < n) acc += wc[j] * a.dy[(first + o) * a.C + c];
                    }
                    gx[(first + t) * a.C + c] = acc;
                }
        }
        if (!gw) continue;
        for (int64_t c = c0; c < c1; c++) {
            for (int64_t j = 0; j < a.K; j++) {
                double acc = 0;
                for (int64_t s = 0; s < a.nseg; s++) {
                    int64_t first = a.seg[s], n = a.seg[s + 1] - first;
                    for (int64_t t = 0; t < n; t++)
                        acc += (double)a.dy[(first + t) * a.C + c] * conv_in(&a, s, first, t - a.K + 1 + j, c);
                }
                gw[c * a.K + j] += (float)acc;
            }
        }
    }
    return LUNAR_OK;
}
