// adamw.cu: one AdamW step on the GPU: the element update of kernels/adamw_math.h, shared with
// kernels/cpu/adamw.c, so both backends give the same bits (every f32 operation explicitly
// rounded, never fused; tests/cuda/check_adamw_ptx.sh checks the compiled kernel). param (TP)
// and grad (TG) may have different float dtypes; m, v and master are f32. With master, the
// update reads and writes master and param receives its rounding; without, param is f32
// (checked by the host).
#include "adamw_math.h"
#include "common.cuh"

template <typename TP, typename TG>
__global__ void adamw_kernel(TP *param, float *master, float *m, float *v, const TG *grad, int64_t n,
                             lunar_adamw_scalars s) {
    LUNAR_GRID_STRIDE(i, n) {
        float mi = m[i], vi = v[i];
        float p = lunar_adamw_element(master ? master[i] : lunar_to_f32(param[i]), lunar_to_f32(grad[i]), &mi, &vi, &s);
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
    const lunar_adamw_scalars s = lunar_adamw_scalars_for(hp);
    float *mp = (float *)lunar_tensor_data(m), *vp = (float *)lunar_tensor_data(v);
    float *ms = master ? (float *)lunar_tensor_data(master) : NULL;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, param->dtype, TP,
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, grad->dtype, TG,
            adamw_kernel<TP, TG><<<lunar_cuda_grid(n), LUNAR_CUDA_BLOCK, 0, stream>>>(
                (TP *)lunar_tensor_data(param), ms, mp, vp, (const TG *)lunar_tensor_data(grad), n, s)));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "adamw_step");
    return LUNAR_OK;
}
