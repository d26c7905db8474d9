#!/usr/bin/env python3
"""Oracle check of a checkpoint that lunar exported (model:save_hf(dir)).

    python3 tests/ref/check_export.py DIR REF [--tol 1e-5]

DIR  a checkpoint directory (config.json + model.safetensors or a sharded index) written by lunar.
REF  a safetensors file lunar writes next to the export, holding the inputs it ran and the logits it
     computed: input_ids (i64 [B, S]), position_ids (i64 [B, S]), optional attention_mask
     (i64 [B, S]), optional labels (i64 [B, S]) and loss ([1]), and logits (f32/bf16 [B, S, V]).
     The fixtures' own reference.safetensors has exactly this form.

Loads DIR with transformers' from_pretrained in fp32, eager attention, eager experts, and fails
(exit 2) if any key is missing, unexpected or of the wrong shape. The only keys tolerated beyond the
model's own are the MTP layer(s) model.layers.<L..L+n-1>.* for num_nextn_predict_layers = n, which
HF ignores by design (it ignores model.layers.78.* of the real GLM-5 the same way). Then it runs the
saved inputs (use_cache=False) and prints the max abs logits difference against REF, the max abs
logit, their ratio and, when labels are present, both losses. Only positions whose attention_mask
is 1 are compared. Exit 1 if the ratio exceeds --tol.

Needs torch and the transformers version pinned in make_reference.py (a different version prints
a warning: the modeling code changed numerically between releases).
"""
import argparse
import json
import os
import re
import sys

import torch

PINNED_TRANSFORMERS = "5.25.0"


def load_model(ckpt_dir):
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()   # the load report; this script checks the keys itself
    if transformers.__version__ != PINNED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, the fixtures use {PINNED_TRANSFORMERS}",
              file=sys.stderr)
    cfg = json.load(open(os.path.join(ckpt_dir, "config.json")))
    cls = AutoModelForCausalLM
    if cfg.get("model_type") == "glm5_next":   # GLM-5.3-Flash: the vision-language class, text inputs
        from transformers import Glm5NextForConditionalGeneration as cls
    model, info = cls.from_pretrained(
        ckpt_dir, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
        output_loading_info=True, use_kernels=False)
    text = cfg.get("text_config") or cfg
    L = text["num_hidden_layers"]
    n_mtp = int(text.get("num_nextn_predict_layers") or 0)
    mtp = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")

    def is_mtp(k):
        m = mtp.match(k)
        return m is not None and L <= int(m.group(1)) < L + n_mtp

    unexpected = [k for k in info["unexpected_keys"] if not is_mtp(k)]
    ignored = [k for k in info["unexpected_keys"] if is_mtp(k)]
    problems = []
    if info["missing_keys"]:
        problems.append(f"missing keys: {sorted(info['missing_keys'])}")
    if unexpected:
        problems.append(f"unexpected keys: {sorted(unexpected)}")
    if info.get("mismatched_keys"):
        problems.append(f"mismatched shapes: {info['mismatched_keys']}")
    if info.get("error_msgs"):
        problems.append(f"errors: {info['error_msgs']}")
    if problems:
        print("check_export: strict load of %s failed:\n  %s" % (ckpt_dir, "\n  ".join(problems)), file=sys.stderr)
        sys.exit(2)
    model.eval()
    return model, ignored


def check(ckpt_dir, ref_path, quiet=False, tol=None):
    from safetensors.torch import load_file
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, ignored = load_model(ckpt_dir)
    ref = load_file(ref_path)
    am = ref.get("attention_mask")
    with torch.no_grad():
        out = model(input_ids=ref["input_ids"], position_ids=ref.get("position_ids"), attention_mask=am,
                    labels=ref.get("labels"), use_cache=False)
    got = out.logits.float()
    want = ref["logits"].float()
    if got.shape != want.shape:
        print(f"check_export: logits shape {tuple(got.shape)} != REF {tuple(want.shape)}", file=sys.stderr)
        sys.exit(2)
    keep = torch.ones(got.shape[:2], dtype=torch.bool) if am is None else am.bool()
    diff = float((got - want).abs()[keep].max())
    scale = float(want.abs()[keep].max())
    ratio = diff / max(scale, 1e-30)
    if not quiet:
        print(f"checkpoint: {ckpt_dir}")
        if ignored:
            print(f"ignored MTP tensors (HF has no MTP): {len(ignored)}")
        print(f"compared positions: {int(keep.sum())} of {keep.numel()}")
        print(f"max abs logits diff: {diff:.3e}")
        print(f"max abs logit:       {scale:.3e}")
        print(f"ratio:               {ratio:.3e}")
        if out.loss is not None and "loss" in ref:
            print(f"loss HF {float(out.loss):.8f}  REF {float(ref['loss'][0]):.8f}  "
                  f"rel diff {abs(float(out.loss) - float(ref['loss'][0])) / abs(float(ref['loss'][0])):.3e}")
    if tol is not None and ratio > tol:
        print(f"FAIL: ratio {ratio:.3e} > tol {tol:.1e}")
        sys.exit(1)
    return diff


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("ref")
    ap.add_argument("--tol", type=float, default=1e-5, help="max allowed max|dlogits| / max|logit|")
    a = ap.parse_args()
    check(a.dir, a.ref, tol=a.tol)
    print("OK")


if __name__ == "__main__":
    main()
