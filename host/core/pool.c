/* pool.c: the owned-buffer pool of one device.
 *
 * Requests are rounded up to a size class (multiples of 256 bytes below 64 KiB, then 8 classes
 * per power of two, so waste stays under 12.5%) and freed blocks are kept in a per-class free
 * list for reuse. The list is a plain array scanned linearly: pools hold tens to hundreds of
 * blocks, and allocation sits outside the kernels' hot loops.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct pool_block { void *ptr; size_t bytes; } pool_block;

struct lunar_pool {
    lunar_device device;
    const lunar_backend *backend;
    pool_block *free_blocks;
    size_t free_count, free_cap;
    lunar_pool_stats stats;
};

/* The size class of an n-byte request; 0 when n is too large to have one (above half the
 * address space, where the doubling below would overflow). */
static size_t size_class(size_t n) {
    if (n == 0) n = 1;
    if (n <= 65536) return (n + 255) & ~(size_t)255;
    if (n > SIZE_MAX / 2) return 0;
    size_t p = 65536;
    while (p * 2 < n) p *= 2;             /* p < n <= 2p */
    size_t step = p / 8;
    return ((n + step - 1) / step) * step;
}

lunar_status lunar_pool_new(lunar_ctx *ctx, lunar_device dev, lunar_pool **out) {
    LUNAR_TRY(lunar_ctx_check_device(ctx, dev));
    const lunar_backend *be = lunar_ctx_backend(ctx, dev.type);
    lunar_pool *p = calloc(1, sizeof *p);
    if (!p) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "out of host memory for a pool");
    p->device = dev;
    p->backend = be;
    *out = p;
    return LUNAR_OK;
}

void lunar_pool_trim(lunar_ctx *ctx, lunar_pool *p) {
    for (size_t i = 0; i < p->free_count; i++)
        p->backend->free(ctx, p->device.index, p->free_blocks[i].ptr);
    p->free_count = 0;
    p->stats.cached = 0;
}

void lunar_pool_destroy(lunar_ctx *ctx, lunar_pool *p) {
    lunar_pool_trim(ctx, p);
    free(p->free_blocks);
    free(p);
}

lunar_status lunar_pool_get(lunar_ctx *ctx, lunar_pool *p, size_t nbytes, void **out, size_t *class_bytes) {
    size_t bytes = size_class(nbytes);
    if (bytes == 0) {
        char d[32];
        lunar_device_format(p->device, d, sizeof d);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: cannot allocate %zu bytes (more than half the address space)", d,
                          nbytes);
    }
    for (size_t i = p->free_count; i-- > 0;) {
        if (p->free_blocks[i].bytes == bytes) {
            *out = p->free_blocks[i].ptr;
            p->free_blocks[i] = p->free_blocks[--p->free_count];
            p->stats.cached -= bytes;
            p->stats.reuses++;
            goto done;
        }
    }
    lunar_status st = p->backend->alloc(ctx, p->device.index, bytes, out);
    if (st != LUNAR_OK) {
        /* give the cache back and try once more before failing */
        lunar_pool_trim(ctx, p);
        st = p->backend->alloc(ctx, p->device.index, bytes, out);
        if (st != LUNAR_OK) return st;
    }
    p->stats.allocs++;
done:
    *class_bytes = bytes;
    p->stats.in_use += bytes;
    if (p->stats.in_use > p->stats.peak_in_use) p->stats.peak_in_use = p->stats.in_use;
    return LUNAR_OK;
}

void lunar_pool_put(lunar_ctx *ctx, lunar_pool *p, void *ptr, size_t class_bytes) {
    p->stats.in_use -= class_bytes;
    if (p->free_count == p->free_cap) {
        size_t cap = p->free_cap ? p->free_cap * 2 : 64;
        pool_block *b = realloc(p->free_blocks, cap * sizeof *b);
        if (!b) { p->backend->free(ctx, p->device.index, ptr); return; }
        p->free_blocks = b;
        p->free_cap = cap;
    }
    p->free_blocks[p->free_count].ptr = ptr;
    p->free_blocks[p->free_count].bytes = class_bytes;
    p->free_count++;
    p->stats.cached += class_bytes;
}

lunar_pool_stats lunar_pool_stats_get(const lunar_pool *p) { return p->stats; }
