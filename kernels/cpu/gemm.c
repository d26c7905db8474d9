/* gemm.c: CPU kernels (stub: not implemented yet). */
#include "cpu.h"

lunar_status lunar_cpu_gemm(lunar_ctx *ctx, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b, int trans_a, int trans_b, float alpha, float beta) {
    (void)c;
    (void)a;
    (void)b;
    (void)trans_a;
    (void)trans_b;
    (void)alpha;
    (void)beta;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "gemm is not implemented on the cpu backend yet");
}
