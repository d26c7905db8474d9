/* tokenizer.h: byte-level BPE tokenizers read from Hugging Face `tokenizer.json` files.
 *
 * What is read (docs/tokenizer.md has the details and the differences from HF tokenizers):
 *   model          BPE: vocab, merges ("a b" strings or ["a", "b"] pairs), ignore_merges;
 *                  dropout, unk_token, byte_fallback, continuing_subword_prefix and
 *                  end_of_word_suffix must be absent/null/false/empty
 *   normalizer     null (anything else is an error naming the type)
 *   pre_tokenizer  ByteLevel (use_regex true or false, add_prefix_space true or false), or a
 *                  Sequence of Split steps (Regex or String pattern, behavior Isolated, not
 *                  inverted) ending with ByteLevel; the regexes run under PCRE2 (UTF, UCP, JIT)
 *   decoder        ByteLevel
 *   post_processor ignored: encode never adds tokens (HF's add_special_tokens=False)
 *   added_tokens   special and non-special, with lstrip / rstrip / single_word / normalized;
 *                  split out of the text before the pre-tokenizer, leftmost-longest, the
 *                  non-normalized ones first, then the normalized ones in what remains (HF's
 *                  order)
 * Errors name the file and the key ("tokenizer.json: model.merges[12]: 'a' is not in the vocab").
 *
 * Encoding works on bytes: text need not be valid UTF-8. Each maximal run of bytes that are not
 * part of a well-formed UTF-8 character is its own pre-token, encoded by byte-level BPE, so
 * decode(encode(x)) == x for any bytes (HF takes only valid UTF-8; on valid text the ids are
 * HF's). Decoding returns the raw bytes (HF replaces invalid UTF-8 with U+FFFD).
 *
 * A tokenizer is read-only after loading except for its per-thread word caches: calls on one
 * tokenizer must not run concurrently (lunar_tokenizer_encode_batch parallelises internally).
 */
#ifndef LUNAR_TOKENIZER_H
#define LUNAR_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "lunar/ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lunar_tokenizer lunar_tokenizer;

/* flags of encode */
#define LUNAR_TOK_NO_SPECIAL   1   /* special added tokens in the text are plain text (HF's
                                      encode_special_tokens = True); non-special added tokens
                                      such as <think> are still recognised, as in HF */
/* flags of decode */
#define LUNAR_TOK_SKIP_SPECIAL 1   /* leave out special tokens (HF's skip_special_tokens) */

typedef struct lunar_tok_added {
    int32_t     id;
    const char *content;   /* NUL-terminated */
    size_t      len;
    int         special, lstrip, rstrip, single_word, normalized;
} lunar_tok_added;

/* path: a tokenizer.json file or a directory that holds one. */
lunar_status lunar_tokenizer_load(lunar_ctx *ctx, lunar_tokenizer **out, const char *path);
/* The same from a JSON text in memory; what names it in errors. */
lunar_status lunar_tokenizer_load_json(lunar_ctx *ctx, lunar_tokenizer **out, const char *what, const char *json,
                                       size_t n);
void         lunar_tokenizer_free(lunar_tokenizer *tok);   /* NULL is a no-op */

const char  *lunar_tokenizer_path(const lunar_tokenizer *tok);
/* largest id of the model vocab and the added tokens, plus one */
int32_t      lunar_tokenizer_vocab_size(const lunar_tokenizer *tok);
/* the id of a token string as it appears in tokenizer.json (added tokens first, then the model
 * vocab: "Ġthe", "<|user|>"), or -1 */
int32_t      lunar_tokenizer_token_to_id(const lunar_tokenizer *tok, const char *s, size_t n);
/* the token string of an id (added tokens first), or NULL; *n gets its length */
const char  *lunar_tokenizer_id_to_token(const lunar_tokenizer *tok, int32_t id, size_t *n);
int          lunar_tokenizer_is_special(const lunar_tokenizer *tok, int32_t id);
int          lunar_tokenizer_added_count(const lunar_tokenizer *tok);
const lunar_tok_added *lunar_tokenizer_added(const lunar_tokenizer *tok, int i);   /* in id order */

/* text[0..n) -> *ids (malloc'd; the caller frees), *n_ids ids. */
lunar_status lunar_tokenizer_encode(lunar_ctx *ctx, lunar_tokenizer *tok, const char *text, size_t n, int flags,
                                    int32_t **ids, size_t *n_ids);
/* n_texts texts, encoded in parallel (OpenMP, lunar_ctx_threads threads): the ids of text i are
 * (*ids)[offsets[i] .. offsets[i+1]). offsets has n_texts + 1 entries (the caller's array);
 * *ids is malloc'd (the caller frees). */
lunar_status lunar_tokenizer_encode_batch(lunar_ctx *ctx, lunar_tokenizer *tok, size_t n_texts,
                                          const char *const *texts, const size_t *lens, int flags, int32_t **ids,
                                          int64_t *offsets);
/* ids -> bytes (*out malloc'd and NUL-terminated, the caller frees; *n excludes the NUL). An id
 * outside the vocabulary is an error naming it and its position. */
lunar_status lunar_tokenizer_decode(lunar_ctx *ctx, const lunar_tokenizer *tok, const int64_t *ids, size_t n_ids,
                                    int flags, char **out, size_t *n);

/* Test hook: words of more than this many bytes use the heap-based merge loop instead of the
 * linear scan (both give the same ids; the default is 48). */
void         lunar_tokenizer_set_linear_max(lunar_tokenizer *tok, int n);

#ifdef __cplusplus
}
#endif
#endif
