/* lua_io.c: checkpoint and JSON bindings as core.io (the friendly API is lua/lunar/io.lua).
 *
 * core.io.open(path, kind) -> checkpoint userdata; kind 'file' (one .safetensors file) or 'any'
 *   (a file, an index .json, or a directory). Methods: keys() (sorted), info(name) -> table or
 *   nil, tensor(name) -> CPU view named after the tensor, metadata() -> {str = str}, shards()
 *   -> {paths}, path(), close().
 * core.io.save_safetensors(path, names, tensors, metadata, fail_after_bytes, fail_kill)
 * core.io.save_checkpoint(dir, names, tensors, max_shard_bytes, metadata, fail_after_bytes, fail_kill)
 * core.io.read_json(path) / decode_json(string, what) -> Lua value; JSON null is core.io.null
 *   (a NULL light userdata); an empty JSON array comes back as an empty table with metatable
 *   core.io.array_mt, so that it is written back as [].
 * core.io.encode_json(value) -> string; core.io.write_json(path, value) writes atomically (so does
 *   write_file(path, bytes)). Keys are sorted and the layout is json.dumps(indent=2,
 *   sort_keys=True) + "\n", like transformers' config.json. Numbers read as float literals (1.0)
 *   are written back as floats: the tables that hold them carry the metatable
 *   {__json_floats = {key = true}} (transformers' strict config classes reject 1 where a float is
 *   declared).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/io.h"
#include "lua_lunar.h"
#include "lunar/safetensors.h"

#define CKPT_MT     "lunar.Checkpoint"
#define ARRAY_MT    "lunar.io.array_mt"
#define JSON_DEPTH  200

typedef struct lua_ckpt { lunar_checkpoint *c; } lua_ckpt;

static lunar_checkpoint *check_ckpt(lua_State *L, int idx) {
    lua_ckpt *u = luaL_checkudata(L, idx, CKPT_MT);
    if (!u->c) lunar_lua_error(L, "checkpoint used after close()");
    return u->c;
}

static int l_open(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    const char *kind = luaL_optstring(L, 2, "any");
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (strcmp(kind, "file") == 0) {
        struct stat sb;
        size_t n = strlen(path);
        if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
            return lunar_lua_error(L, "%s: is a directory; safetensors_open takes one .safetensors file "
                                      "(load_checkpoint reads directories)", path);
        if (n >= 5 && strcmp(path + n - 5, ".json") == 0)
            return lunar_lua_error(L, "%s: is an index file; safetensors_open takes one .safetensors file "
                                      "(load_checkpoint reads sharded checkpoints)", path);
    }
    lua_ckpt *u = lua_newuserdata(L, sizeof *u);
    u->c = NULL;
    luaL_getmetatable(L, CKPT_MT);
    lua_setmetatable(L, -2);
    lunar_lua_check_status(L, lunar_checkpoint_open(ctx, &u->c, path));
    return 1;
}

static int l_close(lua_State *L) {
    lua_ckpt *u = luaL_checkudata(L, 1, CKPT_MT);
    if (u->c) lunar_checkpoint_close(lunar_lua_ctx(L), u->c);
    u->c = NULL;
    return 0;
}

static int l_path(lua_State *L) {
    lua_pushstring(L, lunar_checkpoint_path(check_ckpt(L, 1)));
    return 1;
}

static int l_keys(lua_State *L) {
    lunar_checkpoint *c = check_ckpt(L, 1);
    int n = lunar_checkpoint_count(c);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushstring(L, lunar_checkpoint_entry(c, i, NULL)->name);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_info(lua_State *L) {
    lunar_checkpoint *c = check_ckpt(L, 1);
    const char *name = luaL_checkstring(L, 2);
    const lunar_safetensors *shard;
    const lunar_safetensors_info *e = lunar_checkpoint_find(c, name, &shard);
    if (!e) {
        lua_pushnil(L);
        return 1;
    }
    lua_createtable(L, 0, 7);
    lua_pushstring(L, e->supported ? lunar_dtype_name(e->dtype) : e->file_dtype);
    lua_setfield(L, -2, "dtype");
    lua_pushstring(L, e->file_dtype);
    lua_setfield(L, -2, "file_dtype");
    lua_pushboolean(L, e->supported);
    lua_setfield(L, -2, "supported");
    lua_createtable(L, e->ndim, 0);
    for (int d = 0; d < e->ndim; d++) {
        lua_pushnumber(L, (lua_Number)e->shape[d]);
        lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "shape");
    lua_createtable(L, 2, 0);
    lua_pushnumber(L, (lua_Number)e->begin);
    lua_rawseti(L, -2, 1);
    lua_pushnumber(L, (lua_Number)e->end);
    lua_rawseti(L, -2, 2);
    lua_setfield(L, -2, "data_offsets");
    lua_pushnumber(L, (lua_Number)(e->end - e->begin));
    lua_setfield(L, -2, "nbytes");
    lua_pushstring(L, lunar_safetensors_path(shard));
    lua_setfield(L, -2, "file");
    return 1;
}

static int l_tensor(lua_State *L) {
    lunar_checkpoint *c = check_ckpt(L, 1);
    const char *name = luaL_checkstring(L, 2);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_tensor *t = lunar_lua_push_empty_tensor(L);   /* owns the view from here on */
    lunar_lua_check_status(L, lunar_checkpoint_tensor(ctx, t, c, name));
    lunar_lua_check_status(L, lunar_scope_track(ctx, t->storage));   /* only copies (OWNED) are tracked */
    return 1;
}

/* __metadata__ of every shard, merged (the first shard that has a key wins) */
static int l_metadata(lua_State *L) {
    lunar_checkpoint *c = check_ckpt(L, 1);
    lua_newtable(L);
    for (int s = 0; s < lunar_checkpoint_shard_count(c); s++) {
        const lunar_safetensors *f = lunar_checkpoint_shard(c, s);
        for (int i = 0; i < lunar_safetensors_metadata_count(f); i++) {
            const char *k, *v;
            lunar_safetensors_metadata_at(f, i, &k, &v);
            lua_getfield(L, -1, k);
            int have = !lua_isnil(L, -1);
            lua_pop(L, 1);
            if (have) continue;
            lua_pushstring(L, v);
            lua_setfield(L, -2, k);
        }
    }
    return 1;
}

static int l_shards(lua_State *L) {
    lunar_checkpoint *c = check_ckpt(L, 1);
    int n = lunar_checkpoint_shard_count(c);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushstring(L, lunar_safetensors_path(lunar_checkpoint_shard(c, i)));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_tostring(lua_State *L) {
    lua_ckpt *u = luaL_checkudata(L, 1, CKPT_MT);
    if (!u->c) lua_pushstring(L, "lunar.Checkpoint (closed)");
    else
        lua_pushfstring(L, "lunar.Checkpoint('%s', %d tensors in %d file%s)", lunar_checkpoint_path(u->c),
                        lunar_checkpoint_count(u->c), lunar_checkpoint_shard_count(u->c),
                        lunar_checkpoint_shard_count(u->c) == 1 ? "" : "s");
    return 1;
}

/* ---- saving ------------------------------------------------------------------------------------ */

typedef struct save_args {
    int                  n, n_meta;
    const char         **names;
    const lunar_tensor **tensors;
    const char         **meta_keys, **meta_values;
} save_args;

/* names (array of strings) at ni, tensors (array) at ti, metadata ({str = str} or nil) at mi.
 * The arrays live in a userdata left on the stack, so they are freed by the GC even when a
 * check below raises. */
static void collect_save_args(lua_State *L, int ni, int ti, int mi, save_args *a) {
    luaL_checktype(L, ni, LUA_TTABLE);
    luaL_checktype(L, ti, LUA_TTABLE);
    int n = (int)lua_objlen(L, ni), nm = 0;
    if ((int)lua_objlen(L, ti) != n) lunar_lua_error(L, "save: %d names but %d tensors", n, (int)lua_objlen(L, ti));
    if (!lua_isnoneornil(L, mi)) {
        luaL_checktype(L, mi, LUA_TTABLE);
        lua_pushnil(L);
        while (lua_next(L, mi)) {
            nm++;
            lua_pop(L, 1);
        }
    }
    size_t bytes = sizeof(void *) * (size_t)(2 * n + 2 * nm + 1);
    void **mem = lua_newuserdata(L, bytes);
    memset(mem, 0, bytes);
    a->n = n;
    a->n_meta = nm;
    a->names = (const char **)mem;
    a->tensors = (const lunar_tensor **)(mem + n);
    a->meta_keys = (const char **)(mem + 2 * n);
    a->meta_values = (const char **)(mem + 2 * n + nm);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, ni, i + 1);
        if (lua_type(L, -1) != LUA_TSTRING) lunar_lua_error(L, "save: name %d is not a string", i + 1);
        a->names[i] = lua_tostring(L, -1);   /* anchored by the names table */
        lua_pop(L, 1);
        lua_rawgeti(L, ti, i + 1);
        if (!lunar_lua_is_tensor(L, -1)) lunar_lua_error(L, "save: '%s' is not a tensor (a %s)", a->names[i], luaL_typename(L, -1));
        a->tensors[i] = lunar_lua_check_tensor(L, -1);   /* anchored by the tensors table */
        lua_pop(L, 1);
    }
    int k = 0;
    if (nm > 0) {
        lua_pushnil(L);
        while (lua_next(L, mi)) {
            if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING)
                lunar_lua_error(L, "save: metadata must map strings to strings (got %s = %s)", luaL_typename(L, -2),
                                luaL_typename(L, -1));
            a->meta_keys[k] = lua_tostring(L, -2);
            a->meta_values[k] = lua_tostring(L, -1);
            k++;
            lua_pop(L, 1);
        }
    }
}

static int l_save_safetensors(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    save_args a;
    collect_save_args(L, 2, 3, 4, &a);
    lunar_safetensors_write_opts o = {a.n_meta, a.meta_keys, a.meta_values, (uint64_t)luaL_optnumber(L, 5, 0),
                                      lua_toboolean(L, 6)};
    lunar_lua_check_status(L, lunar_safetensors_save(lunar_lua_ctx(L), path, a.n, a.names, a.tensors, &o));
    return 0;
}

static int l_save_checkpoint(lua_State *L) {
    const char *dir = luaL_checkstring(L, 1);
    double max = luaL_checknumber(L, 4);
    if (!(max >= 1)) return lunar_lua_error(L, "save_checkpoint: max_shard_bytes must be >= 1, got %g", max);
    save_args a;
    collect_save_args(L, 2, 3, 5, &a);
    lunar_safetensors_write_opts o = {a.n_meta, a.meta_keys, a.meta_values, (uint64_t)luaL_optnumber(L, 6, 0),
                                      lua_toboolean(L, 7)};
    lunar_lua_check_status(L, lunar_checkpoint_save(lunar_lua_ctx(L), dir, a.n, a.names, a.tensors, (uint64_t)max, &o));
    return 0;
}

/* ---- JSON -> Lua ------------------------------------------------------------------------------- */

/* Float literals: a table whose members include numbers written as floats (1.0, 2.5, 1e-05)
 * gets the metatable {__json_floats = {key = true}}, so write_json writes 1.0 back as 1.0. */
typedef struct dec {
    const unsigned char *flags;   /* per number, in document order */
    size_t               n, next;
} dec;

static void push_json(lua_State *L, const cJSON *v, int depth, dec *d);

/* pushes child c of a container; returns whether it is a number written as a float literal */
static int push_child(lua_State *L, const cJSON *c, int depth, dec *d) {
    int is_float = 0;
    if (cJSON_IsNumber(c)) {
        is_float = d->next < d->n && d->flags[d->next];
        d->next++;
    }
    push_json(L, c, depth + 1, d);
    return is_float;
}

/* sets {__json_floats = floats} on the table below the float set (floats at the top, popped) */
static void attach_floats(lua_State *L, int have) {
    if (!have) return;
    lua_createtable(L, 0, 1);
    lua_insert(L, -2);
    lua_setfield(L, -2, "__json_floats");
    lua_setmetatable(L, -2);
}

static void push_json(lua_State *L, const cJSON *v, int depth, dec *d) {
    if (depth > JSON_DEPTH) lunar_lua_error(L, "JSON nested more than %d levels deep", JSON_DEPTH);
    luaL_checkstack(L, 6, "JSON nesting");
    if (cJSON_IsNull(v)) {
        lua_pushlightuserdata(L, NULL);
    } else if (cJSON_IsBool(v)) {
        lua_pushboolean(L, cJSON_IsTrue(v));
    } else if (cJSON_IsNumber(v)) {
        lua_pushnumber(L, v->valuedouble);
    } else if (cJSON_IsString(v)) {
        lua_pushstring(L, v->valuestring);
    } else if (cJSON_IsArray(v)) {
        int n = cJSON_GetArraySize(v), i = 0, have = 0;
        lua_createtable(L, n, 0);
        int t = lua_gettop(L);
        lua_newtable(L);   /* float set */
        for (const cJSON *c = v->child; c; c = c->next) {
            int f = push_child(L, c, depth, d);
            lua_rawseti(L, t, ++i);
            if (f) {
                lua_pushboolean(L, 1);
                lua_rawseti(L, t + 1, i);
                have = 1;
            }
        }
        if (!have) lua_pop(L, 1);
        attach_floats(L, have);
        if (n == 0) {
            luaL_getmetatable(L, ARRAY_MT);
            lua_setmetatable(L, -2);
        }
    } else if (cJSON_IsObject(v)) {
        lua_createtable(L, 0, cJSON_GetArraySize(v));
        int t = lua_gettop(L), have = 0;
        lua_newtable(L);   /* float set */
        for (const cJSON *c = v->child; c; c = c->next) {   /* a repeated key: the last one wins */
            int f = push_child(L, c, depth, d);
            lua_setfield(L, t, c->string);
            lua_pushboolean(L, f);
            lua_setfield(L, t + 1, c->string);
            have |= f;
        }
        if (!have) lua_pop(L, 1);
        attach_floats(L, have);
    } else {
        lua_pushnil(L);
    }
}

/* the tree and flags are freed whatever happens while converting: convert under pcall */
typedef struct tree_args {
    const cJSON *root;
    dec          d;
} tree_args;

static int push_json_protected(lua_State *L) {
    tree_args *a = lua_touserdata(L, 1);
    push_json(L, a->root, 0, &a->d);
    return 1;
}

/* text buf[0..n) -> Lua value; what names the source in errors */
static int push_text(lua_State *L, const char *what, const char *buf, size_t n) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    cJSON *root;
    lunar_status st = lunar_json_parse(ctx, what, buf, n, &root);
    if (st != LUNAR_OK) return lunar_lua_check_status(L, st);
    unsigned char *flags = NULL;
    tree_args a = {root, {NULL, 0, 0}};
    st = lunar_json_float_flags(ctx, buf, n, &flags, &a.d.n);
    if (st != LUNAR_OK) {
        cJSON_Delete(root);
        return lunar_lua_check_status(L, st);
    }
    a.d.flags = flags;
    lua_pushcfunction(L, push_json_protected);
    lua_pushlightuserdata(L, &a);
    int rc = lua_pcall(L, 1, 1, 0);
    cJSON_Delete(root);
    free(flags);
    if (rc != 0) return lua_error(L);
    return 1;
}

static int l_read_json(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    char *buf;
    size_t n;
    lunar_lua_check_status(L, lunar_read_file(lunar_lua_ctx(L), path, &buf, &n));
    /* the buffer must not leak if a Lua error is raised: keep it in a Lua string */
    lua_pushlstring(L, buf, n);
    free(buf);
    size_t len;
    const char *s = lua_tolstring(L, -1, &len);
    return push_text(L, path, s, len);
}

static int l_decode_json(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    const char *what = luaL_optstring(L, 2, "JSON string");
    return push_text(L, what, s, n);
}

/* ---- Lua -> JSON ------------------------------------------------------------------------------- */

typedef struct enc {
    lua_State *L;
    lunar_buf  b;
    char       err[512];
    char       path[256];   /* where in the value ("config.rope_parameters") */
} enc;

static int enc_fail(enc *e, const char *fmt, const char *detail) {
    if (!e->err[0]) snprintf(e->err, sizeof e->err, fmt, e->path[0] ? e->path : "(top level)", detail);
    return 0;
}

static void indent(lunar_buf *b, int depth) {
    lunar_buf_puts(b, "\n");
    for (int i = 0; i < depth; i++) lunar_buf_puts(b, "  ");
}

static int cmp_cstr(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

static int encode(enc *e, int idx, int depth, int as_float);

/* pushes the __json_floats set of the table at idx, or nil */
static void push_float_set(lua_State *L, int idx) {
    if (!lua_getmetatable(L, idx)) {
        lua_pushnil(L);
        return;
    }
    lua_getfield(L, -1, "__json_floats");
    lua_remove(L, -2);
    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        lua_pushnil(L);
    }
}

/* is the member (key at the top of the stack) of the float set at fs marked? pops the key */
static int marked(lua_State *L, int fs) {
    if (lua_isnil(L, fs)) {
        lua_pop(L, 1);
        return 0;
    }
    lua_rawget(L, fs);
    int m = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return m;
}

/* path bookkeeping: append ".key" or "[i]"; restore with the returned length */
static size_t path_push(enc *e, const char *key, int index) {
    size_t len = strlen(e->path);
    if (key) snprintf(e->path + len, sizeof e->path - len, "%s%s", len ? "." : "", key);
    else snprintf(e->path + len, sizeof e->path - len, "[%d]", index);
    return len;
}

static int encode_table(enc *e, int idx, int depth) {
    lua_State *L = e->L;
    if (depth > JSON_DEPTH) return enc_fail(e, "%s: nested more than 200 levels (a cycle?)%s", "");
    luaL_checkstack(L, 6, "JSON nesting");
    int is_array_mt = 0;
    if (lua_getmetatable(L, idx)) {
        luaL_getmetatable(L, ARRAY_MT);
        is_array_mt = lua_rawequal(L, -1, -2);
        lua_pop(L, 2);
    }
    int count = 0, all_int = 1, all_str = 1;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        count++;
        if (lua_type(L, -2) == LUA_TSTRING) all_int = 0;
        else if (lua_type(L, -2) == LUA_TNUMBER) {
            all_str = 0;
            double k = lua_tonumber(L, -2);
            if (k < 1 || k != floor(k)) all_int = 0;
        } else {
            all_int = all_str = 0;
        }
        lua_pop(L, 1);
    }
    int n = (int)lua_objlen(L, idx);
    push_float_set(L, idx);
    int fs = lua_gettop(L), ok = 1;
    if (is_array_mt || (count > 0 && all_int && n == count)) {
        if (n == 0) {
            lunar_buf_puts(&e->b, "[]");
            lua_pop(L, 1);
            return 1;
        }
        lunar_buf_puts(&e->b, "[");
        for (int i = 1; i <= n && ok; i++) {
            if (i > 1) lunar_buf_puts(&e->b, ",");
            indent(&e->b, depth + 1);
            size_t saved = path_push(e, NULL, i);
            lua_pushinteger(L, i);
            int as_float = marked(L, fs);
            lua_rawgeti(L, idx, i);
            ok = encode(e, lua_gettop(L), depth + 1, as_float);
            lua_pop(L, 1);
            e->path[saved] = 0;
        }
        lua_pop(L, 1);
        if (!ok) return 0;
        indent(&e->b, depth);
        lunar_buf_puts(&e->b, "]");
        return 1;
    }
    if (count == 0) {
        lunar_buf_puts(&e->b, "{}");
        lua_pop(L, 1);
        return 1;
    }
    if (!all_str) {
        lua_pop(L, 1);
        return enc_fail(e, "%s: a table must be an array (keys 1..n) or have only string keys%s", "");
    }
    const char **keys = malloc(sizeof *keys * (size_t)count);
    if (!keys) {
        lua_pop(L, 1);
        return enc_fail(e, "%s: out of memory%s", "");
    }
    int k = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        keys[k++] = lua_tostring(L, -2);   /* the keys stay anchored by the table */
        lua_pop(L, 1);
    }
    qsort(keys, (size_t)k, sizeof *keys, cmp_cstr);
    lunar_buf_puts(&e->b, "{");
    for (int i = 0; i < k && ok; i++) {
        if (i) lunar_buf_puts(&e->b, ",");
        indent(&e->b, depth + 1);
        lunar_json_put_string(&e->b, keys[i], strlen(keys[i]));
        lunar_buf_puts(&e->b, ": ");
        size_t saved = path_push(e, keys[i], 0);
        lua_pushstring(L, keys[i]);
        int as_float = marked(L, fs);
        lua_pushstring(L, keys[i]);
        lua_rawget(L, idx);
        ok = encode(e, lua_gettop(L), depth + 1, as_float);
        lua_pop(L, 1);
        e->path[saved] = 0;
    }
    free(keys);
    lua_pop(L, 1);
    if (!ok) return 0;
    indent(&e->b, depth);
    lunar_buf_puts(&e->b, "}");
    return 1;
}

static int encode(enc *e, int idx, int depth, int as_float) {
    lua_State *L = e->L;
    switch (lua_type(L, idx)) {
    case LUA_TNIL:
        lunar_buf_puts(&e->b, "null");
        return 1;
    case LUA_TBOOLEAN:
        lunar_buf_puts(&e->b, lua_toboolean(L, idx) ? "true" : "false");
        return 1;
    case LUA_TNUMBER:
        if (!(as_float ? lunar_json_put_float : lunar_json_put_number)(&e->b, lua_tonumber(L, idx)))
            return enc_fail(e, "%s: %s cannot be written as JSON", isnan(lua_tonumber(L, idx)) ? "NaN" : "an infinity");
        return 1;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        lunar_json_put_string(&e->b, s, n);
        return 1;
    }
    case LUA_TLIGHTUSERDATA:
        if (lua_touserdata(L, idx) == NULL) {
            lunar_buf_puts(&e->b, "null");
            return 1;
        }
        break;
    case LUA_TTABLE:
        return encode_table(e, idx, depth);
    default:
        break;
    }
    return enc_fail(e, "%s: a %s cannot be written as JSON", luaL_typename(L, idx));
}

/* value at idx -> JSON text in e->b (NUL-terminated); raises naming the bad spot */
static void encode_value(lua_State *L, int idx, enc *e) {
    memset(e, 0, sizeof *e);
    e->L = L;
    int ok = encode(e, idx, 0, 0);
    if (ok) lunar_buf_puts(&e->b, "\n");
    if (ok && e->b.oom) {
        ok = 0;
        snprintf(e->err, sizeof e->err, "out of memory");
    }
    if (!ok) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", e->err);
        lunar_buf_free(&e->b);
        lunar_lua_error(L, "JSON: %s", msg);
    }
}

static int l_encode_json(lua_State *L) {
    luaL_checkany(L, 1);
    enc e;
    encode_value(L, 1, &e);
    lua_pushlstring(L, e.b.data, e.b.len);
    lunar_buf_free(&e.b);
    return 1;
}

static int l_write_json(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    luaL_checkany(L, 2);
    enc e;
    encode_value(L, 2, &e);
    lunar_status st = lunar_write_file_atomic(lunar_lua_ctx(L), path, e.b.data, e.b.len);
    lunar_buf_free(&e.b);
    lunar_lua_check_status(L, st);
    return 0;
}

/* write_file(path, bytes): the bytes to path atomically (temp file, fsync, rename) */
static int l_write_file(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    size_t n;
    const char *data = luaL_checklstring(L, 2, &n);
    lunar_lua_check_status(L, lunar_write_file_atomic(lunar_lua_ctx(L), path, data, n));
    return 0;
}

void lunar_lua_open_io(lua_State *L) {
    static const luaL_Reg methods[] = {{"keys", l_keys}, {"info", l_info}, {"tensor", l_tensor}, {"metadata", l_metadata},
                                       {"shards", l_shards}, {"path", l_path}, {"close", l_close}, {NULL, NULL}};
    luaL_newmetatable(L, CKPT_MT);
    lua_newtable(L);
    lunar_lua_setfuncs(L, methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_close);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);

    static const luaL_Reg fns[] = {{"open", l_open},
                                   {"save_safetensors", l_save_safetensors},
                                   {"save_checkpoint", l_save_checkpoint},
                                   {"read_json", l_read_json},
                                   {"decode_json", l_decode_json},
                                   {"encode_json", l_encode_json},
                                   {"write_json", l_write_json},
                                   {"write_file", l_write_file},
                                   {NULL, NULL}};
    lua_newtable(L);
    lunar_lua_setfuncs(L, fns);
    lua_pushlightuserdata(L, NULL);
    lua_setfield(L, -2, "null");
    luaL_newmetatable(L, ARRAY_MT);
    lua_pushstring(L, "json array");
    lua_setfield(L, -2, "__name");
    lua_setfield(L, -2, "array_mt");
    lua_setfield(L, -2, "io");
}
