/* safetensors.c: the safetensors reader (mmap, validation, zero-copy views) and writer (see
 * lunar/safetensors.h for the contract). Sharded checkpoints are in checkpoint.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io.h"
#include "lunar/ops.h"
#include "lunar/safetensors.h"

/* ---- dtypes ----------------------------------------------------------------------------------- */

/* Every dtype string of the format, in the reference implementation's enum order: the writer
 * lays tensors out by this rank, descending. lunar is the tensor type, or -1 when lunar has none. */
typedef struct st_dtype {
    const char *name;
    int         bits;
    int         lunar;
} st_dtype;

static const st_dtype st_dtypes[] = {
    {"BOOL", 8, LUNAR_DTYPE_BOOL},      {"F4", 4, -1},        {"F6_E2M3", 6, -1},
    {"F6_E3M2", 6, -1},                 {"U8", 8, LUNAR_DTYPE_U8},
    {"I8", 8, LUNAR_DTYPE_I8},          {"F8_E5M2", 8, LUNAR_DTYPE_F8E5M2},
    {"F8_E4M3", 8, LUNAR_DTYPE_F8E4M3}, {"F8_E8M0", 8, -1},   {"F8_E4M3FNUZ", 8, -1},
    {"F8_E5M2FNUZ", 8, -1},             {"I16", 16, -1},      {"U16", 16, -1},
    {"F16", 16, LUNAR_DTYPE_F16},       {"BF16", 16, LUNAR_DTYPE_BF16},
    {"I32", 32, LUNAR_DTYPE_I32},       {"U32", 32, -1},      {"F32", 32, LUNAR_DTYPE_F32},
    {"C64", 64, -1},                    {"F64", 64, LUNAR_DTYPE_F64},
    {"I64", 64, LUNAR_DTYPE_I64},       {"U64", 64, -1},
};
#define N_ST_DTYPES ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

static int st_dtype_find(const char *s) {
    for (int i = 0; i < N_ST_DTYPES; i++)
        if (strcmp(st_dtypes[i].name, s) == 0) return i;
    return -1;
}

static int st_dtype_of_lunar(lunar_dtype dt) {
    for (int i = 0; i < N_ST_DTYPES; i++)
        if (st_dtypes[i].lunar == (int)dt) return i;
    return -1;
}

struct lunar_safetensors {
    char                   *path;
    lunar_mapped           *map;
    cJSON                  *root;          /* owns the name and metadata strings */
    int                     n;
    lunar_safetensors_info *entries;       /* sorted by name */
    int64_t                *shapes;
    int                     n_meta;
    const char            **meta_keys, **meta_values;   /* sorted by key */
    uint64_t                data_start;    /* 8 + N */
    uint64_t                data_len;
};

/* ---- validation helpers ------------------------------------------------------------------------ */

/* 1 if s[0..n) is valid UTF-8 (no overlongs, surrogates or code points past U+10FFFF); else 0
 * and *bad = offset of the first bad byte */
static int utf8_valid(const unsigned char *s, size_t n, size_t *bad) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t len;
        unsigned cp;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
        else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }
        else { *bad = i; return 0; }
        if (i + len > n) { *bad = i; return 0; }
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) { *bad = i; return 0; }
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
            *bad = i;
            return 0;
        }
        i += len;
    }
    return 1;
}

/* a JSON number that is a non-negative integer exactly representable in a double */
static int json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0) || d > 9007199254740992.0 || d != (double)(uint64_t)d) return 0;
    *out = (uint64_t)d;
    return 1;
}

static void json_value_desc(const cJSON *v, char *buf, size_t n) {
    if (cJSON_IsNumber(v)) snprintf(buf, n, "%.17g", v->valuedouble);
    else if (cJSON_IsString(v)) snprintf(buf, n, "\"%.40s\"", v->valuestring);
    else if (cJSON_IsBool(v)) snprintf(buf, n, "%s", cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsNull(v)) snprintf(buf, n, "null");
    else if (cJSON_IsArray(v)) snprintf(buf, n, "an array");
    else if (cJSON_IsObject(v)) snprintf(buf, n, "an object");
    else snprintf(buf, n, "an invalid value");
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* the first duplicate member name of object o, or NULL */
static const char *find_duplicate_key(const cJSON *o, int count) {
    if (count < 2) return NULL;
    const char **names = malloc(sizeof *names * (size_t)count);
    if (!names) return NULL;
    int k = 0;
    for (const cJSON *c = o->child; c && k < count; c = c->next) names[k++] = c->string ? c->string : "";
    qsort(names, (size_t)k, sizeof *names, cmp_str_ptr);
    const char *dup = NULL;
    for (int i = 1; i < k && !dup; i++)
        if (strcmp(names[i], names[i - 1]) == 0) dup = names[i];
    free(names);
    return dup;
}

static int cmp_info_name(const void *a, const void *b) {
    return strcmp(((const lunar_safetensors_info *)a)->name, ((const lunar_safetensors_info *)b)->name);
}

static int cmp_info_offsets(const void *a, const void *b) {
    const lunar_safetensors_info *x = *(const lunar_safetensors_info *const *)a;
    const lunar_safetensors_info *y = *(const lunar_safetensors_info *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_meta(const void *a, const void *b) {
    return strcmp(((const cJSON *const *)a)[0]->string, ((const cJSON *const *)b)[0]->string);
}

/* ---- header parsing ---------------------------------------------------------------------------- */

static lunar_status parse_metadata(lunar_ctx *ctx, lunar_safetensors *f, const cJSON *m) {
    const char *path = f->path;
    if (cJSON_IsNull(m)) return LUNAR_OK;
    if (!cJSON_IsObject(m))
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: __metadata__ must be an object mapping strings to strings", path);
    int count = cJSON_GetArraySize(m);
    const char *dup = find_duplicate_key(m, count);
    if (dup) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: duplicate key '%s' in __metadata__", path, dup);
    if (count == 0) return LUNAR_OK;
    const cJSON **items = malloc(sizeof *items * (size_t)count);
    f->meta_keys = malloc(sizeof *f->meta_keys * (size_t)count);
    f->meta_values = malloc(sizeof *f->meta_values * (size_t)count);
    if (!items || !f->meta_keys || !f->meta_values) {
        free(items);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory reading __metadata__", path);
    }
    int k = 0;
    for (const cJSON *c = m->child; c; c = c->next) {
        if (!cJSON_IsString(c)) {
            char d[64];
            json_value_desc(c, d, sizeof d);
            free(items);
            return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: __metadata__ must map strings to strings, but '%s' is %s", path,
                              c->string, d);
        }
        items[k++] = c;
    }
    qsort(items, (size_t)k, sizeof *items, cmp_meta);
    for (int i = 0; i < k; i++) {
        f->meta_keys[i] = items[i]->string;
        f->meta_values[i] = items[i]->valuestring;
    }
    f->n_meta = k;
    free(items);
    return LUNAR_OK;
}

/* fills e (name, dtype, shape into shapes[*shape_pos...]) from one header entry */
static lunar_status parse_entry(lunar_ctx *ctx, lunar_safetensors *f, const cJSON *o, lunar_safetensors_info *e,
                                int64_t *shapes, size_t *shape_pos) {
    const char *path = f->path, *name = o->string;
    e->name = name;
    if (!cJSON_IsObject(o))
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' must be an object with dtype, shape and data_offsets",
                          path, name);
    const char *dup = find_duplicate_key(o, cJSON_GetArraySize(o));
    if (dup) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' has the key '%s' twice", path, name, dup);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(o, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(o, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(o, "data_offsets");
    if (!dt || !shape || !offs)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' has no %s", path, name,
                          !dt ? "dtype" : !shape ? "shape" : "data_offsets");
    if (!cJSON_IsString(dt)) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' dtype is not a string", path, name);
    int di = st_dtype_find(dt->valuestring);
    if (di < 0)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' has unknown dtype '%s'", path, name, dt->valuestring);
    e->file_dtype = st_dtypes[di].name;
    e->supported = st_dtypes[di].lunar >= 0;
    e->dtype = e->supported ? (lunar_dtype)st_dtypes[di].lunar : LUNAR_DTYPE_U8;
    if (!cJSON_IsArray(shape)) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' shape is not an array", path, name);
    e->ndim = cJSON_GetArraySize(shape);
    e->shape = shapes + *shape_pos;
    if (e->ndim > LUNAR_MAX_DIMS) e->supported = 0;
    uint64_t numel = 1, nonzero = 1;   /* nonzero: product of the non-zero dims (strides must fit) */
    int overflow = 0, k = 0;
    for (const cJSON *d = shape->child; d; d = d->next, k++) {
        uint64_t v;
        if (!json_uint(d, &v)) {
            char desc[64];
            json_value_desc(d, desc, sizeof desc);
            return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' shape entry %d is %s, not a non-negative integer",
                              path, name, k, desc);
        }
        shapes[(*shape_pos)++] = (int64_t)v;
        if (v != 0 && numel > UINT64_MAX / v) overflow = 1;
        else numel *= v;
        if (v != 0 && nonzero > ((uint64_t)1 << 62) / v) overflow = 1;
        else if (v != 0) nonzero *= v;
    }
    uint64_t bits = (uint64_t)st_dtypes[di].bits;
    if (overflow || (numel != 0 && numel > UINT64_MAX / bits))
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' shape has too many elements", path, name);
    if ((numel * bits) % 8 != 0)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' of %llu %s elements does not end on a byte boundary",
                          path, name, (unsigned long long)numel, e->file_dtype);
    uint64_t nbytes = numel * bits / 8;
    uint64_t b, en;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !json_uint(offs->child, &b) ||
        !json_uint(offs->child->next, &en))
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' data_offsets must be [begin, end] with non-negative integers",
                          path, name);
    e->begin = b;
    e->end = en;
    if (en < b)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' data_offsets [%llu, %llu] end before they begin", path,
                          name, (unsigned long long)b, (unsigned long long)en);
    if (en - b != nbytes) {
        char sh[160];
        lunar_shape_format(e->ndim <= LUNAR_MAX_DIMS ? e->ndim : LUNAR_MAX_DIMS, e->shape, sh, sizeof sh);
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                          "%s: tensor '%s' is %s %s = %llu bytes but its data_offsets [%llu, %llu] span %llu bytes", path,
                          name, e->file_dtype, sh, (unsigned long long)nbytes, (unsigned long long)b,
                          (unsigned long long)en, (unsigned long long)(en - b));
    }
    if (en > f->data_len)
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' data_offsets [%llu, %llu] go past the end of the data (%llu bytes)",
                          path, name, (unsigned long long)b, (unsigned long long)en, (unsigned long long)f->data_len);
    return LUNAR_OK;
}

/* the tensors must tile [0, data_len) exactly, as the reference reader requires */
static lunar_status check_tiling(lunar_ctx *ctx, lunar_safetensors *f) {
    lunar_safetensors_info **by_off = malloc(sizeof *by_off * (size_t)(f->n ? f->n : 1));
    if (!by_off) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", f->path);
    for (int i = 0; i < f->n; i++) by_off[i] = &f->entries[i];
    qsort(by_off, (size_t)f->n, sizeof *by_off, cmp_info_offsets);
    uint64_t expect = 0;
    lunar_status st = LUNAR_OK;
    const lunar_safetensors_info *prev = NULL;
    for (int i = 0; i < f->n && st == LUNAR_OK; i++) {
        const lunar_safetensors_info *e = by_off[i];
        if (e->begin < expect)
            st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: tensor '%s' data_offsets [%llu, %llu] overlap tensor '%s' [%llu, %llu]",
                            f->path, e->name, (unsigned long long)e->begin, (unsigned long long)e->end, prev->name,
                            (unsigned long long)prev->begin, (unsigned long long)prev->end);
        else if (e->begin > expect)
            st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                            "%s: hole in the data: bytes [%llu, %llu) before tensor '%s' belong to no tensor", f->path,
                            (unsigned long long)expect, (unsigned long long)e->begin, e->name);
        expect = e->end;
        prev = e;
    }
    if (st == LUNAR_OK && expect != f->data_len)
        st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                        "%s: the data buffer has %llu bytes but the tensors cover only %llu (trailing bytes belong to no tensor)",
                        f->path, (unsigned long long)f->data_len, (unsigned long long)expect);
    free(by_off);
    return st;
}

static lunar_status parse_header(lunar_ctx *ctx, lunar_safetensors *f) {
    const unsigned char *base = f->map->base;
    uint64_t hlen = f->data_start - 8;
    const char *hdr = (const char *)base + 8;
    if (hlen == 0) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: the header is empty (length 0)", f->path);
    if (hdr[0] != '{')
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: the header is not a JSON object (it must start with '{', found byte 0x%02x)",
                          f->path, (unsigned)(unsigned char)hdr[0]);
    size_t bad;
    if (!utf8_valid((const unsigned char *)hdr, (size_t)hlen, &bad))
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: the header is not valid UTF-8 (byte %zu of the header)", f->path, bad);
    char what[1200];
    snprintf(what, sizeof what, "%s: header", f->path);
    LUNAR_TRY(lunar_json_parse(ctx, what, hdr, (size_t)hlen, &f->root));
    if (!cJSON_IsObject(f->root))
        return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: the header is not a JSON object", f->path);
    int count = cJSON_GetArraySize(f->root);
    const char *dup = find_duplicate_key(f->root, count);
    if (dup) return LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: duplicate key '%s' in the header", f->path, dup);
    size_t total_dims = 0;
    int n = 0;
    for (const cJSON *c = f->root->child; c; c = c->next) {
        if (strcmp(c->string, "__metadata__") == 0) continue;
        n++;
        const cJSON *shape = cJSON_IsObject(c) ? cJSON_GetObjectItemCaseSensitive(c, "shape") : NULL;
        if (cJSON_IsArray(shape)) total_dims += (size_t)cJSON_GetArraySize(shape);
    }
    f->entries = calloc((size_t)(n ? n : 1), sizeof *f->entries);
    f->shapes = calloc(total_dims ? total_dims : 1, sizeof *f->shapes);
    if (!f->entries || !f->shapes) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory for %d tensors", f->path, n);
    size_t shape_pos = 0;
    for (const cJSON *c = f->root->child; c; c = c->next) {
        if (strcmp(c->string, "__metadata__") == 0) {
            LUNAR_TRY(parse_metadata(ctx, f, c));
            continue;
        }
        LUNAR_TRY(parse_entry(ctx, f, c, &f->entries[f->n], f->shapes, &shape_pos));
        f->n++;
    }
    LUNAR_TRY(check_tiling(ctx, f));
    qsort(f->entries, (size_t)f->n, sizeof *f->entries, cmp_info_name);
    return LUNAR_OK;
}

/* ---- open / close / lookup ------------------------------------------------------------------- */

void lunar_safetensors_close(lunar_ctx *ctx, lunar_safetensors *f) {
    (void)ctx;
    if (!f) return;
    lunar_mapped_unref(f->map);
    cJSON_Delete(f->root);
    free(f->entries);
    free(f->shapes);
    free(f->meta_keys);
    free(f->meta_values);
    free(f->path);
    free(f);
}

static uint64_t read_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

lunar_status lunar_safetensors_open(lunar_ctx *ctx, lunar_safetensors **out, const char *path) {
    *out = NULL;
    lunar_safetensors *f = calloc(1, sizeof *f);
    if (f) f->path = strdup(path);
    if (!f || !f->path) {
        free(f);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    }
    lunar_status st = lunar_map_file(ctx, path, &f->map);
    if (st == LUNAR_OK && f->map->size < 8)
        st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                        "%s: file is %llu bytes, too short to hold the 8-byte header length (truncated file?)", path,
                        (unsigned long long)f->map->size);
    if (st == LUNAR_OK) {
        uint64_t size = (uint64_t)f->map->size;
        uint64_t hlen = read_le64(f->map->base);
        if (hlen > LUNAR_SAFETENSORS_MAX_HEADER)
            st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT, "%s: header length %llu is larger than the limit of %llu bytes", path,
                            (unsigned long long)hlen, (unsigned long long)LUNAR_SAFETENSORS_MAX_HEADER);
        else if (8 + hlen > size)
            st = LUNAR_FAIL(ctx, LUNAR_ERR_FORMAT,
                            "%s: header length %llu goes past the end of the file (%llu bytes; truncated file?)", path,
                            (unsigned long long)hlen, (unsigned long long)size);
        else {
            f->data_start = 8 + hlen;
            f->data_len = size - f->data_start;
            st = parse_header(ctx, f);
        }
    }
    if (st != LUNAR_OK) {
        lunar_safetensors_close(ctx, f);
        return st;
    }
    *out = f;
    return LUNAR_OK;
}

const char *lunar_safetensors_path(const lunar_safetensors *f) { return f->path; }
int lunar_safetensors_count(const lunar_safetensors *f) { return f->n; }

const lunar_safetensors_info *lunar_safetensors_entry(const lunar_safetensors *f, int i) {
    return i >= 0 && i < f->n ? &f->entries[i] : NULL;
}

const lunar_safetensors_info *lunar_safetensors_find(const lunar_safetensors *f, const char *name) {
    int lo = 0, hi = f->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(name, f->entries[mid].name);
        if (c == 0) return &f->entries[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

int lunar_safetensors_metadata_count(const lunar_safetensors *f) { return f->n_meta; }

void lunar_safetensors_metadata_at(const lunar_safetensors *f, int i, const char **key, const char **value) {
    *key = i >= 0 && i < f->n_meta ? f->meta_keys[i] : NULL;
    *value = i >= 0 && i < f->n_meta ? f->meta_values[i] : NULL;
}

const char *lunar_safetensors_metadata_get(const lunar_safetensors *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_values[i];
    return NULL;
}

lunar_status lunar_safetensors_tensor(lunar_ctx *ctx, lunar_tensor *out, const lunar_safetensors *f, const char *name) {
    memset(out, 0, sizeof *out);
    const lunar_safetensors_info *e = lunar_safetensors_find(f, name);
    if (!e) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: no tensor '%s' in this file", f->path, name);
    if (e->ndim > LUNAR_MAX_DIMS)
        return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "%s: tensor '%s' has %d dims; lunar tensors have at most %d", f->path,
                          name, e->ndim, LUNAR_MAX_DIMS);
    if (!e->supported)
        return LUNAR_FAIL(ctx, LUNAR_ERR_UNSUPPORTED, "%s: tensor '%s' has unsupported dtype %s (lunar has no tensor type for it)",
                          f->path, name, e->file_dtype);
    lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
    unsigned char *p = (unsigned char *)f->map->base + f->data_start + e->begin;
    size_t nbytes = (size_t)(e->end - e->begin);
    size_t esize = lunar_dtype_size(e->dtype);
    lunar_status st;
    if ((uintptr_t)p % esize != 0) {
        /* misaligned for its element type (a header length that is not a multiple of 8, from
         * another writer): kernels read typed pointers, so this one gets an aligned copy */
        st = lunar_tensor_new(ctx, out, e->dtype, cpu, e->ndim, e->shape);
        if (st == LUNAR_OK) memcpy(lunar_tensor_data(out), p, nbytes);
    } else {
        st = lunar_mapped_view(ctx, out, f->map, p, nbytes, e->dtype, e->ndim, e->shape);
    }
    if (st != LUNAR_OK) {
        lunar_ctx_prefix_error(ctx, "%s: tensor '%s'", f->path, name);
        lunar_tensor_release(ctx, out);
        return st;
    }
    lunar_tensor_set_name(out, name);
    return LUNAR_OK;
}

/* ---- writer ------------------------------------------------------------------------------------ */

typedef struct wr_item {
    const char         *name;
    const lunar_tensor *t;
    int                 st_dtype;   /* index into st_dtypes */
    uint64_t            nbytes;
} wr_item;

static int cmp_wr_layout(const void *a, const void *b) {
    const wr_item *x = a, *y = b;
    if (x->st_dtype != y->st_dtype) return x->st_dtype > y->st_dtype ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_wr_name(const void *a, const void *b) {
    return strcmp(((const wr_item *)a)->name, ((const wr_item *)b)->name);
}

/* the row-major bytes of t, written to f (a host copy first for device or strided tensors) */
static lunar_status write_tensor_bytes(lunar_ctx *ctx, lunar_afile *f, const lunar_tensor *t, uint64_t nbytes) {
    if (nbytes == 0) return LUNAR_OK;
    if (lunar_device_is_host(lunar_tensor_device(t)) && lunar_tensor_is_contiguous(t))
        return lunar_afile_write(ctx, f, lunar_tensor_data(t), (size_t)nbytes);
    lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
    lunar_tensor host = {0};
    lunar_status st = lunar_tensor_new(ctx, &host, t->dtype, cpu, t->ndim, t->shape);
    if (st == LUNAR_OK) st = lunar_copy(ctx, &host, t);
    if (st == LUNAR_OK) st = lunar_afile_write(ctx, f, lunar_tensor_data(&host), (size_t)nbytes);
    lunar_tensor_release(ctx, &host);
    return st;
}

lunar_status lunar_safetensors_save(lunar_ctx *ctx, const char *path, int n, const char *const *names,
                                    const lunar_tensor *const *tensors, const lunar_safetensors_write_opts *opts) {
    lunar_safetensors_write_opts none = {0};
    if (!opts) opts = &none;
    if (n < 0) return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: negative tensor count", path);
    wr_item *items = calloc((size_t)(n ? n : 1), sizeof *items);
    if (!items) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    lunar_status st = LUNAR_OK;
    for (int i = 0; i < n && st == LUNAR_OK; i++) {
        items[i].name = names[i];
        items[i].t = tensors[i];
        if (!names[i]) {
            st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: tensor %d has no name", path, i);
        } else if (strcmp(names[i], "__metadata__") == 0) {
            st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: '__metadata__' cannot be a tensor name", path);
        } else if (!tensors[i] || lunar_tensor_check(ctx, tensors[i]) != LUNAR_OK) {
            if (!tensors[i]) st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: tensor '%s' is missing", path, names[i]);
            else {
                lunar_ctx_prefix_error(ctx, "%s: tensor '%s'", path, names[i]);
                st = lunar_ctx_status(ctx);
            }
        } else {
            items[i].st_dtype = st_dtype_of_lunar(tensors[i]->dtype);
            items[i].nbytes = (uint64_t)lunar_tensor_nbytes(tensors[i]);
            if (items[i].st_dtype < 0)
                st = LUNAR_FAIL(ctx, LUNAR_ERR_DTYPE, "%s: tensor '%s' has dtype %s, which safetensors cannot hold", path,
                                names[i], lunar_dtype_name(tensors[i]->dtype));
        }
    }
    if (st == LUNAR_OK) {
        qsort(items, (size_t)n, sizeof *items, cmp_wr_name);
        for (int i = 1; i < n && st == LUNAR_OK; i++)
            if (strcmp(items[i].name, items[i - 1].name) == 0)
                st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: tensor name '%s' is given twice", path, items[i].name);
    }
    /* metadata, sorted by key */
    int nm = opts->n_metadata > 0 ? opts->n_metadata : 0;
    int *morder = calloc((size_t)(nm ? nm : 1), sizeof *morder);
    if (!morder && st == LUNAR_OK) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; i < nm && st == LUNAR_OK; i++) {
        if (!opts->metadata_keys[i] || !opts->metadata_values[i]) {
            st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: metadata entry %d has no key or value", path, i);
            break;
        }
        int j = i;   /* insertion sort: metadata is a handful of entries */
        while (j > 0 && strcmp(opts->metadata_keys[morder[j - 1]], opts->metadata_keys[i]) > 0) {
            morder[j] = morder[j - 1];
            j--;
        }
        morder[j] = i;
    }
    for (int i = 1; i < nm && st == LUNAR_OK; i++)
        if (strcmp(opts->metadata_keys[morder[i]], opts->metadata_keys[morder[i - 1]]) == 0)
            st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: metadata key '%s' is given twice", path,
                            opts->metadata_keys[morder[i]]);
    if (st != LUNAR_OK) {
        free(items);
        free(morder);
        return st;
    }

    /* the header, in data order */
    qsort(items, (size_t)n, sizeof *items, cmp_wr_layout);
    lunar_buf h = {0};
    lunar_buf_puts(&h, "{");
    if (nm > 0) {
        lunar_buf_puts(&h, "\"__metadata__\":{");
        for (int i = 0; i < nm; i++) {
            const char *k = opts->metadata_keys[morder[i]], *v = opts->metadata_values[morder[i]];
            if (i) lunar_buf_puts(&h, ",");
            lunar_json_put_string(&h, k, strlen(k));
            lunar_buf_puts(&h, ":");
            lunar_json_put_string(&h, v, strlen(v));
        }
        lunar_buf_puts(&h, "}");
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const wr_item *it = &items[i];
        if (i || nm > 0) lunar_buf_puts(&h, ",");
        lunar_json_put_string(&h, it->name, strlen(it->name));
        lunar_buf_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", st_dtypes[it->st_dtype].name);
        for (int d = 0; d < it->t->ndim; d++) lunar_buf_printf(&h, d ? ",%lld" : "%lld", (long long)it->t->shape[d]);
        lunar_buf_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                         (unsigned long long)(off + it->nbytes));
        off += it->nbytes;
    }
    lunar_buf_puts(&h, "}");
    while (h.len % 8 != 0) lunar_buf_puts(&h, " ");
    free(morder);
    if (h.oom) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory building the header", path);
    else if (h.len > LUNAR_SAFETENSORS_MAX_HEADER)
        st = LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: the header would be %zu bytes, over the format's limit of %llu", path,
                        h.len, (unsigned long long)LUNAR_SAFETENSORS_MAX_HEADER);
    lunar_afile af;
    if (st == LUNAR_OK) st = lunar_afile_open(ctx, &af, path);
    if (st == LUNAR_OK) {
        af.fail_after = opts->fail_after_bytes;
        af.fail_kill = opts->fail_kill;
        unsigned char len8[8];
        uint64_t hl = (uint64_t)h.len;
        for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(hl >> (8 * i));
        st = lunar_afile_write(ctx, &af, len8, 8);
        if (st == LUNAR_OK) st = lunar_afile_write(ctx, &af, h.data, h.len);
        for (int i = 0; i < n && st == LUNAR_OK; i++) {
            st = write_tensor_bytes(ctx, &af, items[i].t, items[i].nbytes);
            if (st != LUNAR_OK) lunar_ctx_prefix_error(ctx, "writing tensor '%s'", items[i].name);
        }
        if (st == LUNAR_OK) st = lunar_afile_commit(ctx, &af);
        else lunar_afile_abort(&af);
    }
    lunar_buf_free(&h);
    free(items);
    return st;
}
