/* status.h: every fallible lunar function returns a lunar_status.
 *
 * The message that goes with a failure is written into the lunar_ctx that was passed in
 * (lunar_ctx_error), never into a global. Library code never exits, aborts or longjmps: the Lua
 * bindings turn a status into a Lua error at the boundary, after releasing what they hold.
 */
#ifndef LUNAR_STATUS_H
#define LUNAR_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lunar_status {
    LUNAR_OK = 0,
    LUNAR_ERR_ARG,          /* bad argument value */
    LUNAR_ERR_SHAPE,        /* shapes that do not fit together */
    LUNAR_ERR_DTYPE,        /* dtype not supported or mismatched */
    LUNAR_ERR_DEVICE,       /* tensors on different devices, or device not available */
    LUNAR_ERR_OOM,          /* allocation failed or arena full */
    LUNAR_ERR_STALE,        /* tensor used after free() or after its arena was reset */
    LUNAR_ERR_IO,           /* file system */
    LUNAR_ERR_FORMAT,       /* malformed file contents */
    LUNAR_ERR_CUDA,         /* CUDA runtime / cuBLAS */
    LUNAR_ERR_COMM,         /* MPI / NCCL */
    LUNAR_ERR_UNSUPPORTED,  /* not built in, or not implemented for this case */
    LUNAR_ERR_INTERNAL,
    LUNAR_STATUS_COUNT
} lunar_status;

const char * lunar_status_name(lunar_status st);

#ifdef __cplusplus
}
#endif

#endif
