-- bench_grpo_step.lua: the time of one GRPO step of the tiny preset (recipes/gsm8k.lua preset=tiny)
-- on CPU, f32, split as the trainer's metrics split it: generate, old logprobs, train. Driven by
-- tests/bench/bench_grpo_vs_torch.py, which times the same step in a PyTorch stack in the same run.
--
--   lunar tests/bench/bench_grpo_step.lua [prompts=8] [n=8] [new=128] [mini_batches=2] [micro_batch=8]
--       [steps=2] [warmup=1] [export=DIR] [profile=true] [serve=true]
--
-- The step is lunar.rl.trainer's run_step made of the same pieces (lunar.rl.rollout, .batch,
-- .advantages, .policy) with two changes that make the two sides do the same work: every step
-- draws the first `prompts` GSM8K questions (no shuffle), and no token stops a response, so every
-- sample has exactly `new` tokens (a model from a seeded init seldom samples a stop token anyway).
-- export=DIR writes the seeded model as an HF checkpoint (with the tokenizer and its chat
-- template) and DIR/prompts.json (the rendered prompt ids and gold answers), then exits.
-- Prints one JSON line: the mean seconds (wall and CPU) of each phase over the measured steps.
-- serve=true runs a step for each "step" line read from stdin and answers with its JSON line
-- (what the driver uses to interleave the two sides).
-- profile=true also prints to stderr where each measured phase's time went: the functions below
-- (modules, ops, generation, optimizer) wrapped with lunar.clock(), inclusive (a module's time
-- holds the ops it calls), with call counts.
local lunar = require 'lunar'
local common = dofile('recipes/common.lua')
local base = require('lunar.train.trainer').setup_parts
local rewards = require 'lunar.rl.rewards'
local prompts_mod = require 'lunar.rl.prompts'
local rollout = require 'lunar.rl.rollout'
local advantages = require 'lunar.rl.advantages'
local rlbatch = require 'lunar.rl.batch'
local policy = require 'lunar.rl.policy'

local o = lunar.config.overrides()
local P, N, NEW = o.prompts or 8, o.n or 8, o.new or 128
local steps, warmup = o.steps or 2, o.warmup or 1

local cfg = common.recipe('grpo', {preset = 'tiny', quiet = true,
    rl = {prompts = P, n = N, mini_batches = o.mini_batches or 2, micro_batch = o.micro_batch or 8},
    rollout = {max_new_tokens = NEW}, data = {shuffle = false}})
local rl = cfg.rl

local run = {cfg = cfg, mcfg = base.model_config(cfg)}
run.tok = lunar.tokenizer.load(cfg.tokenizer)
run.reward = rewards.get(rl.reward)
local set = prompts_mod.load(cfg.data.train, {tokenizer = run.tok, reward = rl.reward, template = cfg.data.template,
    enable_thinking = cfg.rollout.enable_thinking,
    prompt_field = cfg.data.prompt_field, answer_field = cfg.data.answer_field,
    max_prompt_len = cfg.rollout.max_prompt_len, limit = P})
assert(#set.problems == P, 'the first prompts of data.train are all shorter than rollout.max_prompt_len')
run.model = base.build_model(cfg)

if o.export then
    run.model:save_hf(o.export)
    for _, f in ipairs({'tokenizer.json', 'tokenizer_config.json'}) do
        local src = assert(io.open('recipes/presets/tiny/' .. f, 'rb'))
        lunar.io.write_file(o.export .. '/' .. f, src:read('*a'))
        src:close()
    end
    local rows = {}
    for i, p in ipairs(set.problems) do rows[i] = {ids = p.ids, gold = p.gold, question = p.question} end
    lunar.io.write_json(o.export .. '/prompts.json', {prompts = rows, rl = rl, rollout = cfg.rollout, optim = cfg.optim})
    os.exit(0)
end

-- the same problems every step, in file order
run.sampler = {next = function(_, k) local out = {} for i = 1, k do out[i] = set.problems[i] end return out end}
if (rl.kl_coef or 0) > 0 then
    run.ref_model = base.build_model(cfg)
    run.ref_policy = policy.reference(run)
end
run.stop_ids = {}
run.moe_layers = {}
for i, L in ipairs(run.model.layers) do
    if L.mlp_type == 'sparse' then run.moe_layers[#run.moe_layers + 1] = i - 1 end
end
run.moe = #run.moe_layers > 0
local oc = cfg.optim
run.opt = lunar.optim.AdamW.new(run.model.params, {lr = oc.lr, betas = oc.betas, eps = oc.eps,
    weight_decay = oc.weight_decay, no_decay = oc.no_decay, clip = oc.clip_grad, accum = 1})

-- ---- profile: wrap functions with timers, per phase ------------------------------------------------
local prof = {phase = nil, acc = {}}
local function wrap(tbl, key, label)
    local f = tbl[key]
    assert(type(f) == 'function', label)
    tbl[key] = function(...)
        if not prof.phase then return f(...) end
        local ph = prof.phase
        local t0 = lunar.clock()
        local r = {f(...)}
        local a = prof.acc[ph][label] or {0, 0}
        a[1], a[2] = a[1] + lunar.clock() - t0, a[2] + 1
        prof.acc[ph][label] = a
        return unpack(r, 1, table.maxn(r))
    end
end
if o.profile then
    local nn, ops, glm = require 'lunar.nn', lunar.ops, require 'lunar.model.glm'
    local decode, gattn = require 'lunar.generate.decode', require 'lunar.generate.attention'
    local sampling = require 'lunar.generate.sampling'
    for _, w in ipairs({
        {glm.Model, 'forward', 'model:forward'}, {glm.Model, 'backward', 'model:backward'},
        {glm.Model, 'prepare', 'model:prepare (masks, positions)'}, {glm, 'entropy', 'entropy'},
        {glm, 'entropy_backward_', 'entropy backward'},
        {nn.MLA, 'forward', 'MLA forward'}, {nn.MLA, 'backward', 'MLA backward'},
        {nn.DSA, 'forward', 'DSA indexer forward'}, {nn.MoE, 'forward', 'MoE forward'},
        {nn.MoE, 'backward', 'MoE backward'}, {nn.MLP, 'forward', 'MLP forward'}, {nn.MLP, 'backward', 'MLP backward'},
        {nn.RMSNorm, 'forward', 'RMSNorm forward'}, {nn.RMSNorm, 'backward', 'RMSNorm backward'},
        {nn.Embedding, 'forward', 'embedding forward'},
        {ops, 'attention', 'op attention'}, {ops, 'attention_backward', 'op attention_backward'},
        {ops, 'index_scores', 'op index_scores'}, {ops, 'cross_entropy', 'op cross_entropy'},
        {ops, 'cross_entropy_backward', 'op cross_entropy_backward'}, {ops, 'gemm', 'op gemm'},
        {ops, 'block_mask', 'op block_mask'}, {ops, 'topk', 'op topk'}, {ops, 'index_select', 'op index_select'},
        {ops, 'index_add_', 'op index_add_'},
        {decode, 'prefill', 'decode.prefill'}, {decode, 'step', 'decode.step'},
        {gattn, 'decode', 'decode attention (per layer)'}, {gattn, 'store_prefill', 'prefill cache writes'},
        {sampling, 'sample', 'sampling.sample'}, {lunar.generate, 'run', 'lunar.generate'},
        {require 'lunar.rl.loss', 'policy', 'loss.policy'}, {rlbatch, 'build', 'rl.batch.build'},
        {lunar.optim.AdamW, 'step', 'AdamW step'}, {run.tok, 'decode', 'tokenizer decode'},
    }) do wrap(w[1], w[2], w[3]) end
end
local function in_phase(name, fn, ...)
    if o.profile then prof.phase = name; prof.acc[name] = prof.acc[name] or {} end
    local r = {fn(...)}
    prof.phase = nil
    return unpack(r, 1, table.maxn(r))
end

-- CPU seconds of this process (user + system, all threads; /proc/self/stat counts 1/100 s ticks)
local function cpu_seconds()
    local f = io.open('/proc/self/stat', 'r')
    if not f then return 0 end
    local line = f:read('*l')
    f:close()
    local fields = {}
    for x in line:match('%) (.*)$'):gmatch('%S+') do fields[#fields + 1] = x end
    return (tonumber(fields[12]) + tonumber(fields[13])) / 100
end

-- trainer.lua's run_step, timed the same way (its time_generate, time_old_logprobs, time_train)
local function step_of(step)
    local t0, c0 = lunar.clock(), cpu_seconds()
    local groups, gen = in_phase('generate', rollout.collect, run, step)
    local t_gen, c_gen = lunar.clock(), cpu_seconds()
    local minis = rlbatch.build(groups, {mini_batches = rl.mini_batches, micro_batch = rl.micro_batch,
        share_prompts = rl.share_prompts,
        routing = run.moe, replay = rl.routing_replay, experts_per_token = run.mcfg.num_experts_per_tok,
        moe_layers = run.moe_layers})
    local t_build = lunar.clock()
    local old = in_phase('old_logprobs', policy.old_logprobs, run, minis)
    local scores = {}
    for _, g in ipairs(groups) do for _, s in ipairs(g.samples) do scores[#scores + 1] = s.reward end end
    local adv = advantages.compute(scores, rl.n, {estimator = rl.advantage, std_normalize = rl.std_normalize,
        eps = rl.std_eps})
    local i = 0
    for _, g in ipairs(groups) do for _, s in ipairs(g.samples) do i = i + 1; s.advantage = adv[i] end end
    rlbatch.set_advantages(minis)
    local t_old, c_old = lunar.clock(), cpu_seconds()
    local upd = in_phase('train', policy.update, run, minis, function(mb) return mb.advantages end, old)
    local t_end, c_end = lunar.clock(), cpu_seconds()
    local correct = 0
    for _, s in ipairs(scores) do correct = correct + s end
    return {generate = t_gen - t0, batch = t_build - t_gen, old_logprobs = t_old - t_gen, train = t_end - t_old,
            step = t_end - t0, gen_tokens = gen.gen_tokens, gen_seconds = gen.gen_seconds, loss = upd.loss,
            reward_sum = correct, cpu_generate = c_gen - c0, cpu_old_logprobs = c_old - c_gen,
            cpu_train = c_end - c_old, cpu_step = c_end - c0}
end

local function json_line(t) return (lunar.io.encode_json(t):gsub('\n%s*', ' ')) end

-- serve=true: one step per line read from stdin ("step"; "quit" or the end ends), one JSON line
-- of its times back on stdout, so that a driver can interleave the steps of two implementations
if o.serve then
    print('ready')
    io.stdout:flush()
    local s = 0
    while true do
        local line = io.read('*l')
        if not line or line == 'quit' then break end
        s = s + 1
        local r = lunar.scope(step_of, s)
        r.impl, r.threads = 'lunar', lunar.threads()
        print(json_line(r))
        io.stdout:flush()
    end
    os.exit(0)
end

local sums, count, last = {}, 0, nil
for s = 1, warmup + steps do
    local r = lunar.scope(step_of, s)
    io.stderr:write(('lunar step %d: generate %.2f s, old logprobs %.2f s, train %.2f s, step %.2f s, loss %.4g\n')
        :format(s, r.generate, r.old_logprobs, r.train, r.step, r.loss or 0))
    if s <= warmup then prof.acc = {} end
    if s > warmup then
        count = count + 1
        for k, v in pairs(r) do if type(v) == 'number' then sums[k] = (sums[k] or 0) + v end end
    end
    last = r
end
if o.profile then
    for _, ph in ipairs({'generate', 'old_logprobs', 'train'}) do
        local rows = {}
        for label, a in pairs(prof.acc[ph] or {}) do rows[#rows + 1] = {label, a[1] / count, a[2] / count} end
        table.sort(rows, function(x, y) return x[2] > y[2] end)
        io.stderr:write(('profile %s (%.2f s per step; inclusive seconds per step, calls per step):\n'):format(ph,
            sums[ph] / count))
        for _, r in ipairs(rows) do io.stderr:write(('  %-34s %8.3f s %8d\n'):format(r[1], r[2], r[3])) end
    end
end
local out = {impl = 'lunar', threads = lunar.threads(), steps = count}
for k, v in pairs(sums) do out[k] = v / count end
out.gen_tokens_per_s = out.gen_tokens / out.gen_seconds
out.last_loss = last.loss
print(json_line(out))
