/* dtype.c: the dtype table, names, and the generic load/store used by slow paths. */
#include <math.h>
#include <string.h>

#include "lunar/dtype.h"

static const struct { const char *name; size_t size; int is_float; } dtype_info[LUNAR_DTYPE_COUNT] = {
    [LUNAR_DTYPE_F32] = {"f32", 4, 1},
    [LUNAR_DTYPE_F64] = {"f64", 8, 1},
    [LUNAR_DTYPE_BF16] = {"bf16", 2, 1},
    [LUNAR_DTYPE_F16] = {"f16", 2, 1},
    [LUNAR_DTYPE_F8E4M3] = {"f8e4m3", 1, 1},
    [LUNAR_DTYPE_F8E5M2] = {"f8e5m2", 1, 1},
    [LUNAR_DTYPE_I8] = {"i8", 1, 0},
    [LUNAR_DTYPE_I32] = {"i32", 4, 0},
    [LUNAR_DTYPE_I64] = {"i64", 8, 0},
    [LUNAR_DTYPE_U8] = {"u8", 1, 0},
    [LUNAR_DTYPE_BOOL] = {"bool", 1, 0},
};

size_t lunar_dtype_size(lunar_dtype dt) {
    return (unsigned)dt < LUNAR_DTYPE_COUNT ? dtype_info[dt].size : 0;
}

const char *lunar_dtype_name(lunar_dtype dt) {
    return (unsigned)dt < LUNAR_DTYPE_COUNT ? dtype_info[dt].name : "invalid";
}

int lunar_dtype_is_float(lunar_dtype dt) { return (unsigned)dt < LUNAR_DTYPE_COUNT && dtype_info[dt].is_float; }
int lunar_dtype_is_int(lunar_dtype dt) { return (unsigned)dt < LUNAR_DTYPE_COUNT && !dtype_info[dt].is_float; }

int lunar_dtype_int_range(lunar_dtype dt, int64_t *min, int64_t *max) {
    switch (dt) {
    case LUNAR_DTYPE_I8: *min = INT8_MIN, *max = INT8_MAX; return 1;
    case LUNAR_DTYPE_U8: *min = 0, *max = UINT8_MAX; return 1;
    case LUNAR_DTYPE_BOOL: *min = 0, *max = 1; return 1;
    case LUNAR_DTYPE_I32: *min = INT32_MIN, *max = INT32_MAX; return 1;
    case LUNAR_DTYPE_I64: *min = INT64_MIN, *max = INT64_MAX; return 1;
    default: return 0;
    }
}

int lunar_dtype_from_name(const char *name, lunar_dtype *out) {
    static const struct { const char *alias; lunar_dtype dt; } aliases[] = {
        {"float32", LUNAR_DTYPE_F32}, {"float", LUNAR_DTYPE_F32}, {"F32", LUNAR_DTYPE_F32},
        {"float64", LUNAR_DTYPE_F64}, {"double", LUNAR_DTYPE_F64}, {"F64", LUNAR_DTYPE_F64},
        {"bfloat16", LUNAR_DTYPE_BF16}, {"BF16", LUNAR_DTYPE_BF16},
        {"float16", LUNAR_DTYPE_F16}, {"half", LUNAR_DTYPE_F16}, {"F16", LUNAR_DTYPE_F16},
        {"float8_e4m3fn", LUNAR_DTYPE_F8E4M3}, {"F8_E4M3", LUNAR_DTYPE_F8E4M3}, {"fp8", LUNAR_DTYPE_F8E4M3},
        {"float8_e5m2", LUNAR_DTYPE_F8E5M2}, {"F8_E5M2", LUNAR_DTYPE_F8E5M2},
        {"int8", LUNAR_DTYPE_I8}, {"I8", LUNAR_DTYPE_I8},
        {"int32", LUNAR_DTYPE_I32}, {"int", LUNAR_DTYPE_I32}, {"I32", LUNAR_DTYPE_I32},
        {"int64", LUNAR_DTYPE_I64}, {"long", LUNAR_DTYPE_I64}, {"I64", LUNAR_DTYPE_I64},
        {"uint8", LUNAR_DTYPE_U8}, {"byte", LUNAR_DTYPE_U8}, {"U8", LUNAR_DTYPE_U8},
        {"BOOL", LUNAR_DTYPE_BOOL},
    };
    if (!name) return 0;
    for (int i = 0; i < LUNAR_DTYPE_COUNT; i++)
        if (strcmp(name, dtype_info[i].name) == 0) { *out = (lunar_dtype)i; return 1; }
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
        if (strcmp(name, aliases[i].alias) == 0) { *out = aliases[i].dt; return 1; }
    return 0;
}

double lunar_dtype_load(lunar_dtype dt, const void *p) {
    switch (dt) {
    case LUNAR_DTYPE_F32: { float v; memcpy(&v, p, 4); return v; }
    case LUNAR_DTYPE_F64: { double v; memcpy(&v, p, 8); return v; }
    case LUNAR_DTYPE_BF16: { uint16_t v; memcpy(&v, p, 2); return lunar_bf16_to_f32(v); }
    case LUNAR_DTYPE_F16: { uint16_t v; memcpy(&v, p, 2); return lunar_f16_to_f32(v); }
    case LUNAR_DTYPE_F8E4M3: return lunar_f8e4m3_to_f32(*(const uint8_t *)p);
    case LUNAR_DTYPE_F8E5M2: return lunar_f8e5m2_to_f32(*(const uint8_t *)p);
    case LUNAR_DTYPE_I8: return *(const int8_t *)p;
    case LUNAR_DTYPE_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case LUNAR_DTYPE_I64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case LUNAR_DTYPE_U8: return *(const uint8_t *)p;
    case LUNAR_DTYPE_BOOL: return *(const uint8_t *)p ? 1.0 : 0.0;
    default: return 0.0;
    }
}

/* Float to integer conversion truncates toward zero like a C cast (and torch), with NaN and
 * out-of-range values clamped so that the conversion is never undefined behaviour. */
static int64_t double_to_i64(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775807.0) return INT64_MAX;
    if (v <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}

void lunar_dtype_store(lunar_dtype dt, void *p, double v) {
    switch (dt) {
    case LUNAR_DTYPE_F32: { float f = (float)v; memcpy(p, &f, 4); break; }
    case LUNAR_DTYPE_F64: memcpy(p, &v, 8); break;
    case LUNAR_DTYPE_BF16: { uint16_t h = lunar_f32_to_bf16((float)v); memcpy(p, &h, 2); break; }
    case LUNAR_DTYPE_F16: { uint16_t h = lunar_f32_to_f16((float)v); memcpy(p, &h, 2); break; }
    case LUNAR_DTYPE_F8E4M3: *(uint8_t *)p = lunar_f32_to_f8e4m3((float)v); break;
    case LUNAR_DTYPE_F8E5M2: *(uint8_t *)p = lunar_f32_to_f8e5m2((float)v); break;
    case LUNAR_DTYPE_I8: *(int8_t *)p = (int8_t)double_to_i64(v); break;
    case LUNAR_DTYPE_I32: { int32_t i = (int32_t)double_to_i64(v); memcpy(p, &i, 4); break; }
    case LUNAR_DTYPE_I64: { int64_t i = double_to_i64(v); memcpy(p, &i, 8); break; }
    case LUNAR_DTYPE_U8: *(uint8_t *)p = (uint8_t)double_to_i64(v); break;
    case LUNAR_DTYPE_BOOL: *(uint8_t *)p = v != 0.0; break;
    default: break;
    }
}
