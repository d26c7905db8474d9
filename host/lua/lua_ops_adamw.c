/* lua_ops_adamw.c: bindings of the adamw ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_adamw(lua_State *L) { (void)L; }
