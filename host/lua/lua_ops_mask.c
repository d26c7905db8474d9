/* lua_ops_mask.c: bindings of the mask ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_mask(lua_State *L) { (void)L; }
