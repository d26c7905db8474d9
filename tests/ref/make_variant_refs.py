#!/usr/bin/env python3
"""Builds the small GLM-5 / GLM-4.x variant fixtures under tests/fixtures/models/<case>/:

  <arch>_<act>     for act in gelu_pytorch_tanh, gelu_new, relu (arch glm5, glm4moe): a 2-layer
                   model (dense MLP, then MoE with a shared expert) whose hidden_act is act, with
                   HF's logits, loss and every gradient. The generator also reruns the same
                   weights with every other activation formula and requires the logits to move by
                   more than 10x the tests' tolerance, so a fixture tells the formulas apart.
                   A seed is rejected (and the next tried) on a router near-tie, when the other
                   formulas move the logits less than that, or when the finite-difference check
                   fails (relu: a step crossed the kink).
  <arch>_nomtp     a checkpoint exactly as save_pretrained writes it for a config that declares
                   num_nextn_predict_layers = 1 (Glm4MoeConfig's default): no MTP tensor in it.

Developer machine only (CI reads the committed files). Needs torch and the transformers version
pinned in make_reference.py, whose helpers this script reuses:

    python3 tests/ref/make_variant_refs.py              # all cases
    python3 tests/ref/make_variant_refs.py glm5_relu    # some cases
    python3 tests/ref/make_variant_refs.py --check      # only re-verify the committed files

Every case is fp32, eager, one CPU thread, fixed seeds: a re-run writes the same bytes. Each is
verified as make_reference.py verifies its cases (dtypes, loss from the saved logits, a strict
from_pretrained reload reproducing the logits, finite differences of a few gradients).
"""
import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_reference as mr  # noqa: E402  (asserts the pinned transformers version)
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, GlmMoeDsaForCausalLM  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402

B, S = 2, 8
ACTS = ("gelu_pytorch_tanh", "gelu_new", "relu")
# formulas that differ (gelu_new and gelu_pytorch_tanh are the same function)
FORMULA = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "relu": "relu"}
FD_TOL = 2e-3           # make_reference.verify_case's bound on the finite-difference check
DISCRIMINATION = 1e-4   # 10x the tests' logits tolerance (1e-5 of max |logit|)


def tiny_glm5(**kw):
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                index_head_dim=8, index_n_heads=2, index_topk=32, num_hidden_layers=2, n_group=1, topk_group=1,
                indexer_types=["full", "full"], mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1)
    base.update(kw)
    return GlmMoeDsaForCausalLM, mr.glm5_config(**base)


def tiny_glm4moe(**kw):
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, first_k_dense_replace=1,
                n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64, use_cache=False,
                bos_token_id=None, eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base.update(kw)
    return Glm4MoeForCausalLM, Glm4MoeConfig(**base)


def set_act_(model, act):
    """Every MLP and expert module of model computes act from now on."""
    n = 0
    for m in model.modules():
        if hasattr(m, "act_fn"):
            m.act_fn = ACT2FN[act]
            n += 1
    assert n > 0
    return n


def run_case(name, cls, cfg, act):
    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = mr.build_model(cls, cfg)
        mr.randomize_(model, gen)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        labels = ids.clone()
        out, cap = mr.run_hf(model, ids, pos, labels)
        rs = mr.check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        if rs is None:
            return None
        t = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        t.update(mr.dsa_routing_tensors(cap, B, S, getattr(cfg, "index_topk", 0), S))
        g, none = mr.collect_grads(model)
        t.update(g)
        meta = {"router": rs, "params_without_grad_attr": none, "hidden_act": act}
        # the same weights under every other formula: how far the logits move
        ref = out.logits.detach()
        moved = {}
        with torch.no_grad():
            for other in FORMULA:
                if FORMULA[other] == FORMULA[act]:
                    continue
                set_act_(model, other)
                lg = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                moved[other] = float((lg - ref).abs().max() / ref.abs().max())
            set_act_(model, act)
            again = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            assert torch.equal(again, ref), "restoring the activation must restore the logits"
        meta["logits_moved_by_other_activations"] = moved
        if min(moved.values()) < DISCRIMINATION:
            return None          # this seed's activations sit where the formulas agree: try another
        # relu has a kink: a seed where the verification's finite-difference steps (3e-3) push a
        # pre-activation across 0 cannot be verified that way, so it is rejected like a tie
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            if mr.fd_check(tmp, t) >= FD_TOL:
                return None
        return {"model": model, "tensors": t, "meta": meta}

    return mr.try_seeds(build, name)


def act_case(arch, act):
    cls, cfg = (tiny_glm5 if arch == "glm5" else tiny_glm4moe)(hidden_act=act, num_nextn_predict_layers=0)
    return lambda: run_case(f"{arch}_{act}", cls, cfg, act)


def nomtp_case(arch):
    if arch == "glm5":
        cls, cfg = tiny_glm5(num_nextn_predict_layers=1)
    else:
        cls, cfg = tiny_glm4moe()                    # HF's default: num_nextn_predict_layers = 1
    assert cfg.num_nextn_predict_layers == 1
    return lambda: run_case(f"{arch}_nomtp", cls, cfg, "silu")


CASES = {}
for _arch in ("glm5", "glm4moe"):
    for _act in ACTS:
        CASES[f"{_arch}_{_act}"] = act_case(_arch, _act)
    CASES[f"{_arch}_nomtp"] = nomtp_case(_arch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", help=f"subset of {list(CASES)}")
    ap.add_argument("--check", action="store_true", help="only verify the committed files")
    args = ap.parse_args()
    names = args.cases or list(CASES)
    for n in names:
        if n not in CASES:
            sys.exit(f"unknown case {n}; known: {list(CASES)}")
    total = 0
    for n in names:
        if not args.check:
            r = CASES[n]()
            d = mr.write_case(n, r["model"], r["tensors"], r["meta"])
            keys = mr.checkpoint_keys(d)
            L = r["model"].config.num_hidden_layers
            assert not any(k.startswith(f"model.layers.{L}.") for k in keys), f"{n}: an MTP tensor was saved"
        res = mr.verify_case(n)
        m = res.pop("meta")
        total += res["files_bytes"]
        moved = ", ".join(f"{k} {v:.1e}" for k, v in sorted(m["logits_moved_by_other_activations"].items()))
        print(f"{n}: {res['arch']} {m['hidden_act']} seed {m['seed']} (rejected {m['seeds_rejected_for_ties']}), "
              f"{res['files_bytes']} bytes, loss {res['loss']:.6f}, reload max|dlogits| "
              f"{res['reload_max_abs_logits']:.1e}, finite-difference grads {res['fd_worst_rel']:.1e}; "
              f"logits move under other formulas: {moved}")
    print(f"these cases: {total} bytes")


if __name__ == "__main__":
    main()
