/* rng.c: Philox-4x32-10 streams (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
 *
 * Counter layout: element draws use words (ctr_lo, ctr_hi, 0, 0); key derivation for split()
 * uses (id_lo, id_hi, 1, 0), so a child key can never collide with an element of its parent. */
#include <math.h>
#include <stdint.h>
#include <string.h>

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
                             double b, double top, const char *what) {
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
        st = be->rng_fill(ctx, out, kind, r->key, r->counter, a, b, top);
    } else {
        /* draw into a contiguous temporary so element i is the same whatever the strides */
        lunar_tensor tmp = {0};
        LUNAR_TRY(lunar_tensor_new(ctx, &tmp, out->dtype, dev, out->ndim, out->shape));
        st = be->rng_fill(ctx, &tmp, kind, r->key, r->counter, a, b, top);
        if (st == LUNAR_OK) st = lunar_copy(ctx, out, &tmp);
        lunar_tensor_release(ctx, &tmp);
    }
    if (st == LUNAR_OK) r->counter += (uint64_t)n;
    return st;
}

/* The largest value of dtype dt that is < hi (as a double), for float dtypes; -inf if none. hi
 * rounded to dt is its nearest value; if that is not below hi, the one under it is (nothing of
 * dt lies between hi and its nearest value). The float bit patterns of one sign are ordered
 * like integers, so that neighbour is one pattern away: down for positive values, up for
 * negative ones. */
static double largest_below(lunar_dtype dt, double hi) {
    unsigned char buf[8] = {0};
    size_t es = lunar_dtype_size(dt);
    lunar_dtype_store(dt, buf, hi);
    double r = lunar_dtype_load(dt, buf);
    if (!(r < hi)) {
        uint64_t bits = 0;
        memcpy(&bits, buf, es);   /* little-endian host: the low es bytes */
        uint64_t sign = (uint64_t)1 << (8 * es - 1), mag = bits & (sign - 1);
        if (r != r) return -INFINITY;
        if (!(bits & sign) && mag > 0) bits -= 1;                 /* positive: toward zero */
        else if (bits & sign) bits += 1;                          /* negative (or -0): away from zero */
        else bits = sign | 1;                                     /* +0: the smallest negative */
        memcpy(buf, &bits, es);
        r = lunar_dtype_load(dt, buf);
    }
    return r < hi ? r : -INFINITY;
}

lunar_status lunar_rng_uniform(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, double lo, double hi) {
    if (!(lo <= hi))
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "uniform: [lo %g, hi %g) is not a range (lo must be <= hi) for '%s'", lo, hi,
                          lunar_tensor_label(out));
    /* lo == hi: every draw is lo (as torch) */
    double top = lunar_dtype_is_float(out->dtype) && lo < hi ? largest_below(out->dtype, hi) : hi;
    if (!(top >= lo))
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "uniform: [%g, %g) holds no %s value for '%s'", lo, hi,
                          lunar_dtype_name(out->dtype), lunar_tensor_label(out));
    return rng_draw(ctx, out, r, LUNAR_RNG_UNIFORM, lo, hi, top, "uniform");
}

lunar_status lunar_rng_normal(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, double mean, double std) {
    return rng_draw(ctx, out, r, LUNAR_RNG_NORMAL, mean, std, 0.0, "normal");
}

lunar_status lunar_rng_randint(lunar_ctx *ctx, lunar_tensor *out, lunar_rng *r, int64_t lo, int64_t hi) {
    if (hi <= lo) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "randint: empty range [%lld, %lld)", (long long)lo, (long long)hi);
    int64_t min, max;
    /* float dtypes take any range (values round as the dtype rounds) */
    if (lunar_dtype_int_range(out->dtype, &min, &max) && (lo < min || hi - 1 > max))
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "randint: [%lld, %lld) does not fit %s '%s' (which holds %lld..%lld)",
                          (long long)lo, (long long)hi, lunar_dtype_name(out->dtype), lunar_tensor_label(out),
                          (long long)min, (long long)max);
    return rng_draw(ctx, out, r, LUNAR_RNG_RANDINT, (double)lo, (double)hi, 0.0, "randint");
}
