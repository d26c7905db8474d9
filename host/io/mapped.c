/* mapped.c: whole files mapped into memory, shared by a reader and the tensors that view them
 * (safetensors files, Megatron .bin/.idx). See io.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io.h"

void lunar_mapped_unref(lunar_mapped *m) {
    if (!m || --m->refs > 0) return;
    if (m->base) munmap(m->base, m->size);
    free(m);
}

lunar_status lunar_map_file(lunar_ctx *ctx, const char *path, lunar_mapped **out) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    lunar_status st = LUNAR_OK;
    lunar_mapped *m = NULL;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: not a regular file", path);
    if (st == LUNAR_OK) {
        m = calloc(1, sizeof *m);
        if (!m) st = LUNAR_FAIL(ctx, LUNAR_ERR_OOM, "%s: out of memory", path);
    }
    if (st == LUNAR_OK) {
        m->refs = 1;
        m->size = (size_t)sb.st_size;
        if (m->size > 0) {
            /* private and writable: copy-on-write, so a write into a view can never reach the
             * file nor fault; no swap is reserved for pages that are never written */
            void *p = mmap(NULL, m->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
            if (p == MAP_FAILED) st = LUNAR_FAIL(ctx, LUNAR_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
            else m->base = p;
        }
    }
    close(fd);
    if (st != LUNAR_OK) {
        lunar_mapped_unref(m);
        return st;
    }
    *out = m;
    return LUNAR_OK;
}

/* release callback of a view's external storage: the view's reference to the mapping */
static void view_release(void *ud, void *data) {
    (void)data;
    lunar_mapped_unref(ud);
}

lunar_status lunar_mapped_view(lunar_ctx *ctx, lunar_tensor *out, lunar_mapped *m, void *p, size_t nbytes,
                               lunar_dtype dt, int ndim, const int64_t *shape) {
    lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
    lunar_storage *s;
    m->refs++;
    lunar_status st = lunar_storage_wrap(ctx, &s, cpu, p, nbytes, view_release, m);
    if (st != LUNAR_OK) {
        m->refs--;
        return st;
    }
    st = lunar_tensor_from_storage(ctx, out, s, dt, 0, ndim, shape);
    lunar_storage_release(ctx, s);   /* the view holds the storage now (or it is gone) */
    return st;
}
