#!/bin/sh
# tests/sh/test_sft_kill.sh LUNAR_BIN: the SFT recipe (tiny preset, small settings) killed with
# SIGKILL in the middle of a checkpoint write resumes from the previous complete checkpoint, and
# every later step's loss (metrics.jsonl) equals the uninterrupted run's, bit for bit.
set -u
LUNAR=${1:?usage: test_sft_kill.sh LUNAR_BIN}
case $LUNAR in /*) ;; *) LUNAR=$(pwd)/$LUNAR ;; esac
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lunar-sft-kill.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }
ARGS="quiet=true expect_loss_fall=false data.limit=48 data.seq_len=128 data.max_rejected=0.5 data.micro_batch=2 train.steps=6 optim.warmup=1 checkpoint.every=2 output.dir=false"

run() { # dir [env]
    "$LUNAR" recipes/sft.lua $ARGS checkpoint.dir="$1/ckpt" metrics.dir="$1"
}
losses() { # metrics.jsonl -> "step loss" lines for steps 3..6
    sed -n 's/.*"step": *\([0-9]*\).*"loss": *\([-0-9.e]*\).*/\1 \2/p' "$1" | awk '$1 >= 3'
}

run "$TMP/ref" >"$TMP/ref.out" 2>&1 || { cat "$TMP/ref.out"; fail "reference run"; }
losses "$TMP/ref/metrics.jsonl" >"$TMP/ref.losses"
[ "$(wc -l <"$TMP/ref.losses")" = 4 ] || fail "reference losses: $(cat "$TMP/ref/metrics.jsonl")"

LUNAR_CKPT_TEST_SLEEP=0.5 run "$TMP/run" >"$TMP/run.out1" 2>&1 &
pid=$!
i=0
while :; do   # wait for the write of step 4 to start, then kill the process in its middle
    found=$(ls -d "$TMP/run/ckpt"/.tmp.step_000004.*/model 2>/dev/null | head -n 1)
    [ -n "$found" ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$TMP/run.out1"; fail "the run ended before the kill"; }
    i=$((i + 1)); [ $i -lt 2400 ] || { kill -9 "$pid"; fail "the step-4 checkpoint never started"; }
    sleep 0.05
done
kill -9 "$pid"; wait "$pid" 2>/dev/null; rc=$?
[ $rc = 137 ] || fail "the killed run exited with $rc, not 137"
[ -f "$TMP/run/ckpt/step_000002/COMPLETE.json" ] || fail "step 2 is not complete"
[ -e "$TMP/run/ckpt/step_000004" ] && fail "a step_000004 directory exists after the kill"

run "$TMP/run" >"$TMP/run.out2" 2>"$TMP/run.err2" || { cat "$TMP/run.out2" "$TMP/run.err2"; fail "the resumed run failed"; }
[ -f "$TMP/run/ckpt/step_000006/COMPLETE.json" ] || fail "the resumed run did not finish"
losses "$TMP/run/metrics.jsonl" >"$TMP/run.losses"
cmp -s "$TMP/ref.losses" "$TMP/run.losses" || { diff "$TMP/ref.losses" "$TMP/run.losses"; fail "losses after the resume differ"; }
cmp -s "$TMP/ref/ckpt/step_000006/model/model.safetensors" "$TMP/run/ckpt/step_000006/model/model.safetensors" \
    || fail "the final weights differ"
echo "test_sft_kill: killed during the step-4 checkpoint, resumed from step 2, identical losses for steps 3-6"
