/* main.c: the lunar executable.
 *
 *   lunar script.lua [key.sub=value ...] [args ...]   run a script with dotted overrides
 *   lunar -e 'code'                                  run a string
 *   lunar -i [script.lua ...]                        REPL (after the script, if one is given)
 *   lunar --repl-on-error script.lua                 on error, a REPL at the failure
 *   lunar --traceback script.lua                     tracebacks for user errors too
 *   lunar --version
 *
 * Everything after the script name belongs to the script: `arg` holds it (arg[0] is the script)
 * and the key=value entries are also available parsed as lunar.config.overrides(). A script
 * error prints the message with a traceback and exits 1; under mpirun the message carries the
 * rank and the whole job is aborted, so no rank is left waiting in a collective.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lauxlib.h>
#include <lua.h>

#include "lua/lua_lunar.h"
#include "lua/vm.h"
#include "lunar/ctx.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: lunar [options] [script.lua [key=value ...] [args ...]]\n"
            "  -e CODE           run CODE (before the script)\n"
            "  -i                interactive REPL (after the script, if any, even if it failed)\n"
            "  --repl-on-error   open the REPL at the failure if the script raises an error\n"
            "  --traceback       show the traceback of a user error (a bad setting, a missing file) too\n"
            "  --threads N       CPU threads for kernels (default: LUNAR_THREADS or all cores)\n"
            "  --version         print the version\n"
            "  -h, --help        this help\n"
            "Environment: LUNAR_LUA_PATH=dir loads lunar's Lua modules from dir instead of the\n"
            "embedded copy; LUNAR_HISTORY sets the REPL history file.\n");
}

/* Print a fatal script error. Under a launcher with several ranks, prefix the rank so the
 * failing rank is obvious in the interleaved output. */
static void report_error(lua_State *L) {
    const char *msg = lua_tostring(L, -1);
    int size = lunar_dist_env_size();
    if (size > 1) fprintf(stderr, "[rank %d/%d] lunar: %s\n", lunar_dist_env_rank(), size, msg ? msg : "(no message)");
    else fprintf(stderr, "lunar: %s\n", msg ? msg : "(no message)");
    fflush(stderr);
}

static void push_args(lua_State *L, const char *script, int argc, char **argv, int first) {
    /* arg = {[0] = script, ...}, overrides = {"a.b=1", ...} */
    lua_createtable(L, argc - first, 1);
    lua_pushstring(L, script ? script : "");
    lua_rawseti(L, -2, 0);
    for (int i = first; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i - first + 1);
    }
    lua_setglobal(L, "arg");
    lua_newtable(L);
    int n = 0;
    for (int i = first; i < argc; i++) {
        /* only dotted.key=value: an argument like a URL with '=' in it stays a plain argument */
        if (!lunar_vm_is_override(argv[i])) continue;
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, ++n);
    }
    lua_setfield(L, LUA_REGISTRYINDEX, "lunar.overrides");
}

int main(int argc, char **argv) {
    const char *code = NULL, *script = NULL;
    int interactive = 0, repl_on_error = 0, traceback = 0, threads = 0, i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--version") == 0) {
            printf("lunar %s\n", LUNAR_VERSION);
            return 0;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "-i") == 0) {
            interactive = 1;
        } else if (strcmp(a, "--repl-on-error") == 0) {
            repl_on_error = 1;
        } else if (strcmp(a, "--traceback") == 0) {
            traceback = 1;
        } else if (strcmp(a, "-e") == 0) {
            if (++i >= argc) { fprintf(stderr, "lunar: -e needs an argument\n"); return 2; }
            code = argv[i];
        } else if (strcmp(a, "--threads") == 0) {
            char *end = NULL;
            long n = ++i < argc ? strtol(argv[i], &end, 10) : 0;
            if (i >= argc || end == argv[i] || *end != 0 || n < 1 || n > 4096) {
                fprintf(stderr, "lunar: --threads needs a thread count (1..4096)\n");
                usage(stderr);
                return 2;
            }
            threads = (int)n;
        } else if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (a[0] == '-' && a[1] != 0) {
            fprintf(stderr, "lunar: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else {
            break;
        }
    }
    /* after -e, key=value arguments are overrides for the code, not a script to run */
    if (i < argc && !(code && lunar_vm_is_override(argv[i]))) script = argv[i++];
    if (!script && !code) interactive = 1;

    lunar_ctx *ctx = NULL;
    if (lunar_ctx_init(&ctx) != LUNAR_OK) {
        fprintf(stderr, "lunar: cannot create the context (out of memory)\n");
        return 1;
    }
    if (threads > 0) lunar_ctx_set_threads(ctx, threads);
    lua_State *L = lunar_vm_new(ctx);
    if (!L) {
        fprintf(stderr, "lunar: cannot create the Lua VM\n");
        lunar_ctx_free(ctx);
        return 1;
    }
    push_args(L, script, argc, argv, i);
    if (repl_on_error) {
        lua_pushboolean(L, 1);
        lua_setfield(L, LUA_REGISTRYINDEX, "lunar.repl_on_error");
    }
    if (traceback) {
        lua_pushboolean(L, 1);
        lua_setfield(L, LUA_REGISTRYINDEX, "lunar.traceback");
    }

    int rc = 0;
    if (code && lunar_vm_dostring(L, code, "=(command line)") != 0) rc = 1;
    if (rc == 0 && script) {
        int nargs = argc - i;
        for (int k = i; k < argc; k++) lua_pushstring(L, argv[k]);
        if (strcmp(script, "-") == 0) script = NULL;   /* stdin */
        if (lunar_vm_dofile(L, script, nargs) != 0) rc = 1;
    }
    int repl_ran = 0;
    if (rc != 0) {
        report_error(L);
        if (repl_on_error) repl_ran = lunar_vm_repl_at_failure(L);   /* exits 1 afterwards all the same */
    }
    /* -i opens the REPL after the script even when it failed (as python -i does), with what the
     * script had defined by then; the exit status stays the script's */
    /* (not for a failed rank of a multi-rank job: the other ranks would wait on its REPL) */
    if (interactive && !repl_ran && !(rc != 0 && lunar_dist_env_size() > 1)) {
        lua_settop(L, 0);
        lua_pushnil(L);   /* --repl-on-error is about the script: errors typed at the REPL are just shown */
        lua_setfield(L, LUA_REGISTRYINDEX, "lunar.repl_on_error");
        if (lunar_vm_dostring(L, "lunar = lunar or require 'lunar'", "=(repl)") != 0) {
            report_error(L);
            lua_settop(L, 0);
        }
        printf("lunar %s (LuaJIT; `lunar` is loaded; Ctrl-D exits)\n", LUNAR_VERSION);
        fflush(stdout);
        lunar_repl_run(L, 0);
    }
    if (rc != 0 && lunar_dist_env_size() > 1) lunar_dist_abort(1);
    lunar_vm_free(L);
    lunar_dist_finalize();
    lunar_ctx_free(ctx);
    return rc;
}
