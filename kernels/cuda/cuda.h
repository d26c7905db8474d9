/* cuda.h: the CUDA kernels behind lunar_backend_cuda() (see lunar/backend.h for the contract:
 * contiguous tensors, f32/bf16/f16 floats, i64 indices, shapes already checked). One family per
 * .cu file, each a set of kernels plus the launchers declared here. Plain C declarations, so the
 * C host and nvcc both read this header. */
#ifndef LUNAR_KERNELS_CUDA_H
#define LUNAR_KERNELS_CUDA_H

#include "lunar/backend.h"

#ifdef __cplusplus
extern "C" {
#endif


/* copy.cu */
lunar_status lunar_cuda_copy(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src, int saturate);
lunar_status lunar_cuda_fill(lunar_ctx *ctx, lunar_tensor *t, double value);
lunar_status lunar_cuda_arange(lunar_ctx *ctx, lunar_tensor *t, double start, double step);
lunar_status lunar_cuda_rng_fill(lunar_ctx *ctx, lunar_tensor *out, lunar_rng_kind kind, uint64_t key,
                                uint64_t counter, double a, double b, double top);

/* gemm.cu */
lunar_status lunar_cuda_gemm(lunar_ctx *ctx, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                            int trans_a, int trans_b, float alpha, float beta);

/* gemm_row_invariant.cu */
lunar_status lunar_cuda_gemm_row_invariant(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                           const lunar_tensor *const *b, int trans_b, float alpha, float beta);

/* elementwise.cu */
lunar_status lunar_cuda_binary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, const lunar_tensor *b,
                              lunar_binary_op op);
lunar_status lunar_cuda_binary_scalar(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, double s,
                                     lunar_binary_op op);
lunar_status lunar_cuda_unary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, lunar_unary_op op);
lunar_status lunar_cuda_unary_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *x,
                                      lunar_unary_op op);
lunar_status lunar_cuda_swiglu_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *gate,
                                      const lunar_tensor *up);
lunar_status lunar_cuda_swiglu_backward(lunar_ctx *ctx, lunar_tensor *dgate, lunar_tensor *dup,
                                       const lunar_tensor *dout, const lunar_tensor *gate, const lunar_tensor *up);
lunar_status lunar_cuda_masked_fill(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, const lunar_tensor *mask,
                                   double value);

/* reduce.cu */
lunar_status lunar_cuda_reduce(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer, int64_t n,
                              int64_t inner, lunar_reduce_op op);
lunar_status lunar_cuda_reduce_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *x,
                                       const lunar_tensor *y, int64_t outer, int64_t n, int64_t inner,
                                       lunar_reduce_op op);
lunar_status lunar_cuda_max_dim(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                               int64_t outer, int64_t n, int64_t inner);
lunar_status lunar_cuda_cumsum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, int64_t outer, int64_t n,
                              int64_t inner, int reverse);
lunar_status lunar_cuda_global_norm(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *const *ts, int n);

/* softmax.cu */
lunar_status lunar_cuda_softmax_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, int log);
lunar_status lunar_cuda_softmax_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *y,
                                        int log);
lunar_status lunar_cuda_cross_entropy_forward(lunar_ctx *ctx, lunar_tensor *loss, lunar_tensor *logprobs,
                                             lunar_tensor *lse, const lunar_tensor *logits,
                                             const lunar_tensor *targets, int64_t ignore_index);
lunar_status lunar_cuda_cross_entropy_backward(lunar_ctx *ctx, lunar_tensor *dlogits, const lunar_tensor *dloss,
                                              const lunar_tensor *logits, const lunar_tensor *lse,
                                              const lunar_tensor *targets, int64_t ignore_index);
lunar_status lunar_cuda_entropy_forward(lunar_ctx *ctx, lunar_tensor *entropy, const lunar_tensor *logits,
                                        const lunar_tensor *lse);

/* norm.cu */
lunar_status lunar_cuda_rmsnorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *rstd, const lunar_tensor *x,
                                       const lunar_tensor *w, float eps);
lunar_status lunar_cuda_rmsnorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                              const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *rstd);
lunar_status lunar_cuda_rmsnorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, const lunar_tensor *dout,
                                               const lunar_tensor *x, const lunar_tensor *rstd);
lunar_status lunar_cuda_layernorm_forward(lunar_ctx *ctx, lunar_tensor *out, lunar_tensor *mean, lunar_tensor *rstd,
                                         const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *b, float eps);
lunar_status lunar_cuda_layernorm_backward_input(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dout,
                                                const lunar_tensor *x, const lunar_tensor *w, const lunar_tensor *mean,
                                                const lunar_tensor *rstd);
lunar_status lunar_cuda_layernorm_backward_params(lunar_ctx *ctx, lunar_tensor *dw, lunar_tensor *db,
                                                 const lunar_tensor *dout, const lunar_tensor *x,
                                                 const lunar_tensor *mean, const lunar_tensor *rstd);

/* rope.cu */
lunar_status lunar_cuda_rope(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, const lunar_tensor *positions,
                            const lunar_tensor *inv_freq, lunar_rope_layout layout, float scale, int inverse);

/* index.cu */
lunar_status lunar_cuda_embedding_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *ids,
                                         const lunar_tensor *weight);
lunar_status lunar_cuda_embedding_backward(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout,
                                          const lunar_tensor *ids);
lunar_status lunar_cuda_index_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                    const lunar_tensor *index, int64_t outer, int64_t n_src, int64_t inner);
lunar_status lunar_cuda_gather(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, const lunar_tensor *index,
                              int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner);

/* index_accumulate.cu */
lunar_status lunar_cuda_index_add(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index, const lunar_tensor *src,
                                 double alpha, int64_t outer, int64_t n_dst, int64_t inner);
lunar_status lunar_cuda_scatter(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index, const lunar_tensor *src,
                               int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner, int accumulate);
lunar_status lunar_cuda_index_select_sum(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                        const lunar_tensor *index, int accumulate);
lunar_status lunar_cuda_bincount(lunar_ctx *ctx, lunar_tensor *counts, const lunar_tensor *values);

/* sort.cu */
lunar_status lunar_cuda_topk(lunar_ctx *ctx, lunar_tensor *values, lunar_tensor *indices, const lunar_tensor *x,
                            int64_t rows, int64_t n, int64_t k, int largest);
lunar_status lunar_cuda_argsort(lunar_ctx *ctx, lunar_tensor *indices, const lunar_tensor *x, int64_t rows, int64_t n,
                               int descending);

/* mask.cu */
lunar_status lunar_cuda_causal_mask(lunar_ctx *ctx, lunar_tensor *out, int64_t offset);
lunar_status lunar_cuda_block_mask(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *cu_seqlens, int causal);

/* attention.cu */
lunar_status lunar_cuda_attention_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *lse, const lunar_tensor *q,
                                          const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *keys,
                                          const lunar_tensor *mask, float scale);
lunar_status lunar_cuda_attention_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                           const lunar_tensor *dout, const lunar_tensor *o, const lunar_tensor *lse,
                                           const lunar_tensor *q, const lunar_tensor *k, const lunar_tensor *v,
                                           const lunar_tensor *keys, const lunar_tensor *mask, float scale);
lunar_status lunar_cuda_index_scores(lunar_ctx *ctx, lunar_tensor *scores, lunar_tensor *topk, const lunar_tensor *qi,
                                     const lunar_tensor *ki, const lunar_tensor *w, const lunar_tensor *mask,
                                     float scale);

/* attention_paged.cu */
lunar_status lunar_cuda_attention_paged(lunar_ctx *ctx, lunar_tensor *o, const lunar_tensor *q, const lunar_tensor *k,
                                        const lunar_tensor *v, const lunar_tensor *table, const lunar_tensor *lengths,
                                        const lunar_tensor *keys, int64_t block_size, float scale);

/* adamw.cu */
lunar_status lunar_cuda_adamw_step(lunar_ctx *ctx, lunar_tensor *param, lunar_tensor *master, lunar_tensor *m,
                                  lunar_tensor *v, const lunar_tensor *grad, const lunar_adamw_hparams *hp);

/* fp8.cu */
lunar_status lunar_cuda_fp8_block_dequant(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *q,
                                          const lunar_tensor *scale_inv, int64_t block_m, int64_t block_n);

/* kda.cu */
lunar_status lunar_cuda_kda_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                                    const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                    const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0);
lunar_status lunar_cuda_kda_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                     lunar_tensor *dg, lunar_tensor *dbeta, lunar_tensor *dstate0,
                                     const lunar_tensor *dout, const lunar_tensor *dstate, const lunar_tensor *q,
                                     const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                     const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0);
lunar_status lunar_cuda_kda_step(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                                 const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                 const lunar_tensor *beta, const lunar_tensor *slots);
lunar_status lunar_cuda_conv1d_causal_forward(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x,
                                              const lunar_tensor *w, const lunar_tensor *seg, const lunar_tensor *hist);
lunar_status lunar_cuda_conv1d_causal_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dw,
                                               const lunar_tensor *dy, const lunar_tensor *x, const lunar_tensor *w,
                                               const lunar_tensor *seg, const lunar_tensor *hist);
lunar_status lunar_cuda_conv1d_step(lunar_ctx *ctx, lunar_tensor *y, lunar_tensor *hist, const lunar_tensor *x,
                                    const lunar_tensor *w, const lunar_tensor *slots);

/* hyper.cu */
lunar_status lunar_cuda_hc_weights(lunar_ctx *ctx, lunar_tensor *pre, lunar_tensor *post, lunar_tensor *comb,
                                   const lunar_tensor *z, int64_t n, int iters, float eps);
lunar_status lunar_cuda_hc_weights_backward(lunar_ctx *ctx, lunar_tensor *dz, const lunar_tensor *dpre,
                                            const lunar_tensor *dpost, const lunar_tensor *dcomb, const lunar_tensor *z,
                                            int64_t n, int iters, float eps);
lunar_status lunar_cuda_hc_mix(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *a,
                               const lunar_tensor *post, const lunar_tensor *comb);
lunar_status lunar_cuda_hc_mix_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *da, lunar_tensor *dpost,
                                        lunar_tensor *dcomb, const lunar_tensor *dy, const lunar_tensor *x,
                                        const lunar_tensor *a, const lunar_tensor *post, const lunar_tensor *comb);
lunar_status lunar_cuda_hc_collapse(lunar_ctx *ctx, lunar_tensor *u, const lunar_tensor *x, const lunar_tensor *pre);
lunar_status lunar_cuda_hc_collapse_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dpre,
                                             const lunar_tensor *du, const lunar_tensor *x, const lunar_tensor *pre);

#ifdef __cplusplus
}
#endif

#endif
