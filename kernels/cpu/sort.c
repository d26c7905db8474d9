/* sort.c: top-k and argsort along rows on the CPU. x (rows, n) f32, indices i64.
 *
 * Each element becomes one 64-bit key: the high 32 bits order the value (NaN above +inf, -0
 * equal to +0, bits inverted for descending order) and the low 32 bits hold its index. Keys are
 * unique, so "smallest keys first" is a total order that puts equal values in index order, and
 * any correct selection gives the same answer: no comparator through a function pointer, no
 * qsort instability. Top-k keeps a max-heap of the k smallest keys (O(n log k)) and heap-sorts
 * it; argsort is the same with k = n. The keys live in the i64 index output itself, which is
 * then overwritten with the indices, so no scratch memory is needed.
 */
#include <string.h>

#include "cpu.h"

static inline uint64_t sort_key(float v, int64_t idx, int descending) {
    uint32_t u;
    if (v != v) {
        u = 0xFFFFFFFFu;
    } else {
        if (v == 0.0f) v = 0.0f;   /* -0 sorts as +0 */
        memcpy(&u, &v, sizeof u);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    if (descending) u = ~u;
    return ((uint64_t)u << 32) | (uint32_t)idx;
}

static inline void sift_down(uint64_t *h, int64_t i, int64_t n) {
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && h[c + 1] > h[c]) c++;
        if (h[c] <= h[i]) return;
        uint64_t t = h[c];
        h[c] = h[i];
        h[i] = t;
        i = c;
    }
}

/* h[0..k) = the k smallest keys of the row, ascending. */
static void smallest_keys(uint64_t *h, const float *x, int64_t n, int64_t k, int descending) {
    for (int64_t j = 0; j < k; j++) h[j] = sort_key(x[j], j, descending);
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(h, i, k);
    for (int64_t j = k; j < n; j++) {
        uint64_t key = sort_key(x[j], j, descending);
        if (key < h[0]) {
            h[0] = key;
            sift_down(h, 0, k);
        }
    }
    for (int64_t end = k - 1; end > 0; end--) {
        uint64_t t = h[0];
        h[0] = h[end];
        h[end] = t;
        sift_down(h, 0, end);
    }
}

/* order-preserving u32 of a float (NaN above +inf, -0 equal to +0), as sort_key's high half */
static inline uint32_t value_key(float v) {
    uint32_t u;
    float z = v == 0.0f ? 0.0f : v;
    memcpy(&u, &z, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return v != v ? 0xFFFFFFFFu : u;
}

void lunar_cpu_topk_set(int64_t *idx, const float *x, int64_t n, int64_t k, uint32_t *scratch) {
    uint32_t *key = scratch, *cand = scratch + n;
    for (int64_t j = 0; j < n; j++) key[j] = value_key(x[j]);
    /* MSD radix select of the k-th largest key: thr's bytes from the top; `need` of the keys
     * equal to thr belong to the top k, every key above thr does */
    uint32_t thr = 0, *c = key;
    int64_t nc = n, need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int32_t cnt[4][256];
        memset(cnt, 0, sizeof cnt);
        int64_t i = 0;
        for (; i + 4 <= nc; i += 4)   /* four histograms: no store-to-load chains on equal bytes */
            for (int l = 0; l < 4; l++) cnt[l][(c[i + l] >> shift) & 255]++;
        for (; i < nc; i++) cnt[0][(c[i] >> shift) & 255]++;
        int d = 255;
        int64_t above = 0;
        for (;; d--) {
            int64_t cd = cnt[0][d] + cnt[1][d] + cnt[2][d] + cnt[3][d];
            if (above + cd >= need) break;
            above += cd;
        }
        need -= above;
        thr |= (uint32_t)d << shift;
        if (shift == 0) break;
        int64_t m = 0;
        for (i = 0; i < nc; i++) {   /* candidates: the keys in bucket d */
            uint32_t v = c[i];
            cand[m] = v;
            m += (int64_t)(((v >> shift) & 255) == (uint32_t)d);
        }
        c = cand, nc = m;
    }
    /* the set in increasing position: every key above thr, and the first `need` equal to it */
    int64_t o = 0;
    for (int64_t j = 0; j < n && o < k; j++) {
        uint32_t v = key[j];
        int eq = v == thr && need > 0;
        need -= eq;
        if (v > thr || eq) idx[o++] = j;
    }
}

lunar_status lunar_cpu_topk(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                            int64_t rows, int64_t n, int64_t k, int largest) {
    (void)ctx;
    const float *xp = lunar_tensor_data(x);               // (rows, n)
    int64_t *ip = lunar_tensor_data(indices);             // (rows, k)
    float *vp = values ? lunar_tensor_data(values) : NULL;  // (rows, k)
#pragma omp parallel for schedule(static) if (rows * n >= LUNAR_CPU_PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        uint64_t *h = (uint64_t *)(ip + r * k);
        const float *xr = xp + r * n;
        smallest_keys(h, xr, n, k, largest);
        for (int64_t j = 0; j < k; j++) {
            int64_t idx = (int64_t)(h[j] & 0xFFFFFFFFu);
            ip[r * k + j] = idx;
            if (vp) vp[r * k + j] = xr[idx];
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_argsort(lunar_ctx *ctx, lunar_tensor *indices, const lunar_tensor *x, int64_t rows, int64_t n,
                               int descending) {
    return lunar_cpu_topk(ctx, NULL, indices, x, rows, n, n, descending);
}
