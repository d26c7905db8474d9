#!/usr/bin/env python3
"""Builds tests/fixtures/generate/hf_greedy.json: transformers' own greedy generation (KV-cached
`generate`) on fixture checkpoints, the reference for lunar's cached decoding
(tests/lua/test_generate_hf.lua).

Developer machine only (CI reads the committed file). Needs torch and the pinned transformers
(tests/fixtures/models/README.md says how to install it):

    python3 tests/ref/make_generate_refs.py            # writes the fixture
    python3 tests/ref/make_generate_refs.py --check    # regenerates and compares with the file

For each case: the checkpoint under tests/fixtures/models/<case> loaded with from_pretrained in
fp32, eager attention, eager experts, no hub kernels, one CPU thread; each prompt (token ids from
a seeded generator, every one longer than the GLM-5 cases' index_topk, so DSA drops keys at
every step) runs alone (batch 1, no padding) through `generate(do_sample=False,
use_cache=True, max_new_tokens=N)`. The script also checks, per prompt:
  - the same `generate` with use_cache=False gives the same ids (transformers' cache agrees with
    its full forward);
  - every generated token is the argmax of a full forward of the sequence before it, with a
    top-1 margin of at least MARGIN relative to the largest |logit| (so float rounding cannot
    flip a token); the smallest margin is recorded.
"""
import argparse
import json
import os
import sys

import torch

PINNED_TRANSFORMERS = "5.25.0"

import transformers  # noqa: E402

if transformers.__version__ != PINNED_TRANSFORMERS:
    sys.exit(f"make_generate_refs.py: transformers {PINNED_TRANSFORMERS} is required, found {transformers.__version__}")

from transformers import AutoModelForCausalLM, Glm5NextForConditionalGeneration  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(REPO, "tests", "fixtures", "models")
OUT = os.path.join(REPO, "tests", "fixtures", "generate", "hf_greedy.json")

MARGIN = 1e-4
MAX_NEW = 32
# case -> prompt lengths (GLM-5 cases: all longer than index_topk)
CASES = {
    "glm5_dsa": [6, 11, 19],        # index_topk 4
    "glm5_bf16": [50, 57, 66],      # index_topk 48; the trained model (clear top-1 margins)
    "glm4moe": [5, 12, 20],
    "flash_a": [14, 21, 30],        # GLM-5.3-Flash: index_topk 8, index_kpool 4 with the tail
    "flash_b": [9, 16, 25],         # index_topk 6, index_kpool 2, no tail
}
SEED = 2024

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


def load(case):
    path = os.path.join(MODELS, case)
    with open(os.path.join(path, "config.json")) as f:
        flash = json.load(f).get("model_type") == "glm5_next"
    # GLM-5.3-Flash: transformers' only class with an LM head is the vision-language one
    cls = Glm5NextForConditionalGeneration if flash else AutoModelForCausalLM
    model = cls.from_pretrained(
        os.path.join(MODELS, case), attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32, use_kernels=False)
    model.eval()
    return model


def prompts_for(case, vocab):
    gen = torch.Generator().manual_seed(SEED + sum(map(ord, case)))
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in CASES[case]]


def generate(model, prompt, use_cache):
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=use_cache,
                         max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def full_forward_margin(model, prompt, new):
    """Checks that each new token is the argmax of the full forward; returns the smallest top-1
    margin relative to max |logit| over the generated steps."""
    seq = torch.tensor([prompt + new[:-1]], dtype=torch.long)
    logits = model(seq, use_cache=False).logits[0]
    worst = float("inf")
    for s, tok in enumerate(new):
        row = logits[len(prompt) - 1 + s]
        top2 = row.topk(2)
        if top2.indices[0].item() != tok:
            raise SystemExit(f"generated token {s} ({tok}) is not the full forward's argmax ({top2.indices[0].item()})")
        worst = min(worst, ((top2.values[0] - top2.values[1]) / row.abs().max()).item())
    return worst


def build():
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "max_new_tokens": MAX_NEW,
              "seed": SEED, "margin_required": MARGIN, "cases": {}}
    for case in CASES:
        model = load(case)
        cfg = model.config
        prompts = prompts_for(case, getattr(cfg, "text_config", cfg).vocab_size)
        rows = []
        for p in prompts:
            with torch.no_grad():
                new = generate(model, p, True)
                if generate(model, p, False) != new:
                    raise SystemExit(f"{case}: generate with and without the cache disagree")
                margin = full_forward_margin(model, p, new)
            if margin < MARGIN:
                raise SystemExit(f"{case}: top-1 margin {margin:.3g} below {MARGIN} (choose another seed)")
            rows.append({"prompt": p, "generated": new, "min_margin": round(margin, 6)})
            print(f"{case}: prompt {len(p)} tokens -> {new[:8]}... min top-1 margin {margin:.3g}")
        text = getattr(cfg, "text_config", cfg)
        entry = {"index_topk": getattr(text, "index_topk", None), "prompts": rows}
        result["cases"][case] = entry
    return result


def to_text(result):
    """JSON with one line per prompt (its ids inline), so a diff of the file reads by prompt."""
    cases = result.pop("cases")
    head = json.dumps(result, indent=1)[:-2]
    parts = []
    for case, entry in cases.items():
        rows = ",\n".join("    " + json.dumps(r) for r in entry["prompts"])
        parts.append(f'  "{case}": {{"index_topk": {json.dumps(entry["index_topk"])}, "prompts": [\n{rows}\n  ]}}')
    text = head + ',\n "cases": {\n' + ",\n".join(parts) + "\n }\n}\n"
    json.loads(text)
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = ap.parse_args()
    result = build()
    text = to_text(result)
    if args.check:
        if open(OUT).read() != text:
            sys.exit(f"{OUT} differs from a fresh run")
        print("OK: the fixture is reproduced")
        return
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
