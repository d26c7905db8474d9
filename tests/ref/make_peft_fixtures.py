#!/usr/bin/env python3
"""Record what an unmodified PEFT builds from the adapters lunar writes, for the test that runs
without Python (tests/lua/test_peft_files.lua). Developer machines only (torch, transformers
5.25.0, peft).

    ./build/lunar tests/ref/peft_cases.lua /tmp/peft_cases
    python3 tests/ref/make_peft_fixtures.py /tmp/peft_cases [--out tests/fixtures/peft/cases.json]

For every case directory (case.json, adapter/, lunar_reference.safetensors) it loads the fixture
model with transformers, puts the adapter on it with peft.PeftModel.from_pretrained and records:

  model, options, gaps       the case as lunar ran it, and what lunar's save said PEFT cannot apply
  adapter_config             the adapter_config.json lunar wrote (base_model_name_or_path left out)
  file_keys                  the tensors in adapter_model.safetensors
  peft.layers                every LoRA layer PEFT built: module, the parameter it wraps (target
                             parameters and fused experts) or null, r, scaling, lora_A / lora_B shapes
  peft.missing_keys          LoRA parameters that got no tensor from the file
  peft.unexpected_keys       tensors of the file that found no LoRA parameter (PEFT drops them
                             without a message)
  logits_ratio               max|PEFT logits - lunar logits| / max|lunar logits| on the fixture's
                             reference inputs

plus the versions of peft, transformers and torch. It fails (exit 1) when a case without gaps
does not load completely or its logits ratio exceeds --tol.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_peft  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "fixtures", "peft", "cases.json"))
    ap.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    result = {"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
              "cases": {}}
    bad = 0
    for name in sorted(os.listdir(a.cases)):
        cdir = os.path.join(a.cases, name)
        if not os.path.isfile(os.path.join(cdir, "case.json")):
            continue
        case = json.load(open(os.path.join(cdir, "case.json")))
        adapter = os.path.join(cdir, "adapter")
        cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
        base_dir = os.path.join(here, "..", "fixtures", "models", case["model"])
        pm = check_peft.load_peft(base_dir, adapter)
        facts = check_peft.peft_facts(pm, adapter)
        ref = load_file(os.path.join(cdir, "lunar_reference.safetensors"))
        _, _, ratio, _ = check_peft.logits_ratio(pm, ref)
        cfg.pop("base_model_name_or_path", None)
        result["cases"][name] = {
            "model": case["model"], "options": case["options"], "gaps": case["gaps"],
            "adapter_config": cfg, "file_keys": check_peft.file_keys(adapter), "peft": facts,
            "logits_ratio": ratio,
        }
        complete = not facts["missing_keys"] and not facts["unexpected_keys"]
        print(f"{name}: {len(facts['layers'])} LoRA layers, {len(facts['missing_keys'])} without a tensor, "
              f"{len(facts['unexpected_keys'])} tensors dropped, logits ratio {ratio:.3e}, "
              f"lunar's gaps: {case['gaps'] or 'none'}")
        if not case["gaps"] and (not complete or ratio > a.tol):
            print(f"FAIL: {name} has no gaps by lunar's account but PEFT does not reproduce it")
            bad += 1
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"written {a.out}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
