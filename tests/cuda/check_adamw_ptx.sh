#!/bin/sh
# check_adamw_ptx.sh NVCC SOURCE_DIR ARCHS [NVCC_FLAGS...]: compiles kernels/cuda/adamw.cu to PTX
# for each architecture in ARCHS (comma-separated, e.g. 90,100) and fails when the AdamW kernel
# could round differently from the CPU kernel: it must contain no f32 fused multiply-add
# (fma.rn.f32, mad.f32, their ftz/sat/x2 forms), no f32 multiply without a rounding modifier
# (ptxas may fuse such a mul.f32 with the add that follows it; mul.rn.f32 is never fused), and no
# approximate division or square root. The CPU rounds p * decay, the update and every other
# product on its own; a fused multiply-add rounds once, about one ulp apart per step.
set -eu
nvcc=$1
root=$2
archs=$(echo "$3" | tr ',;' '  ')
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
for a in $archs; do
    ptx=$tmp/adamw_sm$a.ptx
    "$nvcc" -ptx -arch="compute_$a" -O3 --expt-relaxed-constexpr -I"$root/host/include" -I"$root/host" \
        -I"$root/kernels" "$@" "$root/kernels/cuda/adamw.cu" -o "$ptx"
    kernels=$(grep -c '^\.visible \.entry .*adamw_kernel' "$ptx" || true)
    if [ "$kernels" -eq 0 ]; then
        echo "sm_$a: no adamw_kernel in the PTX of kernels/cuda/adamw.cu (renamed? update this check)"
        fail=1
        continue
    fi
    # the file holds the AdamW kernels and what they inline, so every line of it is checked
    op='[[:space:]]*(@!?%p[0-9]+[[:space:]]+)?'
    fused=$(grep -nE "^$op((fma|mad)(\.[a-z0-9]+)*\.f32(x2)?|mul(\.ftz)?(\.sat)?\.f32(x2)?)[[:space:]]" "$ptx" || true)
    approx=$(grep -nE "^$op(div|sqrt|rcp|rsqrt)\.(approx|full)(\.ftz)?\.f32[[:space:]]" "$ptx" || true)
    if [ -n "$fused" ] || [ -n "$approx" ]; then
        echo "sm_$a: kernels/cuda/adamw.cu does not round like kernels/cpu/adamw.c:"
        [ -n "$fused" ] && echo "  f32 fused multiply-adds or unrounded multiplies (use hd.h's lunar_hd_mulf, ..., never a * b + c):" &&
            echo "$fused" | head -20 | sed 's/^/    /'
        [ -n "$approx" ] && echo "  approximate division or square root:" && echo "$approx" | head -20 | sed 's/^/    /'
        fail=1
    else
        echo "sm_$a: $kernels adamw kernels, no f32 fused multiply-add, unrounded multiply or approximate division"
    fi
done
exit $fail
