/* fileio.c: atomic file writes, whole-file reads, mkdir -p, and the growable buffer. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io.h"

const char *lunar_path_base(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* ---- atomic writes ---------------------------------------------------------------------------- */

lunar_status lunar_afile_open(lunar_ctx *ctx, lunar_afile *f, const char *path) {
    memset(f, 0, sizeof *f);
    f->fd = -1;
    size_t n = strlen(path) + 48;
    f->path = strdup(path);
    f->tmp = malloc(n);
    if (!f->path || !f->tmp) {
        lunar_afile_abort(f);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    }
    snprintf(f->tmp, n, "%s.tmp.%ld", path, (long)getpid());
    /* a file left by a killed process with the same pid is ours to replace */
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (f->fd < 0) {
        int e = errno;
        free(f->tmp);
        f->tmp = NULL;   /* nothing to remove */
        lunar_afile_abort(f);
        return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot create the temporary file for writing: %s", path,
                          strerror(e));
    }
    return LUNAR_OK;
}

lunar_status lunar_afile_write(lunar_ctx *ctx, lunar_afile *f, const void *data, size_t n) {
    const char *p = data;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        if (f->fail_after) {
            if (f->written >= f->fail_after) {
                if (f->fail_kill) raise(SIGKILL);
                return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: write failed after %llu bytes (injected failure)", f->path,
                                  (unsigned long long)f->written);
            }
            if (f->written + chunk > f->fail_after) chunk = (size_t)(f->fail_after - f->written);
        }
        ssize_t w = write(f->fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: write failed after %llu bytes: %s", f->path,
                              (unsigned long long)f->written, strerror(errno));
        }
        p += w;
        n -= (size_t)w;
        f->written += (uint64_t)w;
    }
    return LUNAR_OK;
}

lunar_status lunar_fsync_parent_dir(lunar_ctx *ctx, const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash) dir = strdup(".");
    else if (slash == path) dir = strdup("/");
    else dir = strndup(path, (size_t)(slash - path));
    if (!dir) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    lunar_status st = LUNAR_OK;
    if (fd < 0) {
        st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot open directory '%s' to sync it: %s", path, dir, strerror(errno));
    } else {
        /* some file systems do not support fsync on directories (EINVAL): nothing more to do there */
        if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS)
            st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: fsync of directory '%s' failed: %s", path, dir, strerror(errno));
        close(fd);
    }
    free(dir);
    return st;
}

lunar_status lunar_afile_commit(lunar_ctx *ctx, lunar_afile *f) {
    lunar_status st = LUNAR_OK;
    if (fsync(f->fd) != 0) st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: fsync failed: %s", f->path, strerror(errno));
    if (close(f->fd) != 0 && st == LUNAR_OK)
        st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: close failed: %s", f->path, strerror(errno));
    f->fd = -1;
    if (st == LUNAR_OK && rename(f->tmp, f->path) != 0)
        st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot rename the temporary file into place: %s", f->path,
                        strerror(errno));
    if (st != LUNAR_OK) {
        lunar_afile_abort(f);
        return st;
    }
    free(f->tmp);
    f->tmp = NULL;
    st = lunar_fsync_parent_dir(ctx, f->path);
    lunar_afile_abort(f);   /* frees the names */
    return st;
}

void lunar_afile_abort(lunar_afile *f) {
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
    if (f->tmp) unlink(f->tmp);
    free(f->tmp);
    free(f->path);
    f->tmp = NULL;
    f->path = NULL;
}

lunar_status lunar_write_file_atomic(lunar_ctx *ctx, const char *path, const void *data, size_t n) {
    lunar_afile f;
    LUNAR_TRY(lunar_afile_open(ctx, &f, path));
    lunar_status st = lunar_afile_write(ctx, &f, data, n);
    if (st != LUNAR_OK) {
        lunar_afile_abort(&f);
        return st;
    }
    return lunar_afile_commit(ctx, &f);
}

lunar_status lunar_mkdir_p(lunar_ctx *ctx, const char *path) {
    char *p = strdup(path);
    if (!p) return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') p[--n] = 0;
    for (char *s = p + 1;; s++) {
        char c = *s;
        if (c == '/' || c == 0) {
            *s = 0;
            if (mkdir(p, 0755) != 0 && errno != EEXIST) {
                lunar_status st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot create directory '%s': %s", path, p,
                                             strerror(errno));
                free(p);
                return st;
            }
            *s = c;
            if (c == 0) break;
        }
    }
    struct stat sb;
    lunar_status st = LUNAR_OK;
    if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode))
        st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: exists and is not a directory", path);
    free(p);
    return st;
}

/* ---- reading --------------------------------------------------------------------------------- */

lunar_status lunar_read_file(lunar_ctx *ctx, const char *path, char **out, size_t *n) {
    *out = NULL;
    *n = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: not a regular file", path);
    }
    size_t size = (size_t)sb.st_size;
    char *buf = malloc(size + 1);
    if (!buf) {
        close(fd);
        return LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: cannot allocate %zu bytes to read it", path, size);
    }
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got != size) {
        free(buf);
        return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: short read (%zu of %zu bytes)", path, got, size);
    }
    buf[size] = 0;
    *out = buf;
    *n = size;
    return LUNAR_OK;
}

/* ---- growable buffer ------------------------------------------------------------------------- */

static int buf_reserve(lunar_buf *b, size_t extra) {
    if (b->oom) return 0;
    if (b->len + extra + 1 <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) {
        b->oom = 1;
        return 0;
    }
    b->data = d;
    b->cap = cap;
    return 1;
}

void lunar_buf_append(lunar_buf *b, const void *p, size_t n) {
    if (!buf_reserve(b, n)) return;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

void lunar_buf_puts(lunar_buf *b, const char *s) { lunar_buf_append(b, s, strlen(s)); }

void lunar_buf_printf(lunar_buf *b, const char *fmt, ...) {
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        lunar_buf_append(b, small, (size_t)n);
        return;
    }
    if (!buf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void lunar_buf_free(lunar_buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}
