/* lua_ops_attention.c: bindings of the fused attention ops, the paged decode attention and the
 * DSA index score (outputs passed in; keys, mask, scores and topk may be nil). */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.attention_forward(o, lse, q, k, v, keys, mask, scale) -> o, lse */
static int l_attention_forward(lua_State *L) {
    lunar_tensor *o = lunar_lua_check_tensor(L, 1);
    lunar_tensor *lse = lunar_lua_check_tensor(L, 2);
    lunar_tensor *q = lunar_lua_check_tensor(L, 3);
    lunar_tensor *k = lunar_lua_check_tensor(L, 4);
    lunar_tensor *v = lunar_lua_check_tensor(L, 5);
    lunar_tensor *keys = lunar_lua_opt_tensor(L, 6);
    lunar_tensor *mask = lunar_lua_opt_tensor(L, 7);
    float scale = (float)luaL_checknumber(L, 8);
    lunar_lua_check_status(L, lunar_attention_forward(lunar_lua_ctx(L), o, lse, q, k, v, keys, mask, scale));
    lua_settop(L, 2);
    return 2;
}

/* core.ops.attention_backward(dq, dk, dv, dout, o, lse, q, k, v, keys, mask, scale) -> dq, dk, dv */
static int l_attention_backward(lua_State *L) {
    lunar_tensor *dq = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dk = lunar_lua_check_tensor(L, 2);
    lunar_tensor *dv = lunar_lua_check_tensor(L, 3);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 4);
    lunar_tensor *o = lunar_lua_check_tensor(L, 5);
    lunar_tensor *lse = lunar_lua_check_tensor(L, 6);
    lunar_tensor *q = lunar_lua_check_tensor(L, 7);
    lunar_tensor *k = lunar_lua_check_tensor(L, 8);
    lunar_tensor *v = lunar_lua_check_tensor(L, 9);
    lunar_tensor *keys = lunar_lua_opt_tensor(L, 10);
    lunar_tensor *mask = lunar_lua_opt_tensor(L, 11);
    float scale = (float)luaL_checknumber(L, 12);
    lunar_lua_check_status(L, lunar_attention_backward(lunar_lua_ctx(L), dq, dk, dv, dout, o, lse, q, k, v, keys,
                                                       mask, scale));
    lua_settop(L, 3);
    return 3;
}

/* core.ops.index_scores(scores, topk, qi, ki, w, mask, scale) -> scores, topk */
static int l_index_scores(lua_State *L) {
    lunar_tensor *scores = lunar_lua_opt_tensor(L, 1);
    lunar_tensor *topk = lunar_lua_opt_tensor(L, 2);
    lunar_tensor *qi = lunar_lua_check_tensor(L, 3);
    lunar_tensor *ki = lunar_lua_check_tensor(L, 4);
    lunar_tensor *w = lunar_lua_check_tensor(L, 5);
    lunar_tensor *mask = lunar_lua_opt_tensor(L, 6);
    float scale = (float)luaL_checknumber(L, 7);
    lunar_lua_check_status(L, lunar_index_scores(lunar_lua_ctx(L), scores, topk, qi, ki, w, mask, scale));
    lua_settop(L, 2);
    return 2;
}

/* core.ops.attention_paged(o, q, k, v, table, lengths, keys, block_size, scale) -> o */
static int l_attention_paged(lua_State *L) {
    lunar_tensor *o = lunar_lua_check_tensor(L, 1);
    lunar_tensor *q = lunar_lua_check_tensor(L, 2);
    lunar_tensor *k = lunar_lua_check_tensor(L, 3);
    lunar_tensor *v = lunar_lua_check_tensor(L, 4);
    lunar_tensor *table = lunar_lua_check_tensor(L, 5);
    lunar_tensor *lengths = lunar_lua_check_tensor(L, 6);
    lunar_tensor *keys = lunar_lua_opt_tensor(L, 7);
    int64_t block_size = (int64_t)luaL_checknumber(L, 8);
    float scale = (float)luaL_checknumber(L, 9);
    lunar_lua_check_status(L, lunar_attention_paged(lunar_lua_ctx(L), o, q, k, v, table, lengths, keys, block_size,
                                                    scale));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_attention(lua_State *L) {
    static const luaL_Reg fns[] = {{"attention_forward", l_attention_forward},
                                   {"attention_backward", l_attention_backward},
                                   {"attention_paged", l_attention_paged},
                                   {"index_scores", l_index_scores},
                                   {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
