/* lua_ops_reduce.c: bindings of the reduce ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_reduce(lua_State *L) { (void)L; }
