/* test_safetensors.c: the safetensors reader and writer and sharded checkpoints, without Lua:
 * the golden file (read, FP8 dequantisation, byte-identical rewrite), a round trip of every
 * dtype, one test per malformed input (each message names the file and the problem; run
 * under ASan in CI, none may crash), every truncation and many byte flips of a valid file,
 * crash-safe writes (injected failure, SIGKILL midway), and sharded save/load. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lunar/ops.h"
#include "lunar/safetensors.h"

static int failures = 0;
#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            failures++;                                                     \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                   \
            fprintf(stderr, "\n");                                          \
        }                                                                   \
    } while (0)

static const lunar_device CPU = {LUNAR_DEVICE_CPU, 0};
static const char *GOLDEN = "tests/fixtures/tiny.safetensors";

static char tmpdir[64];

static void path_in(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", tmpdir, name); }

static int read_all(const char *path, unsigned char **out, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc((size_t)len + 1);
    *n = fread(*out, 1, (size_t)len, f);
    fclose(f);
    return *n == (size_t)len;
}

static void write_all(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(data, 1, n, f);
    fclose(f);
}

static int file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0;
}

/* how many mappings of the file at path this process has (from /proc/self/maps) */
static int mappings_of(const char *path) {
    char real[4096], line[8192];
    if (!realpath(path, real)) return -1;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    int n = 0;
    size_t rl = strlen(real);
    while (fgets(line, sizeof line, f)) {
        size_t l = strlen(line);
        while (l && (line[l - 1] == '\n' || line[l - 1] == ' ')) line[--l] = 0;
        if (l >= rl && strcmp(line + l - rl, real) == 0) n++;
    }
    fclose(f);
    return n;
}

/* ---- golden file --------------------------------------------------------------------------- */

static void test_golden(lunar_ctx *ctx) {
    lunar_safetensors *f = NULL;
    CHECK(lunar_safetensors_open(ctx, &f, GOLDEN) == LUNAR_OK, "open golden: %s", lunar_ctx_error(ctx));
    if (!f) return;
    CHECK(lunar_safetensors_count(f) == 4, "count %d", lunar_safetensors_count(f));
    const char *want[4] = {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                           "model.layers.0.mlp.down_proj.weight_scale_inv", "model.norm.weight"};
    for (int i = 0; i < 4; i++) CHECK(strcmp(lunar_safetensors_entry(f, i)->name, want[i]) == 0, "name %d", i);
    CHECK(strcmp(lunar_safetensors_metadata_get(f, "format"), "pt") == 0, "metadata");
    const lunar_safetensors_info *e = lunar_safetensors_find(f, "model.layers.0.mlp.down_proj.weight");
    CHECK(e && e->dtype == LUNAR_DTYPE_F8E4M3 && e->ndim == 2 && e->shape[0] == 2 && e->shape[1] == 4 && e->begin == 36 &&
              e->end == 44, "fp8 info");
    const double expect[8] = {0.5, -1, 1.5, 2, 0.25, 0.125, -0.5, 3};
    lunar_tensor emb = {0}, q = {0}, s = {0}, norm = {0}, w = {0};
    CHECK(lunar_safetensors_tensor(ctx, &emb, f, "model.embed_tokens.weight") == LUNAR_OK, "emb");
    CHECK(lunar_safetensors_tensor(ctx, &q, f, "model.layers.0.mlp.down_proj.weight") == LUNAR_OK, "q");
    CHECK(lunar_safetensors_tensor(ctx, &s, f, "model.layers.0.mlp.down_proj.weight_scale_inv") == LUNAR_OK, "s");
    CHECK(lunar_safetensors_tensor(ctx, &norm, f, "model.norm.weight") == LUNAR_OK, "norm");
    CHECK(strcmp(q.name, "model.layers.0.mlp.down_proj.weight") == 0, "view is named after the tensor");
    CHECK(emb.storage->kind == LUNAR_STORAGE_EXTERNAL, "zero-copy view");
    CHECK(mappings_of(GOLDEN) == 1, "mapped once: %d", mappings_of(GOLDEN));
    /* the views outlive the file object */
    lunar_safetensors_close(ctx, f);
    CHECK(mappings_of(GOLDEN) == 1, "still mapped while views remain");
    for (int i = 0; i < 8; i++) {
        double v = lunar_bf16_to_f32(((const uint16_t *)lunar_tensor_data(&emb))[i]);
        CHECK(v == expect[i], "bf16[%d] = %g", i, v);
    }
    int64_t shape[2] = {2, 4};
    lunar_tensor_new(ctx, &w, LUNAR_DTYPE_F32, CPU, 2, shape);
    CHECK(lunar_fp8_block_dequant(ctx, &w, &q, &s, 128, 128) == LUNAR_OK, "dequant: %s", lunar_ctx_error(ctx));
    for (int i = 0; i < 8; i++)
        CHECK(((float *)lunar_tensor_data(&w))[i] == (float)expect[i], "dequant[%d] = %g", i,
              ((float *)lunar_tensor_data(&w))[i]);
    /* rewriting the four tensors reproduces the golden bytes (reference layout and padding) */
    const char *names[4] = {"model.norm.weight", "model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                            "model.layers.0.mlp.down_proj.weight_scale_inv"};
    const lunar_tensor *ts[4] = {&norm, &emb, &q, &s};
    const char *mk[1] = {"format"}, *mv[1] = {"pt"};
    lunar_safetensors_write_opts o = {1, mk, mv, 0, 0};
    char out[256];
    path_in(out, sizeof out, "golden_copy.safetensors");
    CHECK(lunar_safetensors_save(ctx, out, 4, names, ts, &o) == LUNAR_OK, "save: %s", lunar_ctx_error(ctx));
    unsigned char *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    CHECK(read_all(out, &a, &na) && read_all(GOLDEN, &b, &nb) && na == nb && memcmp(a, b, na) == 0,
          "rewrite is byte-identical (%zu vs %zu bytes)", na, nb);
    free(a);
    free(b);
    lunar_tensor *all[] = {&emb, &q, &s, &norm, &w};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) lunar_tensor_release(ctx, all[i]);
    CHECK(mappings_of(GOLDEN) == 0, "unmapped after the file is closed and the last view is gone: %d",
          mappings_of(GOLDEN));
    /* closing with no view unmaps at once; a freed view drops its reference too */
    f = NULL;
    lunar_safetensors_open(ctx, &f, GOLDEN);
    lunar_tensor v = {0};
    lunar_safetensors_tensor(ctx, &v, f, "model.norm.weight");
    lunar_safetensors_close(ctx, f);
    lunar_storage_free(ctx, v.storage);
    CHECK(mappings_of(GOLDEN) == 0, "unmapped after free() of the last view");
    CHECK(lunar_tensor_check(ctx, &v) == LUNAR_ERR_STALE, "freed view is stale");
    lunar_tensor_release(ctx, &v);
}

/* ---- every dtype round trip ------------------------------------------------------------------ */

static void test_all_dtypes(lunar_ctx *ctx) {
    enum { ND = LUNAR_DTYPE_COUNT };
    lunar_tensor t[ND + 3];
    const lunar_tensor *tp[ND + 3];
    const char *names[ND + 3];
    char namebuf[ND + 3][32];
    memset(t, 0, sizeof t);
    int n = 0;
    for (int d = 0; d < ND; d++, n++) {
        int64_t shape[3] = {2, 3, 1 + d};
        lunar_tensor_new(ctx, &t[n], (lunar_dtype)d, CPU, 3, shape);
        unsigned char *p = lunar_tensor_data(&t[n]);
        size_t nb = lunar_tensor_nbytes(&t[n]);
        for (size_t i = 0; i < nb; i++) p[i] = (unsigned char)(i * 37 + (size_t)d * 11);   /* any bit pattern */
        if (d == LUNAR_DTYPE_BOOL)
            for (size_t i = 0; i < nb; i++) p[i] &= 1;
        snprintf(namebuf[n], sizeof namebuf[n], "t.%s", lunar_dtype_name((lunar_dtype)d));
    }
    /* a scalar, an empty tensor, and a transposed (non-contiguous) view */
    lunar_tensor_new(ctx, &t[n], LUNAR_DTYPE_F32, CPU, 0, NULL);
    *(float *)lunar_tensor_data(&t[n]) = 3.25f;
    snprintf(namebuf[n++], 32, "scalar");
    int64_t zs[2] = {0, 5};
    lunar_tensor_new(ctx, &t[n], LUNAR_DTYPE_BF16, CPU, 2, zs);
    snprintf(namebuf[n++], 32, "empty");
    lunar_tensor_transpose(ctx, &t[n], &t[0], 0, 2);   /* of the f32 tensor (2,3,1) -> (1,3,2) */
    snprintf(namebuf[n++], 32, "transposed");
    for (int i = 0; i < n; i++) {
        tp[i] = &t[i];
        names[i] = namebuf[i];
    }
    char path[256], path2[256];
    path_in(path, sizeof path, "all.safetensors");
    path_in(path2, sizeof path2, "all2.safetensors");
    CHECK(lunar_safetensors_save(ctx, path, n, names, tp, NULL) == LUNAR_OK, "save all: %s", lunar_ctx_error(ctx));
    lunar_safetensors *f = NULL;
    CHECK(lunar_safetensors_open(ctx, &f, path) == LUNAR_OK, "open all: %s", lunar_ctx_error(ctx));
    if (!f) return;
    CHECK(lunar_safetensors_count(f) == n, "count");
    lunar_tensor back[ND + 3];
    const lunar_tensor *bp[ND + 3];
    memset(back, 0, sizeof back);
    for (int i = 0; i < n; i++) {
        CHECK(lunar_safetensors_tensor(ctx, &back[i], f, names[i]) == LUNAR_OK, "read %s", names[i]);
        bp[i] = &back[i];
        CHECK(back[i].dtype == t[i].dtype && back[i].ndim == t[i].ndim, "%s dtype/ndim", names[i]);
        for (int d = 0; d < t[i].ndim; d++) CHECK(back[i].shape[d] == t[i].shape[d], "%s shape", names[i]);
        /* bytes equal the source in row-major order */
        lunar_tensor c = {0};
        lunar_tensor_new(ctx, &c, t[i].dtype, CPU, t[i].ndim, t[i].shape);
        lunar_copy(ctx, &c, &t[i]);
        CHECK(memcmp(lunar_tensor_data(&c), lunar_tensor_data(&back[i]), lunar_tensor_nbytes(&c)) == 0, "%s bytes",
              names[i]);
        lunar_tensor_release(ctx, &c);
    }
    /* export of the import is the same file */
    CHECK(lunar_safetensors_save(ctx, path2, n, names, bp, NULL) == LUNAR_OK, "re-save");
    unsigned char *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    CHECK(read_all(path, &a, &na) && read_all(path2, &b, &nb) && na == nb && memcmp(a, b, na) == 0,
          "import -> export is byte-identical");
    free(a);
    free(b);
    lunar_safetensors_close(ctx, f);
    for (int i = 0; i < n; i++) {
        lunar_tensor_release(ctx, &t[i]);
        lunar_tensor_release(ctx, &back[i]);
    }
}

/* ---- malformed files ------------------------------------------------------------------------- */

/* a file: 8-byte length (hlen_override if nonzero), header text, data_len data bytes */
static void make_file(const char *path, const char *header, uint64_t hlen_override, size_t data_len) {
    size_t hl = strlen(header);
    uint64_t n = hlen_override ? hlen_override : hl;
    unsigned char *buf = calloc(1, 8 + hl + data_len);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(n >> (8 * i));
    memcpy(buf + 8, header, hl);
    write_all(path, buf, 8 + hl + data_len);
    free(buf);
}

static void expect_open_error(lunar_ctx *ctx, const char *label, const char *path, const char *problem) {
    lunar_safetensors *f = NULL;
    lunar_status st = lunar_safetensors_open(ctx, &f, path);
    CHECK(st != LUNAR_OK && !f, "%s: open must fail", label);
    const char *msg = lunar_ctx_error(ctx);
    CHECK(strstr(msg, path) != NULL, "%s: message names the file: %s", label, msg);
    CHECK(strstr(msg, problem) != NULL, "%s: message names the problem '%s': %s", label, problem, msg);
    lunar_safetensors_close(ctx, f);
}

static void test_bad_inputs(lunar_ctx *ctx) {
    char p[256];
    path_in(p, sizeof p, "bad.safetensors");
#define T "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}"

    write_all(p, "\x05\x00\x00", 3);
    expect_open_error(ctx, "truncated", p, "too short to hold the 8-byte header length");
    write_all(p, "", 0);
    expect_open_error(ctx, "empty file", p, "too short");
    make_file(p, "{}", 4000, 0);
    expect_open_error(ctx, "header length past the end", p, "header length 4000 goes past the end of the file");
    make_file(p, "{}", 200000000, 0);
    expect_open_error(ctx, "header length over the limit", p, "larger than the limit");
    make_file(p, "{\"a\": [1, 2", 0, 0);
    expect_open_error(ctx, "header not JSON", p, "invalid JSON at line 1");
    make_file(p, "{\"a\":{}}  x", 0, 0);
    expect_open_error(ctx, "junk after the JSON", p, "unexpected content after the value");
    make_file(p, "[1, 2, 3]", 0, 0);
    expect_open_error(ctx, "header not an object", p, "not a JSON object");
    make_file(p, "", 0, 0);
    expect_open_error(ctx, "empty header", p, "header is empty");
    make_file(p, "{\"a\xff\":1}", 0, 0);
    expect_open_error(ctx, "invalid UTF-8", p, "not valid UTF-8");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 0, 12);
    expect_open_error(ctx, "overlap", p, "tensor 'b' data_offsets [4, 12] overlap tensor 'a' [0, 8]");
    make_file(p, T "}", 0, 4);
    expect_open_error(ctx, "out of bounds", p, "tensor 'a' data_offsets [0, 8] go past the end of the data (4 bytes)");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}", 0, 16);
    expect_open_error(ctx, "hole", p, "hole in the data: bytes [8, 12) before tensor 'b'");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 0, 12);
    expect_open_error(ctx, "hole at the start", p, "hole in the data: bytes [0, 4)");
    make_file(p, T "}", 0, 10);
    expect_open_error(ctx, "trailing bytes", p, "cover only 8");
    make_file(p, "{\"a\":{\"dtype\":\"F7\",\"shape\":[2],\"data_offsets\":[0,8]}}", 0, 8);
    expect_open_error(ctx, "unknown dtype", p, "tensor 'a' has unknown dtype 'F7'");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 0, 8);
    expect_open_error(ctx, "shape/bytes mismatch", p, "tensor 'a' is F32 (3) = 12 bytes but its data_offsets [0, 8] span 8");
    make_file(p, T ",\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]}}", 0, 8);
    expect_open_error(ctx, "duplicate tensor", p, "duplicate key 'a' in the header");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 0, 8);
    expect_open_error(ctx, "duplicate field", p, "tensor 'a' has the key 'dtype' twice");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 0, 8);
    expect_open_error(ctx, "negative dim", p, "shape entry 0 is -2, not a non-negative integer");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 0, 8);
    expect_open_error(ctx, "fractional dim", p, "not a non-negative integer");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 0, 8);
    expect_open_error(ctx, "reversed offsets", p, "end before they begin");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 0, 8);
    expect_open_error(ctx, "no offsets", p, "tensor 'a' has no data_offsets");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 0, 8);
    expect_open_error(ctx, "one offset", p, "data_offsets must be [begin, end]");
    make_file(p, "{\"__metadata__\":{\"format\":1}}", 0, 0);
    expect_open_error(ctx, "metadata value", p, "__metadata__ must map strings to strings, but 'format' is 1");
    make_file(p, "{\"__metadata__\":[\"x\"]}", 0, 0);
    expect_open_error(ctx, "metadata array", p, "__metadata__ must be an object");
    make_file(p, "{\"__metadata__\":{\"a\":\"x\",\"a\":\"y\"}}", 0, 0);
    expect_open_error(ctx, "metadata duplicate", p, "duplicate key 'a' in __metadata__");
    make_file(p, "{\"a\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,1]}}", 0, 1);
    expect_open_error(ctx, "F4 odd count", p, "does not end on a byte boundary");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,8]}}", 0, 8);
    expect_open_error(ctx, "numel overflow", p, "too many elements");
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[0,4294967296,4294967296],\"data_offsets\":[0,0]}}", 0, 0);
    expect_open_error(ctx, "empty but huge strides", p, "too many elements");
    make_file(p, "{\"a\":7}", 0, 0);
    expect_open_error(ctx, "entry not an object", p, "tensor 'a' must be an object");

    /* valid files with dtypes lunar has no type for: open works, the tensor gives a clear error */
    make_file(p, "{\"a\":{\"dtype\":\"U16\",\"shape\":[2],\"data_offsets\":[0,4]},"
                 "\"b\":{\"dtype\":\"F4\",\"shape\":[4],\"data_offsets\":[4,6]}}", 0, 6);
    lunar_safetensors *f = NULL;
    CHECK(lunar_safetensors_open(ctx, &f, p) == LUNAR_OK, "U16/F4 file opens: %s", lunar_ctx_error(ctx));
    if (f) {
        lunar_tensor t = {0};
        CHECK(lunar_safetensors_tensor(ctx, &t, f, "a") == LUNAR_ERR_UNSUPPORTED, "U16 tensor");
        CHECK(strstr(lunar_ctx_error(ctx), "tensor 'a' has unsupported dtype U16") && strstr(lunar_ctx_error(ctx), p),
              "U16 message: %s", lunar_ctx_error(ctx));
        CHECK(lunar_safetensors_tensor(ctx, &t, f, "b") == LUNAR_ERR_UNSUPPORTED, "F4 tensor");
        CHECK(lunar_safetensors_tensor(ctx, &t, f, "zzz") == LUNAR_ERR_ARG && strstr(lunar_ctx_error(ctx), "no tensor 'zzz'"),
              "missing tensor: %s", lunar_ctx_error(ctx));
        lunar_safetensors_close(ctx, f);
    }
    /* a header length that leaves f32 data misaligned: read through an aligned copy */
    make_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 0, 4);
    f = NULL;
    CHECK(lunar_safetensors_open(ctx, &f, p) == LUNAR_OK, "misaligned file opens");
    if (f) {
        lunar_tensor t = {0};
        CHECK(lunar_safetensors_tensor(ctx, &t, f, "a") == LUNAR_OK, "misaligned tensor");
        CHECK(t.storage && t.storage->kind == LUNAR_STORAGE_OWNED && ((uintptr_t)lunar_tensor_data(&t) % 4) == 0,
              "misaligned data is copied");
        lunar_tensor_release(ctx, &t);
        lunar_safetensors_close(ctx, f);
    }
    lunar_ctx_clear_error(ctx);
#undef T
}

/* every prefix of the golden file, and single-byte changes of it, must open or fail cleanly */
static void test_truncations_and_flips(lunar_ctx *ctx) {
    unsigned char *g = NULL;
    size_t n = 0;
    CHECK(read_all(GOLDEN, &g, &n), "read golden");
    char p[256];
    path_in(p, sizeof p, "mutant.safetensors");
    for (size_t len = 0; len < n; len++) {
        write_all(p, g, len);
        lunar_safetensors *f = NULL;
        CHECK(lunar_safetensors_open(ctx, &f, p) != LUNAR_OK, "prefix of %zu bytes must fail", len);
        CHECK(strstr(lunar_ctx_error(ctx), p) != NULL, "prefix %zu message names the file: %s", len, lunar_ctx_error(ctx));
        lunar_safetensors_close(ctx, f);
    }
    const unsigned char vals[] = {0x00, 0x22, 0x2c, 0x30, 0x39, 0x5b, 0x5d, 0x7b, 0x7d, 0xff};
    unsigned seed = 12345;
    for (int k = 0; k < 400; k++) {
        unsigned char *m = malloc(n);
        memcpy(m, g, n);
        seed = seed * 1103515245u + 12345u;
        size_t pos = (seed >> 8) % (8 + 384);   /* the length and the header */
        seed = seed * 1103515245u + 12345u;
        m[pos] = vals[(seed >> 8) % sizeof vals];
        write_all(p, m, n);
        lunar_safetensors *f = NULL;
        if (lunar_safetensors_open(ctx, &f, p) == LUNAR_OK) {
            for (int i = 0; i < lunar_safetensors_count(f); i++) {
                lunar_tensor t = {0};
                if (lunar_safetensors_tensor(ctx, &t, f, lunar_safetensors_entry(f, i)->name) == LUNAR_OK) {
                    volatile unsigned char sink = 0;
                    const unsigned char *d = lunar_tensor_data(&t);
                    for (size_t b = 0; b < lunar_tensor_nbytes(&t); b++) sink ^= d[b];
                    (void)sink;
                }
                lunar_tensor_release(ctx, &t);
            }
        } else {
            CHECK(strstr(lunar_ctx_error(ctx), p) != NULL, "flip message names the file: %s", lunar_ctx_error(ctx));
        }
        lunar_safetensors_close(ctx, f);
        free(m);
    }
    free(g);
}

/* ---- crash-safe writes ----------------------------------------------------------------------- */

static void test_atomic_write(lunar_ctx *ctx) {
    char p[256], tmp[300];
    path_in(p, sizeof p, "precious.safetensors");
    unsigned char *g = NULL, *after = NULL;
    size_t n = 0, na = 0;
    read_all(GOLDEN, &g, &n);
    write_all(p, g, n);   /* the previous version of the file */
    lunar_tensor big = {0};
    int64_t shape[1] = {100000};
    lunar_tensor_new(ctx, &big, LUNAR_DTYPE_F32, CPU, 1, shape);
    lunar_fill(ctx, &big, 1.5);
    const char *names[1] = {"big"};
    const lunar_tensor *ts[1] = {&big};
    /* the write fails after 1000 bytes of the temporary file */
    lunar_safetensors_write_opts o = {0, NULL, NULL, 1000, 0};
    CHECK(lunar_safetensors_save(ctx, p, 1, names, ts, &o) == LUNAR_ERR_IO, "injected failure");
    CHECK(strstr(lunar_ctx_error(ctx), "injected") && strstr(lunar_ctx_error(ctx), p), "message: %s", lunar_ctx_error(ctx));
    CHECK(read_all(p, &after, &na) && na == n && memcmp(after, g, n) == 0, "previous file intact after a failed write");
    free(after);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", p, (long)getpid());
    CHECK(!file_exists(tmp), "temporary file removed after a failed write");
    /* a process killed in the middle of the write */
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        lunar_safetensors_write_opts k = {0, NULL, NULL, 5000, 1};
        lunar_safetensors_save(ctx, p, 1, names, ts, &k);
        _exit(0);   /* not reached: the hook kills the process */
    }
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child was killed (status %d)", status);
    CHECK(read_all(p, &after, &na) && na == n && memcmp(after, g, n) == 0, "previous file intact after a kill");
    free(after);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", p, (long)child);
    CHECK(file_exists(tmp), "the killed writer left only its temporary file");
    unlink(tmp);
    /* a successful write replaces the file */
    CHECK(lunar_safetensors_save(ctx, p, 1, names, ts, NULL) == LUNAR_OK, "save");
    lunar_safetensors *f = NULL;
    CHECK(lunar_safetensors_open(ctx, &f, p) == LUNAR_OK && lunar_safetensors_count(f) == 1, "new file");
    lunar_safetensors_close(ctx, f);
    /* writing into a directory that does not exist fails naming the path */
    char nodir[300];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/x.safetensors", tmpdir);
    CHECK(lunar_safetensors_save(ctx, nodir, 1, names, ts, NULL) == LUNAR_ERR_IO && strstr(lunar_ctx_error(ctx), nodir),
          "missing dir: %s", lunar_ctx_error(ctx));
    /* duplicate names and the reserved name */
    const char *dup[2] = {"x", "x"};
    const lunar_tensor *two[2] = {&big, &big};
    CHECK(lunar_safetensors_save(ctx, p, 2, dup, two, NULL) == LUNAR_ERR_ARG && strstr(lunar_ctx_error(ctx), "'x' is given twice"),
          "dup: %s", lunar_ctx_error(ctx));
    const char *meta[1] = {"__metadata__"};
    CHECK(lunar_safetensors_save(ctx, p, 1, meta, ts, NULL) == LUNAR_ERR_ARG, "reserved name");
    free(g);
    lunar_tensor_release(ctx, &big);
    lunar_ctx_clear_error(ctx);
}

/* ---- sharded checkpoints --------------------------------------------------------------------- */

static void test_sharded(lunar_ctx *ctx) {
    enum { N = 9 };
    lunar_tensor t[N];
    const lunar_tensor *tp[N];
    const char *names[N];
    char nb[N][48];
    memset(t, 0, sizeof t);
    for (int i = 0; i < N; i++) {
        int64_t shape[2] = {3 + i, 50};
        lunar_dtype dt = i % 3 == 0 ? LUNAR_DTYPE_BF16 : i % 3 == 1 ? LUNAR_DTYPE_F32 : LUNAR_DTYPE_I64;
        lunar_tensor_new(ctx, &t[i], dt, CPU, 2, shape);
        lunar_arange(ctx, &t[i], i, 0.5);
        snprintf(nb[i], sizeof nb[i], "model.layers.%d.w", i);
        names[i] = nb[i];
        tp[i] = &t[i];
    }
    char dir[256], idx[300], path[300];
    path_in(dir, sizeof dir, "ckpt");
    /* all fits: a single model.safetensors */
    CHECK(lunar_checkpoint_save(ctx, dir, N, names, tp, 1ull << 30, NULL) == LUNAR_OK, "save single: %s", lunar_ctx_error(ctx));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(file_exists(path), "model.safetensors written");
    /* 3000-byte shards: several shards plus the index; the single file of the earlier save goes */
    CHECK(lunar_checkpoint_save(ctx, dir, N, names, tp, 3000, NULL) == LUNAR_OK, "save sharded: %s", lunar_ctx_error(ctx));
    CHECK(!file_exists(path), "stale model.safetensors removed");
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    CHECK(file_exists(idx), "index written");
    lunar_checkpoint *c = NULL;
    int ns_saved = 0;
    CHECK(lunar_checkpoint_open(ctx, &c, dir) == LUNAR_OK, "open dir: %s", lunar_ctx_error(ctx));
    if (c) {
        CHECK(lunar_checkpoint_shard_count(c) >= 3, "shards: %d", lunar_checkpoint_shard_count(c));
        CHECK(lunar_checkpoint_count(c) == N, "count");
        for (int i = 0; i < N; i++) {
            lunar_tensor b = {0};
            CHECK(lunar_checkpoint_tensor(ctx, &b, c, names[i]) == LUNAR_OK, "tensor %s", names[i]);
            CHECK(b.dtype == t[i].dtype && b.shape[0] == t[i].shape[0] && b.shape[1] == t[i].shape[1], "meta %s", names[i]);
            CHECK(memcmp(lunar_tensor_data(&b), lunar_tensor_data(&t[i]), lunar_tensor_nbytes(&b)) == 0, "bytes %s", names[i]);
            lunar_tensor_release(ctx, &b);
        }
        int ns = lunar_checkpoint_shard_count(c);
        ns_saved = ns;
        char first[300];
        snprintf(first, sizeof first, "%s/model-00001-of-%05d.safetensors", dir, ns);
        CHECK(strcmp(lunar_safetensors_path(lunar_checkpoint_shard(c, 0)), first) == 0, "shard name %s",
              lunar_safetensors_path(lunar_checkpoint_shard(c, 0)));
        lunar_checkpoint_close(ctx, c);

        /* a tensor listed in the index but absent from its shard */
        unsigned char *text = NULL;
        size_t tn = 0;
        read_all(idx, &text, &tn);
        text[tn] = 0;
        char *edited = malloc(tn + 200);
        char *wm = strstr((char *)text, "\"weight_map\": {");
        size_t head = (size_t)(wm - (char *)text) + strlen("\"weight_map\": {");
        memcpy(edited, text, head);
        sprintf(edited + head, "\n    \"ghost.weight\": \"model-00001-of-%05d.safetensors\",%s", ns, (char *)text + head);
        write_all(idx, edited, strlen(edited));
        c = NULL;
        CHECK(lunar_checkpoint_open(ctx, &c, dir) != LUNAR_OK, "ghost tensor must fail");
        CHECK(strstr(lunar_ctx_error(ctx), idx) && strstr(lunar_ctx_error(ctx), "tensor 'ghost.weight' is mapped to shard") &&
                  strstr(lunar_ctx_error(ctx), "has no such tensor"),
              "ghost message: %s", lunar_ctx_error(ctx));
        lunar_checkpoint_close(ctx, c);
        /* an index naming a shard that does not exist */
        write_all(idx, text, tn);
        char shard2[300];
        snprintf(shard2, sizeof shard2, "%s/model-00002-of-%05d.safetensors", dir, ns);
        unlink(shard2);
        c = NULL;
        CHECK(lunar_checkpoint_open(ctx, &c, idx) != LUNAR_OK, "missing shard must fail");
        CHECK(strstr(lunar_ctx_error(ctx), idx) && strstr(lunar_ctx_error(ctx), "does not exist") &&
                  strstr(lunar_ctx_error(ctx), "shard 'model-00002-of-"),
              "missing shard message: %s", lunar_ctx_error(ctx));
        lunar_checkpoint_close(ctx, c);
        /* an index that is not JSON */
        write_all(idx, "{\n  \"weight_map\": {\n    \"a\": 1,,\n", 34);
        CHECK(lunar_checkpoint_open(ctx, &c, dir) != LUNAR_OK && strstr(lunar_ctx_error(ctx), "line 3"),
              "bad index JSON: %s", lunar_ctx_error(ctx));
        write_all(idx, "{\"weight_map\": {\"a\": \"../../etc/passwd\"}}", 41);
        CHECK(lunar_checkpoint_open(ctx, &c, dir) != LUNAR_OK && strstr(lunar_ctx_error(ctx), "not a file inside"),
              "climbing shard name: %s", lunar_ctx_error(ctx));
        free(text);
        free(edited);
    }
    /* saving everything in one shard again removes the index and the shards */
    CHECK(lunar_checkpoint_save(ctx, dir, N, names, tp, 1ull << 30, NULL) == LUNAR_OK, "save single again");
    CHECK(!file_exists(idx), "stale index removed");
    snprintf(path, sizeof path, "%s/model-00001-of-%05d.safetensors", dir, ns_saved);
    CHECK(!file_exists(path), "stale shards removed");
    c = NULL;
    CHECK(lunar_checkpoint_open(ctx, &c, dir) == LUNAR_OK && lunar_checkpoint_count(c) == N, "single again opens");
    lunar_checkpoint_close(ctx, c);
    /* the golden index (one shard named tiny.safetensors) */
    c = NULL;
    CHECK(lunar_checkpoint_open(ctx, &c, "tests/fixtures/tiny.safetensors.index.json") == LUNAR_OK &&
              lunar_checkpoint_count(c) == 4, "golden index: %s", lunar_ctx_error(ctx));
    lunar_checkpoint_close(ctx, c);
    for (int i = 0; i < N; i++) lunar_tensor_release(ctx, &t[i]);
    lunar_ctx_clear_error(ctx);
}

int main(void) {
    lunar_ctx *ctx = NULL;
    if (lunar_ctx_init(&ctx) != LUNAR_OK) return 1;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/lunar_st_XXXXXX");
    if (!mkdtemp(tmpdir)) return 1;
    test_golden(ctx);
    test_all_dtypes(ctx);
    test_bad_inputs(ctx);
    test_truncations_and_flips(ctx);
    test_atomic_write(ctx);
    test_sharded(ctx);
    lunar_ctx_free(ctx);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    if (failures) {
        fprintf(stderr, "test_safetensors: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_safetensors: all passed\n");
    return 0;
}
