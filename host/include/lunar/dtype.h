/* dtype.h: element types and the scalar conversions between them.
 *
 * The low-precision conversions follow PyTorch bit for bit (tests/fixtures/dtype_*.bin were made
 * with torch): round to nearest even, NaN kept as NaN, and for float8 the overflow rules of
 * torch's float8_e4m3fn / float8_e5m2 casts. They are inline and shared with the CUDA kernels
 * (LUNAR_HD), so the cast loops make no call per element and both backends give the same bits.
 */
#ifndef LUNAR_DTYPE_H
#define LUNAR_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "lunar/hd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lunar_dtype {
    LUNAR_DTYPE_F32 = 0,
    LUNAR_DTYPE_F64,
    LUNAR_DTYPE_BF16,
    LUNAR_DTYPE_F16,
    LUNAR_DTYPE_F8E4M3,   /* torch.float8_e4m3fn: bias 7, max 448, no inf, NaN = S.1111.111 */
    LUNAR_DTYPE_F8E5M2,   /* torch.float8_e5m2: IEEE-like, bias 15, max 57344, has inf */
    LUNAR_DTYPE_I8,
    LUNAR_DTYPE_I32,
    LUNAR_DTYPE_I64,
    LUNAR_DTYPE_U8,
    LUNAR_DTYPE_BOOL,     /* one byte, 0 or 1 */
    LUNAR_DTYPE_COUNT
} lunar_dtype;

size_t      lunar_dtype_size(lunar_dtype dt);
const char *lunar_dtype_name(lunar_dtype dt);       /* "f32", "bf16", ... */
int         lunar_dtype_from_name(const char *name, lunar_dtype *out); /* 1 if known; accepts torch names too */
int         lunar_dtype_is_float(lunar_dtype dt);   /* f32 f64 bf16 f16 f8 */
int         lunar_dtype_is_int(lunar_dtype dt);     /* i8 i32 i64 u8 bool */
/* the integers an integer dtype holds, [*min, *max] (bool: 0..1); 0 for a float dtype */
int         lunar_dtype_int_range(lunar_dtype dt, int64_t *min, int64_t *max);

/* ---- scalar conversions ---------------------------------------------------------------- */

LUNAR_HD uint32_t lunar_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
LUNAR_HD float lunar_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* bf16 is the top half of an f32; rounding is to nearest even; NaN becomes torch's 0x7fc0. */
LUNAR_HD uint16_t lunar_f32_to_bf16(float f) {
    uint32_t u = lunar_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
LUNAR_HD float lunar_bf16_to_f32(uint16_t h) { return lunar_bits_f32((uint32_t)h << 16); }

/* Magnitude code of a finite |f| (abs_bits = its f32 bits without sign) in a small float format
 * with `mbits` mantissa bits and exponent bias `bias`, rounded to nearest even. A carry out of the
 * mantissa moves into the exponent: that is how values round up into the next binade, or past
 * the top code (callers handle the codes that mean inf/NaN). */
LUNAR_HD uint32_t lunar_small_float_code(uint32_t abs_bits, int mbits, int bias) {
    int e = (int)(abs_bits >> 23) - 127;
    int emin = 1 - bias;
    if (e < emin) {
        /* subnormal in the target: count quanta of 2^(emin - mbits); the scaling is exact and
         * rintf rounds half to even in the default rounding mode */
        return (uint32_t)rintf(ldexpf(lunar_bits_f32(abs_bits), mbits - emin));
    }
    uint32_t mant = abs_bits & 0x7fffffu;
    int shift = 23 - mbits;
    uint32_t code = ((uint32_t)(e + bias) << mbits) | (mant >> shift);
    uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (code & 1u))) code++;
    return code;
}

LUNAR_HD float lunar_small_float_value(uint32_t code, int mbits, int bias) {
    uint32_t e = code >> mbits, m = code & ((1u << mbits) - 1u);
    if (e == 0) return ldexpf((float)m, 1 - bias - mbits);
    return ldexpf(1.0f + ldexpf((float)m, -mbits), (int)e - bias);
}

/* Overflow rules follow torch's casts (checked against torch 2.15, tests/fixtures):
 *   f16     rounds past 65504 -> inf; NaN -> 0x7e00 | sign
 *   e4m3fn  no inf: finite overflow and inf saturate to +-448 (0x7e | sign), including the values
 *           in (464, 480) that would round into the NaN code; NaN -> 0x7f | sign. (Older torch
 *           releases turned |x| >= 480 and inf into NaN.)
 *   e5m2    |x| >= 61440 rounds to inf; NaN -> 0x7f | sign */
LUNAR_HD uint16_t lunar_f32_to_f16(float f) {
    uint32_t u = lunar_f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);
    return (uint16_t)(sign | lunar_small_float_code(a, 10, 15));
}

LUNAR_HD float lunar_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, code = h & 0x7fffu;
    if ((code >> 10) == 31) return lunar_bits_f32(sign | 0x7f800000u | ((code & 0x3ffu) << 13));
    return lunar_bits_f32(lunar_f32_bits(lunar_small_float_value(code, 10, 15)) | sign);
}

LUNAR_HD uint8_t lunar_f32_to_f8e4m3(float f) {
    uint32_t u = lunar_f32_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    uint32_t code = a >= 0x43f00000u ? 0x7eu : lunar_small_float_code(a, 3, 7);
    return (uint8_t)(sign | (code > 0x7eu ? 0x7eu : code));
}

LUNAR_HD float lunar_f8e4m3_to_f32(uint8_t b) {
    uint32_t code = b & 0x7fu;
    if (code == 0x7fu) return lunar_bits_f32(0x7fc00000u | ((uint32_t)(b & 0x80u) << 24));
    return lunar_bits_f32(lunar_f32_bits(lunar_small_float_value(code, 3, 7)) | ((uint32_t)(b & 0x80u) << 24));
}

LUNAR_HD uint8_t lunar_f32_to_f8e5m2(float f) {
    uint32_t u = lunar_f32_bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if (a >= 0x47800000u) return (uint8_t)(sign | 0x7cu);
    return (uint8_t)(sign | lunar_small_float_code(a, 2, 15));
}

LUNAR_HD float lunar_f8e5m2_to_f32(uint8_t b) {
    uint32_t code = b & 0x7fu, sign = (uint32_t)(b & 0x80u) << 24;
    if ((code >> 2) == 31) return lunar_bits_f32(sign | ((code & 3u) ? 0x7fc00000u : 0x7f800000u));
    return lunar_bits_f32(lunar_f32_bits(lunar_small_float_value(code, 2, 15)) | sign);
}

/* Saturating float8 casts (for quantisation): finite values clamp to +-max, inf to max, NaN
 * stays NaN. For e4m3fn this is what the plain cast does too; for e5m2 it differs (no inf). */
LUNAR_HD uint8_t lunar_f32_to_f8e4m3_sat(float f) {
    if (f == f) f = f > 448.0f ? 448.0f : (f < -448.0f ? -448.0f : f);
    return lunar_f32_to_f8e4m3(f);
}
LUNAR_HD uint8_t lunar_f32_to_f8e5m2_sat(float f) {
    if (f == f) f = f > 57344.0f ? 57344.0f : (f < -57344.0f ? -57344.0f : f);
    return lunar_f32_to_f8e5m2(f);
}

/* Read/write one element of any dtype as double (used by slow paths, printing and tests). */
double lunar_dtype_load(lunar_dtype dt, const void *p);
void   lunar_dtype_store(lunar_dtype dt, void *p, double v);

#ifdef __cplusplus
}
#endif

#endif
