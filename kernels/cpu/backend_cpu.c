/* backend_cpu.c: the CPU backend table and its memory functions. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* cpu:0, plus the debug devices of LUNAR_FAKE_CPU_DEVICES (ctx.h): the same memory and kernels */
static lunar_status cpu_device_count(lunar_ctx *ctx, int *count) {
    *count = lunar_ctx_cpu_device_count(ctx);
    return LUNAR_OK;
}

static lunar_status cpu_alloc(lunar_ctx *ctx, int device, size_t nbytes, void **out) {
    (void)device;
    void *p = NULL;
    size_t n = (nbytes + 63) & ~(size_t)63;
    if (n == 0) n = 64;
    if (posix_memalign(&p, 64, n) != 0 || !p)
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "cpu: cannot allocate %zu bytes", nbytes);
    *out = p;
    return LUNAR_OK;
}

static void cpu_free(lunar_ctx *ctx, int device, void *ptr) {
    (void)ctx;
    (void)device;
    free(ptr);
}

static lunar_status cpu_memcpy(lunar_ctx *ctx, int device, void *dst, const void *src, size_t n) {
    (void)ctx;
    (void)device;
    memcpy(dst, src, n);
    return LUNAR_OK;
}

static lunar_status cpu_synchronize(lunar_ctx *ctx, int device) {
    (void)ctx;
    (void)device;
    return LUNAR_OK;
}

static const lunar_backend cpu_backend = {
    .name = "cpu",
    .device_type = LUNAR_DEVICE_CPU,
    .float_dtypes = 1u << LUNAR_DTYPE_F32,
    .int_reduce = 1,
    .device_count = cpu_device_count,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_to_host = cpu_memcpy,
    .copy_from_host = cpu_memcpy,
    .synchronize = cpu_synchronize,
    .copy = lunar_cpu_copy,
    .fill = lunar_cpu_fill,
    .arange = lunar_cpu_arange,
    .rng_fill = lunar_cpu_rng_fill,
    .gemm = lunar_cpu_gemm,
    .gemm_grouped = lunar_cpu_gemm_grouped,
    .gemm_row_invariant = lunar_cpu_gemm_row_invariant,
    .binary = lunar_cpu_binary,
    .binary_scalar = lunar_cpu_binary_scalar,
    .unary = lunar_cpu_unary,
    .unary_backward = lunar_cpu_unary_backward,
    .swiglu_forward = lunar_cpu_swiglu_forward,
    .swiglu_backward = lunar_cpu_swiglu_backward,
    .masked_fill = lunar_cpu_masked_fill,
    .reduce = lunar_cpu_reduce,
    .reduce_backward = lunar_cpu_reduce_backward,
    .max_dim = lunar_cpu_max_dim,
    .cumsum = lunar_cpu_cumsum,
    .global_norm = lunar_cpu_global_norm,
    .softmax_forward = lunar_cpu_softmax_forward,
    .softmax_backward = lunar_cpu_softmax_backward,
    .cross_entropy_forward = lunar_cpu_cross_entropy_forward,
    .cross_entropy_backward = lunar_cpu_cross_entropy_backward,
    .entropy_forward = lunar_cpu_entropy_forward,
    .sample_rows = lunar_cpu_sample_rows,
    .rmsnorm_forward = lunar_cpu_rmsnorm_forward,
    .rmsnorm_backward_input = lunar_cpu_rmsnorm_backward_input,
    .rmsnorm_backward_params = lunar_cpu_rmsnorm_backward_params,
    .layernorm_forward = lunar_cpu_layernorm_forward,
    .layernorm_backward_input = lunar_cpu_layernorm_backward_input,
    .layernorm_backward_params = lunar_cpu_layernorm_backward_params,
    .rope = lunar_cpu_rope,
    .embedding_forward = lunar_cpu_embedding_forward,
    .embedding_backward = lunar_cpu_embedding_backward,
    .index_select = lunar_cpu_index_select,
    .index_add = lunar_cpu_index_add,
    .gather = lunar_cpu_gather,
    .scatter = lunar_cpu_scatter,
    .index_select_sum = lunar_cpu_index_select_sum,
    .bincount = lunar_cpu_bincount,
    .topk = lunar_cpu_topk,
    .argsort = lunar_cpu_argsort,
    .causal_mask = lunar_cpu_causal_mask,
    .block_mask = lunar_cpu_block_mask,
    .attention_forward = lunar_cpu_attention_forward,
    .attention_backward = lunar_cpu_attention_backward,
    .index_scores = lunar_cpu_index_scores,
    .attention_paged = lunar_cpu_attention_paged,
    .kda_forward = lunar_cpu_kda_forward,
    .kda_backward = lunar_cpu_kda_backward,
    .conv1d_causal_forward = lunar_cpu_conv1d_causal_forward,
    .conv1d_causal_backward = lunar_cpu_conv1d_causal_backward,
    .conv1d_step = lunar_cpu_conv1d_step,
    .kda_step = lunar_cpu_kda_step,
    .hc_weights = lunar_cpu_hc_weights,
    .hc_weights_backward = lunar_cpu_hc_weights_backward,
    .hc_mix = lunar_cpu_hc_mix,
    .hc_mix_backward = lunar_cpu_hc_mix_backward,
    .hc_collapse = lunar_cpu_hc_collapse,
    .hc_collapse_backward = lunar_cpu_hc_collapse_backward,
    .adamw_step = lunar_cpu_adamw_step,
    .fp8_block_dequant = lunar_cpu_fp8_block_dequant,
};

const lunar_backend *lunar_backend_cpu(void) { return &cpu_backend; }
