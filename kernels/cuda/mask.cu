// mask.cu: attention masks on the GPU. out (Tq, Tk) is bool/u8 (1 visible) or float (0 / -inf).
#include <math.h>

#include "common.cuh"

template <typename T>
__device__ __forceinline__ void put(T *out, int64_t i, bool visible) {
    out[i] = lunar_from_f32<T>(visible ? 0.0f : -INFINITY);
}
template <>
__device__ __forceinline__ void put<uint8_t>(uint8_t *out, int64_t i, bool visible) {
    out[i] = visible ? 1 : 0;
}

template <typename T>
__global__ void causal_mask_kernel(T *out, int64_t tq, int64_t tk, int64_t offset) {
    LUNAR_GRID_STRIDE(i, tq * tk) {
        int64_t q = i / tk, k = i % tk;
        put(out, i, k <= q + offset);
    }
}

template <typename T>
__global__ void block_mask_kernel(T *out, int64_t t, const int64_t *cu, int64_t s, int causal) {
    LUNAR_GRID_STRIDE(i, t * t) {
        int64_t q = i / t, k = i % t;
        int64_t lo = 0, hi = s;          // binary search: the document d with cu[d] <= q < cu[d+1]
        while (hi - lo > 1) {
            int64_t mid = (lo + hi) / 2;
            if (cu[mid] <= q) lo = mid; else hi = mid;
        }
        put(out, i, k >= cu[lo] && k < cu[lo + 1] && (!causal || k <= q));
    }
}

extern "C" lunar_status lunar_cuda_causal_mask(lunar_ctx *ctx, lunar_tensor *out, int64_t offset) {
    int64_t tq = out->shape[0], tk = out->shape[1];
    if (tq * tk == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(tq * tk);
    if (out->dtype == LUNAR_DTYPE_BOOL || out->dtype == LUNAR_DTYPE_U8) {
        causal_mask_kernel<<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>((uint8_t *)lunar_tensor_data(out), tq, tk, offset);
    } else {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, out->dtype, T,
            causal_mask_kernel<<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>((T *)lunar_tensor_data(out), tq, tk, offset));
    }
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "causal_mask");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_block_mask(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens,
                                              int causal) {
    int64_t t = out->shape[0], s = cu_seqlens->shape[0] - 1;
    if (t == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(t * t);
    const int64_t *cu = (const int64_t *)lunar_tensor_data(cu_seqlens);
    if (out->dtype == LUNAR_DTYPE_BOOL || out->dtype == LUNAR_DTYPE_U8) {
        block_mask_kernel<<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>((uint8_t *)lunar_tensor_data(out), t, cu, s, causal);
    } else {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, out->dtype, T,
            block_mask_kernel<<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>((T *)lunar_tensor_data(out), t, cu, s, causal));
    }
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "block_mask");
    return LUNAR_OK;
}
