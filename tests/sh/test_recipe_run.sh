#!/bin/sh
# tests/sh/test_recipe_run.sh LUNAR_BIN: a recipe as a process (the tiny SFT preset, small
# settings):
#   * SIGTERM, or a first Ctrl-C (SIGINT), finishes the step, writes a checkpoint of it and exits
#     non-zero saying so; the same command resumes from that step; a second SIGINT ends the
#     process at once;
#   * under mpirun with 2 ranks the recipe trains data parallel (one progress line a step, an
#     optimizer shard per rank); killed with SIGKILL after a checkpoint, the same command resumes
#     with bit-identical losses; a layout that does not fit the ranks, or tp > 1, refuses on every
#     rank before any work, naming the numbers;
#   * --help lists every setting with its meaning; --dry-run prints the plan and writes nothing;
#   * quiet=true keeps the end-of-run summary; checkpoint saves are logged;
#   * a user error is one line, with the stack only under --traceback;
#   * paths on the command line are relative to the current directory.
set -u
LUNAR=${1:?usage: test_recipe_run.sh LUNAR_BIN}
case $LUNAR in /*) ;; *) LUNAR=$(pwd)/$LUNAR ;; esac
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lunar-recipe.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
SMALL="expect_loss_fall=false data.limit=24 data.seq_len=128 data.micro_batch=2 data.max_rejected=0.5 optim.warmup=0"

run() { # dir args...: the SFT recipe writing under dir; output in dir.out / dir.err, status in rc
    d=$1
    shift
    "$LUNAR" "$REPO/recipes/sft.lua" $SMALL checkpoint.dir="$d/ckpt" metrics.dir="$d" output.dir="$d/final" "$@" \
        >"$d.out" 2>"$d.err" </dev/null
    rc=$?
}
expect() { # file text what
    grep -q -F -- "$2" "$1" || { cat "$1" >&2; fail "$3: '$2' not in $1"; }
}
# waits until the run writing under $1 has logged step $2 (pid $3)
wait_step() {
    i=0
    until grep -q "\"step\":$2," "$1/metrics.jsonl" 2>/dev/null; do
        kill -0 "$3" 2>/dev/null || { cat "$1.out" "$1.err" >&2; fail "the run ended before step $2"; }
        i=$((i + 1)); [ $i -lt 3000 ] || { kill -9 "$3"; fail "step $2 never came"; }
        sleep 0.05
    done
}

# ---- SIGTERM: a checkpoint of the step, a message, a non-zero exit; then the run resumes -------
mkdir -p "$TMP/term"
"$LUNAR" "$REPO/recipes/sft.lua" $SMALL train.steps=500 checkpoint.every=1000 quiet=true \
    checkpoint.dir="$TMP/term/ckpt" metrics.dir="$TMP/term" output.dir="$TMP/term/final" \
    >"$TMP/term.out" 2>"$TMP/term.err" </dev/null &
pid=$!
wait_step "$TMP/term" 2 $pid
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 1 ] || { cat "$TMP/term.err"; fail "SIGTERM: exit status $rc, want 1"; }
expect "$TMP/term.err" "stopped by SIGTERM at step" "SIGTERM message"
step=$(sed -n 's/.*stopped by SIGTERM at step \([0-9]*\) of.*/\1/p' "$TMP/term.err")
ck=$(printf '%s/term/ckpt/step_%06d' "$TMP" "$step")
[ -f "$ck/COMPLETE.json" ] || fail "SIGTERM: no complete checkpoint of step $step"
[ ! -e "$TMP/term/final" ] || fail "SIGTERM: a stopped run wrote its final output"
"$LUNAR" "$REPO/recipes/sft.lua" $SMALL train.steps=$((step + 1)) checkpoint.every=1000 \
    checkpoint.dir="$TMP/term/ckpt" metrics.dir="$TMP/term" output.dir="$TMP/term/final" \
    >"$TMP/term2.out" 2>"$TMP/term2.err" </dev/null || { cat "$TMP/term2.err"; fail "the resumed run failed"; }
expect "$TMP/term2.out" "(step $step)" "resumed from the SIGTERM checkpoint"
echo "ok    SIGTERM: checkpoint of step $step, exit 1, resumed"

# ---- SIGINT twice: the second one ends the process at once, even during the stop's checkpoint ---
# (the checkpoint pauses 5 s after each file, so the second SIGINT lands inside it even on a busy
# machine; after the stop the handlers the shell gave the process are back, and a background
# process of a non-interactive shell ignores SIGINT)
two_sigints() { # dir: 0 when the second SIGINT ended the run (status 130)
    mkdir -p "$1"
    LUNAR_CKPT_TEST_SLEEP=5 "$LUNAR" "$REPO/recipes/sft.lua" $SMALL train.steps=500 checkpoint.every=1000 quiet=true \
        checkpoint.dir="$1/ckpt" metrics.dir="$1" output.dir="$1/final" >"$1.out" 2>"$1.err" </dev/null &
    pid=$!
    wait_step "$1" 1 $pid
    kill -INT $pid
    i=0
    until ls -d "$1/ckpt"/.tmp.step_* >/dev/null 2>&1; do   # the first one's checkpoint is being written
        kill -0 $pid 2>/dev/null || { cat "$1.err" >&2; fail "the run ended after one SIGINT"; }
        i=$((i + 1)); [ $i -lt 1200 ] || { kill -9 $pid; fail "the first SIGINT started no checkpoint"; }
        sleep 0.05
    done
    sigs=$(grep -E '^Sig(Blk|Ign|Cgt)' /proc/$pid/status 2>/dev/null | tr '\n' ' ')
    kill -INT $pid
    wait $pid
    rc=$?
    [ $rc = 130 ] && return 0
    echo "two SIGINTs in $1: exit status $rc, want 130; before the second: $sigs; $(tail -n 1 "$1.err")" >&2
    return 1
}
# (a second try when the first ends otherwise: signal delivery on a loaded machine is not ours to
# time, but a run that ignores the second SIGINT twice in a row fails)
two_sigints "$TMP/int" || two_sigints "$TMP/int2" || fail "a second SIGINT did not end the run, twice"
echo "ok    a second SIGINT ends the process at once"

# ---- under mpirun: data parallel; a layout that does not fit refuses on every rank ------------
case ",${LUNAR_BUILT_WITHOUT:-}," in
*,mpi,*) echo "skip  mpirun (built without MPI)" ;;
*)
    if command -v mpirun >/dev/null 2>&1; then
        MPIRUN="mpirun --allow-run-as-root --oversubscribe -x LUNAR_THREADS=1 -x OMP_NUM_THREADS=1"
        mpi_run() { # np dir args...: the SFT recipe on np ranks writing under dir; status in rc
            np=$1 d=$2
            shift 2
            timeout 300 $MPIRUN -np "$np" "$LUNAR" "$REPO/recipes/sft.lua" $SMALL checkpoint.dir="$d/ckpt" \
                metrics.dir="$d/m" output.dir="$d/final" metrics.tensorboard=false metrics.progress=lines train.log_every=1 "$@" \
                >"$d.out" 2>&1 </dev/null
            rc=$?
        }
        losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1/m/metrics.jsonl"; }

        # 2 ranks train data parallel: rank 0 alone prints and writes, every rank its optimizer shard
        mkdir -p "$TMP/dp"
        mpi_run 2 "$TMP/dp" train.steps=4 checkpoint.every=2
        [ $rc = 0 ] || { cat "$TMP/dp.out"; fail "mpirun -np 2: exit status $rc"; }
        expect "$TMP/dp.out" "data parallel: 2 ranks" "the layout"
        expect "$TMP/dp.out" "rank 1: parameters" "rank 1's bytes"
        n=$(grep -c "^step [0-9]*/4" "$TMP/dp.out")
        [ "$n" = 4 ] || { cat "$TMP/dp.out"; fail "mpirun -np 2: $n progress lines for 4 steps"; }
        [ "$(losses "$TMP/dp" | wc -l)" = 4 ] || fail "mpirun -np 2: metrics.jsonl does not have 4 steps"
        for r in 00000 00001; do
            [ -f "$TMP/dp/ckpt/step_000004/optimizer_shards/rank_$r.safetensors" ] || fail "no optimizer shard $r"
        done
        [ -f "$TMP/dp/final/config.json" ] || fail "mpirun -np 2: no final model"
        echo "ok    mpirun -np 2 trains data parallel (one progress line a step, a shard per rank)"

        # SIGKILL of the whole job after a checkpoint, then the same command: bit-identical losses
        mkdir -p "$TMP/dpk"
        setsid $MPIRUN -np 2 "$LUNAR" "$REPO/recipes/sft.lua" $SMALL checkpoint.dir="$TMP/dpk/ckpt" \
            metrics.dir="$TMP/dpk/m" output.dir="$TMP/dpk/final" metrics.tensorboard=false train.log_every=1 \
            train.steps=8 checkpoint.every=2 quiet=true >"$TMP/dpk.out" 2>&1 </dev/null &
        pid=$!
        i=0
        until [ -f "$TMP/dpk/ckpt/step_000004/COMPLETE.json" ]; do
            kill -0 $pid 2>/dev/null || { cat "$TMP/dpk.out"; fail "the run ended before its checkpoint of step 4"; }
            i=$((i + 1)); [ $i -lt 3000 ] || { kill -KILL -$pid; fail "no checkpoint of step 4"; }
            sleep 0.05
        done
        kill -KILL -$pid   # mpirun and both ranks (their own process group)
        wait $pid 2>/dev/null
        # a rank mpirun started in a process group of its own outlives it for a moment, and could
        # still finish a checkpoint while the resumed job reads the directory: kill it, and wait
        i=0
        while pgrep -f "checkpoint.dir=$TMP/dpk/ckpt" >/dev/null 2>&1; do
            pkill -KILL -f "checkpoint.dir=$TMP/dpk/ckpt" 2>/dev/null
            i=$((i + 1)); [ $i -lt 200 ] || fail "the killed job's ranks do not end"
            sleep 0.05
        done
        [ ! -e "$TMP/dpk/ckpt/step_000008" ] || fail "the run finished before SIGKILL"
        mpi_run 2 "$TMP/dpk" train.steps=8 checkpoint.every=2
        [ $rc = 0 ] || { cat "$TMP/dpk.out"; fail "the resumed run failed"; }
        expect "$TMP/dpk.out" "resumed from" "resumed after SIGKILL"
        resumed=$(sed -n 's/.*resumed from .*(step \([0-9]*\)).*/\1/p' "$TMP/dpk.out" | head -n 1)
        [ -n "$resumed" ] && [ "$resumed" -ge 4 ] && [ "$resumed" -lt 8 ] || fail "resumed from step '$resumed'"
        mkdir -p "$TMP/dpw"
        mpi_run 2 "$TMP/dpw" train.steps=8 checkpoint.every=2
        [ $rc = 0 ] || { cat "$TMP/dpw.out"; fail "the uninterrupted run failed"; }
        losses "$TMP/dpw" >"$TMP/dpw.losses"
        losses "$TMP/dpk" >"$TMP/dpk.losses"
        [ "$(wc -l <"$TMP/dpw.losses")" = 8 ] || fail "the uninterrupted run logged $(wc -l <"$TMP/dpw.losses") steps"
        cmp -s "$TMP/dpw.losses" "$TMP/dpk.losses" || { paste "$TMP/dpw.losses" "$TMP/dpk.losses"; \
            fail "killed and resumed at dp=2: the losses differ from the uninterrupted run"; }
        echo "ok    SIGKILL of the job at dp=2, resumed from step $resumed: bit-identical losses"

        # a layout the world does not fit, and a degree not implemented yet: every rank refuses
        # before any work, naming the numbers
        mpi_run 3 "$TMP/bada" parallel.tp=2
        [ $rc != 0 ] || fail "mpirun -np 3 parallel.tp=2: exit status 0"
        expect "$TMP/bada.out" "world size 3 is not divisible by tp*pp*cp = 2*1*1 = 2" "the layout's numbers"
        mpi_run 4 "$TMP/badb" parallel.pp=2
        [ $rc != 0 ] || fail "mpirun -np 4 parallel.pp=2: exit status 0"
        expect "$TMP/badb.out" "parallel.pp=2: this parallel degree is not implemented" "pp refusal"
        [ ! -e "$TMP/bada" ] && [ ! -e "$TMP/badb" ] || fail "a refused layout wrote files: $(ls -R "$TMP"/bad?)"
        echo "ok    mpirun -np 3 with tp=2 and -np 4 with pp=2 refuse (rc $rc), nothing written"
    else
        echo "skip  mpirun (not installed)"
    fi
    ;;
esac

# ---- --help, --dry-run ------------------------------------------------------------------------
"$LUNAR" "$REPO/recipes/sft.lua" --help >"$TMP/help.out" 2>&1 || fail "--help failed"
expect "$TMP/help.out" "usage: lunar recipes/sft.lua" "--help"
grep -q '^  optim.lr  *0.0025  *peak learning rate' "$TMP/help.out" || { cat "$TMP/help.out"; fail "--help: optim.lr"; }
mkdir -p "$TMP/plan"
(cd "$TMP/plan" && "$LUNAR" "$REPO/recipes/sft.lua" --dry-run quiet=true >"$TMP/plan.out" 2>&1) ||
    { cat "$TMP/plan.out"; fail "--dry-run failed"; }
expect "$TMP/plan.out" "plan of tiny_sft (sft):" "--dry-run"
grep -q 'rows of 512 (packing bfd, efficiency [0-9.]*%)' "$TMP/plan.out" || { cat "$TMP/plan.out"; fail "--dry-run: packing"; }
expect "$TMP/plan.out" "3,446,720 parameters" "--dry-run: parameters"
[ -z "$(ls "$TMP/plan")" ] || fail "--dry-run wrote files: $(ls "$TMP/plan")"
echo "ok    --help and --dry-run"

# ---- quiet keeps the summary; saves are logged --------------------------------------------------
mkdir -p "$TMP/q"
run "$TMP/q" train.steps=2 quiet=true
[ $rc = 0 ] || { cat "$TMP/q.err"; fail "quiet run: exit status $rc"; }
expect "$TMP/q.out" "Run summary: 2 steps (1-2)" "quiet=true keeps the summary"
mkdir -p "$TMP/v"
run "$TMP/v" train.steps=2 checkpoint.every=1
[ $rc = 0 ] || { cat "$TMP/v.err"; fail "run: exit status $rc"; }
grep -q "^checkpoint step 1: $TMP/v/ckpt/step_000001 ([0-9.]* MiB, [0-9.]* s)" "$TMP/v.out" ||
    { cat "$TMP/v.out"; fail "checkpoint saves are not logged"; }
echo "ok    quiet=true prints the summary; saves are logged"

# ---- generate and eval on the model the quiet run wrote -------------------------------------------
"$LUNAR" "$REPO/recipes/generate.lua" model.path="$TMP/q/final" limit=3 n=2 temperature=0.8 seed=5 \
    max_new_tokens=6 output="$TMP/gen.jsonl" >"$TMP/gen.out" 2>"$TMP/gen.err" || { cat "$TMP/gen.err"; fail "generate.lua"; }
[ "$(wc -l <"$TMP/gen.jsonl")" = 6 ] || { cat "$TMP/gen.jsonl"; fail "generate.lua: 3 prompts x 2 samples"; }
grep -q '"index": 3, "sample": 2, "prompt": ' "$TMP/gen.jsonl" || fail "generate.lua: rows"
expect "$TMP/gen.out" "wrote 6 completions to $TMP/gen.jsonl" "generate.lua"
"$LUNAR" "$REPO/recipes/generate.lua" model.path="$TMP/q/final" temperature=0.8 >"$TMP/gen.out" 2>"$TMP/gen.err"
[ $? = 1 ] || fail "generate.lua without a seed at temperature 0.8"
expect "$TMP/gen.err" "seed" "generate.lua without a seed"
"$LUNAR" "$REPO/recipes/eval.lua" model.path="$TMP/q/final" limit=2 max_new_tokens=6 datasets=[gsm8k,MATH-500] \
    samples="$TMP/ev/samples.jsonl" >"$TMP/ev.out" 2>"$TMP/ev.err" || { cat "$TMP/ev.err"; fail "eval.lua"; }
[ "$(wc -l <"$TMP/ev/samples.jsonl")" = 4 ] || fail "eval.lua: 2 datasets x 2 problems"
grep -q '^gsm8k  *2  *1 ' "$TMP/ev.out" || { cat "$TMP/ev.out"; fail "eval.lua: the report"; }
[ -f "$TMP/ev/samples.report.json" ] || fail "eval.lua: the report file"
"$LUNAR" "$REPO/recipes/eval.lua" model.path="$TMP/q/final" datasets=[gsm9k] >"$TMP/ev.out" 2>"$TMP/ev.err"
expect "$TMP/ev.err" 'unknown dataset "gsm9k"' "eval.lua with a bad dataset"
echo "ok    generate.lua and eval.lua on the run's model"

# ---- user errors: one line; --traceback shows the stack -----------------------------------------
"$LUNAR" "$REPO/recipes/sft.lua" model.dtype=int8 >"$TMP/e.out" 2>"$TMP/e.err"
rc=$?
[ $rc = 1 ] || fail "model.dtype=int8: exit status $rc"
[ "$(wc -l <"$TMP/e.err")" = 1 ] || { cat "$TMP/e.err"; fail "a user error is not one line"; }
expect "$TMP/e.err" "lunar: recipe tiny_sft: model.dtype=int8: expected f32, bf16, f16" "model.dtype=int8"
"$LUNAR" --traceback "$REPO/recipes/sft.lua" model.dtype=int8 >"$TMP/e.out" 2>"$TMP/e.err"
expect "$TMP/e.err" "stack traceback:" "--traceback"
"$LUNAR" "$REPO/recipes/sft.lua" model.dtype=int8 --traceback >"$TMP/e.out" 2>"$TMP/e.err"
expect "$TMP/e.err" "stack traceback:" "the recipe's own --traceback"
echo "ok    user errors are one line; --traceback"

# ---- paths on the command line are relative to the current directory ----------------------------
mkdir -p "$TMP/cwd"
head -n 30 "$REPO/examples/data/sft/gsm8k_train_chat_first1000.jsonl" >"$TMP/cwd/mine.jsonl"
(cd "$TMP/cwd" && "$LUNAR" "$REPO/recipes/sft.lua" data.train=mine.jsonl --dry-run quiet=true >"$TMP/cwd.out" 2>&1) ||
    { cat "$TMP/cwd.out"; fail "data.train relative to the current directory"; }
expect "$TMP/cwd.out" "30 documents" "data.train=mine.jsonl read from the current directory"
echo "ok    command-line paths are relative to the current directory"
echo "all passed"
