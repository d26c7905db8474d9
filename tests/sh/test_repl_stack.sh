#!/bin/sh
# tests/sh/test_repl_stack.sh LUNAR_BIN: the REPL of --repl-on-error moving along the stack of
# the failure: :where, :up, :down, :frame, :locals and :help; expressions seeing the selected
# frame's locals and upvalues; assignments (a local changes the REPL's copy and says so, an
# upvalue is set for real); an error inside lunar.scope keeping the tensors of every frame; an
# error raised inside lunar's library opening at the user's frame. Piped input always; the same
# at a terminal through tmux when tmux is installed.
set -u
LUNAR=${1:?usage: test_repl_stack.sh LUNAR_BIN}
case $LUNAR in /*) ;; *) LUNAR=$(pwd)/$LUNAR ;; esac
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lunar-stack.XXXXXX")
fail() { echo "FAIL: $*" >&2; exit 1; }
. "$(dirname "$0")/tmux_lib.sh"
trap 'tmux_cleanup; [ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT INT TERM
export LUNAR_HISTORY="$TMP/history"

# run_input TEXT CMD...: TEXT (a printf format) on stdin, stdout to $TMP/out, stderr to $TMP/err
run_input() {
    text=$1
    shift
    # shellcheck disable=SC2059
    printf "$text" | "$@" >"$TMP/out" 2>"$TMP/err"
    rc=$?
}
show() { echo "---- stdout" >&2; cat "$TMP/out" >&2; echo "---- stderr" >&2; cat "$TMP/err" >&2; }
# out_line LINE: stdout has LINE as a whole line (a grep basic regular expression)
out_line() { grep -q -x -- "$1" "$TMP/out" || { show; fail "stdout lacks the line '$1'"; }; }
err_has() { grep -q -F -- "$1" "$TMP/err" || { show; fail "stderr lacks '$1'"; }; }

# three frames deep: outer -> middle -> inner, which raises
cat > "$TMP/deep.lua" <<'EOF'
local lunar = require 'lunar'
local shared = 'up-' .. 'value'
local function inner(x)
    local inner_local = x * 2
    local t = lunar.ones(2, 3)
    error('deep ' .. 'failure ' .. inner_local)
end
local function middle(y)
    local middle_local = y + 100
    inner(middle_local)
end
local function outer()
    local outer_local = 'outer-' .. 'text'
    middle(1)
    return shared
end
probe = function() return shared end
outer()
EOF

# the REPL opens at inner (#1; #0 is the C function error), :where marks it
run_input ':where\nprint("A=" .. inner_local)\n:locals\n' "$LUNAR" --repl-on-error "$TMP/deep.lua"
[ "$rc" = 1 ] || { show; fail "--repl-on-error exited with status $rc, want 1"; }
err_has 'deep.lua:6: deep failure 202'
err_has "#1  $TMP/deep.lua:6: in function 'inner'"
out_line "  #0  \[C\]: in function 'error'"
out_line "> #1  .*deep.lua:6: in function 'inner'"
out_line "  #2  .*deep.lua:10: in function 'middle'"
out_line "  #3  .*deep.lua:14: in function 'outer'"
out_line "  #4  .*deep.lua:18: in main chunk"
[ "$(grep -c '#[0-9]' "$TMP/out")" -ge 6 ] || { show; fail ":where did not list 5 frames"; }
out_line 'A=202'
# :locals: the frame's locals with short values, a tensor as its summary line, then its upvalues
out_line "#1  .*deep.lua:6: in function 'inner'"
out_line 'locals:'
out_line '  x = 101'
out_line '  inner_local = 202'
out_line '  t = \[lunar.f32 tensor of size 2x3\]'
out_line 'upvalues:'

# :up and :down move one frame (or N), expressions see the selected frame's locals and upvalues
run_input ':up\nprint("B=" .. middle_local)\nprint("C=" .. tostring(inner_local))\n:up\n:where\nprint("D=" .. outer_local .. " " .. shared)\n:locals\n:down 2\nprint("E=" .. inner_local + 1)\n:down\n:down\n:up 9\n:up\n:frame 2\nprint("F=" .. y)\n' \
    "$LUNAR" --repl-on-error "$TMP/deep.lua"
[ "$rc" = 1 ] || { show; fail "exit status $rc after :up/:down, want 1"; }
out_line "#2  .*deep.lua:10: in function 'middle'"
out_line '    inner(middle_local)'          # the source line of the selected frame
out_line 'B=101'
out_line 'C=nil'                            # inner's local is not visible from middle
out_line "> #3  .*deep.lua:14: in function 'outer'"
out_line "  #1  .*deep.lua:6: in function 'inner'"
out_line 'D=outer-text up-value'
out_line '  outer_local = "outer-text"'
out_line '  shared = "up-value"'
out_line 'E=203'
out_line "#0  \[C\]: in function 'error'"
err_has ':down: already at the innermost frame (#0)'
out_line "#4  .*deep.lua:18: in main chunk"   # :up 9 stops at the outermost frame
err_has ':up: already at the outermost frame (#4)'
out_line 'F=1'

# assigning: a local of the (unwound) frame changes the REPL's copy, and the REPL says so; an
# upvalue is set in the function that holds it, so the program's own closures see it
run_input 'inner_local = 5\nprint("G=" .. inner_local)\n:up 2\nshared = "set"\nprint("H=" .. probe())\nfresh = 7\n:down\nprint("I=" .. fresh)\n' \
    "$LUNAR" --repl-on-error "$TMP/deep.lua"
out_line 'G=5'
err_has "'inner_local' is a local of frame #1, which the error has already unwound: only the REPL's copy is changed"
out_line 'H=set'
out_line 'I=7'                              # a new name is a global: every frame sees it

# bad commands get one line naming the command; :help lists the commands
run_input ':up x\n:down 0\n:frame 7\n:where now\n:nosuch\n:help\nprint("J=" .. 1)\n' "$LUNAR" --repl-on-error "$TMP/deep.lua"
err_has ':up takes a number of frames (1 or more), got "x"'
err_has ':down takes a number of frames (1 or more), got "0"'
err_has ':frame 7: there are frames #0 to #4'
err_has ':where takes no argument, got "now"'
err_has 'unknown command ":nosuch" (:help lists the commands)'
for c in :where ':up \[N\]' ':down \[N\]' ':frame N' :locals; do
    grep -q "^$c " "$TMP/out" || { show; fail ":help does not list $c"; }
done
out_line 'J=1'

# a deep stack: :where shows its ends and the frames around the selected one; :frame N selects any
cat > "$TMP/recursion.lua" <<'EOF'
local function r(n)
    if n == 0 then error('bottom') end
    local depth = n
    r(n - 1)
end
r(40)
EOF
run_input ':where\n:frame 20\nprint("O=" .. depth)\n:where\n' "$LUNAR" --repl-on-error "$TMP/recursion.lua"
out_line '  ... 23 frames (:frame N selects any)'
out_line "  #42  .*recursion.lua:6: in main chunk"
out_line 'O=19'
out_line "> #20  .*recursion.lua:4: in function 'r'"
out_line '  ... 8 frames (:frame N selects any)'
out_line '  ... 10 frames (:frame N selects any)'
# 20 frames shown by the first :where (10 at each end), 25 by the second (and 5 around #20)
[ "$(grep -c -e '^> #' -e '^  #' "$TMP/out")" = 45 ] || { show; fail ":where showed other frames than expected"; }

# without a failure there is no stack: the plain REPL says so
run_input ':where\nprint("K=" .. 2)\n' "$LUNAR" -i
err_has ':where: no stack to show: this REPL was not opened at a failure'
out_line 'K=2'

# inside lunar.scope: the tensors of every frame of the failing stack stay alive, not only the
# innermost one's
cat > "$TMP/scoped.lua" <<'EOF'
local lunar = require 'lunar'
local function inner(a)
    local b = lunar.ones(2, 2)
    local c = a:matmul(lunar.ones(5, 5))
    return c
end
local function middle()
    local kept = lunar.ones(3, 4)
    local r = inner(lunar.ones(2, 3))
    return r
end
lunar.scope(function() middle() end)
EOF
run_input ':where\nprint("L=" .. b:sum():item())\n:up\nprint("M=" .. kept:sum():item())\n' "$LUNAR" --repl-on-error "$TMP/scoped.lua"
out_line "> #1  .*scoped.lua:4: in function 'inner'"
out_line "  #5  lunar:lunar/init.lua:[0-9]*: in function 'scope'"
out_line 'L=4'
out_line 'M=12'

# an error raised inside lunar's own library opens at the user's frame that called it; the
# library's frames are on the stack, and :down reaches them
cat > "$TMP/inlib.lua" <<'EOF'
local lunar = require 'lunar'
local function normalise(x)
    local weight = 'not a tensor'
    local y = lunar.ops.rmsnorm(x, weight, 1e-5)
    return y
end
normalise(lunar.ones(2, 4))
EOF
run_input ':where\nprint("N=" .. weight)\n:down\n' "$LUNAR" --repl-on-error "$TMP/inlib.lua"
out_line "> #2  .*inlib.lua:4: in function 'normalise'"
out_line "  #1  lunar:lunar/ops/norm.lua:[0-9]*: in function 'rmsnorm'"
out_line 'N=not a tensor'
out_line "#1  lunar:lunar/ops/norm.lua:[0-9]*: in function 'rmsnorm'"

# at a terminal, through tmux
if command -v tmux >/dev/null 2>&1; then
    tmux_start deep "env INPUTRC=/dev/null LUNAR_HISTORY='$TMP/history' '$LUNAR' --repl-on-error '$TMP/deep.lua'"
    tmux_wait deep 'lunar> '
    tmux_keys deep ':where'
    tmux_wait deep "> #1  "
    tmux_keys deep ':up 2'
    tmux_wait deep "#3  "
    tmux_keys deep "print('outer is ' .. outer_local)"
    tmux_wait deep 'outer is outer-text'
    tmux_keys deep ':down'
    tmux_keys deep ':locals'
    tmux_wait deep '  middle_local = 101'
    tmux_key deep C-d
    status=$(tmux_wait_exit deep) || fail "--repl-on-error did not exit on Ctrl-D"
    [ "$status" = 1 ] || fail "--repl-on-error exited with status $status after Ctrl-D (want 1)"
else
    echo "tmux not installed: the terminal part is skipped"
fi

echo "test_repl_stack: all passed"
