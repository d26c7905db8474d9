/* lua_ops_sort.c: bindings of top-k and argsort (along the last dim; indices are 0-based). */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.topk(values|nil, indices, x, k, largest) -> values, indices */
static int l_topk(lua_State *L) {
    lunar_tensor *values = lunar_lua_opt_tensor(L, 1);
    lunar_tensor *indices = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    int64_t k = (int64_t)luaL_checknumber(L, 4);
    int largest = lua_isnoneornil(L, 5) ? 1 : lua_toboolean(L, 5);
    lunar_lua_check_status(L, lunar_topk(lunar_lua_ctx(L), values, indices, x, k, largest));
    lua_settop(L, 2);
    return 2;
}

/* core.ops.argsort(indices, x, descending) -> indices */
static int l_argsort(lua_State *L) {
    lunar_tensor *indices = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    int descending = lua_toboolean(L, 3);
    lunar_lua_check_status(L, lunar_argsort(lunar_lua_ctx(L), indices, x, descending));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_sort(lua_State *L) {
    static const luaL_Reg fns[] = {{"topk", l_topk}, {"argsort", l_argsort}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
