/* softmax.c: softmax, log-softmax and fused cross-entropy over the last dim on the CPU.
 *
 * Rows are independent (one OpenMP iteration each). Every row subtracts its max before
 * exponentiating. The exponential is lunar_expf_upto88 (vecmath.h), which vectorises, and the row
 * functions have an AVX-512 clone as well as the AVX2 one (LUNAR_CPU_VECTOR_WIDE); sums run
 * in 16 lanes (f32 within blocks of 256 elements, f64 across blocks) combined in a fixed order,
 * so a row's result does not depend on the thread count. Each element of the input is read
 * before the output at the same position is written, so the output may alias the input.
 * Log-probabilities are formed as (x - max) - log(sum), which keeps them accurate for large
 * logits. NaN anywhere in a row makes the whole row NaN, as in torch.
 */
#include <math.h>

#include "cpu.h"
#include "vecmath.h"

#define LANES 16

static double lanes_total(const double *acc) {
    double s = 0.0;
    for (int k = 0; k < LANES; k++) s += acc[k];
    return s;
}

/* m[k] = max(m[k], x[k]) for the 16 lanes: a loop of its own over restrict pointers, kept a loop
 * (-O3 unrolls it fully first, and the 16 scalar maxes are then never vectorised), which GCC
 * turns into vmaxps */
static inline void max16(float *restrict m, const float *restrict x) {
#pragma GCC unroll 1
    for (int k = 0; k < LANES; k++) m[k] = x[k] > m[k] ? x[k] : m[k];
}

LUNAR_CPU_VECTOR_WIDE static float row_max(const float *x, int64_t v) {
    float m[LANES];
    for (int k = 0; k < LANES; k++) m[k] = -INFINITY;
    int64_t j = 0;
    for (; j + LANES <= v; j += LANES) max16(m, x + j);
    for (; j < v; j++) m[0] = x[j] > m[0] ? x[j] : m[0];
    float r = m[0];
    for (int k = 1; k < LANES; k++) r = m[k] > r ? m[k] : r;
    return r;
}

/* Sums run in blocks of BLOCK elements: 16 f32 lanes inside a block (16 terms each), then the
 * block's lanes are added into 16 f64 lanes; the lanes are combined in a fixed order at the end. */
#define BLOCK 256

/* The exponential passes run from L1 and are bound by arithmetic, while the max pass before them
 * waits on memory; so each exponential pass also prefetches the next row (next: that row's start,
 * or any readable address), one cache line per 16 elements, and the memory fetch overlaps the
 * arithmetic. With the static schedule the next row is the thread's own next row except at the
 * end of its share. Measured on the development VM (bench_cpu's paired medians): softmax of a
 * 32 MiB tensor went from 0.56-0.78 of the triad bandwidth to 0.72-0.86. */
#define PREFETCH_LINE(p) __builtin_prefetch((p), 0, 3)

/* sum_j exp(x[j] - m) */
LUNAR_CPU_VECTOR_WIDE static double row_sumexp(const float *x, int64_t v, float m, const float *next) {
    double acc[LANES] = {0};
    int64_t j = 0;
    for (; j + BLOCK <= v; j += BLOCK) {
        float b[LANES] = {0};
        for (int64_t i = 0; i < BLOCK; i += LANES) {
            PREFETCH_LINE(next + j + i);
            for (int k = 0; k < LANES; k++) b[k] += lunar_expf_upto88(x[j + i + k] - m);
        }
        for (int k = 0; k < LANES; k++) acc[k] += b[k];
    }
    for (; j < v; j++) acc[0] += lunar_expf_upto88(x[j] - m);
    return lanes_total(acc);
}

/* y[k] = exp(x[k] - m) and b[k] += y[k] for the 16 lanes, as max16; restrict, so y is not x
 * here: an in-place softmax takes exp_inplace16 */
static inline void exp_store16(float *restrict y, float *restrict b, const float *restrict x, float m) {
#pragma GCC unroll 1
    for (int k = 0; k < LANES; k++) {
        y[k] = lunar_expf_upto88(x[k] - m);
        b[k] += y[k];
    }
}

/* y[k] = exp(y[k] - m) and b[k] += y[k] */
static inline void exp_inplace16(float *restrict y, float *restrict b, float m) {
#pragma GCC unroll 1
    for (int k = 0; k < LANES; k++) {
        y[k] = lunar_expf_upto88(y[k] - m);
        b[k] += y[k];
    }
}

/* y[j] = exp(x[j] - m), returns the sum */
LUNAR_CPU_VECTOR_WIDE static double row_exp_store(float *y, const float *x, int64_t v, float m, const float *next) {
    double acc[LANES] = {0};
    int64_t j = 0;
    for (; j + BLOCK <= v; j += BLOCK) {
        float b[LANES] = {0};
        if (y == x)
            for (int64_t i = 0; i < BLOCK; i += LANES) {
                PREFETCH_LINE(next + j + i);
                exp_inplace16(y + j + i, b, m);
            }
        else
            for (int64_t i = 0; i < BLOCK; i += LANES) {
                PREFETCH_LINE(next + j + i);
                exp_store16(y + j + i, b, x + j + i, m);
            }
        for (int k = 0; k < LANES; k++) acc[k] += b[k];
    }
    for (; j < v; j++) {
        float e = lunar_expf_upto88(x[j] - m);
        y[j] = e;
        acc[0] += e;
    }
    return lanes_total(acc);
}

LUNAR_CPU_VECTOR_WIDE static void row_scale(float *y, int64_t v, float s) {
    for (int64_t j = 0; j < v; j++) y[j] *= s;
}

/* y[j] = (x[j] - m) - ls */
LUNAR_CPU_VECTOR_WIDE static void row_shift(float *y, const float *x, int64_t v, float m, float ls) {
    for (int64_t j = 0; j < v; j++) y[j] = (x[j] - m) - ls;
}

/* sum_j a[j] * b[j] (b == NULL: sum_j a[j]) */
LUNAR_CPU_VECTOR_WIDE static double row_dot(const float *a, const float *b, int64_t v) {
    double acc[LANES] = {0};
    int64_t j = 0;
    for (; j + BLOCK <= v; j += BLOCK) {
        float s[LANES] = {0};
        if (b) {
            for (int64_t i = 0; i < BLOCK; i += LANES)
                for (int k = 0; k < LANES; k++) s[k] += a[j + i + k] * b[j + i + k];
        } else {
            for (int64_t i = 0; i < BLOCK; i += LANES)
                for (int k = 0; k < LANES; k++) s[k] += a[j + i + k];
        }
        for (int k = 0; k < LANES; k++) acc[k] += s[k];
    }
    for (; j < v; j++) acc[0] += b ? (double)a[j] * b[j] : (double)a[j];
    return lanes_total(acc);
}

/* d[j] = g[j] - exp(y[j]) * s (y: the forward's log-probabilities, all <= 0) */
LUNAR_CPU_VECTOR_WIDE static void row_log_softmax_grad(float *d, const float *g, const float *y, int64_t v, float s) {
    for (int64_t j = 0; j < v; j++) d[j] = g[j] - lunar_expf_upto88(y[j]) * s;
}

/* d[j] = y[j] * (g[j] - s) */
LUNAR_CPU_VECTOR_WIDE static void row_softmax_grad(float *d, const float *g, const float *y, int64_t v, float s) {
    for (int64_t j = 0; j < v; j++) d[j] = y[j] * (g[j] - s);
}

/* d[j] = g * exp(x[j] - l) */
LUNAR_CPU_VECTOR_WIDE static void row_ce_grad(float *d, const float *x, int64_t v, float g, float l) {
    for (int64_t j = 0; j < v; j++) d[j] = g * lunar_expf_upto88(x[j] - l);
}

lunar_status lunar_cpu_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, int is_log) {
    (void)ctx;
    int64_t v = x->shape[x->ndim - 1], rows = lunar_tensor_numel(x) / v;
    const float *xp = lunar_tensor_data(x);   // (rows, V)
    float *yp = lunar_tensor_data(y);         // (rows, V)
#pragma omp parallel for schedule(static) if (rows * v >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = xp + r * v, *next = r + 1 < rows ? xr + v : xr;
        float *yr = yp + r * v;
        float m = row_max(xr, v);
        if (is_log) {
            float ls = (float)log(row_sumexp(xr, v, m, next));
            row_shift(yr, xr, v, m, ls);
        } else {
            double s = row_exp_store(yr, xr, v, m, next);
            row_scale(yr, v, (float)(1.0 / s));
        }
    }
    return LUNAR_OK;
}

/* softmax:     dx = y * (dy - sum(dy * y))
 * log_softmax: dx = dy - exp(y) * sum(dy) */
lunar_status lunar_cpu_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *y,
                                        int is_log) {
    (void)ctx;
    int64_t v = y->shape[y->ndim - 1], rows = lunar_tensor_numel(y) / v;
    const float *dyp = lunar_tensor_data(dy);   // (rows, V)
    const float *yp = lunar_tensor_data(y);     // (rows, V)
    float *dxp = lunar_tensor_data(dx);         // (rows, V)
#pragma omp parallel for schedule(static) if (rows * v >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = dyp + r * v, *yr = yp + r * v;
        float *d = dxp + r * v;
        if (is_log) row_log_softmax_grad(d, g, yr, v, (float)row_dot(g, NULL, v));
        else row_softmax_grad(d, g, yr, v, (float)row_dot(g, yr, v));
    }
    return LUNAR_OK;
}

/* Targets must lie in [0, V) unless equal to ignore_index; the first bad one is reported. */
static lunar_status check_targets(lunar_ctx *ctx, const char *op, const int64_t *t, int64_t n, int64_t v,
                                  int64_t ignore_index) {
    for (int64_t i = 0; i < n; i++)
        if (t[i] != ignore_index && (t[i] < 0 || t[i] >= v))
            return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: target %lld of row %lld is out of range [0, %lld) (ignore_index %lld)",
                              op, (long long)t[i], (long long)i, (long long)v, (long long)ignore_index);
    return LUNAR_OK;
}

lunar_status lunar_cpu_cross_entropy_forward(lunar_ctx *ctx, lunar_tensor *loss, lunar_tensor *logprobs,
                                             lunar_tensor *lse, const lunar_tensor *logits,
                                             const lunar_tensor *targets, int64_t ignore_index) {
    int64_t n = logits->shape[0], v = logits->shape[1];
    const float *xp = lunar_tensor_data(logits);     // (N, V)
    const int64_t *tp = lunar_tensor_data(targets);  // (N)
    float *lossp = lunar_tensor_data(loss);          // (N)
    float *lpp = lunar_tensor_data(logprobs);        // (N)
    float *lsep = lunar_tensor_data(lse);            // (N)
    LUNAR_TRY(check_targets(ctx, "cross_entropy_forward", tp, n, v, ignore_index));
#pragma omp parallel for schedule(static) if (n * v >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = xp + r * v, *next = r + 1 < n ? xr + v : xr;
        float m = row_max(xr, v);
        float ls = (float)log(row_sumexp(xr, v, m, next));
        lsep[r] = m + ls;
        if (tp[r] == ignore_index) {
            lpp[r] = 0.0f;
            lossp[r] = 0.0f;
        } else {
            float lp = (xr[tp[r]] - m) - ls;
            lpp[r] = lp;
            lossp[r] = -lp;
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_cross_entropy_backward(lunar_ctx *ctx, lunar_tensor *dlogits, const lunar_tensor *dloss,
                                              const lunar_tensor *logits, const lunar_tensor *lse,
                                              const lunar_tensor *targets, int64_t ignore_index) {
    int64_t n = logits->shape[0], v = logits->shape[1];
    float *dp = lunar_tensor_data(dlogits);          // (N, V)
    const float *gp = lunar_tensor_data(dloss);      // (N)
    const float *xp = lunar_tensor_data(logits);     // (N, V)
    const float *lsep = lunar_tensor_data(lse);      // (N)
    const int64_t *tp = lunar_tensor_data(targets);  // (N)
    LUNAR_TRY(check_targets(ctx, "cross_entropy_backward", tp, n, v, ignore_index));
#pragma omp parallel for schedule(static) if (n * v >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < n; r++) {
        float *d = dp + r * v;
        const float *xr = xp + r * v;
        if (tp[r] == ignore_index) {
            for (int64_t j = 0; j < v; j++) d[j] = 0.0f;
            continue;
        }
        float g = gp[r];
        row_ce_grad(d, xr, v, g, lsep[r]);
        d[tp[r]] -= g;
    }
    return LUNAR_OK;
}

/* sum_j p_j (x[j] - l) with p_j = exp(x[j] - l): the entropy's -H, in one pass. A token of
 * probability 0 (x = -inf, or too small for an f32) adds 0, not 0 * -inf. */
LUNAR_CPU_VECTOR_WIDE static double row_plogp(const float *x, int64_t v, float l, const float *next) {
    double acc[LANES] = {0};
    int64_t j = 0;
    for (; j + BLOCK <= v; j += BLOCK) {
        float b[LANES] = {0};
        for (int64_t i = 0; i < BLOCK; i += LANES) {
            PREFETCH_LINE(next + j + i);
            for (int k = 0; k < LANES; k++) {
                float d = x[j + i + k] - l;
                float e = lunar_expf_upto88(d);
                b[k] += e > 0.0f ? e * d : 0.0f;
            }
        }
        for (int k = 0; k < LANES; k++) acc[k] += b[k];
    }
    for (; j < v; j++) {
        float d = x[j] - l;
        float e = lunar_expf_upto88(d);
        acc[0] += e > 0.0f ? e * d : 0.0f;
    }
    return lanes_total(acc);
}

lunar_status lunar_cpu_entropy_forward(lunar_ctx *ctx, lunar_tensor *entropy, const lunar_tensor *logits,
                                       const lunar_tensor *lse) {
    (void)ctx;
    int64_t n = logits->shape[0], v = logits->shape[1];
    const float *xp = lunar_tensor_data(logits);     // (N, V)
    const float *lsep = lunar_tensor_data(lse);      // (N)
    float *hp = lunar_tensor_data(entropy);          // (N)
#pragma omp parallel for schedule(static) if (n * v >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = xp + r * v, *next = r + 1 < n ? xr + v : xr;
        float l = lsep[r];
        hp[r] = isnan(l) ? NAN : (float)-row_plogp(xr, v, l, next);
    }
    return LUNAR_OK;
}

/* One draw per row from softmax(z): the first token whose running sum of exp(z - max) (f64, in
 * token order) exceeds u * the row's total, and its log-probability (x - max) - log(total) as
 * lunar_cpu_cross_entropy_forward forms it. u < 1, so some running sum exceeds the target, and
 * the token that crossed it added a positive weight. */
lunar_status lunar_cpu_sample_rows(lunar_ctx *ctx, lunar_tensor *tokens, lunar_tensor *logprobs,
                                   const lunar_tensor *z, const lunar_tensor *u) {
    (void)ctx;
    int64_t n = z->shape[0], v = z->shape[1];
    const float *zp = lunar_tensor_data(z);          // (N, V)
    const float *up = lunar_tensor_data(u);          // (N)
    int64_t *tp = lunar_tensor_data(tokens);         // (N)
    float *lp = lunar_tensor_data(logprobs);         // (N)
#pragma omp parallel for schedule(static) if (n * v >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < n; r++) {
        const float *zr = zp + r * v;
        float m = row_max(zr, v);
        double total = row_sumexp(zr, v, m, zr);
        double target = (double)up[r] * total, run = 0.0;
        int64_t tok = v - 1;
        for (int64_t j = 0; j < v; j++) {
            run += lunar_expf_upto88(zr[j] - m);
            if (run > target) {
                tok = j;
                break;
            }
        }
        tp[r] = tok;
        lp[r] = (zr[tok] - m) - (float)log(total);
    }
    return LUNAR_OK;
}
