/* gemm.c: c = alpha * op(a) @ op(b) + beta * c on the CPU through OpenBLAS (cblas_sgemm).
 *
 * a, b, c are f32 row-major views (unit stride in the last dim, leading dimension in
 * stride[ndim-2]; see backend.h), 2-D or batched 3-D. Batches run one cblas_sgemm each, except:
 *   - a 3-D a whose batches are stacked rows (batch stride = M * lda, no trans) times a shared
 *     2-D b is one (batch*M, K) @ (K, N) call, like a linear layer over tokens (when batch*M
 *     fits BLAS's int; the host checks each dim, not their product);
 *   - many small batches run in parallel, one OpenMP thread per matrix (OpenBLAS runs single
 *     threaded inside a parallel region), since a lone small sgemm cannot use the threads.
 * Every matrix is computed by the same sequence of BLAS calls regardless of the thread count
 * over batches, so results are deterministic.
 */
#include <cblas.h>
#include <limits.h>

#include "cpu.h"

/* products below this many multiply-adds per matrix go one thread per matrix */
#define GEMM_SMALL_MACS (64 * 64 * 64)

static int64_t batch_stride(const lunar_tensor *t) { return t->ndim == 3 ? t->stride[0] : 0; }
static int64_t lead_dim(const lunar_tensor *t) { return t->stride[t->ndim - 2]; }

lunar_status lunar_cpu_gemm(lunar_ctx *ctx, lunar_tensor *c, const lunar_tensor *a, const lunar_tensor *b,
                            int trans_a, int trans_b, float alpha, float beta) {
    int threads = lunar_ctx_threads(ctx);
    if (openblas_get_num_threads() != threads) openblas_set_num_threads(threads);

    int64_t batch = c->ndim == 3 ? c->shape[0] : 1;
    int64_t m = c->shape[c->ndim - 2], n = c->shape[c->ndim - 1];
    int64_t k = a->shape[a->ndim - 1 - trans_a];
    int64_t lda = lead_dim(a), ldb = lead_dim(b), ldc = lead_dim(c);
    int64_t sa = batch_stride(a), sb = batch_stride(b), sc = batch_stride(c);
    const float *pa = lunar_tensor_data(a), *pb = lunar_tensor_data(b);
    float *pc = lunar_tensor_data(c);
    enum CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;

    if (batch > 1 && sb == 0 && !trans_a && sa == m * lda && sc == m * ldc && batch * m <= INT_MAX) {
        /* stacked rows: one tall product */
        cblas_sgemm(CblasRowMajor, ta, tb, (int)(batch * m), (int)n, (int)k, alpha, pa, (int)lda, pb, (int)ldb, beta,
                    pc, (int)ldc);
        return LUNAR_OK;
    }
    /* ... but only when the whole batch is worth a parallel region (tiny attention products
     * would otherwise pay an OpenMP fork/join, which stalls on a busy machine) */
    if (batch > 1 && threads > 1 && m * n * k < GEMM_SMALL_MACS && batch * m * n * k >= LUNAR_CPU_PAR_MIN) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < batch; i++)
            cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, pa + i * sa, (int)lda, pb + i * sb,
                        (int)ldb, beta, pc + i * sc, (int)ldc);
        return LUNAR_OK;
    }
    for (int64_t i = 0; i < batch; i++)
        cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, pa + i * sa, (int)lda, pb + i * sb, (int)ldb,
                    beta, pc + i * sc, (int)ldc);
    return LUNAR_OK;
}

/* Grouped 2-D products: moderately small ones (the experts of an MoE layer) run side by side,
 * one OpenMP thread each with single-threaded BLAS (one product split over two threads pays a
 * fork/join and halves its blocks); large ones go one at a time through the threaded gemm. Every
 * product is one BLAS call either way: the results do not depend on the threads. */
#define GROUP_SIDE_MAX_MACS (256LL * 1024 * 1024)
#define GROUP_SIDE_MIN_MACS (4LL * 1024 * 1024)   /* below this in all, a parallel region costs more */

lunar_status lunar_cpu_gemm_grouped(lunar_ctx *ctx, int n, lunar_tensor *const *c, const lunar_tensor *const *a,
                                    const lunar_tensor *const *b, const int *trans_a, const int *trans_b, float alpha,
                                    float beta) {
    int threads = lunar_ctx_threads(ctx);
    if (openblas_get_num_threads() != threads) openblas_set_num_threads(threads);
    int64_t max_macs = 0, total = 0;
    for (int i = 0; i < n; i++) {
        int64_t macs = c[i]->shape[0] * c[i]->shape[1] * a[i]->shape[1 - trans_a[i]];
        max_macs = macs > max_macs ? macs : max_macs;
        total += macs;
    }
    if (threads > 1 && n > 1 && max_macs <= GROUP_SIDE_MAX_MACS && total >= GROUP_SIDE_MIN_MACS) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int i = 0; i < n; i++) {
            cblas_sgemm(CblasRowMajor, trans_a[i] ? CblasTrans : CblasNoTrans, trans_b[i] ? CblasTrans : CblasNoTrans,
                        (int)c[i]->shape[0], (int)c[i]->shape[1], (int)a[i]->shape[1 - trans_a[i]], alpha,
                        lunar_tensor_data(a[i]), (int)lead_dim(a[i]), lunar_tensor_data(b[i]), (int)lead_dim(b[i]),
                        beta, lunar_tensor_data(c[i]), (int)lead_dim(c[i]));
        }
        return LUNAR_OK;
    }
    for (int i = 0; i < n; i++) LUNAR_TRY(lunar_cpu_gemm(ctx, c[i], a[i], b[i], trans_a[i], trans_b[i], alpha, beta));
    return LUNAR_OK;
}
