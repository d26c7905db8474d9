/* repl.c: the interactive loop of `lunar -i`: readline editing and history, multi-line input,
 * `=expr` and bare expressions printed (tensors pretty-printed by lunar.repl.show), errors
 * printed with a traceback without leaving the loop, Ctrl-C interrupting a running chunk, and
 * commands (a line starting with ':' and a letter: :help, :where, :up ...; lunar.repl.command).
 * Built
 * without readline (LUNAR_WITH_READLINE undefined), lines are read with getline: no editing, no
 * history, and Ctrl-C at the prompt interrupts lunar as it would any program. */
#include <ctype.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef LUNAR_WITH_READLINE
#include <termios.h>

#include <readline/history.h>
#include <readline/readline.h>
#endif

#include <lauxlib.h>

#include "lua_lunar.h"
#include "vm.h"

#ifdef LUNAR_WITH_READLINE

static void history_path(char *buf, size_t n) {
    const char *p = getenv("LUNAR_HISTORY");
    if (p && *p) { snprintf(buf, n, "%s", p); return; }
    const char *home = getenv("HOME");
    snprintf(buf, n, "%s/.lunar_history", home && *home ? home : ".");
}

/* Ctrl-C at the prompt cancels the input typed so far instead of ending lunar (and the session
 * with whatever it had loaded). While readline reads a line the terminal's interrupt character is
 * switched off, so ^C arrives as a key; cancel_line ends the line with a ^C mark that the loop
 * recognises. Outside readline (while code runs) ^C interrupts as usual. */
static void prep_terminal(int meta) {
    rl_prep_terminal(meta);   /* saves the terminal's settings, restored by rl_deprep_terminal */
    int fd = fileno(rl_instream ? rl_instream : stdin);
    struct termios t;
    if (tcgetattr(fd, &t) == 0) {
        t.c_cc[VINTR] = _POSIX_VDISABLE;
        tcsetattr(fd, TCSADRAIN, &t);
    }
}

static int cancel_line(int count, int key) {
    (void)count;
    rl_point = rl_end;
    rl_insert_text("\003");   /* shown as ^C */
    rl_redisplay();
    return rl_newline(1, key);
}

static int is_cancelled(const char *line) {
    size_t n = strlen(line);
    return n > 0 && line[n - 1] == '\003';
}

/* readline's history (in hist) and key bindings, for a terminal */
static void editing_start(const char *hist) {
    using_history();
    /* a chunk typed over several lines is one history entry: entries are written with a
     * timestamp line before them, which is what tells the reader where one ends */
    history_comment_char = '#';
    history_write_timestamps = 1;
    history_multiline_entries = 1;
    /* a nested REPL (lunar.breakpoint from the REPL) keeps the history already loaded */
    if (history_length == 0 && read_history(hist) != 0)
        write_history(hist);                            /* create it so append_history works */
    rl_prep_term_function = prep_terminal;
    rl_bind_key('\003', cancel_line);
}

/* a complete chunk (without its last newline) becomes one history entry */
static void editing_remember(const char *chunk, const char *hist) {
    HIST_ENTRY *last = history_length > 0 ? history_get(history_base + history_length - 1) : NULL;
    if (!last || strcmp(last->line, chunk) != 0) {   /* a repeated line is kept once */
        add_history(chunk);
        append_history(1, hist);
    }
}

static void editing_end(const char *hist) { history_truncate_file(hist, 2000); }

#endif   /* LUNAR_WITH_READLINE */

/* 1 if a parse error on top of the stack is only the input ending early */
static int ends_early(lua_State *L) {
    size_t len;
    const char *msg = lua_tolstring(L, -1, &len);
    const char *tail = "'<eof>'";
    size_t tl = strlen(tail);
    return msg && len >= tl && strcmp(msg + len - tl, tail) == 0;
}

/* 1 if code is the start of an expression or of a statement that more lines could complete
 * (`=1 +`, `{`, `x +`, `for i = 1, 3 do`, an open long comment). The expression is tried as
 * "return code", not inside select(...), whose closing parenthesis would hide the early end. */
static int incomplete(lua_State *L, const char *code, int is_expr) {
    int more = 0;
    lua_pushfstring(L, "return %s", code);
    if (luaL_loadbuffer(L, lua_tostring(L, -1), lua_objlen(L, -1), "=stdin") == LUA_ERRSYNTAX) more = ends_early(L);
    lua_pop(L, 2);
    if (!more && !is_expr) {
        if (luaL_loadbuffer(L, code, strlen(code), "=stdin") == LUA_ERRSYNTAX) more = ends_early(L);
        lua_pop(L, 1);
    }
    return more;
}

/* Ctrl-C while a chunk runs: the first one raises "interrupted!" in Lua at the next hook (a
 * function call or return, or every 1000 VM instructions), as lua.c does, so the session and
 * what it loaded survive; it cannot stop a loop running as JIT-compiled code or inside one C
 * op, so a second Ctrl-C ends lunar as usual. The handler needs the running state, and a signal
 * handler has no argument to carry it: running_state is set only while a chunk runs. */
static lua_State *volatile running_state;

static void interrupt_hook(lua_State *L, lua_Debug *ar) {
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    luaL_error(L, "interrupted!");
}

static void on_interrupt(int sig) {
    signal(sig, SIG_DFL);   /* a second Ctrl-C ends the process */
    lua_State *L = running_state;
    if (L) lua_sethook(L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1000);
}

/* run the loaded chunk under the traceback handler, Ctrl-C interrupting it (tty only) */
static int run_chunk(lua_State *L, int tty) {
    void (*previous)(int) = SIG_DFL;
    lua_State *outer = running_state;   /* a REPL nested in a running chunk (core.repl) */
    if (tty) {
        running_state = L;
        previous = signal(SIGINT, on_interrupt);
    }
    int rc = lunar_vm_pcall(L, 0, LUA_MULTRET);
    if (tty) {
        signal(SIGINT, previous == SIG_ERR ? SIG_DFL : previous);
        running_state = outer;
        if (lua_gethook(L) == interrupt_hook) lua_sethook(L, NULL, 0, 0);   /* a user's hook stays */
    }
    return rc;
}

/* one line without its newline (malloc'd), or NULL at end of input */
static char *read_line(const char *prompt, int tty) {
#ifdef LUNAR_WITH_READLINE
    if (tty) return readline(prompt);
#else
    if (tty) {
        fputs(prompt, stdout);
        fflush(stdout);
    }
#endif
    char *line = NULL;
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0) {
        free(line);
        return NULL;
    }
    if (n && line[n - 1] == '\n') line[n - 1] = 0;
    return line;
}

/* print the values on the stack from index `first` to the top */
static void show_results(lua_State *L, int first) {
    int n = lua_gettop(L) - first + 1;
    if (n <= 0) return;
    lua_getglobal(L, "require");
    lua_pushstring(L, "lunar.repl");
    if (lua_pcall(L, 1, 1, 0) == 0 && lua_istable(L, -1)) {
        lua_getfield(L, -1, "show");
        lua_remove(L, -2);
    } else {
        lua_pop(L, 1);
        lua_getglobal(L, "print");
    }
    lua_insert(L, first);
    if (lunar_vm_pcall(L, n, 0) != 0) {
        fprintf(stderr, "%s\n", lua_tostring(L, -1));
        lua_pop(L, 1);
    }
}

/* 1 if line is a REPL command: ':' and a letter (no Lua statement starts so; a goto label
 * "::name::" starts with two) */
static int is_command(const char *line) { return line[0] == ':' && isalpha((unsigned char)line[1]); }

/* require('lunar.repl').command(line, env): its errors are one line for the user (an unknown
 * command, a bad count), shown without a traceback */
static void run_command(lua_State *L, const char *line, int env) {
    int top = lua_gettop(L);
    lua_getglobal(L, "require");
    lua_pushstring(L, "lunar.repl");
    int rc = lua_pcall(L, 1, 1, 0);
    if (rc == 0) {
        lua_getfield(L, -1, "command");
        lua_pushstring(L, line);
        if (env) lua_pushvalue(L, env);
        else lua_pushnil(L);
        rc = lua_pcall(L, 2, 0, 0);
    }
    if (rc != 0) fprintf(stderr, "%s\n", lua_tostring(L, -1));
    lua_settop(L, top);
    fflush(stdout);
}

void lunar_repl_run(lua_State *L, int env) {
    int tty = isatty(STDIN_FILENO);
#ifdef LUNAR_WITH_READLINE
    char hist[1024];
    history_path(hist, sizeof hist);
    if (tty) editing_start(hist);
#endif
    if (env < 0) env = lua_gettop(L) + env + 1;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    if (!buf) return;
    buf[0] = 0;
    for (;;) {
        char *line = read_line(len == 0 ? "lunar> " : "   >> ", tty);
        if (!line) {
            if (tty) fputc('\n', stdout);
            break;
        }
#ifdef LUNAR_WITH_READLINE
        if (tty && is_cancelled(line)) {                    /* ^C: drop the pending input */
            free(line);
            len = 0;
            buf[0] = 0;
            continue;
        }
#endif
        if (len == 0 && line[0] == 0) { free(line); continue; }
        if (len == 0 && is_command(line)) {
#ifdef LUNAR_WITH_READLINE
            if (tty) editing_remember(line, hist);
#endif
            run_command(L, line, env);
            free(line);
            continue;
        }
        size_t ln = strlen(line);
        if (len + ln + 2 > cap) {
            while (len + ln + 2 > cap) cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) { free(line); break; }
            buf = nb;
        }
        memcpy(buf + len, line, ln);
        len += ln;
        buf[len++] = '\n';
        buf[len] = 0;
        free(line);

        int top = lua_gettop(L);
        int is_expr = buf[0] == '=';
        const char *code = is_expr ? buf + 1 : buf;
        /* an expression first, then a statement. The expression list is passed through
         * select(1, ...) rather than returned directly: `return f(x)` would be a tail call, and
         * an error inside f would then show a traceback without the line typed. */
        lua_pushfstring(L, "return select(1, %s)", code);
        int rc = luaL_loadbuffer(L, lua_tostring(L, -1), strlen(lua_tostring(L, -1)), "=stdin");
        lua_remove(L, -2);
        if (rc != 0 && !is_expr) {
            lua_pop(L, 1);
            rc = luaL_loadbuffer(L, code, strlen(code), "=stdin");
        }
        if (rc == LUA_ERRSYNTAX && incomplete(L, code, is_expr)) {
            lua_pop(L, 1);
            continue;
        }
        if (rc == LUA_ERRSYNTAX && is_expr) {   /* report the expression's own error */
            lua_pop(L, 1);
            lua_pushfstring(L, "return %s", code);
            rc = luaL_loadbuffer(L, lua_tostring(L, -1), lua_objlen(L, -1), "=stdin");
            lua_remove(L, -2);
        }
#ifdef LUNAR_WITH_READLINE
        if (tty) {
            buf[len - 1] = 0;
            editing_remember(buf, hist);
        }
#endif
        len = 0;
        buf[0] = 0;
        if (rc != 0) {
            fprintf(stderr, "%s\n", lua_tostring(L, -1));
            lua_settop(L, top);
            continue;
        }
        if (env) {
            lua_pushvalue(L, env);
            lua_setfenv(L, -2);
        }
        if (run_chunk(L, tty) != 0) {
            fprintf(stderr, "%s\n", lua_tostring(L, -1));
            lua_settop(L, top);
            continue;
        }
        show_results(L, top + 1);
        lua_settop(L, top);
        fflush(stdout);
    }
    free(buf);
#ifdef LUNAR_WITH_READLINE
    if (tty) editing_end(hist);
#endif
}
