// reduce.cu: reductions, their backward, max with indices, cumulative sums and the global norm
// on the GPU. x is seen as (outer, n, inner), contiguous, f32/bf16/f16; math in f32, sums in f64.
//
// Determinism: no atomics. Contiguous rows (inner == 1) are reduced by one block per row (or,
// for few long rows, by S fixed slices per row whose f64 partials a second kernel combines in
// order); block reductions use a fixed shared-memory tree. Columns (inner > 1) are reduced by
// one thread each, in index order. S depends only on the shape, so results are reproducible.
// max/min propagate NaN; arg-extremes are the first position (lowest index) on ties and NaN.
#include <math.h>

#include "common.cuh"

#define RED_BLOCK 256        // threads per block for row reductions (a power of two)
#define RED_SLICE 32768      // elements per slice when few long rows are split
#define RED_MAX_SLICES 256

enum { ACC_SUM = 0, ACC_SUMSQ, ACC_MAX, ACC_MIN };

template <int K> __device__ __forceinline__ double acc_identity() {
    return K == ACC_MAX ? -INFINITY : (K == ACC_MIN ? INFINITY : 0.0);
}

template <int K> __device__ __forceinline__ double acc_combine(double a, double b) {
    if (K == ACC_SUM || K == ACC_SUMSQ) return a + b;
    if (a != a) return a;
    if (b != b) return b;
    if (K == ACC_MAX) return b > a ? b : a;
    return b < a ? b : a;
}

template <int K> __device__ __forceinline__ double acc_load(float v) {
    return K == ACC_SUMSQ ? (double)v * (double)v : (double)v;
}

// Fixed-order tree over the block (blockDim.x == RED_BLOCK); every thread gets the result.
template <int K> __device__ double block_reduce(double v, double *smem) {
    smem[threadIdx.x] = v;
    __syncthreads();
    for (int s = RED_BLOCK / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) smem[threadIdx.x] = acc_combine<K>(smem[threadIdx.x], smem[threadIdx.x + s]);
        __syncthreads();
    }
    double r = smem[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ double finish(int op, double s, int64_t n) {
    if (op == LUNAR_REDUCE_MEAN) return s / (double)n;
    if (op == LUNAR_REDUCE_NORM) return sqrt(s);
    return s;
}

// One block per (row, slice). slices == 1: writes the finished value; else an f64 partial.
template <typename T, int K>
__global__ void reduce_rows_kernel(T *out, double *partial, const T *x, int64_t rows, int64_t n, int slices, int op) {
    __shared__ double smem[RED_BLOCK];
    for (int64_t b = blockIdx.x; b < rows * slices; b += gridDim.x) {
        int64_t r = b / slices, s = b % slices;
        int64_t lo = n * s / slices, hi = n * (s + 1) / slices;
        const T *xr = x + r * n;
        double acc = acc_identity<K>();
        for (int64_t j = lo + threadIdx.x; j < hi; j += RED_BLOCK) acc = acc_combine<K>(acc, acc_load<K>(lunar_to_f32(xr[j])));
        acc = block_reduce<K>(acc, smem);
        if (threadIdx.x == 0) {
            if (slices == 1) out[r] = lunar_from_f32<T>((float)finish(op, acc, n));
            else partial[b] = acc;
        }
    }
}

template <typename T, int K>
__global__ void reduce_partials_kernel(T *out, const double *partial, int64_t rows, int slices, int64_t n, int op) {
    __shared__ double smem[RED_BLOCK];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        double acc = acc_identity<K>();
        for (int s = threadIdx.x; s < slices; s += RED_BLOCK) acc = acc_combine<K>(acc, partial[r * slices + s]);
        acc = block_reduce<K>(acc, smem);
        if (threadIdx.x == 0) out[r] = lunar_from_f32<T>((float)finish(op, acc, n));
    }
}

// One thread per output column (o, i), in index order over n; reads are coalesced across i.
template <typename T, int K>
__global__ void reduce_cols_kernel(T *out, const T *x, int64_t outer, int64_t n, int64_t inner, int op) {
    LUNAR_GRID_STRIDE(r, outer * inner) {
        int64_t o = r / inner, i = r % inner;
        const T *col = x + o * n * inner + i;
        double acc = acc_identity<K>();
        for (int64_t j = 0; j < n; j++) acc = acc_combine<K>(acc, acc_load<K>(lunar_to_f32(col[j * inner])));
        out[r] = lunar_from_f32<T>((float)finish(op, acc, n));
    }
}

static int slices_for(int64_t rows, int64_t n) {
    if (rows >= 1024) return 1;
    int64_t s = CEIL_DIV(n, (int64_t)RED_SLICE);
    if (s < 1) s = 1;
    if (s > RED_MAX_SLICES) s = RED_MAX_SLICES;
    return (int)s;
}

template <typename T, int K>
static lunar_status reduce_launch(lunar_ctx *ctx, cudaStream_t stream, lunar_tensor *out, const lunar_tensor *x,
                                  int64_t outer, int64_t n, int64_t inner, int op) {
    T *o = (T *)lunar_tensor_data(out);
    const T *xp = (const T *)lunar_tensor_data(x);
    if (inner > 1) {
        reduce_cols_kernel<T, K><<<lunar_cuda_grid(outer * inner), LUNAR_CUDA_BLOCK, 0, stream>>>(o, xp, outer, n, inner, op);
        LUNAR_CUDA_LAUNCH_CHECK(ctx, "reduce (columns)");
        return LUNAR_OK;
    }
    int slices = slices_for(outer, n);
    unsigned grid = (unsigned)(outer * slices < 65535 * 32 ? outer * slices : 65535 * 32);
    if (slices == 1) {
        reduce_rows_kernel<T, K><<<grid, RED_BLOCK, 0, stream>>>(o, NULL, xp, outer, n, 1, op);
        LUNAR_CUDA_LAUNCH_CHECK(ctx, "reduce (rows)");
        return LUNAR_OK;
    }
    lunar_tensor part = {0};
    int64_t np = outer * slices;
    LUNAR_TRY(lunar_tensor_new(ctx, &part, LUNAR_DTYPE_F64, lunar_tensor_device(x), 1, &np));
    double *pp = (double *)lunar_tensor_data(&part);
    reduce_rows_kernel<T, K><<<grid, RED_BLOCK, 0, stream>>>(o, pp, xp, outer, n, slices, op);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        unsigned g2 = (unsigned)(outer < 65535 * 32 ? outer : 65535 * 32);
        reduce_partials_kernel<T, K><<<g2, RED_BLOCK, 0, stream>>>(o, pp, outer, slices, n, op);
        e = cudaGetLastError();
    }
    lunar_tensor_release(ctx, &part);   // stream-ordered reuse: later work runs after these kernels
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "reduce (sliced rows) launch: %s", cudaGetErrorString(e));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_reduce(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer,
                                          int64_t n, int64_t inner, lunar_reduce_op op) {
    if (outer * inner == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    switch (op) {
    case LUNAR_REDUCE_SUM:
    case LUNAR_REDUCE_MEAN:
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T, return (reduce_launch<T, ACC_SUM>(ctx, stream, out, x, outer, n, inner, op)));
        break;
    case LUNAR_REDUCE_NORM:
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T, return (reduce_launch<T, ACC_SUMSQ>(ctx, stream, out, x, outer, n, inner, op)));
        break;
    case LUNAR_REDUCE_MAX:
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T, return (reduce_launch<T, ACC_MAX>(ctx, stream, out, x, outer, n, inner, op)));
        break;
    case LUNAR_REDUCE_MIN:
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T, return (reduce_launch<T, ACC_MIN>(ctx, stream, out, x, outer, n, inner, op)));
        break;
    default: break;
    }
    return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "reduce: unknown op %d", (int)op);
}

// ---- arg-extremes (max_dim, and the backward of max/min) ------------------------------------

// (v, i) becomes (v2, i2) when the candidate wins: NaN first, then the extreme, then the lower index.
template <bool MAX> __device__ __forceinline__ void arg_combine(float &v, int64_t &i, float v2, int64_t i2) {
    bool nan1 = v != v, nan2 = v2 != v2, take;
    if (nan1 || nan2) take = nan2 && (!nan1 || i2 < i);
    else take = (MAX ? v2 > v : v2 < v) || (v2 == v && i2 < i);
    if (take) {
        v = v2;
        i = i2;
    }
}

template <typename T, bool MAX>
__global__ void arg_rows_kernel(T *values, int64_t *indices, const T *x, int64_t rows, int64_t n) {
    __shared__ float sv[RED_BLOCK];
    __shared__ int64_t si[RED_BLOCK];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float v = MAX ? -INFINITY : INFINITY;
        int64_t i = INT64_MAX;
        for (int64_t j = threadIdx.x; j < n; j += RED_BLOCK) arg_combine<MAX>(v, i, lunar_to_f32(x[r * n + j]), j);
        sv[threadIdx.x] = v;
        si[threadIdx.x] = i;
        __syncthreads();
        for (int s = RED_BLOCK / 2; s > 0; s >>= 1) {
            if ((int)threadIdx.x < s) {
                float a = sv[threadIdx.x];
                int64_t ai = si[threadIdx.x];
                arg_combine<MAX>(a, ai, sv[threadIdx.x + s], si[threadIdx.x + s]);
                sv[threadIdx.x] = a;
                si[threadIdx.x] = ai;
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            if (values) values[r] = x[r * n + si[0]];
            indices[r] = si[0];
        }
        __syncthreads();
    }
}

template <typename T, bool MAX>
__global__ void arg_cols_kernel(T *values, int64_t *indices, const T *x, int64_t outer, int64_t n, int64_t inner) {
    LUNAR_GRID_STRIDE(r, outer * inner) {
        int64_t o = r / inner, c = r % inner;
        const T *col = x + o * n * inner + c;
        float v = MAX ? -INFINITY : INFINITY;
        int64_t i = INT64_MAX;
        for (int64_t j = 0; j < n; j++) arg_combine<MAX>(v, i, lunar_to_f32(col[j * inner]), j);
        if (values) values[r] = col[i * inner];
        indices[r] = i;
    }
}

// values may be NULL (indices only). n >= 1 (the host rejects empty extents).
template <typename T, bool MAX>
static lunar_status arg_launch(lunar_ctx *ctx, cudaStream_t stream, T *values, int64_t *indices, const T *x,
                               int64_t outer, int64_t n, int64_t inner) {
    if (inner == 1) {
        unsigned grid = (unsigned)(outer < 65535 * 32 ? outer : 65535 * 32);
        arg_rows_kernel<T, MAX><<<grid, RED_BLOCK, 0, stream>>>(values, indices, x, outer, n);
    } else {
        arg_cols_kernel<T, MAX><<<lunar_cuda_grid(outer * inner), LUNAR_CUDA_BLOCK, 0, stream>>>(values, indices, x, outer,
                                                                                                  n, inner);
    }
    LUNAR_CUDA_LAUNCH_CHECK(ctx, MAX ? "argmax" : "argmin");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_max_dim(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices,
                                           const lunar_tensor *x, int64_t outer, int64_t n, int64_t inner) {
    if (outer * inner == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    int64_t *ip = (int64_t *)lunar_tensor_data(indices);
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        return (arg_launch<T, true>(ctx, stream, (T *)lunar_tensor_data(values), ip, (const T *)lunar_tensor_data(x),
                                    outer, n, inner)));
    return LUNAR_OK;
}

// ---- backward ----------------------------------------------------------------------------

template <typename T>
__global__ void reduce_backward_kernel(T *dx, const T *dy, const T *x, const T *y, const int64_t *arg, int64_t outer,
                                       int64_t n, int64_t inner, int op) {
    LUNAR_GRID_STRIDE(e, outer * n * inner) {
        int64_t i = e % inner, j = (e / inner) % n, o = e / (n * inner);
        int64_t r = o * inner + i;
        float g = lunar_to_f32(dy[r]), d;
        switch (op) {
        case LUNAR_REDUCE_SUM: d = g; break;
        case LUNAR_REDUCE_MEAN: d = g * (float)(1.0 / (double)n); break;
        case LUNAR_REDUCE_NORM: {
            float yv = lunar_to_f32(y[r]);
            d = yv == 0.0f ? 0.0f : g * lunar_to_f32(x[e]) / yv;
            break;
        }
        default: d = arg[r] == j ? g : 0.0f; break;   // MAX, MIN: the first extreme position
        }
        dx[e] = lunar_from_f32<T>(d);
    }
}

extern "C" lunar_status lunar_cuda_reduce_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                                   const lunar_tensor *x, const lunar_tensor *y, int64_t outer,
                                                   int64_t n, int64_t inner, lunar_reduce_op op) {
    int64_t total = outer * n * inner;
    if (total == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, dx, &stream);
    if (st != LUNAR_OK) return st;
    lunar_tensor arg = {0};
    if (op == LUNAR_REDUCE_MAX || op == LUNAR_REDUCE_MIN) {
        int64_t m = outer * inner;
        LUNAR_TRY(lunar_tensor_new(ctx, &arg, LUNAR_DTYPE_I64, lunar_tensor_device(dx), 1, &m));
        int64_t *ap = (int64_t *)lunar_tensor_data(&arg);
        if (op == LUNAR_REDUCE_MAX) {
            LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
                st = (arg_launch<T, true>(ctx, stream, (T *)NULL, ap, (const T *)lunar_tensor_data(x), outer, n, inner)));
        } else {
            LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
                st = (arg_launch<T, false>(ctx, stream, (T *)NULL, ap, (const T *)lunar_tensor_data(x), outer, n, inner)));
        }
        if (st != LUNAR_OK) {
            lunar_tensor_release(ctx, &arg);
            return st;
        }
    }
    const int64_t *ap = arg.storage ? (const int64_t *)lunar_tensor_data(&arg) : NULL;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, dx->dtype, T,
        reduce_backward_kernel<T><<<lunar_cuda_grid(total), LUNAR_CUDA_BLOCK, 0, stream>>>(
            (T *)lunar_tensor_data(dx), (const T *)lunar_tensor_data(dy),
            x ? (const T *)lunar_tensor_data(x) : (const T *)NULL, y ? (const T *)lunar_tensor_data(y) : (const T *)NULL,
            ap, outer, n, inner, (int)op));
    cudaError_t e = cudaGetLastError();
    lunar_tensor_release(ctx, &arg);
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "reduce_backward launch: %s", cudaGetErrorString(e));
    return LUNAR_OK;
}

// ---- cumulative sums -----------------------------------------------------------------------

// One block per long row: tiles of RED_BLOCK elements, an inclusive f64 scan of each tile in
// shared memory (Hillis-Steele, fixed order) plus the running carry of the previous tiles.
template <typename T>
__global__ void cumsum_rows_kernel(T *out, const T *x, int64_t rows, int64_t n, int reverse) {
    __shared__ double buf[RED_BLOCK];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        double carry = 0.0;
        for (int64_t t0 = 0; t0 < n; t0 += RED_BLOCK) {
            int64_t pos = t0 + threadIdx.x;
            int64_t j = reverse ? n - 1 - pos : pos;
            double v = pos < n ? (double)lunar_to_f32(x[r * n + j]) : 0.0;
            buf[threadIdx.x] = v;
            __syncthreads();
            for (int s = 1; s < RED_BLOCK; s <<= 1) {
                double add = (int)threadIdx.x >= s ? buf[threadIdx.x - s] : 0.0;
                __syncthreads();
                buf[threadIdx.x] += add;
                __syncthreads();
            }
            if (pos < n) out[r * n + j] = lunar_from_f32<T>((float)(carry + buf[threadIdx.x]));
            carry += buf[RED_BLOCK - 1];
            __syncthreads();
        }
    }
}

// One thread per column (short rows, or inner > 1), in index order.
template <typename T>
__global__ void cumsum_cols_kernel(T *out, const T *x, int64_t outer, int64_t n, int64_t inner, int reverse) {
    LUNAR_GRID_STRIDE(r, outer * inner) {
        int64_t o = r / inner, i = r % inner;
        double acc = 0.0;
        for (int64_t s = 0; s < n; s++) {
            int64_t j = reverse ? n - 1 - s : s;
            int64_t e = (o * n + j) * inner + i;
            acc += (double)lunar_to_f32(x[e]);
            out[e] = lunar_from_f32<T>((float)acc);
        }
    }
}

extern "C" lunar_status lunar_cuda_cumsum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer,
                                          int64_t n, int64_t inner, int reverse) {
    if (outer * n * inner == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    if (inner == 1 && n > 64) {
        unsigned grid = (unsigned)(outer < 65535 * 32 ? outer : 65535 * 32);
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
            cumsum_rows_kernel<T><<<grid, RED_BLOCK, 0, stream>>>((T *)lunar_tensor_data(out),
                                                                  (const T *)lunar_tensor_data(x), outer, n, reverse));
    } else {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
            cumsum_cols_kernel<T><<<lunar_cuda_grid(outer * inner), LUNAR_CUDA_BLOCK, 0, stream>>>(
                (T *)lunar_tensor_data(out), (const T *)lunar_tensor_data(x), outer, n, inner, reverse));
    }
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "cumsum");
    return LUNAR_OK;
}

// ---- global norm ---------------------------------------------------------------------------

// Block b of `blocks` writes the f64 sum of squares of its fixed slice of t into partial[b].
template <typename T>
__global__ void sumsq_slices_kernel(double *partial, const T *t, int64_t m, int blocks) {
    __shared__ double smem[RED_BLOCK];
    for (int b = blockIdx.x; b < blocks; b += gridDim.x) {
        int64_t lo = m * b / blocks, hi = m * (b + 1) / blocks;
        double acc = 0.0;
        for (int64_t j = lo + threadIdx.x; j < hi; j += RED_BLOCK) {
            double v = lunar_to_f32(t[j]);
            acc += v * v;
        }
        acc = block_reduce<ACC_SUM>(acc, smem);
        if (threadIdx.x == 0) partial[b] = acc;
    }
}

__global__ void global_norm_final_kernel(float *out, const double *partial, int64_t np) {
    __shared__ double smem[RED_BLOCK];
    double acc = 0.0;
    for (int64_t j = threadIdx.x; j < np; j += RED_BLOCK) acc += partial[j];
    acc = block_reduce<ACC_SUM>(acc, smem);
    if (threadIdx.x == 0) out[0] = (float)sqrt(acc);
}

static int norm_blocks(int64_t m) {
    int64_t b = CEIL_DIV(m, (int64_t)RED_SLICE);
    if (b < 1) b = 1;
    if (b > RED_MAX_SLICES) b = RED_MAX_SLICES;
    return (int)b;
}

extern "C" lunar_status lunar_cuda_global_norm(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *const *ts, int n) {
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    int64_t np = 0;
    for (int i = 0; i < n; i++)
        if (lunar_tensor_numel(ts[i]) > 0) np += norm_blocks(lunar_tensor_numel(ts[i]));
    lunar_tensor part = {0};
    int64_t alloc = np > 0 ? np : 1;
    LUNAR_TRY(lunar_tensor_new(ctx, &part, LUNAR_DTYPE_F64, lunar_tensor_device(out), 1, &alloc));
    double *pp = (double *)lunar_tensor_data(&part);
    int64_t off = 0;
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < n && e == cudaSuccess; i++) {
        int64_t m = lunar_tensor_numel(ts[i]);
        if (m == 0) continue;
        int blocks = norm_blocks(m);
        switch (ts[i]->dtype) {
        case LUNAR_DTYPE_F32:
            sumsq_slices_kernel<float><<<blocks, RED_BLOCK, 0, stream>>>(pp + off, (const float *)lunar_tensor_data(ts[i]), m, blocks);
            break;
        case LUNAR_DTYPE_BF16:
            sumsq_slices_kernel<__nv_bfloat16><<<blocks, RED_BLOCK, 0, stream>>>(
                pp + off, (const __nv_bfloat16 *)lunar_tensor_data(ts[i]), m, blocks);
            break;
        case LUNAR_DTYPE_F16:
            sumsq_slices_kernel<__half><<<blocks, RED_BLOCK, 0, stream>>>(pp + off, (const __half *)lunar_tensor_data(ts[i]), m, blocks);
            break;
        default:
            lunar_tensor_release(ctx, &part);
            return LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "global_norm: unsupported dtype %s on cuda", lunar_dtype_name(ts[i]->dtype));
        }
        e = cudaGetLastError();
        off += blocks;
    }
    if (e == cudaSuccess) {
        global_norm_final_kernel<<<1, RED_BLOCK, 0, stream>>>((float *)lunar_tensor_data(out), pp, np);
        e = cudaGetLastError();
    }
    lunar_tensor_release(ctx, &part);
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "global_norm launch: %s", cudaGetErrorString(e));
    return LUNAR_OK;
}
