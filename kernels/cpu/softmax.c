/* softmax.c: CPU kernels (stub: not implemented yet). */
#include "cpu.h"

lunar_status lunar_cpu_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, int log) {
    (void)y;
    (void)x;
    (void)log;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "softmax_forward is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *y, int log) {
    (void)dx;
    (void)dy;
    (void)y;
    (void)log;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "softmax_backward is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_cross_entropy_forward(lunar_ctx *ctx, lunar_tensor *loss, lunar_tensor *logprobs, lunar_tensor *lse, const lunar_tensor *logits, const lunar_tensor *targets, int64_t ignore_index) {
    (void)loss;
    (void)logprobs;
    (void)lse;
    (void)logits;
    (void)targets;
    (void)ignore_index;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "cross_entropy_forward is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_cross_entropy_backward(lunar_ctx *ctx, lunar_tensor *dlogits, const lunar_tensor *dloss, const lunar_tensor *logits, const lunar_tensor *lse, const lunar_tensor *targets, int64_t ignore_index) {
    (void)dlogits;
    (void)dloss;
    (void)logits;
    (void)lse;
    (void)targets;
    (void)ignore_index;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "cross_entropy_backward is not implemented on the cpu backend yet");
}
