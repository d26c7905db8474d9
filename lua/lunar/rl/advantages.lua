-- lunar.rl.advantages: outcome advantages from one scalar score per response, computed over
-- the groups of responses that share a prompt (docs/rl.md, "Advantages").
--
--   local adv, info = advantages.grpo(scores, groups[, {std_normalize = true, eps = 1e-6}])
--   local adv, info = advantages.rloo(scores, groups)
--   local adv, info = advantages.compute(scores, groups, {estimator = 'grpo'|'rloo', ...})
--   advantages.check{estimator = 'grpo', n = 16, std_normalize = true}   -- a recipe's setting
--
-- scores: a flat Lua list of numbers, one per response, each group's responses contiguous.
-- groups: the group size n (a number dividing #scores) or a list of group sizes (uneven groups,
-- summing to #scores). The result is a Lua list of the same length as scores; the loop
-- broadcasts it over each response's tokens. info = {groups =, singleton_groups =,
-- zero_variance_groups =} counts what the loop may want to log.
--
-- GRPO (SkyRL's and verl's compute_grpo_outcome_advantage): per group, mean and the unbiased
-- standard deviation (divides by n - 1, torch.std's default); A = (s - mean) / (std + eps), the
-- epsilon added to the std, not the variance. std_normalize = false is Dr. GRPO: A = s - mean.
-- A group of one has mean 0 and std 1 by that convention, so its advantage is the raw score
-- (divided by 1 + eps under std normalisation): counted in info.singleton_groups; check() refuses a recipe that would make every group one.
-- RLOO: A = s - (mean of the other n - 1 scores) = n / (n - 1) * (s - mean); a group of one has
-- no baseline and gets 0 (as SkyRL does), also counted.
local M = {}

local DEFAULT_EPS = 1e-6

local function fail(msg) error('lunar.rl.advantages: ' .. msg, 0) end

local function check_scores(scores, op)
    if type(scores) ~= 'table' then fail(('%s: scores must be a list of numbers, got a %s'):format(op, type(scores))) end
    local n = #scores
    for i = 1, n do
        local s = scores[i]
        if type(s) ~= 'number' then
            fail(('%s: score %d is a %s (%s), expected a number'):format(op, i, type(s), tostring(s)))
        end
        if s ~= s or s == math.huge or s == -math.huge then
            fail(('%s: score %d is %s, expected a finite number'):format(op, i, tostring(s)))
        end
    end
    for k in pairs(scores) do
        if type(k) ~= 'number' or k < 1 or k > n or k ~= math.floor(k) then
            fail(('%s: scores must be a list (keys 1..%d), found the key %s'):format(op, n, tostring(k)))
        end
    end
    return n
end

-- groups (a size or a list of sizes) -> list of sizes covering n scores
local function group_sizes(groups, n, op)
    local sizes = {}
    if type(groups) == 'number' then
        if groups < 1 or groups ~= math.floor(groups) then
            fail(('%s: the group size must be a positive integer, got %s'):format(op, tostring(groups)))
        end
        if n % groups ~= 0 then
            fail(('%s: %d scores do not divide into groups of %d (give a list of group sizes for uneven groups)'):format(
                op, n, groups))
        end
        for g = 1, n / groups do sizes[g] = groups end
    elseif type(groups) == 'table' then
        local total = 0
        for g, size in ipairs(groups) do
            if type(size) ~= 'number' or size < 1 or size ~= math.floor(size) then
                fail(('%s: group size %d is %s, expected a positive integer'):format(op, g, tostring(size)))
            end
            sizes[g] = size
            total = total + size
        end
        if total ~= n then
            fail(('%s: the group sizes sum to %d, but there are %d scores'):format(op, total, n))
        end
    else
        fail(('%s: groups must be a group size or a list of group sizes, got a %s'):format(op, type(groups)))
    end
    return sizes
end

-- mean and unbiased std of scores[first .. first + size - 1]
local function group_stats(scores, first, size)
    local sum = 0
    for i = first, first + size - 1 do sum = sum + scores[i] end
    local mean = sum / size
    local sq = 0
    for i = first, first + size - 1 do
        local d = scores[i] - mean
        sq = sq + d * d
    end
    return mean, math.sqrt(sq / (size - 1))
end

local function is_constant(scores, first, size)
    for i = first + 1, first + size - 1 do
        if scores[i] ~= scores[first] then return false end
    end
    return true
end

function M.grpo(scores, groups, opts)
    opts = opts or {}
    local n = check_scores(scores, 'grpo')
    local sizes = group_sizes(groups, n, 'grpo')
    local std_normalize = opts.std_normalize ~= false
    local eps = opts.eps or DEFAULT_EPS
    if type(eps) ~= 'number' or eps < 0 then fail(('grpo: eps must be a number >= 0, got %s'):format(tostring(eps))) end
    local adv = {}
    local info = {groups = #sizes, singleton_groups = 0, zero_variance_groups = 0}
    local first = 1
    for _, size in ipairs(sizes) do
        if size == 1 then
            -- mean 0, std 1 (the raw score, over 1 + eps with std normalisation)
            info.singleton_groups = info.singleton_groups + 1
            adv[first] = std_normalize and scores[first] / (1 + eps) or scores[first]
        else
            local mean, std = group_stats(scores, first, size)
            if is_constant(scores, first, size) then info.zero_variance_groups = info.zero_variance_groups + 1 end
            for i = first, first + size - 1 do
                if std_normalize then
                    adv[i] = (scores[i] - mean) / (std + eps)
                else
                    adv[i] = scores[i] - mean
                end
            end
        end
        first = first + size
    end
    return adv, info
end

function M.rloo(scores, groups)
    local n = check_scores(scores, 'rloo')
    local sizes = group_sizes(groups, n, 'rloo')
    local adv = {}
    local info = {groups = #sizes, singleton_groups = 0, zero_variance_groups = 0}
    local first = 1
    for _, size in ipairs(sizes) do
        if size == 1 then
            info.singleton_groups = info.singleton_groups + 1
            adv[first] = 0
        else
            local mean = group_stats(scores, first, size)
            if is_constant(scores, first, size) then info.zero_variance_groups = info.zero_variance_groups + 1 end
            local factor = size / (size - 1)
            for i = first, first + size - 1 do adv[i] = (scores[i] - mean) * factor end
        end
        first = first + size
    end
    return adv, info
end

M.ESTIMATORS = {grpo = true, rloo = true}

local function estimator_of(cfg, op)
    local est = cfg.estimator or 'grpo'
    if not M.ESTIMATORS[est] then
        fail(('%s: estimator %q is not known (grpo, rloo)'):format(op, tostring(est)))
    end
    return est
end

-- compute(scores, groups, {estimator = 'grpo', std_normalize = true, eps = 1e-6})
function M.compute(scores, groups, cfg)
    cfg = cfg or {}
    local est = estimator_of(cfg, 'compute')
    if est == 'rloo' then return M.rloo(scores, groups) end
    return M.grpo(scores, groups, cfg)
end

-- check{estimator =, n = samples per prompt, std_normalize =}: refuses settings under which
-- every group has one response (no baseline: GRPO with std normalisation would train on raw
-- scores, RLOO on zeros). Returns true.
function M.check(cfg)
    if type(cfg) ~= 'table' then fail('check: expected a table {estimator =, n =, std_normalize =}') end
    local est = estimator_of(cfg, 'check')
    local n = cfg.n
    if type(n) ~= 'number' or n < 1 or n ~= math.floor(n) then
        fail(('check: n (samples per prompt) must be a positive integer, got %s'):format(tostring(n)))
    end
    if n == 1 then
        if est == 'grpo' and cfg.std_normalize ~= false then
            fail('n = 1 sample per prompt with GRPO\'s std normalisation: a group of one has no spread (mean 0, '
                .. 'std 1 by convention), so every advantage would be the raw score; sample n >= 2 per prompt')
        elseif est == 'grpo' then
            fail('n = 1 sample per prompt with GRPO (std_normalize = false): every advantage would be the raw '
                .. 'score (mean 0 for a group of one); sample n >= 2 per prompt')
        else
            fail('n = 1 sample per prompt with RLOO: a group of one has no leave-one-out baseline and every '
                .. 'advantage would be 0; sample n >= 2 per prompt')
        end
    end
    return true
end

return M
