/* vecmath.h: vectorisable math for the CPU kernels.
 *
 * libm's expf is a function call per element and keeps loops scalar; softmax, cross-entropy and
 * the activations are then bound by it instead of by memory. lunar_expf is branch-free (selects
 * instead of branches) so GCC vectorises loops that call it, and accurate to about 2 ulp over the
 * whole float range: inputs are split as x = n ln2 + r with |r| <= ln2/2, e^r comes from its
 * degree-6 Taylor polynomial (truncation below 2^-23 relative), and 2^n is applied as two
 * exact power-of-two factors so the whole range down to the subnormals is covered.
 *
 * LUNAR_CPU_VECTOR marks a row function to be compiled for x86-64-v3 (AVX2 + FMA) as well as the
 * baseline, picked at load time by the CPU it runs on (GCC function multiversioning), with
 * multiply-adds fused. So results can differ in the last bit between a machine with FMA and one
 * without; on one machine they are always the same. (An AVX-512 clone measured slower than AVX2
 * on the development VM, so there is none.) OpenMP outlines the body of a parallel loop into a
 * separate function that would not be cloned, so the per-row work goes in such a marked function
 * and the parallel loop calls it once per row.
 */
#ifndef LUNAR_KERNELS_CPU_VECMATH_H
#define LUNAR_KERNELS_CPU_VECMATH_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define LUNAR_CPU_VECTOR __attribute__((target_clones("default", "arch=x86-64-v3"), optimize("fp-contract=fast")))
#else
#define LUNAR_CPU_VECTOR
#endif

static inline float lunar_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* e^x for any float x: 0 below -103.98, +inf above 88.73, NaN for NaN. */
static inline float lunar_expf(float x) {
    const float hi = 88.7228394f, lo = -103.972084f;
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    xc = x == x ? xc : 0.0f;                               /* NaN: compute on 0, fix below */
    float t = xc * 1.44269504f;
    float nf = (t + 12582912.0f) - 12582912.0f;            /* round to nearest (|t| < 2^22) */
    float r = xc - nf * 0.693145752f;                      /* ln2 split in two for accuracy */
    r = r - nf * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t n = (int32_t)nf;                               /* in [-150, 128] */
    int32_t n1 = n / 2, n2 = n - n1;                       /* both in [-75, 64] */
    float s1 = lunar_bits_to_float((uint32_t)(n1 + 127) << 23);
    float s2 = lunar_bits_to_float((uint32_t)(n2 + 127) << 23);
    float y = p * s1 * s2;
    y = x > hi ? __builtin_inff() : y;
    y = x < lo ? 0.0f : y;
    return x == x ? y : x;
}

/* e^x for x <= 88 (what softmax-like code needs: x - max, log-probabilities): 0 below -87.3,
 * NaN for NaN; the same polynomial as lunar_expf with fewer guards, about 2 ulp. */
static inline float lunar_expf_upto88(float x) {
    const float lo = -87.3365479f;
    float xc = x < lo ? lo : x;                            /* NaN stays NaN and makes y NaN */
    float t = xc * 1.44269504f;
    float nf = (t + 12582912.0f) - 12582912.0f;
    float r = xc - nf * 0.693145752f;
    r = r - nf * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t n = (int32_t)nf;                               /* in [-126, 127] */
    float y = p * lunar_bits_to_float((uint32_t)(n + 127) << 23);
    return x < lo ? 0.0f : y;
}

#endif
