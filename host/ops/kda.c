/* kda.c: KDA's gated delta rule and its short causal convolution (ops.h): validation, then
 * the backend. Every float tensor goes to the backend in f32 (KDA's math is f32 whatever the
 * model's dtype), seg as i64. On the CPU the segment offsets are checked here (rising from 0 to
 * the number of rows).
 */
#include <stdint.h>
#include <stdio.h>

#include "prep.h"

/* a valid float tensor of shape (a, b[, c[, d]]) */
static lunar_status fshape(lunar_prep *p, const lunar_tensor *t, const char *role, int ndim, int64_t a, int64_t b,
                           int64_t c, int64_t d) {
    if (p->st) return p->st;
    if (prep_check(p, t, role) || prep_expect_float(p, t, role)) return p->st;
    int64_t sh[4] = {a, b, c, d};
    return prep_expect_shape(p, t, role, ndim, sh);
}

/* seg: (nseg + 1) index vector; *nseg from its length */
static lunar_status check_seg(lunar_prep *p, const lunar_tensor *seg, int64_t *nseg) {
    if (p->st) return p->st;
    if (prep_check(p, seg, "seg") || prep_expect_index(p, seg, "seg")) return p->st;
    if (seg->ndim != 1 || seg->shape[0] < 1) {
        char sh[128];
        lunar_tensor_shape_str(seg, sh, sizeof sh);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE,
                                  "%s: seg '%s' has shape %s, expected a vector of segment offsets (nseg + 1)", p->op,
                                  lunar_tensor_label(seg), sh);
    }
    *nseg = seg->shape[0] - 1;
    return LUNAR_OK;
}

/* CPU: the prepared offsets rise from 0 to N */
static lunar_status check_seg_values(lunar_prep *p, const lunar_tensor *sw, const lunar_tensor *seg, int64_t N) {
    if (p->st || p->dev.type != LUNAR_DEVICE_CPU) return p->st;
    const int64_t *v = lunar_tensor_data(sw);
    int64_t n = sw->shape[0];
    if (v[0] != 0 || v[n - 1] != N)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: seg '%s' runs from %lld to %lld, expected 0 to N = %lld",
                                  p->op, lunar_tensor_label(seg), (long long)v[0], (long long)v[n - 1], (long long)N);
    for (int64_t i = 1; i < n; i++)
        if (v[i] < v[i - 1])
            return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: seg '%s' falls at position %lld (%lld after %lld)",
                                      p->op, lunar_tensor_label(seg), (long long)i, (long long)v[i],
                                      (long long)v[i - 1]);
    return LUNAR_OK;
}

typedef struct kda_dims {
    int64_t N, H, Dk, Dv, nseg;
} kda_dims;

static lunar_status check_kda(lunar_prep *p, kda_dims *d, const lunar_tensor *q, const lunar_tensor *k,
                              const lunar_tensor *v, const lunar_tensor *g, const lunar_tensor *beta,
                              const lunar_tensor *seg, const lunar_tensor *state0) {
    if (prep_check(p, q, "q") || prep_expect_float(p, q, "q")) return p->st;
    if (q->ndim != 3) {
        char sh[128];
        lunar_tensor_shape_str(q, sh, sizeof sh);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: q '%s' has shape %s, expected 3 dims (N, H, Dk)", p->op,
                                  lunar_tensor_label(q), sh);
    }
    d->N = q->shape[0], d->H = q->shape[1], d->Dk = q->shape[2];
    if (prep_check(p, v, "v") || prep_expect_float(p, v, "v")) return p->st;
    d->Dv = v->ndim == 3 ? v->shape[2] : -1;
    fshape(p, k, "k", 3, d->N, d->H, d->Dk, 0);
    fshape(p, v, "v", 3, d->N, d->H, d->Dv < 1 ? 1 : d->Dv, 0);
    fshape(p, g, "g", 3, d->N, d->H, d->Dk, 0);
    fshape(p, beta, "beta", 2, d->N, d->H, 0, 0);
    check_seg(p, seg, &d->nseg);
    if (state0) fshape(p, state0, "state0", 4, d->nseg, d->H, d->Dk, d->Dv);
    if (!p->st && (d->Dk < 1 || d->Dv < 1))
        p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: head dims Dk = %lld, Dv = %lld must be >= 1", p->op,
                           (long long)d->Dk, (long long)d->Dv);
    return p->st;
}

lunar_status lunar_kda_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                               const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                               const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "kda_forward", q));
    if (!p.be->kda_forward) return prep_end(&p, prep_unsupported(&p));
    kda_dims d;
    if (check_kda(&p, &d, q, k, v, g, beta, seg, state0)) return prep_end(&p, p.st);
    fshape(&p, o, "o", 3, d.N, d.H, d.Dv, 0);
    if (state) fshape(&p, state, "state", 4, d.nseg, d.H, d.Dk, d.Dv);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor qw, kw, vw, gw, bw, sw, s0w, ow, stw;
    prep_in(&p, &qw, q, "q", F);
    prep_in(&p, &kw, k, "k", F);
    prep_in(&p, &vw, v, "v", F);
    prep_in(&p, &gw, g, "g", F);
    prep_in(&p, &bw, beta, "beta", F);
    prep_in(&p, &sw, seg, "seg", LUNAR_DTYPE_I64);
    if (state0) prep_in(&p, &s0w, state0, "state0", F);
    check_seg_values(&p, &sw, seg, d.N);
    prep_out(&p, &ow, o, "o", F, 0);
    if (state) prep_out(&p, &stw, state, "state", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->kda_forward(ctx, &ow, state ? &stw : NULL, &qw, &kw, &vw, &gw, &bw, &sw,
                                          state0 ? &s0w : NULL));
}

lunar_status lunar_kda_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv, lunar_tensor *dg,
                                lunar_tensor *dbeta, lunar_tensor *dstate0, const lunar_tensor *dout,
                                const lunar_tensor *dstate, const lunar_tensor *q, const lunar_tensor *k,
                                const lunar_tensor *v, const lunar_tensor *g, const lunar_tensor *beta,
                                const lunar_tensor *seg, const lunar_tensor *state0) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "kda_backward", q));
    if (!p.be->kda_backward) return prep_end(&p, prep_unsupported(&p));
    kda_dims d;
    if (check_kda(&p, &d, q, k, v, g, beta, seg, state0)) return prep_end(&p, p.st);
    fshape(&p, dout, "dout", 3, d.N, d.H, d.Dv, 0);
    if (dstate) fshape(&p, dstate, "dstate", 4, d.nseg, d.H, d.Dk, d.Dv);
    fshape(&p, dq, "dq", 3, d.N, d.H, d.Dk, 0);
    fshape(&p, dk, "dk", 3, d.N, d.H, d.Dk, 0);
    fshape(&p, dv, "dv", 3, d.N, d.H, d.Dv, 0);
    fshape(&p, dg, "dg", 3, d.N, d.H, d.Dk, 0);
    fshape(&p, dbeta, "dbeta", 2, d.N, d.H, 0, 0);
    if (dstate0) fshape(&p, dstate0, "dstate0", 4, d.nseg, d.H, d.Dk, d.Dv);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor qw, kw, vw, gw, bw, sw, s0w, dow, dsw, dqw, dkw, dvw, dgw, dbw, ds0w;
    prep_in(&p, &qw, q, "q", F);
    prep_in(&p, &kw, k, "k", F);
    prep_in(&p, &vw, v, "v", F);
    prep_in(&p, &gw, g, "g", F);
    prep_in(&p, &bw, beta, "beta", F);
    prep_in(&p, &sw, seg, "seg", LUNAR_DTYPE_I64);
    if (state0) prep_in(&p, &s0w, state0, "state0", F);
    prep_in(&p, &dow, dout, "dout", F);
    if (dstate) prep_in(&p, &dsw, dstate, "dstate", F);
    check_seg_values(&p, &sw, seg, d.N);
    prep_out(&p, &dqw, dq, "dq", F, 0);
    prep_out(&p, &dkw, dk, "dk", F, 0);
    prep_out(&p, &dvw, dv, "dv", F, 0);
    prep_out(&p, &dgw, dg, "dg", F, 0);
    prep_out(&p, &dbw, dbeta, "dbeta", F, 0);
    if (dstate0) prep_out(&p, &ds0w, dstate0, "dstate0", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->kda_backward(ctx, &dqw, &dkw, &dvw, &dgw, &dbw, dstate0 ? &ds0w : NULL, &dow,
                                           dstate ? &dsw : NULL, &qw, &kw, &vw, &gw, &bw, &sw, state0 ? &s0w : NULL));
}

/* x (N, C), w (C, K), seg, hist (nseg, K - 1, C) or NULL */
static lunar_status check_conv(lunar_prep *p, const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *seg,
                               const lunar_tensor *hist, int64_t *N, int64_t *C, int64_t *K, int64_t *nseg) {
    if (prep_check(p, x, "x") || prep_expect_float(p, x, "x")) return p->st;
    if (prep_check(p, w, "w") || prep_expect_float(p, w, "w")) return p->st;
    if (x->ndim != 2 || w->ndim != 2 || w->shape[0] != x->shape[1] || w->shape[1] < 1) {
        char a[128], b[128];
        lunar_tensor_shape_str(x, a, sizeof a);
        lunar_tensor_shape_str(w, b, sizeof b);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE,
                                  "%s: x '%s' %s and w '%s' %s do not fit: expected x (N, C) and w (C, K >= 1)", p->op,
                                  lunar_tensor_label(x), a, lunar_tensor_label(w), b);
    }
    *N = x->shape[0], *C = x->shape[1], *K = w->shape[1];
    check_seg(p, seg, nseg);
    if (hist && *K > 1) fshape(p, hist, "hist", 3, *nseg, *K - 1, *C, 0);
    return p->st;
}

lunar_status lunar_conv1d_causal_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *w,
                                         const lunar_tensor *seg, const lunar_tensor *hist) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "conv1d_causal_forward", x));
    if (!p.be->conv1d_causal_forward) return prep_end(&p, prep_unsupported(&p));
    int64_t N, C, K, nseg;
    if (check_conv(&p, x, w, seg, hist, &N, &C, &K, &nseg)) return prep_end(&p, p.st);
    fshape(&p, y, "y", 2, N, C, 0, 0);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    int use_hist = hist && K > 1;
    lunar_tensor xw, ww, sw, hw, yw;
    prep_in(&p, &xw, x, "x", F);
    prep_in(&p, &ww, w, "w", F);
    prep_in(&p, &sw, seg, "seg", LUNAR_DTYPE_I64);
    if (use_hist) prep_in(&p, &hw, hist, "hist", F);
    check_seg_values(&p, &sw, seg, N);
    prep_out(&p, &yw, y, "y", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->conv1d_causal_forward(ctx, &yw, &xw, &ww, &sw, use_hist ? &hw : NULL));
}

lunar_status lunar_conv1d_causal_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dw, const lunar_tensor *dy,
                                          const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *seg,
                                          const lunar_tensor *hist) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "conv1d_causal_backward", x));
    if (!p.be->conv1d_causal_backward) return prep_end(&p, prep_unsupported(&p));
    int64_t N, C, K, nseg;
    if (check_conv(&p, x, w, seg, hist, &N, &C, &K, &nseg)) return prep_end(&p, p.st);
    fshape(&p, dy, "dy", 2, N, C, 0, 0);
    fshape(&p, dx, "dx", 2, N, C, 0, 0);
    if (dw) fshape(&p, dw, "dw", 2, C, K, 0, 0);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    int use_hist = hist && K > 1;
    lunar_tensor xw, ww, sw, hw, dyw, dxw, dww;
    prep_in(&p, &xw, x, "x", F);
    prep_in(&p, &ww, w, "w", F);
    prep_in(&p, &sw, seg, "seg", LUNAR_DTYPE_I64);
    if (use_hist) prep_in(&p, &hw, hist, "hist", F);
    prep_in(&p, &dyw, dy, "dy", F);
    check_seg_values(&p, &sw, seg, N);
    prep_out(&p, &dxw, dx, "dx", F, 0);
    if (dw) prep_out(&p, &dww, dw, "dw", F, 1);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->conv1d_causal_backward(ctx, &dxw, dw ? &dww : NULL, &dyw, &xw, &ww, &sw,
                                                     use_hist ? &hw : NULL));
}

/* slots (B) i64: distinct rows of a (S, ...) state, checked on the CPU */
static lunar_status check_slots(lunar_prep *p, const lunar_tensor *slots, const lunar_tensor *sw, int64_t B, int64_t S) {
    if (p->st) return p->st;
    if (prep_check(p, slots, "slots") || prep_expect_index(p, slots, "slots")) return p->st;
    if (slots->ndim != 1 || slots->shape[0] != B)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: slots '%s' must be a vector of %lld slots (one per row)",
                                  p->op, lunar_tensor_label(slots), (long long)B);
    if (!sw || p->dev.type != LUNAR_DEVICE_CPU) return LUNAR_OK;
    const int64_t *v = lunar_tensor_data(sw);
    for (int64_t i = 0; i < B; i++) {
        if (v[i] < 0 || v[i] >= S)
            return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: slots '%s'[%lld] = %lld is not a slot of the %lld in the state",
                                      p->op, lunar_tensor_label(slots), (long long)i, (long long)v[i], (long long)S);
        for (int64_t j = 0; j < i; j++)
            if (v[j] == v[i])
                return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: slots '%s' names slot %lld twice (rows %lld and %lld)",
                                          p->op, lunar_tensor_label(slots), (long long)v[i], (long long)j, (long long)i);
    }
    return LUNAR_OK;
}

lunar_status lunar_conv1d_step(lunar_ctx *ctx, lunar_tensor *y, lunar_tensor *hist, const lunar_tensor *x,
                               const lunar_tensor *w, const lunar_tensor *slots) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "conv1d_step", x));
    if (!p.be->conv1d_step) return prep_end(&p, prep_unsupported(&p));
    if (prep_check(&p, x, "x") || prep_expect_float(&p, x, "x") || prep_check(&p, w, "w") ||
        prep_expect_float(&p, w, "w"))
        return prep_end(&p, p.st);
    if (x->ndim != 2 || w->ndim != 2 || w->shape[0] != x->shape[1] || w->shape[1] < 1) {
        char a[128], b[128];
        lunar_tensor_shape_str(x, a, sizeof a);
        lunar_tensor_shape_str(w, b, sizeof b);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                                       "conv1d_step: x '%s' %s and w '%s' %s do not fit: expected x (B, C) and w (C, K >= 1)",
                                       lunar_tensor_label(x), a, lunar_tensor_label(w), b));
    }
    int64_t B = x->shape[0], C = x->shape[1], K = w->shape[1];
    if (K > 1 && (prep_check(&p, hist, "hist") || prep_expect_float(&p, hist, "hist"))) return prep_end(&p, p.st);
    if (K > 1 && (hist->ndim != 3 || hist->shape[1] != K - 1 || hist->shape[2] != C)) {
        char a[128];
        lunar_tensor_shape_str(hist, a, sizeof a);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "conv1d_step: hist '%s' %s, expected (slots, %lld, %lld)",
                                       lunar_tensor_label(hist), a, (long long)(K - 1), (long long)C));
    }
    fshape(&p, y, "y", 2, B, C, 0, 0);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor xw, ww, sw, hw, yw;
    prep_in(&p, &xw, x, "x", F);
    prep_in(&p, &ww, w, "w", F);
    prep_in(&p, &sw, slots, "slots", LUNAR_DTYPE_I64);
    check_slots(&p, slots, &sw, B, K > 1 ? hist->shape[0] : INT64_MAX);
    if (K > 1) prep_out(&p, &hw, hist, "hist", F, 1);
    prep_out(&p, &yw, y, "y", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->conv1d_step(ctx, &yw, K > 1 ? &hw : NULL, &xw, &ww, &sw));
}

lunar_status lunar_kda_step(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                            const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                            const lunar_tensor *beta, const lunar_tensor *slots) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "kda_step", q));
    if (!p.be->kda_step) return prep_end(&p, prep_unsupported(&p));
    if (prep_check(&p, q, "q") || prep_expect_float(&p, q, "q") || prep_check(&p, v, "v") ||
        prep_expect_float(&p, v, "v") || prep_check(&p, state, "state") || prep_expect_float(&p, state, "state"))
        return prep_end(&p, p.st);
    if (q->ndim != 3 || v->ndim != 3 || state->ndim != 4) {
        char a[128], b[128], c[128];
        lunar_tensor_shape_str(q, a, sizeof a);
        lunar_tensor_shape_str(v, b, sizeof b);
        lunar_tensor_shape_str(state, c, sizeof c);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                                       "kda_step: expected q (B, H, Dk), v (B, H, Dv), state (slots, H, Dk, Dv); got q '%s' %s, "
                                       "v '%s' %s, state '%s' %s", lunar_tensor_label(q), a, lunar_tensor_label(v), b,
                                       lunar_tensor_label(state), c));
    }
    int64_t B = q->shape[0], H = q->shape[1], Dk = q->shape[2], Dv = v->shape[2], S = state->shape[0];
    if (Dv > LUNAR_KDA_STEP_MAX_DV)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "kda_step: Dv = %lld is above the %d this op takes",
                                       (long long)Dv, LUNAR_KDA_STEP_MAX_DV));
    fshape(&p, k, "k", 3, B, H, Dk, 0);
    fshape(&p, g, "g", 3, B, H, Dk, 0);
    fshape(&p, v, "v", 3, B, H, Dv, 0);
    fshape(&p, beta, "beta", 2, B, H, 0, 0);
    fshape(&p, state, "state", 4, S, H, Dk, Dv);
    fshape(&p, o, "o", 3, B, H, Dv, 0);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor qw, kw, vw, gw, bw, sw, stw, ow;
    prep_in(&p, &qw, q, "q", F);
    prep_in(&p, &kw, k, "k", F);
    prep_in(&p, &vw, v, "v", F);
    prep_in(&p, &gw, g, "g", F);
    prep_in(&p, &bw, beta, "beta", F);
    prep_in(&p, &sw, slots, "slots", LUNAR_DTYPE_I64);
    check_slots(&p, slots, &sw, B, S);
    prep_out(&p, &stw, state, "state", F, 1);
    prep_out(&p, &ow, o, "o", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->kda_step(ctx, &ow, &stw, &qw, &kw, &vw, &gw, &bw, &sw));
}
