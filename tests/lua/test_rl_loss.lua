-- test_rl_loss.lua: lunar.rl.loss against torch (tests/fixtures/rl/loss_cases.json, made by
-- tests/ref/make_rl_loss_refs.py in float64 from the definitions in docs/rl.md):
--   every reduction, KL estimator (in the loss), dual clip, clip-higher, TIS, entropy bonus,
--   per-response and per-token advantages, far-out ratios and an all-masked row: loss and
--   d loss / d logprobs, d loss / d entropy within 1e-6 (absolute + relative) of torch, clip,
--   dual-clip and TIS-cap counts equal, the other metrics within 1e-6;
--   a mini-batch split into micro-batches (one normaliser) gives the whole mini-batch's
--   gradients bit for bit and its loss to rounding;
--   KL in the reward; the errors of bad settings and inputs.
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local loss = require 'lunar.rl.loss'
local ops = lunar.ops
local T = require('lunar.testing').suite('rl.loss')

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local FIXTURE = here .. '/../fixtures/rl/loss_cases.json'
local fx = io_.read_json(FIXTURE)

local TOL = {rtol = 1e-6, atol = 1e-6}

local function nn(v) if v == nil or io_.is_null(v) then return nil end return v end

local function inputs_of(case)
    local inp = {}
    for k, v in pairs(case.inputs) do inp[k] = lunar.tensor(v) end
    return inp
end

-- the fixture's cfg as a Lua table (kl is a nested table)
local function cfg_of(case)
    local c = {}
    for k, v in pairs(case.cfg) do c[k] = v end
    return c
end

local function close_number(got, want, what)
    T.close(got, want, {rtol = TOL.rtol, atol = TOL.atol, msg = what})
end

assert(#fx.cases >= 16, 'fixture cases: ' .. #fx.cases)

for _, case in ipairs(fx.cases) do
    T:test(case.name .. ': loss, gradients and metrics match torch', function()
        local inp, cfg, e = inputs_of(case), cfg_of(case), case.expected
        local value, grads, m = loss.policy(inp, cfg)
        close_number(value, e.loss, 'loss')
        T.close(grads.dlogprobs, e.dlogprobs, {rtol = TOL.rtol, atol = TOL.atol, msg = 'dlogprobs'})
        if nn(e.dentropy) then
            T.close(grads.dentropy, e.dentropy, {rtol = TOL.rtol, atol = TOL.atol, msg = 'dentropy'})
        else
            assert(grads.dentropy == nil, 'no entropy coefficient: no dentropy')
        end
        local em = e.metrics
        local n = em.tokens
        assert(m.tokens == n, ('tokens %s vs %s'):format(m.tokens, n))
        -- counts: equal (fractions of the same token count)
        T.equal(m.pg_clipfrac_low * n, em.clip_low_count, 'clip low count')
        T.close(m.pg_clipfrac_high * n, em.clip_high_count, {rtol = 0, atol = 1e-9, msg = 'clip high count'})
        T.close(m.pg_clipfrac_low * n, em.clip_low_count, {rtol = 0, atol = 1e-9, msg = 'clip low count'})
        T.close(m.pg_clipfrac_dual * n, em.dual_count, {rtol = 0, atol = 1e-9, msg = 'dual clip count'})
        T.close(m.pg_clipfrac, (em.clip_low_count + em.clip_high_count) / n, {rtol = 1e-12, atol = 0, msg = 'clipfrac'})
        if cfg.tis_cap then
            T.close(m.tis_capped_frac * n, em.tis_capped_count, {rtol = 0, atol = 1e-9, msg = 'tis capped count'})
            close_number(m.tis_weight_mean, em.tis_weight_mean, 'tis weight mean')
        else
            assert(m.tis_capped_frac == nil and m.tis_weight_mean == nil)
        end
        for _, k in ipairs({'pg_loss', 'ratio_mean', 'ppo_kl', 'approx_kl', 'entropy_mean',
                            'rollout_logprob_abs_diff_mean'}) do
            close_number(m[k], em[k], k)
        end
        close_number(m.ratio_min, em.ratio_min, 'ratio_min')
        close_number(m.ratio_max, em.ratio_max, 'ratio_max')
        if cfg.kl then
            close_number(m.kl_mean, em.kl_mean, 'kl_mean')
            close_number(m.kl_term, em.kl_term, 'kl_term')
        end
        close_number(m.entropy_term, em.entropy_term, 'entropy_term')
        -- the loss is its terms
        local sum = m.pg_loss + (cfg.kl and cfg.kl.coef * m.kl_term or 0) - (cfg.entropy_coef or 0) * m.entropy_term
        close_number(value, sum, 'loss = pg + kl - entropy terms')
    end)
end

T:test('the fixture covers what it claims (far ratios, dual clip, caps, empty rows)', function()
    local dual, capped, clipped_low, clipped_high, empty_rows, k3_clamped = 0, 0, 0, 0, 0, false
    for _, case in ipairs(fx.cases) do
        local em = case.expected.metrics
        dual = dual + em.dual_count
        capped = capped + (nn(em.tis_capped_count) or 0)
        clipped_low = clipped_low + em.clip_low_count
        clipped_high = clipped_high + em.clip_high_count
        for _, row in ipairs(case.inputs.mask) do
            local s = 0
            for _, x in ipairs(row) do s = s + x end
            if s == 0 then empty_rows = empty_rows + 1 end
        end
        if case.cfg.kl and case.cfg.kl.estimator == 'k3' and (nn(em.kl_mean) or 0) > 1 then k3_clamped = true end
    end
    assert(dual > 0 and capped > 0 and clipped_low > 0 and clipped_high > 0 and empty_rows > 0 and k3_clamped,
        ('dual %d capped %d low %d high %d empty %d k3 %s'):format(dual, capped, clipped_low, clipped_high, empty_rows,
            tostring(k3_clamped)))
end)

-- rows [first, first + count) of every (N, T) or (N) input
local function rows(inp, first, count)
    local out = {}
    for k, t in pairs(inp) do out[k] = t:narrow(1, first, count):contiguous() end
    return out
end

for _, pick in ipairs({1, 6, 15, 16}) do
    local case = fx.cases[pick]
    T:test('micro-batches (2 + 3 + 1 rows) with the mini-batch normaliser = the mini-batch: ' .. case.name, function()
        local inp, cfg = inputs_of(case), cfg_of(case)
        local whole, gw = loss.policy(inp, cfg)
        local parts = {{1, 2}, {3, 3}, {6, 1}}
        local masks = {}
        for i, p in ipairs(parts) do masks[i] = inp.mask:narrow(1, p[1], p[2]) end
        local norm = loss.normaliser(masks, cfg)
        local total = 0
        for _, p in ipairs(parts) do
            local v, g = loss.policy(rows(inp, p[1], p[2]), cfg, norm)
            total = total + v
            T.equal(g.dlogprobs, gw.dlogprobs:narrow(1, p[1], p[2]), 'dlogprobs of rows ' .. p[1])
            if gw.dentropy then T.equal(g.dentropy, gw.dentropy:narrow(1, p[1], p[2]), 'dentropy') end
        end
        T.close(total, whole, {rtol = 1e-6, atol = 1e-7, msg = 'sum of micro-batch losses'})
        -- without the normaliser each micro-batch would be its own mini-batch: a different loss
        -- (token-mean and seq-mean reductions depend on the mini-batch's counts)
        local alone = 0
        for _, p in ipairs(parts) do alone = alone + loss.policy(rows(inp, p[1], p[2]), cfg) end
        assert(math.abs(alone - whole) > 1e-6 * math.abs(whole), 'micro-batch normalisation should differ')
    end)
end

T:test('normaliser counts: tokens over all masks, every row a sequence', function()
    local m1 = lunar.tensor({{1, 1, 0}, {0, 0, 0}})
    local m2 = lunar.tensor({{1, 1, 1}})
    local n = loss.normaliser({m1, m2}, {reduction = 'seq-mean-token-mean'})
    assert(n.tokens == 5 and n.sequences == 3 and n.reduction == 'seq-mean-token-mean')
    T.raises(function() loss.normaliser({lunar.tensor({{1, 0.5}})}) end, 'values other than 0 and 1')
end)

T:test('KL in the reward: per-token k1 penalty and per-response sums', function()
    local lp = lunar.tensor({{-1.0, -2.0, -0.5}, {-0.25, -3.0, -1.0}})
    local ref = lunar.tensor({{-1.5, -1.0, -0.5}, {-0.5, -2.0, -4.0}})
    local mask = lunar.tensor({{1, 1, 0}, {1, 1, 1}})
    local token, seq, mean = loss.kl_penalty(lp, ref, mask, 0.1)
    T.close(token, {{0.05, -0.1, 0}, {0.025, -0.1, 0.3}}, {rtol = 1e-6, atol = 1e-7})
    T.close(seq, {-0.05, 0.225}, {rtol = 1e-6, atol = 1e-7})
    T.close(mean, (0.5 - 1 + 0.25 - 1 + 3) / 5, {rtol = 1e-6, atol = 1e-7})
    -- k3 and k2 agree with the loss's estimators (kl_mean of a loss with those settings)
    for _, est in ipairs({'k2', 'k3'}) do
        local _, _, m3 = loss.kl_penalty(lp, ref, mask, 1, est)
        local _, _, pm = loss.policy({logprobs = lp, old_logprobs = lp, advantages = lunar.zeros(2), mask = mask,
            ref_logprobs = ref}, {kl = {coef = 1, estimator = est}})
        T.close(m3, pm.kl_mean, {rtol = 1e-6, atol = 1e-7, msg = est})
    end
end)

T:test('masked positions may hold anything (inf, nan): no effect on loss or gradients', function()
    local case = fx.cases[3]
    local inp, cfg = inputs_of(case), cfg_of(case)
    local v1, g1 = loss.policy(inp, cfg)
    local invalid = ops.eq(inp.mask, 0)
    for _, k in ipairs({'logprobs', 'old_logprobs', 'rollout_logprobs', 'ref_logprobs', 'entropy'}) do
        inp[k] = ops.masked_fill(inp[k], invalid, 0 / 0)
    end
    inp.rollout_logprobs = ops.masked_fill(inp.rollout_logprobs, invalid, -math.huge)
    inp.advantages = ops.masked_fill(inp.advantages:view(6, 1):expand(6, 9):contiguous(), invalid, math.huge)
    local v2, g2 = loss.policy(inp, cfg)
    assert(v1 == v2, ('loss %.9g vs %.9g'):format(v1, v2))
    T.equal(g2.dlogprobs, g1.dlogprobs, 'dlogprobs')
end)

T:test('settings and inputs: one clear error each', function()
    local inp = inputs_of(fx.cases[1])
    local function try(cfg, pattern, i) T.raises(function() loss.policy(i or inp, cfg) end, pattern) end
    try({reduction = 'token_mean'}, 'cfg.reduction "token_mean" is not known')
    try({reduction = 'seq-mean-token-sum-norm'}, 'cfg.norm_length')
    try({norm_length = 5}, 'only used by reduction seq-mean-token-sum-norm')
    try({dual_clip = 1}, 'cfg.dual_clip (c) must be a number > 1')
    try({kl = {coef = 0.1, estimator = 'k4'}}, 'cfg.kl.estimator "k4" is not known')
    try({eps_lo = 0.2}, 'cfg.eps_lo is not a setting')
    try({tis_cap = 2}, 'cfg.tis_cap needs inputs.rollout_logprobs', {logprobs = inp.logprobs,
        old_logprobs = inp.old_logprobs, advantages = inp.advantages, mask = inp.mask})
    try({kl = {coef = 0.1}}, 'cfg.kl.coef > 0 needs inputs.ref_logprobs', {logprobs = inp.logprobs,
        old_logprobs = inp.old_logprobs, advantages = inp.advantages, mask = inp.mask})
    try({entropy_coef = 0.1}, 'needs inputs.entropy', {logprobs = inp.logprobs,
        old_logprobs = inp.old_logprobs, advantages = inp.advantages, mask = inp.mask})
    local bad = {}
    for k, v in pairs(inp) do bad[k] = v end
    bad.old_logprobs = inp.old_logprobs:narrow(2, 1, 4)
    try({}, 'inputs.old_logprobs has shape (6, 4), expected (6, 9) like inputs.mask', bad)
    bad.old_logprobs = inp.old_logprobs
    bad.advantages = lunar.zeros(5)
    try({}, 'inputs.advantages has shape (5), expected (6) per response or (6, 9) per token', bad)
    bad.advantages = inp.advantages
    bad.mask = ops.mul(inp.mask, 0.5)
    try({}, ('mask 1 has %d values other than 0 and 1'):format(fx.cases[1].expected.metrics.tokens), bad)
    local norm = loss.normaliser(inp.mask, {reduction = 'token-mean'})
    T.raises(function() loss.policy(inp, {reduction = 'seq-mean-token-mean'}, norm) end,
        'the normaliser was made for reduction token-mean')
end)

os.exit(T:run())
