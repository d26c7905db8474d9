#!/usr/bin/env python3
"""Writes tests/fixtures/modules/moe_glm_moe_dsa.json, the transformers oracle of the parity test
in tests/lua/test_nn_moe.lua: one MoE layer (GlmMoeDsaMoE and Glm4MoeMoE) in fp32 with eager
experts, its input, output, input gradient and every parameter gradient for a random upstream
gradient. Needs torch and transformers (pinned below) on a developer machine; CI reads only the
committed JSON.   Re-run with:  python3 tests/ref/make_moe_refs.py

Parameters are written under their checkpoint names (per-expert tensors, split from HF's fused
in-memory gate_up_proj / down_proj, section 10.2 of the spec), with a non-zero
e_score_correction_bias, and the router weight scaled up so that routing is not uniform. Each case
is drawn until every token's top-k (and top group) choice has a margin of at least 1e-3, so f32
rounding differences cannot change the choice.
"""
import json
import os

import torch
import transformers

PIN = "5.25.0"
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "modules", "moe_glm_moe_dsa.json")
PREFIX = "model.layers.3.mlp"


def entry(t, **extra):
    t = t.detach().to(torch.float32).contiguous()
    d = {"shape": list(t.shape), "data": [float("%.9g" % v) for v in t.reshape(-1).tolist()]}
    d.update(extra)
    return d


def margins_ok(moe, x, cfg):
    """every token's choice has a margin >= 1e-3 (top-k boundary and group boundary)"""
    with torch.no_grad():
        s = torch.sigmoid(x @ moe.gate.weight.t()) + moe.gate.e_score_correction_bias
        n, e = s.shape
        g, tg, k = cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]
        if g > 1:
            gs = s.view(n, g, e // g).topk(2, dim=-1)[0].sum(-1).sort(dim=-1, descending=True)[0]
            if (gs[:, tg - 1] - gs[:, tg]).min() < 1e-3:
                return False
            keep = s.view(n, g, e // g).topk(2, dim=-1)[0].sum(-1).topk(tg, dim=-1)[1]
            mask = torch.zeros(n, g).scatter_(1, keep, 1).bool()
            s = s.view(n, g, e // g).masked_fill(~mask[:, :, None], float("-inf")).view(n, e)
        srt = s.sort(dim=-1, descending=True)[0]
        if k < e and (srt[:, k - 1] - srt[:, k]).min() < 1e-3:
            return False
    return True


def make_case(label, model, cfg, n_tokens, seed):
    if model == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod
        config = transformers.GlmMoeDsaConfig(**cfg)
        cls = mod.GlmMoeDsaMoE
    else:
        from transformers.models.glm4_moe import modeling_glm4_moe as mod
        config = transformers.Glm4MoeConfig(**cfg)
        cls = mod.Glm4MoeMoE
    config._experts_implementation = "eager"
    h, im, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    for attempt in range(200):
        torch.manual_seed(seed + attempt)
        moe = cls(config).float()
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0.0, 0.3)
            moe.gate.weight.normal_(0.0, 0.5)
            moe.gate.e_score_correction_bias.normal_(0.0, 0.05)
        x = torch.randn(n_tokens, h)
        if margins_ok(moe, x, cfg):
            break
    else:
        raise RuntimeError(label + ": no draw with clear routing margins")
    x.requires_grad_(True)
    y = moe(x)
    _, _, topk_idx = moe.gate(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    params, grads = [], []

    def add(name, t, g, trainable=True):
        params.append(entry(t, name=PREFIX + "." + name, trainable=trainable))
        if g is not None:
            grads.append(entry(g, name=PREFIX + "." + name))

    add("gate.weight", moe.gate.weight, moe.gate.weight.grad)
    add("gate.e_score_correction_bias", moe.gate.e_score_correction_bias, None, trainable=False)
    gu, gug = moe.experts.gate_up_proj, moe.experts.gate_up_proj.grad      # [E, 2Im, H]
    dn, dng = moe.experts.down_proj, moe.experts.down_proj.grad            # [E, H, Im]
    for k in range(e):
        add("experts.%d.gate_proj.weight" % k, gu[k, :im], gug[k, :im])
        add("experts.%d.up_proj.weight" % k, gu[k, im:], gug[k, im:])
        add("experts.%d.down_proj.weight" % k, dn[k], dng[k])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(moe.shared_experts, proj).weight
        add("shared_experts.%s.weight" % proj, w, w.grad)

    keys = ["n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
            "routed_scaling_factor", "n_shared_experts", "hidden_act"]
    return {
        "label": label, "model": model, "prefix": PREFIX,
        "config": {k: cfg[k] for k in keys},
        "params": params, "grads": grads,
        "x": entry(x), "y": entry(y), "dy": entry(dy), "dx": entry(x.grad),
        "topk_idx": entry(topk_idx.float()),
    }


def main():
    if transformers.__version__ != PIN:
        raise SystemExit("needs transformers==%s, found %s" % (PIN, transformers.__version__))
    torch.set_num_threads(1)
    base = dict(hidden_size=16, moe_intermediate_size=6, n_shared_experts=1, hidden_act="silu",
                num_hidden_layers=1, vocab_size=32)
    dsa = dict(base, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=16)
    glm4 = dict(base, hidden_size=12, moe_intermediate_size=4, n_routed_experts=8, num_experts_per_tok=3,
                n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=2,
                hidden_act="gelu")
    cases = [
        make_case("GlmMoeDsaMoE silu, groups 2/1, norm, scale 2.5", "glm_moe_dsa", dsa, 10, 100),
        make_case("Glm4MoeMoE gelu, groups 4/2, no norm, 2 shared", "glm4_moe", glm4, 9, 200),
    ]
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "cases": cases}, f,
                  separators=(",", ":"))
        f.write("\n")
    print("wrote %s (%d bytes)" % (OUT, os.path.getsize(OUT)))


if __name__ == "__main__":
    main()
