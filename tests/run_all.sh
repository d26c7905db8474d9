#!/bin/sh
# tests/run_all.sh: builds lunar (with the CUDA backend when nvcc is present) and runs every
# test, then builds it again with ASan+UBSan (CPU backend) and runs the C and Lua tests there.
# Usage: sh tests/run_all.sh [--no-asan]
set -eu
cd "$(dirname "$0")/.."
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

echo "== build (release) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$JOBS"
echo "== tests (release) =="
ctest --test-dir build --output-on-failure -j"$JOBS"

if [ "${1:-}" != "--no-asan" ]; then
    echo "== build (asan+ubsan) =="
    cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DLUNAR_SANITIZE=ON -DLUNAR_WITH_CUDA=OFF >/dev/null
    cmake --build build-asan -j"$JOBS"
    echo "== tests (asan+ubsan) =="
    # multi-rank and tmux tests exercise the same code paths; run the C and Lua ones under ASan
    ctest --test-dir build-asan --output-on-failure -j"$JOBS" -R '^(c_|lua_)'
fi
echo "== all tests passed =="
