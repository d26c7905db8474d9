// norm.cu: CUDA kernels (stub: not implemented yet).
#include "common.cuh"

extern "C" lunar_status lunar_cuda_rmsnorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *rstd, const lunar_tensor *x, const lunar_tensor *w, float eps) {
    (void)out;
    (void)rstd;
    (void)x;
    (void)w;
    (void)eps;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "rmsnorm_forward is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_rmsnorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout, const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *rstd) {
    (void)dx;
    (void)dout;
    (void)x;
    (void)w;
    (void)rstd;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "rmsnorm_backward_input is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_rmsnorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, const lunar_tensor *dout, const lunar_tensor *x, const lunar_tensor *rstd) {
    (void)dw;
    (void)dout;
    (void)x;
    (void)rstd;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "rmsnorm_backward_params is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_layernorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *mean, lunar_tensor *rstd, const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *b, float eps) {
    (void)out;
    (void)mean;
    (void)rstd;
    (void)x;
    (void)w;
    (void)b;
    (void)eps;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "layernorm_forward is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_layernorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout, const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *mean, const lunar_tensor *rstd) {
    (void)dx;
    (void)dout;
    (void)x;
    (void)w;
    (void)mean;
    (void)rstd;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "layernorm_backward_input is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_layernorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, lunar_tensor *db, const lunar_tensor *dout, const lunar_tensor *x, const lunar_tensor *mean, const lunar_tensor *rstd) {
    (void)dw;
    (void)db;
    (void)dout;
    (void)x;
    (void)mean;
    (void)rstd;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "layernorm_backward_params is not implemented on the cuda backend yet");
}
