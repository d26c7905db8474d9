/* hd.h: LUNAR_HD marks small inline functions that both the C host and CUDA kernels compile
 * (dtype conversions, RNG transforms), so the two backends compute identical bits. */
#ifndef LUNAR_HD_H
#define LUNAR_HD_H

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

#endif
