-- np: 4
-- Tensor parallel on 4 ranks, a GLM-4.x MoE model and the tiny GLM-5: one step at tp=4 and at
-- tp=2 x dp=2 equals one rank's on the whole global batch (the loss and every gradient within 1e-5 relative L2, each
-- rank's block against its block of the whole gradient); tp with ep is refused, naming both.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('tensor parallel np4', 4)

local report = dpc.report

T:test('one step at tp=4 equals one rank (GLM-4.x MoE)', function()
    report('tp=4', dpc.layout_step(T, {tp = 4}, dpc.glm4_config))
end)

T:test('one step at tp=2 x dp=2 equals one rank (GLM-4.x MoE)', function()
    report('tp=2 x dp=2', dpc.layout_step(T, {tp = 2}, dpc.glm4_config))
end)

T:test('one step at tp=4 and tp=2 x dp=2 equals one rank (the tiny GLM-5: MLA, DSA, MoE)', function()
    report('tp=4 GLM-5', dpc.layout_step(T, {tp = 4}))
    report('tp=2 x dp=2 GLM-5, index_topk 64', dpc.layout_step(T, {tp = 2}, {index_topk = 64}))
end)

T:test('tp with ep is refused on every rank, naming both', function()
    local lay = d.layout{tp = 2, ep = 2}
    T.raises(function() lunar.model.new(dpc.glm4_config, {tp = lay:group('tp'), ep = lay:group('ep')}) end,
        'tensor parallel (tp = 2) with expert parallel (ep = 2) is not implemented')
end)

local recipes = dofile('recipes/common.lua')

T:test('20 steps of the tiny SFT recipe at tp=4 and tp=2 x dp=2 give the losses of one rank', function()
    local dir = dpc.tmpdir()
    local function check(label, got, want) dpc.same_losses(T, label, got, want, 20) end
    local one2 = dpc.single(dir .. '/one2.' .. d.rank(), {})
    check('tp=4', recipes.run('sft', dpc.recipe(dir .. '/tp4', {parallel = {tp = 4}, checkpoint = {every = 0}})).losses,
        one2.losses)
    local one4 = dpc.single(dir .. '/one4.' .. d.rank(), {data = {micro_batch = 4}})
    check('tp=2 x dp=2', recipes.run('sft', dpc.recipe(dir .. '/tp2', {parallel = {tp = 2},
        checkpoint = {every = 0}})).losses, one4.losses)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
