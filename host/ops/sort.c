/* sort.c: top-k and stable argsort along the last dim.
 *
 * The backend sees x as (rows, n) and writes i64 indices (0-based positions along the last dim).
 * Order is total and deterministic on every backend: values compare numerically with NaN above
 * +inf and -0 equal to +0, and equal values keep their index order (lower index first), in both
 * directions. Integer inputs are sorted through f32, so they are exact up to 2^24 in magnitude.
 */
#include "prep.h"

/* x (..., n) with at least one dim and fewer than 2^31 entries along it. */
static lunar_status check_sort_input(lunar_prep *p, const lunar_tensor *x) {
    if (p->st) return p->st;
    if (x->dtype == LUNAR_DTYPE_BOOL)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_DTYPE, "%s: x '%s' is bool; sort a numeric tensor", p->op,
                                  lunar_tensor_label(x));
    if (x->ndim < 1)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: x '%s' is 0-dim; it needs a last dim to sort along",
                                  p->op, lunar_tensor_label(x));
    if (x->shape[x->ndim - 1] > INT32_MAX)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: x '%s' has %lld entries along the last dim (at most 2^31 - 1)",
                                  p->op, lunar_tensor_label(x), (long long)x->shape[x->ndim - 1]);
    return LUNAR_OK;
}

lunar_status lunar_topk(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                        int64_t k, int largest) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "topk", x));
    if (!p.be->topk) return prep_end(&p, prep_unsupported(&p));
    check_sort_input(&p, x);
    prep_check(&p, indices, "indices");
    prep_expect_index(&p, indices, "indices");
    if (values) prep_check(&p, values, "values");
    if (p.st) return prep_end(&p, p.st);
    int64_t n = x->shape[x->ndim - 1];
    if (k < 0 || k > n) {
        char a[160];
        lunar_tensor_shape_str(x, a, sizeof a);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "topk: k = %lld out of range [0, %lld] for x '%s' %s",
                                       (long long)k, (long long)n, lunar_tensor_label(x), a));
    }
    int64_t oshape[LUNAR_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) oshape[i] = x->shape[i];
    oshape[x->ndim - 1] = k;
    prep_expect_shape(&p, indices, "indices", x->ndim, oshape);
    if (values) prep_expect_shape(&p, values, "values", x->ndim, oshape);
    if (p.st) return prep_end(&p, p.st);
    /* values keep x's dtype: floats run in the backend's dtype, integers through f32 */
    lunar_dtype dt = lunar_dtype_is_float(x->dtype) ? prep_compute_dtype(&p, x->dtype) : LUNAR_DTYPE_F32;
    lunar_tensor xw, iw, vw = {0};
    prep_in(&p, &xw, x, "x", dt);
    prep_out(&p, &iw, indices, "indices", LUNAR_DTYPE_I64, 0);
    if (values) prep_out(&p, &vw, values, "values", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    int64_t rows = n > 0 ? lunar_tensor_numel(x) / n : 0;
    for (int i = 0; i < x->ndim - 1; i++) if (x->shape[i] == 0) rows = 0;
    if (rows == 0 || k == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->topk(ctx, values ? &vw : NULL, &iw, &xw, rows, n, k, largest));
}

lunar_status lunar_argsort(lunar_ctx *ctx, lunar_tensor *indices, const lunar_tensor *x, int descending) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "argsort", x));
    if (!p.be->argsort) return prep_end(&p, prep_unsupported(&p));
    check_sort_input(&p, x);
    prep_check(&p, indices, "indices");
    prep_expect_index(&p, indices, "indices");
    if (!p.st) prep_expect_shape(&p, indices, "indices", x->ndim, x->shape);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = lunar_dtype_is_float(x->dtype) ? prep_compute_dtype(&p, x->dtype) : LUNAR_DTYPE_F32;
    lunar_tensor xw, iw;
    prep_in(&p, &xw, x, "x", dt);
    prep_out(&p, &iw, indices, "indices", LUNAR_DTYPE_I64, 0);
    if (p.st) return prep_end(&p, p.st);
    int64_t n = x->shape[x->ndim - 1];
    if (lunar_tensor_numel(x) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->argsort(ctx, &iw, &xw, lunar_tensor_numel(x) / n, n, descending));
}
