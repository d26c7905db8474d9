/* ops.h: every op, for every device.
 *
 * Conventions (llm.c argument order, torch/nn forward/backward split):
 *   lunar_<op>(ctx, outputs..., saved statistics..., inputs..., weights..., scalars...)
 *   lunar_<op>_forward / _backward_input (dgrad, "=") / _backward_params (wgrad, "+=")
 * Outputs are allocated by the caller with the right shape. All tensors of one call must be on
 * the same device. Inputs may be any strided view (transposed, narrowed, expanded); outputs
 * may be views too. Floating tensors may be f32, bf16 or f16 (math is f32); index tensors are
 * i32 or i64. Shapes use the glossary N rows/tokens, C channels, V vocab, T time, H heads,
 * D head dim, K top-k. Dims are 0-based; a negative dim counts from the end.
 *
 * Each function validates devices, dtypes and shapes and names the tensors in its error, then
 * hands contiguous tensors of a dtype the backend supports to the backend (host/ops/prep.c),
 * and copies results back into non-contiguous or other-dtype outputs.
 */
#ifndef LUNAR_OPS_H
#define LUNAR_OPS_H

#include "lunar/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LUNAR_ALL_DIMS (-1000)   /* reduce over every element */

/* ---- copy, cast, fill -------------------------------------------------------------------- */

/* dst = src, with broadcasting of src to dst's shape, dtype conversion and device transfer. */
lunar_status lunar_copy(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src);
/* Like lunar_copy, but float8 destinations saturate to +-max instead of becoming NaN/inf. */
lunar_status lunar_copy_saturate(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src);
lunar_status lunar_fill(lunar_ctx *ctx, lunar_tensor *t, double value);
/* t[i] = start + i * step over the flattened tensor. */
lunar_status lunar_arange(lunar_ctx *ctx, lunar_tensor *t, double start, double step);
/* Waits for queued device work (no-op on CPU), then checks the device as lunar_sync_check does. */
lunar_status lunar_synchronize(lunar_ctx *ctx, lunar_device dev);

/* ---- check points: index range errors of devices ------------------------------------------ */

/* An index op on the host (cpu) fails at once on an index value outside its range. On any other
 * device that would take a read of device memory, a synchronisation, per op; so there the op
 * skips the bad values (its output is unspecified until the error is raised: CUDA gathers write
 * 0 for them, the debug devices skip the whole kernel) and the device records the first one:
 * CUDA kernels in a per-device record, the debug devices cpu:N in the context (ctx.h). "First"
 * is the first op in stream order; within one op with several bad values, the CPU and cpu:N
 * report the lowest position, CUDA whichever thread claimed the record first (the op is right,
 * the value and position may differ from run to run). A check point raises it:
 *   lunar_sync_check(dev) reads and clears the record (one read, counted as a transfer; a no-op
 *   on the host) and fails with the op, the tensor, the value, its position and the valid
 *   range. lunar_synchronize, a model forward that reads its loss and the optimizer step call
 *   it (lua/lunar); with check-each-op (ctx.h) every index op on a device does. */
struct lunar_range_error {
    const char *op;                  /* "index_select", ...; NULL once no longer known */
    const char *role;                /* the tensor indexed: "src", "dst", "weight", "dweight" */
    char        label[LUNAR_NAME_MAX];
    int         dim;                 /* its dim (0-based); -1 when the backend does not know it */
    int64_t     pos, value, n;       /* flat position in the index, the bad value, valid 0..n-1 */
};
lunar_status lunar_sync_check(lunar_ctx *ctx, lunar_device dev);
/* The message of e, stored in ctx; deferred adds where it was found and how to find the op. */
lunar_status lunar_range_error_fail(lunar_ctx *ctx, const lunar_range_error *e, lunar_device dev, int deferred);

/* ---- GEMM -------------------------------------------------------------------------------- */

/* c = alpha * op(a) @ op(b) + beta * c, op(x) = x or x^T (last two dims), f32 accumulation.
 *   2-D:   a (M, K) [or (K, M) if trans_a], b (K, N) [or (N, K)], c (M, N)
 *   3-D:   batched over dim 0; a or b may also be 2-D (shared across the batch).
 * bf16/f16 inputs are multiplied with f32 accumulation; c may be f32, bf16 or f16. */
lunar_status lunar_gemm(lunar_ctx *ctx, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                        int trans_a, int trans_b, float alpha, float beta);

/* n independent 2-D products c[i] = alpha * op(a[i]) @ op(b[i]) + beta * c[i], each as in
 * lunar_gemm (the same trans flags, alpha and beta for all), with the same results as n
 * lunar_gemm calls. The CPU runs moderately small products side by side, one thread each (the
 * per-expert products of an MoE layer), instead of splitting each one over the threads. */
lunar_status lunar_gemm_grouped(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                const lunar_tensor *const *b, int trans_a, int trans_b, float alpha, float beta);

/* n independent products c[i] = alpha * a[i] @ op(b[i]) + beta * c[i], row-invariant: a (M, K),
 * b (N, K) when trans_b (a linear layer's weight, (out, in)) else (K, N), c (M, N); each may also
 * be batched, 3-D with the batch first (a 2-D a or b is then shared by the batch). Every element
 * c[r][j] is the dot product of row r of a and column j of op(b) summed in one fixed order that
 * depends on K only (the CPU's: kernels/cpu/gemm_row_invariant.c; CUDA's:
 * kernels/cuda/gemm_row_invariant.cu), so a row gets the same bits whatever other rows its
 * product has, in any grouping, with any threads, on a given device and machine. Generation
 * relies on it: a sequence's rows give the same results alone or batched with others (lunar_gemm
 * makes no such promise: BLAS picks kernels by shape). c is not read when beta is 0. Floats of
 * any dtype (f32 accumulation; c of the inputs' dtype or f32); a view whose rows are not unit
 * stride is copied first (the same bits). No product may write memory another one reads. */
lunar_status lunar_gemm_row_invariant(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                      const lunar_tensor *const *b, int trans_b, float alpha, float beta);

/* ---- elementwise ------------------------------------------------------------------------- */

typedef enum lunar_binary_op {
    LUNAR_BINARY_ADD = 0, LUNAR_BINARY_SUB, LUNAR_BINARY_MUL, LUNAR_BINARY_DIV,
    LUNAR_BINARY_MAX, LUNAR_BINARY_MIN, LUNAR_BINARY_POW,
    LUNAR_BINARY_RSUB, LUNAR_BINARY_RDIV,       /* b - a, b / a (for scalar forms) */
    LUNAR_BINARY_EQ, LUNAR_BINARY_NE, LUNAR_BINARY_LT, LUNAR_BINARY_LE, LUNAR_BINARY_GT, LUNAR_BINARY_GE,
    LUNAR_BINARY_COUNT
} lunar_binary_op;

typedef enum lunar_unary_op {
    LUNAR_UNARY_NEG = 0, LUNAR_UNARY_ABS, LUNAR_UNARY_EXP, LUNAR_UNARY_LOG, LUNAR_UNARY_SQRT,
    LUNAR_UNARY_RSQRT, LUNAR_UNARY_RECIP, LUNAR_UNARY_SQUARE, LUNAR_UNARY_TANH, LUNAR_UNARY_SIGMOID,
    LUNAR_UNARY_SILU, LUNAR_UNARY_GELU /* erf */, LUNAR_UNARY_GELU_TANH, LUNAR_UNARY_RELU,
    LUNAR_UNARY_SIN, LUNAR_UNARY_COS,
    LUNAR_UNARY_COUNT
} lunar_unary_op;

const char *lunar_binary_op_name(lunar_binary_op op);
const char *lunar_unary_op_name(lunar_unary_op op);
int lunar_binary_op_from_name(const char *name, lunar_binary_op *out);
int lunar_unary_op_from_name(const char *name, lunar_unary_op *out);

/* out = a <op> b, a and b broadcast to out's shape. Comparisons give 1/0 (out may be bool). */
lunar_status lunar_binary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, const lunar_tensor *b,
                          lunar_binary_op op);
/* out = a <op> s */
lunar_status lunar_binary_scalar(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, double s,
                                 lunar_binary_op op);
/* out = f(x) */
lunar_status lunar_unary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, lunar_unary_op op);
/* dx = dy * f'(x) */
lunar_status lunar_unary_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                  const lunar_tensor *x, lunar_unary_op op);
/* out = silu(gate) * up; all (N, F) */
lunar_status lunar_swiglu_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *gate,
                                  const lunar_tensor *up);
lunar_status lunar_swiglu_backward(lunar_ctx *ctx, lunar_tensor *dgate, lunar_tensor *dup,
                                   const lunar_tensor *dout, const lunar_tensor *gate, const lunar_tensor *up);
/* out = mask ? value : x; mask (bool/u8) broadcasts to x. Its backward is itself with value 0. */
lunar_status lunar_masked_fill(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x,
                               const lunar_tensor *mask, double value);

/* ---- reductions -------------------------------------------------------------------------- */

typedef enum lunar_reduce_op {
    LUNAR_REDUCE_SUM = 0, LUNAR_REDUCE_MEAN, LUNAR_REDUCE_MAX, LUNAR_REDUCE_MIN,
    LUNAR_REDUCE_NORM,    /* L2 norm */
    LUNAR_REDUCE_COUNT
} lunar_reduce_op;
const char *lunar_reduce_op_name(lunar_reduce_op op);
int lunar_reduce_op_from_name(const char *name, lunar_reduce_op *out);

/* out = reduce(x) over dim (or LUNAR_ALL_DIMS). out has x's shape with dim removed or kept as 1
 * (keepdim); for ALL_DIMS out has one element. Sums accumulate in f64 on CPU, in a fixed order.
 * An integer or bool x (CPU only) takes SUM, MAX and MIN, computed exactly in i64 into an integer
 * out. */
lunar_status lunar_reduce(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int dim,
                          lunar_reduce_op op);
/* dx = d reduce / dx * dy; y is the forward output (needed for MAX/MIN/NORM). The gradient of
 * MAX/MIN goes to the first position that attains the extreme. */
lunar_status lunar_reduce_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                   const lunar_tensor *x, const lunar_tensor *y, int dim, lunar_reduce_op op);
/* values, indices (i64 or i32) = max / argmax over dim (first occurrence). */
lunar_status lunar_max_dim(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices,
                           const lunar_tensor *x, int dim);
/* out = cumulative sum over dim; backward: dx = reverse cumulative sum of dy. */
lunar_status lunar_cumsum_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int dim);
lunar_status lunar_cumsum_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, int dim);
/* out (one element, f32) = sqrt(sum over tensors of sum(t^2)), in a fixed order. */
lunar_status lunar_global_norm(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *const *ts, int n);

/* ---- softmax and losses (over the last dim) --------------------------------------------- */

lunar_status lunar_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x);
lunar_status lunar_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                    const lunar_tensor *y);
lunar_status lunar_log_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x);
lunar_status lunar_log_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                        const lunar_tensor *y);
/* Fused cross-entropy over logits (N, V) and targets (N):
 *   lse (N)      = logsumexp(logits[i])                       (f32, saved for backward)
 *   logprobs (N) = logits[i, t_i] - lse[i]                     (f32; 0 where t_i == ignore_index)
 *   loss (N)     = -logprobs[i]                                (f32; 0 where ignored)
 * backward: dlogits[i] = dloss[i] * (softmax(logits[i]) - onehot(t_i)), 0 for ignored rows. */
lunar_status lunar_cross_entropy_forward(lunar_ctx *ctx, lunar_tensor *loss, lunar_tensor *logprobs,
                                         lunar_tensor *lse, const lunar_tensor *logits,
                                         const lunar_tensor *targets, int64_t ignore_index);
lunar_status lunar_cross_entropy_backward(lunar_ctx *ctx, lunar_tensor *dlogits, const lunar_tensor *dloss,
                                          const lunar_tensor *logits, const lunar_tensor *lse,
                                          const lunar_tensor *targets, int64_t ignore_index);
/* entropy (N) f32 = -sum_v p log p of softmax(logits[i]), with log p = logits[i] - lse[i] (lse
 * from lunar_cross_entropy_forward on the same logits): one pass over each row. */
lunar_status lunar_entropy_forward(lunar_ctx *ctx, lunar_tensor *entropy, const lunar_tensor *logits,
                                   const lunar_tensor *lse);
/* One categorical draw per row of softmax(z (N, V) f32): tokens (N) i64 the first id whose running
 * sum of exp(z - max) exceeds u (N) f32 in [0, 1) times the row's total; logprobs (N) f32 its
 * log-probability, formed as lunar_cross_entropy_forward forms it. The CPU backend has it; the
 * others answer LUNAR_ERR_UNSUPPORTED (their callers draw with softmax, cumsum and argmax). */
lunar_status lunar_sample_rows(lunar_ctx *ctx, lunar_tensor *tokens, lunar_tensor *logprobs, const lunar_tensor *z,
                               const lunar_tensor *u);

/* ---- normalisation (over the last dim) ---------------------------------------------------- */

/* out (N, C) = x / sqrt(mean(x^2) + eps) * w; rstd (N) f32 saved. w may be NULL (no weight). */
lunar_status lunar_rmsnorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *rstd,
                                   const lunar_tensor *x, const lunar_tensor *w, float eps);
lunar_status lunar_rmsnorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                          const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *rstd);
lunar_status lunar_rmsnorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, const lunar_tensor *dout,
                                           const lunar_tensor *x, const lunar_tensor *rstd);
/* out (N, C) = (x - mean) * rstd * w + b, biased variance; mean, rstd (N) f32 saved; w, b may be NULL. */
lunar_status lunar_layernorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *mean, lunar_tensor *rstd,
                                     const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *b, float eps);
lunar_status lunar_layernorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                            const lunar_tensor *x, const lunar_tensor *w,
                                            const lunar_tensor *mean, const lunar_tensor *rstd);
/* dw += sum(dout * xhat), db += sum(dout); either may be NULL. */
lunar_status lunar_layernorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, lunar_tensor *db,
                                             const lunar_tensor *dout, const lunar_tensor *x,
                                             const lunar_tensor *mean, const lunar_tensor *rstd);

/* ---- rotary position embedding ------------------------------------------------------------ */

typedef enum lunar_rope_layout {
    LUNAR_ROPE_HALF = 0,            /* NeoX rotate_half: pairs (i, i + R/2) */
    LUNAR_ROPE_INTERLEAVED,         /* GPT-J / DeepSeek complex pairs (2i, 2i+1), output in place */
    LUNAR_ROPE_INTERLEAVED_TO_HALF, /* HF apply_rotary_pos_emb_interleave: pairs (2i, 2i+1), output
                                       written in half-split order (see glm5-architecture.md 4.4) */
    LUNAR_ROPE_LAYOUT_COUNT
} lunar_rope_layout;

/* x, out (T, H, D): token t rotated by angle_i = f32(positions[t]) * inv_freq[i] on its first
 * R = 2 * numel(inv_freq) channels (partial rotary: the rest is copied); cos/sin are multiplied
 * by scale (HF attention_scaling, 1 for default rope). positions (T) i32/i64, inv_freq (R/2) f32.
 * backward: dx = rotation of dout by -angle (the inverse permutation for INTERLEAVED_TO_HALF). */
lunar_status lunar_rope_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x,
                                const lunar_tensor *positions, const lunar_tensor *inv_freq,
                                lunar_rope_layout layout, float scale);
lunar_status lunar_rope_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                 const lunar_tensor *positions, const lunar_tensor *inv_freq,
                                 lunar_rope_layout layout, float scale);

/* ---- embedding, gather, scatter ----------------------------------------------------------- */

/* out (N, C) = weight[ids[n]]; ids (N) i32/i64, weight (V, C). Out-of-range ids are an error. */
lunar_status lunar_embedding_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *ids,
                                     const lunar_tensor *weight);
/* dweight (V, C) += scatter-add of dout (N, C) by ids; deterministic order. */
lunar_status lunar_embedding_backward(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout,
                                      const lunar_tensor *ids);
/* out = src.index_select(dim, index); index (K) */
lunar_status lunar_index_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim,
                                const lunar_tensor *index);
/* dst.index_add_(dim, index, alpha * src) */
lunar_status lunar_index_add(lunar_ctx *ctx, lunar_tensor *dst, int dim, const lunar_tensor *index,
                             const lunar_tensor *src, double alpha);
/* torch.gather: out[..i..] = src[..index[..i..]..] along dim; out has index's shape. */
lunar_status lunar_gather(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim,
                          const lunar_tensor *index);
/* torch.scatter_ / scatter_add_: dst[..index[..i..]..] (=|+=) src[..i..] along dim. */
lunar_status lunar_scatter(lunar_ctx *ctx, lunar_tensor *dst, int dim, const lunar_tensor *index,
                           const lunar_tensor *src);
lunar_status lunar_scatter_add(lunar_ctx *ctx, lunar_tensor *dst, int dim, const lunar_tensor *index,
                               const lunar_tensor *src);
/* out (N, C) (= or +=) the sum over k = 0..K-1, in that order, of src (R, C)[index[n, k], :];
 * index (N, K). Each element is summed in f32, from 0 (or from out's value when accumulate), and
 * rounded to out's dtype once: the bits of index_add_ of those rows, in that order, into a zeroed
 * (or the given) out. The MoE layer combines its experts' rows with it (docs/model.md). */
lunar_status lunar_index_select_sum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                    const lunar_tensor *index, int accumulate);
/* counts (B) i32/i64 = how often each value 0..B-1 occurs in values (any shape, i32/i64), as
 * torch.bincount(values, minlength=B); a value outside [0, B) is an error. */
lunar_status lunar_bincount(lunar_ctx *ctx, lunar_tensor *counts, const lunar_tensor *values);

/* ---- sorting ------------------------------------------------------------------------------ */

/* values, indices (..., K) = the k largest (or smallest) along the last dim, sorted; ties go to
 * the lower index first. indices i64 or i32; values may be NULL. */
lunar_status lunar_topk(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                        int64_t k, int largest);
/* indices (same shape as x) that sort x along the last dim; stable. */
lunar_status lunar_argsort(lunar_ctx *ctx, lunar_tensor *indices, const lunar_tensor *x, int descending);

/* ---- attention masks ---------------------------------------------------------------------- */

/* out (Tq, Tk): key k visible to query q iff k <= q + offset. Float out: 0 / -inf; bool out: 1 / 0. */
lunar_status lunar_causal_mask(lunar_ctx *ctx, lunar_tensor *out, int64_t offset);
/* out (T, T) for packed sequences: cu_seqlens (S+1) i32/i64 with cu_seqlens[0] = 0 and
 * cu_seqlens[S] = T; k visible to q iff same document and (not causal or k <= q). */
lunar_status lunar_block_mask(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens, int causal);

/* ---- fused attention (token-major, flash-style: no (T, T) matrix in memory) --------------- */

/* Softmax attention of every query over its own set of candidate keys, HF eager semantics:
 *   q (B, S, NH, Dq), k (B, T, Hk, Dq), v (B, T, Hk, Dv); NH >= 1 (no heads is an error on every
 *   backend, as T, Hk, Dq, Dv >= 1 are; B or S may be 0); Hk divides NH and query head h uses key
 *   head h / (NH / Hk) (Hk = NH per head, Hk < NH grouped / GQA);
 *   keys (B, S, K) i32/i64 or NULL: the candidate keys of query (b, s) are keys[b, s, :] (DSA
 *   top-k; entries < 0 are ignored, a key listed twice counts once), or all T keys when NULL;
 *   mask (B, S, T) additive f32 or NULL (lunar.nn.masks: 0 visible, f32 finfo.min hidden).
 * The score of candidate key t is dot(q, k) * scale + mask[b, s, t]. A candidate whose mask value
 * is <= -FLT_MAX (finfo.min or -inf) is not attendable: it gets probability exactly 0 and its
 * products are never computed (so a causal mask halves the work). A query with no attendable key
 * (a padded row) attends uniformly to all T keys, as the softmax of an all-finfo.min row does.
 *   o (B, S, NH, Dv) = sum_t P[t] v[t], P = softmax over the attendable keys (f32 math);
 *   lse (B, NH, S) f32 = log sum_t exp(score_t) over them (finfo.min for a padded row).
 * Entries of keys >= T are an error on the CPU (checked on the host); CUDA kernels ignore them. */
lunar_status lunar_attention_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *lse, const lunar_tensor *q,
                                     const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *keys,
                                     const lunar_tensor *mask, float scale);
/* dq, dk, dv (shapes of q, k, v; all written, "=") from dout (o's shape) and the forward's o and
 * lse: P recomputed, D = rowsum(dout * o), dS = P (dout.v - D), dq = scale dS k,
 * dk = scale dS^T q and dv = P^T dout summed over the queries and the heads sharing each key head.
 * The CPU accumulates dk and dv in a fixed order (deterministic for any thread count). */
lunar_status lunar_attention_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                      const lunar_tensor *dout, const lunar_tensor *o, const lunar_tensor *lse,
                                      const lunar_tensor *q, const lunar_tensor *k, const lunar_tensor *v,
                                      const lunar_tensor *keys, const lunar_tensor *mask, float scale);
/* Decode attention over a paged KV cache, read in place: one new query per sequence against the
 * cached rows of its blocks (no gathered copy of the cache).
 *   q (B, NH, Dq), o (B, NH, Dv);
 *   k (R, Hk * Dq), v (R, Hk * Dv): the cache's rows, R = blocks * block_size; key head g is
 *     columns g * Dq .. (g + 1) * Dq - 1 (v likewise); views with a unit stride along the row
 *     are read as they are (v may be a narrowed view of k: MLA's latents are its keys' first
 *     columns); query head h uses key head h / (NH / Hk);
 *   table (B, NB) i64: sequence b's blocks; its token t is row
 *     table[b, t / block_size] * block_size + t % block_size;
 *   lengths (B) i64: sequence b's tokens, 1 <= lengths[b] <= NB * block_size;
 *   keys (B, K) i64 or NULL: the positions sequence b attends (DSA's top-k, which lists them in
 *     increasing order); an entry outside [0, lengths[b]) or not greater than the last attended
 *     one counts nothing (so a repeat counts once). NULL: every position below lengths[b].
 *   o[b, h] = sum_t p_t v_t, p = softmax_t(scale * q[b, h] . k_t) over the attended positions
 *     (f32 math; 0 when none is attended).
 * Each sequence is computed on its own in a fixed order (kernels/cpu/attention_paged.c,
 * kernels/cuda/attention_paged.cu), so its bits do not depend on the other sequences of the call.
 * k and v share a float dtype and are never copied (the CPU converts bf16 and f16 rows as it reads
 * them); q and o are in the compute dtype of k's dtype (f32 on the CPU). A block id outside
 * [0, blocks) or a length outside [1, NB * block_size] is an error naming the tensor (checked on
 * the host for the CPU; CUDA records it for the next check point and skips the sequence). */
lunar_status lunar_attention_paged(lunar_ctx *ctx, lunar_tensor *o, const lunar_tensor *q, const lunar_tensor *k,
                                   const lunar_tensor *v, const lunar_tensor *table, const lunar_tensor *lengths,
                                   const lunar_tensor *keys, int64_t block_size, float scale);
/* DSA lightning-indexer score (GLM-5 / DeepSeek-V3.2), f32:
 *   scores (B, S, T)[b, s, t] = sum_h w[b, s, h] * relu(scale * dot(qi[b, s, h], ki[b, t])) + mask[b, s, t]
 *   qi (B, S, Hi, Di), ki (B, T, Di), w (B, S, Hi) f32, mask (B, S, T) additive f32 or NULL.
 * Keys whose mask value is <= -FLT_MAX get the mask value itself without their products being
 * computed. topk (B, S, K) i64 or NULL: the keys of the K largest scores of each row (ties to the
 * lower key, the set lunar_topk selects) in increasing key order (attention needs the set, not
 * an order); scores may be NULL when topk is given. */
lunar_status lunar_index_scores(lunar_ctx *ctx, lunar_tensor *scores, lunar_tensor *topk, const lunar_tensor *qi,
                                const lunar_tensor *ki, const lunar_tensor *w, const lunar_tensor *mask, float scale);

/* ---- KDA: GLM-5.3-Flash's linear attention --------------------------------------------------- */

/* The gated delta rule of KDA, per segment s (rows seg[s] .. seg[s+1]-1 of the N token rows: a
 * document or a batch row) and head h, the state S (Dk, Dv) starting at state0[s, h] (zeros when
 * state0 is NULL):
 *   S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
 *   q, k, g (N, H, Dk); v, o (N, H, Dv); beta (N, H); seg (nseg + 1) index offsets rising from 0
 *   to N; state0, state (nseg, H, Dk, Dv) or NULL: each segment's state before and after.
 * g is a log decay (g <= 0: exp(g) <= 1). f32 math, f32 outputs (other float inputs are
 * converted). Computed chunk-wise in the WY form (kernels/cpu/kda.c), one (segment, head) at a
 * time, so its bits do not depend on the other segments. */
lunar_status lunar_kda_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                               const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                               const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0);
/* The gradients of sum(dout . o) + sum(dstate . state) (dstate NULL: 0): dq, dk, dg (N, H, Dk),
 * dv (N, H, Dv), dbeta (N, H) and dstate0 (nseg, H, Dk, Dv; NULL: not wanted) written (not
 * accumulated). */
lunar_status lunar_kda_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv, lunar_tensor *dg,
                                lunar_tensor *dbeta, lunar_tensor *dstate0, const lunar_tensor *dout,
                                const lunar_tensor *dstate, const lunar_tensor *q, const lunar_tensor *k,
                                const lunar_tensor *v, const lunar_tensor *g, const lunar_tensor *beta,
                                const lunar_tensor *seg, const lunar_tensor *state0);
/* Depthwise causal convolution over the rows of each segment (KDA's short conv, no bias):
 *   y[t, c] = sum_{j < K} w[c, j] x[t - K + 1 + j, c]
 * where a row before its segment's first is the segment's history hist[s, K - 1 - (first - row),
 * c] (the last K - 1 inputs before it: a cache's conv state), or 0 when hist is NULL.
 *   x, y (N, C); w (C, K); seg (nseg + 1) as for KDA; hist (nseg, K - 1, C) or NULL. f32. */
lunar_status lunar_conv1d_causal_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *w,
                                         const lunar_tensor *seg, const lunar_tensor *hist);
/* dx (N, C) written; dw (C, K) accumulated (+=), NULL: not wanted. No gradient of hist. */
lunar_status lunar_conv1d_causal_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dw, const lunar_tensor *dy,
                                          const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *seg,
                                          const lunar_tensor *hist);

/* One decode step of the short conv for B sequences, each from and back to its slot of a cache's
 * conv state: y[b, c] = sum_{j < K - 1} w[c, j] hist[slots[b], j, c] + w[c, K - 1] x[b, c] (the
 * order conv1d_causal sums a one-row segment in: the same bits), then hist[slots[b]] drops its
 * oldest row and takes x[b] as its newest.
 *   x, y (B, C); w (C, K); hist (slots, K - 1, C), updated in place (NULL when K = 1); slots (B)
 *   i64, distinct (checked on the CPU). f32. */
lunar_status lunar_conv1d_step(lunar_ctx *ctx, lunar_tensor *y, lunar_tensor *hist, const lunar_tensor *x,
                               const lunar_tensor *w, const lunar_tensor *slots);
/* One token of the gated delta rule for B sequences, each from and back to its slot of a cache's
 * state (lunar_kda_forward's recurrence, token by token):
 *   S = state[slots[b], h]: S <- diag(exp(g)) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
 *   q, k, g (B, H, Dk); v, o (B, H, Dv), Dv <= LUNAR_KDA_STEP_MAX_DV; beta (B, H); state (slots, H,
 *   Dk, Dv) updated in place; slots (B) i64, distinct (checked on the CPU). f32; each (sequence,
 *   head) computed on its own in a fixed order. */
#define LUNAR_KDA_STEP_MAX_DV 1024
lunar_status lunar_kda_step(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                            const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                            const lunar_tensor *beta, const lunar_tensor *slots);

/* ---- mHC: hyper-connection residual streams (GLM-5.3-Flash) ------------------------------- */

/* The weights of one hyper-connection site per row, from its pre-activations
 * z (N, (2 + n) n) = [pre n | post n | comb n x n]:
 *   pre = sigmoid(z_pre) + eps;  post = 2 sigmoid(z_post);
 *   comb = softmax over the last dim of z_comb (n, n), + eps, then Sinkhorn: a column division
 *   (x / (sum over the row index + eps)), then iters - 1 times a row division and a column one.
 * pre, post (N, n); comb (N, n, n); 1 <= n <= 64, iters >= 1. f32. */
lunar_status lunar_hc_weights(lunar_ctx *ctx, lunar_tensor *pre, lunar_tensor *post, lunar_tensor *comb,
                              const lunar_tensor *z, int64_t n, int iters, float eps);
/* dz (N, (2 + n) n) written: the gradient through every division and the softmax. */
lunar_status lunar_hc_weights_backward(lunar_ctx *ctx, lunar_tensor *dz, const lunar_tensor *dpre,
                                       const lunar_tensor *dpost, const lunar_tensor *dcomb, const lunar_tensor *z,
                                       int64_t n, int iters, float eps);
/* A site's write: y[r, i] = post[r, i] a[r] + sum_j comb[r, j, i] x[r, j].
 *   x, y (N, n, H) streams; a (N, H) the block's output; post (N, n); comb (N, n, n). f32. */
lunar_status lunar_hc_mix(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *a,
                          const lunar_tensor *post, const lunar_tensor *comb);
/* dx, da, dpost, dcomb written. */
lunar_status lunar_hc_mix_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *da, lunar_tensor *dpost,
                                   lunar_tensor *dcomb, const lunar_tensor *dy, const lunar_tensor *x,
                                   const lunar_tensor *a, const lunar_tensor *post, const lunar_tensor *comb);
/* A site's read: u[r] = sum_j pre[r, j] x[r, j]; x (N, n, H), pre (N, n), u (N, H). f32. */
lunar_status lunar_hc_collapse(lunar_ctx *ctx, lunar_tensor *u, const lunar_tensor *x, const lunar_tensor *pre);
/* dx (N, n, H) accumulated (+=: the streams also feed the site's norm and mix); dpre written. */
lunar_status lunar_hc_collapse_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dpre, const lunar_tensor *du,
                                        const lunar_tensor *x, const lunar_tensor *pre);

/* ---- optimizer ---------------------------------------------------------------------------- */

typedef struct lunar_adamw_hparams {
    double  lr, beta1, beta2, eps, weight_decay;
    int64_t step;        /* 1-based step number, for bias correction */
    double  grad_scale;  /* grad is multiplied by this first (1 = none; e.g. 1/clip factor) */
} lunar_adamw_hparams;

/* One AdamW step (torch.optim.AdamW semantics, decoupled weight decay). m, v, master are f32.
 * If master is non-NULL it is the f32 copy that is updated and param receives its rounding
 * (bf16 params with f32 master weights); otherwise param itself must be f32. */
lunar_status lunar_adamw_step(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master,
                              lunar_tensor *m, lunar_tensor *v, const lunar_tensor *grad,
                              const lunar_adamw_hparams *hp);

/* ---- FP8 ---------------------------------------------------------------------------------- */

/* Block dequantisation of DeepSeek / GLM-5 FP8 checkpoints:
 *   out[i, j] = f32(q[i, j]) * scale_inv[i / block_m, j / block_n]
 * computed in f32, then rounded to out's float dtype (edge blocks are partial).
 *   q (M, N) f8e4m3 or f8e5m2, scale_inv (ceil(M / block_m), ceil(N / block_n)) float,
 *   out (M, N) float. Wrong shapes are errors naming both q and scale_inv. */
lunar_status lunar_fp8_block_dequant(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *q,
                                     const lunar_tensor *scale_inv, int64_t block_m, int64_t block_n);

#ifdef __cplusplus
}
#endif

#endif
