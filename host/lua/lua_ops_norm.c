/* lua_ops_norm.c: bindings of the RMSNorm / LayerNorm ops (outputs passed in; w, b may be nil). */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.rmsnorm_forward(out, rstd, x, w, eps) -> out */
static int l_rmsnorm_forward(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *rstd = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    lunar_tensor *w = lunar_lua_opt_tensor(L, 4);
    float eps = (float)luaL_optnumber(L, 5, 1e-6);
    lunar_lua_check_status(L, lunar_rmsnorm_forward(lunar_lua_ctx(L), out, rstd, x, w, eps));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.rmsnorm_backward_input(dx, dout, x, w, rstd) -> dx */
static int l_rmsnorm_backward_input(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    lunar_tensor *w = lunar_lua_opt_tensor(L, 4);
    lunar_tensor *rstd = lunar_lua_check_tensor(L, 5);
    lunar_lua_check_status(L, lunar_rmsnorm_backward_input(lunar_lua_ctx(L), dx, dout, x, w, rstd));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.rmsnorm_backward_params(dw, dout, x, rstd) -> dw (accumulated) */
static int l_rmsnorm_backward_params(lua_State *L) {
    lunar_tensor *dw = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    lunar_tensor *rstd = lunar_lua_check_tensor(L, 4);
    lunar_lua_check_status(L, lunar_rmsnorm_backward_params(lunar_lua_ctx(L), dw, dout, x, rstd));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.layernorm_forward(out, mean, rstd, x, w, b, eps) -> out */
static int l_layernorm_forward(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *mean = lunar_lua_check_tensor(L, 2);
    lunar_tensor *rstd = lunar_lua_check_tensor(L, 3);
    lunar_tensor *x = lunar_lua_check_tensor(L, 4);
    lunar_tensor *w = lunar_lua_opt_tensor(L, 5);
    lunar_tensor *b = lunar_lua_opt_tensor(L, 6);
    float eps = (float)luaL_optnumber(L, 7, 1e-5);
    lunar_lua_check_status(L, lunar_layernorm_forward(lunar_lua_ctx(L), out, mean, rstd, x, w, b, eps));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.layernorm_backward_input(dx, dout, x, w, mean, rstd) -> dx */
static int l_layernorm_backward_input(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    lunar_tensor *w = lunar_lua_opt_tensor(L, 4);
    lunar_tensor *mean = lunar_lua_check_tensor(L, 5);
    lunar_tensor *rstd = lunar_lua_check_tensor(L, 6);
    lunar_lua_check_status(L, lunar_layernorm_backward_input(lunar_lua_ctx(L), dx, dout, x, w, mean, rstd));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.layernorm_backward_params(dw, db, dout, x, mean, rstd) -> dw, db (accumulated; either may be nil) */
static int l_layernorm_backward_params(lua_State *L) {
    lunar_tensor *dw = lunar_lua_opt_tensor(L, 1);
    lunar_tensor *db = lunar_lua_opt_tensor(L, 2);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 3);
    lunar_tensor *x = lunar_lua_check_tensor(L, 4);
    lunar_tensor *mean = lunar_lua_check_tensor(L, 5);
    lunar_tensor *rstd = lunar_lua_check_tensor(L, 6);
    lunar_lua_check_status(L, lunar_layernorm_backward_params(lunar_lua_ctx(L), dw, db, dout, x, mean, rstd));
    lua_settop(L, 2);
    return 2;
}

void lunar_lua_ops_norm(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"rmsnorm_forward", l_rmsnorm_forward},
        {"rmsnorm_backward_input", l_rmsnorm_backward_input},
        {"rmsnorm_backward_params", l_rmsnorm_backward_params},
        {"layernorm_forward", l_layernorm_forward},
        {"layernorm_backward_input", l_layernorm_backward_input},
        {"layernorm_backward_params", l_layernorm_backward_params},
        {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
