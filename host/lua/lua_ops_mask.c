/* lua_ops_mask.c: bindings of the mask ops. */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.causal_mask(out, offset) */
static int l_causal_mask(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    int64_t offset = (int64_t)luaL_optnumber(L, 2, 0);
    lunar_lua_check_status(L, lunar_causal_mask(lunar_lua_ctx(L), out, offset));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.block_mask(out, cu_seqlens, causal) */
static int l_block_mask(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *cu = lunar_lua_check_tensor(L, 2);
    int causal = lua_isnoneornil(L, 3) ? 1 : lua_toboolean(L, 3);
    lunar_lua_check_status(L, lunar_block_mask(lunar_lua_ctx(L), out, cu, causal));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_mask(lua_State *L) {
    static const luaL_Reg fns[] = {{"causal_mask", l_causal_mask}, {"block_mask", l_block_mask}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
