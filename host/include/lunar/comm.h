/* comm.h: process groups and collectives on tensors.
 *
 * A lunar_comm is a group of ranks (the world, or a tp/dp/ep/... group split from it). It wraps
 * an MPI communicator; CPU tensors go through MPI, CUDA tensors through an NCCL communicator
 * that the group creates on its first CUDA collective (rank 0 of the group makes the NCCL id and
 * broadcasts it over MPI), on the tensor's stream. A process that was not started by a launcher
 * (no OMPI_COMM_WORLD_SIZE / PMI_SIZE / PMIX_RANK in the environment) gets a single-rank world
 * made without calling MPI at all, so `lunar script.lua` never needs mpirun. A lunar built
 * without MPI (LUNAR_WITH_MPI off) only has that world; under a launcher with several ranks its
 * init fails with a message saying so.
 *
 * On a group of one member every collective is done locally (a copy at most), with one
 * exception: after lunar_comm_nccl_init, CUDA tensors go through the group's one-rank NCCL
 * communicator (created from a local id, without MPI), which lets a single GPU test NCCL.
 *
 * Every operation is collective over the group: all members call it, in the same order, with
 * tensors of the same dtype and device and matching shapes. With checks on (the default), each
 * collective first compares a small signature (op, dtype, device type, shape, root, reduce op)
 * across the group with one tiny MPI all-reduce, so a mismatch becomes an error on every member
 * that names the op, the group and both shapes, instead of a hang or garbage. Point-to-point
 * transfers send the signature ahead of the data and the receiver checks it.
 *
 * Tensors may be any strided view: non-contiguous ones go through a contiguous staging copy.
 * Reductions of bf16/f16/f8 CPU tensors are computed in f32 (MPI has no such types) and
 * rounded once at the end; CUDA reductions use NCCL's native types (f8 in f32). avg is for
 * floating dtypes only; bool takes max/min only. Data movement (gather, broadcast, all-to-all,
 * send/recv) takes every dtype.
 *
 * CPU transfers are blocking, except the non-blocking *_start collectives (a request finished by
 * lunar_comm_wait). CUDA transfers are ordered on the tensor's stream: the call returns once the
 * work is queued. Pair blocking sends and receives so they cannot wait on each other
 * (for a ring, use lunar_comm_send_recv).
 *
 * Ranks and coordinates are 0-based; dim 0 is the first dimension.
 */
#ifndef LUNAR_COMM_H
#define LUNAR_COMM_H

#include <stdint.h>

#include "lunar/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lunar_comm lunar_comm;

#define LUNAR_COMM_NAME_MAX 64

typedef enum lunar_comm_op {
    LUNAR_COMM_SUM = 0,
    LUNAR_COMM_AVG,
    LUNAR_COMM_MAX,
    LUNAR_COMM_MIN,
    LUNAR_COMM_OP_COUNT
} lunar_comm_op;

const char *lunar_comm_op_name(lunar_comm_op op);                /* "sum", "avg", ... */
int         lunar_comm_op_from_name(const char *name, lunar_comm_op *out);   /* 1 if known */

/* ---- the launcher's environment (no MPI call; valid before and without init) -------------- */

int lunar_comm_env_launched(void);     /* 1 under mpirun/srun (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK) */
int lunar_comm_env_rank(void);         /* OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, SLURM_PROCID; else 0 */
int lunar_comm_env_size(void);         /* OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS; else 1 */
int lunar_comm_env_local_rank(void);   /* OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID; else -1 */

/* ---- groups --------------------------------------------------------------------------------- */

/* The world. Under a launcher this initialises MPI (MPI_Init_thread, MPI_THREAD_SERIALIZED) if
 * nobody did yet and wraps a duplicate of MPI_COMM_WORLD whose MPI errors come back as
 * LUNAR_ERR_COMM; alone it is a single-rank group without MPI. Collective under a launcher. */
lunar_status lunar_comm_init_world(lunar_ctx *ctx, lunar_comm **out);
/* MPI_Comm_split of parent: members with the same color form a group, ordered by key. Every
 * member of parent calls it. name is used in error messages ("tp", "dp", ...). */
lunar_status lunar_comm_split(lunar_ctx *ctx, lunar_comm **out, lunar_comm *parent, int color, int key,
                              const char *name);
/* Frees the group (its NCCL communicator too). Safe after MPI was finalised, and on NULL. */
void lunar_comm_free(lunar_ctx *ctx, lunar_comm *c);

int         lunar_comm_rank(const lunar_comm *c);
int         lunar_comm_size(const lunar_comm *c);
const char *lunar_comm_name(const lunar_comm *c);
/* World rank of each member, in group order (size entries). */
const int  *lunar_comm_world_ranks(const lunar_comm *c);
/* Rank among the processes on this node (launcher environment, else an MPI shared-memory split). */
int         lunar_comm_local_rank(const lunar_comm *c);
int         lunar_comm_uses_mpi(const lunar_comm *c);
/* 1 once the group has an NCCL communicator (after its first CUDA collective, or nccl_init). */
int         lunar_comm_uses_nccl(const lunar_comm *c);
/* Cross-rank signature checks before each collective (default on; inherited by splits). */
void        lunar_comm_set_checks(lunar_comm *c, int on);
int         lunar_comm_checks(const lunar_comm *c);
/* Creates the NCCL communicator of the group for a CUDA device now (otherwise it is made on the
 * first CUDA collective of a group of several). Collective. On a group of one, CUDA collectives
 * go through NCCL from then on instead of local copies. LUNAR_ERR_UNSUPPORTED in builds
 * without CUDA. */
lunar_status lunar_comm_nccl_init(lunar_ctx *ctx, lunar_comm *c, int device);

/* ---- collectives (ctx, group, outputs, inputs, scalars) -------------------------------------- */

/* t = op over the group of t, in place. (any shape) */
lunar_status lunar_comm_all_reduce(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, lunar_comm_op op);
/* out = the members' in concatenated along dim 0 in rank order.
 *   in (N, ...)   out (size * N, ...) */
lunar_status lunar_comm_all_gather(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in);
/* Reduce in over the group, then split along dim 0: member r keeps rows [r*N, (r+1)*N).
 *   in (size * N, ...)   out (N, ...)      op: sum or avg (max/min too) */
lunar_status lunar_comm_reduce_scatter(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in,
                                       lunar_comm_op op);
/* t = root's t on every member. (any shape) */
lunar_status lunar_comm_broadcast(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, int root);
/* Uneven all-to-all along dim 0: this member sends rows [sum(send_rows[0..j)), +send_rows[j]) of
 * in to member j and receives recv_rows[j] rows from member j, placed in member order in out.
 * send_rows[j] here must equal recv_rows[me] on member j. Zero counts are allowed.
 *   in (sum(send_rows), ...)   out (sum(recv_rows), ...)   send_rows, recv_rows: size entries */
lunar_status lunar_comm_all_to_all(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in,
                                   const int64_t *send_rows, const int64_t *recv_rows);
/* Point to point within the group (peer is a group rank, not this one). */
lunar_status lunar_comm_send(lunar_ctx *ctx, lunar_comm *c, const lunar_tensor *t, int dst);
lunar_status lunar_comm_recv(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, int src);
/* Send to dst and receive from src at once (no ordering deadlock: rings, pipeline shifts). */
lunar_status lunar_comm_send_recv(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *recv, int src,
                                  const lunar_tensor *send, int dst);
lunar_status lunar_comm_barrier(lunar_ctx *ctx, lunar_comm *c);

/* ---- non-blocking collectives ---------------------------------------------------------------
 *
 * A start call checks the tensors (and, with checks on, compares its signature across the group
 * in one small blocking all-reduce, as the blocking collectives do), starts the operation and
 * returns at once with a request; lunar_comm_wait finishes it. Data-parallel training starts the
 * reduction of a bucket of gradients this way as soon as backward has completed the bucket, and
 * waits for all of them before the optimizer step.
 *
 * The tensors are used in place, without staging: they must be contiguous, of a dtype MPI
 * reduces directly on CPU (f32, f64, i8, i32, i64, u8), and neither read, written nor freed
 * until the wait. Non-blocking and blocking collectives do not match each other: every member
 * starts the same operations in the same order. On CUDA the operation is queued on the tensor's
 * stream through NCCL (which is non-blocking by nature) and the wait has nothing left to do: what
 * runs later on that stream sees the result.
 *
 * Every request must be waited for exactly once (also after an error elsewhere: an abandoned
 * request leaves MPI writing into the tensor). lunar_comm_test drives MPI's progress (MPI
 * implementations without a progress thread move data only inside MPI calls), so calling it
 * between pieces of computation lets a reduction advance while backward continues. */

typedef struct lunar_comm_request lunar_comm_request;

/* Starts t = op over the group of t, in place. (any shape, contiguous) */
lunar_status lunar_comm_all_reduce_start(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *t, lunar_comm_op op,
                                         lunar_comm_request **req);
/* Starts a reduce-scatter with uneven pieces: in is a 1-D tensor of sum(counts) elements;
 * member j receives the reduction of elements [sum(counts[0..j)), +counts[j]) into its out, a
 * 1-D tensor of counts[j] elements. Counts may be zero (out then has 0 elements); every member
 * passes the same counts (size entries). in and out must not overlap.
 *   in (sum(counts))   out (counts[me])      op: sum or avg (max/min too) */
lunar_status lunar_comm_reduce_scatter_start(lunar_ctx *ctx, lunar_comm *c, lunar_tensor *out, const lunar_tensor *in,
                                             const int64_t *counts, lunar_comm_op op, lunar_comm_request **req);
/* Sets *done to 1 when the request has finished (then the wait returns at once), else 0. */
lunar_status lunar_comm_test(lunar_ctx *ctx, lunar_comm_request *req, int *done);
/* Waits for the request, finishes it (avg divides here) and frees it, on success and on error.
 * NULL is a no-op. */
lunar_status lunar_comm_wait(lunar_ctx *ctx, lunar_comm_request *req);

/* ---- process level -------------------------------------------------------------------------- */

/* MPI_Finalize if MPI was initialised and not yet finalised (free groups first). */
void lunar_comm_finalize(void);
/* Ends every rank of the job (MPI_Abort) when MPI is initialised; returns otherwise. */
void lunar_comm_abort(int code);
/* 1 while MPI is initialised and not finalised. */
int  lunar_comm_mpi_active(void);

#ifdef __cplusplus
}
#endif

#endif
