// softmax.cu: softmax, log-softmax and fused cross-entropy over the last dim on the GPU.
//
// One block of SM_BLOCK threads per row (grid-stride over rows): the row max, then the sum of
// exp(x - max), each reduced by a fixed shared-memory tree (deterministic), then the outputs.
// Math is f32; the input is re-read from global memory in each pass (rows up to any V).
// Log-probabilities are formed as (x - max) - log(sum), which stays accurate for large logits.
// Targets outside [0, V) that are not ignore_index cannot raise an error from a kernel: their
// loss and log-prob are NaN and their gradient row is NaN (the CPU backend reports them).
#include <math.h>

#include "common.cuh"

#define SM_BLOCK 256   // a power of two

__device__ __forceinline__ float max_nan(float a, float b) {
    if (a != a) return a;
    if (b != b) return b;
    return b > a ? b : a;
}

template <bool MAX> __device__ float block_reduce_f(float v, float *smem) {
    smem[threadIdx.x] = v;
    __syncthreads();
    for (int s = SM_BLOCK / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) {
            float a = smem[threadIdx.x], b = smem[threadIdx.x + s];
            smem[threadIdx.x] = MAX ? max_nan(a, b) : a + b;
        }
        __syncthreads();
    }
    float r = smem[0];
    __syncthreads();
    return r;
}

// max and log(sum(exp(x - max))) of a row, for every thread of the block
template <typename T> __device__ void row_stats(const T *xr, int64_t v, float *smem, float *m_out, float *ls_out) {
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) m = max_nan(m, lunar_to_f32(xr[j]));
    m = block_reduce_f<true>(m, smem);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) s += expf(lunar_to_f32(xr[j]) - m);
    s = block_reduce_f<false>(s, smem);
    *m_out = m;
    *ls_out = logf(s);
}

template <typename T>
__global__ void softmax_forward_kernel(T *y, const T *x, int64_t rows, int64_t v, int is_log) {
    __shared__ float smem[SM_BLOCK];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * v;
        T *yr = y + r * v;
        float m, ls;
        row_stats(xr, v, smem, &m, &ls);
        if (is_log) {
            for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) yr[j] = lunar_from_f32<T>((lunar_to_f32(xr[j]) - m) - ls);
        } else {
            for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) yr[j] = lunar_from_f32<T>(expf((lunar_to_f32(xr[j]) - m) - ls));
        }
    }
}

// softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy)
template <typename T>
__global__ void softmax_backward_kernel(T *dx, const T *dy, const T *y, int64_t rows, int64_t v, int is_log) {
    __shared__ float smem[SM_BLOCK];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *g = dy + r * v, *yr = y + r * v;
        T *d = dx + r * v;
        float s = 0.0f;
        if (is_log) {
            for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) s += lunar_to_f32(g[j]);
        } else {
            for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) s += lunar_to_f32(g[j]) * lunar_to_f32(yr[j]);
        }
        s = block_reduce_f<false>(s, smem);
        for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) {
            float gy = lunar_to_f32(g[j]), yy = lunar_to_f32(yr[j]);
            d[j] = lunar_from_f32<T>(is_log ? gy - expf(yy) * s : yy * (gy - s));
        }
    }
}

static unsigned row_grid(int64_t rows) { return (unsigned)(rows < 65535 * 32 ? rows : 65535 * 32); }

extern "C" lunar_status lunar_cuda_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, int log) {
    int64_t v = x->shape[x->ndim - 1], rows = lunar_tensor_numel(x) / v;
    if (rows == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        softmax_forward_kernel<T><<<row_grid(rows), SM_BLOCK, 0, stream>>>((T *)lunar_tensor_data(y),
                                                                           (const T *)lunar_tensor_data(x), rows, v, log));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, log ? "log_softmax_forward" : "softmax_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                                    const lunar_tensor *y, int log) {
    int64_t v = y->shape[y->ndim - 1], rows = lunar_tensor_numel(y) / v;
    if (rows == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, y, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, y->dtype, T,
        softmax_backward_kernel<T><<<row_grid(rows), SM_BLOCK, 0, stream>>>(
            (T *)lunar_tensor_data(dx), (const T *)lunar_tensor_data(dy), (const T *)lunar_tensor_data(y), rows, v, log));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, log ? "log_softmax_backward" : "softmax_backward");
    return LUNAR_OK;
}

template <typename T>
__global__ void cross_entropy_forward_kernel(float *loss, float *logprobs, float *lse, const T *logits,
                                             const int64_t *targets, int64_t rows, int64_t v, int64_t ignore_index) {
    __shared__ float smem[SM_BLOCK];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = logits + r * v;
        float m, ls;
        row_stats(xr, v, smem, &m, &ls);
        if (threadIdx.x == 0) {
            int64_t t = targets[r];
            lse[r] = m + ls;
            if (t == ignore_index) {
                logprobs[r] = 0.0f;
                loss[r] = 0.0f;
            } else if (t < 0 || t >= v) {
                logprobs[r] = NAN;
                loss[r] = NAN;
            } else {
                float lp = (lunar_to_f32(xr[t]) - m) - ls;
                logprobs[r] = lp;
                loss[r] = -lp;
            }
        }
    }
}

// elementwise: dlogits[r, j] = dloss[r] * (exp(x - lse) - (j == t_r)), 0 for ignored rows
template <typename T>
__global__ void cross_entropy_backward_kernel(T *dlogits, const float *dloss, const T *logits, const float *lse,
                                              const int64_t *targets, int64_t rows, int64_t v, int64_t ignore_index) {
    LUNAR_GRID_STRIDE(e, rows * v) {
        int64_t r = e / v, j = e % v, t = targets[r];
        float d;
        if (t == ignore_index) d = 0.0f;
        else if (t < 0 || t >= v) d = NAN;
        else d = dloss[r] * (expf(lunar_to_f32(logits[e]) - lse[r]) - (j == t ? 1.0f : 0.0f));
        dlogits[e] = lunar_from_f32<T>(d);
    }
}

extern "C" lunar_status lunar_cuda_cross_entropy_forward(lunar_ctx *ctx, lunar_tensor *loss, lunar_tensor *logprobs,
                                                         lunar_tensor *lse, const lunar_tensor *logits,
                                                         const lunar_tensor *targets, int64_t ignore_index) {
    int64_t rows = logits->shape[0], v = logits->shape[1];
    if (rows == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, logits, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, logits->dtype, T,
        cross_entropy_forward_kernel<T><<<row_grid(rows), SM_BLOCK, 0, stream>>>(
            (float *)lunar_tensor_data(loss), (float *)lunar_tensor_data(logprobs), (float *)lunar_tensor_data(lse),
            (const T *)lunar_tensor_data(logits), (const int64_t *)lunar_tensor_data(targets), rows, v, ignore_index));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "cross_entropy_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_cross_entropy_backward(lunar_ctx *ctx, lunar_tensor *dlogits,
                                                          const lunar_tensor *dloss, const lunar_tensor *logits,
                                                          const lunar_tensor *lse, const lunar_tensor *targets,
                                                          int64_t ignore_index) {
    int64_t rows = logits->shape[0], v = logits->shape[1];
    if (rows * v == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, logits, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, logits->dtype, T,
        cross_entropy_backward_kernel<T><<<lunar_cuda_grid(rows * v), LUNAR_CUDA_BLOCK, 0, stream>>>(
            (T *)lunar_tensor_data(dlogits), (const float *)lunar_tensor_data(dloss),
            (const T *)lunar_tensor_data(logits), (const float *)lunar_tensor_data(lse),
            (const int64_t *)lunar_tensor_data(targets), rows, v, ignore_index));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "cross_entropy_backward");
    return LUNAR_OK;
}

// entropy[r] = -sum_j p_j (x_j - lse_r), p_j = exp(x_j - lse_r); a probability of 0 adds 0
template <typename T>
__global__ void entropy_forward_kernel(float *entropy, const T *logits, const float *lse, int64_t rows, int64_t v) {
    __shared__ float smem[SM_BLOCK];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = logits + r * v;
        float l = lse[r], s = 0.0f;
        for (int64_t j = threadIdx.x; j < v; j += SM_BLOCK) {
            float d = lunar_to_f32(xr[j]) - l;
            float e = expf(d);
            s += e > 0.0f ? e * d : 0.0f;
        }
        s = block_reduce_f<false>(s, smem);
        if (threadIdx.x == 0) entropy[r] = isnan(l) ? NAN : -s;
    }
}

extern "C" lunar_status lunar_cuda_entropy_forward(lunar_ctx *ctx, lunar_tensor *entropy, const lunar_tensor *logits,
                                                   const lunar_tensor *lse) {
    int64_t rows = logits->shape[0], v = logits->shape[1];
    if (rows == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, logits, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, logits->dtype, T,
        entropy_forward_kernel<T><<<row_grid(rows), SM_BLOCK, 0, stream>>>(
            (float *)lunar_tensor_data(entropy), (const T *)lunar_tensor_data(logits),
            (const float *)lunar_tensor_data(lse), rows, v));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "entropy_forward");
    return LUNAR_OK;
}
