/* io.h: file helpers shared by host/io and the Lua I/O bindings (not part of the public API).
 *
 * Atomic writes: lunar_afile_open creates `<path>.tmp.<pid>`; lunar_afile_commit fsyncs it,
 * renames it over path and fsyncs the directory; lunar_afile_abort removes it. A process killed
 * in between leaves at most the temporary file, never a truncated file under path.
 *
 * JSON: lunar_json_parse parses with cJSON and reports failures as "<what>: line L, column C:
 * <problem>"; lunar_json_read_file reads and parses a whole file. The JSON writer helpers append
 * to a growable buffer: strings escaped, numbers as exact integers or shortest round-trip
 * decimals.
 */
#ifndef LUNAR_IO_IO_H
#define LUNAR_IO_IO_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "lunar/ctx.h"
#include "lunar/tensor.h"

/* ---- atomic file writes ---------------------------------------------------------------------- */

typedef struct lunar_afile {
    int      fd;
    char    *path;          /* final name */
    char    *tmp;           /* <path>.tmp.<pid> */
    uint64_t written;
    uint64_t fail_after;    /* test hook (see lunar_safetensors_write_opts); 0 = never */
    int      fail_kill;
} lunar_afile;

lunar_status lunar_afile_open(lunar_ctx *ctx, lunar_afile *f, const char *path);
lunar_status lunar_afile_write(lunar_ctx *ctx, lunar_afile *f, const void *data, size_t n);
/* fsync, close, rename over the final name, fsync the directory; the temporary is removed on
 * failure. f is closed either way. */
lunar_status lunar_afile_commit(lunar_ctx *ctx, lunar_afile *f);
/* Close and remove the temporary file (safe after a failed write or on an unopened f). */
void         lunar_afile_abort(lunar_afile *f);
/* Whole buffer to path, atomically. */
lunar_status lunar_write_file_atomic(lunar_ctx *ctx, const char *path, const void *data, size_t n);

/* fsync the directory that holds path */
lunar_status lunar_fsync_parent_dir(lunar_ctx *ctx, const char *path);
/* mkdir -p; fails if path exists and is not a directory */
lunar_status lunar_mkdir_p(lunar_ctx *ctx, const char *path);
/* "a/b/c.json" -> "c.json" (pointer into path) */
const char  *lunar_path_base(const char *path);

/* ---- reading files --------------------------------------------------------------------------- */

/* The whole file, NUL-terminated (*n excludes the NUL). Caller frees *out. */
lunar_status lunar_read_file(lunar_ctx *ctx, const char *path, char **out, size_t *n);

/* ---- mapped files ---------------------------------------------------------------------------- */

/* A whole file mapped private and writable (copy-on-write: a write into a view never reaches the
 * file), shared by reference count between its reader and the tensors that view it, so a view
 * outlives the reader that made it. An empty file maps with base NULL. */
typedef struct lunar_mapped {
    void  *base;
    size_t size;
    int    refs;
} lunar_mapped;

lunar_status lunar_map_file(lunar_ctx *ctx, const char *path, lunar_mapped **out);
/* Drops one reference (NULL is a no-op); the last one unmaps. */
void         lunar_mapped_unref(lunar_mapped *m);
/* out = a zero-copy cpu tensor (dtype dt, shape) over bytes [p, p + nbytes) of m, holding a
 * reference to m. p must be aligned for dt. */
lunar_status lunar_mapped_view(lunar_ctx *ctx, lunar_tensor *out, lunar_mapped *m, void *p, size_t nbytes,
                               lunar_dtype dt, int ndim, const int64_t *shape);

/* ---- JSON ------------------------------------------------------------------------------------ */

/* Parses buf[0..n) as one JSON value (trailing whitespace allowed). what names the source in
 * errors ("config.json"). */
lunar_status lunar_json_parse(lunar_ctx *ctx, const char *what, const char *buf, size_t n, cJSON **out);
lunar_status lunar_json_read_file(lunar_ctx *ctx, const char *path, cJSON **out);

/* Which numbers of a valid JSON text are float literals (written with '.', 'e' or 'E'): one
 * byte per number, in document order, which is the order a depth-first walk of the parsed tree
 * meets them. Lets a reader keep 1.0 apart from 1 (transformers' strict configs reject an int
 * where a float is declared). Caller frees *flags. */
lunar_status lunar_json_float_flags(lunar_ctx *ctx, const char *buf, size_t n, unsigned char **flags, size_t *count);

/* A growable byte buffer (the JSON writers append to it). */
typedef struct lunar_buf {
    char  *data;
    size_t len, cap;
    int    oom;            /* set when a growth failed; later appends are no-ops */
} lunar_buf;

void lunar_buf_append(lunar_buf *b, const void *p, size_t n);
void lunar_buf_puts(lunar_buf *b, const char *s);
void lunar_buf_printf(lunar_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void lunar_buf_free(lunar_buf *b);
/* "..." with JSON escapes; bytes >= 0x80 are copied as they are (UTF-8 in, UTF-8 out) */
void lunar_json_put_string(lunar_buf *b, const char *s, size_t n);
/* integers with |v| < 2^53 exactly ("10000"), else the shortest %.{15,16,17}g that reads back
 * as v. Returns 0 for NaN and infinities, which JSON cannot hold. */
int  lunar_json_put_number(lunar_buf *b, double v);
/* the same, but always a float literal: "1.0" rather than "1" (like Python's repr) */
int  lunar_json_put_float(lunar_buf *b, double v);

#endif
