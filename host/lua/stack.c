/* stack.c: a copy of the Lua call stack, taken by the error handlers while the failing frames
 * still exist (after the unwind they are gone), for the --repl-on-error REPL: its :where, :up,
 * :down and :locals, and the names its expressions see (lua/lunar/repl.lua reads the copy).
 *
 * The copy is a list of frames, innermost first:
 *
 *   {start = i, {what=, source=, chunk=, line=, name=, namewhat=, linedefined=, lib=, func=,
 *                locals = {n=, names={...}, values={...}},
 *                upvalues = {n=, names={...}, values={...}}}, ...}
 *
 * source is the short form shown in tracebacks, chunk the chunk name ("@path" for a file).
 * values[i] is nil for a variable that holds nil (names[i] still says it exists). `start` is the
 * frame the REPL opens at: the innermost frame of the user's code (not C, not lunar's own
 * library, chunk names "@lunar:..."), so an error raised inside the library opens where the
 * user called it. */
#include <string.h>

#include <lauxlib.h>

#include "lua_lunar.h"
#include "vm.h"

static int is_library(const lua_Debug *ar) {
    return strncmp(ar->source, LUNAR_LIB_CHUNK_PREFIX, strlen(LUNAR_LIB_CHUNK_PREFIX)) == 0;
}

/* pushes {n=, names=, values=} for a name/value list collected by the caller: the names table
 * is at names_idx, the values table at values_idx (both popped) */
static void push_vars(lua_State *L, int names_idx, int values_idx, int n) {
    lua_createtable(L, 0, 3);
    lua_pushinteger(L, n);
    lua_setfield(L, -2, "n");
    lua_pushvalue(L, names_idx);
    lua_setfield(L, -2, "names");
    lua_pushvalue(L, values_idx);
    lua_setfield(L, -2, "values");
    lua_replace(L, names_idx);
    lua_settop(L, names_idx);
}

/* the frame's locals in declaration order (a later one of the same name shadows an earlier
 * one); the VM's temporaries, named "(...)", are left out */
static void push_locals(lua_State *L, lua_Debug *ar) {
    lua_newtable(L);
    int names = lua_gettop(L);
    lua_newtable(L);
    int values = names + 1, n = 0;
    const char *name;
    for (int i = 1; (name = lua_getlocal(L, ar, i)) != NULL; i++) {
        if (name[0] == '(') {
            lua_pop(L, 1);
            continue;
        }
        n++;
        lua_rawseti(L, values, n);
        lua_pushstring(L, name);
        lua_rawseti(L, names, n);
    }
    push_vars(L, names, values, n);
}

/* the upvalues of the function at func (a C function's have no names and are left out) */
static void push_upvalues(lua_State *L, int func) {
    lua_newtable(L);
    int names = lua_gettop(L);
    lua_newtable(L);
    int values = names + 1, n = 0;
    const char *name;
    for (int i = 1; (name = lua_getupvalue(L, func, i)) != NULL; i++) {
        if (!*name) {
            lua_pop(L, 1);
            continue;
        }
        n++;
        lua_rawseti(L, values, n);
        lua_pushstring(L, name);
        lua_rawseti(L, names, n);
    }
    push_vars(L, names, values, n);
}

static void set_string(lua_State *L, const char *key, const char *s) {
    if (!s) return;
    lua_pushstring(L, s);
    lua_setfield(L, -2, key);
}

static void set_int(lua_State *L, const char *key, int v) {
    lua_pushinteger(L, v);
    lua_setfield(L, -2, key);
}

void lunar_vm_push_stack(lua_State *L, int level) {
    lua_Debug ar;
    lua_newtable(L);
    int stack = lua_gettop(L);
    int n = 0, start = 0, first_lua = 0;
    for (; lua_getstack(L, level, &ar); level++) {
        if (!lua_getinfo(L, "Slnf", &ar)) break;
        int func = lua_gettop(L);
        int is_lua = strcmp(ar.what, "C") != 0;
        n++;
        if (is_lua && !first_lua) first_lua = n;
        if (is_lua && !start && !is_library(&ar)) start = n;
        lua_createtable(L, 0, 12);
        set_string(L, "what", ar.what);
        set_string(L, "source", ar.short_src);
        set_string(L, "chunk", ar.source);
        set_int(L, "line", ar.currentline);
        set_string(L, "name", ar.name);
        set_string(L, "namewhat", ar.namewhat);
        set_int(L, "linedefined", ar.linedefined);
        lua_pushboolean(L, is_library(&ar));
        lua_setfield(L, -2, "lib");
        lua_pushvalue(L, func);
        lua_setfield(L, -2, "func");
        push_locals(L, &ar);
        lua_setfield(L, -2, "locals");
        push_upvalues(L, func);
        lua_setfield(L, -2, "upvalues");
        lua_rawseti(L, stack, n);
        lua_settop(L, stack);
    }
    /* no user frame: the innermost Lua frame, else the innermost frame */
    set_int(L, "start", start ? start : first_lua ? first_lua : 1);
}
