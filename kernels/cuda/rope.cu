// rope.cu: CUDA kernels (stub: not implemented yet).
#include "common.cuh"

extern "C" lunar_status lunar_cuda_rope(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, const lunar_tensor *positions, const lunar_tensor *inv_freq, lunar_rope_layout layout, float scale, int inverse) {
    (void)out;
    (void)x;
    (void)positions;
    (void)inv_freq;
    (void)layout;
    (void)scale;
    (void)inverse;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "rope is not implemented on the cuda backend yet");
}
