// attention.cu: fused attention over per-query key sets and the DSA index score on the GPU
// (contracts in lunar/ops.h). Written for correctness first; floats are computed in f32.
//
// Key lists (keys given): a first kernel turns each query row's keys into its attendable keys in
// increasing order (a bitmap of T bits in shared memory removes repeats; the mask removes hidden
// keys) in a (B*S, L) scratch with L = min(K, T), plus their number (0 = none: the row is uniform
// over all T keys, as HF's softmax of an all-finfo.min row). Without keys a row's candidates
// are all T keys, filtered by the mask chunk by chunk. Entries of keys outside [0, T) are
// ignored here (the CPU reports them).
//
//   forward: one block per (b, s, h); the attendable keys in chunks of ATT_CHUNK: scores (one
//     warp per key), an online softmax (running max and sum, rescaled per chunk) and the
//     output accumulated in shared memory (one thread per channel, keys in increasing order).
//   backward: (1) one block per (b, s, h): D = dout . o, P = exp(score - lse), dS = P (dout.v - D),
//     dq = scale sum dS k; it records D and whether the row is uniform. (2) one block per key
//     (b, t, key head g): warp w walks the queries s = w, w + nwarps, ... in order, tests whether
//     the query attends key t (binary search in its list, or the mask), and accumulates
//     dk = scale sum dS q and dv = sum P dout over the heads of group g into its own shared row;
//     the warps' rows are added in warp order: deterministic, no atomics on floats.
//   index score: one block per query row (b, s), one thread per key; the top-k reuses the
//     bitonic top-k of sort.cu on the scores, then each row's k ids are put in increasing order.
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "attention_smem.h"   // kernels/: the shared memory each launch needs, checked on the host
#include "common.cuh"

#define ATT_BLOCK LUNAR_ATT_BLOCK
#define ATT_WARPS LUNAR_ATT_WARPS
#define ATT_CHUNK LUNAR_ATT_CHUNK
#define ATT_GRID_MAX (65535LL * 32)
static_assert(ATT_CHUNK == ATT_BLOCK, "chunk_keys filters one candidate per thread");

static __device__ __forceinline__ bool att_masked(float m) { return m <= -FLT_MAX; }

static unsigned att_grid(int64_t blocks) { return (unsigned)(blocks < ATT_GRID_MAX ? blocks : ATT_GRID_MAX); }

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// block-wide sum / max (every thread gets the result); red holds ATT_WARPS floats
static __device__ float att_block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < ATT_WARPS; i++) t += red[i];
    return t;
}

static __device__ float att_block_max(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = -INFINITY;
    for (int i = 0; i < ATT_WARPS; i++) t = fmaxf(t, red[i]);
    return t;
}

// exclusive prefix sum of one int per thread over the block; returns the total. scan holds
// ATT_BLOCK ints.
static __device__ int att_block_scan(int v, int *scan, int *excl) {
    scan[threadIdx.x] = v;
    __syncthreads();
    for (int off = 1; off < ATT_BLOCK; off <<= 1) {
        int add = threadIdx.x >= off ? scan[threadIdx.x - off] : 0;
        __syncthreads();
        scan[threadIdx.x] += add;
        __syncthreads();
    }
    *excl = scan[threadIdx.x] - v;
    int total = scan[ATT_BLOCK - 1];
    __syncthreads();
    return total;
}

// ---- key lists ------------------------------------------------------------------------------

__global__ void att_lists_kernel(int32_t *li, int32_t *ln, const int64_t *keys, const float *mask, int64_t rows,
                                 int64_t T, int64_t K, int64_t L) {
    extern __shared__ uint32_t bm[];          // (T + 31) / 32 words
    __shared__ int scan[ATT_BLOCK];
    int64_t nw = (T + 31) / 32;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int64_t i = threadIdx.x; i < nw; i += blockDim.x) bm[i] = 0u;
        __syncthreads();
        for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
            int64_t t = keys[r * K + j];
            if (t >= 0 && t < T) atomicOr(&bm[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
        int64_t base = 0;
        for (int64_t w0 = 0; w0 < nw; w0 += blockDim.x) {
            int64_t w = w0 + threadIdx.x;
            uint32_t bits = w < nw ? bm[w] : 0u;
            if (mask) {
                uint32_t b = bits;
                while (b) {
                    int i = __ffs(b) - 1;
                    b &= b - 1;
                    if (att_masked(mask[r * T + w * 32 + i])) bits &= ~(1u << i);
                }
            }
            int excl;
            int total = att_block_scan(__popc(bits), scan, &excl);
            int64_t o = base + excl;
            while (bits) {
                int i = __ffs(bits) - 1;
                bits &= bits - 1;
                li[r * L + o++] = (int32_t)(w * 32 + i);
            }
            base += total;
        }
        if (threadIdx.x == 0) ln[r] = (int32_t)base;
        __syncthreads();
    }
}

// The attendable keys of row r from candidate c0 on (at most ATT_CHUNK of them) into ix / ma;
// returns their number (the same in every thread). *next is the next candidate.
static __device__ int chunk_keys(int *ix, float *ma, int *scan, const int32_t *li, const int32_t *ln, const float *mask,
                          int64_t r, int64_t T, int64_t L, int64_t c0, int64_t *next) {
    if (li) {
        int64_t n = ln[r] - c0;
        if (n > ATT_CHUNK) n = ATT_CHUNK;
        if (n < 0) n = 0;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            int t = li[r * L + c0 + i];
            ix[i] = t;
            ma[i] = mask ? mask[r * T + t] : 0.0f;
        }
        *next = c0 + n;
        __syncthreads();
        return (int)n;
    }
    // candidates c0 .. c0 + ATT_BLOCK - 1, kept when the mask shows them (ATT_CHUNK == ATT_BLOCK)
    int64_t t = c0 + threadIdx.x;
    float m = 0.0f;
    int keep = 0;
    if (t < T) {
        m = mask ? mask[r * T + t] : 0.0f;
        keep = !att_masked(m);
    }
    int excl;
    int total = att_block_scan(keep, scan, &excl);
    if (keep) {
        ix[excl] = (int)t;
        ma[excl] = m;
    }
    *next = c0 + ATT_BLOCK;
    __syncthreads();
    return total;
}

static __device__ __forceinline__ int64_t att_ncand(const int32_t *li, const int32_t *ln, int64_t r, int64_t T) {
    return li ? (int64_t)ln[r] : T;
}

// ---- forward --------------------------------------------------------------------------------

template <typename TT>
__global__ void att_fwd_kernel(TT *o, float *lse, const TT *q, const TT *k, const TT *v, const float *mask,
                               const int32_t *li, const int32_t *ln, int64_t B, int64_t S, int64_t T, int64_t NH,
                               int64_t Hk, int64_t Dq, int64_t Dv, int64_t L, float scale) {
    extern __shared__ float sm[];
    float *qs = sm, *oacc = qs + Dq, *sc = oacc + Dv, *ma = sc + ATT_CHUNK;
    int *ix = (int *)(ma + ATT_CHUNK);
    __shared__ float red[ATT_WARPS];
    __shared__ int scan[ATT_BLOCK];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t nb = B * S * NH;
    for (int64_t bid = blockIdx.x; bid < nb; bid += gridDim.x) {
        int64_t h = bid % NH, r = bid / NH, b = r / S, g = h / (NH / Hk);
        for (int64_t d = threadIdx.x; d < Dq; d += blockDim.x) qs[d] = lunar_to_f32(q[(r * NH + h) * Dq + d]);
        for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) oacc[d] = 0.0f;
        __syncthreads();
        float m = -INFINITY, sum = 0.0f;
        int64_t total = 0, nc = att_ncand(li, ln, r, T), c0 = 0;
        while (c0 < nc) {
            int n = chunk_keys(ix, ma, scan, li, ln, mask, r, T, L, c0, &c0);
            if (n == 0) continue;
            for (int i = warp; i < n; i += ATT_WARPS) {
                const TT *kr = k + ((b * T + ix[i]) * Hk + g) * Dq;
                float dot = 0.0f;
                for (int64_t d = lane; d < Dq; d += 32) dot += qs[d] * lunar_to_f32(kr[d]);
                dot = warp_sum(dot);
                if (lane == 0) sc[i] = dot * scale + ma[i];
            }
            __syncthreads();
            float cm = -INFINITY;
            for (int i = threadIdx.x; i < n; i += blockDim.x) cm = fmaxf(cm, sc[i]);
            cm = att_block_max(cm, red);
            float nm = fmaxf(m, cm);
            float factor = expf(m - nm);
            __syncthreads();
            float part = 0.0f;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                sc[i] = expf(sc[i] - nm);
                part += sc[i];
            }
            float cs = att_block_sum(part, red);
            sum = sum * factor + cs;
            m = nm;
            total += n;
            for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
                float acc = oacc[d] * factor;
                for (int i = 0; i < n; i++) acc += sc[i] * lunar_to_f32(v[((b * T + ix[i]) * Hk + g) * Dv + d]);
                oacc[d] = acc;
            }
            __syncthreads();
        }
        TT *orow = o + (r * NH + h) * Dv;
        if (total == 0) {   // no attendable key: uniform over all T keys
            for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
                float acc = 0.0f;
                for (int64_t t = 0; t < T; t++) acc += lunar_to_f32(v[((b * T + t) * Hk + g) * Dv + d]);
                orow[d] = lunar_from_f32<TT>(acc / (float)T);
            }
            if (threadIdx.x == 0) lse[(b * NH + h) * S + r % S] = -FLT_MAX;
        } else {
            float inv = 1.0f / sum;
            for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) orow[d] = lunar_from_f32<TT>(oacc[d] * inv);
            if (threadIdx.x == 0) lse[(b * NH + h) * S + r % S] = m + logf(sum);
        }
        __syncthreads();
    }
}

// ---- backward -------------------------------------------------------------------------------

template <typename TT>
__global__ void att_bwd_q_kernel(TT *dq, float *Dbuf, int32_t *uni, const TT *dout, const TT *o, const float *lse,
                                 const TT *q, const TT *k, const TT *v, const float *mask, const int32_t *li,
                                 const int32_t *ln, int64_t B, int64_t S, int64_t T, int64_t NH, int64_t Hk,
                                 int64_t Dq, int64_t Dv, int64_t L, float scale) {
    extern __shared__ float sm[];
    float *qs = sm, *dos = qs + Dq, *acc = dos + Dv, *ds = acc + Dq, *ma = ds + ATT_CHUNK;
    int *ix = (int *)(ma + ATT_CHUNK);
    __shared__ float red[ATT_WARPS];
    __shared__ int scan[ATT_BLOCK];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t nb = B * S * NH;
    for (int64_t bid = blockIdx.x; bid < nb; bid += gridDim.x) {
        int64_t h = bid % NH, r = bid / NH, b = r / S, s = r % S, g = h / (NH / Hk), row = r * NH + h;
        for (int64_t d = threadIdx.x; d < Dq; d += blockDim.x) {
            qs[d] = lunar_to_f32(q[row * Dq + d]);
            acc[d] = 0.0f;
        }
        float part = 0.0f;
        for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
            dos[d] = lunar_to_f32(dout[row * Dv + d]);
            part += dos[d] * lunar_to_f32(o[row * Dv + d]);
        }
        float D = att_block_sum(part, red);
        float l = lse[(b * NH + h) * S + s];
        int64_t total = 0, nc = att_ncand(li, ln, r, T), c0 = 0;
        int nuni = 0;
        // pass 0: the attendable keys; pass 1 (only for a row without any): all T keys, P = 1/T
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 1) {
                if (total > 0) break;
                nuni = 1, nc = T, c0 = 0;
            }
            while (c0 < nc) {
                int n;
                if (pass == 0) {
                    n = chunk_keys(ix, ma, scan, li, ln, mask, r, T, L, c0, &c0);
                } else {
                    n = (int)(T - c0 < ATT_CHUNK ? T - c0 : ATT_CHUNK);
                    for (int i = threadIdx.x; i < n; i += blockDim.x) ix[i] = (int)(c0 + i);
                    c0 += n;
                    __syncthreads();
                }
                if (n == 0) continue;
                for (int i = warp; i < n; i += ATT_WARPS) {
                    const TT *kr = k + ((b * T + ix[i]) * Hk + g) * Dq;
                    const TT *vr = v + ((b * T + ix[i]) * Hk + g) * Dv;
                    float dot = 0.0f, dp = 0.0f;
                    if (pass == 0)
                        for (int64_t d = lane; d < Dq; d += 32) dot += qs[d] * lunar_to_f32(kr[d]);
                    for (int64_t d = lane; d < Dv; d += 32) dp += dos[d] * lunar_to_f32(vr[d]);
                    dot = warp_sum(dot);
                    dp = warp_sum(dp);
                    float p = pass == 0 ? expf(dot * scale + ma[i] - l) : 1.0f / (float)T;
                    if (lane == 0) ds[i] = p * (dp - D);
                }
                __syncthreads();
                for (int64_t d = threadIdx.x; d < Dq; d += blockDim.x) {
                    float a = acc[d];
                    for (int i = 0; i < n; i++) a += ds[i] * lunar_to_f32(k[((b * T + ix[i]) * Hk + g) * Dq + d]);
                    acc[d] = a;
                }
                total += n;
                __syncthreads();
            }
        }
        for (int64_t d = threadIdx.x; d < Dq; d += blockDim.x) dq[row * Dq + d] = lunar_from_f32<TT>(scale * acc[d]);
        if (threadIdx.x == 0) {
            Dbuf[row] = D;
            if (h == 0) uni[r] = nuni;   // the same for every head of the row
        }
        __syncthreads();
    }
}

// does row r attend key t (keys: binary search in its increasing list; else the mask)?
static __device__ __forceinline__ bool att_attends(const int32_t *li, const int32_t *ln, const float *mask, int64_t r,
                                            int64_t T, int64_t L, int64_t t) {
    if (li) {
        int64_t lo = 0, hi = ln[r];
        const int32_t *l = li + r * L;
        while (lo < hi) {
            int64_t mid = (lo + hi) / 2;
            if (l[mid] < t) lo = mid + 1;
            else hi = mid;
        }
        return lo < ln[r] && l[lo] == t;
    }
    return !mask || !att_masked(mask[r * T + t]);
}

template <typename TT>
__global__ void att_bwd_kv_kernel(TT *dk, TT *dv, const TT *dout, const float *lse, const float *Dbuf,
                                  const int32_t *uni, const TT *q, const TT *k, const TT *v, const float *mask,
                                  const int32_t *li, const int32_t *ln, int64_t B, int64_t S, int64_t T, int64_t NH,
                                  int64_t Hk, int64_t Dq, int64_t Dv, int64_t L, float scale) {
    extern __shared__ float sm[];   // per warp: [dk row Dq | dv row Dv]
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t G = NH / Hk, nb = B * T * Hk, w_len = Dq + Dv;
    float *mine = sm + warp * w_len;
    for (int64_t bid = blockIdx.x; bid < nb; bid += gridDim.x) {
        int64_t g = bid % Hk, t = (bid / Hk) % T, b = bid / (Hk * T);
        const TT *kr = k + ((b * T + t) * Hk + g) * Dq, *vr = v + ((b * T + t) * Hk + g) * Dv;
        for (int64_t d = lane; d < w_len; d += 32) mine[d] = 0.0f;
        __syncwarp();
        for (int64_t s = warp; s < S; s += ATT_WARPS) {
            int64_t r = b * S + s;
            bool u = uni[r] != 0;
            if (!u && !att_attends(li, ln, mask, r, T, L, t)) continue;
            float madd = (mask && !u) ? mask[r * T + t] : 0.0f;
            for (int64_t h = g * G; h < (g + 1) * G; h++) {
                int64_t row = r * NH + h;
                const TT *qr = q + row * Dq, *dr = dout + row * Dv;
                float dot = 0.0f, dp = 0.0f;
                for (int64_t d = lane; d < Dq; d += 32) dot += lunar_to_f32(qr[d]) * lunar_to_f32(kr[d]);
                for (int64_t d = lane; d < Dv; d += 32) dp += lunar_to_f32(dr[d]) * lunar_to_f32(vr[d]);
                dot = warp_sum(dot);
                dp = warp_sum(dp);
                float p = u ? 1.0f / (float)T : expf(dot * scale + madd - lse[(b * NH + h) * S + s]);
                float dsv = p * (dp - Dbuf[row]);
                for (int64_t d = lane; d < Dq; d += 32) mine[d] += dsv * lunar_to_f32(qr[d]);
                for (int64_t d = lane; d < Dv; d += 32) mine[Dq + d] += p * lunar_to_f32(dr[d]);
            }
        }
        __syncthreads();
        for (int64_t d = threadIdx.x; d < w_len; d += blockDim.x) {
            float a = 0.0f;
            for (int w = 0; w < ATT_WARPS; w++) a += sm[w * w_len + d];
            if (d < Dq) dk[((b * T + t) * Hk + g) * Dq + d] = lunar_from_f32<TT>(scale * a);
            else dv[((b * T + t) * Hk + g) * Dv + (d - Dq)] = lunar_from_f32<TT>(a);
        }
        __syncthreads();
    }
}

// ---- launchers ------------------------------------------------------------------------------

// Checks a launch's shared memory against the device, counting the kernel's static __shared__
// arrays, which the launch cannot see (a launch beyond the limit would fail with a bare "invalid
// argument"), and opts the kernel in to more dynamic shared memory than the default 48 KiB when
// the launch needs it. The device must be current (lunar_cuda_stream_for).
template <typename K>
static lunar_status att_smem_prepare(lunar_ctx *ctx, K *kernel, const lunar_att_smem *need, int device) {
    cudaFuncAttributes fa;
    LUNAR_CUDA_CHECK(ctx, cudaFuncGetAttributes(&fa, kernel));
    int limit = 0;
    LUNAR_CUDA_CHECK(ctx, cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    LUNAR_TRY(lunar_att_smem_check(ctx, need, fa.sharedSizeBytes, (size_t)limit, device));
    size_t dyn = lunar_att_smem_bytes(need);
    if (dyn > (size_t)fa.maxDynamicSharedSizeBytes)
        LUNAR_CUDA_CHECK(ctx, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
    return LUNAR_OK;
}

typedef struct att_lists {
    lunar_tensor buf;   // li (rows, L) | ln (rows)
    int32_t *li, *ln;
    int64_t L;
} att_lists;

static lunar_status make_lists(lunar_ctx *ctx, cudaStream_t stream, att_lists *al, const char *op,
                               const lunar_tensor *keys, const lunar_tensor *mask, int64_t rows, int64_t T) {
    memset(al, 0, sizeof *al);
    if (!keys) return LUNAR_OK;
    int64_t K = keys->shape[2];
    al->L = K < T ? K : T;
    lunar_att_smem need = lunar_att_smem_lists(op, T);
    size_t smem = lunar_att_smem_bytes(&need);
    LUNAR_TRY(att_smem_prepare(ctx, att_lists_kernel, &need, lunar_tensor_device(keys).index));
    int64_t n = rows * al->L + rows;
    LUNAR_TRY(lunar_tensor_new(ctx, &al->buf, LUNAR_DTYPE_I32, lunar_tensor_device(keys), 1, &n));
    al->li = (int32_t *)lunar_tensor_data(&al->buf);
    al->ln = al->li + rows * al->L;
    att_lists_kernel<<<att_grid(rows), ATT_BLOCK, smem, stream>>>(
        al->li, al->ln, (const int64_t *)lunar_tensor_data(keys), mask ? (const float *)lunar_tensor_data(mask) : NULL,
        rows, T, K, al->L);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        lunar_tensor_release(ctx, &al->buf);
        return LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "attention key lists launch: %s", cudaGetErrorString(e));
    }
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_attention_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *lse,
                                                     const lunar_tensor *q, const lunar_tensor *k,
                                                     const lunar_tensor *v, const lunar_tensor *keys,
                                                     const lunar_tensor *mask, float scale) {
    int64_t B = q->shape[0], S = q->shape[1], NH = q->shape[2], Dq = q->shape[3];
    int64_t T = k->shape[1], Hk = k->shape[2], Dv = v->shape[3];
    if (B * S == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, q, &stream));
    int dev = lunar_tensor_device(q).index;
    lunar_att_smem need = lunar_att_smem_forward(Dq, Dv);
    size_t smem = lunar_att_smem_bytes(&need);
    LUNAR_TRY([&]() -> lunar_status {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, q->dtype, TT, return att_smem_prepare(ctx, att_fwd_kernel<TT>, &need, dev));
        return LUNAR_OK;
    }());
    att_lists al;
    LUNAR_TRY(make_lists(ctx, stream, &al, "attention_forward", keys, mask, B * S, T));
    const float *mp = mask ? (const float *)lunar_tensor_data(mask) : NULL;
    lunar_status st = [&]() -> lunar_status {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, q->dtype, TT,
            att_fwd_kernel<TT><<<att_grid(B * S * NH), ATT_BLOCK, smem, stream>>>(
                (TT *)lunar_tensor_data(o), (float *)lunar_tensor_data(lse), (const TT *)lunar_tensor_data(q),
                (const TT *)lunar_tensor_data(k), (const TT *)lunar_tensor_data(v), mp, al.li, al.ln, B, S, T, NH,
                Hk, Dq, Dv, al.L, scale));
        return LUNAR_OK;
    }();
    cudaError_t e = cudaGetLastError();
    if (!st && e != cudaSuccess)
        st = LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "attention_forward launch: %s", cudaGetErrorString(e));
    if (keys) lunar_tensor_release(ctx, &al.buf);   // stream-ordered reuse
    return st;
}

extern "C" lunar_status lunar_cuda_attention_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk,
                                                      lunar_tensor *dv, const lunar_tensor *dout, const lunar_tensor *o,
                                                      const lunar_tensor *lse, const lunar_tensor *q,
                                                      const lunar_tensor *k, const lunar_tensor *v,
                                                      const lunar_tensor *keys, const lunar_tensor *mask, float scale) {
    int64_t B = q->shape[0], S = q->shape[1], NH = q->shape[2], Dq = q->shape[3];
    int64_t T = k->shape[1], Hk = k->shape[2], Dv = v->shape[3];
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, q, &stream));
    if (B * S == 0) {
        LUNAR_TRY(lunar_fill(ctx, dk, 0.0));
        return lunar_fill(ctx, dv, 0.0);
    }
    int dev = lunar_tensor_device(q).index;
    lunar_att_smem need_q = lunar_att_smem_backward_q(Dq, Dv), need_kv = lunar_att_smem_backward_kv(Dq, Dv);
    size_t smem_q = lunar_att_smem_bytes(&need_q), smem_kv = lunar_att_smem_bytes(&need_kv);
    LUNAR_TRY([&]() -> lunar_status {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, q->dtype, TT, {
            LUNAR_TRY(att_smem_prepare(ctx, att_bwd_q_kernel<TT>, &need_q, dev));
            return att_smem_prepare(ctx, att_bwd_kv_kernel<TT>, &need_kv, dev);
        });
        return LUNAR_OK;
    }());
    att_lists al;
    LUNAR_TRY(make_lists(ctx, stream, &al, "attention_backward", keys, mask, B * S, T));
    // scratch: D (B*S*NH f32) | uniform flags (B*S i32)
    lunar_tensor scr = {0};
    int64_t n = B * S * NH + B * S;
    lunar_status st = lunar_tensor_new(ctx, &scr, LUNAR_DTYPE_F32, lunar_tensor_device(q), 1, &n);
    if (st) {
        if (keys) lunar_tensor_release(ctx, &al.buf);
        return st;
    }
    float *Dbuf = (float *)lunar_tensor_data(&scr);
    int32_t *uni = (int32_t *)(Dbuf + B * S * NH);
    const float *mp = mask ? (const float *)lunar_tensor_data(mask) : NULL;
    st = [&]() -> lunar_status {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, q->dtype, TT, {
            att_bwd_q_kernel<TT><<<att_grid(B * S * NH), ATT_BLOCK, smem_q, stream>>>(
                (TT *)lunar_tensor_data(dq), Dbuf, uni, (const TT *)lunar_tensor_data(dout),
                (const TT *)lunar_tensor_data(o), (const float *)lunar_tensor_data(lse), (const TT *)lunar_tensor_data(q),
                (const TT *)lunar_tensor_data(k), (const TT *)lunar_tensor_data(v), mp, al.li, al.ln, B, S, T, NH, Hk,
                Dq, Dv, al.L, scale);
            att_bwd_kv_kernel<TT><<<att_grid(B * T * Hk), ATT_BLOCK, smem_kv, stream>>>(
                (TT *)lunar_tensor_data(dk), (TT *)lunar_tensor_data(dv), (const TT *)lunar_tensor_data(dout),
                (const float *)lunar_tensor_data(lse), Dbuf, uni, (const TT *)lunar_tensor_data(q),
                (const TT *)lunar_tensor_data(k), (const TT *)lunar_tensor_data(v), mp, al.li, al.ln, B, S, T, NH, Hk,
                Dq, Dv, al.L, scale);
        });
        return LUNAR_OK;
    }();
    cudaError_t e = cudaGetLastError();
    if (!st && e != cudaSuccess)
        st = LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "attention_backward launch: %s", cudaGetErrorString(e));
    lunar_tensor_release(ctx, &scr);
    if (keys) lunar_tensor_release(ctx, &al.buf);
    return st;
}

// ---- DSA index score ------------------------------------------------------------------------

template <typename TT>
__global__ void index_scores_kernel(float *scores, const TT *qi, const TT *ki, const float *w, const float *mask,
                                   int64_t B, int64_t S, int64_t T, int64_t Hi, int64_t Di, float scale) {
    extern __shared__ float sm[];   // qi row (Hi, Di) | w (Hi)
    float *qs = sm, *ws = qs + Hi * Di;
    for (int64_t r = blockIdx.x; r < B * S; r += gridDim.x) {
        int64_t b = r / S;
        for (int64_t i = threadIdx.x; i < Hi * Di; i += blockDim.x) qs[i] = lunar_to_f32(qi[r * Hi * Di + i]);
        for (int64_t i = threadIdx.x; i < Hi; i += blockDim.x) ws[i] = w[r * Hi + i];
        __syncthreads();
        for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
            float m = mask ? mask[r * T + t] : 0.0f;
            float out = m;
            if (!att_masked(m)) {
                const TT *kr = ki + (b * T + t) * Di;
                float acc = 0.0f;
                for (int64_t h = 0; h < Hi; h++) {
                    float dot = 0.0f;
                    for (int64_t d = 0; d < Di; d++) dot += qs[h * Di + d] * lunar_to_f32(kr[d]);
                    acc += ws[h] * fmaxf(dot * scale, 0.0f);
                }
                out = acc + m;
            }
            scores[r * T + t] = out;
        }
        __syncthreads();
    }
}

// each row's k ids in increasing order (rank sort: ids are distinct)
__global__ void att_sort_ids_kernel(int64_t *ids, int64_t rows, int64_t k) {
    extern __shared__ int64_t row[];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int64_t i = threadIdx.x; i < k; i += blockDim.x) row[i] = ids[r * k + i];
        __syncthreads();
        for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
            int64_t x = row[i], rank = 0;
            for (int64_t j = 0; j < k; j++) rank += row[j] < x;
            ids[r * k + rank] = x;
        }
        __syncthreads();
    }
}

__global__ void att_sort_ids_global_kernel(int64_t *out, const int64_t *ids, int64_t rows, int64_t k) {
    LUNAR_GRID_STRIDE(i, rows * k) {
        int64_t r = i / k, x = ids[i], rank = 0;
        for (int64_t j = 0; j < k; j++) rank += ids[r * k + j] < x;
        out[r * k + rank] = x;
    }
}

extern "C" lunar_status lunar_cuda_index_scores(lunar_ctx *ctx, lunar_tensor *scores, lunar_tensor *topk,
                                                const lunar_tensor *qi, const lunar_tensor *ki, const lunar_tensor *w,
                                                const lunar_tensor *mask, float scale) {
    int64_t B = qi->shape[0], S = qi->shape[1], Hi = qi->shape[2], Di = qi->shape[3], T = ki->shape[1];
    if (B * S == 0) return LUNAR_OK;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, qi, &stream));
    lunar_att_smem need = lunar_att_smem_index_scores(Hi, Di);
    size_t smem = lunar_att_smem_bytes(&need);
    LUNAR_TRY([&]() -> lunar_status {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, qi->dtype, TT,
            return att_smem_prepare(ctx, index_scores_kernel<TT>, &need, lunar_tensor_device(qi).index));
        return LUNAR_OK;
    }());
    lunar_tensor tmp = {0};
    lunar_tensor *sc = scores;
    if (!sc) {
        int64_t shape[2] = {B * S, T};
        LUNAR_TRY(lunar_tensor_new(ctx, &tmp, LUNAR_DTYPE_F32, lunar_tensor_device(qi), 2, shape));
        sc = &tmp;
    }
    lunar_status st = [&]() -> lunar_status {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, qi->dtype, TT,
            index_scores_kernel<TT><<<att_grid(B * S), ATT_BLOCK, smem, stream>>>(
                (float *)lunar_tensor_data(sc), (const TT *)lunar_tensor_data(qi), (const TT *)lunar_tensor_data(ki),
                (const float *)lunar_tensor_data(w), mask ? (const float *)lunar_tensor_data(mask) : NULL, B, S, T,
                Hi, Di, scale));
        return LUNAR_OK;
    }();
    cudaError_t e = cudaGetLastError();
    if (!st && e != cudaSuccess) st = LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "index_scores launch: %s", cudaGetErrorString(e));
    if (!st && topk) {
        int64_t K = topk->shape[2], rows = B * S;
        st = lunar_cuda_topk(ctx, NULL, topk, sc, rows, T, K, 1);
        if (!st) {
            int64_t *ids = (int64_t *)lunar_tensor_data(topk);
            if ((size_t)K * 8 <= 48 * 1024) {
                att_sort_ids_kernel<<<att_grid(rows), ATT_BLOCK, (size_t)K * 8, stream>>>(ids, rows, K);
            } else {
                lunar_tensor cp = {0};
                int64_t n = rows * K;
                st = lunar_tensor_new(ctx, &cp, LUNAR_DTYPE_I64, lunar_tensor_device(qi), 1, &n);
                if (!st) {
                    e = cudaMemcpyAsync(lunar_tensor_data(&cp), ids, (size_t)n * 8, cudaMemcpyDeviceToDevice, stream);
                    if (e == cudaSuccess)
                        att_sort_ids_global_kernel<<<lunar_cuda_grid(n), LUNAR_CUDA_BLOCK, 0, stream>>>(
                            ids, (const int64_t *)lunar_tensor_data(&cp), rows, K);
                    lunar_tensor_release(ctx, &cp);
                }
            }
            e = cudaGetLastError();
            if (!st && e != cudaSuccess)
                st = LUNAR_FAIL(ctx, LUNAR_ERR_CUDA, "index_scores top-k order launch: %s", cudaGetErrorString(e));
        }
    }
    if (!scores) lunar_tensor_release(ctx, &tmp);
    return st;
}
