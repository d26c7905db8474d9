#!/usr/bin/env python3
"""bench_generate_vs_hf.py: prefill and decode tokens/s of lunar.generate vs transformers'
generate on the same GLM-5-shaped model, CPU, fp32, greedy, same thread count, one run.

    python3 tests/bench/bench_generate_vs_hf.py [--lunar build/lunar] [--threads 2] [--batch 16]
        [--prompt 128] [--new 128] [--family glm5|flash]

--family flash: the GLM-5.3-Flash-shaped Glm5NextForConditionalGeneration of bench_glm5_vs_hf.py
(KDA x3 + k-pool DSA, twice; mHC over 4 streams). Its cache is reported per sequence after the
prompt (the KDA states and conv inputs, a fixed size) and per token (the DSA layers' latents and
indexer rows), for lunar from the cache plan, for transformers from its DynamicCache's tensors.

Developer-machine benchmark (needs torch and transformers==5.25.0; CI never runs it). It builds
the random GlmMoeDsaForCausalLM of bench_glm5_vs_hf.py (hidden 512, 8 layers, 16 routed experts
top-4, DSA with index_topk 256), saves it, then in one process per implementation runs the same
batch of prompts (all of --prompt tokens, so transformers needs no padding) twice: with 1 new
token (the prefill) and with --new tokens. Decode tokens/s = batch * (new - 1) / (t_new - t_1).
It also prints the cache bytes per token of each: lunar's cache:bytes_per_token() and
transformers' DynamicCache (keys, values and the DSA indexer's keys) after the prefill divided by
the tokens it holds.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from bench_glm5_vs_hf import CONFIG, FLASH_TEXT, FLASH_VISION  # noqa: E402

HF_RUNNER = r'''
import json, sys, time, torch
import transformers
d, cls, batch, plen, new, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
torch.set_num_threads(threads)
m = getattr(transformers, cls).from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager", use_kernels=False).eval()
g = torch.Generator().manual_seed(7)
ids = torch.randint(0, m.config.get_text_config().vocab_size, (batch, plen), generator=g)
def run(n):
    t0 = time.time()
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=0)
    return time.time() - t0, out
run(2)   # warm-up
t1, out1 = run(1)
tn, _ = run(new)
cache = out1.past_key_values
nbytes, state = 0, 0
for layer in cache.layers:
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "indexer_keys", None)):
        if t is not None: nbytes += t.numel() * t.element_size()
    # (GLM-5.3-Flash's KDA layers: recurrent and conv states, whatever the length)
    for name in ("recurrent_states", "conv_states"):
        for t in (getattr(layer, name, None) or {}).values():
            if torch.is_tensor(t): state += t.numel() * t.element_size()
tokens = batch * plen   # generating 1 token caches the prompt only
print(json.dumps({"impl": "transformers", "prefill_tokens_per_s": batch * plen / t1,
                  "decode_tokens_per_s": batch * (new - 1) / (tn - t1), "t1": t1, "tn": tn,
                  "cache_bytes_per_token": nbytes / tokens, "state_bytes_per_sequence": state / batch}))
'''

LUNAR_RUNNER = r'''
local lunar = require 'lunar'
local d, batch, plen, new = arg[1], tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4])
local model = lunar.model.load(d)
local V = model.cfg.vocab_size
local rng = lunar.rng(7)
local prompts = {}
for b = 1, batch do
    prompts[b] = lunar.randint(0, V, {plen}, 'i64', {rng = rng}):tolist_flat()
end
local function run(n)
    local t0 = lunar.clock()
    local out = lunar.generate(model, prompts, {max_new_tokens = n, stop_token_ids = {}, max_batch = batch})
    return lunar.clock() - t0, out
end
run(2)
local t1 = run(1)
local tn = run(new)
local Cache = require 'lunar.generate.cache'
local plan = Cache.plan(model, {budget_bytes = 2^40, max_seq_len = plen + new, max_sequences = batch})
print((lunar.io.encode_json({impl = 'lunar', prefill_tokens_per_s = batch * plen / t1,
    decode_tokens_per_s = batch * (new - 1) / (tn - t1), t1 = t1, tn = tn,
    cache_bytes_per_token = plan.bytes_per_token, state_bytes_per_sequence = plan.bytes_per_sequence}):gsub('\n%s*', ' ')))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lunar", default="build/lunar")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--family", choices=["glm5", "flash"], default="glm5")
    a = ap.parse_args()
    import torch
    import transformers
    torch.manual_seed(0)
    if a.family == "flash":
        from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
        cls, conf = "Glm5NextForConditionalGeneration", FLASH_TEXT
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=FLASH_TEXT, vision_config=FLASH_VISION))
    else:
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        cls, conf = "GlmMoeDsaForCausalLM", CONFIG
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**CONFIG))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        del model
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), LUNAR_THREADS=str(a.threads))
        args = [str(a.batch), str(a.prompt), str(a.new)]
        hf = subprocess.run([sys.executable, "-c", HF_RUNNER, d, cls] + args + [str(a.threads)], env=env,
                            capture_output=True, text=True)
        if hf.returncode != 0:
            sys.exit("transformers run failed:\n" + hf.stderr)
        script = os.path.join(d, "run.lua")
        with open(script, "w") as f:
            f.write(LUNAR_RUNNER)
        lu = subprocess.run([a.lunar, script, d] + args, env=env, capture_output=True, text=True)
        if lu.returncode != 0:
            sys.exit("lunar run failed:\n" + lu.stderr)
    r_hf = json.loads(hf.stdout.strip().splitlines()[-1])
    r_lu = json.loads(lu.stdout.strip().splitlines()[-1])
    print(f"config: {cls}, hidden {conf['hidden_size']}, {conf['num_hidden_layers']} layers, "
          f"{conf['n_routed_experts']} experts top-{conf['num_experts_per_tok']}, batch {a.batch}, "
          f"prompt {a.prompt}, {a.new} new tokens, greedy, {a.threads} threads, fp32, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")
    for r in (r_hf, r_lu):
        print(f"  {r['impl']:13s} prefill {r['prefill_tokens_per_s']:9.1f} tokens/s  decode "
              f"{r['decode_tokens_per_s']:8.1f} tokens/s  cache {r['cache_bytes_per_token']:8.0f} bytes/token")
    if a.family == "flash":
        for r in (r_hf, r_lu):
            print(f"  {r['impl']:13s} KDA state {r['state_bytes_per_sequence']:10.0f} bytes/sequence")
        print(f"ratio: KDA state bytes per sequence {r_lu['state_bytes_per_sequence'] / r_hf['state_bytes_per_sequence']:.2f}x")
    print(f"ratio: decode {r_lu['decode_tokens_per_s'] / r_hf['decode_tokens_per_s']:.2f}x (floor 4x), prefill "
          f"{r_lu['prefill_tokens_per_s'] / r_hf['prefill_tokens_per_s']:.2f}x, cache bytes per token "
          f"{r_lu['cache_bytes_per_token'] / r_hf['cache_bytes_per_token']:.2f}x")


if __name__ == "__main__":
    main()
