/* test_dtype_fixtures.c: lunar's dtype conversions against PyTorch's, bit for bit.
 *
 * tests/fixtures/dtype_conversions.bin holds torch's results (made by make_dtype_fixtures.py,
 * whose docstring describes the layout): f32 inputs cast to bf16, f16, float8_e4m3fn and
 * float8_e5m2 (plain and saturating), every code of those four types decoded to f32, and every
 * code of each cast to the other three. Each is checked twice: the scalar functions of
 * lunar/dtype.h, and the tensor cast lunar_copy / lunar_copy_saturate (contiguous, and between
 * strided views) on the CPU and, when one is present, on the first GPU.
 *
 * NaN: torch's NaN bits depend on the code path (its CPU bf16 cast writes 0xffff for every NaN,
 * scalar c10 code 0x7fc0; decoding keeps or quiets payloads differently), so where torch gives
 * a NaN lunar must give a NaN of the same type, with the same sign except for bf16 results.
 * Every other result, including -0, infinities and subnormals, must match exactly.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lunar/backend.h"
#include "lunar/ops.h"
#include "lunar/tensor.h"

#ifndef LUNAR_SOURCE_DIR
#define LUNAR_SOURCE_DIR "."
#endif

static const lunar_device CPU = {LUNAR_DEVICE_CPU, 0};

/* ---- the formats ------------------------------------------------------------------------ */

typedef enum { FMT_F32, FMT_BF16, FMT_F16, FMT_E4M3, FMT_E5M2, FMT_COUNT } fmt;

static const struct {
    const char *name;   /* as in the fixture's section names */
    lunar_dtype dt;
    size_t size;
} FMT[FMT_COUNT] = {
    [FMT_F32] = {"f32", LUNAR_DTYPE_F32, 4},
    [FMT_BF16] = {"bf16", LUNAR_DTYPE_BF16, 2},
    [FMT_F16] = {"f16", LUNAR_DTYPE_F16, 2},
    [FMT_E4M3] = {"e4m3fn", LUNAR_DTYPE_F8E4M3, 1},
    [FMT_E5M2] = {"e5m2", LUNAR_DTYPE_F8E5M2, 1},
};

static int is_nan(fmt f, uint32_t c) {
    switch (f) {
    case FMT_F32: return (c & 0x7fffffffu) > 0x7f800000u;
    case FMT_BF16: return (c & 0x7fffu) > 0x7f80u;
    case FMT_F16: return (c & 0x7fffu) > 0x7c00u;
    case FMT_E4M3: return (c & 0x7fu) == 0x7fu;
    case FMT_E5M2: return (c & 0x7fu) > 0x7cu;
    default: return 0;
    }
}

static uint32_t sign_bit(fmt f) { return 1u << (8 * FMT[f].size - 1); }

/* torch's NaN bits are not portable: a NaN must meet a NaN (same sign except for bf16) */
static int same_code(fmt f, uint32_t expect, uint32_t got) {
    if (is_nan(f, expect)) {
        if (!is_nan(f, got)) return 0;
        return f == FMT_BF16 || (expect & sign_bit(f)) == (got & sign_bit(f));
    }
    return expect == got;
}

/* the scalar API: encode an f32 into f (sat: the saturating float8 casts), decode f to f32 */
static uint32_t encode(fmt f, float x, int sat) {
    switch (f) {
    case FMT_F32: return lunar_f32_bits(x);
    case FMT_BF16: return lunar_f32_to_bf16(x);
    case FMT_F16: return lunar_f32_to_f16(x);
    case FMT_E4M3: return sat ? lunar_f32_to_f8e4m3_sat(x) : lunar_f32_to_f8e4m3(x);
    case FMT_E5M2: return sat ? lunar_f32_to_f8e5m2_sat(x) : lunar_f32_to_f8e5m2(x);
    default: return 0;
    }
}

static float decode(fmt f, uint32_t c) {
    switch (f) {
    case FMT_F32: return lunar_bits_f32(c);
    case FMT_BF16: return lunar_bf16_to_f32((uint16_t)c);
    case FMT_F16: return lunar_f16_to_f32((uint16_t)c);
    case FMT_E4M3: return lunar_f8e4m3_to_f32((uint8_t)c);
    case FMT_E5M2: return lunar_f8e5m2_to_f32((uint8_t)c);
    default: return 0.0f;
    }
}

/* little-endian element i of size `size` at p */
static uint32_t get_code(const void *p, size_t size, int64_t i) {
    const uint8_t *b = (const uint8_t *)p + (size_t)i * size;
    uint32_t v = 0;
    for (size_t k = 0; k < size; k++) v |= (uint32_t)b[k] << (8 * k);
    return v;
}

static void put_code(void *p, size_t size, int64_t i, uint32_t v) {
    uint8_t *b = (uint8_t *)p + (size_t)i * size;
    for (size_t k = 0; k < size; k++) b[k] = (uint8_t)(v >> (8 * k));
}

/* ---- the fixture -------------------------------------------------------------------------- */

typedef struct {
    char name[25];
    uint32_t size, count;
    const uint8_t *data;
} section;

typedef struct {
    uint8_t *buf;
    char torch_version[49];
    int nsec;
    section sec[64];
} fixture;

static int load_fixture(fixture *fx, const char *path) {
    memset(fx, 0, sizeof *fx);
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", path); return 0; }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    fx->buf = malloc((size_t)n);
    size_t got = fx->buf ? fread(fx->buf, 1, (size_t)n, f) : 0;
    fclose(f);
    if (got != (size_t)n || n < 64 || memcmp(fx->buf, "LUNARDTF", 8) != 0) {
        fprintf(stderr, "%s: not a lunar dtype fixture\n", path);
        return 0;
    }
    uint32_t version = get_code(fx->buf + 8, 4, 0), nsec = get_code(fx->buf + 12, 4, 0);
    if (version != 1 || nsec > 64) { fprintf(stderr, "%s: format %u, %u sections\n", path, version, nsec); return 0; }
    memcpy(fx->torch_version, fx->buf + 16, 48);
    size_t at = 64;
    for (uint32_t s = 0; s < nsec; s++) {
        section *sc = &fx->sec[s];
        if (at + 32 > (size_t)n) { fprintf(stderr, "%s: truncated\n", path); return 0; }
        memcpy(sc->name, fx->buf + at, 24);
        sc->size = get_code(fx->buf + at + 24, 4, 0);
        sc->count = get_code(fx->buf + at + 28, 4, 0);
        sc->data = fx->buf + at + 32;
        at += 32 + (size_t)sc->size * sc->count;
        if (at > (size_t)n) { fprintf(stderr, "%s: section %s truncated\n", path, sc->name); return 0; }
    }
    fx->nsec = (int)nsec;
    return 1;
}

static const section *find(const fixture *fx, const char *name) {
    for (int i = 0; i < fx->nsec; i++)
        if (strcmp(fx->sec[i].name, name) == 0) return &fx->sec[i];
    fprintf(stderr, "FAIL: the fixture has no section '%s'\n", name);
    return NULL;
}

/* ---- checking ----------------------------------------------------------------------------- */

typedef struct {
    int failures;     /* checks (sections x paths) with at least one mismatch */
    int64_t compared; /* values compared in all */
    int64_t nan_bits; /* NaN results that are NaN in both but with other bits (allowed) */
} tally;

/* Compare got[0..n) (codes of format out) with torch's section; inputs in[] (codes of format
 * in) are printed with the first mismatches. */
static void compare(tally *t, const char *what, fmt in, const uint32_t *inputs, fmt out, const section *exp,
                    const uint32_t *got, int64_t n) {
    if (!exp) { t->failures++; return; }
    if ((int64_t)exp->count != n || exp->size != FMT[out].size) {
        fprintf(stderr, "FAIL %s: section %s has %u x %u bytes, want %lld x %zu\n", what, exp->name, exp->count,
                exp->size, (long long)n, FMT[out].size);
        t->failures++;
        return;
    }
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t e = get_code(exp->data, exp->size, i);
        if (same_code(out, e, got[i])) {
            t->nan_bits += e != got[i];
            continue;
        }
        if (bad++ < 8) {
            int w = (int)FMT[in].size * 2, wo = (int)FMT[out].size * 2;
            fprintf(stderr, "  %s: %s 0x%0*x (%.9g): torch 0x%0*x, lunar 0x%0*x\n", what, FMT[in].name, w, inputs[i],
                    (double)decode(in, inputs[i]), wo, e, wo, got[i]);
        }
    }
    t->compared += n;
    if (bad) {
        fprintf(stderr, "FAIL %s: %lld of %lld differ from torch\n", what, (long long)bad, (long long)n);
        t->failures++;
    }
}

/* lunar_copy(_saturate) of the codes in[0..n) (format fi) into format fo on device dev, into
 * got[]; strided: between a column of an (n, 2) source and a column of an (n, 3) destination,
 * whose other columns must be left alone. On a GPU the codes go there and back with lunar_copy
 * of the whole (same-dtype) tensors. Returns 0 (after printing) on an error status. */
static int tensor_cast(lunar_ctx *ctx, lunar_device dev, fmt fi, const uint32_t *in, fmt fo, uint32_t *got,
                       int64_t n, int sat, int strided) {
    lunar_tensor hs = {0}, hd = {0}, ds = {0}, dd = {0}, sv = {0}, dv = {0};
    int64_t sshape[2] = {n, 2}, dshape[2] = {n, 3};
    int nd = strided ? 2 : 1, on_cpu = dev.type == LUNAR_DEVICE_CPU;
    size_t si = FMT[fi].size, so = FMT[fo].size;
    uint32_t fill = 0xa5a5a5a5u >> (32 - 8 * so);
    int ok = lunar_tensor_new(ctx, &hs, FMT[fi].dt, CPU, nd, sshape) == LUNAR_OK &&
             lunar_tensor_new(ctx, &hd, FMT[fo].dt, CPU, nd, dshape) == LUNAR_OK;
    uint8_t *sp = ok ? lunar_tensor_data(&hs) : NULL, *dp = ok ? lunar_tensor_data(&hd) : NULL;
    if (ok) {
        memset(sp, 0x3c, lunar_tensor_nbytes(&hs));
        memset(dp, 0xa5, lunar_tensor_nbytes(&hd));
        for (int64_t i = 0; i < n; i++) put_code(sp, si, strided ? 2 * i : i, in[i]);
    }
    if (ok && on_cpu) {
        lunar_tensor_share(&ds, &hs);
        lunar_tensor_share(&dd, &hd);
    } else if (ok) {
        ok = lunar_tensor_new(ctx, &ds, FMT[fi].dt, dev, nd, sshape) == LUNAR_OK &&
             lunar_tensor_new(ctx, &dd, FMT[fo].dt, dev, nd, dshape) == LUNAR_OK &&
             lunar_copy(ctx, &ds, &hs) == LUNAR_OK && lunar_copy(ctx, &dd, &hd) == LUNAR_OK;
    }
    if (ok && strided) {
        ok = lunar_tensor_select(ctx, &sv, &ds, 1, 0) == LUNAR_OK && lunar_tensor_select(ctx, &dv, &dd, 1, 2) == LUNAR_OK;
    } else if (ok) {
        lunar_tensor_share(&sv, &ds);
        lunar_tensor_share(&dv, &dd);
    }
    if (ok) ok = (sat ? lunar_copy_saturate(ctx, &dv, &sv) : lunar_copy(ctx, &dv, &sv)) == LUNAR_OK;
    if (ok && !on_cpu) ok = lunar_copy(ctx, &hd, &dd) == LUNAR_OK;
    if (!ok) fprintf(stderr, "FAIL copy %s -> %s: %s\n", FMT[fi].name, FMT[fo].name, lunar_ctx_error(ctx));
    for (int64_t i = 0; ok && i < n; i++) {
        got[i] = get_code(dp, so, strided ? 3 * i + 2 : i);
        if (strided && (get_code(dp, so, 3 * i) != fill || get_code(dp, so, 3 * i + 1) != fill)) {
            fprintf(stderr, "FAIL copy %s -> %s (strided) wrote outside its column at row %lld\n", FMT[fi].name,
                    FMT[fo].name, (long long)i);
            ok = 0;
        }
    }
    lunar_tensor *all[6] = {&sv, &dv, &ds, &dd, &hs, &hd};
    for (int i = 0; i < 6; i++) lunar_tensor_release(ctx, all[i]);
    return ok;
}

/* the devices lunar_copy is checked on: the CPU, and the first GPU when there is one */
typedef struct {
    lunar_device dev[2];
    int n;
} device_list;

static device_list devices(lunar_ctx *ctx) {
    device_list d = {{CPU, CPU}, 1};
    const lunar_backend *be = lunar_ctx_backend(ctx, LUNAR_DEVICE_CUDA);
    int count = 0;
    if (be && be->device_count(ctx, &count) == LUNAR_OK && count > 0) {
        d.dev[1] = (lunar_device){LUNAR_DEVICE_CUDA, 0};
        d.n = 2;
    }
    lunar_ctx_clear_error(ctx);
    return d;
}

/* one conversion in[] (fi) -> fo checked by the scalar functions and by lunar_copy (contiguous
 * and strided, on each device) against torch's section */
static void check_cast(lunar_ctx *ctx, tally *t, const fixture *fx, const char *sec_name, fmt fi, const uint32_t *in,
                       fmt fo, int64_t n, int sat) {
    const section *exp = find(fx, sec_name);
    uint32_t *got = malloc((size_t)n * sizeof *got);
    char what[128], dname[32];
    for (int64_t i = 0; i < n; i++) got[i] = encode(fo, decode(fi, in[i]), sat);
    snprintf(what, sizeof what, "%s (scalar)", sec_name);
    compare(t, what, fi, in, fo, exp, got, n);
    device_list dl = devices(ctx);
    for (int d = 0; d < dl.n; d++) {
        lunar_device_format(dl.dev[d], dname, sizeof dname);
        for (int strided = 0; strided < 2; strided++) {
            snprintf(what, sizeof what, "%s (lunar_copy%s on %s%s)", sec_name, sat ? "_saturate" : "", dname,
                     strided ? ", strided" : "");
            if (!tensor_cast(ctx, dl.dev[d], fi, in, fo, got, n, sat, strided)) { t->failures++; continue; }
            compare(t, what, fi, in, fo, exp, got, n);
        }
    }
    free(got);
}

int main(void) {
    const char *path = getenv("LUNAR_DTYPE_FIXTURE");
    if (!path) path = LUNAR_SOURCE_DIR "/tests/fixtures/dtype_conversions.bin";
    fixture fx;
    if (!load_fixture(&fx, path)) { free(fx.buf); return 1; }
    lunar_ctx *ctx = NULL;
    if (lunar_ctx_init(&ctx) != LUNAR_OK) return 1;
    tally t = {0, 0, 0};

    /* f32 inputs -> each type, plain and saturating */
    const section *inputs = find(&fx, "f32_inputs");
    if (inputs) {
        int64_t n = inputs->count;
        uint32_t *in = malloc((size_t)n * sizeof *in);
        for (int64_t i = 0; i < n; i++) in[i] = get_code(inputs->data, 4, i);
        char name[64];
        for (int f = FMT_BF16; f < FMT_COUNT; f++) {
            snprintf(name, sizeof name, "f32_to_%s", FMT[f].name);
            check_cast(ctx, &t, &fx, name, FMT_F32, in, (fmt)f, n, 0);
        }
        check_cast(ctx, &t, &fx, "f32_to_e4m3fn_sat", FMT_F32, in, FMT_E4M3, n, 1);
        check_cast(ctx, &t, &fx, "f32_to_e5m2_sat", FMT_F32, in, FMT_E5M2, n, 1);
        free(in);
    } else {
        t.failures++;
    }

    /* every code of each small type -> f32 and -> each other small type */
    uint32_t *codes = malloc(65536 * sizeof *codes);
    for (uint32_t c = 0; c < 65536; c++) codes[c] = c;
    char name[64];
    for (int fi = FMT_BF16; fi < FMT_COUNT; fi++) {
        int64_t n = FMT[fi].size == 2 ? 65536 : 256;
        for (int fo = FMT_F32; fo < FMT_COUNT; fo++) {
            if (fo == fi) continue;
            snprintf(name, sizeof name, "%s_to_%s", FMT[fi].name, FMT[fo].name);
            check_cast(ctx, &t, &fx, name, (fmt)fi, codes, (fmt)fo, n, 0);
        }
    }
    free(codes);

    device_list dl = devices(ctx);
    printf("test_dtype_fixtures: lunar_copy checked on the cpu%s\n", dl.n > 1 ? " and cuda:0" : " only (no GPU)");
    printf("test_dtype_fixtures: %lld values compared with torch %s: %s (%lld NaN results differ from "
           "torch's only in payload bits, or for bf16 the sign, as allowed)\n",
           (long long)t.compared, fx.torch_version, t.failures ? "FAILED" : "all equal", (long long)t.nan_bits);
    lunar_ctx_free(ctx);
    free(fx.buf);
    return t.failures ? 1 : 0;
}
