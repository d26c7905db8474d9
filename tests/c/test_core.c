/* test_core.c: the C core without Lua: views, arenas (stale detection), pool reuse, scopes,
 * dtype conversions at their edges, RNG determinism and splitting, copy with broadcasting, and
 * the CPU kernels' vectorised exponential. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lunar/ops.h"
#include "lunar/rng.h"
#include "lunar/tensor.h"
#include "cpu/vecmath.h"

static int failures = 0;
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);\
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
        }                                                                  \
    } while (0)

static const lunar_device CPU = {LUNAR_DEVICE_CPU, 0};

static float at(const lunar_tensor *t, int64_t i, int64_t j) {
    return ((float *)t->storage->data)[t->offset + i * t->stride[0] + j * t->stride[1]];
}

static void test_views(lunar_ctx *ctx) {
    lunar_tensor a = {0}, v = {0}, tr = {0}, n = {0}, r = {0};
    int64_t shape[2] = {3, 4};
    CHECK(lunar_tensor_new(ctx, &a, LUNAR_DTYPE_F32, CPU, 2, shape) == LUNAR_OK, "new");
    CHECK(lunar_arange(ctx, &a, 0, 1) == LUNAR_OK, "arange: %s", lunar_ctx_error(ctx));
    CHECK(lunar_tensor_transpose(ctx, &tr, &a, 0, 1) == LUNAR_OK, "transpose");
    CHECK(tr.shape[0] == 4 && tr.shape[1] == 3 && !lunar_tensor_is_contiguous(&tr), "transposed shape");
    CHECK(at(&tr, 1, 2) == 9.0f, "tr[1][2] = %g", at(&tr, 1, 2));
    CHECK(lunar_tensor_narrow(ctx, &n, &a, 1, 1, 2) == LUNAR_OK, "narrow");
    CHECK(at(&n, 2, 0) == 9.0f, "narrow value %g", at(&n, 2, 0));
    int64_t flat[1] = {12};
    CHECK(lunar_tensor_view(ctx, &v, &a, 1, flat) == LUNAR_OK, "view contiguous");
    CHECK(lunar_tensor_view(ctx, &r, &tr, 1, flat) == LUNAR_ERR_SHAPE, "view of a transpose must fail");
    CHECK(strstr(lunar_ctx_error(ctx), "not contiguous") != NULL, "message: %s", lunar_ctx_error(ctx));
    int64_t split[3] = {3, 2, 2};
    lunar_tensor s = {0};
    CHECK(lunar_tensor_view(ctx, &s, &a, 3, split) == LUNAR_OK, "split last dim");
    CHECK(s.stride[0] == 4 && s.stride[1] == 2 && s.stride[2] == 1, "strides %lld %lld %lld", (long long)s.stride[0],
          (long long)s.stride[1], (long long)s.stride[2]);
    /* copy a transposed view into a contiguous tensor */
    lunar_tensor c = {0};
    int64_t cs[2] = {4, 3};
    CHECK(lunar_tensor_new(ctx, &c, LUNAR_DTYPE_F32, CPU, 2, cs) == LUNAR_OK, "new");
    CHECK(lunar_copy(ctx, &c, &tr) == LUNAR_OK, "copy");
    CHECK(((float *)c.storage->data)[1 * 3 + 2] == 9.0f, "copied transpose");
    /* broadcast a row into a matrix */
    lunar_tensor row = {0}, m = {0};
    int64_t rs[1] = {3};
    lunar_tensor_new(ctx, &row, LUNAR_DTYPE_F32, CPU, 1, rs);
    lunar_arange(ctx, &row, 10, 1);
    lunar_tensor_new(ctx, &m, LUNAR_DTYPE_F32, CPU, 2, cs);
    CHECK(lunar_copy(ctx, &m, &row) == LUNAR_OK, "broadcast copy: %s", lunar_ctx_error(ctx));
    CHECK(((float *)m.storage->data)[3 * 3 + 2] == 12.0f, "broadcast value");
    lunar_tensor *all[] = {&a, &v, &tr, &n, &r, &s, &c, &row, &m};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) lunar_tensor_release(ctx, all[i]);
}

static void test_arena(lunar_ctx *ctx) {
    lunar_arena *ar = NULL;
    CHECK(lunar_arena_new(ctx, &ar, "step", CPU, 1 << 16) == LUNAR_OK, "arena");
    lunar_tensor t = {0}, big = {0};
    int64_t shape[1] = {100};
    CHECK(lunar_tensor_new_in(ctx, &t, ar, LUNAR_DTYPE_F32, 1, shape) == LUNAR_OK, "alloc");
    lunar_tensor_set_name(&t, "layers.3.attn.q");
    CHECK(lunar_tensor_check(ctx, &t) == LUNAR_OK, "valid before reset");
    lunar_arena_reset(ar);
    CHECK(lunar_tensor_check(ctx, &t) == LUNAR_ERR_STALE, "stale after reset");
    CHECK(strstr(lunar_ctx_error(ctx), "layers.3.attn.q") && strstr(lunar_ctx_error(ctx), "'step'"), "message names tensor and arena: %s",
          lunar_ctx_error(ctx));
    int64_t huge[1] = {1 << 20};
    CHECK(lunar_tensor_new_in(ctx, &big, ar, LUNAR_DTYPE_F32, 1, huge) == LUNAR_ERR_OOM, "arena full");
    CHECK(strstr(lunar_ctx_error(ctx), "is full") != NULL, "full message: %s", lunar_ctx_error(ctx));
    lunar_arena_release(ctx, ar);   /* the owner goes; t still holds the header */
    CHECK(lunar_tensor_check(ctx, &t) == LUNAR_ERR_STALE, "still stale");
    lunar_tensor_release(ctx, &t);
}

static void test_pool_and_scope(lunar_ctx *ctx) {
    lunar_pool *p;
    lunar_ctx_pool(ctx, CPU, &p);
    lunar_pool_stats before = lunar_pool_stats_get(p);
    lunar_tensor t = {0};
    int64_t shape[1] = {1000};
    lunar_tensor_new(ctx, &t, LUNAR_DTYPE_F32, CPU, 1, shape);
    lunar_storage_free(ctx, t.storage);
    CHECK(lunar_tensor_check(ctx, &t) == LUNAR_ERR_STALE, "freed tensor is stale");
    CHECK(strstr(lunar_ctx_error(ctx), "used after free") != NULL, "%s", lunar_ctx_error(ctx));
    lunar_storage_free(ctx, t.storage);   /* idempotent */
    lunar_tensor_release(ctx, &t);
    lunar_tensor u = {0};
    lunar_tensor_new(ctx, &u, LUNAR_DTYPE_F32, CPU, 1, shape);
    lunar_pool_stats after = lunar_pool_stats_get(p);
    CHECK(after.reuses > before.reuses, "the freed block was reused");
    lunar_tensor_release(ctx, &u);

    lunar_tensor a = {0}, b = {0};
    lunar_scope_push(ctx);
    lunar_tensor_new(ctx, &a, LUNAR_DTYPE_F32, CPU, 1, shape);
    lunar_scope_track(ctx, a.storage);
    lunar_tensor_new(ctx, &b, LUNAR_DTYPE_F32, CPU, 1, shape);
    lunar_scope_track(ctx, b.storage);
    lunar_scope_keep(ctx, b.storage);
    lunar_scope_pop(ctx);
    CHECK(lunar_tensor_check(ctx, &a) == LUNAR_ERR_STALE, "scope freed a");
    CHECK(lunar_tensor_check(ctx, &b) == LUNAR_OK, "scope kept b");
    lunar_tensor_release(ctx, &a);
    lunar_tensor_release(ctx, &b);
}

static void test_dtypes(void) {
    CHECK(lunar_f32_to_bf16(1.0f) == 0x3f80, "bf16 1");
    CHECK(lunar_f32_to_bf16(lunar_bits_f32(0x3f808000u)) == 0x3f80, "bf16 tie to even (down)");
    CHECK(lunar_f32_to_bf16(lunar_bits_f32(0x3f818000u)) == 0x3f82, "bf16 tie to even (up)");
    CHECK(lunar_f32_to_f8e4m3(448.0f) == 0x7e, "e4m3 max");
    CHECK(lunar_f32_to_f8e4m3(1000.0f) == 0x7e, "e4m3 overflow saturates like torch 2.15");
    CHECK(lunar_f32_to_f8e4m3_sat(1000.0f) == 0x7e, "e4m3 saturating cast");
    CHECK(lunar_f8e4m3_to_f32(0x01) == ldexpf(1.0f, -9), "e4m3 smallest subnormal");
    CHECK(lunar_f32_to_f8e5m2(1e6f) == 0x7c, "e5m2 overflow is inf");
    CHECK(lunar_f32_to_f16(65520.0f) == 0x7c00, "f16 rounds to inf");
    CHECK(lunar_f32_to_f16(65504.0f) == 0x7bff, "f16 max");
    CHECK(lunar_f16_to_f32(0x0001) == ldexpf(1.0f, -24), "f16 smallest subnormal");
    /* every e4m3 / e5m2 code decodes and re-encodes to itself (NaN codes aside) */
    for (int b = 0; b < 256; b++) {
        float f = lunar_f8e4m3_to_f32((uint8_t)b);
        if (f == f) CHECK(lunar_f32_to_f8e4m3(f) == b, "e4m3 round trip %02x", b);
        float g = lunar_f8e5m2_to_f32((uint8_t)b);
        if (g == g) CHECK(lunar_f32_to_f8e5m2(g) == b, "e5m2 round trip %02x", b);
    }
}

static void test_rng(lunar_ctx *ctx) {
    lunar_rng r1, r2;
    lunar_rng_seed(&r1, 42);
    lunar_rng_seed(&r2, 42);
    lunar_tensor a = {0}, b = {0};
    int64_t shape[1] = {1000};
    lunar_tensor_new(ctx, &a, LUNAR_DTYPE_F32, CPU, 1, shape);
    lunar_tensor_new(ctx, &b, LUNAR_DTYPE_F32, CPU, 1, shape);
    lunar_rng_normal(ctx, &a, &r1, 0, 1);
    lunar_rng_normal(ctx, &b, &r2, 0, 1);
    CHECK(memcmp(a.storage->data, b.storage->data, 4000) == 0, "same seed, same numbers");
    CHECK(r1.counter == 1000, "counter advanced by numel");
    double s = 0, s2 = 0;
    for (int i = 0; i < 1000; i++) { double x = ((float *)a.storage->data)[i]; s += x; s2 += x * x; }
    CHECK(fabs(s / 1000) < 0.15 && fabs(s2 / 1000 - 1) < 0.15, "normal moments %g %g", s / 1000, s2 / 1000);
    lunar_rng c1 = lunar_rng_split(&r1, 1), c2 = lunar_rng_split(&r1, 2);
    CHECK(c1.key != c2.key && c1.key != r1.key, "split keys differ");
    /* drawing 1000 numbers at once equals drawing 400 then 600 */
    lunar_rng r3, r4;
    lunar_rng_seed(&r3, 7);
    lunar_rng_seed(&r4, 7);
    lunar_rng_uniform(ctx, &a, &r3, 0, 1);
    lunar_tensor p1 = {0}, p2 = {0};
    lunar_tensor_narrow(ctx, &p1, &b, 0, 0, 400);
    lunar_tensor_narrow(ctx, &p2, &b, 0, 400, 600);
    lunar_rng_uniform(ctx, &p1, &r4, 0, 1);
    lunar_rng_uniform(ctx, &p2, &r4, 0, 1);
    CHECK(memcmp(a.storage->data, b.storage->data, 4000) == 0, "split draws equal one draw");
    lunar_tensor_release(ctx, &p1);
    lunar_tensor_release(ctx, &p2);
    lunar_tensor_release(ctx, &a);
    lunar_tensor_release(ctx, &b);
}

/* hd.h's log and cos (the Box-Muller of normal(), built from single IEEE operations so host and
 * device agree bit for bit) against libm: within 2 ulp-sized errors over their whole range. */
static void test_hd_math(void) {
    lunar_rng r;
    lunar_rng_seed(&r, 3);
    double worst_log = 0, worst_cos = 0;
    for (uint64_t i = 0; i < 200000; i++) {
        uint32_t w[4];
        lunar_philox_element(r.key, i, w);
        double u = lunar_rng_u01(w[0], w[1]);          /* [0, 1): the argument range normal() uses */
        double x = 1.0 - u;                             /* (0, 1] */
        if (i % 4 == 1) x = ldexp(x, (int)(w[2] % 2000) - 1000);   /* and far outside it */
        double got = lunar_hd_log(x), want = log(x);
        double e = fabs(got - want) / fmax(fabs(want), 1e-300);
        if (want != 0 && e > worst_log) worst_log = e;
        CHECK(want != 0 || got == 0, "log(1) = %g", got);
        double c = lunar_hd_cos_2pi(u), cw = cos(6.283185307179586 * u);
        /* absolute: near the zeros libm's own argument 2 pi u carries an error of ~1e-16 */
        if (fabs(c - cw) > worst_cos) worst_cos = fabs(c - cw);
    }
    CHECK(worst_log < 4.5e-16, "log relative error %.3g", worst_log);
    CHECK(worst_cos < 1e-15, "cos(2 pi u) absolute error %.3g", worst_cos);
    /* the folds: exact values at the octant boundaries */
    CHECK(lunar_hd_cos_2pi(0.0) == 1.0 && lunar_hd_cos_2pi(0.5) == -1.0, "cos at 0 and 1/2");
    CHECK(fabs(lunar_hd_cos_2pi(0.25)) < 1e-300 && fabs(lunar_hd_cos_2pi(0.75)) < 1e-300, "cos at 1/4, 3/4");
    CHECK(fabs(lunar_hd_cos_2pi(0.125) - sqrt(0.5)) < 2e-16, "cos at 1/8: %.17g", lunar_hd_cos_2pi(0.125));
    CHECK(lunar_hd_log(1.0) == 0 && fabs(lunar_hd_log(2.0) - log(2.0)) < 2e-16, "log(1), log(2)");
}

/* the exponential as the kernels compile it: once per instruction set the kernels are cloned for
 * (vecmath.h), with multiply-adds fused as there; a CPU runs the variants it supports */
typedef void (*exp_array_fn)(float *y, const float *x, int n);

#define EXP_ARRAY_BODY \
    for (int i = 0; i < n; i++) y[i] = lunar_expf_upto88(x[i]);

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((optimize("fp-contract=fast"))) static void exp_array_base(float *y, const float *x, int n) {
    EXP_ARRAY_BODY
}
__attribute__((target("arch=x86-64-v3"), optimize("fp-contract=fast"))) static void exp_array_v3(float *y, const float *x,
                                                                                               int n) {
    EXP_ARRAY_BODY
}
__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast"))) static void exp_array_v4(float *y, const float *x,
                                                                                               int n) {
    EXP_ARRAY_BODY
}
static int exp_variants(exp_array_fn *fns, const char **names) {
    int k = 0;
    fns[k] = exp_array_base, names[k++] = "baseline";
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) fns[k] = exp_array_v3, names[k++] = "x86-64-v3";
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl"))
        fns[k] = exp_array_v4, names[k++] = "x86-64-v4";
    return k;
}
#else
static void exp_array_base(float *y, const float *x, int n) { EXP_ARRAY_BODY }
static int exp_variants(exp_array_fn *fns, const char **names) {
    fns[0] = exp_array_base, names[0] = "plain";
    return 1;
}
#endif

/* one batch of inputs: the worst relative error where e^x is a normal float; elsewhere the
 * result must be below the smallest normal float */
static void exp_batch(exp_array_fn fn, const char *name, const float *xs, float *ys, int n, double *worst,
                      float *worst_x) {
    fn(ys, xs, n);
    for (int i = 0; i < n; i++) {
        double want = exp((double)xs[i]);
        if (want >= 1.1754943508222875e-38) {
            double e = fabs(ys[i] - want) / want;
            if (e > *worst) { *worst = e; *worst_x = xs[i]; }
        } else {
            CHECK(ys[i] >= 0 && ys[i] < 1.1754943508222875e-38f, "%s: exp(%.9g) = %g, want %g", name, xs[i], ys[i],
                  want);
        }
    }
}

/* lunar_expf_upto88 over its domain x <= 88, in every variant: within 2 x 2^-23 of e^x wherever
 * e^x is a normal float (inputs: 2M evenly spaced over [-90, 88], which covers the exponent's
 * whole range finely, and every 4099th float bit pattern in it, which covers tiny |x|); exactly 0
 * for -inf and far below; exactly 1 at 0; NaN for NaN */
static void test_vec_exp(void) {
    enum { BATCH = 4096, SPACED = 1 << 21 };
    static float xs[BATCH], ys[BATCH];
    exp_array_fn fns[3];
    const char *names[3];
    int variants = exp_variants(fns, names);
    for (int f = 0; f < variants; f++) {
        double worst = 0;
        float worst_x = 0;
        int n = 0;
        int64_t checked = 0;
        for (int64_t k = 0; k <= SPACED; k++) {
            xs[n++] = (float)(-90.0 + 178.0 * (double)k / SPACED);
            if (n == BATCH || k == SPACED) {
                exp_batch(fns[f], names[f], xs, ys, n, &worst, &worst_x);
                checked += n;
                n = 0;
            }
        }
        for (uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
            float x;
            uint32_t w = (uint32_t)u;
            memcpy(&x, &w, 4);
            if (x >= -90.0f && x <= 88.0f) xs[n++] = x;
            if (n == BATCH || (u + 4099 > 0xffffffffu && n > 0)) {
                exp_batch(fns[f], names[f], xs, ys, n, &worst, &worst_x);
                checked += n;
                n = 0;
            }
        }
        CHECK(checked > 2500000, "%s: only %lld inputs checked", names[f], (long long)checked);
        CHECK(worst <= 2.0 * 0x1p-23, "%s: exp relative error %.3g (%.2f x 2^-23) at x = %.9g", names[f], worst,
              worst * 0x1p23, worst_x);
        float special[6] = {0.0f, -INFINITY, -88.1f, -1000.0f, NAN, -87.0f}, out[6];
        fns[f](out, special, 6);
        CHECK(out[0] == 1.0f, "%s: exp(0) = %.9g", names[f], out[0]);
        CHECK(out[1] == 0.0f && out[2] == 0.0f && out[3] == 0.0f, "%s: exp(-inf, -88.1, -1000) = %g %g %g", names[f],
              out[1], out[2], out[3]);
        CHECK(isnan(out[4]), "%s: exp(NaN) = %g", names[f], out[4]);
        CHECK(out[5] > 0 && fabs(out[5] - exp(-87.0)) < 2.0 * 0x1p-23 * exp(-87.0), "%s: exp(-87) = %g", names[f],
              out[5]);
        printf("test_core: exp (%s): worst relative error %.2f x 2^-23 over %lld inputs\n", names[f], worst * 0x1p23,
               (long long)checked);
    }
}

/* Sizes whose element or byte count overflows int64 (or size_t) are shape errors, never a tiny
 * allocation that views and kernels would then index past; views cannot create them either. */
static void test_size_limits(lunar_ctx *ctx) {
    lunar_tensor t = {0}, v = {0};
    int64_t huge[2] = {(int64_t)1 << 40, (int64_t)1 << 40};
    CHECK(lunar_tensor_new(ctx, &t, LUNAR_DTYPE_F32, CPU, 2, huge) == LUNAR_ERR_SHAPE, "2^80 elements must fail");
    CHECK(strstr(lunar_ctx_error(ctx), "too large") != NULL, "message: %s", lunar_ctx_error(ctx));
    int64_t bytes[1] = {(int64_t)1 << 62};   /* fits int64 as elements, not as f32 bytes */
    CHECK(lunar_tensor_new(ctx, &t, LUNAR_DTYPE_F32, CPU, 1, bytes) == LUNAR_ERR_SHAPE, "2^64 bytes must fail");
    CHECK(t.storage == NULL, "nothing allocated");
    /* a pool request near SIZE_MAX fails (it used to loop forever rounding to a size class) */
    lunar_storage *s = NULL;
    CHECK(lunar_storage_new(ctx, &s, CPU, (size_t)-1 - 1000) == LUNAR_ERR_OOM, "huge storage must fail");
    CHECK(s == NULL, "no storage");

    int64_t one[1] = {3};
    CHECK(lunar_tensor_new(ctx, &t, LUNAR_DTYPE_F32, CPU, 1, one) == LUNAR_OK, "new");
    int64_t neg[2] = {-1, 3};   /* -1 keeps a size; a new leading dim has none to keep */
    CHECK(lunar_tensor_expand(ctx, &v, &t, 2, neg) == LUNAR_ERR_SHAPE, "expand to a -1 leading dim must fail");
    CHECK(v.storage == NULL, "no view");
    int64_t neg2[2] = {2, -5};
    lunar_tensor u = {0};
    int64_t us[2] = {3, 1};
    CHECK(lunar_tensor_new(ctx, &u, LUNAR_DTYPE_F32, CPU, 2, us) == LUNAR_OK, "new");
    CHECK(lunar_tensor_expand(ctx, &v, &u, 2, neg2) == LUNAR_ERR_SHAPE, "expand to size -5 must fail");
    int64_t big[3] = {(int64_t)1 << 40, (int64_t)1 << 40, 3};
    CHECK(lunar_tensor_expand(ctx, &v, &t, 3, big) == LUNAR_ERR_SHAPE, "expand past int64 elements must fail");
    CHECK(v.storage == NULL, "no view");
    /* narrow bounds are checked without overflowing start + length */
    CHECK(lunar_tensor_narrow(ctx, &v, &t, 0, (int64_t)1 << 62, (int64_t)3 << 61) == LUNAR_ERR_ARG,
          "narrow far out of range must fail");
    CHECK(v.storage == NULL, "no view");
    lunar_tensor_release(ctx, &t);
    lunar_tensor_release(ctx, &u);
}

/* device names, and the debug device cpu:1 of LUNAR_FAKE_CPU_DEVICES (ctx.h): absent by default;
 * when enabled, its own pool, and copies to and from it counted as transfers */
static void test_devices(void) {
    lunar_device d;
    char buf[32];
    CHECK(lunar_device_parse("cpu:1", &d) && d.type == LUNAR_DEVICE_CPU && d.index == 1, "parse cpu:1");
    CHECK(lunar_device_parse("cpu:0", &d) && d.index == 0 && lunar_device_is_host(d), "cpu:0 is the host");
    CHECK(!lunar_device_parse("cpu:99", &d) && !lunar_device_parse("cpu:", &d) && !lunar_device_parse("cpux", &d),
          "bad cpu names");
    lunar_device_format((lunar_device){LUNAR_DEVICE_CPU, 1}, buf, sizeof buf);
    CHECK(strcmp(buf, "cpu:1") == 0, "format %s", buf);
    lunar_device_format((lunar_device){LUNAR_DEVICE_CPU, 0}, buf, sizeof buf);
    CHECK(strcmp(buf, "cpu") == 0, "format %s", buf);
    lunar_device cpu1 = {LUNAR_DEVICE_CPU, 1};
    int64_t shape[1] = {16};
    lunar_ctx *ctx;
    unsetenv("LUNAR_FAKE_CPU_DEVICES");
    if (lunar_ctx_init(&ctx) != LUNAR_OK) { failures++; return; }
    lunar_tensor t = {0};
    CHECK(lunar_tensor_new(ctx, &t, LUNAR_DTYPE_F32, cpu1, 1, shape) == LUNAR_ERR_DEVICE, "cpu:1 is off by default");
    CHECK(strstr(lunar_ctx_error(ctx), "LUNAR_FAKE_CPU_DEVICES") != NULL, "message: %s", lunar_ctx_error(ctx));
    lunar_ctx_free(ctx);
    setenv("LUNAR_FAKE_CPU_DEVICES", "1", 1);
    int ok = lunar_ctx_init(&ctx) == LUNAR_OK;
    unsetenv("LUNAR_FAKE_CPU_DEVICES");
    if (!ok) { failures++; return; }
    CHECK(lunar_ctx_cpu_device_count(ctx) == 2, "two cpu devices");
    lunar_tensor h = {0}, g = {0}, back = {0};
    CHECK(lunar_tensor_new(ctx, &h, LUNAR_DTYPE_F32, CPU, 1, shape) == LUNAR_OK, "new");
    CHECK(lunar_arange(ctx, &h, 0, 1) == LUNAR_OK, "arange");
    CHECK(lunar_tensor_new(ctx, &g, LUNAR_DTYPE_F32, cpu1, 1, shape) == LUNAR_OK, "new on cpu:1: %s",
          lunar_ctx_error(ctx));
    CHECK(lunar_tensor_new(ctx, &back, LUNAR_DTYPE_F32, CPU, 1, shape) == LUNAR_OK, "new");
    lunar_pool *p0, *p1;
    CHECK(lunar_ctx_pool(ctx, CPU, &p0) == LUNAR_OK && lunar_ctx_pool(ctx, cpu1, &p1) == LUNAR_OK && p0 != p1,
          "one pool per device");
    CHECK(lunar_copy(ctx, &g, &h) == LUNAR_OK && lunar_copy(ctx, &back, &g) == LUNAR_OK, "copies");
    CHECK(((float *)back.storage->data)[7] == 7.0f, "round trip");
    lunar_transfer_stats ts = lunar_ctx_transfer_stats(ctx);
    CHECK(ts.to_host == 1 && ts.from_host == 1 && ts.to_host_bytes == 64, "transfers %llu %llu",
          (unsigned long long)ts.to_host, (unsigned long long)ts.from_host);
    CHECK(lunar_binary(ctx, &back, &h, &g, LUNAR_BINARY_ADD) == LUNAR_ERR_DEVICE, "mixing cpu and cpu:1");
    CHECK(strstr(lunar_ctx_error(ctx), "cpu:1") != NULL, "message: %s", lunar_ctx_error(ctx));
    lunar_tensor_release(ctx, &h);
    lunar_tensor_release(ctx, &g);
    lunar_tensor_release(ctx, &back);
    lunar_ctx_free(ctx);
}

int main(void) {
    test_devices();
    lunar_ctx *ctx;
    if (lunar_ctx_init(&ctx) != LUNAR_OK) return 1;
    test_views(ctx);
    test_arena(ctx);
    test_pool_and_scope(ctx);
    test_dtypes();
    test_rng(ctx);
    test_hd_math();
    test_vec_exp();
    test_size_limits(ctx);
    lunar_ctx_free(ctx);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("test_core: all checks passed\n");
    return 0;
}
