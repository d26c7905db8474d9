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
#include <string.h>

#include "cpu.h"
#include "lunar/ops.h"
#include "vecmath.h"

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

/* one (sequence, head): S (Dk, Dv) in place, out (Dv). u = beta (v - (diag(e^g) S)^T k) is read
 * off S first; then one pass writes S <- diag(e^g) S + k u^T and sums o = S^T q, so S is read
 * twice and written once. g is a log decay (<= 0): lunar_expf_upto88's range. */
LUNAR_CPU_VECTOR static void kda_step_head(float *S, float *out, const float *qr, const float *kr, const float *gr,
                                           const float *vr, float be, int64_t Dk, int64_t Dv) {
    float u[LUNAR_KDA_STEP_MAX_DV];   /* (the op checks Dv) */
    for (int64_t j = 0; j < Dv; j++) u[j] = 0;
    for (int64_t d = 0; d < Dk; d++) {
        float e = lunar_expf_upto88(gr[d]), kd = kr[d];
        const float *Sd = S + d * Dv;
        for (int64_t j = 0; j < Dv; j++) u[j] += kd * (Sd[j] * e);
    }
    for (int64_t j = 0; j < Dv; j++) u[j] = be * (vr[j] - u[j]);
    for (int64_t j = 0; j < Dv; j++) out[j] = 0;
    for (int64_t d = 0; d < Dk; d++) {
        float e = lunar_expf_upto88(gr[d]), kd = kr[d], qd = qr[d];
        float *Sd = S + d * Dv;
        for (int64_t j = 0; j < Dv; j++) {
            Sd[j] = Sd[j] * e + kd * u[j];
            out[j] += qd * Sd[j];
        }
    }
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
        kda_step_head(sp + (sl[b] * H + h) * Dk * Dv, op + bh * Dv, qp + bh * Dk, kp + bh * Dk, gp + bh * Dk,
                      vp + bh * Dv, bp[bh], Dk, Dv);
    }
    return LUNAR_OK;
}
