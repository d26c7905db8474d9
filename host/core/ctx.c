/* ctx.c: the lunar context: errors, threads, backends, pools and scopes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

lunar_status lunar_ctx_init(lunar_ctx **out) {
    lunar_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return LUNAR_ERR_OOM;
    ctx->backends[LUNAR_DEVICE_CPU] = lunar_backend_cpu();
    ctx->backends[LUNAR_DEVICE_CUDA] = lunar_backend_cuda();
    int threads = 0;
    const char *env = getenv("LUNAR_THREADS");
    if (env && *env) threads = atoi(env);
#ifdef _OPENMP
    if (threads <= 0) threads = omp_get_num_procs();
#endif
    if (threads <= 0) threads = 1;
    lunar_ctx_set_threads(ctx, threads);
    const char *fake = getenv("LUNAR_FAKE_CPU_DEVICES");
    if (fake && *fake) {
        int n = atoi(fake);
        ctx->fake_cpu_devices = n < 0 ? 0 : n >= LUNAR_MAX_CPU_DEVICES ? LUNAR_MAX_CPU_DEVICES - 1 : n;
    }
    const char *each = getenv("LUNAR_CHECK_EACH_OP");
    ctx->check_each_op = each && *each && strcmp(each, "0") != 0;
    *out = ctx;
    return LUNAR_OK;
}

void lunar_ctx_free(lunar_ctx *ctx) {
    if (!ctx) return;
    while (ctx->scope_depth > 0) lunar_scope_pop(ctx);
    free(ctx->scopes);
    for (int i = 0; i < LUNAR_MAX_CPU_DEVICES; i++)
        if (ctx->cpu_pools[i]) lunar_pool_destroy(ctx, ctx->cpu_pools[i]);
    for (int i = 0; i < LUNAR_MAX_CUDA_DEVICES; i++)
        if (ctx->cuda_pools[i]) lunar_pool_destroy(ctx, ctx->cuda_pools[i]);
    for (int t = 0; t < LUNAR_DEVICE_TYPE_COUNT; t++)
        if (ctx->backends[t] && ctx->backends[t]->shutdown) ctx->backends[t]->shutdown(ctx);
    free(ctx);
}

lunar_status lunar_failv(lunar_ctx *ctx, lunar_status st, const char *file, int line, const char *fmt,
                         va_list ap) {
    if (!ctx) return st;
    vsnprintf(ctx->err, sizeof ctx->err, fmt, ap);
    snprintf(ctx->err_where, sizeof ctx->err_where, "%s:%d", file ? file : "?", line);
    ctx->err_status = st;
    return st;
}

lunar_status lunar_fail(lunar_ctx *ctx, lunar_status st, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lunar_failv(ctx, st, file, line, fmt, ap);
    va_end(ap);
    return st;
}

const char *lunar_ctx_error(const lunar_ctx *ctx) { return ctx->err; }
const char *lunar_ctx_error_where(const lunar_ctx *ctx) { return ctx->err_where; }
lunar_status lunar_ctx_status(const lunar_ctx *ctx) { return ctx->err_status; }

void lunar_ctx_clear_error(lunar_ctx *ctx) {
    ctx->err[0] = 0;
    ctx->err_where[0] = 0;
    ctx->err_status = LUNAR_OK;
}

void lunar_ctx_prefix_error(lunar_ctx *ctx, const char *fmt, ...) {
    char prefix[512], old[sizeof ctx->err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, ctx->err, sizeof old);
    snprintf(ctx->err, sizeof ctx->err, "%s: %s", prefix, old);
}

int lunar_ctx_threads(const lunar_ctx *ctx) { return ctx->threads; }

void lunar_ctx_set_threads(lunar_ctx *ctx, int n) {
    if (n < 1) n = 1;
    ctx->threads = n;
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
}

int lunar_ctx_default_cuda_device(const lunar_ctx *ctx) { return ctx->default_cuda; }

void lunar_ctx_set_default_cuda_device(lunar_ctx *ctx, int index) {
    ctx->default_cuda = (index >= 0 && index < LUNAR_MAX_CUDA_DEVICES) ? index : 0;
}

const lunar_backend *lunar_ctx_backend(const lunar_ctx *ctx, int device_type) {
    if (device_type < 0 || device_type >= LUNAR_DEVICE_TYPE_COUNT) return NULL;
    return ctx->backends[device_type];
}

void *lunar_ctx_backend_state(lunar_ctx *ctx, int device_type) {
    if (device_type < 0 || device_type >= LUNAR_DEVICE_TYPE_COUNT) return NULL;
    return ctx->backend_state[device_type];
}

void lunar_ctx_set_backend_state(lunar_ctx *ctx, int device_type, void *state) {
    if (device_type >= 0 && device_type < LUNAR_DEVICE_TYPE_COUNT) ctx->backend_state[device_type] = state;
}

lunar_status lunar_ctx_pool(lunar_ctx *ctx, lunar_device dev, lunar_pool **out) {
    lunar_pool **slot = NULL;
    if (dev.type == LUNAR_DEVICE_CPU) {
        if (dev.index < 0 || dev.index >= LUNAR_MAX_CPU_DEVICES)
            return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "cpu device index %d out of range", dev.index);
        slot = &ctx->cpu_pools[dev.index];
    } else if (dev.type == LUNAR_DEVICE_CUDA) {
        if (dev.index < 0 || dev.index >= LUNAR_MAX_CUDA_DEVICES)
            return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "cuda device index %d out of range", dev.index);
        slot = &ctx->cuda_pools[dev.index];
    } else {
        return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "unknown device type %d", dev.type);
    }
    if (!*slot) LUNAR_TRY(lunar_pool_new(ctx, dev, slot));
    *out = *slot;
    return LUNAR_OK;
}

int lunar_ctx_cpu_device_count(const lunar_ctx *ctx) { return 1 + ctx->fake_cpu_devices; }

int lunar_ctx_cuda_status(lunar_ctx *ctx, char *buf, size_t n) {
    const lunar_backend *be = ctx->backends[LUNAR_DEVICE_CUDA];
    int count = 0;
    if (!be) {
        snprintf(buf, n, "CUDA is not available: this lunar was built without CUDA (LUNAR_WITH_CUDA=OFF, or no nvcc)");
        return 0;
    }
    if (be->device_count(ctx, &count) != LUNAR_OK) {
        snprintf(buf, n, "CUDA is not available: %s", ctx->err);
        lunar_ctx_clear_error(ctx);
        return 0;
    }
    if (count > 0) {
        snprintf(buf, n, "%d CUDA device%s", count, count == 1 ? "" : "s");
        return count;
    }
    const char *why = be->device_count_error ? be->device_count_error(ctx) : "";
    snprintf(buf, n, "CUDA is not available: %s", why && *why ? why : "the CUDA runtime found no device");
    return 0;
}

lunar_status lunar_ctx_check_device(lunar_ctx *ctx, lunar_device dev) {
    char d[32], why[512] = "";
    lunar_device_format(dev, d, sizeof d);
    const lunar_backend *be = lunar_ctx_backend(ctx, dev.type);
    if (dev.type == LUNAR_DEVICE_CUDA && lunar_ctx_cuda_status(ctx, why, sizeof why) > 0) why[0] = 0;
    if (!be) {
        if (why[0]) return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "device %s not available: %s", d, why);
        return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "device %s: this lunar was built without that backend", d);
    }
    int count = 0;
    LUNAR_TRY(be->device_count(ctx, &count));
    if (dev.index >= 0 && dev.index < count) return LUNAR_OK;
    const char *hint = dev.type == LUNAR_DEVICE_CPU ? "; LUNAR_FAKE_CPU_DEVICES=n adds the debug devices cpu:1..cpu:n"
                                                    : "";
    return LUNAR_FAIL(ctx, LUNAR_ERR_DEVICE, "device %s not available (%d %s device%s found%s%s%s)", d, count, be->name,
                      count == 1 ? "" : "s", hint, why[0] ? "; " : "", why);
}

lunar_transfer_stats lunar_ctx_transfer_stats(const lunar_ctx *ctx) { return ctx->transfers; }

void lunar_ctx_count_transfer(lunar_ctx *ctx, int to_host, size_t nbytes) {
    if (to_host) {
        ctx->transfers.to_host++;
        ctx->transfers.to_host_bytes += nbytes;
    } else {
        ctx->transfers.from_host++;
        ctx->transfers.from_host_bytes += nbytes;
    }
}

void lunar_ctx_defer_range_error(lunar_ctx *ctx, lunar_device dev, const lunar_range_error *e) {
    if (dev.type != LUNAR_DEVICE_CPU || dev.index < 0 || dev.index >= LUNAR_MAX_CPU_DEVICES) return;
    if (ctx->range_pending[dev.index]) return;   /* the first bad op is the one to report */
    ctx->range_errors[dev.index] = *e;
    ctx->range_pending[dev.index] = 1;
}

int lunar_ctx_take_range_error(lunar_ctx *ctx, lunar_device dev, lunar_range_error *e) {
    if (dev.type != LUNAR_DEVICE_CPU || dev.index < 0 || dev.index >= LUNAR_MAX_CPU_DEVICES) return 0;
    if (!ctx->range_pending[dev.index]) return 0;
    *e = ctx->range_errors[dev.index];
    ctx->range_pending[dev.index] = 0;
    return 1;
}

int lunar_ctx_check_each_op(const lunar_ctx *ctx) { return ctx->check_each_op; }
void lunar_ctx_set_check_each_op(lunar_ctx *ctx, int on) { ctx->check_each_op = on != 0; }

int lunar_device_equal(lunar_device a, lunar_device b) { return a.type == b.type && a.index == b.index; }

int lunar_device_is_host(lunar_device d) { return d.type == LUNAR_DEVICE_CPU && d.index == 0; }

void lunar_device_format(lunar_device d, char *buf, size_t n) {
    if (d.type == LUNAR_DEVICE_CPU && d.index == 0) snprintf(buf, n, "cpu");
    else if (d.type == LUNAR_DEVICE_CPU) snprintf(buf, n, "cpu:%d", d.index);
    else if (d.type == LUNAR_DEVICE_CUDA) snprintf(buf, n, "cuda:%d", d.index);
    else snprintf(buf, n, "device%d:%d", d.type, d.index);
}

int lunar_device_parse(const char *s, lunar_device *out) {
    if (!s) return 0;
    if (strcmp(s, "cpu") == 0) { out->type = LUNAR_DEVICE_CPU; out->index = 0; return 1; }
    if (strncmp(s, "cpu:", 4) == 0 && s[4]) {
        char *end = NULL;
        long i = strtol(s + 4, &end, 10);
        if (*end || i < 0 || i >= LUNAR_MAX_CPU_DEVICES) return 0;
        out->type = LUNAR_DEVICE_CPU;
        out->index = (int)i;
        return 1;
    }
    if (strncmp(s, "cuda", 4) == 0) {
        if (s[4] == 0) { out->type = LUNAR_DEVICE_CUDA; out->index = 0; return 1; }
        if (s[4] == ':' && s[5]) {
            char *end = NULL;
            long i = strtol(s + 5, &end, 10);
            if (*end || i < 0 || i >= LUNAR_MAX_CUDA_DEVICES) return 0;
            out->type = LUNAR_DEVICE_CUDA;
            out->index = (int)i;
            return 1;
        }
    }
    return 0;
}

/* ---- scopes ---------------------------------------------------------------------------- */

lunar_status lunar_scope_push(lunar_ctx *ctx) {
    if (ctx->scope_depth == ctx->scope_cap) {
        int cap = ctx->scope_cap ? ctx->scope_cap * 2 : 8;
        lunar_scope_frame *f = realloc(ctx->scopes, (size_t)cap * sizeof *f);
        if (!f) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "lunar.scope: out of host memory");
        ctx->scopes = f;
        ctx->scope_cap = cap;
    }
    memset(&ctx->scopes[ctx->scope_depth], 0, sizeof ctx->scopes[0]);
    ctx->scope_depth++;
    return LUNAR_OK;
}

static lunar_status frame_add(lunar_ctx *ctx, lunar_scope_frame *f, lunar_storage *s) {
    if (f->count == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 16;
        lunar_storage **items = realloc(f->items, cap * sizeof *items);
        if (!items) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "lunar.scope: out of host memory");
        f->items = items;
        int *kept = realloc(f->kept, cap * sizeof *kept);
        if (!kept) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "lunar.scope: out of host memory");
        f->kept = kept;
        f->cap = cap;
    }
    lunar_storage_retain(s);
    f->items[f->count] = s;
    f->kept[f->count] = 0;
    f->count++;
    return LUNAR_OK;
}

lunar_status lunar_scope_track(lunar_ctx *ctx, lunar_storage *s) {
    if (ctx->scope_depth == 0 || !s || s->kind != LUNAR_STORAGE_OWNED) return LUNAR_OK;
    return frame_add(ctx, &ctx->scopes[ctx->scope_depth - 1], s);
}

void lunar_scope_keep(lunar_ctx *ctx, lunar_storage *s) {
    if (ctx->scope_depth == 0) return;
    lunar_scope_frame *f = &ctx->scopes[ctx->scope_depth - 1];
    for (size_t i = 0; i < f->count; i++)
        if (f->items[i] == s) f->kept[i] = 1;
}

void lunar_scope_untrack(lunar_ctx *ctx, lunar_storage *s) {
    for (int d = ctx->scope_depth - 1; d >= 0; d--) {
        lunar_scope_frame *f = &ctx->scopes[d];
        for (size_t i = 0; i < f->count; i++) {
            if (f->items[i] != s) continue;
            f->items[i] = f->items[f->count - 1];
            f->kept[i] = f->kept[f->count - 1];
            f->count--;
            lunar_storage_release(ctx, s);
            return;
        }
    }
}

void lunar_scope_pop(lunar_ctx *ctx) {
    if (ctx->scope_depth == 0) return;
    lunar_scope_frame *f = &ctx->scopes[--ctx->scope_depth];
    lunar_scope_frame *parent = ctx->scope_depth > 0 ? &ctx->scopes[ctx->scope_depth - 1] : NULL;
    for (size_t i = 0; i < f->count; i++) {
        lunar_storage *s = f->items[i];
        if (f->kept[i]) {
            if (parent) frame_add(ctx, parent, s);   /* on OOM the storage just stops being tracked */
        } else {
            lunar_storage_free(ctx, s);
        }
        lunar_storage_release(ctx, s);
    }
    free(f->items);
    free(f->kept);
}

int lunar_scope_depth(const lunar_ctx *ctx) { return ctx->scope_depth; }
