/* lua_ops_adamw.c: binding of the AdamW step. */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.adamw_step(param, master, m, v, grad, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
 * -> param (master may be nil) */
static int l_adamw_step(lua_State *L) {
    lunar_tensor *param = lunar_lua_check_tensor(L, 1);
    lunar_tensor *master = lunar_lua_opt_tensor(L, 2);
    lunar_tensor *m = lunar_lua_check_tensor(L, 3);
    lunar_tensor *v = lunar_lua_check_tensor(L, 4);
    lunar_tensor *grad = lunar_lua_check_tensor(L, 5);
    lunar_adamw_hparams hp;
    hp.lr = luaL_checknumber(L, 6);
    hp.beta1 = luaL_checknumber(L, 7);
    hp.beta2 = luaL_checknumber(L, 8);
    hp.eps = luaL_checknumber(L, 9);
    hp.weight_decay = luaL_checknumber(L, 10);
    hp.step = (int64_t)luaL_checknumber(L, 11);
    hp.grad_scale = luaL_optnumber(L, 12, 1.0);
    lunar_lua_check_status(L, lunar_adamw_step(lunar_lua_ctx(L), param, master, m, v, grad, &hp));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_adamw(lua_State *L) {
    static const luaL_Reg fns[] = {{"adamw_step", l_adamw_step}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
