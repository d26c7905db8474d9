/* softmax.c: softmax, log-softmax and fused cross-entropy over the last dim on the CPU.
 *
 * Rows are independent (one OpenMP iteration each). Every row subtracts its max before
 * exponentiating (expf, f32), and sums the exponentials in f64 in index order, so results do not
 * depend on the thread count. Each element of the input is read before the output at the same
 * position is written, so the output may alias the input. Log-probabilities are formed as
 * (x - max) - log(sum), which keeps them accurate for large logits.
 */
#include <math.h>

#include "cpu.h"

static float row_max(const float *x, int64_t v) {
    float m = -INFINITY;
    for (int64_t j = 0; j < v; j++) {
        if (x[j] != x[j]) return x[j];
        if (x[j] > m) m = x[j];
    }
    return m;
}

static double row_sumexp(const float *x, int64_t v, float m) {
    double s = 0.0;
    for (int64_t j = 0; j < v; j++) s += expf(x[j] - m);
    return s;
}

lunar_status lunar_cpu_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, int is_log) {
    (void)ctx;
    int64_t v = x->shape[x->ndim - 1], rows = lunar_tensor_numel(x) / v;
    const float *xp = lunar_tensor_data(x);   // (rows, V)
    float *yp = lunar_tensor_data(y);         // (rows, V)
#pragma omp parallel for schedule(static) if (rows * v >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = xp + r * v;
        float *yr = yp + r * v;
        float m = row_max(xr, v);
        if (is_log) {
            float ls = (float)log(row_sumexp(xr, v, m));
            for (int64_t j = 0; j < v; j++) yr[j] = (xr[j] - m) - ls;
        } else {
            double s = 0.0;
            for (int64_t j = 0; j < v; j++) {
                float e = expf(xr[j] - m);
                yr[j] = e;
                s += e;
            }
            float inv = (float)(1.0 / s);
            for (int64_t j = 0; j < v; j++) yr[j] *= inv;
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
        double s = 0.0;
        if (is_log) {
            for (int64_t j = 0; j < v; j++) s += g[j];
            float sf = (float)s;
            for (int64_t j = 0; j < v; j++) d[j] = g[j] - expf(yr[j]) * sf;
        } else {
            for (int64_t j = 0; j < v; j++) s += (double)g[j] * yr[j];
            float sf = (float)s;
            for (int64_t j = 0; j < v; j++) d[j] = yr[j] * (g[j] - sf);
        }
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
        const float *xr = xp + r * v;
        float m = row_max(xr, v);
        float ls = (float)log(row_sumexp(xr, v, m));
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
        float g = gp[r], l = lsep[r];
        for (int64_t j = 0; j < v; j++) d[j] = g * expf(xr[j] - l);
        d[tp[r]] -= g;
    }
    return LUNAR_OK;
}
