/* internal.h: struct layouts shared by host/core files (not part of the public API). */
#ifndef LUNAR_CORE_INTERNAL_H
#define LUNAR_CORE_INTERNAL_H

#include "lunar/backend.h"
#include "lunar/ctx.h"
#include "lunar/tensor.h"

typedef struct lunar_scope_frame {
    lunar_storage **items;   /* each holds one reference */
    int            *kept;
    size_t          count, cap;
} lunar_scope_frame;

struct lunar_ctx {
    char          err[2048];
    char          err_where[256];
    lunar_status  err_status;
    int           threads;
    int           default_cuda;   /* index that "cuda" means (lunar.dist sets the local rank's) */
    const lunar_backend *backends[LUNAR_DEVICE_TYPE_COUNT];
    void         *backend_state[LUNAR_DEVICE_TYPE_COUNT];
    int           fake_cpu_devices;   /* LUNAR_FAKE_CPU_DEVICES: debug devices cpu:1.. (ctx.h) */
    lunar_transfer_stats transfers;
    int           check_each_op;      /* ctx.h: a check point after every index op on a device */
    int           range_pending[LUNAR_MAX_CPU_DEVICES];       /* debug devices' pending range errors */
    lunar_range_error range_errors[LUNAR_MAX_CPU_DEVICES];
    lunar_pool   *cpu_pools[LUNAR_MAX_CPU_DEVICES];
    lunar_pool   *cuda_pools[LUNAR_MAX_CUDA_DEVICES];
    lunar_scope_frame *scopes;
    int           scope_depth, scope_cap;
};

struct lunar_arena {
    char         name[64];
    lunar_device device;
    void        *base;
    size_t       capacity, used, peak;
    uint64_t     generation;
    int          refcount;   /* the owner's reference plus one per live storage */
    int          freed;
};

lunar_status lunar_pool_new(lunar_ctx *ctx, lunar_device dev, lunar_pool **out);
void         lunar_pool_destroy(lunar_ctx *ctx, lunar_pool *p);

#endif
