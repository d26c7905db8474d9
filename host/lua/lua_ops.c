/* lua_ops.c: builds core.ops from the per-family binding files. */
#include "lua_ops.h"

void lunar_lua_open_ops(lua_State *L) {
    lua_newtable(L);
    lunar_lua_ops_gemm(L);
    lunar_lua_ops_elementwise(L);
    lunar_lua_ops_reduce(L);
    lunar_lua_ops_softmax(L);
    lunar_lua_ops_norm(L);
    lunar_lua_ops_rope(L);
    lunar_lua_ops_index(L);
    lunar_lua_ops_sort(L);
    lunar_lua_ops_mask(L);
    lunar_lua_ops_adamw(L);
    lunar_lua_ops_fp8(L);
    lunar_lua_ops_attention(L);
    lunar_lua_ops_kda(L);
    lunar_lua_ops_hyper(L);
    lua_setfield(L, -2, "ops");
}
