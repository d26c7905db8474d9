-- test_recipes_flash.lua: the training recipes on tiny_flash (GLM-5.3-Flash), small settings:
--   * SFT: the loss falls, a resumed run continues bit for bit, the export keeps transformers' names;
--   * LoRA: the base stays bit-identical, the adapters are written in PEFT's layout, a resumed run
--     with dropout continues bit for bit.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('recipes flash')
local common = dofile('recipes/common.lua')

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

-- small settings: a fraction of the data, short rows, few steps
local function small(dir, extra)
    -- (rows of 128 tokens leave some GSM8K prompts with no answer token: those rows are rejected)
    local o = {quiet = true, expect_loss_fall = false, data = {limit = 48, seq_len = 128, micro_batch = 2, max_rejected = 0.5},
               checkpoint = {dir = dir .. '/ckpt', every = 4, keep_last = 3},
               metrics = {dir = dir}, output = {dir = false}}
    for k, v in pairs(extra or {}) do
        if type(v) == 'table' and type(o[k]) == 'table' then for kk, vv in pairs(v) do o[k][kk] = vv end
        else o[k] = v end
    end
    return o
end

local function params_equal(a, b)
    for name, t in pairs(a) do
        local u = b[name]
        assert(u, 'missing ' .. name)
        T.equal(t, u, name)
    end
end

T:test('tiny_flash sft (GLM-5.3-Flash): the loss falls, a resumed run continues bit for bit, transformers names', function()
    local d1, d2 = tmpdir(), tmpdir()
    local o = {preset = 'tiny_flash', train = {steps = 4, log_every = 100}, optim = {warmup = 1},
               checkpoint = {every = 1}}
    local full = common.run('sft', small(d1, o))
    assert(full.model.cfg.model_type == 'glm5_next')
    assert(full.losses[4] < full.losses[1] * 0.99, ('loss %.4f -> %.4f'):format(full.losses[1], full.losses[4]))
    local o1 = small(d2, o)
    o1.stop_after, o1.checkpoint.resume = 2, 'none'
    common.run('sft', o1)
    local second = common.run('sft', small(d2, o))
    assert(second.start_step == 2, 'resumed at step ' .. tostring(second.start_step))
    for i = 1, 2 do
        assert(second.losses[i] == full.losses[2 + i],
            ('step %d: resumed loss %.17g vs uninterrupted %.17g'):format(2 + i, second.losses[i], full.losses[2 + i]))
    end
    params_equal(full.model:parameters(), second.model:parameters())
    for name in pairs(full.model:parameters()) do
        assert(name == 'lm_head.weight' or name:find('^model%.language_model%.'), name)
    end
    os.execute(('rm -rf %q %q'):format(d1, d2))
end)

T:test('tiny_flash lora: base weights stay bit-identical, a resumed run with dropout continues bit for bit', function()
    local d1, d2 = tmpdir(), tmpdir()
    local o = {preset = 'tiny_flash', train = {steps = 4, log_every = 100}, optim = {warmup = 1},
               peft = {dropout = 0.1}, checkpoint = {every = 1}}
    local base = lunar.model.new(common.recipe('lora', {preset = 'tiny_flash'}).model.config, {seed = 1234})
    local o1 = small(d1, o)
    o1.output = {dir = d1 .. '/adapter'}
    local full = common.run('lora', o1)
    params_equal(base:parameters(), full.model:parameters())
    local ad = lunar.io.load_checkpoint(d1 .. '/adapter/adapter_model.safetensors')
    assert(ad['base_model.model.model.language_model.layers.0.self_attn.forget_gate.f_a_proj.lora_A.weight'],
        'the forget gate under transformers\' module name')
    assert(ad['base_model.model.model.language_model.layers.1.mlp.experts.base_layer.lora_A.weight'], 'fused experts')
    local o2 = small(d2, o)
    o2.stop_after, o2.checkpoint.resume = 2, 'none'
    common.run('lora', o2)
    local second = common.run('lora', small(d2, o))
    assert(second.start_step == 2, 'resumed at step ' .. tostring(second.start_step))
    for i = 1, 2 do
        assert(second.losses[i] == full.losses[2 + i], ('step %d: %.17g vs %.17g'):format(2 + i, second.losses[i],
            full.losses[2 + i]))
    end
    os.execute(('rm -rf %q %q'):format(d1, d2))
end)

os.exit(T:run())
