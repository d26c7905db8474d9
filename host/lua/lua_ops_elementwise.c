/* lua_ops_elementwise.c: bindings of the elementwise ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_elementwise(lua_State *L) { (void)L; }
