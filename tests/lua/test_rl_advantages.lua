-- test_rl_advantages.lua: lunar.rl.advantages against torch (tests/fixtures/rl/advantages.json,
-- made by tests/ref/make_rl_loss_refs.py in float64: torch.mean, torch.std (unbiased), eps on
-- the std, singleton groups mean 0 / std 1; RLOO as the score minus the mean of the others):
-- GRPO with and without std normalisation (Dr. GRPO) and RLOO, even and uneven groups, within
-- 1e-12; the counts in info; check() on recipe settings; the errors of bad input.
local io_ = require 'lunar.io'
local adv = require 'lunar.rl.advantages'
local T = require('lunar.testing').suite('rl.advantages')

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local fx = io_.read_json(here .. '/../fixtures/rl/advantages.json')

assert(#fx.cases >= 4, 'fixture cases: ' .. #fx.cases)

local TOL = {rtol = 1e-12, atol = 1e-12}

for _, case in ipairs(fx.cases) do
    T:test(case.name .. ': grpo, grpo without std, rloo match torch', function()
        local a = adv.grpo(case.scores, case.groups)
        T.close(a, case.grpo, {rtol = TOL.rtol, atol = TOL.atol, msg = 'grpo'})
        local b = adv.grpo(case.scores, case.groups, {std_normalize = false})
        T.close(b, case.grpo_no_std, {rtol = TOL.rtol, atol = TOL.atol, msg = 'grpo without std'})
        local c = adv.rloo(case.scores, case.groups)
        T.close(c, case.rloo, {rtol = TOL.rtol, atol = TOL.atol, msg = 'rloo'})
        -- compute() dispatches to the same functions
        T.equal(adv.compute(case.scores, case.groups, {estimator = 'grpo'}), a, 'compute grpo')
        T.equal(adv.compute(case.scores, case.groups, {estimator = 'rloo'}), c, 'compute rloo')
        T.equal(adv.compute(case.scores, case.groups, {std_normalize = false}), b, 'compute grpo no std')
    end)
end

T:test('info counts groups, singleton groups and zero-variance groups', function()
    local scores = {1, 1, 1, 0, 1, 0, 0.5, 2, 2}
    local a, info = adv.grpo(scores, {3, 3, 1, 2}, {std_normalize = false})
    assert(info.groups == 4 and info.singleton_groups == 1 and info.zero_variance_groups == 2,
        ('%d %d %d'):format(info.groups, info.singleton_groups, info.zero_variance_groups))
    -- zero-variance groups give 0, the singleton its raw score
    T.equal({a[1], a[2], a[3], a[8], a[9]}, {0, 0, 0, 0, 0}, 'zero variance')
    assert(a[7] == 0.5, 'singleton: the raw score')
    local r, rinfo = adv.rloo(scores, {3, 3, 1, 2})
    assert(r[7] == 0 and rinfo.singleton_groups == 1)
end)

T:test('eps is added to the std: a tiny spread is not blown up', function()
    local a = adv.grpo({0, 1e-7}, 2)
    -- std = 1e-7 / sqrt(2); (s - mean) / (std + 1e-6)
    local std = 1e-7 / math.sqrt(2)
    T.close(a[2], 0.5e-7 / (std + 1e-6), {rtol = 1e-12, atol = 0})
    local b = adv.grpo({0, 1e-7}, 2, {eps = 0})
    T.close(b[2], 1 / math.sqrt(2), {rtol = 1e-12, atol = 0})
end)

T:test('check(): refuses one sample per prompt, accepts n >= 2', function()
    T.raises(function() adv.check{estimator = 'grpo', n = 1, std_normalize = true} end,
        "n = 1 sample per prompt with GRPO's std normalisation")
    T.raises(function() adv.check{n = 1} end, "n = 1 sample per prompt with GRPO's std normalisation")
    T.raises(function() adv.check{estimator = 'grpo', n = 1, std_normalize = false} end, 'n = 1 sample per prompt')
    T.raises(function() adv.check{estimator = 'rloo', n = 1} end, 'no leave-one-out baseline')
    T.raises(function() adv.check{estimator = 'ppo', n = 4} end, 'estimator "ppo" is not known')
    T.raises(function() adv.check{n = 2.5} end, 'n (samples per prompt) must be a positive integer')
    assert(adv.check{estimator = 'grpo', n = 2})
    assert(adv.check{estimator = 'rloo', n = 16})
end)

T:test('bad scores and groups: one clear error each', function()
    T.raises(function() adv.grpo({1, 2, 3}, 2) end, '3 scores do not divide into groups of 2')
    T.raises(function() adv.grpo({1, 'x', 3, 4}, 2) end, 'score 2 is a string')
    T.raises(function() adv.grpo({1, 0 / 0}, 2) end, 'score 2 is nan')
    T.raises(function() adv.rloo({1, math.huge}, 2) end, 'score 2 is inf')
    T.raises(function() adv.grpo({1, 2, 3}, {2, 2}) end, 'the group sizes sum to 4, but there are 3 scores')
    T.raises(function() adv.grpo({1, 2}, {2, 0}) end, 'group size 2 is 0')
    T.raises(function() adv.grpo({1, 2}, 0) end, 'the group size must be a positive integer')
    T.raises(function() adv.grpo({1, 2}, 'two') end, 'groups must be a group size or a list of group sizes')
    T.raises(function() adv.grpo({1, 2, x = 3}, 2) end, 'found the key x')
    T.raises(function() adv.compute({1, 2}, 2, {estimator = 'gae'}) end, 'estimator "gae" is not known')
end)

os.exit(T:run())
