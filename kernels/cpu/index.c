/* index.c: embedding, index_select / index_add, gather / scatter, index_select_sum and bincount
 * on the CPU (f32 data, i64 indices already range-checked by the host).
 *
 * Accumulating kernels are deterministic without atomics: the work is split so that each
 * output element is updated by one thread, which adds its contributions in index order.
 *   embedding_backward: threads split the channels C; each walks all ids in order.
 *   index_add:          threads split (outer, inner column blocks); each walks the index in order.
 *   scatter(_add):      threads split (outer, inner) positions; each walks n_idx in order, so for
 *                       scatter the last duplicate index wins (torch leaves it unspecified).
 *   index_select_sum:   threads split (rows, column blocks); each sums its row's K sources in order.
 */
#include <string.h>

#include "cpu.h"

#define COL_BLOCK 256   /* columns per work item when threads split a row */

lunar_status lunar_cpu_embedding_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *ids,
                                         const lunar_tensor *weight) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(ids), c = weight->shape[1];
    const int64_t *id = lunar_tensor_data(ids);    /* (N) */
    const float *w = lunar_tensor_data(weight);    /* (V, C) */
    float *o = lunar_tensor_data(out);             /* (N, C) */
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && n > 1)
    for (int64_t i = 0; i < n; i++) memcpy(o + i * c, w + id[i] * c, (size_t)c * sizeof(float));
    return LUNAR_OK;
}

lunar_status lunar_cpu_embedding_backward(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout,
                                          const lunar_tensor *ids) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(ids), c = dweight->shape[1];
    const int64_t *id = lunar_tensor_data(ids);   /* (N) */
    const float *d = lunar_tensor_data(dout);     /* (N, C) */
    float *dw = lunar_tensor_data(dweight);       /* (V, C) */
    int64_t blocks = (c + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) if (n * c >= LUNAR_CPU_PAR_MIN && blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t c0 = b * COL_BLOCK, m = c - c0 < COL_BLOCK ? c - c0 : COL_BLOCK;
        for (int64_t i = 0; i < n; i++) {
            float *dst = dw + id[i] * c + c0;
            const float *src = d + i * c + c0;
            for (int64_t j = 0; j < m; j++) dst[j] += src[j];
        }
    }
    return LUNAR_OK;
}

/* out (outer, K, inner) = src (outer, n_src, inner)[:, index, :] */
lunar_status lunar_cpu_index_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                    const lunar_tensor *index, int64_t outer, int64_t n_src, int64_t inner) {
    (void)ctx;
    int64_t k = lunar_tensor_numel(index);
    const int64_t *idx = lunar_tensor_data(index);
    const float *s = lunar_tensor_data(src);
    float *o = lunar_tensor_data(out);
    int64_t rows = outer * k;
#pragma omp parallel for schedule(static) if (rows * inner >= LUNAR_CPU_PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t ob = r / k, j = r % k;
        memcpy(o + r * inner, s + (ob * n_src + idx[j]) * inner, (size_t)inner * sizeof(float));
    }
    return LUNAR_OK;
}

/* dst (outer, n_dst, inner)[:, index[j], :] += alpha * src (outer, K, inner)[:, j, :], j in order */
lunar_status lunar_cpu_index_add(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index, const lunar_tensor *src,
                                 double alpha, int64_t outer, int64_t n_dst, int64_t inner) {
    (void)ctx;
    int64_t k = lunar_tensor_numel(index);
    const int64_t *idx = lunar_tensor_data(index);
    const float *s = lunar_tensor_data(src);
    float *d = lunar_tensor_data(dst);
    float a = (float)alpha;
    int64_t blocks = (inner + COL_BLOCK - 1) / COL_BLOCK, items = outer * blocks;
#pragma omp parallel for schedule(static) if (outer * k * inner >= LUNAR_CPU_PAR_MIN && items > 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t ob = it / blocks, c0 = (it % blocks) * COL_BLOCK;
        int64_t m = inner - c0 < COL_BLOCK ? inner - c0 : COL_BLOCK;
        for (int64_t j = 0; j < k; j++) {
            float *dr = d + (ob * n_dst + idx[j]) * inner + c0;
            const float *sr = s + (ob * k + j) * inner + c0;
            if (a == 1.0f) {
                for (int64_t q = 0; q < m; q++) dr[q] += sr[q];
            } else {
                for (int64_t q = 0; q < m; q++) dr[q] += a * sr[q];
            }
        }
    }
    return LUNAR_OK;
}

/* out (outer, n_idx, inner)[o, j, i] = src (outer, n_data, inner)[o, index[o, j, i], i] */
lunar_status lunar_cpu_gather(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, const lunar_tensor *index,
                              int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner) {
    (void)ctx;
    const int64_t *idx = lunar_tensor_data(index);
    const float *s = lunar_tensor_data(src);
    float *o = lunar_tensor_data(out);
    int64_t rows = outer * n_idx;
#pragma omp parallel for schedule(static) if (rows * inner >= LUNAR_CPU_PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t ob = r / n_idx;
        const int64_t *ir = idx + r * inner;
        const float *sb = s + ob * n_data * inner;
        float *orow = o + r * inner;
        for (int64_t i = 0; i < inner; i++) orow[i] = sb[ir[i] * inner + i];
    }
    return LUNAR_OK;
}

/* dst (outer, n_data, inner)[o, index[o, j, i], i] (= or +=) src (outer, n_idx, inner)[o, j, i] */
lunar_status lunar_cpu_scatter(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index, const lunar_tensor *src,
                               int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner, int accumulate) {
    (void)ctx;
    const int64_t *idx = lunar_tensor_data(index);
    const float *s = lunar_tensor_data(src);
    float *d = lunar_tensor_data(dst);
    int64_t blocks = (inner + COL_BLOCK - 1) / COL_BLOCK, items = outer * blocks;
#pragma omp parallel for schedule(static) if (outer * n_idx * inner >= LUNAR_CPU_PAR_MIN && items > 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t ob = it / blocks, c0 = (it % blocks) * COL_BLOCK;
        int64_t m = inner - c0 < COL_BLOCK ? inner - c0 : COL_BLOCK;
        float *db = d + ob * n_data * inner;
        for (int64_t j = 0; j < n_idx; j++) {
            const int64_t *ir = idx + (ob * n_idx + j) * inner;
            const float *sr = s + (ob * n_idx + j) * inner;
            if (accumulate) {
                for (int64_t i = c0; i < c0 + m; i++) db[ir[i] * inner + i] += sr[i];
            } else {
                for (int64_t i = c0; i < c0 + m; i++) db[ir[i] * inner + i] = sr[i];
            }
        }
    }
    return LUNAR_OK;
}

/* out (N, C)[n, :] (= or +=) the sum over k in order of src (R, C)[index[n, k], :]. Each out
 * element is owned by one thread and summed as index_add sums it: 0 (or out) + row, row by row. */
lunar_status lunar_cpu_index_select_sum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                        const lunar_tensor *index, int accumulate) {
    (void)ctx;
    int64_t n = index->shape[0], k = index->shape[1], c = src->shape[1];
    const int64_t *idx = lunar_tensor_data(index);
    const float *s = lunar_tensor_data(src);
    float *o = lunar_tensor_data(out);
    int64_t blocks = (c + COL_BLOCK - 1) / COL_BLOCK, items = n * blocks;
#pragma omp parallel for schedule(static) if (n * k * c >= LUNAR_CPU_PAR_MIN && items > 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t row = it / blocks, c0 = (it % blocks) * COL_BLOCK;
        int64_t m = c - c0 < COL_BLOCK ? c - c0 : COL_BLOCK;
        float *orow = o + row * c + c0;
        if (!accumulate) memset(orow, 0, (size_t)m * sizeof(float));
        for (int64_t j = 0; j < k; j++) {
            const float *srow = s + idx[row * k + j] * c + c0;
            for (int64_t q = 0; q < m; q++) orow[q] += srow[q];
        }
    }
    return LUNAR_OK;
}

/* counts (B) = occurrences of each value (host-checked to lie in [0, B)); integer counts are
 * exact in any order, one pass is enough at the sizes it serves (N*K routing entries) */
lunar_status lunar_cpu_bincount(lunar_ctx *ctx, lunar_tensor *counts, const lunar_tensor *values) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(values), bins = lunar_tensor_numel(counts);
    const int64_t *v = lunar_tensor_data(values);
    int64_t *c = lunar_tensor_data(counts);
    memset(c, 0, (size_t)bins * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) c[v[i]]++;
    return LUNAR_OK;
}
