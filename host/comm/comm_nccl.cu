// comm_nccl.cu: collectives on CUDA tensors through NCCL, on the tensor's stream (the same
// per-device stream the kernels use, so no extra synchronisation is needed around them).
// host/comm/comm_mpi.c has already validated the call, checked it across ranks, staged the
// tensors (contiguous, on the communicator's device) and bootstrapped the communicator.
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

#include "comm_nccl.h"
#include "cuda/common.cuh"

static_assert(sizeof(ncclUniqueId) == LUNAR_NCCL_ID_BYTES, "LUNAR_NCCL_ID_BYTES must be sizeof(ncclUniqueId)");

struct lunar_nccl {
    ncclComm_t comm;
    int        device;
};

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
#define LUNAR_NCCL_DETAIL(comm) ncclGetLastError(comm)
#else
#define LUNAR_NCCL_DETAIL(comm) ""
#endif

// Return a status naming the failed call; the message goes into ctx.
#define LUNAR_NCCL_CHECK(ctx, comm, expr)                                                       \
    do {                                                                                        \
        ncclResult_t r_ = (expr);                                                               \
        if (r_ != ncclSuccess)                                                                  \
            return LUNAR_FAIL((ctx), LUNAR_ERR_COMM, "%s: %s %s", #expr, ncclGetErrorString(r_), \
                              LUNAR_NCCL_DETAIL(comm));                                         \
    } while (0)

static lunar_status nccl_reduce_type(lunar_ctx *ctx, lunar_dtype dt, ncclDataType_t *out) {
    switch (dt) {
    case LUNAR_DTYPE_F32: *out = ncclFloat32; return LUNAR_OK;
    case LUNAR_DTYPE_F64: *out = ncclFloat64; return LUNAR_OK;
    case LUNAR_DTYPE_BF16: *out = ncclBfloat16; return LUNAR_OK;
    case LUNAR_DTYPE_F16: *out = ncclFloat16; return LUNAR_OK;
    case LUNAR_DTYPE_I8: *out = ncclInt8; return LUNAR_OK;
    case LUNAR_DTYPE_I32: *out = ncclInt32; return LUNAR_OK;
    case LUNAR_DTYPE_I64: *out = ncclInt64; return LUNAR_OK;
    case LUNAR_DTYPE_U8:
    case LUNAR_DTYPE_BOOL: *out = ncclUint8; return LUNAR_OK;
    default:
        return LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "nccl: no reduction for dtype %s", lunar_dtype_name(dt));
    }
}

static ncclRedOp_t nccl_op(lunar_comm_op op) {
    switch (op) {
    case LUNAR_COMM_AVG: return ncclAvg;
    case LUNAR_COMM_MAX: return ncclMax;
    case LUNAR_COMM_MIN: return ncclMin;
    default: return ncclSum;
    }
}

extern "C" lunar_status lunar_nccl_unique_id(lunar_ctx *ctx, unsigned char id[LUNAR_NCCL_ID_BYTES]) {
    ncclUniqueId uid;
    LUNAR_NCCL_CHECK(ctx, (ncclComm_t)NULL, ncclGetUniqueId(&uid));
    memcpy(id, &uid, sizeof uid);
    return LUNAR_OK;
}

extern "C" lunar_status lunar_nccl_init(lunar_ctx *ctx, lunar_nccl **out, const unsigned char id[LUNAR_NCCL_ID_BYTES],
                                        int size, int rank, int device) {
    *out = NULL;
    lunar_cuda_device *d;
    LUNAR_TRY(lunar_cuda_device_get(ctx, device, &d));   // makes the device current
    ncclUniqueId uid;
    memcpy(&uid, id, sizeof uid);
    ncclComm_t comm;
    LUNAR_NCCL_CHECK(ctx, (ncclComm_t)NULL, ncclCommInitRank(&comm, size, uid, rank));
    lunar_nccl *n = (lunar_nccl *)calloc(1, sizeof *n);
    if (!n) {
        ncclCommDestroy(comm);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "nccl: out of host memory");
    }
    n->comm = comm;
    n->device = device;
    *out = n;
    return LUNAR_OK;
}

extern "C" void lunar_nccl_free(lunar_nccl *n) {
    if (!n) return;
    ncclCommDestroy(n->comm);
    free(n);
}

extern "C" int lunar_nccl_device(const lunar_nccl *n) { return n->device; }

extern "C" lunar_status lunar_nccl_all_reduce(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *t, lunar_comm_op op) {
    cudaStream_t stream;
    ncclDataType_t type = ncclFloat32;
    LUNAR_TRY(nccl_reduce_type(ctx, t->dtype, &type));
    LUNAR_TRY(lunar_cuda_stream_for(ctx, t, &stream));
    void *p = lunar_tensor_data(t);
    LUNAR_NCCL_CHECK(ctx, n->comm,
                     ncclAllReduce(p, p, (size_t)lunar_tensor_numel(t), type, nccl_op(op), n->comm, stream));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_nccl_all_gather(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out, const lunar_tensor *in) {
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, in, &stream));
    // rank-major concatenation along dim 0 is exactly NCCL's output layout
    LUNAR_NCCL_CHECK(ctx, n->comm,
                     ncclAllGather(lunar_tensor_data(in), lunar_tensor_data(out), lunar_tensor_nbytes(in), ncclUint8,
                                   n->comm, stream));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_nccl_reduce_scatter(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out,
                                                  const lunar_tensor *in, lunar_comm_op op) {
    cudaStream_t stream;
    ncclDataType_t type = ncclFloat32;
    LUNAR_TRY(nccl_reduce_type(ctx, in->dtype, &type));
    LUNAR_TRY(lunar_cuda_stream_for(ctx, in, &stream));
    LUNAR_NCCL_CHECK(ctx, n->comm,
                     ncclReduceScatter(lunar_tensor_data(in), lunar_tensor_data(out), (size_t)lunar_tensor_numel(out),
                                       type, nccl_op(op), n->comm, stream));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_nccl_reduce_scatter_v(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out,
                                                    const lunar_tensor *in, const int64_t *counts, int size, int me,
                                                    lunar_comm_op op) {
    cudaStream_t stream;
    ncclDataType_t type = ncclFloat32;
    LUNAR_TRY(nccl_reduce_type(ctx, in->dtype, &type));
    LUNAR_TRY(lunar_cuda_stream_for(ctx, in, &stream));
    const char *src = (const char *)lunar_tensor_data(in);
    size_t el = lunar_dtype_size(in->dtype);
    // one reduction per member that receives a piece, rooted there; only the root's receive
    // buffer is written, so the others pass their own input piece (never written)
    LUNAR_NCCL_CHECK(ctx, n->comm, ncclGroupStart());
    ncclResult_t r = ncclSuccess;
    int64_t off = 0;
    for (int j = 0; j < size && r == ncclSuccess; j++) {
        if (counts[j] > 0) {
            const void *piece = src + (size_t)off * el;
            void *recv = j == me ? lunar_tensor_data(out) : (void *)piece;
            r = ncclReduce(piece, recv, (size_t)counts[j], type, nccl_op(op), j, n->comm, stream);
        }
        off += counts[j];
    }
    ncclResult_t e = ncclGroupEnd();
    LUNAR_NCCL_CHECK(ctx, n->comm, r);
    LUNAR_NCCL_CHECK(ctx, n->comm, e);
    return LUNAR_OK;
}

extern "C" lunar_status lunar_nccl_broadcast(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *t, int root) {
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, t, &stream));
    void *p = lunar_tensor_data(t);
    LUNAR_NCCL_CHECK(ctx, n->comm, ncclBroadcast(p, p, lunar_tensor_nbytes(t), ncclUint8, root, n->comm, stream));
    return LUNAR_OK;
}

extern "C" lunar_status lunar_nccl_all_to_all(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out, const lunar_tensor *in,
                                              const int64_t *send_rows, const int64_t *recv_rows, int64_t row_bytes,
                                              int size, int me) {
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, in, &stream));
    const char *src = (const char *)lunar_tensor_data(in);
    char *dst = (char *)lunar_tensor_data(out);
    // this member's own rows: a device copy, outside the NCCL group
    int64_t soff = 0, roff = 0;
    for (int j = 0; j < me; j++) soff += send_rows[j], roff += recv_rows[j];
    if (send_rows[me] > 0)
        LUNAR_CUDA_CHECK(ctx, cudaMemcpyAsync(dst + roff * row_bytes, src + soff * row_bytes,
                                              (size_t)(send_rows[me] * row_bytes), cudaMemcpyDeviceToDevice, stream));
    // every other member: grouped sends and receives, so NCCL schedules them together
    LUNAR_NCCL_CHECK(ctx, n->comm, ncclGroupStart());
    ncclResult_t r = ncclSuccess;
    soff = roff = 0;
    for (int j = 0; j < size; j++) {
        if (j != me && send_rows[j] > 0 && r == ncclSuccess)
            r = ncclSend(src + soff * row_bytes, (size_t)(send_rows[j] * row_bytes), ncclUint8, j, n->comm, stream);
        if (j != me && recv_rows[j] > 0 && r == ncclSuccess)
            r = ncclRecv(dst + roff * row_bytes, (size_t)(recv_rows[j] * row_bytes), ncclUint8, j, n->comm, stream);
        soff += send_rows[j];
        roff += recv_rows[j];
    }
    ncclResult_t e = ncclGroupEnd();
    LUNAR_NCCL_CHECK(ctx, n->comm, r);
    LUNAR_NCCL_CHECK(ctx, n->comm, e);
    return LUNAR_OK;
}

extern "C" lunar_status lunar_nccl_send_recv(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *recv, int src,
                                             const lunar_tensor *send, int dst) {
    cudaStream_t stream;
    LUNAR_TRY(lunar_cuda_stream_for(ctx, send ? send : recv, &stream));
    LUNAR_NCCL_CHECK(ctx, n->comm, ncclGroupStart());
    ncclResult_t r = ncclSuccess;
    if (send && lunar_tensor_nbytes(send) > 0)
        r = ncclSend(lunar_tensor_data(send), lunar_tensor_nbytes(send), ncclUint8, dst, n->comm, stream);
    if (recv && lunar_tensor_nbytes(recv) > 0 && r == ncclSuccess)
        r = ncclRecv(lunar_tensor_data(recv), lunar_tensor_nbytes(recv), ncclUint8, src, n->comm, stream);
    ncclResult_t e = ncclGroupEnd();
    LUNAR_NCCL_CHECK(ctx, n->comm, r);
    LUNAR_NCCL_CHECK(ctx, n->comm, e);
    return LUNAR_OK;
}
