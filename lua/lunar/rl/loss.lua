-- lunar.rl.loss: the GRPO/DAPO policy loss on per-token tensors, its gradients with respect to
-- the model's outputs (log-probs and entropy), the mini-batch normaliser that makes
-- micro-batches add up to the mini-batch, and the KL penalty for KL-in-reward. The definitions,
-- with the references they follow, are in docs/rl.md ("Loss math").
--
--   local norm = loss.normaliser({mask_1, mask_2, ...}, cfg)   -- once per mini-batch
--   local value, grads, metrics = loss.policy(inputs, cfg, norm)  -- per micro-batch
--   model:backward{dlogprobs = grads.dlogprobs, dentropy = grads.dentropy}
--
-- inputs: logprobs, old_logprobs, mask (N, T) (N responses, T token positions; mask 1 on the
-- response tokens that count, 0 elsewhere), advantages (N) per response or (N, T) per token,
-- and optionally ref_logprobs (N, T) (KL in the loss), rollout_logprobs (N, T) (TIS and the
-- rollout-vs-trainer gap), entropy (N, T) (the entropy bonus and its metric). Float tensors on
-- one device; the result is f32 there.
--
-- cfg: eps_low = 0.2, eps_high = eps_low (clip-higher: DAPO 0.2 / 0.28), dual_clip = c (> 1) or
-- nil, reduction = 'token-mean' | 'seq-mean-token-sum' | 'seq-mean-token-mean' |
-- 'seq-mean-token-sum-norm' (the last needs norm_length, the constant L of Dr. GRPO), kl =
-- {coef =, estimator = 'k1' | 'k2' | 'k3'} or nil, entropy_coef = 0, tis_cap = C or nil.
--
-- Per valid token (i, t), with r = exp(clamp(logp - old, -20, 20)):
--   pg  = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and with dual clip, for A < 0 only,
--         min(pg, -c A) (the loss is capped at c |A|)
--   tis = min(exp(clamp(old - rollout, -20, 20)), tis_cap)      (1 without TIS; no gradient)
--   L   = tis * pg + kl.coef * kl(logp, ref) - entropy_coef * entropy
-- and the loss is sum_i w_i sum_t mask * L with the per-response weight w_i of the reduction
-- over the mini-batch (T_M valid tokens, B_M responses):
--   token-mean               1 / T_M
--   seq-mean-token-sum       1 / B_M
--   seq-mean-token-mean      1 / (B_M |o_i|)          |o_i| = response i's valid tokens
--   seq-mean-token-sum-norm  1 / (B_M norm_length)
-- A plain sum over micro-batches therefore gives the mini-batch's loss and gradient exactly.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'

local M = {}

local LOG_RATIO_CLAMP = 20   -- |log ratio| clamp before exp (SkyRL safe_exp_delta, verl)
local K3_CLAMP = 10          -- k3 values clamped to [-10, 10]

M.REDUCTIONS = {['token-mean'] = true, ['seq-mean-token-sum'] = true, ['seq-mean-token-mean'] = true,
                ['seq-mean-token-sum-norm'] = true}
M.KL_ESTIMATORS = {k1 = true, k2 = true, k3 = true}

local CFG_KEYS = {eps_low = true, eps_high = true, dual_clip = true, reduction = true, norm_length = true,
                  kl = true, entropy_coef = true, tis_cap = true}

local function fail(msg) tensor.fail('lunar.rl.loss: ' .. msg) end

local function is_number(x) return type(x) == 'number' and x == x end

-- validated settings with defaults filled in (a new table)
function M.config(cfg)
    cfg = cfg or {}
    if type(cfg) ~= 'table' then fail('cfg must be a table') end
    for k in pairs(cfg) do
        if not CFG_KEYS[k] then
            fail(('cfg.%s is not a setting of the policy loss (eps_low, eps_high, dual_clip, reduction, '
                .. 'norm_length, kl, entropy_coef, tis_cap)'):format(tostring(k)))
        end
    end
    local c = {}
    c.eps_low = cfg.eps_low or 0.2
    c.eps_high = cfg.eps_high or c.eps_low
    for _, k in ipairs({'eps_low', 'eps_high'}) do
        if not is_number(c[k]) or c[k] < 0 or (k == 'eps_low' and c[k] >= 1) then
            fail(('cfg.%s must be a number in [0, %s), got %s'):format(k, k == 'eps_low' and '1' or 'inf',
                tostring(c[k])))
        end
    end
    c.reduction = cfg.reduction or 'token-mean'
    if not M.REDUCTIONS[c.reduction] then
        fail(('cfg.reduction %q is not known (token-mean, seq-mean-token-sum, seq-mean-token-mean, '
            .. 'seq-mean-token-sum-norm)'):format(tostring(c.reduction)))
    end
    if c.reduction == 'seq-mean-token-sum-norm' then
        if not is_number(cfg.norm_length) or cfg.norm_length <= 0 then
            fail(('cfg.norm_length (the constant length L of seq-mean-token-sum-norm, e.g. the prompt + response '
                .. 'budget) must be a number > 0, got %s'):format(tostring(cfg.norm_length)))
        end
        c.norm_length = cfg.norm_length
    elseif cfg.norm_length ~= nil then
        fail(('cfg.norm_length is only used by reduction seq-mean-token-sum-norm (reduction is %s)'):format(
            c.reduction))
    end
    if cfg.dual_clip ~= nil then
        if not is_number(cfg.dual_clip) or cfg.dual_clip <= 1 then
            fail(('cfg.dual_clip (c) must be a number > 1 (DAPO recipes use 10), got %s'):format(
                tostring(cfg.dual_clip)))
        end
        c.dual_clip = cfg.dual_clip
    end
    c.entropy_coef = cfg.entropy_coef or 0
    if not is_number(c.entropy_coef) then
        fail(('cfg.entropy_coef must be a number, got %s'):format(tostring(cfg.entropy_coef)))
    end
    if cfg.tis_cap ~= nil then
        if not is_number(cfg.tis_cap) or cfg.tis_cap <= 0 then
            fail(('cfg.tis_cap must be a number > 0 (SkyRL\'s default 2), got %s'):format(tostring(cfg.tis_cap)))
        end
        c.tis_cap = cfg.tis_cap
    end
    if cfg.kl ~= nil then
        if type(cfg.kl) ~= 'table' then fail('cfg.kl must be a table {coef =, estimator =}') end
        for k in pairs(cfg.kl) do
            if k ~= 'coef' and k ~= 'estimator' then fail(('cfg.kl.%s is not a setting (coef, estimator)'):format(k)) end
        end
        if not is_number(cfg.kl.coef) or cfg.kl.coef < 0 then
            fail(('cfg.kl.coef must be a number >= 0, got %s'):format(tostring(cfg.kl.coef)))
        end
        local est = cfg.kl.estimator or 'k3'
        if not M.KL_ESTIMATORS[est] then
            fail(('cfg.kl.estimator %q is not known (k1, k2, k3)'):format(tostring(est)))
        end
        c.kl = {coef = cfg.kl.coef, estimator = est}
    end
    return c
end

-- ---- inputs -------------------------------------------------------------------------------

local function shape_str(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

-- t as f32 (N, T), checked against the mask's shape
local function per_token(name, t, N, T, device)
    if not tensor.is_tensor(t) then fail(('inputs.%s must be a tensor, got a %s'):format(name, type(t))) end
    if not tensor.FLOAT_DTYPES[t:dtype()] then
        fail(('inputs.%s must be a float tensor, got %s'):format(name, t:dtype()))
    end
    if t:dim() ~= 2 or t:size(1) ~= N or t:size(2) ~= T then
        fail(('inputs.%s has shape %s, expected (%d, %d) like inputs.mask'):format(name, shape_str(t), N, T))
    end
    if t:device() ~= device then
        fail(('inputs.%s is on %s, inputs.mask on %s'):format(name, t:device(), device))
    end
    return t:dtype() == 'f32' and t or t:float()
end

-- the mask as (valid f32 1/0, invalid bool); values other than 0 and 1 are found in the one
-- read of the results (the stats' last slot)
local function mask_parts(mask)
    local valid = ops.ne(mask, 0, {dtype = 'f32'})
    local invalid = ops.eq(mask, 0)
    local odd = ops.mul(valid, ops.ne(mask, 1, {dtype = 'f32'}))   -- nonzero and not 1
    return valid, invalid, odd
end

local function check_mask(mask, op)
    if not tensor.is_tensor(mask) then fail(('%s: the mask must be a tensor, got a %s'):format(op, type(mask))) end
    if mask:dim() ~= 2 then fail(('%s: the mask has shape %s, expected (N, T)'):format(op, shape_str(mask))) end
end

-- ---- the mini-batch normaliser ----------------------------------------------------------------

-- normaliser(masks, cfg) -> {reduction =, tokens = T_M, sequences = B_M, norm_length =}
-- masks: the (N_k, T_k) masks of every micro-batch of one mini-batch (a list), or one mask. B_M
-- counts every row given, rows whose mask is all 0 included (a filtered response keeps its
-- place in the denominators, as in SkyRL). Under data parallelism, add tokens and sequences of
-- every rank (plain numbers) before the micro-batches use the normaliser, and sum (not
-- average) the gradients over ranks.
function M.normaliser(masks, cfg)
    local c = M.config(cfg)
    if tensor.is_tensor(masks) then masks = {masks} end
    if type(masks) ~= 'table' or #masks == 0 then fail('normaliser: expected a mask or a non-empty list of masks') end
    local tokens, sequences = 0, 0
    for k, mask in ipairs(masks) do
        check_mask(mask, ('normaliser: mask %d'):format(k))
        local valid, _, odd = mask_parts(mask)
        local st = core.empty({2}, 'f32', mask:device())
        ops.sum(valid, {out = st:select(1, 1)})
        ops.sum(odd, {out = st:select(1, 2)})
        local v = st:tolist_flat()
        if v[2] > 0 then
            fail(('normaliser: mask %d has %d values other than 0 and 1'):format(k, v[2]))
        end
        tokens = tokens + v[1]
        sequences = sequences + mask:size(1)
    end
    return {reduction = c.reduction, tokens = tokens, sequences = sequences, norm_length = c.norm_length}
end

-- w: a number, or an (N, 1) tensor for seq-mean-token-mean
local function row_weights(norm, valid)
    local red = norm.reduction
    if red == 'token-mean' then
        return norm.tokens > 0 and 1 / norm.tokens or 0
    elseif red == 'seq-mean-token-sum' then
        return 1 / norm.sequences
    elseif red == 'seq-mean-token-sum-norm' then
        return 1 / (norm.sequences * norm.norm_length)
    end
    local len = ops.sum(valid, 2, {keepdim = true})                 -- (N, 1)
    return ops.div_(ops.reciprocal(ops.maximum(len, 1)), norm.sequences)
end

local function check_norm(norm, c)
    if type(norm) ~= 'table' or type(norm.tokens) ~= 'number' or type(norm.sequences) ~= 'number' then
        fail('policy: norm must come from loss.normaliser(masks, cfg)')
    end
    if norm.reduction ~= c.reduction then
        fail(('policy: the normaliser was made for reduction %s, cfg.reduction is %s'):format(
            tostring(norm.reduction), c.reduction))
    end
    if norm.sequences <= 0 then fail('policy: the normaliser counts no sequences') end
    if c.reduction == 'seq-mean-token-sum-norm' and norm.norm_length ~= c.norm_length then
        fail(('policy: the normaliser was made with norm_length %s, cfg.norm_length is %s'):format(
            tostring(norm.norm_length), tostring(c.norm_length)))
    end
end

-- ---- KL estimators ----------------------------------------------------------------------------

-- kl(logp, ref) and d kl / d logp, per token (f32 (N, T)), with delta = logp - ref:
--   k1 = delta; k2 = delta^2 / 2; k3: x = clamp(ref - logp, -20, 20), e^x - x - 1 clamped to
--   [-10, 10]. A clamp passes the gradient where its input lies within the bounds (inclusive),
--   as torch.clamp does.
local function kl_estimate(logp, ref, estimator)
    if estimator == 'k1' then
        return ops.sub(logp, ref), nil   -- gradient 1
    elseif estimator == 'k2' then
        local delta = ops.sub(logp, ref)
        return ops.mul(ops.square(delta), 0.5), delta
    end
    local x = ops.sub(ref, logp)
    local xin = ops.mul(ops.ge(x, -LOG_RATIO_CLAMP, {dtype = 'f32'}), ops.le(x, LOG_RATIO_CLAMP, {dtype = 'f32'}))
    x = ops.minimum(ops.maximum(x, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    local e = ops.exp(x)
    local raw = ops.sub_(ops.sub(e, x), 1)
    local kin = ops.mul(ops.ge(raw, -K3_CLAMP, {dtype = 'f32'}), ops.le(raw, K3_CLAMP, {dtype = 'f32'}))
    local kl = ops.minimum(ops.maximum(raw, -K3_CLAMP), K3_CLAMP)
    -- d/dlogp (e^x - x - 1) with x = ref - logp: -(e^x - 1) = 1 - e^x
    local grad = ops.mul_(ops.mul_(ops.sub(1, e), xin), kin)
    return kl, grad
end

-- kl_penalty(logprobs, ref_logprobs, mask, coef[, estimator = 'k1']) -> token, sequence, kl_mean
-- KL in the reward: token (N, T) = coef * kl per valid token (0 elsewhere), to subtract from the
-- per-token reward; sequence: a Lua list of its row sums, to subtract from each response's
-- scalar score (the score is the sum of the token rewards); kl_mean: the mean kl over valid
-- tokens (before coef). verl's default estimator for KL in the reward is k1 (logprobs of the
-- policy that sampled, the recomputed old log-probs, minus the reference's).
function M.kl_penalty(logprobs, ref_logprobs, mask, coef, estimator)
    estimator = estimator or 'k1'
    if not M.KL_ESTIMATORS[estimator] then fail(('kl_penalty: estimator %q is not known (k1, k2, k3)'):format(
        tostring(estimator))) end
    if not is_number(coef) then fail(('kl_penalty: coef must be a number, got %s'):format(tostring(coef))) end
    check_mask(mask, 'kl_penalty')
    local N, T, dev = mask:size(1), mask:size(2), mask:device()
    local lp = per_token('logprobs', logprobs, N, T, dev)
    local ref = per_token('ref_logprobs', ref_logprobs, N, T, dev)
    local valid, invalid, odd = mask_parts(mask)
    local kl = ops.masked_fill_(kl_estimate(lp, ref, estimator), invalid, 0)
    local token = ops.mul(kl, coef)
    local seq = ops.sum(token, 2)                                   -- (N)
    local st = core.empty({3}, 'f32', dev)
    ops.sum(kl, {out = st:select(1, 1)})
    ops.sum(valid, {out = st:select(1, 2)})
    ops.sum(odd, {out = st:select(1, 3)})
    local v = st:tolist_flat()
    if v[3] > 0 then fail(('kl_penalty: the mask has %d values other than 0 and 1'):format(v[3])) end
    return token, seq:tolist_flat(), v[2] > 0 and v[1] / v[2] or 0
end

-- ---- the policy loss --------------------------------------------------------------------------

-- policy(inputs, cfg[, norm]) -> loss (number), grads, metrics
--   norm: from loss.normaliser over the mini-batch's masks; without it the micro-batch is taken
--   as the whole mini-batch.
--   grads = {dlogprobs = (N, T) f32, dentropy = (N, T) f32 or nil (entropy_coef 0)}: d loss /
--   d inputs, 0 at masked tokens.
--   metrics (over this micro-batch's valid tokens; metrics.tokens of them), see docs/rl.md.
function M.policy(inputs, cfg, norm)
    local c = M.config(cfg)
    if type(inputs) ~= 'table' then fail('policy: inputs must be a table of tensors') end
    local mask = inputs.mask
    check_mask(mask, 'policy')
    local N, T, dev = mask:size(1), mask:size(2), mask:device()
    norm = norm or M.normaliser(mask, cfg)
    check_norm(norm, c)
    local lp = per_token('logprobs', inputs.logprobs, N, T, dev)
    local old = per_token('old_logprobs', inputs.old_logprobs, N, T, dev)
    local adv = inputs.advantages
    if not tensor.is_tensor(adv) then fail(('inputs.advantages must be a tensor, got a %s'):format(type(adv))) end
    if adv:dim() == 1 and adv:size(1) == N then
        adv = adv:view(N, 1)
    elseif not (adv:dim() == 2 and adv:size(1) == N and adv:size(2) == T) then
        fail(('inputs.advantages has shape %s, expected (%d) per response or (%d, %d) per token'):format(
            shape_str(adv), N, N, T))
    end
    if adv:device() ~= dev then fail(('inputs.advantages is on %s, inputs.mask on %s'):format(adv:device(), dev)) end
    if not tensor.FLOAT_DTYPES[adv:dtype()] then fail('inputs.advantages must be a float tensor') end
    if adv:dtype() ~= 'f32' then adv = adv:float() end
    local ref = inputs.ref_logprobs and per_token('ref_logprobs', inputs.ref_logprobs, N, T, dev)
    local rollout = inputs.rollout_logprobs and per_token('rollout_logprobs', inputs.rollout_logprobs, N, T, dev)
    local entropy = inputs.entropy and per_token('entropy', inputs.entropy, N, T, dev)
    local kl_on = c.kl and c.kl.coef ~= 0
    if kl_on and not ref then fail('policy: cfg.kl.coef > 0 needs inputs.ref_logprobs') end
    if c.tis_cap and not rollout then fail('policy: cfg.tis_cap needs inputs.rollout_logprobs') end
    if c.entropy_coef ~= 0 and not entropy then fail('policy: cfg.entropy_coef ~= 0 needs inputs.entropy') end

    local valid, invalid, odd = mask_parts(mask)
    local w = row_weights(norm, valid)

    -- ratio r = exp(clamp(logp - old, -20, 20)); the clamp passes the gradient inside the bounds
    local d = ops.sub(lp, old)
    local din = ops.mul(ops.ge(d, -LOG_RATIO_CLAMP, {dtype = 'f32'}), ops.le(d, LOG_RATIO_CLAMP, {dtype = 'f32'}))
    local dc = ops.minimum(ops.maximum(d, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    local r = ops.exp(dc)
    local apos = ops.gt(adv, 0, {dtype = 'f32'})
    local aneg = ops.lt(adv, 0, {dtype = 'f32'})
    -- the clipped branch is the larger loss exactly where the clip moved r against A's sign
    local clip_high = ops.mul(ops.gt(r, 1 + c.eps_high, {dtype = 'f32'}), apos)
    local clip_low = ops.mul(ops.lt(r, 1 - c.eps_low, {dtype = 'f32'}), aneg)
    local rc = ops.minimum(ops.maximum(r, 1 - c.eps_low), 1 + c.eps_high)
    local nadv = ops.neg(adv)
    local pg = ops.maximum(ops.mul(nadv, r), ops.mul(nadv, rc))
    -- d pg / d logp = -A r where the unclipped branch is taken (and the log-ratio clamp passes)
    local active = ops.sub(1, ops.add(clip_high, clip_low))
    local dual
    if c.dual_clip then
        -- -c A for A < 0, +inf elsewhere: min(pg, .) caps only negative-advantage tokens
        local cap = ops.masked_fill_(ops.mul(adv, -c.dual_clip), ops.ge(adv, 0), math.huge)
        dual = ops.gt(pg, cap, {dtype = 'f32'})
        pg = ops.minimum(pg, cap)
        ops.mul_(active, ops.sub(1, dual))
    end
    ops.mul_(active, din)
    local dpg = ops.mul_(ops.mul(nadv, r), active)                  -- d pg / d logp

    local tis, tis_capped
    if c.tis_cap then
        local rho = ops.exp(ops.minimum(ops.maximum(ops.sub(old, rollout), -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP))
        tis_capped = ops.gt(rho, c.tis_cap, {dtype = 'f32'})
        tis = ops.minimum(rho, c.tis_cap)
        pg = ops.mul(pg, tis)
        ops.mul_(dpg, tis)
    end

    -- per-token loss and its gradient
    local tok = ops.masked_fill(pg, invalid, 0)
    local dlp = ops.masked_fill(dpg, invalid, 0)
    local kl
    if kl_on or (ref and c.kl) then
        local kgrad
        kl, kgrad = kl_estimate(lp, ref, c.kl.estimator)
        ops.masked_fill_(kl, invalid, 0)
        if kl_on then
            ops.add_(tok, ops.mul(kl, c.kl.coef))
            if kgrad then
                ops.add_(dlp, ops.masked_fill_(ops.mul(kgrad, c.kl.coef), invalid, 0))
            else
                ops.add_(dlp, ops.mul(valid, c.kl.coef))
            end
        end
    end
    local ent
    if entropy then
        ent = ops.masked_fill(entropy, invalid, 0)
        if c.entropy_coef ~= 0 then ops.sub_(tok, ops.mul(ent, c.entropy_coef)) end
    end
    -- weights of the reduction
    local weighted = ops.mul(tok, w)
    ops.mul_(dlp, w)
    local dent
    if entropy and c.entropy_coef ~= 0 then dent = ops.mul(ops.mul(valid, -c.entropy_coef), w) end

    -- every number comes back in one read
    local slots, names = {}, {}
    local function stat(name, t, how)
        names[#names + 1] = name
        slots[#slots + 1] = {t = t, how = how or 'sum'}
    end
    local function on_valid(t) return ops.masked_fill(t, invalid, 0) end
    stat('loss', weighted)
    stat('tokens', valid)
    stat('odd_mask', odd)
    stat('pg_loss', ops.mul(on_valid(pg), w))
    stat('clip_low', on_valid(clip_low))
    stat('clip_high', on_valid(clip_high))
    if dual then stat('dual', on_valid(dual)) end
    stat('ratio_sum', on_valid(r))
    stat('ratio_min', ops.masked_fill(r, invalid, math.huge), 'min')
    stat('ratio_max', ops.masked_fill(r, invalid, -math.huge), 'max')
    stat('ppo_kl', on_valid(ops.neg(dc)))
    -- k3 of the old policy against the current one: r - 1 - log r
    stat('approx_kl', on_valid(ops.sub_(ops.sub(r, dc), 1)))
    if ent then
        stat('entropy', ent)
        stat('entropy_term', ops.mul(ent, w))
    end
    if kl then
        stat('kl', kl)
        stat('kl_term', ops.mul(kl, w))
    end
    if tis then
        stat('tis_weight', on_valid(tis))
        stat('tis_capped', on_valid(tis_capped))
    end
    if rollout then
        local gap = on_valid(ops.abs(ops.sub(lp, rollout)))
        stat('rollout_gap', gap)
        stat('rollout_gap_max', gap, 'max')
    end
    local st = core.empty({#slots}, 'f32', dev)
    for k, s in ipairs(slots) do
        local out = st:select(1, k)
        if s.how == 'sum' then ops.sum(s.t, {out = out})
        elseif s.how == 'min' then ops.min(s.t, {out = out})
        else ops.max(s.t, {out = out}) end
    end
    local vals = st:tolist_flat()
    local v = {}
    for k, name in ipairs(names) do v[name] = vals[k] end
    if v.odd_mask > 0 then fail(('policy: inputs.mask has %d values other than 0 and 1'):format(v.odd_mask)) end

    local n = v.tokens
    local function mean(x) return n > 0 and x / n or 0 end
    local metrics = {
        tokens = n,
        pg_loss = v.pg_loss,
        pg_clipfrac_low = mean(v.clip_low),
        pg_clipfrac_high = mean(v.clip_high),
        pg_clipfrac = mean(v.clip_low + v.clip_high),
        pg_clipfrac_dual = mean(v.dual or 0),
        ratio_mean = mean(v.ratio_sum),
        ratio_min = n > 0 and v.ratio_min or nil,
        ratio_max = n > 0 and v.ratio_max or nil,
        ppo_kl = mean(v.ppo_kl),
        approx_kl = mean(v.approx_kl),
        entropy_mean = v.entropy and mean(v.entropy) or nil,
        kl_mean = v.kl and mean(v.kl) or nil,
        kl_term = v.kl_term,
        entropy_term = v.entropy_term,
        tis_weight_mean = v.tis_weight and mean(v.tis_weight) or nil,
        tis_capped_frac = v.tis_capped and mean(v.tis_capped) or nil,
        rollout_logprob_abs_diff_mean = v.rollout_gap and mean(v.rollout_gap) or nil,
        rollout_logprob_abs_diff_max = (v.rollout_gap_max and n > 0) and v.rollout_gap_max or nil,
    }
    return v.loss, {dlogprobs = dlp, dentropy = dent}, metrics
end

-- every name policy()'s metrics may hold (some only with their setting, or with tokens), in one
-- order, with how the micro-batches' values make the mini-batch's (lunar.rl.policy; over the
-- micro-batches of every data-parallel rank): 'sum' (a share of the mini-batch's value: the
-- token count, the weighted loss terms), 'mean' (a mean over the micro-batch's trained tokens:
-- weighted by them), 'min' and 'max'
M.METRICS = {{'tokens', 'sum'}, {'pg_loss', 'sum'}, {'pg_clipfrac_low', 'mean'}, {'pg_clipfrac_high', 'mean'},
    {'pg_clipfrac', 'mean'}, {'pg_clipfrac_dual', 'mean'}, {'ratio_mean', 'mean'}, {'ratio_min', 'min'},
    {'ratio_max', 'max'}, {'ppo_kl', 'mean'}, {'approx_kl', 'mean'}, {'entropy_mean', 'mean'}, {'kl_mean', 'mean'},
    {'kl_term', 'sum'}, {'entropy_term', 'sum'}, {'tis_weight_mean', 'mean'}, {'tis_capped_frac', 'mean'},
    {'rollout_logprob_abs_diff_mean', 'mean'}, {'rollout_logprob_abs_diff_max', 'max'}}

return M
