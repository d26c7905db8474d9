// hyper.cu: mHC (GLM-5.3-Flash's hyper-connection residual streams) on the GPU, f32 (contracts
// in lunar/ops.h: lunar_hc_weights, lunar_hc_mix, lunar_hc_collapse and their backwards).
//
// The weights one thread per row, with the CPU's own row functions (kernels/hyper_math.h: f64,
// the Sinkhorn divisions rebuilt for the backward in a scratch of the row's own); the stream
// mixes one thread per output element or per sum, each over its terms in the CPU's order.
#include "common.cuh"
#include "hyper_math.h"

// scratch per row: c (n x n), den (n)
__global__ void hc_weights_kernel(float *pre, float *post, float *comb, const float *z, double *scr, int64_t N,
                                  int64_t n, int iters, float eps) {
    int64_t M = (2 + n) * n, nn = n * n;
    LUNAR_GRID_STRIDE(r, N) {
        double *c = scr + r * (nn + n);
        lunar_hc_weights_row(pre + r * n, post + r * n, comb + r * nn, z + r * M, c, c + nn, n, 2 * iters - 1, eps);
    }
}

// scratch per row: lunar_hc_backward_scratch(n, steps) doubles
__global__ void hc_weights_bwd_kernel(float *dz, const float *dpre, const float *dpost, const float *dcomb,
                                      const float *z, double *scr, int64_t N, int64_t n, int iters, float eps) {
    int64_t M = (2 + n) * n, nn = n * n;
    int steps = 2 * iters - 1;
    int64_t wf = lunar_hc_backward_scratch(n, steps);
    LUNAR_GRID_STRIDE(r, N) {
        lunar_hc_weights_backward_row(dz + r * M, dpre + r * n, dpost + r * n, dcomb + r * nn, z + r * M, scr + r * wf, n,
                                      steps, eps);
    }
}

// y[r, i, h] = post[r, i] a[r, h] + sum_j comb[r, j, i] x[r, j, h]
__global__ void hc_mix_kernel(float *y, const float *x, const float *a, const float *post, const float *comb, int64_t N,
                              int64_t n, int64_t H) {
    LUNAR_GRID_STRIDE(idx, N * n * H) {
        int64_t h = idx % H, i = (idx / H) % n, r = idx / (n * H);
        float acc = post[r * n + i] * a[r * H + h];
        for (int64_t j = 0; j < n; j++) acc += comb[(r * n + j) * n + i] * x[(r * n + j) * H + h];
        y[idx] = acc;
    }
}

// da[r, h] = sum_i post[r, i] dy[r, i, h];  dx[r, j, h] = sum_i comb[r, j, i] dy[r, i, h]
__global__ void hc_mix_bwd_rows_kernel(float *dx, float *da, const float *dy, const float *post, const float *comb,
                                       int64_t N, int64_t n, int64_t H) {
    LUNAR_GRID_STRIDE(idx, N * (n + 1) * H) {
        int64_t h = idx % H, j = (idx / H) % (n + 1), r = idx / ((n + 1) * H);
        float acc = 0;
        if (j == n) {
            for (int64_t i = 0; i < n; i++) acc += post[r * n + i] * dy[(r * n + i) * H + h];
            da[r * H + h] = acc;
        } else {
            for (int64_t i = 0; i < n; i++) acc += comb[(r * n + j) * n + i] * dy[(r * n + i) * H + h];
            dx[(r * n + j) * H + h] = acc;
        }
    }
}

// dpost[r, i] = sum_h dy[r, i, h] a[r, h];  dcomb[r, j, i] = sum_h dy[r, i, h] x[r, j, h]
__global__ void hc_mix_bwd_weights_kernel(float *dpost, float *dcomb, const float *dy, const float *x, const float *a,
                                          int64_t N, int64_t n, int64_t H) {
    LUNAR_GRID_STRIDE(idx, N * (n + 1) * n) {
        int64_t i = idx % n, j = (idx / n) % (n + 1), r = idx / ((n + 1) * n);
        const float *gi = dy + (r * n + i) * H;
        const float *other = j == n ? a + r * H : x + (r * n + j) * H;
        float acc = 0;
        for (int64_t h = 0; h < H; h++) acc += gi[h] * other[h];
        if (j == n) dpost[r * n + i] = acc;
        else dcomb[(r * n + j) * n + i] = acc;
    }
}

// u[r, h] = sum_j pre[r, j] x[r, j, h]
__global__ void hc_collapse_kernel(float *u, const float *x, const float *pre, int64_t N, int64_t n, int64_t H) {
    LUNAR_GRID_STRIDE(idx, N * H) {
        int64_t h = idx % H, r = idx / H;
        float acc = 0;
        for (int64_t j = 0; j < n; j++) acc += pre[r * n + j] * x[(r * n + j) * H + h];
        u[idx] = acc;
    }
}

// dx[r, j, h] += pre[r, j] du[r, h]
__global__ void hc_collapse_bwd_dx_kernel(float *dx, const float *du, const float *pre, int64_t N, int64_t n, int64_t H) {
    LUNAR_GRID_STRIDE(idx, N * n * H) {
        int64_t h = idx % H, rj = idx / H, r = rj / n;
        dx[idx] += pre[rj] * du[r * H + h];
    }
}

// dpre[r, j] = sum_h du[r, h] x[r, j, h]
__global__ void hc_collapse_bwd_dpre_kernel(float *dpre, const float *du, const float *x, int64_t N, int64_t n, int64_t H) {
    LUNAR_GRID_STRIDE(rj, N * n) {
        int64_t r = rj / n;
        float acc = 0;
        for (int64_t h = 0; h < H; h++) acc += du[r * H + h] * x[rj * H + h];
        dpre[rj] = acc;
    }
}

#define F(t) ((float *)lunar_tensor_data(t))
#define CF(t) ((const float *)lunar_tensor_data(t))

// a scratch of n doubles on the tensor's device (released by the caller)
static lunar_status hc_scratch(lunar_ctx *ctx, lunar_tensor *scr, const lunar_tensor *like, int64_t n) {
    return lunar_tensor_new(ctx, scr, LUNAR_DTYPE_F64, lunar_tensor_device(like), 1, &n);
}

extern "C" lunar_status lunar_cuda_hc_weights(lunar_ctx *ctx, lunar_tensor *pre, lunar_tensor *post, lunar_tensor *comb,
                                              const lunar_tensor *z, int64_t n, int iters, float eps) {
    int64_t N = z->shape[0];
    if (N == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, z, &stream));
    lunar_tensor scr = {0};
    LUNAR_TRY(hc_scratch(ctx, &scr, z, N * (n * n + n)));
    hc_weights_kernel<<<lunar_cuda_grid(N, 128), 128, 0, stream>>>(F(pre), F(post), F(comb), CF(z),
                                                                  (double *)lunar_tensor_data(&scr), N, n, iters, eps);
    cudaError_t e = cudaGetLastError();
    lunar_tensor_release(ctx, &scr);
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "hc_weights launch: %s", cudaGetErrorString(e));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_hc_weights_backward(lunar_ctx *ctx, lunar_tensor *dz, const lunar_tensor *dpre,
                                                       const lunar_tensor *dpost, const lunar_tensor *dcomb,
                                                       const lunar_tensor *z, int64_t n, int iters, float eps) {
    int64_t N = z->shape[0];
    if (N == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, z, &stream));
    int64_t wf = lunar_hc_backward_scratch(n, 2 * iters - 1);
    lunar_tensor scr = {0};
    LUNAR_TRY(hc_scratch(ctx, &scr, z, N * wf));
    hc_weights_bwd_kernel<<<lunar_cuda_grid(N, 128), 128, 0, stream>>>(F(dz), CF(dpre), CF(dpost), CF(dcomb), CF(z),
                                                                      (double *)lunar_tensor_data(&scr), N, n, iters,
                                                                      eps);
    cudaError_t e = cudaGetLastError();
    lunar_tensor_release(ctx, &scr);
    if (e != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "hc_weights_backward launch: %s", cudaGetErrorString(e));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_hc_mix(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *a,
                                          const lunar_tensor *post, const lunar_tensor *comb) {
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    if (N * n * H == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, x, &stream));
    hc_mix_kernel<<<lunar_cuda_grid(N * n * H), LUNAR_CUDA_BLOCK, 0, stream>>>(F(y), CF(x), CF(a), CF(post), CF(comb), N,
                                                                               n, H);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "hc_mix");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_hc_mix_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *da, lunar_tensor *dpost,
                                                   lunar_tensor *dcomb, const lunar_tensor *dy, const lunar_tensor *x,
                                                   const lunar_tensor *a, const lunar_tensor *post,
                                                   const lunar_tensor *comb) {
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    if (N * n == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, x, &stream));
    hc_mix_bwd_rows_kernel<<<lunar_cuda_grid(N * (n + 1) * H), LUNAR_CUDA_BLOCK, 0, stream>>>(F(dx), F(da), CF(dy),
                                                                                              CF(post), CF(comb), N, n, H);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "hc_mix_backward (dx, da)");
    hc_mix_bwd_weights_kernel<<<lunar_cuda_grid(N * (n + 1) * n), LUNAR_CUDA_BLOCK, 0, stream>>>(F(dpost), F(dcomb),
                                                                                                 CF(dy), CF(x), CF(a),
                                                                                                 N, n, H);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "hc_mix_backward (dpost, dcomb)");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_hc_collapse(lunar_ctx *ctx, lunar_tensor *u, const lunar_tensor *x,
                                               const lunar_tensor *pre) {
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    if (N * H == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, x, &stream));
    hc_collapse_kernel<<<lunar_cuda_grid(N * H), LUNAR_CUDA_BLOCK, 0, stream>>>(F(u), CF(x), CF(pre), N, n, H);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "hc_collapse");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_hc_collapse_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dpre,
                                                        const lunar_tensor *du, const lunar_tensor *x,
                                                        const lunar_tensor *pre) {
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    if (N * n == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, x, &stream));
    hc_collapse_bwd_dx_kernel<<<lunar_cuda_grid(N * n * H), LUNAR_CUDA_BLOCK, 0, stream>>>(F(dx), CF(du), CF(pre), N, n,
                                                                                           H);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "hc_collapse_backward (dx)");
    hc_collapse_bwd_dpre_kernel<<<lunar_cuda_grid(N * n), LUNAR_CUDA_BLOCK, 0, stream>>>(F(dpre), CF(du), CF(x), N, n, H);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "hc_collapse_backward (dpre)");
    return LUNAR_OK;
}
