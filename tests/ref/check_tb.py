#!/usr/bin/env python3
"""Oracle check: TensorBoard's own event reader reads lunar's event files.

    pip install tensorboard
    python3 tests/ref/check_tb.py [--lunar build-cpu/lunar]

1. The golden file tests/fixtures/tb/events.out.tfevents.1700000000.golden (which lunar reproduces
   byte for byte, tests/lua/test_train_metrics.lua) is read with
   tensorboard.backend.event_processing.event_accumulator: tag train/loss, steps 1-3, values 2.5,
   2.25, 2.0, wall times 1700000001-3.
2. lunar logs a 20-step run with lunar.train.metrics (a NaN loss at step 7, an extra scalar, MFU
   from a FLOP count); the accumulator must find every expected tag, each with steps 1..20, and
   values equal to the float32 rounding of the numbers in metrics.jsonl (NaN where the JSONL has
   null for a non-finite loss or grad norm).
3. A run interrupted after step 6 and resumed from step 4 (two event files): the accumulator shows
   steps 1-8 once each, the resumed run's values from step 5 (its SessionLog START purges the rest).

Exit 0 when everything matches, 1 otherwise. Needs only tensorboard (and its numpy/protobuf).
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

from tensorboard.backend.event_processing import event_accumulator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GOLDEN = os.path.join(ROOT, "tests", "fixtures", "tb", "events.out.tfevents.1700000000.golden")

LUA = r"""
local metrics = require 'lunar.train.metrics'
local m = metrics.new{dir = arg_dir, total_steps = 20, warmup_steps = 2, flops_per_token = 6e6,
                      peak_flops = 1e12, progress = false}
for s = 1, 20 do
    local loss = 3 / s + 0.1
    if s == 7 then loss = 0 / 0 end
    m:log(s, {loss = loss, grad_norm = 1 / (s + 2), lr = 1e-3 * math.min(1, s / 5), tokens = 512 + s,
              skipped = s == 7, extra = {aux_loss = 0.01 * s}})
end
m:close()
"""

# 3. an interrupted run (steps 1-6) resumed from its step-4 checkpoint (steps 5-8, new values)
LUA_RESUME = r"""
local metrics = require 'lunar.train.metrics'
local m = metrics.new{dir = arg_dir, progress = false, tb_filename = 'events.out.tfevents.1700000000.host.1.0'}
for s = 1, 6 do m:log(s, {loss = s}) end
m:close()
m = metrics.new{dir = arg_dir, progress = false, start_step = 4, tb_filename = 'events.out.tfevents.1700000100.host.2.0'}
for s = 5, 8 do m:log(s, {loss = 100 + s}) end
m:close()
"""

TAGS = {
    "train/loss": "loss", "train/grad_norm": "grad_norm", "train/lr": "lr", "perf/tokens_per_s": "tokens_per_s",
    "perf/step_time_s": "step_time_s", "perf/tflops_per_device": "tflops", "perf/mfu": "mfu",
    "mem/peak_gib": "peak_mem_bytes", "train/skipped_steps": "skipped_steps", "train/nan_steps": "nan_steps",
    "train/aux_loss": "aux_loss",
}


def f32(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


def load(path):
    acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lunar", default=os.path.join(ROOT, "build-cpu", "lunar"))
    ap.add_argument("--keep", help="write the run here instead of a temporary directory")
    a = ap.parse_args()
    bad = []

    # 1. the golden file
    acc = load(GOLDEN)
    tags = acc.Tags()["scalars"]
    ev = acc.Scalars("train/loss") if "train/loss" in tags else []
    got = [(e.step, e.value, e.wall_time) for e in ev]
    want = [(1, 2.5, 1700000001.0), (2, 2.25, 1700000002.0), (3, 2.0, 1700000003.0)]
    print(f"golden: tags {tags}, events {got}")
    if tags != ["train/loss"] or got != want:
        bad.append(f"golden: expected {want}")

    # 2. a run logged by lunar
    with tempfile.TemporaryDirectory() as tmp:
        run = a.keep or os.path.join(tmp, "run")
        script = os.path.join(tmp, "run.lua")
        with open(script, "w") as f:
            f.write(f"local arg_dir = {json.dumps(run)}\n" + LUA)
        subprocess.run([a.lunar, script], check=True, env=dict(os.environ, LUNAR_LUA_PATH=os.path.join(ROOT, "lua")))
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        acc = load(os.path.join(run, "tb"))
        tags = sorted(acc.Tags()["scalars"])
        print(f"run: {len(rows)} JSONL rows, tags {tags}")
        if tags != sorted(TAGS):
            bad.append(f"run: tags {tags}, expected {sorted(TAGS)}")
        checked = 0
        for tag, key in TAGS.items():
            if tag not in tags:
                continue
            events = acc.Scalars(tag)
            steps = [e.step for e in events]
            if steps != list(range(1, 21)):
                bad.append(f"{tag}: steps {steps}")
                continue
            for e, r in zip(events, rows):
                v = r.get(key)
                if v is None:
                    ok = math.isnan(e.value)
                else:
                    if key == "peak_mem_bytes":
                        v = v / 2**30
                    ok = e.value == f32(float(v))
                if not ok:
                    bad.append(f"{tag} step {e.step}: TensorBoard read {e.value!r}, JSONL has {r.get(key)!r}")
                checked += 1
        print(f"run: {checked} values compared")

    # 3. a resumed run: TensorBoard shows each step once, the resumed run's value after step 4
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "resumed")
        script = os.path.join(tmp, "resume.lua")
        with open(script, "w") as f:
            f.write(f"local arg_dir = {json.dumps(run)}\n" + LUA_RESUME)
        subprocess.run([a.lunar, script], check=True, env=dict(os.environ, LUNAR_LUA_PATH=os.path.join(ROOT, "lua")))
        acc = load(os.path.join(run, "tb"))
        got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
        want = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]
        print(f"resumed: {got}")
        if got != want:
            bad.append(f"resumed: TensorBoard read {got}, expected {want}")
    for b in bad:
        print("MISMATCH:", b)
    print("check_tb: " + ("FAILED" if bad else "OK: TensorBoard reads lunar's event files (tags, steps, values)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
