/* encode.c: text -> ids and ids -> text.
 *
 * Encoding a text, in HF tokenizers' order:
 *   1. added tokens are split out (leftmost-longest; the non-normalized tokens over the whole
 *      text first, then the normalized ones in the pieces that remain), applying HF's
 *      single_word / lstrip / rstrip rules and, with LUNAR_TOK_NO_SPECIAL, skipping special
 *      tokens the way HF's encode_special_tokens does;
 *   2. each remaining piece is cut into runs of well-formed UTF-8 and runs of other bytes; the
 *      latter go to BPE whole (lunar's rule for bytes HF cannot take);
 *   3. the pre-tokenizer steps split the UTF-8 runs (each Split regex in turn, then ByteLevel's
 *      optional prefix space and regex);
 *   4. each pre-token is encoded by byte-level BPE: its bytes become the one-byte tokens and the
 *      adjacent pair with the lowest merge rank (leftmost on ties) is merged until none is left.
 *      Short words use a linear scan over cached pair ranks; long ones a binary heap with lazy
 *      deletion (the same order as HF's). Results are cached per thread by word bytes.
 *
 * Per-thread state (PCRE2 match data and JIT stack, the word cache, scratch arrays) lives in a
 * workspace; lunar_tokenizer_encode_batch gives each OpenMP thread its own.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok.h"
#include "unicode.h"

#define CACHE_SLOTS   (1u << 15)   /* power of two */
#define CACHE_MAX     (1u << 14)   /* entries before the cache is cleared */
#define CACHE_KEY_MAX 128          /* longer words are not cached */

typedef struct cache_slot {
    uint64_t hash;
    uint32_t key_off, ids_off;
    uint16_t key_len;   /* 0: empty */
    uint16_t n_ids;
} cache_slot;

typedef struct heap_entry {
    int32_t rank, pos;
} heap_entry;

struct tok_ws {
    pcre2_match_data    *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack     *jst;

    int32_t *out;
    size_t   n_out, cap_out;

    cache_slot *cslots;
    size_t      ccount;
    uint8_t    *ckeys;
    size_t      ckeys_len, ckeys_cap;
    int32_t    *cids;
    size_t      cids_len, cids_cap;

    int32_t    *sid, *snext, *sprev, *srank, *smerged;
    size_t      scap;
    heap_entry *heap;
    size_t      hcap;

    uint8_t *tmp;
    size_t   tmp_cap;

    lunar_status err;
    char         msg[256];
};

/* ---- workspaces ------------------------------------------------------------------------------ */

static void ws_free(tok_ws *w) {
    if (!w) return;
    pcre2_match_data_free(w->md);
    pcre2_match_context_free(w->mctx);
    pcre2_jit_stack_free(w->jst);
    free(w->out);
    free(w->cslots);
    free(w->ckeys);
    free(w->cids);
    free(w->sid);
    free(w->snext);
    free(w->sprev);
    free(w->srank);
    free(w->smerged);
    free(w->heap);
    free(w->tmp);
    free(w);
}

void tok_ws_free_all(lunar_tokenizer *tok) {
    for (int i = 0; i < tok->n_ws; i++) ws_free(tok->ws[i]);
    free(tok->ws);
    tok->ws = NULL;
    tok->n_ws = 0;
}

static tok_ws *ws_new(void) {
    tok_ws *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->md = pcre2_match_data_create(1, NULL);
    w->mctx = pcre2_match_context_create(NULL);
    w->jst = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    w->cslots = calloc(CACHE_SLOTS, sizeof *w->cslots);
    if (!w->md || !w->mctx || !w->cslots) {
        ws_free(w);
        return NULL;
    }
    if (w->jst) pcre2_jit_stack_assign(w->mctx, NULL, w->jst);
    return w;
}

static lunar_status ws_ensure(lunar_ctx *ctx, lunar_tokenizer *tok, int n) {
    if (tok->n_ws >= n) return LUNAR_OK;
    tok_ws **a = realloc(tok->ws, (size_t)n * sizeof *a);
    if (!a) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory for tokenizer workspaces", tok->path);
    tok->ws = a;
    while (tok->n_ws < n) {
        if (!(tok->ws[tok->n_ws] = ws_new()))
            return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory for tokenizer workspaces", tok->path);
        tok->n_ws++;
    }
    return LUNAR_OK;
}

static int ws_fail(tok_ws *w, lunar_status st, const char *msg) {
    if (!w->err) {
        w->err = st;
        snprintf(w->msg, sizeof w->msg, "%s", msg);
    }
    return -1;
}

/* grow *p (elements of size sz) to hold at least need; 0 on success */
static int grow(void **p, size_t *cap, size_t need, size_t sz) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * sz);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

static inline int emit(tok_ws *w, int32_t id) {
    if (w->n_out == w->cap_out && grow((void **)&w->out, &w->cap_out, w->n_out + 1, sizeof *w->out))
        return ws_fail(w, LUNAR_ERR_OOM, "out of memory for the ids");
    w->out[w->n_out++] = id;
    return 0;
}

/* ---- the word cache ---------------------------------------------------------------------------- */

static void cache_clear(tok_ws *w) {
    memset(w->cslots, 0, CACHE_SLOTS * sizeof *w->cslots);
    w->ccount = w->ckeys_len = w->cids_len = 0;
}

/* 1 and the ids appended to the output when the word is cached */
static inline int cache_get(tok_ws *w, const uint8_t *word, size_t n, uint64_t h, int *err) {
    size_t mask = CACHE_SLOTS - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        const cache_slot *s = &w->cslots[i];
        if (s->key_len == 0) return 0;
        if (s->hash == h && s->key_len == n && memcmp(w->ckeys + s->key_off, word, n) == 0) {
            if (w->n_out + s->n_ids > w->cap_out &&
                grow((void **)&w->out, &w->cap_out, w->n_out + s->n_ids, sizeof *w->out)) {
                *err = ws_fail(w, LUNAR_ERR_OOM, "out of memory for the ids");
                return 1;
            }
            memcpy(w->out + w->n_out, w->cids + s->ids_off, s->n_ids * sizeof *w->out);
            w->n_out += s->n_ids;
            return 1;
        }
    }
}

/* remember the last n_ids ids of the output as the word's (a failed allocation only skips it) */
static void cache_put(tok_ws *w, const uint8_t *word, size_t n, uint64_t h, size_t n_ids) {
    if (w->ccount >= CACHE_MAX) cache_clear(w);
    if (grow((void **)&w->ckeys, &w->ckeys_cap, w->ckeys_len + n, 1) ||
        grow((void **)&w->cids, &w->cids_cap, w->cids_len + n_ids, sizeof *w->cids))
        return;
    size_t mask = CACHE_SLOTS - 1, i = (size_t)h & mask;
    while (w->cslots[i].key_len) i = (i + 1) & mask;
    cache_slot *s = &w->cslots[i];
    s->hash = h;
    s->key_off = (uint32_t)w->ckeys_len;
    s->key_len = (uint16_t)n;
    s->ids_off = (uint32_t)w->cids_len;
    s->n_ids = (uint16_t)n_ids;
    memcpy(w->ckeys + w->ckeys_len, word, n);
    memcpy(w->cids + w->cids_len, w->out + w->n_out - n_ids, n_ids * sizeof *w->cids);
    w->ckeys_len += n;
    w->cids_len += n_ids;
    w->ccount++;
}

/* ---- BPE ---------------------------------------------------------------------------------------- */

static inline void pair_rank(const lunar_tokenizer *tok, tok_ws *w, int32_t i) {
    int32_t j = w->snext[i];
    w->srank[i] = INT32_MAX;
    if (j < 0) return;
    size_t k = tok_merge_find(&tok->merges, w->sid[i], w->sid[j]);
    if (k != (size_t)-1) {
        w->srank[i] = tok->merges.rank[k];
        w->smerged[i] = tok->merges.merged[k];
    }
}

static inline int heap_less(heap_entry a, heap_entry b) { return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos); }

static inline void heap_push(heap_entry *h, size_t *n, heap_entry e) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(e, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static inline heap_entry heap_pop(heap_entry *h, size_t *n) {
    heap_entry top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(h[c + 1], h[c])) c++;
        if (!heap_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

/* merge the symbols sid[0..n) in place (removed ones get -1), lowest rank first, leftmost on ties */
static void merge_linear(const lunar_tokenizer *tok, tok_ws *w, int32_t n) {
    for (int32_t i = 0; i < n; i++) pair_rank(tok, w, i);
    for (;;) {
        int32_t best = -1, br = INT32_MAX;
        for (int32_t i = 0; i >= 0; i = w->snext[i])
            if (w->srank[i] < br) {
                br = w->srank[i];
                best = i;
            }
        if (best < 0) return;
        int32_t j = w->snext[best];
        w->sid[best] = w->smerged[best];
        w->sid[j] = -1;
        w->snext[best] = w->snext[j];
        if (w->snext[j] >= 0) w->sprev[w->snext[j]] = best;
        pair_rank(tok, w, best);
        if (w->sprev[best] >= 0) pair_rank(tok, w, w->sprev[best]);
    }
}

static int merge_heap(const lunar_tokenizer *tok, tok_ws *w, int32_t n) {
    if (grow((void **)&w->heap, &w->hcap, 3 * (size_t)n + 4, sizeof *w->heap))
        return ws_fail(w, LUNAR_ERR_OOM, "out of memory in the BPE merge loop");
    heap_entry *h = w->heap;
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < n; i++) {
        size_t k = tok_merge_find(&tok->merges, w->sid[i], w->sid[i + 1]);
        if (k != (size_t)-1) heap_push(h, &hn, (heap_entry){tok->merges.rank[k], i});
    }
    while (hn) {
        heap_entry top = heap_pop(h, &hn);
        int32_t pos = top.pos;
        if (w->sid[pos] < 0) continue;   /* merged into its left neighbour */
        int32_t j = w->snext[pos];
        if (j < 0) continue;
        size_t k = tok_merge_find(&tok->merges, w->sid[pos], w->sid[j]);
        if (k == (size_t)-1 || tok->merges.rank[k] != top.rank) continue;   /* stale entry */
        w->sid[pos] = tok->merges.merged[k];
        w->sid[j] = -1;
        w->snext[pos] = w->snext[j];
        if (w->snext[pos] >= 0) w->sprev[w->snext[pos]] = pos;
        int32_t p = w->sprev[pos];
        if (p >= 0 && (k = tok_merge_find(&tok->merges, w->sid[p], w->sid[pos])) != (size_t)-1)
            heap_push(h, &hn, (heap_entry){tok->merges.rank[k], p});
        if (w->snext[pos] >= 0 && (k = tok_merge_find(&tok->merges, w->sid[pos], w->sid[w->snext[pos]])) != (size_t)-1)
            heap_push(h, &hn, (heap_entry){tok->merges.rank[k], pos});
    }
    return 0;
}

static int bpe_word(const lunar_tokenizer *tok, tok_ws *w, const uint8_t *word, size_t n) {
    if (n == 0) return 0;
    uint64_t h = 0;
    int cacheable = n <= CACHE_KEY_MAX;
    if (cacheable) {
        int err = 0;
        h = tok_hash(word, n);
        if (cache_get(w, word, n, h, &err)) return err;
    }
    size_t before = w->n_out;
    if (tok->ignore_merges) {
        int32_t id = tok_strmap_get(&tok->raw_vocab, tok->pool, word, n);
        if (id >= 0) {
            if (emit(w, id)) return -1;
            if (cacheable) cache_put(w, word, n, h, 1);
            return 0;
        }
    }
    if (n > (size_t)INT32_MAX / 4) return ws_fail(w, LUNAR_ERR_ARG, "a pre-token of more than 512 MiB");
    if (n > w->scap) {
        size_t c = w->scap ? w->scap : 64;
        while (c < n) c *= 2;
        int32_t **arrs[] = {&w->sid, &w->snext, &w->sprev, &w->srank, &w->smerged};
        for (int a = 0; a < 5; a++) {
            int32_t *q = realloc(*arrs[a], c * sizeof(int32_t));
            if (!q) return ws_fail(w, LUNAR_ERR_OOM, "out of memory in the BPE merge loop");
            *arrs[a] = q;
        }
        w->scap = c;
    }
    /* the symbols: one-byte tokens; bytes without one become unk_token (fused when fuse_unk)
     * or are dropped, as in HF */
    int32_t ns = 0;
    int unk_pending = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_id[word[i]];
        if (id >= 0) {
            if (unk_pending) w->sid[ns++] = tok->unk_id;
            unk_pending = 0;
            w->sid[ns++] = id;
        } else if (tok->unk_id >= 0) {
            if (unk_pending && !tok->fuse_unk) w->sid[ns++] = tok->unk_id;
            unk_pending = 1;
        }
    }
    if (unk_pending) w->sid[ns++] = tok->unk_id;
    if (ns == 0) return 0;
    for (int32_t i = 0; i < ns; i++) {
        w->snext[i] = i + 1 < ns ? i + 1 : -1;
        w->sprev[i] = i - 1;
    }
    if (ns > 1) {
        if (ns <= tok->linear_max) merge_linear(tok, w, ns);
        else if (merge_heap(tok, w, ns)) return -1;
    }
    for (int32_t i = 0; i >= 0; i = w->snext[i])
        if (emit(w, w->sid[i])) return -1;
    if (cacheable) cache_put(w, word, n, h, w->n_out - before);
    return 0;
}

/* ---- pre-tokenizer -------------------------------------------------------------------------------- */

static int run_stage(const lunar_tokenizer *tok, tok_ws *w, int k, const uint8_t *p, size_t n);

/* a piece made by stage k goes on to the next stage, or to BPE after ByteLevel */
static inline int piece_done(const lunar_tokenizer *tok, tok_ws *w, int k, const uint8_t *p, size_t n) {
    if (n == 0) return 0;
    if (tok->stages[k].kind == TOK_STAGE_BYTELEVEL) return bpe_word(tok, w, p, n);
    return run_stage(tok, w, k + 1, p, n);
}

/* Isolated split: every match and every gap between matches is a piece */
static int split_regex(const lunar_tokenizer *tok, tok_ws *w, int k, const uint8_t *p, size_t n) {
    const tok_stage *s = &tok->stages[k];
    size_t off = 0, prev = 0;
    while (off < n) {
        int rc = s->jit ? pcre2_jit_match(s->re, p, n, off, 0, w->md, w->mctx)
                        : pcre2_match(s->re, p, n, off, PCRE2_NO_UTF_CHECK, w->md, w->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            char m[220];
            pcre2_get_error_message(rc, msg, sizeof msg);
            snprintf(m, sizeof m, "the pre-tokenizer regex failed: %s", (const char *)msg);
            return ws_fail(w, LUNAR_ERR_INTERNAL, m);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        size_t a = ov[0], b = ov[1];
        if (a > prev && piece_done(tok, w, k, p + prev, a - prev)) return -1;
        if (b == a) {   /* an empty match: the next search starts one character later */
            uint32_t cp;
            int l = a < n ? tok_utf8_len(p + a, n - a, &cp) : 1;
            prev = a;
            off = a + (size_t)(l > 0 ? l : 1);
            continue;
        }
        if (piece_done(tok, w, k, p + a, b - a)) return -1;
        prev = off = b;
    }
    if (prev < n && piece_done(tok, w, k, p + prev, n - prev)) return -1;
    return 0;
}

static int run_stage(const lunar_tokenizer *tok, tok_ws *w, int k, const uint8_t *p, size_t n) {
    const tok_stage *s = &tok->stages[k];
    if (s->kind == TOK_STAGE_BYTELEVEL && s->prefix_space && p[0] != ' ') {
        /* ByteLevel(add_prefix_space): a space before every piece that does not start with one */
        if (grow((void **)&w->tmp, &w->tmp_cap, n + 1, 1)) return ws_fail(w, LUNAR_ERR_OOM, "out of memory");
        w->tmp[0] = ' ';
        memcpy(w->tmp + 1, p, n);
        p = w->tmp;
        n++;
    }
    if (s->re) return split_regex(tok, w, k, p, n);
    return bpe_word(tok, w, p, n);
}

/* runs of well-formed UTF-8 go through the pre-tokenizer; runs of other bytes straight to BPE */
static int pretokenize(const lunar_tokenizer *tok, tok_ws *w, const uint8_t *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        uint32_t cp;
        while (j < n) {
            if (p[j] < 0x80) {
                j++;
                continue;
            }
            int l = tok_utf8_len(p + j, n - j, &cp);
            if (!l) break;
            j += (size_t)l;
        }
        if (j > i && run_stage(tok, w, 0, p + i, j - i)) return -1;
        i = j;
        while (j < n && p[j] >= 0x80 && !tok_utf8_len(p + j, n - j, &cp)) j++;
        if (j > i && bpe_word(tok, w, p + i, j - i)) return -1;
        i = j;
    }
    return 0;
}

/* ---- added tokens ------------------------------------------------------------------------------- */

/* length of the well-formed character that ends at p + end (not before p + lo), or 0 */
static int char_before(const uint8_t *p, size_t lo, size_t end, uint32_t *cp) {
    for (int l = 1; l <= 4 && end >= lo + (size_t)l; l++)
        if (tok_utf8_len(p + end - l, (size_t)l, cp) == l) return l;
    return 0;
}

static int added_pass(const lunar_tokenizer *tok, tok_ws *w, int set, const uint8_t *p, size_t n, int flags);

static inline int gap_done(const lunar_tokenizer *tok, tok_ws *w, int set, const uint8_t *p, size_t n, int flags) {
    if (n == 0) return 0;
    return set == 0 ? added_pass(tok, w, 1, p, n, flags) : pretokenize(tok, w, p, n);
}

/* HF's AddedVocabulary::find_matches over p[0..n) with the tokens of one set */
static int added_pass(const lunar_tokenizer *tok, tok_ws *w, int set, const uint8_t *p, size_t n, int flags) {
    const tok_matcher *mt = &tok->match[set];
    if (mt->n == 0) return gap_done(tok, w, set, p, n, flags);
    size_t start_offset = 0, i = 0;
    while (i < n) {
        int b0 = mt->start[p[i]], b1 = mt->start[p[i] + 1];
        const lunar_tok_added *a = NULL;
        for (int q = b0; q < b1; q++) {
            const lunar_tok_added *c = &tok->added[mt->order[q]];
            if (c->len <= n - i && memcmp(p + i, c->content, c->len) == 0) {
                a = c;
                break;
            }
        }
        if (!a) {
            i++;
            continue;
        }
        size_t start = i, stop = i + a->len;
        i = stop;   /* matches do not overlap, even the ones dropped below */
        if ((flags & LUNAR_TOK_NO_SPECIAL) && a->special) continue;
        if (a->single_word) {
            uint32_t cp;
            int l = char_before(p, 0, start, &cp);
            int start_space = start == 0 || !(l && tok_is_rust_word(cp));
            l = stop < n ? tok_utf8_len(p + stop, n - stop, &cp) : 0;
            int stop_space = stop == n || !(l && tok_is_rust_word(cp));
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {   /* take the whitespace before it, but not what an earlier match took */
            size_t s = start;
            uint32_t cp;
            int l;
            while ((l = char_before(p, 0, s, &cp)) && tok_is_white_space(cp)) s -= (size_t)l;
            start = s > start_offset ? s : start_offset;
        }
        if (a->rstrip) {
            uint32_t cp;
            int l;
            while (stop < n && (l = tok_utf8_len(p + stop, n - stop, &cp)) && tok_is_white_space(cp)) stop += (size_t)l;
        }
        if (start_offset < start && gap_done(tok, w, set, p + start_offset, start - start_offset, flags)) return -1;
        if (emit(w, a->id)) return -1;
        start_offset = stop;
    }
    if (start_offset < n && gap_done(tok, w, set, p + start_offset, n - start_offset, flags)) return -1;
    return 0;
}

/* ---- entry points -------------------------------------------------------------------------------- */

static int encode_text(const lunar_tokenizer *tok, tok_ws *w, const char *text, size_t n, int flags) {
    return added_pass(tok, w, 0, (const uint8_t *)text, n, flags);
}

lunar_status lunar_tokenizer_encode(lunar_ctx *ctx, lunar_tokenizer *tok, const char *text, size_t n, int flags,
                                    int32_t **ids, size_t *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    LUNAR_TRY(ws_ensure(ctx, tok, 1));
    tok_ws *w = tok->ws[0];
    w->n_out = 0;
    w->err = LUNAR_OK;
    if (encode_text(tok, w, text, n, flags))
        return LUNAR_FAIL(ctx, w->err, "%s: encode: %s", tok->path, w->msg);
    int32_t *out = malloc((w->n_out ? w->n_out : 1) * sizeof *out);
    if (!out) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: encode: out of memory for %zu ids", tok->path, w->n_out);
    memcpy(out, w->out, w->n_out * sizeof *out);
    *ids = out;
    *n_ids = w->n_out;
    return LUNAR_OK;
}

lunar_status lunar_tokenizer_encode_batch(lunar_ctx *ctx, lunar_tokenizer *tok, size_t n_texts,
                                          const char *const *texts, const size_t *lens, int flags, int32_t **ids,
                                          int64_t *offsets) {
    *ids = NULL;
    int nt = lunar_ctx_threads(ctx);
    if (nt < 1) nt = 1;
    if ((size_t)nt > n_texts) nt = n_texts > 0 ? (int)n_texts : 1;
    LUNAR_TRY(ws_ensure(ctx, tok, nt));
    /* each thread appends the ids of its texts to its own workspace; text i's ids are then at
     * ws[who[i]]->out + where[i] (offsets[i + 1] temporarily holds the count) */
    int32_t *who = malloc((n_texts + 1) * sizeof *who);
    size_t *where = malloc((n_texts + 1) * sizeof *where);
    if (!who || !where) {
        free(who);
        free(where);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: encode_batch: out of memory for %zu texts", tok->path, n_texts);
    }
    for (int t = 0; t < nt; t++) {
        tok->ws[t]->n_out = 0;
        tok->ws[t]->err = LUNAR_OK;
    }
    size_t failed_text = (size_t)-1;
    const lunar_tokenizer *ctok = tok;
    tok_ws **wss = tok->ws;
#pragma omp parallel for schedule(dynamic, 8) num_threads(nt) if (nt > 1)
    for (size_t i = 0; i < n_texts; i++) {
        int t = omp_get_thread_num();
        tok_ws *w = wss[t];
        if (w->err) continue;
        size_t before = w->n_out;
        if (encode_text(ctok, w, texts[i], lens[i], flags)) {
#pragma omp critical(lunar_tok_fail)
            if (i < failed_text) failed_text = i;
            continue;
        }
        who[i] = t;
        where[i] = before;
        offsets[i + 1] = (int64_t)(w->n_out - before);
    }
    lunar_status st = LUNAR_OK;
    if (failed_text != (size_t)-1) {
        tok_ws *bad = NULL;
        for (int t = 0; t < nt && !bad; t++)
            if (tok->ws[t]->err) bad = tok->ws[t];
        st = LUNAR_FAIL(ctx, bad ? bad->err : LUNAR_ERR_INTERNAL, "%s: encode_batch: text %zu: %s", tok->path,
                        failed_text, bad ? bad->msg : "failed");
    }
    if (st == LUNAR_OK) {
        offsets[0] = 0;
        for (size_t i = 0; i < n_texts; i++) offsets[i + 1] += offsets[i];
        size_t total = (size_t)offsets[n_texts];
        int32_t *out = malloc((total ? total : 1) * sizeof *out);
        if (!out) {
            st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: encode_batch: out of memory for %zu ids", tok->path, total);
        } else {
            for (size_t i = 0; i < n_texts; i++)
                memcpy(out + offsets[i], tok->ws[who[i]]->out + where[i],
                       (size_t)(offsets[i + 1] - offsets[i]) * sizeof *out);
            *ids = out;
        }
    }
    free(who);
    free(where);
    return st;
}

lunar_status lunar_tokenizer_decode(lunar_ctx *ctx, const lunar_tokenizer *tok, const int64_t *ids, size_t n_ids,
                                    int flags, char **out, size_t *n) {
    *out = NULL;
    *n = 0;
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= tok->n_ids || tok->tokens[id].str_len == UINT32_MAX)
            return LUNAR_FAIL(ctx, LUNAR_ERR_ARG, "%s: decode: id %lld at position %zu is not in the vocabulary (size %d)",
                              tok->path, (long long)id, i + 1, tok->n_ids);
        if (!((flags & LUNAR_TOK_SKIP_SPECIAL) && tok->special[id])) total += tok->tokens[id].dec_len;
    }
    char *s = malloc(total + 1);
    if (!s) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: decode: out of memory for %zu bytes", tok->path, total);
    size_t k = 0;
    for (size_t i = 0; i < n_ids; i++) {
        const tok_entry *e = &tok->tokens[ids[i]];
        if ((flags & LUNAR_TOK_SKIP_SPECIAL) && tok->special[ids[i]]) continue;
        memcpy(s + k, tok->pool + e->dec_off, e->dec_len);
        k += e->dec_len;
    }
    s[k] = 0;
    *out = s;
    *n = k;
    return LUNAR_OK;
}
