/* lua_ops_gemm.c: binding of gemm. */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.gemm(c, a, b, trans_a, trans_b, alpha, beta) -> c */
static int l_gemm(lua_State *L) {
    lunar_tensor *c = lunar_lua_check_tensor(L, 1);
    lunar_tensor *a = lunar_lua_check_tensor(L, 2);
    lunar_tensor *b = lunar_lua_check_tensor(L, 3);
    int trans_a = lua_toboolean(L, 4), trans_b = lua_toboolean(L, 5);
    float alpha = (float)luaL_optnumber(L, 6, 1.0), beta = (float)luaL_optnumber(L, 7, 0.0);
    lunar_lua_check_status(L, lunar_gemm(lunar_lua_ctx(L), c, a, b, trans_a, trans_b, alpha, beta));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_gemm(lua_State *L) {
    static const luaL_Reg fns[] = {{"gemm", l_gemm}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
