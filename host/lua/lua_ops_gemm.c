/* lua_ops_gemm.c: bindings of the gemm ops (stub: none yet). */
#include "lua_ops.h"

void lunar_lua_ops_gemm(lua_State *L) { (void)L; }
