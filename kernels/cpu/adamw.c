/* adamw.c: one AdamW step on the CPU, in f32: the element update of kernels/adamw_math.h
 * (torch.optim.AdamW's operations and roundings), which the CUDA kernel shares. With a master
 * copy the update reads and writes master, then param = master. Elementwise, so the result does
 * not depend on the thread count. */
#include "adamw_math.h"
#include "cpu.h"

lunar_status lunar_cpu_adamw_step(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master, lunar_tensor *m,
                                  lunar_tensor *v, const lunar_tensor *grad, const lunar_adamw_hparams *hp) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(param);
    float *pp = lunar_tensor_data(param);
    float *src = master ? lunar_tensor_data(master) : pp;   /* the f32 value being updated */
    float *mp = lunar_tensor_data(m), *vp = lunar_tensor_data(v);
    const float *gp = lunar_tensor_data(grad);
    lunar_adamw_scalars s = lunar_adamw_scalars_for(hp);
    /* firstprivate: a copy per thread that the stores cannot alias, so the loop vectorises */
#pragma omp parallel for schedule(static) firstprivate(s) if (n >= LUNAR_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        float p = lunar_adamw_element(src[i], gp[i], &mp[i], &vp[i], &s);
        src[i] = p;
        pp[i] = p;
    }
    return LUNAR_OK;
}
