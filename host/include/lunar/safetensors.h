/* safetensors.h: reading and writing safetensors files and sharded Hugging Face checkpoints.
 *
 * Format (docs/architecture.md section 9b has lunar's rules): an 8-byte little-endian header length N, N bytes
 * of JSON ({"__metadata__": {str: str}, "<name>": {"dtype", "shape", "data_offsets"}, ...}),
 * then the tensor bytes, row-major, with no holes.
 *
 * Reader: lunar_safetensors_open maps the file (private, copy-on-write: the file itself is
 * opened read-only and never changes, and a write into a view only changes this process's
 * copy) and validates the whole header before returning: header length, JSON object, known
 * dtype strings, shapes, data_offsets that match numel * element size and tile the data buffer
 * exactly (sorted by begin, no overlap, no hole, nothing left over), string metadata, no
 * duplicate keys. Every error names the file and the problem. Tensors come out as zero-copy
 * CPU views named after the tensor; each view holds a reference on the mapping, which is
 * unmapped when the file is closed and no view remains. (A tensor whose data is not aligned
 * to its element size, possible in files from other writers, is copied instead.)
 *
 * Writer: lunar_safetensors_save writes tensors of any dtype and device (non-contiguous views
 * in row-major order) laid out like the reference writer (dtype rank descending, then name),
 * with the header padded with spaces to a multiple of 8. It writes `<path>.tmp.<pid>`, fsyncs,
 * renames and fsyncs the directory, so a killed process never leaves a truncated file under
 * the final name.
 *
 * Checkpoints: lunar_checkpoint_open reads a single file, a `*.safetensors.index.json`
 * (weight_map), or a directory holding one of them; lunar_checkpoint_save writes
 * `model.safetensors`, or shards `model-%05d-of-%05d.safetensors` split at a size limit plus
 * `model.safetensors.index.json` when everything does not fit in one shard.
 */
#ifndef LUNAR_SAFETENSORS_H
#define LUNAR_SAFETENSORS_H

#include <stdint.h>

#include "lunar/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LUNAR_SAFETENSORS_MAX_HEADER 100000000ull   /* the reference reader's limit on N */

typedef struct lunar_safetensors lunar_safetensors;

typedef struct lunar_safetensors_info {
    const char    *name;
    const char    *file_dtype;   /* the dtype string in the file: "BF16", "F8_E4M3", "U16", ... */
    int            supported;    /* lunar has a tensor type for it (and ndim <= LUNAR_MAX_DIMS) */
    lunar_dtype    dtype;        /* when supported */
    int            ndim;
    const int64_t *shape;        /* ndim entries */
    uint64_t       begin, end;   /* data_offsets, relative to the data buffer */
} lunar_safetensors_info;

lunar_status lunar_safetensors_open(lunar_ctx *ctx, lunar_safetensors **out, const char *path);
/* Drops the file's reference on the mapping; views made by lunar_safetensors_tensor stay valid.
 * NULL is a no-op. */
void         lunar_safetensors_close(lunar_ctx *ctx, lunar_safetensors *f);

const char  *lunar_safetensors_path(const lunar_safetensors *f);
int          lunar_safetensors_count(const lunar_safetensors *f);
/* The i-th tensor in name order (strcmp), 0 <= i < count. */
const lunar_safetensors_info *lunar_safetensors_entry(const lunar_safetensors *f, int i);
/* NULL when the file has no tensor of that name. */
const lunar_safetensors_info *lunar_safetensors_find(const lunar_safetensors *f, const char *name);
/* __metadata__, in key order. */
int          lunar_safetensors_metadata_count(const lunar_safetensors *f);
void         lunar_safetensors_metadata_at(const lunar_safetensors *f, int i, const char **key, const char **value);
const char  *lunar_safetensors_metadata_get(const lunar_safetensors *f, const char *key);   /* NULL if absent */

/* out (empty) becomes a CPU view of the tensor, named after it. Fails naming the file and the
 * tensor when it is absent or its dtype has no lunar type ("unsupported dtype U16"). */
lunar_status lunar_safetensors_tensor(lunar_ctx *ctx, lunar_tensor *out, const lunar_safetensors *f,
                                      const char *name);

/* Writer options (all optional; pass NULL for none). */
typedef struct lunar_safetensors_write_opts {
    int                n_metadata;          /* __metadata__ entries (strings) */
    const char *const *metadata_keys;
    const char *const *metadata_values;
    /* Test hooks for the crash-safety tests: after this many bytes reached the temporary file
     * the write fails with LUNAR_ERR_IO (fail_kill = 0) or the process kills itself with
     * SIGKILL (fail_kill = 1), as if it died there. 0 = never. */
    uint64_t           fail_after_bytes;
    int                fail_kill;
} lunar_safetensors_write_opts;

/* Writes n tensors (names[i], tensors[i]); names must be unique and not "__metadata__". */
lunar_status lunar_safetensors_save(lunar_ctx *ctx, const char *path, int n, const char *const *names,
                                    const lunar_tensor *const *tensors, const lunar_safetensors_write_opts *opts);

/* ---- checkpoints (one file or a sharded index) ----------------------------------------------- */

typedef struct lunar_checkpoint lunar_checkpoint;

/* path: a .safetensors file; a .json index (its weight_map names shards next to it); or a
 * directory with model.safetensors.index.json, else model.safetensors, else exactly one
 * *.safetensors file. A shard the index names that does not exist, or a tensor the index maps
 * to a shard that does not hold it, is an error naming the index, the shard and the tensor.
 * Tensors come from the index's weight_map only (shard tensors it does not list are ignored,
 * as transformers does). */
lunar_status lunar_checkpoint_open(lunar_ctx *ctx, lunar_checkpoint **out, const char *path);
void         lunar_checkpoint_close(lunar_ctx *ctx, lunar_checkpoint *c);
/* The path of the index file, or of the single file. */
const char  *lunar_checkpoint_path(const lunar_checkpoint *c);
int          lunar_checkpoint_count(const lunar_checkpoint *c);
/* i-th tensor in name order, with the shard it lives in. */
const lunar_safetensors_info *lunar_checkpoint_entry(const lunar_checkpoint *c, int i,
                                                     const lunar_safetensors **shard);
const lunar_safetensors_info *lunar_checkpoint_find(const lunar_checkpoint *c, const char *name,
                                                    const lunar_safetensors **shard);
int          lunar_checkpoint_shard_count(const lunar_checkpoint *c);
const lunar_safetensors *lunar_checkpoint_shard(const lunar_checkpoint *c, int i);
lunar_status lunar_checkpoint_tensor(lunar_ctx *ctx, lunar_tensor *out, const lunar_checkpoint *c, const char *name);

/* Writes the n tensors into directory dir (created if missing), in the given order: one
 * model.safetensors when the tensor bytes fit in max_shard_bytes, else shards split before the
 * tensor that would overflow the current shard (a tensor larger than the limit gets a shard of
 * its own; tensors are never split) and model.safetensors.index.json with metadata.total_size
 * and the weight_map (keys sorted, 2-space indent). Each file is written atomically, the index
 * last; files of an earlier save into the same directory that the new layout does not use
 * (other model-NNNNN-of-NNNNN.safetensors shards, a stale index or model.safetensors) are
 * removed after the new files are in place. opts' metadata goes into every shard. */
lunar_status lunar_checkpoint_save(lunar_ctx *ctx, const char *dir, int n, const char *const *names,
                                   const lunar_tensor *const *tensors, uint64_t max_shard_bytes,
                                   const lunar_safetensors_write_opts *opts);

#ifdef __cplusplus
}
#endif

#endif
