-- np: 4
-- GLM-5.3-Flash (the tiny_flash preset's model) on 4 ranks: one step at tp=2 x ep=2 (each tp rank
-- sends its share of the tokens to the experts), tp=2 x etp=2 and tp=2 x dp=2 equals one rank's on
-- the whole global batch (the loss and every gradient within 1e-5 relative L2, each rank's block
-- against its block of the whole gradient, and against the larger of its own norm and 1e-3 of the
-- largest gradient's: layer 0's mHC scales, where every stream is still the embedding, have
-- gradients that cancel to rounding noise: with a floor of 1e-4 of the largest, tp=2 x ep=2 with
-- replayed routes measured 1.8e-5 there, an error below 2e-9 of the largest gradient's norm), and
-- 20 steps of the tiny_flash SFT recipe at tp=2 x ep=2 give the
-- losses of one rank; tp=2 x ep=2 checkpoints resume bit for bit and load whole at one rank,
-- with the vision tower the model carries.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local recipes = dofile('recipes/common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('GLM-5.3-Flash parallel np4', 4)
local FLASH = dofile('recipes/presets/tiny_flash.lua').common.model.config
local FLOOR = {norm_floor = 1e-3}

T:test('one step at tp=2 x ep=2, tp=2 x etp=2 and tp=2 x dp=2 equals one rank', function()
    dpc.report('flash tp=2 x ep=2', dpc.layout_step(T, {tp = 2, ep = 2}, FLASH, nil, nil, FLOOR))
    dpc.report('flash tp=2 x ep=2, R3', dpc.layout_step(T, {tp = 2, ep = 2}, FLASH, nil, true, FLOOR))
    dpc.report('flash tp=2 x etp=2', dpc.layout_step(T, {tp = 2, etp = 2}, FLASH, nil, nil, FLOOR))
    dpc.report('flash tp=2 x dp=2', dpc.layout_step(T, {tp = 2}, FLASH, nil, nil, FLOOR))
end)

T:test('20 steps of the tiny_flash SFT recipe at tp=2 x ep=2 give the losses of one rank', function()
    local dir = dpc.tmpdir()
    local over = {preset = 'tiny_flash', data = {seq_len = 128}, checkpoint = {every = 0}}
    -- two dp groups of micro-batch 2: the one-rank run of their micro-batches in turn
    local one = dpc.single(dir .. '/one.' .. d.rank(), dpc.merge(dpc.same_micro_batches(2, 2), over))
    local run = recipes.run('sft', dpc.recipe(dir .. '/tpep', dpc.merge({parallel = {tp = 2, ep = 2}}, over)))
    dpc.same_losses(T, 'flash tp=2 x ep=2', run.losses, one.losses, 20)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('tp=2 x ep=2 checkpoints: stopped and resumed, bit for bit; the pieces load at one rank, vision tower included',
    function()
    local dir = dpc.tmpdir()
    local over = {preset = 'tiny_flash', data = {seq_len = 128}, train = {steps = 8}, checkpoint = {every = 3},
                  parallel = {tp = 2, ep = 2}}
    local whole = recipes.run('sft', dpc.recipe(dir .. '/whole', over))
    dpc.stop_and_resume(T, 'sft', dir, over, whole)
    d.barrier()
    if d.rank() == 0 then
        -- the step-6 checkpoint of the uninterrupted run (pieces of 4 ranks), read whole on one
        -- rank: every tensor of the manifest, the carried vision tower too
        local ck = dir .. '/whole/ckpt/' .. require('lunar.train.checkpoint').step_name(6) .. '/model'
        local m = lunar.model.load(ck)
        local n = 0
        for name in pairs(m.carried) do if name:find('^model%.visual%.') then n = n + 1 end end
        assert(n > 0, 'the vision tower is in the sharded checkpoint')
        local sharded = require 'lunar.parallel.checkpoint'
        local entries = sharded.entries(ck)
        for name in m.params:names() do assert(entries[name], name .. ' in the manifest') end
        -- loading again at one rank gives the same bits
        local m2 = lunar.model.load(ck)
        for name, t in pairs(m.params.tensors) do T.equal(m2.params:get(name), t, name) end
        os.execute(('rm -rf %q'):format(dir))
    end
end)

os.exit(T:run())
