#!/bin/bash
# tests/gpu/run.sh: build lunar with CUDA on a GPU machine and run everything that needs the GPU:
# the CUDA-vs-CPU tests (tests/gpu/test_*.lua), the dtype fixture test (its copies also run on
# cuda:0 when a device is present), the GPU benchmark (tests/bench/bench_gpu.lua), a torch
# reference benchmark at the same sizes when python3 has torch with CUDA, and last the CPU suites
# of ctest with that build. Every step runs even when an earlier one failed (except after a
# failed build); a summary ends the log. Exit status: 1 when any step failed, 2 when steps were
# left out because the time budget ran out (nothing failed), else 0.
#
# ---- running it ---------------------------------------------------------------------------------
#   1. on a machine with network access, in the checkout, once:    sh tests/gpu/fetch_deps.sh
#      (apt-get download of LuaJIT, cJSON, OpenBLAS and GCC runtime .debs into .gpudeps/,
#      about 13 MiB; it is in .gitignore, so copy it along with the checkout when the GPU machine
#      has no network)
#   2. on the GPU machine, in a copy of the checkout with .gpudeps/:    bash tests/gpu/run.sh
#      The script keeps itself within LUNAR_GPU_BUDGET_S (default 420 s; steps that would not
#      fit are reported as skipped). Expect 3-5 minutes on an H100/H200-class machine; the build
#      dir stays, so a rerun only rebuilds what changed.
#   3. the results are files in $OUT: run.log (everything: the machine, configure, build, every
#      test's output), summary.txt (one line per step), bench_gpu.txt and bench_torch.txt; the
#      summary also ends the output. Without $OUT the files go to build-gpu/out/.
# To check the flow without a GPU: LUNAR_FORCE_DEPS_PREFIX=1 JOBS=2 bash tests/gpu/run.sh (the
# GPU steps skip); with LUNAR_GPU_DRY_RUN=1 as well, the new GPU tests and the benchmark run
# with the CPU standing in for the GPU.
#
# ---- how it finds what it needs --------------------------------------------------------------
# The GPU machine's image has nvcc, CMake, ninja and python3 with torch, but may lack LuaJIT,
# cJSON and OpenBLAS: when their headers are missing (or LUNAR_FORCE_DEPS_PREFIX=1), every .deb
# in .gpudeps/ is unpacked with `dpkg-deb -x` (or python3 without dpkg) into a private prefix
# (LUNAR_DEPS_DIR, default /tmp/lunar-deps; GCC runtime packages only when the machine lacks the
# library), the build gets -DLUNAR_DEPS_PREFIX=<prefix> and LD_LIBRARY_PATH gets its lib dirs.
# NCCL comes from the CUDA toolkit or the system, else from python's nvidia-nccl package. The
# build is without MPI and readline (a one-rank lunar.dist, a plain REPL) and, so that a new
# compiler's warning cannot stop the run, without -Werror (warnings are counted in the summary).
#
# Environment: OUT (log folder), LUNAR_GPU_BUDGET_S (420), LUNAR_CUDA_ARCHS (90),
# LUNAR_GPU_BUILD_DIR (build-gpu), JOBS (nproc), LUNAR_FORCE_DEPS_PREFIX (0),
# LUNAR_DEPS_DIR (/tmp/lunar-deps), LUNAR_GPU_CMAKE_ARGS (extra configure arguments),
# LUNAR_GPU_TORCH_REF (1: run the torch reference when torch sees a GPU).
set -u
set -o pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
BUDGET=${LUNAR_GPU_BUDGET_S:-420}
BUILD=${LUNAR_GPU_BUILD_DIR:-build-gpu}
case $BUILD in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
ARCHS=${LUNAR_CUDA_ARCHS:-90}
DEPS=${LUNAR_DEPS_DIR:-/tmp/lunar-deps}
OUTDIR=${OUT:-$BUILD/out}
mkdir -p "$OUTDIR" "$BUILD"
LOG=$OUTDIR/run.log
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
SECONDS=0

# ---- steps and the summary ---------------------------------------------------------------------
SUMMARY=()
FAILED=0
INCOMPLETE=0
note() { SUMMARY+=("$(printf '%-8s %-40s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }
section() { printf '\n==== %s (at %ss) ====\n' "$1" "$SECONDS"; }

# seconds a step may take: at most $1, and what is left of the budget less 15 s for the summary
allowance() {
    local left=$((BUDGET - SECONDS - 15))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

# run_step NAME CAP CMD...: runs CMD under a timeout; PASS (0), SKIP (77), TIMEOUT, FAIL
run_step() {
    local name=$1 cap=$2
    shift 2
    local t
    t=$(allowance "$cap")
    section "$name"
    if [ "$t" -lt 20 ]; then
        echo "not run: the time budget (${BUDGET}s) is spent"
        note SKIP "$name" 0 "time budget spent"
        INCOMPLETE=1
        return 0
    fi
    local t0=$SECONDS rc
    timeout -k 10 "$t" "$@"
    rc=$?
    local dt=$((SECONDS - t0))
    case $rc in
        0) note PASS "$name" "$dt" ;;
        77) note SKIP "$name" "$dt" "exit 77 (no device or not applicable)" ;;
        124 | 137) note TIMEOUT "$name" "$dt" "stopped after ${t}s"; FAILED=1 ;;
        *) note FAIL "$name" "$dt" "exit $rc"; FAILED=1 ;;
    esac
    return $rc
}

# the commit and whether the tree differs from it (the device's copy has no .git: "unknown")
commit_desc() {
    local c
    c=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) || { echo "unknown (no git metadata here)"; return; }
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null && echo "$c" || echo "$c with local changes"
}

finish() {
    section "summary"
    local s
    {
        echo "lunar GPU run $(date -u '+%Y-%m-%d %H:%M:%S UTC'), ${SECONDS}s of a ${BUDGET}s budget"
        echo "commit: $(commit_desc)"
        echo "device: ${GPU_NAME:-none}"
        for s in "${SUMMARY[@]}"; do echo "$s"; done
        if [ "$FAILED" != 0 ]; then echo "RESULT: FAILED"
        elif [ "$INCOMPLETE" != 0 ]; then echo "RESULT: INCOMPLETE (the time budget ran out; nothing failed)"
        else echo "RESULT: all steps passed or were skipped"; fi
    } | tee "$OUTDIR/summary.txt"
    exec >&- 2>&-   # let tee write the last lines of run.log before the script ends
    wait "$TEE_PID" 2>/dev/null
    [ "$FAILED" != 0 ] && exit 1
    [ "$INCOMPLETE" != 0 ] && exit 2
    exit 0
}

# ---- the machine -----------------------------------------------------------------------------
section "machine"
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
GPU_NAME=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
echo "gpu:     ${GPU_NAME:-none found by nvidia-smi}"
echo "host:    $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
echo "os:      $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
echo "nvcc:    $(nvcc --version 2>/dev/null | tail -1 || echo missing)"
echo "cc:      $(cc --version 2>/dev/null | head -1 || echo missing)"
echo "cmake:   $(cmake --version 2>/dev/null | head -1 || echo missing)"
echo "ninja:   $(ninja --version 2>/dev/null || echo missing)"
echo "python3: $(python3 --version 2>/dev/null || echo missing)"
echo "commit:  $(commit_desc)"
echo "budget:  ${BUDGET}s, jobs ${JOBS}, archs ${ARCHS}, build dir ${BUILD}, log ${LOG}"
nvidia-smi 2>/dev/null | head -20

# ---- dependencies ----------------------------------------------------------------------------
section "dependencies"
MULTIARCH=$(gcc -print-multiarch 2>/dev/null)
[ -n "$MULTIARCH" ] || MULTIARCH=x86_64-linux-gnu

have_header() {   # have_header PATH...: any of the headers under /usr/include or /usr/local/include
    local h
    for h in "$@"; do
        [ -f "/usr/include/$h" ] || [ -f "/usr/local/include/$h" ] && return 0
    done
    return 1
}
system_has_deps() {
    have_header luajit-2.1/luajit.h || return 1
    have_header cjson/cJSON.h || return 1
    have_header pcre2.h || return 1
    have_header "$MULTIARCH/openblas-openmp/cblas.h" "$MULTIARCH/openblas-pthread/cblas.h" openblas/cblas.h || return 1
}

# extract_deb DEB DIR: unpack a Debian package's files (dpkg -x, or python3 where dpkg is missing)
extract_deb() {
    if command -v dpkg-deb >/dev/null 2>&1 && [ "${LUNAR_DEB_EXTRACT:-dpkg}" = dpkg ]; then
        dpkg-deb -x "$1" "$2"
        return
    fi
    python3 - "$1" "$2" <<'EOF'
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
data = open(deb, 'rb').read()
if data[:8] != b'!<arch>\n':
    sys.exit(deb + ': not a Debian package')
pos = 8
while pos + 60 <= len(data):
    name = data[pos:pos + 16].decode().strip().rstrip('/')
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    pos += 60 + size + (size & 1)
    if name.startswith('data.tar'):
        with tarfile.open(fileobj=io.BytesIO(body)) as tf:
            try:
                tf.extractall(dest, filter='tar')
            except TypeError:   # python before 3.12
                tf.extractall(dest)
        sys.exit(0)
sys.exit(deb + ': no data.tar member')
EOF
}

# the GCC runtime packages are unpacked only where the machine lacks their library (a newer
# system copy must win: lunar's own objects may need its newer symbol versions)
runtime_soname() {
    case $1 in
        libgfortran5) echo libgfortran.so.5 ;;
        libquadmath0) echo libquadmath.so.0 ;;
        libgomp1) echo libgomp.so.1 ;;
    esac
}

CMAKE_DEPS=()
if [ "${LUNAR_FORCE_DEPS_PREFIX:-0}" = 1 ] || ! system_has_deps; then
    [ "${LUNAR_FORCE_DEPS_PREFIX:-0}" = 1 ] && echo "LUNAR_FORCE_DEPS_PREFIX=1: using the private prefix" ||
        echo "LuaJIT, cJSON, PCRE2 or OpenBLAS headers missing on this machine: using the private prefix"
    if ! ls .gpudeps/*.deb >/dev/null 2>&1; then
        echo "no .gpudeps/*.deb: run 'sh tests/gpu/fetch_deps.sh' in the checkout, and carry [\".gpudeps\"]"
        note FAIL "dependencies" "$SECONDS" ".gpudeps/ is empty"
        FAILED=1
        finish
    fi
    rm -rf "$DEPS"
    mkdir -p "$DEPS"
    for deb in .gpudeps/*.deb; do
        pkg=$(basename "$deb" | cut -d_ -f1)
        so=$(runtime_soname "$pkg")
        if [ -n "$so" ] && ldconfig -p 2>/dev/null | grep -q "[[:space:]]$so "; then
            echo "  $pkg: the system has $so, not unpacked"
            continue
        fi
        if ! extract_deb "$deb" "$DEPS"; then
            note FAIL "dependencies" "$SECONDS" "cannot unpack $deb"
            FAILED=1
            finish
        fi
        echo "  $pkg unpacked"
    done
    LIBDIR=$DEPS/usr/lib/$MULTIARCH
    export LD_LIBRARY_PATH="$LIBDIR:$LIBDIR/openblas-openmp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    CMAKE_DEPS+=("-DLUNAR_DEPS_PREFIX=$DEPS")
    note PASS "dependencies (private prefix $DEPS)" "$SECONDS"
else
    echo "LuaJIT, cJSON and OpenBLAS found on the system"
    CMAKE_DEPS+=("-DLUNAR_DEPS_PREFIX=")   # clears a prefix cached by an earlier configure
    note PASS "dependencies (system)" "$SECONDS"
fi

# NCCL: the toolkit's or the system's, else the one python's torch uses (nvidia-nccl wheel)
nccl_header=""
for d in /usr/include /usr/local/include /usr/local/cuda/include "${CUDA_HOME:-/nonexistent}/include"; do
    [ -f "$d/nccl.h" ] && nccl_header=$d/nccl.h && break
done
if [ -z "$nccl_header" ]; then
    NCCL_ROOT=$(python3 -c 'import os, nvidia.nccl as m; print(next(p for p in m.__path__ if os.path.exists(p + "/include/nccl.h")))' 2>/dev/null)
    if [ -n "$NCCL_ROOT" ]; then
        echo "NCCL from python: $NCCL_ROOT"
        CMAKE_DEPS+=("-DNCCL_ROOT=$NCCL_ROOT")
        export LD_LIBRARY_PATH="$NCCL_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    else
        echo "NCCL not found: the build goes on without it (test_gpu_nccl will skip)"
    fi
else
    echo "NCCL: $nccl_header"
fi
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

# ---- configure and build ---------------------------------------------------------------------
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
if [ -f "$BUILD/CMakeCache.txt" ]; then
    cached=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$BUILD/CMakeCache.txt")
    want=Ninja
    [ ${#GEN[@]} -eq 0 ] && want="Unix Makefiles"
    [ "$cached" != "$want" ] && echo "removing $BUILD (made with $cached)" && rm -rf "${BUILD:?}/CMakeCache.txt" "${BUILD:?}/CMakeFiles"
fi
# shellcheck disable=SC2086
run_step "configure" 120 cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLUNAR_WITH_CUDA=ON \
    -DLUNAR_CUDA_ARCHS="$ARCHS" -DLUNAR_WITH_MPI=OFF -DLUNAR_WITH_READLINE=OFF -DLUNAR_WERROR=OFF \
    "${CMAKE_DEPS[@]}" ${LUNAR_GPU_CMAKE_ARGS:-}
if [ $? -ne 0 ]; then
    for f in "$BUILD/CMakeFiles/CMakeConfigureLog.yaml" "$BUILD/CMakeFiles/CMakeError.log"; do
        [ -f "$f" ] && echo "---- tail of $f" && tail -40 "$f"
    done
    finish
fi

section "build"
t0=$SECONDS
timeout -k 10 "$(allowance 300)" cmake --build "$BUILD" -j"$JOBS" 2>&1 | tee "$BUILD/build.log"
rc=$?
warnings=$(grep -c -i 'warning' "$BUILD/build.log")
if [ $rc -ne 0 ]; then
    [ $rc = 124 ] && note TIMEOUT "build" "$((SECONDS - t0))" "the time budget ran out" ||
        note FAIL "build" "$((SECONDS - t0))" "exit $rc, $warnings warning lines"
    FAILED=1
    finish
fi
note PASS "build" "$((SECONDS - t0))" "$warnings warning lines (-Werror off; see build.log in the log)"
[ "$warnings" -gt 0 ] && grep -i -A3 'warning' "$BUILD/build.log" | head -60
LUNAR=$BUILD/lunar
echo "---- libraries of $LUNAR"
ldd "$LUNAR" | grep -E 'luajit|cjson|openblas|gomp|gfortran|nccl|cublas|cudart|not found'

# ---- tests -----------------------------------------------------------------------------------
export LUNAR_THREADS=$JOBS OMP_NUM_THREADS=$JOBS NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# NCCL's bootstrap needs a socket interface: on a machine with only the loopback, name it
if [ -z "${NCCL_SOCKET_IFNAME:-}" ] && [ "$(ls /sys/class/net 2>/dev/null | grep -v -x lo | wc -l)" = 0 ]; then
    export NCCL_SOCKET_IFNAME=lo
    echo "only the loopback interface: NCCL_SOCKET_IFNAME=lo"
fi
# with a GPU on the machine lunar must see it (else every GPU test below would only skip)
run_step "lunar sees the device" 30 env GPU_SEEN="${GPU_NAME:+1}" "$LUNAR" -e '
local lunar = require "lunar"
local n = lunar.device_count("cuda")
print(("cuda built: %s, cuda devices: %d"):format(tostring(lunar.cuda_built()), n))
if n == 0 then os.exit(os.getenv("GPU_SEEN") == "1" and 1 or 77) end'

for f in tests/gpu/test_*.lua; do
    run_step "$(basename "$f" .lua)" 240 "$LUNAR" "$f"
done

# the dtype fixtures: lunar_copy on the cpu and on cuda:0 against torch's bits. The steps below
# that are shell functions run in a child bash (timeout needs a program): they are exported.
export ROOT BUILD LUNAR OUTDIR GPU_NAME
fixture_check() {
    set -o pipefail
    "$BUILD/tests/test_dtype_fixtures" | tee "$BUILD/dtype_fixtures.out" || return 1
    grep -q 'cuda:0' "$BUILD/dtype_fixtures.out" && return 0
    [ -z "$GPU_NAME" ] && return 77   # no GPU here: the cpu half ran
    echo "the fixture test did not run on cuda:0"
    return 1
}
export -f fixture_check
run_step "test_dtype_fixtures (cpu and cuda:0)" 120 bash -c fixture_check

# ---- benchmarks ------------------------------------------------------------------------------
bench() {
    set -o pipefail
    "$LUNAR" tests/bench/bench_gpu.lua | tee "$OUTDIR/bench_gpu.txt"
}
export -f bench
run_step "bench_gpu" 240 bash -c bench

torch_ref() {
    set -o pipefail
    PYTHONUNBUFFERED=1 python3 tests/bench/bench_gpu_torch.py | tee "$OUTDIR/bench_torch.txt"
}
export -f torch_ref
if [ "${LUNAR_GPU_TORCH_REF:-1}" = 1 ] && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    run_step "bench_gpu_torch (reference)" 150 bash -c torch_ref
else
    note SKIP "bench_gpu_torch (reference)" 0 "no torch with CUDA (or LUNAR_GPU_TORCH_REF=0)"
fi

# last, as CI runs them too: the CPU suites with this build (no MPI, no readline, CUDA on)
run_step "ctest: the CPU suites with this build" 180 ctest --test-dir "$BUILD" -j"$JOBS" --output-on-failure \
    -E '^(gpu_|c_test_dtype_fixtures$)'

finish
