/* copy.c: copies, casts and transfers between devices; fill, arange, synchronize. */
#include <string.h>

#include "prep.h"

static lunar_status copy_impl(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src, int saturate) {
    const char *op = saturate ? "copy_saturate" : "copy";
    LUNAR_TRY(lunar_tensor_check(ctx, dst));
    LUNAR_TRY(lunar_tensor_check(ctx, src));
    for (int i = 0; i < dst->ndim; i++)
        if (dst->stride[i] == 0 && dst->shape[i] > 1)
            return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: destination '%s' is an expanded view and cannot be written", op,
                              lunar_tensor_label(dst));
    lunar_tensor view = {0};
    lunar_status st = lunar_tensor_expand(ctx, &view, src, dst->ndim, dst->shape);
    if (st != LUNAR_OK) {
        lunar_ctx_prefix_error(ctx, "%s into '%s'", op, lunar_tensor_label(dst));
        return st;
    }
    lunar_device dd = lunar_tensor_device(dst), sd = lunar_tensor_device(&view);
    const lunar_backend *dbe = lunar_ctx_backend(ctx, dd.type), *sbe = lunar_ctx_backend(ctx, sd.type);
    if (lunar_device_equal(dd, sd)) {
        if (lunar_tensor_same_view(dst, &view) && !saturate) {
            st = LUNAR_OK;   /* a copy onto itself */
        } else if (lunar_tensor_overlaps(dst, &view)) {
            /* the kernels read and write in an order of their own: go through a temporary */
            lunar_tensor tmp = {0};
            st = lunar_tensor_new(ctx, &tmp, view.dtype, sd, view.ndim, view.shape);
            if (st == LUNAR_OK) st = sbe->copy(ctx, &tmp, &view, 0);
            if (st == LUNAR_OK) st = dbe->copy(ctx, dst, &tmp, saturate);
            lunar_tensor_release(ctx, &tmp);
        } else {
            st = dbe->copy(ctx, dst, &view, saturate);
        }
        lunar_tensor_release(ctx, &view);
        return st;
    }
    /* different devices: make a contiguous source of dst's dtype, move the bytes, then place
     * them into dst (directly when dst is contiguous) */
    lunar_tensor s_tmp = {0}, d_tmp = {0};
    const lunar_tensor *s_use = &view;
    if (view.dtype != dst->dtype || !lunar_tensor_is_contiguous(&view)) {
        st = lunar_tensor_new(ctx, &s_tmp, dst->dtype, sd, dst->ndim, dst->shape);
        if (st == LUNAR_OK) st = sbe->copy(ctx, &s_tmp, &view, saturate);
        s_use = &s_tmp;
    }
    lunar_tensor *d_use = dst;
    if (st == LUNAR_OK && !lunar_tensor_is_contiguous(dst)) {
        st = lunar_tensor_new(ctx, &d_tmp, dst->dtype, dd, dst->ndim, dst->shape);
        d_use = &d_tmp;
    }
    size_t n = lunar_tensor_nbytes(dst);
    if (st == LUNAR_OK && n > 0) {
        /* the debug devices cpu:N (N >= 1) take these paths too, as a GPU does (ctx.h) */
        if (lunar_device_is_host(sd)) {
            st = dbe->copy_from_host(ctx, dd.index, lunar_tensor_data(d_use), lunar_tensor_data(s_use), n);
            lunar_ctx_count_transfer(ctx, 0, n);
        } else if (lunar_device_is_host(dd)) {
            st = sbe->copy_to_host(ctx, sd.index, lunar_tensor_data(d_use), lunar_tensor_data(s_use), n);
            lunar_ctx_count_transfer(ctx, 1, n);
        } else {
            /* device to device through a host staging buffer */
            lunar_tensor h = {0};
            lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
            st = lunar_tensor_new(ctx, &h, dst->dtype, cpu, dst->ndim, dst->shape);
            if (st == LUNAR_OK) st = sbe->copy_to_host(ctx, sd.index, lunar_tensor_data(&h), lunar_tensor_data(s_use), n);
            if (st == LUNAR_OK) st = dbe->copy_from_host(ctx, dd.index, lunar_tensor_data(d_use), lunar_tensor_data(&h), n);
            lunar_ctx_count_transfer(ctx, 1, n);
            lunar_ctx_count_transfer(ctx, 0, n);
            lunar_tensor_release(ctx, &h);
        }
    }
    if (st == LUNAR_OK && d_use != dst) st = dbe->copy(ctx, dst, d_use, 0);
    lunar_tensor_release(ctx, &s_tmp);
    lunar_tensor_release(ctx, &d_tmp);
    lunar_tensor_release(ctx, &view);
    return st;
}

lunar_status lunar_copy(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src) {
    return copy_impl(ctx, dst, src, 0);
}

lunar_status lunar_copy_saturate(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src) {
    return copy_impl(ctx, dst, src, 1);
}

lunar_status lunar_fill(lunar_ctx *ctx, lunar_tensor *t, double value) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "fill", t));
    lunar_tensor w;
    if (lunar_tensor_is_contiguous(t)) return prep_end(&p, p.be->fill(ctx, t, value));
    prep_out(&p, &w, t, "tensor", t->dtype, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->fill(ctx, &w, value));
}

lunar_status lunar_arange(lunar_ctx *ctx, lunar_tensor *t, double start, double step) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "arange", t));
    lunar_tensor w;
    prep_out(&p, &w, t, "tensor", t->dtype, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->arange(ctx, &w, start, step));
}

lunar_status lunar_synchronize(lunar_ctx *ctx, lunar_device dev) {
    const lunar_backend *be = lunar_ctx_backend(ctx, dev.type);
    if (!be) return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "synchronize: backend not built");
    LUNAR_TRY(be->synchronize(ctx, dev.index));
    return lunar_sync_check(ctx, dev);   /* an explicit synchronisation is a check point (check.c) */
}
