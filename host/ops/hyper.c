/* hyper.c: mHC hyper-connection ops (ops.h): validation, then the backend, every float tensor in
 * f32 (the streams' mixing is f32 whatever the model's dtype).
 */
#include <stdio.h>

#include "prep.h"

#define HC_MAX_STREAMS 64

static lunar_status fshape(lunar_prep *p, const lunar_tensor *t, const char *role, int ndim, int64_t a, int64_t b,
                           int64_t c) {
    if (p->st) return p->st;
    if (prep_check(p, t, role) || prep_expect_float(p, t, role)) return p->st;
    int64_t sh[3] = {a, b, c};
    return prep_expect_shape(p, t, role, ndim, sh);
}

/* z (N, (2 + n) n); n in 1..HC_MAX_STREAMS, iters >= 1 */
static lunar_status check_weights(lunar_prep *p, const lunar_tensor *z, int64_t n, int iters, int64_t *N) {
    if (n < 1 || n > HC_MAX_STREAMS)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: n = %lld streams, expected 1 to %d", p->op, (long long)n,
                                  HC_MAX_STREAMS);
    if (iters < 1)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: iters = %d Sinkhorn iterations, expected >= 1", p->op,
                                  iters);
    if (prep_check(p, z, "z") || prep_expect_float(p, z, "z")) return p->st;
    *N = z->ndim == 2 ? z->shape[0] : 0;
    return fshape(p, z, "z", 2, *N, (2 + n) * n, 0);
}

lunar_status lunar_hc_weights(lunar_ctx *ctx, lunar_tensor *pre, lunar_tensor *post, lunar_tensor *comb,
                              const lunar_tensor *z, int64_t n, int iters, float eps) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "hc_weights", z));
    if (!p.be->hc_weights) return prep_end(&p, prep_unsupported(&p));
    int64_t N = 0;
    check_weights(&p, z, n, iters, &N);
    fshape(&p, pre, "pre", 2, N, n, 0);
    fshape(&p, post, "post", 2, N, n, 0);
    fshape(&p, comb, "comb", 3, N, n, n);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor zw, pw, qw, cw;
    prep_in(&p, &zw, z, "z", F);
    prep_out(&p, &pw, pre, "pre", F, 0);
    prep_out(&p, &qw, post, "post", F, 0);
    prep_out(&p, &cw, comb, "comb", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->hc_weights(ctx, &pw, &qw, &cw, &zw, n, iters, eps));
}

lunar_status lunar_hc_weights_backward(lunar_ctx *ctx, lunar_tensor *dz, const lunar_tensor *dpre,
                                       const lunar_tensor *dpost, const lunar_tensor *dcomb, const lunar_tensor *z,
                                       int64_t n, int iters, float eps) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "hc_weights_backward", z));
    if (!p.be->hc_weights_backward) return prep_end(&p, prep_unsupported(&p));
    int64_t N = 0;
    check_weights(&p, z, n, iters, &N);
    fshape(&p, dpre, "dpre", 2, N, n, 0);
    fshape(&p, dpost, "dpost", 2, N, n, 0);
    fshape(&p, dcomb, "dcomb", 3, N, n, n);
    fshape(&p, dz, "dz", 2, N, (2 + n) * n, 0);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor zw, dpw, dqw, dcw, dzw;
    prep_in(&p, &zw, z, "z", F);
    prep_in(&p, &dpw, dpre, "dpre", F);
    prep_in(&p, &dqw, dpost, "dpost", F);
    prep_in(&p, &dcw, dcomb, "dcomb", F);
    prep_out(&p, &dzw, dz, "dz", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->hc_weights_backward(ctx, &dzw, &dpw, &dqw, &dcw, &zw, n, iters, eps));
}

/* x (N, n, H) streams: *N, *n, *H */
static lunar_status check_streams(lunar_prep *p, const lunar_tensor *x, int64_t *N, int64_t *n, int64_t *H) {
    if (prep_check(p, x, "x") || prep_expect_float(p, x, "x")) return p->st;
    if (x->ndim != 3 || x->shape[1] < 1 || x->shape[1] > HC_MAX_STREAMS) {
        char sh[128];
        lunar_tensor_shape_str(x, sh, sizeof sh);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE,
                                  "%s: x '%s' has shape %s, expected the streams (N, n, H) with 1 <= n <= %d", p->op,
                                  lunar_tensor_label(x), sh, HC_MAX_STREAMS);
    }
    *N = x->shape[0], *n = x->shape[1], *H = x->shape[2];
    return LUNAR_OK;
}

lunar_status lunar_hc_mix(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *a,
                          const lunar_tensor *post, const lunar_tensor *comb) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "hc_mix", x));
    if (!p.be->hc_mix) return prep_end(&p, prep_unsupported(&p));
    int64_t N, n, H;
    if (check_streams(&p, x, &N, &n, &H)) return prep_end(&p, p.st);
    fshape(&p, a, "a", 2, N, H, 0);
    fshape(&p, post, "post", 2, N, n, 0);
    fshape(&p, comb, "comb", 3, N, n, n);
    fshape(&p, y, "y", 3, N, n, H);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor xw, aw, pw, cw, yw;
    prep_in(&p, &xw, x, "x", F);
    prep_in(&p, &aw, a, "a", F);
    prep_in(&p, &pw, post, "post", F);
    prep_in(&p, &cw, comb, "comb", F);
    prep_out(&p, &yw, y, "y", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->hc_mix(ctx, &yw, &xw, &aw, &pw, &cw));
}

lunar_status lunar_hc_mix_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *da, lunar_tensor *dpost,
                                   lunar_tensor *dcomb, const lunar_tensor *dy, const lunar_tensor *x,
                                   const lunar_tensor *a, const lunar_tensor *post, const lunar_tensor *comb) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "hc_mix_backward", x));
    if (!p.be->hc_mix_backward) return prep_end(&p, prep_unsupported(&p));
    int64_t N, n, H;
    if (check_streams(&p, x, &N, &n, &H)) return prep_end(&p, p.st);
    fshape(&p, a, "a", 2, N, H, 0);
    fshape(&p, post, "post", 2, N, n, 0);
    fshape(&p, comb, "comb", 3, N, n, n);
    fshape(&p, dy, "dy", 3, N, n, H);
    fshape(&p, dx, "dx", 3, N, n, H);
    fshape(&p, da, "da", 2, N, H, 0);
    fshape(&p, dpost, "dpost", 2, N, n, 0);
    fshape(&p, dcomb, "dcomb", 3, N, n, n);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor xw, aw, pw, cw, dyw, dxw, daw, dpw, dcw;
    prep_in(&p, &xw, x, "x", F);
    prep_in(&p, &aw, a, "a", F);
    prep_in(&p, &pw, post, "post", F);
    prep_in(&p, &cw, comb, "comb", F);
    prep_in(&p, &dyw, dy, "dy", F);
    prep_out(&p, &dxw, dx, "dx", F, 0);
    prep_out(&p, &daw, da, "da", F, 0);
    prep_out(&p, &dpw, dpost, "dpost", F, 0);
    prep_out(&p, &dcw, dcomb, "dcomb", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->hc_mix_backward(ctx, &dxw, &daw, &dpw, &dcw, &dyw, &xw, &aw, &pw, &cw));
}

lunar_status lunar_hc_collapse(lunar_ctx *ctx, lunar_tensor *u, const lunar_tensor *x, const lunar_tensor *pre) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "hc_collapse", x));
    if (!p.be->hc_collapse) return prep_end(&p, prep_unsupported(&p));
    int64_t N, n, H;
    if (check_streams(&p, x, &N, &n, &H)) return prep_end(&p, p.st);
    fshape(&p, pre, "pre", 2, N, n, 0);
    fshape(&p, u, "u", 2, N, H, 0);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor xw, pw, uw;
    prep_in(&p, &xw, x, "x", F);
    prep_in(&p, &pw, pre, "pre", F);
    prep_out(&p, &uw, u, "u", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->hc_collapse(ctx, &uw, &xw, &pw));
}

lunar_status lunar_hc_collapse_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dpre, const lunar_tensor *du,
                                        const lunar_tensor *x, const lunar_tensor *pre) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "hc_collapse_backward", x));
    if (!p.be->hc_collapse_backward) return prep_end(&p, prep_unsupported(&p));
    int64_t N, n, H;
    if (check_streams(&p, x, &N, &n, &H)) return prep_end(&p, p.st);
    fshape(&p, pre, "pre", 2, N, n, 0);
    fshape(&p, du, "du", 2, N, H, 0);
    fshape(&p, dx, "dx", 3, N, n, H);
    fshape(&p, dpre, "dpre", 2, N, n, 0);
    if (p.st) return prep_end(&p, p.st);
    const lunar_dtype F = LUNAR_DTYPE_F32;
    lunar_tensor xw, pw, duw, dxw, dpw;
    prep_in(&p, &xw, x, "x", F);
    prep_in(&p, &pw, pre, "pre", F);
    prep_in(&p, &duw, du, "du", F);
    prep_out(&p, &dxw, dx, "dx", F, 1);
    prep_out(&p, &dpw, dpre, "dpre", F, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->hc_collapse_backward(ctx, &dxw, &dpw, &duw, &xw, &pw));
}
