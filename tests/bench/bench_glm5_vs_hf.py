#!/usr/bin/env python3
"""bench_glm5_vs_hf.py: forward+backward tokens/s and peak memory of lunar vs transformers on the
same small GLM-5 config, CPU, fp32, same thread count, measured in one run.

    python3 tests/bench/bench_glm5_vs_hf.py [--lunar build/lunar] [--threads 2] [--seq 1024]
    python3 tests/bench/bench_glm5_vs_hf.py --family flash     # GLM-5.3-Flash-shaped (glm5_next)

--family flash: Glm5NextForConditionalGeneration of the same width with 8 layers (KDA, KDA, KDA,
k-pool DSA, twice), mHC over 4 streams, the same MoE with the SwiGLU clamp; lunar trains its
text tower, transformers the same (its vision tower is never run).

Developer-machine benchmark (needs torch and transformers==5.25.0; CI never runs it). It builds a
random GlmMoeDsaForCausalLM (hidden 512, 8 layers, 16 routed experts top-4, 1 shared, DSA on
with index_topk 256 < seq), saves it with save_pretrained, then runs each implementation in its
own process (so peak RSS is each one's own) for warm-up + timed steps of forward + backward on
the same random tokens, and prints both and the ratios.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIG = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
    n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5, n_group=1, topk_group=1,
    kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
    index_topk=256, index_head_dim=64, index_n_heads=8, mlp_layer_types=["dense"] + ["sparse"] * 7,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

FLASH_TEXT = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
    n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5, n_group=1, topk_group=1,
    kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=0, qk_nope_head_dim=64, v_head_dim=64,
    index_topk=256, index_head_dim=64, index_n_heads=8, index_kpool=4,
    layer_types=["linear_attention"] * 3 + ["indexed_attention"] + ["linear_attention"] * 3 + ["indexed_attention"],
    mlp_layer_types=["dense"] + ["sparse"] * 7, linear_num_heads=8, linear_head_dim=64, linear_conv_kernel_dim=4,
    hc_mult=4, swiglu_limit=10.0, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
    pad_token_id=0, bos_token_id=1, eos_token_id=0,
)
FLASH_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=512,
                    projection_intermediate_size=16, patch_size=2, image_size=4, spatial_merge_size=1)

HF_RUNNER = r'''
import json, resource, sys, time, torch
import transformers
d, cls, seq, batch, steps, warmup, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
torch.set_num_threads(threads)
m = getattr(transformers, cls).from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager", use_kernels=False)
m.train()
g = torch.Generator().manual_seed(7)
ids = torch.randint(0, m.config.get_text_config().vocab_size, (batch, seq), generator=g)
pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
times = []
for s in range(warmup + steps):
    t0 = time.time()
    out = m(input_ids=ids, labels=ids, position_ids=pos, use_cache=False)
    out.loss.backward()
    m.zero_grad(set_to_none=True)
    dt = time.time() - t0
    if s >= warmup: times.append(dt)
per = sum(times) / len(times)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"impl": "transformers", "seq": seq, "batch": batch, "threads": threads,
                  "sec_per_step": per, "tokens_per_s": seq * batch / per, "peak_rss_mib": rss}))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lunar", default="build/lunar")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
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
        args = [str(a.seq), str(a.batch), str(a.steps), str(a.warmup), str(a.threads)]
        hf = subprocess.run([sys.executable, "-c", HF_RUNNER, d, cls] + args, env=env, capture_output=True, text=True)
        if hf.returncode != 0:
            sys.exit("transformers run failed:\n" + hf.stderr)
        lu = subprocess.run([a.lunar, "tests/bench/bench_model.lua", d, f"seq={a.seq}", f"batch={a.batch}",
                             f"steps={a.steps}", f"warmup={a.warmup}"], env=env, capture_output=True, text=True)
        if lu.returncode != 0:
            sys.exit("lunar run failed:\n" + lu.stderr)
    r_hf = json.loads(hf.stdout.strip().splitlines()[-1])
    r_lu = json.loads(lu.stdout.strip().splitlines()[-1])
    print(f"config ({cls}): hidden {conf['hidden_size']}, {conf['num_hidden_layers']} layers, "
          f"{conf['n_routed_experts']} experts top-{conf['num_experts_per_tok']}, seq {a.seq}, batch {a.batch}, "
          f"{a.threads} threads, fp32, transformers {transformers.__version__} eager, torch {torch.__version__}")
    for r in (r_hf, r_lu):
        print(f"  {r['impl']:13s} {r['tokens_per_s']:9.1f} tokens/s  {r['sec_per_step']:7.3f} s/step  "
              f"peak RSS {r['peak_rss_mib']:8.1f} MiB")
    print(f"ratio: lunar {r_lu['tokens_per_s'] / r_hf['tokens_per_s']:.2f}x the tokens/s of transformers "
          f"(floor {3.0 if a.family == 'flash' else 1.5}x); peak memory {r_lu['peak_rss_mib'] / r_hf['peak_rss_mib']:.2f}x (floor <= 1.0)")


if __name__ == "__main__":
    main()
