/* norm.c: RMSNorm and LayerNorm over the last dim (x seen as (N, C)).
 *
 * The saved statistics (rstd, mean) hold one f32 value per row: any tensor with N elements
 * (the Lua layer gives them x's shape without the last dim). Weights and biases are (C) and
 * optional. Floating tensors of one call are handed to the backend in x's compute dtype, the
 * statistics in f32, except the accumulated parameter gradients dw and db, which keep their own
 * compute dtype (f32 gradients of bf16 activations are not rounded through bf16).
 *
 * RMSNorm is HF's Glm/DeepSeek RMSNorm: variance = mean(x^2) in f32, x * rsqrt(variance + eps),
 * then * w. For 16-bit x, HF rounds x * rstd to x's dtype before the weight; the CUDA kernel
 * does the same, while the CPU backend (f32 only) rounds the output once (at most one ulp of
 * the 16-bit dtype apart). */
#include "prep.h"

/* x must be a float tensor with at least one dim; gives N rows of C channels */
static lunar_status norm_rows(lunar_prep *p, const lunar_tensor *x, const char *role, int64_t *n, int64_t *c) {
    if (prep_check(p, x, role) || prep_expect_float(p, x, role)) return p->st;
    if (x->ndim < 1) {
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' must have at least 1 dim (..., C), got a scalar",
                                  p->op, role, lunar_tensor_label(x));
    }
    *c = x->shape[x->ndim - 1];
    *n = *c > 0 ? lunar_tensor_numel(x) / *c : 0;
    if (*c == 0) {
        int64_t m = 1;
        for (int i = 0; i < x->ndim - 1; i++) m *= x->shape[i];
        *n = m;
    }
    return LUNAR_OK;
}

/* a float tensor with x's shape */
static lunar_status like_x(lunar_prep *p, const lunar_tensor *t, const char *role, const lunar_tensor *x) {
    if (prep_check(p, t, role) || prep_expect_float(p, t, role)) return p->st;
    return prep_expect_shape(p, t, role, x->ndim, x->shape);
}

/* one statistic per row */
static lunar_status per_row(lunar_prep *p, const lunar_tensor *t, const char *role, int64_t n) {
    if (prep_check(p, t, role) || prep_expect_float(p, t, role)) return p->st;
    if (lunar_tensor_numel(t) == n) return LUNAR_OK;
    char a[128];
    lunar_tensor_shape_str(t, a, sizeof a);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' %s must have one element per row (%lld rows)", p->op,
                              role, lunar_tensor_label(t), a, (long long)n);
}

/* an optional (C) parameter */
static lunar_status per_channel(lunar_prep *p, const lunar_tensor *t, const char *role, int64_t c) {
    if (!t) return p->st;
    if (prep_check(p, t, role) || prep_expect_float(p, t, role)) return p->st;
    return prep_expect_shape(p, t, role, 1, &c);
}

lunar_status lunar_rmsnorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *rstd, const lunar_tensor *x,
                                   const lunar_tensor *w, float eps) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "rmsnorm_forward", x));
    p.alias_ok = 1;
    if (!p.be->rmsnorm_forward) return prep_end(&p, prep_unsupported(&p));
    int64_t n = 0, c = 0;
    norm_rows(&p, x, "x", &n, &c);
    like_x(&p, out, "out", x);
    per_row(&p, rstd, "rstd", n);
    per_channel(&p, w, "w", c);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor xw, ww, ow, rw;
    prep_in(&p, &xw, x, "x", dt);
    if (w) prep_in(&p, &ww, w, "w", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    prep_out(&p, &rw, rstd, "rstd", LUNAR_DTYPE_F32, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->rmsnorm_forward(ctx, &ow, &rw, &xw, w ? &ww : NULL, eps));
}

lunar_status lunar_rmsnorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                          const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *rstd) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "rmsnorm_backward_input", x));
    p.alias_ok = 1;
    if (!p.be->rmsnorm_backward_input) return prep_end(&p, prep_unsupported(&p));
    int64_t n = 0, c = 0;
    norm_rows(&p, x, "x", &n, &c);
    like_x(&p, dx, "dx", x);
    like_x(&p, dout, "dout", x);
    per_row(&p, rstd, "rstd", n);
    per_channel(&p, w, "w", c);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor dxw, dow, xw, ww, rw;
    prep_in(&p, &dow, dout, "dout", dt);
    prep_in(&p, &xw, x, "x", dt);
    if (w) prep_in(&p, &ww, w, "w", dt);
    prep_in(&p, &rw, rstd, "rstd", LUNAR_DTYPE_F32);
    prep_out(&p, &dxw, dx, "dx", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->rmsnorm_backward_input(ctx, &dxw, &dow, &xw, w ? &ww : NULL, &rw));
}

lunar_status lunar_rmsnorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, const lunar_tensor *dout,
                                           const lunar_tensor *x, const lunar_tensor *rstd) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "rmsnorm_backward_params", x));
    if (!p.be->rmsnorm_backward_params) return prep_end(&p, prep_unsupported(&p));
    int64_t n = 0, c = 0;
    norm_rows(&p, x, "x", &n, &c);
    like_x(&p, dout, "dout", x);
    per_row(&p, rstd, "rstd", n);
    if (!dw && !p.st) p.st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "rmsnorm_backward_params: dw is missing");
    per_channel(&p, dw, "dw", c);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor dww, dow, xw, rw;
    prep_in(&p, &dow, dout, "dout", dt);
    prep_in(&p, &xw, x, "x", dt);
    prep_in(&p, &rw, rstd, "rstd", LUNAR_DTYPE_F32);
    prep_out(&p, &dww, dw, "dw", prep_compute_dtype(&p, dw->dtype), 1);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->rmsnorm_backward_params(ctx, &dww, &dow, &xw, &rw));
}

lunar_status lunar_layernorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *mean, lunar_tensor *rstd,
                                     const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *b, float eps) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "layernorm_forward", x));
    p.alias_ok = 1;
    if (!p.be->layernorm_forward) return prep_end(&p, prep_unsupported(&p));
    int64_t n = 0, c = 0;
    norm_rows(&p, x, "x", &n, &c);
    like_x(&p, out, "out", x);
    per_row(&p, mean, "mean", n);
    per_row(&p, rstd, "rstd", n);
    per_channel(&p, w, "w", c);
    per_channel(&p, b, "b", c);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor xw, ww, bw, ow, mw, rw;
    prep_in(&p, &xw, x, "x", dt);
    if (w) prep_in(&p, &ww, w, "w", dt);
    if (b) prep_in(&p, &bw, b, "b", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    prep_out(&p, &mw, mean, "mean", LUNAR_DTYPE_F32, 0);
    prep_out(&p, &rw, rstd, "rstd", LUNAR_DTYPE_F32, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->layernorm_forward(ctx, &ow, &mw, &rw, &xw, w ? &ww : NULL, b ? &bw : NULL, eps));
}

lunar_status lunar_layernorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                            const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *mean,
                                            const lunar_tensor *rstd) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "layernorm_backward_input", x));
    p.alias_ok = 1;
    if (!p.be->layernorm_backward_input) return prep_end(&p, prep_unsupported(&p));
    int64_t n = 0, c = 0;
    norm_rows(&p, x, "x", &n, &c);
    like_x(&p, dx, "dx", x);
    like_x(&p, dout, "dout", x);
    per_row(&p, mean, "mean", n);
    per_row(&p, rstd, "rstd", n);
    per_channel(&p, w, "w", c);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor dxw, dow, xw, ww, mw, rw;
    prep_in(&p, &dow, dout, "dout", dt);
    prep_in(&p, &xw, x, "x", dt);
    if (w) prep_in(&p, &ww, w, "w", dt);
    prep_in(&p, &mw, mean, "mean", LUNAR_DTYPE_F32);
    prep_in(&p, &rw, rstd, "rstd", LUNAR_DTYPE_F32);
    prep_out(&p, &dxw, dx, "dx", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->layernorm_backward_input(ctx, &dxw, &dow, &xw, w ? &ww : NULL, &mw, &rw));
}

lunar_status lunar_layernorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, lunar_tensor *db,
                                             const lunar_tensor *dout, const lunar_tensor *x,
                                             const lunar_tensor *mean, const lunar_tensor *rstd) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "layernorm_backward_params", x));
    if (!p.be->layernorm_backward_params) return prep_end(&p, prep_unsupported(&p));
    int64_t n = 0, c = 0;
    norm_rows(&p, x, "x", &n, &c);
    like_x(&p, dout, "dout", x);
    per_row(&p, mean, "mean", n);
    per_row(&p, rstd, "rstd", n);
    per_channel(&p, dw, "dw", c);
    per_channel(&p, db, "db", c);
    if (p.st) return prep_end(&p, p.st);
    if (!dw && !db) return prep_end(&p, LUNAR_OK);   /* nothing asked for */
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor dww, dbw, dow, xw, mw, rw;
    prep_in(&p, &dow, dout, "dout", dt);
    prep_in(&p, &xw, x, "x", dt);
    prep_in(&p, &mw, mean, "mean", LUNAR_DTYPE_F32);
    prep_in(&p, &rw, rstd, "rstd", LUNAR_DTYPE_F32);
    if (dw) prep_out(&p, &dww, dw, "dw", prep_compute_dtype(&p, dw->dtype), 1);
    if (db) prep_out(&p, &dbw, db, "db", prep_compute_dtype(&p, db->dtype), 1);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->layernorm_backward_params(ctx, dw ? &dww : NULL, db ? &dbw : NULL, &dow, &xw, &mw, &rw));
}
