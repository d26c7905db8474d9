/* lua_ops_softmax.c: bindings of the softmax ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_softmax(lua_State *L) { (void)L; }
