/* elementwise.c: binary, scalar, unary (forward and backward), SwiGLU and masked_fill on the
 * CPU. Every float tensor is f32 and contiguous with out's shape (backend.h); comparison
 * outputs are bool/u8 bytes or f32. The op switch is outside the loops: each case is its own
 * loop, which the compiler vectorises where it can. */
#include <math.h>

#include "cpu.h"
#include "elementwise_math.h"   /* kernels/: shared with the CUDA kernels */

/* One parallel loop over i in [0, n) with x[i] as xa and YB as yb; stores expr into o[i]. */
#define EW_BINARY(YB, expr)                                                                     \
    do {                                                                                        \
        _Pragma("omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)")                \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const float xa = x[i], yb = (YB);                                                   \
            o[i] = (expr);                                                                      \
        }                                                                                       \
    } while (0)

#define ARITH_SWITCH(YB)                                                                        \
    switch (op) {                                                                               \
    case LUNAR_BINARY_ADD: EW_BINARY(YB, xa + yb); break;                                       \
    case LUNAR_BINARY_SUB: EW_BINARY(YB, xa - yb); break;                                       \
    case LUNAR_BINARY_MUL: EW_BINARY(YB, xa * yb); break;                                       \
    case LUNAR_BINARY_DIV: EW_BINARY(YB, xa / yb); break;                                       \
    case LUNAR_BINARY_MAX: EW_BINARY(YB, lunar_ew_max(xa, yb)); break;                          \
    case LUNAR_BINARY_MIN: EW_BINARY(YB, lunar_ew_min(xa, yb)); break;                          \
    case LUNAR_BINARY_POW: EW_BINARY(YB, powf(xa, yb)); break;                                  \
    case LUNAR_BINARY_RSUB: EW_BINARY(YB, yb - xa); break;                                      \
    case LUNAR_BINARY_RDIV: EW_BINARY(YB, yb / xa); break;                                      \
    default: return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cpu binary: unknown op %d", (int)op);       \
    }

#define COMPARE_SWITCH(YB)                                                                      \
    switch (op) {                                                                               \
    case LUNAR_BINARY_EQ: EW_BINARY(YB, xa == yb); break;                                       \
    case LUNAR_BINARY_NE: EW_BINARY(YB, xa != yb); break;                                       \
    case LUNAR_BINARY_LT: EW_BINARY(YB, xa < yb); break;                                        \
    case LUNAR_BINARY_LE: EW_BINARY(YB, xa <= yb); break;                                       \
    case LUNAR_BINARY_GT: EW_BINARY(YB, xa > yb); break;                                        \
    case LUNAR_BINARY_GE: EW_BINARY(YB, xa >= yb); break;                                       \
    default: return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cpu binary: unknown op %d", (int)op);       \
    }

static int is_compare(lunar_binary_op op) { return op >= LUNAR_BINARY_EQ; }

lunar_status lunar_cpu_binary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, const lunar_tensor *b,
                              lunar_binary_op op) {
    int64_t n = lunar_tensor_numel(out);
    const float *x = lunar_tensor_data(a), *y = lunar_tensor_data(b);
    if (out->dtype != LUNAR_DTYPE_F32) {   /* bool/u8 result of a comparison */
        uint8_t *o = lunar_tensor_data(out);
        COMPARE_SWITCH(y[i])
        return LUNAR_OK;
    }
    float *o = lunar_tensor_data(out);
    if (is_compare(op)) {
        COMPARE_SWITCH(y[i])
    } else {
        ARITH_SWITCH(y[i])
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_binary_scalar(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, double s,
                                     lunar_binary_op op) {
    int64_t n = lunar_tensor_numel(out);
    const float *x = lunar_tensor_data(a);
    const float sf = (float)s;
    if (out->dtype != LUNAR_DTYPE_F32) {   /* bool/u8 result of a comparison */
        uint8_t *o = lunar_tensor_data(out);
        COMPARE_SWITCH(sf)
        return LUNAR_OK;
    }
    float *o = lunar_tensor_data(out);
    if (is_compare(op)) {
        COMPARE_SWITCH(sf)
    } else {
        ARITH_SWITCH(sf)
    }
    return LUNAR_OK;
}

/* One parallel loop with v = x[i] (and g = dy[i] for backward); stores expr into o[i]. */
#define EW_UNARY(expr)                                                                          \
    do {                                                                                        \
        _Pragma("omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)")                \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const float v = x[i];                                                               \
            o[i] = (expr);                                                                      \
        }                                                                                       \
    } while (0)

#define EW_UNARY_BACKWARD(deriv)                                                                \
    do {                                                                                        \
        _Pragma("omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)")                \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const float v = x[i];                                                               \
            (void)v;                                                                            \
            o[i] = g[i] * (deriv);                                                              \
        }                                                                                       \
    } while (0)

lunar_status lunar_cpu_unary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *xt, lunar_unary_op op) {
    int64_t n = lunar_tensor_numel(out);
    const float *x = lunar_tensor_data(xt);
    float *o = lunar_tensor_data(out);
    switch (op) {
    case LUNAR_UNARY_NEG: EW_UNARY(-v); break;
    case LUNAR_UNARY_ABS: EW_UNARY(fabsf(v)); break;
    case LUNAR_UNARY_EXP: EW_UNARY(expf(v)); break;
    case LUNAR_UNARY_LOG: EW_UNARY(logf(v)); break;
    case LUNAR_UNARY_SQRT: EW_UNARY(sqrtf(v)); break;
    case LUNAR_UNARY_RSQRT: EW_UNARY(1.0f / sqrtf(v)); break;
    case LUNAR_UNARY_RECIP: EW_UNARY(1.0f / v); break;
    case LUNAR_UNARY_SQUARE: EW_UNARY(v * v); break;
    case LUNAR_UNARY_TANH: EW_UNARY(tanhf(v)); break;
    case LUNAR_UNARY_SIGMOID: EW_UNARY(lunar_ew_sigmoid(v)); break;
    case LUNAR_UNARY_SILU: EW_UNARY(v * lunar_ew_sigmoid(v)); break;
    case LUNAR_UNARY_GELU: EW_UNARY(lunar_ew_gelu(v)); break;
    case LUNAR_UNARY_GELU_TANH: EW_UNARY(lunar_ew_gelu_tanh(v)); break;
    case LUNAR_UNARY_RELU: EW_UNARY(v < 0.0f ? 0.0f : v); break;
    case LUNAR_UNARY_SIN: EW_UNARY(sinf(v)); break;
    case LUNAR_UNARY_COS: EW_UNARY(cosf(v)); break;
    default: return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cpu unary: unknown op %d", (int)op);
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_unary_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy, const lunar_tensor *xt,
                                      lunar_unary_op op) {
    int64_t n = lunar_tensor_numel(dx);
    const float *x = lunar_tensor_data(xt), *g = lunar_tensor_data(dy);
    float *o = lunar_tensor_data(dx);
    switch (op) {
    case LUNAR_UNARY_NEG: EW_UNARY_BACKWARD(-1.0f); break;
    case LUNAR_UNARY_ABS: EW_UNARY_BACKWARD(v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f)); break;
    case LUNAR_UNARY_EXP: EW_UNARY_BACKWARD(expf(v)); break;
    case LUNAR_UNARY_LOG: EW_UNARY_BACKWARD(1.0f / v); break;
    case LUNAR_UNARY_SQRT: EW_UNARY_BACKWARD(0.5f / sqrtf(v)); break;
    case LUNAR_UNARY_RSQRT: EW_UNARY_BACKWARD(-0.5f / (v * sqrtf(v))); break;
    case LUNAR_UNARY_RECIP: EW_UNARY_BACKWARD(-1.0f / (v * v)); break;
    case LUNAR_UNARY_SQUARE: EW_UNARY_BACKWARD(2.0f * v); break;
    case LUNAR_UNARY_TANH: EW_UNARY_BACKWARD(lunar_ew_dtanh(v)); break;
    case LUNAR_UNARY_SIGMOID: EW_UNARY_BACKWARD(lunar_ew_dsigmoid(v)); break;
    case LUNAR_UNARY_SILU: EW_UNARY_BACKWARD(lunar_ew_dsilu(v)); break;
    case LUNAR_UNARY_GELU: EW_UNARY_BACKWARD(lunar_ew_dgelu(v)); break;
    case LUNAR_UNARY_GELU_TANH: EW_UNARY_BACKWARD(lunar_ew_dgelu_tanh(v)); break;
    case LUNAR_UNARY_RELU: EW_UNARY_BACKWARD(v > 0.0f ? 1.0f : 0.0f); break;
    case LUNAR_UNARY_SIN: EW_UNARY_BACKWARD(cosf(v)); break;
    case LUNAR_UNARY_COS: EW_UNARY_BACKWARD(-sinf(v)); break;
    default: return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cpu unary_backward: unknown op %d", (int)op);
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_swiglu_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *gate,
                                      const lunar_tensor *up) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(out);
    const float *g = lunar_tensor_data(gate), *u = lunar_tensor_data(up);
    float *o = lunar_tensor_data(out);
#pragma omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) o[i] = g[i] * lunar_ew_sigmoid(g[i]) * u[i];
    return LUNAR_OK;
}

lunar_status lunar_cpu_swiglu_backward(lunar_ctx *ctx, lunar_tensor *dgate, lunar_tensor *dup,
                                       const lunar_tensor *dout, const lunar_tensor *gate, const lunar_tensor *up) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(dgate);
    const float *d = lunar_tensor_data(dout), *g = lunar_tensor_data(gate), *u = lunar_tensor_data(up);
    float *dg = lunar_tensor_data(dgate), *du = lunar_tensor_data(dup);
#pragma omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        /* every input is read before either output is written: dgate may alias gate, dup up */
        float gi = g[i], di = d[i], ui = u[i];
        float s = lunar_ew_sigmoid(gi);
        dg[i] = di * ui * lunar_ew_dsilu_s(gi, s);
        du[i] = di * gi * s;
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_masked_fill(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, const lunar_tensor *mask,
                                   double value) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(out);
    const float *xs = lunar_tensor_data(x);
    const uint8_t *m = lunar_tensor_data(mask);
    float *o = lunar_tensor_data(out);
    const float v = (float)value;
#pragma omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) o[i] = m[i] ? v : xs[i];
    return LUNAR_OK;
}
