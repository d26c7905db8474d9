/* rope.c: rotary position embedding, forward and backward (glm5-architecture.md section 4.4).
 *
 * x, out (T, H, D); positions (T) i32/i64; inv_freq (R/2) f32 with R <= D. The backward is the
 * same kernel with the rotation transposed (inverse = 1). When out shares storage with x the
 * input is copied first, so in-place calls are safe for every layout (INTERLEAVED_TO_HALF
 * moves channels, so a kernel cannot read and write one buffer). */
#include "prep.h"

static const char *layout_name(lunar_rope_layout l) {
    switch (l) {
    case LUNAR_ROPE_HALF: return "half";
    case LUNAR_ROPE_INTERLEAVED: return "interleaved";
    case LUNAR_ROPE_INTERLEAVED_TO_HALF: return "interleaved_to_half";
    default: return "?";
    }
}

static lunar_status rope_impl(lunar_ctx *ctx, const char *op, lunar_tensor *out, const lunar_tensor *x,
                              const lunar_tensor *positions, const lunar_tensor *inv_freq, lunar_rope_layout layout,
                              float scale, int inverse) {
    const char *xr = inverse ? "dout" : "x", *orole = inverse ? "dx" : "out";
    lunar_prep p;
    LUNAR_TRY(prep_begin(&p, ctx, op, x));
    if (!p.be->rope) return prep_end(&p, prep_unsupported(&p));
    prep_check(&p, x, xr);
    prep_expect_float(&p, x, xr);
    prep_check(&p, out, orole);
    prep_expect_float(&p, out, orole);
    prep_check(&p, positions, "positions");
    prep_expect_index(&p, positions, "positions");
    prep_check(&p, inv_freq, "inv_freq");
    prep_expect_float(&p, inv_freq, "inv_freq");
    if (p.st) return prep_end(&p, p.st);
    if ((int)layout < 0 || layout >= LUNAR_ROPE_LAYOUT_COUNT)
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: unknown layout %d", op, (int)layout));
    if (x->ndim != 3) {
        char a[128];
        lunar_tensor_shape_str(x, a, sizeof a);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "%s: %s '%s' must be (T, H, D), got %s", op, xr,
                                       lunar_tensor_label(x), a));
    }
    prep_expect_shape(&p, out, orole, 3, x->shape);
    prep_expect_shape(&p, positions, "positions", 1, x->shape);
    if (p.st) return prep_end(&p, p.st);
    if (inv_freq->ndim != 1 || 2 * inv_freq->shape[0] > x->shape[2]) {
        char a[128], b[128];
        lunar_tensor_shape_str(inv_freq, a, sizeof a);
        lunar_tensor_shape_str(x, b, sizeof b);
        return prep_end(&p, LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                                       "%s: inv_freq '%s' %s must be 1-dim (R/2) with R <= D for %s '%s' %s (layout %s)",
                                       op, lunar_tensor_label(inv_freq), a, xr, lunar_tensor_label(x), b,
                                       layout_name(layout)));
    }
    lunar_dtype dt = prep_compute_dtype(&p, x->dtype);
    lunar_tensor xw, pw, fw, ow;
    if (out->storage == x->storage) {
        /* in place (or overlapping): read from a private copy */
        prep_temp(&p, &xw, dt, x->ndim, x->shape);
        if (!p.st) {
            lunar_status st = p.be->copy(ctx, &xw, x, 0);
            if (st) return prep_end(&p, st);
        }
    } else {
        prep_in(&p, &xw, x, xr, dt);
    }
    prep_in(&p, &pw, positions, "positions", LUNAR_DTYPE_I64);
    prep_in(&p, &fw, inv_freq, "inv_freq", LUNAR_DTYPE_F32);
    prep_out(&p, &ow, out, orole, dt, 0);
    if (p.st) return prep_end(&p, p.st);
    return prep_end(&p, p.be->rope(ctx, &ow, &xw, &pw, &fw, layout, scale, inverse));
}

lunar_status lunar_rope_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x,
                                const lunar_tensor *positions, const lunar_tensor *inv_freq,
                                lunar_rope_layout layout, float scale) {
    return rope_impl(ctx, "rope_forward", out, x, positions, inv_freq, layout, scale, 0);
}

lunar_status lunar_rope_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                 const lunar_tensor *positions, const lunar_tensor *inv_freq,
                                 lunar_rope_layout layout, float scale) {
    return rope_impl(ctx, "rope_backward", dx, dout, positions, inv_freq, layout, scale, 1);
}
