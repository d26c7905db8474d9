-- test_recipes.lua: the training recipes end to end on small settings of the tiny preset:
--   * SFT: the loss falls; a run resumed from a mid-run checkpoint gives bit-identical losses and
--     weights for every later step;
--   * LoRA: only the adapters change (the base weights are bit-identical after training), and the
--     adapters are written in PEFT's format;
--   * pretraining on a Megatron indexed dataset built from the shipped text: the loss falls;
--   * the real GLM-5.x presets resolve (their layouts are written down) and refuse to run here
--     with a message naming the job they describe.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('recipes')
local common = dofile('recipes/common.lua')

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

-- small settings: a fraction of the data, short rows, few steps
local function small(dir, extra)
    local o = {quiet = true, expect_loss_fall = false, data = {limit = 48, seq_len = 128, micro_batch = 2},
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

T:test('sft: the loss falls, and a resumed run continues bit for bit', function()
    local d1, d2 = tmpdir(), tmpdir()
    local full = common.run('sft', small(d1, {train = {steps = 8, log_every = 100}, optim = {warmup = 2}}))
    assert(full.losses[8] < full.losses[1] * 0.95, ('loss %.4f -> %.4f'):format(full.losses[1], full.losses[8]))
    -- the same run stopped at step 4 (a checkpoint), then resumed to step 8
    local first = common.run('sft', small(d2, {train = {steps = 8, log_every = 100}, optim = {warmup = 2},
        checkpoint = {resume = 'none'}, stop_after = 4}))
    assert(#first.losses == 4)
    local second = common.run('sft', small(d2, {train = {steps = 8, log_every = 100}, optim = {warmup = 2}}))
    assert(second.start_step == 4, 'resumed at step ' .. tostring(second.start_step))
    for i = 1, 4 do
        assert(second.losses[i] == full.losses[4 + i],
            ('step %d: resumed loss %.17g vs uninterrupted %.17g'):format(4 + i, second.losses[i], full.losses[4 + i]))
    end
    params_equal(full.model:parameters(), second.model:parameters())
    os.execute(('rm -rf %q %q'):format(d1, d2))
end)

T:test('lora: base weights stay bit-identical, adapters train and are saved for PEFT', function()
    local d = tmpdir()
    local base = lunar.model.new(common.recipe('sft', {}).model.config, {seed = 1234})
    local r = common.run('lora', small(d, {train = {steps = 4, log_every = 100}, optim = {warmup = 1},
        output = {dir = d .. '/adapter'}}))
    params_equal(base:parameters(), r.model:parameters())
    assert(r.losses[4] < r.losses[1], 'the LoRA loss falls')
    local cfg = lunar.io.read_json(d .. '/adapter/adapter_config.json')
    assert(cfg.peft_type == 'LORA' and cfg.r == 8)
    local ad = lunar.io.load_checkpoint(d .. '/adapter/adapter_model.safetensors')
    assert(ad['base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight'])
    os.execute(('rm -rf %q'):format(d))
end)

T:test('lora with dropout: a resumed run continues bit for bit (the dropout stream is checkpointed)', function()
    local d1, d2 = tmpdir(), tmpdir()
    local o = {train = {steps = 6, log_every = 100}, optim = {warmup = 1}, peft = {dropout = 0.1}}
    local full = common.run('lora', small(d1, o))
    local o2 = small(d2, o)
    o2.stop_after = 4
    o2.checkpoint.resume = 'none'
    common.run('lora', o2)
    local second = common.run('lora', small(d2, o))
    assert(second.start_step == 4)
    for i = 1, 2 do
        assert(second.losses[i] == full.losses[4 + i], ('step %d: %.17g vs %.17g'):format(4 + i, second.losses[i],
            full.losses[4 + i]))
    end
    os.execute(('rm -rf %q %q'):format(d1, d2))
end)

T:test('pretrain on a Megatron dataset built from the shipped text', function()
    local d = tmpdir()
    local prefix = d .. '/shakespeare'
    lunar.data.preprocess{input = 'examples/data/pretrain/tinyshakespeare.txt', output_prefix = prefix,
        tokenizer = 'recipes/presets/tiny/tokenizer.json', format = 'text', split = 'blank', limit = 400,
        quiet = true}
    local produced = prefix .. '_text_document'
    local r = common.run('pretrain', small(d, {data = {kind = 'indexed', train = produced, limit = false},
        train = {steps = 8, log_every = 100}, optim = {warmup = 2}}))
    assert(r.losses[8] < r.losses[1] * 0.9, ('loss %.4f -> %.4f'):format(r.losses[1], r.losses[8]))
    os.execute(('rm -rf %q'):format(d))
end)

T:test('the GLM-5.x presets resolve and refuse to run on one CPU process', function()
    for _, p in ipairs({'glm5_2', 'glm5_3'}) do
        for _, kind in ipairs({'sft', 'pretrain', 'lora'}) do
            local ok, cfg = pcall(common.recipe, kind, {preset = p})
            if ok then
                assert(cfg.hardware.gpus_per_node > 0 and cfg.model.hf_id, p .. ' ' .. kind .. ' describes a GPU job')
                T.raises(function() common.check_runnable(cfg) end, 'multi-rank training is not implemented')
            else
                assert(tostring(cfg):find('has no ' .. kind .. ' recipe', 1, true), tostring(cfg))
            end
        end
    end
end)

T:test('unknown keys and wrong types in overrides are errors naming the key', function()
    T.raises(function() common.recipe('sft', {train = {stpes = 3}}) end, 'train.stpes')
    T.raises(function() common.recipe('sft', {optim = {lr = 'fast'}}) end, 'optim.lr')
    T.raises(function() common.recipe('sft', {preset = 'nope'}) end, 'preset "nope"')
end)

os.exit(T:run())
