// sort.cu: top-k and argsort along rows on the GPU. x (rows, n) f32/bf16/f16, indices i64.
//
// As on the CPU, each element becomes a unique 64-bit key (high 32 bits: the value's order, NaN
// above +inf, -0 equal to +0, inverted for descending; low 32 bits: its index), so sorting the
// keys ascending is a total order with ties in index order, and the result is deterministic.
//
// Limits and strategy (correctness first):
//   n <= SORT_SMEM_MAX (4096): one block per row sorts the keys in shared memory with a bitonic
//     network over the next power of two (padding keys are all ones, so they sort last); the
//     first k keys give the result. 32 KiB of shared memory per block.
//   n >  SORT_SMEM_MAX: the keys of all rows go to a scratch buffer of rows x next_pow2(n) u64
//     in device memory and the same bitonic network runs there, one launch per (stage, step):
//     log2(N) * (log2(N) + 1) / 2 launches (210 for n = 2^20). Correct for any n < 2^31, but
//     slow and memory hungry for very long rows; top-k of large n sorts the whole row.
#include <stdint.h>
#include <string.h>

#include "common.cuh"

#define SORT_SMEM_MAX 4096
#define SORT_BLOCK 512

__device__ __forceinline__ uint64_t sort_key(float v, int64_t idx, int descending) {
    uint32_t u;
    if (v != v) {
        u = 0xFFFFFFFFu;
    } else {
        if (v == 0.0f) v = 0.0f;   // -0 sorts as +0
        u = __float_as_uint(v);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    if (descending) u = ~u;
    return ((uint64_t)u << 32) | (uint32_t)idx;
}

static int64_t next_pow2(int64_t n) {
    int64_t p = 1;
    while (p < n) p <<= 1;
    return p;
}

template <typename T>
__global__ void sort_smem_kernel(T *values, int64_t *indices, const T *x, int64_t rows, int64_t n, int64_t npad,
                                 int64_t k, int descending) {
    extern __shared__ uint64_t keys[];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * n;
        for (int64_t j = threadIdx.x; j < npad; j += blockDim.x)
            keys[j] = j < n ? sort_key(lunar_to_f32(xr[j]), j, descending) : ~(uint64_t)0;
        __syncthreads();
        for (int64_t size = 2; size <= npad; size <<= 1) {
            for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
                for (int64_t i = threadIdx.x; i < npad; i += blockDim.x) {
                    int64_t p = i ^ stride;
                    if (p > i) {
                        bool up = (i & size) == 0;
                        uint64_t a = keys[i], b = keys[p];
                        if ((a > b) == up) {
                            keys[i] = b;
                            keys[p] = a;
                        }
                    }
                }
                __syncthreads();
            }
        }
        for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
            int64_t idx = (int64_t)(keys[j] & 0xFFFFFFFFu);
            indices[r * k + j] = idx;
            if (values) values[r * k + j] = xr[idx];
        }
        __syncthreads();
    }
}

template <typename T>
__global__ void keys_init_kernel(uint64_t *keys, const T *x, int64_t rows, int64_t n, int64_t npad, int descending) {
    LUNAR_GRID_STRIDE(e, rows * npad) {
        int64_t r = e / npad, j = e % npad;
        keys[e] = j < n ? sort_key(lunar_to_f32(x[r * n + j]), j, descending) : ~(uint64_t)0;
    }
}

// one compare-exchange step of the bitonic network, over every row at once
__global__ void bitonic_step_kernel(uint64_t *keys, int64_t rows, int64_t npad, int64_t size, int64_t stride) {
    LUNAR_GRID_STRIDE(e, rows * npad) {
        int64_t i = e % npad, p = i ^ stride;
        if (p > i) {
            uint64_t *row = keys + (e - i);
            bool up = (i & size) == 0;
            uint64_t a = row[i], b = row[p];
            if ((a > b) == up) {
                row[i] = b;
                row[p] = a;
            }
        }
    }
}

template <typename T>
__global__ void keys_extract_kernel(T *values, int64_t *indices, const uint64_t *keys, const T *x, int64_t rows,
                                    int64_t n, int64_t npad, int64_t k) {
    LUNAR_GRID_STRIDE(e, rows * k) {
        int64_t r = e / k, j = e % k;
        int64_t idx = (int64_t)(keys[r * npad + j] & 0xFFFFFFFFu);
        indices[e] = idx;
        if (values) values[e] = x[r * n + idx];
    }
}

template <typename T>
static lunar_status sort_rows(lunar_ctx *ctx, cudaStream_t stream, T *values, int64_t *indices, const T *x,
                              const lunar_tensor *xt, int64_t rows, int64_t n, int64_t k, int descending) {
    int64_t npad = next_pow2(n);
    if (npad <= SORT_SMEM_MAX) {
        unsigned grid = (unsigned)(rows < 65535 * 32 ? rows : 65535 * 32);
        size_t smem = (size_t)npad * sizeof(uint64_t);
        sort_smem_kernel<T><<<grid, SORT_BLOCK, smem, stream>>>(values, indices, x, rows, n, npad, k, descending);
        LUNAR_CUDA_LAUNCH_CHECK(ctx, "sort (shared memory)");
        return LUNAR_OK;
    }
    lunar_tensor scratch = {0};
    int64_t total = rows * npad;
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_I64, lunar_tensor_device(xt), 1, &total));
    uint64_t *keys = (uint64_t *)lunar_tensor_data(&scratch);
    unsigned grid = lunar_cuda_grid(total);
    keys_init_kernel<T><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(keys, x, rows, n, npad, descending);
    cudaError_t e = cudaGetLastError();
    for (int64_t size = 2; size <= npad && e == cudaSuccess; size <<= 1)
        for (int64_t stride = size >> 1; stride > 0 && e == cudaSuccess; stride >>= 1) {
            bitonic_step_kernel<<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(keys, rows, npad, size, stride);
            e = cudaGetLastError();
        }
    if (e == cudaSuccess) {
        keys_extract_kernel<T><<<lunar_cuda_grid(rows * k), LUNAR_CUDA_BLOCK, 0, stream>>>(values, indices, keys, x, rows,
                                                                                            n, npad, k);
        e = cudaGetLastError();
    }
    lunar_tensor_release(ctx, &scratch);   // stream-ordered reuse of the pool block
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "sort (global) launch: %s", cudaGetErrorString(e));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_topk(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices,
                                        const lunar_tensor *x, int64_t rows, int64_t n, int64_t k, int largest) {
    if (rows * k == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    int64_t *ip = (int64_t *)lunar_tensor_data(indices);
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        return (sort_rows<T>(ctx, stream, values ? (T *)lunar_tensor_data(values) : (T *)NULL, ip,
                             (const T *)lunar_tensor_data(x), x, rows, n, k, largest)));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_argsort(lunar_ctx *ctx, lunar_tensor *indices, const lunar_tensor *x, int64_t rows,
                                           int64_t n, int descending) {
    return lunar_cuda_topk(ctx, NULL, indices, x, rows, n, n, descending);
}
