-- test_rl_recipes_flash.lua: the RL recipes on GLM-5.3-Flash (preset=tiny_flash: KDA states,
-- the pooled-key cache and mHC in the rollout engine): recipes/gsm8k.lua (GRPO) and
-- recipes/dapo.lua (DAPO) run 3 steps with the preset's 12 samples per prompt and routing replay
-- (R3), the f32 gap between the rollout's and the trainer's logprobs under 1e-5 at every step, and
-- write a glm5_next checkpoint. (A SIGKILL and resume of the Flash GRPO run: tests/sh/test_rl_resume.sh.)
local lunar = require 'lunar'
local T = require('lunar.testing').suite('rl recipes flash')
local common = dofile('recipes/common.lua')

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
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

T:test('tiny_flash (GLM-5.3-Flash): gsm8k and dapo, 3 steps, 12 samples per prompt, R3, gap < 1e-5', function()
    for _, kind in ipairs({'grpo', 'dapo'}) do
        local dir = tmpdir()
        -- the preset's settings (n = 12, routing replay) with shorter answers; DAPO keeps every
        -- group (the untrained model's rewards are all alike: dynamic sampling would drop them)
        common.run(kind, {preset = 'tiny_flash', quiet = true, data = {limit = 64, valid = false},
            rollout = {max_new_tokens = 16, max_prompt_len = 400},
            rl = kind == 'dapo' and {dynamic_sampling = false, overlong_buffer = 8} or {},
            train = {steps = 3, log_every = 100}, checkpoint = {dir = dir .. '/ckpt', every = 100},
            metrics = {dir = dir, tensorboard = false}, output = {dir = dir .. '/final'}})
        local rows = steps_of(dir)
        for step = 1, 3 do
            local r = rows[step]
            assert(r, kind .. ': no metrics for step ' .. step)
            assert(r.groups_kept == 2, kind .. ': two prompts kept')
            assert(r.logprob_gap < 1e-5 and r.logprob_gap_max < 1e-5, ('%s step %d: f32 logprob gap %.3g (largest %.3g)'):format(
                kind, step, r.logprob_gap, r.logprob_gap_max))
            assert(r.router_agreement == nil, 'routing replay on')
        end
        local f = assert(io.open(dir .. '/final/config.json'))
        assert(f:read('*a'):find('glm5_next', 1, true), kind .. ': the final model is a glm5_next checkpoint')
        f:close()
    end
end)

os.exit(T:run())
