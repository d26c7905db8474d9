// rope.cu: rotary position embedding on the GPU (same formulas as kernels/cpu/rope.c).
//
// x, out (T, H, D); positions (T) i64; inv_freq (R/2) f32. One thread per rotated pair or per
// copied channel: work item j < R/2 of row (t, h) rotates pair j, the others copy channel
// R + (j - R/2). angle = f32(position) * inv_freq[j] in f32; cos/sin in f32 (accurate sincosf,
// positions up to ~2^24), times scale. The host guarantees out does not alias x.
#include "common.cuh"
#include "rope_layout.h"   // kernels/: shared with the CPU kernel

template <typename T>
__global__ void rope_kernel(T *out, const T *x, const int64_t *pos, const float *freq, int64_t t_n, int64_t h_n,
                            int64_t d, int64_t half, int64_t in_step, int64_t in_second, int64_t out_step,
                            int64_t out_second, float scale, float sign) {
    int64_t per_row = half + (d - 2 * half);   // pairs, then copied channels
    LUNAR_GRID_STRIDE(k, t_n * h_n * per_row) {
        int64_t row = k / per_row, j = k % per_row;
        const T *xr = x + row * d;
        T *orow = out + row * d;
        if (j < half) {
            float angle = (float)pos[row / h_n] * freq[j];
            float s, c;
            sincosf(angle, &s, &c);
            c *= scale;
            s = sign * (s * scale);
            float a = lunar_to_f32(xr[j * in_step]), b = lunar_to_f32(xr[j * in_step + in_second]);
            orow[j * out_step] = lunar_from_f32<T>(a * c - b * s);
            orow[j * out_step + out_second] = lunar_from_f32<T>(b * c + a * s);
        } else {
            int64_t ch = 2 * half + (j - half);
            orow[ch] = xr[ch];
        }
    }
}

extern "C" lunar_status lunar_cuda_rope(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x,
                                        const lunar_tensor *positions, const lunar_tensor *inv_freq,
                                        lunar_rope_layout layout, float scale, int inverse) {
    int64_t t_n = x->shape[0], h_n = x->shape[1], d = x->shape[2], half = inv_freq->shape[0];
    int64_t work = t_n * h_n * (d - half);
    if (work == 0) return LUNAR_OK;
    lunar_rope_pairs pr = lunar_rope_pairs_for(layout, half, inverse);
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        rope_kernel<T><<<lunar_cuda_grid(work), LUNAR_CUDA_BLOCK, 0, stream>>>(
            (T *)lunar_tensor_data(out), (const T *)lunar_tensor_data(x), (const int64_t *)lunar_tensor_data(positions),
            (const float *)lunar_tensor_data(inv_freq), t_n, h_n, d, half, pr.in_step, pr.in_second, pr.out_step,
            pr.out_second,
            scale, inverse ? -1.0f : 1.0f));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "rope");
    return LUNAR_OK;
}
