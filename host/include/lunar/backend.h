/* backend.h: the table each device type fills in (ggml's backend interface, made for lunar).
 *
 * host/ops/ validates every call, then calls the backend with prepared tensors:
 *   - every tensor is contiguous (gemm takes row-major views, see its entry) and lives on the
 *     backend's device type;
 *   - floating tensors have a dtype in the backend's `float_dtypes` mask (others were converted
 *     to f32 by the host), and all floating inputs and outputs of one call share the dtype of
 *     the first floating input, except the tensors the op documents as f32 (statistics such as
 *     rstd and lse, losses, optimizer state, inv_freq);
 *   - index tensors are i64;
 *   - shapes were checked against each other.
 * So a kernel only has to handle the contiguous case. The entries mirror ops.h one to one;
 * a NULL entry means "not implemented on this backend" and the host reports it by name.
 */
#ifndef LUNAR_BACKEND_H
#define LUNAR_BACKEND_H

#include "lunar/ops.h"
#include "lunar/rng.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lunar_rng_kind { LUNAR_RNG_UNIFORM = 0, LUNAR_RNG_NORMAL, LUNAR_RNG_RANDINT } lunar_rng_kind;

struct lunar_backend {
    const char *name;
    int         device_type;
    unsigned    float_dtypes;     /* bit (1u << dtype) for each float dtype the kernels take */
    int         int_reduce;       /* reduce takes i64 x and out (sum, max, min) */

    /* devices and memory */
    lunar_status (*device_count)(lunar_ctx *ctx, int *count);
    /* after device_count: why it found no device, as the runtime said ("" when it said nothing,
     * e.g. a machine with devices); NULL for a backend that always has its devices */
    const char  *(*device_count_error)(lunar_ctx *ctx);
    lunar_status (*alloc)(lunar_ctx *ctx, int device, size_t nbytes, void **out);
    void         (*free)(lunar_ctx *ctx, int device, void *ptr);
    lunar_status (*copy_to_host)(lunar_ctx *ctx, int device, void *dst, const void *src, size_t n);
    lunar_status (*copy_from_host)(lunar_ctx *ctx, int device, void *dst, const void *src, size_t n);
    lunar_status (*synchronize)(lunar_ctx *ctx, int device);
    /* The device's index range record (ops.h, check points): waits for the queued work, reads the
     * record (one 32-byte read, which the caller counts), clears it and gives the first bad index
     * that a kernel met since the last call (*found = 1) or none (*found = 0). NULL for the CPU,
     * whose ops check index values on the host. */
    lunar_status (*take_range_error)(lunar_ctx *ctx, int device, lunar_range_error *e, int *found);
    /* frees backend state kept in the context (streams, handles); called by lunar_ctx_free */
    void         (*shutdown)(lunar_ctx *ctx);

    /* copy within the device: dst and src may be strided and of any dtype (the one op that takes
     * strided tensors; src may have 0 strides for broadcasting). saturate: f8 clamps to max. */
    lunar_status (*copy)(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src, int saturate);
    lunar_status (*fill)(lunar_ctx *ctx, lunar_tensor *t, double value);
    lunar_status (*arange)(lunar_ctx *ctx, lunar_tensor *t, double start, double step);
    /* uniform: a = lo, b = hi, top = the largest value of out's dtype below hi (every draw is
     * clamped to it in f64 before rounding, so none rounds up to hi); normal: mean, std;
     * randint: lo, hi */
    lunar_status (*rng_fill)(lunar_ctx *ctx, lunar_tensor *out, lunar_rng_kind kind, uint64_t key,
                             uint64_t counter, double a, double b, double top);

    /* gemm relaxes the contiguity rule so that views reach BLAS without copies. Each of a, b, c
     * is 2-D (R, C) or 3-D (batch, R, C) and "row-major": unit stride in the last dim and a row
     * stride (the leading dimension, stride[ndim-2]) >= max(1, C); the batch stride is any value
     * >= 0 for a and b (0 = the same matrix for every batch) and nonzero for c when batch > 1. A
     * 2-D a or b with a 3-D c is shared across the batch. a and b have one dtype from
     * float_dtypes; c has that dtype or f32. Dims and strides fit in an int; M, N, K >= 1. The
     * host turns transposed views into flipped trans flags and copies only views with no unit
     * stride in their last two dims. */
    lunar_status (*gemm)(lunar_ctx *ctx, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                         int trans_a, int trans_b, float alpha, float beta);

    /* optional: n 2-D products, each prepared as for gemm (its own trans flags after view flips);
     * all inputs share one dtype and every c is that dtype. NULL: the host calls gemm n times. */
    lunar_status (*gemm_grouped)(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                 const lunar_tensor *const *b, const int *trans_a, const int *trans_b, float alpha,
                                 float beta);

    /* optional: n 2-D products c[i] (M, N) = alpha * a[i] (M, K) @ op(b[i]) + beta * c[i], b (N, K)
     * when trans_b, else (K, N), each element computed as lunar_gemm_row_invariant promises
     * (ops.h). a, b and c are row-major views as for gemm (unit stride in the last dim, row
     * stride in stride[0]), of one dtype from float_dtypes; no c overlaps an a or b; M, N, K >= 1. */
    lunar_status (*gemm_row_invariant)(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                       const lunar_tensor *const *b, int trans_b, float alpha, float beta);

    /* binary: a and b already have out's shape (the host expanded and copied broadcasts) */
    lunar_status (*binary)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, const lunar_tensor *b,
                           lunar_binary_op op);
    lunar_status (*binary_scalar)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, double s,
                                  lunar_binary_op op);
    lunar_status (*unary)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, lunar_unary_op op);
    lunar_status (*unary_backward)(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                   const lunar_tensor *x, lunar_unary_op op);
    lunar_status (*swiglu_forward)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *gate,
                                   const lunar_tensor *up);
    lunar_status (*swiglu_backward)(lunar_ctx *ctx, lunar_tensor *dgate, lunar_tensor *dup,
                                    const lunar_tensor *dout, const lunar_tensor *gate, const lunar_tensor *up);
    /* mask (u8, x's shape after host expansion) */
    lunar_status (*masked_fill)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x,
                                const lunar_tensor *mask, double value);

    /* reductions see x as (outer, n, inner) with n the reduced extent: for ALL_DIMS outer = inner = 1 */
    lunar_status (*reduce)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer,
                           int64_t n, int64_t inner, lunar_reduce_op op);
    lunar_status (*reduce_backward)(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                    const lunar_tensor *x, const lunar_tensor *y, int64_t outer, int64_t n,
                                    int64_t inner, lunar_reduce_op op);
    lunar_status (*max_dim)(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                            int64_t outer, int64_t n, int64_t inner);
    lunar_status (*cumsum)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer,
                           int64_t n, int64_t inner, int reverse);
    /* out: one f32 element; ts: n contiguous tensors (any float dtype the backend takes) */
    lunar_status (*global_norm)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *const *ts, int n);

    lunar_status (*softmax_forward)(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, int log);
    lunar_status (*softmax_backward)(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                     const lunar_tensor *y, int log);
    lunar_status (*cross_entropy_forward)(lunar_ctx *ctx, lunar_tensor *loss, lunar_tensor *logprobs,
                                          lunar_tensor *lse, const lunar_tensor *logits,
                                          const lunar_tensor *targets, int64_t ignore_index);
    lunar_status (*cross_entropy_backward)(lunar_ctx *ctx, lunar_tensor *dlogits, const lunar_tensor *dloss,
                                           const lunar_tensor *logits, const lunar_tensor *lse,
                                           const lunar_tensor *targets, int64_t ignore_index);
    lunar_status (*entropy_forward)(lunar_ctx *ctx, lunar_tensor *entropy, const lunar_tensor *logits,
                                    const lunar_tensor *lse);
    /* optional (NULL: the caller draws with softmax, cumsum and argmax instead) */
    lunar_status (*sample_rows)(lunar_ctx *ctx, lunar_tensor *tokens, lunar_tensor *logprobs,
                                const lunar_tensor *z, const lunar_tensor *u);

    lunar_status (*rmsnorm_forward)(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *rstd,
                                    const lunar_tensor *x, const lunar_tensor *w, float eps);
    lunar_status (*rmsnorm_backward_input)(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                           const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *rstd);
    /* backward_params: dw (and db) keep their own float dtype (f32 gradients of bf16 activations) */
    lunar_status (*rmsnorm_backward_params)(lunar_ctx *ctx, lunar_tensor *dw, const lunar_tensor *dout,
                                            const lunar_tensor *x, const lunar_tensor *rstd);
    lunar_status (*layernorm_forward)(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *mean, lunar_tensor *rstd,
                                      const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *b, float eps);
    lunar_status (*layernorm_backward_input)(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                             const lunar_tensor *x, const lunar_tensor *w,
                                             const lunar_tensor *mean, const lunar_tensor *rstd);
    lunar_status (*layernorm_backward_params)(lunar_ctx *ctx, lunar_tensor *dw, lunar_tensor *db,
                                              const lunar_tensor *dout, const lunar_tensor *x,
                                              const lunar_tensor *mean, const lunar_tensor *rstd);

    /* x, out (T, H, D); positions (T) i64; inv_freq (R/2) f32; inverse = 1 for the backward */
    lunar_status (*rope)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, const lunar_tensor *positions,
                         const lunar_tensor *inv_freq, lunar_rope_layout layout, float scale, int inverse);

    /* gather/scatter family: the host reshapes to (outer, n, inner) around dim where it can. The
     * tensor read from (weight, src) sets the float dtype of gathers, the accumulating one (dweight,
     * dst) that of scatters. Index values are range-checked by the host for CPU tensors; CUDA
     * kernels check on the device, skip a bad value and record the first one in the device's
     * range record (take_range_error), never reading it back themselves. */
    lunar_status (*embedding_forward)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *ids,
                                      const lunar_tensor *weight);
    lunar_status (*embedding_backward)(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout,
                                       const lunar_tensor *ids);
    /* src seen as (outer, n_src, inner), out/dst as (outer, n_idx, inner) */
    lunar_status (*index_select)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                 const lunar_tensor *index, int64_t outer, int64_t n_src, int64_t inner);
    lunar_status (*index_add)(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index,
                              const lunar_tensor *src, double alpha, int64_t outer, int64_t n_dst, int64_t inner);
    /* gather/scatter with index of shape (outer, n_idx, inner) and src/dst extent n_data along dim */
    lunar_status (*gather)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, const lunar_tensor *index,
                           int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner);
    lunar_status (*scatter)(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index, const lunar_tensor *src,
                            int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner, int accumulate);
    /* out (N, C), src (R, C) and index (N, K), as ops.h; out sets the float dtype */
    lunar_status (*index_select_sum)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                     const lunar_tensor *index, int accumulate);
    /* counts (B) i64, values (n) i64 */
    lunar_status (*bincount)(lunar_ctx *ctx, lunar_tensor *counts, const lunar_tensor *values);

    /* x seen as (rows, n) */
    lunar_status (*topk)(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                         int64_t rows, int64_t n, int64_t k, int largest);
    lunar_status (*argsort)(lunar_ctx *ctx, lunar_tensor *indices, const lunar_tensor *x, int64_t rows,
                            int64_t n, int descending);

    lunar_status (*causal_mask)(lunar_ctx *ctx, lunar_tensor *out, int64_t offset);
    lunar_status (*block_mask)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens, int causal);

    /* fused attention (ops.h): q, k, v, o, dout, dq, dk, dv in one float dtype; lse, mask f32;
     * keys i64 or NULL, mask NULL when absent; keys values on the CPU are < T (host-checked) */
    lunar_status (*attention_forward)(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *lse, const lunar_tensor *q,
                                      const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *keys,
                                      const lunar_tensor *mask, float scale);
    lunar_status (*attention_backward)(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                       const lunar_tensor *dout, const lunar_tensor *o, const lunar_tensor *lse,
                                       const lunar_tensor *q, const lunar_tensor *k, const lunar_tensor *v,
                                       const lunar_tensor *keys, const lunar_tensor *mask, float scale);
    /* paged decode attention (ops.h): q and o in one float dtype from float_dtypes; k and v in one
     * float dtype of their own (f32, bf16 or f16: a backend whose float_dtypes lack it converts
     * rows as it reads them), 2-D with unit stride along a row and their row stride in stride[0];
     * table, lengths, keys contiguous i64 (keys NULL when absent); on the CPU every block id and
     * length is in range (host-checked) */
    lunar_status (*attention_paged)(lunar_ctx *ctx, lunar_tensor *o, const lunar_tensor *q, const lunar_tensor *k,
                                    const lunar_tensor *v, const lunar_tensor *table, const lunar_tensor *lengths,
                                    const lunar_tensor *keys, int64_t block_size, float scale);
    /* qi, ki in one float dtype; w, mask, scores f32; scores or topk may be NULL (not both) */
    lunar_status (*index_scores)(lunar_ctx *ctx, lunar_tensor *scores, lunar_tensor *topk, const lunar_tensor *qi,
                                 const lunar_tensor *ki, const lunar_tensor *w, const lunar_tensor *mask, float scale);

    /* KDA and its short conv (ops.h): every float tensor f32, seg i64; on the CPU the segment
     * offsets were checked */
    lunar_status (*kda_forward)(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                                const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0);
    lunar_status (*kda_backward)(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                 lunar_tensor *dg, lunar_tensor *dbeta, lunar_tensor *dstate0,
                                 const lunar_tensor *dout, const lunar_tensor *dstate, const lunar_tensor *q,
                                 const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                 const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0);
    lunar_status (*conv1d_causal_forward)(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x,
                                          const lunar_tensor *w, const lunar_tensor *seg, const lunar_tensor *hist);
    lunar_status (*conv1d_causal_backward)(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dw, const lunar_tensor *dy,
                                           const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *seg,
                                           const lunar_tensor *hist);
    /* a decode step (ops.h): the state or history of each row's slot updated in place */
    lunar_status (*conv1d_step)(lunar_ctx *ctx, lunar_tensor *y, lunar_tensor *hist, const lunar_tensor *x,
                                const lunar_tensor *w, const lunar_tensor *slots);
    lunar_status (*kda_step)(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                             const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                             const lunar_tensor *beta, const lunar_tensor *slots);
    /* mHC (ops.h): every tensor f32 */
    lunar_status (*hc_weights)(lunar_ctx *ctx, lunar_tensor *pre, lunar_tensor *post, lunar_tensor *comb,
                               const lunar_tensor *z, int64_t n, int iters, float eps);
    lunar_status (*hc_weights_backward)(lunar_ctx *ctx, lunar_tensor *dz, const lunar_tensor *dpre,
                                        const lunar_tensor *dpost, const lunar_tensor *dcomb, const lunar_tensor *z,
                                        int64_t n, int iters, float eps);
    lunar_status (*hc_mix)(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *a,
                           const lunar_tensor *post, const lunar_tensor *comb);
    lunar_status (*hc_mix_backward)(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *da, lunar_tensor *dpost,
                                    lunar_tensor *dcomb, const lunar_tensor *dy, const lunar_tensor *x,
                                    const lunar_tensor *a, const lunar_tensor *post, const lunar_tensor *comb);
    lunar_status (*hc_collapse)(lunar_ctx *ctx, lunar_tensor *u, const lunar_tensor *x, const lunar_tensor *pre);
    lunar_status (*hc_collapse_backward)(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dpre,
                                         const lunar_tensor *du, const lunar_tensor *x, const lunar_tensor *pre);

    /* param and grad each keep their own float dtype (a bf16 param may have an f32 grad) */
    lunar_status (*adamw_step)(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master, lunar_tensor *m,
                               lunar_tensor *v, const lunar_tensor *grad, const lunar_adamw_hparams *hp);

    /* q (M, N) stays f8e4m3 / f8e5m2 (the exception to the float dtype rule), scale_inv
     * (ceil(M/block_m), ceil(N/block_n)) f32, out (M, N) in float_dtypes */
    lunar_status (*fp8_block_dequant)(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *q,
                                      const lunar_tensor *scale_inv, int64_t block_m, int64_t block_n);
};

/* Backends that were built (the CUDA one only with LUNAR_WITH_CUDA). */
const lunar_backend *lunar_backend_cpu(void);
const lunar_backend *lunar_backend_cuda(void);

#ifdef __cplusplus
}
#endif

#endif
