/* hyper.c: mHC (manifold-constrained hyper-connections, GLM-5.3-Flash's residual streams) on the
 * CPU, f32 (contracts in lunar/ops.h: lunar_hc_weights, lunar_hc_mix, lunar_hc_collapse and
 * their backwards).
 *
 * Every op is per token row and independent of the other rows; threads split the rows. The
 * weights (the softmax and the Sinkhorn divisions) are computed in f64 and rounded once: the
 * gradients of the tiny mHC scales and bases sum many cancelling terms, which f32 rounding along
 * 2 iters - 1 divisions would blur. The Sinkhorn backward rebuilds the iterations of its row from
 * the softmax (2 iters matrices of n x n per row in the thread's scratch), so the forward keeps
 * nothing but its outputs.
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"
#include "hyper_math.h"

lunar_status lunar_cpu_hc_weights(lunar_ctx *ctx, lunar_tensor *pre, lunar_tensor *post, lunar_tensor *comb,
                                  const lunar_tensor *z, int64_t n, int iters, float eps) {
    (void)ctx;
    int64_t N = z->shape[0], M = z->shape[1], nn = n * n;
    const float *zp = lunar_tensor_data(z);
    float *pp = lunar_tensor_data(pre), *qp = lunar_tensor_data(post), *cp = lunar_tensor_data(comb);
    int steps = 2 * iters - 1;
#pragma omp parallel for schedule(static) if (N * nn * steps >= LUNAR_CPU_PAR_MIN && N > 1)
    for (int64_t r = 0; r < N; r++) {
        double c[64 * 64], den[64];
        lunar_hc_weights_row(pp + r * n, qp + r * n, cp + r * nn, zp + r * M, c, den, n, steps, eps);
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_hc_weights_backward(lunar_ctx *ctx, lunar_tensor *dz, const lunar_tensor *dpre,
                                           const lunar_tensor *dpost, const lunar_tensor *dcomb, const lunar_tensor *z,
                                           int64_t n, int iters, float eps) {
    int64_t N = z->shape[0], M = z->shape[1], nn = n * n;
    int steps = 2 * iters - 1;
    const float *zp = lunar_tensor_data(z), *gpre = lunar_tensor_data(dpre), *gpost = lunar_tensor_data(dpost);
    const float *gcomb = lunar_tensor_data(dcomb);
    float *gz = lunar_tensor_data(dz);
    int nt = lunar_ctx_threads(ctx);
    /* per thread: a row's scratch (hyper_math.h) */
    size_t wf = (size_t)lunar_hc_backward_scratch(n, steps);
    wf = (wf + 7) & ~(size_t)7;
    int64_t nbytes = (int64_t)(wf * sizeof(double)) * nt;
    lunar_tensor scratch = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    double *sb = lunar_tensor_data(&scratch);
#pragma omp parallel num_threads(nt) if (N * nn * steps >= LUNAR_CPU_PAR_MIN && N > 1)
    {
        double *mats = sb + wf * (size_t)omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < N; r++)
            lunar_hc_weights_backward_row(gz + r * M, gpre + r * n, gpost + r * n, gcomb + r * nn, zp + r * M, mats, n,
                                          steps, eps);
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}

lunar_status lunar_cpu_hc_mix(lunar_ctx *ctx, lunar_tensor *y, const lunar_tensor *x, const lunar_tensor *a,
                              const lunar_tensor *post, const lunar_tensor *comb) {
    (void)ctx;
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    const float *xp = lunar_tensor_data(x), *ap = lunar_tensor_data(a), *pp = lunar_tensor_data(post);
    const float *cp = lunar_tensor_data(comb);
    float *yp = lunar_tensor_data(y);
#pragma omp parallel for schedule(static) if (N * n * n * H >= LUNAR_CPU_PAR_MIN && N > 1)
    for (int64_t r = 0; r < N; r++) {
        const float *xr = xp + r * n * H, *ar = ap + r * H, *c = cp + r * n * n;
        for (int64_t i = 0; i < n; i++) {
            float *yi = yp + (r * n + i) * H;
            float p = pp[r * n + i];
            for (int64_t h = 0; h < H; h++) yi[h] = p * ar[h];
            for (int64_t j = 0; j < n; j++) {
                float cji = c[j * n + i];
                const float *xj = xr + j * H;
                for (int64_t h = 0; h < H; h++) yi[h] += cji * xj[h];
            }
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_hc_mix_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *da, lunar_tensor *dpost,
                                       lunar_tensor *dcomb, const lunar_tensor *dy, const lunar_tensor *x,
                                       const lunar_tensor *a, const lunar_tensor *post, const lunar_tensor *comb) {
    (void)ctx;
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    const float *xp = lunar_tensor_data(x), *ap = lunar_tensor_data(a), *pp = lunar_tensor_data(post);
    const float *cp = lunar_tensor_data(comb), *gy = lunar_tensor_data(dy);
    float *gx = lunar_tensor_data(dx), *ga = lunar_tensor_data(da), *gp = lunar_tensor_data(dpost);
    float *gc = lunar_tensor_data(dcomb);
#pragma omp parallel for schedule(static) if (N * n * n * H >= LUNAR_CPU_PAR_MIN && N > 1)
    for (int64_t r = 0; r < N; r++) {
        const float *xr = xp + r * n * H, *ar = ap + r * H, *c = cp + r * n * n, *gyr = gy + r * n * H;
        float *gar = ga + r * H, *gxr = gx + r * n * H;
        for (int64_t h = 0; h < H; h++) gar[h] = 0;
        for (int64_t i = 0; i < n; i++) {
            const float *gi = gyr + i * H;
            float p = pp[r * n + i], dp = 0;
            for (int64_t h = 0; h < H; h++) {
                gar[h] += p * gi[h];
                dp += gi[h] * ar[h];
            }
            gp[r * n + i] = dp;
        }
        for (int64_t j = 0; j < n; j++) {
            float *gj = gxr + j * H;
            const float *xj = xr + j * H;
            for (int64_t h = 0; h < H; h++) gj[h] = 0;
            for (int64_t i = 0; i < n; i++) {
                const float *gi = gyr + i * H;
                float cji = c[j * n + i], dc = 0;
                for (int64_t h = 0; h < H; h++) {
                    gj[h] += cji * gi[h];
                    dc += gi[h] * xj[h];
                }
                gc[r * n * n + j * n + i] = dc;
            }
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_hc_collapse(lunar_ctx *ctx, lunar_tensor *u, const lunar_tensor *x, const lunar_tensor *pre) {
    (void)ctx;
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    const float *xp = lunar_tensor_data(x), *pp = lunar_tensor_data(pre);
    float *up = lunar_tensor_data(u);
#pragma omp parallel for schedule(static) if (N * n * H >= LUNAR_CPU_PAR_MIN && N > 1)
    for (int64_t r = 0; r < N; r++) {
        float *ur = up + r * H;
        for (int64_t h = 0; h < H; h++) ur[h] = 0;
        for (int64_t j = 0; j < n; j++) {
            float p = pp[r * n + j];
            const float *xj = xp + (r * n + j) * H;
            for (int64_t h = 0; h < H; h++) ur[h] += p * xj[h];
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_hc_collapse_backward(lunar_ctx *ctx, lunar_tensor *dx, lunar_tensor *dpre,
                                            const lunar_tensor *du, const lunar_tensor *x, const lunar_tensor *pre) {
    (void)ctx;
    int64_t N = x->shape[0], n = x->shape[1], H = x->shape[2];
    const float *xp = lunar_tensor_data(x), *pp = lunar_tensor_data(pre), *gu = lunar_tensor_data(du);
    float *gx = lunar_tensor_data(dx), *gp = lunar_tensor_data(dpre);
#pragma omp parallel for schedule(static) if (N * n * H >= LUNAR_CPU_PAR_MIN && N > 1)
    for (int64_t r = 0; r < N; r++) {
        const float *gur = gu + r * H;
        for (int64_t j = 0; j < n; j++) {
            float p = pp[r * n + j], s = 0;
            const float *xj = xp + (r * n + j) * H;
            float *gj = gx + (r * n + j) * H;
            for (int64_t h = 0; h < H; h++) {
                gj[h] += p * gur[h];
                s += gur[h] * xj[h];
            }
            gp[r * n + j] = s;
        }
    }
    return LUNAR_OK;
}
