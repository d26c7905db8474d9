// range_error.cuh: how CUDA index kernels report an index value out of range without a read
// back per op (ops.h, "check points").
//
// Each device has a range record in device memory. A launcher takes a ticket
// (lunar_cuda_range_ticket), which remembers on the host the op, the tensor indexed and its
// role, and passes it to its kernel by value. A kernel thread that meets a bad value skips it and
// calls lunar_index_ok, which records it: the first thread to find the record free claims it with
// a compare-and-swap of its ticket and writes the position, value and range; every later one
// finds it claimed and leaves it. Kernels of one stream run in order, so the record names the
// first op in stream order that met a bad value (when that op met several, the one whose thread
// came first). Nothing is read back here: lunar_sync_check reads the record once
// (lunar_cuda_take_range_error) and clears it.
//
// The convention for an index kernel: take `lunar_range_ticket rt` as an argument and test each
// index value with lunar_index_ok(rt, value, n, flat position in the index) before using it.
#pragma once

#include "common.cuh"

// In device memory, 32 bytes (the read that backend.h's take_range_error counts). op = 0: no bad
// value since the last check; else the ticket of the op that met one.
typedef struct lunar_range_record {
    unsigned long long op;
    long long          pos, value, n;
} lunar_range_record;

typedef struct lunar_range_ticket {
    lunar_range_record *rec;
    unsigned long long  op;   // >= 1, increasing per device
} lunar_range_ticket;

// true when 0 <= v < n; otherwise records (pos, v, n) under the ticket if the record is free.
__device__ __forceinline__ bool lunar_index_ok(lunar_range_ticket rt, int64_t v, int64_t n, int64_t pos) {
    if (v >= 0 && v < n) return true;
    if (atomicCAS(&rt.rec->op, 0ULL, rt.op) == 0ULL) {
        rt.rec->pos = pos;
        rt.rec->value = v;
        rt.rec->n = n;
    }
    return false;
}

// For a launcher: a ticket for an op on the device of `on` that indexes `data` (role "src",
// "dst", "weight", "dweight"; dim 0-based, -1 when the launcher does not know it). Host only:
// nothing is launched or read.
lunar_status lunar_cuda_range_ticket(lunar_ctx *ctx, const lunar_tensor *on, const char *op, const char *role,
                                     const lunar_tensor *data, int dim, lunar_range_ticket *out);

// backend_cuda.cu: the device's record and the ops it remembers, made with the device's other
// state and freed with it (the device is current).
lunar_status lunar_cuda_range_init(lunar_ctx *ctx, lunar_cuda_device *d);
void         lunar_cuda_range_free(lunar_cuda_device *d);
// backend.h take_range_error
extern "C" lunar_status lunar_cuda_take_range_error(lunar_ctx *ctx, int device, lunar_range_error *e, int *found);
