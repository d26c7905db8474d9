-- lunar.eval.metrics: accuracy over k samples per problem, per dataset.
--
--   local metrics = require('lunar.eval.metrics')
--   metrics.pass_at_k(n, c, k)   -- 1 - C(n-c, k) / C(n, k): the chance that at least one of k
--                                -- samples drawn without replacement from n, c of them correct,
--                                -- is correct (the unbiased estimator of pass@k)
--   local report = metrics.summarize(samples, {k = {1, 4, 16}})
--       samples: a list of {dataset = 'gsm8k', problem = 17 (any id), correct = true|false,
--                score = 1 (optional, the grader's reward)}, one per generated sample, in any
--                order; every problem of a dataset needs the same number n of samples.
--       k: the pass@k to report (default {1, n}); each must be 1 <= k <= n.
--       report[i] = {dataset =, problems =, n = (samples per problem),
--                    avg = avg@n (the mean over problems of each problem's fraction correct),
--                    pass = {[k] = pass@k averaged over problems, ...},
--                    mean_score = (mean reward over samples, when every sample has a score)}
--       in the order the datasets first appear; report.by_dataset[name] is the same table.
--   metrics.scalars(report, prefix)   -- {['<prefix>/<dataset>/avg@n'] = .., ['.../pass@k'] = ..,
--                                     --  ['.../mean_score'] = ..} for a metrics logger
--
-- pass@k is computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), the same ratio of binomials without
-- forming them: C(200, 100) alone is past 1e58 and C(2000, 1000) past a double's range, while
-- each factor here lies in [0, 1]. With n - c < k every draw of k holds a correct sample: 1.
local M = {}

local function is_count(x) return type(x) == 'number' and x == math.floor(x) and x >= 0 and x < 2 ^ 53 end

function M.pass_at_k(n, c, k)
    if not is_count(n) or n < 1 then
        error(('metrics.pass_at_k: n (samples) must be a positive integer, got %s'):format(tostring(n)), 2)
    end
    if not is_count(c) or c > n then
        error(('metrics.pass_at_k: c (correct samples) must be an integer in [0, n = %d], got %s'):format(
            n, tostring(c)), 2)
    end
    if not is_count(k) or k < 1 or k > n then
        error(('metrics.pass_at_k: k must be an integer in [1, n = %d] (pass@k needs at least k samples), got %s')
            :format(n, tostring(k)), 2)
    end
    if n - c < k then return 1 end
    local miss = 1   -- C(n-c, k) / C(n, k): the chance that k draws are all incorrect
    for i = n - c + 1, n do miss = miss * (1 - k / i) end
    return 1 - miss
end

local function sample_error(i, what)
    error(('metrics.summarize: sample %d %s'):format(i, what), 3)
end

function M.summarize(samples, opts)
    opts = opts or {}
    if type(samples) ~= 'table' then
        error(('metrics.summarize: samples must be a list of tables, got %s'):format(type(samples)), 2)
    end
    if opts.k ~= nil and type(opts.k) ~= 'table' then
        error(('metrics.summarize: k must be a list of integers, got %s'):format(type(opts.k)), 2)
    end
    -- group: dataset -> problem -> {n, c}; first-seen order of datasets and problems
    local order, groups = {}, {}
    for i, s in ipairs(samples) do
        if type(s) ~= 'table' then sample_error(i, 'is not a table') end
        if type(s.dataset) ~= 'string' or s.dataset == '' then sample_error(i, 'has no dataset name') end
        if s.problem == nil then sample_error(i, 'has no problem id') end
        if type(s.correct) ~= 'boolean' then
            sample_error(i, ('has correct = %s, expected true or false'):format(tostring(s.correct)))
        end
        if s.score ~= nil and type(s.score) ~= 'number' then
            sample_error(i, ('has score = %s, expected a number'):format(tostring(s.score)))
        end
        local g = groups[s.dataset]
        if not g then
            g = {problems = {}, list = {}, score_sum = 0, scored = 0, samples = 0}
            groups[s.dataset] = g
            order[#order + 1] = s.dataset
        end
        local p = g.problems[s.problem]
        if not p then
            p = {id = s.problem, n = 0, c = 0}
            g.problems[s.problem] = p
            g.list[#g.list + 1] = p
        end
        p.n = p.n + 1
        if s.correct then p.c = p.c + 1 end
        g.samples = g.samples + 1
        if s.score ~= nil then
            g.score_sum = g.score_sum + s.score
            g.scored = g.scored + 1
        end
    end

    local report = {by_dataset = {}}
    for _, name in ipairs(order) do
        local g = groups[name]
        local n = g.list[1].n
        for _, p in ipairs(g.list) do
            if p.n ~= n then
                error(('metrics.summarize: dataset %s: problem %s has %d samples and problem %s has %d; '
                    .. 'avg@k and pass@k need the same number for every problem'):format(
                    name, tostring(g.list[1].id), n, tostring(p.id), p.n), 2)
            end
        end
        local ks = opts.k or (n > 1 and {1, n} or {1})
        local entry = {dataset = name, problems = #g.list, n = n, pass = {}}
        local acc = 0
        for _, p in ipairs(g.list) do acc = acc + p.c / n end
        entry.avg = acc / #g.list
        for _, k in ipairs(ks) do
            if not is_count(k) or k < 1 or k > n then
                error(('metrics.summarize: dataset %s: pass@%s needs 1 <= k <= %d (the samples per problem)')
                    :format(name, tostring(k), n), 2)
            end
            local sum = 0
            for _, p in ipairs(g.list) do sum = sum + M.pass_at_k(n, p.c, k) end
            entry.pass[k] = sum / #g.list
        end
        if g.scored == g.samples then entry.mean_score = g.score_sum / g.samples end
        report[#report + 1] = entry
        report.by_dataset[name] = entry
    end
    return report
end

function M.scalars(report, prefix)
    local out = {}
    local head = prefix and (prefix .. '/') or ''
    for _, e in ipairs(report) do
        out[('%s%s/avg@%d'):format(head, e.dataset, e.n)] = e.avg
        for k, v in pairs(e.pass) do out[('%s%s/pass@%d'):format(head, e.dataset, k)] = v end
        if e.mean_score then out[('%s%s/mean_score'):format(head, e.dataset)] = e.mean_score end
    end
    return out
end

return M
