/* indexed.h: Megatron-LM indexed datasets (<prefix>.bin + <prefix>.idx), read and written.
 *
 * Format (docs/formats.md section 2 of the shared notes; all integers little-endian):
 *   <prefix>.bin  every sequence's tokens, concatenated, stored as the index dtype, no header
 *   <prefix>.idx  "MMIDIDX\0\0", u64 version = 1, u8 dtype code, u64 S (sequences),
 *                 u64 D (document indices = documents + 1), i32 lengths[S], i64 pointers[S]
 *                 (byte offset of each sequence in .bin), i64 document_indices[D] (starts at 0;
 *                 after each document the cumulative sequence count), i8 modes[S] (multimodal
 *                 datasets only: the file is then S bytes longer)
 *
 * Reader: both files are mapped privately (copy-on-write: a write into a view never reaches the
 * file). Opening validates everything before returning: magic, version, dtype code, the .idx
 * size for S and D, lengths >= 0, pointers equal to the running sum of length x itemsize (what
 * every Megatron writer produces), .bin size equal to the total, document indices starting at
 * 0, non-decreasing and <= S. Errors name the file and the problem. The index arrays sit at
 * unaligned offsets of the .idx (34 is not a multiple of 4), so they are read through memcpy
 * accessors, never through typed pointers into the mapping.
 *
 * Token views: a sequence (or a span of one, or a whole document: its sequences are adjacent in
 * .bin) is a zero-copy CPU tensor over the mapping when the stored dtype is one lunar has
 * (u8, i8, i32, i64, f32, f64); for uint16 and int16 it is a converted i32 copy. Each view holds
 * a reference on the mapping, so views outlive lunar_indexed_close.
 *
 * Writer: streams sequences into <prefix>.bin.tmp.<pid> (buffered), keeps the index arrays in
 * memory, and on finish writes the .idx the way Megatron's builder does (byte-identical for the
 * same content) and renames both files into place (fsynced). Token values are range-checked
 * against the dtype; a failure names the sequence and the value. abort removes the temporaries.
 */
#ifndef LUNAR_INDEXED_H
#define LUNAR_INDEXED_H

#include <stddef.h>
#include <stdint.h>

#include "lunar/ctx.h"
#include "lunar/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Megatron's dtype codes */
enum {
    LUNAR_MMIDX_U8 = 1, LUNAR_MMIDX_I8 = 2, LUNAR_MMIDX_I16 = 3, LUNAR_MMIDX_I32 = 4,
    LUNAR_MMIDX_I64 = 5, LUNAR_MMIDX_F64 = 6, LUNAR_MMIDX_F32 = 7, LUNAR_MMIDX_U16 = 8,
};

/* "uint16" etc. for a code (NULL if unknown); the code for a name (numpy names: uint8 int8
 * int16 int32 int64 float64 float32 uint16), 0 if unknown; the element size (0 if unknown). */
const char *lunar_mmidx_dtype_name(int code);
int         lunar_mmidx_dtype_code(const char *name);
size_t      lunar_mmidx_itemsize(int code);

/* ---- reader ------------------------------------------------------------------------------------ */

typedef struct lunar_indexed lunar_indexed;

lunar_status lunar_indexed_open(lunar_ctx *ctx, lunar_indexed **out, const char *prefix);
void         lunar_indexed_close(lunar_ctx *ctx, lunar_indexed *d);   /* NULL is fine */

const char *lunar_indexed_prefix(const lunar_indexed *d);
int         lunar_indexed_dtype(const lunar_indexed *d);         /* Megatron code */
int64_t     lunar_indexed_sequence_count(const lunar_indexed *d);   /* S */
int64_t     lunar_indexed_document_count(const lunar_indexed *d);   /* D - 1 */
int         lunar_indexed_multimodal(const lunar_indexed *d);    /* 1 when modes[] is present */
int64_t     lunar_indexed_total_tokens(const lunar_indexed *d);
/* 0-based accessors; the index must be in range (checked by the callers) */
int32_t     lunar_indexed_length(const lunar_indexed *d, int64_t seq);
int64_t     lunar_indexed_pointer(const lunar_indexed *d, int64_t seq);
int64_t     lunar_indexed_doc_index(const lunar_indexed *d, int64_t i);   /* i in [0, D) */
int8_t      lunar_indexed_mode(const lunar_indexed *d, int64_t seq);      /* 0 if not multimodal */

/* out = tokens [offset, offset + length) of sequence seq (0-based); length < 0 = to the end.
 * Named "<prefix base>[seq]". */
lunar_status lunar_indexed_sequence(lunar_ctx *ctx, lunar_tensor *out, const lunar_indexed *d, int64_t seq,
                                    int64_t offset, int64_t length);
/* out = all tokens of document doc (0-based), its sequences concatenated. */
lunar_status lunar_indexed_document(lunar_ctx *ctx, lunar_tensor *out, const lunar_indexed *d, int64_t doc);
/* n tokens starting at token number first of the whole .bin, converted to int64. */
lunar_status lunar_indexed_read_i64(lunar_ctx *ctx, int64_t *dst, const lunar_indexed *d, int64_t first, int64_t n);

/* ---- writer ------------------------------------------------------------------------------------ */

typedef struct lunar_indexed_writer lunar_indexed_writer;

lunar_status lunar_indexed_writer_open(lunar_ctx *ctx, lunar_indexed_writer **out, const char *prefix, int dtype_code);
/* Append one sequence of n token ids (any values the dtype holds; floats are written exactly
 * when representable). */
lunar_status lunar_indexed_writer_add(lunar_ctx *ctx, lunar_indexed_writer *w, const int64_t *ids, int64_t n);
/* Close the current document: document_indices gets the sequence count so far. */
lunar_status lunar_indexed_writer_end_document(lunar_ctx *ctx, lunar_indexed_writer *w);
int64_t      lunar_indexed_writer_sequences(const lunar_indexed_writer *w);
int64_t      lunar_indexed_writer_documents(const lunar_indexed_writer *w);
int64_t      lunar_indexed_writer_tokens(const lunar_indexed_writer *w);
/* Write the .idx, commit both files, free w (also on failure). */
lunar_status lunar_indexed_writer_finish(lunar_ctx *ctx, lunar_indexed_writer *w);
/* Remove the temporaries and free w (NULL is fine). */
void         lunar_indexed_writer_abort(lunar_indexed_writer *w);

#ifdef __cplusplus
}
#endif

#endif
