// mask.cu: CUDA kernels (stub: not implemented yet).
#include "common.cuh"

extern "C" lunar_status lunar_cuda_causal_mask(lunar_ctx *ctx, lunar_tensor *out, int64_t offset) {
    (void)out;
    (void)offset;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "causal_mask is not implemented on the cuda backend yet");
}

extern "C" lunar_status lunar_cuda_block_mask(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens, int causal) {
    (void)out;
    (void)cu_seqlens;
    (void)causal;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "block_mask is not implemented on the cuda backend yet");
}
