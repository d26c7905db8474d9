#!/usr/bin/env python3
"""Writes tests/fixtures/modules/flash_hf.json, the HF oracle of tests/lua/test_nn_flash.lua:
GLM-5.3-Flash's (glm5_next) new pieces run through transformers' own code, fp32 on the CPU:

  kda      chunk_kimi_delta_attention (the torch WY form HF runs on the CPU) over 3 chunks of
           two rows, from an initial state, with the final state: loss = sum(o r) + sum(S rs)
  linear   Glm5NextTextLinearAttention (projections, short conv, forget gate with the lower
           bound, beta, KDA, gated norm, o_proj) on a left-padded batch; and a second layer
           with linear_lower_bound=None (the softplus gate)
  hyper    Glm5NextTextHyperConnection (hc_mult 4 and 2) and the decoder layer's write
           Y = post a + comb^T X around a stand-in block a = tanh(u)

Every case records the inputs, the weights, the outputs and the gradients of its loss with
respect to the inputs and every parameter.

Developer machines only (CI reads the committed JSON):
    pip install torch transformers==5.25.0
    python3 tests/ref/make_flash_module_refs.py
"""
import json
import os

import torch
import transformers
from transformers.models.glm5_next import modeling_glm5_next as m
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

PIN = "5.25.0"
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "modules", "flash_hf.json")


def flat(t):
    return [float("%.9g" % v) for v in t.detach().reshape(-1).tolist()]


def entry(t):
    return {"shape": list(t.shape), "data": flat(t)}


def params_of(module, prefix):
    out = []
    for name, p in module.named_parameters():
        e = {"name": prefix + name, "shape": list(p.shape), "data": flat(p)}
        e["grad"] = flat(p.grad) if p.grad is not None else None
        out.append(e)
    return out


def text_config(**kw):
    base = dict(vocab_size=64, hidden_size=24, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                qk_rope_head_dim=0, v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, index_topk=4,
                index_kpool=2, index_n_heads=4, index_head_dim=8, linear_num_heads=2, linear_head_dim=8,
                linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
                rms_norm_eps=1e-5, pad_token_id=0)
    base.update(kw)
    return Glm5NextTextConfig(**base)


def kda_case(gen):
    B, S, H, D = 2, 140, 2, 8
    q = m.l2norm(torch.randn(B, S, H, D, generator=gen)).requires_grad_(True)
    k = m.l2norm(torch.randn(B, S, H, D, generator=gen)).requires_grad_(True)
    v = torch.randn(B, S, H, D, generator=gen).requires_grad_(True)
    g = (-5.0 * torch.sigmoid(torch.randn(B, S, H, D, generator=gen) - 2)).requires_grad_(True)
    beta = torch.sigmoid(torch.randn(B, S, H, generator=gen)).requires_grad_(True)
    s0 = (0.3 * torch.randn(B, H, D, D, generator=gen)).requires_grad_(True)
    o, st = m.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=False)
    r = torch.randn(o.shape, generator=gen)
    rs = torch.randn(st.shape, generator=gen)
    ((o * r).sum() + (st * rs).sum()).backward()
    out = {"B": B, "S": S, "H": H, "D": D, "scale": D ** -0.5, "r": entry(r), "rs": entry(rs), "o": entry(o),
           "state": entry(st)}
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state0", s0)):
        out[name] = entry(t)
        out["d" + name] = entry(t.grad)
    return out


def randomize(module, gen, scale=0.4):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def linear_case(gen, lower_bound):
    cfg = text_config(linear_lower_bound=lower_bound)
    layer = m.Glm5NextTextLinearAttention(cfg, 0).float()
    randomize(layer, gen)
    B, S = 2, 70
    am = torch.ones(B, S, dtype=torch.long)
    am[1, :9] = 0                       # a left-padded row
    x = torch.randn(B, S, cfg.hidden_size, generator=gen).requires_grad_(True)
    r = torch.randn(B, S, cfg.hidden_size, generator=gen) * am[:, :, None]
    out = layer(x, cache=None, attention_mask=am.bool())
    (out * r).sum().backward()
    return {"config": {k: getattr(cfg, k) for k in ("hidden_size", "linear_num_heads", "linear_head_dim",
                                                    "linear_conv_kernel_dim", "linear_lower_bound", "rms_norm_eps",
                                                    "hidden_act")},
            "B": B, "S": S, "attention_mask": flat(am), "x": entry(x), "r": entry(r), "out": entry(out),
            "dx": entry(x.grad), "params": params_of(layer, "self_attn.")}


def hyper_case(gen, n):
    cfg = text_config(hc_mult=n)
    hc = m.Glm5NextTextHyperConnection(cfg)
    with torch.no_grad():
        hc.fn.normal_(0, 0.3, generator=gen)
        hc.base.normal_(0, 0.5, generator=gen)
        hc.scale.normal_(0, 0.5, generator=gen)
    B, S, H = 2, 5, cfg.hidden_size
    X = torch.randn(B, S, n, H, generator=gen).requires_grad_(True)
    post, comb, u = hc(X)
    a = torch.tanh(u)
    Y = post.unsqueeze(-1) * a.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), X)
    r = torch.randn(Y.shape, generator=gen)
    (Y * r).sum().backward()
    return {"n": n, "H": H, "B": B, "S": S, "iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
            "rms_norm_eps": cfg.rms_norm_eps, "X": entry(X), "r": entry(r), "post": entry(post),
            "comb": entry(comb), "u": entry(u), "Y": entry(Y), "dX": entry(X.grad),
            "params": params_of(hc, "attn_hc.")}


def main():
    if transformers.__version__ != PIN:
        raise SystemExit(f"transformers {transformers.__version__} found, the fixtures pin {PIN}")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4321)
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "kda": kda_case(gen),
           "linear": linear_case(gen, -5.0), "linear_softplus": linear_case(gen, None),
           "hyper4": hyper_case(gen, 4), "hyper2": hyper_case(gen, 2)}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote", OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
