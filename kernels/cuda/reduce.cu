// reduce.cu: CUDA kernels (stub: not implemented yet).
#include "common.cuh"

extern "C" lunar_status lunar_cuda_reduce(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer, int64_t n, int64_t inner, lunar_reduce_op op) {
    (void)out;
    (void)x;
    (void)outer;
    (void)n;
    (void)inner;
    (void)op;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "reduce is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_reduce_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *x, const lunar_tensor *y, int64_t outer, int64_t n, int64_t inner, lunar_reduce_op op) {
    (void)dx;
    (void)dy;
    (void)x;
    (void)y;
    (void)outer;
    (void)n;
    (void)inner;
    (void)op;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "reduce_backward is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_max_dim(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x, int64_t outer, int64_t n, int64_t inner) {
    (void)values;
    (void)indices;
    (void)x;
    (void)outer;
    (void)n;
    (void)inner;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "max_dim is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_cumsum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer, int64_t n, int64_t inner, int reverse) {
    (void)out;
    (void)x;
    (void)outer;
    (void)n;
    (void)inner;
    (void)reverse;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "cumsum is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_global_norm(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *const *ts, int n) {
    (void)out;
    (void)ts;
    (void)n;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "global_norm is not implemented on the cuda backend yet");
}
