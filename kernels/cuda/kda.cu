// kda.cu: KDA's gated delta rule, its short causal conv and their decode steps on the GPU, f32
// (contracts in lunar/ops.h: lunar_kda_forward / _backward, lunar_conv1d_causal_forward /
// _backward, lunar_conv1d_step, lunar_kda_step; the host ops pass every tensor in f32, seg and
// slots in i64).
//
// The delta rule runs token by token (the recurrence itself, not the CPU's chunked WY form: the
// same math, rounded differently). One block per (segment, head) with one thread per value column
// j of the state S (Dk, Dv): thread j holds S[:, j], and every step of the rule is a column-wise
// update, so the threads never exchange state; the token's q, k and decay go through shared memory.
// The backward needs each token's state again, in reverse order: a forward pass writes the state
// at the start of every chunk of KDA_CUDA_CHUNK tokens, then each chunk, last first, is recomputed
// into a per-block buffer and walked backwards (the recurrence's adjoint, as kernels/cpu/kda.c
// runs it; the states are rebuilt in f32, the adjoint summed in f64). The sums over the columns
// (dq, dk, dg, dbeta) go through shared memory in a fixed order, so the results do not depend on
// the launch. Limits: Dk <= KDA_CUDA_MAX_DK; Dv <= 1024 (LUNAR_KDA_STEP_MAX_DV), and <= 512 for
// the backward, whose column sums take Dv x 32 doubles of shared memory.
//
// The conv kernels take one thread per output element, each summing in the CPU kernel's order.
#include "common.cuh"
#include "lunar/ops.h"

#define KDA_CUDA_MAX_DK 256
#define KDA_CUDA_CHUNK 64
#define KDA_CUDA_BWD_BLOCKS 64   // backward blocks at once (each holds a chunk's states)

static inline int kda_threads(int64_t Dv) { return (int)(CEIL_DIV(Dv, 32) * 32); }

// ---- the conv ---------------------------------------------------------------------------------

// the segment of row r (binary search of seg (nseg + 1) offsets)
__device__ __forceinline__ int64_t seg_of_row(const int64_t *seg, int64_t nseg, int64_t r) {
    int64_t lo = 0, hi = nseg - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (seg[mid] <= r) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__device__ __forceinline__ float conv_in(const float *x, const float *hist, int64_t C, int64_t K, int64_t s,
                                         int64_t first, int64_t t, int64_t c) {
    if (t >= 0) return x[(first + t) * C + c];
    if (!hist || t < -(K - 1)) return 0.0f;
    return hist[(s * (K - 1) + (K - 1) + t) * C + c];
}

__global__ void conv_fwd_kernel(float *y, const float *x, const float *w, const int64_t *seg, const float *hist,
                                int64_t nseg, int64_t N, int64_t C, int64_t K) {
    LUNAR_GRID_STRIDE(idx, N * C) {
        int64_t r = idx / C, c = idx % C;
        int64_t s = seg_of_row(seg, nseg, r), first = seg[s], t = r - first;
        float acc = 0;
        for (int64_t j = 0; j < K; j++) acc += w[c * K + j] * conv_in(x, hist, C, K, s, first, t - K + 1 + j, c);
        y[idx] = acc;
    }
}

__global__ void conv_bwd_dx_kernel(float *dx, const float *dy, const float *w, const int64_t *seg, int64_t nseg,
                                   int64_t N, int64_t C, int64_t K) {
    LUNAR_GRID_STRIDE(idx, N * C) {
        int64_t r = idx / C, c = idx % C;
        int64_t s = seg_of_row(seg, nseg, r), first = seg[s], n = seg[s + 1] - first, t = r - first;
        float acc = 0;
        for (int64_t j = 0; j < K; j++) {
            int64_t o = t + K - 1 - j;
            if (o < n) acc += w[c * K + j] * dy[(first + o) * C + c];
        }
        dx[idx] = acc;
    }
}

// dw[c, j] += sum over every row (segment by segment, in order) of dy * the input it multiplied
__global__ void conv_bwd_dw_kernel(float *dw, const float *dy, const float *x, const int64_t *seg, const float *hist,
                                   int64_t nseg, int64_t C, int64_t K) {
    LUNAR_GRID_STRIDE(idx, C * K) {
        int64_t c = idx / K, j = idx % K;
        double acc = 0;
        for (int64_t s = 0; s < nseg; s++) {
            int64_t first = seg[s], n = seg[s + 1] - first;
            for (int64_t t = 0; t < n; t++)
                acc += (double)dy[(first + t) * C + c] * conv_in(x, hist, C, K, s, first, t - K + 1 + j, c);
        }
        dw[idx] += (float)acc;
    }
}

__global__ void conv_step_kernel(float *y, float *hist, const float *x, const float *w, const int64_t *slots,
                                 int64_t B, int64_t C, int64_t K) {
    LUNAR_GRID_STRIDE(idx, B * C) {
        int64_t b = idx / C, c = idx % C;
        float *h = hist ? hist + slots[b] * (K - 1) * C : NULL;
        float acc = 0;
        for (int64_t j = 0; j < K - 1; j++) acc += w[c * K + j] * h[j * C + c];
        acc += w[c * K + K - 1] * x[idx];
        y[idx] = acc;
        if (h) {   // this thread's channel of the history only
            for (int64_t j = 0; j + 1 < K - 1; j++) h[j * C + c] = h[(j + 1) * C + c];
            h[(K - 2) * C + c] = x[idx];
        }
    }
}

// ---- the delta rule ---------------------------------------------------------------------------

struct kda_dev {
    const float *q, *k, *v, *g, *beta, *state0, *dout, *dstate;
    float *o, *state, *dq, *dk, *dv, *dg, *dbeta, *dstate0, *ckpt, *buf;
    const int64_t *seg;
    int64_t nseg, H, Dk, Dv;
};

// one token of the rule for thread j's column S[0..Dk) (shared: q, k, e^g of the token)
__device__ __forceinline__ float kda_token(float *S, const float *qs, const float *ks, const float *es, float beta,
                                           float vj, int64_t Dk) {
    float kS = 0;
    for (int64_t d = 0; d < Dk; d++) {
        S[d] *= es[d];
        kS += ks[d] * S[d];
    }
    float u = beta * (vj - kS);
    float o = 0;
    for (int64_t d = 0; d < Dk; d++) {
        S[d] += ks[d] * u;
        o += qs[d] * S[d];
    }
    return o;
}

// the token's q, k and e^g into shared memory (all threads of the block)
__device__ __forceinline__ void kda_load(const kda_dev &a, int64_t row, int64_t h, float *qs, float *ks, float *es) {
    const float *q = a.q + (row * a.H + h) * a.Dk, *k = a.k + (row * a.H + h) * a.Dk, *g = a.g + (row * a.H + h) * a.Dk;
    for (int64_t d = threadIdx.x; d < a.Dk; d += blockDim.x) {
        qs[d] = q[d];
        ks[d] = k[d];
        es[d] = expf(g[d]);
    }
}

__global__ void kda_fwd_kernel(kda_dev a) {
    __shared__ float qs[KDA_CUDA_MAX_DK], ks[KDA_CUDA_MAX_DK], es[KDA_CUDA_MAX_DK];
    int64_t item = blockIdx.x, s = item / a.H, h = item % a.H, j = threadIdx.x;
    bool live = j < a.Dv;
    float S[KDA_CUDA_MAX_DK];
    for (int64_t d = 0; d < a.Dk; d++) S[d] = live && a.state0 ? a.state0[((s * a.H + h) * a.Dk + d) * a.Dv + j] : 0.0f;
    for (int64_t row = a.seg[s]; row < a.seg[s + 1]; row++) {
        __syncthreads();
        kda_load(a, row, h, qs, ks, es);
        __syncthreads();
        if (live) {
            float o = kda_token(S, qs, ks, es, a.beta[row * a.H + h], a.v[(row * a.H + h) * a.Dv + j], a.Dk);
            a.o[(row * a.H + h) * a.Dv + j] = o;
        }
    }
    if (live && a.state)
        for (int64_t d = 0; d < a.Dk; d++) a.state[((s * a.H + h) * a.Dk + d) * a.Dv + j] = S[d];
}

// the chunk offset of segment s: sum of the earlier segments' chunk counts
__device__ __forceinline__ int64_t chunk_base(const int64_t *seg, int64_t s) {
    int64_t c = 0;
    for (int64_t i = 0; i < s; i++) c += CEIL_DIV(seg[i + 1] - seg[i], (int64_t)KDA_CUDA_CHUNK);
    return c;
}

// sum over the block's columns of vals[j] for every d: red (blockDim.x, 32) shared; out[d] (d
// < Dk) written by the thread of index d % 32 of warp 0 in a fixed order over j
__device__ void column_sums(const double *vals, int64_t Dk, float *out, double *red, int64_t nthreads) {
    int64_t j = threadIdx.x;
    for (int64_t d0 = 0; d0 < Dk; d0 += 32) {
        __syncthreads();
        for (int64_t e = 0; e < 32; e++) red[j * 32 + e] = (d0 + e < Dk) ? vals[d0 + e] : 0.0;
        __syncthreads();
        if (j < 32 && d0 + j < Dk) {
            double acc = 0;
            for (int64_t t = 0; t < nthreads; t++) acc += red[t * 32 + j];
            out[d0 + j] = (float)acc;
        }
    }
}

__global__ void kda_bwd_kernel(kda_dev a, int64_t nitems) {
    __shared__ float qs[KDA_CUDA_MAX_DK], ks[KDA_CUDA_MAX_DK], es[KDA_CUDA_MAX_DK], outv[KDA_CUDA_MAX_DK];
    extern __shared__ double red[];   // (blockDim.x, 32)
    int64_t j = threadIdx.x, nt = blockDim.x;
    bool live = j < a.Dv;
    int64_t Dk = a.Dk, Dv = a.Dv, H = a.H;
    float S[KDA_CUDA_MAX_DK];
    double dS[KDA_CUDA_MAX_DK], tmp[KDA_CUDA_MAX_DK];
    float *buf = a.buf + (int64_t)blockIdx.x * KDA_CUDA_CHUNK * Dk * Dv;   // this block's chunk states
    for (int64_t item = blockIdx.x; item < nitems; item += gridDim.x) {
        int64_t s = item / H, h = item % H, first = a.seg[s], n = a.seg[s + 1] - first;
        int64_t nch = CEIL_DIV(n, (int64_t)KDA_CUDA_CHUNK);
        float *ck = a.ckpt + (chunk_base(a.seg, s) * H + h * nch) * Dk * Dv;   // (nch, Dk, Dv) of this item
        // forward: the state at each chunk's start
        for (int64_t d = 0; d < Dk; d++) S[d] = live && a.state0 ? a.state0[((s * H + h) * Dk + d) * Dv + j] : 0.0f;
        for (int64_t t = 0; t < n; t++) {
            if (t % KDA_CUDA_CHUNK == 0 && live)
                for (int64_t d = 0; d < Dk; d++) ck[((t / KDA_CUDA_CHUNK) * Dk + d) * Dv + j] = S[d];
            __syncthreads();
            kda_load(a, first + t, h, qs, ks, es);
            __syncthreads();
            if (live) kda_token(S, qs, ks, es, a.beta[(first + t) * H + h], a.v[((first + t) * H + h) * Dv + j], Dk);
        }
        for (int64_t d = 0; d < Dk; d++) dS[d] = live && a.dstate ? a.dstate[((s * H + h) * Dk + d) * Dv + j] : 0.0;
        for (int64_t c = nch - 1; c >= 0; c--) {
            int64_t t0 = c * KDA_CUDA_CHUNK, L = n - t0 < KDA_CUDA_CHUNK ? n - t0 : KDA_CUDA_CHUNK;
            // the chunk's states before each token into buf (L, Dk, Dv)
            for (int64_t d = 0; d < Dk; d++) S[d] = live ? ck[(c * Dk + d) * Dv + j] : 0.0f;
            for (int64_t i = 0; i < L; i++) {
                if (live) for (int64_t d = 0; d < Dk; d++) buf[(i * Dk + d) * Dv + j] = S[d];
                __syncthreads();
                kda_load(a, first + t0 + i, h, qs, ks, es);
                __syncthreads();
                if (live) kda_token(S, qs, ks, es, a.beta[(first + t0 + i) * H + h], a.v[((first + t0 + i) * H + h) * Dv + j], Dk);
            }
            // the adjoint, last token first
            for (int64_t i = L - 1; i >= 0; i--) {
                int64_t row = first + t0 + i;
                __syncthreads();
                kda_load(a, row, h, qs, ks, es);
                __syncthreads();
                float be = a.beta[row * H + h];
                float vj = live ? a.v[(row * H + h) * Dv + j] : 0.0f;
                float doj = live ? a.dout[(row * H + h) * Dv + j] : 0.0f;
                // S' = e^g S_prev, u = beta (v - S'^T k), S_t = S' + k u
                double kS = 0;
                for (int64_t d = 0; d < Dk; d++) {
                    float sp = live ? es[d] * buf[(i * Dk + d) * Dv + j] : 0.0f;
                    S[d] = sp;
                    kS += (double)ks[d] * sp;
                }
                double u = live ? (double)be * ((double)vj - kS) : 0.0;
                // dS += q do^T; dq = S_t do
                for (int64_t d = 0; d < Dk; d++) {
                    dS[d] += (double)qs[d] * doj;
                    tmp[d] = live ? ((double)S[d] + (double)ks[d] * u) * doj : 0.0;
                }
                column_sums(tmp, Dk, outv, red, nt);
                __syncthreads();
                for (int64_t d = threadIdx.x; d < Dk; d += nt) a.dq[(row * H + h) * Dk + d] = outv[d];
                // du = beta dS^T k (per column); dv = du; dbeta = sum_d k_d sum_j dS u / beta ...
                double dSk = 0;
                for (int64_t d = 0; d < Dk; d++) dSk += dS[d] * ks[d];
                double du = be * dSk;
                if (live) a.dv[(row * H + h) * Dv + j] = (float)du;
                // dbeta = k^T dS u / (the u without beta): sum_j dSk_j (v_j - S'^T k)_j
                for (int64_t d = 0; d < Dk; d++) tmp[d] = (d == 0 && live) ? dSk * ((double)vj - kS) : 0.0;
                column_sums(tmp, 1, outv, red, nt);
                __syncthreads();
                if (threadIdx.x == 0) a.dbeta[row * H + h] = outv[0];
                // dk = beta dS u - S' du; dS' = dS - k du; dg = rowsum(dS' o S'); dS = e^g dS'
                for (int64_t d = 0; d < Dk; d++) tmp[d] = live ? dS[d] * u - (double)S[d] * du : 0.0;
                column_sums(tmp, Dk, outv, red, nt);
                __syncthreads();
                for (int64_t d = threadIdx.x; d < Dk; d += nt) a.dk[(row * H + h) * Dk + d] = outv[d];
                for (int64_t d = 0; d < Dk; d++) {
                    dS[d] -= (double)ks[d] * du;
                    tmp[d] = live ? dS[d] * (double)S[d] : 0.0;
                }
                column_sums(tmp, Dk, outv, red, nt);
                __syncthreads();
                for (int64_t d = threadIdx.x; d < Dk; d += nt) a.dg[(row * H + h) * Dk + d] = outv[d];
                for (int64_t d = 0; d < Dk; d++) dS[d] *= es[d];
            }
        }
        if (live && a.dstate0)
            for (int64_t d = 0; d < Dk; d++) a.dstate0[((s * H + h) * Dk + d) * Dv + j] = (float)dS[d];
        __syncthreads();
    }
}

__global__ void kda_step_kernel(float *o, float *state, const float *q, const float *k, const float *v, const float *g,
                                const float *beta, const int64_t *slots, int64_t H, int64_t Dk, int64_t Dv) {
    __shared__ float qs[KDA_CUDA_MAX_DK], ks[KDA_CUDA_MAX_DK], es[KDA_CUDA_MAX_DK];
    int64_t bh = blockIdx.x, b = bh / H, h = bh % H, j = threadIdx.x;
    for (int64_t d = threadIdx.x; d < Dk; d += blockDim.x) {
        qs[d] = q[bh * Dk + d];
        ks[d] = k[bh * Dk + d];
        es[d] = expf(g[bh * Dk + d]);
    }
    __syncthreads();
    if (j >= Dv) return;
    float *Sg = state + (slots[b] * H + h) * Dk * Dv;
    float S[KDA_CUDA_MAX_DK];
    for (int64_t d = 0; d < Dk; d++) S[d] = Sg[d * Dv + j];
    o[bh * Dv + j] = kda_token(S, qs, ks, es, beta[bh], v[bh * Dv + j], Dk);
    for (int64_t d = 0; d < Dk; d++) Sg[d * Dv + j] = S[d];
}

// ---- launchers ----------------------------------------------------------------------------------

static lunar_status kda_check_dims(lunar_ctx *ctx, const char *op, int64_t Dk, int64_t Dv, int64_t max_dv) {
    if (Dk > KDA_CUDA_MAX_DK || Dv > max_dv)
        return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "%s on CUDA: head dims Dk = %lld (at most %d), Dv = %lld (at most %lld)",
                          op, (long long)Dk, KDA_CUDA_MAX_DK, (long long)Dv, (long long)max_dv);
    return LUNAR_OK;
}

#define F(t) ((float *)lunar_tensor_data(t))
#define CF(t) ((const float *)lunar_tensor_data(t))
#define OPT(t) ((t) ? (float *)lunar_tensor_data(t) : NULL)
#define COPT(t) ((t) ? (const float *)lunar_tensor_data(t) : NULL)

extern "C" lunar_status lunar_cuda_kda_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                                               const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                               const lunar_tensor *beta, const lunar_tensor *seg,
                                               const lunar_tensor *state0) {
    int64_t H = q->shape[1], Dk = q->shape[2], Dv = v->shape[2], nseg = seg->shape[0] - 1;
    LUNAR_TRY(kda_check_dims(ctx, "kda_forward", Dk, Dv, 1024));
    if (nseg * H == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, q, &stream));
    kda_dev a = {};
    a.q = CF(q), a.k = CF(k), a.v = CF(v), a.g = CF(g), a.beta = CF(beta), a.state0 = COPT(state0);
    a.o = F(o), a.state = OPT(state), a.seg = (const int64_t *)lunar_tensor_data(seg);
    a.nseg = nseg, a.H = H, a.Dk = Dk, a.Dv = Dv;
    kda_fwd_kernel<<<(unsigned)(nseg * H), kda_threads(Dv), 0, stream>>>(a);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "kda_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_kda_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                                lunar_tensor *dg, lunar_tensor *dbeta, lunar_tensor *dstate0,
                                                const lunar_tensor *dout, const lunar_tensor *dstate,
                                                const lunar_tensor *q, const lunar_tensor *k, const lunar_tensor *v,
                                                const lunar_tensor *g, const lunar_tensor *beta, const lunar_tensor *seg,
                                                const lunar_tensor *state0) {
    int64_t N = q->shape[0], H = q->shape[1], Dk = q->shape[2], Dv = v->shape[2], nseg = seg->shape[0] - 1;
    LUNAR_TRY(kda_check_dims(ctx, "kda_backward", Dk, Dv, 512));
    if (nseg * H == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, q, &stream));
    // scratch: the chunk-start states (at most N / chunk + nseg chunks in all, per head) and one
    // chunk's states per block
    int64_t nitems = nseg * H, blocks = nitems < KDA_CUDA_BWD_BLOCKS ? nitems : KDA_CUDA_BWD_BLOCKS;
    int64_t chunks = N / KDA_CUDA_CHUNK + nseg;
    int64_t n = (chunks * H + blocks * KDA_CUDA_CHUNK) * Dk * Dv;
    lunar_tensor scr = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scr, LUNAR_DTYPE_F32, lunar_tensor_device(q), 1, &n));
    kda_dev a = {};
    a.q = CF(q), a.k = CF(k), a.v = CF(v), a.g = CF(g), a.beta = CF(beta), a.state0 = COPT(state0);
    a.dout = CF(dout), a.dstate = COPT(dstate);
    a.dq = F(dq), a.dk = F(dk), a.dv = F(dv), a.dg = F(dg), a.dbeta = F(dbeta), a.dstate0 = OPT(dstate0);
    a.ckpt = F(&scr), a.buf = F(&scr) + chunks * H * Dk * Dv;
    a.seg = (const int64_t *)lunar_tensor_data(seg), a.nseg = nseg, a.H = H, a.Dk = Dk, a.Dv = Dv;
    int threads = kda_threads(Dv);
    size_t smem = (size_t)threads * 32 * sizeof(double);
    lunar_status st = LUNAR_OK;
    cudaError_t e = cudaFuncSetAttribute(kda_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) {
        kda_bwd_kernel<<<(unsigned)blocks, threads, smem, stream>>>(a, nitems);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) st = LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "kda_backward launch: %s", cudaGetErrorString(e));
    lunar_tensor_release(ctx, &scr);
    return st;
}

extern "C" lunar_status lunar_cuda_kda_step(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                                            const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                            const lunar_tensor *beta, const lunar_tensor *slots) {
    int64_t B = q->shape[0], H = q->shape[1], Dk = q->shape[2], Dv = v->shape[2];
    LUNAR_TRY(kda_check_dims(ctx, "kda_step", Dk, Dv, LUNAR_KDA_STEP_MAX_DV));
    if (B * H == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, q, &stream));
    kda_step_kernel<<<(unsigned)(B * H), kda_threads(Dv), 0, stream>>>(F(o), F(state), CF(q), CF(k), CF(v), CF(g),
                                                                      CF(beta), (const int64_t *)lunar_tensor_data(slots),
                                                                      H, Dk, Dv);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "kda_step");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_conv1d_causal_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x,
                                                         const lunar_tensor *w, const lunar_tensor *seg,
                                                         const lunar_tensor *hist) {
    int64_t N = x->shape[0], C = x->shape[1], K = w->shape[1], nseg = seg->shape[0] - 1;
    if (N * C == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, x, &stream));
    conv_fwd_kernel<<<lunar_cuda_grid(N * C), LUNAR_CUDA_BLOCK, 0, stream>>>(
        F(y), CF(x), CF(w), (const int64_t *)lunar_tensor_data(seg), COPT(hist), nseg, N, C, K);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "conv1d_causal_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_conv1d_causal_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dw,
                                                          const lunar_tensor *dy, const lunar_tensor *x,
                                                          const lunar_tensor *w, const lunar_tensor *seg,
                                                          const lunar_tensor *hist) {
    int64_t N = x->shape[0], C = x->shape[1], K = w->shape[1], nseg = seg->shape[0] - 1;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, x, &stream));
    const int64_t *sg = (const int64_t *)lunar_tensor_data(seg);
    if (N * C > 0) {
        conv_bwd_dx_kernel<<<lunar_cuda_grid(N * C), LUNAR_CUDA_BLOCK, 0, stream>>>(F(dx), CF(dy), CF(w), sg, nseg, N,
                                                                                    C, K);
        LUNAR_CUDA_LAUNCH_CHECK(ctx, "conv1d_causal_backward (dx)");
    }
    if (dw && C * K > 0) {
        conv_bwd_dw_kernel<<<lunar_cuda_grid(C * K), LUNAR_CUDA_BLOCK, 0, stream>>>(F(dw), CF(dy), CF(x), sg, COPT(hist),
                                                                                    nseg, C, K);
        LUNAR_CUDA_LAUNCH_CHECK(ctx, "conv1d_causal_backward (dw)");
    }
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_conv1d_step(lunar_ctx *ctx, lunar_tensor *y, lunar_tensor *hist, const lunar_tensor *x,
                                               const lunar_tensor *w, const lunar_tensor *slots) {
    int64_t B = x->shape[0], C = x->shape[1], K = w->shape[1];
    if (B * C == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, x, &stream));
    conv_step_kernel<<<lunar_cuda_grid(B * C), LUNAR_CUDA_BLOCK, 0, stream>>>(
        F(y), OPT(hist), CF(x), CF(w), (const int64_t *)lunar_tensor_data(slots), B, C, K);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "conv1d_step");
    return LUNAR_OK;
}
