// gemm.cu: c = alpha * op(a) @ op(b) + beta * c through cuBLAS, f32 accumulation
// (CUBLAS_COMPUTE_32F) for f32, bf16 and f16 inputs; c has the inputs' dtype or f32.
//
// a, b, c are row-major views (unit stride in the last dim, leading dimension in
// stride[ndim-2]; see backend.h). cuBLAS is column-major, and a row-major (R, C) matrix with
// leading dimension ld is the column-major (C, R) matrix with the same ld, i.e. its transpose.
// So the row-major c = op(a) op(b) is computed as the column-major c^T = op(b)^T op(a)^T:
// cuBLAS gets b first, then a, with m = N, n = M and the same trans flags.
#include <limits.h>

#include "common.cuh"

static cudaDataType_t cublas_type(lunar_dtype dt) {
    switch (dt) {
    case LUNAR_DTYPE_BF16: return CUDA_R_16BF;
    case LUNAR_DTYPE_F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
    }
}

static int64_t batch_stride(const lunar_tensor *t) { return t->ndim == 3 ? t->stride[0] : 0; }
static int64_t lead_dim(const lunar_tensor *t) { return t->stride[t->ndim - 2]; }

extern "C" lunar_status lunar_cuda_gemm(lunar_ctx *ctx, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                                        int trans_a, int trans_b, float alpha, float beta) {
    lunar_cuda_device *d;
    lunar_status st = lunar_cuda_device_get(ctx, lunar_tensor_device(c).index, &d);
    if (st != LUNAR_OK) return st;

    int64_t batch = c->ndim == 3 ? c->shape[0] : 1;
    int64_t m = c->shape[c->ndim - 2], n = c->shape[c->ndim - 1];
    int64_t k = a->shape[a->ndim - 1 - trans_a];
    int64_t lda = lead_dim(a), ldb = lead_dim(b), ldc = lead_dim(c);
    long long sa = batch_stride(a), sb = batch_stride(b), sc = batch_stride(c);
    if (batch > 1 && sb == 0 && !trans_a && sa == m * lda && sc == m * ldc && batch * m <= INT_MAX) {
        // a's batches are stacked rows and b is shared: one (batch*M, K) @ (K, N) product (when
        // batch*M fits cuBLAS's int; the host checks each dim, not their product)
        m *= batch;
        batch = 1;
    }
    cublasOperation_t opa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, opb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cudaDataType_t in_type = cublas_type(a->dtype), c_type = cublas_type(c->dtype);
    if (batch == 1) {
        LUNAR_CUBLAS_CHECK(ctx, cublasGemmEx(d->cublas, opb, opa, (int)n, (int)m, (int)k, &alpha,
                                             lunar_tensor_data(b), in_type, (int)ldb, lunar_tensor_data(a), in_type,
                                             (int)lda, &beta, lunar_tensor_data(c), c_type, (int)ldc,
                                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else {
        LUNAR_CUBLAS_CHECK(ctx, cublasGemmStridedBatchedEx(d->cublas, opb, opa, (int)n, (int)m, (int)k, &alpha,
                                                           lunar_tensor_data(b), in_type, (int)ldb, sb,
                                                           lunar_tensor_data(a), in_type, (int)lda, sa, &beta,
                                                           lunar_tensor_data(c), c_type, (int)ldc, sc, (int)batch,
                                                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    return LUNAR_OK;
}
