// fp8.cu: FP8 block dequantisation on the GPU (contract in lunar/backend.h). The f8 decoding is
// the shared inline code of lunar/dtype.h, so the CPU and GPU give the same bits.
#include "common.cuh"

template <typename T>
__global__ void fp8_block_dequant_kernel(T *out, const uint8_t *q, const float *scale, int64_t m, int64_t n,
                                         int64_t sn, int64_t block_m, int64_t block_n, int e5m2) {
    LUNAR_GRID_STRIDE(idx, m * n) {
        int64_t i = idx / n, j = idx % n;
        float v = e5m2 ? lunar_f8e5m2_to_f32(q[idx]) : lunar_f8e4m3_to_f32(q[idx]);
        out[idx] = lunar_from_f32<T>(v * scale[(i / block_m) * sn + j / block_n]);
    }
}

extern "C" lunar_status lunar_cuda_fp8_block_dequant(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *q,
                                                     const lunar_tensor *scale_inv, int64_t block_m, int64_t block_n) {
    int64_t m = q->shape[0], n = q->shape[1], sn = scale_inv->shape[1];
    if (m * n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(m * n);
    const uint8_t *qd = (const uint8_t *)lunar_tensor_data(q);
    const float *sd = (const float *)lunar_tensor_data(scale_inv);
    int e5m2 = q->dtype == LUNAR_DTYPE_F8E5M2;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, out->dtype, T,
        fp8_block_dequant_kernel<<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>((T *)lunar_tensor_data(out), qd, sd, m, n, sn,
                                                                        block_m, block_n, e5m2));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "fp8_block_dequant");
    return LUNAR_OK;
}
