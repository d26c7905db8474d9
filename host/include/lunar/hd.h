/* hd.h: LUNAR_HD marks small inline functions that both the C host and CUDA kernels compile
 * (dtype conversions, RNG transforms), so the two backends compute identical bits. */
#ifndef LUNAR_HD_H
#define LUNAR_HD_H

#if defined(__CUDACC__)
#define LUNAR_HD static __host__ __device__ __forceinline__
#else
#define LUNAR_HD static inline
#endif

#endif
