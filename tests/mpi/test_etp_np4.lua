-- np: 4
-- Expert tensor parallel on 4 ranks: one step of the tiny GLM-5 and a GLM-4.x MoE config at
-- ep=2 x etp=2, etp=4 and tp=2 x etp=2 (replayed routes) equals one rank's on the whole global
-- batch (the loss and every gradient within 1e-5 relative L2, each expert block against its block
-- of the whole gradient); the model written from ep=2 x etp=2 is the one-rank file byte for byte;
-- 20 steps of the tiny SFT recipe at ep=2 x etp=2 give the losses of one rank, and a run stopped
-- after a checkpoint resumes bit for bit; what etp does not do yet is refused by name.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local recipes = dofile('recipes/common.lua')
local data_parallel = require 'lunar.train.data_parallel'
local d = lunar.dist

lunar.threads(1)
local T = common.suite('expert tensor parallel np4', 4)

local report = dpc.report

T:test('one step at ep=2 x etp=2 equals one rank (GLM-5 and GLM-4.x)', function()
    report('ep=2 x etp=2 GLM-5', dpc.layout_step(T, {ep = 2, etp = 2}))
    report('ep=2 x etp=2 GLM-4.x', dpc.layout_step(T, {ep = 2, etp = 2}, dpc.glm4_config))
end)

T:test('one step at etp=4 and at tp=2 x etp=2 (replayed routes) equals one rank', function()
    report('etp=4', dpc.layout_step(T, {etp = 4}))
    report('tp=2 x etp=2, replayed routes', dpc.layout_step(T, {tp = 2, etp = 2}, nil, nil, true))
end)

T:test('an expert width etp does not divide fails naming the numbers', function()
    local lay = d.layout{etp = 4}
    local cfg = {}
    for k, v in pairs(dpc.glm4_config) do cfg[k] = v end
    cfg.moe_intermediate_size = 30
    T.raises(function() lunar.model.new(cfg, {ep = lay:group('ep'), etp = lay:group('etp')}) end,
        'moe_intermediate_size 30 is not divisible by etp = 4')
end)

T:test('the model written from ep=2 x etp=2 is the one-rank file, byte for byte; each rank loads its blocks back',
    function()
    local dir = dpc.tmpdir()
    local cfg = dpc.preset.common.model.config
    local dp = data_parallel.setup({parallel = {ep = 2, etp = 2}})
    local spread = lunar.model.new(cfg, {seed = 5, ep = dp.ep, etp = dp.etp})
    require('lunar.train.export').write_hf(dp, spread, dir .. '/etp')   -- gathered as it is written
    if d.rank() == 0 then
        lunar.model.new(cfg, {seed = 5}):save_hf(dir .. '/one')
        dpc.same_model_files(dir .. '/etp', dir .. '/one')
    end
    d.barrier()
    local back = lunar.model.load(dir .. '/one', {ep = dp.ep, etp = dp.etp})
    local n = 0
    for name in spread.params:names() do
        assert(lunar.ops.global_norm({lunar.ops.sub(back.params:get(name), spread.params:get(name))}) == 0,
            name .. ' differs after loading at ep=2 x etp=2')
        n = n + 1
    end
    assert(n > 50, 'compared ' .. n)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('20 steps of the tiny SFT recipe at ep=2 x etp=2 give the losses of one rank; stopped and resumed, bit for '
    .. 'bit', function()
    local dir = dpc.tmpdir()
    local one = dpc.single(dir .. '/one.' .. d.rank(), dpc.same_micro_batches(1, 4))
    local over = {data = {micro_batch = 1}, parallel = {ep = 2, etp = 2}, checkpoint = {every = 0}}
    local run = recipes.run('sft', dpc.recipe(dir .. '/etp', over))
    dpc.same_losses(T, 'ep=2 x etp=2', run.losses, one.losses, 20)
    -- stop after step 5 (its last checkpoint is step 3), resume: steps 4-8 as the uninterrupted run
    local ck = {train = {steps = 8}, checkpoint = {every = 3}, data = {micro_batch = 1}, parallel = {ep = 2, etp = 2}}
    dpc.stop_and_resume(T, 'sft', dir, ck, recipes.run('sft', dpc.recipe(dir .. '/whole', ck)))
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('etp refuses LoRA, on every rank, naming the setting', function()
    local dir = dpc.tmpdir()
    T.raises(function() recipes.run('lora', dpc.recipe(dir .. '/lora', {parallel = {ep = 2, etp = 2}})) end,
        'parallel.etp=2 with LoRA')
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
