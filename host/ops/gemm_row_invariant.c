/* gemm_row_invariant.c: n products c[i] = alpha * a[i] @ op(b[i]) + beta * c[i] whose every
 * element is one dot product in a fixed order (the contract is in lunar/ops.h; the kernels are
 * kernels/cpu/gemm_row_invariant.c and kernels/cuda/gemm_row_invariant.cu).
 *
 * A batched (3-D) product is split into its 2-D products, as borrowed views. 2-D products whose
 * a, b and c are already what the backend reads (one dtype it takes, unit stride along each
 * row, c not overlapping a or b) go to it together (an MoE layer's experts: narrowed rows of one
 * sorted tensor and the experts' weights; the heads of a batched product). Any other product runs
 * on its own through contiguous copies of the compute dtype (prep_in / prep_out): the same
 * kernel, so the same bits.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "prep.h"

#define RI_GROUP 64   /* 2-D products handed to the backend per call at most */

/* the products gathered for one backend call, and the views they borrow */
typedef struct ri_group {
    lunar_tensor  cv[RI_GROUP], av[RI_GROUP], bv[RI_GROUP];
    lunar_tensor *c[RI_GROUP];
    const lunar_tensor *a[RI_GROUP], *b[RI_GROUP];
    int           n;
    lunar_dtype   dt;
} ri_group;

static lunar_status product_error(lunar_ctx *ctx, int i, const lunar_tensor *c, const lunar_tensor *a,
                                  const lunar_tensor *b, int trans_b, const char *why) {
    char sa[160], sb[160], sc[160];
    lunar_tensor_shape_str(a, sa, sizeof sa);
    lunar_tensor_shape_str(b, sb, sizeof sb);
    lunar_tensor_shape_str(c, sc, sizeof sc);
    return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                      "gemm_row_invariant: product %d: a '%s' %s, b '%s' %s and c '%s' %s do not fit a (M, K), "
                      "b %s, c (M, N): %s",
                      i, lunar_tensor_label(a), sa, lunar_tensor_label(b), sb, lunar_tensor_label(c), sc,
                      trans_b ? "(N, K)" : "(K, N)", why);
}

/* *v = the 2-D matrix at batch index bi of t (t itself when 2-D), borrowed: a struct copy that
 * takes no storage reference (the caller's tensors keep the storage alive for the call) */
static void matrix_at(lunar_tensor *v, const lunar_tensor *t, int64_t bi) {
    *v = *t;
    if (t->ndim == 3) {
        v->ndim = 2;
        v->offset = t->offset + bi * t->stride[0];
        v->shape[0] = t->shape[1], v->shape[1] = t->shape[2];
        v->stride[0] = t->stride[1], v->stride[1] = t->stride[2];
    }
}

/* unit stride along the row (dim 1) and a row stride that keeps rows apart */
static int rows_ok(const lunar_tensor *t) {
    int64_t r = t->shape[0], n = t->shape[1];
    return (n == 1 || t->stride[1] == 1) && (r == 1 || t->stride[0] >= n);
}

/* the checks of product i (1-based in messages); *batch: its 2-D products (0: nothing to do) */
static lunar_status check_product(lunar_prep *p, int i, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                                  int trans_b, int64_t *batch) {
    lunar_ctx *ctx = p->ctx;
    if (!c || !a || !b) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "gemm_row_invariant: product %d is missing a tensor", i);
    prep_check(p, a, "a");
    prep_check(p, b, "b");
    prep_check(p, c, "c");
    prep_expect_float(p, a, "a");
    prep_expect_float(p, b, "b");
    prep_expect_float(p, c, "c");
    if (p->st) {
        lunar_ctx_prefix_error(ctx, "gemm_row_invariant: product %d", i);
        return p->st;
    }
    if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3 || c->ndim < 2 || c->ndim > 3)
        return product_error(ctx, i, c, a, b, trans_b, "each must be 2-dim or 3-dim (batched)");
    int64_t nb = 1;
    int batched = a->ndim == 3 || b->ndim == 3;
    if (a->ndim == 3) nb = a->shape[0];
    if (b->ndim == 3) {
        if (a->ndim == 3 && b->shape[0] != nb) return product_error(ctx, i, c, a, b, trans_b, "batch sizes differ");
        nb = b->shape[0];
    }
    if ((c->ndim == 3) != batched || (batched && c->shape[0] != nb))
        return product_error(ctx, i, c, a, b, trans_b, "c's batch is not a's and b's");
    int da = a->ndim - 2, db = b->ndim - 2, dc = c->ndim - 2;
    int64_t m = a->shape[da], k = a->shape[da + 1];
    int64_t kb = b->shape[db + (trans_b ? 1 : 0)], n = b->shape[db + (trans_b ? 0 : 1)];
    if (k != kb) return product_error(ctx, i, c, a, b, trans_b, "a and b have different K");
    if (c->shape[dc] != m || c->shape[dc + 1] != n)
        return product_error(ctx, i, c, a, b, trans_b, "c is not (M, N)");
    const lunar_tensor *all[3] = {a, b, c};
    for (int t = 0; t < 3; t++)
        for (int d = 0; d < all[t]->ndim; d++)
            if (all[t]->shape[d] > INT_MAX || all[t]->stride[d] > INT_MAX)
                return product_error(ctx, i, c, a, b, trans_b, "a dim or stride exceeds the int range");
    *batch = m == 0 || n == 0 ? 0 : nb;
    return LUNAR_OK;
}

/* one 2-D product through contiguous copies of the compute dtype (or c = beta * c when K is 0) */
static lunar_status run_alone(lunar_ctx *ctx, int i, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                              int trans_b, float alpha, float beta) {
    if (a->shape[1] == 0)
        return beta == 0.0f ? lunar_fill(ctx, c, 0.0) : lunar_binary_scalar(ctx, c, c, beta, LUNAR_BINARY_MUL);
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "gemm_row_invariant", c));
    lunar_dtype dt = a->dtype == b->dtype ? prep_compute_dtype(&p, a->dtype) : LUNAR_DTYPE_F32;
    lunar_tensor aw, bw, cw;
    prep_in(&p, &aw, a, "a", dt);
    prep_in(&p, &bw, b, "b", dt);
    prep_out(&p, &cw, c, "c", dt, beta != 0.0f);
    lunar_status st = p.st;
    if (!st) {
        lunar_tensor *cp = &cw;
        const lunar_tensor *ap = &aw, *bp = &bw;
        st = p.be->gemm_row_invariant(ctx, 1, &cp, &ap, &bp, trans_b, alpha, beta);
    }
    st = prep_end(&p, st);
    if (st) lunar_ctx_prefix_error(ctx, "gemm_row_invariant: product %d", i);
    return st;
}

static lunar_status flush(lunar_ctx *ctx, const lunar_backend *be, ri_group *g, int trans_b, float alpha, float beta) {
    lunar_status st = g->n > 0 ? be->gemm_row_invariant(ctx, g->n, g->c, g->a, g->b, trans_b, alpha, beta) : LUNAR_OK;
    g->n = 0;
    return st;
}

lunar_status lunar_gemm_row_invariant(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                      const lunar_tensor *const *b, int trans_b, float alpha, float beta) {
    if (n <= 0) return LUNAR_OK;
    if (!c || !a || !b) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "gemm_row_invariant: missing tensor lists");
    if (!c[0]) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "gemm_row_invariant: product 1 is missing a tensor");
    trans_b = trans_b != 0;
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "gemm_row_invariant", c[0]));
    if (!p.be->gemm_row_invariant) return prep_end(&p, prep_unsupported(&p));
    _Static_assert(sizeof(ri_group) < 64 * 1024, "ri_group lives on the stack");
    ri_group g;
    g.n = 0;
    g.dt = LUNAR_DTYPE_F32;
    lunar_status st = LUNAR_OK;
    for (int i = 0; i < n && !st; i++) {
        int64_t nb = 0;
        st = check_product(&p, i + 1, c[i], a[i], b[i], trans_b, &nb);
        for (int64_t bi = 0; bi < nb && !st; bi++) {
            lunar_tensor *cv = &g.cv[g.n], *av = &g.av[g.n], *bv = &g.bv[g.n];
            matrix_at(cv, c[i], bi);
            matrix_at(av, a[i], bi);
            matrix_at(bv, b[i], bi);
            lunar_dtype dt = prep_compute_dtype(&p, av->dtype);
            int direct = av->dtype == dt && bv->dtype == dt && cv->dtype == dt && av->shape[1] > 0 && rows_ok(av) &&
                         rows_ok(bv) && rows_ok(cv) && !lunar_tensor_overlaps(cv, av) &&
                         !lunar_tensor_overlaps(cv, bv);
            if (!direct) {
                st = run_alone(ctx, i + 1, cv, av, bv, trans_b, alpha, beta);
                continue;
            }
            if (g.n > 0 && dt != g.dt) {   /* a backend call takes one dtype */
                lunar_tensor cs = *cv, as = *av, bs = *bv;
                if ((st = flush(ctx, p.be, &g, trans_b, alpha, beta))) break;
                g.cv[0] = cs, g.av[0] = as, g.bv[0] = bs;
            }
            g.dt = dt;
            g.c[g.n] = &g.cv[g.n], g.a[g.n] = &g.av[g.n], g.b[g.n] = &g.bv[g.n];
            if (++g.n == RI_GROUP) st = flush(ctx, p.be, &g, trans_b, alpha, beta);
        }
    }
    if (!st) st = flush(ctx, p.be, &g, trans_b, alpha, beta);
    return prep_end(&p, st);
}
