// elementwise.cu: CUDA kernels (stub: not implemented yet).
#include "common.cuh"

extern "C" lunar_status lunar_cuda_binary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, const lunar_tensor *b, lunar_binary_op op) {
    (void)out;
    (void)a;
    (void)b;
    (void)op;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "binary is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_binary_scalar(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, double s, lunar_binary_op op) {
    (void)out;
    (void)a;
    (void)s;
    (void)op;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "binary_scalar is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_unary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, lunar_unary_op op) {
    (void)out;
    (void)x;
    (void)op;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "unary is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_unary_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *x, lunar_unary_op op) {
    (void)dx;
    (void)dy;
    (void)x;
    (void)op;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "unary_backward is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_swiglu_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *gate, const lunar_tensor *up) {
    (void)out;
    (void)gate;
    (void)up;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "swiglu_forward is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_swiglu_backward(lunar_ctx *ctx, lunar_tensor *dgate, lunar_tensor *dup, const lunar_tensor *dout, const lunar_tensor *gate, const lunar_tensor *up) {
    (void)dgate;
    (void)dup;
    (void)dout;
    (void)gate;
    (void)up;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "swiglu_backward is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_masked_fill(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, const lunar_tensor *mask, double value) {
    (void)out;
    (void)x;
    (void)mask;
    (void)value;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "masked_fill is not implemented on the cuda backend yet");
}
