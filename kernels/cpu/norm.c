/* norm.c: RMSNorm and LayerNorm on the CPU, over the last dim (x seen as (N, C), f32).
 *
 * Forward and backward_input run one row per iteration, rows split across threads. A row is
 * read once from memory for its statistics and once more (from cache) for the output, so the
 * forward is a single streaming pass. Row sums use LANES independent f32 accumulators (so the
 * compiler vectorises them) combined in f64 in a fixed order: the result does not depend on the
 * thread count.
 *
 * backward_params accumulates dw[c] (and db[c]) over all rows in row order, in f64, then adds
 * the sum to dw once. Threads split the columns, never the rows, so each output element is
 * summed by one thread in the same order whatever the number of threads.
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"

#define LANES 16
#define COL_CHUNK 512   /* columns per backward_params work item (f64 accumulators on the stack) */

static double row_sum(const float *x, int64_t c) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= c; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j];
    double s = 0;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < c; i++) s += x[i];
    return s;
}

static double row_sumsq(const float *x, int64_t c) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= c; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    double s = 0;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < c; i++) s += (double)x[i] * x[i];
    return s;
}

/* sum((x - m)^2) */
static double row_sumsq_centered(const float *x, int64_t c, float m) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= c; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float d = x[i + j] - m;
            acc[j] += d * d;
        }
    double s = 0;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < c; i++) {
        double d = (double)x[i] - m;
        s += d * d;
    }
    return s;
}

/* sum(a * b) */
static double row_dot(const float *a, const float *b, int64_t c) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= c; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    double s = 0;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < c; i++) s += (double)a[i] * b[i];
    return s;
}

/* sum(a * w * b) */
static double row_dot3(const float *a, const float *w, const float *b, int64_t c) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= c; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * w[i + j] * b[i + j];
    double s = 0;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < c; i++) s += (double)(a[i] * w[i]) * b[i];
    return s;
}

static void split_rows(const lunar_tensor *x, int64_t *n, int64_t *c) {
    *c = x->shape[x->ndim - 1];
    *n = 1;
    for (int i = 0; i < x->ndim - 1; i++) *n *= x->shape[i];
}

/* columns per work item for backward_params: enough items for every thread when C is small */
static int64_t col_chunk(int64_t c) {
    int t = omp_get_max_threads();
    int64_t w = (c + t - 1) / (t > 0 ? t : 1);
    w = (w + 15) / 16 * 16;
    if (w < 16) w = 16;
    if (w > COL_CHUNK) w = COL_CHUNK;
    return w;
}

/* ---- RMSNorm ------------------------------------------------------------------------------ */

lunar_status lunar_cpu_rmsnorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *rstd, const lunar_tensor *x,
                                       const lunar_tensor *w, float eps) {
    (void)ctx;
    int64_t n, c;
    split_rows(x, &n, &c);
    const float *xp = lunar_tensor_data(x);              /* (N, C) */
    const float *wp = w ? lunar_tensor_data(w) : NULL;   /* (C) */
    float *op = lunar_tensor_data(out);                  /* (N, C) */
    float *rp = lunar_tensor_data(rstd);                 /* (N) */
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && n > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = xp + r * c;
        float *orow = op + r * c;
        /* HF: variance = mean(x^2) in f32, x * rsqrt(variance + eps), then * weight */
        float var = c > 0 ? (float)(row_sumsq(xr, c) / (double)c) : 0.0f;
        float rs = 1.0f / sqrtf(var + eps);
        rp[r] = rs;
        if (wp) {
            for (int64_t i = 0; i < c; i++) orow[i] = (xr[i] * rs) * wp[i];
        } else {
            for (int64_t i = 0; i < c; i++) orow[i] = xr[i] * rs;
        }
    }
    return LUNAR_OK;
}

/* dx = rstd * (g - xhat * mean(g * xhat)), g = dout * w, xhat = x * rstd */
lunar_status lunar_cpu_rmsnorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                              const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *rstd) {
    (void)ctx;
    int64_t n, c;
    split_rows(x, &n, &c);
    const float *xp = lunar_tensor_data(x);              /* (N, C) */
    const float *dop = lunar_tensor_data(dout);          /* (N, C) */
    const float *wp = w ? lunar_tensor_data(w) : NULL;   /* (C) */
    const float *rp = lunar_tensor_data(rstd);           /* (N) */
    float *dxp = lunar_tensor_data(dx);                  /* (N, C) */
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && n > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = xp + r * c, *dr = dop + r * c;
        float *dxr = dxp + r * c;
        double rs = rp[r];
        double s = wp ? row_dot3(dr, wp, xr, c) : row_dot(dr, xr, c);   /* sum(g * x) */
        float a = (float)rs;
        float k = c > 0 ? (float)(rs * rs * rs * s / (double)c) : 0.0f;
        if (wp) {
            for (int64_t i = 0; i < c; i++) dxr[i] = a * (dr[i] * wp[i]) - xr[i] * k;
        } else {
            for (int64_t i = 0; i < c; i++) dxr[i] = a * dr[i] - xr[i] * k;
        }
    }
    return LUNAR_OK;
}

/* dw[c] += sum over rows of dout * x * rstd */
lunar_status lunar_cpu_rmsnorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, const lunar_tensor *dout,
                                               const lunar_tensor *x, const lunar_tensor *rstd) {
    (void)ctx;
    int64_t n, c;
    split_rows(x, &n, &c);
    const float *xp = lunar_tensor_data(x);       /* (N, C) */
    const float *dop = lunar_tensor_data(dout);   /* (N, C) */
    const float *rp = lunar_tensor_data(rstd);    /* (N) */
    float *dwp = lunar_tensor_data(dw);           /* (C) */
    int64_t cw = col_chunk(c);
    int64_t chunks = (c + cw - 1) / cw;
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && chunks > 1)
    for (int64_t ch = 0; ch < chunks; ch++) {
        int64_t c0 = ch * cw, m = c - c0 < cw ? c - c0 : cw;
        double acc[COL_CHUNK];
        for (int64_t j = 0; j < m; j++) acc[j] = 0;
        for (int64_t r = 0; r < n; r++) {
            const float *xr = xp + r * c + c0, *dr = dop + r * c + c0;
            float rs = rp[r];
            for (int64_t j = 0; j < m; j++) acc[j] += (double)(dr[j] * (xr[j] * rs));
        }
        for (int64_t j = 0; j < m; j++) dwp[c0 + j] = (float)((double)dwp[c0 + j] + acc[j]);
    }
    return LUNAR_OK;
}

/* ---- LayerNorm ---------------------------------------------------------------------------- */

lunar_status lunar_cpu_layernorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *mean, lunar_tensor *rstd,
                                         const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *b, float eps) {
    (void)ctx;
    int64_t n, c;
    split_rows(x, &n, &c);
    const float *xp = lunar_tensor_data(x);              /* (N, C) */
    const float *wp = w ? lunar_tensor_data(w) : NULL;   /* (C) */
    const float *bp = b ? lunar_tensor_data(b) : NULL;   /* (C) */
    float *op = lunar_tensor_data(out);                  /* (N, C) */
    float *mp = lunar_tensor_data(mean);                 /* (N) */
    float *rp = lunar_tensor_data(rstd);                 /* (N) */
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && n > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = xp + r * c;
        float *orow = op + r * c;
        float mu = c > 0 ? (float)(row_sum(xr, c) / (double)c) : 0.0f;
        float var = c > 0 ? (float)(row_sumsq_centered(xr, c, mu) / (double)c) : 0.0f;   /* biased */
        float rs = 1.0f / sqrtf(var + eps);
        mp[r] = mu;
        rp[r] = rs;
        if (wp && bp) {
            for (int64_t i = 0; i < c; i++) orow[i] = (xr[i] - mu) * rs * wp[i] + bp[i];
        } else if (wp) {
            for (int64_t i = 0; i < c; i++) orow[i] = (xr[i] - mu) * rs * wp[i];
        } else if (bp) {
            for (int64_t i = 0; i < c; i++) orow[i] = (xr[i] - mu) * rs + bp[i];
        } else {
            for (int64_t i = 0; i < c; i++) orow[i] = (xr[i] - mu) * rs;
        }
    }
    return LUNAR_OK;
}

/* dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * w, xhat = (x - mean) * rstd */
lunar_status lunar_cpu_layernorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                                const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *mean,
                                                const lunar_tensor *rstd) {
    (void)ctx;
    int64_t n, c;
    split_rows(x, &n, &c);
    const float *xp = lunar_tensor_data(x);              /* (N, C) */
    const float *dop = lunar_tensor_data(dout);          /* (N, C) */
    const float *wp = w ? lunar_tensor_data(w) : NULL;   /* (C) */
    const float *mp = lunar_tensor_data(mean);           /* (N) */
    const float *rp = lunar_tensor_data(rstd);           /* (N) */
    float *dxp = lunar_tensor_data(dx);                  /* (N, C) */
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && n > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = xp + r * c, *dr = dop + r * c;
        float *dxr = dxp + r * c;
        float mu = mp[r], rs = rp[r];
        /* sum(g) and sum(g * (x - mu)) */
        float ag[LANES] = {0}, agx[LANES] = {0};
        int64_t i = 0;
        if (wp) {
            for (; i + LANES <= c; i += LANES)
                for (int j = 0; j < LANES; j++) {
                    float g = dr[i + j] * wp[i + j];
                    ag[j] += g;
                    agx[j] += g * (xr[i + j] - mu);
                }
        } else {
            for (; i + LANES <= c; i += LANES)
                for (int j = 0; j < LANES; j++) {
                    ag[j] += dr[i + j];
                    agx[j] += dr[i + j] * (xr[i + j] - mu);
                }
        }
        double sg = 0, sgx = 0;
        for (int j = 0; j < LANES; j++) {
            sg += ag[j];
            sgx += agx[j];
        }
        for (; i < c; i++) {
            float g = wp ? dr[i] * wp[i] : dr[i];
            sg += g;
            sgx += (double)g * (xr[i] - mu);
        }
        float mg = c > 0 ? (float)(sg / (double)c) : 0.0f;
        float mgx = c > 0 ? (float)(sgx * rs / (double)c) : 0.0f;   /* mean(g * xhat) */
        if (wp) {
            for (i = 0; i < c; i++) dxr[i] = rs * (dr[i] * wp[i] - mg - (xr[i] - mu) * rs * mgx);
        } else {
            for (i = 0; i < c; i++) dxr[i] = rs * (dr[i] - mg - (xr[i] - mu) * rs * mgx);
        }
    }
    return LUNAR_OK;
}

/* dw[c] += sum dout * xhat, db[c] += sum dout; either may be NULL */
lunar_status lunar_cpu_layernorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, lunar_tensor *db,
                                                 const lunar_tensor *dout, const lunar_tensor *x,
                                                 const lunar_tensor *mean, const lunar_tensor *rstd) {
    (void)ctx;
    int64_t n, c;
    split_rows(x, &n, &c);
    const float *xp = lunar_tensor_data(x);                /* (N, C) */
    const float *dop = lunar_tensor_data(dout);            /* (N, C) */
    const float *mp = lunar_tensor_data(mean);             /* (N) */
    const float *rp = lunar_tensor_data(rstd);             /* (N) */
    float *dwp = dw ? lunar_tensor_data(dw) : NULL;        /* (C) */
    float *dbp = db ? lunar_tensor_data(db) : NULL;        /* (C) */
    int64_t cw = col_chunk(c);
    int64_t chunks = (c + cw - 1) / cw;
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && chunks > 1)
    for (int64_t ch = 0; ch < chunks; ch++) {
        int64_t c0 = ch * cw, m = c - c0 < cw ? c - c0 : cw;
        double aw[COL_CHUNK], ab[COL_CHUNK];
        for (int64_t j = 0; j < m; j++) aw[j] = ab[j] = 0;
        for (int64_t r = 0; r < n; r++) {
            const float *xr = xp + r * c + c0, *dr = dop + r * c + c0;
            float mu = mp[r], rs = rp[r];
            if (dwp)
                for (int64_t j = 0; j < m; j++) aw[j] += (double)(dr[j] * ((xr[j] - mu) * rs));
            if (dbp)
                for (int64_t j = 0; j < m; j++) ab[j] += dr[j];
        }
        if (dwp)
            for (int64_t j = 0; j < m; j++) dwp[c0 + j] = (float)((double)dwp[c0 + j] + aw[j]);
        if (dbp)
            for (int64_t j = 0; j < m; j++) dbp[c0 + j] = (float)((double)dbp[c0 + j] + ab[j]);
    }
    return LUNAR_OK;
}
