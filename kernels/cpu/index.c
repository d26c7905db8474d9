/* index.c: CPU kernels (stub: not implemented yet). */
#include "cpu.h"

lunar_status lunar_cpu_embedding_forward(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *ids, const lunar_tensor *weight) {
    (void)out;
    (void)ids;
    (void)weight;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "embedding_forward is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_embedding_backward(lunar_ctx *ctx, lunar_tensor *dweight, const lunar_tensor *dout, const lunar_tensor *ids) {
    (void)dweight;
    (void)dout;
    (void)ids;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "embedding_backward is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_index_select(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, const lunar_tensor *index, int64_t outer, int64_t n_src, int64_t inner) {
    (void)out;
    (void)src;
    (void)index;
    (void)outer;
    (void)n_src;
    (void)inner;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "index_select is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_index_add(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index, const lunar_tensor *src, double alpha, int64_t outer, int64_t n_dst, int64_t inner) {
    (void)dst;
    (void)index;
    (void)src;
    (void)alpha;
    (void)outer;
    (void)n_dst;
    (void)inner;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "index_add is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_gather(lunar_ctx *ctx, lunar_tensor *out, const lunar_tensor *src, const lunar_tensor *index, int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner) {
    (void)out;
    (void)src;
    (void)index;
    (void)outer;
    (void)n_data;
    (void)n_idx;
    (void)inner;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "gather is not implemented on the cpu backend yet");
}

lunar_status lunar_cpu_scatter(lunar_ctx *ctx, lunar_tensor *dst, const lunar_tensor *index, const lunar_tensor *src, int64_t outer, int64_t n_data, int64_t n_idx, int64_t inner, int accumulate) {
    (void)dst;
    (void)index;
    (void)src;
    (void)outer;
    (void)n_data;
    (void)n_idx;
    (void)inner;
    (void)accumulate;
    return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "scatter is not implemented on the cpu backend yet");
}
