/* indexed.c: Megatron-LM indexed datasets (.bin/.idx): mmap reader with validation and token
 * views, streaming writer (see lunar/indexed.h for the contract). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io.h"
#include "lunar/indexed.h"

static const char MAGIC[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
#define HEADER_BYTES 34   /* magic 9 + version 8 + dtype 1 + S 8 + D 8 */

typedef struct mm_dtype {
    const char *name;
    size_t      size;
    int         lunar;   /* lunar dtype, -1 when lunar has none */
} mm_dtype;

/* indexed by Megatron's code; 0 is unused */
static const mm_dtype mm_dtypes[9] = {
    {NULL, 0, -1},
    {"uint8", 1, LUNAR_DTYPE_U8},  {"int8", 1, LUNAR_DTYPE_I8},     {"int16", 2, -1},
    {"int32", 4, LUNAR_DTYPE_I32}, {"int64", 8, LUNAR_DTYPE_I64},   {"float64", 8, LUNAR_DTYPE_F64},
    {"float32", 4, LUNAR_DTYPE_F32}, {"uint16", 2, -1},
};

const char *lunar_mmidx_dtype_name(int code) { return code >= 1 && code <= 8 ? mm_dtypes[code].name : NULL; }
size_t lunar_mmidx_itemsize(int code) { return code >= 1 && code <= 8 ? mm_dtypes[code].size : 0; }

int lunar_mmidx_dtype_code(const char *name) {
    for (int c = 1; c <= 8; c++)
        if (strcmp(mm_dtypes[c].name, name) == 0) return c;
    return 0;
}

/* little-endian loads and stores through memcpy (the .idx arrays are unaligned) */
static uint64_t ld_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint32_t ld_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void st_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void st_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* ---- reader ------------------------------------------------------------------------------------ */

struct lunar_indexed {
    char    *prefix, *idx_path, *bin_path;
    char     label[96];          /* basename of the prefix, for tensor names */
    lunar_mapped *idx, *bin;
    int      code;
    size_t   itemsize;
    int64_t  S, D;
    int      multimodal;
    const unsigned char *lengths, *pointers, *doc_idx, *modes;
    int64_t  total_tokens;
};

const char *lunar_indexed_prefix(const lunar_indexed *d) { return d->prefix; }
int lunar_indexed_dtype(const lunar_indexed *d) { return d->code; }
int64_t lunar_indexed_sequence_count(const lunar_indexed *d) { return d->S; }
int64_t lunar_indexed_document_count(const lunar_indexed *d) { return d->D - 1; }
int lunar_indexed_multimodal(const lunar_indexed *d) { return d->multimodal; }
int64_t lunar_indexed_total_tokens(const lunar_indexed *d) { return d->total_tokens; }

int32_t lunar_indexed_length(const lunar_indexed *d, int64_t seq) {
    return (int32_t)ld_u32(d->lengths + 4 * (size_t)seq);
}
int64_t lunar_indexed_pointer(const lunar_indexed *d, int64_t seq) {
    return (int64_t)ld_u64(d->pointers + 8 * (size_t)seq);
}
int64_t lunar_indexed_doc_index(const lunar_indexed *d, int64_t i) {
    return (int64_t)ld_u64(d->doc_idx + 8 * (size_t)i);
}
int8_t lunar_indexed_mode(const lunar_indexed *d, int64_t seq) {
    return d->modes ? (int8_t)d->modes[seq] : 0;
}

void lunar_indexed_close(lunar_ctx *ctx, lunar_indexed *d) {
    (void)ctx;
    if (!d) return;
    lunar_mapped_unref(d->idx);
    lunar_mapped_unref(d->bin);
    free(d->prefix);
    free(d->idx_path);
    free(d->bin_path);
    free(d);
}

static char *concat(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *s = malloc(na + nb + 1);
    if (!s) return NULL;
    memcpy(s, a, na);
    memcpy(s + na, b, nb + 1);
    return s;
}

static lunar_status validate(lunar_ctx *ctx, lunar_indexed *d) {
    const char *ip = d->idx_path;
    const unsigned char *p = d->idx->base;
    uint64_t size = d->idx->size;
    if (size < HEADER_BYTES)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: file is %llu bytes, too short for the %d-byte header (truncated?)",
                          ip, (unsigned long long)size, HEADER_BYTES);
    if (memcmp(p, MAGIC, 9) != 0)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: bad magic (expected \"MMIDIDX\\0\\0\"): not a Megatron index file", ip);
    uint64_t version = ld_u64(p + 9);
    if (version != 1)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: version %llu, only version 1 is known", ip,
                          (unsigned long long)version);
    int code = p[17];
    if (code < 1 || code > 8)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: dtype code %d is not one of 1..8", ip, code);
    d->code = code;
    d->itemsize = mm_dtypes[code].size;
    uint64_t S = ld_u64(p + 18), D = ld_u64(p + 26);
    uint64_t room = size - HEADER_BYTES;
    /* each sequence costs 12 bytes and each document index 8: reject counts that cannot fit
     * before multiplying them */
    if (S > room / 12 || D > room / 8 || S * 12 + D * 8 > room)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                          "%s: header says %llu sequences and %llu document indices, which need more than the "
                          "file's %llu bytes (truncated?)", ip, (unsigned long long)S, (unsigned long long)D,
                          (unsigned long long)size);
    uint64_t base = HEADER_BYTES + S * 12 + D * 8;
    if (size == base) d->multimodal = 0;
    else if (size == base + S && S > 0) d->multimodal = 1;
    else
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                          "%s: file is %llu bytes; %llu sequences and %llu document indices need %llu (or %llu with "
                          "multimodal modes)", ip, (unsigned long long)size, (unsigned long long)S,
                          (unsigned long long)D, (unsigned long long)base, (unsigned long long)(base + S));
    if (D < 1) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: document count is 0 (it must start with the index 0)", ip);
    d->S = (int64_t)S;
    d->D = (int64_t)D;
    d->lengths = p + HEADER_BYTES;
    d->pointers = d->lengths + 4 * S;
    d->doc_idx = d->pointers + 8 * S;
    d->modes = d->multimodal ? d->doc_idx + 8 * D : NULL;

    uint64_t expect = 0;
    for (uint64_t i = 0; i < S; i++) {
        int32_t len = lunar_indexed_length(d, (int64_t)i);
        uint64_t ptr = (uint64_t)lunar_indexed_pointer(d, (int64_t)i);
        if (len < 0)
            return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: sequence %llu has negative length %d", ip,
                              (unsigned long long)i, (int)len);
        if (ptr != expect)
            return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                              "%s: sequence %llu starts at byte %llu of the .bin, expected %llu (the running sum of "
                              "length x %zu bytes)", ip, (unsigned long long)i, (unsigned long long)ptr,
                              (unsigned long long)expect, d->itemsize);
        expect += (uint64_t)len * d->itemsize;
    }
    if (expect != d->bin->size)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                          "%s: is %llu bytes but %s describes %llu (%llu tokens of %s): the two files do not belong "
                          "together or one is truncated", d->bin_path, (unsigned long long)d->bin->size, ip,
                          (unsigned long long)expect, (unsigned long long)(expect / d->itemsize),
                          mm_dtypes[code].name);
    d->total_tokens = (int64_t)(expect / d->itemsize);
    int64_t prev = 0;
    for (int64_t i = 0; i < d->D; i++) {
        int64_t v = lunar_indexed_doc_index(d, i);
        if (i == 0 && v != 0)
            return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: document_indices[0] is %lld, expected 0", ip, (long long)v);
        if (v < prev || v > d->S)
            return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                              "%s: document_indices[%lld] = %lld is out of order (previous %lld, %lld sequences)", ip,
                              (long long)i, (long long)v, (long long)prev, (long long)d->S);
        prev = v;
    }
    return LUNAR_OK;
}

lunar_status lunar_indexed_open(lunar_ctx *ctx, lunar_indexed **out, const char *prefix) {
    *out = NULL;
    lunar_indexed *d = calloc(1, sizeof *d);
    if (!d) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", prefix);
    d->prefix = strdup(prefix);
    d->idx_path = concat(prefix, ".idx");
    d->bin_path = concat(prefix, ".bin");
    if (!d->prefix || !d->idx_path || !d->bin_path) {
        lunar_indexed_close(ctx, d);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", prefix);
    }
    snprintf(d->label, sizeof d->label, "%s", lunar_path_base(prefix));
    lunar_status st = lunar_map_file(ctx, d->idx_path, &d->idx);
    if (st == LUNAR_OK) st = lunar_map_file(ctx, d->bin_path, &d->bin);
    if (st == LUNAR_OK) st = validate(ctx, d);
    if (st != LUNAR_OK) {
        lunar_indexed_close(ctx, d);
        return st;
    }
    *out = d;
    return LUNAR_OK;
}

/* tokens [first, first + n) of the whole .bin as a tensor named name */
static lunar_status token_view(lunar_ctx *ctx, lunar_tensor *out, const lunar_indexed *d, int64_t first, int64_t n,
                               const char *name) {
    memset(out, 0, sizeof *out);
    lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
    int lt = mm_dtypes[d->code].lunar;
    int64_t shape[1] = {n};
    lunar_status st;
    const unsigned char *src = (const unsigned char *)d->bin->base + (size_t)first * d->itemsize;
    if (lt < 0) {
        /* uint16 / int16: an i32 copy */
        st = lunar_tensor_new(ctx, out, LUNAR_DTYPE_I32, cpu, 1, shape);
        if (st == LUNAR_OK) {
            int32_t *dst = lunar_tensor_data(out);
            for (int64_t i = 0; i < n; i++) {
                uint16_t v;
                memcpy(&v, src + 2 * i, 2);
                dst[i] = d->code == LUNAR_MMIDX_U16 ? (int32_t)v : (int32_t)(int16_t)v;
            }
        }
    } else if (n == 0 || !d->bin->base) {
        st = lunar_tensor_new(ctx, out, (lunar_dtype)lt, cpu, 1, shape);
    } else {
        st = lunar_mapped_view(ctx, out, d->bin, (void *)src, (size_t)n * d->itemsize, (lunar_dtype)lt, 1, shape);
    }
    if (st != LUNAR_OK) {
        lunar_tensor_release(ctx, out);
        return st;
    }
    lunar_tensor_set_name(out, name);
    return LUNAR_OK;
}

lunar_status lunar_indexed_sequence(lunar_ctx *ctx, lunar_tensor *out, const lunar_indexed *d, int64_t seq,
                                    int64_t offset, int64_t length) {
    memset(out, 0, sizeof *out);
    if (seq < 0 || seq >= d->S)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: sequence %lld is out of range (%lld sequences)", d->prefix,
                          (long long)seq, (long long)d->S);
    int64_t len = lunar_indexed_length(d, seq);
    if (length < 0) length = len - offset;
    if (offset < 0 || length < 0 || offset + length > len)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: tokens [%lld, %lld) of sequence %lld are out of range (length %lld)",
                          d->prefix, (long long)offset, (long long)(offset + length), (long long)seq, (long long)len);
    char name[LUNAR_NAME_MAX];
    snprintf(name, sizeof name, "%.100s[%lld]", d->label, (long long)seq);
    int64_t first = lunar_indexed_pointer(d, seq) / (int64_t)d->itemsize + offset;
    return token_view(ctx, out, d, first, length, name);
}

lunar_status lunar_indexed_document(lunar_ctx *ctx, lunar_tensor *out, const lunar_indexed *d, int64_t doc) {
    memset(out, 0, sizeof *out);
    if (doc < 0 || doc >= d->D - 1)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: document %lld is out of range (%lld documents)", d->prefix,
                          (long long)doc, (long long)(d->D - 1));
    int64_t s0 = lunar_indexed_doc_index(d, doc), s1 = lunar_indexed_doc_index(d, doc + 1);
    int64_t first = 0, n = 0;
    if (s1 > s0) {
        first = lunar_indexed_pointer(d, s0) / (int64_t)d->itemsize;
        int64_t last = lunar_indexed_pointer(d, s1 - 1) / (int64_t)d->itemsize + lunar_indexed_length(d, s1 - 1);
        n = last - first;
    }
    char name[LUNAR_NAME_MAX];
    snprintf(name, sizeof name, "%.100s:doc[%lld]", d->label, (long long)doc);
    return token_view(ctx, out, d, first, n, name);
}

lunar_status lunar_indexed_read_i64(lunar_ctx *ctx, int64_t *dst, const lunar_indexed *d, int64_t first, int64_t n) {
    if (first < 0 || n < 0 || first + n > d->total_tokens)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: tokens [%lld, %lld) are out of range (%lld tokens)", d->prefix,
                          (long long)first, (long long)(first + n), (long long)d->total_tokens);
    const unsigned char *src = (const unsigned char *)d->bin->base + (size_t)first * d->itemsize;
    for (int64_t i = 0; i < n; i++) {
        const unsigned char *q = src + (size_t)i * d->itemsize;
        switch (d->code) {
        case LUNAR_MMIDX_U8: dst[i] = q[0]; break;
        case LUNAR_MMIDX_I8: dst[i] = (int8_t)q[0]; break;
        case LUNAR_MMIDX_I16: { int16_t v; memcpy(&v, q, 2); dst[i] = v; break; }
        case LUNAR_MMIDX_U16: { uint16_t v; memcpy(&v, q, 2); dst[i] = v; break; }
        case LUNAR_MMIDX_I32: { int32_t v; memcpy(&v, q, 4); dst[i] = v; break; }
        case LUNAR_MMIDX_I64: { int64_t v; memcpy(&v, q, 8); dst[i] = v; break; }
        case LUNAR_MMIDX_F32: { float v; memcpy(&v, q, 4); dst[i] = v == v && v > -9e18f && v < 9e18f ? (int64_t)v : 0; break; }
        default: { double v; memcpy(&v, q, 8); dst[i] = v == v && v > -9e18 && v < 9e18 ? (int64_t)v : 0; break; }
        }
    }
    return LUNAR_OK;
}

/* ---- writer ------------------------------------------------------------------------------------ */

#define WBUF_BYTES ((size_t)1 << 20)

struct lunar_indexed_writer {
    char         *prefix, *idx_path, *bin_path;
    int           code;
    size_t        itemsize;
    lunar_afile   bin;
    unsigned char *buf;
    size_t        buf_len;
    int32_t      *lengths;
    int64_t       n_seq, cap_seq;
    int64_t      *docs;
    int64_t       n_docs, cap_docs;   /* n_docs counts document_indices entries (starts at 1) */
    int64_t       tokens;
};

int64_t lunar_indexed_writer_sequences(const lunar_indexed_writer *w) { return w->n_seq; }
int64_t lunar_indexed_writer_documents(const lunar_indexed_writer *w) { return w->n_docs - 1; }
int64_t lunar_indexed_writer_tokens(const lunar_indexed_writer *w) { return w->tokens; }

static void writer_free(lunar_indexed_writer *w) {
    free(w->prefix);
    free(w->idx_path);
    free(w->bin_path);
    free(w->buf);
    free(w->lengths);
    free(w->docs);
    free(w);
}

void lunar_indexed_writer_abort(lunar_indexed_writer *w) {
    if (!w) return;
    lunar_afile_abort(&w->bin);
    writer_free(w);
}

lunar_status lunar_indexed_writer_open(lunar_ctx *ctx, lunar_indexed_writer **out, const char *prefix, int dtype_code) {
    *out = NULL;
    if (dtype_code < 1 || dtype_code > 8)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: dtype code %d is not one of 1..8", prefix, dtype_code);
    lunar_indexed_writer *w = calloc(1, sizeof *w);
    if (!w) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", prefix);
    w->bin.fd = -1;
    w->code = dtype_code;
    w->itemsize = mm_dtypes[dtype_code].size;
    w->prefix = strdup(prefix);
    w->idx_path = concat(prefix, ".idx");
    w->bin_path = concat(prefix, ".bin");
    w->buf = malloc(WBUF_BYTES);
    w->cap_docs = 1024;
    w->docs = malloc((size_t)w->cap_docs * sizeof *w->docs);
    if (!w->prefix || !w->idx_path || !w->bin_path || !w->buf || !w->docs) {
        writer_free(w);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", prefix);
    }
    w->docs[0] = 0;
    w->n_docs = 1;
    lunar_status st = lunar_afile_open(ctx, &w->bin, w->bin_path);
    if (st != LUNAR_OK) {
        writer_free(w);
        return st;
    }
    *out = w;
    return LUNAR_OK;
}

static lunar_status flush_buf(lunar_ctx *ctx, lunar_indexed_writer *w) {
    lunar_status st = w->buf_len ? lunar_afile_write(ctx, &w->bin, w->buf, w->buf_len) : LUNAR_OK;
    w->buf_len = 0;
    return st;
}

/* one token id in the dataset's dtype, or 0 when the value does not fit */
static int encode_token(int code, int64_t v, unsigned char *q) {
    switch (code) {
    case LUNAR_MMIDX_U8:
        if (v < 0 || v > 255) return 0;
        q[0] = (unsigned char)v;
        return 1;
    case LUNAR_MMIDX_I8:
        if (v < -128 || v > 127) return 0;
        q[0] = (unsigned char)(int8_t)v;
        return 1;
    case LUNAR_MMIDX_I16:
        if (v < -32768 || v > 32767) return 0;
        q[0] = (unsigned char)((uint16_t)v & 0xff);
        q[1] = (unsigned char)((uint16_t)v >> 8);
        return 1;
    case LUNAR_MMIDX_U16:
        if (v < 0 || v > 65535) return 0;
        q[0] = (unsigned char)(v & 0xff);
        q[1] = (unsigned char)(v >> 8);
        return 1;
    case LUNAR_MMIDX_I32:
        if (v < INT32_MIN || v > INT32_MAX) return 0;
        st_u32(q, (uint32_t)(int32_t)v);
        return 1;
    case LUNAR_MMIDX_I64:
        st_u64(q, (uint64_t)v);
        return 1;
    case LUNAR_MMIDX_F32: {
        if (v < -(INT64_C(1) << 24) || v > (INT64_C(1) << 24)) return 0;   /* exact integers only */
        float f = (float)v;
        memcpy(q, &f, 4);
        return 1;
    }
    default: {
        if (v < -(INT64_C(1) << 53) || v > (INT64_C(1) << 53)) return 0;
        double f = (double)v;
        memcpy(q, &f, 8);
        return 1;
    }
    }
}

lunar_status lunar_indexed_writer_add(lunar_ctx *ctx, lunar_indexed_writer *w, const int64_t *ids, int64_t n) {
    if (n < 0 || n > INT32_MAX)
        return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: sequence %lld has %lld tokens; the index stores lengths as int32",
                          w->prefix, (long long)w->n_seq, (long long)n);
    if (w->n_seq == w->cap_seq) {
        int64_t cap = w->cap_seq ? 2 * w->cap_seq : 1024;
        int32_t *p = realloc(w->lengths, (size_t)cap * sizeof *p);
        if (!p) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", w->prefix);
        w->lengths = p;
        w->cap_seq = cap;
    }
    /* check every value first, so that a failed add leaves the writer as it was */
    unsigned char scratch[8];
    for (int64_t i = 0; i < n; i++)
        if (!encode_token(w->code, ids[i], scratch))
            return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: token %lld of sequence %lld is %" PRId64 ", which %s cannot hold",
                              w->prefix, (long long)i, (long long)w->n_seq, ids[i], mm_dtypes[w->code].name);
    for (int64_t i = 0; i < n; i++) {
        if (w->buf_len + w->itemsize > WBUF_BYTES) {
            lunar_status st = flush_buf(ctx, w);
            if (st != LUNAR_OK) return st;
        }
        encode_token(w->code, ids[i], w->buf + w->buf_len);
        w->buf_len += w->itemsize;
    }
    w->lengths[w->n_seq++] = (int32_t)n;
    w->tokens += n;
    return LUNAR_OK;
}

lunar_status lunar_indexed_writer_end_document(lunar_ctx *ctx, lunar_indexed_writer *w) {
    if (w->n_docs == w->cap_docs) {
        int64_t cap = 2 * w->cap_docs;
        int64_t *p = realloc(w->docs, (size_t)cap * sizeof *p);
        if (!p) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", w->prefix);
        w->docs = p;
        w->cap_docs = cap;
    }
    w->docs[w->n_docs++] = w->n_seq;
    return LUNAR_OK;
}

/* append one array to the .idx file through the buffer */
static lunar_status put_bytes(lunar_ctx *ctx, lunar_afile *f, unsigned char *buf, size_t *len, const void *p, size_t n) {
    const unsigned char *s = p;
    while (n > 0) {
        size_t k = WBUF_BYTES - *len < n ? WBUF_BYTES - *len : n;
        memcpy(buf + *len, s, k);
        *len += k;
        s += k;
        n -= k;
        if (*len == WBUF_BYTES) {
            lunar_status st = lunar_afile_write(ctx, f, buf, *len);
            *len = 0;
            if (st != LUNAR_OK) return st;
        }
    }
    return LUNAR_OK;
}

lunar_status lunar_indexed_writer_finish(lunar_ctx *ctx, lunar_indexed_writer *w) {
    lunar_status st = LUNAR_OK;
    /* sequences added after the last end_document form a last document */
    if (w->docs[w->n_docs - 1] != w->n_seq) st = lunar_indexed_writer_end_document(ctx, w);
    if (st == LUNAR_OK) st = flush_buf(ctx, w);
    if (st != LUNAR_OK) {
        lunar_indexed_writer_abort(w);
        return st;
    }
    lunar_afile idx;
    st = lunar_afile_open(ctx, &idx, w->idx_path);
    if (st != LUNAR_OK) {
        lunar_indexed_writer_abort(w);
        return st;
    }
    unsigned char head[HEADER_BYTES], e[8];
    memcpy(head, MAGIC, 9);
    st_u64(head + 9, 1);
    head[17] = (unsigned char)w->code;
    st_u64(head + 18, (uint64_t)w->n_seq);
    st_u64(head + 26, (uint64_t)w->n_docs);
    size_t len = 0;
    st = put_bytes(ctx, &idx, w->buf, &len, head, sizeof head);
    for (int64_t i = 0; i < w->n_seq && st == LUNAR_OK; i++) {
        st_u32(e, (uint32_t)w->lengths[i]);
        st = put_bytes(ctx, &idx, w->buf, &len, e, 4);
    }
    uint64_t ptr = 0;
    for (int64_t i = 0; i < w->n_seq && st == LUNAR_OK; i++) {
        st_u64(e, ptr);
        st = put_bytes(ctx, &idx, w->buf, &len, e, 8);
        ptr += (uint64_t)w->lengths[i] * w->itemsize;
    }
    for (int64_t i = 0; i < w->n_docs && st == LUNAR_OK; i++) {
        st_u64(e, (uint64_t)w->docs[i]);
        st = put_bytes(ctx, &idx, w->buf, &len, e, 8);
    }
    if (st == LUNAR_OK && len) st = lunar_afile_write(ctx, &idx, w->buf, len);
    /* the .bin goes first: a reader that finds the new .idx also finds its .bin */
    if (st == LUNAR_OK) st = lunar_afile_commit(ctx, &w->bin);
    if (st == LUNAR_OK) st = lunar_afile_commit(ctx, &idx);
    else lunar_afile_abort(&idx);
    lunar_indexed_writer_abort(w);   /* removes nothing once committed; frees */
    return st;
}
