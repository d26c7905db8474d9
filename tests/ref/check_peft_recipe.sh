#!/usr/bin/env bash
# check_peft_recipe.sh: run the lora recipe and check its output with an unmodified PEFT.
# Developer machines only (needs torch, transformers 5.25.0, peft).
#
#   tests/ref/check_peft_recipe.sh [LUNAR] [WORKDIR] [recipe overrides ...]
#   tests/ref/check_peft_recipe.sh ./build/lunar /tmp/lora_peft train.steps=20
#
# 1. LUNAR recipes/lora.lua (the tiny preset unless an override says otherwise), its output in
#    WORKDIR/run/final (adapters, and the seeded base in final/base);
# 2. tests/ref/peft_reference.lua: lunar's logits with those adapters, the merged export;
# 3. tests/ref/check_peft.py: PEFT must load every tensor and give the same logits (1e-5 of the
#    largest logit), and the merged export too.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
lunar=${1:-$root/build/lunar}
work=${2:-/tmp/lunar_peft_recipe}
shift $(( $# < 2 ? $# : 2 ))
rm -rf "$work"
mkdir -p "$work"
cd "$root"
"$lunar" recipes/lora.lua output.dir="$work/run/final" checkpoint.dir="$work/run/checkpoints" "$@"
"$lunar" tests/ref/peft_reference.lua "$work/run/final" "$work/check"
python3 tests/ref/check_peft.py "$work/check"
