#!/usr/bin/env python3
"""Builds the fixtures of lunar.rl (tests/fixtures/rl/): the policy loss, its gradients and
metrics (loss_cases.json), the group advantages (advantages.json) and the temperature-scaled
log-probs and entropy of rows of logits (token_stats.json), computed with torch in float64 from
the definitions in docs/rl.md ("Loss math"), which restate rl-algorithms sections 1.2-1.7, 2.2,
2.4, 3.7. tests/lua/test_rl_loss.lua, test_rl_advantages.lua and test_rl_model_grad.lua read them.

Developer machine only (CI reads the committed files):

    python3 tests/ref/make_rl_loss_refs.py            # writes the fixtures
    python3 tests/ref/make_rl_loss_refs.py --check    # regenerates and compares with the files

Inputs are float32 values written exactly (repr of the float); every log-prob is a multiple of
2^-12 below 64 in magnitude, so the differences lunar forms in float32 are exact. A case is
refused and its inputs nudged when a decision (a clip bound, the dual-clip cap, the log-ratio
and k3 clamps, the TIS cap) lies within MARGIN of its threshold, so float32 arithmetic and this
float64 reference cannot decide it differently. Gradients come from torch autograd, where a
clamp passes the gradient at its bounds and maximum/minimum split it at ties (ties only occur
inside the clip range, where both branches have the same gradient).
"""
import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, '..', 'fixtures', 'rl')
MARGIN = 1e-3
QUANT = 2.0 ** -12
F64 = torch.float64


def q(x):
    """float32-exact values on the 2^-12 grid."""
    return torch.round(x / QUANT) * QUANT


# ---- the reference ----------------------------------------------------------------------------

def kl_value(lp, ref, estimator):
    if estimator == 'k1':
        return lp - ref
    if estimator == 'k2':
        return 0.5 * (lp - ref) ** 2
    x = torch.clamp(ref - lp, -20.0, 20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)


def reference(inp, cfg):
    lp = torch.tensor(inp['logprobs'], dtype=F64, requires_grad=True)
    ent = torch.tensor(inp['entropy'], dtype=F64, requires_grad=True)
    old = torch.tensor(inp['old_logprobs'], dtype=F64)
    ref = torch.tensor(inp['ref_logprobs'], dtype=F64)
    roll = torch.tensor(inp['rollout_logprobs'], dtype=F64)
    m = torch.tensor(inp['mask'], dtype=F64)
    A = torch.tensor(inp['advantages'], dtype=F64)
    if A.dim() == 1:
        A = A[:, None]
    N, T = m.shape
    valid = m > 0
    el, eh = cfg['eps_low'], cfg['eps_high']

    # 1.3 clipped surrogate, 2.2 clip-higher, dual clip for A < 0 only
    logr = torch.clamp(lp - old, -20.0, 20.0)
    r = torch.exp(logr)
    pg1 = -A * r
    pg2 = -A * torch.clamp(r, 1.0 - el, 1.0 + eh)
    pg = torch.maximum(pg1, pg2)
    clip_high = ((A > 0) & (r > 1.0 + eh) & valid)
    clip_low = ((A < 0) & (r < 1.0 - el) & valid)
    assert torch.equal((pg2 > pg1) & valid, clip_high | clip_low)
    dual = torch.zeros_like(valid)
    if cfg.get('dual_clip') is not None:
        c = cfg['dual_clip']
        pg3 = -c * A
        dual = (A < 0) & (pg > pg3) & valid
        pg = torch.where(A < 0, torch.minimum(pg, pg3), pg)
    # 3.7 token TIS, no gradient through the weight
    tis = None
    if cfg.get('tis_cap') is not None:
        rho = torch.exp(torch.clamp(old - roll, -20.0, 20.0))
        tis = torch.clamp(rho, max=cfg['tis_cap'])
        tis_capped = (rho > cfg['tis_cap']) & valid
        pg = pg * tis
    L = pg
    kl = None
    if cfg.get('kl') is not None:
        kl = kl_value(lp, ref, cfg['kl']['estimator'])
        L = L + cfg['kl']['coef'] * kl
    alpha = cfg.get('entropy_coef', 0.0)
    L = L - alpha * ent

    # 1.7 reductions as per-row weights
    red = cfg['reduction']
    tokens = valid.sum().item()
    if red == 'token-mean':
        w = torch.full((N, 1), 1.0 / tokens if tokens > 0 else 0.0, dtype=F64)
    elif red == 'seq-mean-token-sum':
        w = torch.full((N, 1), 1.0 / N, dtype=F64)
    elif red == 'seq-mean-token-mean':
        w = 1.0 / (N * m.sum(1, keepdim=True).clamp(min=1.0))
    else:
        w = torch.full((N, 1), 1.0 / (N * cfg['norm_length']), dtype=F64)

    def reduce(x):
        return (torch.where(valid, x, torch.zeros_like(x)) * w).sum()

    loss = reduce(L)
    loss.backward()

    def vmean(x):
        return (torch.where(valid, x, torch.zeros_like(x)).sum() / max(tokens, 1)).item()

    rv = r.detach()[valid]
    out = {
        'loss': loss.item(),
        'dlogprobs': lp.grad.tolist(),
        'dentropy': ent.grad.tolist() if alpha != 0 else None,
        'metrics': {
            'tokens': tokens,
            'clip_low_count': int(clip_low.sum()),
            'clip_high_count': int(clip_high.sum()),
            'dual_count': int(dual.sum()),
            'pg_loss': reduce(pg.detach()).item(),
            'ratio_mean': vmean(r.detach()),
            'ratio_min': rv.min().item() if tokens else None,
            'ratio_max': rv.max().item() if tokens else None,
            'ppo_kl': vmean(-logr.detach()),
            'approx_kl': vmean((r - 1.0 - logr).detach()),
            'entropy_mean': vmean(ent.detach()),
            'entropy_term': reduce(ent.detach()).item(),
            'rollout_logprob_abs_diff_mean': vmean((lp.detach() - roll).abs()),
        },
    }
    if kl is not None:
        out['metrics']['kl_mean'] = vmean(kl.detach())
        out['metrics']['kl_term'] = reduce(kl.detach()).item()
    if tis is not None:
        out['metrics']['tis_weight_mean'] = vmean(tis)
        out['metrics']['tis_capped_count'] = int(tis_capped.sum())
    return out


# ---- inputs -----------------------------------------------------------------------------------

def near(x, t, tol):
    return (x - t).abs() <= tol * max(1.0, abs(t))


def decisions_clear(old, lp, ref, roll, A, m, cfg):
    """True when no decision of the reference lies within MARGIN of its threshold."""
    valid = m > 0
    d = lp - old
    r = torch.exp(torch.clamp(d, -20.0, 20.0))
    bad = near(d, 20.0, MARGIN) | near(d, -20.0, MARGIN)
    bad |= near(r, 1.0 + cfg['eps_high'], MARGIN) | near(r, 1.0 - cfg['eps_low'], MARGIN)
    Ab = A[:, None].expand_as(d) if A.dim() == 1 else A
    if cfg.get('dual_clip') is not None:
        pg = torch.maximum(-Ab * r, -Ab * torch.clamp(r, 1 - cfg['eps_low'], 1 + cfg['eps_high']))
        pg3 = -cfg['dual_clip'] * Ab
        bad |= (Ab < 0) & ((pg - pg3).abs() <= MARGIN * torch.clamp(pg3.abs(), min=1.0))
    if cfg.get('kl') is not None and cfg['kl']['estimator'] == 'k3':
        x = ref - lp
        raw = torch.exp(torch.clamp(x, -20.0, 20.0)) - torch.clamp(x, -20.0, 20.0) - 1
        bad |= near(x, 20.0, MARGIN) | near(x, -20.0, MARGIN) | ((raw - 10.0).abs() <= MARGIN * 10)
    if cfg.get('tis_cap') is not None:
        rho = torch.exp(torch.clamp(old - roll, -20.0, 20.0))
        bad |= near(rho, cfg['tis_cap'], MARGIN)
    return not bool((bad & valid).any())


def make_inputs(seed, N, T, cfg, per_token_adv=False, far=False, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    for attempt in range(200):
        lp = q(-torch.rand(N, T, generator=g, dtype=F64) * 3.0 - 0.05)
        old = q(lp + torch.randn(N, T, generator=g, dtype=F64) * 0.35)
        ref = q(lp + torch.randn(N, T, generator=g, dtype=F64) * 0.6)
        roll = q(old + torch.randn(N, T, generator=g, dtype=F64) * 0.5)
        if far:
            # log-ratios far outside the clamp (+-20) and the clip range, for A > 0 (row 1) and
            # A < 0 (row 2): ratio e^20 (clamped, no gradient), ratio 20 with A < 0 (the unclipped
            # branch, or the dual-clip cap), ratios e^-20 and e^-3
            old[0, 0] = q(lp[0, 0] - 25.0)
            old[1, 1] = q(lp[1, 1] - 25.0)
            old[1, 3] = q(lp[1, 3] - 3.0)
            old[1, 0] = q(lp[1, 0] + 3.0)
            old[0, 2] = q(lp[0, 2] + 24.0)
            ref[0, 1] = q(lp[0, 1] + 4.0)     # k3 above its clamp of 10
            ref[1, 2] = q(lp[1, 2] - 22.0)    # log ratio of k3 beyond -20
            roll[0, 3] = q(old[0, 3] - 2.5)   # TIS weight capped
        if per_token_adv:
            A = torch.randn(N, T, generator=g, dtype=F64)
            A[0, 4] = 0.0
        else:
            A = torch.randn(N, generator=g, dtype=F64)
            A[0], A[1] = abs(A[0]) + 0.3, -abs(A[1]) - 0.3   # rows 1 and 2 positive and negative
            if N > 3:
                A[3] = 0.0                                      # a zero-advantage response
        A = A.to(torch.float32).to(F64)
        lengths = torch.randint(1, T + 1, (N,), generator=g)
        m = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
        m[0, :] = 1.0
        m[1, :] = 1.0
        if empty_row:
            m[N - 1, :] = 0.0                                   # an all-masked row
        ent = (torch.rand(N, T, generator=g, dtype=F64) * 2.0).to(torch.float32).to(F64)
        if decisions_clear(old, lp, ref, roll, A, m, cfg):
            return {
                'logprobs': lp.tolist(), 'old_logprobs': old.tolist(), 'ref_logprobs': ref.tolist(),
                'rollout_logprobs': roll.tolist(), 'advantages': A.tolist(), 'mask': m.tolist(),
                'entropy': ent.tolist(),
            }
    raise RuntimeError('no clear inputs for seed %d' % seed)


def base_cfg(**kw):
    cfg = {'eps_low': 0.2, 'eps_high': 0.2, 'reduction': 'token-mean'}
    cfg.update(kw)
    return cfg


def loss_cases():
    specs = [
        ('plain clip, token-mean', base_cfg(), {}),
        ('clip-higher', base_cfg(eps_high=0.28), {}),
        ('dual clip c=3, far ratios', base_cfg(eps_high=0.28, dual_clip=3.0), {'far': True}),
        ('no dual clip, far ratios', base_cfg(), {'far': True}),
        ('seq-mean-token-sum', base_cfg(reduction='seq-mean-token-sum'), {}),
        ('seq-mean-token-mean', base_cfg(reduction='seq-mean-token-mean'), {}),
        ('seq-mean-token-sum-norm', base_cfg(reduction='seq-mean-token-sum-norm', norm_length=16), {}),
        ('kl k1 in the loss', base_cfg(kl={'coef': 0.05, 'estimator': 'k1'}), {}),
        ('kl k2 in the loss', base_cfg(kl={'coef': 0.05, 'estimator': 'k2'}), {}),
        ('kl k3 in the loss, clamps active', base_cfg(kl={'coef': 0.05, 'estimator': 'k3'}), {'far': True}),
        ('tis cap 2', base_cfg(tis_cap=2.0), {'far': True}),
        ('entropy bonus', base_cfg(entropy_coef=0.01), {}),
        ('per-token advantages', base_cfg(eps_high=0.28), {'per_token_adv': True}),
        ('no masked row', base_cfg(reduction='seq-mean-token-mean'), {'empty_row': False}),
        ('everything (DAPO-like + kl k3 + tis + entropy)',
         base_cfg(eps_high=0.28, dual_clip=10.0, reduction='seq-mean-token-mean', kl={'coef': 0.01, 'estimator': 'k3'},
                  tis_cap=2.0, entropy_coef=0.003), {'far': True}),
        ('everything, token-mean, k2',
         base_cfg(eps_high=0.28, dual_clip=3.0, kl={'coef': 0.1, 'estimator': 'k2'}, tis_cap=1.5, entropy_coef=0.02),
         {'far': True, 'per_token_adv': True}),
    ]
    cases = []
    for k, (name, cfg, opts) in enumerate(specs):
        inp = make_inputs(1000 + k, 6, 9, cfg, **opts)
        cases.append({'name': name, 'cfg': cfg, 'inputs': inp, 'expected': reference(inp, cfg)})
    return cases


# ---- advantages (1.2) -------------------------------------------------------------------------

def grpo_ref(scores, sizes, std_normalize, eps=1e-6):
    out, first = [], 0
    for n in sizes:
        s = torch.tensor(scores[first:first + n], dtype=F64)
        if n == 1:
            mean, std = torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64)
        else:
            mean, std = s.mean(), s.std()   # unbiased
        a = (s - mean) / (std + eps) if std_normalize else s - mean
        out += a.tolist()
        first += n
    return out


def rloo_ref(scores, sizes):
    out, first = [], 0
    for n in sizes:
        s = torch.tensor(scores[first:first + n], dtype=F64)
        if n == 1:
            out.append(0.0)
        else:
            # mean of the other n - 1 responses
            others = (s.sum() - s) / (n - 1)
            out += (s - others).tolist()
        first += n
    return out


def advantage_cases():
    g = torch.Generator().manual_seed(7)
    cases = []
    binary = (torch.rand(32, generator=g) > 0.5).to(F64).tolist()
    binary[0:4] = [1.0, 1.0, 1.0, 1.0]   # a zero-variance group
    shaped = (torch.rand(24, generator=g, dtype=F64) * 3 - 2).tolist()   # DAPO-like -2..1
    inputs = [
        ('binary, n=4', binary, 4),
        ('binary, n=8', binary, 8),
        ('shaped, n=6', shaped, 6),
        ('uneven groups with a singleton', shaped[:13], [5, 1, 4, 3]),
    ]
    for name, scores, groups in inputs:
        sizes = groups if isinstance(groups, list) else [groups] * (len(scores) // groups)
        cases.append({
            'name': name, 'scores': scores, 'groups': groups,
            'grpo': grpo_ref(scores, sizes, True),
            'grpo_no_std': grpo_ref(scores, sizes, False),
            'rloo': rloo_ref(scores, sizes),
        })
    return cases


# ---- temperature log-probs and entropy (1.5, 1.6) ---------------------------------------------

def token_stats_cases():
    g = torch.Generator().manual_seed(11)
    cases = []
    for temperature in (1.0, 0.7, 1.3):
        R, V = 5, 37
        logits = (torch.randn(R, V, generator=g) * 3).to(torch.float32)
        targets = torch.randint(0, V, (R,), generator=g)
        z = logits.to(F64) / temperature
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        ent = -(p * logp).sum(-1)
        cases.append({
            'temperature': temperature, 'logits': logits.to(F64).tolist(), 'targets': targets.tolist(),
            'logprobs': logp.gather(1, targets[:, None]).squeeze(1).tolist(), 'entropy': ent.tolist(),
        })
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--check', action='store_true')
    args = ap.parse_args()
    torch.set_default_dtype(F64)
    files = {
        'loss_cases.json': {'cases': loss_cases()},
        'advantages.json': {'cases': advantage_cases()},
        'token_stats.json': {'cases': token_stats_cases()},
    }
    os.makedirs(OUT, exist_ok=True)
    bad = 0
    for name, data in files.items():
        path = os.path.join(OUT, name)
        text = json.dumps(data, indent=1) + '\n'
        if args.check:
            with open(path) as f:
                if f.read() != text:
                    print('differs: ' + path)
                    bad += 1
        else:
            with open(path, 'w') as f:
                f.write(text)
            print('wrote ' + path)
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
