/* lua_ops_rope.c: bindings of the rope ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_rope(lua_State *L) { (void)L; }
