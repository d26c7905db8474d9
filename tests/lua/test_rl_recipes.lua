-- test_rl_recipes.lua: the RL recipes (recipes/gsm8k.lua: GRPO, recipes/dapo.lua: DAPO) end to end
-- on the tiny model, with small settings:
--   * both run on the shipped GSM8K and DAPO-Math problems with the GLM-5 chat template: the
--     steps' metrics (reward, accuracy, lengths, clip fractions, ratios, the logprob gap, the time
--     split), a greedy evaluation of data.valid before and after, checkpoints and the final model;
--   * routing replay: the training forwards route every token as generation did (the f32 gap of
--     the rollout's and the trainer's logprobs under 1e-5); without replay the router agreement
--     is measured instead;
--   * dynamic sampling drops the groups whose answers are all right or all wrong and generates
--     more prompts until the batch is full, within rl.max_gen_batches rounds (counted);
--   * a run stopped after a checkpoint and resumed gives the same metrics at every later step;
--   * LoRA: the base weights are bit-identical after training, the adapters are written in
--     PEFT's format;
--   * bad input: a reward function that raises or returns a non-number (an error naming it, or a
--     counted skip), no usable prompt, one sample per prompt with GRPO's std, greedy rollouts.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('rl recipes')
local common = dofile('recipes/common.lua')

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

local function merge(o, extra)
    for k, v in pairs(extra or {}) do
        if type(v) == 'table' and type(o[k]) == 'table' and #v == 0 then merge(o[k], v) else o[k] = v end
    end
    return o
end

-- small settings: few prompts, short answers, everything under dir
local function small(dir, extra)
    return merge({quiet = true, data = {limit = 64},
        rl = {prompts = 2, n = 4, micro_batch = 4, mini_batches = 1, eval_limit = 4},
        rollout = {max_new_tokens = 16, max_prompt_len = 400},
        train = {steps = 2, log_every = 100},
        checkpoint = {dir = dir .. '/ckpt', every = 100, keep_last = 3},
        metrics = {dir = dir, tensorboard = false}, output = {dir = dir .. '/final'}}, extra)
end

local function read(path)
    local f = assert(io.open(path, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

-- the metrics.jsonl rows of training steps, by step
local function steps_of(dir)
    local out = {}
    for line in read(dir .. '/metrics.jsonl'):gmatch('[^\n]+') do
        local row = lunar.io.decode_json(line)
        if row.reward_mean ~= nil then out[row.step] = row end
    end
    return out
end

local function evals_of(dir)
    local out = {}
    for line in read(dir .. '/metrics.jsonl'):gmatch('[^\n]+') do
        local row = lunar.io.decode_json(line)
        if row['eval/accuracy'] ~= nil then out[#out + 1] = row end
    end
    return out
end

local function refuses(fn, wants)
    local ok, err = pcall(fn)
    assert(not ok, 'expected an error mentioning ' .. wants[1])
    err = tostring(err)
    for _, w in ipairs(wants) do
        assert(err:find(w, 1, true), ('error %q does not mention %q'):format(err, w))
    end
    return err
end

T:test('--help gives every RL setting a line of meaning', function()
    local texts = common.help_texts(common.source, 'M%.rl_defaults = {')
    for sect, t in pairs(common.rl_defaults) do
        for k in pairs(t) do
            assert(texts[sect .. '.' .. k] and texts[sect .. '.' .. k] ~= '', 'no meaning for ' .. sect .. '.' .. k)
        end
    end
    local help = common.help('grpo', common.recipe('grpo', {}))
    for _, key in ipairs({'rl.eps_high', 'rollout.temperature', 'optim.lr'}) do
        assert(help:find('\n  ' .. key .. ' ', 1, true), key .. ' is not in --help')
    end
    assert(help:find("the ratio's upper clip", 1, true), 'the meaning of rl.eps_high')
    assert(not common.help('sft', common.recipe('sft', {})):find('rl.eps_high', 1, true), 'sft has no RL settings')
end)

T:test('gsm8k (GRPO) and dapo (DAPO) run on the shipped problems with the GLM-5 template', function()
    for _, kind in ipairs({'grpo', 'dapo'}) do
        local dir = tmpdir()
        local res = common.run(kind, small(dir, {train = {steps = 3},
            rl = kind == 'dapo' and {dynamic_sampling = false, overlong_buffer = 8} or {kl_coef = 0.001}}))
        local rows = steps_of(dir)
        for step = 1, 3 do
            local r = rows[step]
            assert(r, kind .. ': no metrics for step ' .. step)
            for _, k in ipairs({'reward_mean', 'reward_std', 'accuracy', 'response_len_mean', 'response_len_max',
                                'response_clip_frac', 'entropy_mean', 'pg_clipfrac_low', 'pg_clipfrac_high',
                                'approx_kl', 'ratio_mean', 'logprob_gap', 'time_generate', 'time_old_logprobs',
                                'time_train', 'gen_tokens_per_s', 'groups_kept'}) do
                assert(type(r[k]) == 'number', ('%s step %d: metric %s missing'):format(kind, step, k))
            end
            assert(r.optimizer_steps == 1, kind .. ': one optimizer step per rollout step')
            assert(r.response_len_max <= 16, kind .. ': response budget')
            assert(r.groups_kept == 2, kind .. ': groups kept')
        end
        assert(#evals_of(dir) == (kind == 'grpo' and 2 or 0), kind .. ': evaluations of data.valid before and after')
        assert(lunar.core.fs.stat(dir .. '/final/config.json'), kind .. ': the final model')
        assert(lunar.core.fs.stat(dir .. '/ckpt/' .. require('lunar.train.checkpoint').step_name(3) .. '/COMPLETE.json'),
            kind .. ': the last checkpoint')
        assert(res.start_step == 0)
    end
end)

T:test('routing replay: the trainer routes as generation did (gap < 1e-5); off: the agreement is measured', function()
    local dir = tmpdir()
    common.run('grpo', small(dir, {train = {steps = 1}, data = {valid = false}}))
    local r = steps_of(dir)[1]
    assert(r.logprob_gap < 1e-5, ('f32 logprob gap with replay %.3g'):format(r.logprob_gap))
    assert(r.logprob_gap_max < 1e-4, ('largest gap %.3g'):format(r.logprob_gap_max))
    assert(r.router_agreement == nil, 'no agreement metric with replay on')
    local dir2 = tmpdir()
    common.run('grpo', small(dir2, {train = {steps = 1}, data = {valid = false}, rl = {routing_replay = false}}))
    local r2 = steps_of(dir2)[1]
    assert(type(r2.router_agreement) == 'number' and r2.router_agreement > 0.5 and r2.router_agreement <= 1,
        'router agreement without replay: ' .. tostring(r2.router_agreement))
end)

T:test('dynamic sampling drops groups that are all right or all wrong, and generates more', function()
    local dir = tmpdir()
    -- the first sample of an even prompt is right: odd prompts' groups are all wrong (dropped)
    local function reward(_, _, info) return (info.prompt % 2 == 0 and info.sample == 1) and 1 or -1 end
    common.run('dapo', small(dir, {train = {steps = 1}, rl = {reward = reward, prompts = 2, max_gen_batches = 4,
        overlong_buffer = 8}}))
    local r = steps_of(dir)[1]
    assert(r.groups_dropped >= 2, 'dropped groups: ' .. tostring(r.groups_dropped))
    assert(r.gen_rounds >= 2, 'rounds: ' .. tostring(r.gen_rounds))
    assert(r.groups_kept == 2 and r.groups_short == 0, 'kept a full batch')
    -- a budget of one round falls short, trains on what it kept, and says so
    local dir2 = tmpdir()
    common.run('dapo', small(dir2, {train = {steps = 1}, rl = {reward = reward, prompts = 2, max_gen_batches = 1,
        overlong_buffer = 8}}))
    local r2 = steps_of(dir2)[1]
    assert(r2.gen_rounds == 1 and r2.groups_kept == 1 and r2.groups_short == 1, 'a short batch is counted')
end)

T:test('a stopped run resumed from its checkpoint gives the same metrics at every later step', function()
    local full, part = tmpdir(), tmpdir()
    local settings = {train = {steps = 4}, data = {valid = false}, checkpoint = {every = 2}}
    common.run('grpo', small(full, settings))
    common.run('grpo', small(part, merge(merge({}, settings), {stop_after = 2})))
    local again = common.run('grpo', small(part, settings))
    assert(again.start_step == 2, 'resumed at step 2')
    local a, b = steps_of(full), steps_of(part)
    for step = 3, 4 do
        for k, v in pairs(a[step]) do
            if not (k:match('^time') or k:match('_s$') or k:match('per_s$') or k == 'peak_mem_bytes') then
                assert(b[step][k] == v, ('step %d %s: %s resumed, %s uninterrupted'):format(step, k,
                    tostring(b[step][k]), tostring(v)))
            end
        end
    end
end)

T:test('LoRA: the base weights are bit-identical after training; the adapters in PEFT format', function()
    local dir = tmpdir()
    local res = common.run('grpo', small(dir, {data = {valid = false}, optim = {lr = 1e-2},
        peft = {r = 4, alpha = 8, targets = {'q_a_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'}}}))
    local cfg = common.recipe('grpo', {})
    local fresh = lunar.model.new(cfg.model.config, {seed = cfg.model.seed})
    local moved = 0
    for name, t in pairs(fresh:parameters()) do
        local trained = res.model:parameters()[name]
        T.equal(trained, t, 'base weight ' .. name)
    end
    for _, t in pairs(res.adapters.params.tensors) do
        if lunar.ops.max(lunar.ops.abs(t)):item() > 0 then moved = moved + 1 end
    end
    assert(moved > 0, 'the adapters trained')
    local acfg = lunar.io.read_json(dir .. '/final/adapter_config.json')
    assert(acfg.peft_type == 'LORA' and acfg.r == 4, 'adapter_config.json')
    assert(lunar.core.fs.stat(dir .. '/final/adapter_model.safetensors'), 'adapter weights')
end)

T:test('bad input: reward functions that fail, no usable prompt, a group of one, greedy rollouts', function()
    local dir = tmpdir()
    refuses(function()
        common.run('grpo', small(dir, {data = {valid = false}, rl = {reward = function() error('boom') end}}))
    end, {'reward function', 'boom'})
    refuses(function()
        common.run('grpo', small(dir, {data = {valid = false}, checkpoint = {resume = 'none'},
            rl = {reward = function() return 'yes' end}}))
    end, {'reward function', 'string'})
    local skip = tmpdir()
    local calls = 0
    common.run('grpo', small(skip, {train = {steps = 1}, data = {valid = false},
        rl = {on_reward_error = 'skip', reward = function()
            calls = calls + 1
            if calls % 2 == 0 then error('boom') end
            return 1
        end}}))
    assert(steps_of(skip)[1].reward_errors == 4, 'reward errors counted')
    refuses(function() common.run('grpo', small(dir, {rollout = {max_prompt_len = 5}})) end,
        {'none of the', 'rollout.max_prompt_len'})
    refuses(function() common.run('grpo', small(dir, {rl = {n = 1}})) end, {'rl.n'})
    refuses(function() common.run('grpo', small(dir, {rollout = {temperature = 0}})) end, {'rollout.temperature'})
    refuses(function() common.run('grpo', small(dir, {rl = {prompts = 3, mini_batches = 2}})) end, {'rl.mini_batches'})
    refuses(function() common.run('grpo', small(dir, {rl = {reward = 'nope'}})) end, {'rl.reward'})
end)

os.exit(T:run())
