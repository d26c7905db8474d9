/* rng.c: Philox-4x32-10 streams (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
 *
 * Counter layout: element draws use words (ctr_lo, ctr_hi, 0, 0); key derivation for split()
 * uses (id_lo, id_hi, 1, 0), so a child key can never collide with an element of its parent. */
#include "lunar/rng.h"

#include "lunar/backend.h"
#include "lunar/ops.h"

void lunar_philox4x32(uint64_t key, uint64_t counter, uint32_t out[4]) {
    lunar_philox_element(key, counter, out);
}

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

void lunar_rng_seed(lunar_rng *r, uint64_t seed) {
    r->key = splitmix64(seed);
    r->counter = 0;
}

lunar_rng lunar_rng_split(const lunar_rng *r, uint64_t id) {
    uint32_t c[4] = {(uint32_t)id, (uint32_t)(id >> 32), 1u, 0u};
    lunar_philox_rounds((uint32_t)r->key, (uint32_t)(r->key >> 32), c);
    lunar_rng child = {((uint64_t)c[1] << 32) | c[0], 0};
    return child;
}

static lunar_status rng_draw(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, lunar_rng_kind kind, double a,
                             double b, const char *what) {
    LUNAR_TRY(lunar_tensor_check(ctx, out));
    lunar_device dev = lunar_tensor_device(out);
    const lunar_backend *be = lunar_ctx_backend(ctx, dev.type);
    if (!be || !be->rng_fill) return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "%s: no backend", what);
    if (kind != LUNAR_RNG_RANDINT && !lunar_dtype_is_float(out->dtype))
        return LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "%s: '%s' must be a float tensor, not %s", what,
                          lunar_tensor_label(out), lunar_dtype_name(out->dtype));
    int64_t n = lunar_tensor_numel(out);
    lunar_status st;
    if (lunar_tensor_is_contiguous(out)) {
        st = be->rng_fill(ctx, out, kind, r->key, r->counter, a, b);
    } else {
        /* draw into a contiguous temporary so element i is the same whatever the strides */
        lunar_tensor tmp = {0};
        LUNAR_TRY(lunar_tensor_new(ctx, &tmp, out->dtype, dev, out->ndim, out->shape));
        st = be->rng_fill(ctx, &tmp, kind, r->key, r->counter, a, b);
        if (st == LUNAR_OK) st = lunar_copy(ctx, out, &tmp);
        lunar_tensor_release(ctx, &tmp);
    }
    if (st == LUNAR_OK) r->counter += (uint64_t)n;
    return st;
}

lunar_status lunar_rng_uniform(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, double lo, double hi) {
    return rng_draw(ctx, out, r, LUNAR_RNG_UNIFORM, lo, hi, "uniform");
}

lunar_status lunar_rng_normal(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, double mean, double std) {
    return rng_draw(ctx, out, r, LUNAR_RNG_NORMAL, mean, std, "normal");
}

lunar_status lunar_rng_randint(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, int64_t lo, int64_t hi) {
    if (hi <= lo) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "randint: empty range [%lld, %lld)", (long long)lo, (long long)hi);
    return rng_draw(ctx, out, r, LUNAR_RNG_RANDINT, (double)lo, (double)hi, "randint");
}
