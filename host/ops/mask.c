/* mask.c: causal and block-diagonal (packed sequence) attention masks. */
#include "prep.h"

static lunar_status check_mask_out(lunar_prep *p, const lunar_tensor *out) {
    if (p->st) return p->st;
    if (out->ndim != 2) {
        char sh[128];
        lunar_tensor_shape_str(out, sh, sizeof sh);
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_SHAPE, "%s: out '%s' must be 2-dim (Tq, Tk), got %s", p->op,
                                  lunar_tensor_label(out), sh);
    }
    if (!lunar_dtype_is_float(out->dtype) && out->dtype != LUNAR_DTYPE_BOOL && out->dtype != LUNAR_DTYPE_U8)
        return p->st = LUNAR_FAIL(p->ctx, LUNAR_ERR_DTYPE, "%s: out '%s' must be float or bool, not %s", p->op,
                                  lunar_tensor_label(out), lunar_dtype_name(out->dtype));
    return LUNAR_OK;
}

/* Masks are written in the output dtype directly: bool/u8 (1 = visible) or float (0 / -inf);
 * a float dtype the backend does not take is produced in f32 and converted. */
static lunar_dtype mask_dtype(const lunar_prep *p, lunar_dtype dt) {
    if (dt == LUNAR_DTYPE_BOOL || dt == LUNAR_DTYPE_U8) return dt;
    return prep_compute_dtype(p, dt);
}

lunar_status lunar_causal_mask(lunar_ctx *ctx, lunar_tensor *out, int64_t offset) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "causal_mask", out));
    if (!p.be->causal_mask) return prep_end(&p, prep_unsupported(&p));
    lunar_tensor o;
    check_mask_out(&p, out);
    prep_out(&p, &o, out, "out", mask_dtype(&p, out->dtype), 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->causal_mask(ctx, &o, offset));
}

lunar_status lunar_block_mask(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens, int causal) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "block_mask", out));
    if (!p.be->block_mask) return prep_end(&p, prep_unsupported(&p));
    lunar_tensor o, cu;
    check_mask_out(&p, out);
    prep_check(&p, cu_seqlens, "cu_seqlens");
    prep_expect_index(&p, cu_seqlens, "cu_seqlens");
    if (!p.st && (cu_seqlens->ndim != 1 || cu_seqlens->shape[0] < 2 || out->shape[0] != out->shape[1])) {
        char a[128], b[128];
        lunar_tensor_shape_str(cu_seqlens, a, sizeof a);
        lunar_tensor_shape_str(out, b, sizeof b);
        p.st = LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "block_mask: cu_seqlens %s must be (S+1) with S >= 1 and out %s square (T, T)",
                          a, b);
    }
    prep_in(&p, &cu, cu_seqlens, "cu_seqlens", LUNAR_DTYPE_I64);
    prep_out(&p, &o, out, "out", mask_dtype(&p, out->dtype), 0);
    if (p.st) return prep_end(&p, p.st);
    /* the boundaries are small: validate them on the host so kernels can trust them */
    int64_t s = cu.shape[0];
    int64_t *host = NULL, host_buf[64];
    lunar_tensor hcopy = {0};
    if (lunar_device_is_host(lunar_tensor_device(&cu))) {
        host = lunar_tensor_data(&cu);
    } else {
        lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
        if (s <= 64) {
            lunar_status st = p.be->copy_to_host(ctx, lunar_tensor_device(&cu).index, host_buf, lunar_tensor_data(&cu),
                                                 (size_t)s * 8);
            if (st) return prep_end(&p, st);
            lunar_ctx_count_transfer(ctx, 1, (size_t)s * 8);
            host = host_buf;
        } else {
            lunar_status st = lunar_tensor_new(ctx, &hcopy, LUNAR_DTYPE_I64, cpu, 1, &s);
            if (!st) st = lunar_copy(ctx, &hcopy, &cu);
            if (st) { lunar_tensor_release(ctx, &hcopy); return prep_end(&p, st); }
            host = lunar_tensor_data(&hcopy);
        }
    }
    lunar_status st = LUNAR_OK;
    if (host[0] != 0 || host[s - 1] != out->shape[0]) {
        st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "block_mask: cu_seqlens must start at 0 and end at T=%lld, got %lld..%lld",
                        (long long)out->shape[0], (long long)host[0], (long long)host[s - 1]);
    }
    for (int64_t i = 1; st == LUNAR_OK && i < s; i++)
        if (host[i] < host[i - 1])
            st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "block_mask: cu_seqlens decreases at entry %lld (%lld < %lld)",
                            (long long)i, (long long)host[i], (long long)host[i - 1]);
    lunar_tensor_release(ctx, &hcopy);
    if (st) return prep_end(&p, st);
    return prep_end(&p, p.be->block_mask(ctx, &o, &cu, causal));
}
