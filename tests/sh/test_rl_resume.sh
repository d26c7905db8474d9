#!/bin/sh
# tests/sh/test_rl_resume.sh LUNAR_BIN: an RL run (recipes/gsm8k.lua, small settings, the tiny
# preset and tiny_flash: GLM-5 and GLM-5.3-Flash) killed with SIGKILL after a checkpoint and
# started again with the same command resumes from that checkpoint, and every later step's metrics
# equal those of a run that was never interrupted (timings and memory aside): the policy, the
# optimizer, the prompt order and the sampling streams all continue exactly.
set -u
LUNAR=${1:?usage: test_rl_resume.sh LUNAR_BIN}
case $LUNAR in /*) ;; *) LUNAR=$(pwd)/$LUNAR ;; esac
REPO=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=$(mktemp -d "${TMPDIR:-/tmp}/lunar-rl.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$ROOT"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
SMALL="quiet=true data.valid=false data.limit=64 rl.prompts=2 rl.n=4 rl.micro_batch=4 rollout.max_new_tokens=16 train.steps=4
 checkpoint.every=2 metrics.tensorboard=false"

run() { # dir: the GRPO recipe writing under dir
    "$LUNAR" "$REPO/recipes/gsm8k.lua" preset=$PRESET $SMALL checkpoint.dir="$1/ckpt" metrics.dir="$1" output.dir="$1/final" \
        >"$1.out" 2>"$1.err" </dev/null
}

for PRESET in tiny tiny_flash; do
    TMP=$ROOT/$PRESET
    mkdir -p "$TMP/full" "$TMP/killed"
    run "$TMP/full" || { cat "$TMP/full.err"; fail "the uninterrupted run failed"; }

    # (exec: $! is lunar itself, not a subshell that would die and leave lunar running)
    (exec "$LUNAR" "$REPO/recipes/gsm8k.lua" preset=$PRESET $SMALL checkpoint.dir="$TMP/killed/ckpt" metrics.dir="$TMP/killed" \
        output.dir="$TMP/killed/final" >"$TMP/killed.out" 2>"$TMP/killed.err" </dev/null) &
    pid=$!
    i=0
    until [ -f "$TMP/killed/ckpt/step_000002/COMPLETE.json" ]; do
        kill -0 $pid 2>/dev/null || { cat "$TMP/killed.err"; fail "the run ended before its checkpoint of step 2"; }
        i=$((i + 1)); [ $i -lt 6000 ] || { kill -9 $pid; fail "the checkpoint of step 2 never came"; }
        sleep 0.05
    done
    kill -9 $pid
    wait $pid 2>/dev/null
    [ ! -e "$TMP/killed/final" ] || fail "the killed run had already finished"
    grep -q '"step":4,' "$TMP/killed/metrics.jsonl" && fail "the killed run had already logged step 4"
    run "$TMP/killed" || { cat "$TMP/killed.err"; fail "the resumed run failed"; }
    grep -q "2 steps (3-4)" "$TMP/killed.out" || { cat "$TMP/killed.out"; fail "the run did not resume from step 2"; }

    # steps 3 and 4 of both runs, without the fields that measure time or memory
    strip() {
        grep -E '"step":(3|4),' "$1/metrics.jsonl" | grep '"reward_mean"' |
            sed -E 's/"(step_time_s|time|tokens_per_s|gen_tokens_per_s|time_[a-z_]+|peak_mem_bytes)":[^,}]*,?//g'
    }
    strip "$TMP/full" >"$TMP/a"
    strip "$TMP/killed" >"$TMP/b"
    [ "$(wc -l <"$TMP/a")" = 2 ] || { cat "$TMP/full/metrics.jsonl"; fail "the uninterrupted run logged no steps 3 and 4"; }
    cmp -s "$TMP/a" "$TMP/b" || { diff "$TMP/a" "$TMP/b" >&2; fail "the resumed run's metrics differ"; }
    echo "ok: $PRESET killed after the checkpoint of step 2 (SIGKILL), resumed, steps 3-4 identical"
done
