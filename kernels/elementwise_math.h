/* elementwise_math.h: the scalar math of the elementwise ops, shared by the CPU and CUDA
 * kernels (LUNAR_HD) so that both backends evaluate the same formulas in f32.
 *   gelu       exact form: x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
 *   gelu_tanh  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 *   maximum / minimum propagate NaN (like torch.maximum / torch.minimum) */
#ifndef LUNAR_KERNELS_ELEMENTWISE_MATH_H
#define LUNAR_KERNELS_ELEMENTWISE_MATH_H

#include <math.h>

#include "lunar/hd.h"

#define LUNAR_EW_SQRT1_2 0.70710678118654752f     /* 1 / sqrt(2) */
#define LUNAR_EW_INV_SQRT_2PI 0.39894228040143268f /* 1 / sqrt(2 pi) */
#define LUNAR_EW_SQRT_2_PI 0.79788456080286536f   /* sqrt(2 / pi) */
#define LUNAR_EW_GELU_C 0.044715f

LUNAR_HD float lunar_ew_max(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
LUNAR_HD float lunar_ew_min(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }

LUNAR_HD float lunar_ew_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }
LUNAR_HD float lunar_ew_dsigmoid(float v) {
    float s = lunar_ew_sigmoid(v);
    return s * (1.0f - s);
}
/* d silu / dv given s = sigmoid(v) */
LUNAR_HD float lunar_ew_dsilu_s(float v, float s) { return s * (1.0f + v * (1.0f - s)); }
LUNAR_HD float lunar_ew_dsilu(float v) { return lunar_ew_dsilu_s(v, lunar_ew_sigmoid(v)); }

LUNAR_HD float lunar_ew_dtanh(float v) {
    float t = tanhf(v);
    return 1.0f - t * t;
}

LUNAR_HD float lunar_ew_gelu(float v) { return 0.5f * v * (1.0f + erff(v * LUNAR_EW_SQRT1_2)); }
LUNAR_HD float lunar_ew_dgelu(float v) {
    float cdf = 0.5f * (1.0f + erff(v * LUNAR_EW_SQRT1_2));
    float pdf = expf(-0.5f * v * v) * LUNAR_EW_INV_SQRT_2PI;
    return cdf + v * pdf;
}

LUNAR_HD float lunar_ew_gelu_tanh(float v) {
    float u = LUNAR_EW_SQRT_2_PI * (v + LUNAR_EW_GELU_C * v * v * v);
    return 0.5f * v * (1.0f + tanhf(u));
}
LUNAR_HD float lunar_ew_dgelu_tanh(float v) {
    float u = LUNAR_EW_SQRT_2_PI * (v + LUNAR_EW_GELU_C * v * v * v);
    float t = tanhf(u);
    float du = LUNAR_EW_SQRT_2_PI * (1.0f + 3.0f * LUNAR_EW_GELU_C * v * v);
    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
}

#endif
