// index.cu: embedding, index_select and gather on the GPU.
//
// Index range checks happen here, on the device, with range_error.cuh's convention: a kernel that
// meets an index outside [0, n) skips it (gathers write 0) and records it in the device's range
// record under the launcher's ticket. No launcher reads anything back; the next check point
// (lunar_sync_check) fails with the op, the bad value and the valid range, as the CPU's host
// check does at the op.
//
// index_add, scatter / scatter_add (and index_select_sum, bincount) are in index_accumulate.cu:
// parallel over the index with the CPU's bits. embedding_backward uses atomicAdd over the rows
// (fast, but float sums in a run-dependent order); the CPU backend is the deterministic reference.
#include <limits.h>

#include "common.cuh"
#include "range_error.cuh"

template <typename T>
__global__ void embedding_forward_kernel(T *out, const int64_t *ids, const T *w, int64_t n, int64_t v, int64_t c,
                                         lunar_range_ticket rt) {
    LUNAR_GRID_STRIDE(k, n * c) {
        int64_t i = k / c, j = k % c;
        int64_t id = ids[i];
        out[k] = lunar_index_ok(rt, id, v, i) ? w[id * c + j] : lunar_from_f32<T>(0.0f);
    }
}

template <typename T>
__global__ void embedding_backward_kernel(T *dw, const T *dout, const int64_t *ids, int64_t n, int64_t v, int64_t c,
                                          lunar_range_ticket rt) {
    LUNAR_GRID_STRIDE(k, n * c) {
        int64_t i = k / c, j = k % c;
        int64_t id = ids[i];
        if (lunar_index_ok(rt, id, v, i)) atomicAdd(dw + id * c + j, dout[k]);
    }
}

template <typename T>
__global__ void index_select_kernel(T *out, const T *src, const int64_t *idx, int64_t outer, int64_t n_src, int64_t k_n,
                                    int64_t inner, lunar_range_ticket rt) {
    LUNAR_GRID_STRIDE(k, outer * k_n * inner) {
        int64_t i = k % inner, r = k / inner;
        int64_t j = r % k_n, o = r / k_n;
        int64_t s = idx[j];
        out[k] = lunar_index_ok(rt, s, n_src, j) ? src[(o * n_src + s) * inner + i] : lunar_from_f32<T>(0.0f);
    }
}

template <typename T>
__global__ void gather_kernel(T *out, const T *src, const int64_t *idx, int64_t outer, int64_t n_data, int64_t n_idx,
                              int64_t inner, lunar_range_ticket rt) {
    LUNAR_GRID_STRIDE(k, outer * n_idx * inner) {
        int64_t i = k % inner, o = k / (n_idx * inner);
        int64_t s = idx[k];
        out[k] = lunar_index_ok(rt, s, n_data, k) ? src[(o * n_data + s) * inner + i] : lunar_from_f32<T>(0.0f);
    }
}

#define DATA(T, t) ((T *)lunar_tensor_data(t))

// ---- launchers ---------------------------------------------------------------------------------

// Runs `launch` (a statement using T) for the float dtype dt.
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
    lunar_range_ticket rt;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, out, &stream));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, out, "embedding_forward", "weight", weight, 0, &rt));
    INDEX_DISPATCH(weight->dtype, T,
        embedding_forward_kernel<T><<<lunar_cuda_grid(n * c), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, out), DATA(const int64_t, ids), DATA(const T, weight), n, v, c, rt));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "embedding_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_embedding_backward(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout,
                                                      const lunar_tensor *ids) {
    int64_t n = lunar_tensor_numel(ids), v = dweight->shape[0], c = dweight->shape[1];
    if (n * c == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_range_ticket rt;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, dweight, &stream));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, dweight, "embedding_backward", "dweight", dweight, 0, &rt));
    INDEX_DISPATCH(dweight->dtype, T,
        embedding_backward_kernel<T><<<lunar_cuda_grid(n * c), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, dweight), DATA(const T, dout), DATA(const int64_t, ids), n, v, c, rt));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "embedding_backward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_index_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                                const lunar_tensor *index, int64_t outer, int64_t n_src,
                                                int64_t inner) {
    int64_t k_n = lunar_tensor_numel(index), work = outer * k_n * inner;
    if (work == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_range_ticket rt;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, out, &stream));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, out, "index_select", "src", src, -1, &rt));
    INDEX_DISPATCH(src->dtype, T,
        index_select_kernel<T><<<lunar_cuda_grid(work), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, out), DATA(const T, src), DATA(const int64_t, index), outer, n_src, k_n, inner, rt));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "index_select");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_gather(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                          const lunar_tensor *index, int64_t outer, int64_t n_data, int64_t n_idx,
                                          int64_t inner) {
    int64_t work = outer * n_idx * inner;
    if (work == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_range_ticket rt;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, out, &stream));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, out, "gather", "src", src, -1, &rt));
    INDEX_DISPATCH(src->dtype, T,
        gather_kernel<T><<<lunar_cuda_grid(work), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, out), DATA(const T, src), DATA(const int64_t, index), outer, n_data, n_idx, inner, rt));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "gather");
    return LUNAR_OK;
}
