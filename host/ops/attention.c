/* attention.c: fused attention over per-query key sets and the DSA index score (ops.h).
 *
 * Everything is token-major: q (B, S, NH, Dq), k (B, T, Hk, Dq), v (B, T, Hk, Dv),
 * o (B, S, NH, Dv); lse (B, NH, S) f32; keys (B, S, K) or NULL; mask (B, S, T) f32 or NULL.
 * The index score: qi (B, S, Hi, Di), ki (B, T, Di), w (B, S, Hi) f32, scores (B, S, T) f32,
 * topk (B, S, K) i64. Floating tensors are handed to the backend in q's (qi's) compute dtype,
 * lse, mask, w and scores in f32, keys and topk as i64. Key indices are range-checked here for
 * CPU tensors (entries < 0 mean "no key"); CUDA kernels skip entries >= T.
 */
#include <stdio.h>

#include "prep.h"

static lunar_status fail_shape(lunar_prep *p, const lunar_tensor *t, const char *role, const char *want) {
    if (p->st) return p->st;
    char sh[128];
    lunar_tensor_shape_str(t, sh, sizeof sh);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' has shape %s, expected %s", p->op, role,
                              lunar_tensor_label(t), sh, want);
}

/* a valid float tensor of ndim dims */
static lunar_status float_nd(lunar_prep *p, const lunar_tensor *t, const char *role, int ndim, const char *layout) {
    if (prep_check(p, t, role) || prep_expect_float(p, t, role)) return p->st;
    if (t->ndim != ndim) {
        char want[96];
        snprintf(want, sizeof want, "%d dims %s", ndim, layout);
        return fail_shape(p, t, role, want);
    }
    return LUNAR_OK;
}

/* a valid float tensor of the given 3-dim or 4-dim shape */
static lunar_status float_shape(lunar_prep *p, const lunar_tensor *t, const char *role, int ndim, int64_t a,
                                int64_t b, int64_t c, int64_t d) {
    if (p->st) return p->st;
    if (prep_check(p, t, role) || prep_expect_float(p, t, role)) return p->st;
    int64_t sh[4] = {a, b, c, d};
    return prep_expect_shape(p, t, role, ndim, sh);
}

/* keys (B, S, K) index tensor, K >= 1 */
static lunar_status check_keys(lunar_prep *p, const lunar_tensor *keys, int64_t B, int64_t S) {
    if (!keys || p->st) return p->st;
    if (prep_check(p, keys, "keys") || prep_expect_index(p, keys, "keys")) return p->st;
    if (keys->ndim != 3 || keys->shape[0] != B || keys->shape[1] != S || keys->shape[2] < 1) {
        char want[96];
        snprintf(want, sizeof want, "(B, S, K) = (%lld, %lld, K >= 1)", (long long)B, (long long)S);
        return fail_shape(p, keys, "keys", want);
    }
    return LUNAR_OK;
}

/* CPU: every prepared key index must be < T (negative entries are "no key") */
static lunar_status check_keys_range(lunar_prep *p, const lunar_tensor *kw, const lunar_tensor *keys, int64_t T) {
    if (p->st || p->dev.type != LUNAR_DEVICE_CPU) return p->st;
    const int64_t *v = lunar_tensor_data(kw);
    int64_t n = lunar_tensor_numel(kw);
    for (int64_t i = 0; i < n; i++)
        if (v[i] >= T)
            return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG,
                                      "%s: keys '%s' holds %lld (at flat position %lld) but there are only T = %lld keys (valid 0..%lld; < 0 = none)",
                                      p->op, lunar_tensor_label(keys), (long long)v[i], (long long)i, (long long)T,
                                      (long long)T - 1);
    return LUNAR_OK;
}

/* shared validation of the attention operands; gives the sizes */
typedef struct att_dims {
    int64_t B, S, T, NH, Hk, Dq, Dv;
} att_dims;

static lunar_status check_attention(lunar_prep *p, att_dims *d, const lunar_tensor *q, const lunar_tensor *k,
                                    const lunar_tensor *v, const lunar_tensor *keys, const lunar_tensor *mask,
                                    float scale) {
    float_nd(p, q, "q", 4, "(B, S, NH, Dq)");
    float_nd(p, k, "k", 4, "(B, T, Hk, Dq)");
    float_nd(p, v, "v", 4, "(B, T, Hk, Dv)");
    if (p->st) return p->st;
    d->B = q->shape[0], d->S = q->shape[1], d->NH = q->shape[2], d->Dq = q->shape[3];
    d->T = k->shape[1], d->Hk = k->shape[2], d->Dv = v->shape[3];
    /* no heads: nothing to compute, but a backend would launch no block at all (an error on CUDA
     * while the CPU returns), so every backend refuses it here */
    if (d->NH < 1) return fail_shape(p, q, "q", "(B, S, NH, Dq) with NH >= 1 query heads");
    char want[160];
    snprintf(want, sizeof want, "(B, T, Hk, Dq) with B = %lld, Dq = %lld, T >= 1 and Hk dividing NH = %lld",
             (long long)d->B, (long long)d->Dq, (long long)d->NH);
    if (k->shape[0] != d->B || k->shape[3] != d->Dq || d->T < 1 || d->Hk < 1 || d->NH % d->Hk != 0)
        return fail_shape(p, k, "k", want);
    snprintf(want, sizeof want, "(B, T, Hk, Dv) = (%lld, %lld, %lld, Dv >= 1)", (long long)d->B, (long long)d->T,
             (long long)d->Hk);
    if (v->shape[0] != d->B || v->shape[1] != d->T || v->shape[2] != d->Hk || d->Dv < 1)
        return fail_shape(p, v, "v", want);
    if (d->Dq < 1) return fail_shape(p, q, "q", "a head dim Dq >= 1");
    check_keys(p, keys, d->B, d->S);
    if (mask) float_shape(p, mask, "mask", 3, d->B, d->S, d->T, 0);
    if (!p->st && !(scale == scale)) p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: scale is NaN", p->op);
    return p->st;
}

lunar_status lunar_attention_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *lse, const lunar_tensor *q,
                                     const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *keys,
                                     const lunar_tensor *mask, float scale) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "attention_forward", q));
    if (!p.be->attention_forward) return prep_end(&p, prep_unsupported(&p));
    att_dims d = {0};
    check_attention(&p, &d, q, k, v, keys, mask, scale);
    float_shape(&p, o, "o", 4, d.B, d.S, d.NH, d.Dv);
    float_shape(&p, lse, "lse", 3, d.B, d.NH, d.S, 0);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, q->dtype);
    lunar_tensor qw, kw, vw, keysw, mw, ow, lw;
    prep_in(&p, &qw, q, "q", dt);
    prep_in(&p, &kw, k, "k", dt);
    prep_in(&p, &vw, v, "v", dt);
    if (keys) prep_in(&p, &keysw, keys, "keys", LUNAR_DTYPE_I64);
    if (mask) prep_in(&p, &mw, mask, "mask", LUNAR_DTYPE_F32);
    if (keys) check_keys_range(&p, &keysw, keys, d.T);
    prep_out(&p, &ow, o, "o", dt, 0);
    prep_out(&p, &lw, lse, "lse", LUNAR_DTYPE_F32, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->attention_forward(ctx, &ow, &lw, &qw, &kw, &vw, keys ? &keysw : NULL,
                                                 mask ? &mw : NULL, scale));
}

lunar_status lunar_attention_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                      const lunar_tensor *dout, const lunar_tensor *o, const lunar_tensor *lse,
                                      const lunar_tensor *q, const lunar_tensor *k, const lunar_tensor *v,
                                      const lunar_tensor *keys, const lunar_tensor *mask, float scale) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "attention_backward", q));
    if (!p.be->attention_backward) return prep_end(&p, prep_unsupported(&p));
    att_dims d = {0};
    check_attention(&p, &d, q, k, v, keys, mask, scale);
    float_shape(&p, o, "o", 4, d.B, d.S, d.NH, d.Dv);
    float_shape(&p, dout, "dout", 4, d.B, d.S, d.NH, d.Dv);
    float_shape(&p, lse, "lse", 3, d.B, d.NH, d.S, 0);
    float_shape(&p, dq, "dq", 4, d.B, d.S, d.NH, d.Dq);
    float_shape(&p, dk, "dk", 4, d.B, d.T, d.Hk, d.Dq);
    float_shape(&p, dv, "dv", 4, d.B, d.T, d.Hk, d.Dv);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, q->dtype);
    lunar_tensor qw, kw, vw, keysw, mw, dow, ow, lw, dqw, dkw, dvw;
    prep_in(&p, &dow, dout, "dout", dt);
    prep_in(&p, &ow, o, "o", dt);
    prep_in(&p, &lw, lse, "lse", LUNAR_DTYPE_F32);
    prep_in(&p, &qw, q, "q", dt);
    prep_in(&p, &kw, k, "k", dt);
    prep_in(&p, &vw, v, "v", dt);
    if (keys) prep_in(&p, &keysw, keys, "keys", LUNAR_DTYPE_I64);
    if (mask) prep_in(&p, &mw, mask, "mask", LUNAR_DTYPE_F32);
    if (keys) check_keys_range(&p, &keysw, keys, d.T);
    prep_out(&p, &dqw, dq, "dq", dt, 0);
    prep_out(&p, &dkw, dk, "dk", dt, 0);
    prep_out(&p, &dvw, dv, "dv", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->attention_backward(ctx, &dqw, &dkw, &dvw, &dow, &ow, &lw, &qw, &kw, &vw,
                                                  keys ? &keysw : NULL, mask ? &mw : NULL, scale));
}

lunar_status lunar_index_scores(lunar_ctx *ctx, lunar_tensor *scores, lunar_tensor *topk, const lunar_tensor *qi,
                                const lunar_tensor *ki, const lunar_tensor *w, const lunar_tensor *mask, float scale) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "index_scores", qi));
    if (!p.be->index_scores) return prep_end(&p, prep_unsupported(&p));
    float_nd(&p, qi, "qi", 4, "(B, S, Hi, Di)");
    float_nd(&p, ki, "ki", 3, "(B, T, Di)");
    if (p.st) return prep_end(&p, p.st);
    int64_t B = qi->shape[0], S = qi->shape[1], Hi = qi->shape[2], Di = qi->shape[3], T = ki->shape[1];
    char want[128];
    snprintf(want, sizeof want, "(B, T, Di) with B = %lld, Di = %lld, T >= 1", (long long)B, (long long)Di);
    if (ki->shape[0] != B || ki->shape[2] != Di || T < 1) return prep_end(&p, fail_shape(&p, ki, "ki", want));
    float_shape(&p, w, "w", 3, B, S, Hi, 0);
    if (mask) float_shape(&p, mask, "mask", 3, B, S, T, 0);
    if (!scores && !topk && !p.st)
        p.st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "index_scores: scores and topk are both NULL: nothing to compute");
    if (scores) float_shape(&p, scores, "scores", 3, B, S, T, 0);
    if (topk && !p.st && !(prep_check(&p, topk, "topk") || prep_expect_index(&p, topk, "topk"))) {
        if (topk->ndim != 3 || topk->shape[0] != B || topk->shape[1] != S || topk->shape[2] < 1 || topk->shape[2] > T) {
            snprintf(want, sizeof want, "(B, S, K) = (%lld, %lld, K) with 1 <= K <= T = %lld", (long long)B,
                     (long long)S, (long long)T);
            fail_shape(&p, topk, "topk", want);
        }
    }
    if (!p.st && !(scale == scale)) p.st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "index_scores: scale is NaN");
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, qi->dtype);
    lunar_tensor qw, kw, ww, mw, sw, tw;
    prep_in(&p, &qw, qi, "qi", dt);
    prep_in(&p, &kw, ki, "ki", dt);
    prep_in(&p, &ww, w, "w", LUNAR_DTYPE_F32);
    if (mask) prep_in(&p, &mw, mask, "mask", LUNAR_DTYPE_F32);
    if (scores) prep_out(&p, &sw, scores, "scores", LUNAR_DTYPE_F32, 0);
    if (topk) prep_out(&p, &tw, topk, "topk", LUNAR_DTYPE_I64, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->index_scores(ctx, scores ? &sw : NULL, topk ? &tw : NULL, &qw, &kw, &ww,
                                           mask ? &mw : NULL, scale));
}
