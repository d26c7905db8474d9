/* rng.h: seeded, splittable random streams that give the same numbers on CPU and GPU.
 *
 * A stream is a Philox-4x32-10 key plus a counter. Element i of a draw of n numbers is computed
 * from philox(key, counter + i) alone, so any device, thread count or launch shape produces the
 * same tensor; the draw then advances the counter by n. Splitting derives an independent key
 * from the parent key and a stream id (e.g. one stream per purpose: init, dropout, data order,
 * sampling), without advancing the parent.
 *
 * uniform, randint and normal are bit-identical across devices: normal is Box-Muller in f64 with
 * the log and cos of hd.h (IEEE operations only, none fused), not libm's.
 */
#ifndef LUNAR_RNG_H
#define LUNAR_RNG_H

#include <math.h>
#include <stdint.h>

#include "lunar/hd.h"
#include "lunar/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lunar_rng {
    uint64_t key;
    uint64_t counter;
} lunar_rng;

void      lunar_rng_seed(lunar_rng *r, uint64_t seed);
/* An independent stream derived from r and id; r is not advanced. */
lunar_rng lunar_rng_split(const lunar_rng *r, uint64_t id);


/* Ten Philox rounds on the 4-word counter c with the 2-word key (k0, k1). */
LUNAR_HD void lunar_philox_rounds(uint32_t k0, uint32_t k1, uint32_t c[4]) {
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = (uint32_t)p1;
        c[2] = n2;
        c[3] = (uint32_t)p0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* The 4 words for element `counter` of stream `key`. */
LUNAR_HD void lunar_philox_element(uint64_t key, uint64_t counter, uint32_t w[4]) {
    w[0] = (uint32_t)counter;
    w[1] = (uint32_t)(counter >> 32);
    w[2] = 0;
    w[3] = 0;
    lunar_philox_rounds((uint32_t)key, (uint32_t)(key >> 32), w);
}

/* Per-element transforms shared by every backend. */
LUNAR_HD double lunar_rng_u01(uint32_t hi, uint32_t lo) {   /* 53 random bits -> [0, 1) */
    uint64_t b = (((uint64_t)hi << 32) | lo) >> 11;
    return (double)b * (1.0 / 9007199254740992.0);
}
LUNAR_HD double lunar_rng_uniform_value(const uint32_t w[4], double lo, double hi) {
    return lunar_hd_mul_add(hi - lo, lunar_rng_u01(w[0], w[1]), lo);   /* lo + (hi - lo) * u, unfused */
}
/* the uniform value clamped to top, the largest value of the output dtype below hi: the
 * rounding to that dtype then cannot reach hi (u < 1 alone does not ensure it: 1 - 2^-53 rounds
 * to 1 in f32, and bf16 rounds about 1 draw in 500 of [0, 1) up to 1) */
LUNAR_HD double lunar_rng_uniform_below(const uint32_t w[4], double lo, double hi, double top) {
    double v = lunar_rng_uniform_value(w, lo, hi);
    return v > top ? top : v;
}
LUNAR_HD double lunar_rng_normal_value(const uint32_t w[4], double mean, double std) {
    double u1 = 1.0 - lunar_rng_u01(w[0], w[1]);   /* (0, 1] so the log is finite */
    double u2 = lunar_rng_u01(w[2], w[3]);
    /* Box-Muller from hd.h's log and cos: libm's differ between host and device in the last bit */
    double radius = lunar_hd_sqrt(-2.0 * lunar_hd_log(u1));
    return lunar_hd_mul_add(std, lunar_hd_mul(radius, lunar_hd_cos_2pi(u2)), mean);
}
LUNAR_HD int64_t lunar_rng_randint_value(const uint32_t w[4], int64_t lo, int64_t hi) {
    uint64_t r = ((uint64_t)w[0] << 32) | w[1], range = (uint64_t)(hi - lo);
    /* high 64 bits of r * range: unbiased enough for ranges far below 2^64, and no modulo */
    uint64_t r_hi = r >> 32, r_lo = r & 0xffffffffu, g_hi = range >> 32, g_lo = range & 0xffffffffu;
    uint64_t mid = r_hi * g_lo + ((r_lo * g_lo) >> 32);
    uint64_t mid2 = r_lo * g_hi + (mid & 0xffffffffu);
    uint64_t high = r_hi * g_hi + (mid >> 32) + (mid2 >> 32);
    return lo + (int64_t)high;
}

/* The 4 words of philox(key, counter). */
void lunar_philox4x32(uint64_t key, uint64_t counter, uint32_t out[4]);

/* Fill out (any float dtype) with uniform [lo, hi), normal(mean, std) or integers in [lo, hi). */
lunar_status lunar_rng_uniform(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, double lo, double hi);
lunar_status lunar_rng_normal(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, double mean, double std);
lunar_status lunar_rng_randint(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, int64_t lo, int64_t hi);

#ifdef __cplusplus
}
#endif

#endif
