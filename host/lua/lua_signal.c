/* lua_signal.c: a graceful stop on SIGTERM and SIGINT for long runs (core.signal).
 *
 *   core.signal.catch_stop()      from now on the first SIGTERM or SIGINT only sets a flag
 *   core.signal.stop_requested()  -> 'SIGTERM' | 'SIGINT' | nil
 *   core.signal.release()         the handlers that were there before catch_stop, flag cleared
 *
 * Schedulers (Slurm, Kubernetes) send SIGTERM some time before they kill a job, and a user
 * presses Ctrl-C: the trainer polls stop_requested() after each step, writes a checkpoint and
 * stops. A second SIGTERM or SIGINT ends the process at once (the handler puts the default
 * actions back when it sets the flag), so a stuck run can still be stopped.
 *
 * A signal handler gets no argument, so the flag and the saved handlers are file-scope state;
 * the flag is a volatile sig_atomic_t, the only type a handler may write. */
#include <signal.h>
#include <string.h>

#include "lua_lunar.h"

static volatile sig_atomic_t stop_signal;   /* 0, or the signal that asked for a stop */
static struct sigaction saved_term, saved_int;
static int catching;

/* The first signal sets the flag and puts the default actions back, so the next one ends the
 * process; a second one that still reaches this handler (it was already on its way) ends it
 * here, with the default action of that signal. */
static void on_stop(int sig) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGTERM, &dfl, NULL);
    sigaction(SIGINT, &dfl, NULL);
    if (stop_signal) {
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, sig);
        sigprocmask(SIG_UNBLOCK, &one, NULL);   /* it is blocked while its handler runs */
        raise(sig);
        return;
    }
    stop_signal = sig;
}

static int l_catch_stop(lua_State *L) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    stop_signal = 0;
    if (!catching) {
        if (sigaction(SIGTERM, &sa, &saved_term) != 0 || sigaction(SIGINT, &sa, &saved_int) != 0)
            return lunar_lua_error(L, "signal.catch_stop: cannot install the SIGTERM/SIGINT handlers");
        catching = 1;
    } else {
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
    }
    return 0;
}

static int l_stop_requested(lua_State *L) {
    int sig = stop_signal;
    if (sig == SIGTERM) lua_pushliteral(L, "SIGTERM");
    else if (sig == SIGINT) lua_pushliteral(L, "SIGINT");
    else lua_pushnil(L);
    return 1;
}

static int l_release(lua_State *L) {
    (void)L;
    if (catching) {
        sigaction(SIGTERM, &saved_term, NULL);
        sigaction(SIGINT, &saved_int, NULL);
        catching = 0;
    }
    stop_signal = 0;
    return 0;
}

void lunar_lua_open_signal(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"catch_stop", l_catch_stop}, {"stop_requested", l_stop_requested}, {"release", l_release}, {NULL, NULL}};
    lua_newtable(L);
    lunar_lua_setfuncs(L, fns);
    lua_setfield(L, -2, "signal");
}
