// elementwise.cu: binary (tensor and scalar forms), unary forward/backward, SwiGLU and
// masked_fill on the GPU. Tensors are contiguous with out's shape (backend.h); floats are
// f32/bf16/f16 (T), computed in f32; comparison outputs are bool/u8 bytes or T. Kernels are
// grid-stride loops templated on the element type and on the op, so the op switch is resolved
// at compile time (the launchers switch once per call). The scalar math is shared with the CPU
// kernels (elementwise_math.h).
#include "common.cuh"
#include "elementwise_math.h"

// ---- per-element math, the op a compile-time constant -----------------------------------------

template <int OP>
__device__ __forceinline__ float apply_binary(float a, float b) {
    switch (OP) {
    case LUNAR_BINARY_ADD: return a + b;
    case LUNAR_BINARY_SUB: return a - b;
    case LUNAR_BINARY_MUL: return a * b;
    case LUNAR_BINARY_DIV: return a / b;
    case LUNAR_BINARY_MAX: return lunar_ew_max(a, b);
    case LUNAR_BINARY_MIN: return lunar_ew_min(a, b);
    case LUNAR_BINARY_POW: return powf(a, b);
    case LUNAR_BINARY_RSUB: return b - a;
    case LUNAR_BINARY_RDIV: return b / a;
    case LUNAR_BINARY_EQ: return a == b ? 1.0f : 0.0f;
    case LUNAR_BINARY_NE: return a != b ? 1.0f : 0.0f;
    case LUNAR_BINARY_LT: return a < b ? 1.0f : 0.0f;
    case LUNAR_BINARY_LE: return a <= b ? 1.0f : 0.0f;
    case LUNAR_BINARY_GT: return a > b ? 1.0f : 0.0f;
    default: return a >= b ? 1.0f : 0.0f;   // LUNAR_BINARY_GE
    }
}

template <int OP>
__device__ __forceinline__ float apply_unary(float v) {
    switch (OP) {
    case LUNAR_UNARY_NEG: return -v;
    case LUNAR_UNARY_ABS: return fabsf(v);
    case LUNAR_UNARY_EXP: return expf(v);
    case LUNAR_UNARY_LOG: return logf(v);
    case LUNAR_UNARY_SQRT: return sqrtf(v);
    case LUNAR_UNARY_RSQRT: return 1.0f / sqrtf(v);
    case LUNAR_UNARY_RECIP: return 1.0f / v;
    case LUNAR_UNARY_SQUARE: return v * v;
    case LUNAR_UNARY_TANH: return tanhf(v);
    case LUNAR_UNARY_SIGMOID: return lunar_ew_sigmoid(v);
    case LUNAR_UNARY_SILU: return v * lunar_ew_sigmoid(v);
    case LUNAR_UNARY_GELU: return lunar_ew_gelu(v);
    case LUNAR_UNARY_GELU_TANH: return lunar_ew_gelu_tanh(v);
    case LUNAR_UNARY_RELU: return v < 0.0f ? 0.0f : v;
    case LUNAR_UNARY_SIN: return sinf(v);
    default: return cosf(v);   // LUNAR_UNARY_COS
    }
}

// f'(v)
template <int OP>
__device__ __forceinline__ float unary_deriv(float v) {
    switch (OP) {
    case LUNAR_UNARY_NEG: return -1.0f;
    case LUNAR_UNARY_ABS: return v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f);
    case LUNAR_UNARY_EXP: return expf(v);
    case LUNAR_UNARY_LOG: return 1.0f / v;
    case LUNAR_UNARY_SQRT: return 0.5f / sqrtf(v);
    case LUNAR_UNARY_RSQRT: return -0.5f / (v * sqrtf(v));
    case LUNAR_UNARY_RECIP: return -1.0f / (v * v);
    case LUNAR_UNARY_SQUARE: return 2.0f * v;
    case LUNAR_UNARY_TANH: return lunar_ew_dtanh(v);
    case LUNAR_UNARY_SIGMOID: return lunar_ew_dsigmoid(v);
    case LUNAR_UNARY_SILU: return lunar_ew_dsilu(v);
    case LUNAR_UNARY_GELU: return lunar_ew_dgelu(v);
    case LUNAR_UNARY_GELU_TANH: return lunar_ew_dgelu_tanh(v);
    case LUNAR_UNARY_RELU: return v > 0.0f ? 1.0f : 0.0f;
    case LUNAR_UNARY_SIN: return cosf(v);
    default: return -sinf(v);   // LUNAR_UNARY_COS
    }
}

// stores f32 results: float types round, bool/u8 bytes are 1 for nonzero
template <typename O>
__device__ __forceinline__ O ew_store(float v) { return lunar_from_f32<O>(v); }
template <>
__device__ __forceinline__ uint8_t ew_store<uint8_t>(float v) { return v != 0.0f ? 1 : 0; }

// ---- kernels ------------------------------------------------------------------------------

// out = a <op> b; b == nullptr means the scalar s (binary_scalar)
template <typename T, typename O, int OP>
__global__ void binary_kernel(O *out, const T *a, const T *b, float s, int64_t n) {
    LUNAR_GRID_STRIDE(i, n) {
        float y = b ? lunar_to_f32(b[i]) : s;
        out[i] = ew_store<O>(apply_binary<OP>(lunar_to_f32(a[i]), y));
    }
}

template <typename T, int OP>
__global__ void unary_kernel(T *out, const T *x, int64_t n) {
    LUNAR_GRID_STRIDE(i, n) out[i] = lunar_from_f32<T>(apply_unary<OP>(lunar_to_f32(x[i])));
}

template <typename T, int OP>
__global__ void unary_backward_kernel(T *dx, const T *dy, const T *x, int64_t n) {
    LUNAR_GRID_STRIDE(i, n) dx[i] = lunar_from_f32<T>(lunar_to_f32(dy[i]) * unary_deriv<OP>(lunar_to_f32(x[i])));
}

template <typename T>
__global__ void swiglu_forward_kernel(T *out, const T *gate, const T *up, int64_t n) {
    LUNAR_GRID_STRIDE(i, n) {
        float g = lunar_to_f32(gate[i]);
        out[i] = lunar_from_f32<T>(g * lunar_ew_sigmoid(g) * lunar_to_f32(up[i]));
    }
}

template <typename T>
__global__ void swiglu_backward_kernel(T *dgate, T *dup, const T *dout, const T *gate, const T *up, int64_t n) {
    LUNAR_GRID_STRIDE(i, n) {
        float g = lunar_to_f32(gate[i]), u = lunar_to_f32(up[i]), d = lunar_to_f32(dout[i]);
        float s = lunar_ew_sigmoid(g);
        dgate[i] = lunar_from_f32<T>(d * u * lunar_ew_dsilu_s(g, s));
        dup[i] = lunar_from_f32<T>(d * g * s);
    }
}

template <typename T>
__global__ void masked_fill_kernel(T *out, const T *x, const uint8_t *mask, float value, int64_t n) {
    LUNAR_GRID_STRIDE(i, n) out[i] = mask[i] ? lunar_from_f32<T>(value) : x[i];
}

// ---- launchers ----------------------------------------------------------------------------

#define EW_BINARY_CASE(OPV) \
    case OPV: binary_kernel<T, O, OPV><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(out, a, b, s, n); break;

template <typename T, typename O>
static bool launch_compare(lunar_binary_op op, O *out, const T *a, const T *b, float s, int64_t n,
                           cudaStream_t stream) {
    unsigned grid = lunar_cuda_grid(n);
    switch (op) {
    EW_BINARY_CASE(LUNAR_BINARY_EQ)
    EW_BINARY_CASE(LUNAR_BINARY_NE)
    EW_BINARY_CASE(LUNAR_BINARY_LT)
    EW_BINARY_CASE(LUNAR_BINARY_LE)
    EW_BINARY_CASE(LUNAR_BINARY_GT)
    EW_BINARY_CASE(LUNAR_BINARY_GE)
    default: return false;
    }
    return true;
}

template <typename T>
static bool launch_binary(lunar_binary_op op, T *out, const T *a, const T *b, float s, int64_t n,
                          cudaStream_t stream) {
    typedef T O;
    unsigned grid = lunar_cuda_grid(n);
    switch (op) {
    EW_BINARY_CASE(LUNAR_BINARY_ADD)
    EW_BINARY_CASE(LUNAR_BINARY_SUB)
    EW_BINARY_CASE(LUNAR_BINARY_MUL)
    EW_BINARY_CASE(LUNAR_BINARY_DIV)
    EW_BINARY_CASE(LUNAR_BINARY_MAX)
    EW_BINARY_CASE(LUNAR_BINARY_MIN)
    EW_BINARY_CASE(LUNAR_BINARY_POW)
    EW_BINARY_CASE(LUNAR_BINARY_RSUB)
    EW_BINARY_CASE(LUNAR_BINARY_RDIV)
    default: return launch_compare<T, T>(op, out, a, b, s, n, stream);
    }
    return true;
}

// Shared by binary and binary_scalar: b == NULL selects the scalar s.
static lunar_status binary_impl(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, const lunar_tensor *b,
                                double s, lunar_binary_op op, const char *name) {
    int64_t n = lunar_tensor_numel(out);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    bool ok = true;
    float sf = (float)s;
    if (out->dtype == LUNAR_DTYPE_BOOL || out->dtype == LUNAR_DTYPE_U8) {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, a->dtype, T,
            ok = launch_compare<T, uint8_t>(op, (uint8_t *)lunar_tensor_data(out), (const T *)lunar_tensor_data(a),
                                            b ? (const T *)lunar_tensor_data(b) : nullptr, sf, n, stream));
    } else {
        LUNAR_CUDA_DISPATCH_FLOAT(ctx, a->dtype, T,
            ok = launch_binary<T>(op, (T *)lunar_tensor_data(out), (const T *)lunar_tensor_data(a),
                                  b ? (const T *)lunar_tensor_data(b) : nullptr, sf, n, stream));
    }
    if (!ok) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cuda %s: op %d not valid for a %s out", name, (int)op,
                               lunar_dtype_name(out->dtype));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, name);
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_binary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a,
                                          const lunar_tensor *b, lunar_binary_op op) {
    return binary_impl(ctx, out, a, b, 0.0, op, "binary");
}

extern "C" lunar_status lunar_cuda_binary_scalar(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *a, double s,
                                                 lunar_binary_op op) {
    return binary_impl(ctx, out, a, NULL, s, op, "binary_scalar");
}

#define EW_UNARY_CASES(KERNEL, ...)                                                              \
    switch (op) {                                                                               \
    case LUNAR_UNARY_NEG: KERNEL<T, LUNAR_UNARY_NEG><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_ABS: KERNEL<T, LUNAR_UNARY_ABS><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_EXP: KERNEL<T, LUNAR_UNARY_EXP><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_LOG: KERNEL<T, LUNAR_UNARY_LOG><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_SQRT: KERNEL<T, LUNAR_UNARY_SQRT><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_RSQRT: KERNEL<T, LUNAR_UNARY_RSQRT><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_RECIP: KERNEL<T, LUNAR_UNARY_RECIP><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_SQUARE: KERNEL<T, LUNAR_UNARY_SQUARE><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_TANH: KERNEL<T, LUNAR_UNARY_TANH><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_SIGMOID: KERNEL<T, LUNAR_UNARY_SIGMOID><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_SILU: KERNEL<T, LUNAR_UNARY_SILU><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_GELU: KERNEL<T, LUNAR_UNARY_GELU><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_GELU_TANH: KERNEL<T, LUNAR_UNARY_GELU_TANH><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_RELU: KERNEL<T, LUNAR_UNARY_RELU><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_SIN: KERNEL<T, LUNAR_UNARY_SIN><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    case LUNAR_UNARY_COS: KERNEL<T, LUNAR_UNARY_COS><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(__VA_ARGS__); break; \
    default: ok = false; break;                                                                 \
    }

extern "C" lunar_status lunar_cuda_unary(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x, lunar_unary_op op) {
    int64_t n = lunar_tensor_numel(out);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(n);
    bool ok = true;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, out->dtype, T,
        EW_UNARY_CASES(unary_kernel, (T *)lunar_tensor_data(out), (const T *)lunar_tensor_data(x), n));
    if (!ok) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cuda unary: unknown op %d", (int)op);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "unary");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_unary_backward(lunar_ctx *ctx, lunar_tensor *dx, const lunar_tensor *dy,
                                                  const lunar_tensor *x, lunar_unary_op op) {
    int64_t n = lunar_tensor_numel(dx);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, dx, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(n);
    bool ok = true;
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, dx->dtype, T,
        EW_UNARY_CASES(unary_backward_kernel, (T *)lunar_tensor_data(dx), (const T *)lunar_tensor_data(dy),
                       (const T *)lunar_tensor_data(x), n));
    if (!ok) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "cuda unary_backward: unknown op %d", (int)op);
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "unary_backward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_swiglu_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *gate,
                                                  const lunar_tensor *up) {
    int64_t n = lunar_tensor_numel(out);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(n);
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, out->dtype, T,
        swiglu_forward_kernel<T><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(
            (T *)lunar_tensor_data(out), (const T *)lunar_tensor_data(gate), (const T *)lunar_tensor_data(up), n));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "swiglu_forward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_swiglu_backward(lunar_ctx *ctx, lunar_tensor *dgate, lunar_tensor *dup,
                                                   const lunar_tensor *dout, const lunar_tensor *gate,
                                                   const lunar_tensor *up) {
    int64_t n = lunar_tensor_numel(dgate);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, dgate, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(n);
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, dgate->dtype, T,
        swiglu_backward_kernel<T><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(
            (T *)lunar_tensor_data(dgate), (T *)lunar_tensor_data(dup), (const T *)lunar_tensor_data(dout),
            (const T *)lunar_tensor_data(gate), (const T *)lunar_tensor_data(up), n));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "swiglu_backward");
    return LUNAR_OK;
}

extern "C" lunar_status lunar_cuda_masked_fill(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *x,
                                               const lunar_tensor *mask, double value) {
    int64_t n = lunar_tensor_numel(out);
    if (n == 0) return LUNAR_OK;
    cudaStream_t stream;
    lunar_status st = lunar_cuda_stream_for(ctx, out, &stream);
    if (st != LUNAR_OK) return st;
    unsigned grid = lunar_cuda_grid(n);
    LUNAR_CUDA_DISPATCH_FLOAT(ctx, out->dtype, T,
        masked_fill_kernel<T><<<grid, LUNAR_CUDA_BLOCK, 0, stream>>>(
            (T *)lunar_tensor_data(out), (const T *)lunar_tensor_data(x), (const uint8_t *)lunar_tensor_data(mask),
            (float)value, n));
    LUNAR_CUDA_LAUNCH_CHECK(ctx, "masked_fill");
    return LUNAR_OK;
}
