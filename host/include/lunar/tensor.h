/* tensor.h: storage, tensors and views (the torch7 model: storage + offset + shape + strides).
 *
 * A lunar_storage is a refcounted block of device memory that comes from one of three places:
 *   OWNED    the context's owned-buffer pool of that device; freed by lunar_storage_free()
 *            (idempotent) or when the last reference goes, returning the block to the pool;
 *   ARENA    a bump allocation inside a lunar_arena; it dies when the arena is reset or freed,
 *            which bumps the arena's generation so every older view is detected as stale;
 *   EXTERNAL memory lunar does not own (mmapped files, caller buffers), with an optional
 *            release callback.
 *
 * A lunar_tensor is a small value struct: a storage reference plus dtype, offset, shape and
 * strides, all in elements. Views (narrow, select, transpose, reshape, expand) share the storage.
 * Every op checks its tensors with lunar_tensor_check(), which turns use-after-free and use after
 * an arena reset into an error that names the tensor.
 *
 * Dimensions are 0-based in C (the Lua layer is 1-based, like torch7).
 */
#ifndef LUNAR_TENSOR_H
#define LUNAR_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "lunar/ctx.h"
#include "lunar/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LUNAR_MAX_DIMS 8
#define LUNAR_NAME_MAX 128

typedef struct lunar_arena lunar_arena;

typedef enum lunar_storage_kind {
    LUNAR_STORAGE_OWNED = 0,
    LUNAR_STORAGE_ARENA,
    LUNAR_STORAGE_EXTERNAL,
} lunar_storage_kind;

typedef struct lunar_storage {
    void        *data;            /* NULL once freed */
    size_t       nbytes;
    lunar_device device;
    int          kind;            /* lunar_storage_kind */
    int          refcount;
    int          freed;           /* set by lunar_storage_free */
    lunar_pool  *pool;            /* OWNED: where data goes back */
    size_t       pool_bytes;      /* OWNED: the size class it came from */
    lunar_arena *arena;           /* ARENA: the arena (retained) */
    uint64_t     arena_generation;/* ARENA: arena generation at allocation */
    void       (*release)(void *ud, void *data);  /* EXTERNAL: called once when freed */
    void        *release_ud;
} lunar_storage;

typedef struct lunar_tensor {
    lunar_storage *storage;       /* NULL for an empty (unset) tensor */
    lunar_dtype    dtype;
    int            ndim;          /* 0 = scalar */
    int64_t        offset;        /* elements from storage->data */
    int64_t        shape[LUNAR_MAX_DIMS];
    int64_t        stride[LUNAR_MAX_DIMS];
    char           name[LUNAR_NAME_MAX];  /* "" if unnamed; used in every error message */
} lunar_tensor;

/* ---- storage ------------------------------------------------------------------------- */

/* A new OWNED storage of nbytes on dev (refcount 1). */
lunar_status lunar_storage_new(lunar_ctx *ctx, lunar_storage **out, lunar_device dev, size_t nbytes);
/* Wrap memory lunar does not own (refcount 1). release may be NULL. */
lunar_status lunar_storage_wrap(lunar_ctx *ctx, lunar_storage **out, lunar_device dev, void *data,
                                size_t nbytes, void (*release)(void *ud, void *data), void *release_ud);
void lunar_storage_retain(lunar_storage *s);
void lunar_storage_release(lunar_ctx *ctx, lunar_storage *s);   /* drops one reference */
/* Frees the memory now (every view becomes stale); the header lives until its last release. */
void lunar_storage_free(lunar_ctx *ctx, lunar_storage *s);

/* ---- tensors --------------------------------------------------------------------------- */

/* Sets t to a fresh contiguous tensor of the given shape in OWNED storage. t must be empty or
 * released. Contents are uninitialised. */
lunar_status lunar_tensor_new(lunar_ctx *ctx, lunar_tensor *t, lunar_dtype dt, lunar_device dev,
                              int ndim, const int64_t *shape);
/* Same, but the memory comes from an arena. */
lunar_status lunar_tensor_new_in(lunar_ctx *ctx, lunar_tensor *t, lunar_arena *a, lunar_dtype dt,
                                 int ndim, const int64_t *shape);
/* A contiguous tensor over existing storage (retained), starting at element offset. */
lunar_status lunar_tensor_from_storage(lunar_ctx *ctx, lunar_tensor *t, lunar_storage *s, lunar_dtype dt,
                                       int64_t offset, int ndim, const int64_t *shape);
/* Drops t's storage reference and zeroes t. Safe on an empty tensor. */
void lunar_tensor_release(lunar_ctx *ctx, lunar_tensor *t);
/* dst = another reference to the same view as src (dst must be empty). */
void lunar_tensor_share(lunar_tensor *dst, const lunar_tensor *src);
void lunar_tensor_set_name(lunar_tensor *t, const char *name);
/* A printable name: the tensor's name, or "tensor" when unnamed. */
const char *lunar_tensor_label(const lunar_tensor *t);

int64_t lunar_tensor_numel(const lunar_tensor *t);
size_t  lunar_tensor_nbytes(const lunar_tensor *t);   /* numel * element size */
int     lunar_tensor_is_contiguous(const lunar_tensor *t);
lunar_device lunar_tensor_device(const lunar_tensor *t);
/* Pointer to element 0 of the view (NULL if freed/stale: call lunar_tensor_check first). */
void   *lunar_tensor_data(const lunar_tensor *t);
/* "(2, 3, 4)" */
void    lunar_shape_format(int ndim, const int64_t *shape, char *buf, size_t n);
void    lunar_tensor_shape_str(const lunar_tensor *t, char *buf, size_t n);
int     lunar_tensor_same_shape(const lunar_tensor *a, const lunar_tensor *b);
/* 1 if a and b are views of one storage whose address ranges intersect (they may share
 * elements): an op writing one while reading the other must go through a temporary. */
int     lunar_tensor_overlaps(const lunar_tensor *a, const lunar_tensor *b);
/* 1 if a and b address the same elements in the same order with the same dtype (strides of
 * size-1 dims aside): one view, possibly through two tensor structs. */
int     lunar_tensor_same_view(const lunar_tensor *a, const lunar_tensor *b);

/* LUNAR_OK if t can be used: it has storage, was not freed, and its arena was not reset since.
 * The error names the tensor ("tensor 'w' is a view of arena 'step' generation 41 (now 42)"). */
lunar_status lunar_tensor_check(lunar_ctx *ctx, const lunar_tensor *t);

/* ---- views: out must be empty; it shares src's storage ------------------------------------ */

lunar_status lunar_tensor_narrow(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                 int dim, int64_t start, int64_t length);
lunar_status lunar_tensor_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                 int dim, int64_t index);
lunar_status lunar_tensor_transpose(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                    int dim0, int dim1);
lunar_status lunar_tensor_permute(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                  const int *perm);
/* Reshape without copying; fails (LUNAR_ERR_SHAPE) when the strides do not allow it. One entry
 * of shape may be -1. */
lunar_status lunar_tensor_view(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                               int ndim, const int64_t *shape);
/* Broadcast size-1 dims (stride 0) to shape; ndim may add leading dims. */
lunar_status lunar_tensor_expand(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src,
                                 int ndim, const int64_t *shape);
lunar_status lunar_tensor_unsqueeze(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim);
lunar_status lunar_tensor_squeeze(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, int dim);

/* Shapes a and b broadcast to (numpy rules). */
lunar_status lunar_broadcast_shape(lunar_ctx *ctx, const lunar_tensor *a, const lunar_tensor *b,
                                   int *ndim, int64_t *shape);

/* ---- arenas ------------------------------------------------------------------------------ */

/* An arena is one block of device memory handed out by bump allocation (64-byte aligned) to
 * tensors of one lifetime (weights, grads, step activations...). reset() makes every tensor
 * carved from it stale at once. The arena header is refcounted by its storages, so a stale view
 * can still be diagnosed after the arena itself was freed. */
lunar_status lunar_arena_new(lunar_ctx *ctx, lunar_arena **out, const char *name, lunar_device dev,
                             size_t capacity);
lunar_status lunar_arena_alloc(lunar_ctx *ctx, lunar_arena *a, size_t nbytes, lunar_storage **out);
void         lunar_arena_reset(lunar_arena *a);
void         lunar_arena_free(lunar_ctx *ctx, lunar_arena *a);      /* frees the block; idempotent */
void         lunar_arena_retain(lunar_arena *a);
void         lunar_arena_release(lunar_ctx *ctx, lunar_arena *a);
const char  *lunar_arena_name(const lunar_arena *a);
size_t       lunar_arena_used(const lunar_arena *a);
size_t       lunar_arena_capacity(const lunar_arena *a);
size_t       lunar_arena_peak(const lunar_arena *a);
uint64_t     lunar_arena_generation(const lunar_arena *a);
lunar_device lunar_arena_device(const lunar_arena *a);
int          lunar_arena_is_freed(const lunar_arena *a);

/* ---- the owned-buffer pool ---------------------------------------------------------------- */

/* Each device has a pool that rounds requests to size classes and keeps freed blocks for reuse,
 * so that steady-state training does no fresh allocation (first touch costs ~3 ms/MiB on the
 * development VM, and cudaMalloc synchronises). */
typedef struct lunar_pool_stats {
    size_t in_use;        /* bytes handed out */
    size_t cached;        /* bytes held for reuse */
    size_t peak_in_use;
    uint64_t allocs, reuses;
} lunar_pool_stats;

lunar_status lunar_pool_get(lunar_ctx *ctx, lunar_pool *p, size_t nbytes, void **out, size_t *class_bytes);
void         lunar_pool_put(lunar_ctx *ctx, lunar_pool *p, void *ptr, size_t class_bytes);
void         lunar_pool_trim(lunar_ctx *ctx, lunar_pool *p);   /* give cached blocks back */
lunar_pool_stats lunar_pool_stats_get(const lunar_pool *p);

/* ---- scopes ------------------------------------------------------------------------------- */

/* lunar.scope(fn): OWNED storages tracked while a scope is open are freed when it closes,
 * except those marked kept (they move to the enclosing scope). The Lua layer tracks what it
 * creates for the user; internal temporaries of ops are not tracked (they are freed by the op). */
lunar_status lunar_scope_push(lunar_ctx *ctx);
lunar_status lunar_scope_track(lunar_ctx *ctx, lunar_storage *s);   /* no-op outside a scope */
void         lunar_scope_keep(lunar_ctx *ctx, lunar_storage *s);
/* Stop tracking s in any open scope: it outlives them (parameters, gradients, optimizer state). */
void         lunar_scope_untrack(lunar_ctx *ctx, lunar_storage *s);
void         lunar_scope_pop(lunar_ctx *ctx);
int          lunar_scope_depth(const lunar_ctx *ctx);

#ifdef __cplusplus
}
#endif

#endif
