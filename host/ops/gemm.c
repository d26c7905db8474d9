/* gemm.c: c = alpha * op(a) @ op(b) + beta * c, 2-D and batched.
 *
 * The backend contract for gemm is looser than for other ops (see backend.h), so that views
 * reach BLAS without copies: every matrix is handed over "row-major", i.e. with unit stride in
 * its last dim and a row stride (the leading dimension) of at least its column count. A view
 * whose unit stride is in the second-to-last dim instead (a transposed matrix) is handed over as
 * its transpose with the trans flag flipped; for c the whole product is transposed
 * (c^T = op(b)^T op(a)^T, so a and b swap). Only a matrix with no unit stride at all (or an
 * expanded one) is copied to a contiguous temporary.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "prep.h"

/* Shape "(3, 4)" of t and, if trans, a note that it is used transposed. */
static void describe(const lunar_tensor *t, int trans, char *buf, size_t n) {
    char sh[160];
    lunar_tensor_shape_str(t, sh, sizeof sh);
    snprintf(buf, n, "'%s' %s%s", lunar_tensor_label(t), sh, trans ? " (transposed)" : "");
}

static lunar_status shape_error(lunar_prep *p, const lunar_tensor *a, int ta, const lunar_tensor *b, int tb,
                                const char *why) {
    char x[200], y[200];
    describe(a, ta, x, sizeof x);
    describe(b, tb, y, sizeof y);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "gemm: a %s and b %s do not fit: %s", x, y, why);
}

/* Can the last two dims of t (R, C) be read as a row-major matrix (unit column stride, row
 * stride >= C)? Size-1 dims may have any stride. */
static int rowmajor_ok(const lunar_tensor *t) {
    int n = t->ndim;
    int64_t r = t->shape[n - 2], c = t->shape[n - 1], sr = t->stride[n - 2], sc = t->stride[n - 1];
    return (c == 1 || sc == 1) && (r == 1 || sr >= (c > 1 ? c : 1));
}

/* Like rowmajor_ok for the transpose (unit row stride). */
static int colmajor_ok(const lunar_tensor *t) {
    int n = t->ndim;
    int64_t r = t->shape[n - 2], c = t->shape[n - 1], sr = t->stride[n - 2], sc = t->stride[n - 1];
    return (r == 1 || sr == 1) && (c == 1 || sc >= (r > 1 ? r : 1));
}

/* The views below are borrowed: plain copies of the caller's tensor structs that take no
 * storage reference (the caller's tensors keep the storage alive for the whole call), so the
 * per-call overhead stays small for small matrices. */
static void borrow(lunar_tensor *v, const lunar_tensor *t) {
    v->storage = t->storage;
    v->dtype = t->dtype;
    v->ndim = t->ndim;
    v->offset = t->offset;
    memcpy(v->shape, t->shape, sizeof v->shape);
    memcpy(v->stride, t->stride, sizeof v->stride);
    memcpy(v->name, t->name, sizeof v->name);
}

/* *v = t with the last two dims swapped (borrowed). */
static void borrow_transposed(lunar_tensor *v, const lunar_tensor *t) {
    borrow(v, t);
    int n = t->ndim;
    v->shape[n - 2] = t->shape[n - 1];
    v->shape[n - 1] = t->shape[n - 2];
    v->stride[n - 2] = t->stride[n - 1];
    v->stride[n - 1] = t->stride[n - 2];
}

/* Gives size-1 dims of a row-major-readable view the strides BLAS expects (unit column stride,
 * row stride >= max(1, C)); strides of size-1 dims never address anything. */
static void canonical_strides(lunar_tensor *v) {
    int n = v->ndim;
    if (v->shape[n - 1] == 1) v->stride[n - 1] = 1;
    if (v->shape[n - 2] == 1) v->stride[n - 2] = v->shape[n - 1] > 1 ? v->shape[n - 1] : 1;
    if (n == 3 && v->shape[0] == 1) v->stride[0] = 0;
}

/* Does a row-major-readable t already have those strides (so it can be passed as it is)? */
static int is_canonical(const lunar_tensor *t) {
    int n = t->ndim;
    int64_t min_ld = t->shape[n - 1] > 1 ? t->shape[n - 1] : 1;
    return t->stride[n - 1] == 1 && (t->shape[n - 2] > 1 || t->stride[n - 2] >= min_ld) &&
           (n == 2 || t->shape[0] > 1 || t->stride[0] == 0);
}

/* An input matrix for the backend: a borrowed row-major view of src (possibly its transpose,
 * flipping *trans), or a contiguous copy (released by prep_end) when no view fits. */
static const lunar_tensor *gemm_input(lunar_prep *p, lunar_tensor *view, lunar_tensor *copy, const lunar_tensor *src,
                                      const char *role, lunar_dtype dt, int *trans) {
    if (p->st) return NULL;
    if (src->dtype == dt && rowmajor_ok(src)) {
        if (is_canonical(src)) return src;   /* the common case: no copy of the struct either */
        borrow(view, src);
    } else if (src->dtype == dt && colmajor_ok(src)) {
        borrow_transposed(view, src);
        *trans = !*trans;
    } else {
        if (prep_in(p, copy, src, role, dt)) return NULL;
        return copy;
    }
    canonical_strides(view);
    return view;
}

static int too_big(int64_t v) { return v > INT_MAX; }

lunar_status lunar_gemm(lunar_ctx *ctx, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                        int trans_a, int trans_b, float alpha, float beta) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "gemm", c));
    if (!p.be->gemm) return prep_end(&p, prep_unsupported(&p));
    trans_a = trans_a != 0;
    trans_b = trans_b != 0;
    prep_check(&p, a, "a");
    prep_check(&p, b, "b");
    prep_expect_float(&p, a, "a");
    prep_expect_float(&p, b, "b");
    prep_expect_float(&p, c, "c");
    if (p.st) return prep_end(&p, p.st);

    /* shapes: a (.., M, K) or (.., K, M), b (.., K, N) or (.., N, K), c (.., M, N) */
    if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3)
        return prep_end(&p, shape_error(&p, a, trans_a, b, trans_b, "both must be 2-dim or 3-dim (batched)"));
    int64_t batch = -1;
    if (a->ndim == 3) batch = a->shape[0];
    if (b->ndim == 3) {
        if (batch >= 0 && b->shape[0] != batch)
            return prep_end(&p, shape_error(&p, a, trans_a, b, trans_b, "batch sizes differ"));
        batch = b->shape[0];
    }
    int64_t m = a->shape[a->ndim - 2 + trans_a], ka = a->shape[a->ndim - 1 - trans_a];
    int64_t kb = b->shape[b->ndim - 2 + trans_b], n = b->shape[b->ndim - 1 - trans_b];
    if (ka != kb) {
        char why[128];
        snprintf(why, sizeof why, "inner dims differ (%lld vs %lld)", (long long)ka, (long long)kb);
        return prep_end(&p, shape_error(&p, a, trans_a, b, trans_b, why));
    }
    int64_t want[3];
    int wn = 0;
    if (batch >= 0) want[wn++] = batch;
    want[wn++] = m;
    want[wn++] = n;
    if (prep_expect_shape(&p, c, "c", wn, want)) return prep_end(&p, p.st);
    if (too_big(m) || too_big(n) || too_big(ka) || too_big(batch))
        return prep_end(&p, p.st = LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                                              "gemm: dims of c '%s' or k=%lld exceed the BLAS int range",
                                              lunar_tensor_label(c), (long long)ka));
    if (m == 0 || n == 0 || batch == 0) return prep_end(&p, LUNAR_OK);
    if (ka == 0) {
        /* no products: c = beta * c (c is not read when beta is 0, as in BLAS) */
        lunar_status st = beta == 0.0f ? lunar_fill(ctx, c, 0.0)
                                       : lunar_binary_scalar(ctx, c, c, beta, LUNAR_BINARY_MUL);
        return prep_end(&p, st);
    }

    /* dtypes: a and b share one the backend takes (else f32); c is that dtype or f32 */
    lunar_dtype in_dt = a->dtype == b->dtype ? prep_compute_dtype(&p, a->dtype) : LUNAR_DTYPE_F32;
    lunar_dtype c_dt = prep_compute_dtype(&p, c->dtype);
    if (c_dt != in_dt && c_dt != LUNAR_DTYPE_F32) c_dt = LUNAR_DTYPE_F32;

    /* c: written in place when BLAS can address it; a transposed c swaps the product */
    lunar_tensor cview, ccopy, aview, acopy, bview, bcopy;
    const lunar_tensor *x = a, *y = b;
    const char *xrole = "a", *yrole = "b";
    int tx = trans_a, ty = trans_b;
    lunar_tensor *cw;
    int c_batch_ok = c->ndim == 2 || c->shape[0] == 1 || c->stride[0] != 0;
    /* BLAS must not write memory it reads: a c that shares memory with a or b (out = a) gets a
     * temporary, copied into c at the end */
    int alias = lunar_tensor_overlaps(c, a) || lunar_tensor_overlaps(c, b);
    if (alias) {
        prep_temp(&p, &ccopy, c_dt, c->ndim, c->shape);
        if (!p.st && beta != 0.0f) {
            lunar_status st = p.be->copy(ctx, &ccopy, c, 0);
            if (st) p.st = st;
        }
        cw = &ccopy;
    } else if (c->dtype == c_dt && c_batch_ok && rowmajor_ok(c)) {
        if (is_canonical(c)) {
            cw = c;
        } else {
            borrow(&cview, c);
            cw = &cview;
        }
    } else if (c->dtype == c_dt && c_batch_ok && colmajor_ok(c)) {
        borrow_transposed(&cview, c);
        cw = &cview;
        x = b; y = a;
        xrole = "b"; yrole = "a";
        tx = !trans_b; ty = !trans_a;
    } else {
        prep_out(&p, &ccopy, c, "c", c_dt, beta != 0.0f);
        cw = &ccopy;
    }
    if (cw == &cview) canonical_strides(&cview);
    const lunar_tensor *xw = gemm_input(&p, &aview, &acopy, x, xrole, in_dt, &tx);
    const lunar_tensor *yw = gemm_input(&p, &bview, &bcopy, y, yrole, in_dt, &ty);
    lunar_status st = p.st;
    if (!st) {
        for (int i = 0; i < 3 && !st; i++) {
            const lunar_tensor *t = i == 0 ? cw : i == 1 ? xw : yw;
            for (int d = 0; d < t->ndim && !st; d++)
                if (too_big(t->stride[d]))
                    st = LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "gemm: a stride of '%s' exceeds the BLAS int range",
                                    lunar_tensor_label(t));
        }
    }
    if (!st) st = p.be->gemm(ctx, cw, xw, yw, tx, ty, alpha, beta);
    if (!st && alias) st = lunar_copy(ctx, c, &ccopy);
    return prep_end(&p, st);
}

/* ---- grouped --------------------------------------------------------------------------------- */

#define GROUP_CHUNK 128

/* Can item i go to the backend's grouped entry as borrowed views? (2-D, one dtype the backend
 * takes, consistent shapes, BLAS-addressable, c not overlapping a or b, int-sized.) Anything
 * else takes the plain per-product path, which also reports errors. */
static int group_item_ok(lunar_prep *p, lunar_tensor *cv, lunar_tensor *av, lunar_tensor *bv, int *ta, int *tb,
                         lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b, lunar_dtype dt) {
    if (prep_check(p, c, "c") || prep_check(p, a, "a") || prep_check(p, b, "b")) return 0;
    if (c->ndim != 2 || a->ndim != 2 || b->ndim != 2) return 0;
    if (a->dtype != dt || b->dtype != dt || c->dtype != dt) return 0;
    int64_t m = a->shape[*ta], ka = a->shape[1 - *ta], kb = b->shape[*tb], n = b->shape[1 - *tb];
    if (ka != kb || c->shape[0] != m || c->shape[1] != n || m < 1 || n < 1 || ka < 1) return 0;
    if (too_big(m) || too_big(n) || too_big(ka)) return 0;
    if (lunar_tensor_overlaps(c, a) || lunar_tensor_overlaps(c, b)) return 0;
    if (!rowmajor_ok(c)) return 0;
    borrow(cv, c);
    canonical_strides(cv);
    const lunar_tensor *in[2] = {a, b};
    lunar_tensor *out[2] = {av, bv};
    int *tr[2] = {ta, tb};
    for (int i = 0; i < 2; i++) {
        if (rowmajor_ok(in[i])) {
            borrow(out[i], in[i]);
        } else if (colmajor_ok(in[i])) {
            borrow_transposed(out[i], in[i]);
            *tr[i] = !*tr[i];
        } else {
            return 0;
        }
        canonical_strides(out[i]);
    }
    lunar_tensor *all[3] = {cv, av, bv};
    for (int i = 0; i < 3; i++)
        for (int d = 0; d < 2; d++)
            if (too_big(all[i]->stride[d])) return 0;
    return 1;
}

lunar_status lunar_gemm_grouped(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                const lunar_tensor *const *b, int trans_a, int trans_b, float alpha, float beta) {
    if (n <= 0) return LUNAR_OK;
    if (!c || !a || !b) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "gemm_grouped: missing tensor lists");
    trans_a = trans_a != 0;
    trans_b = trans_b != 0;
    for (int i0 = 0; i0 < n; i0 += GROUP_CHUNK) {
        int cnt = n - i0 < GROUP_CHUNK ? n - i0 : GROUP_CHUNK;
        lunar_tensor cv[GROUP_CHUNK], av[GROUP_CHUNK], bv[GROUP_CHUNK];
        lunar_tensor *cp[GROUP_CHUNK];
        const lunar_tensor *ap[GROUP_CHUNK], *bp[GROUP_CHUNK];
        int ta[GROUP_CHUNK], tb[GROUP_CHUNK];
        int grouped = 0;
        lunar_prep p;
        if (c[i0] && a[i0] && b[i0] && prep_begin(&p, ctx, "gemm_grouped", c[i0]) == LUNAR_OK) {
            lunar_dtype dt = prep_compute_dtype(&p, a[i0]->dtype);
            grouped = p.be->gemm_grouped != NULL;
            for (int j = 0; j < cnt && grouped; j++) {
                int i = i0 + j;
                ta[j] = trans_a, tb[j] = trans_b;
                grouped = c[i] && a[i] && b[i] &&
                          group_item_ok(&p, &cv[j], &av[j], &bv[j], &ta[j], &tb[j], c[i], a[i], b[i], dt);
                cp[j] = &cv[j], ap[j] = &av[j], bp[j] = &bv[j];
            }
            if (p.st) lunar_ctx_clear_error(ctx);   /* the per-product path reports it */
            p.st = LUNAR_OK;
            lunar_status st = grouped ? p.be->gemm_grouped(ctx, cnt, cp, ap, bp, ta, tb, alpha, beta) : LUNAR_OK;
            prep_end(&p, LUNAR_OK);
            if (st) return st;
        }
        if (!grouped)
            for (int j = 0; j < cnt; j++) {
                int i = i0 + j;
                if (!c[i] || !a[i] || !b[i])
                    return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "gemm_grouped: product %d is missing a tensor", i + 1);
                lunar_status st = lunar_gemm(ctx, c[i], a[i], b[i], trans_a, trans_b, alpha, beta);
                if (st) {
                    lunar_ctx_prefix_error(ctx, "gemm_grouped: product %d", i + 1);
                    return st;
                }
            }
    }
    return LUNAR_OK;
}
