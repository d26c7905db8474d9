/* prep.c: argument checking and layout preparation shared by every op (see prep.h). */
#include <stdio.h>
#include <string.h>

#include "prep.h"

lunar_status prep_begin(lunar_prep *p, lunar_ctx *ctx, const char *op, const lunar_tensor *first) {
    memset(p, 0, sizeof *p);
    p->ctx = ctx;
    p->op = op;
    if (!first) return p->st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: missing tensor argument", op);
    if (lunar_tensor_check(ctx, first) != LUNAR_OK) {
        lunar_ctx_prefix_error(ctx, "%s", op);
        return p->st = lunar_ctx_status(ctx);
    }
    p->dev = lunar_tensor_device(first);
    p->be = lunar_ctx_backend(ctx, p->dev.type);
    if (!p->be) return p->st = LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "%s: backend for this device was not built", op);
    return LUNAR_OK;
}

lunar_status prep_unsupported(lunar_prep *p) {
    if (p->st) return p->st;
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_UNSUPPORTED, "%s is not implemented on the %s backend", p->op,
                              p->be->name);
}

lunar_status prep_check(lunar_prep *p, const lunar_tensor *t, const char *role) {
    if (p->st) return p->st;
    if (!t) return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: %s is missing", p->op, role);
    if (lunar_tensor_check(p->ctx, t) != LUNAR_OK) {
        lunar_ctx_prefix_error(p->ctx, "%s: %s", p->op, role);
        return p->st = lunar_ctx_status(p->ctx);
    }
    lunar_device d = lunar_tensor_device(t);
    if (!lunar_device_equal(d, p->dev)) {
        char a[32], b[32], sh[160];
        lunar_device_format(d, a, sizeof a);
        lunar_device_format(p->dev, b, sizeof b);
        lunar_tensor_shape_str(t, sh, sizeof sh);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_DEVICE, "%s: %s '%s' %s is on %s but the op runs on %s", p->op,
                                  role, lunar_tensor_label(t), sh, a, b);
    }
    return LUNAR_OK;
}

lunar_dtype prep_compute_dtype(const lunar_prep *p, lunar_dtype dt) {
    if (lunar_dtype_is_int(dt)) return LUNAR_DTYPE_I64;
    if (p->be && (p->be->float_dtypes & (1u << dt))) return dt;
    return LUNAR_DTYPE_F32;
}

static lunar_status hold(lunar_prep *p, lunar_tensor *work) {
    if (p->n_held >= PREP_MAX) {
        lunar_tensor_release(p->ctx, work);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_INTERNAL, "%s: too many prepared tensors", p->op);
    }
    p->held[p->n_held++] = work;
    return LUNAR_OK;
}

lunar_status prep_temp(lunar_prep *p, lunar_tensor *work, lunar_dtype dt, int ndim, const int64_t *shape) {
    memset(work, 0, sizeof *work);
    if (p->st) return p->st;
    lunar_status st = lunar_tensor_new(p->ctx, work, dt, p->dev, ndim, shape);
    if (st != LUNAR_OK) {
        lunar_ctx_prefix_error(p->ctx, "%s: temporary", p->op);
        return p->st = st;
    }
    return hold(p, work);
}

lunar_status prep_in(lunar_prep *p, lunar_tensor *work, const lunar_tensor *src, const char *role, lunar_dtype want) {
    memset(work, 0, sizeof *work);
    if (prep_check(p, src, role)) return p->st;
    if (src->dtype == want && lunar_tensor_is_contiguous(src)) {
        lunar_tensor_share(work, src);
        if (p->n_in_place < PREP_MAX) p->in_place[p->n_in_place++] = *src;
        return hold(p, work);
    }
    if (prep_temp(p, work, want, src->ndim, src->shape)) return p->st;
    lunar_tensor_set_name(work, src->name);
    lunar_status st = p->be->copy(p->ctx, work, src, 0);
    if (st != LUNAR_OK) {
        lunar_ctx_prefix_error(p->ctx, "%s: preparing %s '%s'", p->op, role, lunar_tensor_label(src));
        return p->st = st;
    }
    return LUNAR_OK;
}

/* Would writing user in place clobber an input the kernel reads in place? */
static int clobbers_input(const lunar_prep *p, const lunar_tensor *user) {
    for (int i = 0; i < p->n_in_place; i++) {
        const lunar_tensor *in = &p->in_place[i];
        if (!lunar_tensor_overlaps(user, in)) continue;
        if (p->alias_ok && lunar_tensor_same_view(user, in)) continue;
        return 1;
    }
    return 0;
}

lunar_status prep_out(lunar_prep *p, lunar_tensor *work, lunar_tensor *user, const char *role, lunar_dtype want,
                      int load) {
    memset(work, 0, sizeof *work);
    if (prep_check(p, user, role)) return p->st;
    if (user->dtype == want && lunar_tensor_is_contiguous(user) && !clobbers_input(p, user)) {
        lunar_tensor_share(work, user);
        return hold(p, work);
    }
    for (int i = 0; i < user->ndim; i++) {
        if (user->stride[i] == 0 && user->shape[i] > 1)
            return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: %s '%s' is an expanded (broadcast) view and cannot be written",
                                      p->op, role, lunar_tensor_label(user));
    }
    if (prep_temp(p, work, want, user->ndim, user->shape)) return p->st;
    lunar_tensor_set_name(work, user->name);
    if (load) {
        lunar_status st = p->be->copy(p->ctx, work, user, 0);
        if (st != LUNAR_OK) return p->st = st;
    }
    if (p->n_out >= PREP_MAX) return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_INTERNAL, "%s: too many outputs", p->op);
    p->out_user[p->n_out] = user;
    p->out_work[p->n_out] = work;
    p->n_out++;
    return LUNAR_OK;
}

lunar_status prep_end(lunar_prep *p, lunar_status st) {
    if (st == LUNAR_OK && p->st) st = p->st;
    if (st == LUNAR_OK) {
        for (int i = 0; i < p->n_out && st == LUNAR_OK; i++) st = p->be->copy(p->ctx, p->out_user[i], p->out_work[i], 0);
    }
    for (int i = 0; i < p->n_held; i++) lunar_tensor_release(p->ctx, p->held[i]);
    p->n_held = 0;
    p->n_out = 0;
    return st;
}

lunar_status prep_expect_shape(lunar_prep *p, const lunar_tensor *t, const char *role, int ndim, const int64_t *shape) {
    if (p->st) return p->st;
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (ok) return LUNAR_OK;
    char a[160], b[160];
    lunar_tensor_shape_str(t, a, sizeof a);
    lunar_shape_format(ndim, shape, b, sizeof b);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' has shape %s, expected %s", p->op, role,
                              lunar_tensor_label(t), a, b);
}

lunar_status prep_expect_float(lunar_prep *p, const lunar_tensor *t, const char *role) {
    if (p->st) return p->st;
    if (lunar_dtype_is_float(t->dtype)) return LUNAR_OK;
    char sh[160];
    lunar_tensor_shape_str(t, sh, sizeof sh);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_DTYPE, "%s: %s '%s' %s must be a float tensor, not %s", p->op, role,
                              lunar_tensor_label(t), sh, lunar_dtype_name(t->dtype));
}

lunar_status prep_expect_index(lunar_prep *p, const lunar_tensor *t, const char *role) {
    if (p->st) return p->st;
    if (t->dtype == LUNAR_DTYPE_I32 || t->dtype == LUNAR_DTYPE_I64) return LUNAR_OK;
    char sh[160];
    lunar_tensor_shape_str(t, sh, sizeof sh);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_DTYPE, "%s: %s '%s' %s must be i32 or i64, not %s", p->op, role,
                              lunar_tensor_label(t), sh, lunar_dtype_name(t->dtype));
}

lunar_status prep_dim(lunar_prep *p, const lunar_tensor *t, const char *role, int *dim) {
    if (p->st) return p->st;
    int d = *dim < 0 ? *dim + t->ndim : *dim;
    if (d < 0 || d >= t->ndim) {
        char a[160];
        lunar_tensor_shape_str(t, a, sizeof a);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_ARG, "%s: dim %d out of range for %s '%s' %s", p->op, *dim, role,
                                  lunar_tensor_label(t), a);
    }
    *dim = d;
    return LUNAR_OK;
}

void prep_split_dim(const lunar_tensor *t, int dim, int64_t *outer, int64_t *n, int64_t *inner) {
    int64_t o = 1, in = 1;
    for (int i = 0; i < dim; i++) o *= t->shape[i];
    for (int i = dim + 1; i < t->ndim; i++) in *= t->shape[i];
    *outer = o;
    *n = t->shape[dim];
    *inner = in;
}
