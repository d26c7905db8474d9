/* adamw.c: one AdamW step on the CPU, in f32, following torch.optim.AdamW's single-tensor
 * update operation by operation (scalars computed in f64 and rounded to f32 as torch does):
 *     g  = grad * grad_scale
 *     p  = p * (1 - lr * wd)
 *     m  = lerp(m, g, 1 - beta1)
 *     v  = v * beta2 + (1 - beta2) * g * g
 *     p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * With a master copy the update reads and writes master, then param = master. Elementwise, so
 * the result does not depend on the thread count. */
#include <math.h>

#include "cpu.h"

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
        mi = small ? mi + w1 * (g - mi) : g - (g - mi) * (1.0f - w1);   /* torch.lerp */
        float vi = vp[i] * b2;
        vi = vi + w2 * g * g;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p = p + step_size * (mi / denom);
        mp[i] = mi;
        vp[i] = vi;
        src[i] = p;
        pp[i] = p;
    }
    return LUNAR_OK;
}
