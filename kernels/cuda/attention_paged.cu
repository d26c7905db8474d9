// attention_paged.cu: decode attention over a paged KV cache on the GPU (contract:
// lunar_attention_paged in lunar/ops.h; the CPU kernel is kernels/cpu/attention_paged.c): one
// query per sequence against its cached rows, read in place through the block table.
//
// One thread block per (sequence b, key head g, group of up to HG of the G query heads sharing
// it), 128 threads. The attended positions go by in chunks of AP_CHUNK (the key list's entries,
// or 0 .. length - 1); an entry counts when it lies in [0, length) and, in a key list, is greater
// than the entry before it. Per chunk:
//   - each warp takes a quarter of the positions: it reads the key row once (lane l holds
//     columns l, l + 32, ...) and forms every head's score, lane sums then a butterfly
//     (__shfl_xor_sync 16, 8, 4, 2, 1), times scale;
//   - per head, one thread updates the running max m and sum l (in position order):
//     m' = max(m, chunk max), c = e^(m - m'), p_i = e^(s_i - m'), l' = l c + sum_i p_i;
//   - each thread holds up to AP_ACC output elements (h, d) and does o = o c + sum_i p_i v_i[d]
//     in position order (the threads read consecutive d of a value row: coalesced).
// At the end o / l (0 for a sequence with no attended position). Every order is fixed by the
// sequence's own positions, so its bits do not depend on the other sequences; the arithmetic is
// not the CPU's (an online softmax here, two passes there), so the devices agree within rounding.
// A block id outside [0, blocks) or a length outside [1, NB * block_size] is recorded for the next
// check point (range_error.cuh); the sequence's positions behind a bad block, or all of a
// sequence with a bad length, count nothing.
#include <math.h>

#include "common.cuh"
#include "range_error.cuh"

#define AP_THREADS 128
#define AP_WARPS (AP_THREADS / 32)
#define AP_CHUNK 32        // positions per chunk
#define AP_ACC 32          // output elements per thread: HG * Dv <= AP_THREADS * AP_ACC
#define AP_HG_MAX 32       // query heads per block at most
#define AP_DQ_MAX 1024     // key row columns held in registers: AP_DQ_MAX / 32 per lane

struct ApArgs {
    const void *q, *k, *v;
    void *o;
    long long ldk, ldv, nblocks;
    const int64_t *table, *lens, *keys;
    int NH, Hk, G, HG, Dq, Dv, NB, bs, K;
    float scale;
    lunar_range_ticket rt_table, rt_len;
};

// shared memory of a block: q rows (HG x Dq), chunk probabilities (AP_CHUNK x HG), per head m, l, c
static size_t ap_smem_bytes(int HG, int Dq) {
    return ((size_t)HG * Dq + (size_t)AP_CHUNK * HG + 3 * AP_HG_MAX) * sizeof(float);
}

template <typename T>
__global__ void __launch_bounds__(AP_THREADS) attention_paged_kernel(ApArgs a) {
    extern __shared__ float smem[];
    __shared__ long long rows[AP_CHUNK];
    __shared__ int valid[AP_CHUNK];
    const int b = blockIdx.y, groups = (a.G + a.HG - 1) / a.HG;
    const int g = blockIdx.x / groups, h0 = g * a.G + (blockIdx.x % groups) * a.HG;
    const int nh = min(a.HG, g * a.G + a.G - h0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float *qs = smem, *ps = qs + a.HG * a.Dq, *ms = ps + AP_CHUNK * a.HG, *ls = ms + AP_HG_MAX,
          *cs = ls + AP_HG_MAX;
    const T *q = (const T *)a.q + ((long long)b * a.NH + h0) * a.Dq;
    for (int e = tid; e < nh * a.Dq; e += AP_THREADS) qs[e] = lunar_to_f32(q[e]);
    if (tid < AP_HG_MAX) ms[tid] = -INFINITY, ls[tid] = 0.0f;
    const long long len = a.lens[b], cap = (long long)a.NB * a.bs;
    const bool len_ok = lunar_index_ok(a.rt_len, len - 1, cap, b);   // every thread sees the same
    const long long n = !len_ok ? 0 : a.keys ? a.K : len;            // list entries (or positions)
    const int nacc = (nh * a.Dv + AP_THREADS - 1) / AP_THREADS;
    float acc[AP_ACC];
#pragma unroll
    for (int j = 0; j < AP_ACC; j++) acc[j] = 0.0f;
    const int kcols = (a.Dq + 31) / 32;
    for (long long c0 = 0; c0 < n; c0 += AP_CHUNK) {
        const int cn = (int)min((long long)AP_CHUNK, n - c0);
        __syncthreads();   // the previous chunk's rows, valid and ps are consumed
        if (tid < cn) {
            long long t = a.keys ? a.keys[(long long)b * a.K + c0 + tid] : c0 + tid;
            bool ok = t >= 0 && t < len;
            if (ok && a.keys && c0 + tid > 0) ok = t > a.keys[(long long)b * a.K + c0 + tid - 1];
            long long row = 0;
            if (ok) {
                long long at = (long long)b * a.NB + t / a.bs;
                long long blk = a.table[at];
                ok = lunar_index_ok(a.rt_table, blk, a.nblocks, at);
                row = blk * a.bs + t % a.bs;
            }
            rows[tid] = row;
            valid[tid] = ok;
        }
        __syncthreads();
        // scores: warp w takes positions w, w + 4, ...
        for (int i = warp; i < cn; i += AP_WARPS) {
            if (!valid[i]) {
                if (lane < nh) ps[i * a.HG + lane] = -INFINITY;
                continue;
            }
            const T *kr = (const T *)a.k + rows[i] * a.ldk + (long long)g * a.Dq;
            float kreg[AP_DQ_MAX / 32];
#pragma unroll
            for (int j = 0; j < AP_DQ_MAX / 32; j++) {
                int d = lane + 32 * j;
                kreg[j] = j < kcols && d < a.Dq ? lunar_to_f32(kr[d]) : 0.0f;
            }
            for (int h = 0; h < nh; h++) {
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < AP_DQ_MAX / 32; j++) {
                    int d = lane + 32 * j;
                    if (j < kcols && d < a.Dq) part = __fmaf_rn(qs[h * a.Dq + d], kreg[j], part);
                }
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) part = __fadd_rn(part, __shfl_xor_sync(0xffffffffu, part, off));
                if (lane == 0) ps[i * a.HG + h] = __fmul_rn(part, a.scale);
            }
        }
        __syncthreads();
        // running max and sum per head, positions in order
        if (tid < nh) {
            float m = ms[tid], mc = -INFINITY;
            for (int i = 0; i < cn; i++) mc = fmaxf(mc, ps[i * a.HG + tid]);
            float mn = fmaxf(m, mc), l = ls[tid], c = 1.0f;
            if (mn != -INFINITY) {
                c = m == -INFINITY ? 0.0f : expf(m - mn);
                l = __fmul_rn(l, c);
                for (int i = 0; i < cn; i++) {
                    float p = valid[i] ? expf(ps[i * a.HG + tid] - mn) : 0.0f;
                    ps[i * a.HG + tid] = p;
                    l = __fadd_rn(l, p);
                }
            } else {
                for (int i = 0; i < cn; i++) ps[i * a.HG + tid] = 0.0f;
            }
            ms[tid] = mn, ls[tid] = l, cs[tid] = c;
        }
        __syncthreads();
        // outputs: element e = tid + AP_THREADS * j is head e / Dv, column e % Dv
#pragma unroll
        for (int j = 0; j < AP_ACC; j++) {
            if (j >= nacc) break;
            int e = tid + AP_THREADS * j;
            if (e >= nh * a.Dv) break;
            int h = e / a.Dv, d = e % a.Dv;
            float o = __fmul_rn(acc[j], cs[h]);
            for (int i = 0; i < cn; i++) {
                if (!valid[i]) continue;
                const T *vr = (const T *)a.v + rows[i] * a.ldv + (long long)g * a.Dv;
                o = __fmaf_rn(ps[i * a.HG + h], lunar_to_f32(vr[d]), o);
            }
            acc[j] = o;
        }
    }
    __syncthreads();
    T *out = (T *)a.o + ((long long)b * a.NH + h0) * a.Dv;
#pragma unroll
    for (int j = 0; j < AP_ACC; j++) {
        if (j >= nacc) break;
        int e = tid + AP_THREADS * j;
        if (e >= nh * a.Dv) break;
        float l = ls[e / a.Dv];
        out[e] = lunar_from_f32<T>(l > 0.0f ? __fdiv_rn(acc[j], l) : 0.0f);
    }
}

extern "C" lunar_status lunar_cuda_attention_paged(lunar_ctx *ctx, lunar_tensor *o, const lunar_tensor *q,
                                                   const lunar_tensor *k, const lunar_tensor *v,
                                                   const lunar_tensor *table, const lunar_tensor *lengths,
                                                   const lunar_tensor *keys, int64_t block_size, float scale) {
    int B = (int)q->shape[0], NH = (int)q->shape[1], Dq = (int)q->shape[2], Dv = (int)o->shape[2];
    int Hk = (int)(k->shape[1] / Dq), G = NH / Hk;
    if (B == 0) return LUNAR_OK;
    if (Dq > AP_DQ_MAX || Dv > AP_THREADS * AP_ACC)
        return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                          "attention_paged on cuda: head dims Dq = %d, Dv = %d; this kernel takes Dq <= %d and Dv <= %d",
                          Dq, Dv, AP_DQ_MAX, AP_THREADS * AP_ACC);
    if (q->dtype != k->dtype)
        return LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "attention_paged on cuda: q is %s and the cache %s",
                          lunar_dtype_name(q->dtype), lunar_dtype_name(k->dtype));
    int HG = G < AP_HG_MAX ? G : AP_HG_MAX;
    if (HG > (AP_THREADS * AP_ACC) / Dv) HG = (AP_THREADS * AP_ACC) / Dv;
    while (HG > 1 && ap_smem_bytes(HG, Dq) > 48 * 1024) HG--;
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, o, &stream));
    ApArgs a;
    a.q = lunar_tensor_data(q), a.k = lunar_tensor_data(k), a.v = lunar_tensor_data(v), a.o = lunar_tensor_data(o);
    a.ldk = k->stride[0], a.ldv = v->stride[0], a.nblocks = k->shape[0] / block_size;
    a.table = (const int64_t *)lunar_tensor_data(table), a.lens = (const int64_t *)lunar_tensor_data(lengths);
    a.keys = keys ? (const int64_t *)lunar_tensor_data(keys) : NULL;
    a.NH = NH, a.Hk = Hk, a.G = G, a.HG = HG, a.Dq = Dq, a.Dv = Dv, a.NB = (int)table->shape[1];
    a.bs = (int)block_size, a.K = keys ? (int)keys->shape[1] : 0, a.scale = scale;
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, o, "attention_paged", "k (blocks of the cache)", k, 0, &a.rt_table));
    LUNAR_TRY(lunar_cuda_range_ticket(ctx, o, "attention_paged", "the positions of table (lengths - 1)", table, 1,
                                      &a.rt_len));
    dim3 grid(Hk * ((G + HG - 1) / HG), B);
    size_t smem = ap_smem_bytes(HG, Dq);
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, q->dtype, T, attention_paged_kernel<T><<<grid, AP_THREADS, smem, stream>>>(a));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "attention_paged");
    return LUNAR_OK;
}
