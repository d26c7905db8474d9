/* lua_ops_hyper.c: bindings of the mHC hyper-connection ops (outputs passed in). */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.hc_weights(pre, post, comb, z, n, iters, eps) -> pre, post, comb */
static int l_hc_weights(lua_State *L) {
    lunar_tensor *pre = lunar_lua_check_tensor(L, 1);
    lunar_tensor *post = lunar_lua_check_tensor(L, 2);
    lunar_tensor *comb = lunar_lua_check_tensor(L, 3);
    lunar_tensor *z = lunar_lua_check_tensor(L, 4);
    int64_t n = (int64_t)luaL_checkinteger(L, 5);
    int iters = (int)luaL_checkinteger(L, 6);
    float eps = (float)luaL_checknumber(L, 7);
    lunar_lua_check_status(L, lunar_hc_weights(lunar_lua_ctx(L), pre, post, comb, z, n, iters, eps));
    lua_settop(L, 3);
    return 3;
}

/* core.ops.hc_weights_backward(dz, dpre, dpost, dcomb, z, n, iters, eps) -> dz */
static int l_hc_weights_backward(lua_State *L) {
    lunar_tensor *dz = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dpre = lunar_lua_check_tensor(L, 2);
    lunar_tensor *dpost = lunar_lua_check_tensor(L, 3);
    lunar_tensor *dcomb = lunar_lua_check_tensor(L, 4);
    lunar_tensor *z = lunar_lua_check_tensor(L, 5);
    int64_t n = (int64_t)luaL_checkinteger(L, 6);
    int iters = (int)luaL_checkinteger(L, 7);
    float eps = (float)luaL_checknumber(L, 8);
    lunar_lua_check_status(L, lunar_hc_weights_backward(lunar_lua_ctx(L), dz, dpre, dpost, dcomb, z, n, iters, eps));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.hc_mix(y, x, a, post, comb) -> y */
static int l_hc_mix(lua_State *L) {
    lunar_tensor *y = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    lunar_tensor *a = lunar_lua_check_tensor(L, 3);
    lunar_tensor *post = lunar_lua_check_tensor(L, 4);
    lunar_tensor *comb = lunar_lua_check_tensor(L, 5);
    lunar_lua_check_status(L, lunar_hc_mix(lunar_lua_ctx(L), y, x, a, post, comb));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.hc_mix_backward(dx, da, dpost, dcomb, dy, x, a, post, comb) -> dx, da, dpost, dcomb */
static int l_hc_mix_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *da = lunar_lua_check_tensor(L, 2);
    lunar_tensor *dpost = lunar_lua_check_tensor(L, 3);
    lunar_tensor *dcomb = lunar_lua_check_tensor(L, 4);
    lunar_tensor *dy = lunar_lua_check_tensor(L, 5);
    lunar_tensor *x = lunar_lua_check_tensor(L, 6);
    lunar_tensor *a = lunar_lua_check_tensor(L, 7);
    lunar_tensor *post = lunar_lua_check_tensor(L, 8);
    lunar_tensor *comb = lunar_lua_check_tensor(L, 9);
    lunar_lua_check_status(L, lunar_hc_mix_backward(lunar_lua_ctx(L), dx, da, dpost, dcomb, dy, x, a, post, comb));
    lua_settop(L, 4);
    return 4;
}

/* core.ops.hc_collapse(u, x, pre) -> u */
static int l_hc_collapse(lua_State *L) {
    lunar_tensor *u = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    lunar_tensor *pre = lunar_lua_check_tensor(L, 3);
    lunar_lua_check_status(L, lunar_hc_collapse(lunar_lua_ctx(L), u, x, pre));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.hc_collapse_backward(dx, dpre, du, x, pre) -> dx, dpre */
static int l_hc_collapse_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dpre = lunar_lua_check_tensor(L, 2);
    lunar_tensor *du = lunar_lua_check_tensor(L, 3);
    lunar_tensor *x = lunar_lua_check_tensor(L, 4);
    lunar_tensor *pre = lunar_lua_check_tensor(L, 5);
    lunar_lua_check_status(L, lunar_hc_collapse_backward(lunar_lua_ctx(L), dx, dpre, du, x, pre));
    lua_settop(L, 2);
    return 2;
}

void lunar_lua_ops_hyper(lua_State *L) {
    static const luaL_Reg fns[] = {{"hc_weights", l_hc_weights},
                                   {"hc_weights_backward", l_hc_weights_backward},
                                   {"hc_mix", l_hc_mix},
                                   {"hc_mix_backward", l_hc_mix_backward},
                                   {"hc_collapse", l_hc_collapse},
                                   {"hc_collapse_backward", l_hc_collapse_backward},
                                   {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
