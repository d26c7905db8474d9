-- lunar.rl.trainer: the RL loop behind recipes/gsm8k.lua (GRPO) and recipes/dapo.lua (DAPO).
--
--   local trainer = require 'lunar.rl.trainer'
--   local result = trainer.run(cfg)     -- cfg: a validated recipe (recipes/common.lua, kind grpo or dapo)
--
-- One step (run_step below, the whole algorithm on one screen): generate rl.n samples for each of
-- rl.prompts prompts with the model being trained (lunar.rl.rollout: rewards, overlong shaping,
-- dynamic sampling), advantages per group (lunar.rl.advantages), the training batches
-- (lunar.rl.batch: packed micro-batches, the routes generation chose), reference and old
-- logprobs once, then rl.epochs passes over rl.mini_batches mini-batches, one optimizer step each
-- (lunar.rl.policy, lunar.rl.loss). Then metrics, a greedy evaluation of data.valid every
-- train.eval_every steps (and before the first and after the last), and checkpoints (the setup
-- and the tail of the step are lunar.train.runner's, shared with the training recipes).
--
-- A checkpoint holds the whole RL state: the policy (or its adapters), the optimizer and its
-- schedule, the prompt order's position and the step. Generation draws from streams keyed by
-- (rollout.seed, step, round, prompt) and every forward is deterministic, so a resumed run's
-- later steps are bit-identical to the uninterrupted run's (timings aside).
--
-- The learning-rate schedule counts optimizer steps: train.steps x rl.epochs x rl.mini_batches.
--
-- Under mpirun the step's prompts are split over the data-parallel ranks and the model over
-- parallel.tp / ep / etp as the training recipes split it (lunar.rl.parallel: each rank generates
-- and trains its share; lunar.generate runs on the split model); rank 0 prints and writes.
local lunar = require 'lunar'
local core = require 'lunar.core'
local runner = require 'lunar.train.runner'
local rewards = require 'lunar.rl.rewards'
local prompts = require 'lunar.rl.prompts'
local rollout = require 'lunar.rl.rollout'
local advantages = require 'lunar.rl.advantages'
local rlbatch = require 'lunar.rl.batch'
local policy = require 'lunar.rl.policy'
local rlpar = require 'lunar.rl.parallel'

local user_error = core.user_error
local strip_where = lunar.config.strip_where
local log = runner.log

local M = {}

-- ---- setup --------------------------------------------------------------------------------------

-- the ids that end a response: the model's eos ids and the chat template's end-of-turn tokens
local function stop_ids(model, tok)
    local list, seen = {}, {}
    local function add(v)
        if type(v) == 'table' then for _, x in ipairs(v) do add(x) end
        elseif type(v) == 'number' and not seen[v] then seen[v] = true; list[#list + 1] = v end
    end
    add(model.cfg.eos_token_id)
    for _, t in ipairs({'<|user|>', '<|observation|>', '<|endoftext|>'}) do add(tok:token_to_id(t)) end
    return list
end

local function setup(cfg)
    -- several ranks: the step's prompts split over dp, the model over tp / ep / etp
    -- (lunar.rl.parallel); rank 0 prints and writes the run's files
    local run = runner.begin(cfg, function(_, mcfg)
        local need = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
        if mcfg.max_position_embeddings and need > mcfg.max_position_embeddings then
            user_error(('rollout.max_prompt_len + rollout.max_new_tokens = %d is longer than the model\'s '
                .. 'max_position_embeddings=%d'):format(need, mcfg.max_position_embeddings))
        end
    end)
    local dp = run.dp
    run.reward = rewards.get(cfg.rl.reward, {on_error = cfg.rl.on_reward_error})
    local d = cfg.data
    local popts = {tokenizer = run.tok, reward = cfg.rl.reward, template = d.template,
                   enable_thinking = cfg.rollout.enable_thinking, prompt_field = d.prompt_field,
                   answer_field = d.answer_field, max_prompt_len = cfg.rollout.max_prompt_len, limit = d.limit}
    run.problems = prompts.load(d.train, popts)
    log(cfg, 'data.train: %d problems (%d prompts longer than rollout.max_prompt_len=%d left out)',
        #run.problems.problems, run.problems.too_long, cfg.rollout.max_prompt_len)
    if d.valid then
        popts.limit = cfg.rl.eval_limit
        run.valid = prompts.load(d.valid, popts).problems
    end
    run.sampler = prompts.sampler(run.problems, {seed = d.seed, shuffle = d.shuffle ~= false})

    local o, rl = cfg.optim, cfg.rl
    local per_step = rl.epochs * rl.mini_batches
    runner.build(run, {
        lr = o.lr, betas = o.betas, eps = o.eps, weight_decay = o.weight_decay, no_decay = o.no_decay,
        clip = o.clip_grad, accum = 1,
        schedule = {warmup = (o.warmup or 0) * per_step, total = cfg.train.steps * per_step, decay = o.schedule,
                    min_lr = o.min_lr}},
        {after_model = function()
            -- the reference policy of the KL term: the base under the adapters, or the starting
            -- weights (split as the policy is)
            if (cfg.rl.kl_coef or 0) > 0 then
                if not cfg.peft then run.ref_model = runner.build_model(cfg, nil, dp) end
                run.ref_policy = policy.reference(run)
            end
            run.stop_ids = stop_ids(run.model, run.tok)
            run.moe_layers = {}
            for i, L in ipairs(run.model.layers) do
                if L.mlp_type == 'sparse' then run.moe_layers[#run.moe_layers + 1] = i - 1 end
            end
            run.moe = #run.moe_layers > 0
            run.share_prompts = cfg.rl.share_prompts
            if run.share_prompts and run.model.no_shared_prompts then
                run.share_prompts = false
                log(cfg, 'rl.share_prompts: off for %s (%s)', run.mcfg.architecture or run.mcfg.model_type,
                    run.model.no_shared_prompts)
            end
            return run.moe and (cfg.rl.routing_replay and ', routing replay on' or ', routing replay off') or ''
        end})
    if not dp.single then
        log(cfg, '  rl: each step\'s %d prompts split over the %d dp ranks (%s a rank)', rl.prompts, dp.size,
            rl.prompts % dp.size == 0 and tostring(rl.prompts / dp.size) or 'about ' .. math.floor(rl.prompts / dp.size))
    end
    local st = run.st
    if st then
        local ok, err = pcall(run.sampler.set_state, run.sampler, st.data)
        if not ok then
            if not cfg.checkpoint.allow_changes then user_error(('resuming %s: %s'):format(st.dir, strip_where(err))) end
            log(cfg, 'note: the prompt position was not restored (%s): the prompts start from the beginning',
                strip_where(err))
        end
        run.start = st.step
        log(cfg, 'resumed from %s (step %d)', st.dir, run.start)
    end
    return run
end

-- ---- evaluation and checkpoints ------------------------------------------------------------------

-- greedy accuracy of the policy on data.valid (graded by rl.reward); data parallel: each dp rank
-- generates every dp-th problem (the tp members of a group the same ones) and the counts add up
local function evaluate(run)
    if run.adapters then run.adapters:eval() end
    local dp = run.dp
    local list, problems = {}, {}
    for i, p in ipairs(run.valid) do
        if (i - 1) % dp.size == dp.rank then list[#list + 1] = p.ids; problems[#problems + 1] = p end
    end
    -- (expert parallel: a rank with no problem still takes part in the others' forwards)
    local res = (#list > 0 or dp.ep) and lunar.scope(function()
        return lunar.generate(run.model, list, {tokenizer = run.tok, max_new_tokens = run.cfg.rollout.max_new_tokens,
            temperature = 0, stop_token_ids = run.stop_ids, max_batch = run.cfg.rollout.max_batch})
    end) or {}
    if run.adapters then run.adapters:train() end
    local correct, len = 0, 0
    for _, r in ipairs(res) do
        local p = problems[r.prompt]
        local got = run.reward(r.text or '', p.gold, {prompt = p.index, sample = 1, problem = p})
        if got and got.correct then correct = correct + 1 end
        len = len + #r.ids
    end
    correct, len = rlpar.sum(dp, correct, len)
    return correct / #run.valid, len / #run.valid
end

-- every rank calls it (data parallel: the model's pieces or the gathered adapters are collective)
local function save_checkpoint(run, step, m)
    runner.save_checkpoint(run, step, m, run.sampler:state(), m:counts())
end

-- ---- one step -----------------------------------------------------------------------------------

-- what the generated samples say: reward, accuracy, lengths (over every sample of the step, of
-- every dp rank)
local function rollout_stats(all, max_new, dp)
    local n, sum, sumsq, correct, lens, clipped, maxlen = 0, 0, 0, 0, 0, 0, 0
    for _, g in ipairs(all) do
        for _, s in ipairs(g.samples) do
            n, sum = n + 1, sum + s.reward
            if s.correct then correct = correct + 1 end
            lens = lens + #s.ids
            if #s.ids > maxlen then maxlen = #s.ids end
            if s.finish_reason == 'length' or #s.ids >= max_new then clipped = clipped + 1 end
        end
    end
    n, sum, correct, lens, clipped = rlpar.sum(dp, n, sum, correct, lens, clipped)
    maxlen = rlpar.max(dp, maxlen)
    local mean = n > 0 and sum / n or 0
    -- the spread about the global mean (a second pass, as one rank computes it)
    for _, g in ipairs(all) do
        for _, s in ipairs(g.samples) do sumsq = sumsq + (s.reward - mean) ^ 2 end
    end
    sumsq = rlpar.sum(dp, sumsq)
    local m = math.max(n, 1)
    return {reward_mean = mean, reward_std = n > 1 and math.sqrt(sumsq / (n - 1)) or 0, accuracy = correct / m,
            response_len_mean = lens / m, response_len_max = maxlen, response_clip_frac = clipped / m}
end

-- each sample's advantage from the rewards of its group (the shaped rewards)
local function assign_advantages(groups, rl)
    local scores, sizes = {}, {}
    for g, grp in ipairs(groups) do
        sizes[g] = #grp.samples
        for _, s in ipairs(grp.samples) do scores[#scores + 1] = s.reward end
    end
    if #scores == 0 then return end
    local adv = advantages.compute(scores, sizes, {estimator = rl.advantage, std_normalize = rl.std_normalize or false,
        eps = rl.std_eps})
    local i = 0
    for _, grp in ipairs(groups) do
        for _, s in ipairs(grp.samples) do i = i + 1; s.advantage = adv[i] end
    end
end

-- One RL step: rollout, advantages, batches, old logprobs, updates -> the step's metrics record
local function run_step(run, step)
    local cfg, rl = run.cfg, run.cfg.rl
    local t0 = lunar.clock()
    local groups, gen = rollout.collect(run, step)                        -- generate, score, filter
    local t_gen = lunar.clock()
    local bopts = {mini_batches = math.min(rl.mini_batches, math.max(gen.kept, 1)), total = gen.kept,
        keep_empty = not run.dp.single, micro_batch = rl.micro_batch, routing = run.moe, replay = rl.routing_replay,
        share_prompts = run.share_prompts, experts_per_token = run.mcfg.num_experts_per_tok, moe_layers = run.moe_layers}
    local minis = gen.kept > 0 and rlbatch.build(groups, bopts) or {}
    rlpar.pad(run.dp, minis, function() return rlbatch.dummy(bopts) end) -- every rank as many micro-batches
    local old = policy.old_logprobs(run, minis)                            -- reference and old logprobs, once
    if rl.kl_in_reward and run.ref_policy then policy.kl_into_rewards(minis, rl) end
    assign_advantages(groups, rl)                                          -- per sample, within its group
    rlbatch.set_advantages(minis)
    local t_old = lunar.clock()
    local upd = #minis > 0 and policy.update(run, minis, function(mb) return mb.advantages end, old) or {}
    local t_end = lunar.clock()
    old = policy.stats(old, run.dp)
    local rs = rollout_stats(gen.all, cfg.rollout.max_new_tokens, run.dp)
    gen.gen_tokens, gen.reward_errors = rlpar.sum(run.dp, gen.gen_tokens, gen.reward_errors)
    gen.gen_seconds = rlpar.max(run.dp, gen.gen_seconds)
    local extra = {reward_mean = rs.reward_mean, reward_std = rs.reward_std, accuracy = rs.accuracy,
        response_len_mean = rs.response_len_mean, response_len_max = rs.response_len_max,
        response_clip_frac = rs.response_clip_frac, logprob_gap = old.gap, logprob_gap_max = old.gap_max,
        router_agreement = old.router_agreement,
        groups_generated = gen.generated, groups_kept = gen.kept, groups_dropped = gen.dropped,
        gen_rounds = gen.rounds, groups_short = gen.short, reward_errors = gen.reward_errors,
        time_generate = t_gen - t0, time_old_logprobs = t_old - t_gen, time_train = t_end - t_old,
        gen_tokens_per_s = gen.gen_seconds > 0 and gen.gen_tokens / gen.gen_seconds or 0,
        optimizer_steps = upd.optimizer_steps or 0}
    for k, v in pairs(upd) do
        if type(v) == 'number' and k ~= 'loss' and k ~= 'grad_norm' and k ~= 'lr' then
            extra[k == 'tokens' and 'train_tokens' or k] = v
        end
    end
    return {loss = upd.loss, grad_norm = upd.grad_norm, lr = upd.lr, tokens = gen.gen_tokens,
            skipped = (upd.skipped_steps or 0) > 0, time = t_end - t0, extra = extra,
            peak_mem_bytes = run.dp:peak_memory(run.model:device()),   -- the largest of any rank
            show = {{'reward', rs.reward_mean}, {'acc', rs.accuracy}, {'len', rs.response_len_mean}}}
end

-- ---- the run ------------------------------------------------------------------------------------

function M.run(cfg)
    local t_start = lunar.clock()
    local run = setup(cfg)
    local result = {model = run.model, adapters = run.adapters, start_step = run.start, evals = {}}
    if run.start >= cfg.train.steps then
        log(cfg, 'nothing to do: %s is at step %d of train.steps=%d (the run finished)', run.st.dir, run.start,
            cfg.train.steps)
        result.finished = true
        return result
    end
    local main = run.dp:is_main()
    local m = runner.metrics(run)
    local function eval_now(step)
        if not run.valid then return end
        local acc, len = evaluate(run)
        m:log_scalars(step, {{'eval/accuracy', acc}, {'eval/response_len', len}})
        m:note(('eval step %d | greedy accuracy %.4f on %d problems of data.valid | mean length %.1f'):format(step,
            acc, #run.valid, len))
        result.evals[#result.evals + 1] = {step = step, accuracy = acc}
    end
    if run.start == 0 then eval_now(0) end
    local every = cfg.train.eval_every
    local stop, early = runner.loop(run, m, {
        step = function(step) return lunar.scope(run_step, run, step) end,
        after_step = function()
            -- every step has other lengths, so the pool keeps buffers of ever more sizes: when
            -- its cache holds more than twice the most the run has used at once, it is given back
            local dev = run.model:device()
            local ps = lunar.memory_stats(dev)
            if ps and ps.cached > 2 * ps.peak_in_use then core.pool_trim(dev) end
        end,
        eval_due = function(step) return every > 0 and step % every == 0 end,
        eval = eval_now,
        save = function(step) save_checkpoint(run, step, m) end,
    })
    result.stopped_early = early
    if not stop and not early then eval_now(cfg.train.steps) end
    result.summary = m:close()
    runner.raise_stop(run, stop)
    if not early then
        -- a split model is gathered as it is written, by every rank (lunar.train.export)
        local out_model, written = runner.write_final(run)
        if main then runner.save_output(cfg, out_model, run.adapters, written) end
    end
    if #result.evals >= 2 then
        local first, last = result.evals[1], result.evals[#result.evals]
        log(cfg, 'greedy accuracy on data.valid: %.1f%% at step %d -> %.1f%% at step %d', 100 * first.accuracy,
            first.step, 100 * last.accuracy, last.step)
    end
    result.seconds = lunar.clock() - t_start
    return result
end

-- what run(cfg) would do, without generating or training
function M.plan(cfg)
    local mcfg = runner.model_config(cfg)
    local tok = lunar.tokenizer.load(cfg.tokenizer)
    local set = prompts.load(cfg.data.train, {tokenizer = tok, reward = cfg.rl.reward, template = cfg.data.template,
        enable_thinking = cfg.rollout.enable_thinking,
        prompt_field = cfg.data.prompt_field, answer_field = cfg.data.answer_field,
        max_prompt_len = cfg.rollout.max_prompt_len, limit = cfg.data.limit})
    local rl = cfg.rl
    local lines = {
        ('plan of %s (%s):'):format(cfg.name, cfg.kind),
        ('  model        %s, %d layers, hidden %d'):format(mcfg.architecture, mcfg.num_hidden_layers, mcfg.hidden_size),
        ('  prompts      %d problems (%d longer than rollout.max_prompt_len=%d left out)'):format(#set.problems,
            set.too_long, cfg.rollout.max_prompt_len),
        ('  steps        %d steps of %d prompts x %d samples, %d optimizer steps each (%d epochs x %d mini-batches)')
            :format(cfg.train.steps, rl.prompts, rl.n, rl.epochs * rl.mini_batches, rl.epochs, rl.mini_batches),
        ('  outputs      checkpoints %s, metrics %s, final %s'):format(cfg.checkpoint.dir, cfg.metrics.dir,
            cfg.output.dir or '-'),
    }
    print(table.concat(lines, '\n'))
    return {problems = #set.problems, too_long = set.too_long}
end

return M
