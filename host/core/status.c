/* status.c: names of status codes. */
#include "lunar/status.h"

const char *lunar_status_name(lunar_status st) {
    switch (st) {
    case LUNAR_OK: return "ok";
    case LUNAR_ERR_ARG: return "bad argument";
    case LUNAR_ERR_SHAPE: return "shape error";
    case LUNAR_ERR_DTYPE: return "dtype error";
    case LUNAR_ERR_DEVICE: return "device error";
    case LUNAR_ERR_OOM: return "out of memory";
    case LUNAR_ERR_STALE: return "stale tensor";
    case LUNAR_ERR_IO: return "I/O error";
    case LUNAR_ERR_FORMAT: return "format error";
    case LUNAR_ERR_CUDA: return "CUDA error";
    case LUNAR_ERR_COMM: return "communication error";
    case LUNAR_ERR_UNSUPPORTED: return "unsupported";
    case LUNAR_ERR_INTERNAL: return "internal error";
    default: return "unknown status";
    }
}
