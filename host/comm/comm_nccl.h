/* comm_nccl.h: the NCCL half of lunar_comm (host/comm/comm_nccl.cu, CUDA builds with NCCL only).
 *
 * comm_mpi.c validates, checks signatures across ranks, stages non-contiguous tensors and
 * bootstraps the NCCL communicator over MPI; these functions only issue NCCL calls on the
 * tensor's stream. Every tensor passed here is contiguous and on the communicator's device.
 * Plain C declarations, so both the C host and nvcc read this header; no MPI in it.
 */
#ifndef LUNAR_COMM_NCCL_H
#define LUNAR_COMM_NCCL_H

#include <stdint.h>

#include "lunar/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LUNAR_NCCL_ID_BYTES 128   /* sizeof(ncclUniqueId) */

typedef struct lunar_nccl lunar_nccl;

lunar_status lunar_nccl_unique_id(lunar_ctx *ctx, unsigned char id[LUNAR_NCCL_ID_BYTES]);
/* ncclCommInitRank on `device` (made current first). Collective over the group. */
lunar_status lunar_nccl_init(lunar_ctx *ctx, lunar_nccl **out, const unsigned char id[LUNAR_NCCL_ID_BYTES],
                             int size, int rank, int device);
void         lunar_nccl_free(lunar_nccl *n);
int          lunar_nccl_device(const lunar_nccl *n);

/* t (any shape), in place. op is valid for t's dtype (checked by the host). */
lunar_status lunar_nccl_all_reduce(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *t, lunar_comm_op op);
/* in (N, ...) -> out (size * N, ...) */
lunar_status lunar_nccl_all_gather(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out, const lunar_tensor *in);
/* uneven reduce-scatter of 1-D in: member j gets elements [sum(counts[0..j)), +counts[j]) reduced
 * into its out (counts[me] elements); one ncclReduce per member with a piece, in one NCCL group */
lunar_status lunar_nccl_reduce_scatter_v(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out, const lunar_tensor *in,
                                         const int64_t *counts, int size, int me, lunar_comm_op op);
/* in (size * N, ...) -> out (N, ...) */
lunar_status lunar_nccl_reduce_scatter(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out, const lunar_tensor *in,
                                       lunar_comm_op op);
lunar_status lunar_nccl_broadcast(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *t, int root);
/* rows of row_bytes bytes; counts per member (size entries); me = this member */
lunar_status lunar_nccl_all_to_all(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *out, const lunar_tensor *in,
                                   const int64_t *send_rows, const int64_t *recv_rows, int64_t row_bytes,
                                   int size, int me);
/* send (to dst) and/or recv (from src) in one NCCL group; either tensor may be NULL */
lunar_status lunar_nccl_send_recv(lunar_ctx *ctx, lunar_nccl *n, lunar_tensor *recv, int src,
                                  const lunar_tensor *send, int dst);

#ifdef __cplusplus
}
#endif

#endif
