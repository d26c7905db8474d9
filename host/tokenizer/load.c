/* load.c: reading a Hugging Face tokenizer.json into lunar's tokenizer tables.
 *
 * Everything the encoder needs is built here once: the model vocab as a hash map, the merges as
 * a map (id a, id b) -> (rank, merged id), the one-byte tokens, the bytes each id decodes to
 * (HF's ByteLevel decoder rule), the added tokens grouped by first byte for leftmost-longest
 * matching, and the pre-tokenizer steps with their regexes translated to PCRE2 (regex.c) and
 * compiled (JIT when the platform has it). Anything the encoder does not implement is refused with an error that
 * names the file, the key and the value, so that nothing is silently mis-tokenized.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/io.h"
#include "tok.h"

#define TOK_MAX_ID (1 << 24)   /* ids above this are refused (the tables are indexed by id) */

/* GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes
 * take the code points 256, 257, ... in byte order. */
void tok_byte_chars(uint32_t byte_cp[256], int16_t cp_byte[324]) {
    for (int i = 0; i < 324; i++) cp_byte[i] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint32_t cp = printable ? (uint32_t)b : (uint32_t)(256 + extra++);
        byte_cp[b] = cp;
        cp_byte[cp] = (int16_t)b;
    }
}

static int put_utf8(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    out[0] = (char)(0xE0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
}

/* ---- string maps -------------------------------------------------------------------------------- */

static int strmap_init(tok_strmap *m, size_t expected) {
    size_t cap = 16;
    while (cap < expected * 2 + 1) cap *= 2;
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots) return -1;
    for (size_t i = 0; i < cap; i++) m->slots[i].val = -1;
    m->cap = cap;
    m->count = 0;
    return 0;
}

static void strmap_free(tok_strmap *m) {
    free(m->slots);
    m->slots = NULL;
    m->cap = m->count = 0;
}

int32_t tok_strmap_get(const tok_strmap *m, const char *pool, const void *key, size_t n) {
    if (!m->slots) return -1;
    uint64_t h = tok_hash(key, n);
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        const tok_strmap_slot *s = &m->slots[i];
        if (s->val < 0) return -1;
        if (s->hash == h && s->len == n && memcmp(pool + s->off, key, n) == 0) return s->val;
    }
}

/* 1: inserted; 0: the key was there (*old = its value, unchanged). The map never grows: it
 * was sized for its final count. */
static int strmap_put(tok_strmap *m, const char *pool, uint32_t off, uint32_t len, int32_t val, int32_t *old) {
    uint64_t h = tok_hash(pool + off, len);
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        tok_strmap_slot *s = &m->slots[i];
        if (s->val < 0) {
            s->hash = h;
            s->off = off;
            s->len = len;
            s->val = val;
            m->count++;
            return 1;
        }
        if (s->hash == h && s->len == len && memcmp(pool + s->off, pool + off, len) == 0) {
            if (old) *old = s->val;
            return 0;
        }
    }
}

/* ---- merge map ------------------------------------------------------------------------------------ */

static int mergemap_init(tok_mergemap *m, size_t expected) {
    size_t cap = 16;
    int bits = 4;
    while (cap < expected * 2 + 1) {
        cap *= 2;
        bits++;
    }
    m->keys = malloc(cap * sizeof *m->keys);
    m->rank = malloc(cap * sizeof *m->rank);
    m->merged = malloc(cap * sizeof *m->merged);
    if (!m->keys || !m->rank || !m->merged) return -1;
    for (size_t i = 0; i < cap; i++) m->keys[i] = UINT64_MAX;
    m->cap = cap;
    m->count = 0;
    m->shift = 64 - bits;
    return 0;
}

static void mergemap_free(tok_mergemap *m) {
    free(m->keys);
    free(m->rank);
    free(m->merged);
    memset(m, 0, sizeof *m);
}

/* a later duplicate of a pair replaces the earlier one (HF builds a hash map in file order) */
static void mergemap_put(tok_mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t merged) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t mask = m->cap - 1, i = (size_t)((key * 0x9e3779b97f4a7c15ull) >> m->shift);
    while (m->keys[i] != UINT64_MAX && m->keys[i] != key) i = (i + 1) & mask;
    if (m->keys[i] == UINT64_MAX) m->count++;
    m->keys[i] = key;
    m->rank[i] = rank;
    m->merged[i] = merged;
}

/* ---- building -------------------------------------------------------------------------------------- */

typedef struct loader {
    lunar_ctx       *ctx;
    lunar_tokenizer *tok;
    const char      *what;   /* the file name in messages */
} loader;

__attribute__((format(printf, 3, 4))) static lunar_status lfail(loader *ld, lunar_status st, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return LUNAR_FAIL(ld->ctx, st, "%s: %s", ld->what, msg);
}

static lunar_status oom(loader *ld) { return lfail(ld, LUNAR_ERR_OOM, "out of memory reading the tokenizer"); }

/* append n bytes to the string pool; *off gets their offset */
static lunar_status pool_add(loader *ld, const void *data, size_t n, uint32_t *off) {
    lunar_tokenizer *tok = ld->tok;
    if (tok->pool_len + n + 1 > tok->pool_cap) {
        size_t cap = tok->pool_cap ? tok->pool_cap : 1 << 16;
        while (cap < tok->pool_len + n + 1) cap *= 2;
        if (cap > UINT32_MAX) return lfail(ld, LUNAR_ERR_FORMAT, "the token strings take more than 4 GiB");
        char *p = realloc(tok->pool, cap);
        if (!p) return oom(ld);
        tok->pool = p;
        tok->pool_cap = cap;
    }
    memcpy(tok->pool + tok->pool_len, data, n);
    *off = (uint32_t)tok->pool_len;
    tok->pool_len += n;
    tok->pool[tok->pool_len] = 0;   /* keeps the pool a C string for printing; not counted */
    return LUNAR_OK;
}

static const char *type_of(const cJSON *j) {
    if (cJSON_IsNull(j)) return "null";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsNumber(j)) return "a number";
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsArray(j)) return "an array";
    return "an object";
}

/* a boolean member: def when absent or null */
static lunar_status get_bool(loader *ld, const cJSON *obj, const char *key, const char *where, int def, int *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!j || cJSON_IsNull(j)) {
        *out = def;
        return LUNAR_OK;
    }
    if (!cJSON_IsBool(j)) return lfail(ld, LUNAR_ERR_FORMAT, "%s.%s: expected true or false, got %s", where, key, type_of(j));
    *out = cJSON_IsTrue(j);
    return LUNAR_OK;
}

static lunar_status get_id(loader *ld, const cJSON *j, const char *where, int32_t *out) {
    if (!cJSON_IsNumber(j))
        return lfail(ld, LUNAR_ERR_FORMAT, "%s: expected an integer id, got %s", where, type_of(j));
    double v = j->valuedouble;
    if (v != (double)(int64_t)v || v < 0)
        return lfail(ld, LUNAR_ERR_FORMAT, "%s: id %g is not a non-negative integer", where, v);
    if (v >= TOK_MAX_ID) return lfail(ld, LUNAR_ERR_FORMAT, "%s: id %.0f is too large (lunar takes ids below %d)", where, v, TOK_MAX_ID);
    *out = (int32_t)v;
    return LUNAR_OK;
}

/* the type string of an object ("BPE"), or NULL */
static const char *type_name(const cJSON *obj) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(obj, "type");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

/* a null-or-empty-string member ("continuing_subword_prefix": null) */
static lunar_status want_null(loader *ld, const cJSON *obj, const char *key, const char *where, const char *why) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!j || cJSON_IsNull(j) || (cJSON_IsString(j) && j->valuestring[0] == 0) || (cJSON_IsBool(j) && !cJSON_IsTrue(j)))
        return LUNAR_OK;
    if (cJSON_IsString(j))
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "%s.%s: '%s' is not supported (%s)", where, key, j->valuestring, why);
    return lfail(ld, LUNAR_ERR_UNSUPPORTED, "%s.%s: %s is not supported (%s)", where, key,
                 cJSON_IsTrue(j) ? "true" : type_of(j), why);
}

/* ---- model ---------------------------------------------------------------------------------------- */

static lunar_status read_model(loader *ld, const cJSON *root, int32_t *max_id) {
    lunar_tokenizer *tok = ld->tok;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!m) return lfail(ld, LUNAR_ERR_FORMAT, "model: missing");
    if (!cJSON_IsObject(m)) return lfail(ld, LUNAR_ERR_FORMAT, "model: expected an object, got %s", type_of(m));
    const char *type = type_name(m);
    if (type && strcmp(type, "BPE") != 0)
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "model.type: '%s' is not supported (lunar reads BPE models)", type);
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(m, "dropout");
    if (dropout && !cJSON_IsNull(dropout))
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "model.dropout: BPE dropout is not supported (expected null)");
    LUNAR_TRY(want_null(ld, m, "continuing_subword_prefix", "model", "byte-level BPE has none"));
    LUNAR_TRY(want_null(ld, m, "end_of_word_suffix", "model", "byte-level BPE has none"));
    LUNAR_TRY(want_null(ld, m, "byte_fallback", "model", "byte-level BPE covers every byte without it"));
    LUNAR_TRY(get_bool(ld, m, "fuse_unk", "model", 0, &tok->fuse_unk));
    LUNAR_TRY(get_bool(ld, m, "ignore_merges", "model", 0, &tok->ignore_merges));

    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
    if (!vocab) return lfail(ld, LUNAR_ERR_FORMAT, "model.vocab: missing");
    if (!cJSON_IsObject(vocab)) return lfail(ld, LUNAR_ERR_FORMAT, "model.vocab: expected an object, got %s", type_of(vocab));
    size_t nv = (size_t)cJSON_GetArraySize(vocab);
    if (strmap_init(&tok->vocab, nv) != 0) return oom(ld);
    char where[160];
    for (const cJSON *e = vocab->child; e; e = e->next) {
        snprintf(where, sizeof where, "model.vocab['%.60s']", e->string);
        int32_t id;
        LUNAR_TRY(get_id(ld, e, where, &id));
        uint32_t off;
        size_t len = strlen(e->string);
        if (len == 0) return lfail(ld, LUNAR_ERR_FORMAT, "model.vocab: an empty token string (id %d)", id);
        LUNAR_TRY(pool_add(ld, e->string, len, &off));
        int32_t old;
        if (!strmap_put(&tok->vocab, tok->pool, off, (uint32_t)len, id, &old))
            return lfail(ld, LUNAR_ERR_FORMAT, "%s: the token appears twice (ids %d and %d)", where, old, id);
        if (id > *max_id) *max_id = id;
    }

    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(m, "unk_token");
    tok->unk_id = -1;
    if (unk && !cJSON_IsNull(unk)) {
        if (!cJSON_IsString(unk)) return lfail(ld, LUNAR_ERR_FORMAT, "model.unk_token: expected a string or null");
        tok->unk_id = tok_strmap_get(&tok->vocab, tok->pool, unk->valuestring, strlen(unk->valuestring));
        if (tok->unk_id < 0)
            return lfail(ld, LUNAR_ERR_FORMAT, "model.unk_token: '%s' is not in model.vocab", unk->valuestring);
    }

    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(m, "merges");
    if (!merges) return lfail(ld, LUNAR_ERR_FORMAT, "model.merges: missing");
    if (!cJSON_IsArray(merges)) return lfail(ld, LUNAR_ERR_FORMAT, "model.merges: expected an array, got %s", type_of(merges));
    size_t nm = (size_t)cJSON_GetArraySize(merges);
    if (mergemap_init(&tok->merges, nm) != 0) return oom(ld);
    char *buf = NULL;
    size_t buf_cap = 0;
    lunar_status st = LUNAR_OK;
    int32_t rank = 0;
    for (const cJSON *e = merges->child; e; e = e->next, rank++) {
        const char *a, *b;
        size_t la, lb;
        if (cJSON_IsString(e)) {   /* "a b": exactly one space (HF's rule) */
            const char *s = e->valuestring, *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                st = lfail(ld, LUNAR_ERR_FORMAT, "model.merges[%d]: '%.60s' is not two tokens separated by one space",
                           rank, s);
                break;
            }
            a = s, la = (size_t)(sp - s), b = sp + 1, lb = strlen(sp + 1);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
                   cJSON_IsString(e->child->next)) {
            a = e->child->valuestring, la = strlen(a), b = e->child->next->valuestring, lb = strlen(b);
        } else {
            st = lfail(ld, LUNAR_ERR_FORMAT, "model.merges[%d]: expected \"a b\" or [\"a\", \"b\"], got %s", rank,
                       type_of(e));
            break;
        }
        int32_t ia = tok_strmap_get(&tok->vocab, tok->pool, a, la);
        int32_t ib = tok_strmap_get(&tok->vocab, tok->pool, b, lb);
        if (la + lb + 1 > buf_cap) {
            buf_cap = (la + lb + 1) * 2;
            char *nb = realloc(buf, buf_cap);
            if (!nb) {
                st = oom(ld);
                break;
            }
            buf = nb;
        }
        memcpy(buf, a, la);
        memcpy(buf + la, b, lb);
        int32_t im = tok_strmap_get(&tok->vocab, tok->pool, buf, la + lb);
        if (ia < 0 || ib < 0 || im < 0) {
            const char *miss = ia < 0 ? a : ib < 0 ? b : buf;
            int lmiss = (int)(ia < 0 ? la : ib < 0 ? lb : la + lb);
            st = lfail(ld, LUNAR_ERR_FORMAT, "model.merges[%d]: '%.*s' is not in model.vocab", rank,
                       lmiss > 60 ? 60 : lmiss, miss);
            break;
        }
        mergemap_put(&tok->merges, ia, ib, rank, im);
    }
    free(buf);
    return st;
}

/* ---- added tokens --------------------------------------------------------------------------------- */

static int cmp_match(const void *pa, const void *pb, void *arg) {
    const lunar_tokenizer *tok = arg;
    const lunar_tok_added *a = &tok->added[*(const int32_t *)pa], *b = &tok->added[*(const int32_t *)pb];
    uint8_t ca = (uint8_t)a->content[0], cb = (uint8_t)b->content[0];
    if (ca != cb) return ca < cb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static int cmp_added_id(const void *pa, const void *pb) {
    const lunar_tok_added *a = pa, *b = pb;
    return a->id < b->id ? -1 : a->id > b->id;
}

static lunar_status read_added(loader *ld, const cJSON *root, int32_t *max_id) {
    lunar_tokenizer *tok = ld->tok;
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!arr || cJSON_IsNull(arr)) return LUNAR_OK;
    if (!cJSON_IsArray(arr)) return lfail(ld, LUNAR_ERR_FORMAT, "added_tokens: expected an array, got %s", type_of(arr));
    int n = cJSON_GetArraySize(arr);
    size_t text = 0;
    for (const cJSON *e = arr->child; e; e = e->next) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (cJSON_IsString(c)) text += strlen(c->valuestring) + 1;
    }
    tok->added = calloc((size_t)n + 1, sizeof *tok->added);
    tok->added_text = malloc(text + 1);
    if (!tok->added || !tok->added_text || strmap_init(&tok->added_map, (size_t)n) != 0) return oom(ld);
    char where[64];
    size_t tpos = 0;
    int i = 0, k = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        snprintf(where, sizeof where, "added_tokens[%d]", i);
        if (!cJSON_IsObject(e)) return lfail(ld, LUNAR_ERR_FORMAT, "%s: expected an object, got %s", where, type_of(e));
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsString(c))
            return lfail(ld, LUNAR_ERR_FORMAT, "%s.content: expected a string, got %s", where, c ? type_of(c) : "nothing");
        const cJSON *jid = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (!jid) return lfail(ld, LUNAR_ERR_FORMAT, "%s.id: missing", where);
        char idwhere[80];
        snprintf(idwhere, sizeof idwhere, "%s.id", where);
        lunar_tok_added *a = &tok->added[k];
        LUNAR_TRY(get_id(ld, jid, idwhere, &a->id));
        LUNAR_TRY(get_bool(ld, e, "special", where, 0, &a->special));
        LUNAR_TRY(get_bool(ld, e, "lstrip", where, 0, &a->lstrip));
        LUNAR_TRY(get_bool(ld, e, "rstrip", where, 0, &a->rstrip));
        LUNAR_TRY(get_bool(ld, e, "single_word", where, 0, &a->single_word));
        LUNAR_TRY(get_bool(ld, e, "normalized", where, !a->special, &a->normalized));
        size_t len = strlen(c->valuestring);
        if (len == 0) continue;   /* HF ignores empty added tokens */
        memcpy(tok->added_text + tpos, c->valuestring, len + 1);
        a->content = tok->added_text + tpos;
        a->len = len;
        tpos += len + 1;
        int32_t mid = tok_strmap_get(&tok->vocab, tok->pool, a->content, len);
        if (mid >= 0 && mid != a->id)
            return lfail(ld, LUNAR_ERR_FORMAT, "%s: '%.60s' has id %d but model.vocab gives it %d", where, a->content,
                         a->id, mid);
        uint32_t off;
        LUNAR_TRY(pool_add(ld, a->content, len, &off));
        int32_t old;
        if (!strmap_put(&tok->added_map, tok->pool, off, (uint32_t)len, a->id, &old))
            return lfail(ld, LUNAR_ERR_FORMAT, "%s: '%.60s' appears twice (ids %d and %d)", where, a->content, old, a->id);
        if (a->id > *max_id) *max_id = a->id;
        k++;
    }
    tok->n_added = k;
    qsort(tok->added, (size_t)k, sizeof *tok->added, cmp_added_id);
    for (int j = 1; j < k; j++)
        if (tok->added[j].id == tok->added[j - 1].id)
            return lfail(ld, LUNAR_ERR_FORMAT, "added_tokens: id %d is given to both '%.60s' and '%.60s'", tok->added[j].id,
                         tok->added[j - 1].content, tok->added[j].content);
    /* the matchers: non-normalized tokens, then normalized ones (HF's two passes) */
    for (int set = 0; set < 2; set++) {
        tok_matcher *mt = &tok->match[set];
        mt->order = malloc(((size_t)k + 1) * sizeof *mt->order);
        if (!mt->order) return oom(ld);
        mt->n = 0;
        for (int j = 0; j < k; j++)
            if (tok->added[j].normalized == set) mt->order[mt->n++] = j;
        qsort_r(mt->order, (size_t)mt->n, sizeof *mt->order, cmp_match, tok);
        int p = 0;
        for (int b = 0; b <= 256; b++) {
            while (p < mt->n && (uint8_t)tok->added[mt->order[p]].content[0] < b) p++;
            mt->start[b] = p;
        }
    }
    return LUNAR_OK;
}

/* ---- pre-tokenizer, normalizer, decoder --------------------------------------------------------------- */

/* A Split or ByteLevel regex: translated from HF's Oniguruma syntax into a PCRE2 pattern whose
 * classes follow lunar's Unicode 16 tables (regex.c), then compiled (JIT when available). */
static lunar_status compile_re(loader *ld, tok_stage *s, const char *pat, size_t len, int literal, const char *where) {
    int err;
    PCRE2_SIZE erroff;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    char *tr = NULL;
    if (!literal) {
        char msg[400];
        if (!(tr = tok_regex_translate(pat, len, &len, msg, sizeof msg)))
            return lfail(ld, LUNAR_ERR_UNSUPPORTED, "%s: %s", where, msg);
        pat = tr;
    }
    s->re = pcre2_compile((PCRE2_SPTR)pat, len, opts, &err, &erroff, NULL);
    free(tr);
    if (!s->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return lfail(ld, LUNAR_ERR_FORMAT, "%s: PCRE2 cannot compile the pattern (%s)", where, (const char *)msg);
    }
    s->jit = pcre2_jit_compile(s->re, PCRE2_JIT_COMPLETE) == 0;
    return LUNAR_OK;
}

/* the regex of HF's ByteLevel pre-tokenizer (GPT-2's) */
static const char BYTELEVEL_RE[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static lunar_status read_bytelevel(loader *ld, const cJSON *pt, const char *where) {
    lunar_tokenizer *tok = ld->tok;
    tok_stage *s = &tok->stages[tok->n_stages++];
    s->kind = TOK_STAGE_BYTELEVEL;
    int use_regex = 1;
    LUNAR_TRY(get_bool(ld, pt, "add_prefix_space", where, 1, &s->prefix_space));
    LUNAR_TRY(get_bool(ld, pt, "use_regex", where, 1, &use_regex));
    if (use_regex) LUNAR_TRY(compile_re(ld, s, BYTELEVEL_RE, sizeof BYTELEVEL_RE - 1, 0, where));
    return LUNAR_OK;
}

static lunar_status read_split(loader *ld, const cJSON *pt, const char *where) {
    lunar_tokenizer *tok = ld->tok;
    const cJSON *beh = cJSON_GetObjectItemCaseSensitive(pt, "behavior");
    if (!cJSON_IsString(beh)) return lfail(ld, LUNAR_ERR_FORMAT, "%s.behavior: expected a string", where);
    if (strcmp(beh->valuestring, "Isolated") != 0)
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "%s.behavior: '%s' is not supported (lunar splits Isolated)", where,
                     beh->valuestring);
    int invert = 0;
    LUNAR_TRY(get_bool(ld, pt, "invert", where, 0, &invert));
    if (invert) return lfail(ld, LUNAR_ERR_UNSUPPORTED, "%s.invert: true is not supported", where);
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(pt, "pattern");
    const cJSON *re = pat ? cJSON_GetObjectItemCaseSensitive(pat, "Regex") : NULL;
    const cJSON *str = pat ? cJSON_GetObjectItemCaseSensitive(pat, "String") : NULL;
    const cJSON *p = re ? re : str;
    if (!cJSON_IsString(p))
        return lfail(ld, LUNAR_ERR_FORMAT, "%s.pattern: expected {\"Regex\": ...} or {\"String\": ...}", where);
    if (strlen(p->valuestring) == 0) return lfail(ld, LUNAR_ERR_FORMAT, "%s.pattern: empty", where);
    tok_stage *s = &tok->stages[tok->n_stages++];
    s->kind = TOK_STAGE_SPLIT;
    char w[160];
    snprintf(w, sizeof w, "%s.pattern.%s", where, re ? "Regex" : "String");
    return compile_re(ld, s, p->valuestring, strlen(p->valuestring), !re, w);
}

static lunar_status read_pre_tokenizer(loader *ld, const cJSON *root) {
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    if (!pt || cJSON_IsNull(pt))
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "pre_tokenizer: null is not supported (byte-level BPE needs ByteLevel)");
    const char *type = type_name(pt);
    if (!type) return lfail(ld, LUNAR_ERR_FORMAT, "pre_tokenizer.type: missing");
    if (strcmp(type, "ByteLevel") == 0) return read_bytelevel(ld, pt, "pre_tokenizer");
    if (strcmp(type, "Sequence") != 0)
        return lfail(ld, LUNAR_ERR_UNSUPPORTED,
                     "pre_tokenizer.type: '%s' is not supported (lunar reads ByteLevel, or a Sequence of Split steps "
                     "ending with ByteLevel)", type);
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers");
    if (!cJSON_IsArray(arr)) return lfail(ld, LUNAR_ERR_FORMAT, "pre_tokenizer.pretokenizers: expected an array");
    int n = cJSON_GetArraySize(arr), i = 0;
    if (n > TOK_MAX_STAGES) return lfail(ld, LUNAR_ERR_UNSUPPORTED, "pre_tokenizer.pretokenizers: more than %d steps", TOK_MAX_STAGES);
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        char where[64];
        snprintf(where, sizeof where, "pre_tokenizer.pretokenizers[%d]", i);
        const char *t = type_name(e);
        if (!t) return lfail(ld, LUNAR_ERR_FORMAT, "%s.type: missing", where);
        if (strcmp(t, "Split") == 0) {
            LUNAR_TRY(read_split(ld, e, where));
        } else if (strcmp(t, "ByteLevel") == 0) {
            if (i != n - 1)
                return lfail(ld, LUNAR_ERR_UNSUPPORTED, "%s: ByteLevel must be the last step of the sequence", where);
            LUNAR_TRY(read_bytelevel(ld, e, where));
        } else {
            return lfail(ld, LUNAR_ERR_UNSUPPORTED, "%s.type: '%s' is not supported (lunar reads Split and ByteLevel)",
                         where, t);
        }
    }
    if (ld->tok->n_stages == 0 || ld->tok->stages[ld->tok->n_stages - 1].kind != TOK_STAGE_BYTELEVEL)
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "pre_tokenizer.pretokenizers: the sequence must end with ByteLevel");
    return LUNAR_OK;
}

static lunar_status read_others(loader *ld, const cJSON *root) {
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    if (norm && !cJSON_IsNull(norm)) {
        const char *t = type_name(norm);
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "normalizer: type '%s' is not supported (lunar reads normalizer null)",
                     t ? t : "?");
    }
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(root, "decoder");
    const char *t = dec && !cJSON_IsNull(dec) ? type_name(dec) : "null";
    if (!t || strcmp(t, "ByteLevel") != 0)
        return lfail(ld, LUNAR_ERR_UNSUPPORTED, "decoder: type '%s' is not supported (lunar decodes ByteLevel)",
                     t ? t : "?");
    return LUNAR_OK;
}

/* ---- derived tables ----------------------------------------------------------------------------------- */

static lunar_status build_tables(loader *ld, int32_t max_id) {
    lunar_tokenizer *tok = ld->tok;
    uint32_t byte_cp[256];
    int16_t cp_byte[324];
    tok_byte_chars(byte_cp, cp_byte);
    tok->n_ids = max_id + 1;
    tok->tokens = malloc((size_t)tok->n_ids * sizeof *tok->tokens);
    tok->special = calloc((size_t)tok->n_ids, 1);
    if (!tok->tokens || !tok->special) return oom(ld);
    for (int32_t i = 0; i < tok->n_ids; i++) tok->tokens[i].str_len = UINT32_MAX;
    /* token strings: the model vocab, then the added tokens over it (HF looks added tokens up first) */
    for (size_t i = 0; i < tok->vocab.cap; i++) {
        const tok_strmap_slot *s = &tok->vocab.slots[i];
        if (s->val < 0) continue;
        if (tok->tokens[s->val].str_len != UINT32_MAX)
            return lfail(ld, LUNAR_ERR_FORMAT, "model.vocab: id %d is given to both '%.*s' and '%.*s'", s->val,
                         (int)(tok->tokens[s->val].str_len > 60 ? 60 : tok->tokens[s->val].str_len),
                         tok->pool + tok->tokens[s->val].str_off, (int)(s->len > 60 ? 60 : s->len), tok->pool + s->off);
        tok->tokens[s->val].str_off = s->off;
        tok->tokens[s->val].str_len = s->len;
    }
    for (int i = 0; i < tok->n_added; i++) {
        const lunar_tok_added *a = &tok->added[i];
        int32_t v = tok_strmap_get(&tok->added_map, tok->pool, a->content, a->len);
        uint32_t off = 0;
        for (size_t j = 0; j < tok->added_map.cap; j++)   /* the pool copy of the content */
            if (tok->added_map.slots[j].val == v) off = tok->added_map.slots[j].off;
        if (tok->tokens[a->id].str_len != UINT32_MAX &&
            (tok->tokens[a->id].str_len != a->len || memcmp(tok->pool + tok->tokens[a->id].str_off, a->content, a->len)))
            return lfail(ld, LUNAR_ERR_FORMAT, "added_tokens: id %d of '%.60s' is the model token '%.*s'", a->id,
                         a->content, (int)(tok->tokens[a->id].str_len > 60 ? 60 : tok->tokens[a->id].str_len),
                         tok->pool + tok->tokens[a->id].str_off);
        tok->tokens[a->id].str_off = off;
        tok->tokens[a->id].str_len = (uint32_t)a->len;
        if (a->special) tok->special[a->id] = 1;
    }
    /* decoded bytes: HF's ByteLevel decoder maps every character of a token through the byte
     * alphabet, or, when one character is outside it, writes the token's own UTF-8 bytes */
    uint8_t *mapped = calloc((size_t)tok->n_ids, 1);
    size_t tmp_cap = 64, nraw = 0;
    char *tmp = malloc(tmp_cap);
    lunar_status st = LUNAR_OK;
    if (!mapped || !tmp) st = oom(ld);
    for (int32_t id = 0; id < tok->n_ids && st == LUNAR_OK; id++) {
        tok_entry *e = &tok->tokens[id];
        if (e->str_len == UINT32_MAX) continue;
        if (e->str_len > tmp_cap) {
            tmp_cap = (size_t)e->str_len * 2;
            char *t2 = realloc(tmp, tmp_cap);
            if (!t2) {
                st = oom(ld);
                break;
            }
            tmp = t2;
        }
        size_t n = 0;
        mapped[id] = 1;
        for (uint32_t i = 0; i < e->str_len;) {
            uint32_t cp;
            int l = tok_utf8_len((const uint8_t *)tok->pool + e->str_off + i, e->str_len - i, &cp);
            if (l == 0 || cp >= 324 || cp_byte[cp] < 0) {
                mapped[id] = 0;
                break;
            }
            tmp[n++] = (char)cp_byte[cp];
            i += (uint32_t)l;
        }
        if (mapped[id]) {
            st = pool_add(ld, tmp, n, &e->dec_off);
            e->dec_len = (uint32_t)n;
            nraw++;
        } else {
            e->dec_off = e->str_off;
            e->dec_len = e->str_len;
        }
    }
    free(tmp);
    /* the one-byte tokens, and raw bytes -> id of the model tokens for ignore_merges */
    for (int b = 0; b < 256; b++) {
        char s[4];
        int l = put_utf8(byte_cp[b], s);
        tok->byte_id[b] = tok_strmap_get(&tok->vocab, tok->pool, s, (size_t)l);
    }
    if (st == LUNAR_OK && tok->ignore_merges) {
        if (strmap_init(&tok->raw_vocab, nraw) != 0) st = oom(ld);
        for (size_t i = 0; i < tok->vocab.cap && st == LUNAR_OK; i++) {
            const tok_strmap_slot *s = &tok->vocab.slots[i];
            if (s->val >= 0 && mapped[s->val])
                strmap_put(&tok->raw_vocab, tok->pool, tok->tokens[s->val].dec_off, tok->tokens[s->val].dec_len, s->val,
                           NULL);
        }
    }
    free(mapped);
    if (st != LUNAR_OK) return st;
    return LUNAR_OK;
}

/* ---- entry points ---------------------------------------------------------------------------------------- */

lunar_status lunar_tokenizer_load_json(lunar_ctx *ctx, lunar_tokenizer **out, const char *what, const char *json,
                                       size_t n) {
    *out = NULL;
    lunar_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok || !(tok->path = strdup(what))) {
        free(tok);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", what);
    }
    tok->unk_id = -1;
    tok->linear_max = 48;
    loader ld = {ctx, tok, what};
    cJSON *root = NULL;
    lunar_status st = lunar_json_parse(ctx, what, json, n, &root);
    if (st == LUNAR_OK && !cJSON_IsObject(root)) st = lfail(&ld, LUNAR_ERR_FORMAT, "expected a JSON object at the top");
    int32_t max_id = -1;
    if (st == LUNAR_OK) st = read_model(&ld, root, &max_id);
    if (st == LUNAR_OK) st = read_added(&ld, root, &max_id);
    if (st == LUNAR_OK) st = read_others(&ld, root);
    if (st == LUNAR_OK) st = read_pre_tokenizer(&ld, root);
    if (st == LUNAR_OK && max_id < 0) st = lfail(&ld, LUNAR_ERR_FORMAT, "model.vocab: empty");
    if (st == LUNAR_OK) st = build_tables(&ld, max_id);
    cJSON_Delete(root);
    if (st != LUNAR_OK) {
        lunar_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return LUNAR_OK;
}

lunar_status lunar_tokenizer_load(lunar_ctx *ctx, lunar_tokenizer **out, const char *path) {
    *out = NULL;
    struct stat sb;
    char *file = NULL;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        size_t n = strlen(path) + 32;
        if (!(file = malloc(n))) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
        snprintf(file, n, "%s/tokenizer.json", path);
        if (stat(file, &sb) != 0) {
            lunar_status st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: the directory has no tokenizer.json", path);
            free(file);
            return st;
        }
    }
    const char *p = file ? file : path;
    char *buf;
    size_t n;
    lunar_status st = lunar_read_file(ctx, p, &buf, &n);
    if (st == LUNAR_OK) {
        st = lunar_tokenizer_load_json(ctx, out, p, buf, n);
        free(buf);
    }
    free(file);
    return st;
}

void lunar_tokenizer_free(lunar_tokenizer *tok) {
    if (!tok) return;
    tok_ws_free_all(tok);
    for (int i = 0; i < tok->n_stages; i++) pcre2_code_free(tok->stages[i].re);
    strmap_free(&tok->vocab);
    strmap_free(&tok->raw_vocab);
    strmap_free(&tok->added_map);
    mergemap_free(&tok->merges);
    free(tok->match[0].order);
    free(tok->match[1].order);
    free(tok->added);
    free(tok->added_text);
    free(tok->tokens);
    free(tok->special);
    free(tok->pool);
    free(tok->path);
    free(tok);
}

/* ---- queries ------------------------------------------------------------------------------------------------ */

const char *lunar_tokenizer_path(const lunar_tokenizer *tok) { return tok->path; }
int32_t     lunar_tokenizer_vocab_size(const lunar_tokenizer *tok) { return tok->n_ids; }
int         lunar_tokenizer_added_count(const lunar_tokenizer *tok) { return tok->n_added; }

const lunar_tok_added *lunar_tokenizer_added(const lunar_tokenizer *tok, int i) {
    return i >= 0 && i < tok->n_added ? &tok->added[i] : NULL;
}

int32_t lunar_tokenizer_token_to_id(const lunar_tokenizer *tok, const char *s, size_t n) {
    int32_t id = tok_strmap_get(&tok->added_map, tok->pool, s, n);
    return id >= 0 ? id : tok_strmap_get(&tok->vocab, tok->pool, s, n);
}

const char *lunar_tokenizer_id_to_token(const lunar_tokenizer *tok, int32_t id, size_t *n) {
    if (id < 0 || id >= tok->n_ids || tok->tokens[id].str_len == UINT32_MAX) return NULL;
    if (n) *n = tok->tokens[id].str_len;
    return tok->pool + tok->tokens[id].str_off;
}

int lunar_tokenizer_is_special(const lunar_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_ids && tok->special[id];
}

void lunar_tokenizer_set_linear_max(lunar_tokenizer *tok, int n) { tok->linear_max = n < 0 ? 0 : n; }
