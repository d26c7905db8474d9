// range_error.cu: the host side of the per-device index range record (range_error.cuh).
//
// The record only says which ticket met a bad value; the op, tensor and role of each ticket stay
// on the host, in a ring of the last LUNAR_RANGE_OPS tickets. A check point normally comes once
// per forward and once per optimizer step, far fewer index ops apart than that; if the op has
// left the ring, the message still gives the value, its position and the range, and says the op
// is no longer known.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "range_error.cuh"

#define LUNAR_RANGE_OPS 4096

typedef struct lunar_range_op {
    unsigned long long ticket;   // 0: never used
    const char        *op, *role;
    int                dim;
    char               label[LUNAR_NAME_MAX];
} lunar_range_op;

struct lunar_cuda_range {
    lunar_range_record *rec;      // device memory
    unsigned long long  next;     // the next ticket (from 1)
    lunar_range_op      ops[LUNAR_RANGE_OPS];   // ticket t at t % LUNAR_RANGE_OPS
};

lunar_status lunar_cuda_range_init(lunar_ctx *ctx, lunar_cuda_device *d) {
    d->range = (lunar_cuda_range *)calloc(1, sizeof *d->range);
    if (!d->range) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "cuda: out of host memory for the index range record");
    d->range->next = 1;
    LUNAR_CUDA_CHECK(ctx, cudaMalloc(&d->range->rec, sizeof(lunar_range_record)));
    /* on the device's own stream: it does not wait for the legacy default stream, so a plain
     * cudaMemset would not be ordered before the first index kernel */
    LUNAR_CUDA_CHECK(ctx, cudaMemsetAsync(d->range->rec, 0, sizeof(lunar_range_record), d->stream));
    return LUNAR_OK;
}

void lunar_cuda_range_free(lunar_cuda_device *d) {
    if (!d->range) return;
    if (d->range->rec) cudaFree(d->range->rec);
    free(d->range);
    d->range = NULL;
}

lunar_status lunar_cuda_range_ticket(lunar_ctx *ctx, const lunar_tensor *on, const char *op, const char *role,
                                     const lunar_tensor *data, int dim, lunar_range_ticket *out) {
    lunar_cuda_device *d;
    LUNAR_TRY(lunar_cuda_device_get(ctx, lunar_tensor_device(on).index, &d));
    lunar_cuda_range *r = d->range;
    unsigned long long t = r->next++;
    lunar_range_op *o = &r->ops[t % LUNAR_RANGE_OPS];
    o->ticket = t;
    o->op = op;
    o->role = role;
    o->dim = dim;
    snprintf(o->label, sizeof o->label, "%s", lunar_tensor_label(data));
    out->rec = r->rec;
    out->op = t;
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_take_range_error(lunar_ctx *ctx, int device, lunar_range_error *e, int *found) {
    lunar_cuda_device *d;
    LUNAR_TRY(lunar_cuda_device_get(ctx, device, &d));
    lunar_cuda_range *r = d->range;
    lunar_range_record rec;
    LUNAR_CUDA_CHECK(ctx, cudaMemcpyAsync(&rec, r->rec, sizeof rec, cudaMemcpyDeviceToHost, d->stream));
    LUNAR_CUDA_CHECK(ctx, cudaStreamSynchronize(d->stream));
    *found = rec.op != 0;
    if (!*found) return LUNAR_OK;
    LUNAR_CUDA_CHECK(ctx, cudaMemsetAsync(r->rec, 0, sizeof rec, d->stream));   // ordered before later kernels
    memset(e, 0, sizeof *e);
    const lunar_range_op *o = &r->ops[rec.op % LUNAR_RANGE_OPS];
    e->dim = -1;
    if (o->ticket == rec.op) {
        e->op = o->op;
        e->role = o->role;
        e->dim = o->dim;
        memcpy(e->label, o->label, sizeof e->label);
    }
    e->pos = rec.pos;
    e->value = rec.value;
    e->n = rec.n;
    return LUNAR_OK;
}
