// copy.cu: strided copy with dtype conversion, fill, arange and random fills on the GPU.
//
// Conversions use the same inline functions as the CPU (lunar/dtype.h), so casts give the same
// bits on both backends. Each thread handles one destination element and unravels its index
// over the (at most 8) dims; strides may be 0 on the source (broadcast).
#include <cmath>

#include "common.cuh"

struct copy_layout {
    int     ndim;
    int64_t shape[LUNAR_MAX_DIMS];
    int64_t dstride[LUNAR_MAX_DIMS];
    int64_t sstride[LUNAR_MAX_DIMS];
};

__device__ __forceinline__ double load_as_f64(int dt, const char *p, int64_t i) {
    switch (dt) {
    case LUNAR_DTYPE_F32: return ((const float *)p)[i];
    case LUNAR_DTYPE_F64: return ((const double *)p)[i];
    case LUNAR_DTYPE_BF16: return lunar_bf16_to_f32(((const uint16_t *)p)[i]);
    case LUNAR_DTYPE_F16: return lunar_f16_to_f32(((const uint16_t *)p)[i]);
    case LUNAR_DTYPE_F8E4M3: return lunar_f8e4m3_to_f32(((const uint8_t *)p)[i]);
    case LUNAR_DTYPE_F8E5M2: return lunar_f8e5m2_to_f32(((const uint8_t *)p)[i]);
    case LUNAR_DTYPE_I8: return ((const int8_t *)p)[i];
    case LUNAR_DTYPE_I32: return ((const int32_t *)p)[i];
    case LUNAR_DTYPE_I64: return (double)((const int64_t *)p)[i];
    case LUNAR_DTYPE_U8: return ((const uint8_t *)p)[i];
    case LUNAR_DTYPE_BOOL: return ((const uint8_t *)p)[i] ? 1.0 : 0.0;
    default: return 0.0;
    }
}

__device__ __forceinline__ int64_t load_as_i64(int dt, const char *p, int64_t i) {
    switch (dt) {
    case LUNAR_DTYPE_I64: return ((const int64_t *)p)[i];
    case LUNAR_DTYPE_I32: return ((const int32_t *)p)[i];
    case LUNAR_DTYPE_I8: return ((const int8_t *)p)[i];
    case LUNAR_DTYPE_U8: return ((const uint8_t *)p)[i];
    case LUNAR_DTYPE_BOOL: return ((const uint8_t *)p)[i] != 0;
    default: return 0;
    }
}

__device__ __forceinline__ int64_t f64_to_i64(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775807.0) return INT64_MAX;
    if (v <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}

// Float sources go through f32 for every float destination except f64, as on the CPU.
__device__ __forceinline__ void store_from_f64(int dt, char *p, int64_t i, double v, int saturate, int via_f32) {
    float f = (float)v;
    switch (dt) {
    case LUNAR_DTYPE_F32: ((float *)p)[i] = f; break;
    case LUNAR_DTYPE_F64: ((double *)p)[i] = v; break;
    case LUNAR_DTYPE_BF16: ((uint16_t *)p)[i] = lunar_f32_to_bf16(f); break;
    case LUNAR_DTYPE_F16: ((uint16_t *)p)[i] = lunar_f32_to_f16(f); break;
    case LUNAR_DTYPE_F8E4M3: ((uint8_t *)p)[i] = saturate ? lunar_f32_to_f8e4m3_sat(f) : lunar_f32_to_f8e4m3(f); break;
    case LUNAR_DTYPE_F8E5M2: ((uint8_t *)p)[i] = saturate ? lunar_f32_to_f8e5m2_sat(f) : lunar_f32_to_f8e5m2(f); break;
    case LUNAR_DTYPE_BOOL: ((uint8_t *)p)[i] = via_f32 ? (f != 0.0f) : (v != 0.0); break;
    case LUNAR_DTYPE_I8: ((int8_t *)p)[i] = (int8_t)f64_to_i64(via_f32 ? (double)f : v); break;
    case LUNAR_DTYPE_I32: ((int32_t *)p)[i] = (int32_t)f64_to_i64(via_f32 ? (double)f : v); break;
    case LUNAR_DTYPE_I64: ((int64_t *)p)[i] = f64_to_i64(via_f32 ? (double)f : v); break;
    case LUNAR_DTYPE_U8: ((uint8_t *)p)[i] = (uint8_t)f64_to_i64(via_f32 ? (double)f : v); break;
    default: break;
    }
}

__device__ __forceinline__ void store_from_i64(int dt, char *p, int64_t i, int64_t v) {
    switch (dt) {
    case LUNAR_DTYPE_I64: ((int64_t *)p)[i] = v; break;
    case LUNAR_DTYPE_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case LUNAR_DTYPE_I8: ((int8_t *)p)[i] = (int8_t)v; break;
    case LUNAR_DTYPE_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case LUNAR_DTYPE_BOOL: ((uint8_t *)p)[i] = v != 0; break;
    default: break;
    }
}

static __device__ __forceinline__ bool is_int_dtype(int dt) {
    return dt == LUNAR_DTYPE_I8 || dt == LUNAR_DTYPE_I32 || dt == LUNAR_DTYPE_I64 || dt == LUNAR_DTYPE_U8 ||
           dt == LUNAR_DTYPE_BOOL;
}

__global__ void copy_kernel(char *dst, int ddt, const char *src, int sdt, copy_layout L, int64_t n, int saturate) {
    // the CPU converts float->float through f32 unless f64 or a wide integer is involved
    bool both_int = is_int_dtype(ddt) && is_int_dtype(sdt);
    bool wide = ddt == LUNAR_DTYPE_F64 || sdt == LUNAR_DTYPE_F64 || ddt == LUNAR_DTYPE_I32 ||
                ddt == LUNAR_DTYPE_I64 || sdt == LUNAR_DTYPE_I32 || sdt == LUNAR_DTYPE_I64;
    LUNAR_GRID_STRIDE(i, n) {
        int64_t rem = i, doff = 0, soff = 0;
        for (int d = L.ndim - 1; d >= 0; d--) {
            int64_t idx = rem % L.shape[d];
            rem /= L.shape[d];
            doff += idx * L.dstride[d];
            soff += idx * L.sstride[d];
        }
        if (both_int) store_from_i64(ddt, dst, doff, load_as_i64(sdt, src, soff));
        else store_from_f64(ddt, dst, doff, load_as_f64(sdt, src, soff), saturate, !wide);
    }
}

extern "C" lunar_status lunar_cuda_copy(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src, int saturate) {
    int64_t n = lunar_tensor_numel(dst);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, dst, &stream);
    if (st != LUNAR_OK) return st;
    if (dst->dtype == src->dtype && !saturate && lunar_tensor_is_contiguous(dst) && lunar_tensor_is_contiguous(src)) {
        LUNAR_CUDA_CHECK(ctx, cudaMemcpyAsync(lunar_tensor_data(dst), lunar_tensor_data(src), lunar_tensor_nbytes(dst),
                                              cudaMemcpyDeviceToDevice, stream));
        return LUNAR_OK;
    }
    copy_layout L;
    L.ndim = dst->ndim;
    for (int d = 0; d < dst->ndim; d++) {
        L.shape[d] = dst->shape[d];
        L.dstride[d] = dst->stride[d];
        L.sstride[d] = src->stride[d];
    }
    copy_kernel<<<lunar_cuda_grid(n), LUNAR_CUDA_BLOCK, 0, stream>>>((char *)lunar_tensor_data(dst), dst->dtype,
                                                                   (const char *)lunar_tensor_data(src), src->dtype, L,
                                                                   n, saturate);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "copy");
    return LUNAR_OK;
}

// fill and arange store the f64 value directly (lunar_dtype_store on the CPU), never through f32
__global__ void fill_kernel(char *p, int dt, int64_t n, double v) {
    LUNAR_GRID_STRIDE(i, n) store_from_f64(dt, p, i, v, 0, 0);
}

__global__ void arange_kernel(char *p, int dt, int64_t n, double start, double step) {
    LUNAR_GRID_STRIDE(i, n) store_from_f64(dt, p, i, lunar_hd_mul_add((double)i, step, start), 0, 0);
}

extern "C" lunar_status lunar_cuda_fill(lunar_ctx *ctx, lunar_tensor *t, double value) {
    int64_t n = lunar_tensor_numel(t);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, t, &stream);
    if (st != LUNAR_OK) return st;
    if (value == 0.0 && !std::signbit(value)) {   // all-zero bytes in every dtype (-0.0 is not)
        LUNAR_CUDA_CHECK(ctx, cudaMemsetAsync(lunar_tensor_data(t), 0, lunar_tensor_nbytes(t), stream));
        return LUNAR_OK;
    }
    fill_kernel<<<lunar_cuda_grid(n), LUNAR_CUDA_BLOCK, 0, stream>>>((char *)lunar_tensor_data(t), t->dtype, n, value);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "fill");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_arange(lunar_ctx *ctx, lunar_tensor *t, double start, double step) {
    int64_t n = lunar_tensor_numel(t);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, t, &stream);
    if (st != LUNAR_OK) return st;
    arange_kernel<<<lunar_cuda_grid(n), LUNAR_CUDA_BLOCK, 0, stream>>>((char *)lunar_tensor_data(t), t->dtype, n, start,
                                                                     step);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "arange");
    return LUNAR_OK;
}

// Same element formula as kernels/cpu/copy.c: element i depends only on (key, counter + i).
__global__ void rng_kernel(char *p, int dt, int64_t n, int kind, uint64_t key, uint64_t counter, double a, double b,
                           double top) {
    LUNAR_GRID_STRIDE(i, n) {
        uint32_t w[4];
        lunar_philox_element(key, counter + (uint64_t)i, w);
        if (kind == LUNAR_RNG_RANDINT) {
            int64_t v = lunar_rng_randint_value(w, (int64_t)a, (int64_t)b);
            if (dt == LUNAR_DTYPE_I64) ((int64_t *)p)[i] = v;
            else store_from_f64(dt, p, i, (double)v, 0, 0);
        } else {
            double v = kind == LUNAR_RNG_UNIFORM ? lunar_rng_uniform_below(w, a, b, top) : lunar_rng_normal_value(w, a, b);
            store_from_f64(dt, p, i, v, 0, 0);
        }
    }
}

extern "C" lunar_status lunar_cuda_rng_fill(lunar_ctx *ctx, lunar_tensor *out, lunar_rng_kind kind, uint64_t key,
                                            uint64_t counter, double a, double b, double top) {
    int64_t n = lunar_tensor_numel(out);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    rng_kernel<<<lunar_cuda_grid(n), LUNAR_CUDA_BLOCK, 0, stream>>>((char *)lunar_tensor_data(out), out->dtype, n,
                                                                  (int)kind, key, counter, a, b, top);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "rng");
    return LUNAR_OK;
}
