/* fp8.c: FP8 block dequantisation on the CPU (contract in lunar/backend.h). */
#include "cpu.h"

lunar_status lunar_cpu_fp8_block_dequant(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *q,
                                         const lunar_tensor *scale_inv, int64_t block_m, int64_t block_n) {
    (void)ctx;
    int64_t m = q->shape[0], n = q->shape[1], sn = scale_inv->shape[1];
    const uint8_t *qd = lunar_tensor_data(q);      // (M, N)
    const float *sd = lunar_tensor_data(scale_inv);  // (ceil(M/bm), ceil(N/bn))
    float *od = lunar_tensor_data(out);              // (M, N)
    /* all 256 codes decoded once: the loop below is a table lookup and a multiply */
    float lut[256];
    int e5m2 = q->dtype == LUNAR_DTYPE_F8E5M2;
    for (int c = 0; c < 256; c++) lut[c] = e5m2 ? lunar_f8e5m2_to_f32((uint8_t)c) : lunar_f8e4m3_to_f32((uint8_t)c);
#pragma omp parallel for schedule(static) if (m * n >= LUNAR_CPU_PAR_MIN)
    for (int64_t i = 0; i < m; i++) {
        const float *srow = sd + (i / block_m) * sn;
        const uint8_t *qrow = qd + i * n;
        float *orow = od + i * n;
        for (int64_t j0 = 0; j0 < n; j0 += block_n) {
            float s = srow[j0 / block_n];
            int64_t j1 = j0 + block_n < n ? j0 + block_n : n;
            for (int64_t j = j0; j < j1; j++) orow[j] = lut[qrow[j]] * s;
        }
    }
    return LUNAR_OK;
}
