/* lua_arena.c: arenas from Lua: lunar.arena(name, bytes, device), a:tensor(shape, dtype, name),
 * a:reset(), a:free(), and usage queries. */
#include <string.h>

#include "lua_lunar.h"

static lunar_arena *check_arena(lua_State *L, int idx) {
    lunar_lua_arena *u = (lunar_lua_arena *)luaL_checkudata(L, idx, LUNAR_ARENA_MT);
    if (!u->a) lunar_lua_error(L, "arena was released");
    return u->a;
}

/* core.arena_new(name, bytes, device) */
static int l_arena_new(lua_State *L) {
    const char *name = luaL_checkstring(L, 1);
    double bytes = luaL_checknumber(L, 2);
    lunar_device cpu = {LUNAR_DEVICE_CPU, 0};
    lunar_device dev = lunar_lua_opt_device(L, 3, cpu);
    if (!(bytes >= 0 && bytes < 9223372036854775808.0)) lunar_lua_error(L, "arena '%s': size %g is not a byte count", name, bytes);
    /* the userdata first, so that no Lua error can leave the arena held only by C */
    lunar_lua_arena *u = (lunar_lua_arena *)lua_newuserdata(L, sizeof *u);
    u->a = NULL;
    luaL_getmetatable(L, LUNAR_ARENA_MT);
    lua_setmetatable(L, -2);
    lunar_lua_check_status(L, lunar_arena_new(lunar_lua_ctx(L), &u->a, name, dev, (size_t)bytes));
    return 1;
}

/* a:tensor(shape, dtype, name) */
static int l_arena_tensor(lua_State *L) {
    lunar_arena *a = check_arena(L, 1);
    int64_t shape[LUNAR_MAX_DIMS];
    luaL_checktype(L, 2, LUA_TTABLE);
    int nd = lunar_lua_check_shape(L, 2, shape);
    lunar_dtype dt = lunar_lua_opt_dtype(L, 3, LUNAR_DTYPE_F32);
    const char *name = luaL_optstring(L, 4, "");
    lunar_tensor *t = lunar_lua_push_empty_tensor(L);
    lunar_lua_check_status(L, lunar_tensor_new_in(lunar_lua_ctx(L), t, a, dt, nd, shape));
    lunar_tensor_set_name(t, name);
    return 1;
}

static int l_arena_reset(lua_State *L) { lunar_arena_reset(check_arena(L, 1)); return 0; }

static int l_arena_free(lua_State *L) {
    lunar_lua_arena *u = (lunar_lua_arena *)luaL_checkudata(L, 1, LUNAR_ARENA_MT);
    if (u->a) lunar_arena_free(lunar_lua_ctx(L), u->a);
    return 0;
}

static int l_arena_gc(lua_State *L) {
    lunar_lua_arena *u = (lunar_lua_arena *)luaL_checkudata(L, 1, LUNAR_ARENA_MT);
    if (u->a) {
        lunar_arena_release(lunar_lua_ctx(L), u->a);   /* frees the block once no view holds it */
        u->a = NULL;
    }
    return 0;
}

static int l_arena_info(lua_State *L) {
    lunar_arena *a = check_arena(L, 1);
    char dev[32];
    lunar_device_format(lunar_arena_device(a), dev, sizeof dev);
    lua_createtable(L, 0, 7);
    lua_pushstring(L, lunar_arena_name(a)); lua_setfield(L, -2, "name");
    lua_pushstring(L, dev); lua_setfield(L, -2, "device");
    lua_pushnumber(L, (lua_Number)lunar_arena_used(a)); lua_setfield(L, -2, "used");
    lua_pushnumber(L, (lua_Number)lunar_arena_capacity(a)); lua_setfield(L, -2, "capacity");
    lua_pushnumber(L, (lua_Number)lunar_arena_peak(a)); lua_setfield(L, -2, "peak");
    lua_pushnumber(L, (lua_Number)lunar_arena_generation(a)); lua_setfield(L, -2, "generation");
    lua_pushboolean(L, lunar_arena_is_freed(a)); lua_setfield(L, -2, "freed");
    return 1;
}

static const luaL_Reg arena_methods[] = {
    {"tensor", l_arena_tensor}, {"reset", l_arena_reset}, {"free", l_arena_free}, {"info", l_arena_info},
    {NULL, NULL},
};

void lunar_lua_open_arena(lua_State *L) {
    luaL_newmetatable(L, LUNAR_ARENA_MT);
    lua_pushcfunction(L, l_arena_gc);
    lua_setfield(L, -2, "__gc");
    lua_newtable(L);
    lunar_lua_setfuncs(L, arena_methods);
    lua_pushvalue(L, -1);
    lua_setfield(L, -3, "__index");
    lua_setfield(L, -3, "arena_methods");
    lua_setfield(L, -2, "arena_mt");
    lua_pushcfunction(L, l_arena_new);
    lua_setfield(L, -2, "arena_new");
}
