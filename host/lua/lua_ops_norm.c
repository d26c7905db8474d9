/* lua_ops_norm.c: bindings of the norm ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_norm(lua_State *L) { (void)L; }
