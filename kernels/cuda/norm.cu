// norm.cu: RMSNorm and LayerNorm on the GPU, over the last dim (x seen as (N, C)).
//
// forward / backward_input: one block per row (blocks loop over rows when there are more rows
// than blocks); each thread sums a strided slice in f32 and the block combines the slices in a
// fixed tree (deterministic for a given block size). C = 0 gives mean 0 and variance 0, as on
// the CPU.
// RMSNorm follows HF exactly for 16-bit inputs: x * rstd is rounded to the input dtype before
// the multiplication by the weight (`weight * hidden.to(input_dtype)`).
// backward_params: deterministic two-stage sum. Stage 1: blocks of 32 columns x ROWS_PER_PART
// rows write f32 partial sums (in a fixed order) to a scratch (parts, C); stage 2: one thread
// per column adds the parts in order and accumulates into dw (and db), whose dtype may differ
// from x's (f32 gradients of bf16 activations).
#include "common.cuh"

#define NORM_BLOCK 256
#define ROWS_PER_PART 256
#define PART_TX 32
#define PART_TY 8

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of v over the block; every thread gets the result. sh holds 32 floats.
__device__ float block_sum(float v, float *sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();   // sh may still be read by a previous call
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? sh[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

// ---- RMSNorm -------------------------------------------------------------------------------

template <typename T>
__global__ void rmsnorm_forward_kernel(T *out, float *rstd, const T *x, const T *w, int64_t n, int64_t c, float eps) {
    __shared__ float sh[32];
    for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
        const T *xr = x + row * c;
        T *orow = out + row * c;
        float ss = 0.0f;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float v = lunar_to_f32(xr[i]);
            ss += v * v;
        }
        ss = block_sum(ss, sh);
        float r = rsqrtf((c > 0 ? ss / (float)c : 0.0f) + eps);
        if (threadIdx.x == 0) rstd[row] = r;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float xn = lunar_to_f32(lunar_from_f32<T>(lunar_to_f32(xr[i]) * r));   // HF: .to(input_dtype)
            orow[i] = lunar_from_f32<T>(w ? xn * lunar_to_f32(w[i]) : xn);
        }
    }
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dout * w
template <typename T>
__global__ void rmsnorm_backward_input_kernel(T *dx, const T *dout, const T *x, const T *w, const float *rstd,
                                              int64_t n, int64_t c) {
    __shared__ float sh[32];
    for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
        const T *xr = x + row * c, *dr = dout + row * c;
        T *dxr = dx + row * c;
        float r = rstd[row];
        float s = 0.0f;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float g = lunar_to_f32(dr[i]) * (w ? lunar_to_f32(w[i]) : 1.0f);
            s += g * lunar_to_f32(xr[i]);
        }
        s = block_sum(s, sh);
        float k = r * r * r * s / (float)c;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float g = lunar_to_f32(dr[i]) * (w ? lunar_to_f32(w[i]) : 1.0f);
            dxr[i] = lunar_from_f32<T>(r * g - lunar_to_f32(xr[i]) * k);
        }
    }
}

// ---- LayerNorm -----------------------------------------------------------------------------

template <typename T>
__global__ void layernorm_forward_kernel(T *out, float *mean, float *rstd, const T *x, const T *w, const T *b,
                                         int64_t n, int64_t c, float eps) {
    __shared__ float sh[32];
    for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
        const T *xr = x + row * c;
        T *orow = out + row * c;
        float s = 0.0f;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) s += lunar_to_f32(xr[i]);
        float mu = c > 0 ? block_sum(s, sh) / (float)c : 0.0f;
        float q = 0.0f;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float d = lunar_to_f32(xr[i]) - mu;
            q += d * d;
        }
        float r = rsqrtf((c > 0 ? block_sum(q, sh) / (float)c : 0.0f) + eps);   // biased variance
        if (threadIdx.x == 0) {
            mean[row] = mu;
            rstd[row] = r;
        }
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float y = (lunar_to_f32(xr[i]) - mu) * r;
            if (w) y *= lunar_to_f32(w[i]);
            if (b) y += lunar_to_f32(b[i]);
            orow[i] = lunar_from_f32<T>(y);
        }
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
template <typename T>
__global__ void layernorm_backward_input_kernel(T *dx, const T *dout, const T *x, const T *w, const float *mean,
                                                const float *rstd, int64_t n, int64_t c) {
    __shared__ float sh[32];
    for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
        const T *xr = x + row * c, *dr = dout + row * c;
        T *dxr = dx + row * c;
        float mu = mean[row], r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float g = lunar_to_f32(dr[i]) * (w ? lunar_to_f32(w[i]) : 1.0f);
            sg += g;
            sgx += g * (lunar_to_f32(xr[i]) - mu) * r;
        }
        float mg = block_sum(sg, sh) / (float)c;
        float mgx = block_sum(sgx, sh) / (float)c;
        for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
            float g = lunar_to_f32(dr[i]) * (w ? lunar_to_f32(w[i]) : 1.0f);
            float xh = (lunar_to_f32(xr[i]) - mu) * r;
            dxr[i] = lunar_from_f32<T>(r * (g - mg - xh * mgx));
        }
    }
}

// ---- parameter gradients (both norms) -------------------------------------------------------

// Stage 1: block (PART_TX, PART_TY) covers 32 columns and ROWS_PER_PART rows (blockIdx.y).
// pw[part, c] = sum of dout * xhat, pb[part, c] = sum of dout (pb may be NULL).
// xhat = x * rstd (mean == NULL, RMSNorm) or (x - mean) * rstd.
template <typename T>
__global__ void norm_params_partial_kernel(float *pw, float *pb, const T *dout, const T *x, const float *mean,
                                           const float *rstd, int64_t n, int64_t c) {
    __shared__ float sw[PART_TY][PART_TX + 1], sb[PART_TY][PART_TX + 1];
    int64_t col = (int64_t)blockIdx.x * PART_TX + threadIdx.x;
    int64_t r0 = (int64_t)blockIdx.y * ROWS_PER_PART;
    int64_t r1 = r0 + ROWS_PER_PART < n ? r0 + ROWS_PER_PART : n;
    float aw = 0.0f, ab = 0.0f;
    if (col < c) {
        for (int64_t r = r0 + threadIdx.y; r < r1; r += PART_TY) {
            float d = lunar_to_f32(dout[r * c + col]);
            float xv = lunar_to_f32(x[r * c + col]);
            float xh = mean ? (xv - mean[r]) * rstd[r] : xv * rstd[r];
            aw += d * xh;
            ab += d;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float tw = 0.0f, tb = 0.0f;
        for (int k = 0; k < PART_TY; k++) {
            tw += sw[k][threadIdx.x];
            tb += sb[k][threadIdx.x];
        }
        if (pw) pw[(int64_t)blockIdx.y * c + col] = tw;
        if (pb) pb[(int64_t)blockIdx.y * c + col] = tb;
    }
}

// Stage 2: acc[c] += sum over parts in order (acc is dw or db)
template <typename TW>
__global__ void norm_params_finish_kernel(TW *acc, const float *part, int64_t parts, int64_t c) {
    LUNAR_GRID_STRIDE(col, c) {
        float s = 0.0f;
        for (int64_t p = 0; p < parts; p++) s += part[p * c + col];
        acc[col] = lunar_from_f32<TW>(lunar_to_f32(acc[col]) + s);
    }
}

// ---- launchers -----------------------------------------------------------------------------

static void rows_of(const lunar_tensor *x, int64_t *n, int64_t *c) {
    *c = x->shape[x->ndim - 1];
    *n = 1;
    for (int i = 0; i < x->ndim - 1; i++) *n *= x->shape[i];
}

static int is_cuda_float(lunar_dtype dt) {
    return dt == LUNAR_DTYPE_F32 || dt == LUNAR_DTYPE_BF16 || dt == LUNAR_DTYPE_F16;
}

// blocks for n rows (the kernels loop over rows, so n may exceed the grid limit)
static unsigned row_blocks(int64_t n) { return (unsigned)(n < 65535LL * 32 ? n : 65535LL * 32); }

static unsigned norm_threads(int64_t c) {
    int64_t t = (c + 31) / 32 * 32;
    if (t < 32) t = 32;
    return (unsigned)(t < NORM_BLOCK ? t : NORM_BLOCK);
}

#define DATA(T, t) ((t) ? (T *)lunar_tensor_data(t) : (T *)NULL)

extern "C" lunar_status lunar_cuda_rmsnorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *rstd,
                                                   const lunar_tensor *x, const lunar_tensor *w, float eps) {
    int64_t n, c;
    rows_of(x, &n, &c);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        rmsnorm_forward_kernel<T><<<row_blocks(n), norm_threads(c), 0, stream>>>(
            DATA(T, out), DATA(float, rstd), DATA(const T, x), DATA(const T, w), n, c, eps));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "rmsnorm_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_rmsnorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                                          const lunar_tensor *x, const lunar_tensor *w,
                                                          const lunar_tensor *rstd) {
    int64_t n, c;
    rows_of(x, &n, &c);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        rmsnorm_backward_input_kernel<T><<<row_blocks(n), norm_threads(c), 0, stream>>>(
            DATA(T, dx), DATA(const T, dout), DATA(const T, x), DATA(const T, w), DATA(const float, rstd), n, c));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "rmsnorm_backward_input");
    return LUNAR_OK;
}

// dw, db (C) in their own dtype; mean NULL for RMSNorm
static lunar_status norm_params(lunar_ctx *ctx, const char *name, lunar_tensor *dw, lunar_tensor *db,
                                const lunar_tensor *dout, const lunar_tensor *x, const lunar_tensor *mean,
                                const lunar_tensor *rstd) {
    int64_t n, c;
    rows_of(x, &n, &c);
    if (n == 0 || c == 0 || (!dw && !db)) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    if (!is_cuda_float(x->dtype) || (dw && !is_cuda_float(dw->dtype)) || (db && !is_cuda_float(db->dtype)))
        return LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "%s: unsupported dtype (x %s)", name, lunar_dtype_name(x->dtype));
    int64_t parts = CEIL_DIV(n, (int64_t)ROWS_PER_PART);
    if (parts > 65535) return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "%s: %lld rows is too many", name, (long long)n);
    int64_t shape[2] = {dw && db ? 2 * parts : parts, c};
    lunar_tensor scratch = {0};
    st = lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_F32, lunar_tensor_device(x), 2, shape);
    if (st != LUNAR_OK) return st;
    float *pw = (float *)lunar_tensor_data(&scratch);
    float *pb = dw && db ? pw + parts * c : pw;
    if (!dw) pw = NULL;
    if (!db) pb = NULL;
    dim3 grid((unsigned)CEIL_DIV(c, (int64_t)PART_TX), (unsigned)parts), block(PART_TX, PART_TY);
    cudaError_t err = cudaSuccess;
    do {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
            norm_params_partial_kernel<T><<<grid, block, 0, stream>>>(pw, pb, DATA(const T, dout), DATA(const T, x),
                                                                      DATA(const float, mean), DATA(const float, rstd), n, c));
        err = cudaGetLastError();
        if (err != cudaSuccess) break;
        if (dw) {
            LUNAR_CUDA_DISPATCH_FLOAT(ctx, dw->dtype, TW,
                norm_params_finish_kernel<TW><<<lunar_cuda_grid(c), LUNAR_CUDA_BLOCK, 0, stream>>>(
                    DATA(TW, dw), pw, parts, c));
            err = cudaGetLastError();
            if (err != cudaSuccess) break;
        }
        if (db) {
            LUNAR_CUDA_DISPATCH_FLOAT(ctx, db->dtype, TW,
                norm_params_finish_kernel<TW><<<lunar_cuda_grid(c), LUNAR_CUDA_BLOCK, 0, stream>>>(
                    DATA(TW, db), pb, parts, c));
            err = cudaGetLastError();
        }
    } while (0);
    lunar_tensor_release(ctx, &scratch);   // stream-ordered: later work on this stream reuses it safely
    if (err != cudaSuccess) return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "%s launch: %s", name, cudaGetErrorString(err));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_rmsnorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, const lunar_tensor *dout,
                                                           const lunar_tensor *x, const lunar_tensor *rstd) {
    return norm_params(ctx, "rmsnorm_backward_params", dw, NULL, dout, x, NULL, rstd);
}

extern "C" lunar_status lunar_cuda_layernorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *mean,
                                                     lunar_tensor *rstd, const lunar_tensor *x, const lunar_tensor *w,
                                                     const lunar_tensor *b, float eps) {
    int64_t n, c;
    rows_of(x, &n, &c);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        layernorm_forward_kernel<T><<<row_blocks(n), norm_threads(c), 0, stream>>>(
            DATA(T, out), DATA(float, mean), DATA(float, rstd), DATA(const T, x), DATA(const T, w), DATA(const T, b),
            n, c, eps));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "layernorm_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_layernorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                                            const lunar_tensor *x, const lunar_tensor *w,
                                                            const lunar_tensor *mean, const lunar_tensor *rstd) {
    int64_t n, c;
    rows_of(x, &n, &c);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, x, &stream);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, x->dtype, T,
        layernorm_backward_input_kernel<T><<<row_blocks(n), norm_threads(c), 0, stream>>>(
            DATA(T, dx), DATA(const T, dout), DATA(const T, x), DATA(const T, w), DATA(const float, mean),
            DATA(const float, rstd), n, c));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "layernorm_backward_input");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_layernorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, lunar_tensor *db,
                                                             const lunar_tensor *dout, const lunar_tensor *x,
                                                             const lunar_tensor *mean, const lunar_tensor *rstd) {
    return norm_params(ctx, "layernorm_backward_params", dw, db, dout, x, mean, rstd);
}
