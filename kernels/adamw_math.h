/* adamw_math.h: one element of an AdamW step, shared by the CPU and CUDA kernels (LUNAR_HD), so
 * both backends run the same operations in the same order with the same roundings. It follows
 * torch.optim.AdamW's single-tensor update operation by operation (scalars computed in f64 and
 * rounded to f32; torch's CPU lerp and addcmul use one fused multiply-add):
 *     g  = grad * grad_scale
 *     p  = p * (1 - lr * wd)
 *     m  = lerp(m, g, 1 - beta1)                  = fma(1 - beta1, g - m, m)
 *     v  = v * beta2 + (1 - beta2) * g * g        = fma((1 - beta2) * g, g, v * beta2)
 *     p  = p + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * Every f32 operation is one IEEE operation rounded to nearest (hd.h: never fused with a
 * neighbour; nvcc used to fuse p * decay into the last add, one rounding where the CPU has two).
 * The two fused multiply-adds are an exact f64 product plus one f64 rounding, then the rounding
 * to f32 (the CPU may lack FMA); this differs from a true f32 FMA only in rare double-rounding
 * cases, the same way on both backends. tests/cuda/check_adamw_ptx.sh checks that the compiled
 * CUDA kernel contains no f32 fused multiply-add. */
#ifndef LUNAR_KERNELS_ADAMW_MATH_H
#define LUNAR_KERNELS_ADAMW_MATH_H

#include <math.h>

#include "lunar/hd.h"
#include "lunar/ops.h"

/* the per-step scalars, rounded to f32 once on the host */
typedef struct lunar_adamw_scalars {
    float grad_scale;
    float decay;       /* 1 - lr * wd: exactly 1 when wd = 0 */
    float w1;          /* lerp weight 1 - beta1 */
    int   small_w1;    /* |w1| < 0.5: torch's lerp uses m + w (g - m), else g - (1 - w) (g - m) */
    float b2, w2;      /* beta2, 1 - beta2 */
    float step_size;   /* -lr / (1 - beta1^t) */
    float bc2_sqrt;    /* sqrt(1 - beta2^t) */
    float eps;
} lunar_adamw_scalars;

static inline lunar_adamw_scalars lunar_adamw_scalars_for(const lunar_adamw_hparams *hp) {
    double t = (double)hp->step;
    lunar_adamw_scalars s;
    s.grad_scale = (float)hp->grad_scale;
    s.decay = (float)(1.0 - hp->lr * hp->weight_decay);
    s.w1 = (float)(1.0 - hp->beta1);
    s.small_w1 = fabsf(s.w1) < 0.5f;
    s.b2 = (float)hp->beta2;
    s.w2 = (float)(1.0 - hp->beta2);
    s.step_size = (float)(-(hp->lr / (1.0 - pow(hp->beta1, t))));
    s.bc2_sqrt = (float)sqrt(1.0 - pow(hp->beta2, t));
    s.eps = (float)hp->eps;
    return s;
}

/* a * b + c with the product exact (two f32 factors fit in f64) and one f64 rounding */
LUNAR_HD float lunar_adamw_fma(float a, float b, float c) {
    return (float)lunar_hd_mul_add((double)a, (double)b, (double)c);
}

/* The new value of p (the f32 value being updated: the param or its master copy) for gradient
 * grad; *m and *v are updated. */
LUNAR_HD float lunar_adamw_element(float p, float grad, float *m, float *v, const lunar_adamw_scalars *s) {
    float g = lunar_hd_mulf(grad, s->grad_scale);
    p = lunar_hd_mulf(p, s->decay);
    float gm = lunar_hd_subf(g, *m);
    float mi = s->small_w1 ? lunar_adamw_fma(s->w1, gm, *m) : lunar_adamw_fma(lunar_hd_subf(s->w1, 1.0f), gm, g);
    float vi = lunar_adamw_fma(lunar_hd_mulf(s->w2, g), g, lunar_hd_mulf(*v, s->b2));
    float denom = lunar_hd_addf(lunar_hd_divf(lunar_hd_sqrtf(vi), s->bc2_sqrt), s->eps);
    *m = mi;
    *v = vi;
    return lunar_hd_addf(p, lunar_hd_divf(lunar_hd_mulf(s->step_size, mi), denom));
}

#endif
