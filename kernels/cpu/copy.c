/* copy.c: strided copy with dtype conversion, fill, arange and random fills on the CPU.
 *
 * The copy is the one CPU kernel that takes arbitrary strides (including 0 for broadcasting).
 * It merges dims that are laid out contiguously in both tensors, then walks the rows of the
 * innermost dim: each row is converted through a small stack buffer whose type depends only on
 * the dtype pair (i64 between integer types, f64 when either side is f64 or a wide integer,
 * f32 otherwise), with the dtype switch outside the per-element loops.
 */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "lunar/dtype.h"

#define ROW_CHUNK 512

typedef enum { VIA_F32, VIA_F64, VIA_I64 } via_kind;

static via_kind pick_via(lunar_dtype d, lunar_dtype s) {
    int di = lunar_dtype_is_int(d), si = lunar_dtype_is_int(s);
    if (di && si) return VIA_I64;
    if (d == LUNAR_DTYPE_F64 || s == LUNAR_DTYPE_F64) return VIA_F64;
    if (d == LUNAR_DTYPE_I32 || d == LUNAR_DTYPE_I64 || s == LUNAR_DTYPE_I32 || s == LUNAR_DTYPE_I64) return VIA_F64;
    return VIA_F32;
}

/* ---- loads into the conversion buffer -------------------------------------------------- */

static void load_f32(float *buf, lunar_dtype dt, const char *p, int64_t st, int64_t n) {
    switch (dt) {
    case LUNAR_DTYPE_F32: for (int64_t i = 0; i < n; i++) buf[i] = ((const float *)p)[i * st]; break;
    case LUNAR_DTYPE_BF16: for (int64_t i = 0; i < n; i++) buf[i] = lunar_bf16_to_f32(((const uint16_t *)p)[i * st]); break;
    case LUNAR_DTYPE_F16: for (int64_t i = 0; i < n; i++) buf[i] = lunar_f16_to_f32(((const uint16_t *)p)[i * st]); break;
    case LUNAR_DTYPE_F8E4M3: for (int64_t i = 0; i < n; i++) buf[i] = lunar_f8e4m3_to_f32(((const uint8_t *)p)[i * st]); break;
    case LUNAR_DTYPE_F8E5M2: for (int64_t i = 0; i < n; i++) buf[i] = lunar_f8e5m2_to_f32(((const uint8_t *)p)[i * st]); break;
    case LUNAR_DTYPE_I8: for (int64_t i = 0; i < n; i++) buf[i] = ((const int8_t *)p)[i * st]; break;
    case LUNAR_DTYPE_U8: for (int64_t i = 0; i < n; i++) buf[i] = ((const uint8_t *)p)[i * st]; break;
    case LUNAR_DTYPE_BOOL: for (int64_t i = 0; i < n; i++) buf[i] = ((const uint8_t *)p)[i * st] ? 1.0f : 0.0f; break;
    default: for (int64_t i = 0; i < n; i++) buf[i] = (float)lunar_dtype_load(dt, p + i * st * (int64_t)lunar_dtype_size(dt)); break;
    }
}

static void load_f64(double *buf, lunar_dtype dt, const char *p, int64_t st, int64_t n) {
    switch (dt) {
    case LUNAR_DTYPE_F64: for (int64_t i = 0; i < n; i++) buf[i] = ((const double *)p)[i * st]; break;
    case LUNAR_DTYPE_F32: for (int64_t i = 0; i < n; i++) buf[i] = ((const float *)p)[i * st]; break;
    case LUNAR_DTYPE_I32: for (int64_t i = 0; i < n; i++) buf[i] = ((const int32_t *)p)[i * st]; break;
    case LUNAR_DTYPE_I64: for (int64_t i = 0; i < n; i++) buf[i] = (double)((const int64_t *)p)[i * st]; break;
    default: {
        size_t es = lunar_dtype_size(dt);
        for (int64_t i = 0; i < n; i++) buf[i] = lunar_dtype_load(dt, p + i * st * (int64_t)es);
    }
    }
}

static void load_i64(int64_t *buf, lunar_dtype dt, const char *p, int64_t st, int64_t n) {
    switch (dt) {
    case LUNAR_DTYPE_I64: for (int64_t i = 0; i < n; i++) buf[i] = ((const int64_t *)p)[i * st]; break;
    case LUNAR_DTYPE_I32: for (int64_t i = 0; i < n; i++) buf[i] = ((const int32_t *)p)[i * st]; break;
    case LUNAR_DTYPE_I8: for (int64_t i = 0; i < n; i++) buf[i] = ((const int8_t *)p)[i * st]; break;
    case LUNAR_DTYPE_U8: for (int64_t i = 0; i < n; i++) buf[i] = ((const uint8_t *)p)[i * st]; break;
    case LUNAR_DTYPE_BOOL: for (int64_t i = 0; i < n; i++) buf[i] = ((const uint8_t *)p)[i * st] != 0; break;
    default: break;
    }
}

/* ---- stores from the conversion buffer ------------------------------------------------- */

static void store_f32(char *p, lunar_dtype dt, int64_t st, const float *buf, int64_t n, int saturate) {
    switch (dt) {
    case LUNAR_DTYPE_F32: for (int64_t i = 0; i < n; i++) ((float *)p)[i * st] = buf[i]; break;
    case LUNAR_DTYPE_BF16: for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[i * st] = lunar_f32_to_bf16(buf[i]); break;
    case LUNAR_DTYPE_F16: for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[i * st] = lunar_f32_to_f16(buf[i]); break;
    case LUNAR_DTYPE_F8E4M3:
        if (saturate) for (int64_t i = 0; i < n; i++) ((uint8_t *)p)[i * st] = lunar_f32_to_f8e4m3_sat(buf[i]);
        else for (int64_t i = 0; i < n; i++) ((uint8_t *)p)[i * st] = lunar_f32_to_f8e4m3(buf[i]);
        break;
    case LUNAR_DTYPE_F8E5M2:
        if (saturate) for (int64_t i = 0; i < n; i++) ((uint8_t *)p)[i * st] = lunar_f32_to_f8e5m2_sat(buf[i]);
        else for (int64_t i = 0; i < n; i++) ((uint8_t *)p)[i * st] = lunar_f32_to_f8e5m2(buf[i]);
        break;
    case LUNAR_DTYPE_BOOL: for (int64_t i = 0; i < n; i++) ((uint8_t *)p)[i * st] = buf[i] != 0.0f; break;
    default: {
        size_t es = lunar_dtype_size(dt);
        for (int64_t i = 0; i < n; i++) lunar_dtype_store(dt, p + i * st * (int64_t)es, buf[i]);
    }
    }
}

static void store_f64(char *p, lunar_dtype dt, int64_t st, const double *buf, int64_t n, int saturate) {
    switch (dt) {
    case LUNAR_DTYPE_F64: for (int64_t i = 0; i < n; i++) ((double *)p)[i * st] = buf[i]; break;
    case LUNAR_DTYPE_F32: for (int64_t i = 0; i < n; i++) ((float *)p)[i * st] = (float)buf[i]; break;
    case LUNAR_DTYPE_F8E4M3:
    case LUNAR_DTYPE_F8E5M2: {
        float tmp[ROW_CHUNK];
        for (int64_t i = 0; i < n; i++) tmp[i] = (float)buf[i];
        store_f32(p, dt, st, tmp, n, saturate);
        break;
    }
    default: {
        size_t es = lunar_dtype_size(dt);
        for (int64_t i = 0; i < n; i++) lunar_dtype_store(dt, p + i * st * (int64_t)es, buf[i]);
    }
    }
}

static void store_i64(char *p, lunar_dtype dt, int64_t st, const int64_t *buf, int64_t n) {
    switch (dt) {
    case LUNAR_DTYPE_I64: for (int64_t i = 0; i < n; i++) ((int64_t *)p)[i * st] = buf[i]; break;
    case LUNAR_DTYPE_I32: for (int64_t i = 0; i < n; i++) ((int32_t *)p)[i * st] = (int32_t)buf[i]; break;
    case LUNAR_DTYPE_I8: for (int64_t i = 0; i < n; i++) ((int8_t *)p)[i * st] = (int8_t)buf[i]; break;
    case LUNAR_DTYPE_U8: for (int64_t i = 0; i < n; i++) ((uint8_t *)p)[i * st] = (uint8_t)buf[i]; break;
    case LUNAR_DTYPE_BOOL: for (int64_t i = 0; i < n; i++) ((uint8_t *)p)[i * st] = buf[i] != 0; break;
    default: break;
    }
}

static void copy_same(char *d, int64_t ds, const char *s, int64_t ss, int64_t n, size_t es) {
    if (ds == 1 && ss == 1) { memcpy(d, s, (size_t)n * es); return; }
    switch (es) {
    case 1: for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss]; break;
    case 2: for (int64_t i = 0; i < n; i++) ((uint16_t *)d)[i * ds] = ((const uint16_t *)s)[i * ss]; break;
    case 4: for (int64_t i = 0; i < n; i++) ((uint32_t *)d)[i * ds] = ((const uint32_t *)s)[i * ss]; break;
    default: for (int64_t i = 0; i < n; i++) ((uint64_t *)d)[i * ds] = ((const uint64_t *)s)[i * ss]; break;
    }
}

/* one row of n elements, in chunks through the conversion buffer */
static void copy_row(char *d, lunar_dtype ddt, int64_t ds, const char *s, lunar_dtype sdt, int64_t ss, int64_t n,
                     via_kind via, int saturate) {
    size_t des = lunar_dtype_size(ddt), ses = lunar_dtype_size(sdt);
    if (ddt == sdt && !(saturate && (ddt == LUNAR_DTYPE_F8E4M3 || ddt == LUNAR_DTYPE_F8E5M2))) {
        copy_same(d, ds, s, ss, n, des);
        return;
    }
    for (int64_t c = 0; c < n; c += ROW_CHUNK) {
        int64_t m = n - c < ROW_CHUNK ? n - c : ROW_CHUNK;
        const char *sp = s + c * ss * (int64_t)ses;
        char *dp = d + c * ds * (int64_t)des;
        if (via == VIA_F32) {
            float buf[ROW_CHUNK];
            load_f32(buf, sdt, sp, ss, m);
            store_f32(dp, ddt, ds, buf, m, saturate);
        } else if (via == VIA_F64) {
            double buf[ROW_CHUNK];
            load_f64(buf, sdt, sp, ss, m);
            store_f64(dp, ddt, ds, buf, m, saturate);
        } else {
            int64_t buf[ROW_CHUNK];
            load_i64(buf, sdt, sp, ss, m);
            store_i64(dp, ddt, ds, buf, m);
        }
    }
}

lunar_status lunar_cpu_copy(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *src, int saturate) {
    (void)ctx;
    int64_t shape[LUNAR_MAX_DIMS], dstr[LUNAR_MAX_DIMS], sstr[LUNAR_MAX_DIMS];
    int nd = 0;
    /* drop size-1 dims, merge dims contiguous in both tensors */
    for (int i = 0; i < dst->ndim; i++) {
        if (dst->shape[i] == 0) return LUNAR_OK;
        if (dst->shape[i] == 1) continue;
        if (nd > 0 && dstr[nd - 1] == dst->stride[i] * dst->shape[i] && sstr[nd - 1] == src->stride[i] * dst->shape[i]) {
            shape[nd - 1] *= dst->shape[i];
            dstr[nd - 1] = dst->stride[i];
            sstr[nd - 1] = src->stride[i];
        } else {
            shape[nd] = dst->shape[i];
            dstr[nd] = dst->stride[i];
            sstr[nd] = src->stride[i];
            nd++;
        }
    }
    if (nd == 0) { shape[0] = 1; dstr[0] = 1; sstr[0] = 1; nd = 1; }
    int64_t n = shape[nd - 1], rows = 1;
    for (int i = 0; i < nd - 1; i++) rows *= shape[i];
    char *d = lunar_tensor_data(dst);
    const char *s = lunar_tensor_data(src);
    size_t des = lunar_dtype_size(dst->dtype), ses = lunar_dtype_size(src->dtype);
    via_kind via = pick_via(dst->dtype, src->dtype);
    lunar_dtype ddt = dst->dtype, sdt = src->dtype;
    int64_t ds = dstr[nd - 1], ss = sstr[nd - 1];
    /* work items are (row, block of the row) so that one long row is split across threads too */
    int64_t blk = n > 8192 ? 4096 : n, nblk = (n + blk - 1) / blk;
#pragma omp parallel for schedule(static) if (rows * n >= LUNAR_CPU_PAR_MIN)
    for (int64_t item = 0; item < rows * nblk; item++) {
        int64_t r = item / nblk, b0 = (item % nblk) * blk;
        int64_t m = n - b0 < blk ? n - b0 : blk;
        int64_t rem = r, doff = b0 * ds, soff = b0 * ss;
        for (int i = nd - 2; i >= 0; i--) {
            int64_t idx = rem % shape[i];
            rem /= shape[i];
            doff += idx * dstr[i];
            soff += idx * sstr[i];
        }
        copy_row(d + doff * (int64_t)des, ddt, ds, s + soff * (int64_t)ses, sdt, ss, m, via, saturate);
    }
    return LUNAR_OK;
}

lunar_status lunar_cpu_fill(lunar_ctx *ctx, lunar_tensor *t, double value) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(t);
    char *p = lunar_tensor_data(t);
    size_t es = lunar_dtype_size(t->dtype);
    if (n == 0) return LUNAR_OK;
    unsigned char one[8];
    lunar_dtype_store(t->dtype, one, value);
    if (t->dtype == LUNAR_DTYPE_F32) {
        float v;
        memcpy(&v, one, 4);
        float *f = (float *)p;
#pragma omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN)
        for (int64_t i = 0; i < n; i++) f[i] = v;
        return LUNAR_OK;
    }
    int all_same = 1;
    for (size_t i = 1; i < es; i++) all_same &= one[i] == one[0];
    if (all_same) {
        memset(p, one[0], (size_t)n * es);
        return LUNAR_OK;
    }
    for (int64_t i = 0; i < n; i++) memcpy(p + i * (int64_t)es, one, es);
    return LUNAR_OK;
}

lunar_status lunar_cpu_arange(lunar_ctx *ctx, lunar_tensor *t, double start, double step) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(t);
    char *p = lunar_tensor_data(t);
    size_t es = lunar_dtype_size(t->dtype);
    for (int64_t i = 0; i < n; i++) lunar_dtype_store(t->dtype, p + i * (int64_t)es, start + (double)i * step);
    return LUNAR_OK;
}

lunar_status lunar_cpu_rng_fill(lunar_ctx *ctx, lunar_tensor *out, lunar_rng_kind kind, uint64_t key, uint64_t counter,
                                double a, double b, double top) {
    (void)ctx;
    int64_t n = lunar_tensor_numel(out);
    char *p = lunar_tensor_data(out);
    lunar_dtype dt = out->dtype;
    size_t es = lunar_dtype_size(dt);
#pragma omp parallel for schedule(static) if (n >= LUNAR_CPU_PAR_MIN / 4)
    for (int64_t i = 0; i < n; i++) {
        uint32_t w[4];
        lunar_philox_element(key, counter + (uint64_t)i, w);
        double v;
        if (kind == LUNAR_RNG_UNIFORM) v = lunar_rng_uniform_below(w, a, b, top);
        else if (kind == LUNAR_RNG_NORMAL) v = lunar_rng_normal_value(w, a, b);
        else {
            int64_t iv = lunar_rng_randint_value(w, (int64_t)a, (int64_t)b);
            if (dt == LUNAR_DTYPE_I64) { ((int64_t *)p)[i] = iv; continue; }
            v = (double)iv;
        }
        if (dt == LUNAR_DTYPE_F32) ((float *)p)[i] = (float)v;
        else lunar_dtype_store(dt, p + i * (int64_t)es, v);
    }
    return LUNAR_OK;
}
