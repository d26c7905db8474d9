#!/bin/sh
# tests/sh/test_repl.sh LUNAR_BIN: the interactive REPL (`lunar -i`) driven through tmux, as a
# user at a terminal would: tensor printing, errors that leave the REPL running, multi-line
# input, line editing, Ctrl-C, history, Ctrl-D, and `lunar -i script.lua`.
# Exit 77 (skipped) when tmux is not installed. When LUNAR_BUILT_WITHOUT names readline (set by
# ctest for such builds), the REPL reads plain lines: editing, Ctrl-C and history are not tested.
set -u
LUNAR=${1:?usage: test_repl.sh LUNAR_BIN}
case $LUNAR in /*) ;; *) LUNAR=$(pwd)/$LUNAR ;; esac
command -v tmux >/dev/null 2>&1 || { echo "tmux not installed: skipped"; exit 77; }
case ",${LUNAR_BUILT_WITHOUT:-}," in *,readline,*) readline=0 ;; *) readline=1 ;; esac

TMP=$(mktemp -d "${TMPDIR:-/tmp}/lunar-repl.XXXXXX")
fail() { echo "FAIL: $*" >&2; exit 1; }
. "$(dirname "$0")/tmux_lib.sh"
trap 'tmux_cleanup; [ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT INT TERM

# INPUTRC: readline's default (emacs) key bindings, whatever the user's ~/.inputrc says
RUN="env LUNAR_HISTORY='$TMP/history' INPUTRC=/dev/null ASAN_OPTIONS=detect_leaks=0 '$LUNAR'"

# ---- lunar -i ----------------------------------------------------------------------------
# `trap : INT`: the session's sh has to outlive the Ctrl-C that interrupts a running chunk below
# (it goes to the whole foreground group, and a non-interactive dash exits on it), as the
# interactive shell of a real terminal does; lunar itself starts with SIGINT at its default
tmux_start main "trap : INT; $RUN -i"
tmux_wait main 'lunar> '

# a tensor, shown by a bare expression and by =expr
tmux_keys main 'x = lunar.tensor({{1,2},{3,4}})'
tmux_keys main 'x'
tmux_wait main '[lunar.f32 tensor of size 2x2]' 1
tmux_keys main '=x'
tmux_wait main '[lunar.f32 tensor of size 2x2]' 2
tmux_screen main | grep -q -x ' 1 2' || fail "tensor rows not printed"
tmux_screen main | grep -q -x ' 3 4' || fail "tensor rows not printed"

# plain values: several results (one per line), tables
tmux_keys main "=1 + 2, 'tw' .. 'o'"
tmux_wait main 'two'
tmux_screen main | grep -A1 -x '3' | grep -q -x 'two' || fail "=1 + 2, 'two' not shown as 3 then two"
tmux_keys main '{7, 8, k = 9}'
tmux_wait main '{7, 8, k = 9}' 2   # the input line and the printed table

# an error prints its message (with the op and the shapes), and the REPL keeps working
tmux_keys main 'x:view(3)'
tmux_wait main 'has 4 elements, shape (3)'
tmux_keys main 'error("custom" .. "-failure")'
tmux_wait main 'custom-failure'
tmux_keys main 'y = x:view(4)'
tmux_keys main "print('after error ' .. y:size(1))"
tmux_wait main 'after error 4'

# a syntax error is reported and the buffer is reset (the next line is not appended to it)
tmux_keys main 'if then'
tmux_wait main "unexpected symbol near 'then'"
tmux_keys main "print('syntax' .. 'ok')"
tmux_wait main 'syntaxok'

# multi-line input: the continuation prompt, then the loop runs once complete
tmux_keys main 'for i = 1, 3 do'
tmux_wait main '   >> ' 1
tmux_keys main "  print('row' .. i * 10)"
tmux_wait main '   >> ' 2
tmux_keys main 'end'
tmux_wait main 'row30'
[ "$(tmux_screen main | grep -c -x 'row[123]0')" -eq 3 ] || fail "the for loop did not print 3 rows"
# an unfinished expression continues on the next line (=1 + / 2, and a table opened alone)
tmux_keys main '=1 +'
tmux_wait main '   >> ' 3
tmux_keys main '2000'
tmux_wait main '2001'
tmux_keys main '{'
tmux_keys main "'open', 'table'}"
tmux_wait main '{"open", "table"}'
tmux_keys main 'local function sq(v)'
tmux_keys main '  return v * v'
tmux_keys main 'end print("sq=" .. sq(12))'
tmux_wait main 'sq=144'

if [ "$readline" = 1 ]; then
    # line editing: Ctrl-A moves to the start of the line, the inserted text lands there
    tmux_cmd send-keys -t main -l "rint('edi' .. 'ted')"
    tmux_key main C-a
    tmux_cmd send-keys -t main -l 'p'
    tmux_key main Enter
    tmux_wait main 'edited'

    # Ctrl-C at the prompt cancels the pending input (a half-typed line, or an unfinished chunk)
    # and the REPL carries on at a fresh prompt
    tmux_cmd send-keys -t main -l "print('never' .. 'printed')"
    tmux_key main C-c
    tmux_wait main "print('never' .. 'printed')^C"
    tmux_keys main 'for i = 1, 2 do'
    tmux_cmd send-keys -t main -l "print('never' .. 'either')"
    tmux_key main C-c
    tmux_keys main "print('after' .. 'cancel')"
    tmux_wait main 'aftercancel'
    tmux_screen main | grep -q -F "lunar> print('after' .. 'cancel')" || fail "no fresh prompt after Ctrl-C"
    tmux_screen main | grep -q -x -e 'neverprinted' -e 'nevereither' && fail "cancelled input was run"

    # Ctrl-C while a chunk runs interrupts it ("interrupted!") and the session survives, with
    # what it had defined (the loop calls a C function each turn, so it runs interpreted and
    # reaches the hook; a JIT-compiled loop needs a second Ctrl-C, which ends lunar)
    tmux_keys main 'kept = 41'
    tmux_keys main 'while true do os.time() end'
    sleep 0.5
    tmux_key main C-c
    tmux_wait main 'interrupted!'
    tmux_keys main "print('kept' .. kept + 1)"
    tmux_wait main 'kept42'

    # history: Up recalls the previous line, Up Up the one before (a line repeated right away is
    # stored once, so after running histtwo again the one before it is still histone)
    tmux_keys main "print('hist' .. 'one')"
    tmux_wait main 'histone' 1
    tmux_keys main "print('hist' .. 'two')"
    tmux_wait main 'histtwo' 1
    tmux_key main Up Enter
    tmux_wait main 'histtwo' 2
    tmux_key main Up Up Enter
    tmux_wait main 'histone' 2
else
    echo "built without readline: line editing, Ctrl-C and history not tested"
fi

# Ctrl-D at an empty prompt exits with status 0
tmux_key main C-d
status=$(tmux_wait_exit main) || fail "lunar -i did not exit on Ctrl-D"
[ "$status" = 0 ] || fail "lunar -i exited with status $status after Ctrl-D (want 0)"

if [ "$readline" = 1 ]; then
    # the history file holds the lines entered, a multi-line chunk as one entry
    [ -s "$TMP/history" ] || fail "history file $TMP/history not written"
    grep -q -F 'x = lunar.tensor({{1,2},{3,4}})' "$TMP/history" || fail "history lacks the tensor line"
    grep -q -F "print('hist' .. 'two')" "$TMP/history" || fail "history lacks the histtwo line"
    [ "$(grep -c -F "print('hist' .. 'two')" "$TMP/history")" -eq 1 ] || fail "a repeated line was stored twice"

    # ---- a new session reads the history back: Up recalls the last line of the previous one ------
    # (the recalled histone line, run last above)
    tmux_start again "$RUN -i"
    tmux_wait again 'lunar> '
    tmux_key again Up Enter
    tmux_wait again 'histone'
    # the three-line chunk came back as one entry: found by reverse search (Ctrl-R), it runs whole
    tmux_key again C-r
    tmux_cmd send-keys -t again -l 'function sq'
    tmux_key again Enter
    tmux_wait again 'sq=144'
    tmux_key again C-d
    status=$(tmux_wait_exit again) || fail "second lunar -i did not exit"
    [ "$status" = 0 ] || fail "second lunar -i exited with status $status"
fi

# ---- lunar -i script.lua: the script runs first, the REPL sees its globals ----------------------
cat > "$TMP/setup.lua" <<'EOF'
local lunar = require 'lunar'
answer = 6 * 7
weights = lunar.ones(2, 3)
print('setup' .. ' done')
EOF
tmux_start script "$RUN -i '$TMP/setup.lua'"
tmux_wait script 'setup done'
tmux_wait script 'lunar> '
tmux_keys script '=answer + 0.5'
tmux_wait script '42.5'
tmux_keys script 'weights'
tmux_wait script '[lunar.f32 tensor of size 2x3]'
tmux_keys script 'os.exit(3)'
status=$(tmux_wait_exit script) || fail "lunar -i script.lua did not exit on os.exit"
[ "$status" = 3 ] || fail "os.exit(3) in the REPL exited with status $status"

echo "test_repl: all passed"
