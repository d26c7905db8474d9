/* lua_rng.c: random streams from Lua: lunar.rng(seed), r:split(id), r:uniform_(t, lo, hi),
 * r:normal_(t, mean, std), r:randint_(t, lo, hi), r:uniform_at(i), r:state() / r:set_state(s)
 * for checkpoints. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua_lunar.h"

static void push_rng(lua_State *L, lunar_rng r) {
    lunar_lua_rng *u = (lunar_lua_rng *)lua_newuserdata(L, sizeof *u);
    u->r = r;
    luaL_getmetatable(L, LUNAR_RNG_MT);
    lua_setmetatable(L, -2);
}

/* Seeds and ids may be numbers (exact up to 2^53) or decimal strings (full 64 bits). */
static uint64_t check_u64(lua_State *L, int idx) {
    if (lua_type(L, idx) == LUA_TSTRING) {
        const char *s = lua_tostring(L, idx);
        char *end = NULL;
        unsigned long long v = strtoull(s, &end, 0);
        if (!*s || *end) lunar_lua_error(L, "'%s' is not an integer", s);
        return (uint64_t)v;
    }
    double d = luaL_checknumber(L, idx);
    if (d < 0 || d != (double)(uint64_t)d) lunar_lua_error(L, "%g is not a non-negative integer", d);
    return (uint64_t)d;
}

static int l_rng_new(lua_State *L) {
    lunar_rng r;
    lunar_rng_seed(&r, check_u64(L, 1));
    push_rng(L, r);
    return 1;
}

static int l_split(lua_State *L) {
    lunar_rng *r = lunar_lua_check_rng(L, 1);
    uint64_t id;
    if (lua_type(L, 2) == LUA_TSTRING && !lua_isnumber(L, 2)) {
        /* a purpose name ("init", "dropout", ...): FNV-1a of the bytes */
        size_t n;
        const char *s = lua_tolstring(L, 2, &n);
        id = 1469598103934665603ull;
        for (size_t i = 0; i < n; i++) id = (id ^ (unsigned char)s[i]) * 1099511628211ull;
    } else {
        id = check_u64(L, 2);
    }
    push_rng(L, lunar_rng_split(r, id));
    return 1;
}

static int fill(lua_State *L, int kind) {
    lunar_rng *r = lunar_lua_check_rng(L, 1);
    lunar_tensor *t = lunar_lua_check_tensor(L, 2);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_status st;
    if (kind == 0) st = lunar_rng_uniform(ctx, t, r, luaL_optnumber(L, 3, 0.0), luaL_optnumber(L, 4, 1.0));
    else if (kind == 1) st = lunar_rng_normal(ctx, t, r, luaL_optnumber(L, 3, 0.0), luaL_optnumber(L, 4, 1.0));
    else st = lunar_rng_randint(ctx, t, r, (int64_t)luaL_checknumber(L, 3), (int64_t)luaL_checknumber(L, 4));
    lunar_lua_check_status(L, st);
    lua_settop(L, 2);
    return 1;
}

static int l_uniform(lua_State *L) { return fill(L, 0); }
static int l_normal(lua_State *L) { return fill(L, 1); }
static int l_randint(lua_State *L) { return fill(L, 2); }

/* r:uniform_at(i) -> the number in [0, 1) that element i (0-based) of r:uniform_ into an f64
 * tensor would be now (53 bits of philox(key, counter + i)); r does not advance. One draw at a
 * chosen place of a stream, with no tensor: the sampler's draw for a token position. */
static int l_uniform_at(lua_State *L) {
    lunar_rng *r = lunar_lua_check_rng(L, 1);
    uint64_t i = check_u64(L, 2);
    uint32_t w[4];
    lunar_philox_element(r->key, r->counter + i, w);
    lua_pushnumber(L, lunar_rng_u01(w[0], w[1]));
    return 1;
}

/* r:state() -> "key:counter" in hex (exact, for checkpoints) */
static int l_state(lua_State *L) {
    lunar_rng *r = lunar_lua_check_rng(L, 1);
    char buf[64];
    snprintf(buf, sizeof buf, "%016" PRIx64 ":%016" PRIx64, r->key, r->counter);
    lua_pushstring(L, buf);
    return 1;
}

static int l_set_state(lua_State *L) {
    lunar_rng *r = lunar_lua_check_rng(L, 1);
    const char *s = luaL_checkstring(L, 2);
    unsigned long long k, c;
    char tail;
    if (sscanf(s, "%16llx:%16llx%c", &k, &c, &tail) != 2) lunar_lua_error(L, "rng state '%s' is not 'key:counter' hex", s);
    r->key = k;
    r->counter = c;
    return 0;
}

static int l_tostring(lua_State *L) {
    lunar_rng *r = lunar_lua_check_rng(L, 1);
    lua_pushfstring(L, "lunar.rng(key=%p, counter=%f)", (void *)(uintptr_t)r->key, (double)r->counter);
    return 1;
}

static const luaL_Reg rng_methods[] = {
    {"split", l_split}, {"uniform_", l_uniform}, {"normal_", l_normal}, {"randint_", l_randint},
    {"uniform_at", l_uniform_at}, {"state", l_state}, {"set_state", l_set_state},
    {NULL, NULL},
};

void lunar_lua_open_rng(lua_State *L) {
    luaL_newmetatable(L, LUNAR_RNG_MT);
    lua_pushcfunction(L, l_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_newtable(L);
    lunar_lua_setfuncs(L, rng_methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, -3, "__index");
    lua_setfield(L, -3, "rng_methods");
    lua_setfield(L, -2, "rng_mt");
    lua_pushcfunction(L, l_rng_new);
    lua_setfield(L, -2, "rng_new");
}
