/* attention_paged.c: decode attention over a paged KV cache (the contract is in lunar/ops.h; the
 * kernels are kernels/cpu/attention_paged.c and kernels/cuda/attention_paged.cu).
 *
 * The cache tensors k and v go to the backend as they are, in their own dtype (the whole cache:
 * a copy per call would cost more than the attention), as 2-D views with a unit stride along the
 * row; only a cache view without one is copied. q and o are small and take the compute dtype of
 * k's dtype. Block ids and lengths of a CPU tensor are checked here, before the kernel, as
 * index.c checks indices: the host (cpu) fails at once; a debug device (cpu:N, standing in for a
 * GPU) keeps the first bad value for its next check point and writes zeros, as a CUDA kernel
 * that skips a bad sequence does.
 */
#include <stdio.h>

#include "prep.h"

static lunar_status fail_shape(lunar_prep *p, const lunar_tensor *t, const char *role, const char *want) {
    if (p->st) return p->st;
    char sh[128];
    lunar_tensor_shape_str(t, sh, sizeof sh);
    return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' has shape %s, expected %s", p->op, role,
                              lunar_tensor_label(t), sh, want);
}

/* a valid index tensor of shape (a) or (a, b) (b < 0: any) */
static lunar_status index_shape(lunar_prep *p, const lunar_tensor *t, const char *role, int ndim, int64_t a,
                                int64_t b, const char *want) {
    if (p->st) return p->st;
    if (prep_check(p, t, role) || prep_expect_index(p, t, role)) return p->st;
    if (t->ndim != ndim || t->shape[0] != a || (ndim == 2 && b >= 0 && t->shape[1] != b) ||
        (ndim == 2 && t->shape[1] < 1))
        return fail_shape(p, t, role, want);
    return LUNAR_OK;
}

/* unit stride along the row and a row stride that keeps rows apart */
static int rows_ok(const lunar_tensor *t) {
    return (t->shape[1] == 1 || t->stride[1] == 1) && (t->shape[0] == 1 || t->stride[0] >= t->shape[1]);
}

/* The first block id outside [0, nblocks) or length outside [1, max_len] of the prepared i64
 * table and lengths, as *e; 0 when there is none. */
static int first_bad(lunar_prep *p, const lunar_tensor *table, const lunar_tensor *tw, const lunar_tensor *lengths,
                     const lunar_tensor *lw, const lunar_tensor *k, int64_t nblocks, int64_t max_len,
                     lunar_range_error *e) {
    const int64_t *t = lunar_tensor_data(tw), *l = lunar_tensor_data(lw);
    int64_t nt = lunar_tensor_numel(tw), nl = lunar_tensor_numel(lw);
    for (int64_t i = 0; i < nt; i++) {
        if (t[i] >= 0 && t[i] < nblocks) continue;
        *e = (lunar_range_error){.op = p->op, .role = "k (blocks of the cache)", .dim = 0, .pos = i, .value = t[i],
                                 .n = nblocks};
        snprintf(e->label, sizeof e->label, "%s", lunar_tensor_label(k));
        return 1;
    }
    for (int64_t i = 0; i < nl; i++) {
        if (l[i] >= 1 && l[i] <= max_len) continue;
        /* as an index: length - 1 must address one of the table's max_len positions */
        *e = (lunar_range_error){.op = p->op, .role = "the positions of table (lengths - 1)", .dim = 1, .pos = i,
                                 .value = l[i] - 1, .n = max_len};
        snprintf(e->label, sizeof e->label, "%s", lunar_tensor_label(table));
        return 1;
    }
    (void)lengths;
    return 0;
}

lunar_status lunar_attention_paged(lunar_ctx *ctx, lunar_tensor *o, const lunar_tensor *q, const lunar_tensor *k,
                                   const lunar_tensor *v, const lunar_tensor *table, const lunar_tensor *lengths,
                                   const lunar_tensor *keys, int64_t block_size, float scale) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "attention_paged", q));
    if (!p.be->attention_paged) return prep_end(&p, prep_unsupported(&p));
    const lunar_tensor *fl[4] = {q, k, v, o};
    const char *fr[4] = {"q", "k", "v", "o"};
    const char *fw[4] = {"3 dims (B, NH, Dq)", "2 dims (cache rows, Hk * Dq)", "2 dims (cache rows, Hk * Dv)",
                         "3 dims (B, NH, Dv)"};
    for (int i = 0; i < 4 && !p.st; i++) {
        if (prep_check(&p, fl[i], fr[i]) || prep_expect_float(&p, fl[i], fr[i])) break;
        if (fl[i]->ndim != (i == 1 || i == 2 ? 2 : 3)) fail_shape(&p, fl[i], fr[i], fw[i]);
    }
    if (p.st) return prep_end(&p, p.st);
    int64_t B = q->shape[0], NH = q->shape[1], Dq = q->shape[2], R = k->shape[0];
    char want[160];
    if (block_size < 1)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "attention_paged: block_size is %lld, must be >= 1",
                                       (long long)block_size));
    if (NH < 1 || Dq < 1 || k->shape[1] % Dq != 0 || k->shape[1] == 0 || NH % (k->shape[1] / Dq) != 0) {
        snprintf(want, sizeof want, "(rows, Hk * %lld) with Hk >= 1 dividing NH = %lld", (long long)Dq,
                 (long long)NH);
        return prep_end(&p, fail_shape(&p, k, "k", want));
    }
    int64_t Hk = k->shape[1] / Dq;
    if (R % block_size != 0 || R == 0) {
        snprintf(want, sizeof want, "rows a positive multiple of block_size %lld", (long long)block_size);
        return prep_end(&p, fail_shape(&p, k, "k", want));
    }
    if (v->shape[0] != R || v->shape[1] % Hk != 0 || v->shape[1] == 0) {
        snprintf(want, sizeof want, "(%lld, Hk * Dv) with Hk = %lld (k's rows and key heads)", (long long)R,
                 (long long)Hk);
        return prep_end(&p, fail_shape(&p, v, "v", want));
    }
    int64_t Dv = v->shape[1] / Hk;
    int64_t osh[3] = {B, NH, Dv};
    if (prep_expect_shape(&p, o, "o", 3, osh)) return prep_end(&p, p.st);
    if (k->dtype != v->dtype)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "attention_paged: k '%s' is %s and v '%s' is %s; the "
                                       "cache tensors must share a dtype", lunar_tensor_label(k),
                                       lunar_dtype_name(k->dtype), lunar_tensor_label(v), lunar_dtype_name(v->dtype)));
    if (k->dtype != LUNAR_DTYPE_F32 && k->dtype != LUNAR_DTYPE_BF16 && k->dtype != LUNAR_DTYPE_F16)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "attention_paged: k '%s' is %s; the cache must be f32, "
                                       "bf16 or f16", lunar_tensor_label(k), lunar_dtype_name(k->dtype)));
    snprintf(want, sizeof want, "(B, NB) = (%lld, NB >= 1)", (long long)B);
    index_shape(&p, table, "table", 2, B, -1, want);
    snprintf(want, sizeof want, "(B) = (%lld)", (long long)B);
    index_shape(&p, lengths, "lengths", 1, B, 0, want);
    if (keys) {
        snprintf(want, sizeof want, "(B, K) = (%lld, K >= 1)", (long long)B);
        index_shape(&p, keys, "keys", 2, B, -1, want);
    }
    if (p.st) return prep_end(&p, p.st);
    if (B == 0) return prep_end(&p, LUNAR_OK);

    lunar_dtype dt = prep_compute_dtype(&p, k->dtype);
    lunar_tensor qw, ow, kw, vw, tw, lw, xw;
    prep_in(&p, &qw, q, "q", dt);
    const lunar_tensor *kp = k, *vp = v;
    if (!rows_ok(k)) kp = prep_in(&p, &kw, k, "k", k->dtype) ? NULL : &kw;
    if (!rows_ok(v)) vp = prep_in(&p, &vw, v, "v", v->dtype) ? NULL : &vw;
    prep_in(&p, &tw, table, "table", LUNAR_DTYPE_I64);
    prep_in(&p, &lw, lengths, "lengths", LUNAR_DTYPE_I64);
    if (keys) prep_in(&p, &xw, keys, "keys", LUNAR_DTYPE_I64);
    prep_out(&p, &ow, o, "o", dt, 0);
    if (p.st) return prep_end(&p, p.st);
    if (p.dev.type == LUNAR_DEVICE_CPU) {
        lunar_range_error e;
        if (first_bad(&p, table, &tw, lengths, &lw, k, R / block_size, table->shape[1] * block_size, &e)) {
            if (lunar_device_is_host(p.dev)) return prep_end(&p, lunar_range_error_fail(ctx, &e, p.dev, 0));
            lunar_ctx_defer_range_error(ctx, p.dev, &e);
            return prep_end(&p, lunar_fill(ctx, &ow, 0.0));
        }
    }
    lunar_status st = p.be->attention_paged(ctx, &ow, &qw, kp, vp, &tw, &lw, keys ? &xw : NULL, block_size, scale);
    st = prep_end(&p, st);
    if (st == LUNAR_OK && lunar_ctx_check_each_op(ctx) && !lunar_device_is_host(lunar_tensor_device(q)))
        st = lunar_sync_check(ctx, lunar_tensor_device(q));
    return st;
}
