/* tok.h: the tokenizer's internal structures, shared by load.c (tokenizer.json -> tables) and
 * encode.c (encode, decode, the word caches). Not part of the public API (lunar/tokenizer.h).
 */
#ifndef LUNAR_TOK_H
#define LUNAR_TOK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "lunar/tokenizer.h"

#define TOK_MAX_STAGES 8

/* ---- hashing --------------------------------------------------------------------------------- */

static inline uint64_t tok_mix(uint64_t h) {
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    return h;
}

static inline uint64_t tok_hash(const void *data, size_t n) {
    const uint8_t *p = data;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ ((uint64_t)n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = tok_mix(h ^ v) * 0x94d049bb133111ebull;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, p, n);
    return tok_mix(h ^ v ^ ((uint64_t)n << 56));
}

/* A map from byte strings to int32 values: open addressing, linear probing, keys stored as
 * (offset, length) into a pool the caller passes to every call (the pool may move while a
 * tokenizer is built, so no pointers are kept). */
typedef struct tok_strmap_slot {
    uint64_t hash;
    uint32_t off, len;
    int32_t  val;      /* -1: empty */
} tok_strmap_slot;

typedef struct tok_strmap {
    tok_strmap_slot *slots;
    size_t           cap, count;   /* cap: a power of two */
} tok_strmap;

int32_t tok_strmap_get(const tok_strmap *m, const char *pool, const void *key, size_t n);

/* A map from an ordered pair of ids to (rank, merged id). */
typedef struct tok_mergemap {
    uint64_t *keys;     /* (a << 32) | b; UINT64_MAX = empty */
    int32_t  *rank, *merged;
    size_t    cap, count;
    int       shift;
} tok_mergemap;

static inline size_t tok_merge_find(const tok_mergemap *m, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t mask = m->cap - 1, i = (size_t)((key * 0x9e3779b97f4a7c15ull) >> m->shift);
    for (;;) {
        uint64_t k = m->keys[i];
        if (k == key) return i;
        if (k == UINT64_MAX) return (size_t)-1;
        i = (i + 1) & mask;
    }
}

/* ---- the tokenizer ---------------------------------------------------------------------------- */

typedef struct tok_entry {
    uint32_t str_off, str_len;   /* the token string (id_to_token); str_len == UINT32_MAX: no token */
    uint32_t dec_off, dec_len;   /* the bytes decode writes */
} tok_entry;

/* added tokens that start with each byte, longest first (leftmost-longest matching) */
typedef struct tok_matcher {
    int      n;
    int32_t *order;       /* indices into tok->added */
    int32_t  start[257];  /* order[start[b] .. start[b+1]) begin with byte b */
} tok_matcher;

typedef enum { TOK_STAGE_SPLIT, TOK_STAGE_BYTELEVEL } tok_stage_kind;

typedef struct tok_stage {
    tok_stage_kind kind;
    pcre2_code    *re;            /* NULL: ByteLevel without use_regex */
    int            jit;           /* re was JIT-compiled */
    int            prefix_space;  /* ByteLevel add_prefix_space */
} tok_stage;

typedef struct tok_ws tok_ws;

struct lunar_tokenizer {
    char *path;
    char *pool;                   /* every string: vocab, contents, decoded bytes */
    size_t pool_len, pool_cap;

    int32_t    n_ids;             /* vocab size: largest id + 1 */
    tok_entry *tokens;            /* n_ids */
    uint8_t   *special;           /* n_ids: 1 = skipped by decode(skip_special) */

    tok_strmap   vocab;           /* model token string -> id */
    tok_strmap   raw_vocab;       /* the bytes of a model token made of byte-level characters -> id */
    tok_strmap   added_map;       /* added token content -> id */
    tok_mergemap merges;
    int32_t      byte_id[256];    /* id of the one-byte token of each byte, or -1 */
    int32_t      unk_id;          /* -1: none */
    int          fuse_unk;
    int          ignore_merges;

    int              n_added;
    lunar_tok_added *added;       /* in id order; content points into added_text */
    char            *added_text;
    tok_matcher      match[2];    /* 0: non-normalized tokens, 1: normalized ones */

    int       n_stages;
    tok_stage stages[TOK_MAX_STAGES];

    int      linear_max;
    int      n_ws;
    tok_ws **ws;                  /* one workspace per thread, made on demand */
};

/* ---- UTF-8 ------------------------------------------------------------------------------------ */

/* Length (1-4) of the well-formed UTF-8 character at p[0..n), or 0 when p starts no such
 * character (Unicode table 3-7: no overlongs, no surrogates, nothing above U+10FFFF). */
static inline int tok_utf8_len(const uint8_t *p, size_t n, uint32_t *cp) {
    uint8_t c = p[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c < 0xC2) return 0;
    if (c < 0xE0) {
        if (n < 2 || (p[1] & 0xC0) != 0x80) return 0;
        *cp = ((uint32_t)(c & 0x1F) << 6) | (p[1] & 0x3F);
        return 2;
    }
    if (c < 0xF0) {
        if (n < 3) return 0;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80) return 0;
        *cp = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
        return 3;
    }
    if (c < 0xF5) {
        if (n < 4) return 0;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
        if (p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
        *cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(p[1] & 0x3F) << 12) | ((uint32_t)(p[2] & 0x3F) << 6) |
              (p[3] & 0x3F);
        return 4;
    }
    return 0;
}

/* GPT-2's byte <-> character map: the character of each byte, and the byte of a character
 * (code points below 324), or -1. */
void tok_byte_chars(uint32_t byte_cp[256], int16_t cp_byte[324]);

/* HF's pre-tokenizer regex (Oniguruma syntax) as a PCRE2 pattern whose classes are lunar's
 * Unicode 16 ones (regex.c). NULL with msg set when the pattern uses what lunar cannot match
 * the way HF does; otherwise a malloc'ed pattern of *out_len bytes. */
char *tok_regex_translate(const char *pat, size_t len, size_t *out_len, char *msg, size_t msg_size);

/* internal to encode.c, used by load.c */
void tok_ws_free_all(lunar_tokenizer *tok);

#endif
