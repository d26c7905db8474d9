/* vecmath.h: vectorisable math for the CPU kernels.
 *
 * libm's expf is a function call per element and keeps loops scalar; softmax, cross-entropy and
 * attention are then bound by it instead of by memory. lunar_expf_upto88 is branch-free (selects
 * instead of branches) so GCC vectorises loops that call it.
 *
 * LUNAR_CPU_VECTOR marks a row function to be compiled for x86-64-v3 (AVX2 + FMA) as well as the
 * baseline, picked at load time by the CPU it runs on (GCC function multiversioning), with
 * multiply-adds fused. So results can differ in the last bit between a machine with FMA and one
 * without; on one machine they are always the same. OpenMP outlines the body of a parallel loop
 * into a separate function that would not be cloned, so the per-row work goes in such a marked
 * function and the parallel loop calls it once per row.
 *
 * LUNAR_CPU_VECTOR_WIDE adds an x86-64-v4 (AVX-512) clone. The softmax family takes it: its
 * 16-lane loops become one 512-bit vector each, and on the development VM (Zen 4) softmax runs
 * 1.3-1.4x faster than with AVX2, with bit-identical results (every lane does the same fused
 * operations in both). The attention rows keep LUNAR_CPU_VECTOR: no gain was measured there.
 */
#ifndef LUNAR_KERNELS_CPU_VECMATH_H
#define LUNAR_KERNELS_CPU_VECMATH_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define LUNAR_CPU_VECTOR __attribute__((target_clones("default", "arch=x86-64-v3"), optimize("fp-contract=fast")))
#define LUNAR_CPU_VECTOR_WIDE \
    __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4"), optimize("fp-contract=fast")))
#else
#define LUNAR_CPU_VECTOR
#define LUNAR_CPU_VECTOR_WIDE
#endif

static inline float lunar_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* e^x for x <= 88 (what softmax-like code needs: x - max, log-probabilities): relative error at
 * most 1.38 x 2^-23 with fused multiply-adds, 1.56 x 2^-23 without (measured on every float of
 * [-88, 88] whose e^x is a normal float); 0 below about -87.7 and for -inf; NaN for NaN. Above
 * 88 the result is not e^x (+inf from 88.38, then garbage), so callers keep the argument <= 0:
 * x - max, or a log-probability.
 *
 * x = n ln2 + r with |r| <= ln2/2; e^r is a degree-5 polynomial fitted for least maximum
 * relative error on that interval (9.5e-8 with the float coefficients, under the 1.2e-7 of one
 * ulp), so the chain is 5 multiply-adds. Rounding uses the magic constant 1.5 * 2^23 + 127: after
 * t + magic the low bits of the float hold n + 127, so 2^n is that word shifted left by 23, with
 * no float-to-int conversion. The input is clamped at -127 ln2, where n = -127 makes that word 0
 * and so e^x exactly 0, with no separate select. */
static inline float lunar_expf_upto88(float x) {
    const float lo = -88.0296919f;                         /* -127 ln2 */
    const float magic = 12582912.0f + 127.0f;
    float xc = x < lo ? lo : x;                            /* NaN stays NaN and makes y NaN */
    float v = xc * 1.44269504f + magic;                    /* n + 127 in the low bits */
    float nf = v - magic;                                  /* n as a float */
    float r = xc - nf * 0.693145752f;                      /* ln2 split in two for accuracy */
    r = r - nf * 1.42860677e-6f;
    float p = 8.290315047e-03f;
    p = p * r + 4.189793020e-02f;
    p = p * r + 1.666763574e-01f;
    p = p * r + 4.999915063e-01f;
    p = p * r + 9.999997020e-01f;
    p = p * r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return p * lunar_bits_to_float(bits << 23);
}

#endif
