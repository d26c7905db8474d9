// common.cuh: what every CUDA kernel file shares: error checks that return a status (never
// exit), the per-device stream and cuBLAS handles, element load/store for f32/bf16/f16, and
// a dtype dispatch macro. Launchers run on the stream of the device their tensors live on.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda.h"
#include "lunar/dtype.h"

#define LUNAR_CUDA_BLOCK 256
#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// Return a status naming the failed call; the message goes into ctx.
#define LUNAR_CUDA_CHECK(ctx, expr)                                                             \
    do {                                                                                        \
        cudaError_t e_ = (expr);                                                                \
        if (e_ != cudaSuccess)                                                                  \
            return LUNAR_FAIL((ctx), LUNAR_ERR_CUDA, "%s: %s", #expr, cudaGetErrorString(e_));  \
    } while (0)

#define LUNAR_CUBLAS_CHECK(ctx, expr)                                                           \
    do {                                                                                        \
        cublasStatus_t s_ = (expr);                                                             \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                        \
            return LUNAR_FAIL((ctx), LUNAR_ERR_CUDA, "%s: cuBLAS status %d", #expr, (int)s_);   \
    } while (0)

// After a launch: configuration errors show up here, not at the launch.
#define LUNAR_CUDA_LAUNCH_CHECK(ctx, name)                                                      \
    do {                                                                                        \
        cudaError_t e_ = cudaGetLastError();                                                    \
        if (e_ != cudaSuccess)                                                                  \
            return LUNAR_FAIL((ctx), LUNAR_ERR_CUDA, "%s launch: %s", (name), cudaGetErrorString(e_)); \
    } while (0)

// Per-device state kept in the context (lunar_ctx_backend_state). Created on first use.
typedef struct lunar_cuda_range lunar_cuda_range;
typedef struct lunar_cuda_device {
    int               ready;
    cudaStream_t      stream;
    cublasHandle_t    cublas;
    cublasLtHandle_t  cublaslt;
    void             *workspace;       // cuBLASLt workspace
    size_t            workspace_bytes;
    lunar_cuda_range *range;           // index range errors (range_error.cuh)
} lunar_cuda_device;

typedef struct lunar_cuda_state {
    int               count;           // -1 until queried
    char              count_error[256];   // why cudaGetDeviceCount failed ("" when it did not)
    lunar_cuda_device dev[LUNAR_MAX_CUDA_DEVICES];
} lunar_cuda_state;

// Makes `device` current and returns its state (stream, handles).
extern "C" lunar_status lunar_cuda_device_get(lunar_ctx *ctx, int device, lunar_cuda_device **out);

// For a launcher: makes the tensor's device current and gives its stream.
static inline lunar_status lunar_cuda_stream_for(lunar_ctx *ctx, const lunar_tensor *t, cudaStream_t *stream) {
    lunar_cuda_device *d;
    lunar_status st = lunar_cuda_device_get(ctx, lunar_tensor_device(t).index, &d);
    if (st != LUNAR_OK) return st;
    *stream = d->stream;
    return LUNAR_OK;
}

static inline unsigned lunar_cuda_grid(int64_t n, int block = LUNAR_CUDA_BLOCK) {
    int64_t g = CEIL_DIV(n, (int64_t)block);
    if (g < 1) g = 1;
    if (g > 65535LL * 32) g = 65535LL * 32;   // grid-stride loops cover the rest
    return (unsigned)g;
}

// ---- element access: kernels compute in f32 and store in the tensor's type ----------------
// The conversions are lunar/dtype.h's, the CPU's own, so both backends write the same bits. CUDA's
// __float2bfloat16_rn and __float2half_rn write every NaN as 0x7fff; lunar, like torch, writes
// 0x7fc0 (bf16) and 0x7e00 | sign (f16). __host__ as well, so that tests/cuda can run these very
// functions on the host against the CPU's.

__host__ __device__ __forceinline__ float lunar_to_f32(float v) { return v; }
__host__ __device__ __forceinline__ float lunar_to_f32(__nv_bfloat16 v) { return lunar_bf16_to_f32(__bfloat16_as_ushort(v)); }
__host__ __device__ __forceinline__ float lunar_to_f32(__half v) {
#ifdef __CUDA_ARCH__
    // every finite f16 is an f32, so the hardware conversion is exact and gives the same bits
    // (about 18 instructions where lunar's takes 67, inside attention's inner loops); only
    // infinities and NaNs (exponent 31) take lunar's path, which keeps the NaN's payload
    if ((__half_as_ushort(v) & 0x7c00u) != 0x7c00u) return __half2float(v);
#endif
    return lunar_f16_to_f32(__half_as_ushort(v));
}

template <typename T> __host__ __device__ __forceinline__ T lunar_from_f32(float v);
template <> __host__ __device__ __forceinline__ float lunar_from_f32<float>(float v) { return v; }
template <> __host__ __device__ __forceinline__ __nv_bfloat16 lunar_from_f32<__nv_bfloat16>(float v) {
    return __ushort_as_bfloat16(lunar_f32_to_bf16(v));
}
template <> __host__ __device__ __forceinline__ __half lunar_from_f32<__half>(float v) {
    return __ushort_as_half(lunar_f32_to_f16(v));
}

// Runs the statement with T bound to the C++ type of float dtype dt (f32, bf16 or f16).
#define LUNAR_CUDA_DISPATCH_FLOAT(ctx, dt, T, ...)                                              \
    do {                                                                                        \
        switch (dt) {                                                                           \
        case LUNAR_DTYPE_F32: { typedef float T; __VA_ARGS__; break; }                          \
        case LUNAR_DTYPE_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; break; }                 \
        case LUNAR_DTYPE_F16: { typedef __half T; __VA_ARGS__; break; }                         \
        default:                                                                                \
            return LUNAR_FAIL((ctx), LUNAR_ERR_DTYPE, "cuda: unsupported float dtype %s",       \
                              lunar_dtype_name(dt));                                            \
        }                                                                                       \
    } while (0)

#define LUNAR_GRID_STRIDE(i, n)                                                                 \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                   \
         i += (int64_t)blockDim.x * gridDim.x)
