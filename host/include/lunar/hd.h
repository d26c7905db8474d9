/* hd.h: LUNAR_HD marks small inline functions that both the C host and CUDA kernels compile
 * (dtype conversions, RNG transforms), so the two backends compute identical bits. */
#ifndef LUNAR_HD_H
#define LUNAR_HD_H

#include <math.h>

#if defined(__CUDACC__)
#define LUNAR_HD static __host__ __device__ __forceinline__
#else
#define LUNAR_HD static inline
#endif

/* a * b + c with two roundings, as the C host computes it: nvcc would contract the expression
 * into one fused multiply-add in device code and round once, giving different bits. */
LUNAR_HD double lunar_hd_mul_add(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(__dmul_rn(a, b), c);
#else
    return a * b + c;
#endif
}

/* One IEEE operation each, rounded to nearest, never fused with a neighbour (the C host is
 * built as ISO C11, where GCC does not contract; device code uses the explicit intrinsics). */
LUNAR_HD double lunar_hd_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
LUNAR_HD double lunar_hd_add(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
LUNAR_HD double lunar_hd_div(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}
LUNAR_HD double lunar_hd_sqrt(double a) {
#if defined(__CUDA_ARCH__)
    return __dsqrt_rn(a);
#else
    return sqrt(a);
#endif
}

/* The same for f32: with the default -fmad=true nvcc fuses a plain a * b + c (and ptxas may fuse
 * an unrounded mul.f32 / add.f32 pair) into one fma; the _rn intrinsics are never fused. */
LUNAR_HD float lunar_hd_mulf(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
LUNAR_HD float lunar_hd_addf(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
LUNAR_HD float lunar_hd_subf(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
LUNAR_HD float lunar_hd_divf(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
LUNAR_HD float lunar_hd_sqrtf(float a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return sqrtf(a);
#endif
}

/* c[0] + c[1] x + ... + c[n-1] x^(n-1) by Horner's rule, one rounding per operation */
LUNAR_HD double lunar_hd_poly(const double *c, int n, double x) {
    double p = c[n - 1];
    for (int k = n - 2; k >= 0; k--) p = lunar_hd_mul_add(p, x, c[k]);
    return p;
}

/* log(x) for finite x > 0, and cos(2 pi u) for u in [0, 1), from the operations above only, so
 * the host and the device get the same bits (libm's log and cos differ between them in the last
 * place). Accurate to a few ulp of f64. */
LUNAR_HD double lunar_hd_log(double x) {
    int e;
    double m = frexp(x, &e);                       /* x = m 2^e, m in [0.5, 1): exact */
    if (m < 0.70710678118654752) {
        m = m * 2.0;                               /* exact */
        e -= 1;
    }
    double f = m - 1.0;                            /* exact (Sterbenz), in [-0.293, 0.415) */
    double s = lunar_hd_div(f, lunar_hd_add(2.0, f));
    double s2 = lunar_hd_mul(s, s);                /* log(1 + f) = 2 atanh(s) = 2 (s + s^3/3 + ...) */
    const double inv_odd[11] = {0.3333333333333333, 0.2, 0.14285714285714285, 0.1111111111111111,
                                0.09090909090909091, 0.07692307692307693, 0.06666666666666667,
                                0.058823529411764705, 0.05263157894736842, 0.047619047619047616,
                                0.043478260869565216};   /* 1/3, 1/5, ..., 1/23 */
    double log_m = lunar_hd_mul_add(lunar_hd_mul(2.0 * s, s2), lunar_hd_poly(inv_odd, 11, s2), 2.0 * s);
    /* ln 2 split (fdlibm's): ln2_hi ends in 21 zero bits, so e * ln2_hi is exact for any exponent */
    const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    return lunar_hd_add(lunar_hd_mul((double)e, ln2_hi), lunar_hd_mul_add((double)e, ln2_lo, log_m));
}

LUNAR_HD double lunar_hd_cos_2pi(double u) {
    /* fold u into [0, 1/8] with exact subtractions: cos(2 pi u) = cos(2 pi (1 - u)),
     * = -cos(2 pi (1/2 - u)), = sin(2 pi (1/4 - u)) */
    double sign = 1.0;
    int use_sin = 0;
    if (u > 0.5) u = 1.0 - u;
    if (u > 0.25) {
        u = 0.5 - u;
        sign = -1.0;
    }
    if (u > 0.125) {
        u = 0.25 - u;
        use_sin = 1;
    }
    double x = lunar_hd_mul(u, 6.28318530717958647692), x2 = lunar_hd_mul(x, x);   /* x in [0, pi/4] */
    double r;
    if (use_sin) {    /* x - x^3/3! + ... + x^21/21!: Horner in x^2 over 1/(2k+1)! */
        const double c[11] = {1.0, -0.16666666666666666, 0.008333333333333333, -0.0001984126984126984,
                              2.7557319223985893e-06, -2.505210838544172e-08, 1.6059043836821613e-10,
                              -7.647163731819816e-13, 2.8114572543455206e-15, -8.22063524662433e-18,
                              1.9572941063391263e-20};
        r = lunar_hd_mul(x, lunar_hd_poly(c, 11, x2));
    } else {          /* 1 - x^2/2! + ... + x^20/20!: Horner in x^2 over 1/(2k)! */
        const double c[11] = {1.0, -0.5, 0.041666666666666664, -0.001388888888888889, 2.48015873015873e-05,
                              -2.755731922398589e-07, 2.08767569878681e-09, -1.1470745597729725e-11,
                              4.779477332387385e-14, -1.5619206968586225e-16, 4.110317623312165e-19};
        r = lunar_hd_poly(c, 11, x2);
    }
    return sign * r;
}

#endif
