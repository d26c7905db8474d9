/* lua_ops_rope.c: bindings of the rotary embedding ops. */
#include <string.h>

#include "lua_ops.h"
#include "lunar/ops.h"

static lunar_rope_layout check_layout(lua_State *L, int idx) {
    const char *s = luaL_optstring(L, idx, "half");
    if (strcmp(s, "half") == 0) return LUNAR_ROPE_HALF;
    if (strcmp(s, "interleaved") == 0) return LUNAR_ROPE_INTERLEAVED;
    if (strcmp(s, "interleaved_to_half") == 0) return LUNAR_ROPE_INTERLEAVED_TO_HALF;
    lunar_lua_error(L, "rope: unknown layout '%s' (expected 'half', 'interleaved' or 'interleaved_to_half')", s);
    return LUNAR_ROPE_HALF;
}

/* core.ops.rope_forward(out, x, positions, inv_freq, layout, scale) -> out */
static int l_rope_forward(lua_State *L) {
    lunar_tensor *out = lunar_lua_check_tensor(L, 1);
    lunar_tensor *x = lunar_lua_check_tensor(L, 2);
    lunar_tensor *pos = lunar_lua_check_tensor(L, 3);
    lunar_tensor *freq = lunar_lua_check_tensor(L, 4);
    lunar_rope_layout layout = check_layout(L, 5);
    float scale = (float)luaL_optnumber(L, 6, 1.0);
    lunar_lua_check_status(L, lunar_rope_forward(lunar_lua_ctx(L), out, x, pos, freq, layout, scale));
    lua_settop(L, 1);
    return 1;
}

/* core.ops.rope_backward(dx, dout, positions, inv_freq, layout, scale) -> dx */
static int l_rope_backward(lua_State *L) {
    lunar_tensor *dx = lunar_lua_check_tensor(L, 1);
    lunar_tensor *dout = lunar_lua_check_tensor(L, 2);
    lunar_tensor *pos = lunar_lua_check_tensor(L, 3);
    lunar_tensor *freq = lunar_lua_check_tensor(L, 4);
    lunar_rope_layout layout = check_layout(L, 5);
    float scale = (float)luaL_optnumber(L, 6, 1.0);
    lunar_lua_check_status(L, lunar_rope_backward(lunar_lua_ctx(L), dx, dout, pos, freq, layout, scale));
    lua_settop(L, 1);
    return 1;
}

void lunar_lua_ops_rope(lua_State *L) {
    static const luaL_Reg fns[] = {{"rope_forward", l_rope_forward}, {"rope_backward", l_rope_backward}, {NULL, NULL}};
    lunar_lua_setfuncs(L, fns);
}
