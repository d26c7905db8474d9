/* lua_ops_elementwise.c: bindings of the elementwise ops. Ops are named by strings ('add',
 * 'exp', ...: the names of lunar_binary_op_name / lunar_unary_op_name). */
#include "lua_ops.h"
#include "lunar/ops.h"

static lunar_binary_op check_binary_op(lua_State *L, int idx) {
    const char *name = luaL_checkstring(L, idx);
    lunar_binary_op op;
    if (!lunar_binary_op_from_name(name, &op)) lunar_lua_error(L, "unknown binary op '%s'", name);
    return op;
}

static lunar_unary_op check_unary_op(lua_State *L, int idx) {
    const char *name = luaL_checkstring(L, idx);
    lunar_unary_op op;
    if (!lunar_unary_op_from_name(name, &op)) lunar_lua_error(L, "unknown unary op '%s'", name);
    return op;
}

/* core.ops.binary(out, a, b, op) -> out; b may be a number (the scalar form) */
static int l_binary(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *a = lunar_lua_check_tensor(L, 2);
    lunar_binary_op op = check_binary_op(L, 4);
    lunar_ctx *ctx = lunar_lua_ctx(L);
    if (lua_type(L, 3) == LUA_TNUMBER) {
        lunar_lua_check_status(L, lunar_binary_scalar(ctx, out, a, lua_tonumber(L, 3), op));
    } else {
        lunar_tensor *b = lunar_lua_check_tensor(L, 3);
        lunar_lua_check_status(L, lunar_binary(ctx, out, a, b, op));
    }
    lua_settop(L, 1);
    return 1;
}

/* core.ops.unary(out, x, op) -> out */
static int l_unary(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    lunar_unary_op op = check_unary_op(L, 3);
    lunar_lua_check_status(L, lunar_unary(lunar_lua_ctx(L), out, x, op));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.unary_backward(dx, dy, x, op) -> dx */
static int l_unary_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dy = lunar_lua_check_tensor(L, 2);
    lunar_tensor *x = lunar_lua_check_tensor(L, 3);
    lunar_unary_op op = check_unary_op(L, 4);
    lunar_lua_check_status(L, lunar_unary_backward(lunar_lua_ctx(L), dx, dy, x, op));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.swiglu_forward(out, gate, up) -> out */
static int l_swiglu_forward(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *gate = lunar_lua_check_tensor(L, 2);
    lunar_tensor *up = lunar_lua_check_tensor(L, 3);
    lunar_lua_check_status(L, lunar_swiglu_forward(lunar_lua_ctx(L), out, gate, up));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.swiglu_backward(dgate, dup, dout, gate, up) -> dgate, dup */
static int l_swiglu_backward(lua_State *L) {
    lunar_tensor *dgate = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dup = lunar_lua_check_tensor(L, 2);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 3);
    lunar_tensor *gate = lunar_lua_check_tensor(L, 4);
    lunar_tensor *up = lunar_lua_check_tensor(L, 5);
    lunar_lua_check_status(L, lunar_swiglu_backward(lunar_lua_ctx(L), dgate, dup, dout, gate, up));
    lua_settop(L, 2);
    return 2;
}

/* core.ops.masked_fill(out, x, mask, value) -> out */
static int l_masked_fill(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    lunar_tensor *mask = lunar_lua_check_tensor(L, 3);
    double value = luaL_checknumber(L, 4);
    lunar_lua_check_status(L, lunar_masked_fill(lunar_lua_ctx(L), out, x, mask, value));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_elementwise(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"binary", l_binary},
        {"unary", l_unary},
        {"unary_backward", l_unary_backward},
        {"swiglu_forward", l_swiglu_forward},
        {"swiglu_backward", l_swiglu_backward},
        {"masked_fill", l_masked_fill},
        {NULL, NULL},
    };
    lunar_lua_setfuncs(L, fns);
}
