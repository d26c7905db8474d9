/* reduce.c: sum, mean, max, min and L2 norm over one dim or all dims, their backward, max with
 * indices, cumulative sums and the global norm of a list of tensors.
 *
 * The backend sees x as (outer, n, inner) around the reduced dim (outer = inner = 1 and n =
 * numel for LUNAR_ALL_DIMS). Whether the reduced dim is kept (size 1) or dropped is decided by
 * the output's shape: both are accepted. For ALL_DIMS any one-element output is accepted.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prep.h"

static const char *const reduce_names[LUNAR_REDUCE_COUNT] = {"sum", "mean", "max", "min", "norm"};

const char *lunar_reduce_op_name(lunar_reduce_op op) {
    return (unsigned)op < LUNAR_REDUCE_COUNT ? reduce_names[op] : "?";
}

int lunar_reduce_op_from_name(const char *name, lunar_reduce_op *out) {
    for (int i = 0; i < LUNAR_REDUCE_COUNT; i++)
        if (name && strcmp(name, reduce_names[i]) == 0) {
            *out = (lunar_reduce_op)i;
            return 1;
        }
    return 0;
}

/* The dtype float kernels run in: the common dtype of the float inputs when the backend takes
 * it, else f32. */
static lunar_dtype common_float(const lunar_prep *p, const lunar_tensor *a, const lunar_tensor *b) {
    if (b && a->dtype != b->dtype) return LUNAR_DTYPE_F32;
    return prep_compute_dtype(p, a->dtype);
}

/* Normalises dim (or keeps LUNAR_ALL_DIMS) and gives the (outer, n, inner) split of x. */
static lunar_status split_for(lunar_prep *p, const lunar_tensor *x, const char *role, int *dim, int64_t *outer,
                              int64_t *n, int64_t *inner) {
    if (p->st) return p->st;
    if (*dim == LUNAR_ALL_DIMS) {
        *outer = 1;
        *n = lunar_tensor_numel(x);
        *inner = 1;
        return LUNAR_OK;
    }
    if (prep_dim(p, x, role, dim)) return p->st;
    prep_split_dim(x, *dim, outer, n, inner);
    return LUNAR_OK;
}

/* t must have x's shape reduced over dim: dim dropped or kept with size 1 (ALL_DIMS: one element). */
static lunar_status expect_reduced(lunar_prep *p, const lunar_tensor *t, const char *role, const lunar_tensor *x,
                                   int dim) {
    if (p->st) return p->st;
    if (dim == LUNAR_ALL_DIMS) {
        if (lunar_tensor_numel(t) == 1) return LUNAR_OK;
        char a[160];
        lunar_tensor_shape_str(t, a, sizeof a);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' has shape %s, expected one element (reduction over all dims)",
                                  p->op, role, lunar_tensor_label(t), a);
    }
    int64_t keep[LUNAR_MAX_DIMS], drop[LUNAR_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < x->ndim; i++) {
        keep[i] = i == dim ? 1 : x->shape[i];
        if (i != dim) drop[nd++] = x->shape[i];
    }
    int ok = 0;
    if (t->ndim == x->ndim) {
        ok = 1;
        for (int i = 0; i < t->ndim; i++) ok = ok && t->shape[i] == keep[i];
    } else if (t->ndim == nd) {
        ok = 1;
        for (int i = 0; i < nd; i++) ok = ok && t->shape[i] == drop[i];
    }
    if (ok) return LUNAR_OK;
    char a[160], b[160], c[160];
    lunar_tensor_shape_str(t, a, sizeof a);
    lunar_shape_format(x->ndim, keep, b, sizeof b);
    lunar_shape_format(nd, drop, c, sizeof c);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' has shape %s, expected %s or %s (x '%s' reduced over dim %d)",
                              p->op, role, lunar_tensor_label(t), a, b, c, lunar_tensor_label(x), dim);
}

static lunar_status expect_nonempty(lunar_prep *p, const lunar_tensor *x, int64_t n, int64_t outer, int64_t inner,
                                    const char *what) {
    if (p->st || n > 0 || outer * inner == 0) return p->st;
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: cannot take the %s of an empty extent (x '%s' has 0 elements along the reduced dim)",
                              p->op, what, lunar_tensor_label(x));
}

lunar_status lunar_reduce(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int dim, lunar_reduce_op op) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "reduce", x));
    if ((unsigned)op < LUNAR_REDUCE_COUNT) p.op = reduce_names[op];
    else return prep_end(&p, p.st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "reduce: unknown op %d", (int)op));
    if (!p.be->reduce) return prep_end(&p, prep_unsupported(&p));
    int64_t outer, n, inner;
    prep_check(&p, out, "out");
    /* integer and bool tensors: sum (into i64, as torch), max and min, exactly in i64 (the
     * compute dtype of an integer), on backends whose reduce takes i64. mean and norm need a
     * float tensor, as in torch. */
    int exact = lunar_dtype_is_int(x->dtype) &&
                (op == LUNAR_REDUCE_SUM || op == LUNAR_REDUCE_MAX || op == LUNAR_REDUCE_MIN);
    if (exact && !p.st) {
        if (!p.be->int_reduce)
            return prep_end(&p, p.st = LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED,
                                                  "%s of an integer tensor is not implemented on the %s backend (x is %s)",
                                                  p.op, p.be->name, lunar_dtype_name(x->dtype)));
        if (!lunar_dtype_is_int(out->dtype))
            return prep_end(&p, p.st = LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE,
                                                  "%s: out '%s' must be an integer tensor for an integer x, not %s",
                                                  p.op, lunar_tensor_label(out), lunar_dtype_name(out->dtype)));
    } else {
        prep_expect_float(&p, x, "x");
        prep_expect_float(&p, out, "out");
    }
    split_for(&p, x, "x", &dim, &outer, &n, &inner);
    expect_reduced(&p, out, "out", x, dim);
    if (op == LUNAR_REDUCE_MAX || op == LUNAR_REDUCE_MIN) expect_nonempty(&p, x, n, outer, inner, p.op);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor xw, ow;
    prep_in(&p, &xw, x, "x", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (outer * inner == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->reduce(ctx, &ow, &xw, outer, n, inner, op));
}

lunar_status lunar_reduce_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *x,
                                   const lunar_tensor *y, int dim, lunar_reduce_op op) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "reduce_backward", dx));
    static const char *const names[LUNAR_REDUCE_COUNT] = {"sum_backward", "mean_backward", "max_backward",
                                                          "min_backward", "norm_backward"};
    if ((unsigned)op < LUNAR_REDUCE_COUNT) p.op = names[op];
    else return prep_end(&p, p.st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "reduce_backward: unknown op %d", (int)op));
    if (!p.be->reduce_backward) return prep_end(&p, prep_unsupported(&p));
    int need_x = op == LUNAR_REDUCE_MAX || op == LUNAR_REDUCE_MIN || op == LUNAR_REDUCE_NORM;
    int need_y = op == LUNAR_REDUCE_NORM;
    int64_t outer, n, inner;
    prep_check(&p, dy, "dy");
    prep_expect_float(&p, dx, "dx");
    prep_expect_float(&p, dy, "dy");
    if (need_x || x) {
        prep_check(&p, x, "x");
        prep_expect_float(&p, x, "x");
        if (!p.st) prep_expect_shape(&p, x, "x", dx->ndim, dx->shape);
    }
    if (need_y || y) {
        prep_check(&p, y, "y");
        prep_expect_float(&p, y, "y");
    }
    split_for(&p, dx, "dx", &dim, &outer, &n, &inner);
    expect_reduced(&p, dy, "dy", dx, dim);
    if (y) expect_reduced(&p, y, "y", dx, dim);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = common_float(&p, dy, x);
    if (y && y->dtype != dy->dtype) dt = LUNAR_DTYPE_F32;
    lunar_tensor dxw, dyw, xw = {0}, yw = {0};
    prep_in(&p, &dyw, dy, "dy", dt);
    if (x) prep_in(&p, &xw, x, "x", dt);
    if (y) prep_in(&p, &yw, y, "y", dt);
    prep_out(&p, &dxw, dx, "dx", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(dx) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->reduce_backward(ctx, &dxw, &dyw, x ? &xw : NULL, y ? &yw : NULL, outer, n, inner, op));
}

lunar_status lunar_max_dim(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                           int dim) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "max_dim", x));
    if (!p.be->max_dim) return prep_end(&p, prep_unsupported(&p));
    int64_t outer, n, inner;
    prep_expect_float(&p, x, "x");
    prep_check(&p, indices, "indices");
    prep_expect_index(&p, indices, "indices");
    if (values) {
        prep_check(&p, values, "values");
        prep_expect_float(&p, values, "values");
    }
    split_for(&p, x, "x", &dim, &outer, &n, &inner);
    expect_reduced(&p, indices, "indices", x, dim);
    if (values) expect_reduced(&p, values, "values", x, dim);
    expect_nonempty(&p, x, n, outer, inner, "max");
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor xw, vw, iw;
    prep_in(&p, &xw, x, "x", dt);
    prep_out(&p, &iw, indices, "indices", LUNAR_DTYPE_I64, 0);
    if (values) prep_out(&p, &vw, values, "values", dt, 0);
    else prep_temp(&p, &vw, dt, indices->ndim, indices->shape);
    if (p.st) return prep_end(&p, p.st);
    if (outer * inner == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->max_dim(ctx, &vw, &iw, &xw, outer, n, inner));
}

static lunar_status cumsum_impl(lunar_ctx *ctx, const char *op, lunar_tensor *out, const lunar_tensor *x, int dim,
                                int reverse) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, op, x));
    p.alias_ok = 1;
    if (!p.be->cumsum) return prep_end(&p, prep_unsupported(&p));
    const char *in_role = reverse ? "dy" : "x", *out_role = reverse ? "dx" : "out";
    int64_t outer, n, inner;
    prep_check(&p, out, out_role);
    prep_expect_float(&p, x, in_role);
    prep_expect_float(&p, out, out_role);
    if (!p.st) prep_expect_shape(&p, out, out_role, x->ndim, x->shape);
    split_for(&p, x, in_role, &dim, &outer, &n, &inner);
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor xw, ow;
    prep_in(&p, &xw, x, in_role, dt);
    prep_out(&p, &ow, out, out_role, dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(x) == 0) return prep_end(&p, LUNAR_OK);
    return prep_end(&p, p.be->cumsum(ctx, &ow, &xw, outer, n, inner, reverse));
}

lunar_status lunar_cumsum_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int dim) {
    if (dim == LUNAR_ALL_DIMS) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cumsum_forward: needs one dim, not ALL_DIMS");
    return cumsum_impl(ctx, "cumsum_forward", out, x, dim, 0);
}

lunar_status lunar_cumsum_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, int dim) {
    if (dim == LUNAR_ALL_DIMS) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cumsum_backward: needs one dim, not ALL_DIMS");
    return cumsum_impl(ctx, "cumsum_backward", dx, dy, dim, 1);
}

/* The tensors are handed to the backend as they are when already contiguous and of a dtype it
 * takes; only the others are converted, one temporary each, released at the end. There is no
 * limit on the number of tensors. */
lunar_status lunar_global_norm(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *const *ts, int n) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "global_norm", out));
    if (!p.be->global_norm) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, out, "out");
    if (!p.st && lunar_tensor_numel(out) != 1) {
        char a[160];
        lunar_tensor_shape_str(out, a, sizeof a);
        p.st = LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "global_norm: out '%s' has shape %s, expected one element",
                          lunar_tensor_label(out), a);
    }
    if (!p.st && (n < 0 || (n > 0 && !ts)))
        p.st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "global_norm: bad tensor list (n = %d)", n);
    char role[48];
    for (int i = 0; i < n && !p.st; i++) {
        snprintf(role, sizeof role, "tensor %d of the list", i + 1);
        prep_check(&p, ts[i], role);
        prep_expect_float(&p, ts[i], role);
    }
    lunar_tensor ow;
    prep_out(&p, &ow, out, "out", LUNAR_DTYPE_F32, 0);
    if (p.st) return prep_end(&p, p.st);
    const lunar_tensor **use = NULL;
    lunar_tensor *tmp = NULL;
    if (n > 0) {
        use = calloc((size_t)n, sizeof *use);
        tmp = calloc((size_t)n, sizeof *tmp);
        if (!use || !tmp) {
            free(use);
            free(tmp);
            return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "global_norm: out of host memory for %d tensors", n));
        }
    }
    lunar_status st = LUNAR_OK;
    for (int i = 0; i < n && st == LUNAR_OK; i++) {
        const lunar_tensor *t = ts[i];
        lunar_dtype want = prep_compute_dtype(&p, t->dtype);
        if (t->dtype == want && lunar_tensor_is_contiguous(t)) {
            use[i] = t;
            continue;
        }
        st = lunar_tensor_new(ctx, &tmp[i], want, p.dev, t->ndim, t->shape);
        if (st == LUNAR_OK) st = p.be->copy(ctx, &tmp[i], t, 0);
        if (st != LUNAR_OK) lunar_ctx_prefix_error(ctx, "global_norm: preparing tensor %d '%s'", i + 1, lunar_tensor_label(t));
        use[i] = &tmp[i];
    }
    if (st == LUNAR_OK) st = p.be->global_norm(ctx, &ow, use, n);
    for (int i = 0; i < n; i++) lunar_tensor_release(ctx, &tmp[i]);
    free(use);
    free(tmp);
    return prep_end(&p, st);
}
