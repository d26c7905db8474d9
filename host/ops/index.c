/* index.c: embedding, index_select / index_add, gather / scatter / scatter_add, index_select_sum
 * (the MoE combine) and bincount (its per-expert counts).
 *
 * Index values are 0-based. An out-of-range value is an error naming the op, the value and the
 * valid range. Where it is checked and raised (ops.h, "check points"):
 *   - the host (cpu): here, before the kernel runs (the prepared index is i64 in host memory),
 *     and the op fails at once;
 *   - CUDA: in the kernel, which skips bad entries and records the first one in the device's
 *     range record; nothing is read back per op, and the next check point raises it;
 *   - the debug devices cpu:N model CUDA: the values are checked here, the first bad one is kept
 *     as the device's pending error (ctx.h) and the op skips its kernel (a gather writes 0s).
 * With check-each-op (ctx.h) every index op on a device ends with its check point.
 *
 * Dtypes: the tensor that is read from (weight, src) sets the compute dtype of gathers; the
 * tensor that accumulates (dweight, dst) sets it for scatters, so f32 gradients are not rounded
 * through a bf16 input. gather/scatter follow torch: index has the data's number of dims, and
 * the host narrows src (and dst) to index's shape in the dims other than dim before handing
 * contiguous (outer, n, inner) tensors to the backend.
 */
#include <stdio.h>
#include <string.h>

#include "prep.h"

/* The first value of the prepared i64 index outside [0, n) as *e; 0 when there is none. */
static int first_bad(lunar_prep *p, const lunar_tensor *idx, const lunar_tensor *data, const char *role, int dim,
                     lunar_range_error *e) {
    int64_t n = data->shape[dim];
    const int64_t *v = lunar_tensor_data(idx);
    int64_t k = lunar_tensor_numel(idx);
    for (int64_t i = 0; i < k; i++) {
        if (v[i] >= 0 && v[i] < n) continue;
        *e = (lunar_range_error){.op = p->op, .role = role, .dim = dim, .pos = i, .value = v[i], .n = n};
        snprintf(e->label, sizeof e->label, "%s", lunar_tensor_label(data));
        return 1;
    }
    return 0;
}

/* The values of the prepared i64 index against n = data->shape[dim]: 1 when the kernel may run
 * (all in range, or a CUDA index, which the kernel checks); 0 when one is not: the host fails
 * (p->st), a debug device keeps the error for its next check point. Called after every other
 * preparation of the op, just before its kernel: an op that fails for another reason records no
 * range error (as on CUDA, where no kernel would run). */
static int range_ok(lunar_prep *p, const lunar_tensor *idx, const lunar_tensor *data, const char *role, int dim) {
    if (p->st) return 0;
    if (p->dev.type != LUNAR_DEVICE_CPU) return 1;
    lunar_range_error e;
    if (!first_bad(p, idx, data, role, dim, &e)) return 1;
    if (lunar_device_is_host(p->dev)) p->st = lunar_range_error_fail(p->ctx, &e, p->dev, 0);
    else lunar_ctx_defer_range_error(p->ctx, p->dev, &e);
    return 0;
}

/* After the op: releases what prep holds, and with check-each-op (ctx.h) checks the device. */
static lunar_status index_end(lunar_prep *p, lunar_status st) {
    st = prep_end(p, st);
    if (st == LUNAR_OK && lunar_ctx_check_each_op(p->ctx) && !lunar_device_is_host(p->dev))
        st = lunar_sync_check(p->ctx, p->dev);
    return st;
}

static lunar_status shape_fail(lunar_prep *p, const char *why, const lunar_tensor *a, const char *ra,
                               const lunar_tensor *b, const char *rb) {
    if (p->st) return p->st;
    char sa[128], sb[128];
    lunar_tensor_shape_str(a, sa, sizeof sa);
    lunar_tensor_shape_str(b, sb, sizeof sb);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' %s and %s '%s' %s: %s", p->op, ra,
                              lunar_tensor_label(a), sa, rb, lunar_tensor_label(b), sb, why);
}

/* ---- embedding ---------------------------------------------------------------------------- */

/* out must be ids.shape + (C) */
static lunar_status check_embedding_shapes(lunar_prep *p, const lunar_tensor *out, const char *orole,
                                           const lunar_tensor *ids, const lunar_tensor *weight, const char *wrole) {
    if (p->st) return p->st;
    if (weight->ndim != 2) {
        char a[128];
        lunar_tensor_shape_str(weight, a, sizeof a);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' must be 2-dim (V, C), got %s", p->op, wrole,
                                  lunar_tensor_label(weight), a);
    }
    if (ids->ndim + 1 > LUNAR_MAX_DIMS) return shape_fail(p, "ids has too many dims", ids, "ids", weight, wrole);
    int64_t want[LUNAR_MAX_DIMS];
    for (int i = 0; i < ids->ndim; i++) want[i] = ids->shape[i];
    want[ids->ndim] = weight->shape[1];
    return prep_expect_shape(p, out, orole, ids->ndim + 1, want);
}

lunar_status lunar_embedding_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *ids,
                                     const lunar_tensor *weight) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "embedding_forward", weight));
    if (!p.be->embedding_forward) return prep_end(&p, prep_unsupported(&p));
    prep_check(&p, out, "out");
    prep_expect_float(&p, out, "out");
    prep_check(&p, ids, "ids");
    prep_expect_index(&p, ids, "ids");
    prep_expect_float(&p, weight, "weight");
    check_embedding_shapes(&p, out, "out", ids, weight, "weight");
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, weight->dtype);
    lunar_tensor iw, ww, ow;
    prep_in(&p, &iw, ids, "ids", LUNAR_DTYPE_I64);
    prep_in(&p, &ww, weight, "weight", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    int ok = range_ok(&p, &iw, weight, "weight", 0);
    if (p.st) return prep_end(&p, p.st);
    return index_end(&p, ok ? p.be->embedding_forward(ctx, &ow, &iw, &ww) : p.be->fill(ctx, &ow, 0.0));
}

lunar_status lunar_embedding_backward(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout,
                                      const lunar_tensor *ids) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "embedding_backward", dweight));
    if (!p.be->embedding_backward) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, dweight, "dweight");
    prep_check(&p, dout, "dout");
    prep_expect_float(&p, dout, "dout");
    prep_check(&p, ids, "ids");
    prep_expect_index(&p, ids, "ids");
    check_embedding_shapes(&p, dout, "dout", ids, dweight, "dweight");
    if (p.st) return prep_end(&p, p.st);
    lunar_dtype dt = prep_compute_dtype(&p, dweight->dtype);
    lunar_tensor iw, dw, dow;
    prep_in(&p, &iw, ids, "ids", LUNAR_DTYPE_I64);
    prep_in(&p, &dow, dout, "dout", dt);
    prep_out(&p, &dw, dweight, "dweight", dt, 1);
    if (p.st) return prep_end(&p, p.st);
    int ok = range_ok(&p, &iw, dweight, "dweight", 0);
    if (p.st) return prep_end(&p, p.st);
    return index_end(&p, ok ? p.be->embedding_backward(ctx, &dw, &dow, &iw) : LUNAR_OK);
}

/* ---- index_select / index_add --------------------------------------------------------------- */

/* other must be data's shape with dim replaced by numel(index); index 1-dim */
static lunar_status check_index_dim(lunar_prep *p, const lunar_tensor *data, const char *rdata, int *dim,
                                    const lunar_tensor *index, const lunar_tensor *other, const char *rother) {
    if (p->st) return p->st;
    if (data->ndim < 1) return shape_fail(p, "data must have at least 1 dim", data, rdata, index, "index");
    if (prep_dim(p, data, rdata, dim)) return p->st;
    if (index->ndim != 1) return shape_fail(p, "index must be 1-dim", index, "index", data, rdata);
    int64_t want[LUNAR_MAX_DIMS];
    memcpy(want, data->shape, sizeof want);
    want[*dim] = index->shape[0];
    return prep_expect_shape(p, other, rother, data->ndim, want);
}

lunar_status lunar_index_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim,
                                const lunar_tensor *index) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "index_select", src));
    if (!p.be->index_select) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, src, "src");
    prep_check(&p, out, "out");
    prep_expect_float(&p, out, "out");
    prep_check(&p, index, "index");
    prep_expect_index(&p, index, "index");
    check_index_dim(&p, src, "src", &dim, index, out, "out");
    if (p.st) return prep_end(&p, p.st);
    int64_t outer, n, inner;
    prep_split_dim(src, dim, &outer, &n, &inner);
    lunar_dtype dt = prep_compute_dtype(&p, src->dtype);
    lunar_tensor iw, sw, ow;
    prep_in(&p, &iw, index, "index", LUNAR_DTYPE_I64);
    prep_in(&p, &sw, src, "src", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    int ok = range_ok(&p, &iw, src, "src", dim);
    if (p.st) return prep_end(&p, p.st);
    return index_end(&p, ok ? p.be->index_select(ctx, &ow, &sw, &iw, outer, n, inner) : p.be->fill(ctx, &ow, 0.0));
}

lunar_status lunar_index_add(lunar_ctx *ctx, lunar_tensor *dst, int dim, const lunar_tensor *index,
                             const lunar_tensor *src, double alpha) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "index_add", dst));
    if (!p.be->index_add) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, dst, "dst");
    prep_check(&p, src, "src");
    prep_expect_float(&p, src, "src");
    prep_check(&p, index, "index");
    prep_expect_index(&p, index, "index");
    check_index_dim(&p, dst, "dst", &dim, index, src, "src");
    if (p.st) return prep_end(&p, p.st);
    int64_t outer, n, inner;
    prep_split_dim(dst, dim, &outer, &n, &inner);
    lunar_dtype dt = prep_compute_dtype(&p, dst->dtype);
    lunar_tensor iw, sw, dw;
    prep_in(&p, &iw, index, "index", LUNAR_DTYPE_I64);
    prep_in(&p, &sw, src, "src", dt);
    prep_out(&p, &dw, dst, "dst", dt, 1);
    if (p.st) return prep_end(&p, p.st);
    int ok = range_ok(&p, &iw, dst, "dst", dim);
    if (p.st) return prep_end(&p, p.st);
    return index_end(&p, ok ? p.be->index_add(ctx, &dw, &iw, &sw, alpha, outer, n, inner) : LUNAR_OK);
}

/* ---- gather / scatter --------------------------------------------------------------------- */

/* index must have data's ndim and, in every dim (other than dim when skip_dim), a size <= data's */
static lunar_status check_like_index(lunar_prep *p, const lunar_tensor *index, const lunar_tensor *data,
                                     const char *rdata, int dim, int skip_dim) {
    if (p->st) return p->st;
    if (index->ndim != data->ndim)
        return shape_fail(p, "index must have as many dims as the data", index, "index", data, rdata);
    for (int d = 0; d < data->ndim; d++) {
        if (skip_dim && d == dim) continue;
        if (index->shape[d] > data->shape[d]) {
            char why[160];
            snprintf(why, sizeof why, "index is larger than %s in dim %d (%lld > %lld)", rdata, d,
                     (long long)index->shape[d], (long long)data->shape[d]);
            return shape_fail(p, why, index, "index", data, rdata);
        }
    }
    return LUNAR_OK;
}

/* view = t narrowed to index's shape in every dim except `dim` (all dims when dim < 0) */
static lunar_status narrow_to(lunar_prep *p, lunar_tensor *view, const lunar_tensor *t, const lunar_tensor *index,
                              int dim) {
    memset(view, 0, sizeof *view);
    if (p->st) return p->st;
    lunar_tensor_share(view, t);
    for (int d = 0; d < t->ndim; d++) {
        if (d == dim || view->shape[d] == index->shape[d]) continue;
        view->shape[d] = index->shape[d];   /* a narrow from 0 only changes the size */
    }
    return LUNAR_OK;
}

lunar_status lunar_gather(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim,
                          const lunar_tensor *index) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "gather", src));
    if (!p.be->gather) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, src, "src");
    prep_check(&p, out, "out");
    prep_expect_float(&p, out, "out");
    prep_check(&p, index, "index");
    prep_expect_index(&p, index, "index");
    if (!p.st && src->ndim < 1) shape_fail(&p, "src must have at least 1 dim", src, "src", index, "index");
    prep_dim(&p, src, "src", &dim);
    check_like_index(&p, index, src, "src", dim, 1);
    if (!p.st) prep_expect_shape(&p, out, "out", index->ndim, index->shape);
    if (p.st) return prep_end(&p, p.st);
    int64_t outer, n_idx, inner, n_data = src->shape[dim];
    prep_split_dim(index, dim, &outer, &n_idx, &inner);
    lunar_dtype dt = prep_compute_dtype(&p, src->dtype);
    lunar_tensor sv, iw, sw, ow;
    narrow_to(&p, &sv, src, index, dim);
    prep_in(&p, &iw, index, "index", LUNAR_DTYPE_I64);
    prep_in(&p, &sw, &sv, "src", dt);
    prep_out(&p, &ow, out, "out", dt, 0);
    int ok = range_ok(&p, &iw, src, "src", dim);
    lunar_status st = p.st ? p.st
                      : ok ? p.be->gather(ctx, &ow, &sw, &iw, outer, n_data, n_idx, inner)
                           : p.be->fill(ctx, &ow, 0.0);
    st = index_end(&p, st);
    lunar_tensor_release(ctx, &sv);
    return st;
}

static lunar_status scatter_impl(lunar_ctx *ctx, const char *op, lunar_tensor *dst, int dim,
                                 const lunar_tensor *index, const lunar_tensor *src, int accumulate) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, op, dst));
    if (!p.be->scatter) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, dst, "dst");
    prep_check(&p, src, "src");
    prep_expect_float(&p, src, "src");
    prep_check(&p, index, "index");
    prep_expect_index(&p, index, "index");
    if (!p.st && dst->ndim < 1) shape_fail(&p, "dst must have at least 1 dim", dst, "dst", index, "index");
    prep_dim(&p, dst, "dst", &dim);
    check_like_index(&p, index, dst, "dst", dim, 1);
    check_like_index(&p, index, src, "src", dim, 0);
    if (p.st) return prep_end(&p, p.st);
    int64_t outer, n_idx, inner, n_data = dst->shape[dim];
    prep_split_dim(index, dim, &outer, &n_idx, &inner);
    lunar_dtype dt = prep_compute_dtype(&p, dst->dtype);
    lunar_tensor dv, sv, iw, sw, dw;
    narrow_to(&p, &dv, dst, index, dim);
    narrow_to(&p, &sv, src, index, -1);
    prep_in(&p, &iw, index, "index", LUNAR_DTYPE_I64);
    prep_in(&p, &sw, &sv, "src", dt);
    prep_out(&p, &dw, &dv, "dst", dt, 1);
    int ok = range_ok(&p, &iw, dst, "dst", dim);
    lunar_status st = p.st ? p.st
                      : ok ? p.be->scatter(ctx, &dw, &iw, &sw, outer, n_data, n_idx, inner, accumulate)
                           : LUNAR_OK;
    st = index_end(&p, st);
    lunar_tensor_release(ctx, &dv);
    lunar_tensor_release(ctx, &sv);
    return st;
}

lunar_status lunar_scatter(lunar_ctx *ctx, lunar_tensor *dst, int dim, const lunar_tensor *index,
                           const lunar_tensor *src) {
    return scatter_impl(ctx, "scatter", dst, dim, index, src, 0);
}

lunar_status lunar_scatter_add(lunar_ctx *ctx, lunar_tensor *dst, int dim, const lunar_tensor *index,
                               const lunar_tensor *src) {
    return scatter_impl(ctx, "scatter_add", dst, dim, index, src, 1);
}

/* ---- index_select_sum, bincount ----------------------------------------------------------- */

lunar_status lunar_index_select_sum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                    const lunar_tensor *index, int accumulate) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "index_select_sum", out));
    if (!p.be->index_select_sum) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, out, "out");
    prep_check(&p, src, "src");
    prep_expect_float(&p, src, "src");
    prep_check(&p, index, "index");
    prep_expect_index(&p, index, "index");
    if (!p.st && src->ndim != 2) shape_fail(&p, "src must be 2-dim (rows, C)", src, "src", index, "index");
    if (!p.st && index->ndim != 2) shape_fail(&p, "index must be 2-dim (N, K)", index, "index", src, "src");
    /* one dtype: a device computing in out's dtype would round a wider src before the sum, where
     * the CPU rounds once */
    if (!p.st && src->dtype != out->dtype)
        p.st = LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "index_select_sum: src '%s' is %s but out '%s' is %s: give both one dtype",
                          lunar_tensor_label(src), lunar_dtype_name(src->dtype), lunar_tensor_label(out),
                          lunar_dtype_name(out->dtype));
    if (!p.st) {
        int64_t want[2] = {index->shape[0], src->shape[1]};
        prep_expect_shape(&p, out, "out", 2, want);
    }
    if (p.st) return prep_end(&p, p.st);
    /* out accumulates, so it sets the dtype (as dst does for index_add) */
    lunar_dtype dt = prep_compute_dtype(&p, out->dtype);
    lunar_tensor iw, sw, ow;
    prep_in(&p, &iw, index, "index", LUNAR_DTYPE_I64);
    prep_in(&p, &sw, src, "src", dt);
    prep_out(&p, &ow, out, "out", dt, accumulate);
    if (p.st) return prep_end(&p, p.st);
    /* nothing to sum: no kernel runs on any device, so none checks the index either */
    if (lunar_tensor_numel(out) == 0) return prep_end(&p, LUNAR_OK);
    int ok = range_ok(&p, &iw, src, "src", 0);
    if (p.st) return prep_end(&p, p.st);
    if (!ok) return index_end(&p, accumulate ? LUNAR_OK : p.be->fill(ctx, &ow, 0.0));
    return index_end(&p, p.be->index_select_sum(ctx, &ow, &sw, &iw, accumulate));
}

lunar_status lunar_bincount(lunar_ctx *ctx, lunar_tensor *counts, const lunar_tensor *values) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "bincount", counts));
    if (!p.be->bincount) return prep_end(&p, prep_unsupported(&p));
    prep_expect_index(&p, counts, "counts");
    prep_check(&p, values, "values");
    prep_expect_index(&p, values, "values");
    if (!p.st && counts->ndim != 1) shape_fail(&p, "counts must be 1-dim (one per bin)", counts, "counts", values, "values");
    if (p.st) return prep_end(&p, p.st);
    lunar_tensor vw, cw;
    prep_in(&p, &vw, values, "values", LUNAR_DTYPE_I64);
    prep_out(&p, &cw, counts, "counts", LUNAR_DTYPE_I64, 0);
    if (p.st) return prep_end(&p, p.st);
    if (lunar_tensor_numel(counts) == 0) {
        /* no bin: every value is out of range, on every device, without looking at them */
        if (lunar_tensor_numel(values) > 0)
            return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "bincount: values '%s' has %lld entries but counts '%s' "
                                           "has no bin to count them in", lunar_tensor_label(values),
                                           (long long)lunar_tensor_numel(values), lunar_tensor_label(counts)));
        return prep_end(&p, LUNAR_OK);
    }
    int ok = range_ok(&p, &vw, counts, "counts", 0);
    if (p.st) return prep_end(&p, p.st);
    return index_end(&p, ok ? p.be->bincount(ctx, &cw, &vw) : p.be->fill(ctx, &cw, 0.0));
}
