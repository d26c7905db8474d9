/* tensor.c: tensors as views over storage; shape bookkeeping and the validity check. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* numel of a shape whose element count and byte count (es bytes per element) both fit in an
 * int64; 0 when they do not (or a size is negative). Every tensor keeps this invariant, so numel
 * and byte computations elsewhere cannot overflow. */
static int shape_fits(int ndim, const int64_t *shape, size_t es, int64_t *numel) {
    int64_t n = 1, bytes;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || __builtin_mul_overflow(n, shape[i], &n)) return 0;
    }
    if (__builtin_mul_overflow(n, (int64_t)(es ? es : 1), &bytes)) return 0;
    *numel = n;
    return 1;
}

static lunar_status check_shape(lunar_ctx *ctx, int ndim, const int64_t *shape, lunar_dtype dt, const char *what) {
    if (ndim < 0 || ndim > LUNAR_MAX_DIMS)
        return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "%s: %d dims (at most %d)", what, ndim, LUNAR_MAX_DIMS);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0) return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "%s: negative size %lld in dim %d", what,
                                            (long long)shape[i], i + 1);
    if ((unsigned)dt >= LUNAR_DTYPE_COUNT) return LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "invalid dtype %d", (int)dt);
    int64_t n;
    if (!shape_fits(ndim, shape, lunar_dtype_size(dt), &n)) {
        char sh[LUNAR_MAX_DIMS * 24];
        lunar_shape_format(ndim, shape, sh, sizeof sh);
        return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "%s: shape %s of %s is too large (its byte count overflows 64 bits)",
                          what, sh, lunar_dtype_name(dt));
    }
    return LUNAR_OK;
}

static int64_t shape_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

static void set_contiguous(lunar_tensor *t, int ndim, const int64_t *shape) {
    t->ndim = ndim;
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->shape[i] = shape[i];
        t->stride[i] = s;
        s *= shape[i] > 0 ? shape[i] : 1;
    }
}

lunar_status lunar_tensor_from_storage(lunar_ctx *ctx, lunar_tensor *t, lunar_storage *s, lunar_dtype dt,
                                       int64_t offset, int ndim, const int64_t *shape) {
    LUNAR_TRY(check_shape(ctx, ndim, shape, dt, "tensor"));
    size_t es = lunar_dtype_size(dt);
    int64_t numel = shape_numel(ndim, shape);
    /* offset + numel elements must fit the storage (checked without overflowing) */
    if (offset < 0 || (uint64_t)offset > s->nbytes / es || (uint64_t)numel > s->nbytes / es - (uint64_t)offset)
        return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                          "tensor of %lld elements of %zu bytes at element %lld does not fit a storage of %zu bytes",
                          (long long)numel, es, (long long)offset, s->nbytes);
    memset(t, 0, sizeof *t);
    lunar_storage_retain(s);
    t->storage = s;
    t->dtype = dt;
    t->offset = offset;
    set_contiguous(t, ndim, shape);
    return LUNAR_OK;
}

lunar_status lunar_tensor_new(lunar_ctx *ctx, lunar_tensor *t, lunar_dtype dt, lunar_device dev, int ndim,
                              const int64_t *shape) {
    LUNAR_TRY(check_shape(ctx, ndim, shape, dt, "new tensor"));
    lunar_storage *s;
    lunar_status st = lunar_storage_new(ctx, &s, dev, (size_t)shape_numel(ndim, shape) * lunar_dtype_size(dt));
    if (st != LUNAR_OK) {   /* say which tensor asked for the memory */
        char sh[160];
        lunar_shape_format(ndim, shape, sh, sizeof sh);
        lunar_ctx_prefix_error(ctx, "new %s tensor of shape %s", lunar_dtype_name(dt), sh);
        return st;
    }
    st = lunar_tensor_from_storage(ctx, t, s, dt, 0, ndim, shape);
    lunar_storage_release(ctx, s);
    return st;
}

lunar_status lunar_tensor_new_in(lunar_ctx *ctx, lunar_tensor *t, lunar_arena *a, lunar_dtype dt, int ndim,
                                 const int64_t *shape) {
    LUNAR_TRY(check_shape(ctx, ndim, shape, dt, "new tensor"));
    lunar_storage *s;
    LUNAR_TRY(lunar_arena_alloc(ctx, a, (size_t)shape_numel(ndim, shape) * lunar_dtype_size(dt), &s));
    lunar_status st = lunar_tensor_from_storage(ctx, t, s, dt, 0, ndim, shape);
    lunar_storage_release(ctx, s);
    return st;
}

void lunar_tensor_release(lunar_ctx *ctx, lunar_tensor *t) {
    if (!t) return;
    if (t->storage) lunar_storage_release(ctx, t->storage);
    memset(t, 0, sizeof *t);
}

void lunar_tensor_share(lunar_tensor *dst, const lunar_tensor *src) {
    *dst = *src;
    lunar_storage_retain(dst->storage);
}

void lunar_tensor_set_name(lunar_tensor *t, const char *name) {
    snprintf(t->name, sizeof t->name, "%s", name ? name : "");
}

const char *lunar_tensor_label(const lunar_tensor *t) { return t && t->name[0] ? t->name : "tensor"; }

int64_t lunar_tensor_numel(const lunar_tensor *t) { return shape_numel(t->ndim, t->shape); }

size_t lunar_tensor_nbytes(const lunar_tensor *t) {
    return (size_t)lunar_tensor_numel(t) * lunar_dtype_size(t->dtype);
}

int lunar_tensor_is_contiguous(const lunar_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] == 1) continue;
        if (t->shape[i] == 0) return 1;
        if (t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

lunar_device lunar_tensor_device(const lunar_tensor *t) {
    lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
    return t->storage ? t->storage->device : cpu;
}

void *lunar_tensor_data(const lunar_tensor *t) {
    if (!t->storage || !t->storage->data) return NULL;
    return (char *)t->storage->data + t->offset * (int64_t)lunar_dtype_size(t->dtype);
}

void lunar_shape_format(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t used = 0;
    used += (size_t)snprintf(buf + used, used < n ? n - used : 0, "(");
    for (int i = 0; i < ndim; i++)
        used += (size_t)snprintf(buf + used, used < n ? n - used : 0, "%s%lld", i ? ", " : "", (long long)shape[i]);
    snprintf(buf + (used < n ? used : n - 1), used < n ? n - used : 1, ")");
}

void lunar_tensor_shape_str(const lunar_tensor *t, char *buf, size_t n) { lunar_shape_format(t->ndim, t->shape, buf, n); }

int lunar_tensor_same_shape(const lunar_tensor *a, const lunar_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

lunar_status lunar_tensor_check(lunar_ctx *ctx, const lunar_tensor *t) {
    if (!t || !t->storage) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s has no storage", lunar_tensor_label(t));
    const lunar_storage *s = t->storage;
    if (s->kind == LUNAR_STORAGE_ARENA && s->arena && !s->freed) {
        const lunar_arena *a = s->arena;
        if (a->freed)
            return LUNAR_FAIL(ctx, LUNAR_ERR_STALE, "tensor '%s' is a view of arena '%s', which was freed",
                              lunar_tensor_label(t), a->name);
        if (a->generation != s->arena_generation)
            return LUNAR_FAIL(ctx, LUNAR_ERR_STALE,
                              "tensor '%s' is a view of arena '%s' generation %llu (now %llu): the arena was reset",
                              lunar_tensor_label(t), a->name, (unsigned long long)s->arena_generation,
                              (unsigned long long)a->generation);
    }
    if (s->freed || !s->data) {
        char sh[160];
        lunar_tensor_shape_str(t, sh, sizeof sh);
        return LUNAR_FAIL(ctx, LUNAR_ERR_STALE,
                          "tensor '%s' %s used after free() (its own, or the end of the lunar.scope that made it)",
                          lunar_tensor_label(t), sh);
    }
    return LUNAR_OK;
}

/* [lo, hi) of the bytes of t's storage that t can address (lo == hi when t has no elements) */
static void byte_span(const lunar_tensor *t, int64_t *lo, int64_t *hi) {
    int64_t a = t->offset, b = t->offset;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) { *lo = *hi = 0; return; }
        if (t->stride[i] > 0) b += (t->shape[i] - 1) * t->stride[i];
        else a += (t->shape[i] - 1) * t->stride[i];
    }
    int64_t es = (int64_t)lunar_dtype_size(t->dtype);
    *lo = a * es;
    *hi = (b + 1) * es;
}

int lunar_tensor_same_view(const lunar_tensor *a, const lunar_tensor *b) {
    if (!a->storage || a->storage != b->storage || a->dtype != b->dtype || a->offset != b->offset ||
        !lunar_tensor_same_shape(a, b))
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] > 1 && a->stride[i] != b->stride[i]) return 0;
    return 1;
}

int lunar_tensor_overlaps(const lunar_tensor *a, const lunar_tensor *b) {
    if (!a->storage || a->storage != b->storage) return 0;
    int64_t a0, a1, b0, b1;
    byte_span(a, &a0, &a1);
    byte_span(b, &b0, &b1);
    return a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;
}

/* ---- views --------------------------------------------------------------------------------- */

static lunar_status norm_dim(lunar_ctx *ctx, const lunar_tensor *t, int *dim, int extra, const char *what) {
    int n = t->ndim + extra;
    int d = *dim < 0 ? *dim + n : *dim;
    if (d < 0 || d >= n || n == 0) {
        char sh[128];
        lunar_tensor_shape_str(t, sh, sizeof sh);
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: dim %d out of range for '%s' %s", what, *dim, lunar_tensor_label(t), sh);
    }
    *dim = d;
    return LUNAR_OK;
}

static void view_from(lunar_tensor *out, const lunar_tensor *src) {
    lunar_tensor_share(out, src);
}

lunar_status lunar_tensor_narrow(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim, int64_t start,
                                 int64_t length) {
    LUNAR_TRY(norm_dim(ctx, src, &dim, 0, "narrow"));
    if (start < 0 || length < 0 || start > src->shape[dim] || length > src->shape[dim] - start) {
        char sh[128];
        lunar_tensor_shape_str(src, sh, sizeof sh);
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "narrow: start %lld, length %lld out of bounds for dim %d of '%s' %s",
                          (long long)start, (long long)length, dim, lunar_tensor_label(src), sh);
    }
    view_from(out, src);
    out->offset += start * src->stride[dim];
    out->shape[dim] = length;
    return LUNAR_OK;
}

lunar_status lunar_tensor_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim, int64_t index) {
    LUNAR_TRY(norm_dim(ctx, src, &dim, 0, "select"));
    if (index < 0) index += src->shape[dim];
    if (index < 0 || index >= src->shape[dim]) {
        char sh[128];
        lunar_tensor_shape_str(src, sh, sizeof sh);
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "select: index %lld out of bounds for dim %d of '%s' %s",
                          (long long)index, dim, lunar_tensor_label(src), sh);
    }
    view_from(out, src);
    out->offset += index * src->stride[dim];
    for (int i = dim; i < src->ndim - 1; i++) {
        out->shape[i] = src->shape[i + 1];
        out->stride[i] = src->stride[i + 1];
    }
    out->ndim = src->ndim - 1;
    return LUNAR_OK;
}

lunar_status lunar_tensor_transpose(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int d0, int d1) {
    LUNAR_TRY(norm_dim(ctx, src, &d0, 0, "transpose"));
    LUNAR_TRY(norm_dim(ctx, src, &d1, 0, "transpose"));
    view_from(out, src);
    out->shape[d0] = src->shape[d1];
    out->stride[d0] = src->stride[d1];
    out->shape[d1] = src->shape[d0];
    out->stride[d1] = src->stride[d0];
    return LUNAR_OK;
}

lunar_status lunar_tensor_permute(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, const int *perm) {
    int seen[LUNAR_MAX_DIMS] = {0};
    for (int i = 0; i < src->ndim; i++) {
        if (perm[i] < 0 || perm[i] >= src->ndim || seen[perm[i]])
            return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "permute: not a permutation of %d dims for '%s'", src->ndim,
                              lunar_tensor_label(src));
        seen[perm[i]] = 1;
    }
    view_from(out, src);
    for (int i = 0; i < src->ndim; i++) {
        out->shape[i] = src->shape[perm[i]];
        out->stride[i] = src->stride[perm[i]];
    }
    return LUNAR_OK;
}

/* Reshape without copying. The source dims (size-1 dims ignored) are merged into runs that
 * are laid out contiguously among themselves; the new shape must split each run, in order,
 * into dims whose sizes multiply to the run's size. Each run then gets contiguous strides on
 * top of its innermost stride. */
lunar_status lunar_tensor_view(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int ndim,
                               const int64_t *shape_in) {
    if (ndim < 0 || ndim > LUNAR_MAX_DIMS)
        return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "view: %d dims (at most %d)", ndim, LUNAR_MAX_DIMS);
    int64_t shape[LUNAR_MAX_DIMS], stride[LUNAR_MAX_DIMS];
    int infer = -1;
    int64_t known = 1, numel = lunar_tensor_numel(src);
    for (int i = 0; i < ndim; i++) {
        shape[i] = shape_in[i];
        if (shape[i] == -1) {
            if (infer >= 0) return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "view: more than one -1 in the shape");
            infer = i;
        } else if (shape[i] < 0) {
            return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "view: negative size %lld", (long long)shape[i]);
        } else if (__builtin_mul_overflow(known, shape[i], &known)) {
            goto mismatch;
        }
    }
    if (infer >= 0) {
        if (known == 0 || numel % known != 0) goto mismatch;
        shape[infer] = numel / known;
        known *= shape[infer];
    }
    if (known != numel) goto mismatch;

    if (numel == 0) {
        int64_t st = 1;
        for (int i = ndim - 1; i >= 0; i--) { stride[i] = st; st *= shape[i] ? shape[i] : 1; }
    } else {
        int64_t run_size[LUNAR_MAX_DIMS], run_inner[LUNAR_MAX_DIMS];
        int nruns = 0, last = -1;
        for (int i = 0; i < src->ndim; i++) {
            if (src->shape[i] == 1) continue;
            if (last >= 0 && src->stride[last] == src->stride[i] * src->shape[i]) {
                run_size[nruns - 1] *= src->shape[i];
                run_inner[nruns - 1] = src->stride[i];
            } else {
                run_size[nruns] = src->shape[i];
                run_inner[nruns] = src->stride[i];
                nruns++;
            }
            last = i;
        }
        int k = 0;
        for (int r = 0; r < nruns; r++) {
            int first = k;
            int64_t p = 1;
            while (k < ndim && p < run_size[r]) p *= shape[k++];
            if (p != run_size[r]) {
                char a[128], b[128];
                lunar_tensor_shape_str(src, a, sizeof a);
                lunar_shape_format(ndim, shape, b, sizeof b);
                return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE,
                                  "view: '%s' %s is not contiguous enough to view as %s (use reshape, which copies)",
                                  lunar_tensor_label(src), a, b);
            }
            int64_t st = run_inner[r];
            for (int j = k - 1; j >= first; j--) { stride[j] = st; st *= shape[j]; }
        }
        for (; k < ndim; k++) stride[k] = 1;   /* trailing size-1 dims */
    }
    view_from(out, src);
    out->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        out->shape[i] = shape[i];
        out->stride[i] = stride[i];
    }
    return LUNAR_OK;
mismatch: {
    char a[128], b[128];
    lunar_tensor_shape_str(src, a, sizeof a);
    lunar_shape_format(ndim, shape_in, b, sizeof b);
    return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "view: '%s' %s has %lld elements, shape %s does not", lunar_tensor_label(src),
                      a, (long long)numel, b);
}
}

lunar_status lunar_tensor_expand(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int ndim,
                                 const int64_t *shape) {
    if (ndim < src->ndim || ndim > LUNAR_MAX_DIMS) goto bad;
    int lead = ndim - src->ndim;
    int64_t nshape[LUNAR_MAX_DIMS], nstride[LUNAR_MAX_DIMS], numel;
    for (int i = 0; i < ndim; i++) {
        if (i < lead) {
            if (shape[i] < 0) goto bad;   /* -1 keeps a size, and a new leading dim has none */
            nshape[i] = shape[i];
            nstride[i] = 0;
            continue;
        }
        int64_t have = src->shape[i - lead];
        int64_t want = shape[i] == -1 ? have : shape[i];
        if (have == want) {
            nshape[i] = have;
            nstride[i] = src->stride[i - lead];
        } else if (have == 1 && want >= 0) {
            nshape[i] = want;
            nstride[i] = 0;
        } else {
            goto bad;
        }
    }
    if (!shape_fits(ndim, nshape, lunar_dtype_size(src->dtype), &numel)) goto bad;
    view_from(out, src);
    out->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        out->shape[i] = nshape[i];
        out->stride[i] = nstride[i];
    }
    return LUNAR_OK;
bad: {
    char a[LUNAR_MAX_DIMS * 24], b[LUNAR_MAX_DIMS * 24];
    lunar_tensor_shape_str(src, a, sizeof a);
    lunar_shape_format(ndim > LUNAR_MAX_DIMS ? LUNAR_MAX_DIMS : ndim, shape, b, sizeof b);
    return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "expand: '%s' %s cannot be broadcast to %s", lunar_tensor_label(src), a, b);
}
}

lunar_status lunar_tensor_unsqueeze(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim) {
    if (src->ndim >= LUNAR_MAX_DIMS) return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "unsqueeze: too many dims");
    LUNAR_TRY(norm_dim(ctx, src, &dim, 1, "unsqueeze"));
    view_from(out, src);
    for (int i = src->ndim; i > dim; i--) {
        out->shape[i] = src->shape[i - 1];
        out->stride[i] = src->stride[i - 1];
    }
    out->shape[dim] = 1;
    out->stride[dim] = dim < src->ndim ? src->shape[dim] * src->stride[dim] : 1;
    out->ndim = src->ndim + 1;
    return LUNAR_OK;
}

lunar_status lunar_tensor_squeeze(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim) {
    LUNAR_TRY(norm_dim(ctx, src, &dim, 0, "squeeze"));
    if (src->shape[dim] != 1) {
        view_from(out, src);
        return LUNAR_OK;
    }
    view_from(out, src);
    for (int i = dim; i < src->ndim - 1; i++) {
        out->shape[i] = src->shape[i + 1];
        out->stride[i] = src->stride[i + 1];
    }
    out->ndim = src->ndim - 1;
    return LUNAR_OK;
}

lunar_status lunar_broadcast_shape(lunar_ctx *ctx, const lunar_tensor *a, const lunar_tensor *b, int *ndim,
                                   int64_t *shape) {
    int n = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < n; i++) {
        int ia = i - (n - a->ndim), ib = i - (n - b->ndim);
        int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
        if (sa == sb || sb == 1) shape[i] = sa;
        else if (sa == 1) shape[i] = sb;
        else {
            char x[128], y[128];
            lunar_tensor_shape_str(a, x, sizeof x);
            lunar_tensor_shape_str(b, y, sizeof y);
            return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "shapes do not broadcast: '%s' %s and '%s' %s", lunar_tensor_label(a),
                              x, lunar_tensor_label(b), y);
        }
    }
    *ndim = n;
    return LUNAR_OK;
}
