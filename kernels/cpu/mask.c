/* mask.c: attention masks on the CPU. out (Tq, Tk) is bool/u8 (1 visible) or f32 (0 / -inf). */
#include <math.h>

#include "cpu.h"

static void put(lunar_tensor *out, int64_t i, int visible) {
    if (out->dtype == LUNAR_DTYPE_F32) ((float *)lunar_tensor_data(out))[i] = visible ? 0.0f : -INFINITY;
    else ((uint8_t *)lunar_tensor_data(out))[i] = (uint8_t)visible;
}

lunar_status lunar_cpu_causal_mask(lunar_ctx *ctx, lunar_tensor *out, int64_t offset) {
    (void)ctx;
    int64_t tq = out->shape[0], tk = out->shape[1];
#pragma omp parallel for schedule(static) if (tq * tk >= LUNAR_CPU_PAR_MIN)
    for (int64_t q = 0; q < tq; q++)
        for (int64_t k = 0; k < tk; k++) put(out, q * tk + k, k <= q + offset);
    return LUNAR_OK;
}

lunar_status lunar_cpu_block_mask(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens, int causal) {
    (void)ctx;
    int64_t t = out->shape[0], s = cu_seqlens->shape[0] - 1;
    const int64_t *cu = lunar_tensor_data(cu_seqlens);
#pragma omp parallel for schedule(static) if (t * t >= LUNAR_CPU_PAR_MIN)
    for (int64_t q = 0; q < t; q++) {
        int64_t d = 0;
        while (d < s && cu[d + 1] <= q) d++;   /* document of q: cu[d] <= q < cu[d+1] */
        int64_t lo = cu[d], hi = cu[d + 1];
        for (int64_t k = 0; k < t; k++) put(out, q * t + k, k >= lo && k < hi && (!causal || k <= q));
    }
    return LUNAR_OK;
}
