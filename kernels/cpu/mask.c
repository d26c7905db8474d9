/* mask.c: CPU kernels (stub: not implemented yet). */
#include "cpu.h"

lunar_status lunar_cpu_causal_mask(lunar_ctx *ctx, lunar_tensor *out, int64_t offset) {
    (void)out;
    (void)offset;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "causal_mask is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_block_mask(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens, int causal) {
    (void)out;
    (void)cu_seqlens;
    (void)causal;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "block_mask is not implemented on the cpu backend yet");
}
