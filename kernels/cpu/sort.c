/* sort.c: CPU kernels (stub: not implemented yet). */
#include "cpu.h"

lunar_status lunar_cpu_topk(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x, int64_t rows, int64_t n, int64_t k, int largest) {
    (void)values;
    (void)indices;
    (void)x;
    (void)rows;
    (void)n;
    (void)k;
    (void)largest;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "topk is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_argsort(lunar_ctx *ctx, lunar_tensor *indices, const lunar_tensor *x, int64_t rows, int64_t n, int descending) {
    (void)indices;
    (void)x;
    (void)rows;
    (void)n;
    (void)descending;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "argsort is not implemented on the cpu backend yet");
}
