/* lua_data.c: data-pipeline bindings as core.data (the friendly API is lua/lunar/data/).
 *
 * core.data.indexed_open(prefix) -> dataset userdata (Megatron .bin/.idx, lunar/indexed.h).
 *   Indices are 0-based here; lua/lunar/data/indexed.lua makes them 1-based. Methods:
 *   prefix(), dtype() -> 'int32'..., dtype_code(), sequence_count(), document_count(),
 *   total_tokens(), multimodal(), length(seq), doc_index(i), lengths() -> i32 (S) copy,
 *   pointers() -> i64 (S), document_indices() -> i64 (D), modes() -> i8 (S) or nil,
 *   sequence(seq, offset, length) -> tensor view, document(doc) -> tensor view,
 *   tokens(first, n) -> Lua list of n ids from token number first of the .bin, close().
 * core.data.indexed_writer(prefix, dtype_code) -> writer userdata: add(ids) (a Lua list of
 *   integers or a contiguous CPU i64 tensor; one sequence), end_document(), counts() ->
 *   sequences, documents, tokens; finish(); abort(). A writer collected unfinished is aborted
 *   (its temporary files removed).
 * core.data.list_dir(path) -> sorted file names, sorted directory names (no . and ..).
 * core.data.utf8_error(s) -> nil if s is valid UTF-8, else the 1-based byte offset of the first
 *   invalid sequence (a stray or missing continuation byte, an overlong form, a surrogate, a
 *   code point above U+10FFFF, a sequence cut by the end).
 */
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lua_lunar.h"
#include "lunar/indexed.h"

#define DS_MT "lunar.IndexedDataset"
#define WR_MT "lunar.IndexedWriter"

typedef struct lua_ds { lunar_indexed *d; } lua_ds;
typedef struct lua_wr { lunar_indexed_writer *w; } lua_wr;

static lunar_indexed *check_ds(lua_State *L, int idx) {
    lua_ds *u = luaL_checkudata(L, idx, DS_MT);
    if (!u->d) lunar_lua_error(L, "indexed dataset used after close()");
    return u->d;
}

static lunar_indexed_writer *check_wr(lua_State *L, int idx) {
    lua_wr *u = luaL_checkudata(L, idx, WR_MT);
    if (!u->w) lunar_lua_error(L, "indexed dataset writer used after finish() or abort()");
    return u->w;
}

/* an integer argument in [lo, hi] */
static int64_t check_int(lua_State *L, int idx, const char *what, int64_t lo, int64_t hi) {
    double v = luaL_checknumber(L, idx);
    if (v != (double)(int64_t)v || (int64_t)v < lo || (int64_t)v > hi)
        lunar_lua_error(L, "%s %.17g is out of range [%lld, %lld]", what, v, (long long)lo, (long long)hi);
    return (int64_t)v;
}

static int l_open(lua_State *L) {
    const char *prefix = luaL_checkstring(L, 1);
    lua_ds *u = lua_newuserdata(L, sizeof *u);
    u->d = NULL;
    luaL_getmetatable(L, DS_MT);
    lua_setmetatable(L, -2);
    lunar_lua_check_status(L, lunar_indexed_open(lunar_lua_ctx(L), &u->d, prefix));
    return 1;
}

static int l_close(lua_State *L) {
    lua_ds *u = luaL_checkudata(L, 1, DS_MT);
    lunar_indexed_close(lunar_lua_ctx(L), u->d);
    u->d = NULL;
    return 0;
}

static int l_prefix(lua_State *L) {
    lua_pushstring(L, lunar_indexed_prefix(check_ds(L, 1)));
    return 1;
}

static int l_dtype(lua_State *L) {
    lua_pushstring(L, lunar_mmidx_dtype_name(lunar_indexed_dtype(check_ds(L, 1))));
    return 1;
}

static int l_dtype_code(lua_State *L) {
    lua_pushinteger(L, lunar_indexed_dtype(check_ds(L, 1)));
    return 1;
}

static int l_sequence_count(lua_State *L) {
    lua_pushnumber(L, (lua_Number)lunar_indexed_sequence_count(check_ds(L, 1)));
    return 1;
}

static int l_document_count(lua_State *L) {
    lua_pushnumber(L, (lua_Number)lunar_indexed_document_count(check_ds(L, 1)));
    return 1;
}

static int l_total_tokens(lua_State *L) {
    lua_pushnumber(L, (lua_Number)lunar_indexed_total_tokens(check_ds(L, 1)));
    return 1;
}

static int l_multimodal(lua_State *L) {
    lua_pushboolean(L, lunar_indexed_multimodal(check_ds(L, 1)));
    return 1;
}

static int l_length(lua_State *L) {
    lunar_indexed *d = check_ds(L, 1);
    int64_t s = check_int(L, 2, "sequence", 0, lunar_indexed_sequence_count(d) - 1);
    lua_pushnumber(L, lunar_indexed_length(d, s));
    return 1;
}

static int l_doc_index(lua_State *L) {
    lunar_indexed *d = check_ds(L, 1);
    int64_t i = check_int(L, 2, "document index", 0, lunar_indexed_document_count(d));
    lua_pushnumber(L, (lua_Number)lunar_indexed_doc_index(d, i));
    return 1;
}

/* one of the index arrays as a fresh tensor: 0 lengths, 1 pointers, 2 document indices, 3 modes */
static int push_array(lua_State *L, int which) {
    lunar_indexed *d = check_ds(L, 1);
    int64_t S = lunar_indexed_sequence_count(d), n = which == 2 ? lunar_indexed_document_count(d) + 1 : S;
    if (which == 3 && !lunar_indexed_multimodal(d)) {
        lua_pushnil(L);
        return 1;
    }
    lunar_dtype dt = which == 0 ? LUNAR_DTYPE_I32 : which == 3 ? LUNAR_DTYPE_I8 : LUNAR_DTYPE_I64;
    lunar_tensor *t = lunar_lua_new_tensor(L, dt, (lunar_device){LUNAR_DEVICE_CPU, 0}, 1, &n);
    void *p = lunar_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        if (which == 0) ((int32_t *)p)[i] = lunar_indexed_length(d, i);
        else if (which == 1) ((int64_t *)p)[i] = lunar_indexed_pointer(d, i);
        else if (which == 2) ((int64_t *)p)[i] = lunar_indexed_doc_index(d, i);
        else ((int8_t *)p)[i] = lunar_indexed_mode(d, i);
    }
    return 1;
}

static int l_lengths(lua_State *L) { return push_array(L, 0); }
static int l_pointers(lua_State *L) { return push_array(L, 1); }
static int l_document_indices(lua_State *L) { return push_array(L, 2); }
static int l_modes(lua_State *L) { return push_array(L, 3); }

static int l_sequence(lua_State *L) {
    lunar_indexed *d = check_ds(L, 1);
    int64_t s = check_int(L, 2, "sequence", 0, lunar_indexed_sequence_count(d) - 1);
    int64_t off = lua_isnoneornil(L, 3) ? 0 : check_int(L, 3, "offset", 0, INT32_MAX);
    int64_t len = lua_isnoneornil(L, 4) ? -1 : check_int(L, 4, "length", 0, INT32_MAX);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_tensor *t = lunar_lua_push_empty_tensor(L);
    lunar_lua_check_status(L, lunar_indexed_sequence(ctx, t, d, s, off, len));
    lunar_lua_check_status(L, lunar_scope_track(ctx, t->storage));   /* only copies (OWNED) are tracked */
    return 1;
}

static int l_document(lua_State *L) {
    lunar_indexed *d = check_ds(L, 1);
    int64_t doc = check_int(L, 2, "document", 0, lunar_indexed_document_count(d) - 1);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_tensor *t = lunar_lua_push_empty_tensor(L);
    lunar_lua_check_status(L, lunar_indexed_document(ctx, t, d, doc));
    lunar_lua_check_status(L, lunar_scope_track(ctx, t->storage));
    return 1;
}

static int l_tokens(lua_State *L) {
    lunar_indexed *d = check_ds(L, 1);
    int64_t total = lunar_indexed_total_tokens(d);
    int64_t first = check_int(L, 2, "first token", 0, total);
    int64_t n = check_int(L, 3, "token count", 0, total - first);
    int64_t chunk[512];
    lua_createtable(L, (int)n, 0);
    for (int64_t i = 0; i < n; i += 512) {
        int64_t k = n - i < 512 ? n - i : 512;
        lunar_lua_check_status(L, lunar_indexed_read_i64(lunar_lua_ctx(L), chunk, d, first + i, k));
        for (int64_t j = 0; j < k; j++) {
            lua_pushnumber(L, (lua_Number)chunk[j]);
            lua_rawseti(L, -2, (int)(i + j + 1));
        }
    }
    return 1;
}

static int l_ds_tostring(lua_State *L) {
    lua_ds *u = luaL_checkudata(L, 1, DS_MT);
    if (!u->d) {
        lua_pushstring(L, "lunar.data.IndexedDataset(closed)");
        return 1;
    }
    lua_pushfstring(L, "lunar.data.IndexedDataset(%s, %s, %f sequences, %f documents, %f tokens)",
                    lunar_indexed_prefix(u->d), lunar_mmidx_dtype_name(lunar_indexed_dtype(u->d)),
                    (double)lunar_indexed_sequence_count(u->d), (double)lunar_indexed_document_count(u->d),
                    (double)lunar_indexed_total_tokens(u->d));
    return 1;
}

/* ---- writer ------------------------------------------------------------------------------------ */

static int l_writer(lua_State *L) {
    const char *prefix = luaL_checkstring(L, 1);
    int code = (int)check_int(L, 2, "dtype code", 1, 8);
    lua_wr *u = lua_newuserdata(L, sizeof *u);
    u->w = NULL;
    luaL_getmetatable(L, WR_MT);
    lua_setmetatable(L, -2);
    lunar_lua_check_status(L, lunar_indexed_writer_open(lunar_lua_ctx(L), &u->w, prefix, code));
    return 1;
}

static int l_add(lua_State *L) {
    lunar_indexed_writer *w = check_wr(L, 1);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (lunar_lua_is_tensor(L, 2)) {
        lunar_tensor *t = lunar_lua_check_tensor(L, 2);
        if (t->dtype != LUNAR_DTYPE_I64 || !lunar_device_is_host(lunar_tensor_device(t)) ||
            !lunar_tensor_is_contiguous(t))
            return lunar_lua_error(L, "indexed writer add: tensor '%s' must be a contiguous CPU i64 tensor",
                                   lunar_tensor_label(t));
        lunar_lua_check_status(L, lunar_indexed_writer_add(ctx, w, lunar_tensor_data(t), lunar_tensor_numel(t)));
        return 0;
    }
    luaL_checktype(L, 2, LUA_TTABLE);
    int64_t n = (int64_t)lua_objlen(L, 2);
    /* a userdata buffer: collected with everything else if an error is raised below */
    int64_t *ids = lua_newuserdata(L, (size_t)(n > 0 ? n : 1) * sizeof *ids);
    for (int64_t i = 0; i < n; i++) {
        lua_rawgeti(L, 2, (int)(i + 1));
        double v = lua_tonumber(L, -1);
        int ok = lua_type(L, -1) == LUA_TNUMBER && v == (double)(int64_t)v;
        lua_pop(L, 1);
        if (!ok) return lunar_lua_error(L, "indexed writer add: token %lld is not an integer", (long long)(i + 1));
        ids[i] = (int64_t)v;
    }
    lunar_lua_check_status(L, lunar_indexed_writer_add(ctx, w, ids, n));
    return 0;
}

static int l_end_document(lua_State *L) {
    lunar_lua_check_status(L, lunar_indexed_writer_end_document(lunar_lua_ctx(L), check_wr(L, 1)));
    return 0;
}

static int l_counts(lua_State *L) {
    lunar_indexed_writer *w = check_wr(L, 1);
    lua_pushnumber(L, (lua_Number)lunar_indexed_writer_sequences(w));
    lua_pushnumber(L, (lua_Number)lunar_indexed_writer_documents(w));
    lua_pushnumber(L, (lua_Number)lunar_indexed_writer_tokens(w));
    return 3;
}

static int l_finish(lua_State *L) {
    lua_wr *u = luaL_checkudata(L, 1, WR_MT);
    lunar_indexed_writer *w = check_wr(L, 1);
    u->w = NULL;   /* finish frees it, also on failure */
    lunar_lua_check_status(L, lunar_indexed_writer_finish(lunar_lua_ctx(L), w));
    return 0;
}

static int l_abort(lua_State *L) {
    lua_wr *u = luaL_checkudata(L, 1, WR_MT);
    lunar_indexed_writer_abort(u->w);
    u->w = NULL;
    return 0;
}

/* ---- directories ------------------------------------------------------------------------------- */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int l_list_dir(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    DIR *dir = opendir(path);
    if (!dir) return lunar_lua_error(L, "%s: cannot list the directory: %s", path, strerror(errno));
    /* collect names in a Lua table first (no C allocation to leak on a memory error) */
    lua_newtable(L);   /* files */
    lua_newtable(L);   /* dirs */
    int nf = 0, nd = 0;
    size_t plen = strlen(path);
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        size_t n = plen + strlen(e->d_name) + 2;
        char full[4096];
        if (n > sizeof full) continue;
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        struct stat sb;
        if (stat(full, &sb) != 0) continue;
        if (S_ISDIR(sb.st_mode)) {
            lua_pushstring(L, e->d_name);
            lua_rawseti(L, -2, ++nd);
        } else if (S_ISREG(sb.st_mode)) {
            lua_pushstring(L, e->d_name);
            lua_rawseti(L, -3, ++nf);
        }
    }
    closedir(dir);
    /* sort both lists by byte order */
    for (int which = -2; which <= -1; which++) {
        int n = which == -2 ? nf : nd;
        const char **names = lua_newuserdata(L, (size_t)(n > 0 ? n : 1) * sizeof *names);
        int t = lua_gettop(L) + which;   /* the list, below the userdata */
        for (int i = 0; i < n; i++) {
            lua_rawgeti(L, t, i + 1);
            names[i] = lua_tostring(L, -1);
            lua_pop(L, 1);   /* still referenced by the table */
        }
        qsort(names, (size_t)n, sizeof *names, cmp_str);
        lua_createtable(L, n, 0);
        for (int i = 0; i < n; i++) {
            lua_pushstring(L, names[i]);
            lua_rawseti(L, -2, i + 1);
        }
        lua_replace(L, t);   /* the sorted list replaces the unsorted one */
        lua_pop(L, 1);       /* the userdata */
    }
    return 2;
}

/* the length of the valid UTF-8 sequence at p (n bytes left), or 0 if it is not one */
static size_t utf8_sequence(const unsigned char *p, size_t n) {
    unsigned c = p[0];
    if (c < 0x80) return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;   /* the range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;         /* overlong */
        else if (c == 0xED) hi = 0x9F;    /* surrogates U+D800..U+DFFF */
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;         /* overlong */
        else if (c == 0xF4) hi = 0x8F;    /* above U+10FFFF */
    } else {
        return 0;
    }
    if (n < len || p[1] < lo || p[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    return len;
}

static int l_utf8_error(lua_State *L) {
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    for (size_t i = 0; i < n;) {
        size_t len = utf8_sequence(s + i, n - i);
        if (len == 0) {
            lua_pushinteger(L, (lua_Integer)i + 1);
            return 1;
        }
        i += len;
    }
    lua_pushnil(L);
    return 1;
}

void lunar_lua_open_data(lua_State *L) {
    static const luaL_Reg ds_methods[] = {
        {"close", l_close}, {"prefix", l_prefix}, {"dtype", l_dtype}, {"dtype_code", l_dtype_code},
        {"sequence_count", l_sequence_count}, {"document_count", l_document_count},
        {"total_tokens", l_total_tokens}, {"multimodal", l_multimodal}, {"length", l_length},
        {"doc_index", l_doc_index}, {"lengths", l_lengths}, {"pointers", l_pointers},
        {"document_indices", l_document_indices}, {"modes", l_modes}, {"sequence", l_sequence},
        {"document", l_document}, {"tokens", l_tokens}, {NULL, NULL}};
    luaL_newmetatable(L, DS_MT);
    lua_newtable(L);
    lunar_lua_setfuncs(L, ds_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_close);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_ds_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);

    static const luaL_Reg wr_methods[] = {{"add", l_add}, {"end_document", l_end_document}, {"counts", l_counts},
                                          {"finish", l_finish}, {"abort", l_abort}, {NULL, NULL}};
    luaL_newmetatable(L, WR_MT);
    lua_newtable(L);
    lunar_lua_setfuncs(L, wr_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_abort);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);

    static const luaL_Reg fns[] = {{"indexed_open", l_open}, {"indexed_writer", l_writer}, {"list_dir", l_list_dir},
                                   {"utf8_error", l_utf8_error}, {NULL, NULL}};
    lua_newtable(L);
    lunar_lua_setfuncs(L, fns);
    lua_setfield(L, -2, "data");
}
