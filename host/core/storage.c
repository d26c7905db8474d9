/* storage.c: refcounted blocks of device memory (owned, arena or external). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

lunar_status lunar_storage_new(lunar_ctx *ctx, lunar_storage **out, lunar_device dev, size_t nbytes) {
    lunar_pool *pool;
    LUNAR_TRY(lunar_ctx_pool(ctx, dev, &pool));
    lunar_storage *s = calloc(1, sizeof *s);
    if (!s) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "out of host memory for a storage header");
    lunar_status st = lunar_pool_get(ctx, pool, nbytes, &s->data, &s->pool_bytes);
    if (st != LUNAR_OK) { free(s); return st; }
    s->nbytes = nbytes;
    s->device = dev;
    s->kind = LUNAR_STORAGE_OWNED;
    s->refcount = 1;
    s->pool = pool;
    *out = s;
    return LUNAR_OK;
}

lunar_status lunar_storage_wrap(lunar_ctx *ctx, lunar_storage **out, lunar_device dev, void *data,
                                size_t nbytes, void (*release)(void *ud, void *data), void *release_ud) {
    lunar_storage *s = calloc(1, sizeof *s);
    if (!s) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "out of host memory for a storage header");
    s->data = data;
    s->nbytes = nbytes;
    s->device = dev;
    s->kind = LUNAR_STORAGE_EXTERNAL;
    s->refcount = 1;
    s->release = release;
    s->release_ud = release_ud;
    *out = s;
    return LUNAR_OK;
}

void lunar_storage_retain(lunar_storage *s) {
    if (s) s->refcount++;
}

void lunar_storage_free(lunar_ctx *ctx, lunar_storage *s) {
    if (!s || s->freed) return;
    s->freed = 1;
    switch (s->kind) {
    case LUNAR_STORAGE_OWNED:
        if (s->data) lunar_pool_put(ctx, s->pool, s->data, s->pool_bytes);
        break;
    case LUNAR_STORAGE_EXTERNAL:
        if (s->release) s->release(s->release_ud, s->data);
        break;
    case LUNAR_STORAGE_ARENA:
        /* the memory belongs to the arena; only the arena reference goes (below) */
        break;
    }
    s->data = NULL;
    if (s->kind == LUNAR_STORAGE_ARENA && s->arena) {
        lunar_arena *a = s->arena;
        s->arena = NULL;
        lunar_arena_release(ctx, a);
    }
}

void lunar_storage_release(lunar_ctx *ctx, lunar_storage *s) {
    if (!s) return;
    if (--s->refcount > 0) return;
    lunar_storage_free(ctx, s);
    free(s);
}
