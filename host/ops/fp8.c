/* fp8.c: block dequantisation of FP8 checkpoint weights (DeepSeek-V3 / GLM-5 layout):
 * out[i, j] = f32(q[i, j]) * scale_inv[i / block_m, j / block_n], in f32, rounded once to out's
 * dtype. q keeps its f8 dtype on the way to the backend; scale_inv goes as f32. */
#include "prep.h"

lunar_status lunar_fp8_block_dequant(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *q,
                                     const lunar_tensor *scale_inv, int64_t block_m, int64_t block_n) {
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, "fp8_block_dequant", out));
    if (!p.be->fp8_block_dequant) return prep_end(&p, prep_unsupported(&p));
    prep_expect_float(&p, out, "out");
    prep_check(&p, q, "q");
    prep_check(&p, scale_inv, "scale_inv");
    prep_expect_float(&p, scale_inv, "scale_inv");
    if (p.st) return prep_end(&p, p.st);
    if (q->dtype != LUNAR_DTYPE_F8E4M3 && q->dtype != LUNAR_DTYPE_F8E5M2)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "fp8_block_dequant: q '%s' must be f8e4m3 or f8e5m2, not %s",
                                       lunar_tensor_label(q), lunar_dtype_name(q->dtype)));
    if (block_m < 1 || block_n < 1)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "fp8_block_dequant: block sizes must be positive, got %lld x %lld",
                                       (long long)block_m, (long long)block_n));
    char qs[128], ss[128];
    lunar_tensor_shape_str(q, qs, sizeof qs);
    lunar_tensor_shape_str(scale_inv, ss, sizeof ss);
    if (q->ndim != 2)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "fp8_block_dequant: q '%s' must be 2-dim (M, N), got %s",
                                       lunar_tensor_label(q), qs));
    int64_t m = q->shape[0], n = q->shape[1];
    int64_t want[2] = {(m + block_m - 1) / block_m, (n + block_n - 1) / block_n};
    if (scale_inv->ndim != 2 || scale_inv->shape[0] != want[0] || scale_inv->shape[1] != want[1]) {
        char ws[64];
        lunar_shape_format(2, want, ws, sizeof ws);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                                       "fp8_block_dequant: scale_inv '%s' has shape %s, but q '%s' %s with %lldx%lld blocks "
                                       "needs %s",
                                       lunar_tensor_label(scale_inv), ss, lunar_tensor_label(q), qs, (long long)block_m,
                                       (long long)block_n, ws));
    }
    prep_expect_shape(&p, out, "out", 2, q->shape);
    lunar_tensor qw, sw, ow;
    prep_in(&p, &qw, q, "q", q->dtype);
    prep_in(&p, &sw, scale_inv, "scale_inv", LUNAR_DTYPE_F32);
    prep_out(&p, &ow, out, "out", prep_compute_dtype(&p, out->dtype), 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->fp8_block_dequant(ctx, &ow, &qw, &sw, block_m, block_n));
}
