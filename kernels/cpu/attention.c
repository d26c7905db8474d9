/* attention.c: fused attention over per-query key sets and the DSA index score on the CPU
 * (contracts in lunar/ops.h; f32, contiguous, token-major).
 *
 * Attention, forward: one OpenMP iteration per query row (b, s). The row's attendable keys are
 * listed once (from keys[b, s, :] and/or the mask row, skipping every key whose mask value is
 * <= -FLT_MAX, so nothing is computed for them) and shared by all NH heads: per head, the scores
 * of the listed keys, their max, exp and sum (f64), then o = sum_j p_j v_j accumulated in key
 * order. A row without any attendable key attends uniformly to all T keys (HF's softmax of an
 * all-finfo.min row). Nothing of size T x T exists: per thread a few rows of T values.
 *
 * Backward: one OpenMP iteration per (b, key head g, query chunk c). The unit walks its queries
 * in order and the heads of group g in order, recomputes each row's probabilities with exactly
 * the forward's code (so P is bit-identical to the forward's; lse is not needed on the CPU),
 * D = dout . o (f64), dS_j = P_j (dout . v_j - D), and accumulates
 *   dq = scale * sum_j dS_j k_j        (the query's own row),
 *   dk_j += dS_j q, dv_j += P_j dout   (rows of key head g: owned by this unit).
 * The number of chunks depends only on the sizes (B * Hk small: the queries are split so that
 * there is parallel work), chunk c > 0 accumulates into its own scratch rows, and the chunks are
 * added in order at the end, then dk is multiplied by scale: the result does not depend on the
 * thread count or the schedule.
 *
 * The index score: one OpenMP iteration per (b, block of QB queries). The visible key range of
 * the block (the hull of its rows' first..last unmasked key) is cut into tiles of KT keys; each
 * tile is one sgemm (QB*Hi, Di) x (Di, KT) (OpenBLAS runs single-threaded inside the parallel
 * region) followed by relu and the head-weighted sum; masked keys get the mask value without
 * being read from the tile. The optional top-k runs on the finished row (lunar_cpu_topk_row).
 *
 * Dot products use 8-lane vectors (GCC vector extensions) with a fixed lane order, four keys at a
 * time; a key's score does not depend on where it sits in the list.
 */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu.h"
#include "vecmath.h"

#define AI static inline __attribute__((always_inline))
#define IS_MASKED(m) ((m) <= -FLT_MAX)

typedef float v8f __attribute__((vector_size(32)));
#define LD8(v, p) memcpy(&(v), (p), sizeof(v8f))

AI float hsum8(const v8f *v) {
    return (((*v)[0] + (*v)[1]) + ((*v)[2] + (*v)[3])) + (((*v)[4] + (*v)[5]) + ((*v)[6] + (*v)[7]));
}

/* dot(a, r), the lane order of dot4 */
AI float dot1(const float *a, const float *r, int64_t n) {
    v8f s = {0}, x, y;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        LD8(x, a + i);
        LD8(y, r + i);
        s += x * y;
    }
    float t = 0.0f;
    for (; i < n; i++) t += a[i] * r[i];
    return hsum8(&s) + t;
}

/* out[l] = dot(a, r_l) for four rows */
AI void dot4(float *out, const float *a, const float *r0, const float *r1, const float *r2, const float *r3,
             int64_t n) {
    v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, x, y;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        LD8(x, a + i);
        LD8(y, r0 + i);
        s0 += x * y;
        LD8(y, r1 + i);
        s1 += x * y;
        LD8(y, r2 + i);
        s2 += x * y;
        LD8(y, r3 + i);
        s3 += x * y;
    }
    float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
    for (; i < n; i++) {
        t0 += a[i] * r0[i];
        t1 += a[i] * r1[i];
        t2 += a[i] * r2[i];
        t3 += a[i] * r3[i];
    }
    out[0] = hsum8(&s0) + t0;
    out[1] = hsum8(&s1) + t1;
    out[2] = hsum8(&s2) + t2;
    out[3] = hsum8(&s3) + t3;
}

#define PF_AHEAD 8   /* keys prefetched ahead of the gathers */

/* the rows of keys idx[j0 .. j0+4) that exist, into the cache */
AI void prefetch4(const float *base, int64_t stride, const int64_t *idx, int64_t j0, int64_t n, int64_t d, int write) {
    for (int64_t j = j0; j < j0 + 4 && j < n; j++) {
        const float *r = base + idx[j] * stride;
        for (int64_t i = 0; i < d; i += 16) {
            if (write) __builtin_prefetch(r + i, 1);
            else __builtin_prefetch(r + i, 0);
        }
    }
}

/* out[j] = dot(a, base + idx[j] * stride) for j < n */
AI void dots(float *out, const float *a, const float *base, int64_t stride, const int64_t *idx, int64_t n,
             int64_t d) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch4(base, stride, idx, j + PF_AHEAD, n, d, 0);
        dot4(out + j, a, base + idx[j] * stride, base + idx[j + 1] * stride, base + idx[j + 2] * stride,
             base + idx[j + 3] * stride, d);
    }
    for (; j < n; j++) out[j] = dot1(a, base + idx[j] * stride, d);
}

/* acc[i] += sum_j c[j] * row_j[i], in order of j (rows base + idx[j] * stride) */
AI void gather_axpy(float *acc, const float *c, const float *base, int64_t stride, const int64_t *idx, int64_t n,
                    int64_t d) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch4(base, stride, idx, j + PF_AHEAD, n, d, 0);
        const float *r0 = base + idx[j] * stride, *r1 = base + idx[j + 1] * stride;
        const float *r2 = base + idx[j + 2] * stride, *r3 = base + idx[j + 3] * stride;
        float c0 = c[j], c1 = c[j + 1], c2 = c[j + 2], c3 = c[j + 3];
        for (int64_t i = 0; i < d; i++) {
            float a = acc[i];
            a += c0 * r0[i];
            a += c1 * r1[i];
            a += c2 * r2[i];
            a += c3 * r3[i];
            acc[i] = a;
        }
    }
    for (; j < n; j++) {
        const float *r = base + idx[j] * stride;
        float cj = c[j];
        for (int64_t i = 0; i < d; i++) acc[i] += cj * r[i];
    }
}

/* row_j += c[j] * x for each listed row (rows base + idx[j] * stride) */
AI void scatter_axpy(float *base, int64_t stride, const int64_t *idx, const float *c, int64_t n, const float *x,
                     int64_t d) {
    for (int64_t j = 0; j < n; j++) {
        if (j % 4 == 0) prefetch4(base, stride, idx, j + PF_AHEAD, n, d, 1);
        float *r = base + idx[j] * stride;
        float cj = c[j];
        for (int64_t i = 0; i < d; i++) r[i] += cj * x[i];
    }
}

/* ---- attention ------------------------------------------------------------------------------ */

typedef struct att_args {
    const float *q, *k, *v, *mask, *dout, *o;
    const int64_t *keys;
    float *out, *lse, *dq, *dk, *dv;
    int64_t B, S, T, NH, Hk, Dq, Dv, K;
    float scale;
} att_args;

typedef struct att_work {   /* one thread's scratch */
    int64_t *idx;           /* (T) attendable keys of the row */
    float   *madd;          /* (T) their mask values */
    float   *p;             /* (T) scores, then probabilities */
    float   *dp;            /* (T) dout . v_j, then dS_j */
    float   *acc;           /* (max(Dq, Dv)) */
    uint8_t *seen;          /* (T) 0, for removing repeated keys */
} att_work;

static size_t work_bytes(int64_t T, int64_t D) {
    return (size_t)T * (sizeof(int64_t) + 3 * sizeof(float) + 1) + (size_t)D * sizeof(float) + 64;
}

static void work_at(att_work *w, char *base, int64_t T, int64_t D) {
    w->idx = (int64_t *)base;
    w->madd = (float *)(w->idx + T);
    w->p = w->madd + T;
    w->dp = w->p + T;
    w->acc = w->dp + T;
    w->seen = (uint8_t *)(w->acc + D);
}

/* Lists the attendable keys of query (b, s) in w->idx / w->madd; returns their number. Zero
 * means "uniform over all T keys"; then idx holds 0..T-1. Branch-free: every candidate is
 * written and the count advances only for attendable ones. */
static int64_t row_keys(const att_args *a, att_work *w, int64_t b, int64_t s) {
    int64_t T = a->T, n = 0;
    const float *mrow = a->mask ? a->mask + (b * a->S + s) * T : NULL;
    int64_t *idx = w->idx;
    float *madd = w->madd;
    if (a->keys) {
        /* the listed keys in ascending order (so that a key list gives bit for bit what the same
         * selection written into the mask gives); a repeated key counts once */
        const int64_t *kr = a->keys + (b * a->S + s) * a->K;
        uint8_t *seen = w->seen;
        int64_t lo = T, hi = -1;
        for (int64_t j = 0; j < a->K; j++) {
            int64_t t = kr[j];
            if (t < 0) continue;
            seen[t] = 1;
            lo = t < lo ? t : lo;
            hi = t > hi ? t : hi;
        }
        for (int64_t t = lo; t <= hi; t++) {
            float m = mrow ? mrow[t] : 0.0f;
            idx[n] = t;
            madd[n] = m;
            n += seen[t] & !IS_MASKED(m);
            seen[t] = 0;
        }
    } else if (mrow) {
        for (int64_t t = 0; t < T; t++) {
            float m = mrow[t];
            idx[n] = t;
            madd[n] = m;
            n += !IS_MASKED(m);
        }
    } else {
        for (int64_t t = 0; t < T; t++) {
            idx[t] = t;
            madd[t] = 0.0f;
        }
        n = T;
    }
    if (n == 0)
        for (int64_t t = 0; t < T; t++) idx[t] = t;
    return n;
}

/* the score of a key from its dot product (one expression, so that the forward and the
 * backward's key-major recomputation round it the same way) */
AI float score_of(float dot, float scale, float madd) { return dot * scale + madd; }

/* The probabilities p[0..n) of head row qh over the listed keys (n > 0), and their lse; n == 0:
 * p = 1/T over all T keys, lse = -FLT_MAX. Shared by forward and backward. */
LUNAR_CPU_VECTOR static float row_probs(att_work *w, const float *qh, const float *kb, int64_t ks, int64_t n,
                                        int64_t T, int64_t D, float scale, float *m_out, float *inv_out) {
    float *p = w->p;
    if (n == 0) {
        float u = 1.0f / (float)T;
        for (int64_t t = 0; t < T; t++) p[t] = u;
        *m_out = -FLT_MAX, *inv_out = u;
        return -FLT_MAX;
    }
    dots(p, qh, kb, ks, w->idx, n, D);
    const float *madd = w->madd;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        p[j] = score_of(p[j], scale, madd[j]);
        m = p[j] > m ? p[j] : m;
    }
    for (int64_t j = 0; j < n; j++) p[j] = lunar_expf_upto88(p[j] - m);
    double acc[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += p[j + l];
    for (; j < n; j++) acc[0] += p[j];
    double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    float inv = (float)(1.0 / sum);
    for (j = 0; j < n; j++) p[j] *= inv;
    *m_out = m, *inv_out = inv;
    return m + (float)log(sum);
}

/* every head of query row (b, s) */
LUNAR_CPU_VECTOR static void forward_row(const att_args *a, att_work *w, int64_t b, int64_t s) {
    int64_t T = a->T, NH = a->NH, Hk = a->Hk, Dq = a->Dq, Dv = a->Dv, G = NH / Hk;
    int64_t n = row_keys(a, w, b, s);
    int64_t np = n ? n : T;
    for (int64_t h = 0; h < NH; h++) {
        int64_t g = h / G;
        const float *kb = a->k + (b * T * Hk + g) * Dq;
        const float *vb = a->v + (b * T * Hk + g) * Dv;
        const float *qh = a->q + ((b * a->S + s) * NH + h) * Dq;
        float m, inv;
        float lse = row_probs(w, qh, kb, Hk * Dq, n, T, Dq, a->scale, &m, &inv);
        float *oh = a->out + ((b * a->S + s) * NH + h) * Dv;
        for (int64_t i = 0; i < Dv; i++) oh[i] = 0.0f;
        gather_axpy(oh, w->p, vb, Hk * Dv, w->idx, np, Dv);
        a->lse[(b * NH + h) * a->S + s] = lse;
    }
}

lunar_status lunar_cpu_attention_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *lse, const lunar_tensor *q,
                                         const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *keys,
                                         const lunar_tensor *mask, float scale) {
    att_args a = {
        .q = lunar_tensor_data(q), .k = lunar_tensor_data(k), .v = lunar_tensor_data(v),
        .mask = mask ? lunar_tensor_data(mask) : NULL, .keys = keys ? lunar_tensor_data(keys) : NULL,
        .out = lunar_tensor_data(o), .lse = lunar_tensor_data(lse),
        .B = q->shape[0], .S = q->shape[1], .T = k->shape[1], .NH = q->shape[2], .Hk = k->shape[2],
        .Dq = q->shape[3], .Dv = v->shape[3], .K = keys ? keys->shape[2] : 0, .scale = scale,
    };
    int64_t rows = a.B * a.S;
    if (rows == 0) return LUNAR_OK;
    int nt = lunar_ctx_threads(ctx);
    int64_t D = a.Dq > a.Dv ? a.Dq : a.Dv;
    size_t wb = (work_bytes(a.T, D) + 63) & ~(size_t)63;
    int64_t nbytes = (int64_t)wb * nt;
    lunar_tensor scratch = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    char *sb = lunar_tensor_data(&scratch);
    memset(sb, 0, (size_t)nbytes);
    int64_t work = rows * a.NH * (a.keys ? a.K : a.T) * (a.Dq + a.Dv);
#pragma omp parallel num_threads(nt) if (work >= LUNAR_CPU_PAR_MIN && rows > 1)
    {
        att_work w;
        work_at(&w, sb + wb * (size_t)omp_get_thread_num(), a.T, D);
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; r++) forward_row(&a, &w, r / a.S, r % a.S);
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}

/* Backward state shared by the passes. */
typedef struct bwd_args {
    int32_t *lists;    /* (B*S, L): the attendable keys of each query row */
    int32_t *count;    /* (B*S): their number (0 = uniform over all T keys) */
    float   *stat;     /* (B*S, NH, 3): the row's max, 1/sum and D = dout . o */
    int32_t *coff;     /* (B, T+1): per key, where its queries start in cidx (per batch row) */
    int32_t *cidx;     /* the queries of every key, in increasing order */
    int64_t  L;
} bwd_args;

/* Pass 1, query row (b, s), every head: P (exactly the forward's), dS, and dq = scale dS k.
 * Records the row's keys and (max, 1/sum, D) per head for pass 3. */
LUNAR_CPU_VECTOR static void backward_row(const att_args *a, const bwd_args *ba, att_work *w, int64_t b, int64_t s) {
    int64_t T = a->T, NH = a->NH, Hk = a->Hk, Dq = a->Dq, Dv = a->Dv, G = NH / Hk, S = a->S;
    int64_t r = b * S + s;
    int64_t n = row_keys(a, w, b, s);
    int64_t np = n ? n : T;
    ba->count[r] = (int32_t)n;
    for (int64_t j = 0; j < n; j++) ba->lists[r * ba->L + j] = (int32_t)w->idx[j];
    for (int64_t h = 0; h < NH; h++) {
        int64_t g = h / G, row = r * NH + h;
        const float *kb = a->k + (b * T * Hk + g) * Dq;
        const float *vb = a->v + (b * T * Hk + g) * Dv;
        const float *qh = a->q + row * Dq, *doh = a->dout + row * Dv, *oh = a->o + row * Dv;
        float *st = ba->stat + row * 3;
        row_probs(w, qh, kb, Hk * Dq, n, T, Dq, a->scale, &st[0], &st[1]);
        double dd = 0.0;
        for (int64_t i = 0; i < Dv; i++) dd += (double)doh[i] * oh[i];
        float D = (float)dd;
        st[2] = D;
        float *p = w->p, *ds = w->dp;
        dots(ds, doh, vb, Hk * Dv, w->idx, np, Dv);
        for (int64_t j = 0; j < np; j++) ds[j] = p[j] * (ds[j] - D);
        float *acc = w->acc;
        for (int64_t i = 0; i < Dq; i++) acc[i] = 0.0f;
        gather_axpy(acc, ds, kb, Hk * Dq, w->idx, np, Dq);
        float *dqh = a->dq + row * Dq;
        for (int64_t i = 0; i < Dq; i++) dqh[i] = a->scale * acc[i];
    }
}

/* Pass 3, key t of batch row b, every key head: dk = scale sum dS q, dv = sum P dout over the
 * queries that attend the key (in increasing order) and the query heads sharing the key head,
 * with P recomputed from the recorded max and 1/sum. */
LUNAR_CPU_VECTOR static void backward_key(const att_args *a, const bwd_args *ba, att_work *w, int64_t b, int64_t t) {
    int64_t T = a->T, NH = a->NH, Hk = a->Hk, Dq = a->Dq, Dv = a->Dv, G = NH / Hk, S = a->S;
    const int32_t *cq = ba->cidx + ba->coff[b * (T + 1) + t];
    int64_t nq = ba->coff[b * (T + 1) + t + 1] - ba->coff[b * (T + 1) + t];
    int64_t *qs = w->idx;
    float *x = w->p, *dp = w->dp, *madd = w->madd;
    for (int64_t j = 0; j < nq; j++) {
        qs[j] = cq[j];
        madd[j] = a->mask ? a->mask[(b * S + cq[j]) * T + t] : 0.0f;
    }
    float uni = 1.0f / (float)T;
    for (int64_t g = 0; g < Hk; g++) {
        const float *kt = a->k + ((b * T + t) * Hk + g) * Dq;
        const float *vt = a->v + ((b * T + t) * Hk + g) * Dv;
        float *dkt = a->dk + ((b * T + t) * Hk + g) * Dq, *dvt = a->dv + ((b * T + t) * Hk + g) * Dv;
        float *acc = w->acc, *acc2 = w->acc + Dq;
        for (int64_t i = 0; i < Dq; i++) acc[i] = 0.0f;
        for (int64_t i = 0; i < Dv; i++) acc2[i] = 0.0f;
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            const float *qb = a->q + (b * S * NH + h) * Dq, *dob = a->dout + (b * S * NH + h) * Dv;
            dots(x, kt, qb, NH * Dq, qs, nq, Dq);
            dots(dp, vt, dob, NH * Dv, qs, nq, Dv);
            for (int64_t j = 0; j < nq; j++) {
                int64_t row = (b * S + qs[j]) * NH + h;
                const float *st = ba->stat + row * 3;
                float p = ba->count[b * S + qs[j]] ? lunar_expf_upto88(score_of(x[j], a->scale, madd[j]) - st[0]) * st[1]
                                                   : uni;
                x[j] = p * (dp[j] - st[2]);   /* dS */
                dp[j] = p;
            }
            gather_axpy(acc, x, qb, NH * Dq, qs, nq, Dq);
            gather_axpy(acc2, dp, dob, NH * Dv, qs, nq, Dv);
        }
        for (int64_t i = 0; i < Dq; i++) dkt[i] = a->scale * acc[i];
        for (int64_t i = 0; i < Dv; i++) dvt[i] = acc2[i];
    }
}

lunar_status lunar_cpu_attention_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                          const lunar_tensor *dout, const lunar_tensor *o, const lunar_tensor *lse,
                                          const lunar_tensor *q, const lunar_tensor *k, const lunar_tensor *v,
                                          const lunar_tensor *keys, const lunar_tensor *mask, float scale) {
    (void)lse;
    att_args a = {
        .q = lunar_tensor_data(q), .k = lunar_tensor_data(k), .v = lunar_tensor_data(v),
        .mask = mask ? lunar_tensor_data(mask) : NULL, .keys = keys ? lunar_tensor_data(keys) : NULL,
        .dout = lunar_tensor_data(dout), .o = lunar_tensor_data(o),
        .dq = lunar_tensor_data(dq), .dk = lunar_tensor_data(dk), .dv = lunar_tensor_data(dv),
        .B = q->shape[0], .S = q->shape[1], .T = k->shape[1], .NH = q->shape[2], .Hk = k->shape[2],
        .Dq = q->shape[3], .Dv = v->shape[3], .K = keys ? keys->shape[2] : 0, .scale = scale,
    };
    int64_t B = a.B, S = a.S, T = a.T, NH = a.NH, Dq = a.Dq, Dv = a.Dv, rows = B * S;
    int64_t L = keys ? (a.K < T ? a.K : T) : T;
    int nt = lunar_ctx_threads(ctx);
    int64_t D = Dq + Dv, TS = T > S ? T : S;
    size_t wb = (work_bytes(TS, D) + 63) & ~(size_t)63;
    /* scratch: per-thread work | lists (rows, L) | count (rows) | stat (rows, NH, 3) | coff (B, T+1)
     *          | fill positions (B, T) */
    size_t off_lists = wb * (size_t)nt;
    size_t off_count = off_lists + (size_t)(rows * L) * 4;
    size_t off_stat = off_count + (size_t)rows * 4;
    size_t off_coff = off_stat + (size_t)(rows * NH * 3) * 4;
    size_t off_pos = off_coff + (size_t)(B * (T + 1)) * 4;
    int64_t nbytes = (int64_t)(off_pos + (size_t)(B * T) * 4);
    lunar_tensor scratch = {0}, cscratch = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    char *sb = lunar_tensor_data(&scratch);
    memset(sb, 0, wb * (size_t)nt);
    bwd_args ba = {
        .lists = (int32_t *)(sb + off_lists), .count = (int32_t *)(sb + off_count), .stat = (float *)(sb + off_stat),
        .coff = (int32_t *)(sb + off_coff), .L = L,
    };
    int32_t *pos = (int32_t *)(sb + off_pos);
    int64_t work = rows * NH * L * D;
    int par = work >= LUNAR_CPU_PAR_MIN;
    /* pass 1: query rows */
#pragma omp parallel num_threads(nt) if (par && rows > 1)
    {
        att_work w;
        work_at(&w, sb + wb * (size_t)omp_get_thread_num(), TS, D);
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; r++) backward_row(&a, &ba, &w, r / S, r % S);
    }
    /* pass 2: the queries of every key (counting sort by key, queries in increasing order) */
    int64_t nnz = 0;
    for (int64_t b = 0; b < B; b++) {
        int32_t *cnt = ba.coff + b * (T + 1);
        memset(cnt, 0, (size_t)(T + 1) * 4);
        for (int64_t s = 0; s < S; s++) {
            int64_t r = b * S + s, n = ba.count[r];
            if (n == 0)
                for (int64_t t = 0; t < T; t++) cnt[t + 1]++;
            for (int64_t j = 0; j < n; j++) cnt[ba.lists[r * L + j] + 1]++;
        }
        cnt[0] = (int32_t)nnz;
        for (int64_t t = 0; t < T; t++) cnt[t + 1] += cnt[t];
        nnz = cnt[T];
    }
    int64_t cbytes = nnz > 0 ? nnz * 4 : 4;
    lunar_status st = lunar_tensor_new(ctx, &cscratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &cbytes);
    if (st) {
        lunar_tensor_release(ctx, &scratch);
        return st;
    }
    ba.cidx = lunar_tensor_data(&cscratch);
    for (int64_t b = 0; b < B; b++) {
        int32_t *pb = pos + b * T;
        memcpy(pb, ba.coff + b * (T + 1), (size_t)T * 4);
        for (int64_t s = 0; s < S; s++) {
            int64_t r = b * S + s, n = ba.count[r];
            if (n == 0)
                for (int64_t t = 0; t < T; t++) ba.cidx[pb[t]++] = (int32_t)s;
            for (int64_t j = 0; j < n; j++) ba.cidx[pb[ba.lists[r * L + j]]++] = (int32_t)s;
        }
    }
    /* pass 3: keys */
#pragma omp parallel num_threads(nt) if (par && B * T > 1)
    {
        att_work w;
        work_at(&w, sb + wb * (size_t)omp_get_thread_num(), TS, D);
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < B * T; r++) backward_key(&a, &ba, &w, r / T, r % T);
    }
    lunar_tensor_release(ctx, &cscratch);
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}

/* ---- DSA index score ------------------------------------------------------------------------ */

#define IDX_QB 16    /* queries per block */
#define IDX_KT 256   /* keys per tile */

/* row[t] for t in [t0, t0 + nt) that are visible: sum_h w[h] relu(A[h][t - t0]) + m */
LUNAR_CPU_VECTOR static void index_tile_row(float *row, float *acc, const float *A, int64_t lda, const float *w,
                                            int64_t Hi, const float *mrow, int64_t t0, int64_t nt) {
    for (int64_t t = 0; t < nt; t++) acc[t] = 0.0f;
    for (int64_t h = 0; h < Hi; h++) {
        const float *ah = A + h * lda;
        float wh = w[h];
        for (int64_t t = 0; t < nt; t++) {
            float x = ah[t] > 0.0f ? ah[t] : 0.0f;
            acc[t] += wh * x;
        }
    }
    if (mrow) {
        for (int64_t t = 0; t < nt; t++) {
            float m = mrow[t0 + t];
            row[t0 + t] = IS_MASKED(m) ? m : acc[t] + m;
        }
    } else {
        for (int64_t t = 0; t < nt; t++) row[t0 + t] = acc[t];
    }
}

lunar_status lunar_cpu_index_scores(lunar_ctx *ctx, lunar_tensor *scores, lunar_tensor *topk, const lunar_tensor *qi,
                                    const lunar_tensor *ki, const lunar_tensor *w, const lunar_tensor *mask,
                                    float scale) {
    int64_t B = qi->shape[0], S = qi->shape[1], Hi = qi->shape[2], Di = qi->shape[3], T = ki->shape[1];
    int64_t K = topk ? topk->shape[2] : 0;
    const float *qp = lunar_tensor_data(qi), *kp = lunar_tensor_data(ki), *wp = lunar_tensor_data(w);
    const float *mp = mask ? lunar_tensor_data(mask) : NULL;
    float *sp = scores ? lunar_tensor_data(scores) : NULL;
    int64_t *tp = topk ? lunar_tensor_data(topk) : NULL;
    if (B * S == 0) return LUNAR_OK;
    int nt = lunar_ctx_threads(ctx);
    if (openblas_get_num_threads() != nt) openblas_set_num_threads(nt);
    /* per thread: the tile (QB*Hi, KT), the accumulator (KT), and the rows when scores is NULL */
    size_t wb = (size_t)(IDX_QB * Hi * IDX_KT + IDX_KT + (sp ? 0 : IDX_QB * T)) * sizeof(float);
    wb = (wb + 63) & ~(size_t)63;
    int64_t nbytes = (int64_t)wb * nt;
    lunar_tensor scratch = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    char *sb = lunar_tensor_data(&scratch);
    int64_t nblk = (S + IDX_QB - 1) / IDX_QB, units = B * nblk;
    int64_t work = B * S * T * Hi * Di;
#pragma omp parallel num_threads(nt) if (work >= LUNAR_CPU_PAR_MIN && units > 1)
    {
        float *tile = (float *)(sb + wb * (size_t)omp_get_thread_num());
        float *acc = tile + IDX_QB * Hi * IDX_KT;
        float *rows = acc + IDX_KT;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            int64_t b = u / nblk, s0 = (u % nblk) * IDX_QB, s1 = s0 + IDX_QB < S ? s0 + IDX_QB : S;
            int64_t lo[IDX_QB], hi[IDX_QB], blo = T, bhi = 0;
            for (int64_t s = s0; s < s1; s++) {
                int64_t l = 0, r = T;
                float *row = sp ? sp + (b * S + s) * T : rows + (s - s0) * T;
                if (mp) {
                    const float *mrow = mp + (b * S + s) * T;
                    while (l < T && IS_MASKED(mrow[l])) l++;
                    while (r > l && IS_MASKED(mrow[r - 1])) r--;
                    memcpy(row, mrow, (size_t)T * sizeof(float));   /* masked keys keep the mask value */
                }
                lo[s - s0] = l, hi[s - s0] = r;
                if (l < r) {
                    blo = l < blo ? l : blo;
                    bhi = r > bhi ? r : bhi;
                }
            }
            for (int64_t t0 = blo; t0 < bhi; t0 += IDX_KT) {
                int64_t n = bhi - t0 < IDX_KT ? bhi - t0 : IDX_KT;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)((s1 - s0) * Hi), (int)n, (int)Di, scale,
                            qp + (b * S + s0) * Hi * Di, (int)Di, kp + (b * T + t0) * Di, (int)Di, 0.0f, tile, (int)n);
                for (int64_t s = s0; s < s1; s++) {
                    int64_t l = lo[s - s0] > t0 ? lo[s - s0] : t0;
                    int64_t r = hi[s - s0] < t0 + n ? hi[s - s0] : t0 + n;
                    if (l >= r) continue;
                    float *row = sp ? sp + (b * S + s) * T : rows + (s - s0) * T;
                    index_tile_row(row, acc, tile + (s - s0) * Hi * n + (l - t0), n, wp + (b * S + s) * Hi, Hi,
                                   mp ? mp + (b * S + s) * T : NULL, l, r - l);
                }
            }
            if (tp)
                for (int64_t s = s0; s < s1; s++)
                    lunar_cpu_topk_row(tp + (b * S + s) * K, sp ? sp + (b * S + s) * T : rows + (s - s0) * T, T, K);
        }
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}
