/* arena.c: bump allocation of tensors that share a lifetime. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ARENA_ALIGN 64

lunar_status lunar_arena_new(lunar_ctx *ctx, lunar_arena **out, const char *name, lunar_device dev,
                             size_t capacity) {
    if (lunar_ctx_check_device(ctx, dev) != LUNAR_OK) {
        lunar_ctx_prefix_error(ctx, "arena '%s'", name ? name : "arena");
        return lunar_ctx_status(ctx);
    }
    const lunar_backend *be = lunar_ctx_backend(ctx, dev.type);
    lunar_arena *a = calloc(1, sizeof *a);
    if (!a) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "arena '%s': out of host memory", name);
    snprintf(a->name, sizeof a->name, "%s", name ? name : "arena");
    a->device = dev;
    a->capacity = capacity;
    a->refcount = 1;
    {
        /* a block even for capacity 0, so that storages carved from it (0-byte ones) never
         * have a NULL data pointer, which marks a freed storage */
        lunar_status st = be->alloc(ctx, dev.index, capacity > 0 ? capacity : ARENA_ALIGN, &a->base);
        if (st != LUNAR_OK) {
            lunar_ctx_prefix_error(ctx, "arena '%s' (%zu bytes)", a->name, capacity);
            free(a);
            return st;
        }
    }
    *out = a;
    return LUNAR_OK;
}

lunar_status lunar_arena_alloc(lunar_ctx *ctx, lunar_arena *a, size_t nbytes, lunar_storage **out) {
    if (a->freed) return LUNAR_FAIL(ctx, LUNAR_ERR_STALE, "arena '%s' was freed", a->name);
    size_t start = (a->used + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    if (start > a->capacity || nbytes > a->capacity - start)
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "arena '%s' is full: %zu bytes requested, %zu of %zu used", a->name,
                          nbytes, a->used, a->capacity);
    lunar_storage *s = calloc(1, sizeof *s);
    if (!s) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "out of host memory for a storage header");
    s->data = (char *)a->base + start;
    s->nbytes = nbytes;
    s->device = a->device;
    s->kind = LUNAR_STORAGE_ARENA;
    s->refcount = 1;
    s->arena = a;
    s->arena_generation = a->generation;
    lunar_arena_retain(a);
    a->used = start + nbytes;
    if (a->used > a->peak) a->peak = a->used;
    *out = s;
    return LUNAR_OK;
}

void lunar_arena_reset(lunar_arena *a) {
    a->generation++;
    a->used = 0;
}

void lunar_arena_free(lunar_ctx *ctx, lunar_arena *a) {
    if (!a || a->freed) return;
    a->freed = 1;
    a->generation++;
    a->used = 0;
    if (a->base) {
        const lunar_backend *be = lunar_ctx_backend(ctx, a->device.type);
        if (be) be->free(ctx, a->device.index, a->base);
        a->base = NULL;
    }
}

void lunar_arena_retain(lunar_arena *a) { a->refcount++; }

void lunar_arena_release(lunar_ctx *ctx, lunar_arena *a) {
    if (!a || --a->refcount > 0) return;
    lunar_arena_free(ctx, a);
    free(a);
}

const char *lunar_arena_name(const lunar_arena *a) { return a->name; }
size_t lunar_arena_used(const lunar_arena *a) { return a->used; }
size_t lunar_arena_capacity(const lunar_arena *a) { return a->capacity; }
size_t lunar_arena_peak(const lunar_arena *a) { return a->peak; }
uint64_t lunar_arena_generation(const lunar_arena *a) { return a->generation; }
lunar_device lunar_arena_device(const lunar_arena *a) { return a->device; }
int lunar_arena_is_freed(const lunar_arena *a) { return a->freed; }
