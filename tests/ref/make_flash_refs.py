#!/usr/bin/env python3
"""Builds the GLM-5.3-Flash (glm5_next) model reference fixtures under tests/fixtures/models/<case>/.

Developer machine only (CI reads the committed files). Needs torch and transformers 5.25.0:

    python3 tests/ref/make_flash_refs.py            # all cases

Each case directory gets what save_pretrained writes (config.json with text_config and a tiny
vision_config, model.safetensors with the vision tower's tensors too) and reference.safetensors:
  input_ids, attention_mask, labels (B, T) i64    the batch (labels -100 at padding)
  logits (B, T, V) f32, loss () f32               HF fp32 eager, use_cache=False
  topk.<layer> (B, T, W) i64                      each DSA layer's selection (the index tensor its
                                                  attention reads; -1 = none)
  grad.<name>                                     d loss / d parameter, under the checkpoint
                                                  names save_pretrained writes (per-expert
                                                  experts, q/k/v conv weights apart...); none for
                                                  the indexer (no_grad) and the vision tower
Gradients are renamed by saving them through save_pretrained itself: a copy of the model whose
parameters hold the gradients (NaN where there is none) is saved and read back.

Cases (random weights; tensors whose init is 0 or 1 are randomised so every path runs):
  flash_a   hc_mult 4, 6 layers: 3 KDA (T = 140: three chunks), a full DSA layer followed by a
            shared one and another full one, dense and sparse MLPs with 2-group routing, clamps
            that bite (swiglu_limit 0.1 against gate / up outputs of about 0.1), index_topk 8 with kp 4 (T > KT + kp: pools dropped), a
            left-padded row
  flash_b   hc_mult 2, tied embeddings, the softplus gate (linear_lower_bound null), kp 2 with
            the tail off, a right-padded row, one expert group
"""
import os
import shutil
import sys
import tempfile

import torch

PIN = "5.25.0"
import transformers  # noqa: E402

if transformers.__version__ != PIN:
    sys.exit(f"make_flash_refs.py: transformers {PIN} is required, found {transformers.__version__}")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "fixtures", "models")

VISION = dict(depth=1, hidden_size=8, intermediate_size=8, num_heads=2, out_hidden_size=32,
              projection_intermediate_size=8, patch_size=2, image_size=4, spatial_merge_size=1)

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, routed_scaling_factor=2.5, index_n_heads=16, index_head_dim=8,
            linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
            rms_norm_eps=1e-5, pad_token_id=0)

CASES = {
    "flash_a": dict(text=dict(BASE, num_hidden_layers=6,
                              layer_types=["linear_attention", "linear_attention", "indexed_attention",
                                           "indexed_attention", "linear_attention", "indexed_attention"],
                              indexer_types=["full", "full", "full", "shared", "full", "full"],
                              mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "sparse"],
                              n_group=2, topk_group=1, swiglu_limit=0.1, index_topk=8, index_kpool=4,
                              linear_lower_bound=-5.0, hc_mult=4),
                    tie=False, B=2, T=140, pad="left"),
    "flash_b": dict(text=dict(BASE, num_hidden_layers=4,
                              layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                                           "linear_attention"],
                              indexer_types=["full", "full", "shared", "full"],
                              mlp_layer_types=["dense", "sparse", "sparse", "dense"],
                              n_group=1, topk_group=1, swiglu_limit=0.15, index_topk=6, index_kpool=2,
                              index_kpool_always_select_tail=False, linear_lower_bound=None, hc_mult=2),
                    tie=True, B=2, T=40, pad="right"),
}


# The linear weights keep transformers' init (normal, std 0.02): larger random weights make the
# f32 WY form of KDA and the Sinkhorn iterations ill-conditioned enough that transformers' own f32
# logits drift 1e-5 from its f64 ones, the size of the tolerance. Tensors whose init is 0 or 1 get
# N(0, 0.5) (as ../shared/docs/glm5_3-flash.md section 10 does), norms 1 + N(0, 0.1). dt_bias keeps
# FLA's init: a random one (decays of e^-2.5 per token) makes the gradient of a layer's tiny gate
# parameters depend on the last bit of the gate's f32 value (transformers' own f32 gradient of
# A_log then sits 1e-4 from its f64 one with other roundings of the same inputs).
def randomize(model, gen):
    with torch.no_grad():
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            if n.endswith(("compress_ape", "compress_gate", "e_score_correction_bias", "A_log", "_hc.base",
                           "_hc.scale")):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))


def grads_by_checkpoint_name(model):
    """d loss / d parameter under save_pretrained's names (None -> absent)."""
    tmp = tempfile.mkdtemp()
    try:
        clone = Glm5NextForConditionalGeneration(model.config).float()
        with torch.no_grad():
            src = dict(model.named_parameters())
            for n, p in clone.named_parameters():
                g = src[n].grad
                p.copy_(g if g is not None else torch.full_like(p, float("nan")))
            for _, b in clone.named_buffers():
                if b.is_floating_point():
                    b.fill_(float("nan"))   # buffers (the router's correction bias) get no gradient
        clone.save_pretrained(tmp)
        out = {}
        for n, t in load_file(os.path.join(tmp, "model.safetensors")).items():
            if n.startswith("model.visual") or torch.isnan(t).any():
                continue
            out["grad." + n] = t.contiguous()
        return out
    finally:
        shutil.rmtree(tmp)


def make(name, spec):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    cfg = Glm5NextConfig(text_config=spec["text"], vision_config=VISION, tie_word_embeddings=spec["tie"])
    model = Glm5NextForConditionalGeneration(cfg).float()
    model.set_attn_implementation("eager")
    randomize(model, gen)
    if spec["tie"]:
        assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    B, T, V = spec["B"], spec["T"], spec["text"]["vocab_size"]
    ids = torch.randint(1, V, (B, T), generator=gen)
    am = torch.ones(B, T, dtype=torch.long)
    if spec["pad"] == "left":
        am[1, :11] = 0
    else:
        am[1, T - 9:] = 0
    ids = ids.masked_fill(am == 0, 0)
    labels = ids.masked_fill(am == 0, -100)
    captured = {}
    hooks = []
    for i, layer in enumerate(model.model.language_model.layers):
        if layer.block_type != "linear_attention":
            hooks.append(layer.self_attn.register_forward_hook(
                lambda mod, inp, out, i=i: captured.__setitem__(i, out[2])))
    out = model(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
    out.loss.backward()
    for h in hooks:
        h.remove()
    ref = {"input_ids": ids, "attention_mask": am, "labels": labels, "logits": out.logits.detach().contiguous(),
           "loss": out.loss.detach().reshape(())}
    for i, t in captured.items():
        if t is not None:
            ref["topk.%d" % i] = t.long().contiguous()
    ref.update(grads_by_checkpoint_name(model))
    d = os.path.join(ROOT, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d)
    save_file(ref, os.path.join(d, "reference.safetensors"))
    print(name, "loss %.6f" % out.loss.item(), "grads", sum(1 for k in ref if k.startswith("grad.")),
          "dsa", sorted(captured))


def main():
    torch.set_num_threads(1)
    for name, spec in CASES.items():
        make(name, spec)


if __name__ == "__main__":
    main()
