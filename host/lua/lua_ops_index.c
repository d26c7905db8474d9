/* lua_ops_index.c: bindings of the index ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_index(lua_State *L) { (void)L; }
