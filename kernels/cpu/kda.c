/* kda.c: the gated delta rule of KDA (GLM-5.3-Flash's linear attention) on the CPU, f32
 * (contract in lunar/ops.h, lunar_kda_forward / lunar_kda_backward).
 *
 * One work item is one (segment, head): its rows are a run of token rows with their own state
 * S (Dk, Dv), so packed documents and batch rows are independent items and the threads split
 * them (dynamic schedule; an item's bits never depend on the thread count).
 *
 * Forward, chunk-wise in the WY form (chunks of KDA_CHUNK rows, the last one shorter), per chunk
 * with G the cumulative sum of g over the chunk's rows:
 *   A[i, j] = -beta_i sum_d k_i[d] k_j[d] e^{G_i[d] - G_j[d]}  (j < i), then P = (I - A)^-1 by
 *            forward substitution (row i: A[i, :i] += A[i, :i] A[:i, :i]; P = A + I)
 *   U = P (beta v),  W = P (beta k e^G),  V' = U - W S
 *   O = (q e^G) S + M V',  M[i, j] = sum_d q_i[d] k_j[d] e^{G_i[d] - G_j[d]}  (j <= i)
 *   S <- e^{G_last} S + (k e^{G_last - G})^T V'
 * Every exponent is of a difference G_i - G_j with i >= j (g <= 0), so nothing overflows.
 *
 * Backward recomputes, in f64: one pass of the token rule keeps the state at each chunk start;
 * then chunk by chunk from the last, the states inside the chunk are rebuilt by the token rule
 * and the adjoint of the recurrence runs backwards over its rows (dS the gradient of the state
 * after row t). f64 because the forget gate's gradient sums dS' * S' over every later row, terms
 * that cancel: in f32 its error grew with the sequence (5e-6 relative at 3 chunks, where f64
 * stays at the inputs' rounding):
 *   dS += q_t do_t^T;  dq_t = S_t do_t;  u = v_t - S'_t^T k_t;  dbeta_t = k_t^T dS u;
 *   du = beta_t dS^T k_t;  dv_t = du;  dk_t = beta_t dS u - S'_t du;  dS' = dS - k_t du^T;
 *   dg_t[d] = sum_e dS'[d, e] S'_t[d, e];  dS = e^{g_t} dS'       (S'_t = e^{g_t} S_{t-1})
 * The memory is the chunk-start states of one item and one chunk of token states per thread (f64).
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu.h"

#define KDA_CHUNK 64

typedef struct kda_args {
    const float   *q, *k, *v, *g, *beta, *state0, *dout, *dstate;
    float         *o, *state, *dq, *dk, *dv, *dg, *dbeta, *dstate0;
    const int64_t *seg;
    int64_t        H, Dk, Dv;
} kda_args;

/* per-thread scratch of the chunked form */
typedef struct kda_work {
    float *G, *A, *U, *W, *S, *tmp;
} kda_work;

static size_t kda_work_floats(int64_t Dk, int64_t Dv) {
    int64_t C = KDA_CHUNK;
    return (size_t)(C * Dk + C * C + C * Dv + C * Dk + Dk * Dv + C * Dv);
}

static void kda_work_at(kda_work *w, float *base, int64_t Dk, int64_t Dv) {
    int64_t C = KDA_CHUNK;
    w->G = base;
    w->A = w->G + C * Dk;
    w->U = w->A + C * C;
    w->W = w->U + C * Dv;
    w->S = w->W + C * Dk;
    w->tmp = w->S + Dk * Dv;
}

/* rows r0 .. r0+L-1 of head h as one chunk from the state w->S (updated in place); writes the
 * outputs when a->o is set (o != NULL) */
static void kda_chunk(const kda_args *a, kda_work *w, int64_t r0, int64_t L, int64_t h, float *o) {
    const int64_t H = a->H, Dk = a->Dk, Dv = a->Dv;
    float *G = w->G, *A = w->A, *U = w->U, *W = w->W, *S = w->S, *Vp = w->tmp;
#define ROW(p, r, D) ((p) + (((r0) + (r)) * H + h) * (D))
    /* G: cumulative log decay */
    for (int64_t i = 0; i < L; i++) {
        const float *gi = ROW(a->g, i, Dk);
        float *Gi = G + i * Dk;
        for (int64_t d = 0; d < Dk; d++) Gi[d] = gi[d] + (i ? G[(i - 1) * Dk + d] : 0.0f);
    }
    /* A strictly lower, then P - I by forward substitution */
    for (int64_t i = 0; i < L; i++) {
        const float *ki = ROW(a->k, i, Dk), *Gi = G + i * Dk;
        float bi = a->beta[(r0 + i) * H + h];
        for (int64_t j = 0; j < i; j++) {
            const float *kj = ROW(a->k, j, Dk), *Gj = G + j * Dk;
            float s = 0;
            for (int64_t d = 0; d < Dk; d++) s += ki[d] * kj[d] * expf(Gi[d] - Gj[d]);
            A[i * KDA_CHUNK + j] = -bi * s;
        }
    }
    for (int64_t i = 1; i < L; i++) {
        float *Ai = A + i * KDA_CHUNK;
        float row[KDA_CHUNK];
        for (int64_t j = 0; j < i; j++) {
            float s = Ai[j];
            for (int64_t m = j + 1; m < i; m++) s += Ai[m] * A[m * KDA_CHUNK + j];
            row[j] = s;
        }
        memcpy(Ai, row, (size_t)i * sizeof(float));
    }
    /* U = P (beta v), W = P (beta k e^G) */
    for (int64_t i = 0; i < L; i++) {
        float *Ui = U + i * Dv, *Wi = W + i * Dk;
        for (int64_t j = 0; j <= i; j++) {
            float p = (j == i ? 1.0f : A[i * KDA_CHUNK + j]) * a->beta[(r0 + j) * H + h];
            const float *vj = ROW(a->v, j, Dv), *kj = ROW(a->k, j, Dk), *Gj = G + j * Dk;
            if (j == 0) {
                for (int64_t e = 0; e < Dv; e++) Ui[e] = p * vj[e];
                for (int64_t d = 0; d < Dk; d++) Wi[d] = p * kj[d] * expf(Gj[d]);
            } else {
                for (int64_t e = 0; e < Dv; e++) Ui[e] += p * vj[e];
                for (int64_t d = 0; d < Dk; d++) Wi[d] += p * kj[d] * expf(Gj[d]);
            }
        }
    }
    /* V' = U - W S */
    for (int64_t i = 0; i < L; i++) {
        float *Vi = Vp + i * Dv;
        const float *Wi = W + i * Dk;
        memcpy(Vi, U + i * Dv, (size_t)Dv * sizeof(float));
        for (int64_t d = 0; d < Dk; d++) {
            float wd = Wi[d];
            const float *Sd = S + d * Dv;
            for (int64_t e = 0; e < Dv; e++) Vi[e] -= wd * Sd[e];
        }
    }
    /* O = (q e^G) S + M V' */
    if (o) {
        for (int64_t i = 0; i < L; i++) {
            const float *qi = ROW(a->q, i, Dk), *Gi = G + i * Dk;
            float *oi = ROW(o, i, Dv);
            for (int64_t e = 0; e < Dv; e++) oi[e] = 0;
            for (int64_t d = 0; d < Dk; d++) {
                float qd = qi[d] * expf(Gi[d]);
                const float *Sd = S + d * Dv;
                for (int64_t e = 0; e < Dv; e++) oi[e] += qd * Sd[e];
            }
            for (int64_t j = 0; j <= i; j++) {
                const float *kj = ROW(a->k, j, Dk), *Gj = G + j * Dk;
                float m = 0;
                for (int64_t d = 0; d < Dk; d++) m += qi[d] * kj[d] * expf(Gi[d] - Gj[d]);
                const float *Vj = Vp + j * Dv;
                for (int64_t e = 0; e < Dv; e++) oi[e] += m * Vj[e];
            }
        }
    }
    /* S <- e^{G_last} S + (k e^{G_last - G})^T V' */
    const float *Gl = G + (L - 1) * Dk;
    for (int64_t d = 0; d < Dk; d++) {
        float *Sd = S + d * Dv;
        float dec = expf(Gl[d]);
        for (int64_t e = 0; e < Dv; e++) Sd[e] *= dec;
        for (int64_t j = 0; j < L; j++) {
            float kd = ROW(a->k, j, Dk)[d] * expf(Gl[d] - G[j * Dk + d]);
            const float *Vj = Vp + j * Dv;
            for (int64_t e = 0; e < Dv; e++) Sd[e] += kd * Vj[e];
        }
    }
#undef ROW
}

static void kda_load_state(const kda_args *a, float *S, int64_t s, int64_t h) {
    size_t n = (size_t)(a->Dk * a->Dv);
    if (a->state0) memcpy(S, a->state0 + (s * a->H + h) * (int64_t)n, n * sizeof(float));
    else memset(S, 0, n * sizeof(float));
}

lunar_status lunar_cpu_kda_forward(lunar_ctx *ctx, lunar_tensor *o, lunar_tensor *state, const lunar_tensor *q,
                                   const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                   const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0) {
    kda_args a = {0};
    a.q = lunar_tensor_data(q), a.k = lunar_tensor_data(k), a.v = lunar_tensor_data(v), a.g = lunar_tensor_data(g);
    a.beta = lunar_tensor_data(beta), a.seg = lunar_tensor_data(seg);
    a.state0 = state0 ? lunar_tensor_data(state0) : NULL;
    a.o = lunar_tensor_data(o), a.state = state ? lunar_tensor_data(state) : NULL;
    a.H = q->shape[1], a.Dk = q->shape[2], a.Dv = v->shape[2];
    int64_t nseg = seg->shape[0] - 1, items = nseg * a.H;
    if (items == 0) return LUNAR_OK;
    int nt = lunar_ctx_threads(ctx);
    size_t wf = (kda_work_floats(a.Dk, a.Dv) + 15) & ~(size_t)15;
    int64_t nbytes = (int64_t)(wf * sizeof(float)) * nt;
    lunar_tensor scratch = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    float *sb = lunar_tensor_data(&scratch);
#pragma omp parallel num_threads(nt) if (items > 1)
    {
        kda_work w;
        kda_work_at(&w, sb + wf * (size_t)omp_get_thread_num(), a.Dk, a.Dv);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t s = it / a.H, h = it % a.H, r0 = a.seg[s], r1 = a.seg[s + 1];
            kda_load_state(&a, w.S, s, h);
            for (int64_t c = r0; c < r1; c += KDA_CHUNK)
                kda_chunk(&a, &w, c, r1 - c < KDA_CHUNK ? r1 - c : KDA_CHUNK, h, a.o);
            if (a.state)
                memcpy(a.state + (s * a.H + h) * a.Dk * a.Dv, w.S, (size_t)(a.Dk * a.Dv) * sizeof(float));
        }
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}

/* one row of the token rule on the f64 state S (Dk, Dv) in place: S <- e^g S; S += k (beta (v - S^T k))^T
 * (u: Dv scratch) */
static void kda_token_step(const kda_args *a, double *S, int64_t r, int64_t h, double *u) {
    const int64_t H = a->H, Dk = a->Dk, Dv = a->Dv;
    const float *g = a->g + (r * H + h) * Dk, *kk = a->k + (r * H + h) * Dk, *vv = a->v + (r * H + h) * Dv;
    double b = a->beta[r * H + h];
    for (int64_t d = 0; d < Dk; d++) {
        double dec = exp((double)g[d]);
        for (int64_t e = 0; e < Dv; e++) S[d * Dv + e] *= dec;
    }
    for (int64_t e = 0; e < Dv; e++) {
        double sk = 0;
        for (int64_t d = 0; d < Dk; d++) sk += S[d * Dv + e] * kk[d];
        u[e] = b * (vv[e] - sk);
    }
    for (int64_t d = 0; d < Dk; d++)
        for (int64_t e = 0; e < Dv; e++) S[d * Dv + e] += kk[d] * u[e];
}

/* the adjoint of one item's rows r0 .. r1-1 (states at chunk starts in starts) */
static void kda_item_backward(const kda_args *a, int64_t s, int64_t h, const double *starts, double *dS, double *Sp,
                              double *St, double *tok, double *u, double *du) {
    const int64_t H = a->H, Dk = a->Dk, Dv = a->Dv, DD = Dk * Dv;
    int64_t r0 = a->seg[s], r1 = a->seg[s + 1];
    for (int64_t i = 0; i < DD; i++) dS[i] = a->dstate ? a->dstate[(s * H + h) * DD + i] : 0.0;
    int64_t nch = (r1 - r0 + KDA_CHUNK - 1) / KDA_CHUNK;
    for (int64_t c = nch - 1; c >= 0; c--) {
        int64_t c0 = r0 + c * KDA_CHUNK, L = r1 - c0 < KDA_CHUNK ? r1 - c0 : KDA_CHUNK;
        /* tok[i]: the state before row c0 + i (token rule from the chunk start) */
        for (int64_t i = 0; i < DD; i++) tok[i] = starts[c * DD + i];
        for (int64_t i = 0; i + 1 < L; i++) {
            memcpy(tok + (i + 1) * DD, tok + i * DD, (size_t)DD * sizeof(double));
            kda_token_step(a, tok + (i + 1) * DD, c0 + i, h, u);
        }
        for (int64_t i = L - 1; i >= 0; i--) {
            int64_t r = c0 + i;
            const float *g = a->g + (r * H + h) * Dk, *kk = a->k + (r * H + h) * Dk, *vv = a->v + (r * H + h) * Dv;
            const float *qq = a->q + (r * H + h) * Dk, *dy = a->dout + (r * H + h) * Dv;
            double b = a->beta[r * H + h];
            const double *prev = tok + i * DD;
            /* S'_t and u = v - S'^T k; S_t = S' + k (b u)^T */
            for (int64_t d = 0; d < Dk; d++) {
                double dec = exp((double)g[d]);
                for (int64_t e = 0; e < Dv; e++) Sp[d * Dv + e] = dec * prev[d * Dv + e];
            }
            for (int64_t e = 0; e < Dv; e++) {
                double sk = 0;
                for (int64_t d = 0; d < Dk; d++) sk += Sp[d * Dv + e] * kk[d];
                u[e] = vv[e] - sk;
            }
            for (int64_t d = 0; d < Dk; d++)
                for (int64_t e = 0; e < Dv; e++) St[d * Dv + e] = Sp[d * Dv + e] + kk[d] * b * u[e];
            /* dS += q do^T; dq = S_t do */
            float *dq = a->dq + (r * H + h) * Dk, *dk = a->dk + (r * H + h) * Dk, *dv = a->dv + (r * H + h) * Dv;
            float *dg = a->dg + (r * H + h) * Dk;
            for (int64_t d = 0; d < Dk; d++) {
                double acc = 0;
                for (int64_t e = 0; e < Dv; e++) {
                    dS[d * Dv + e] += qq[d] * dy[e];
                    acc += St[d * Dv + e] * dy[e];
                }
                dq[d] = acc;
            }
            /* du = b dS^T k; dbeta = k^T dS u */
            double dbeta = 0;
            for (int64_t e = 0; e < Dv; e++) {
                double acc = 0;
                for (int64_t d = 0; d < Dk; d++) acc += dS[d * Dv + e] * kk[d];
                du[e] = b * acc;
                dbeta += acc * u[e];
            }
            a->dbeta[r * H + h] = dbeta;
            for (int64_t e = 0; e < Dv; e++) dv[e] = du[e];
            /* dk = b dS u - S' du; dS' = dS - k du^T; dg = rowsum(dS' * S'); dS = e^g dS' */
            for (int64_t d = 0; d < Dk; d++) {
                double x = 0, y = 0, z = 0;
                double *dSd = dS + d * Dv;
                const double *Spd = Sp + d * Dv;
                for (int64_t e = 0; e < Dv; e++) {
                    x += dSd[e] * u[e];
                    y += Spd[e] * du[e];
                }
                dk[d] = b * x - y;
                double dec = exp((double)g[d]);
                for (int64_t e = 0; e < Dv; e++) {
                    double dsp = dSd[e] - kk[d] * du[e];
                    z += dsp * Spd[e];
                    dSd[e] = dec * dsp;
                }
                dg[d] = z;
            }
        }
    }
    if (a->dstate0)
        for (int64_t i = 0; i < DD; i++) a->dstate0[(s * H + h) * DD + i] = (float)dS[i];
}

lunar_status lunar_cpu_kda_backward(lunar_ctx *ctx, lunar_tensor *dq, lunar_tensor *dk, lunar_tensor *dv,
                                    lunar_tensor *dg, lunar_tensor *dbeta, lunar_tensor *dstate0,
                                    const lunar_tensor *dout, const lunar_tensor *dstate, const lunar_tensor *q,
                                    const lunar_tensor *k, const lunar_tensor *v, const lunar_tensor *g,
                                    const lunar_tensor *beta, const lunar_tensor *seg, const lunar_tensor *state0) {
    kda_args a = {0};
    a.q = lunar_tensor_data(q), a.k = lunar_tensor_data(k), a.v = lunar_tensor_data(v), a.g = lunar_tensor_data(g);
    a.beta = lunar_tensor_data(beta), a.seg = lunar_tensor_data(seg);
    a.state0 = state0 ? lunar_tensor_data(state0) : NULL;
    a.dout = lunar_tensor_data(dout), a.dstate = dstate ? lunar_tensor_data(dstate) : NULL;
    a.dq = lunar_tensor_data(dq), a.dk = lunar_tensor_data(dk), a.dv = lunar_tensor_data(dv);
    a.dg = lunar_tensor_data(dg), a.dbeta = lunar_tensor_data(dbeta);
    a.dstate0 = dstate0 ? lunar_tensor_data(dstate0) : NULL;
    a.H = q->shape[1], a.Dk = q->shape[2], a.Dv = v->shape[2];
    int64_t nseg = seg->shape[0] - 1, items = nseg * a.H, DD = a.Dk * a.Dv;
    if (items == 0) return LUNAR_OK;
    int64_t longest = 0;
    for (int64_t s = 0; s < nseg; s++)
        if (a.seg[s + 1] - a.seg[s] > longest) longest = a.seg[s + 1] - a.seg[s];
    int64_t max_chunks = (longest + KDA_CHUNK - 1) / KDA_CHUNK;
    /* per thread (f64): the chunk-start states, dS, S', S_t, a chunk of token states, u and du */
    size_t wd = (size_t)((max_chunks + 3 + KDA_CHUNK) * DD + 2 * a.Dv);
    wd = (wd + 7) & ~(size_t)7;
    int nt = lunar_ctx_threads(ctx);
    int64_t nbytes = (int64_t)(wd * sizeof(double)) * nt;
    lunar_tensor scratch = {0};
    LUNAR_TRY(lunar_tensor_new(ctx, &scratch, LUNAR_DTYPE_U8, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &nbytes));
    double *sb = lunar_tensor_data(&scratch);
#pragma omp parallel num_threads(nt) if (items > 1)
    {
        double *starts = sb + wd * (size_t)omp_get_thread_num();
        double *dS = starts + max_chunks * DD, *Sp = dS + DD, *St = Sp + DD, *tok = St + DD, *u = tok + KDA_CHUNK * DD, *du = u + a.Dv;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t s = it / a.H, h = it % a.H, r0 = a.seg[s], r1 = a.seg[s + 1];
            if (r1 == r0) {
                if (a.dstate0) {
                    float *d0 = a.dstate0 + (s * a.H + h) * DD;
                    if (a.dstate) memcpy(d0, a.dstate + (s * a.H + h) * DD, (size_t)DD * sizeof(float));
                    else memset(d0, 0, (size_t)DD * sizeof(float));
                }
                continue;
            }
            /* the state at each chunk start, by the token rule in f64 */
            for (int64_t i = 0; i < DD; i++) starts[i] = a.state0 ? a.state0[(s * a.H + h) * DD + i] : 0.0;
            for (int64_t r = r0; r + KDA_CHUNK < r1; r += KDA_CHUNK) {
                double *next = starts + ((r - r0) / KDA_CHUNK + 1) * DD;
                memcpy(next, next - DD, (size_t)DD * sizeof(double));
                for (int64_t t = r; t < r + KDA_CHUNK; t++) kda_token_step(&a, next, t, h, u);
            }
            kda_item_backward(&a, s, h, starts, dS, Sp, St, tok, u, du);
        }
    }
    lunar_tensor_release(ctx, &scratch);
    return LUNAR_OK;
}
