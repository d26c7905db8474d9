/* adamw.c: one AdamW step on the CPU, in f32, following torch.optim.AdamW's single-tensor
 * update operation by operation, with torch's roundings (scalars computed in f64 and rounded
 * to f32; torch's CPU lerp and addcmul use one fused multiply-add):
 *     g  = grad * grad_scale
 *     p  = p * (1 - lr * wd)
 *     m  = lerp(m, g, 1 - beta1)                  = fma(1 - beta1, g - m, m)
 *     v  = v * beta2 + (1 - beta2) * g * g        = fma((1 - beta2) * g, g, v * beta2)
 *     p  = p + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * The fused multiply-adds are computed as an exact f64 product plus one rounding (the machine
 * may lack FMA), which differs from a true FMA only in rare double-rounding cases.
 * With a master copy the update reads and writes master, then param = master. Elementwise, so
 * the result does not depend on the thread count. */
#include <math.h>

#include "cpu.h"

/* a * b + c with the product exact (two f32 factors fit in f64) */
static inline float fma_f64(float a, float b, float c) { return (float)((double)a * (double)b + (double)c); }

lunar_status lunar_cpu_adamw_step(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master, lunar_tensor *m,
                                  lunar_tensor *v, const lunar_tensor *grad, const lunar_adamw_hparams *hp) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(param);
    float *pp = lunar_tensor_data(param);
    float *src = master ? lunar_tensor_data(master) : pp;   /* the f32 value being updated */
    float *mp = lunar_tensor_data(m), *vp = lunar_tensor_data(v);
    const float *gp = lunar_tensor_data(grad);
    double t = (double)hp->step;
    float gs = (float)hp->grad_scale;
    float decay = (float)(1.0 - hp->lr * hp->weight_decay);   /* exactly 1 when wd = 0 */
    float w1 = (float)(1.0 - hp->beta1);                      /* lerp weight */
    float b2 = (float)hp->beta2, w2 = (float)(1.0 - hp->beta2);
    float step_size = (float)(-(hp->lr / (1.0 - pow(hp->beta1, t))));
    float bc2_sqrt = (float)sqrt(1.0 - pow(hp->beta2, t));
    float eps = (float)hp->eps;
    int small = fabsf(w1) < 0.5f;
#pragma omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        float g = gp[i] * gs;
        float p = src[i] * decay;
        float mi = mp[i];
        mi = small ? fma_f64(w1, g - mi, mi) : fma_f64(w1 - 1.0f, g - mi, g);   /* torch.lerp */
        float vi = fma_f64(w2 * g, g, vp[i] * b2);
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p = p + step_size * mi / denom;
        mp[i] = mi;
        vp[i] = vi;
        src[i] = p;
        pp[i] = p;
    }
    return LUNAR_OK;
}
