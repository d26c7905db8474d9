/* vm.c: VM setup (OpenResty's single setup function), module loading and protected calls. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <lauxlib.h>
#include <lualib.h>

#include "lua_lunar.h"
#include "vm.h"

typedef struct { const char *module, *path, *source; size_t size; } lunar_embedded_lua;
extern const lunar_embedded_lua lunar_embedded_lua_files[];

static int file_exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* package.loaders entry: lunar's own modules, from $LUNAR_LUA_PATH or the embedded copy. The
 * chunk name "@lunar:<path>" marks them as library code (see lunar_lua_user_where). */
static int searcher(lua_State *L) {
    const char *name = luaL_checkstring(L, 1);
    const char *dir = getenv("LUNAR_LUA_PATH");
    char rel[512], path[1024], chunk[600];
    snprintf(rel, sizeof rel, "%s", name);
    for (char *c = rel; *c; c++)
        if (*c == '.') *c = '/';
    if (dir && *dir) {
        const char *forms[2] = {"%s/%s.lua", "%s/%s/init.lua"};
        for (int i = 0; i < 2; i++) {
            snprintf(path, sizeof path, forms[i], dir, rel);
            if (file_exists(path)) {
                snprintf(chunk, sizeof chunk, "%s%s", LUNAR_LIB_CHUNK_PREFIX, path + strlen(dir) + 1);
                FILE *f = fopen(path, "rb");
                if (!f) break;
                fseek(f, 0, SEEK_END);
                long n = ftell(f);
                fseek(f, 0, SEEK_SET);
                char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;   /* ftell fails with -1 */
                size_t got = buf ? fread(buf, 1, (size_t)n, f) : 0;
                fclose(f);
                if (!buf || got != (size_t)n) {
                    free(buf);
                    lua_pushfstring(L, "\n\tcannot read '%s'", path);
                    return 1;
                }
                int rc = luaL_loadbuffer(L, buf, (size_t)n, chunk);
                free(buf);
                if (rc != 0) return lua_error(L);
                return 1;
            }
        }
    }
    for (const lunar_embedded_lua *e = lunar_embedded_lua_files; e->module; e++) {
        if (strcmp(e->module, name) == 0) {
            snprintf(chunk, sizeof chunk, "%s%s", LUNAR_LIB_CHUNK_PREFIX, e->path + 4);   /* strip "lua/" */
            if (luaL_loadbuffer(L, e->source, e->size, chunk) != 0) return lua_error(L);
            return 1;
        }
    }
    lua_pushfstring(L, "\n\tno embedded lunar module '%s'", name);
    return 1;
}

/* the rule is in vm.h */
int lunar_vm_is_override(const char *a) {
    const char *p = a;
    int at_key_start = 1;
    for (; *p && *p != '='; p++) {
        int c = (unsigned char)*p;
        if (c == '.') {
            if (at_key_start) return 0;
            at_key_start = 1;
        } else if (isalpha(c) || c == '_' || (!at_key_start && isdigit(c))) {
            at_key_start = 0;
        } else {
            return 0;
        }
    }
    return *p == '=' && p != a && !at_key_start;
}

/* core.is_override(s) -> lunar_vm_is_override(s) */
static int l_is_override(lua_State *L) {
    lua_pushboolean(L, lunar_vm_is_override(luaL_checkstring(L, 1)));
    return 1;
}

/* core.overrides() -> {"a.b=1", ...}: the key=value arguments given after the script */
static int l_overrides(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.overrides");
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        lua_newtable(L);
    }
    return 1;
}

/* core.clock() -> seconds from a monotonic clock (for timing; os.clock is CPU time) */
static int l_clock(lua_State *L) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
    return 1;
}

static int l_error_site(lua_State *L);
static int l_error_stack(lua_State *L);
static int l_reraise(lua_State *L);

/* ---- user errors ------------------------------------------------------------------------------
 *
 * A user's mistake (a bad setting, a missing file, a wrong template) is reported as its one-line
 * message, without a traceback into lunar's library: core.user_error(msg) records the message in
 * the registry set "lunar.user_errors" and raises it. Errors stay plain strings, so a pcall that
 * catches one sees the message as before; the top-level handler (lunar_vm_traceback) leaves the
 * traceback off a message in the set unless the registry flag "lunar.traceback" (lunar
 * --traceback) is set. */
static int l_user_error(lua_State *L) {
    luaL_checkstring(L, 1);
    lua_settop(L, 1);
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.user_errors");
    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setfield(L, LUA_REGISTRYINDEX, "lunar.user_errors");
    }
    lua_pushvalue(L, 1);
    lua_pushboolean(L, 1);
    lua_rawset(L, -3);
    lua_pop(L, 1);
    return lua_error(L);
}

/* core.show_tracebacks(on): user errors get their traceback too (lunar --traceback, or a
 * recipe's own --traceback argument) */
static int l_show_tracebacks(lua_State *L) {
    lua_pushboolean(L, lua_toboolean(L, 1));
    lua_setfield(L, LUA_REGISTRYINDEX, "lunar.traceback");
    return 0;
}

/* core.errors_debugged() -> true under lunar --traceback or --repl-on-error: code that turns
 * errors into user errors (one line) lets them pass as they are, with their stack */
static int l_errors_debugged(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.traceback");
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.repl_on_error");
    lua_pushboolean(L, lua_toboolean(L, -1) || lua_toboolean(L, -2));
    return 1;
}

/* 1 if error value 1 is a user error to be reported without a traceback */
static int is_plain_user_error(lua_State *L) {
    if (lua_type(L, 1) != LUA_TSTRING) return 0;
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.traceback");
    int want_traceback = lua_toboolean(L, -1);
    lua_pop(L, 1);
    if (want_traceback) return 0;
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.user_errors");
    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        return 0;
    }
    lua_pushvalue(L, 1);
    lua_rawget(L, -2);
    int yes = lua_toboolean(L, -1);
    lua_pop(L, 2);
    return yes;
}

static int l_repl(lua_State *L) {
    int env = lua_istable(L, 1) ? 1 : 0;
    lunar_repl_run(L, env);
    return 0;
}

static int open_core(lua_State *L) {
    lua_newtable(L);
    lunar_lua_open_tensor(L);
    lunar_lua_open_arena(L);
    lunar_lua_open_rng(L);
    lunar_lua_open_ops(L);
    lunar_lua_open_dist(L);
    lunar_lua_open_io(L);
    lunar_lua_open_fs(L);
    lunar_lua_open_data(L);
    lunar_lua_open_tokenizer(L);
    lunar_lua_open_signal(L);
    lua_pushstring(L, LUNAR_VERSION);
    lua_setfield(L, -2, "version");
    static const luaL_Reg fns[] = {
        {"overrides", l_overrides},   {"is_override", l_is_override}, {"repl", l_repl},
        {"clock", l_clock},           {"error_site", l_error_site},   {"error_stack", l_error_stack},
        {"reraise", l_reraise},       {"user_error", l_user_error},
        {"show_tracebacks", l_show_tracebacks}, {"errors_debugged", l_errors_debugged}, {NULL, NULL},
    };
    lunar_lua_setfuncs(L, fns);
    return 1;
}

lua_State *lunar_vm_new(lunar_ctx *ctx) {
    lua_State *L = luaL_newstate();
    if (!L) return NULL;
    luaL_openlibs(L);
    lunar_lua_set_ctx(L, ctx);
    /* package.preload["lunar.core"] = open_core */
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "preload");
    lua_pushcfunction(L, open_core);
    lua_setfield(L, -2, "lunar.core");
    lua_pop(L, 1);
    /* insert our searcher right after the preload searcher */
    lua_getfield(L, -1, "loaders");
    int n = (int)lua_objlen(L, -1);
    for (int i = n; i >= 2; i--) {
        lua_rawgeti(L, -1, i);
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushcfunction(L, searcher);
    lua_rawseti(L, -2, 2);
    lua_pop(L, 2);
    return L;
}

void lunar_vm_free(lua_State *L) {
    if (L) lua_close(L);
}

/* ---- --repl-on-error ------------------------------------------------------------------------
 *
 * The message handler runs while the failing frames still exist, so that is where the stack is
 * copied: every frame's function, line, locals and upvalues (stack.c), kept in the registry
 * ("lunar.failure_stack"). The REPL itself opens only after the protected call has returned
 * (lunar_vm_repl_at_failure): inside the handler the VM is in its error-handling state, where
 * an error in code the REPL runs, though caught by the REPL's own protected call, can come out
 * as "error in error handling", so a REPL there could not report its own errors. */

int lunar_vm_repl_at_failure(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.failure_stack");
    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        return 0;
    }
    lua_pushnil(L);
    lua_setfield(L, LUA_REGISTRYINDEX, "lunar.failure_stack");
    int stack = lua_gettop(L);
    /* the REPL's conveniences: `lunar` is there even if the script only had a local one */
    if (lunar_vm_dostring(L, "lunar = lunar or require 'lunar'", "=(repl)") != 0) lua_pop(L, 1);
    /* env = require('lunar.repl').at_failure(stack): the selected frame's names in front of the
     * globals; it says where the REPL opens */
    lua_getglobal(L, "require");
    lua_pushstring(L, "lunar.repl");
    int rc = lunar_vm_pcall(L, 1, 1);
    if (rc == 0) {
        lua_getfield(L, -1, "at_failure");
        lua_pushvalue(L, stack);
        rc = lunar_vm_pcall(L, 1, 1);
    }
    if (rc != 0 || !lua_istable(L, -1)) {
        fprintf(stderr, "lunar: cannot open the REPL at the failure: %s\n",
                rc != 0 ? lua_tostring(L, -1) : "lunar.repl.at_failure returned no table");
        lua_settop(L, stack - 1);
        return 0;
    }
    int env = lua_gettop(L);
    lunar_repl_run(L, env);
    lua_settop(L, stack - 1);
    return 1;
}

/* 1 if the "lunar.repl_on_error" flag is set */
static int repl_on_error_pending(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.repl_on_error");
    int repl = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return repl;
}

/* pushes the traceback of error value 1 from where it was raised (level 2: above the handler) */
static void traceback_at_error(lua_State *L) {
    int top = lua_gettop(L);
    lua_getglobal(L, "debug");
    lua_getfield(L, -1, "traceback");
    if (lua_isstring(L, 1)) {
        lua_pushvalue(L, 1);
    } else if (luaL_callmeta(L, 1, "__tostring") && lua_isstring(L, -1)) {
    } else {
        lua_settop(L, top + 2);   /* drop a __tostring result that is not a string */
        lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    lua_pushinteger(L, 2);
    lua_call(L, 2, 1);
    lua_remove(L, -2);   /* debug */
}

/* core.reraise(err): how lunar.scope passes an error on after its cleanup. The handlers tell a
 * re-raise (the error already has its record) from a new error by this function being the one
 * that raised it, not by the error value: a new error may well have the same value. */
static int l_reraise(lua_State *L) {
    lua_settop(L, 1);
    return lua_error(L);
}

static int raised_by_reraise(lua_State *L) {
    lua_Debug ar;
    if (!lua_getstack(L, 1, &ar)) return 0;
    lua_getinfo(L, "f", &ar);
    int yes = lua_tocfunction(L, -1) == l_reraise;
    lua_pop(L, 1);
    return yes;
}

/* The record of the error passing through lunar.scope ("lunar.error_site" = {error value,
 * traceback, copy of the stack or nil}), made by core.error_site where the failing frames
 * were still on the stack; pushes it if error value 1 is being re-raised by a scope, else
 * pushes nothing and returns 0. */
static int error_record(lua_State *L) {
    if (!raised_by_reraise(L)) return 0;
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.error_site");
    if (lua_istable(L, -1)) {
        lua_rawgeti(L, -1, 1);
        int same = lua_rawequal(L, -1, 1);
        lua_pop(L, 1);
        if (same) return 1;
    }
    lua_pop(L, 1);
    return 0;
}

/* core.error_site(err) -> err: lunar.scope's message handler. A new error gets a record: its
 * traceback and, under --repl-on-error, a copy of the stack with every frame's locals (the scope
 * keeps their tensors alive past its cleanup). Nothing global changes here: the error may yet be caught;
 * only the top-level handler turns the record into the failure REPL's frame. The error value
 * is returned unchanged, so pcall around a scope sees what was raised. */
static int l_error_site(lua_State *L) {
    lua_settop(L, 1);
    if (error_record(L)) {   /* an inner scope re-raising: its record stands */
        lua_pop(L, 1);
        return 1;
    }
    lua_createtable(L, 3, 0);
    lua_pushvalue(L, 1);
    lua_rawseti(L, -2, 1);
    traceback_at_error(L);
    lua_rawseti(L, -2, 2);
    if (repl_on_error_pending(L)) {
        lunar_vm_push_stack(L, 1);
        lua_rawseti(L, -2, 3);
    }
    lua_setfield(L, LUA_REGISTRYINDEX, "lunar.error_site");
    return 1;
}

/* core.error_stack(err) -> the copy of the stack recorded for err, or nil */
static int l_error_stack(lua_State *L) {
    lua_settop(L, 1);
    lua_getfield(L, LUA_REGISTRYINDEX, "lunar.error_site");
    if (!lua_istable(L, -1)) return 0;
    lua_rawgeti(L, -1, 1);
    if (!lua_rawequal(L, -1, 1)) return 0;
    lua_rawgeti(L, -2, 3);
    return 1;
}

int lunar_vm_traceback(lua_State *L) {
    lua_settop(L, 1);
    int repl = repl_on_error_pending(L);
    if (repl) {
        lua_pushnil(L);
        lua_setfield(L, LUA_REGISTRYINDEX, "lunar.repl_on_error");   /* once */
    }
    if (error_record(L)) {
        if (repl) {
            lua_rawgeti(L, -1, 3);
            lua_setfield(L, LUA_REGISTRYINDEX, "lunar.failure_stack");
        }
        lua_rawgeti(L, -1, 2);
        lua_pushnil(L);
        lua_setfield(L, LUA_REGISTRYINDEX, "lunar.error_site");
        if (is_plain_user_error(L)) lua_pushvalue(L, 1);
        return 1;
    }
    if (repl) {
        lunar_vm_push_stack(L, 1);
        lua_setfield(L, LUA_REGISTRYINDEX, "lunar.failure_stack");
    }
    if (is_plain_user_error(L)) lua_pushvalue(L, 1);
    else traceback_at_error(L);
    return 1;
}

int lunar_vm_pcall(lua_State *L, int nargs, int nresults) {
    int base = lua_gettop(L) - nargs;
    lua_pushcfunction(L, lunar_vm_traceback);
    lua_insert(L, base);
    int rc = lua_pcall(L, nargs, nresults, base);
    lua_remove(L, base);
    return rc;
}

int lunar_vm_dofile(lua_State *L, const char *path, int nargs) {
    int rc = luaL_loadfile(L, path);
    if (rc != 0) {
        lua_insert(L, -(nargs + 1));
        lua_pop(L, nargs);
        return rc;
    }
    lua_insert(L, -(nargs + 1));
    return lunar_vm_pcall(L, nargs, 0);
}

int lunar_vm_dostring(lua_State *L, const char *code, const char *chunkname) {
    int rc = luaL_loadbuffer(L, code, strlen(code), chunkname);
    if (rc != 0) return rc;
    return lunar_vm_pcall(L, 0, 0);
}
