#!/usr/bin/env python3
"""Oracle check of a LoRA adapter that lunar trained and saved (lunar.peft.save), and of its merged
export (lunar.peft.save_merged). Developer machines only (needs torch, transformers 5.25.0, peft).

    ./build-cpu/lunar tests/ref/oracle_peft.lua CASE OUT [peft|all]
    python3 tests/ref/check_peft.py OUT [--tol 1e-5]

OUT/adapter                    adapter_config.json + adapter_model.safetensors (PEFT's format);
                               base_model_name_or_path is the fixture checkpoint it was trained on
OUT/merged                     the merged HF checkpoint
OUT/lunar_reference.safetensors  inputs and lunar's logits with the adapters (eval mode)

1. Loads the base checkpoint with transformers (fp32, eager attention and experts), puts the
   adapter on it with peft.PeftModel.from_pretrained, checks that PEFT adapted every module the
   file holds adapters for (exit 3 otherwise, listing the ones it dropped), runs the saved inputs
   and compares the logits with lunar's: max|diff| / max|logit| <= tol (exit 1 otherwise).
   --emulate-peft-3715: PEFT 0.21.2 retargets every gate/up/down_proj target to transformers 5's
   fused expert parameters, so adapters on dense MLPs and shared experts are dropped
   (huggingface/peft#3711). With this flag the config conversion is wrapped to keep dotted
   targets that name existing modules as module targets, which is what the proposed fix
   (huggingface/peft#3715) does; the adapter weights themselves go through PEFT unchanged.
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


def expected_modules(adapter_dir):
    from safetensors import safe_open
    mods = set()
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), "pt") as f:
        for k in f.keys():
            m = re.match(r"^base_model\.model\.(.+)\.lora_[AB]\.weight$", k)
            if not m:
                raise SystemExit(f"check_peft: unexpected tensor {k} in the adapter")
            mods.add(m.group(1))
    return mods


def adapted_modules(pm, wanted):
    """The modules of `wanted` (lunar's per-expert names) that PEFT adapted on the HF model."""
    names = dict(pm.base_model.model.named_modules())
    done = set()
    for mod in wanted:
        m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$", mod)
        if m:
            # transformers 5 fuses the experts: PEFT wraps experts.gate_up_proj / experts.down_proj
            # (ParamWrapper, nested: the outer one is registered at `experts`)
            prefix = m.group(1)
            found = False
            for n, x in names.items():
                if n.startswith(prefix) and hasattr(x, "lora_A") and "default" in getattr(x, "lora_A", {}):
                    pn = getattr(x, "parameter_name", "")
                    want = "down_proj" if m.group(3) == "down_proj" else "gate_up_proj"
                    if pn == want:
                        found = True
            if found:
                done.add(mod)
        else:
            x = names.get(mod)
            if x is not None and hasattr(x, "lora_A") and "default" in x.lora_A:
                done.add(mod)
    return done


def emulate_peft_3715():
    import peft.tuners.tuners_utils  # noqa: F401 (imports the conversion lazily)
    from peft.utils import transformers_weight_conversion as twc
    orig = twc._convert_peft_config_moe

    def patched(peft_config, model):
        modules = {n for n, _ in model.named_modules()}
        tm = peft_config.target_modules
        keep = set()
        if isinstance(tm, (list, set)):
            keep = {t for t in tm if "." in t and t in modules and ".experts." not in t}
            peft_config.target_modules = set(tm) - keep
        orig(peft_config, model)
        if keep:
            peft_config.target_modules = set(peft_config.target_modules or set()) | keep
    twc._convert_peft_config_moe = patched


def logits_ratio(model, ref):
    am = ref.get("attention_mask")
    with torch.no_grad():
        out = model(input_ids=ref["input_ids"], position_ids=ref["position_ids"], attention_mask=am,
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
    ap.add_argument("--emulate-peft-3715", action="store_true")
    a = ap.parse_args()
    if a.emulate_peft_3715:
        emulate_peft_3715()
    import peft
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file
    transformers.logging.set_verbosity_error()
    adapter = os.path.join(a.out, "adapter")
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    base_dir = cfg["base_model_name_or_path"]
    ref = load_file(os.path.join(a.out, "lunar_reference.safetensors"))
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")

    base, _ = check_export.load_model(base_dir)
    pm = PeftModel.from_pretrained(base, adapter).eval()
    wanted = expected_modules(adapter)
    done = adapted_modules(pm, wanted)
    dropped = sorted(wanted - done)
    print(f"adapter: {len(wanted)} modules in the file, r {cfg['r']}, alpha {cfg['lora_alpha']}; "
          f"PEFT adapted {len(done)}")
    diff, scale, ratio, loss = logits_ratio(pm, ref)
    print(f"PEFT logits vs lunar: max abs diff {diff:.3e}, max abs logit {scale:.3e}, ratio {ratio:.3e}")
    if loss is not None and "loss" in ref:
        print(f"  loss PEFT {float(loss):.8f}  lunar {float(ref['loss'][0]):.8f}")
    status = 0
    if dropped:
        print(f"PEFT did not adapt {len(dropped)} module(s), e.g. {dropped[:4]}")
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
