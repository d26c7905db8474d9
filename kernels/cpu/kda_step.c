/* kda_step.c: one decode step of KDA on the CPU, f32 (contracts in lunar/ops.h:
 * lunar_conv1d_step, lunar_kda_step): each sequence of the step reads and updates its slot of the
 * cache's state in place, so a step costs one call per tensor instead of a gather, the op and a
 * copy back per sequence.
 *
 * conv1d_step sums in the order conv1d_causal sums a one-row segment (the history's K - 1 rows,
 * then the new input), so the two give the same bits. kda_step is the recurrence of lunar_kda
 * for one token; each (sequence, head) is one work item in a fixed order, so its bits do not
 * depend on the other sequences of the step.
 */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "lunar/ops.h"

lunar_status lunar_cpu_conv1d_step(lunar_ctx *ctx, lunar_tensor *y, lunar_tensor *hist, const lunar_tensor *x,
                                   const lunar_tensor *w, const lunar_tensor *slots) {
    (void)ctx;
    int64_t B = x->shape[0], C = x->shape[1], K = w->shape[1];
    const float *xp = lunar_tensor_data(x), *wp = lunar_tensor_data(w);
    const int64_t *sl = lunar_tensor_data(slots);
    float *yp = lunar_tensor_data(y), *hp = K > 1 ? lunar_tensor_data(hist) : NULL;
#pragma omp parallel for schedule(static) if (B * C * K >= LUNAR_CPU_PAR_MIN && B > 1)
    for (int64_t b = 0; b < B; b++) {
        float *h = hp ? hp + sl[b] * (K - 1) * C : NULL;   /* (K - 1, C): the last inputs, oldest first */
        const float *xb = xp + b * C;
        for (int64_t c = 0; c < C; c++) {
            const float *wc = wp + c * K;
            float acc = 0;
            for (int64_t j = 0; j < K - 1; j++) acc += wc[j] * h[j * C + c];
            acc += wc[K - 1] * xb[c];
            yp[b * C + c] = acc;
        }
        if (h) {
            memmove(h, h + C, (size_t)((K - 2) * C) * sizeof(float));
            memcpy(h + (K - 2) * C, xb, (size_t)C * sizeof(float));
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_kda_step(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                                const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                const lunar_tensor *beta, const lunar_tensor *slots) {
    (void)ctx;
    int64_t B = q->shape[0], H = q->shape[1], Dk = q->shape[2], Dv = v->shape[2];
    const float *qp = lunar_tensor_data(q), *kp = lunar_tensor_data(k), *vp = lunar_tensor_data(v);
    const float *gp = lunar_tensor_data(g), *bp = lunar_tensor_data(beta);
    const int64_t *sl = lunar_tensor_data(slots);
    float *op = lunar_tensor_data(o), *sp = lunar_tensor_data(state);
#pragma omp parallel for schedule(static) if (B * H * Dk * Dv >= LUNAR_CPU_PAR_MIN && B * H > 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        float *S = sp + (sl[b] * H + h) * Dk * Dv;                 /* (Dk, Dv) */
        const float *qr = qp + bh * Dk, *kr = kp + bh * Dk, *gr = gp + bh * Dk, *vr = vp + bh * Dv;
        float be = bp[bh];
        float *out = op + bh * Dv;
        /* S <- diag(e^g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q */
        float u[LUNAR_KDA_STEP_MAX_DV];   /* (the op checks Dv) */
        for (int64_t j = 0; j < Dv; j++) u[j] = 0;
        for (int64_t d = 0; d < Dk; d++) {
            float e = expf(gr[d]), kd = kr[d];
            float *Sd = S + d * Dv;
            for (int64_t j = 0; j < Dv; j++) {
                Sd[j] *= e;
                u[j] += kd * Sd[j];
            }
        }
        for (int64_t j = 0; j < Dv; j++) u[j] = be * (vr[j] - u[j]);
        for (int64_t j = 0; j < Dv; j++) out[j] = 0;
        for (int64_t d = 0; d < Dk; d++) {
            float kd = kr[d], qd = qr[d];
            float *Sd = S + d * Dv;
            for (int64_t j = 0; j < Dv; j++) {
                Sd[j] += kd * u[j];
                out[j] += qd * Sd[j];
            }
        }
    }
    return LUNAR_OK;
}
