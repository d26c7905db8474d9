#!/bin/sh
# tests/gpu/fetch_deps.sh: downloads (on a Debian 12 machine with network access) the .deb files
# that a bare CUDA image lacks to build and run lunar: LuaJIT, cJSON, PCRE2 and the OpenMP build
# of OpenBLAS (runtime and -dev packages), and the GCC runtime libraries OpenBLAS needs
# (libgfortran5, libquadmath0, libgomp1) in case that image has none. They land in .gpudeps/ at
# the repository root (ignored by git, about 14 MiB); copy the folder to the GPU machine with the
# checkout, and tests/gpu/run.sh unpacks them into a private prefix with `dpkg -x` when the
# machine lacks the libraries. Nothing is installed here.
#
# Usage: sh tests/gpu/fetch_deps.sh        (needs apt's package lists: apt-get update once)
# MPI and readline are left out on purpose: lunar builds without them (a one-rank world, a REPL
# without editing), which is what the GPU run uses.
set -eu
cd "$(dirname "$0")/../.."
DEST=.gpudeps
PKGS="libluajit-5.1-2 libluajit-5.1-common libluajit-5.1-dev
      libcjson1 libcjson-dev
      libopenblas0-openmp libopenblas-openmp-dev
      libpcre2-8-0 libpcre2-dev
      libgfortran5 libquadmath0 libgomp1"

arch=$(dpkg --print-architecture)
if [ "$arch" != amd64 ]; then
    echo "fetch_deps: this machine is $arch; the GPU machine is amd64 (x86-64)." >&2
    echo "  run it where apt serves amd64 packages" >&2
    exit 1
fi

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
# shellcheck disable=SC2086
if ! (cd "$DEST.tmp" && apt-get download $PKGS); then
    echo "fetch_deps: apt-get download failed; run apt-get update first" >&2
    rm -rf "$DEST.tmp"
    exit 1
fi
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
# what was fetched, for the log of the GPU run
(cd "$DEST" && for f in *.deb; do dpkg-deb --show --showformat='${Package} ${Version}\n' "$f"; done) > "$DEST/MANIFEST"
cat "$DEST/MANIFEST"
du -sh "$DEST"
size_kib=$(du -sk "$DEST" | cut -f1)
if [ "$size_kib" -gt 40960 ]; then
    echo "fetch_deps: $DEST holds ${size_kib} KiB, more than the 40 MiB budget" >&2
    exit 1
fi
echo "fetch_deps: done; the device run carries \"$DEST\" (see tests/gpu/run.sh)"
