-- np: 2
-- Tensor parallel on 2 ranks, a GLM-4.x MoE model (GQA attention split by heads, dense and
-- shared-expert MLPs split column/row, routed experts and everything else replicated) and the
-- tiny GLM-5 (MLA split by heads, the DSA indexer whole, with and without dropping keys): one
-- step's loss and every gradient (each rank's block against its block of the whole gradient)
-- equal one rank's on the whole batch within 1e-5 relative L2; a layout the heads do not divide
-- fails naming the numbers.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('tensor parallel np2', 2)

T:test('one step at tp=2 equals one rank (GLM-4.x MoE)', function()
    local m = dpc.layout_step(T, {tp = 2}, dpc.glm4_config)
    if d.rank() == 0 then
        print(('  tp=2: loss rel %.2g, worst gradient rel %.2g (%s), %d gradients'):format(m.loss_rel, m.grad_rel,
            tostring(m.grad_name), m.compared))
    end
end)

T:test('one step at tp=2 equals one rank (the tiny GLM-5: MLA, DSA, MoE)', function()
    local m = dpc.layout_step(T, {tp = 2})
    local m2 = dpc.layout_step(T, {tp = 2}, {index_topk = 64})   -- the indexer selects: DSA really drops keys
    if d.rank() == 0 then
        print(('  tp=2 GLM-5: loss rel %.2g, worst gradient rel %.2g (%s); with index_topk 64: %.2g, %.2g (%s)'):format(
            m.loss_rel, m.grad_rel, tostring(m.grad_name), m2.loss_rel, m2.grad_rel, tostring(m2.grad_name)))
    end
end)

T:test('heads that tp does not divide fail on every rank naming the numbers', function()
    local cfg = {}
    for k, v in pairs(dpc.glm4_config) do cfg[k] = v end
    cfg.num_key_value_heads = 1
    local tp = d.layout{tp = 2}:group('tp')
    T.raises(function() lunar.model.new(cfg, {tp = tp}) end, 'num_key_value_heads 1 is not divisible by tp = 2')
    T.raises(function() lunar.model.new(dpc.preset.common.model.config, {tp = tp, indexer_loss_coeff = 0.1}) end,
        'tensor parallel (tp = 2) with the DSA indexer loss is not implemented')
end)

os.exit(T:run())
