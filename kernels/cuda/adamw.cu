// adamw.cu: one AdamW step on the GPU, elementwise in f32 with the same operations and
// roundings as kernels/cpu/adamw.c (torch.optim.AdamW; lerp and addcmul as fused multiply-adds). param (TP) and grad (TG) may have different float
// dtypes; m, v and master are f32. With master, the update reads and writes master and param
// receives its rounding; without, param is f32 (checked by the host).
#include "common.cuh"

template <typename TP, typename TG>
__global__ void adamw_kernel(TP *param, float *master, float *m, float *v, const TG *grad, int64_t n, float gs,
                             float decay, float w1, int small, float b2, float w2, float step_size, float bc2_sqrt,
                             float eps) {
    LUNAR_GRID_STRIDE(i, n) {
        float g = lunar_to_f32(grad[i]) * gs;
        float p = (master ? master[i] : lunar_to_f32(param[i])) * decay;
        float mi = m[i];
        mi = small ? __fmaf_rn(w1, g - mi, mi) : __fmaf_rn(w1 - 1.0f, g - mi, g);   // torch.lerp
        float vi = __fmaf_rn(w2 * g, g, v[i] * b2);                                 // addcmul
        float denom = __fdiv_rn(sqrtf(vi), bc2_sqrt) + eps;
        p = p + __fdiv_rn(step_size * mi, denom);                                   // addcdiv
        m[i] = mi;
        v[i] = vi;
        if (master) master[i] = p;
        param[i] = lunar_from_f32<TP>(p);
    }
}

extern "C" lunar_status lunar_cuda_adamw_step(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master,
                                              lunar_tensor *m, lunar_tensor *v, const lunar_tensor *grad,
                                              const lunar_adamw_hparams *hp) {
    int64_t n = lunar_tensor_numel(param);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, param, &stream);
    if (st != LUNAR_OK) return st;
    double t = (double)hp->step;
    float gs = (float)hp->grad_scale;
    float decay = (float)(1.0 - hp->lr * hp->weight_decay);
    float w1 = (float)(1.0 - hp->beta1);
    int small = fabsf(w1) < 0.5f;
    float b2 = (float)hp->beta2, w2 = (float)(1.0 - hp->beta2);
    float step_size = (float)(-(hp->lr / (1.0 - pow(hp->beta1, t))));
    float bc2_sqrt = (float)sqrt(1.0 - pow(hp->beta2, t));
    float eps = (float)hp->eps;
    float *mp = (float *)lunar_tensor_data(m), *vp = (float *)lunar_tensor_data(v);
    float *ms = master ? (float *)lunar_tensor_data(master) : NULL;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, param->dtype, TP,
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, grad->dtype, TG,
            adamw_kernel<TP, TG><<<lunar_cuda_grid(n), LUNAR_CUDA_BLOCK, 0, stream>>>(
                (TP *)lunar_tensor_data(param), ms, mp, vp, (const TG *)lunar_tensor_data(grad), n, gs, decay, w1,
                small, b2, w2, step_size, bc2_sqrt, eps)));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "adamw_step");
    return LUNAR_OK;
}
