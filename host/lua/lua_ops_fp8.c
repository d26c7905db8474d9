/* lua_ops_fp8.c: binding of the FP8 block dequantisation. */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.fp8_block_dequant(out, q, scale_inv, block_m, block_n) -> out */
static int l_fp8_block_dequant(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *q = lunar_lua_check_tensor(L, 2);
    lunar_tensor *s = lunar_lua_check_tensor(L, 3);
    int64_t bm = (int64_t)luaL_optnumber(L, 4, 128), bn = (int64_t)luaL_optnumber(L, 5, 128);
    lunar_lua_check_status(L, lunar_fp8_block_dequant(lunar_lua_ctx(L), out, q, s, bm, bn));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_fp8(lua_State *L) {
    static const luaL_Reg fns[] = {{"fp8_block_dequant", l_fp8_block_dequant}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
