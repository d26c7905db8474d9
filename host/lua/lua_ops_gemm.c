/* lua_ops_gemm.c: binding of gemm, gemm_grouped and gemm_row_invariant. */
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

#define GROUPED_MAX 4096

/* the tensors of Lua list at idx, n of them, into ts */
static void check_list(lua_State *L, int idx, int n, lunar_tensor **ts, const char *op, const char *what) {
    luaL_checktype(L, idx, LUA_TTABLE);
    if ((int)lua_objlen(L, idx) != n)
        lunar_lua_error(L, "%s: %s has %d tensors, c has %d", op, what, (int)lua_objlen(L, idx), n);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        ts[i] = lunar_lua_check_tensor(L, -1);
        lua_pop(L, 1);   /* the list keeps the tensor alive */
    }
}

/* core.ops.gemm_grouped({c...}, {a...}, {b...}, trans_a, trans_b, alpha, beta) -> the c list */
static int l_gemm_grouped(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    int n = (int)lua_objlen(L, 1);
    if (n > GROUPED_MAX) return lunar_lua_error(L, "gemm_grouped: %d products exceed %d", n, GROUPED_MAX);
    lunar_tensor **ts = lua_newuserdata(L, sizeof(lunar_tensor *) * 3 * (size_t)(n > 0 ? n : 1));
    lunar_tensor **c = ts, **a = ts + n, **b = ts + 2 * n;
    check_list(L, 1, n, c, "gemm_grouped", "c");
    check_list(L, 2, n, a, "gemm_grouped", "a");
    check_list(L, 3, n, b, "gemm_grouped", "b");
    int trans_a = lua_toboolean(L, 4), trans_b = lua_toboolean(L, 5);
    float alpha = (float)luaL_optnumber(L, 6, 1.0), beta = (float)luaL_optnumber(L, 7, 0.0);
    lunar_lua_check_status(L, lunar_gemm_grouped(lunar_lua_ctx(L), n, c, (const lunar_tensor *const *)a,
                                                 (const lunar_tensor *const *)b, trans_a, trans_b, alpha, beta));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.gemm_row_invariant({c...}, {a...}, {b...}, trans_b, alpha, beta) -> the c list */
static int l_gemm_row_invariant(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    int n = (int)lua_objlen(L, 1);
    if (n > GROUPED_MAX) return lunar_lua_error(L, "gemm_row_invariant: %d products exceed %d", n, GROUPED_MAX);
    lunar_tensor **ts = lua_newuserdata(L, sizeof(lunar_tensor *) * 3 * (size_t)(n > 0 ? n : 1));
    lunar_tensor **c = ts, **a = ts + n, **b = ts + 2 * n;
    check_list(L, 1, n, c, "gemm_row_invariant", "c");
    check_list(L, 2, n, a, "gemm_row_invariant", "a");
    check_list(L, 3, n, b, "gemm_row_invariant", "b");
    int trans_b = lua_toboolean(L, 4);
    float alpha = (float)luaL_optnumber(L, 5, 1.0), beta = (float)luaL_optnumber(L, 6, 0.0);
    lunar_lua_check_status(L, lunar_gemm_row_invariant(lunar_lua_ctx(L), n, c, (const lunar_tensor *const *)a,
                                                       (const lunar_tensor *const *)b, trans_b, alpha, beta));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_gemm(lua_State *L) {
    static const luaL_Reg fns[] = {{"gemm", l_gemm}, {"gemm_grouped", l_gemm_grouped},
                                   {"gemm_row_invariant", l_gemm_row_invariant}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
