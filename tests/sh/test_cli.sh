#!/bin/sh
# tests/sh/test_cli.sh LUNAR_BIN: the command line of the lunar executable: --version, -e,
# scripts and their arguments and dotted overrides, script errors (exit 1, message, traceback),
# usage errors (exit 2), stdin as the script, and --repl-on-error (piped, and through tmux when
# tmux is installed).
set -u
LUNAR=${1:?usage: test_cli.sh LUNAR_BIN}
case $LUNAR in /*) ;; *) LUNAR=$(pwd)/$LUNAR ;; esac
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lunar-cli.XXXXXX")
fail() { echo "FAIL: $*" >&2; exit 1; }
. "$(dirname "$0")/tmux_lib.sh"
trap 'tmux_cleanup; [ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT INT TERM
export LUNAR_HISTORY="$TMP/history"

# run CMD...: stdout to $TMP/out, stderr to $TMP/err, status in $rc
run() {
    "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
    rc=$?
}
# run_input TEXT CMD...: as run, with TEXT (a printf format: \n for newlines) on stdin
run_input() {
    text=$1
    shift
    # shellcheck disable=SC2059
    printf "$text" | "$@" >"$TMP/out" 2>"$TMP/err"
    rc=$?
}
expect_rc() {
    [ "$rc" = "$1" ] || { cat "$TMP/out" "$TMP/err" >&2; fail "$2: exit status $rc, want $1"; }
}
expect_out() { grep -q -F -- "$1" "$TMP/out" || { cat "$TMP/out" >&2; fail "stdout lacks '$1'"; }; }
expect_err() { grep -q -F -- "$1" "$TMP/err" || { cat "$TMP/err" >&2; fail "stderr lacks '$1'"; }; }

# ---- --version, --help, -e ------------------------------------------------------------------
run "$LUNAR" --version
expect_rc 0 "--version"
grep -q -x 'lunar [0-9][0-9.]*' "$TMP/out" || fail "--version printed '$(cat "$TMP/out")'"

run "$LUNAR" --help
expect_rc 0 "--help"
expect_out 'usage: lunar'

run "$LUNAR" -e 'print(1+1)'
expect_rc 0 "-e"
[ "$(cat "$TMP/out")" = 2 ] || fail "-e 'print(1+1)' printed '$(cat "$TMP/out")'"

run "$LUNAR" -e 'local lunar = require "lunar"; print(lunar.ones(2, 3):numel())'
expect_rc 0 "-e with tensors"

run "$LUNAR" -e 'error("from " .. "dash e")'
expect_rc 1 "-e raising an error"
expect_err 'from dash e'

run "$LUNAR" -e 'x = ('
expect_rc 1 "-e with a syntax error"
expect_err "(command line)"

# only dotted.key=value arguments are overrides: one with '=' elsewhere (a URL) stays an argument
printf 'print(#arg, arg[2], require("lunar").config.overrides().steps)\n' > "$TMP/args.lua"
run "$LUNAR" "$TMP/args.lua" steps=2 'http://h/?a=b'
expect_rc 0 "a URL argument next to an override"
[ "$(cat "$TMP/out")" = "2	http://h/?a=b	2" ] || fail "a URL argument: printed '$(cat "$TMP/out")'"

# dotted overrides after -e belong to the code (they are not a script to run)
run "$LUNAR" -e 'local o = require("lunar").config.overrides(); print(o.a.b + o.n)' a.b=3 n=4
expect_rc 0 "-e with overrides"
[ "$(cat "$TMP/out")" = 7 ] || fail "-e with overrides printed '$(cat "$TMP/out")'"

# a recipe refuses a bare word among its overrides, and a value out of range names its key,
# both before anything runs; a recipe runs from inside recipes/ too (arg[0] without a '/')
REPO=$(cd "$(dirname "$0")/../.." && pwd)
run "$LUNAR" "$REPO/recipes/sft.lua" foo
expect_rc 1 "a recipe with a bare argument"
expect_err 'recipe argument "foo" is not key=value'
# a mistyped key is refused too, not skipped (the run would otherwise use the default silently)
run "$LUNAR" "$REPO/recipes/sft.lua" train.step-s=7
expect_rc 1 "a recipe with a mistyped key"
expect_err 'recipe argument "train.step-s=7" is not key=value with a dotted key'
run "$LUNAR" "$REPO/recipes/sft.lua" train.grad_accum=0
expect_rc 1 "a recipe with grad_accum=0"
expect_err 'train.grad_accum=0: expected an integer >= 1'
( cd "$REPO/recipes" && run "$LUNAR" sft.lua data.template=bogus && expect_rc 1 "run from recipes/" &&
  expect_err 'data.template=bogus: expected glm45' ) || exit 1

# ---- usage errors exit 2 with the usage text --------------------------------------------------
run "$LUNAR" --no-such-option
expect_rc 2 "an unknown option"
expect_err "unknown option '--no-such-option'"
expect_err 'usage: lunar'

run "$LUNAR" -e
expect_rc 2 "-e without code"
run "$LUNAR" --threads
expect_rc 2 "--threads without a count"
run "$LUNAR" --threads many -e 'print(1)'
expect_rc 2 "--threads with a non-number"
expect_err 'usage: lunar'
run "$LUNAR" --threads 2 -e 'print(require("lunar").threads())'
expect_rc 0 "--threads 2"
[ "$(cat "$TMP/out")" = 2 ] || fail "--threads 2 gave lunar.threads() = '$(cat "$TMP/out")'"

# ---- a script with arguments and dotted overrides --------------------------------------------
cat > "$TMP/args.lua" <<'EOF'
local lunar = require 'lunar'
local o = lunar.config.overrides()
local keys = {}
for k in pairs(o) do keys[#keys + 1] = k end
table.sort(keys)
assert(table.concat(keys, ',') == 'a,c', 'override keys: ' .. table.concat(keys, ','))
assert(type(o.a) == 'table' and o.a.b == 1 and type(o.a.b) == 'number', 'a.b')
assert(o.c == 'str', 'c')
local n = 0
for _ in pairs(o.a) do n = n + 1 end
assert(n == 1, 'a has one key')
assert(arg[0]:match('args%.lua$'), 'arg[0] = ' .. tostring(arg[0]))
assert(arg[1] == 'a.b=1' and arg[2] == 'c=str' and arg[3] == 'plain' and arg[4] == nil, 'arg')
assert(select('#', ...) == 3 and select(3, ...) == 'plain', 'varargs')
print('args ok')
EOF
run "$LUNAR" "$TMP/args.lua" a.b=1 c=str plain
expect_rc 0 "a script with overrides"
expect_out 'args ok'

# options after the script belong to the script
cat > "$TMP/echo.lua" <<'EOF'
print(table.concat(arg, ' '))
EOF
run "$LUNAR" "$TMP/echo.lua" -i --version x=1
expect_rc 0 "options after the script"
[ "$(cat "$TMP/out")" = '-i --version x=1' ] || fail "script args were '$(cat "$TMP/out")'"

# ---- script errors exit 1 with the message and a traceback naming the script line ---------------
cat > "$TMP/fails.lua" <<'EOF'
local function inner(v)
    local half = v / 2
    error('inner failed with ' .. half)
end
inner(10)
EOF
run "$LUNAR" "$TMP/fails.lua"
expect_rc 1 "a failing script"
expect_err 'fails.lua:3: inner failed with 5'
expect_err 'stack traceback:'
expect_err "fails.lua:3: in function 'inner'"
expect_err 'fails.lua:5: in main chunk'

# an error raised by a tensor op names the op and the script line
cat > "$TMP/badview.lua" <<'EOF'
local lunar = require 'lunar'
local t = lunar.zeros(2, 3)
local v = t:view(4)
EOF
run "$LUNAR" "$TMP/badview.lua"
expect_rc 1 "a failing tensor op"
expect_err 'badview.lua:3:'
expect_err 'view'

run "$LUNAR" "$TMP/no-such-script.lua"
expect_rc 1 "a missing script"
expect_err 'no-such-script.lua'

printf 'x = (\n' > "$TMP/syntax.lua"
run "$LUNAR" "$TMP/syntax.lua"
expect_rc 1 "a script with a syntax error"
expect_err 'syntax.lua:'

cat > "$TMP/exits.lua" <<'EOF'
os.exit(5)
EOF
run "$LUNAR" "$TMP/exits.lua"
expect_rc 5 "os.exit(5)"

# ---- the script from stdin ('-') -----------------------------------------------------------------
run_input 'print(6 * 7, ...)\n' "$LUNAR" - one two
expect_rc 0 "a script on stdin"
[ "$(cat "$TMP/out")" = "$(printf '42\tone\ttwo')" ] || fail "stdin script printed '$(cat "$TMP/out")'"

# ---- the REPL reading piped input (no terminal) ------------------------------------------------
run_input 'answer = 40\n=answer + 2\nerror("oops")\nprint("still " .. "here")\n' "$LUNAR" -i
expect_rc 0 "lunar -i with piped input"
grep -q -x 42 "$TMP/out" || fail "piped REPL did not print 42"
expect_out 'still here'
expect_err 'oops'

# ---- --repl-on-error ---------------------------------------------------------------------------
cat > "$TMP/onerror.lua" <<'EOF'
local lunar = require 'lunar'
local outer = 'outer value'
local function step(n)
    local foo = 42
    local t = lunar.ones(2, 2)
    if n > 0 then error('step ' .. n .. ' failed (' .. outer .. ')') end
end
step(3)
EOF

# piped: the REPL reads its lines from stdin; the run still exits 1
run_input '=foo\n=foo + n\nprint(outer)\n=t:numel()\nnosuch()\nprint("alive")\n' \
    "$LUNAR" --repl-on-error "$TMP/onerror.lua"
expect_rc 1 "--repl-on-error (piped), after the REPL"
expect_err 'onerror.lua:6: step 3 failed (outer value)'
expect_err "onerror.lua:6: in function 'step'"
grep -q -x 42 "$TMP/out" || { cat "$TMP/out" >&2; fail "=foo did not print 42"; }
grep -q -x 45 "$TMP/out" || fail "=foo + n did not print 45"
expect_out 'outer value'
grep -q -x 4 "$TMP/out" || fail "=t:numel() did not print 4"
expect_err "attempt to call global 'nosuch'"
expect_out 'alive'

# without the flag there is no REPL
run "$LUNAR" "$TMP/onerror.lua"
expect_rc 1 "the same script without --repl-on-error"
grep -q 'entering the REPL' "$TMP/err" && fail "a REPL was opened without --repl-on-error"

# -i opens the REPL after a failing script too (as python -i), with the globals it had set; the
# exit status stays the script's
cat > "$TMP/fails.lua" <<'EOF'
answer = 42
error('script ' .. 'failed')
EOF
run_input 'print("after " .. answer)\n' "$LUNAR" -i "$TMP/fails.lua"
expect_rc 1 "-i with a failing script"
expect_err 'script failed'
expect_out 'after 42'

# inside lunar.scope (every training step runs in one): the traceback still reaches the failing
# line, --repl-on-error still sees that frame's locals, and its tensors are still alive
cat > "$TMP/inscope.lua" <<'EOF'
local lunar = require 'lunar'
local function step(inp)
    local acts = lunar.ones(2, 3)
    local y = inp:matmul(lunar.randn(4, 5))
    return y
end
local x = lunar.randn(2, 3)
lunar.scope(function() step(x) end)
EOF
run "$LUNAR" "$TMP/inscope.lua"
expect_rc 1 "an error inside lunar.scope"
expect_err "inscope.lua:4: gemm: a 'tensor' (2, 3) and b 'tensor' (4, 5)"
expect_err "inscope.lua:4: in function 'step'"
expect_err "inscope.lua:8: in function <"
run_input '=acts:sum():item()\n=inp:size(2)\n' "$LUNAR" --repl-on-error "$TMP/inscope.lua"
expect_rc 1 "--repl-on-error inside lunar.scope"
grep -q -x 6 "$TMP/out" || { cat "$TMP/out" "$TMP/err" >&2; fail "=acts:sum():item() did not print 6"; }
grep -q -x 3 "$TMP/out" || fail "=inp:size(2) did not print 3"
# an error caught after leaving a scope leaves nothing behind: the scopes are popped, and the
# failure REPL shows the frame of the error that really ended the run, whose traceback is its own
cat > "$TMP/caught.lua" <<'EOF'
local lunar = require 'lunar'
local function f() local caught_local = 1; error('same message', 0) end
for _ = 1, 3 do pcall(lunar.scope, f) end
depth = lunar.core.scope_depth()
local function real() local real_local = 42; error('same message', 0) end
real()
EOF
run_input '=depth\n=real_local\n=caught_local\n' "$LUNAR" --repl-on-error "$TMP/caught.lua"
expect_rc 1 "--repl-on-error after caught scope errors"
grep -q -x 0 "$TMP/out" || { cat "$TMP/out" "$TMP/err" >&2; fail "scopes left open after caught errors"; }
grep -q -x 42 "$TMP/out" || fail "the failure REPL did not show the real failing frame"
grep -q -x 1 "$TMP/out" && fail "the failure REPL showed the caught error's frame"
expect_err "caught.lua:6: in main chunk"
# pcall around a scope gets the error value as raised (no traceback glued to it)
run "$LUNAR" -e 'local l = require "lunar"
local ok, e = pcall(l.scope, function() error({code = 7}) end)
local ok2, e2 = pcall(l.scope, function() error("plain", 0) end)
print(type(e) == "table" and e.code, e2)'
expect_rc 0 "pcall around lunar.scope"
[ "$(cat "$TMP/out")" = "7	plain" ] || fail "pcall around lunar.scope gave '$(cat "$TMP/out")'"

# through tmux, as at a terminal
if command -v tmux >/dev/null 2>&1; then
    tmux_start onerr "env INPUTRC=/dev/null LUNAR_HISTORY='$TMP/history' '$LUNAR' --repl-on-error '$TMP/onerror.lua'"
    tmux_wait onerr 'entering the REPL'
    tmux_wait onerr 'lunar> '
    tmux_keys onerr '=foo'
    tmux_wait onerr '42'
    tmux_screen onerr | grep -q -x 42 || fail "=foo did not print 42 at the terminal"
    tmux_keys onerr 't:view(3)'
    tmux_wait onerr 'has 4 elements'
    tmux_keys onerr "print('foo is ' .. foo)"
    tmux_wait onerr 'foo is 42'
    tmux_key onerr C-d
    status=$(tmux_wait_exit onerr) || fail "--repl-on-error did not exit on Ctrl-D"
    [ "$status" = 1 ] || fail "--repl-on-error exited with status $status after Ctrl-D (want 1)"
else
    echo "tmux not installed: the terminal part of --repl-on-error is skipped"
fi

echo "test_cli: all passed"
