/* attention_paged.c: decode attention over a paged KV cache on the CPU (contract:
 * lunar_attention_paged in lunar/ops.h): one query per sequence, the cache read in place.
 *
 * A unit of work is one (sequence b, key head g): the G = NH / Hk query heads that share the key
 * head. Units run in parallel (OpenMP, any schedule: a unit owns its outputs), and each is
 * computed in one fixed order, so a sequence's result does not depend on the other sequences,
 * their number or the threads:
 *   1. the attended positions, ascending (the key list's, or 0 .. length - 1);
 *   2. scores: for each position, its key row is read once (converted to f32 if the cache is
 *      bf16 or f16) and dotted with the G queries (four at a time), 8 lanes over d and the
 *      lanes added ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), times scale;
 *   3. per head the softmax over the positions: the max, e^(s - max) (vecmath.h's exponential),
 *      their sum in 8 double lanes added in the same tree, each e times 1 / sum;
 *   4. o[h][d] = sum over the positions, in order, of p[h][i] v[i][d] (one running f32 sum per
 *      element), taken in blocks of AP_KB positions whose value rows are read (and converted)
 *      once for all G heads; four heads by 16 columns at a time.
 * The memory traffic is the sequence's cache rows, read once for the keys and once for the values
 * (for MLA both are the same row); the dense gathered copy the plain attention op needs is gone.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu.h"
#include "lunar/dtype.h"
#include "vecmath.h"

#define AP_LANES 8
#define AP_KB 64   /* positions per block of value rows */

typedef float ap_v8 __attribute__((vector_size(AP_LANES * sizeof(float))));
#define AP_LOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define AP_STORE(p, v) memcpy((p), &(v), sizeof(v))

typedef struct ap_args {
    const float *q;
    float *o;
    const char *k, *v;          /* the cache rows, elements of kv bytes */
    size_t kv;                  /* bytes per cache element */
    lunar_dtype dt;             /* the cache's dtype */
    int64_t ldk, ldv;           /* row strides, elements */
    const int64_t *table, *lens, *keys;
    int64_t B, NH, Hk, G, Dq, Dv, NB, bs, K, T;   /* T: positions a sequence attends at most */
    float scale;
} ap_args;

typedef struct ap_work {   /* one thread's scratch */
    int64_t *pos;          /* (T) attended positions */
    float *s;              /* (T, G) scores, then probabilities */
    float *kb;             /* (Dq) a converted key row */
    float *vb;             /* (AP_KB, Dv) converted value rows */
    float *oacc;           /* (G, Dv) the output sums */
} ap_work;

static size_t ap_work_bytes(const ap_args *a) {
    return (size_t)a->T * 8 + (size_t)(a->T * a->G) * 4 + (size_t)a->Dq * 4 + (size_t)(AP_KB * a->Dv) * 4 +
           (size_t)(a->G * a->Dv) * 4 + 5 * 64;
}

static char *ap_align(char *p) { return (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

static void ap_work_at(ap_work *w, char *base, const ap_args *a) {
    char *p = ap_align(base);
    w->pos = (int64_t *)p, p = ap_align(p + a->T * 8);
    w->s = (float *)p, p = ap_align(p + a->T * a->G * 4);
    w->kb = (float *)p, p = ap_align(p + a->Dq * 4);
    w->vb = (float *)p, p = ap_align(p + AP_KB * a->Dv * 4);
    w->oacc = (float *)p;
}

/* n elements of the cache from src (of the cache's dtype) as f32 */
static inline void ap_convert(float *dst, const char *src, lunar_dtype dt, int64_t n) {
    const uint16_t *h = (const uint16_t *)src;
    if (dt == LUNAR_DTYPE_BF16)
        for (int64_t i = 0; i < n; i++) dst[i] = lunar_bf16_to_f32(h[i]);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = lunar_f16_to_f32(h[i]);
}

/* columns col .. col + n - 1 of cache row r of base (row stride ld) as f32: in place for an f32
 * cache, else converted into buf */
static inline const float *ap_row(const ap_args *a, const char *base, int64_t ld, int64_t r, int64_t col, int64_t n,
                                  float *buf) {
    const char *src = base + (size_t)(r * ld + col) * a->kv;
    if (a->dt == LUNAR_DTYPE_F32) return (const float *)src;
    ap_convert(buf, src, a->dt, n);
    return buf;
}

/* the cache row of position t of sequence b */
static inline int64_t ap_cache_row(const ap_args *a, int64_t b, int64_t t) {
    return a->table[b * a->NB + t / a->bs] * a->bs + t % a->bs;
}

/* (by pointer: a 32-byte vector passed by value has another ABI with and without AVX) */
static inline float ap_lanes_sum(const ap_v8 *v) {
    float l[AP_LANES];
    memcpy(l, v, sizeof l);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* dots[j] = scale * (q row j of qh[] . kr), n floats each, j < 4: per row the fixed order (8
 * lanes, a zero-padded last group, then the tree); four rows at once share the loads of kr and
 * keep four independent chains of multiply-adds in flight */
static inline void ap_dot4(const float *const qh[4], const float *kr, int64_t n, float scale, float dots[4]) {
    ap_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t d = 0;
    for (; d + AP_LANES <= n; d += AP_LANES) {
        ap_v8 kv, x0, x1, x2, x3;
        AP_LOAD(kv, kr + d);
        AP_LOAD(x0, qh[0] + d), AP_LOAD(x1, qh[1] + d), AP_LOAD(x2, qh[2] + d), AP_LOAD(x3, qh[3] + d);
        a0 += x0 * kv, a1 += x1 * kv, a2 += x2 * kv, a3 += x3 * kv;
    }
    if (d < n) {
        float kp[AP_LANES] = {0}, xp[4][AP_LANES];
        memset(xp, 0, sizeof xp);
        memcpy(kp, kr + d, (size_t)(n - d) * 4);
        for (int j = 0; j < 4; j++) memcpy(xp[j], qh[j] + d, (size_t)(n - d) * 4);
        ap_v8 kv, x0, x1, x2, x3;
        AP_LOAD(kv, kp);
        AP_LOAD(x0, xp[0]), AP_LOAD(x1, xp[1]), AP_LOAD(x2, xp[2]), AP_LOAD(x3, xp[3]);
        a0 += x0 * kv, a1 += x1 * kv, a2 += x2 * kv, a3 += x3 * kv;
    }
    dots[0] = ap_lanes_sum(&a0) * scale, dots[1] = ap_lanes_sum(&a1) * scale;
    dots[2] = ap_lanes_sum(&a2) * scale, dots[3] = ap_lanes_sum(&a3) * scale;
}

/* the attended positions of sequence b into pos; returns their number */
static int64_t ap_positions(const ap_args *a, int64_t b, int64_t *pos) {
    int64_t len = a->lens[b], n = 0;
    if (!a->keys) {
        for (int64_t t = 0; t < len; t++) pos[n++] = t;
        return n;
    }
    const int64_t *kr = a->keys + b * a->K;
    int64_t last = -1;
    for (int64_t j = 0; j < a->K; j++) {
        int64_t t = kr[j];
        if (t < 0 || t >= len || t <= last) continue;
        pos[n++] = last = t;
    }
    return n;
}

/* p[i * G + h] = softmax over i of s[i * G + h], for each head h */
static void ap_softmax(float *s, int64_t n, int64_t G) {
    for (int64_t h = 0; h < G; h++) {
        float m = -INFINITY;
        for (int64_t i = 0; i < n; i++) m = s[i * G + h] > m ? s[i * G + h] : m;
        double acc[AP_LANES] = {0};
        for (int64_t i = 0; i < n; i++) {
            float e = lunar_expf_upto88(s[i * G + h] - m);
            s[i * G + h] = e;
            acc[i % AP_LANES] += e;
        }
        double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < n; i++) s[i * G + h] *= inv;
    }
}

LUNAR_CPU_VECTOR static void ap_unit(const ap_args *a, ap_work *w, int64_t b, int64_t g) {
    int64_t G = a->G, Dq = a->Dq, Dv = a->Dv;
    float *out = a->o + (b * a->NH + g * G) * Dv;   /* heads g*G .. g*G + G - 1 of sequence b */
    int64_t n = ap_positions(a, b, w->pos);
    if (n == 0) {
        memset(out, 0, (size_t)(G * Dv) * 4);
        return;
    }
    /* scores, four heads at a time (a last partial group repeats its last head, not stored) */
    const float *qg = a->q + (b * a->NH + g * G) * Dq;
    for (int64_t i = 0; i < n; i++) {
        const float *kr = ap_row(a, a->k, a->ldk, ap_cache_row(a, b, w->pos[i]), g * Dq, Dq, w->kb);
        for (int64_t h0 = 0; h0 < G; h0 += 4) {
            const float *qh[4];
            for (int j = 0; j < 4; j++) qh[j] = qg + (h0 + j < G ? h0 + j : G - 1) * Dq;
            float dots[4];
            ap_dot4(qh, kr, Dq, a->scale, dots);
            for (int j = 0; j < 4 && h0 + j < G; j++) w->s[i * G + h0 + j] = dots[j];
        }
    }
    ap_softmax(w->s, n, G);
    /* values: oacc[h][d] += p[i][h] v[i][d], i in order, in blocks of AP_KB rows; four heads by
     * 16 columns at a time (eight independent running sums) */
    memset(w->oacc, 0, (size_t)(G * Dv) * 4);
    const float *vr[AP_KB];
    for (int64_t i0 = 0; i0 < n; i0 += AP_KB) {
        int64_t nb = n - i0 < AP_KB ? n - i0 : AP_KB;
        for (int64_t i = 0; i < nb; i++)
            vr[i] = ap_row(a, a->v, a->ldv, ap_cache_row(a, b, w->pos[i0 + i]), g * Dv, Dv, w->vb + i * Dv);
        const float *p = w->s + i0 * G;
        for (int64_t h0 = 0; h0 < G; h0 += 4) {
            int64_t hj[4];
            for (int j = 0; j < 4; j++) hj[j] = h0 + j < G ? h0 + j : G - 1;
            int64_t d = 0;
            for (; d + 2 * AP_LANES <= Dv; d += 2 * AP_LANES) {
                ap_v8 o00, o01, o10, o11, o20, o21, o30, o31;
                AP_LOAD(o00, w->oacc + hj[0] * Dv + d), AP_LOAD(o01, w->oacc + hj[0] * Dv + d + AP_LANES);
                AP_LOAD(o10, w->oacc + hj[1] * Dv + d), AP_LOAD(o11, w->oacc + hj[1] * Dv + d + AP_LANES);
                AP_LOAD(o20, w->oacc + hj[2] * Dv + d), AP_LOAD(o21, w->oacc + hj[2] * Dv + d + AP_LANES);
                AP_LOAD(o30, w->oacc + hj[3] * Dv + d), AP_LOAD(o31, w->oacc + hj[3] * Dv + d + AP_LANES);
                for (int64_t i = 0; i < nb; i++) {
                    ap_v8 v0, v1;
                    AP_LOAD(v0, vr[i] + d);
                    AP_LOAD(v1, vr[i] + d + AP_LANES);
                    const float *pi = p + i * G;
                    o00 += v0 * pi[hj[0]], o01 += v1 * pi[hj[0]];
                    o10 += v0 * pi[hj[1]], o11 += v1 * pi[hj[1]];
                    o20 += v0 * pi[hj[2]], o21 += v1 * pi[hj[2]];
                    o30 += v0 * pi[hj[3]], o31 += v1 * pi[hj[3]];
                }
                /* a repeated head is stored again with the same values */
                AP_STORE(w->oacc + hj[0] * Dv + d, o00), AP_STORE(w->oacc + hj[0] * Dv + d + AP_LANES, o01);
                AP_STORE(w->oacc + hj[1] * Dv + d, o10), AP_STORE(w->oacc + hj[1] * Dv + d + AP_LANES, o11);
                AP_STORE(w->oacc + hj[2] * Dv + d, o20), AP_STORE(w->oacc + hj[2] * Dv + d + AP_LANES, o21);
                AP_STORE(w->oacc + hj[3] * Dv + d, o30), AP_STORE(w->oacc + hj[3] * Dv + d + AP_LANES, o31);
            }
            for (; d < Dv; d++)   /* columns past the last group of 16: one running sum each */
                for (int j = 0; j < 4 && h0 + j < G; j++) {
                    float acc = w->oacc[hj[j] * Dv + d];
                    for (int64_t i = 0; i < nb; i++) acc += vr[i][d] * p[i * G + hj[j]];
                    w->oacc[hj[j] * Dv + d] = acc;
                }
        }
    }
    memcpy(out, w->oacc, (size_t)(G * Dv) * 4);
}

lunar_status lunar_cpu_attention_paged(lunar_ctx *ctx, lunar_tensor *o, const lunar_tensor *q, const lunar_tensor *k,
                                       const lunar_tensor *v, const lunar_tensor *table, const lunar_tensor *lengths,
                                       const lunar_tensor *keys, int64_t block_size, float scale) {
    ap_args a = {
        .q = lunar_tensor_data(q), .o = lunar_tensor_data(o), .k = lunar_tensor_data(k), .v = lunar_tensor_data(v),
        .kv = lunar_dtype_size(k->dtype), .dt = k->dtype, .ldk = k->stride[0], .ldv = v->stride[0],
        .table = lunar_tensor_data(table), .lens = lunar_tensor_data(lengths),
        .keys = keys ? lunar_tensor_data(keys) : NULL,
        .B = q->shape[0], .NH = q->shape[1], .Dq = q->shape[2], .Dv = o->shape[2], .NB = table->shape[1],
        .bs = block_size, .K = keys ? keys->shape[1] : 0, .scale = scale,
    };
    a.Hk = k->shape[1] / a.Dq;
    a.G = a.NH / a.Hk;
    a.T = a.NB * a.bs;
    if (keys && a.K < a.T) a.T = a.K;
    if (a.B == 0) return LUNAR_OK;
    int nt = lunar_ctx_threads(ctx);
    int64_t units = a.B * a.Hk, work = 0;
    for (int64_t b = 0; b < a.B; b++) work += a.lens[b];
    work *= a.NH * (a.Dq + a.Dv);
    int par = nt > 1 && units > 1 && work >= LUNAR_CPU_PAR_MIN;
    if (!par) nt = 1;
    size_t wb = (ap_work_bytes(&a) + 63) & ~(size_t)63;
    int64_t nbytes = (int64_t)(wb * (size_t)nt) + 64;
    lunar_tensor scratch = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    char *sb = lunar_tensor_data(&scratch);
#pragma omp parallel num_threads(nt) if (par)
    {
        ap_work w;
        ap_work_at(&w, sb + wb * (size_t)omp_get_thread_num(), &a);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) ap_unit(&a, &w, u / a.Hk, u % a.Hk);
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}
