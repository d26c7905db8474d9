#!/bin/sh
# An error raised on one rank ends the whole job with that rank's message, quickly, instead of
# leaving the other ranks waiting in a collective. Usage: test_dist_abort.sh LUNAR_BIN
LUNAR=${1:?usage: $0 LUNAR_BIN}
# A lunar built without MPI (LUNAR_BUILT_WITHOUT names mpi, set by ctest) refuses a launcher's
# world of several ranks at once, with a message that says why.
case ",${LUNAR_BUILT_WITHOUT:-}," in *,mpi,*)
    msg=$(OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_RANK=0 "$LUNAR" -e 'print(require("lunar").dist.rank())' 2>&1)
    rc=$?
    if [ "$rc" -ne 1 ] || ! echo "$msg" | grep -q 'launcher with 4 ranks, but this lunar was built without MPI'; then
        echo "FAIL  no-MPI build under a launcher: rc $rc, output: $msg"
        exit 1
    fi
    echo "ok    built without MPI: a launcher's world is refused ($msg)"
    exit 0
esac
command -v mpirun >/dev/null 2>&1 || { echo "mpirun not found: skipped"; exit 77; }
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
fail=0

# run NAME CODE [PATTERN]: mpirun -np 4 lunar -e CODE must fail within 30 s, its output naming
# rank 2 and carrying PATTERN (default: rank 2's error, 'boom on rank 2')
run() {
    name=$1
    pattern=${3:-boom on rank 2}
    start=$(date +%s)
    timeout 60 mpirun --allow-run-as-root --oversubscribe -np 4 -x LUNAR_THREADS=1 -x OMP_NUM_THREADS=1 \
        "$LUNAR" -e "$2" >"$OUT" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    problem=""
    [ "$rc" -eq 0 ] && problem="the job exited 0"
    [ "$rc" -eq 124 ] && problem="the job hung (killed by timeout after 60 s)"
    [ -z "$problem" ] && [ "$secs" -gt 30 ] && problem="the job took ${secs} s to end (limit 30 s)"
    grep -q '\[rank 2/4\]' "$OUT" || problem="$problem; no '[rank 2/4]' prefix in the output"
    grep -q -F "$pattern" "$OUT" || problem="$problem; the message '$pattern' is missing"
    if [ -n "$problem" ]; then
        echo "FAIL  $name: $problem (rc $rc)"
        sed 's/^/      /' "$OUT"
        fail=1
    else
        echo "ok    $name (rc $rc, ${secs} s)"
    fi
}

# rank 2 fails while the others wait in a barrier
run "error while the others are in a barrier" '
local d = require("lunar").dist
if d.rank() == 2 then error("boom on rank 2") end
d.barrier()'

# rank 2 fails while the others wait in an all_reduce on a group
run "error while the others are in an all_reduce" '
local lunar = require("lunar")
local d = lunar.dist
local lay = d.layout{tp = 2}
if d.rank() == 2 then error("boom on rank 2") end
d.all_reduce(lunar.ones(8), {group = lay:group("dp")})
d.all_reduce(lunar.ones(8))'

# rank 2 fails before lunar.dist was ever used (MPI not initialised on that rank)
run "error before init" '
local lunar = require("lunar")
if os.getenv("OMPI_COMM_WORLD_RANK") == "2" then error("boom on rank 2") end
lunar.dist.all_reduce(lunar.ones(4))
lunar.dist.barrier()'

# rank 2 leaves through os.exit(3) after printing its reason; the others are in a barrier
run "os.exit with a failure code" '
local d = require("lunar").dist
if d.rank() == 2 then io.stderr:write("[rank 2/4] boom on rank 2\n"); os.exit(3) end
d.barrier()'

# rank 2 asks for another layout than the others: every rank fails, naming both layouts, instead
# of running later collectives on groups of the wrong size
run "ranks asking for different layouts fail" '
local lunar = require("lunar")
local d = lunar.dist
local lay = d.layout{tp = d.rank() == 2 and 4 or 2}
d.all_reduce(lunar.ones(2), {group = lay:group("tp")})' \
    'layout: the ranks disagree: rank 2 asks for tp=4 cp=1 dp=1 pp=1 ep=1, rank 0 for tp=2'

# a clean run with os.exit(0) still ends cleanly (MPI is finalised first)
start=$(date +%s)
if timeout 60 mpirun --allow-run-as-root --oversubscribe -np 4 "$LUNAR" -e '
local d = require("lunar").dist
d.barrier()
os.exit(0)' >"$OUT" 2>&1; then
    echo "ok    os.exit(0) under mpirun ends the job cleanly"
else
    echo "FAIL  os.exit(0) under mpirun: rc $?"
    sed 's/^/      /' "$OUT"
    fail=1
fi
exit $fail
