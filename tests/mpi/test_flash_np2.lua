-- np: 2
-- GLM-5.3-Flash (glm5_next, the tiny_flash preset's model) under data parallel on 2 ranks: one
-- step equals one rank's on the whole global batch (the loss and every gradient within 1e-5
-- relative L2, each against the larger of its own norm and 1e-4 of the largest gradient's: the
-- mHC scales of layer 0, where every stream is still the embedding, have gradients that cancel to
-- rounding noise), with routes replayed (R3) too; 20 steps of the tiny_flash SFT recipe, with the
-- distributed optimizer, give the losses of one rank (resuming is the same code as GLM-5's:
-- test_dp_np2). Tensor and expert parallel are refused for this model family
-- (tests/lua/test_model_flash.lua).
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local recipes = dofile('recipes/common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('GLM-5.3-Flash data parallel np2', 2)
local FLASH = dofile('recipes/presets/tiny_flash.lua').common.model.config
local FLOOR = {norm_floor = 1e-4}

T:test('one step at dp=2 equals one rank', function()
    dpc.report('flash dp=2', dpc.layout_step(T, {dp = 2}, FLASH, nil, nil, FLOOR))
end)

T:test('one step at dp=2 with replayed routes (R3) equals one rank', function()
    dpc.report('flash dp=2, R3', dpc.layout_step(T, {dp = 2}, FLASH, nil, true, FLOOR))
end)

T:test('20 steps of the tiny_flash SFT recipe at dp=2 give the losses of one rank', function()
    local dir = dpc.tmpdir()
    local over = {preset = 'tiny_flash', data = {seq_len = 128}, checkpoint = {every = 0}}
    local one = dpc.single(dir .. '/one.' .. d.rank(), dpc.merge({data = {micro_batch = 4}}, over))
    local dp = recipes.run('sft', dpc.recipe(dir .. '/dp', over))
    dpc.same_losses(T, 'flash dp=2', dp.losses, one.losses, 20)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
