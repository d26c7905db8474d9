/* lua_ops_kda.c: bindings of KDA's gated delta rule and short causal convolution, and their
 * decode steps (outputs passed in; state, state0, dstate, dstate0, hist and dw may be nil). */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.kda_forward(o, state, q, k, v, g, beta, seg, state0) -> o, state */
static int l_kda_forward(lua_State *L) {
    lunar_tensor *o = lunar_lua_check_tensor(L, 1);
    lunar_tensor *state = lunar_lua_opt_tensor(L, 2);
    lunar_tensor *q = lunar_lua_check_tensor(L, 3);
    lunar_tensor *k = lunar_lua_check_tensor(L, 4);
    lunar_tensor *v = lunar_lua_check_tensor(L, 5);
    lunar_tensor *g = lunar_lua_check_tensor(L, 6);
    lunar_tensor *beta = lunar_lua_check_tensor(L, 7);
    lunar_tensor *seg = lunar_lua_check_tensor(L, 8);
    lunar_tensor *state0 = lunar_lua_opt_tensor(L, 9);
    lunar_lua_check_status(L, lunar_kda_forward(lunar_lua_ctx(L), o, state, q, k, v, g, beta, seg, state0));
    lua_settop(L, 2);
    return 2;
}

/* core.ops.kda_backward(dq, dk, dv, dg, dbeta, dstate0, dout, dstate, q, k, v, g, beta, seg, state0)
 * -> dq, dk, dv, dg, dbeta, dstate0 */
static int l_kda_backward(lua_State *L) {
    lunar_tensor *dq = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dk = lunar_lua_check_tensor(L, 2);
    lunar_tensor *dv = lunar_lua_check_tensor(L, 3);
    lunar_tensor *dg = lunar_lua_check_tensor(L, 4);
    lunar_tensor *dbeta = lunar_lua_check_tensor(L, 5);
    lunar_tensor *dstate0 = lunar_lua_opt_tensor(L, 6);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 7);
    lunar_tensor *dstate = lunar_lua_opt_tensor(L, 8);
    lunar_tensor *q = lunar_lua_check_tensor(L, 9);
    lunar_tensor *k = lunar_lua_check_tensor(L, 10);
    lunar_tensor *v = lunar_lua_check_tensor(L, 11);
    lunar_tensor *g = lunar_lua_check_tensor(L, 12);
    lunar_tensor *beta = lunar_lua_check_tensor(L, 13);
    lunar_tensor *seg = lunar_lua_check_tensor(L, 14);
    lunar_tensor *state0 = lunar_lua_opt_tensor(L, 15);
    lunar_lua_check_status(L, lunar_kda_backward(lunar_lua_ctx(L), dq, dk, dv, dg, dbeta, dstate0, dout, dstate, q, k,
                                                 v, g, beta, seg, state0));
    lua_settop(L, 6);
    return 6;
}

/* core.ops.conv1d_causal_forward(y, x, w, seg, hist) -> y */
static int l_conv1d_causal_forward(lua_State *L) {
    lunar_tensor *y = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    lunar_tensor *w = lunar_lua_check_tensor(L, 3);
    lunar_tensor *seg = lunar_lua_check_tensor(L, 4);
    lunar_tensor *hist = lunar_lua_opt_tensor(L, 5);
    lunar_lua_check_status(L, lunar_conv1d_causal_forward(lunar_lua_ctx(L), y, x, w, seg, hist));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.conv1d_causal_backward(dx, dw, dy, x, w, seg, hist) -> dx, dw */
static int l_conv1d_causal_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dw = lunar_lua_opt_tensor(L, 2);
    lunar_tensor *dy = lunar_lua_check_tensor(L, 3);
    lunar_tensor *x = lunar_lua_check_tensor(L, 4);
    lunar_tensor *w = lunar_lua_check_tensor(L, 5);
    lunar_tensor *seg = lunar_lua_check_tensor(L, 6);
    lunar_tensor *hist = lunar_lua_opt_tensor(L, 7);
    lunar_lua_check_status(L, lunar_conv1d_causal_backward(lunar_lua_ctx(L), dx, dw, dy, x, w, seg, hist));
    lua_settop(L, 2);
    return 2;
}

/* core.ops.conv1d_step(y, hist, x, w, slots) -> y (hist updated in place; nil when K = 1) */
static int l_conv1d_step(lua_State *L) {
    lunar_tensor *y = lunar_lua_check_tensor(L, 1);
    lunar_tensor *hist = lunar_lua_opt_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    lunar_tensor *w = lunar_lua_check_tensor(L, 4);
    lunar_tensor *slots = lunar_lua_check_tensor(L, 5);
    lunar_lua_check_status(L, lunar_conv1d_step(lunar_lua_ctx(L), y, hist, x, w, slots));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.kda_step(o, state, q, k, v, g, beta, slots) -> o (state updated in place) */
static int l_kda_step(lua_State *L) {
    lunar_tensor *o = lunar_lua_check_tensor(L, 1);
    lunar_tensor *state = lunar_lua_check_tensor(L, 2);
    lunar_tensor *q = lunar_lua_check_tensor(L, 3);
    lunar_tensor *k = lunar_lua_check_tensor(L, 4);
    lunar_tensor *v = lunar_lua_check_tensor(L, 5);
    lunar_tensor *g = lunar_lua_check_tensor(L, 6);
    lunar_tensor *beta = lunar_lua_check_tensor(L, 7);
    lunar_tensor *slots = lunar_lua_check_tensor(L, 8);
    lunar_lua_check_status(L, lunar_kda_step(lunar_lua_ctx(L), o, state, q, k, v, g, beta, slots));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_kda(lua_State *L) {
    static const luaL_Reg fns[] = {{"kda_forward", l_kda_forward},
                                   {"kda_backward", l_kda_backward},
                                   {"conv1d_causal_forward", l_conv1d_causal_forward},
                                   {"conv1d_causal_backward", l_conv1d_causal_backward},
                                   {"conv1d_step", l_conv1d_step},
                                   {"kda_step", l_kda_step},
                                   {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
