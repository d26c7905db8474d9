/* rope.c: rotary position embedding on the CPU (glm5-architecture.md section 4.4).
 *
 * x, out (T, H, D) f32; positions (T) i64; inv_freq (R/2) f32. Frequency i rotates one pair of
 * channels by angle = f32(position) * inv_freq[i] (an f32 product, as HF computes it), with
 * c = cos(angle) * scale and s = sin(angle) * scale in f32:
 *     out[a_out] = x[a_in] * c - x[b_in] * s
 *     out[b_out] = x[b_in] * c + x[a_in] * s
 * where the pair is (i, i + R/2) in and out for HALF, (2i, 2i + 1) in and out for INTERLEAVED,
 * and (2i, 2i + 1) in, (i, i + R/2) out for INTERLEAVED_TO_HALF. The backward (inverse = 1)
 * applies the transposed rotation (s -> -s) and swaps the in/out pairs. Channels R..D-1 are
 * copied. cos/sin are computed once per token and chunk of frequencies, for all heads.
 */
#include <math.h>

#include "cpu.h"
#include "rope_layout.h"   /* kernels/: shared with the CUDA kernel */

#define FREQ_CHUNK 128

lunar_status lunar_cpu_rope(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, const lunar_tensor *positions,
                            const lunar_tensor *inv_freq, lunar_rope_layout layout, float scale, int inverse) {
    (void)ctx;
    int64_t t_n = x->shape[0], h_n = x->shape[1], d = x->shape[2];
    int64_t half = inv_freq->shape[0], r = 2 * half;
    const float *xp = lunar_tensor_data(x);             /* (T, H, D) */
    const int64_t *pos = lunar_tensor_data(positions);  /* (T) */
    const float *freq = lunar_tensor_data(inv_freq);    /* (R/2) */
    float *op = lunar_tensor_data(out);                 /* (T, H, D) */
    lunar_rope_pairs pr = lunar_rope_pairs_for(layout, half, inverse);
    int64_t in_step = pr.in_step, in_second = pr.in_second, out_step = pr.out_step, out_second = pr.out_second;
    float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static) if (t_n * h_n * d >= LUNAR_CPU_PAR_MIN && t_n > 1)
    for (int64_t t = 0; t < t_n; t++) {
        float cs[FREQ_CHUNK], sn[FREQ_CHUNK];
        float p = (float)pos[t];
        for (int64_t i0 = 0; i0 < half; i0 += FREQ_CHUNK) {
            int64_t m = half - i0 < FREQ_CHUNK ? half - i0 : FREQ_CHUNK;
            for (int64_t j = 0; j < m; j++) {
                float angle = p * freq[i0 + j];
                cs[j] = cosf(angle) * scale;
                sn[j] = sign * (sinf(angle) * scale);
            }
            for (int64_t h = 0; h < h_n; h++) {
                const float *xr = xp + (t * h_n + h) * d;
                float *orow = op + (t * h_n + h) * d;
                for (int64_t j = 0; j < m; j++) {
                    int64_t i = i0 + j;
                    float a = xr[i * in_step], b = xr[i * in_step + in_second];
                    orow[i * out_step] = a * cs[j] - b * sn[j];
                    orow[i * out_step + out_second] = b * cs[j] + a * sn[j];
                }
            }
        }
        for (int64_t h = 0; h < h_n; h++) {
            const float *xr = xp + (t * h_n + h) * d;
            float *orow = op + (t * h_n + h) * d;
            for (int64_t i = r; i < d; i++) orow[i] = xr[i];
        }
    }
    return LUNAR_OK;
}
