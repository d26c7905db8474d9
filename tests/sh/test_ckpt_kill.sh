#!/bin/sh
# tests/sh/test_ckpt_kill.sh LUNAR_BIN: a run killed with SIGKILL in the middle of a checkpoint
# write resumes from the previous complete checkpoint and then prints exactly the losses of an
# uninterrupted run, and its final checkpoint holds the same bytes. The writer is slowed down by
# LUNAR_CKPT_TEST_SLEEP (a pause after each file) and killed at two points of the write of
# step 6: after the model was written, and after trainer_state.json (just before the marker).
set -u
LUNAR=${1:?usage: test_ckpt_kill.sh LUNAR_BIN}
case $LUNAR in /*) ;; *) LUNAR=$(pwd)/$LUNAR ;; esac
HERE=$(cd "$(dirname "$0")" && pwd)
SCRIPT=$HERE/ckpt_train.lua
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lunar-ckpt.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }

"$LUNAR" "$SCRIPT" dir="$TMP/ref" steps=8 >"$TMP/ref.out" 2>&1 || { cat "$TMP/ref.out"; fail "reference run"; }
grep '^step [5-8] ' "$TMP/ref.out" >"$TMP/ref.tail"
[ "$(wc -l <"$TMP/ref.tail")" = 4 ] || fail "reference run printed $(cat "$TMP/ref.out")"

for point in model/model.safetensors trainer_state.json; do
    run=$TMP/run-$(echo "$point" | tr '/.' '__')
    LUNAR_CKPT_TEST_SLEEP=0.4 "$LUNAR" "$SCRIPT" dir="$run" steps=8 >"$run.out1" 2>&1 &
    pid=$!
    # wait (up to 60 s) for the file to appear in the temporary directory of step 6
    i=0
    while :; do
        found=$(ls -d "$run"/.tmp.step_000006.*/"$point" 2>/dev/null | head -n 1)
        [ -n "$found" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$run.out1"; fail "$point: the writer exited before the kill"; }
        i=$((i + 1))
        [ $i -lt 1200 ] || { kill -9 "$pid"; fail "$point: never saw $point"; }
        sleep 0.05
    done
    kill -9 "$pid"
    wait "$pid"
    rc=$?
    [ $rc = 137 ] || fail "$point: the killed run exited with $rc, not 137"
    [ -f "$run/step_000004/COMPLETE.json" ] || fail "$point: step 4 is not complete: $(ls -a "$run")"
    [ -e "$run/step_000006" ] && fail "$point: a step_000006 directory exists after the kill"
    ls -d "$run"/.tmp.step_000006.* >/dev/null 2>&1 || fail "$point: no temporary directory left by the kill"
    [ -e "$(ls -d "$run"/.tmp.step_000006.*)/COMPLETE.json" ] && fail "$point: the marker was written before the kill"

    "$LUNAR" "$SCRIPT" dir="$run" steps=8 resume=auto >"$run.out2" 2>"$run.err2" \
        || { cat "$run.out2" "$run.err2"; fail "$point: the resumed run failed"; }
    grep -q -x 'resumed from step 4' "$run.out2" || { cat "$run.out2"; fail "$point: did not resume from step 4"; }
    grep '^step [5-8] ' "$run.out2" >"$run.tail"
    cmp -s "$TMP/ref.tail" "$run.tail" || { diff "$TMP/ref.tail" "$run.tail"; fail "$point: losses after the resume differ"; }
    cmp -s "$TMP/ref/step_000008/model/model.safetensors" "$run/step_000008/model/model.safetensors" \
        || fail "$point: the final weights differ"
    cmp -s "$TMP/ref/step_000008/optimizer.safetensors" "$run/step_000008/optimizer.safetensors" \
        || fail "$point: the final optimizer state differs"
    ls -d "$run"/.tmp.* >/dev/null 2>&1 && fail "$point: the dead writer's temporary directory was not removed"
    echo "ok: killed after $point, resumed from step 4 with identical losses"
done
echo "test_ckpt_kill: passed"
