#!/usr/bin/env python3
"""Builds the GLM-5 / GLM-4.x model reference fixtures under tests/fixtures/models/<case>/.

Developer machine only (CI never runs Python; it reads the committed files). Needs torch and the
pinned transformers version (see tests/fixtures/models/README.md for the install recipe):

    python3 tests/ref/make_reference.py              # all cases
    python3 tests/ref/make_reference.py glm5_dsa     # some cases
    python3 tests/ref/make_reference.py --check      # only re-verify the committed files

Each case directory gets:
  config.json, generation_config.json, model.safetensors   as HF save_pretrained writes them
  reference.safetensors                                     inputs and HF outputs, see the README

Everything is fp32 (glm5_bf16 is briefly trained first and adds HF's own bf16 run), eager attention,
eager experts, model.eval(), explicit position_ids, use_cache=False, one CPU thread, fixed seeds,
so a re-run reproduces the same bytes on the same torch/transformers versions.
"""
import argparse
import copy
import json
import math
import os
import shutil
import sys

import torch
import torch.nn.functional as F

PINNED_TRANSFORMERS = "5.25.0"

import transformers  # noqa: E402

if transformers.__version__ != PINNED_TRANSFORMERS:
    sys.exit(f"make_reference.py: transformers {PINNED_TRANSFORMERS} is required, found {transformers.__version__} "
             f"(pip install --no-deps transformers=={PINNED_TRANSFORMERS}; see tests/fixtures/models/README.md)")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (Glm4MoeConfig, Glm4MoeForCausalLM, GlmMoeDsaConfig,  # noqa: E402
                          GlmMoeDsaForCausalLM)
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as dsa_mod  # noqa: E402
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (GlmMoeDsaDecoderLayer,  # noqa: E402
                                                                   GlmMoeDsaTopkRouter)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_ROOT = os.path.join(REPO, "tests", "fixtures", "models")

TIE_REL = 1e-4          # required relative gap at every top-k boundary (DSA and router)
TIE_ABS = 1e-6          # and an absolute floor, so two near-zero scores count as a tie
MAX_TRIES = 50          # seeds tried per case before giving up

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


# --------------------------------------------------------------------------------------------
# model construction and randomisation
# --------------------------------------------------------------------------------------------

def build_model(cls, config):
    model = cls._from_config(config, attn_implementation="eager", experts_implementation="eager",
                             dtype=torch.float32)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    assert model.config._experts_implementation == "eager", model.config._experts_implementation
    model.eval()
    return model


def randomize_(module, gen, bias_scale=0.1, embed_std=1.0):
    """Replaces HF's std-0.02 init with O(1)-activation values so routing, top-k, norms and biases
    all matter: matrices ~ N(0, 1/fan_in), norm weights 1 + 0.2 N, biases 0.1 N, embeddings N(0, 1),
    e_score_correction_bias bias_scale * N. The pad embedding row is made non-zero on purpose.
    embed_std scales the embeddings (tied cases use H^-0.5 so the tied lm_head gives O(1) logits)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
            elif p.dim() == 3:          # fused experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[2]))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                raise RuntimeError(f"randomize_: unexpected parameter {name} {tuple(p.shape)}")
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_scale * torch.randn(b.shape, generator=gen))


# --------------------------------------------------------------------------------------------
# capture: DSA top-k (with score recomputation), router decisions
# --------------------------------------------------------------------------------------------

def indexer_scores(ix, hidden_states, q_resid, position_embeddings, mask):
    """Recomputes GlmMoeDsaIndexer's index scores [B, S, T] (the line-by-line V-latest formula)."""
    with torch.no_grad():
        b, s, _ = hidden_states.shape
        cos, sin = position_embeddings
        dr, di = ix.qk_rope_head_dim, ix.head_dim
        q = ix.wq_b(q_resid).view(b, s, ix.n_heads, di)
        q_rot, q_pass = torch.split(q, [dr, di - dr], dim=-1)
        k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [dr, di - dr], dim=-1)
        q_rot, k_rot = dsa_mod.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        sc = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
        w = ix.weights_proj(hidden_states).float() * (ix.n_heads ** -0.5)
        return torch.matmul(w.unsqueeze(-2), sc).squeeze(-2), mask


class Capture:
    """Forward hooks that record, per HF layer index: the DSA top-k of full layers (plus the index
    scores and visibility needed for the tie check) and the router top-k of MoE layers."""

    def __init__(self, layers, index_offset=0):
        self.topk = {}        # layer -> int32 [B, S, k]
        self.scores = {}      # layer -> (float [B, S, T], bool visible [B, S, T])
        self.routing = {}     # layer -> (router_logits [N, E], weights [N, K], ids [N, K], bias [E], router)
        self.handles = []
        for i, layer in enumerate(layers):
            li = i + index_offset
            attn = getattr(layer, "self_attn", None)
            if attn is not None and getattr(attn, "indexer", None) is not None:
                self.handles.append(attn.register_forward_hook(self._attn_hook(li)))
                self.handles.append(attn.indexer.register_forward_pre_hook(self._indexer_hook(li, attn.indexer)))
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if isinstance(gate, (GlmMoeDsaTopkRouter, Glm4MoeTopkRouter)):
                self.handles.append(gate.register_forward_hook(self._gate_hook(li, gate)))

    def _attn_hook(self, li):
        def hook(mod, args, out):
            self.topk[li] = out[2].detach().clone()
        return hook

    def _indexer_hook(self, li, ix):
        def hook(mod, args):
            hs, q_resid, pe, mask = args[0], args[1], args[2], args[3]
            sc, m = indexer_scores(ix, hs, q_resid, pe, mask)
            visible = (m == 0) if m.dtype != torch.bool else m
            self.scores[li] = (sc, visible.expand_as(sc).clone())
        return hook

    def _gate_hook(self, li, gate):
        def hook(mod, args, out):
            logits, w, ids = out
            self.routing[li] = (logits.detach().clone(), w.detach().clone(), ids.detach().clone(),
                                gate.e_score_correction_bias.detach().clone(), gate)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def gap_ok(a, b):
    gap = abs(float(a) - float(b))
    return gap > TIE_REL * max(abs(float(a)), abs(float(b))) and gap > TIE_ABS, gap / max(abs(float(a)), abs(float(b)), 1e-30)


def check_dsa(cap, index_topk, row_ok=None):
    """Checks every full layer: HF's selection equals the top-k of the recomputed scores restricted
    to visible keys, and the k-th/(k+1)-th visible scores are separated. Returns stats or raises."""
    stats = {"min_rel_gap": float("inf"), "queries_dropping_keys": 0, "queries": 0,
             "current_token_dropped": 0}
    for li, (sc, vis) in cap.scores.items():
        sel = cap.topk[li].long()
        B, S, T = sc.shape
        for b in range(B):
            for s in range(S):
                if row_ok is not None and not row_ok[b, s]:
                    continue
                v = vis[b, s].nonzero().flatten()
                stats["queries"] += 1
                chosen = set(int(t) for t in sel[b, s].tolist()) & set(int(t) for t in v.tolist())
                if len(v) <= index_topk:
                    if chosen != set(int(t) for t in v.tolist()):
                        raise AssertionError(f"layer {li} b{b} s{s}: HF did not keep every visible key")
                    continue
                stats["queries_dropping_keys"] += 1
                vs = sc[b, s, v]
                order = torch.argsort(vs, descending=True, stable=True)
                mine = set(int(v[j]) for j in order[:index_topk].tolist())
                ok, rel = gap_ok(vs[order[index_topk - 1]], vs[order[index_topk]])
                stats["min_rel_gap"] = min(stats["min_rel_gap"], rel)
                if not ok:      # a tie (e.g. two keys whose ReLU'd heads are all 0): reject the seed
                    return None
                if mine != chosen:
                    raise AssertionError(f"layer {li} b{b} s{s}: recomputed top-k {sorted(mine)} != HF {sorted(chosen)}")
                # causal position of query s is the largest visible key index
                if int(v.max()) not in chosen:
                    stats["current_token_dropped"] += 1
    return stats


def check_router(cap, n_group, topk_group, top_k):
    """Group and expert top-k boundaries of every token must be separated (no near-ties)."""
    min_rel = float("inf")
    for li, (logits, w, ids, bias, gate) in cap.routing.items():
        s = logits.sigmoid()
        c = s + bias
        N, E = c.shape
        if n_group > 1:
            g = c.view(N, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
            gs = g.sort(dim=-1, descending=True)[0]
            for n in range(N):
                ok, rel = gap_ok(gs[n, topk_group - 1], gs[n, topk_group])
                min_rel = min(min_rel, rel)
                if not ok:
                    return None
            keep = torch.zeros(N, n_group, dtype=torch.bool)
            keep.scatter_(1, g.topk(topk_group, dim=-1)[1], True)
            keep = keep.unsqueeze(-1).expand(N, n_group, E // n_group).reshape(N, E)
            c = c.masked_fill(~keep, float("-inf"))
        cs = c.sort(dim=-1, descending=True)[0]
        for n in range(N):
            if top_k < E and math.isfinite(float(cs[n, top_k])):
                ok, rel = gap_ok(cs[n, top_k - 1], cs[n, top_k])
                min_rel = min(min_rel, rel)
                if not ok:
                    return None
        mine = c.topk(top_k, dim=-1)[1].sort(dim=-1)[0]
        if not torch.equal(mine, ids.sort(dim=-1)[0]):
            raise AssertionError(f"router layer {li}: recomputed selection differs from HF")
    return {"min_rel_gap": min_rel}


# --------------------------------------------------------------------------------------------
# packing tensors for reference.safetensors
# --------------------------------------------------------------------------------------------

def topk_tensor(sel, visible, k_out):
    """int32 [B, S, k_out]: per query the selected keys that are visible, ascending, -1 padded.
    Selected-but-masked keys (ties at finfo.min) are implementation-dependent and dropped."""
    B, S, _ = sel.shape
    out = torch.full((B, S, k_out), -1, dtype=torch.int32)
    for b in range(B):
        for s in range(S):
            keep = sorted(int(t) for t in sel[b, s].tolist() if visible[b, s, int(t)])
            out[b, s, :len(keep)] = torch.tensor(keep, dtype=torch.int32)
    return out


def routing_tensors(ids, w, B, S):
    order = ids.argsort(dim=-1)
    ids_sorted = ids.gather(1, order)
    w_sorted = w.gather(1, order)
    K = ids.shape[1]
    return ids_sorted.to(torch.int32).reshape(B, S, K).contiguous(), w_sorted.float().reshape(B, S, K).contiguous()


def expert_split_grads(name, grad):
    """Maps a parameter name/grad to checkpoint names; splits fused experts per expert."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        im = grad.shape[1] // 2
        out = {}
        for e in range(grad.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = grad[e, :im]
            out[f"{base}{e}.up_proj.weight"] = grad[e, im:]
        return out
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": grad[e] for e in range(grad.shape[0])}
    return {name: grad}


def collect_grads(model, prefix="grad."):
    out, none = {}, []
    for name, p in model.named_parameters():
        if p.grad is None:
            none.append(name)
            continue
        for k, v in expert_split_grads(name, p.grad.detach()).items():
            out[prefix + k] = v.float().contiguous().clone()
    return out, none


def ce_loss(logits, labels, shift=1, dtype=torch.float64):
    """Mean cross-entropy of logits[s] against labels[s + shift] over labels != -100 (float64 for
    checks; dtype=torch.float32 where it is part of a reference computation, as HF's loss is)."""
    lg = logits.to(dtype)
    tgt = F.pad(labels, (0, shift), value=-100)[..., shift:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), ignore_index=-100)


# --------------------------------------------------------------------------------------------
# writing a case
# --------------------------------------------------------------------------------------------

def checkpoint_keys(d):
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def write_case(name, model, tensors, meta, extra_ckpt=None):
    d = os.path.join(OUT_ROOT, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model.save_pretrained(d)
    if extra_ckpt:   # MTP tensors HF does not know: appended to the saved file
        path = os.path.join(d, "model.safetensors")
        with safe_open(path, "pt") as f:
            md = f.metadata()
            cur = {k: f.get_tensor(k) for k in f.keys()}
        clash = set(cur) & set(extra_ckpt)
        assert not clash, clash
        cur.update({k: v.contiguous() for k, v in extra_ckpt.items()})
        save_file(cur, path, metadata=md)
    keys = set(checkpoint_keys(d))
    n_grad = sum(1 for k in tensors if k.startswith("grad."))
    n_main = sum(1 for k in keys if not k.startswith(f"model.layers.{model.config.num_hidden_layers}."))
    if not meta.get("grads_omitted"):
        assert n_grad > 0.8 * n_main - 20, f"{name}: only {n_grad} gradients for {n_main} checkpoint tensors"
    else:
        assert n_grad == 0, name
    for k in tensors:
        if k.startswith("grad.") or k.startswith("mtp.grad."):
            ck = k[len("grad."):] if k.startswith("grad.") else k[len("mtp.grad."):]
            assert ck in keys, f"{name}: gradient {k} names no checkpoint tensor"
    meta = dict(meta)
    if not meta.get("grads_omitted"):
        meta["ckpt_without_grad"] = ckpt_names_without_grad(d, tensors)
    if any(k.startswith("mtp.grad.") for k in tensors):
        meta["ckpt_without_mtp_grad"] = ckpt_names_without_grad(d, tensors, "mtp.grad.")
    meta.update({"case": name, "transformers": transformers.__version__, "torch": torch.__version__})
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(d, "reference.safetensors"), metadata={"lunar": json.dumps(meta, sort_keys=True)})
    return d


def ckpt_names_without_grad(d, tensors, prefix="grad."):
    have = {k[len(prefix):] for k in tensors if k.startswith(prefix)}
    return [k for k in checkpoint_keys(d) if k not in have]


# --------------------------------------------------------------------------------------------
# the GLM-5 runner shared by the DSA cases
# --------------------------------------------------------------------------------------------

def glm5_config(**kw):
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
                num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=12, index_head_dim=16, index_n_heads=8,
                routed_scaling_factor=2.5, hidden_act="silu", max_position_embeddings=256,
                rms_norm_eps=1e-5, use_cache=False, bos_token_id=None, eos_token_id=None)
    base.update(kw)
    return GlmMoeDsaConfig(**base)


def run_hf(model, input_ids, position_ids, labels, attention_mask=None):
    model.zero_grad(set_to_none=True)
    cap = Capture(model.model.layers)
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                labels=labels, use_cache=False)
    out.loss.backward()
    cap.remove()
    return out, cap


def dsa_routing_tensors(cap, B, S, index_topk, n_tokens_T):
    t = {}
    for li in sorted(cap.topk):
        sc, vis = cap.scores[li]
        t[f"topk.{li}"] = topk_tensor(cap.topk[li], vis, min(index_topk, n_tokens_T))
    for li in sorted(cap.routing):
        logits, w, ids, _, _ = cap.routing[li]
        t[f"routing.{li}"], t[f"routing_weights.{li}"] = routing_tensors(ids, w, B, S)
    return t


def try_seeds(build, label):
    """build(seed) returns a result dict or None (tie); tries seeds until one is clean."""
    for seed in range(MAX_TRIES):
        r = build(1000 + seed)
        if r is not None:
            r["meta"]["seed"] = 1000 + seed
            r["meta"]["seeds_rejected_for_ties"] = seed
            return r
    raise RuntimeError(f"{label}: no tie-free seed in {MAX_TRIES} tries")


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------

def case_glm5_dsa():
    B, S, K_IDX = 2, 16, 4
    cfg = glm5_config(num_hidden_layers=4, n_group=2, topk_group=1, index_topk=K_IDX,
                      indexer_types=["full", "shared", "full", "shared"],
                      mlp_layer_types=["dense", "sparse", "sparse", "sparse"], first_k_dense_replace=1)

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = build_model(GlmMoeDsaForCausalLM, cfg)
        randomize_(model, gen)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        labels = ids.clone()
        out, cap = run_hf(model, ids, pos, labels)
        ds = check_dsa(cap, K_IDX)
        rs = check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        if ds is None or rs is None:
            return None
        assert ds["queries_dropping_keys"] > 0
        t = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        t.update(dsa_routing_tensors(cap, B, S, K_IDX, S))
        g, none = collect_grads(model)
        t.update(g)
        return {"model": model, "tensors": t,
                "meta": {"dsa": ds, "router": rs, "params_without_grad_attr": none}}

    return try_seeds(build, "glm5_dsa")


class MTPLayer(torch.nn.Module):
    """lunar's own MTP reference (DeepSeek-V3 style; HF has no MTP). Holds the checkpoint tensors
    model.layers.<L>.{eh_proj, enorm, hnorm, shared_head.norm} and a full HF decoder layer."""

    def __init__(self, cfg_mtp, L):
        super().__init__()
        H = cfg_mtp.hidden_size
        self.enorm = dsa_mod.GlmMoeDsaRMSNorm(H, cfg_mtp.rms_norm_eps)
        self.hnorm = dsa_mod.GlmMoeDsaRMSNorm(H, cfg_mtp.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = dsa_mod.GlmMoeDsaRMSNorm(H, cfg_mtp.rms_norm_eps)
        self.layer = GlmMoeDsaDecoderLayer(cfg_mtp, L)

    def forward(self, model, input_ids, position_ids, h_main):
        """h_main: the main model's last_hidden_state (after model.norm), [B, S, H]. Position s of
        the MTP sequence combines h_main[s] with the embedding of token s+1 and predicts token s+2;
        the MTP sequence has S-1 positions (the last main position has no next token)."""
        emb = model.model.embed_tokens(input_ids[:, 1:])
        h = h_main[:, :-1]
        pos = position_ids[:, :-1]
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        B, S1, _ = x.shape
        pe = model.model.rotary_emb(x, position_ids=pos)
        mask = torch.full((S1, S1), torch.finfo(torch.float32).min).triu(1)
        mask = mask.view(1, 1, S1, S1).expand(B, 1, S1, S1)
        y, _ = self.layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos, prev_topk_indices=None)
        return model.lm_head(self.shared_head.norm(y))


def case_glm5_mtp():
    B, S = 2, 12
    L = 2
    cfg = glm5_config(num_hidden_layers=L, n_group=1, topk_group=1, index_topk=16, first_k_dense_replace=1,
                      num_nextn_predict_layers=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    # the MTP layer: a MoE layer with a full DSA attention and its own indexer, at index L
    cfg_mtp = glm5_config(num_hidden_layers=L + 1, n_group=1, topk_group=1, index_topk=16,
                          first_k_dense_replace=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cfg_mtp._attn_implementation = "eager"
    cfg_mtp._experts_implementation = "eager"
    assert cfg.mlp_layer_types == ["dense", "sparse"] and cfg.indexer_types == ["full", "full"]
    assert cfg_mtp.mlp_layer_types[L] == "sparse" and cfg_mtp.indexer_types[L] == "full"

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = build_model(GlmMoeDsaForCausalLM, cfg)
        randomize_(model, gen)
        mtp = MTPLayer(cfg_mtp, L).float().eval()
        randomize_(mtp, gen)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        labels = ids.clone()
        # main pass (HF)
        out, cap = run_hf(model, ids, pos, labels)
        rs = check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        if rs is None:
            return None
        t = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        t.update(dsa_routing_tensors(cap, B, S, cfg.index_topk, S))
        g, none = collect_grads(model)
        t.update(g)
        # MTP pass (lunar's reference): fresh graph, gradients of the MTP loss alone
        model.zero_grad(set_to_none=True)
        mcap = Capture([mtp.layer], index_offset=L)
        hout = model.model(input_ids=ids, position_ids=pos, use_cache=False)
        mlogits = mtp(model, ids, pos, hout.last_hidden_state)
        mcap.remove()
        if check_router(mcap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) is None:
            return None
        mloss = ce_loss(mlogits, labels[:, 1:], shift=1, dtype=torch.float32)   # logits[s] vs labels[s + 2]
        mloss.backward()
        t["mtp.logits"] = mlogits.detach().float()
        t["mtp.loss"] = mloss.detach().reshape(1)
        for li in sorted(mcap.routing):
            logits_, w, ids_, _, _ = mcap.routing[li]
            t[f"mtp.routing.{li}"], t[f"mtp.routing_weights.{li}"] = routing_tensors(ids_, w, B, S - 1)
        mg, _ = collect_grads(model, prefix="mtp.grad.")
        t.update(mg)
        extra = {}
        for name, p in mtp.named_parameters():
            ck = f"model.layers.{L}." + name.replace("layer.", "", 1) if name.startswith("layer.") \
                else f"model.layers.{L}.{name}"
            for k, v in expert_split_grads(ck, p.detach()).items():
                extra[k] = v.float().contiguous().clone()
            if p.grad is not None:
                for k, v in expert_split_grads(ck, p.grad.detach()).items():
                    t["mtp.grad." + k] = v.float().contiguous().clone()
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                extra[f"model.layers.{L}." + name.replace("layer.", "", 1)] = b.detach().float().clone()
        return {"model": model, "tensors": t, "extra_ckpt": extra,
                "meta": {"router": rs, "params_without_grad_attr": none}}

    return try_seeds(build, "glm5_mtp")


def case_glm5_packed():
    lens = [5, 7, 4]
    S = sum(lens)
    K_IDX = 3
    cfg = glm5_config(num_hidden_layers=3, n_group=2, topk_group=1, index_topk=K_IDX,
                      indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"],
                      first_k_dense_replace=1)

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = build_model(GlmMoeDsaForCausalLM, cfg)
        randomize_(model, gen)
        docs = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in lens]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ids = torch.cat(docs, dim=1)
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
        labels = ids.clone()
        for c in cu[1:-1]:
            labels[0, c] = -100      # a document's last token predicts nothing
        n_targets = int((labels[:, 1:] != -100).sum())
        # separate runs of each document: summed token losses / all targets
        model.zero_grad(set_to_none=True)
        logits, topk, routing, rws = [], {}, {}, {}
        total = 0.0
        dsa_stats, router_gap = {}, float("inf")
        for di, d in enumerate(docs):
            n = d.shape[1]
            cap = Capture(model.model.layers)
            o = model(input_ids=d, position_ids=torch.arange(n).unsqueeze(0), use_cache=False)
            cap.remove()
            ds = check_dsa(cap, K_IDX)
            rs = check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
            if ds is None or rs is None:
                return None
            for k, v in ds.items():
                dsa_stats[k] = min(dsa_stats.get(k, v), v) if k == "min_rel_gap" else dsa_stats.get(k, 0) + v
            router_gap = min(router_gap, rs["min_rel_gap"])
            doc_loss = ce_loss(o.logits, d, dtype=torch.float32) * (n - 1)
            total = total + doc_loss
            logits.append(o.logits.detach().float())
            for li in cap.topk:
                sel = topk_tensor(cap.topk[li], cap.scores[li][1], min(K_IDX, S))
                sel = torch.where(sel >= 0, sel + cu[di], sel)
                topk.setdefault(li, []).append(sel)
            for li in cap.routing:
                _, w, rid, _, _ = cap.routing[li]
                a, bw = routing_tensors(rid, w, 1, n)
                routing.setdefault(li, []).append(a)
                rws.setdefault(li, []).append(bw)
        loss = total / n_targets
        loss.backward()
        t = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "cu_seqlens": torch.tensor(cu, dtype=torch.int64),
             "logits": torch.cat(logits, dim=1), "loss": loss.detach().float().reshape(1)}
        for li in topk:
            t[f"topk.{li}"] = torch.cat(topk[li], dim=1)
        for li in routing:
            t[f"routing.{li}"] = torch.cat(routing[li], dim=1)
            t[f"routing_weights.{li}"] = torch.cat(rws[li], dim=1)
        g, none = collect_grads(model)
        t.update(g)
        # cross-check: HF's own packed path (position_ids resets, no attention_mask, no cache)
        hf_grads = {k: v.clone() for k, v in g.items()}
        out, _ = run_hf(model, ids, pos, labels)
        g2, _ = collect_grads(model)
        d_logits = float((out.logits.detach() - t["logits"]).abs().max())
        d_loss = abs(float(out.loss.detach()) - float(loss.detach()))
        d_grad = max(float((g2[k] - hf_grads[k]).norm() / max(float(hf_grads[k].norm()), 1e-30)) for k in hf_grads)
        return {"model": model, "tensors": t,
                "meta": {"params_without_grad_attr": none, "docs": lens, "dsa": dsa_stats,
                         "router": {"min_rel_gap": router_gap},
                         "hf_packed_vs_separate": {"max_abs_logits": d_logits, "abs_loss": d_loss,
                                                   "max_rel_l2_grad": d_grad}}}

    return try_seeds(build, "glm5_packed")


def case_glm5_padded():
    B, S, K_IDX = 2, 12, 4
    real = [12, 8]
    PAD = 0
    cfg = glm5_config(num_hidden_layers=3, n_group=2, topk_group=1, index_topk=K_IDX, pad_token_id=PAD,
                      indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"],
                      first_k_dense_replace=1)

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = build_model(GlmMoeDsaForCausalLM, cfg)
        randomize_(model, gen)
        ids = torch.randint(1, cfg.vocab_size, (B, S), generator=gen)
        am = torch.zeros(B, S, dtype=torch.int64)
        for b, n in enumerate(real):
            am[b, :n] = 1
            ids[b, n:] = PAD
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        labels = ids.masked_fill(am == 0, -100)
        out, cap = run_hf(model, ids, pos, labels, attention_mask=am)
        ok = am.bool()
        ds = check_dsa(cap, K_IDX, row_ok=ok)
        rs = check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        if ds is None or rs is None:
            return None
        t = {"input_ids": ids, "position_ids": pos, "attention_mask": am, "labels": labels,
             "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        t.update(dsa_routing_tensors(cap, B, S, K_IDX, S))
        g, none = collect_grads(model)
        t.update(g)
        # cross-check: the padded row's real positions equal an unpadded run of that row
        with torch.no_grad():
            n = real[1]
            o1 = model(input_ids=ids[1:, :n], position_ids=pos[1:, :n], use_cache=False)
            d_row = float((o1.logits[0] - out.logits[1, :n]).abs().max())
        return {"model": model, "tensors": t,
                "meta": {"dsa": ds, "router": rs, "params_without_grad_attr": none, "real_lengths": real,
                         "padded_row_vs_unpadded_run_max_abs": d_row}}

    return try_seeds(build, "glm5_padded")


def case_glm5_gelu_tied():
    B, S = 2, 10
    PAD = 3
    cfg = glm5_config(num_hidden_layers=2, n_group=1, topk_group=1, index_topk=32, hidden_act="gelu",
                      tie_word_embeddings=True, attention_bias=True, pad_token_id=PAD,
                      indexer_types=["full", "full"], mlp_layer_types=["sparse", "dense"], first_k_dense_replace=0)

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = build_model(GlmMoeDsaForCausalLM, cfg)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        randomize_(model, gen, embed_std=cfg.hidden_size ** -0.5)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        ids[ids == PAD] = PAD + 1
        ids[0, 3] = PAD
        ids[1, 5] = PAD
        ids[1, 6] = PAD
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        labels = ids.clone()
        seen = {}
        h = model.lm_head.register_forward_hook(lambda m, a, o: seen.__setitem__("x", a[0].detach().clone()))
        out, cap = run_hf(model, ids, pos, labels)
        h.remove()
        rs = check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        if rs is None:
            return None
        t = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        t.update(dsa_routing_tensors(cap, B, S, cfg.index_topk, S))
        g, none = collect_grads(model)
        # tied: the pad row gets no gradient from the lookup (padding_idx) but does get the lm_head
        # part, sum_s dlogits[s, PAD] * x_final[s]; check that it is exactly that
        lg = out.logits.detach().reshape(-1, cfg.vocab_size)
        tgt = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
        valid = tgt != -100
        dlog = lg.softmax(-1)
        dlog[valid] -= F.one_hot(tgt[valid], cfg.vocab_size).float()
        dlog[~valid] = 0
        dlog /= valid.sum()
        want = dlog[:, PAD] @ seen["x"].reshape(-1, cfg.hidden_size)
        got = g["grad.model.embed_tokens.weight"][PAD]
        pad_err = float((got - want).abs().max() / want.abs().max())
        assert pad_err < 1e-5, pad_err
        t.update(g)
        return {"model": model, "tensors": t, "meta": {"router": rs, "params_without_grad_attr": none,
                                                       "tied_pad_row_grad_is_lm_head_part_only_rel_err": pad_err}}

    return try_seeds(build, "glm5_gelu_tied")


def case_glm4moe():
    B, S = 2, 12
    cfg = Glm4MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                        first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        num_nextn_predict_layers=0, max_position_embeddings=256, use_cache=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = build_model(Glm4MoeForCausalLM, cfg)
        randomize_(model, gen)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        labels = ids.clone()
        out, cap = run_hf(model, ids, pos, labels)
        rs = check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        if rs is None:
            return None
        t = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        t.update(dsa_routing_tensors(cap, B, S, 0, S))
        g, none = collect_grads(model)
        t.update(g)
        return {"model": model, "tensors": t, "meta": {"router": rs, "params_without_grad_attr": none}}

    return try_seeds(build, "glm4moe")


def hf_bf16_copy(model):
    """HF's own bf16 model with the same weights: model.to(torch.bfloat16), then back in fp32 with
    their f32 values the tensors from_pretrained(dtype=torch.bfloat16) keeps in fp32: those of
    _keep_in_fp32_modules_strict (gate.weight, e_score_correction_bias) and the rotary inv_freq
    buffers (which a bare .to() would round to bf16). verify_case checks the result against a
    from_pretrained reload bit for bit. Eager attention and experts, as the f32 model."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    keep = tuple(model._keep_in_fp32_modules_strict or ()) + ("inv_freq",)
    src = dict(model.named_parameters())
    src.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if any(name.endswith(k) for k in keep):
                t.data = src[name].detach().clone()
    m.eval()
    return m


def agreement(logits, ref):
    """top-1 agreement (fraction of positions whose argmax equals ref's) and logits relative L2."""
    a = (logits.float().argmax(-1) == ref.float().argmax(-1)).double().mean()
    rel = (logits.float() - ref.float()).double().norm() / ref.double().norm()
    return float(a), float(rel)


# the learnable sequence task glm5_bf16 is briefly trained on (and whose samples are its inputs)
BF16_TASK_P_RANDOM = 0.15   # share of positions holding a uniformly random token
BF16_TRAIN_STEPS = 300      # Adam steps, lr BF16_TRAIN_LR, BF16_TRAIN_BATCH fresh sequences each
BF16_TRAIN_LR = 3e-3
BF16_TRAIN_BATCH = 16


def chain_sequences(n, S, perm, p_random, gen):
    """n sequences of S tokens: a random first token, then each token is perm[previous token]
    (a fixed random permutation of the vocabulary: a learnable bigram chain), except that with
    probability p_random a position holds a uniformly random token instead (the chain continues
    from it). Such positions cannot be predicted, so the task is not trivial; every position's
    most likely next token is still perm[current token], so a trained model has clear top-1s."""
    V = perm.shape[0]
    x = torch.empty(n, S, dtype=torch.int64)
    x[:, 0] = torch.randint(0, V, (n,), generator=gen)
    rnd = torch.rand(n, S, generator=gen) < p_random
    tok = torch.randint(0, V, (n, S), generator=gen)
    for t in range(1, S):
        x[:, t] = torch.where(rnd[:, t], tok[:, t], perm[x[:, t - 1]])
    return x


def train_briefly_(model, S, perm, gen):
    """BF16_TRAIN_STEPS of Adam in fp32 on fresh chain_sequences batches (labels = inputs, HF's
    shifted mean CE), model in eval mode (no dropout anyway); deterministic (one thread,
    deterministic algorithms, generator-driven data). Returns the last training losses."""
    opt = torch.optim.Adam(model.parameters(), lr=BF16_TRAIN_LR)
    pos = torch.arange(S).unsqueeze(0).expand(BF16_TRAIN_BATCH, S).contiguous()
    losses = []
    for _ in range(BF16_TRAIN_STEPS):
        x = chain_sequences(BF16_TRAIN_BATCH, S, perm, BF16_TASK_P_RANDOM, gen)
        out = model(input_ids=x, position_ids=pos, labels=x, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    model.zero_grad(set_to_none=True)
    return losses


def case_glm5_bf16():
    """A larger GLM-5 model for measuring bf16 agreement (lunar bf16 vs HF f32, and HF's own bf16
    run as the baseline), briefly trained (train_briefly_) on a bigram-chain task with 15% random
    tokens so its next-token predictions have clear margins (random weights give flat logits whose
    top-1 no bf16 run can reproduce at 99%). index_topk 48 of 64 keys: DSA drops keys for queries
    48..63 of every row. The inputs are fresh samples of the task. No grad.* (size)."""
    B, S, K_IDX = 4, 64, 48
    cfg = glm5_config(vocab_size=256, hidden_size=64, intermediate_size=32, moe_intermediate_size=16,
                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                      q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                      index_head_dim=16, index_n_heads=8, n_group=1, topk_group=1, index_topk=K_IDX,
                      indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"],
                      first_k_dense_replace=1)

    def build(seed):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = build_model(GlmMoeDsaForCausalLM, cfg)
        randomize_(model, gen)
        perm = torch.randperm(cfg.vocab_size, generator=gen)
        losses = train_briefly_(model, S, perm, gen)
        ids = chain_sequences(B, S, perm, BF16_TASK_P_RANDOM, gen)
        pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        labels = ids.clone()
        cap = Capture(model.model.layers)
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
        cap.remove()
        ds = check_dsa(cap, K_IDX)
        rs = check_router(cap, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        if ds is None or rs is None:
            return None
        assert ds["queries_dropping_keys"] > 0
        t = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        t.update(dsa_routing_tensors(cap, B, S, K_IDX, S))
        # HF's own bf16 run of the same weights: the baseline lunar's bf16 is measured against
        m16 = hf_bf16_copy(model)
        assert m16.model.layers[1].mlp.gate.weight.dtype == torch.float32
        assert m16.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
        cap16 = Capture(m16.model.layers)
        with torch.no_grad():
            o16 = m16(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
        cap16.remove()
        t["logits_hf_bf16"] = o16.logits.detach().float()
        top1, rel = agreement(t["logits_hf_bf16"], t["logits"])
        # where HF-bf16's discrete decisions differ from HF-f32's (visible keys / expert sets)
        dsa_diff = 0
        for li in cap.topk:
            a = topk_tensor(cap.topk[li], cap.scores[li][1], min(K_IDX, S))
            b = topk_tensor(cap16.topk[li], cap.scores[li][1], min(K_IDX, S))
            dsa_diff += int((a != b).any(-1).sum())
        rt_diff = 0
        for li in cap.routing:
            a = cap.routing[li][2].sort(-1)[0]
            b = cap16.routing[li][2].sort(-1)[0]
            rt_diff += int((a != b).any(-1).sum())
        hf16 = {"top1_agreement": top1, "logits_rel_l2": rel, "loss": float(o16.loss.float()),
                "positions": B * S, "dsa_queries_selection_differs": dsa_diff,
                "dsa_queries_dropping_keys": ds["queries_dropping_keys"],
                "router_tokens_experts_differ": rt_diff, "router_tokens": B * S * len(cap.routing),
                "fp32_kept": sorted(model._keep_in_fp32_modules_strict) + ["rotary inv_freq"]}
        # what rounding the logits alone costs: the exact f32 logits rounded to bf16
        hf16["f32_logits_rounded_to_bf16_top1_agreement"] = agreement(t["logits"].bfloat16(), t["logits"])[0]
        # the bare cast (router weight, bias and rotary inv_freq in bf16 too), for information
        m16p = copy.deepcopy(model).to(torch.bfloat16).eval()
        with torch.no_grad():
            lp = m16p(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
        hf16["plain_cast_top1_agreement"], hf16["plain_cast_logits_rel_l2"] = agreement(lp, t["logits"])
        assert top1 >= 0.99, f"glm5_bf16: HF-bf16 top-1 agreement {top1} after training (raise BF16_TRAIN_STEPS)"
        # the trained model: its task, its margins, and that DSA and routing still matter
        lg = t["logits"]
        top2 = lg.topk(2, dim=-1)[0]
        margin = (top2[..., 0] - top2[..., 1]).flatten()
        nxt = ids[:, 1:]
        dense = copy.deepcopy(model)
        for layer in dense.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = S
        with torch.no_grad():
            ld = dense(input_ids=ids, position_ids=pos, use_cache=False).logits
        usage = {str(li): torch.bincount(cap.routing[li][2].flatten(), minlength=cfg.n_routed_experts).tolist()
                 for li in sorted(cap.routing)}
        training = {"task": "bigram chain x[t] = perm[x[t-1]] over a fixed random permutation of the vocabulary, "
                            f"a uniformly random token instead with probability {BF16_TASK_P_RANDOM}",
                    "optimizer": "Adam", "lr": BF16_TRAIN_LR, "steps": BF16_TRAIN_STEPS,
                    "batch": [BF16_TRAIN_BATCH, S], "initial_loss": losses[0],
                    "final_loss_mean_last_10": sum(losses[-10:]) / 10,
                    "input_tokens_off_chain": int((ids[:, 1:] != perm[ids[:, :-1]]).sum()),
                    "f32_top1_predicts_next_token": float((lg[:, :-1].argmax(-1) == nxt).double().mean()),
                    "f32_top1_margin_median": float(margin.median()), "f32_top1_margin_min": float(margin.min()),
                    "dense_attention_logits_rel_l2": agreement(ld, lg)[1],
                    "dense_attention_top1_agreement": agreement(ld, lg)[0],
                    "router_tokens_per_expert": usage}
        return {"model": model, "tensors": t,
                "meta": {"dsa": ds, "router": rs, "grads_omitted": True, "hf_bf16": hf16, "training": training}}

    return try_seeds(build, "glm5_bf16")


CASES = {
    "glm5_dsa": case_glm5_dsa,
    "glm5_mtp": case_glm5_mtp,
    "glm5_packed": case_glm5_packed,
    "glm5_padded": case_glm5_padded,
    "glm5_gelu_tied": case_glm5_gelu_tied,
    "glm4moe": case_glm4moe,
    "glm5_bf16": case_glm5_bf16,
}


# --------------------------------------------------------------------------------------------
# verification of the written files
# --------------------------------------------------------------------------------------------

def verify_case(name):
    d = os.path.join(OUT_ROOT, name)
    ref = load_file(os.path.join(d, "reference.safetensors"))
    with safe_open(os.path.join(d, "reference.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["lunar"])
    ckpt = load_file(os.path.join(d, "model.safetensors"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    for k, v in ref.items():
        if k in ("input_ids", "position_ids", "attention_mask", "labels", "cu_seqlens"):
            assert v.dtype == torch.int64, (k, v.dtype)
        elif k.startswith(("topk.", "routing.", "mtp.routing.")):
            assert v.dtype == torch.int32, (k, v.dtype)
        else:
            assert v.dtype == torch.float32, (k, v.dtype)
        for p in ("grad.", "mtp.grad."):
            if k.startswith(p):
                ck = k[len(p):]
                assert ck in ckpt and ckpt[ck].shape == v.shape, (k, v.shape)
    assert all(v.dtype == torch.float32 for v in ckpt.values())
    # the only checkpoint tensors without a gradient: indexer, e_score_correction_bias, and (for
    # the main loss) the MTP layer, which HF does not run
    L = cfg["num_hidden_layers"]
    for p, extra in (("grad.", f"model.layers.{L}."), ("mtp.grad.", None)):
        if p == "mtp.grad." and "mtp.logits" not in ref:
            continue
        if p == "grad." and meta.get("grads_omitted"):
            assert not any(k.startswith("grad.") for k in ref), name
            continue
        for k in ckpt:
            if p + k in ref:
                continue
            ok = ".indexer." in k or k.endswith("e_score_correction_bias") or (extra and k.startswith(extra))
            assert ok, f"{name}: {k} has no {p} entry"
    # loss from the saved logits
    loss = ce_loss(ref["logits"], ref["labels"])
    rel = abs(float(loss) - float(ref["loss"][0])) / abs(float(ref["loss"][0]))
    assert rel < 1e-6, (name, float(loss), float(ref["loss"][0]))
    res = {"loss": float(ref["loss"][0]), "loss_recomputed_rel_err": rel}
    if "mtp.logits" in ref:
        ml = ce_loss(ref["mtp.logits"], ref["labels"][:, 1:])
        mrel = abs(float(ml) - float(ref["mtp.loss"][0])) / abs(float(ref["mtp.loss"][0]))
        assert mrel < 1e-6, (name, float(ml), float(ref["mtp.loss"][0]))
        res["mtp_loss"] = float(ref["mtp.loss"][0])
        res["mtp_loss_recomputed_rel_err"] = mrel
    # reload the checkpoint the strict way and re-run the saved inputs
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import check_export
    res["reload_max_abs_logits"] = check_export.check(d, os.path.join(d, "reference.safetensors"), quiet=True)
    assert res["reload_max_abs_logits"] < 1e-5, res
    if "mtp.logits" in ref:
        res["mtp_rebuilt_max_abs_logits"] = mtp_rebuild_check(d, ref, ckpt, cfg)
        assert res["mtp_rebuilt_max_abs_logits"] < 1e-5, res
    if meta.get("grads_omitted"):
        res["fd_worst_rel"] = None
    else:
        res["fd_worst_rel"] = fd_check(d, ref)
        assert res["fd_worst_rel"] < 2e-3, res
    if "logits_hf_bf16" in ref:
        res["hf_bf16_reload"] = bf16_reload_check(d, ref, meta)
    res["files_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    res["ckpt_tensors"] = len(ckpt)
    res["ref_tensors"] = len(ref)
    res["arch"] = cfg["architectures"][0]
    res["meta"] = meta
    return res


def bf16_reload_check(d, ref, meta):
    """The saved HF-bf16 run is what from_pretrained(dtype=torch.bfloat16) gives (router weight and
    bias kept in fp32 by _keep_in_fp32_modules_strict), and the metadata's numbers follow from the
    saved logits. Returns max |reloaded bf16 logits - logits_hf_bf16|."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", experts_implementation="eager",
                                             dtype=torch.bfloat16, use_kernels=False).eval()
    kept = sorted(n for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.dtype == torch.float32)
    assert kept and all(n.endswith(("mlp.gate.weight", "e_score_correction_bias", "inv_freq")) for n in kept), kept
    with torch.no_grad():
        lg = m(input_ids=ref["input_ids"], position_ids=ref["position_ids"], use_cache=False).logits.float()
    diff = float((lg - ref["logits_hf_bf16"]).abs().max())
    assert diff == 0.0, diff
    top1, rel = agreement(ref["logits_hf_bf16"], ref["logits"])
    assert top1 == meta["hf_bf16"]["top1_agreement"] and abs(rel - meta["hf_bf16"]["logits_rel_l2"]) < 1e-9, (top1, rel)
    return diff


def mtp_rebuild_check(d, ref, ckpt, cfg):
    """Rebuilds the MTP layer from the checkpoint tensors model.layers.<L>.* alone (fusing the
    per-expert tensors as HF does) and reruns the documented MTP forward: guards the names."""
    import check_export
    model, _ = check_export.load_model(d)
    L = cfg["num_hidden_layers"]
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "dtype",
                                                     "indexer_types", "mlp_layer_types", "layer_types",
                                                     "num_nextn_predict_layers", "qk_head_dim")}
    kw["num_hidden_layers"] = L + 1
    cfg_mtp = GlmMoeDsaConfig(**kw)
    cfg_mtp._attn_implementation = "eager"
    cfg_mtp._experts_implementation = "eager"
    mtp = MTPLayer(cfg_mtp, L).float().eval()
    pre = f"model.layers.{L}."
    sd = {}
    for name, t in mtp.state_dict().items():
        ck = pre + (name[len("layer."):] if name.startswith("layer.") else name)
        if ck.endswith("mlp.experts.gate_up_proj"):
            b = ck[: -len("gate_up_proj")]
            sd[name] = torch.stack([torch.cat([ckpt[f"{b}{e}.gate_proj.weight"], ckpt[f"{b}{e}.up_proj.weight"]])
                                    for e in range(t.shape[0])])
        elif ck.endswith("mlp.experts.down_proj"):
            b = ck[: -len("down_proj")]
            sd[name] = torch.stack([ckpt[f"{b}{e}.down_proj.weight"] for e in range(t.shape[0])])
        else:
            sd[name] = ckpt[ck]
    used = {pre + (n[len("layer."):] if n.startswith("layer.") else n) for n in mtp.state_dict()}
    mtp_keys = {k for k in ckpt if k.startswith(pre) and ".mlp.experts." not in k}
    assert mtp_keys <= used, mtp_keys - used
    mtp.load_state_dict(sd, strict=True)
    with torch.no_grad():
        h = model.model(input_ids=ref["input_ids"], position_ids=ref["position_ids"], use_cache=False)
        lg = mtp(model, ref["input_ids"], ref["position_ids"], h.last_hidden_state)
    return float((lg - ref["mtp.logits"]).abs().max())


def fd_check(d, ref):
    """Central finite differences in float64 on the reloaded checkpoint for the largest-|grad|
    entries of a few tensors (per-expert gate/up/down of the most used expert, router, embedding,
    attention projections, a norm). HF keeps the router matmul in fp32 even in a float64 model,
    so eps is 3e-3 and agreement is about 1e-4; returns the worst relative error."""
    import check_export
    model, _ = check_export.load_model(d)
    model = model.double()
    params = dict(model.named_parameters())
    lab = F.pad(ref["labels"], (0, 1), value=-100)[:, 1:].reshape(-1)

    def loss():
        with torch.no_grad():
            lg = model(input_ids=ref["input_ids"], position_ids=ref["position_ids"],
                       attention_mask=ref.get("attention_mask"), use_cache=False).logits
            return float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab, ignore_index=-100))

    def locate(ck):
        """checkpoint name -> (parameter, index function)"""
        if ".mlp.experts." in ck and ck.split(".mlp.experts.")[1][0].isdigit():
            pre, rest = ck.split(".mlp.experts.")
            e, kind = int(rest.split(".")[0]), rest.split(".")[1]
            if kind == "down_proj":
                return params[pre + ".mlp.experts.down_proj"], lambda i, j: (e, i, j)
            gu = params[pre + ".mlp.experts.gate_up_proj"]
            off = 0 if kind == "gate_proj" else gu.shape[1] // 2
            return gu, lambda i, j: (e, off + i, j)
        return params[ck], (lambda i, j: (i, j))

    names = []
    grads = {k[5:]: v for k, v in ref.items() if k.startswith("grad.")}
    experts = [k for k in grads if ".mlp.experts." in k and k.endswith("gate_proj.weight")]
    if experts:
        best = max(experts, key=lambda k: float(grads[k].norm()))
        names += [best, best.replace("gate_proj", "up_proj"), best.replace("gate_proj", "down_proj")]
    for suffix in ("mlp.gate.weight", "self_attn.o_proj.weight", "self_attn.q_a_proj.weight",
                   "self_attn.kv_b_proj.weight", "self_attn.q_proj.bias", "self_attn.k_norm.weight"):
        cand = [k for k in grads if k.endswith(suffix)]
        if cand:
            names.append(cand[0])
    names += ["model.embed_tokens.weight", "model.norm.weight"]
    worst = 0.0
    for ck in names:
        g = grads[ck]
        p, idx = locate(ck)
        g2 = g.reshape(g.shape[0], -1)
        for f in g2.abs().flatten().argsort(descending=True)[:2].tolist():
            i, j = divmod(f, g2.shape[1])
            pi = idx(i, j) if g.dim() == 2 else (i,)
            old, eps = p.data[pi].item(), 3e-3
            p.data[pi] = old + eps
            lp = loss()
            p.data[pi] = old - eps
            lm = loss()
            p.data[pi] = old
            fd = (lp - lm) / (2 * eps)
            worst = max(worst, abs(fd - float(g2[i, j])) / max(abs(float(g2[i, j])), 1e-12))
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", help=f"subset of {list(CASES)}")
    ap.add_argument("--check", action="store_true", help="only verify the committed files")
    args = ap.parse_args()
    names = args.cases or list(CASES)
    for n in names:
        if n not in CASES:
            sys.exit(f"unknown case {n}; known: {list(CASES)}")
    os.makedirs(OUT_ROOT, exist_ok=True)
    for n in names:
        if not args.check:
            r = CASES[n]()
            write_case(n, r["model"], r["tensors"], r["meta"], r.get("extra_ckpt"))
        res = verify_case(n)
        m = res.pop("meta")
        print(f"{n}: {res['arch']} seed {m['seed']} (rejected {m['seeds_rejected_for_ties']}), "
              f"{res['files_bytes']} bytes, loss {res['loss']:.6f} (recomputed rel err {res['loss_recomputed_rel_err']:.1e}), "
              f"reload max|dlogits| {res['reload_max_abs_logits']:.1e}, finite-difference grads "
              f"{'omitted' if res['fd_worst_rel'] is None else format(res['fd_worst_rel'], '.1e')}")
        if res.get("hf_bf16_reload") is not None:
            print(f"    from_pretrained(dtype=bfloat16) reproduces logits_hf_bf16: max|d| {res['hf_bf16_reload']:.1e}")
        for k in ("dsa", "router", "hf_bf16", "training", "hf_packed_vs_separate", "padded_row_vs_unpadded_run_max_abs",
                  "tied_pad_row_grad_is_lm_head_part_only_rel_err"):
            if k in m:
                print(f"    {k}: {m[k]}")
        if "mtp_loss" in res:
            print(f"    mtp loss {res['mtp_loss']:.6f} (recomputed rel err {res['mtp_loss_recomputed_rel_err']:.1e}), "
                  f"MTP rebuilt from the checkpoint: max|dlogits| {res['mtp_rebuilt_max_abs_logits']:.1e}")
    total = 0
    for root, _, files in os.walk(OUT_ROOT):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"tests/fixtures/models total: {total} bytes")
    if total >= 6 * 1024 * 1024:
        sys.exit("fixtures exceed 6 MB")


if __name__ == "__main__":
    main()
