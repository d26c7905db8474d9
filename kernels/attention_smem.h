/* attention_smem.h: the shared memory per block that each CUDA attention kernel asks for, and the
 * check of a launch against the device's limit. Plain C, so that tests/c checks the arithmetic
 * and the messages with made-up limits on a machine without a GPU; kernels/cuda/attention.cu
 * calls it with the kernel's static shared memory (cudaFuncGetAttributes: its __shared__
 * arrays, which count against the same limit) and the device's opt-in limit
 * (cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KiB on sm_90 and sm_100, where the default
 * without opting in is 48 KiB).
 *
 * Each kernel's dynamic buffers grow with one shape quantity, its size:
 *     bytes = fixed + per_unit * ceil(size / size_per_unit)
 *   key lists            T (keys)       one bit per key: 4 bytes per 32 keys
 *   forward              Dq + Dv        q and output rows, plus 3 chunks of ATT_CHUNK (scores,
 *                                       mask values, key ids)
 *   backward, per query  2 Dq + Dv      q, dq accumulator and dout rows, plus 3 chunks
 *   backward, per key    Dq + Dv        a dk | dv row per warp
 *   index score          Hi * (Di + 1)  the query's index heads and their weights */
#ifndef LUNAR_KERNELS_ATTENTION_SMEM_H
#define LUNAR_KERNELS_ATTENTION_SMEM_H

#include <stddef.h>
#include <stdint.h>

#include "lunar/ctx.h"

#define LUNAR_ATT_BLOCK 256                      /* threads per block */
#define LUNAR_ATT_WARPS (LUNAR_ATT_BLOCK / 32)
#define LUNAR_ATT_CHUNK 256                      /* keys scored per pass */

typedef struct lunar_att_smem {
    const char *op;          /* the op that launches the kernel, for the message */
    const char *size_name;   /* what size counts, in the contract's names */
    int64_t     size;
    size_t      fixed, per_unit;
    int64_t     size_per_unit;
} lunar_att_smem;

static inline lunar_att_smem lunar_att_smem_make(const char *op, const char *size_name, int64_t size, size_t fixed,
                                                 size_t per_unit, int64_t size_per_unit) {
    lunar_att_smem s;
    s.op = op;
    s.size_name = size_name;
    s.size = size;
    s.fixed = fixed;
    s.per_unit = per_unit;
    s.size_per_unit = size_per_unit;
    return s;
}

static inline lunar_att_smem lunar_att_smem_lists(const char *op, int64_t T) {
    return lunar_att_smem_make(op, "T (keys)", T, 0, 4, 32);
}
static inline lunar_att_smem lunar_att_smem_forward(int64_t Dq, int64_t Dv) {
    return lunar_att_smem_make("attention_forward", "Dq + Dv", Dq + Dv, 3 * LUNAR_ATT_CHUNK * 4, 4, 1);
}
static inline lunar_att_smem lunar_att_smem_backward_q(int64_t Dq, int64_t Dv) {
    return lunar_att_smem_make("attention_backward", "2 Dq + Dv", 2 * Dq + Dv, 3 * LUNAR_ATT_CHUNK * 4, 4, 1);
}
static inline lunar_att_smem lunar_att_smem_backward_kv(int64_t Dq, int64_t Dv) {
    return lunar_att_smem_make("attention_backward", "Dq + Dv", Dq + Dv, 0, 4 * LUNAR_ATT_WARPS, 1);
}
static inline lunar_att_smem lunar_att_smem_index_scores(int64_t Hi, int64_t Di) {
    return lunar_att_smem_make("index_scores", "Hi * (Di + 1)", Hi * (Di + 1), 0, 4, 1);
}

/* the dynamic shared memory of the launch, SIZE_MAX when it does not fit in a size_t */
static inline size_t lunar_att_smem_bytes(const lunar_att_smem *s) {
    uint64_t units = s->size <= 0 ? 0 : (uint64_t)((s->size - 1) / s->size_per_unit + 1);
    if (units > (SIZE_MAX - s->fixed) / s->per_unit) return SIZE_MAX;
    return s->fixed + s->per_unit * (size_t)units;
}

/* the largest size whose launch fits in limit bytes beside static_bytes (-1 when none does) */
static inline int64_t lunar_att_smem_max_size(const lunar_att_smem *s, size_t static_bytes, size_t limit) {
    if (limit < static_bytes || limit - static_bytes < s->fixed) return -1;
    return (int64_t)((limit - static_bytes - s->fixed) / s->per_unit) * s->size_per_unit;
}

/* LUNAR_OK when the launch's dynamic bytes and the kernel's static bytes fit in limit (the most
 * one block of this kernel may have on cuda:device); else lunar's message with the need and the
 * largest size the device takes. */
static inline lunar_status lunar_att_smem_check(lunar_ctx *ctx, const lunar_att_smem *s, size_t static_bytes,
                                                size_t limit, int device) {
    size_t dyn = lunar_att_smem_bytes(s);
    size_t need = dyn > SIZE_MAX - static_bytes ? SIZE_MAX : dyn + static_bytes;
    if (need <= limit) return LUNAR_OK;
    int64_t max = lunar_att_smem_max_size(s, static_bytes, limit);
    if (max < 0)
        return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED,
                          "%s (cuda:%d): the kernel needs more shared memory per block than the %zu bytes the device "
                          "allows", s->op, device, limit);
    if (need == SIZE_MAX)
        return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED,
                          "%s (cuda:%d): %s = %lld is too large for shared memory: at most %s = %lld on this device",
                          s->op, device, s->size_name, (long long)s->size, s->size_name, (long long)max);
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED,
                      "%s (cuda:%d): %s = %lld needs %zu bytes of shared memory per block (%zu for the sizes + %zu of "
                      "the kernel's own), more than the %zu the device allows: at most %s = %lld",
                      s->op, device, s->size_name, (long long)s->size, need, dyn, static_bytes, limit, s->size_name,
                      (long long)max);
}

#endif
