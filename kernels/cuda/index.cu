// index.cu: embedding, index_select / index_add, gather / scatter on the GPU.
//
// Index range checks happen here, on the device: a kernel that meets an index outside [0, n)
// skips it (gathers write 0) and records the smallest bad flat position of the index in a
// device flag (atomicMin). The launcher then reads the flag back (one 8-byte copy and a stream
// synchronisation) and, if it was set, fails with the op, the bad value and the valid range,
// like the CPU host check does.
//
// Determinism: index_add and scatter/scatter_add give each (outer, inner) position to one
// thread, which walks the index in order (no atomics; for scatter the last duplicate wins).
// embedding_backward uses atomicAdd over the rows (fast, but float sums in a run-dependent
// order); the CPU backend is the deterministic reference.
#include <limits.h>

#include "common.cuh"

#define NO_BAD 0xffffffffffffffffULL

__device__ __forceinline__ bool in_range(int64_t v, int64_t n, unsigned long long *bad, int64_t pos) {
    if (v >= 0 && v < n) return true;
    atomicMin(bad, (unsigned long long)pos);
    return false;
}

template <typename T>
__global__ void embedding_forward_kernel(T *out, const int64_t *ids, const T *w, int64_t n, int64_t v, int64_t c,
                                         unsigned long long *bad) {
    LUNAR_GRID_STRIDE(k, n * c) {
        int64_t i = k / c, j = k % c;
        int64_t id = ids[i];
        out[k] = in_range(id, v, bad, i) ? w[id * c + j] : lunar_from_f32<T>(0.0f);
    }
}

template <typename T>
__global__ void embedding_backward_kernel(T *dw, const T *dout, const int64_t *ids, int64_t n, int64_t v, int64_t c,
                                          unsigned long long *bad) {
    LUNAR_GRID_STRIDE(k, n * c) {
        int64_t i = k / c, j = k % c;
        int64_t id = ids[i];
        if (in_range(id, v, bad, i)) atomicAdd(dw + id * c + j, dout[k]);
    }
}

template <typename T>
__global__ void index_select_kernel(T *out, const T *src, const int64_t *idx, int64_t outer, int64_t n_src, int64_t k_n,
                                    int64_t inner, unsigned long long *bad) {
    LUNAR_GRID_STRIDE(k, outer * k_n * inner) {
        int64_t i = k % inner, r = k / inner;
        int64_t j = r % k_n, o = r / k_n;
        int64_t s = idx[j];
        out[k] = in_range(s, n_src, bad, j) ? src[(o * n_src + s) * inner + i] : lunar_from_f32<T>(0.0f);
    }
}

// one thread per (outer, inner) position, index walked in order
template <typename T>
__global__ void index_add_kernel(T *dst, const T *src, const int64_t *idx, int64_t outer, int64_t n_dst, int64_t k_n,
                                 int64_t inner, float alpha, unsigned long long *bad) {
    LUNAR_GRID_STRIDE(p, outer * inner) {
        int64_t o = p / inner, i = p % inner;
        for (int64_t j = 0; j < k_n; j++) {
            int64_t d = idx[j];
            if (!in_range(d, n_dst, bad, j)) continue;
            T *q = dst + (o * n_dst + d) * inner + i;
            *q = lunar_from_f32<T>(lunar_to_f32(*q) + alpha * lunar_to_f32(src[(o * k_n + j) * inner + i]));
        }
    }
}

template <typename T>
__global__ void gather_kernel(T *out, const T *src, const int64_t *idx, int64_t outer, int64_t n_data, int64_t n_idx,
                              int64_t inner, unsigned long long *bad) {
    LUNAR_GRID_STRIDE(k, outer * n_idx * inner) {
        int64_t i = k % inner, o = k / (n_idx * inner);
        int64_t s = idx[k];
        out[k] = in_range(s, n_data, bad, k) ? src[(o * n_data + s) * inner + i] : lunar_from_f32<T>(0.0f);
    }
}

template <typename T>
__global__ void scatter_kernel(T *dst, const T *src, const int64_t *idx, int64_t outer, int64_t n_data, int64_t n_idx,
                               int64_t inner, int accumulate, unsigned long long *bad) {
    LUNAR_GRID_STRIDE(p, outer * inner) {
        int64_t o = p / inner, i = p % inner;
        for (int64_t j = 0; j < n_idx; j++) {
            int64_t k = (o * n_idx + j) * inner + i;
            int64_t d = idx[k];
            if (!in_range(d, n_data, bad, k)) continue;
            T *q = dst + (o * n_data + d) * inner + i;
            *q = accumulate ? lunar_from_f32<T>(lunar_to_f32(*q) + lunar_to_f32(src[k])) : src[k];
        }
    }
}

// ---- the out-of-range flag -------------------------------------------------------------------

typedef struct range_flag {
    lunar_tensor t;
    unsigned long long *bad;
} range_flag;

static lunar_status flag_begin(lunar_ctx *ctx, range_flag *f, const lunar_tensor *like, cudaStream_t stream) {
    int64_t one = 1;
    f->t = lunar_tensor{};
    lunar_status st = lunar_tensor_new(ctx, &f->t, LUNAR_DTYPE_I64, lunar_tensor_device(like), 1, &one);
    if (st != LUNAR_OK) return st;
    f->bad = (unsigned long long *)lunar_tensor_data(&f->t);
    cudaError_t e = cudaMemsetAsync(f->bad, 0xff, sizeof *f->bad, stream);
    if (e != cudaSuccess) {
        lunar_tensor_release(ctx, &f->t);
        return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "cudaMemsetAsync: %s", cudaGetErrorString(e));
    }
    return LUNAR_OK;
}

// After the launch: releases the flag; fails naming op, value and range if it was set.
static lunar_status flag_end(lunar_ctx *ctx, range_flag *f, cudaStream_t stream, const char *op,
                             const lunar_tensor *index, const lunar_tensor *data, const char *role, int dim,
                             int64_t n) {
    cudaError_t e = cudaGetLastError();
    unsigned long long pos = NO_BAD;
    long long value = 0;
    if (e == cudaSuccess) e = cudaMemcpyAsync(&pos, f->bad, sizeof pos, cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e == cudaSuccess && pos != NO_BAD) {
        const int64_t *ip = (const int64_t *)lunar_tensor_data(index) + pos;
        e = cudaMemcpyAsync(&value, ip, sizeof value, cudaMemcpyDeviceToHost, stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    }
    lunar_tensor_release(ctx, &f->t);
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "%s: %s", op, cudaGetErrorString(e));
    if (pos != NO_BAD && dim >= 0)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG,
                          "%s: index %lld (at flat position %llu of the index) out of range: %s '%s' has %lld entries along dim %d (0-based), valid 0..%lld",
                          op, value, pos, role, lunar_tensor_label(data), (long long)n, dim, (long long)n - 1);
    if (pos != NO_BAD)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG,
                          "%s: index %lld (at flat position %llu of the index) out of range: %s '%s' has %lld entries along the indexed dim, valid 0..%lld",
                          op, value, pos, role, lunar_tensor_label(data), (long long)n, (long long)n - 1);
    return LUNAR_OK;
}

#define DATA(T, t) ((T *)lunar_tensor_data(t))

// ---- launchers ---------------------------------------------------------------------------------

// Runs `launch` (a statement using T) for the float dtype dt; the flag is released on every path.
#define INDEX_DISPATCH(dt, T, ...)                                                              \
    switch (dt) {                                                                               \
    case LUNAR_DTYPE_F32: { typedef float T; __VA_ARGS__; break; }                              \
    case LUNAR_DTYPE_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; break; }                     \
    default: { typedef __half T; __VA_ARGS__; break; }                                          \
    }

extern "C" lunar_status lunar_cuda_embedding_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *ids,
                                                     const lunar_tensor *weight) {
    int64_t n = lunar_tensor_numel(ids), v = weight->shape[0], c = weight->shape[1];
    if (n * c == 0) return LUNAR_OK;
    cudaStream_t stream;
    range_flag f;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, out, &stream));
    LUNAR_TRY(flag_begin(ctx, &f, out, stream));
    INDEX_DISPATCH(weight->dtype, T,
        embedding_forward_kernel<T><<<lunar_cuda_grid(n * c), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, out), DATA(const int64_t, ids), DATA(const T, weight), n, v, c, f.bad));
    return flag_end(ctx, &f, stream, "embedding_forward", ids, weight, "weight", 0, v);
}

extern "C" lunar_status lunar_cuda_embedding_backward(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout,
                                                      const lunar_tensor *ids) {
    int64_t n = lunar_tensor_numel(ids), v = dweight->shape[0], c = dweight->shape[1];
    if (n * c == 0) return LUNAR_OK;
    cudaStream_t stream;
    range_flag f;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, dweight, &stream));
    LUNAR_TRY(flag_begin(ctx, &f, dweight, stream));
    INDEX_DISPATCH(dweight->dtype, T,
        embedding_backward_kernel<T><<<lunar_cuda_grid(n * c), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, dweight), DATA(const T, dout), DATA(const int64_t, ids), n, v, c, f.bad));
    return flag_end(ctx, &f, stream, "embedding_backward", ids, dweight, "dweight", 0, v);
}

extern "C" lunar_status lunar_cuda_index_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                                const lunar_tensor *index, int64_t outer, int64_t n_src,
                                                int64_t inner) {
    int64_t k_n = lunar_tensor_numel(index), work = outer * k_n * inner;
    if (work == 0) return LUNAR_OK;
    cudaStream_t stream;
    range_flag f;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, out, &stream));
    LUNAR_TRY(flag_begin(ctx, &f, out, stream));
    INDEX_DISPATCH(src->dtype, T,
        index_select_kernel<T><<<lunar_cuda_grid(work), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, out), DATA(const T, src), DATA(const int64_t, index), outer, n_src, k_n, inner, f.bad));
    return flag_end(ctx, &f, stream, "index_select", index, src, "src", -1, n_src);
}

extern "C" lunar_status lunar_cuda_index_add(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index,
                                             const lunar_tensor *src, double alpha, int64_t outer, int64_t n_dst,
                                             int64_t inner) {
    int64_t k_n = lunar_tensor_numel(index), work = outer * inner;
    if (work == 0 || k_n == 0) return LUNAR_OK;
    cudaStream_t stream;
    range_flag f;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, dst, &stream));
    LUNAR_TRY(flag_begin(ctx, &f, dst, stream));
    INDEX_DISPATCH(dst->dtype, T,
        index_add_kernel<T><<<lunar_cuda_grid(work), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, dst), DATA(const T, src), DATA(const int64_t, index), outer, n_dst, k_n, inner, (float)alpha, f.bad));
    return flag_end(ctx, &f, stream, "index_add", index, dst, "dst", -1, n_dst);
}

extern "C" lunar_status lunar_cuda_gather(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                          const lunar_tensor *index, int64_t outer, int64_t n_data, int64_t n_idx,
                                          int64_t inner) {
    int64_t work = outer * n_idx * inner;
    if (work == 0) return LUNAR_OK;
    cudaStream_t stream;
    range_flag f;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, out, &stream));
    LUNAR_TRY(flag_begin(ctx, &f, out, stream));
    INDEX_DISPATCH(src->dtype, T,
        gather_kernel<T><<<lunar_cuda_grid(work), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, out), DATA(const T, src), DATA(const int64_t, index), outer, n_data, n_idx, inner, f.bad));
    return flag_end(ctx, &f, stream, "gather", index, src, "src", -1, n_data);
}

extern "C" lunar_status lunar_cuda_scatter(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index,
                                           const lunar_tensor *src, int64_t outer, int64_t n_data, int64_t n_idx,
                                           int64_t inner, int accumulate) {
    int64_t work = outer * inner;
    if (work == 0 || n_idx == 0) return LUNAR_OK;
    cudaStream_t stream;
    range_flag f;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, dst, &stream));
    LUNAR_TRY(flag_begin(ctx, &f, dst, stream));
    INDEX_DISPATCH(dst->dtype, T,
        scatter_kernel<T><<<lunar_cuda_grid(work), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, dst), DATA(const T, src), DATA(const int64_t, index), outer, n_data, n_idx, inner, accumulate, f.bad));
    return flag_end(ctx, &f, stream, accumulate ? "scatter_add" : "scatter", index, dst, "dst", -1, n_data);
}
