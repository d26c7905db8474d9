// index_accumulate.cu: the index ops that write through an index on the GPU: index_add,
// scatter / scatter_add, index_select_sum (the MoE combine) and bincount (its per-expert counts).
// All are parallel over the index and give the CPU backend's bits (kernels/cpu/index.c):
//
//   index_select_sum: one thread per output element sums its K source rows in k order, in f32
//     from 0 (or from out), and rounds once, which is what the CPU does.
//   bincount: each block counts its share of the values in shared memory, then adds its counts
//     into the result with integer atomics; integer sums are exact in any order.
//   index_add, scatter, scatter_add: the index positions are sorted by destination with a stable
//     radix sort (CUB), so the positions of one destination keep their index order. The thread
//     at the first position of each destination's run then sums the run in that order (f32,
//     starting from the destination's value, rounded once), or for scatter writes the run's last
//     source, so the last duplicate wins as on the CPU. Float sums keep the CPU's order; the
//     price is that a destination with very many entries is summed by one thread.
//
// Index values are checked in the kernels (range_error.cuh): a bad value is skipped and
// recorded, and the next check point raises it.
#include <cub/device/device_radix_sort.cuh>

#include "range_error.cuh"

#define DATA(T, t) ((T *)lunar_tensor_data(t))

// Runs the statement with T bound to the C++ type of float dtype dt; other dtypes set st.
#define ACC_DISPATCH(st, ctx, dt, T, ...)                                                       \
    switch (dt) {                                                                               \
    case LUNAR_DTYPE_F32: { typedef float T; __VA_ARGS__; break; }                              \
    case LUNAR_DTYPE_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; break; }                     \
    case LUNAR_DTYPE_F16: { typedef __half T; __VA_ARGS__; break; }                             \
    default:                                                                                    \
        st = LUNAR_FAIL((ctx), LUNAR_ERR_DTYPE, "cuda: unsupported float dtype %s", lunar_dtype_name(dt)); \
    }

// ---- index_select_sum --------------------------------------------------------------------------

// out (N, C)[n, c] (= or +=) sum over k = 0..K-1 of src (R, C)[index[n, k], c]
template <typename T>
__global__ void index_select_sum_kernel(T *out, const T *src, const int64_t *index, int64_t n, int64_t k_n,
                                        int64_t c, int64_t r_src, int accumulate, lunar_range_ticket rt) {
    LUNAR_GRID_STRIDE(p, n * c) {
        int64_t row = p / c, col = p % c;
        float acc = accumulate ? lunar_to_f32(out[p]) : 0.0f;
        for (int64_t k = 0; k < k_n; k++) {
            int64_t r = index[row * k_n + k];
            if (lunar_index_ok(rt, r, r_src, row * k_n + k)) acc = __fadd_rn(acc, lunar_to_f32(src[r * c + col]));
        }
        out[p] = lunar_from_f32<T>(acc);
    }
}

extern "C" lunar_status lunar_cuda_index_select_sum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                                    const lunar_tensor *index, int accumulate) {
    int64_t n = index->shape[0], k_n = index->shape[1], c = src->shape[1], r_src = src->shape[0];
    if (n * c == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_range_ticket rt;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, out, &stream));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, out, "index_select_sum", "src", src, 0, &rt));
    lunar_status st = LUNAR_OK;
    ACC_DISPATCH(st, ctx, out->dtype, T,
        index_select_sum_kernel<T><<<lunar_cuda_grid(n * c), LUNAR_CUDA_BLOCK, 0, stream>>>(
            DATA(T, out), DATA(const T, src), DATA(const int64_t, index), n, k_n, c, r_src, accumulate, rt));
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "index_select_sum");
    return LUNAR_OK;
}

// ---- bincount ----------------------------------------------------------------------------------

#define BINCOUNT_SMEM_BINS 8192    // u32 counters per block: 32 KiB of shared memory
#define BINCOUNT_MAX_BLOCKS 512    // each block adds all its bins once: keep that part small

__global__ void bincount_smem_kernel(unsigned long long *counts, const int64_t *values, int64_t n, int64_t bins,
                                     lunar_range_ticket rt) {
    extern __shared__ unsigned int block_counts[];
    for (int64_t b = threadIdx.x; b < bins; b += blockDim.x) block_counts[b] = 0;
    __syncthreads();
    LUNAR_GRID_STRIDE(i, n) {
        int64_t v = values[i];
        if (lunar_index_ok(rt, v, bins, i)) atomicAdd(&block_counts[v], 1u);
    }
    __syncthreads();
    for (int64_t b = threadIdx.x; b < bins; b += blockDim.x)
        if (block_counts[b]) atomicAdd(&counts[b], (unsigned long long)block_counts[b]);
}

// more bins than fit in shared memory: count straight into the result
__global__ void bincount_global_kernel(unsigned long long *counts, const int64_t *values, int64_t n, int64_t bins,
                                       lunar_range_ticket rt) {
    LUNAR_GRID_STRIDE(i, n) {
        int64_t v = values[i];
        if (lunar_index_ok(rt, v, bins, i)) atomicAdd(&counts[v], 1ULL);
    }
}

extern "C" lunar_status lunar_cuda_bincount(lunar_ctx *ctx, lunar_tensor *counts, const lunar_tensor *values) {
    int64_t n = lunar_tensor_numel(values), bins = lunar_tensor_numel(counts);
    cudaStream_t stream;
    lunar_range_ticket rt;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, counts, &stream));
    unsigned long long *c = DATA(unsigned long long, counts);   // i64 counts, never negative
    LUNAR_CUDA_CHECK(ctx, cudaMemsetAsync(c, 0, (size_t)bins * sizeof *c, stream));
    if (n == 0) return LUNAR_OK;
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, counts, "bincount", "counts", counts, 0, &rt));
    const int64_t *v = DATA(const int64_t, values);
    unsigned grid = lunar_cuda_grid(n);
    // a block's u32 counters hold at most its share of n, so n < 2^32 keeps them exact
    if (bins <= BINCOUNT_SMEM_BINS && n < (1LL << 32)) {
        if (grid > BINCOUNT_MAX_BLOCKS) grid = BINCOUNT_MAX_BLOCKS;
        bincount_smem_kernel<<<grid, LUNAR_CUDA_BLOCK, (size_t)bins * sizeof(unsigned int), stream>>>(c, v, n, bins, rt);
    } else {
        bincount_global_kernel<<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(c, v, n, bins, rt);
    }
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "bincount");
    return LUNAR_OK;
}

// ---- index positions sorted by destination -----------------------------------------------------

// Scratch for one sort of m (key, position) pairs: a kernel fills keys_in / pos_in, the sort
// writes keys / pos. A key is a flat destination, or `none` (larger than every destination) for
// a bad index value, which sorts last and is skipped.
typedef struct dest_sort {
    lunar_tensor        buf;       // one pool block for everything below
    unsigned long long *keys_in, *keys;
    int64_t            *pos_in, *pos;
    void               *temp;      // CUB's temporary storage
    size_t              temp_bytes;
    int                 end_bit;   // the sort looks at key bits [0, end_bit): enough for `none`
} dest_sort;

static lunar_status dest_sort_new(lunar_ctx *ctx, dest_sort *s, const lunar_tensor *on, int64_t m,
                                  unsigned long long none) {
    s->end_bit = 1;
    while (s->end_bit < 64 && (none >> s->end_bit) != 0) s->end_bit++;
    s->temp_bytes = 0;
    // a size query with the arguments of the real call: nothing runs
    LUNAR_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(NULL, s->temp_bytes, (const unsigned long long *)NULL,
                                                          (unsigned long long *)NULL, (const int64_t *)NULL,
                                                          (int64_t *)NULL, m, 0, s->end_bit));
    int64_t temp_words = CEIL_DIV((int64_t)s->temp_bytes, 32) * 4;   // whole 32-byte lines
    int64_t words = 4 * m + temp_words;
    s->buf = lunar_tensor{};
    LUNAR_TRY(lunar_tensor_new(ctx, &s->buf, LUNAR_DTYPE_I64, lunar_tensor_device(on), 1, &words));
    int64_t *w = DATA(int64_t, &s->buf);
    s->temp = w;   // first: the pool block's alignment (CUB aligns inside it as well)
    s->keys_in = (unsigned long long *)(w + temp_words);
    s->keys = s->keys_in + m;
    s->pos_in = w + temp_words + 2 * m;
    s->pos = s->pos_in + m;
    return LUNAR_OK;
}

// keys_in / pos_in filled: sort them (stable, so equal keys keep position order)
static lunar_status dest_sort_run(lunar_ctx *ctx, dest_sort *s, int64_t m, cudaStream_t stream) {
    LUNAR_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(s->temp, s->temp_bytes, s->keys_in, s->keys, s->pos_in,
                                                          s->pos, m, 0, s->end_bit, stream));
    return LUNAR_OK;
}

// ---- index_add ---------------------------------------------------------------------------------

// keys of index_add: destination row index[j] (or none = n_dst), position j
__global__ void index_add_keys_kernel(unsigned long long *keys, int64_t *pos, const int64_t *index, int64_t k_n,
                                      int64_t n_dst, lunar_range_ticket rt) {
    LUNAR_GRID_STRIDE(j, k_n) {
        int64_t d = index[j];
        keys[j] = lunar_index_ok(rt, d, n_dst, j) ? (unsigned long long)d : (unsigned long long)n_dst;
        pos[j] = j;
    }
}

// dst (outer, n_dst, inner)[o, d, i] += alpha * src (outer, K, inner)[o, j, i] for the run of
// sorted positions s.. whose key is d, in index order; one thread per (o, s, i), the run's first
// s does the work
template <typename T>
__global__ void index_add_runs_kernel(T *dst, const T *src, const unsigned long long *keys, const int64_t *pos,
                                      int64_t outer, int64_t n_dst, int64_t k_n, int64_t inner, float alpha) {
    LUNAR_GRID_STRIDE(p, outer * k_n * inner) {
        int64_t i = p % inner, r = p / inner;
        int64_t s = r % k_n, o = r / k_n;
        unsigned long long d = keys[s];
        if (d == (unsigned long long)n_dst || (s > 0 && keys[s - 1] == d)) continue;
        T *q = dst + (o * n_dst + (int64_t)d) * inner + i;
        float acc = lunar_to_f32(*q);
        for (int64_t e = s; e < k_n && keys[e] == d; e++)
            acc = __fadd_rn(acc, __fmul_rn(alpha, lunar_to_f32(src[(o * k_n + pos[e]) * inner + i])));
        *q = lunar_from_f32<T>(acc);
    }
}

extern "C" lunar_status lunar_cuda_index_add(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index,
                                             const lunar_tensor *src, double alpha, int64_t outer, int64_t n_dst,
                                             int64_t inner) {
    int64_t k_n = lunar_tensor_numel(index);
    if (outer * inner == 0 || k_n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_range_ticket rt;
    dest_sort s;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, dst, &stream));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, dst, "index_add", "dst", dst, -1, &rt));
    LUNAR_TRY(dest_sort_new(ctx, &s, dst, k_n, (unsigned long long)n_dst));
    index_add_keys_kernel<<<lunar_cuda_grid(k_n), LUNAR_CUDA_BLOCK, 0, stream>>>(
        s.keys_in, s.pos_in, DATA(const int64_t, index), k_n, n_dst, rt);
    lunar_status st = dest_sort_run(ctx, &s, k_n, stream);
    if (st == LUNAR_OK) {
        ACC_DISPATCH(st, ctx, dst->dtype, T,
            index_add_runs_kernel<T><<<lunar_cuda_grid(outer * k_n * inner), LUNAR_CUDA_BLOCK, 0, stream>>>(
                DATA(T, dst), DATA(const T, src), s.keys, s.pos, outer, n_dst, k_n, inner, (float)alpha));
    }
    cudaError_t e = cudaGetLastError();
    lunar_tensor_release(ctx, &s.buf);   // stream-ordered reuse: later work on this stream runs after these kernels
    if (st != LUNAR_OK) return st;
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "index_add launch: %s", cudaGetErrorString(e));
    return LUNAR_OK;
}

// ---- scatter / scatter_add ---------------------------------------------------------------------

// keys of scatter: the flat destination (o * n_data + index[k]) * inner + i of each flat index
// position k = (o * n_idx + j) * inner + i (or none = outer * n_data * inner), position k
__global__ void scatter_keys_kernel(unsigned long long *keys, int64_t *pos, const int64_t *index, int64_t outer,
                                    int64_t n_data, int64_t n_idx, int64_t inner, lunar_range_ticket rt) {
    unsigned long long none = (unsigned long long)(outer * n_data * inner);
    LUNAR_GRID_STRIDE(k, outer * n_idx * inner) {
        int64_t i = k % inner, o = k / (n_idx * inner);
        int64_t d = index[k];
        keys[k] = lunar_index_ok(rt, d, n_data, k) ? (unsigned long long)((o * n_data + d) * inner + i) : none;
        pos[k] = k;
    }
}

// dst[d] (+= each, or = the last) src[pos[e]] over the run of sorted positions whose key is d
template <typename T>
__global__ void scatter_runs_kernel(T *dst, const T *src, const unsigned long long *keys, const int64_t *pos,
                                    int64_t m, unsigned long long none, int accumulate) {
    LUNAR_GRID_STRIDE(s, m) {
        unsigned long long d = keys[s];
        if (d == none || (s > 0 && keys[s - 1] == d)) continue;
        int64_t e = s;
        if (accumulate) {
            float acc = lunar_to_f32(dst[d]);
            for (; e < m && keys[e] == d; e++) acc = __fadd_rn(acc, lunar_to_f32(src[pos[e]]));
            dst[d] = lunar_from_f32<T>(acc);
        } else {
            while (e + 1 < m && keys[e + 1] == d) e++;
            dst[d] = src[pos[e]];
        }
    }
}

extern "C" lunar_status lunar_cuda_scatter(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index,
                                           const lunar_tensor *src, int64_t outer, int64_t n_data, int64_t n_idx,
                                           int64_t inner, int accumulate) {
    int64_t m = outer * n_idx * inner;
    if (m == 0) return LUNAR_OK;
    const char *op = accumulate ? "scatter_add" : "scatter";
    unsigned long long none = (unsigned long long)(outer * n_data * inner);
    cudaStream_t stream;
    lunar_range_ticket rt;
    dest_sort s;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, dst, &stream));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, dst, op, "dst", dst, -1, &rt));
    LUNAR_TRY(dest_sort_new(ctx, &s, dst, m, none));
    scatter_keys_kernel<<<lunar_cuda_grid(m), LUNAR_CUDA_BLOCK, 0, stream>>>(
        s.keys_in, s.pos_in, DATA(const int64_t, index), outer, n_data, n_idx, inner, rt);
    lunar_status st = dest_sort_run(ctx, &s, m, stream);
    if (st == LUNAR_OK) {
        ACC_DISPATCH(st, ctx, dst->dtype, T,
            scatter_runs_kernel<T><<<lunar_cuda_grid(m), LUNAR_CUDA_BLOCK, 0, stream>>>(
                DATA(T, dst), DATA(const T, src), s.keys, s.pos, m, none, accumulate));
    }
    cudaError_t e = cudaGetLastError();
    lunar_tensor_release(ctx, &s.buf);   // stream-ordered reuse, as above
    if (st != LUNAR_OK) return st;
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "%s launch: %s", op, cudaGetErrorString(e));
    return LUNAR_OK;
}
