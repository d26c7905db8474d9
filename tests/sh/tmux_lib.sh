# tests/sh/tmux_lib.sh: helpers for driving `lunar` in a detached tmux session (sourced by the
# test_*.sh scripts; not a test itself). Each test uses its own tmux server (-L) so that it
# never touches a user's sessions, and a fixed 200x50 window so that lines do not wrap.
#
#   tmux_start NAME CMD     start CMD in session NAME; CMD's exit status goes to $TMP/NAME.status
#   tmux_keys NAME TEXT     type TEXT literally, then Enter
#   tmux_key NAME KEY...    send tmux key names (Up, C-d, C-a, Enter ...)
#   tmux_screen NAME        the pane, with scrollback
#   tmux_wait NAME PATTERN [COUNT] [SECONDS]
#                           wait until at least COUNT screen lines contain the fixed string PATTERN
#   tmux_wait_exit NAME [SECONDS]
#                           wait until the session has ended; prints the command's exit status
#
# Needs $TMP (a scratch directory) and a `fail` function from the caller.

TMUX_SOCK="lunar-test-$$"

# a plain sh runs the session commands, whatever the user's shell; works inside tmux too
tmux_cmd() { env -u TMUX SHELL=/bin/sh tmux -L "$TMUX_SOCK" "$@"; }

tmux_cleanup() { tmux_cmd kill-server >/dev/null 2>&1 || true; }

tmux_start() {
    # the status file is written after the command ends, then the session closes
    tmux_cmd -f /dev/null new-session -d -s "$1" -x 200 -y 50 \
        "$2; echo \$? > '$TMP/$1.status.tmp'; mv '$TMP/$1.status.tmp' '$TMP/$1.status'" ||
        fail "cannot start tmux session $1"
    tmux_cmd set-option -t "$1" history-limit 5000 >/dev/null
}

tmux_keys() {
    tmux_cmd send-keys -t "$1" -l "$2"
    tmux_cmd send-keys -t "$1" Enter
}

tmux_key() {
    s=$1
    shift
    tmux_cmd send-keys -t "$s" "$@"
}

tmux_screen() { tmux_cmd capture-pane -p -J -S - -t "$1" 2>/dev/null; }

tmux_wait() {
    want=${3:-1}
    tries=$(( ${4:-20} * 10 ))
    while [ "$tries" -gt 0 ]; do
        got=$(tmux_screen "$1" | grep -c -F -- "$2")
        [ "$got" -ge "$want" ] && return 0
        sleep 0.1
        tries=$((tries - 1))
    done
    echo "---- screen of session $1 ----" >&2
    tmux_screen "$1" >&2
    echo "------------------------------" >&2
    fail "timed out waiting for $want line(s) with '$2' (found $got)"
}

tmux_wait_exit() {
    tries=$(( ${2:-20} * 10 ))
    while [ "$tries" -gt 0 ]; do
        if [ -f "$TMP/$1.status" ] && ! tmux_cmd has-session -t "$1" 2>/dev/null; then
            cat "$TMP/$1.status"
            return 0
        fi
        sleep 0.1
        tries=$((tries - 1))
    done
    tmux_screen "$1" >&2
    fail "session $1 did not exit"
}
