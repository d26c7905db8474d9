/* lua_fs.c: file-system helpers for checkpoints and metrics (core.fs) and TensorBoard records
 * (core.tb). The friendly users are lua/lunar/train/checkpoint.lua and metrics.lua.
 *
 *   core.fs.mkdir_p(path)             core.fs.mkdir(path) -> true | nil, err (EEXIST included)
 *   core.fs.list(dir) -> sorted names | nil, err          core.fs.stat(path) -> {type=, size=} | nil, err
 *   core.fs.fsync(path)               a file or a directory (opened read-only)
 *   core.fs.rename(old, new)          core.fs.exchange(a, b) -> true | false, why (RENAME_EXCHANGE)
 *   core.fs.remove_tree(path)         depth first, never follows links; a missing path is fine
 *   core.fs.crc32c(str[, crc]) -> u32 core.fs.crc32c_file(path) -> crc, size
 *   core.fs.sleep(s), getpid(), pid_alive(pid), isatty(fd), hostname(), wall_time()
 *   core.fs.realpath(path) -> absolute path | nil, err
 *   core.tb.record(data), file_version(wall_time), scalars(wall_time, step, {tags}, {values}),
 *   session_start(wall_time, step)
 *       -> the framed record bytes (see host/io/tfevents.h)
 *
 * Actions raise an error naming the path and the reason; probes (mkdir, list, stat) return
 * nil and the reason.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "io/io.h"
#include "io/tfevents.h"
#include "lua_lunar.h"

static int push_fail(lua_State *L, const char *path, int e) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(e));
    return 2;
}

static int l_mkdir_p(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    lunar_lua_check_status(L, lunar_mkdir_p(lunar_lua_ctx(L), path));
    return 0;
}

static int l_mkdir(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    if (mkdir(path, 0755) != 0) return push_fail(L, path, errno);
    lua_pushboolean(L, 1);
    return 1;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int l_list(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    DIR *d = opendir(path);
    if (!d) return push_fail(L, path, errno);
    size_t n = 0, cap = 0;
    char **names = NULL;
    int oom = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 32;
            char **nn = realloc(names, nc * sizeof *nn);
            if (!nn) { oom = 1; break; }
            names = nn;
            cap = nc;
        }
        if (!(names[n] = strdup(de->d_name))) { oom = 1; break; }
        n++;
    }
    closedir(d);
    if (!oom && n > 1) qsort(names, n, sizeof *names, cmp_str);
    /* the strings are freed before anything can raise */
    if (!oom) {
        lua_createtable(L, (int)n, 0);
        for (size_t i = 0; i < n; i++) {
            lua_pushstring(L, names[i]);
            lua_rawseti(L, -2, (int)i + 1);
        }
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (oom) return lunar_lua_error(L, "fs.list: %s: out of memory", path);
    return 1;
}

static int l_stat(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    struct stat st;
    if (lstat(path, &st) != 0) return push_fail(L, path, errno);
    lua_createtable(L, 0, 3);
    const char *type = S_ISREG(st.st_mode) ? "file" : S_ISDIR(st.st_mode) ? "dir" : S_ISLNK(st.st_mode) ? "link" : "other";
    lua_pushstring(L, type);
    lua_setfield(L, -2, "type");
    lua_pushnumber(L, (lua_Number)st.st_size);
    lua_setfield(L, -2, "size");
    lua_pushnumber(L, (lua_Number)st.st_mtim.tv_sec + 1e-9 * (lua_Number)st.st_mtim.tv_nsec);
    lua_setfield(L, -2, "mtime");
    return 1;
}

static int l_fsync(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return lunar_lua_error(L, "fs.fsync: cannot open %s: %s", path, strerror(errno));
    int rc = fsync(fd), e = errno;
    close(fd);
    /* EINVAL: the file system has no fsync for this kind of file (some dirs); nothing to do */
    if (rc != 0 && e != EINVAL) return lunar_lua_error(L, "fs.fsync: %s: %s", path, strerror(e));
    return 0;
}

static int l_rename(lua_State *L) {
    const char *from = luaL_checkstring(L, 1), *to = luaL_checkstring(L, 2);
    if (rename(from, to) != 0) return lunar_lua_error(L, "fs.rename: %s -> %s: %s", from, to, strerror(errno));
    return 0;
}

/* swap two existing paths atomically (renameat2 RENAME_EXCHANGE); false, why where the kernel
 * or the file system cannot */
static int l_exchange(lua_State *L) {
    const char *a = luaL_checkstring(L, 1), *b = luaL_checkstring(L, 2);
#ifdef RENAME_EXCHANGE
    if (renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) == 0) {
        lua_pushboolean(L, 1);
        return 1;
    }
    int e = errno;
    if (e != ENOSYS && e != EINVAL && e != ENOTSUP) return lunar_lua_error(L, "fs.exchange: %s <-> %s: %s", a, b, strerror(e));
    lua_pushboolean(L, 0);
    lua_pushstring(L, strerror(e));
#else
    (void)a;
    (void)b;
    lua_pushboolean(L, 0);
    lua_pushstring(L, "renameat2 RENAME_EXCHANGE is not available");
#endif
    return 2;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)ftw;
    int rc = (flag == FTW_DP) ? rmdir(path) : unlink(path);
    return rc == 0 ? 0 : (errno ? errno : EIO);
}

static int l_remove_tree(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return 0;
        return lunar_lua_error(L, "fs.remove_tree: %s: %s", path, strerror(errno));
    }
    int rc = nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (rc != 0) return lunar_lua_error(L, "fs.remove_tree: %s: %s", path, strerror(rc > 0 ? rc : errno));
    return 0;
}

static int l_crc32c(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    uint32_t crc = (uint32_t)luaL_optnumber(L, 2, 0);
    lua_pushnumber(L, (lua_Number)lunar_crc32c(crc, s, n));
    return 1;
}

static int l_crc32c_file(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return lunar_lua_error(L, "fs.crc32c_file: cannot open %s: %s", path, strerror(errno));
    size_t cap = (size_t)1 << 20;
    unsigned char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        return lunar_lua_error(L, "fs.crc32c_file: %s: out of memory", path);
    }
    uint32_t crc = 0;
    double total = 0;
    int e = 0;
    for (;;) {
        ssize_t r = read(fd, buf, cap);
        if (r < 0) {
            if (errno == EINTR) continue;
            e = errno;
            break;
        }
        if (r == 0) break;
        crc = lunar_crc32c(crc, buf, (size_t)r);
        total += (double)r;
    }
    free(buf);
    close(fd);
    if (e) return lunar_lua_error(L, "fs.crc32c_file: reading %s: %s", path, strerror(e));
    lua_pushnumber(L, (lua_Number)crc);
    lua_pushnumber(L, total);
    return 2;
}

static int l_sleep(lua_State *L) {
    double s = luaL_checknumber(L, 1);
    if (!(s > 0)) return 0;
    struct timespec ts = {(time_t)s, (long)((s - floor(s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
    return 0;
}

static int l_getpid(lua_State *L) {
    lua_pushnumber(L, (lua_Number)getpid());
    return 1;
}

static int l_pid_alive(lua_State *L) {
    lua_Number p = luaL_checknumber(L, 1);
    if (!(p > 0) || p != floor(p)) return lunar_lua_error(L, "fs.pid_alive: %g is not a process id", (double)p);
    int alive = kill((pid_t)p, 0) == 0 || errno == EPERM;
    lua_pushboolean(L, alive);
    return 1;
}

static int l_isatty(lua_State *L) {
    lua_pushboolean(L, isatty((int)luaL_optinteger(L, 1, 1)));
    return 1;
}

static int l_hostname(lua_State *L) {
    char buf[256];
    if (gethostname(buf, sizeof buf) != 0) snprintf(buf, sizeof buf, "localhost");
    buf[sizeof buf - 1] = 0;
    lua_pushstring(L, buf);
    return 1;
}

/* realpath(path) -> the absolute path with links resolved | nil, err (the path must exist) */
static int l_realpath(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    char *abs = realpath(path, NULL);
    if (!abs) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: %s", path, strerror(errno));
        return 2;
    }
    lua_pushstring(L, abs);
    free(abs);
    return 1;
}

static int l_wall_time(lua_State *L) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    lua_pushnumber(L, (lua_Number)ts.tv_sec + 1e-9 * (lua_Number)ts.tv_nsec);
    return 1;
}

/* ---- core.tb ---------------------------------------------------------------------------------- */

static int push_buf(lua_State *L, lunar_buf *b, const char *what) {
    if (b->oom) {
        lunar_buf_free(b);
        return lunar_lua_error(L, "tb.%s: out of memory", what);
    }
    lua_pushlstring(L, b->data ? b->data : "", b->len);
    lunar_buf_free(b);
    return 1;
}

static int l_tb_record(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    lunar_buf b = {0};
    lunar_tb_record(&b, s, n);
    return push_buf(L, &b, "record");
}

static int l_tb_file_version(lua_State *L) {
    lunar_buf b = {0};
    lunar_tb_file_version(&b, luaL_checknumber(L, 1));
    return push_buf(L, &b, "file_version");
}

static int l_tb_session_start(lua_State *L) {
    double wall = luaL_checknumber(L, 1);
    lua_Number step = luaL_checknumber(L, 2);
    if (step != floor(step) || fabs(step) > 9007199254740992.0)
        return lunar_lua_error(L, "tb.session_start: step %g is not an integer", (double)step);
    lunar_buf b = {0};
    lunar_tb_session_start(&b, wall, (int64_t)step);
    return push_buf(L, &b, "session_start");
}

#define TB_MAX_TAGS 256

static int l_tb_scalars(lua_State *L) {
    double wall = luaL_checknumber(L, 1);
    lua_Number step = luaL_checknumber(L, 2);
    luaL_checktype(L, 3, LUA_TTABLE);
    luaL_checktype(L, 4, LUA_TTABLE);
    if (step != floor(step) || fabs(step) > 9007199254740992.0)
        return lunar_lua_error(L, "tb.scalars: step %g is not an integer", (double)step);
    int n = (int)lua_objlen(L, 3);
    if (n != (int)lua_objlen(L, 4))
        return lunar_lua_error(L, "tb.scalars: %d tags but %d values", n, (int)lua_objlen(L, 4));
    if (n > TB_MAX_TAGS) return lunar_lua_error(L, "tb.scalars: %d tags, at most %d per event", n, TB_MAX_TAGS);
    const char *tags[TB_MAX_TAGS];
    size_t lens[TB_MAX_TAGS];
    double values[TB_MAX_TAGS];
    /* the tag strings stay referenced by the tables at 3 and 4 until we return */
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 3, i + 1);
        lua_rawgeti(L, 4, i + 1);
        if (lua_type(L, -2) != LUA_TSTRING) return lunar_lua_error(L, "tb.scalars: tag %d is not a string", i + 1);
        if (lua_type(L, -1) != LUA_TNUMBER) return lunar_lua_error(L, "tb.scalars: value %d is not a number", i + 1);
        tags[i] = lua_tolstring(L, -2, &lens[i]);
        values[i] = lua_tonumber(L, -1);
        lua_pop(L, 2);
    }
    lunar_buf b = {0};
    lunar_tb_scalars(&b, wall, (int64_t)step, n, tags, lens, values);
    return push_buf(L, &b, "scalars");
}

void lunar_lua_open_fs(lua_State *L) {
    static const luaL_Reg fs[] = {
        {"mkdir_p", l_mkdir_p}, {"mkdir", l_mkdir}, {"list", l_list}, {"stat", l_stat}, {"fsync", l_fsync},
        {"rename", l_rename}, {"exchange", l_exchange}, {"remove_tree", l_remove_tree}, {"crc32c", l_crc32c},
        {"crc32c_file", l_crc32c_file}, {"sleep", l_sleep}, {"getpid", l_getpid}, {"pid_alive", l_pid_alive},
        {"isatty", l_isatty}, {"hostname", l_hostname}, {"wall_time", l_wall_time}, {"realpath", l_realpath},
        {NULL, NULL}};
    static const luaL_Reg tb[] = {
        {"record", l_tb_record}, {"file_version", l_tb_file_version}, {"scalars", l_tb_scalars},
        {"session_start", l_tb_session_start}, {NULL, NULL}};
    lua_newtable(L);
    lunar_lua_setfuncs(L, fs);
    lua_setfield(L, -2, "fs");
    lua_newtable(L);
    lunar_lua_setfuncs(L, tb);
    lua_setfield(L, -2, "tb");
}
