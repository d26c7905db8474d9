/* lua_common.c: context lookup, error raising with the user's line, argument checks. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "lua_lunar.h"

#define CTX_KEY "lunar.ctx"

lunar_ctx *lunar_lua_ctx(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, CTX_KEY);
    lunar_ctx *ctx = (lunar_ctx *)lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (!ctx) luaL_error(L, "lunar: no context in this Lua state");
    return ctx;
}

void lunar_lua_set_ctx(lua_State *L, lunar_ctx *ctx) {
    lua_pushlightuserdata(L, ctx);
    lua_setfield(L, LUA_REGISTRYINDEX, CTX_KEY);
}

void lunar_lua_user_where(lua_State *L, char *buf, size_t n) {
    lua_Debug ar;
    buf[0] = 0;
    for (int level = 1; lua_getstack(L, level, &ar); level++) {
        if (!lua_getinfo(L, "Sl", &ar)) continue;
        if (ar.currentline <= 0) continue;                      /* C function or no line info */
        if (strncmp(ar.source, LUNAR_LIB_CHUNK_PREFIX, strlen(LUNAR_LIB_CHUNK_PREFIX)) == 0) continue;
        snprintf(buf, n, "%s:%d: ", ar.short_src, ar.currentline);
        return;
    }
}

int lunar_lua_error(lua_State *L, const char *fmt, ...) {
    char where[512], msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    lunar_lua_user_where(L, where, sizeof where);
    lua_pushfstring(L, "%s%s", where, msg);
    return lua_error(L);
}

int lunar_lua_check_status(lua_State *L, lunar_status st) {
    if (st == LUNAR_OK) return 0;
    lunar_ctx *ctx = lunar_lua_ctx(L);
    return lunar_lua_error(L, "%s", lunar_ctx_error(ctx)[0] ? lunar_ctx_error(ctx) : lunar_status_name(st));
}

void lunar_lua_setfuncs(lua_State *L, const luaL_Reg *l) {
    for (; l->name; l++) {
        lua_pushcfunction(L, l->func);
        lua_setfield(L, -2, l->name);
    }
}

int lunar_lua_is_tensor(lua_State *L, int idx) {
    void *p = lua_touserdata(L, idx);
    if (!p || !lua_getmetatable(L, idx)) return 0;
    luaL_getmetatable(L, LUNAR_TENSOR_MT);
    int eq = lua_rawequal(L, -1, -2);
    lua_pop(L, 2);
    return eq;
}

/* "name" of the running C function (its name as Lua called it: "reduce" for core.ops.reduce,
 * "fill_" for t:fill_), so argument errors name the op. No argument number: the Lua wrappers
 * pass their outputs first, so the C function's numbering is not the caller's; the tensor's
 * name and shape say which one it is. */
static void arg_where(lua_State *L, char *buf, size_t n) {
    lua_Debug ar;
    const char *fn = NULL;
    if (lua_getstack(L, 0, &ar) && lua_getinfo(L, "n", &ar)) fn = ar.name;
    snprintf(buf, n, "%s", fn ? fn : "lunar");
}

lunar_tensor *lunar_lua_check_tensor_raw(lua_State *L, int idx) {
    if (!lunar_lua_is_tensor(L, idx)) {
        char where[128];
        arg_where(L, where, sizeof where);
        lunar_lua_error(L, "%s: expected a tensor, got %s", where, luaL_typename(L, idx));
    }
    return &((lunar_lua_tensor *)lua_touserdata(L, idx))->t;
}

lunar_tensor *lunar_lua_check_tensor(lua_State *L, int idx) {
    lunar_tensor *t = lunar_lua_check_tensor_raw(L, idx);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (!t->storage || lunar_tensor_check(ctx, t) != LUNAR_OK) {
        char where[128];
        arg_where(L, where, sizeof where);
        if (!t->storage) lunar_lua_error(L, "%s: tensor '%s' has no storage", where, lunar_tensor_label(t));
        lunar_lua_error(L, "%s: %s", where, lunar_ctx_error(ctx));
    }
    return t;
}

lunar_tensor *lunar_lua_opt_tensor(lua_State *L, int idx) {
    if (lua_isnoneornil(L, idx)) return NULL;
    return lunar_lua_check_tensor(L, idx);
}

lunar_tensor *lunar_lua_push_empty_tensor(lua_State *L) {
    lunar_lua_tensor *u = (lunar_lua_tensor *)lua_newuserdata(L, sizeof *u);
    memset(u, 0, sizeof *u);
    luaL_getmetatable(L, LUNAR_TENSOR_MT);
    lua_setmetatable(L, -2);
    return &u->t;
}

lunar_tensor *lunar_lua_new_tensor(lua_State *L, lunar_dtype dt, lunar_device dev, int ndim, const int64_t *shape) {
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_tensor *t = lunar_lua_push_empty_tensor(L);   /* owns the storage from here on */
    lunar_lua_check_status(L, lunar_tensor_new(ctx, t, dt, dev, ndim, shape));
    lunar_lua_check_status(L, lunar_scope_track(ctx, t->storage));
    return t;
}

lunar_dtype lunar_lua_check_dtype(lua_State *L, int idx) {
    const char *name = luaL_checkstring(L, idx);
    lunar_dtype dt;
    if (!lunar_dtype_from_name(name, &dt))
        lunar_lua_error(L, "unknown dtype '%s' (f32 f64 bf16 f16 f8e4m3 f8e5m2 i8 i32 i64 u8 bool)", name);
    return dt;
}

lunar_dtype lunar_lua_opt_dtype(lua_State *L, int idx, lunar_dtype def) {
    if (lua_isnoneornil(L, idx)) return def;
    return lunar_lua_check_dtype(L, idx);
}

lunar_device lunar_lua_opt_device(lua_State *L, int idx, lunar_device def) {
    if (lua_isnoneornil(L, idx)) return def;
    const char *s = luaL_checkstring(L, idx);
    lunar_device d;
    if (!lunar_device_parse(s, &d)) lunar_lua_error(L, "unknown device '%s' (cpu, cuda, cuda:N; cpu:N with LUNAR_FAKE_CPU_DEVICES)", s);
    if (strcmp(s, "cuda") == 0) d.index = lunar_ctx_default_cuda_device(lunar_lua_ctx(L));
    return d;
}

/* An integer in [-1, 2^63) (-1: "infer" or "keep" in view/expand); the range is checked before
 * the cast, which is undefined for values outside int64. */
static int is_size(double v) { return v >= -1 && v < 9223372036854775808.0 && v == (double)(int64_t)v; }

int lunar_lua_check_shape(lua_State *L, int idx, int64_t *shape) {
    int n = 0;
    if (lua_istable(L, idx)) {
        n = (int)lua_objlen(L, idx);
        if (n > LUNAR_MAX_DIMS) lunar_lua_error(L, "shape has %d dims (at most %d)", n, LUNAR_MAX_DIMS);
        for (int i = 0; i < n; i++) {
            lua_rawgeti(L, idx, i + 1);
            if (!lua_isnumber(L, -1)) lunar_lua_error(L, "shape entry %d is not a number", i + 1);
            double v = lua_tonumber(L, -1);
            lua_pop(L, 1);
            if (!is_size(v)) lunar_lua_error(L, "shape entry %d is %g, not a valid size", i + 1, v);
            shape[i] = (int64_t)v;
        }
        return n;
    }
    int top = lua_gettop(L);
    for (int i = idx; i <= top && lua_type(L, i) == LUA_TNUMBER; i++) {
        if (n >= LUNAR_MAX_DIMS) lunar_lua_error(L, "shape has more than %d dims", LUNAR_MAX_DIMS);
        double v = lua_tonumber(L, i);
        if (!is_size(v)) lunar_lua_error(L, "size %g is not a valid size", v);
        shape[n++] = (int64_t)v;
    }
    return n;
}

int lunar_lua_check_dim(lua_State *L, int idx, int ndim) {
    lua_Integer d = luaL_checkinteger(L, idx);
    if (d == 0 || d > ndim || d < -ndim) lunar_lua_error(L, "dim %d out of range for a %d-dim tensor (dims are 1-based)", (int)d, ndim);
    return d > 0 ? (int)d - 1 : (int)(d + ndim);
}

lunar_rng *lunar_lua_check_rng(lua_State *L, int idx) {
    return &((lunar_lua_rng *)luaL_checkudata(L, idx, LUNAR_RNG_MT))->r;
}
