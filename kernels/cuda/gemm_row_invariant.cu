// gemm_row_invariant.cu: c = alpha * a @ op(b) + beta * c with every element one dot product in
// a fixed order, on the GPU (contract: lunar_gemm_row_invariant in lunar/ops.h; the CPU kernel is
// kernels/cpu/gemm_row_invariant.c). cuBLAS picks its algorithm by shape, so a row of a product
// may change its bits with the number of rows; generation's decode steps multiply the rows of
// different sequences together and need them not to. The order on this device:
//
//   trans_b (b is (N, K)): one warp per column j; lane l sums a[k] * b[j][k] for k = l, l + 32,
//     ... in order of k (fused multiply-adds), then the 32 lane sums are added by a butterfly
//     (__shfl_xor_sync with offsets 16, 8, 4, 2, 1), which leaves every lane the same bits;
//   not trans_b (b is (K, N)): one thread per column j; one running sum of a[k] * b[k][j] for
//     k = 0, 1, ... (fused multiply-adds);
//
// then c = alpha * sum + beta * c (c not read when beta is 0), each operation rounded on its own.
// Nothing of it depends on M or on the row's place: a warp or thread takes the rows four at a
// time (one read of b for four rows), a group past M repeats the last row, computed and not
// stored, and all four go through the same instructions. Reads are coalesced: the lanes of a
// warp read consecutive k of one row of a and of b (trans_b), the threads of a block consecutive
// columns of a row of b (not trans_b). Up to RI_LAUNCH products go to one launch, passed by value
// (no copy to the device): blockIdx.y is the product, blockIdx.x its block of columns.
#include "common.cuh"

#define RI_LAUNCH 32       // products per launch
#define RI_ROWS 4          // rows of a per pass over b
#define RI_NT_WARPS 8      // trans_b: columns (warps) per block
#define RI_NN_THREADS 128  // not trans_b: columns (threads) per block

struct RiProduct {
    const void *a, *b;
    void *c;
    int m, n, k;
    long long lda, ldb, ldc;
};

struct RiLaunch {
    RiProduct p[RI_LAUNCH];
};

template <typename T>
__device__ __forceinline__ void ri_store(T *c, float sum, float alpha, float beta) {
    float v = __fmul_rn(alpha, sum);
    if (beta != 0.0f) v = __fadd_rn(v, __fmul_rn(beta, lunar_to_f32(*c)));
    *c = lunar_from_f32<T>(v);
}

template <typename T>
__global__ void __launch_bounds__(RI_NT_WARPS * 32) ri_nt_kernel(RiLaunch L, float alpha, float beta) {
    const RiProduct &p = L.p[blockIdx.y];
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * RI_NT_WARPS + (threadIdx.x >> 5);
    if (j >= p.n) return;
    const T *a = (const T *)p.a, *bj = (const T *)p.b + (long long)j * p.ldb;
    T *c = (T *)p.c;
    for (int r0 = 0; r0 < p.m; r0 += RI_ROWS) {
        const T *ar[RI_ROWS];
        for (int s = 0; s < RI_ROWS; s++) ar[s] = a + (long long)min(r0 + s, p.m - 1) * p.lda;
        float acc[RI_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = lane; k < p.k; k += 32) {
            float bv = lunar_to_f32(bj[k]);
#pragma unroll
            for (int s = 0; s < RI_ROWS; s++) acc[s] = __fmaf_rn(lunar_to_f32(ar[s][k]), bv, acc[s]);
        }
#pragma unroll
        for (int s = 0; s < RI_ROWS; s++)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[s] = __fadd_rn(acc[s], __shfl_xor_sync(0xffffffffu, acc[s], off));
        if (lane == 0)
            for (int s = 0; s < RI_ROWS && r0 + s < p.m; s++) ri_store(c + (long long)(r0 + s) * p.ldc + j, acc[s], alpha, beta);
    }
}

template <typename T>
__global__ void __launch_bounds__(RI_NN_THREADS) ri_nn_kernel(RiLaunch L, float alpha, float beta) {
    const RiProduct &p = L.p[blockIdx.y];
    int j = blockIdx.x * RI_NN_THREADS + threadIdx.x;
    if (j >= p.n) return;
    const T *a = (const T *)p.a, *b = (const T *)p.b + j;
    T *c = (T *)p.c;
    for (int r0 = 0; r0 < p.m; r0 += RI_ROWS) {
        const T *ar[RI_ROWS];
        for (int s = 0; s < RI_ROWS; s++) ar[s] = a + (long long)min(r0 + s, p.m - 1) * p.lda;
        float acc[RI_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = 0; k < p.k; k++) {
            float bv = lunar_to_f32(b[(long long)k * p.ldb]);
#pragma unroll
            for (int s = 0; s < RI_ROWS; s++) acc[s] = __fmaf_rn(lunar_to_f32(ar[s][k]), bv, acc[s]);
        }
        for (int s = 0; s < RI_ROWS && r0 + s < p.m; s++) ri_store(c + (long long)(r0 + s) * p.ldc + j, acc[s], alpha, beta);
    }
}

template <typename T>
static lunar_status ri_launch(lunar_ctx *ctx, cudaStream_t stream, const RiLaunch &L, int count, int max_n, int trans_b,
                              float alpha, float beta) {
    if (trans_b) {
        dim3 grid(CEIL_DIV(max_n, RI_NT_WARPS), count);
        ri_nt_kernel<T><<<grid, RI_NT_WARPS * 32, 0, stream>>>(L, alpha, beta);
    } else {
        dim3 grid(CEIL_DIV(max_n, RI_NN_THREADS), count);
        ri_nn_kernel<T><<<grid, RI_NN_THREADS, 0, stream>>>(L, alpha, beta);
    }
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "gemm_row_invariant");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_gemm_row_invariant(lunar_ctx *ctx, int n, lunar_tensor *const *c,
                                                      const lunar_tensor *const *a, const lunar_tensor *const *b,
                                                      int trans_b, float alpha, float beta) {
    if (n <= 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, c[0], &stream));
    for (int i0 = 0; i0 < n; i0 += RI_LAUNCH) {
        int count = n - i0 < RI_LAUNCH ? n - i0 : RI_LAUNCH, max_n = 0;
        RiLaunch L;
        for (int j = 0; j < count; j++) {
            const lunar_tensor *ta = a[i0 + j], *tb = b[i0 + j];
            lunar_tensor *tc = c[i0 + j];
            L.p[j] = RiProduct{lunar_tensor_data(ta), lunar_tensor_data(tb), lunar_tensor_data(tc), (int)tc->shape[0],
                               (int)tc->shape[1], (int)ta->shape[1], (long long)ta->stride[0],
                               (long long)tb->stride[0], (long long)tc->stride[0]};
            max_n = (int)tc->shape[1] > max_n ? (int)tc->shape[1] : max_n;
        }
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, a[i0]->dtype, T,
                                  LUNAR_TRY(ri_launch<T>(ctx, stream, L, count, max_n, trans_b, alpha, beta)));
    }
    return LUNAR_OK;
}
