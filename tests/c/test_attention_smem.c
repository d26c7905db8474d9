/* test_attention_smem.c: the shared-memory check of the CUDA attention launches
 * (kernels/attention_smem.h), with made-up device limits: the kernel's static shared memory
 * counts, the largest size that fits passes and the next one is refused with lunar's message
 * naming the size, the bytes and the limit, sizes too large for a size_t are refused, and the
 * opt-in limit of sm_90 (227 KiB) takes head dims the default 48 KiB did not. No GPU needed. */
#include <stdio.h>
#include <string.h>

#include "attention_smem.h"

static int failures = 0;
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);\
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
        }                                                                  \
    } while (0)

#define DEFAULT_LIMIT 49152   /* 48 KiB: a block's shared memory without opting in */
#define SM90_OPTIN 232448     /* cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 / H200 */
#define FWD_STATIC 1056       /* att_fwd_kernel's own arrays: red[8] floats and scan[256] ints */

static void test_bytes(void) {
    lunar_att_smem f = lunar_att_smem_forward(192, 128);   /* q and out rows + 3 chunks of 256 */
    CHECK(lunar_att_smem_bytes(&f) == (192 + 128) * 4 + 3 * 256 * 4, "forward bytes %zu", lunar_att_smem_bytes(&f));
    lunar_att_smem q = lunar_att_smem_backward_q(192, 128);
    CHECK(lunar_att_smem_bytes(&q) == (2 * 192 + 128) * 4 + 3 * 256 * 4, "backward q bytes %zu", lunar_att_smem_bytes(&q));
    lunar_att_smem kv = lunar_att_smem_backward_kv(192, 128);
    CHECK(lunar_att_smem_bytes(&kv) == 8 * (192 + 128) * 4, "backward kv bytes %zu", lunar_att_smem_bytes(&kv));
    lunar_att_smem l = lunar_att_smem_lists("attention_forward", 33);   /* 33 keys: two bitmap words */
    CHECK(lunar_att_smem_bytes(&l) == 8, "lists bytes %zu", lunar_att_smem_bytes(&l));
    l = lunar_att_smem_lists("attention_forward", 0);
    CHECK(lunar_att_smem_bytes(&l) == 0, "no keys, no bitmap: %zu", lunar_att_smem_bytes(&l));
    lunar_att_smem ix = lunar_att_smem_index_scores(32, 128);
    CHECK(lunar_att_smem_bytes(&ix) == (32 * 128 + 32) * 4, "index score bytes %zu", lunar_att_smem_bytes(&ix));
}

static void test_static_counts(lunar_ctx *ctx) {
    /* the largest Dq + Dv beside 1056 static bytes in 48 KiB: (49152 - 1056 - 3072) / 4 = 11256 */
    lunar_att_smem ok = lunar_att_smem_forward(11000, 256), over = lunar_att_smem_forward(11000, 257);
    CHECK(lunar_att_smem_max_size(&ok, FWD_STATIC, DEFAULT_LIMIT) == 11256, "max %lld",
          (long long)lunar_att_smem_max_size(&ok, FWD_STATIC, DEFAULT_LIMIT));
    CHECK(lunar_att_smem_check(ctx, &ok, FWD_STATIC, DEFAULT_LIMIT, 0) == LUNAR_OK, "11256 fits: %s",
          lunar_ctx_error(ctx));
    /* 11257 asks for 48100 dynamic bytes, under 48 KiB on its own: only the static bytes push it over */
    CHECK(lunar_att_smem_bytes(&over) == 48100, "dynamic bytes %zu", lunar_att_smem_bytes(&over));
    CHECK(lunar_att_smem_check(ctx, &over, FWD_STATIC, DEFAULT_LIMIT, 0) == LUNAR_ERR_UNSUPPORTED, "11257 refused");
    const char *want = "attention_forward (cuda:0): Dq + Dv = 11257 needs 49156 bytes of shared memory per block "
                       "(48100 for the sizes + 1056 of the kernel's own), more than the 49152 the device allows: "
                       "at most Dq + Dv = 11256";
    CHECK(strcmp(lunar_ctx_error(ctx), want) == 0, "message: %s", lunar_ctx_error(ctx));
}

static void test_each_kernel(lunar_ctx *ctx) {
    /* keys: 4 bytes per 32 keys beside 1024 static bytes (the block scan) */
    lunar_att_smem l = lunar_att_smem_lists("attention_backward", 32768);
    CHECK(lunar_att_smem_check(ctx, &l, 1024, 4096 + 1024, 1) == LUNAR_OK, "32768 keys fit: %s", lunar_ctx_error(ctx));
    l = lunar_att_smem_lists("attention_backward", 32769);
    CHECK(lunar_att_smem_check(ctx, &l, 1024, 4096 + 1024, 1) == LUNAR_ERR_UNSUPPORTED, "32769 keys refused");
    CHECK(strstr(lunar_ctx_error(ctx), "attention_backward (cuda:1): T (keys) = 32769 needs 5124 bytes") &&
              strstr(lunar_ctx_error(ctx), "at most T (keys) = 32768"),
          "message: %s", lunar_ctx_error(ctx));
    /* a dk | dv row per warp: 32 bytes per unit of Dq + Dv */
    lunar_att_smem kv = lunar_att_smem_backward_kv(1000, 537);
    CHECK(lunar_att_smem_check(ctx, &kv, 0, DEFAULT_LIMIT, 0) == LUNAR_ERR_UNSUPPORTED, "1537 refused");
    CHECK(strstr(lunar_ctx_error(ctx), "attention_backward (cuda:0): Dq + Dv = 1537") &&
              strstr(lunar_ctx_error(ctx), "at most Dq + Dv = 1536"),
          "message: %s", lunar_ctx_error(ctx));
    lunar_att_smem ix = lunar_att_smem_index_scores(64, 512);
    CHECK(lunar_att_smem_check(ctx, &ix, 0, DEFAULT_LIMIT, 0) == LUNAR_ERR_UNSUPPORTED, "index heads refused");
    CHECK(strstr(lunar_ctx_error(ctx), "index_scores (cuda:0): Hi * (Di + 1) = 32832") &&
              strstr(lunar_ctx_error(ctx), "at most Hi * (Di + 1) = 12288"),
          "message: %s", lunar_ctx_error(ctx));
}

static void test_edges(lunar_ctx *ctx) {
    lunar_att_smem huge = lunar_att_smem_lists("attention_forward", INT64_MAX);
    lunar_att_smem wide = lunar_att_smem_backward_kv(INT64_MAX / 4, INT64_MAX / 4);
    CHECK(lunar_att_smem_bytes(&wide) == SIZE_MAX, "no wrap-around: %zu", lunar_att_smem_bytes(&wide));
    CHECK(lunar_att_smem_check(ctx, &wide, 0, DEFAULT_LIMIT, 0) == LUNAR_ERR_UNSUPPORTED, "huge Dq + Dv refused");
    CHECK(strstr(lunar_ctx_error(ctx), "too large for shared memory: at most Dq + Dv = 1536"), "message: %s",
          lunar_ctx_error(ctx));
    CHECK(lunar_att_smem_check(ctx, &huge, 1024, DEFAULT_LIMIT, 0) == LUNAR_ERR_UNSUPPORTED, "huge T refused");
    /* a device whose limit is below what the kernel needs for any size */
    lunar_att_smem f = lunar_att_smem_forward(1, 1);
    CHECK(lunar_att_smem_check(ctx, &f, FWD_STATIC, 2048, 0) == LUNAR_ERR_UNSUPPORTED, "nothing fits");
    CHECK(strstr(lunar_ctx_error(ctx), "the kernel needs more shared memory per block than the 2048 bytes"),
          "message: %s", lunar_ctx_error(ctx));
}

static void test_opt_in(lunar_ctx *ctx) {
    /* head dims beyond the default 48 KiB fit under sm_90's opt-in limit */
    lunar_att_smem f = lunar_att_smem_forward(6000, 6000), kv = lunar_att_smem_backward_kv(3000, 3000);
    CHECK(lunar_att_smem_check(ctx, &f, FWD_STATIC, DEFAULT_LIMIT, 0) != LUNAR_OK, "over 48 KiB");
    CHECK(lunar_att_smem_check(ctx, &f, FWD_STATIC, SM90_OPTIN, 0) == LUNAR_OK, "fits with opt-in: %s",
          lunar_ctx_error(ctx));
    CHECK(lunar_att_smem_check(ctx, &kv, 0, SM90_OPTIN, 0) == LUNAR_OK, "backward kv fits: %s", lunar_ctx_error(ctx));
    lunar_att_smem t = lunar_att_smem_lists("attention_forward", 200000);   /* GLM-5's longest context */
    CHECK(lunar_att_smem_check(ctx, &t, 1024, DEFAULT_LIMIT, 0) == LUNAR_OK, "200K keys: %s", lunar_ctx_error(ctx));
}

int main(void) {
    lunar_ctx *ctx;
    if (lunar_ctx_init(&ctx) != LUNAR_OK) return 1;
    test_bytes();
    test_static_counts(ctx);
    test_each_kernel(ctx);
    test_edges(ctx);
    test_opt_in(ctx);
    lunar_ctx_free(ctx);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
