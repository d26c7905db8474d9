// backend_cuda.cu: the CUDA backend table, device state and memory functions.
//
// A machine without a driver (the development machines) reports 0 devices rather than an
// error, so lunar runs there on CPU. The runtime's reason is kept (a missing driver, one too old
// for this runtime, no device) and every message that says CUDA is not available gives it:
// "device cuda:0 not available (0 cuda devices found; CUDA is not available: cudaGetDeviceCount:
// CUDA driver version is insufficient for CUDA runtime version (cudaErrorInsufficientDriver))".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "range_error.cuh"

static lunar_cuda_state *cuda_state(lunar_ctx *ctx) {
    lunar_cuda_state *s = (lunar_cuda_state *)lunar_ctx_backend_state(ctx, LUNAR_DEVICE_CUDA);
    if (!s) {
        s = (lunar_cuda_state *)calloc(1, sizeof *s);
        if (!s) return NULL;
        s->count = -1;
        lunar_ctx_set_backend_state(ctx, LUNAR_DEVICE_CUDA, s);
    }
    return s;
}

static lunar_status cuda_device_count(lunar_ctx *ctx, int *count) {
    lunar_cuda_state *s = cuda_state(ctx);
    if (!s) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "cuda: out of host memory");
    if (s->count < 0) {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess) {   // no driver, a driver too old for this runtime, no device, ...
            n = 0;
            snprintf(s->count_error, sizeof s->count_error, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e),
                     cudaGetErrorName(e));
        }
        cudaGetLastError();       // clear the sticky error
        s->count = n > LUNAR_MAX_CUDA_DEVICES ? LUNAR_MAX_CUDA_DEVICES : n;
    }
    *count = s->count;
    return LUNAR_OK;
}

static const char *cuda_device_count_error(lunar_ctx *ctx) {
    lunar_cuda_state *s = cuda_state(ctx);
    return s ? s->count_error : "";
}

// Releases what device_init created (the device is current); safe on a partial init.
static void device_destroy(lunar_cuda_device *d) {
    if (d->stream) cudaStreamSynchronize(d->stream);
    if (d->cublas) cublasDestroy(d->cublas);
    if (d->cublaslt) cublasLtDestroy(d->cublaslt);
    if (d->workspace) cudaFree(d->workspace);
    lunar_cuda_range_free(d);
    if (d->stream) cudaStreamDestroy(d->stream);
    memset(d, 0, sizeof *d);
}

static lunar_status device_init(lunar_ctx *ctx, lunar_cuda_device *d) {
    LUNAR_CUDA_CHECK(ctx, cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking));
    LUNAR_CUBLAS_CHECK(ctx, cublasCreate(&d->cublas));
    LUNAR_CUBLAS_CHECK(ctx, cublasSetStream(d->cublas, d->stream));
    LUNAR_CUBLAS_CHECK(ctx, cublasLtCreate(&d->cublaslt));
    d->workspace_bytes = 32u << 20;
    LUNAR_CUDA_CHECK(ctx, cudaMalloc(&d->workspace, d->workspace_bytes));
    LUNAR_CUBLAS_CHECK(ctx, cublasSetWorkspace(d->cublas, d->workspace, d->workspace_bytes));
    return lunar_cuda_range_init(ctx, d);
}

extern "C" lunar_status lunar_cuda_device_get(lunar_ctx *ctx, int device, lunar_cuda_device **out) {
    int count = 0;
    lunar_status st = cuda_device_count(ctx, &count);
    if (st != LUNAR_OK) return st;
    if (device < 0 || device >= count) {
        const char *why = cuda_state(ctx)->count_error;
        return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "device cuda:%d not available (%d cuda devices found%s%s)", device,
                          count, *why ? "; CUDA is not available: " : "", why);
    }
    lunar_cuda_device *d = &cuda_state(ctx)->dev[device];
    LUNAR_CUDA_CHECK(ctx, cudaSetDevice(device));
    if (!d->ready) {
        st = device_init(ctx, d);
        if (st != LUNAR_OK) {
            device_destroy(d);   // a later call starts again from nothing instead of leaking
            return st;
        }
        d->ready = 1;
    }
    *out = d;
    return LUNAR_OK;
}

static lunar_status cuda_alloc(lunar_ctx *ctx, int device, size_t nbytes, void **out) {
    lunar_cuda_device *d;
    lunar_status st = lunar_cuda_device_get(ctx, device, &d);
    if (st != LUNAR_OK) return st;
    cudaError_t e = cudaMalloc(out, nbytes ? nbytes : 256);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total_b);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "cuda:%d: cannot allocate %zu bytes (%zu of %zu bytes free): %s", device,
                          nbytes, free_b, total_b, cudaGetErrorString(e));
    }
    return LUNAR_OK;
}

static void cuda_free(lunar_ctx *ctx, int device, void *ptr) {
    (void)ctx;
    cudaSetDevice(device);
    cudaFree(ptr);   // synchronises the device, so no kernel still uses the block
}

// A copy between host and device memory on the device's stream, finished before it returns:
// the host side may be a stack buffer or be reused as soon as the call is over.
static lunar_status copy_sync(lunar_ctx *ctx, int device, void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
    lunar_cuda_device *d;
    lunar_status st = lunar_cuda_device_get(ctx, device, &d);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, n, kind, d->stream));
    LUNAR_CUDA_CHECK(ctx, cudaStreamSynchronize(d->stream));
    return LUNAR_OK;
}

static lunar_status cuda_copy_to_host(lunar_ctx *ctx, int device, void *dst, const void *src, size_t n) {
    return copy_sync(ctx, device, dst, src, n, cudaMemcpyDeviceToHost);
}

static lunar_status cuda_copy_from_host(lunar_ctx *ctx, int device, void *dst, const void *src, size_t n) {
    return copy_sync(ctx, device, dst, src, n, cudaMemcpyHostToDevice);
}

static lunar_status cuda_synchronize(lunar_ctx *ctx, int device) {
    lunar_cuda_device *d;
    lunar_status st = lunar_cuda_device_get(ctx, device, &d);
    if (st != LUNAR_OK) return st;
    LUNAR_CUDA_CHECK(ctx, cudaStreamSynchronize(d->stream));
    return LUNAR_OK;
}

static void cuda_shutdown(lunar_ctx *ctx) {
    lunar_cuda_state *s = (lunar_cuda_state *)lunar_ctx_backend_state(ctx, LUNAR_DEVICE_CUDA);
    if (!s) return;
    for (int i = 0; i < LUNAR_MAX_CUDA_DEVICES; i++) {
        lunar_cuda_device *d = &s->dev[i];
        if (!d->ready) continue;
        cudaSetDevice(i);
        device_destroy(d);
    }
    free(s);
    lunar_ctx_set_backend_state(ctx, LUNAR_DEVICE_CUDA, NULL);
}

static lunar_backend make_cuda_backend(void) {
    lunar_backend b;
    memset(&b, 0, sizeof b);
    b.name = "cuda";
    b.device_type = LUNAR_DEVICE_CUDA;
    b.float_dtypes = (1u << LUNAR_DTYPE_F32) | (1u << LUNAR_DTYPE_BF16) | (1u << LUNAR_DTYPE_F16);
    b.device_count = cuda_device_count;
    b.device_count_error = cuda_device_count_error;
    b.alloc = cuda_alloc;
    b.free = cuda_free;
    b.copy_to_host = cuda_copy_to_host;
    b.copy_from_host = cuda_copy_from_host;
    b.synchronize = cuda_synchronize;
    b.take_range_error = lunar_cuda_take_range_error;
    b.shutdown = cuda_shutdown;
    b.copy = lunar_cuda_copy;
    b.fill = lunar_cuda_fill;
    b.arange = lunar_cuda_arange;
    b.rng_fill = lunar_cuda_rng_fill;
    b.gemm = lunar_cuda_gemm;
    b.gemm_row_invariant = lunar_cuda_gemm_row_invariant;
    b.binary = lunar_cuda_binary;
    b.binary_scalar = lunar_cuda_binary_scalar;
    b.unary = lunar_cuda_unary;
    b.unary_backward = lunar_cuda_unary_backward;
    b.swiglu_forward = lunar_cuda_swiglu_forward;
    b.swiglu_backward = lunar_cuda_swiglu_backward;
    b.masked_fill = lunar_cuda_masked_fill;
    b.reduce = lunar_cuda_reduce;
    b.reduce_backward = lunar_cuda_reduce_backward;
    b.max_dim = lunar_cuda_max_dim;
    b.cumsum = lunar_cuda_cumsum;
    b.global_norm = lunar_cuda_global_norm;
    b.softmax_forward = lunar_cuda_softmax_forward;
    b.softmax_backward = lunar_cuda_softmax_backward;
    b.cross_entropy_forward = lunar_cuda_cross_entropy_forward;
    b.cross_entropy_backward = lunar_cuda_cross_entropy_backward;
    b.entropy_forward = lunar_cuda_entropy_forward;
    b.rmsnorm_forward = lunar_cuda_rmsnorm_forward;
    b.rmsnorm_backward_input = lunar_cuda_rmsnorm_backward_input;
    b.rmsnorm_backward_params = lunar_cuda_rmsnorm_backward_params;
    b.layernorm_forward = lunar_cuda_layernorm_forward;
    b.layernorm_backward_input = lunar_cuda_layernorm_backward_input;
    b.layernorm_backward_params = lunar_cuda_layernorm_backward_params;
    b.rope = lunar_cuda_rope;
    b.embedding_forward = lunar_cuda_embedding_forward;
    b.embedding_backward = lunar_cuda_embedding_backward;
    b.index_select = lunar_cuda_index_select;
    b.index_add = lunar_cuda_index_add;
    b.gather = lunar_cuda_gather;
    b.scatter = lunar_cuda_scatter;
    b.index_select_sum = lunar_cuda_index_select_sum;
    b.bincount = lunar_cuda_bincount;
    b.topk = lunar_cuda_topk;
    b.argsort = lunar_cuda_argsort;
    b.causal_mask = lunar_cuda_causal_mask;
    b.block_mask = lunar_cuda_block_mask;
    b.attention_forward = lunar_cuda_attention_forward;
    b.attention_backward = lunar_cuda_attention_backward;
    b.index_scores = lunar_cuda_index_scores;
    b.attention_paged = lunar_cuda_attention_paged;
    b.adamw_step = lunar_cuda_adamw_step;
    b.fp8_block_dequant = lunar_cuda_fp8_block_dequant;
    b.kda_forward = lunar_cuda_kda_forward;
    b.kda_backward = lunar_cuda_kda_backward;
    b.kda_step = lunar_cuda_kda_step;
    b.conv1d_causal_forward = lunar_cuda_conv1d_causal_forward;
    b.conv1d_causal_backward = lunar_cuda_conv1d_causal_backward;
    b.conv1d_step = lunar_cuda_conv1d_step;
    b.hc_weights = lunar_cuda_hc_weights;
    b.hc_weights_backward = lunar_cuda_hc_weights_backward;
    b.hc_mix = lunar_cuda_hc_mix;
    b.hc_mix_backward = lunar_cuda_hc_mix_backward;
    b.hc_collapse = lunar_cuda_hc_collapse;
    b.hc_collapse_backward = lunar_cuda_hc_collapse_backward;
    return b;
}

static const lunar_backend cuda_backend = make_cuda_backend();

extern "C" const lunar_backend *lunar_backend_cuda(void) { return &cuda_backend; }
