/* lua_ops_index.c: bindings of embedding / index_select / index_add / gather / scatter /
 * index_select_sum / bincount. Dims are 0-based C dims here (negative counts from the end);
 * lunar/ops/index.lua converts. */
#include "lua_ops.h"
#include "lunar/ops.h"

/* core.ops.embedding_forward(out, ids, weight) -> out */
static int l_embedding_forward(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *ids = lunar_lua_check_tensor(L, 2);
    lunar_tensor *weight = lunar_lua_check_tensor(L, 3);
    lunar_lua_check_status(L, lunar_embedding_forward(lunar_lua_ctx(L), out, ids, weight));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.embedding_backward(dweight, dout, ids) -> dweight (accumulated) */
static int l_embedding_backward(lua_State *L) {
    lunar_tensor *dweight = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 2);
    lunar_tensor *ids = lunar_lua_check_tensor(L, 3);
    lunar_lua_check_status(L, lunar_embedding_backward(lunar_lua_ctx(L), dweight, dout, ids));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.index_select(out, src, dim, index) -> out */
static int l_index_select(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *src = lunar_lua_check_tensor(L, 2);
    int dim = (int)luaL_checkinteger(L, 3);
    lunar_tensor *index = lunar_lua_check_tensor(L, 4);
    lunar_lua_check_status(L, lunar_index_select(lunar_lua_ctx(L), out, src, dim, index));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.index_add(dst, dim, index, src, alpha) -> dst */
static int l_index_add(lua_State *L) {
    lunar_tensor *dst = lunar_lua_check_tensor(L, 1);
    int dim = (int)luaL_checkinteger(L, 2);
    lunar_tensor *index = lunar_lua_check_tensor(L, 3);
    lunar_tensor *src = lunar_lua_check_tensor(L, 4);
    double alpha = luaL_optnumber(L, 5, 1.0);
    lunar_lua_check_status(L, lunar_index_add(lunar_lua_ctx(L), dst, dim, index, src, alpha));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.gather(out, src, dim, index) -> out */
static int l_gather(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *src = lunar_lua_check_tensor(L, 2);
    int dim = (int)luaL_checkinteger(L, 3);
    lunar_tensor *index = lunar_lua_check_tensor(L, 4);
    lunar_lua_check_status(L, lunar_gather(lunar_lua_ctx(L), out, src, dim, index));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.scatter(dst, dim, index, src) / core.ops.scatter_add(...) -> dst */
static int scatter_common(lua_State *L, int accumulate) {
    lunar_tensor *dst = lunar_lua_check_tensor(L, 1);
    int dim = (int)luaL_checkinteger(L, 2);
    lunar_tensor *index = lunar_lua_check_tensor(L, 3);
    lunar_tensor *src = lunar_lua_check_tensor(L, 4);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    lunar_lua_check_status(L, accumulate ? lunar_scatter_add(ctx, dst, dim, index, src)
                                         : lunar_scatter(ctx, dst, dim, index, src));
    lua_settop(L, 1);
    return 1;
}

static int l_scatter(lua_State *L) { return scatter_common(L, 0); }
static int l_scatter_add(lua_State *L) { return scatter_common(L, 1); }

/* core.ops.index_select_sum(out, src, index, accumulate) -> out */
static int l_index_select_sum(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *src = lunar_lua_check_tensor(L, 2);
    lunar_tensor *index = lunar_lua_check_tensor(L, 3);
    int accumulate = lua_toboolean(L, 4);
    lunar_lua_check_status(L, lunar_index_select_sum(lunar_lua_ctx(L), out, src, index, accumulate));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.bincount(counts, values) -> counts */
static int l_bincount(lua_State *L) {
    lunar_tensor *counts = lunar_lua_check_tensor(L, 1);
    lunar_tensor *values = lunar_lua_check_tensor(L, 2);
    lunar_lua_check_status(L, lunar_bincount(lunar_lua_ctx(L), counts, values));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_index(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"embedding_forward", l_embedding_forward}, {"embedding_backward", l_embedding_backward},
        {"index_select", l_index_select}, {"index_add", l_index_add}, {"gather", l_gather},
        {"scatter", l_scatter}, {"scatter_add", l_scatter_add}, {"index_select_sum", l_index_select_sum},
        {"bincount", l_bincount}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
