/* attention.c: fused attention over per-query key sets and the DSA index score on the CPU
 * (contracts in lunar/ops.h; f32, contiguous, token-major).
 *
 * Attention is block-sparse flash attention on BLAS tiles. Query rows are taken in blocks (at
 * most QB rows; block boundaries never cross a multiple of QB, so every pass forms the same
 * blocks). A block's key columns are the hull [lo, hi) of its rows' attendable keys, or, for
 * key lists much sparser than their hull, the gathered union U of the lists; keys outside are
 * never touched, so a causal mask halves the work. Per head: X = scale Q K_U^T (one sgemm),
 * the softmax of each row over its attendable columns only (the others get probability 0; the
 * key list is the row's own, the mask row decides visibility, a row with no attendable key is
 * uniform over all T keys), O = P V_U (one sgemm). Key-list blocks shrink (halving) until they
 * compute at most WASTE times the listed (query, key) pairs. Nothing of size T x T exists:
 * per thread a few (QB, T) and (T, D) tiles.
 *
 * Backward, per (b, key head g, chunk of blocks): recompute X and P exactly as the forward
 * does (same blocks, same sgemm calls), dP = dO V_U^T, dS = P (dP - D) with D = dO . O (f64),
 * dQ = scale dS K_U, dK_U += scale dS^T Q and dV_U += P^T dO (sgemm with beta = 1), heads and
 * blocks in order. A unit owns the dk/dv rows of its (b, g); when B * Hk is small the blocks are
 * split into chunks that accumulate into their own buffers, added in chunk order at the end.
 * The chunk count depends on the sizes only: results do not depend on the thread count. BLAS
 * runs single-threaded inside the OpenMP region.
 *
 * The index score: one OpenMP iteration per (b, block of IDX_QB queries). The visible key range
 * of the block (the hull of its rows' first..last unmasked key) is cut into tiles of IDX_KT
 * keys; each tile is one sgemm (IDX_QB*Hi, Di) x (Di, IDX_KT) followed by relu and the
 * head-weighted sum; masked keys get the mask value without being read from the tile. The
 * optional top-k runs on the finished row (lunar_cpu_topk_set: a radix select, the set in
 * increasing key order).
 */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu.h"
#include "vecmath.h"

#define IS_MASKED(m) ((m) <= -FLT_MAX)

/* ---- attention ------------------------------------------------------------------------------ */

#define QB 64      /* query rows per block at most; blocks never cross a multiple of QB */
#define WASTE 6    /* a key-list block computes at most this many times its listed pairs */

typedef struct att_args {
    const float *q, *k, *v, *mask, *dout, *o;
    const int64_t *keys;
    float *out, *lse, *dq, *dk, *dv;
    int64_t B, S, T, NH, Hk, Dq, Dv, K;
    float scale;
    /* key lists (keys != NULL): row r's attendable keys li[r*L ..] ascending, their mask values
     * lm[r*L ..], their number ln[r] (0 = uniform over all T keys) */
    int32_t *li, *ln;
    float *lm;
    int64_t L;
} att_args;

typedef struct att_work {    /* one thread's scratch */
    int32_t  *U;             /* (T) gathered key columns */
    int32_t  *pos;           /* (T) column of a key in U (valid for the keys of U) */
    uint32_t *mark;          /* (T) union stamps */
    uint32_t  stamp;
    float    *kb, *vb;       /* (T, Dq), (T, Dv) gathered keys and values of one key head */
    float    *dkb, *dvb;     /* (T, Dq), (T, Dv) their gradients (backward, gathered blocks) */
    float    *x, *p;         /* (QB, T) scores / dP / dS and probabilities */
    float    *xs;            /* (T) one row's listed scores */
    int64_t  *idx;           /* (T) row_keys output */
    float    *madd;          /* (T) */
    uint8_t  *seen;          /* (T) zero between uses */
} att_work;

static size_t work_bytes(int64_t T, int64_t Dq, int64_t Dv) {
    size_t t = (size_t)T;
    return t * (4 + 4 + 4) + 2 * t * (size_t)(Dq + Dv) * 4 + 2 * (size_t)QB * t * 4 + t * 4 + t * (8 + 4 + 1) + 64 * 12;
}

static char *align64(char *p) { return (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

static void work_at(att_work *w, char *base, int64_t T, int64_t Dq, int64_t Dv) {
    char *p = align64(base);
    w->U = (int32_t *)p, p = align64(p + T * 4);
    w->pos = (int32_t *)p, p = align64(p + T * 4);
    w->mark = (uint32_t *)p, p = align64(p + T * 4);
    w->kb = (float *)p, p = align64(p + T * Dq * 4);
    w->vb = (float *)p, p = align64(p + T * Dv * 4);
    w->dkb = (float *)p, p = align64(p + T * Dq * 4);
    w->dvb = (float *)p, p = align64(p + T * Dv * 4);
    w->x = (float *)p, p = align64(p + QB * T * 4);
    w->p = (float *)p, p = align64(p + QB * T * 4);
    w->xs = (float *)p, p = align64(p + T * 4);
    w->idx = (int64_t *)p, p = align64(p + T * 8);
    w->madd = (float *)p, p = align64(p + T * 4);
    w->seen = (uint8_t *)p;
    w->stamp = 0;
}

/* The attendable keys of query (b, s), ascending, in w->idx / w->madd; returns their number
 * (0: none, the row is uniform over all T keys). A listed key counts once. */
static int64_t row_keys(const att_args *a, att_work *w, int64_t b, int64_t s) {
    int64_t T = a->T, n = 0;
    const float *mrow = a->mask ? a->mask + (b * a->S + s) * T : NULL;
    int64_t *idx = w->idx;
    float *madd = w->madd;
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
    for (int64_t t = lo; t <= hi; t++) {   /* branch-free: written always, counted if kept */
        float m = mrow ? mrow[t] : 0.0f;
        idx[n] = t;
        madd[n] = m;
        n += seen[t] & !IS_MASKED(m);
        seen[t] = 0;
    }
    return n;
}

/* the first and one past the last attendable key of row (b, s); [0, T) for a uniform row */
static void row_hull(const att_args *a, int64_t b, int64_t s, int64_t *lo, int64_t *hi) {
    int64_t T = a->T, r = b * a->S + s;
    if (a->keys) {
        int64_t n = a->ln[r];
        if (n == 0) *lo = 0, *hi = T;
        else *lo = a->li[r * a->L], *hi = a->li[r * a->L + n - 1] + 1;
        return;
    }
    if (!a->mask) {
        *lo = 0, *hi = T;
        return;
    }
    const float *m = a->mask + r * T;
    int64_t l = 0, h = T;
    while (l < T && IS_MASKED(m[l])) l++;
    while (h > l && IS_MASKED(m[h - 1])) h--;
    if (l == h) l = 0, h = T;
    *lo = l, *hi = h;
}

typedef struct att_block {
    int64_t b, s0, q;    /* query rows s0 .. s0+q-1 of batch row b */
    int64_t lo, hi;      /* hull of their attendable keys */
    int64_t u;           /* key columns: hi - lo, or the gathered union's size */
    int     gathered;    /* columns are w->U[0..u) (keys and values copied to kb, vb) */
} att_block;

/* Plans the block that starts at row s0 (at most rem rows): its size, hull and columns. */
static void plan_block(const att_args *a, att_work *w, att_block *blk, int64_t b, int64_t s0, int64_t rem) {
    int64_t T = a->T, q = rem, cnt = 0;
    int uni = 0;
    if (a->keys) {
        for (;;) {
            if (++w->stamp == 0) {
                memset(w->mark, 0, (size_t)T * 4);
                w->stamp = 1;
            }
            int64_t pairs = 0;
            cnt = 0, uni = 0;
            for (int64_t s = s0; s < s0 + q; s++) {
                int64_t r = b * a->S + s, n = a->ln[r];
                const int32_t *l = a->li + r * a->L;
                if (n == 0) uni = 1, pairs += T;
                pairs += n;
                for (int64_t j = 0; j < n; j++) {
                    cnt += w->mark[l[j]] != w->stamp;
                    w->mark[l[j]] = w->stamp;
                }
            }
            int64_t u = uni ? T : cnt;
            if (q == 1 || q * u <= WASTE * pairs) break;
            q = (q + 1) / 2;
        }
    }
    int64_t lo = T, hi = 0;
    for (int64_t s = s0; s < s0 + q; s++) {
        int64_t l, h;
        row_hull(a, b, s, &l, &h);
        lo = l < lo ? l : lo;
        hi = h > hi ? h : hi;
    }
    blk->b = b, blk->s0 = s0, blk->q = q, blk->lo = lo, blk->hi = hi;
    blk->gathered = a->keys && !uni && 2 * cnt < hi - lo;
    blk->u = hi - lo;
    if (blk->gathered) {
        int64_t c = 0;
        for (int64_t t = lo; t < hi; t++) {
            if (w->mark[t] != w->stamp) continue;
            w->U[c] = (int32_t)t;
            w->pos[t] = (int32_t)c++;
        }
        blk->u = c;
    }
}

/* kb, vb = the keys and values of key head g at the gathered columns */
static void gather_kv(const att_args *a, att_work *w, const att_block *blk, int64_t g) {
    int64_t T = a->T, Hk = a->Hk, Dq = a->Dq, Dv = a->Dv, b = blk->b;
    for (int64_t c = 0; c < blk->u; c++) {
        int64_t t = w->U[c];
        memcpy(w->kb + c * Dq, a->k + ((b * T + t) * Hk + g) * Dq, (size_t)Dq * 4);
        memcpy(w->vb + c * Dv, a->v + ((b * T + t) * Hk + g) * Dv, (size_t)Dv * 4);
    }
}

/* where the block's key (value) rows of head g start, and their row stride */
static const float *kcols(const att_args *a, const att_work *w, const att_block *blk, int64_t g, int64_t *ld) {
    if (blk->gathered) return *ld = a->Dq, w->kb;
    *ld = a->Hk * a->Dq;
    return a->k + ((blk->b * a->T + blk->lo) * a->Hk + g) * a->Dq;
}
static const float *vcols(const att_args *a, const att_work *w, const att_block *blk, int64_t g, int64_t *ld) {
    if (blk->gathered) return *ld = a->Dv, w->vb;
    *ld = a->Hk * a->Dv;
    return a->v + ((blk->b * a->T + blk->lo) * a->Hk + g) * a->Dv;
}

/* p[0..n) = softmax of x[0..n) (n > 0), sum in f64 lanes; returns lse, gives max and 1/sum */
LUNAR_CPU_VECTOR static float softmax_list(float *p, const float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
    for (int64_t j = 0; j < n; j++) p[j] = lunar_expf_upto88(x[j] - m);
    double acc[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += p[j + l];
    for (; j < n; j++) acc[0] += p[j];
    double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    float inv = (float)(1.0 / sum);
    for (j = 0; j < n; j++) p[j] *= inv;
    return m + (float)log(sum);
}

/* Row i of the block: P (ld u) from the scores X (ld u, already scaled): the softmax over the
 * row's attendable columns (+ their mask values), 0 elsewhere; uniform 1/T for a row with none.
 * Returns the row's lse. */
LUNAR_CPU_VECTOR static float probs_row(const att_args *a, att_work *w, const att_block *blk, int64_t i, float *P,
                                        const float *X) {
    int64_t T = a->T, u = blk->u, r = blk->b * a->S + blk->s0 + i;
    float *pr = P + i * u;
    const float *xr = X + i * u;
    if (a->keys) {
        int64_t n = a->ln[r];
        if (n == 0) {
            float uni = 1.0f / (float)T;
            for (int64_t c = 0; c < u; c++) pr[c] = uni;
            return -FLT_MAX;
        }
        const int32_t *l = a->li + r * a->L;
        const float *lm = a->lm + r * a->L;
        float *xs = w->xs;
        if (blk->gathered)
            for (int64_t j = 0; j < n; j++) xs[j] = xr[w->pos[l[j]]] + lm[j];
        else
            for (int64_t j = 0; j < n; j++) xs[j] = xr[l[j] - blk->lo] + lm[j];
        for (int64_t c = 0; c < u; c++) pr[c] = 0.0f;
        float lse = softmax_list(xs, xs, n);
        if (blk->gathered)
            for (int64_t j = 0; j < n; j++) pr[w->pos[l[j]]] = xs[j];
        else
            for (int64_t j = 0; j < n; j++) pr[l[j] - blk->lo] = xs[j];
        return lse;
    }
    /* mask (or nothing) decides: columns are keys lo .. hi-1 */
    const float *mr = a->mask ? a->mask + r * T + blk->lo : NULL;
    float m = -INFINITY;
    for (int64_t c = 0; c < u; c++) {
        float mv = mr ? mr[c] : 0.0f;
        float xv = xr[c] + mv;
        xv = IS_MASKED(mv) ? -INFINITY : xv;
        pr[c] = xv;
        m = xv > m ? xv : m;
    }
    if (m == -INFINITY) {   /* no visible key: uniform over all T keys (then u == T) */
        float uni = 1.0f / (float)T;
        for (int64_t c = 0; c < u; c++) pr[c] = uni;
        return -FLT_MAX;
    }
    for (int64_t c = 0; c < u; c++) pr[c] = lunar_expf_upto88(pr[c] - m);   /* -inf -> 0 */
    double acc[8] = {0};
    int64_t c = 0;
    for (; c + 8 <= u; c += 8)
        for (int l = 0; l < 8; l++) acc[l] += pr[c + l];
    for (; c < u; c++) acc[0] += pr[c];
    double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    float inv = (float)(1.0 / sum);
    for (c = 0; c < u; c++) pr[c] *= inv;
    return m + (float)log(sum);
}

/* X (q, u) = scale * Q_h K_cols^T for the block's rows */
static void block_scores(const att_args *a, const att_work *w, const att_block *blk, int64_t h, float *X) {
    int64_t ldk, g = h / (a->NH / a->Hk);
    const float *kc = kcols(a, w, blk, g, &ldk);
    const float *qh = a->q + ((blk->b * a->S + blk->s0) * a->NH + h) * a->Dq;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)blk->q, (int)blk->u, (int)a->Dq, a->scale, qh,
                (int)(a->NH * a->Dq), kc, (int)ldk, 0.0f, X, (int)blk->u);
}

static void forward_block(const att_args *a, att_work *w, const att_block *blk) {
    int64_t NH = a->NH, Hk = a->Hk, G = NH / Hk, Dv = a->Dv, S = a->S;
    for (int64_t g = 0; g < Hk; g++) {
        if (blk->gathered) gather_kv(a, w, blk, g);
        int64_t ldv;
        const float *vc = vcols(a, w, blk, g, &ldv);
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            block_scores(a, w, blk, h, w->x);
            for (int64_t i = 0; i < blk->q; i++)
                a->lse[(blk->b * NH + h) * S + blk->s0 + i] = probs_row(a, w, blk, i, w->p, w->x);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)blk->q, (int)Dv, (int)blk->u, 1.0f, w->p,
                        (int)blk->u, vc, (int)ldv, 0.0f, a->out + ((blk->b * S + blk->s0) * NH + h) * Dv,
                        (int)(NH * Dv));
        }
    }
}

/* Key lists of every row (keys != NULL), in parallel. */
static void build_lists(const att_args *a, char *sb, size_t wb, int nt, int par) {
    int64_t rows = a->B * a->S;
#pragma omp parallel num_threads(nt) if (par && rows > 1)
    {
        att_work w;
        work_at(&w, sb + wb * (size_t)omp_get_thread_num(), a->T, a->Dq, a->Dv);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t n = row_keys(a, &w, r / a->S, r % a->S);
            a->ln[r] = (int32_t)n;
            for (int64_t j = 0; j < n; j++) {
                a->li[r * a->L + j] = (int32_t)w.idx[j];
                a->lm[r * a->L + j] = w.madd[j];
            }
        }
    }
}

/* scratch: per-thread work, then the key lists; returns the work stride */
static lunar_status att_setup(lunar_ctx *ctx, att_args *a, lunar_tensor *scratch, int nt, size_t *wb_out,
                              int64_t extra_bytes, char **extra) {
    size_t wb = (work_bytes(a->T, a->Dq, a->Dv) + 63) & ~(size_t)63;
    int64_t rows = a->B * a->S;
    a->L = a->keys ? (a->K < a->T ? a->K : a->T) : 0;
    size_t lists = a->keys ? (size_t)(rows * a->L) * 8 + (size_t)rows * 4 + 64 : 0;
    int64_t nbytes = (int64_t)(wb * (size_t)nt + lists) + extra_bytes + 64;
    LUNAR_TRY(lunar_tensor_new(ctx, scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    char *sb = lunar_tensor_data(scratch);
    for (int i = 0; i < nt; i++) {   /* the seen flags start at zero */
        att_work w;
        work_at(&w, sb + wb * (size_t)i, a->T, a->Dq, a->Dv);
        memset(w.seen, 0, (size_t)a->T);
        memset(w.mark, 0, (size_t)a->T * 4);
    }
    char *p = sb + wb * (size_t)nt;
    if (a->keys) {
        a->li = (int32_t *)p;
        a->lm = (float *)(p + (size_t)(rows * a->L) * 4);
        a->ln = (int32_t *)(p + (size_t)(rows * a->L) * 8);
        p += lists;
    }
    *extra = align64(p);
    *wb_out = wb;
    return LUNAR_OK;
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
    if (a.B * a.S == 0) return LUNAR_OK;
    int nt = lunar_ctx_threads(ctx);
    if (openblas_get_num_threads() != nt) openblas_set_num_threads(nt);
    lunar_tensor scratch = {0};
    size_t wb;
    char *extra;
    LUNAR_TRY(att_setup(ctx, &a, &scratch, nt, &wb, 0, &extra));
    char *sb = lunar_tensor_data(&scratch);
    int64_t nblk = (a.S + QB - 1) / QB, units = a.B * nblk;
    int par = a.B * a.S * a.NH * (a.keys ? a.L : a.T) * (a.Dq + a.Dv) >= LUNAR_CPU_PAR_MIN;
    if (a.keys) build_lists(&a, sb, wb, nt, par);
#pragma omp parallel num_threads(nt) if (par && units > 1)
    {
        att_work w;
        work_at(&w, sb + wb * (size_t)omp_get_thread_num(), a.T, a.Dq, a.Dv);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            /* later blocks see more keys: hand them out first */
            int64_t rev = units - 1 - un, b = rev % a.B, s = (rev / a.B) * QB, end = s + QB < a.S ? s + QB : a.S;
            while (s < end) {
                att_block blk;
                plan_block(&a, &w, &blk, b, s, end - s);
                forward_block(&a, &w, &blk);
                s += blk.q;
            }
        }
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}

LUNAR_CPU_VECTOR static void ds_row(float *ds, const float *p, const float *dp, int64_t u, float D) {
    for (int64_t c = 0; c < u; c++) ds[c] = p[c] * (dp[c] - D);
}

/* dk/dv of key head g for the block, added into dkt/dvt ((T, Hk, D) rows of batch row b) */
static void backward_block(const att_args *a, att_work *w, const att_block *blk, int64_t g, float *dkt, float *dvt) {
    int64_t NH = a->NH, Hk = a->Hk, G = NH / Hk, Dq = a->Dq, Dv = a->Dv, S = a->S, u = blk->u, qn = blk->q;
    if (blk->gathered) {
        gather_kv(a, w, blk, g);
        memset(w->dkb, 0, (size_t)(u * Dq) * 4);
        memset(w->dvb, 0, (size_t)(u * Dv) * 4);
    }
    int64_t ldk, ldv;
    const float *kc = kcols(a, w, blk, g, &ldk), *vc = vcols(a, w, blk, g, &ldv);
    float *dkc = blk->gathered ? w->dkb : dkt + (blk->lo * Hk + g) * Dq;
    float *dvc = blk->gathered ? w->dvb : dvt + (blk->lo * Hk + g) * Dv;
    int64_t lddk = blk->gathered ? Dq : Hk * Dq, lddv = blk->gathered ? Dv : Hk * Dv;
    for (int64_t h = g * G; h < (g + 1) * G; h++) {
        int64_t row0 = (blk->b * S + blk->s0) * NH + h;
        const float *qh = a->q + row0 * Dq, *doh = a->dout + row0 * Dv, *oh = a->o + row0 * Dv;
        block_scores(a, w, blk, h, w->x);
        for (int64_t i = 0; i < qn; i++) probs_row(a, w, blk, i, w->p, w->x);
        /* dP = dO V^T into x, then dS = P (dP - D) in place */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)qn, (int)u, (int)Dv, 1.0f, doh, (int)(NH * Dv), vc,
                    (int)ldv, 0.0f, w->x, (int)u);
        for (int64_t i = 0; i < qn; i++) {
            double dd = 0.0;
            const float *dr = doh + i * NH * Dv, *orow = oh + i * NH * Dv;
            for (int64_t d = 0; d < Dv; d++) dd += (double)dr[d] * orow[d];
            ds_row(w->x + i * u, w->p + i * u, w->x + i * u, u, (float)dd);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)qn, (int)Dq, (int)u, a->scale, w->x, (int)u, kc,
                    (int)ldk, 0.0f, a->dq + row0 * Dq, (int)(NH * Dq));
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)u, (int)Dq, (int)qn, a->scale, w->x, (int)u, qh,
                    (int)(NH * Dq), 1.0f, dkc, (int)lddk);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)u, (int)Dv, (int)qn, 1.0f, w->p, (int)u, doh,
                    (int)(NH * Dv), 1.0f, dvc, (int)lddv);
    }
    if (blk->gathered)
        for (int64_t c = 0; c < u; c++) {
            float *dr = dkt + ((int64_t)w->U[c] * Hk + g) * Dq, *vr = dvt + ((int64_t)w->U[c] * Hk + g) * Dv;
            const float *sk = w->dkb + c * Dq, *sv = w->dvb + c * Dv;
            for (int64_t d = 0; d < Dq; d++) dr[d] += sk[d];
            for (int64_t d = 0; d < Dv; d++) vr[d] += sv[d];
        }
}

LUNAR_CPU_VECTOR static void add_rows(float *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] += src[i];
}

lunar_status lunar_cpu_attention_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                          const lunar_tensor *dout, const lunar_tensor *o, const lunar_tensor *lse,
                                          const lunar_tensor *q, const lunar_tensor *k, const lunar_tensor *v,
                                          const lunar_tensor *keys, const lunar_tensor *mask, float scale) {
    (void)lse;   /* P is recomputed exactly as the forward computed it */
    att_args a = {
        .q = lunar_tensor_data(q), .k = lunar_tensor_data(k), .v = lunar_tensor_data(v),
        .mask = mask ? lunar_tensor_data(mask) : NULL, .keys = keys ? lunar_tensor_data(keys) : NULL,
        .dout = lunar_tensor_data(dout), .o = lunar_tensor_data(o),
        .dq = lunar_tensor_data(dq), .dk = lunar_tensor_data(dk), .dv = lunar_tensor_data(dv),
        .B = q->shape[0], .S = q->shape[1], .T = k->shape[1], .NH = q->shape[2], .Hk = k->shape[2],
        .Dq = q->shape[3], .Dv = v->shape[3], .K = keys ? keys->shape[2] : 0, .scale = scale,
    };
    int64_t B = a.B, S = a.S, T = a.T, Hk = a.Hk, Dq = a.Dq, Dv = a.Dv;
    int64_t nk = T * Hk * Dq, nv = T * Hk * Dv;   /* one batch row of dk, dv */
    if (B * S == 0) {
        memset(a.dk, 0, (size_t)(B * nk) * 4);
        memset(a.dv, 0, (size_t)(B * nv) * 4);
        return LUNAR_OK;
    }
    int nt = lunar_ctx_threads(ctx);
    if (openblas_get_num_threads() != nt) openblas_set_num_threads(nt);
    /* chunks of blocks per (b, g): B * Hk * nc >= 8 units, a function of the sizes only */
    int64_t nblk = (S + QB - 1) / QB;
    int64_t nc = (8 + B * Hk - 1) / (B * Hk);
    if (nc > nblk) nc = nblk;
    if (nc < 1) nc = 1;
    int64_t units = B * Hk * nc;
    lunar_tensor scratch = {0};
    size_t wb;
    char *extra;
    LUNAR_TRY(att_setup(ctx, &a, &scratch, nt, &wb, (nc - 1) * B * (nk + nv) * 4, &extra));
    char *sb = lunar_tensor_data(&scratch);
    float *part = (float *)extra;   /* (nc-1, B, [dk rows | dv rows]) */
    int par = B * S * a.NH * (a.keys ? a.L : T) * (Dq + Dv) >= LUNAR_CPU_PAR_MIN;
    if (a.keys) build_lists(&a, sb, wb, nt, par);
#pragma omp parallel num_threads(nt) if (par && units > 1)
    {
        att_work w;
        work_at(&w, sb + wb * (size_t)omp_get_thread_num(), T, Dq, Dv);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            int64_t c = un % nc, g = (un / nc) % Hk, b = un / (nc * Hk);
            float *dkt = c == 0 ? a.dk + b * nk : part + ((c - 1) * B + b) * (nk + nv);
            float *dvt = c == 0 ? a.dv + b * nv : dkt + nk;
            for (int64_t t = 0; t < T; t++) {
                memset(dkt + (t * Hk + g) * Dq, 0, (size_t)Dq * 4);
                memset(dvt + (t * Hk + g) * Dv, 0, (size_t)Dv * 4);
            }
            /* chunk c: blocks [nblk * c / nc, nblk * (c + 1) / nc) */
            int64_t s = (nblk * c / nc) * QB, send = (nblk * (c + 1) / nc) * QB;
            if (send > S) send = S;
            while (s < send) {
                int64_t end = (s / QB + 1) * QB < send ? (s / QB + 1) * QB : send;
                att_block blk;
                plan_block(&a, &w, &blk, b, s, end - s);
                backward_block(&a, &w, &blk, g, dkt, dvt);
                s += blk.q;
            }
        }
        if (nc > 1) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < B * T; r++) {
                int64_t b = r / T, t = r % T;
                for (int64_t c = 1; c < nc; c++) {
                    const float *pb = part + ((c - 1) * B + b) * (nk + nv);
                    add_rows(a.dk + b * nk + t * Hk * Dq, pb + t * Hk * Dq, Hk * Dq);
                    add_rows(a.dv + b * nv + t * Hk * Dv, pb + nk + t * Hk * Dv, Hk * Dv);
                }
            }
        }
    }
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
    size_t wb = (size_t)(IDX_QB * Hi * IDX_KT + IDX_KT + (sp ? 0 : IDX_QB * T)) * sizeof(float) + (size_t)(2 * T) * 4 + 64;
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
        uint32_t *keyscratch = (uint32_t *)(((uintptr_t)(rows + (sp ? 0 : IDX_QB * T)) + 63) & ~(uintptr_t)63);
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
                    lunar_cpu_topk_set(tp + (b * S + s) * K, sp ? sp + (b * S + s) * T : rows + (s - s0) * T, T, K,
                                       keyscratch);
        }
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}
