/* gemm_row_invariant.c: c = alpha * a @ op(b) + beta * c, every element one dot product in a
 * fixed order, on the CPU (contract: lunar_gemm_row_invariant in lunar/ops.h).
 *
 * Why: generation promises a request the same bits alone or in any batch, and a decode step
 * multiplies the rows of every sequence of the batch together (and an MoE expert gets the rows of
 * whichever tokens chose it). OpenBLAS picks kernels and blockings by the shape: on the
 * development VM a row of a (M, 512) @ (512, 256) product changes its bits from M = 4 on (one
 * thread) or M = 13 on (two). Here every element has one order that depends on K only:
 *
 *   trans_b (b is (N, K), a linear layer's weight): 8 lane sums, lane l adding a[k] * b[j][k] for
 *     k = l, l + 8, l + 16, ... in order of k (the last, partial group of 8 padded with zeros),
 *     then ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
 *   not trans_b (b is (K, N)): one sum, adding a[k] * b[k][j] for k = 0, 1, ... in order;
 *
 * then c = alpha * sum + beta * c (c not read when beta is 0). Neither depends on M, on the row's
 * place among the others, on the threads or on the other products of the call. With FMA (the
 * x86-64-v3 clone, vecmath.h) each step is one fused multiply-add, without it a multiply and an
 * add: results may differ in the last bit between machines, never between runs or batches on one.
 *
 * The work is shaped for decode, where a product has few rows (an expert gets a few tokens) and
 * b (a weight) is the memory traffic: each b is streamed once while the rows of a stay in cache.
 * A unit of work is one product's block of columns; units run in parallel (OpenMP, any schedule)
 * and each owns its outputs. Within a unit, tiles of a few a rows by a few columns go through one
 * microkernel whose accumulators are named vector variables (kept in registers). A tile at the
 * bottom edge repeats its last row of a, computed and not stored, so every row comes out of the
 * very same instructions wherever it sits; trans_b tiles at the right edge repeat their last
 * column likewise, and not-trans_b columns past the last full tile go through a scalar loop per
 * row (a column's place, unlike a row's, depends on N only).
 */
#include <string.h>

#include "cpu.h"
#include "vecmath.h"

#define RI_LANES 8          /* the lanes of the fixed order (the contract's 8) */
#define RI_MR 4             /* a rows per tile (trans_b) */
#define RI_NR 3             /* b rows per tile (trans_b) */
#define RI_NB (16 * RI_NR)  /* b rows per unit of parallel work (trans_b) */
#define RI_NN_MR 6          /* a rows per tile (not trans_b) */
#define RI_NN_W 16          /* columns per tile (not trans_b): two vectors */
#define RI_NN_NB 64         /* columns per unit of parallel work (not trans_b) */
#define RI_PF_FLOATS 1536   /* trans_b prefetch distance (6 KiB): into L2, whose miss queue is deeper than L1's */
#define RI_CHUNK 128        /* products per parallel region */
#define RI_UNITS_PER_THREAD 8   /* below this many units a thread, narrower units */
#define RI_PAR_MIN_MACS (1LL << 18)   /* below this in all, one thread (a parallel region costs more) */

/* 8 f32 lanes: one AVX register, two SSE ones in the baseline clone */
typedef float ri_v8 __attribute__((vector_size(RI_LANES * sizeof(float))));

typedef struct ri_product {
    const float *a, *b;
    float *c;
    int64_t m, n, k, lda, ldb, ldc;
    int trans_b;
    int64_t width;   /* columns per unit of parallel work (ri_run sets it) */
} ri_product;

/* one lane step of the tile: the accumulators c<s><t> += a row s * b row t over 8 lanes at k
 * (named variables, not an array, so that they stay in registers) */
#define RI_LOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define RI_STEP(A0, A1, A2, A3, B0, B1, B2)                                                     \
    do {                                                                                        \
        ri_v8 b0_, b1_, b2_, a_;                                                                \
        RI_LOAD(b0_, B0), RI_LOAD(b1_, B1), RI_LOAD(b2_, B2);                                   \
        RI_LOAD(a_, A0), c00 += a_ * b0_, c01 += a_ * b1_, c02 += a_ * b2_;                     \
        RI_LOAD(a_, A1), c10 += a_ * b0_, c11 += a_ * b1_, c12 += a_ * b2_;                     \
        RI_LOAD(a_, A2), c20 += a_ * b0_, c21 += a_ * b1_, c22 += a_ * b2_;                     \
        RI_LOAD(a_, A3), c30 += a_ * b0_, c31 += a_ * b1_, c32 += a_ * b2_;                     \
    } while (0)

typedef int32_t ri_i8 __attribute__((vector_size(RI_LANES * sizeof(int32_t))));

/* the sums of adjacent lanes of a and b, in each half: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7,
 * b4+b5, b6+b7] (AVX's horizontal add; a macro: a function returning a vector would change the
 * baseline clone's ABI) */
#define RI_PAIR_SUMS(a, b)                                                                      \
    (__builtin_shuffle((a), (b), (ri_i8){0, 2, 8, 10, 4, 6, 12, 14}) +                         \
     __builtin_shuffle((a), (b), (ri_i8){1, 3, 9, 11, 5, 7, 13, 15}))

/* out[i] = the fixed sum of the 8 lanes of v_i, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)),
 * for four vectors at once: two rounds of pair sums leave each vector's two half sums, one in
 * each half of the register, and the halves are added last: the very order of the contract, for
 * a few shuffles (one vector's lanes added one by one cost a store and seven scalar adds) */
#define RI_LANES_SUM4(v0, v1, v2, v3, out)                                                      \
    do {                                                                                        \
        ri_v8 p01_ = RI_PAIR_SUMS(v0, v1), p23_ = RI_PAIR_SUMS(v2, v3);                         \
        ri_v8 h_ = RI_PAIR_SUMS(p01_, p23_); /* [v0..v3 low halves | v0..v3 high halves] */      \
        for (int i_ = 0; i_ < 4; i_++) (out)[i_] = h_[i_] + h_[i_ + 4];                        \
    } while (0)

/* dot[s][t] = the fixed-order dot product of a row ar[s] and b row br[t], each of K floats;
 * pf > 0: also prefetch the b rows pf floats further on (the next tile's) */
static inline __attribute__((always_inline)) void ri_tile(const float *const ar[RI_MR], const float *const br[RI_NR],
                                                          int64_t K, int64_t pf, float dot[RI_MR][RI_NR]) {
    const ri_v8 z = {0};
    ri_v8 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z, c20 = z, c21 = z, c22 = z, c30 = z, c31 = z, c32 = z;
    const float *a0 = ar[0], *a1 = ar[1], *a2 = ar[2], *a3 = ar[3], *b0 = br[0], *b1 = br[1], *b2 = br[2];
    int64_t k = 0;
    if (pf) {   /* the first a tile of a b tile: fetch the next b tile meanwhile */
        for (; k + RI_LANES <= K; k += RI_LANES) {
            __builtin_prefetch(b0 + pf + k, 0, 1);
            __builtin_prefetch(b1 + pf + k, 0, 1);
            __builtin_prefetch(b2 + pf + k, 0, 1);
            RI_STEP(a0 + k, a1 + k, a2 + k, a3 + k, b0 + k, b1 + k, b2 + k);
        }
    } else {
        for (; k + RI_LANES <= K; k += RI_LANES) RI_STEP(a0 + k, a1 + k, a2 + k, a3 + k, b0 + k, b1 + k, b2 + k);
    }
    if (k < K) {   /* the last partial group, zero-padded: the same lane step as the others */
        float ap[RI_MR][RI_LANES], bp[RI_NR][RI_LANES];
        memset(ap, 0, sizeof ap);
        memset(bp, 0, sizeof bp);
        for (int s = 0; s < RI_MR; s++) memcpy(ap[s], ar[s] + k, (size_t)(K - k) * sizeof(float));
        for (int t = 0; t < RI_NR; t++) memcpy(bp[t], br[t] + k, (size_t)(K - k) * sizeof(float));
        RI_STEP(ap[0], ap[1], ap[2], ap[3], bp[0], bp[1], bp[2]);
    }
    float *sums = &dot[0][0];   /* the RI_MR x RI_NR = 12 results in row order: three rounds of four */
    RI_LANES_SUM4(c00, c01, c02, c10, sums);
    RI_LANES_SUM4(c11, c12, c20, c21, sums + 4);
    RI_LANES_SUM4(c22, c30, c31, c32, sums + 8);
}

/* c[r][j] = alpha * dot + beta * c[r][j] for the tile's ns x nt results */
static inline __attribute__((always_inline)) void ri_store(float *c, int64_t ldc, int64_t ns, int64_t nt,
                                                           const float *dot, int64_t ldd, float alpha, float beta) {
    for (int64_t s = 0; s < ns; s++) {
        float *cr = c + s * ldc;
        const float *dr = dot + s * ldd;
        if (beta == 0.0f)
            for (int64_t t = 0; t < nt; t++) cr[t] = alpha * dr[t];
        else
            for (int64_t t = 0; t < nt; t++) cr[t] = alpha * dr[t] + beta * cr[t];
    }
}

/* trans_b: columns j0 .. j1-1 of product p, every row */
LUNAR_CPU_VECTOR static void ri_unit_nt(const ri_product *p, int64_t j0, int64_t j1, float alpha, float beta) {
    /* prefetch distance: whole b tiles, at least RI_PF_FLOATS ahead */
    int64_t tile = RI_NR * p->ldb, pf_tiles = (RI_PF_FLOATS + tile - 1) / tile;
    for (int64_t j = j0; j < j1; j += RI_NR) {
        const float *br[RI_NR];
        for (int t = 0; t < RI_NR; t++) br[t] = p->b + (j + t < j1 ? j + t : j1 - 1) * p->ldb;
        int64_t nt = j1 - j < RI_NR ? j1 - j : RI_NR;
        for (int64_t i = 0; i < p->m; i += RI_MR) {
            const float *ar[RI_MR];
            for (int s = 0; s < RI_MR; s++) ar[s] = p->a + (i + s < p->m ? i + s : p->m - 1) * p->lda;
            float dot[RI_MR][RI_NR];
            ri_tile(ar, br, p->k, i == 0 && j + pf_tiles * RI_NR < j1 ? pf_tiles * tile : 0, dot);
            int64_t ns = p->m - i < RI_MR ? p->m - i : RI_MR;
            ri_store(p->c + i * p->ldc + j, p->ldc, ns, nt, &dot[0][0], RI_NR, alpha, beta);
        }
    }
}

/* not trans_b: sum[s][0..16) over k in order of a[s][k] * b[k][j .. j + 16) for the RI_NN_MR
 * rows ar[s] (two vector accumulators per row, named so that they stay in registers) */
static inline __attribute__((always_inline)) void ri_tile_nn(const float *const ar[RI_NN_MR], const float *bj,
                                                             int64_t ldb, int64_t K, float sum[RI_NN_MR][RI_NN_W]) {
    const ri_v8 z = {0};
    ri_v8 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
    const float *a0 = ar[0], *a1 = ar[1], *a2 = ar[2], *a3 = ar[3], *a4 = ar[4], *a5 = ar[5];
    for (int64_t k = 0; k < K; k++) {
        ri_v8 b0, b1;
        RI_LOAD(b0, bj + k * ldb);
        RI_LOAD(b1, bj + k * ldb + RI_LANES);
        c00 += b0 * a0[k], c01 += b1 * a0[k];
        c10 += b0 * a1[k], c11 += b1 * a1[k];
        c20 += b0 * a2[k], c21 += b1 * a2[k];
        c30 += b0 * a3[k], c31 += b1 * a3[k];
        c40 += b0 * a4[k], c41 += b1 * a4[k];
        c50 += b0 * a5[k], c51 += b1 * a5[k];
    }
    const ri_v8 *acc[RI_NN_MR][2] = {{&c00, &c01}, {&c10, &c11}, {&c20, &c21}, {&c30, &c31}, {&c40, &c41}, {&c50, &c51}};
    for (int s = 0; s < RI_NN_MR; s++) {
        memcpy(sum[s], acc[s][0], sizeof(ri_v8));
        memcpy(sum[s] + RI_LANES, acc[s][1], sizeof(ri_v8));
    }
}

/* not trans_b: columns j0 .. j1-1 of product p, every row */
LUNAR_CPU_VECTOR static void ri_unit_nn(const ri_product *p, int64_t j0, int64_t j1, float alpha, float beta) {
    int64_t j = j0;
    for (; j + RI_NN_W <= j1; j += RI_NN_W) {
        for (int64_t i = 0; i < p->m; i += RI_NN_MR) {
            const float *ar[RI_NN_MR];
            for (int s = 0; s < RI_NN_MR; s++) ar[s] = p->a + (i + s < p->m ? i + s : p->m - 1) * p->lda;
            float sum[RI_NN_MR][RI_NN_W];
            ri_tile_nn(ar, p->b + j, p->ldb, p->k, sum);
            int64_t ns = p->m - i < RI_NN_MR ? p->m - i : RI_NN_MR;
            ri_store(p->c + i * p->ldc + j, p->ldc, ns, RI_NN_W, &sum[0][0], RI_NN_W, alpha, beta);
        }
    }
    for (; j < j1; j++)   /* columns past the last full tile: one sum per element */
        for (int64_t i = 0; i < p->m; i++) {
            const float *ar = p->a + i * p->lda;
            float acc = 0.0f;
            for (int64_t k = 0; k < p->k; k++) acc += ar[k] * p->b[k * p->ldb + j];
            ri_store(p->c + i * p->ldc + j, p->ldc, 1, 1, &acc, 1, alpha, beta);
        }
}

static int64_t ri_blocks(const ri_product *p) { return (p->n + p->width - 1) / p->width; }

/* the unit widths of products ps[0 .. n): RI_NB (RI_NN_NB) columns, or fewer whole tiles where a
 * call would have under RI_UNITS_PER_THREAD units a thread (the mHC sites' 24 columns were one
 * unit, so one thread). Bits do not depend on it: a unit's columns are whole tiles from the
 * product's first column, so every column sits in the same place of the same tile either way. */
static void ri_widths(ri_product *ps, int n, int threads) {
    int64_t units = 0;
    for (int i = 0; i < n; i++) {
        ps[i].width = ps[i].trans_b ? RI_NB : RI_NN_NB;
        units += ri_blocks(&ps[i]);
    }
    int64_t want = (int64_t)RI_UNITS_PER_THREAD * threads;
    if (threads < 2 || units >= want) return;
    int64_t per = (want + n - 1) / n;   /* units wanted of each product */
    for (int i = 0; i < n; i++) {
        int64_t tile = ps[i].trans_b ? RI_NR : RI_NN_W;
        int64_t tiles = (ps[i].n + tile - 1) / tile, w = tile * ((tiles + per - 1) / per);
        if (w < ps[i].width) ps[i].width = w;
    }
}

/* products ps[0 .. n) (n <= RI_CHUNK): units in parallel */
static void ri_run(ri_product *ps, int n, float alpha, float beta, int threads) {
    int64_t first[RI_CHUNK + 1];   /* first[i]: the first unit of product i */
    int64_t macs = 0;
    ri_widths(ps, n, threads);
    first[0] = 0;
    for (int i = 0; i < n; i++) {
        first[i + 1] = first[i] + ri_blocks(&ps[i]);
        macs += ps[i].m * ps[i].n * ps[i].k;
    }
    int64_t units = first[n];
    int par = threads > 1 && units > 1 && macs >= RI_PAR_MIN_MACS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (par)
    for (int64_t u = 0; u < units; u++) {
        int lo = 0, hi = n - 1;   /* the product whose units hold u: first[lo] <= u < first[lo + 1] */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (first[mid] <= u) lo = mid;
            else hi = mid - 1;
        }
        const ri_product *p = &ps[lo];
        int64_t w = p->width, j0 = (u - first[lo]) * w;
        int64_t j1 = j0 + w < p->n ? j0 + w : p->n;
        if (p->trans_b) ri_unit_nt(p, j0, j1, alpha, beta);
        else ri_unit_nn(p, j0, j1, alpha, beta);
    }
}

lunar_status lunar_cpu_gemm_row_invariant(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                          const lunar_tensor *const *b, int trans_b, float alpha, float beta) {
    int threads = lunar_ctx_threads(ctx);
    for (int i0 = 0; i0 < n; i0 += RI_CHUNK) {
        int cnt = n - i0 < RI_CHUNK ? n - i0 : RI_CHUNK;
        ri_product ps[RI_CHUNK];
        for (int j = 0; j < cnt; j++) {
            const lunar_tensor *ta = a[i0 + j], *tb = b[i0 + j];
            lunar_tensor *tc = c[i0 + j];
            ps[j] = (ri_product){.a = lunar_tensor_data(ta), .b = lunar_tensor_data(tb), .c = lunar_tensor_data(tc),
                                 .m = tc->shape[0], .n = tc->shape[1], .k = ta->shape[1],
                                 .lda = ta->stride[0], .ldb = tb->stride[0], .ldc = tc->stride[0],
                                 .trans_b = trans_b};
        }
        ri_run(ps, cnt, alpha, beta, threads);
    }
    return LUNAR_OK;
}
