/* check.c: check points, where the index range errors that devices kept are raised (ops.h).
 *
 * Reading device memory on the host waits for every op queued before it, so an index op on a
 * device does not read back whether its index values were in range: the device keeps the first
 * bad value (CUDA in a record in device memory, the debug devices cpu:N in the context) and a
 * check point reads it once. The read is counted as a transfer like any other (ctx.h), so a
 * budget test on cpu:1 sees a check that comes back once per op.
 */
#include <stdio.h>

#include "prep.h"

lunar_status lunar_range_error_fail(lunar_ctx *ctx, const lunar_range_error *e, lunar_device dev, int deferred) {
    char where[96] = "", note[256] = "";
    if (e->dim >= 0) snprintf(where, sizeof where, "dim %d (0-based)", e->dim);
    else snprintf(where, sizeof where, "the indexed dim");
    if (deferred && !lunar_ctx_check_each_op(ctx)) {
        char d[32];
        lunar_device_format(dev, d, sizeof d);
        snprintf(note, sizeof note,
                 " (found on %s, which reports bad indices at its next check point; LUNAR_CHECK_EACH_OP=1 reports them at the op)",
                 d);
    }
    if (!e->op)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG,
                          "an index op: index %lld (at flat position %lld of the index) out of range, valid 0..%lld; more index ops ran before the check than the device remembers, so which one is unknown%s",
                          (long long)e->value, (long long)e->pos, (long long)e->n - 1, note);
    return LUNAR_FAIL(ctx, LUNAR_ERR_ARG,
                      "%s: index %lld (at flat position %lld of the index) out of range: %s '%s' has %lld entries along %s, valid 0..%lld%s",
                      e->op, (long long)e->value, (long long)e->pos, e->role, e->label, (long long)e->n, where,
                      (long long)e->n - 1, note);
}

lunar_status lunar_sync_check(lunar_ctx *ctx, lunar_device dev) {
    if (lunar_ctx_check_device(ctx, dev) != LUNAR_OK) {
        lunar_ctx_prefix_error(ctx, "sync_check");
        return lunar_ctx_status(ctx);
    }
    if (lunar_device_is_host(dev)) return LUNAR_OK;   /* the host raised every bad index at its op */
    const lunar_backend *be = lunar_ctx_backend(ctx, dev.type);
    lunar_range_error e;
    int found = 0;
    if (dev.type == LUNAR_DEVICE_CPU) {
        /* the debug devices: the values were checked on the host when the op ran (index.c) */
        found = lunar_ctx_take_range_error(ctx, dev, &e);
    } else {
        if (!be->take_range_error) return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "sync_check: %s has no range record", be->name);
        LUNAR_TRY(be->take_range_error(ctx, dev.index, &e, &found));
    }
    lunar_ctx_count_transfer(ctx, 1, sizeof(int64_t) * 4);   /* the record: op, position, value, range */
    return found ? lunar_range_error_fail(ctx, &e, dev, 1) : LUNAR_OK;
}
