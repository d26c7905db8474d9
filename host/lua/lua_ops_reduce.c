/* lua_ops_reduce.c: bindings of the reduce ops. Dims here are 0-based C dims (negative counts
 * from the end) or nil for "all dims"; lua/lunar/ops/reduce.lua converts from 1-based Lua dims. */
#include "lua_ops.h"
#include "lunar/ops.h"

static int opt_dim(lua_State *L, int idx) {
    if (lua_isnoneornil(L, idx)) return LUNAR_ALL_DIMS;
    return (int)luaL_checkinteger(L, idx);
}

static lunar_reduce_op check_reduce_op(lua_State *L, int idx) {
    const char *name = luaL_checkstring(L, idx);
    lunar_reduce_op op;
    if (!lunar_reduce_op_from_name(name, &op))
        lunar_lua_error(L, "reduce: unknown reduction '%s' (sum, mean, max, min, norm)", name);
    return op;
}

/* core.ops.reduce(out, x, dim|nil, op) -> out */
static int l_reduce(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    int dim = opt_dim(L, 3);
    lunar_reduce_op op = check_reduce_op(L, 4);
    lunar_lua_check_status(L, lunar_reduce(lunar_lua_ctx(L), out, x, dim, op));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.reduce_backward(dx, dy, x|nil, y|nil, dim|nil, op) -> dx */
static int l_reduce_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dy = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_opt_tensor(L, 3);
    lunar_tensor *y = lunar_lua_opt_tensor(L, 4);
    int dim = opt_dim(L, 5);
    lunar_reduce_op op = check_reduce_op(L, 6);
    lunar_lua_check_status(L, lunar_reduce_backward(lunar_lua_ctx(L), dx, dy, x, y, dim, op));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.max_dim(values|nil, indices, x, dim|nil) -> values, indices */
static int l_max_dim(lua_State *L) {
    lunar_tensor *values = lunar_lua_opt_tensor(L, 1);
    lunar_tensor *indices = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    int dim = opt_dim(L, 4);
    lunar_lua_check_status(L, lunar_max_dim(lunar_lua_ctx(L), values, indices, x, dim));
    lua_settop(L, 2);
    return 2;
}

/* core.ops.cumsum(out, x, dim) -> out */
static int l_cumsum(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    int dim = (int)luaL_checkinteger(L, 3);
    lunar_lua_check_status(L, lunar_cumsum_forward(lunar_lua_ctx(L), out, x, dim));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.cumsum_backward(dx, dy, dim) -> dx */
static int l_cumsum_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dy = lunar_lua_check_tensor(L, 2);
    int dim = (int)luaL_checkinteger(L, 3);
    lunar_lua_check_status(L, lunar_cumsum_backward(lunar_lua_ctx(L), dx, dy, dim));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.global_norm(out, {t1, t2, ...}) -> out. The pointer array is a userdata, so a Lua
 * error on a bad entry leaks nothing. */
static int l_global_norm(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    int n = (int)lua_objlen(L, 2);
    const lunar_tensor **ts = lua_newuserdata(L, (size_t)(n > 0 ? n : 1) * sizeof *ts);
    int top = lua_gettop(L);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 2, i + 1);
        if (!lunar_lua_is_tensor(L, -1))
            lunar_lua_error(L, "global_norm: entry %d of the list is a %s, not a tensor", i + 1, luaL_typename(L, -1));
        ts[i] = lunar_lua_check_tensor(L, -1);   /* the list keeps the tensor alive */
        lua_settop(L, top);
    }
    lunar_lua_check_status(L, lunar_global_norm(lunar_lua_ctx(L), out, ts, n));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_reduce(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"reduce", l_reduce}, {"reduce_backward", l_reduce_backward}, {"max_dim", l_max_dim},
        {"cumsum", l_cumsum}, {"cumsum_backward", l_cumsum_backward}, {"global_norm", l_global_norm},
        {NULL, NULL},
    };
    lunar_lua_setfuncs(L, fns);
}
