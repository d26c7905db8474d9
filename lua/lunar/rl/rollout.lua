-- lunar.rl.rollout: one rollout step of an RL run: n samples for each of a batch of prompts from
-- lunar.generate, on the very model being trained, scored by the reward, shaped, and (DAPO)
-- filtered to the groups that teach something.
--
--   local rollout = require 'lunar.rl.rollout'
--   local groups, stats = rollout.collect(run, step)
--
-- run: {cfg (the recipe), model, tok, sampler (lunar.rl.prompts), reward (lunar.rl.rewards.get),
-- stop_ids, moe (the model routes tokens: record the routes for replay)}.
-- Each group: {problem = {ids, gold, ...}, samples = {{prompt_ids, ids, text, logprobs (list),
-- finish_reason, routing, score (the reward's), correct, reward (score + overlong penalty),
-- train (false: the overlong filter, or a reward that failed under on_reward_error=skip)}}}.
--
-- Draws: prompt i of round k of step s samples from the stream seeded by
-- (rollout.seed, s, k, i), so a step's samples do not depend on anything but the weights, and a
-- resumed run draws what the uninterrupted one drew.
--
-- Overlong shaping (DAPO, rl-algorithms 2.5): with rl.overlong_buffer = L_cache > 0 and
-- L_max = rollout.max_new_tokens, a response of |y| tokens (its stop token included) gets
-- min(0, ((L_max - L_cache) - |y|) / L_cache) * rl.overlong_penalty added to its score.
-- Overlong filter: a response cut at L_max (finish_reason 'length') trains nothing; its reward
-- still counts in its group's statistics.
-- Dynamic sampling (DAPO, 2.3): a group whose samples are all correct or all wrong is dropped
-- (on correctness, not on the shaped reward); rounds of rl.prompts new prompts are generated
-- until rl.prompts groups are kept, at most rl.max_gen_batches rounds (0: no limit). A step
-- whose rounds run out trains on the groups it kept (stats.short says by how many it fell
-- short), and one that kept none trains nothing (stats.kept = 0); both are in the metrics.
local lunar = require 'lunar'
local core = require 'lunar.core'
local rlpar = require 'lunar.rl.parallel'

local M = {}

-- the seed of prompt i of round k of step s: 52 bits of the stream (seed, s, k) at place i
local function seed_of(seed, step, round, i)
    local r = core.rng_new(seed):split('rl_rollout'):split(step):split(round)
    return math.floor(r:uniform_at(i - 1) * 2 ^ 52)
end
M.seed_of = seed_of

-- generate and score rl.n samples for each problem -> groups, generation stats. at[i]: the place
-- of problems[i] in the round (its stream; data parallel generates a share of the round)
local function round_of(run, problems, at, step, round)
    local cfg = run.cfg
    local rl, ro = cfg.rl, cfg.rollout
    local prompts = {}
    for i, p in ipairs(problems) do prompts[i] = {ids = p.ids, seed = seed_of(ro.seed, step, round, at[i])} end
    local t0 = lunar.clock()
    -- (a rank with no prompt of the round generates nothing, except under expert parallel, where
    -- it takes part in the others' forwards)
    local results = (#prompts > 0 or run.dp.ep) and lunar.generate(run.model, prompts, {tokenizer = run.tok,
        n = rl.n, max_new_tokens = ro.max_new_tokens, temperature = ro.temperature, top_k = ro.top_k, top_p = ro.top_p,
        min_p = ro.min_p, seed = ro.seed, stop_token_ids = run.stop_ids, routing = run.moe or nil,
        max_batch = ro.max_batch}) or {}
    local seconds = lunar.clock() - t0
    local groups, tokens = {}, 0
    for i, p in ipairs(problems) do groups[i] = {problem = p, samples = {}, at = at[i]} end
    local L_max, L_cache = ro.max_new_tokens, rl.overlong_buffer or 0
    local skipped = 0
    for _, res in ipairs(results) do
        local g = groups[res.prompt]
        local s = {prompt_ids = prompts[res.prompt].ids, ids = res.ids, text = res.text or '', logprobs = res.logprobs,
                   finish_reason = res.finish_reason, routing = res.routing, train = true}
        tokens = tokens + #res.ids
        local got, why = run.reward(s.text, g.problem.gold, {prompt = g.problem.index, sample = res.sample,
            problem = g.problem})
        if got then
            s.score, s.correct = got.score, got.correct
        else
            -- on_reward_error = skip: the sample scores 0, trains nothing, and is counted
            s.score, s.correct, s.train, s.reward_error = 0, false, false, why
            skipped = skipped + 1
        end
        s.reward = s.score
        if L_cache > 0 then
            local expected = L_max - L_cache
            if #s.ids > expected then
                s.reward = s.reward + math.min(0, (expected - #s.ids) / L_cache) * rl.overlong_penalty
            end
        end
        if rl.overlong_filter and s.finish_reason == 'length' then s.train = false end
        g.samples[#g.samples + 1] = s
    end
    return groups, {seconds = seconds, tokens = tokens, reward_errors = skipped}
end

-- a group teaches something unless its samples are all correct or all wrong (or it has one)
local function informative(g)
    if #g.samples < 2 then return true end
    local first = g.samples[1].correct
    for i = 2, #g.samples do if g.samples[i].correct ~= first then return true end end
    return false
end

-- collect(run, step) -> groups (rl.prompts of them, fewer when dynamic sampling ran out), stats.
-- Data parallel (run.dp; lunar.rl.parallel): this rank's share of them, each with g.position its
-- place among every rank's kept groups; the stats count every rank's groups, except gen_seconds,
-- gen_tokens, reward_errors and all (this rank's), which the trainer adds up.
function M.collect(run, step)
    local rl = run.cfg.rl
    local dp = run.dp
    local stats = {rounds = 0, generated = 0, kept = 0, dropped = 0, gen_seconds = 0, gen_tokens = 0, short = 0,
                   reward_errors = 0, all = {}}
    local kept, nkept = {}, 0
    while true do
        stats.rounds = stats.rounds + 1
        local problems = run.sampler:next(rl.prompts)          -- every rank draws the whole round
        local at = rlpar.mine(dp, #problems, rl.mini_batches)
        local mine = {}
        for k, i in ipairs(at) do mine[k] = problems[i] end
        local groups, gs = round_of(run, mine, at, step, stats.rounds)
        stats.gen_seconds, stats.gen_tokens = stats.gen_seconds + gs.seconds, stats.gen_tokens + gs.tokens
        stats.reward_errors = stats.reward_errors + gs.reward_errors
        stats.generated = stats.generated + #problems
        -- which groups of the round teach something, every rank's, in round order
        local flags = {}
        for i = 1, #problems do flags[i] = 0 end
        local held = {}
        for _, g in ipairs(groups) do
            stats.all[#stats.all + 1] = g
            flags[g.at], held[g.at] = informative(g) and 1 or 0, g
        end
        flags = rlpar.union(dp, flags, #problems)
        for i = 1, #problems do
            if not rl.dynamic_sampling or flags[i] == 1 then
                if nkept < rl.prompts then
                    nkept = nkept + 1
                    local g = held[i]
                    if g then g.position = nkept; kept[#kept + 1] = g end
                end
            else
                stats.dropped = stats.dropped + 1
            end
        end
        if nkept >= rl.prompts then break end
        if rl.max_gen_batches > 0 and stats.rounds >= rl.max_gen_batches then
            stats.short = rl.prompts - nkept
            break
        end
    end
    stats.kept = nkept
    return kept, stats
end

return M
