/* lua_ops_softmax.c: bindings of softmax, log-softmax and the fused cross-entropy. */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.softmax_forward(y, x, log) -> y */
static int l_softmax_forward(lua_State *L) {
    lunar_tensor *y = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    int is_log = lua_toboolean(L, 3);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_lua_check_status(L, is_log ? lunar_log_softmax_forward(ctx, y, x) : lunar_softmax_forward(ctx, y, x));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.softmax_backward(dx, dy, y, log) -> dx */
static int l_softmax_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dy = lunar_lua_check_tensor(L, 2);
    lunar_tensor *y = lunar_lua_check_tensor(L, 3);
    int is_log = lua_toboolean(L, 4);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_lua_check_status(L, is_log ? lunar_log_softmax_backward(ctx, dx, dy, y) : lunar_softmax_backward(ctx, dx, dy, y));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.cross_entropy_forward(loss|nil, logprobs|nil, lse|nil, logits, targets, ignore_index)
 *   -> loss, logprobs, lse (the ones passed in) */
static int l_cross_entropy_forward(lua_State *L) {
    lunar_tensor *loss = lunar_lua_opt_tensor(L, 1);
    lunar_tensor *logprobs = lunar_lua_opt_tensor(L, 2);
    lunar_tensor *lse = lunar_lua_opt_tensor(L, 3);
    lunar_tensor *logits = lunar_lua_check_tensor(L, 4);
    lunar_tensor *targets = lunar_lua_check_tensor(L, 5);
    int64_t ignore_index = (int64_t)luaL_optnumber(L, 6, -100);
    lunar_lua_check_status(L, lunar_cross_entropy_forward(lunar_lua_ctx(L), loss, logprobs, lse, logits, targets,
                                                          ignore_index));
    lua_settop(L, 3);
    return 3;
}

/* core.ops.cross_entropy_backward(dlogits, dloss, logits, lse, targets, ignore_index) -> dlogits */
static int l_cross_entropy_backward(lua_State *L) {
    lunar_tensor *dlogits = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dloss = lunar_lua_check_tensor(L, 2);
    lunar_tensor *logits = lunar_lua_check_tensor(L, 3);
    lunar_tensor *lse = lunar_lua_check_tensor(L, 4);
    lunar_tensor *targets = lunar_lua_check_tensor(L, 5);
    int64_t ignore_index = (int64_t)luaL_optnumber(L, 6, -100);
    lunar_lua_check_status(L, lunar_cross_entropy_backward(lunar_lua_ctx(L), dlogits, dloss, logits, lse, targets,
                                                           ignore_index));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.entropy_forward(entropy, logits, lse) -> entropy */
static int l_entropy_forward(lua_State *L) {
    lunar_tensor *entropy = lunar_lua_check_tensor(L, 1);
    lunar_tensor *logits = lunar_lua_check_tensor(L, 2);
    lunar_tensor *lse = lunar_lua_check_tensor(L, 3);
    lunar_lua_check_status(L, lunar_entropy_forward(lunar_lua_ctx(L), entropy, logits, lse));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.sample_rows(tokens, logprobs, z, u) -> tokens, logprobs */
static int l_sample_rows(lua_State *L) {
    lunar_tensor *tokens = lunar_lua_check_tensor(L, 1);
    lunar_tensor *logprobs = lunar_lua_check_tensor(L, 2);
    lunar_tensor *z = lunar_lua_check_tensor(L, 3);
    lunar_tensor *u = lunar_lua_check_tensor(L, 4);
    lunar_lua_check_status(L, lunar_sample_rows(lunar_lua_ctx(L), tokens, logprobs, z, u));
    lua_settop(L, 2);
    return 2;
}

void lunar_lua_ops_softmax(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"softmax_forward", l_softmax_forward}, {"softmax_backward", l_softmax_backward},
        {"cross_entropy_forward", l_cross_entropy_forward}, {"cross_entropy_backward", l_cross_entropy_backward},
        {"entropy_forward", l_entropy_forward}, {"sample_rows", l_sample_rows},
        {NULL, NULL},
    };
    lunar_lua_setfuncs(L, fns);
}
