/* reduce.c: reductions, their backward, max with indices, cumulative sums and the global norm
 * on the CPU. x is seen as (outer, n, inner), f32, contiguous.
 *
 * Determinism: sums accumulate in f64 in an order that depends only on the shape, never on the
 * thread count. A contiguous row (inner == 1) is summed as ROW_CHUNKS fixed slices, each in
 * order, and the slice sums are then added in order; when there are few rows the slices run in
 * parallel, otherwise the rows do, with the same numbers either way. Strided columns (inner > 1)
 * are summed in index order over n, COL_TILE columns at a time so reads stay contiguous.
 * max/min propagate NaN and report the first position of the extreme.
 */
#include <math.h>

#include "cpu.h"

#define ROW_CHUNKS 64     /* fixed slices of a long contiguous row */
#define ROW_CHUNK_MIN 4096 /* rows shorter than this are summed in one slice */
#define COL_TILE 256      /* columns accumulated together when inner > 1 */

typedef enum { ACC_SUM, ACC_SUMSQ } acc_kind;

static double slice_sum(const float *x, int64_t n, acc_kind k) {
    double s = 0.0;
    if (k == ACC_SUM) for (int64_t j = 0; j < n; j++) s += x[j];
    else for (int64_t j = 0; j < n; j++) s += (double)x[j] * x[j];
    return s;
}

static void slice_bounds(int64_t n, int c, int64_t *lo, int64_t *hi) {
    *lo = n * c / ROW_CHUNKS;
    *hi = n * (c + 1) / ROW_CHUNKS;
}

/* Sum (or sum of squares) of a contiguous row in the fixed slice order; par: slices in parallel. */
static double row_sum(const float *x, int64_t n, acc_kind k, int par) {
    if (n < ROW_CHUNK_MIN) return slice_sum(x, n, k);
    double part[ROW_CHUNKS];
#pragma omp parallel for schedule(static) if (par)
    for (int c = 0; c < ROW_CHUNKS; c++) {
        int64_t lo, hi;
        slice_bounds(n, c, &lo, &hi);
        part[c] = slice_sum(x + lo, hi - lo, k);
    }
    double s = 0.0;
    for (int c = 0; c < ROW_CHUNKS; c++) s += part[c];
    return s;
}

/* First index of the max (is_max) or min of a strided sequence; NaN wins at its first position. */
static int64_t arg_extreme(const float *x, int64_t n, int64_t stride, int is_max) {
    int64_t best = 0;
    float bv = x[0];
    if (bv != bv) return 0;
    if (is_max) {
        for (int64_t j = 1; j < n; j++) {
            float v = x[j * stride];
            if (v != v) return j;
            if (v > bv) { bv = v; best = j; }
        }
    } else {
        for (int64_t j = 1; j < n; j++) {
            float v = x[j * stride];
            if (v != v) return j;
            if (v < bv) { bv = v; best = j; }
        }
    }
    return best;
}

static double finish(lunar_reduce_op op, double s, int64_t n) {
    if (op == LUNAR_REDUCE_MEAN) return s / (double)n;
    if (op == LUNAR_REDUCE_NORM) return sqrt(s);
    return s;
}

/* i64 x (integer and bool tensors, widened by the host): sum, max or min, exact. Each output row
 * starts from the first slice and takes the others in turn, so the reads run along inner. */
static void reduce_i64(int64_t *outp, const int64_t *xp, int64_t outer, int64_t n, int64_t inner, lunar_reduce_op op) {
    int64_t work = outer * n * inner;
#pragma omp parallel for schedule(static) if (work >= LUNAR_CPU_PAR_MIN)
    for (int64_t o = 0; o < outer; o++) {
        const int64_t *x = xp + o * n * inner;   // (n, inner)
        int64_t *acc = outp + o * inner;         // (inner)
        for (int64_t c = 0; c < inner; c++) acc[c] = op == LUNAR_REDUCE_SUM ? 0 : x[c];
        for (int64_t j = op == LUNAR_REDUCE_SUM ? 0 : 1; j < n; j++) {
            const int64_t *row = x + j * inner;
            if (op == LUNAR_REDUCE_SUM)   /* wraps like torch */
                for (int64_t c = 0; c < inner; c++) acc[c] = (int64_t)((uint64_t)acc[c] + (uint64_t)row[c]);
            else if (op == LUNAR_REDUCE_MAX)
                for (int64_t c = 0; c < inner; c++) acc[c] = row[c] > acc[c] ? row[c] : acc[c];
            else
                for (int64_t c = 0; c < inner; c++) acc[c] = row[c] < acc[c] ? row[c] : acc[c];
        }
    }
}

lunar_status lunar_cpu_reduce(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer, int64_t n,
                              int64_t inner, lunar_reduce_op op) {
    (void)ctx;
    if (x->dtype == LUNAR_DTYPE_I64) {
        reduce_i64(lunar_tensor_data(out), lunar_tensor_data(x), outer, n, inner, op);   // (outer, inner)
        return LUNAR_OK;
    }
    const float *xp = lunar_tensor_data(x);   // (outer, n, inner)
    float *outp = lunar_tensor_data(out);      // (outer, inner)
    int is_ext = op == LUNAR_REDUCE_MAX || op == LUNAR_REDUCE_MIN;
    acc_kind k = op == LUNAR_REDUCE_NORM ? ACC_SUMSQ : ACC_SUM;
    int64_t work = outer * n * inner;
    if (inner == 1) {
        int rows_par = outer >= 4 && work >= LUNAR_CPU_PAR_MIN;
        int slice_par = !rows_par && work >= LUNAR_CPU_PAR_MIN;
        if (is_ext) {
#pragma omp parallel for schedule(static) if (work >= LUNAR_CPU_PAR_MIN)
            for (int64_t o = 0; o < outer; o++)
                outp[o] = xp[o * n + arg_extreme(xp + o * n, n, 1, op == LUNAR_REDUCE_MAX)];
        } else {
#pragma omp parallel for schedule(static) if (rows_par)
            for (int64_t o = 0; o < outer; o++) outp[o] = (float)finish(op, row_sum(xp + o * n, n, k, slice_par), n);
        }
        return LUNAR_OK;
    }
    int64_t tiles = (inner + COL_TILE - 1) / COL_TILE;
#pragma omp parallel for schedule(static) if (work >= LUNAR_CPU_PAR_MIN)
    for (int64_t t = 0; t < outer * tiles; t++) {
        int64_t o = t / tiles, i0 = (t % tiles) * COL_TILE;
        int64_t w = inner - i0 < COL_TILE ? inner - i0 : COL_TILE;
        const float *base = xp + o * n * inner + i0;
        float *dst = outp + o * inner + i0;
        if (is_ext) {
            for (int64_t c = 0; c < w; c++) {
                int64_t j = arg_extreme(base + c, n, inner, op == LUNAR_REDUCE_MAX);
                dst[c] = base[j * inner + c];
            }
            continue;
        }
        double acc[COL_TILE];
        for (int64_t c = 0; c < w; c++) acc[c] = 0.0;
        if (k == ACC_SUM) {
            for (int64_t j = 0; j < n; j++)
                for (int64_t c = 0; c < w; c++) acc[c] += base[j * inner + c];
        } else {
            for (int64_t j = 0; j < n; j++)
                for (int64_t c = 0; c < w; c++) {
                    double v = base[j * inner + c];
                    acc[c] += v * v;
                }
        }
        for (int64_t c = 0; c < w; c++) dst[c] = (float)finish(op, acc[c], n);
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_reduce_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *x,
                                       const lunar_tensor *y, int64_t outer, int64_t n, int64_t inner,
                                       lunar_reduce_op op) {
    (void)ctx;
    float *dxp = lunar_tensor_data(dx);                     // (outer, n, inner)
    const float *dyp = lunar_tensor_data(dy);               // (outer, inner)
    const float *xp = x ? lunar_tensor_data(x) : NULL;      // (outer, n, inner)
    const float *yp = y ? lunar_tensor_data(y) : NULL;      // (outer, inner)
    int64_t work = outer * n * inner;
    switch (op) {
    case LUNAR_REDUCE_SUM:
    case LUNAR_REDUCE_MEAN: {
        float scale = op == LUNAR_REDUCE_MEAN ? (float)(1.0 / (double)n) : 1.0f;
#pragma omp parallel for schedule(static) if (work >= LUNAR_CPU_PAR_MIN)
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < n; j++)
                for (int64_t i = 0; i < inner; i++) dxp[(o * n + j) * inner + i] = dyp[o * inner + i] * scale;
        break;
    }
    case LUNAR_REDUCE_NORM:
        /* d sqrt(sum x^2) / dx = x / y, and 0 where the norm is 0 (as torch) */
#pragma omp parallel for schedule(static) if (work >= LUNAR_CPU_PAR_MIN)
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < n; j++)
                for (int64_t i = 0; i < inner; i++) {
                    int64_t r = o * inner + i, e = (o * n + j) * inner + i;
                    dxp[e] = yp[r] == 0.0f ? 0.0f : dyp[r] * xp[e] / yp[r];
                }
        break;
    case LUNAR_REDUCE_MAX:
    case LUNAR_REDUCE_MIN:
#pragma omp parallel for schedule(static) if (work >= LUNAR_CPU_PAR_MIN)
        for (int64_t r = 0; r < outer * inner; r++) {
            int64_t o = r / inner, i = r % inner;
            const float *col = xp + o * n * inner + i;
            float *dcol = dxp + o * n * inner + i;
            int64_t best = arg_extreme(col, n, inner, op == LUNAR_REDUCE_MAX);
            for (int64_t j = 0; j < n; j++) dcol[j * inner] = j == best ? dyp[r] : 0.0f;
        }
        break;
    default:
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "reduce_backward: unknown op %d", (int)op);
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_max_dim(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                               int64_t outer, int64_t n, int64_t inner) {
    (void)ctx;
    const float *xp = lunar_tensor_data(x);   // (outer, n, inner)
    float *vp = lunar_tensor_data(values);    // (outer, inner)
    int64_t *ip = lunar_tensor_data(indices); // (outer, inner)
#pragma omp parallel for schedule(static) if (outer * n * inner >= LUNAR_CPU_PAR_MIN)
    for (int64_t r = 0; r < outer * inner; r++) {
        int64_t o = r / inner, i = r % inner;
        const float *col = xp + o * n * inner + i;
        int64_t best = arg_extreme(col, n, inner, 1);
        ip[r] = best;
        vp[r] = col[best * inner];
    }
    return LUNAR_OK;
}

/* Running sums in f64, in index order (reverse: from the end), COL_TILE columns at a time. The
 * input is read before the output of the same position is written, so out may alias x. */
lunar_status lunar_cpu_cumsum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer, int64_t n,
                              int64_t inner, int reverse) {
    (void)ctx;
    const float *xp = lunar_tensor_data(x);   // (outer, n, inner)
    float *dst = lunar_tensor_data(out);      // (outer, n, inner)
    int64_t tiles = (inner + COL_TILE - 1) / COL_TILE;
#pragma omp parallel for schedule(static) if (outer * n * inner >= LUNAR_CPU_PAR_MIN)
    for (int64_t t = 0; t < outer * tiles; t++) {
        int64_t o = t / tiles, i0 = (t % tiles) * COL_TILE;
        int64_t w = inner - i0 < COL_TILE ? inner - i0 : COL_TILE;
        double acc[COL_TILE];
        for (int64_t c = 0; c < w; c++) acc[c] = 0.0;
        for (int64_t s = 0; s < n; s++) {
            int64_t j = reverse ? n - 1 - s : s;
            int64_t e = (o * n + j) * inner + i0;
            for (int64_t c = 0; c < w; c++) {
                acc[c] += xp[e + c];
                dst[e + c] = (float)acc[c];
            }
        }
    }
    return LUNAR_OK;
}

/* sqrt of the sum over tensors (in list order) of their row_sum of squares, in f64. */
lunar_status lunar_cpu_global_norm(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *const *ts, int n) {
    (void)ctx;
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        int64_t m = lunar_tensor_numel(ts[i]);
        if (m > 0) total += row_sum(lunar_tensor_data(ts[i]), m, ACC_SUMSQ, m >= LUNAR_CPU_PAR_MIN);
    }
    *(float *)lunar_tensor_data(out) = (float)sqrt(total);
    return LUNAR_OK;
}
