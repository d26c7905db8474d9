#!/usr/bin/env python3
"""Writes tests/fixtures/modules/attention_hf.json, the HF oracle of tests/lua/test_nn_attention_hf.lua:
one GLM-5 MLA layer with its DSA indexer (layer 0, "full"), one IndexShare layer (layer 1,
"shared", reusing layer 0's top-k) and one Glm4Moe GQA attention, all fp32 eager, run through
transformers' own modules (GlmMoeDsaAttention, Glm4MoeAttention, their rotary embeddings and
create_causal_mask). Records inputs, weights, outputs, the top-k indices, and the gradients of
loss = sum(out * r) with respect to the inputs and every parameter (the indexer's stay None).

Developer machines only (CI reads the committed JSON):
    pip install torch transformers==5.25.0
    python3 tests/ref/make_module_refs.py
"""
import json
import os

import torch
import transformers
from transformers import GlmMoeDsaConfig, Glm4MoeConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as dsa_mod
from transformers.models.glm4_moe import modeling_glm4_moe as g4_mod

PIN = "5.25.0"
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "modules", "attention_hf.json")


def flat(t):
    return [float("%.9g" % v) for v in t.detach().reshape(-1).tolist()]


def tensor_entry(t):
    return {"shape": list(t.shape), "data": flat(t)}


def randomize(module, gen):
    # HF's init (std 0.02) makes attention nearly uniform; use O(1) activations instead
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.4 * torch.randn(p.shape, generator=gen))


def params_of(module, prefix):
    out = []
    for name, p in module.named_parameters():
        e = {"name": prefix + "." + name, "shape": list(p.shape), "data": flat(p)}
        e["grad"] = flat(p.grad) if p.grad is not None else None
        out.append(e)
    return out


def mla_case(gen):
    cfg = GlmMoeDsaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
        index_topk=3, index_head_dim=8, index_n_heads=8, attention_bias=True,
        indexer_types=["full", "shared"], mlp_layer_types=["dense", "dense"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg._attn_implementation = "eager"
    B, T = 2, 6
    layers = [dsa_mod.GlmMoeDsaAttention(cfg, 0), dsa_mod.GlmMoeDsaAttention(cfg, 1)]
    for m in layers:
        randomize(m, gen)
    assert layers[1].indexer is None
    rot = dsa_mod.GlmMoeDsaRotaryEmbedding(cfg)
    am = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    x = [torch.randn(B, T, 16, generator=gen).requires_grad_(True) for _ in range(2)]
    r = [torch.randn(B, T, 16, generator=gen) for _ in range(2)]
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    mask = create_causal_mask(config=cfg, inputs_embeds=x[0], attention_mask=am, cache=None,
                              position_ids=pos, allow_is_causal_skip=False)
    pe = rot(x[0], pos)
    out0, _, topk0 = layers[0](x[0], pe, mask, position_ids=pos)
    out1, _, topk1 = layers[1](x[1], pe, mask, position_ids=pos, prev_topk_indices=topk0)
    assert torch.equal(topk0, topk1)
    loss = (out0 * r[0]).sum() + (out1 * r[1]).sum()
    loss.backward()
    return {
        "config": {k: getattr(cfg, k) for k in (
            "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads")},
        "attention_bias": True, "rope_theta": 10000.0, "B": B, "T": T,
        "attention_mask": flat(am), "mask": flat(mask[:, 0]),
        "x0": tensor_entry(x[0]), "x1": tensor_entry(x[1]), "r0": tensor_entry(r[0]), "r1": tensor_entry(r[1]),
        "out0": tensor_entry(out0), "out1": tensor_entry(out1),
        "topk": {"shape": list(topk0.shape), "data": [int(v) for v in topk0.reshape(-1).tolist()]},
        "dx0": tensor_entry(x[0].grad), "dx1": tensor_entry(x[1].grad),
        "params": params_of(layers[0], "model.layers.0.self_attn") + params_of(layers[1], "model.layers.1.self_attn"),
    }


def gqa_case(gen):
    cfg = Glm4MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    cfg._attn_implementation = "eager"
    B, T = 2, 5
    attn = g4_mod.Glm4MoeAttention(cfg, 0)
    randomize(attn, gen)
    rot = g4_mod.Glm4MoeRotaryEmbedding(cfg)
    am = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    x = torch.randn(B, T, 16, generator=gen).requires_grad_(True)
    r = torch.randn(B, T, 16, generator=gen)
    r[0, 0] = 0   # the left-padded query row: HF's loss never reaches it
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=am, cache=None,
                              position_ids=pos, allow_is_causal_skip=False)
    pe = rot(x, pos)
    assert pe[0].shape[-1] == 4, pe[0].shape
    out, _ = attn(x, pe, mask)
    (out * r).sum().backward()
    return {
        "config": {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                   "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5},
        "attention_bias": True, "use_qk_norm": True, "rope_theta": 10000.0, "B": B, "T": T,
        "attention_mask": flat(am), "mask": flat(mask[:, 0]),
        "x": tensor_entry(x), "r": tensor_entry(r), "out": tensor_entry(out), "dx": tensor_entry(x.grad),
        "params": params_of(attn, "model.layers.0.self_attn"),
    }


def main():
    if transformers.__version__ != PIN:
        raise SystemExit(f"transformers {transformers.__version__} found, the fixtures pin {PIN}")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    out = {"transformers": transformers.__version__, "torch": torch.__version__,
           "mla": mla_case(gen), "gqa": gqa_case(gen)}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote", os.path.relpath(OUT), os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
