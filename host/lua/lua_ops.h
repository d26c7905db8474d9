/* lua_ops.h: the op bindings, one file per op family (host/lua/lua_ops_<family>.c). Each
 * function adds its C functions to the table on top of the stack (core.ops). The bindings are
 * thin: every tensor, output included, is passed in; lua/lunar/ops/<family>.lua allocates outputs and
 * gives the friendly signatures. */
#ifndef LUNAR_LUA_OPS_H
#define LUNAR_LUA_OPS_H

#include "lua_lunar.h"

void lunar_lua_ops_gemm(lua_State *L);
void lunar_lua_ops_elementwise(lua_State *L);
void lunar_lua_ops_reduce(lua_State *L);
void lunar_lua_ops_softmax(lua_State *L);
void lunar_lua_ops_norm(lua_State *L);
void lunar_lua_ops_rope(lua_State *L);
void lunar_lua_ops_index(lua_State *L);
void lunar_lua_ops_sort(lua_State *L);
void lunar_lua_ops_mask(lua_State *L);
void lunar_lua_ops_adamw(lua_State *L);
void lunar_lua_ops_fp8(lua_State *L);
void lunar_lua_ops_attention(lua_State *L);
void lunar_lua_ops_kda(lua_State *L);
void lunar_lua_ops_hyper(lua_State *L);

#endif
