#!/usr/bin/env python3
"""Oracle check of a LoRA adapter that lunar saved (lunar.peft.save), and of its merged export
(lunar.peft.save_merged), with an unmodified PEFT. Developer machines only (needs torch,
transformers 5.25.0, peft).

    ./build/lunar tests/ref/oracle_peft.lua CASE OUT            # a fixture model, 5 AdamW steps
    ./build/lunar tests/ref/peft_reference.lua RUN/final OUT    # the lora recipe's output.dir
    python3 tests/ref/check_peft.py OUT [--tol 1e-5]

OUT/adapter                    adapter_config.json + adapter_model.safetensors (PEFT's format);
                               base_model_name_or_path is the base checkpoint
OUT/merged                     the merged HF checkpoint
OUT/lunar_reference.safetensors  inputs and lunar's logits with the adapters (eval mode)

1. Loads the base checkpoint with transformers (fp32, eager attention and experts), puts the
   adapter on it with peft.PeftModel.from_pretrained, then loads the file's tensors once more with
   PEFT's own set_peft_model_state_dict to see where they go: every tensor must land on a LoRA
   parameter and every LoRA parameter must get one (exit 3 otherwise, listing them; tensors of
   the MTP layer, which transformers does not build, are only counted: lunar's save reports
   those). Runs the saved inputs and compares the logits with lunar's: max|diff| / max|logit| <=
   tol (exit 1 otherwise).
2. Reloads OUT/merged strictly (tests/ref/check_export.py: no missing / unexpected keys except the
   MTP layer; exit 2) and compares its logits with lunar's the same way.
"""
import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_export  # noqa: E402


def file_keys(adapter_dir):
    from safetensors import safe_open
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
    for k in keys:
        if not re.match(r"^base_model\.model\.(.+)\.lora_[AB]\.weight$", k):
            raise SystemExit(f"check_peft: unexpected tensor {k} in the adapter")
    return keys


def load_peft(base_dir, adapter_dir):
    """The transformers model with the adapter, as PeftModel.from_pretrained builds it."""
    from peft import PeftModel
    base, _ = check_export.load_model(base_dir)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_facts(pm, adapter_dir):
    """What PEFT made of the adapter: its LoRA layers (module, wrapped parameter or None, r,
    scaling, lora_A and lora_B shapes) and where the file's tensors went (LoRA parameters left
    without a tensor, tensors that found no parameter)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict
    layers = []
    for name, m in pm.base_model.model.named_modules():
        lora_a = getattr(m, "lora_A", None)
        if lora_a is None or "default" not in lora_a:
            continue
        layers.append({
            "module": re.sub(r"(\.base_layer)+$", "", name),
            "parameter": getattr(m, "parameter_name", None),
            "r": int(m.r["default"]),
            "scaling": float(m.scaling["default"]),
            "lora_A": list(lora_a["default"].weight.shape),
            "lora_B": list(m.lora_B["default"].weight.shape),
        })
    layers.sort(key=lambda x: (x["module"], x["parameter"] or ""))
    res = set_peft_model_state_dict(pm, load_peft_weights(adapter_dir, device="cpu"), adapter_name="default")
    missing = sorted(k for k in res.missing_keys if ".lora_" in k)
    return {"layers": layers, "missing_keys": missing, "unexpected_keys": sorted(res.unexpected_keys)}


def mtp_layers(base_dir):
    cfg = json.load(open(os.path.join(base_dir, "config.json")))
    cfg = cfg.get("text_config") or cfg
    L, n = cfg["num_hidden_layers"], int(cfg.get("num_nextn_predict_layers") or 0)
    return lambda key: any(re.search(rf"model\.(language_model\.)?layers\.{i}\.", key) for i in range(L, L + n))


def logits_ratio(model, ref):
    am = ref.get("attention_mask")
    with torch.no_grad():
        out = model(input_ids=ref["input_ids"], position_ids=ref.get("position_ids"), attention_mask=am,
                    labels=ref.get("labels"), use_cache=False)
    got, want = out.logits.float(), ref["logits"].float()
    keep = torch.ones(got.shape[:2], dtype=torch.bool) if am is None else am.bool()
    diff = float((got - want).abs()[keep].max())
    scale = float(want.abs()[keep].max())
    return diff, scale, diff / max(scale, 1e-30), out.loss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    import peft
    import transformers
    from safetensors.torch import load_file
    transformers.logging.set_verbosity_error()
    adapter = os.path.join(a.out, "adapter")
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    base_dir = cfg["base_model_name_or_path"]
    ref = load_file(os.path.join(a.out, "lunar_reference.safetensors"))
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")

    pm = load_peft(base_dir, adapter)
    keys = file_keys(adapter)
    facts = peft_facts(pm, adapter)
    is_mtp = mtp_layers(base_dir)
    dropped = [k for k in facts["unexpected_keys"] if not is_mtp(k)]
    mtp = len(facts["unexpected_keys"]) - len(dropped)
    print(f"adapter: {len(keys)} tensors, r {cfg['r']}, alpha {cfg['lora_alpha']}; PEFT built "
          f"{len(facts['layers'])} LoRA layers, {len(facts['missing_keys'])} LoRA parameters without a tensor, "
          f"{len(dropped)} tensors dropped" + (f" (and {mtp} of the MTP layer)" if mtp else ""))
    diff, scale, ratio, loss = logits_ratio(pm, ref)
    print(f"PEFT logits vs lunar: max abs diff {diff:.3e}, max abs logit {scale:.3e}, ratio {ratio:.3e}")
    if loss is not None and "loss" in ref:
        print(f"  loss PEFT {float(loss):.8f}  lunar {float(ref['loss'][0]):.8f}")
    status = 0
    if dropped or facts["missing_keys"]:
        print(f"FAIL: PEFT dropped {dropped[:4]} ..., left {facts['missing_keys'][:4]} ... without a tensor")
        status = 3
    elif ratio > a.tol:
        print(f"FAIL: PEFT logits ratio {ratio:.3e} > tol {a.tol:.1e}")
        status = 1

    print("merged export:")
    check_export.check(os.path.join(a.out, "merged"), os.path.join(a.out, "lunar_reference.safetensors"), tol=a.tol)
    if status:
        sys.exit(status)
    print("OK")


if __name__ == "__main__":
    main()
