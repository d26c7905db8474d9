/* ctx.h: the lunar context, which every library call takes first.
 *
 * A context owns what would otherwise be global: the last error message, the owned-buffer pools
 * of each device, the stack of lunar.scope() frames, the CPU thread count and the backend table
 * of each device type. One context per process is the normal case (main.c makes it before the
 * Lua VM and frees it after the VM is closed, so no tensor can outlive it).
 */
#ifndef LUNAR_CTX_H
#define LUNAR_CTX_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "lunar/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lunar_ctx lunar_ctx;
typedef struct lunar_backend lunar_backend;
typedef struct lunar_pool lunar_pool;

typedef enum lunar_device_type {
    LUNAR_DEVICE_CPU = 0,
    LUNAR_DEVICE_CUDA = 1,
    LUNAR_DEVICE_TYPE_COUNT
} lunar_device_type;

/* A device is a type and an index: cpu is {CPU, 0}, cuda:3 is {CUDA, 3}. */
typedef struct lunar_device {
    int type;
    int index;
} lunar_device;

#define LUNAR_MAX_CUDA_DEVICES 16

/* Debug devices (a test aid, never for real work): with the environment variable
 * LUNAR_FAKE_CPU_DEVICES=n (1 <= n < LUNAR_MAX_CPU_DEVICES) when the context is made, the CPU
 * backend also exposes cpu:1 .. cpu:n. They are host memory run by the CPU kernels, but lunar
 * treats them as separate devices, as it treats a GPU: each has its own pool, mixing two CPU
 * devices in one op is the device-mismatch error, copies between them go through the backend's
 * copy_to_host / copy_from_host as CUDA transfers do, and element access (get, set, item) goes
 * through those transfers too. Running a workload on cpu:1 thus shows, without a GPU, every
 * place that makes a tensor on the default device or reads device memory on the host. Only
 * cpu:0 (printed "cpu") is the host. */
#define LUNAR_MAX_CPU_DEVICES 4

lunar_status lunar_ctx_init(lunar_ctx **out);
void         lunar_ctx_free(lunar_ctx *ctx);

/* Error reporting. lunar_fail stores the message (printf-style) and returns st, so that a
 * function can `return LUNAR_FAIL(ctx, LUNAR_ERR_SHAPE, "...", ...)`. */
lunar_status lunar_fail(lunar_ctx *ctx, lunar_status st, const char *file, int line,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));
lunar_status lunar_failv(lunar_ctx *ctx, lunar_status st, const char *file, int line,
                         const char *fmt, va_list ap);
#define LUNAR_FAIL(ctx, st, ...) lunar_fail((ctx), (st), __FILE__, __LINE__, __VA_ARGS__)
#define LUNAR_TRY(expr) do { lunar_status st_ = (expr); if (st_ != LUNAR_OK) return st_; } while (0)

const char  *lunar_ctx_error(const lunar_ctx *ctx);        /* message of the last failure */
const char  *lunar_ctx_error_where(const lunar_ctx *ctx);  /* "file:line" of the last failure */
lunar_status lunar_ctx_status(const lunar_ctx *ctx);
void         lunar_ctx_clear_error(lunar_ctx *ctx);
/* Prefix the stored message with "what: " (used by callers that know a tensor's name). */
void         lunar_ctx_prefix_error(lunar_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* CPU threads used by the OpenMP kernels and OpenBLAS (default: LUNAR_THREADS, else all cores). */
int  lunar_ctx_threads(const lunar_ctx *ctx);
void lunar_ctx_set_threads(lunar_ctx *ctx, int n);

/* The CUDA device that a bare "cuda" names in the Lua API (default 0; lunar.dist.init sets it
 * to the local rank, modulo the device count, when CUDA devices exist). */
int  lunar_ctx_default_cuda_device(const lunar_ctx *ctx);
void lunar_ctx_set_default_cuda_device(lunar_ctx *ctx, int index);

/* The backend that runs ops on a device type; NULL when that backend was not built. */
const lunar_backend *lunar_ctx_backend(const lunar_ctx *ctx, int device_type);
/* Backend-private state (the CUDA backend keeps streams and cuBLAS handles here). */
void  *lunar_ctx_backend_state(lunar_ctx *ctx, int device_type);
void   lunar_ctx_set_backend_state(lunar_ctx *ctx, int device_type, void *state);

/* The owned-buffer pool of a device (created on first use). */
lunar_status lunar_ctx_pool(lunar_ctx *ctx, lunar_device dev, lunar_pool **out);

/* Number of CPU devices: 1, plus the debug devices of LUNAR_FAKE_CPU_DEVICES (see above). */
int  lunar_ctx_cpu_device_count(const lunar_ctx *ctx);

/* Whether CUDA has a device: the number found (0 when none), and in buf, when none, why: "CUDA is
 * not available: " and the reason (this lunar was built without CUDA, or the CUDA runtime's error,
 * such as a missing driver or one too old for the runtime); else "N CUDA device(s)". */
int  lunar_ctx_cuda_status(lunar_ctx *ctx, char *buf, size_t n);
/* LUNAR_OK when device dev exists; else fails naming it, how many of its kind were found and,
 * for CUDA, why it has none (lunar_ctx_cuda_status). */
lunar_status lunar_ctx_check_device(lunar_ctx *ctx, lunar_device dev);

/* Transfers between the host and a device (cuda:N, or the debug devices cpu:N, N >= 1): copies
 * of tensors across devices and element reads and writes (get, set, item, tolist). Each is a
 * synchronisation point on a GPU, so a count that grows with the number of ops in a training
 * step points at a host round trip in a hot path. Copies within one device are not counted. */
typedef struct lunar_transfer_stats {
    uint64_t to_host, from_host;               /* number of transfers */
    uint64_t to_host_bytes, from_host_bytes;
} lunar_transfer_stats;
lunar_transfer_stats lunar_ctx_transfer_stats(const lunar_ctx *ctx);
void lunar_ctx_count_transfer(lunar_ctx *ctx, int to_host, size_t nbytes);

/* Pending index range errors of the debug devices cpu:N (ops.h, lunar_sync_check, models what
 * CUDA keeps in device memory). Defer keeps e as dev's pending error unless it has one already
 * (the first one wins); take returns 1 and fills *e when there was one, clearing it. */
typedef struct lunar_range_error lunar_range_error;
void lunar_ctx_defer_range_error(lunar_ctx *ctx, lunar_device dev, const lunar_range_error *e);
int  lunar_ctx_take_range_error(lunar_ctx *ctx, lunar_device dev, lunar_range_error *e);

/* Check each op (a debugging aid, off by default; LUNAR_CHECK_EACH_OP=1 when the context is made,
 * or lunar.check_each_op(true)): every index op on a device is followed by its check point, so a
 * bad index fails at the op that met it, with its traceback. It costs one read, a
 * synchronisation on a GPU, per op. */
int  lunar_ctx_check_each_op(const lunar_ctx *ctx);
void lunar_ctx_set_check_each_op(lunar_ctx *ctx, int on);

int  lunar_device_equal(lunar_device a, lunar_device b);
/* 1 for the host (cpu:0), whose memory lunar reads and writes directly; 0 for every other device. */
int  lunar_device_is_host(lunar_device d);
/* "cpu", "cpu:1", "cuda:0" */
void lunar_device_format(lunar_device d, char *buf, size_t n);
/* Parses "cpu", "cpu:N", "cuda", "cuda:N". Returns 1 on success (whether the device exists is
 * checked when memory is first allocated on it). */
int  lunar_device_parse(const char *s, lunar_device *out);

#ifdef __cplusplus
}
#endif

#endif
