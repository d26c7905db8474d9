/* vm.h: creating the Lua VM and running code in it under a protected call with a traceback. */
#ifndef LUNAR_LUA_VM_H
#define LUNAR_LUA_VM_H

#include <lua.h>

#include "lunar/ctx.h"

/* A new VM with the standard libraries, lunar's module searcher (embedded lua/ sources, or the
 * files under $LUNAR_LUA_PATH when set) and the C core in package.preload["lunar.core"]. */
lua_State *lunar_vm_new(lunar_ctx *ctx);
void       lunar_vm_free(lua_State *L);

/* The message handler used for every protected call: appends a traceback to the error, except
 * to a user error (core.user_error: a bad setting, a missing file), which stays its one line
 * unless the registry flag "lunar.traceback" is set (lunar --traceback).
 * When the registry flag "lunar.repl_on_error" is set (once), it also copies the stack (every
 * frame's locals and upvalues, lunar_vm_push_stack) for lunar_vm_repl_at_failure. */
int lunar_vm_traceback(lua_State *L);

/* After a protected call failed under the "lunar.repl_on_error" flag: runs the REPL at the
 * failing frame, its locals and upvalues visible (globals behind them), :up and :down moving
 * along the copied stack (lua/lunar/repl.lua). Returns 1 if a REPL ran, 0 if nothing had been
 * captured. */
int lunar_vm_repl_at_failure(lua_State *L);

/* Pushes a copy of the call stack from `level` outwards (stack.c): each frame's function,
 * source line, locals and upvalues, for the REPL at the failure. */
void lunar_vm_push_stack(lua_State *L, int level);

/* Load (file, string) and call with nargs arguments already pushed; on error the message with
 * traceback is left on the stack and the status returned. */
int lunar_vm_pcall(lua_State *L, int nargs, int nresults);
int lunar_vm_dofile(lua_State *L, const char *path, int nargs);
int lunar_vm_dostring(lua_State *L, const char *code, const char *chunkname);

/* 1 if a is a dotted override, key(.key)*=value with keys of letters, digits and '_' not
 * starting with a digit: the rule that tells overrides from other arguments, on the command
 * line (main.c) and for lunar.config (core.is_override). */
int lunar_vm_is_override(const char *a);

/* The REPL (repl.c): reads lines with readline and history until EOF or os.exit. env: stack
 * index of a table used as the chunks' environment, or 0 for the globals. */
void lunar_repl_run(lua_State *L, int env);

#endif
