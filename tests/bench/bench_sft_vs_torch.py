#!/usr/bin/env python3
"""bench_sft_vs_torch.py: one SFT step (forward, backward, AdamW) of the tiny preset's model, lunar
vs a PyTorch loop (transformers GlmMoeDsaForCausalLM eager + torch.optim.AdamW), CPU, f32, same
threads, same batch shape, measured in one run, each in its own process (peak RSS is its own).

    python3 tests/bench/bench_sft_vs_torch.py [--lunar build/lunar] [--threads 2] [--batch 4] [--seq 512]

Developer-machine benchmark (needs torch and transformers==5.25.0; CI never runs it).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

TORCH_RUNNER = r'''
import json, resource, sys, time, torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
cfg_path, B, T, steps, warmup, threads = sys.argv[1], *map(int, sys.argv[2:7])
torch.set_num_threads(threads)
torch.manual_seed(1)
cfg = GlmMoeDsaConfig(**json.load(open(cfg_path)))
m = GlmMoeDsaForCausalLM._from_config(cfg, attn_implementation="eager", experts_implementation="eager")
m.train()
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
g = torch.Generator().manual_seed(7)
ids = torch.randint(0, cfg.vocab_size - 64, (B, T), generator=g)
pos = torch.arange(T).unsqueeze(0).expand(B, T)
times = []
for s in range(warmup + steps):
    t0 = time.time()
    out = m(input_ids=ids, labels=ids, position_ids=pos, use_cache=False)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if s >= warmup: times.append(time.time() - t0)
per = sum(times) / len(times)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"impl": "pytorch", "batch": B, "seq": T, "threads": threads, "sec_per_step": per,
                  "tokens_per_s": B * T / per, "peak_rss_mib": rss}))
'''

CONFIG_DUMP = r'''
local common = dofile('recipes/common.lua')
local c = common.recipe('sft', {}).model.config
require('lunar.io').write_json(arg[1], c)
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lunar", default="build/lunar")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    import torch
    import transformers
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), LUNAR_THREADS=str(a.threads))
    with tempfile.TemporaryDirectory() as d:
        cfg_path = os.path.join(d, "config.json")
        lua = os.path.join(d, "dump.lua")
        open(lua, "w").write(CONFIG_DUMP)
        subprocess.run([a.lunar, lua, cfg_path], check=True, env=env)
        args = [str(a.batch), str(a.seq), str(a.steps), str(a.warmup), str(a.threads)]
        pt = subprocess.run([sys.executable, "-c", TORCH_RUNNER, cfg_path] + args, env=env, capture_output=True,
                            text=True)
        if pt.returncode != 0:
            sys.exit("pytorch run failed:\n" + pt.stderr)
        lu = subprocess.run([a.lunar, "tests/bench/bench_sft_step.lua", f"batch={a.batch}", f"seq={a.seq}",
                             f"steps={a.steps}", f"warmup={a.warmup}"], env=env, capture_output=True, text=True)
        if lu.returncode != 0:
            sys.exit("lunar run failed:\n" + lu.stderr)
    r_pt = json.loads(pt.stdout.strip().splitlines()[-1])
    r_lu = json.loads(lu.stdout.strip().splitlines()[-1])
    print(f"tiny preset SFT step, batch {a.batch} x seq {a.seq}, {a.threads} threads, f32; "
          f"transformers {transformers.__version__} eager + torch.optim.AdamW, torch {torch.__version__}")
    for r in (r_pt, r_lu):
        print(f"  {r['impl']:8s} {r['tokens_per_s']:9.1f} tokens/s  {r['sec_per_step']:7.3f} s/step  "
              f"peak RSS {r['peak_rss_mib']:8.1f} MiB")
    print(f"ratio: lunar {r_lu['tokens_per_s'] / r_pt['tokens_per_s']:.2f}x the tokens/s of the PyTorch loop "
          f"(floor 1.5x); peak memory {r_lu['peak_rss_mib'] / r_pt['peak_rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
