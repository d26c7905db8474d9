/* softmax.c: softmax and log-softmax over the last dim (forward and backward) and the fused
 * cross-entropy with per-token log-probs.
 *
 * The backend sees (rows, V) contiguous tensors (rows = numel / V); losses, log-probs, lse and
 * dloss are f32 work tensors whatever dtype the caller's tensors have.
 */
#include "prep.h"

static lunar_status expect_rows(lunar_prep *p, const lunar_tensor *t, const char *role) {
    if (p->st) return p->st;
    if (t->ndim >= 1) return LUNAR_OK;
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' is 0-dim; it needs a last dim to normalise over",
                              p->op, role, lunar_tensor_label(t));
}

static lunar_status softmax_fwd(lunar_ctx *ctx, const char *op, lunar_tensor *y, const lunar_tensor *x, int log) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, op, x));
    p.alias_ok = 1;
    if (!p.be->softmax_forward) return prep_end(&p, prep_unsupported(&p));
    prep_check(&p, y, "y");
    prep_expect_float(&p, x, "x");
    prep_expect_float(&p, y, "y");
    expect_rows(&p, x, "x");
    if (!p.st) prep_expect_shape(&p, y, "y", x->ndim, x->shape);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor xw, yw;
    prep_in(&p, &xw, x, "x", dt);
    prep_out(&p, &yw, y, "y", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(x) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->softmax_forward(ctx, &yw, &xw, log));
}

static lunar_status softmax_bwd(lunar_ctx *ctx, const char *op, lunar_tensor *dx, const lunar_tensor *dy,
                                const lunar_tensor *y, int log) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, op, dy));
    p.alias_ok = 1;
    if (!p.be->softmax_backward) return prep_end(&p, prep_unsupported(&p));
    prep_check(&p, dx, "dx");
    prep_check(&p, y, "y");
    prep_expect_float(&p, dy, "dy");
    prep_expect_float(&p, y, "y");
    prep_expect_float(&p, dx, "dx");
    expect_rows(&p, y, "y");
    if (!p.st) prep_expect_shape(&p, dy, "dy", y->ndim, y->shape);
    if (!p.st) prep_expect_shape(&p, dx, "dx", y->ndim, y->shape);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = dy->dtype == y->dtype ? prep_compute_dtype(&p, y->dtype) : LUNAR_DTYPE_F32;
    lunar_tensor dxw, dyw, yw;
    prep_in(&p, &dyw, dy, "dy", dt);
    prep_in(&p, &yw, y, "y", dt);
    prep_out(&p, &dxw, dx, "dx", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(y) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->softmax_backward(ctx, &dxw, &dyw, &yw, log));
}

lunar_status lunar_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x) {
    return softmax_fwd(ctx, "softmax_forward", y, x, 0);
}

lunar_status lunar_log_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x) {
    return softmax_fwd(ctx, "log_softmax_forward", y, x, 1);
}

lunar_status lunar_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *y) {
    return softmax_bwd(ctx, "softmax_backward", dx, dy, y, 0);
}

lunar_status lunar_log_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                        const lunar_tensor *y) {
    return softmax_bwd(ctx, "log_softmax_backward", dx, dy, y, 1);
}

/* logits (N, V) float with V >= 1, targets (N) i32/i64. */
static lunar_status check_ce_inputs(lunar_prep *p, const lunar_tensor *logits, const lunar_tensor *targets) {
    prep_expect_float(p, logits, "logits");
    prep_check(p, targets, "targets");
    prep_expect_index(p, targets, "targets");
    if (p->st) return p->st;
    if (logits->ndim != 2 || logits->shape[1] < 1) {
        char a[160];
        lunar_tensor_shape_str(logits, a, sizeof a);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: logits '%s' has shape %s, expected (N, V) with V >= 1",
                                  p->op, lunar_tensor_label(logits), a);
    }
    return prep_expect_shape(p, targets, "targets", 1, logits->shape);
}

/* An optional (N) f32 output: the caller's tensor, or a scratch one when it passed NULL. */
static lunar_status ce_row_out(lunar_prep *p, lunar_tensor *work, lunar_tensor *user, const char *role, int64_t n) {
    if (!user) return prep_temp(p, work, LUNAR_DTYPE_F32, 1, &n);
    prep_check(p, user, role);
    prep_expect_float(p, user, role);
    prep_expect_shape(p, user, role, 1, &n);
    return prep_out(p, work, user, role, LUNAR_DTYPE_F32, 0);
}

lunar_status lunar_cross_entropy_forward(lunar_ctx *ctx, lunar_tensor *loss, lunar_tensor *logprobs,
                                         lunar_tensor *lse, const lunar_tensor *logits,
                                         const lunar_tensor *targets, int64_t ignore_index) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "cross_entropy_forward", logits));
    if (!p.be->cross_entropy_forward) return prep_end(&p, prep_unsupported(&p));
    check_ce_inputs(&p, logits, targets);
    if (p.st) return prep_end(&p, p.st);
    int64_t n = logits->shape[0];
    lunar_dtype dt = prep_compute_dtype(&p, logits->dtype);
    lunar_tensor lw, tw, lossw, lpw, lsew;
    prep_in(&p, &lw, logits, "logits", dt);
    prep_in(&p, &tw, targets, "targets", LUNAR_DTYPE_I64);
    ce_row_out(&p, &lossw, loss, "loss", n);
    ce_row_out(&p, &lpw, logprobs, "logprobs", n);
    ce_row_out(&p, &lsew, lse, "lse", n);
    if (p.st) return prep_end(&p, p.st);
    if (n == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->cross_entropy_forward(ctx, &lossw, &lpw, &lsew, &lw, &tw, ignore_index));
}

lunar_status lunar_cross_entropy_backward(lunar_ctx *ctx, lunar_tensor *dlogits, const lunar_tensor *dloss,
                                          const lunar_tensor *logits, const lunar_tensor *lse,
                                          const lunar_tensor *targets, int64_t ignore_index) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "cross_entropy_backward", logits));
    p.alias_ok = 1;
    if (!p.be->cross_entropy_backward) return prep_end(&p, prep_unsupported(&p));
    check_ce_inputs(&p, logits, targets);
    prep_check(&p, dlogits, "dlogits");
    prep_check(&p, dloss, "dloss");
    prep_check(&p, lse, "lse");
    prep_expect_float(&p, dlogits, "dlogits");
    prep_expect_float(&p, dloss, "dloss");
    prep_expect_float(&p, lse, "lse");
    if (p.st) return prep_end(&p, p.st);
    int64_t n = logits->shape[0];
    prep_expect_shape(&p, dlogits, "dlogits", 2, logits->shape);
    prep_expect_shape(&p, dloss, "dloss", 1, &n);
    prep_expect_shape(&p, lse, "lse", 1, &n);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, logits->dtype);
    lunar_tensor dlw, dlossw, lw, lsew, tw;
    prep_in(&p, &dlossw, dloss, "dloss", LUNAR_DTYPE_F32);
    prep_in(&p, &lw, logits, "logits", dt);
    prep_in(&p, &lsew, lse, "lse", LUNAR_DTYPE_F32);
    prep_in(&p, &tw, targets, "targets", LUNAR_DTYPE_I64);
    prep_out(&p, &dlw, dlogits, "dlogits", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (n == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->cross_entropy_backward(ctx, &dlw, &dlossw, &lw, &lsew, &tw, ignore_index));
}

lunar_status lunar_entropy_forward(lunar_ctx *ctx, lunar_tensor *entropy, const lunar_tensor *logits,
                                   const lunar_tensor *lse) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "entropy_forward", logits));
    if (!p.be->entropy_forward) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, logits, "logits");
    prep_check(&p, lse, "lse");
    prep_check(&p, entropy, "entropy");
    prep_expect_float(&p, lse, "lse");
    if (p.st) return prep_end(&p, p.st);
    if (logits->ndim != 2 || logits->shape[1] < 1) {
        char a[160];
        lunar_tensor_shape_str(logits, a, sizeof a);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "entropy_forward: logits '%s' has shape %s, expected "
                                       "(N, V) with V >= 1", lunar_tensor_label(logits), a));
    }
    int64_t n = logits->shape[0];
    prep_expect_shape(&p, lse, "lse", 1, &n);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, logits->dtype);
    lunar_tensor lw, lsew, hw;
    prep_in(&p, &lw, logits, "logits", dt);
    prep_in(&p, &lsew, lse, "lse", LUNAR_DTYPE_F32);
    ce_row_out(&p, &hw, entropy, "entropy", n);
    if (p.st) return prep_end(&p, p.st);
    if (n == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->entropy_forward(ctx, &hw, &lw, &lsew));
}

lunar_status lunar_sample_rows(lunar_ctx *ctx, lunar_tensor *tokens, lunar_tensor *logprobs, const lunar_tensor *z,
                               const lunar_tensor *u) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "sample_rows", z));
    if (!p.be->sample_rows) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, z, "z");
    prep_check(&p, u, "u");
    prep_check(&p, tokens, "tokens");
    prep_check(&p, logprobs, "logprobs");
    prep_expect_float(&p, u, "u");
    prep_expect_index(&p, tokens, "tokens");
    prep_expect_float(&p, logprobs, "logprobs");
    if (p.st) return prep_end(&p, p.st);
    if (z->ndim != 2 || z->shape[1] < 1) {
        char a[160];
        lunar_tensor_shape_str(z, a, sizeof a);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "sample_rows: z '%s' has shape %s, expected (N, V) with "
                                       "V >= 1", lunar_tensor_label(z), a));
    }
    int64_t n = z->shape[0];
    prep_expect_shape(&p, u, "u", 1, &n);
    prep_expect_shape(&p, tokens, "tokens", 1, &n);
    prep_expect_shape(&p, logprobs, "logprobs", 1, &n);
    if (p.st) return prep_end(&p, p.st);
    lunar_tensor zw, uw, tw, lw;
    prep_in(&p, &zw, z, "z", LUNAR_DTYPE_F32);
    prep_in(&p, &uw, u, "u", LUNAR_DTYPE_F32);
    prep_out(&p, &tw, tokens, "tokens", LUNAR_DTYPE_I64, 0);
    prep_out(&p, &lw, logprobs, "logprobs", LUNAR_DTYPE_F32, 0);
    if (p.st) return prep_end(&p, p.st);
    if (n == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->sample_rows(ctx, &tw, &lw, &zw, &uw));
}
