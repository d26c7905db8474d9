/* lua_ops_sort.c: bindings of the sort ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_sort(lua_State *L) { (void)L; }
