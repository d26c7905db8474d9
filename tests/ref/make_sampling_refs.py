#!/usr/bin/env python3
"""Builds tests/fixtures/generate/sampling_hf.json: transformers' processed sampling distributions
(temperature, top-k, top-p, min-p warpers) for rows of logits, the reference that
tests/lua/test_generate_sampling.lua holds lunar.generate.sampling's definition to.

Developer machine only (CI reads the committed file). Needs torch and the pinned transformers:

    python3 tests/ref/make_sampling_refs.py            # writes the fixture
    python3 tests/ref/make_sampling_refs.py --check    # regenerates and compares with the file

For each case: one row of f32 logits (a seeded ramp of values at shuffled ids, or seeded normal
values) and the settings; the warpers are applied in the order generate() builds them
(GenerationMixin._get_logits_processor in 5.25.0: temperature, top-k, top-p, min-p; this script
checks that order in the source), each only when generate() would add it, with
min_tokens_to_keep 1, then softmax. Logits and probabilities are written with 9 significant
digits, which give back the f32 values exactly. A case is refused when a top-p or min-p
decision lies within MARGIN of its threshold, so lunar's f32 arithmetic and the Lua test's f64
reference cannot decide it differently.
"""
import argparse
import inspect
import json
import os
import sys

import torch

PINNED_TRANSFORMERS = "5.25.0"

import transformers  # noqa: E402

if transformers.__version__ != PINNED_TRANSFORMERS:
    sys.exit(f"make_sampling_refs.py: transformers {PINNED_TRANSFORMERS} is required, found {transformers.__version__}")

from transformers.generation import utils as gen_utils  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "tests", "fixtures", "generate", "sampling_hf.json")
MARGIN = 1e-4
SEED = 1107

# name, logits (kind, V, slope), settings
CASES = [
    ("top_k 50, top_p 0.9", ("ramp", 128, 0.03), {"temperature": 0.7, "top_k": 50, "top_p": 0.9}),
    ("min_p 0.05", ("ramp", 128, 0.05), {"temperature": 0.7, "min_p": 0.05}),
    ("top_p 0.9, min_p 0.3", ("ramp", 64, 0.06), {"temperature": 0.8, "top_p": 0.9, "min_p": 0.3}),
    ("top_k 20", ("ramp", 64, 0.06), {"temperature": 1.5, "top_k": 20}),
    ("temperature 1", ("ramp", 64, 0.06), {"temperature": 1.0}),
    ("normal, top_k 100, top_p 0.95, min_p 0.02", ("normal", 300, 1.5),
     {"temperature": 1.2, "top_k": 100, "top_p": 0.95, "min_p": 0.02}),
    ("normal, top_p 0.7", ("normal", 300, 1.5), {"temperature": 0.5, "top_p": 0.7}),
    ("normal, top_k 300 of 300", ("normal", 300, 1.5), {"temperature": 0.9, "top_k": 300}),
]


def check_order():
    """The warper order of generate() in this transformers, read from its source."""
    src = inspect.getsource(gen_utils.GenerationMixin._get_logits_processor)
    pos = [src.index(name + "(") for name in
           ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")]
    if pos != sorted(pos):
        sys.exit("make_sampling_refs.py: generate() no longer applies temperature, top-k, top-p, min-p in that order")


def logits_for(i, kind, V, scale):
    gen = torch.Generator().manual_seed(SEED + i)
    if kind == "normal":
        return torch.randn(V, generator=gen, dtype=torch.float64).mul(scale).float()
    # sorted values falling by `scale` per rank plus noise, placed at shuffled ids
    noise = torch.rand(V, generator=gen, dtype=torch.float64).mul(0.6).sub(0.3)
    ranked = 2 - scale * (torch.arange(V, dtype=torch.float64) + noise)
    perm = torch.randperm(V, generator=gen)
    row = torch.empty(V, dtype=torch.float64)
    row[perm] = ranked
    return row.float()


def warpers(s):
    """The warpers generate() adds for these settings (do_sample, one beam)."""
    out = []
    if s.get("temperature", 1.0) != 1.0:
        out.append(TemperatureLogitsWarper(s["temperature"]))
    if s.get("top_k", 0) != 0:
        out.append(TopKLogitsWarper(top_k=s["top_k"], min_tokens_to_keep=1))
    if s.get("top_p", 1.0) < 1.0:
        out.append(TopPLogitsWarper(top_p=s["top_p"], min_tokens_to_keep=1))
    if s.get("min_p") is not None:
        out.append(MinPLogitsWarper(min_p=s["min_p"], min_tokens_to_keep=1))
    return out


def margins(row, s):
    """The closest top-p and min-p decisions to their thresholds, in f64."""
    x = row.double() / s.get("temperature", 1.0)
    keep = torch.ones_like(x, dtype=torch.bool)
    k = s.get("top_k", 0)
    if 0 < k < x.numel():
        keep &= x >= torch.topk(x, k).values[-1]
    closest = float("inf")
    if s.get("top_p", 1.0) < 1.0:
        p = torch.softmax(x.masked_fill(~keep, -float("inf")), -1)
        order = torch.argsort(p, descending=True, stable=True)
        tail = torch.flip(torch.cumsum(torch.flip(p[order], [0]), 0), [0])
        closest = min(closest, (tail[keep[order]] - (1 - s["top_p"])).abs().min().item())
        drop = tail <= 1 - s["top_p"]
        drop[0] = False
        keep[order[drop]] = False
    if s.get("min_p", 0) > 0:
        p = torch.softmax(x.masked_fill(~keep, -float("inf")), -1)
        rel = (p[keep] / p.max() - s["min_p"]).abs().min().item()
        closest = min(closest, rel)
    return closest


def f32(v):
    """An f32 value as the shortest decimal that reads back as it (9 significant digits)."""
    return float(f"{v:.9g}")


def build():
    check_order()
    cases = []
    for i, (name, (kind, V, scale), s) in enumerate(CASES):
        row = logits_for(i, kind, V, scale)
        m = margins(row, s)
        if m < MARGIN:
            sys.exit(f"make_sampling_refs.py: case {name!r}: a decision lies {m:.2e} from its threshold")
        scores = row.unsqueeze(0).clone()
        ids = torch.zeros((1, 1), dtype=torch.long)
        for w in warpers(s):
            scores = w(ids, scores)
        probs = torch.softmax(scores, -1)[0]
        cases.append({"name": name, "settings": s, "logits": [f32(v) for v in row.tolist()],
                      "probs": [f32(v) for v in probs.tolist()], "kept": int((probs > 0).sum()),
                      "closest": None if m == float("inf") else float(f"{m:.3g}")})
    return {"transformers": transformers.__version__, "torch": torch.__version__, "cases": cases}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = ap.parse_args()
    data = build()
    text = json.dumps(data, indent=1) + "\n"
    if args.check:
        with open(OUT) as f:
            old = json.load(f)
        same = [c["probs"] for c in old["cases"]] == [c["probs"] for c in data["cases"]]
        print("sampling_hf.json matches" if same else "sampling_hf.json differs")
        sys.exit(0 if same else 1)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(text)
    for c in data["cases"]:
        print(f"{c['name']}: {c['kept']} of {len(c['logits'])} tokens kept, closest decision {c['closest']}")


if __name__ == "__main__":
    main()
