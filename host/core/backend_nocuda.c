/* backend_nocuda.c: linked instead of kernels/cuda when lunar is built without CUDA. */
#include "lunar/backend.h"

const lunar_backend *lunar_backend_cuda(void) { return NULL; }
