-- np: 4
-- Tensor parallel on 4 ranks, a GLM-4.x MoE model and the tiny GLM-5: one step at tp=4 and at
-- tp=2 x dp=2 equals one rank's on the whole global batch (the loss and every gradient within 1e-5 relative L2, each
-- rank's block against its block of the whole gradient); so do tp x ep layouts (each tp rank sends
-- its share of the tokens to the experts), and 20 SFT steps in them; tp=2 x ep=2 checkpoints resume
-- bit for bit and load at one rank and at ep=4, and its written model is the one-rank file; the
-- LoRA recipe at tp=2 x ep=2 gives one rank's losses and adapters and resumes bit for bit; the
-- whole model's parameter and adapter counts come out of every layout's blocks.
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
    -- (index_topk 80: at 64 one query's 64th and 65th keys score within rounding of each other
    -- under OpenBLAS's AVX-512 sgemm, so the two sides pick different keys; a comparison of exact
    -- results needs a selection without a near tie)
    report('tp=2 x dp=2 GLM-5, index_topk 80', dpc.layout_step(T, {tp = 2}, {index_topk = 80}))
    report('tp=2 x dp=2 GLM-5, index_topk 80, indexer heads split', dpc.layout_step(T, {tp = 2, split_indexer = true},
        {index_topk = 80}))
end)

T:test('one step at tp=2 x ep=2, tp=4 x ep=2 and tp=2 x ep=4 (replayed routes) equals one rank', function()
    report('tp=2 x ep=2 GLM-5', dpc.layout_step(T, {tp = 2, ep = 2}))
    report('tp=2 x ep=2 GLM-4.x', dpc.layout_step(T, {tp = 2, ep = 2}, dpc.glm4_config))
    report('tp=4 x ep=2 GLM-5', dpc.layout_step(T, {tp = 4, ep = 2}, nil, 3))
    report('tp=2 x ep=4 GLM-5, replayed routes', dpc.layout_step(T, {tp = 2, ep = 4}, nil, nil, true))
end)

T:test('sequence parallel: one step at tp=2 x dp=2, tp=4 (GLM-4.x), tp=2 x ep=2 and tp=2 x etp=2 (replayed routes) '
    .. 'equals one rank', function()
    report('sequence parallel, tp=2 x dp=2 GLM-5', dpc.layout_step(T, {tp = 2, sequence_parallel = true}))
    report('sequence parallel, tp=4 GLM-4.x', dpc.layout_step(T, {tp = 4, sequence_parallel = true}, dpc.glm4_config))
    report('sequence parallel, tp=2 x ep=2 GLM-5', dpc.layout_step(T, {tp = 2, ep = 2, sequence_parallel = true}))
    report('sequence parallel, tp=2 x etp=2 GLM-5, replayed routes', dpc.layout_step(T, {tp = 2, etp = 2,
        sequence_parallel = true}, nil, nil, true))
end)

T:test('an MoE layer at tp=2 x ep=2 on 13 tokens (shares of 7 and 6) equals the whole layer', function()
    local lay = d.layout{tp = 2, ep = 2}
    local A = lunar.model.new(dpc.glm4_config, {seed = 11})
    local B = lunar.model.new(dpc.glm4_config, {seed = 11, tp = lay:group('tp'), ep = lay:group('ep')})
    local mA, mB = A.layers[2].mlp, B.layers[2].mlp
    local H = dpc.glm4_config.hidden_size
    local x = lunar.randn(13, H, {rng = lunar.rng(7)})          -- the same tokens on every rank
    local dy = lunar.randn(13, H, {rng = lunar.rng(8)})
    local yA, sA, rA = mA:forward(x)
    local yB, sB, rB = mB:forward(x)
    T.close(yB, yA, {rtol = 1e-5, atol = 1e-6})
    T.equal(lunar.ops.sum(lunar.ops.ne(rB.idx, rA.idx)):item(), 0, 'the routes, gathered whole')
    T.close(rB.weights, rA.weights, {rtol = 1e-6, atol = 0})
    local dxA, dxB = mA:backward(dy, sA), mB:backward(dy, sB)
    T.close(dxB, dxA, {rtol = 1e-5, atol = 1e-6})
    -- the router's gradient is this rank's share: whole only once summed over tp
    local router = 'model.layers.1.mlp.gate.weight'
    local partial = {}
    for _, n in ipairs(B:tp_partial_grads()) do partial[n] = true end
    assert(partial[router], 'the router is among the tp-partial gradients')
    assert(not partial['model.layers.1.mlp.experts.0.gate_proj.weight'], 'the experts are not')
    local share = B.params.grads[router]:clone()
    B:reduce_tp_grads()
    local rel = dpc.rel_l2(share, A.params.grads[router])
    assert(rel > 0.1, ('one rank\'s share of the router gradient is the whole one (rel %.3g)'):format(rel))
    T.close(B.params.grads[router], A.params.grads[router], {rtol = 1e-5, atol = 1e-7})
    -- each expert this rank holds saw all 13 tokens' rows through the ep group {0, 1} (or {2, 3})
    local e = B.layers[2].mlp.first
    local name = ('model.layers.1.mlp.experts.%d.down_proj.weight'):format(e)
    T.close(B.params.grads[name], A.params.grads[name], {rtol = 1e-5, atol = 1e-7})
end)

local recipes = dofile('recipes/common.lua')

T:test('20 steps of the tiny SFT recipe at tp=4, tp=2 x dp=2, tp=2 x ep=2 (with and without sequence parallel) give '
    .. 'the losses of one rank', function()
    local dir = dpc.tmpdir()
    local function check(label, got, want) dpc.same_losses(T, label, got, want, 20) end
    local one2 = dpc.single(dir .. '/one2.' .. d.rank(), {})
    check('tp=4', recipes.run('sft', dpc.recipe(dir .. '/tp4', {parallel = {tp = 4}, checkpoint = {every = 0}})).losses,
        one2.losses)
    -- (tp=2: two dp groups of micro-batch 2)
    local one4 = dpc.single(dir .. '/one4.' .. d.rank(), dpc.same_micro_batches(2, 2))
    check('tp=2 x dp=2', recipes.run('sft', dpc.recipe(dir .. '/tp2', {parallel = {tp = 2},
        checkpoint = {every = 0}})).losses, one4.losses)
    check('tp=2 x ep=2', recipes.run('sft', dpc.recipe(dir .. '/tpep', {parallel = {tp = 2, ep = 2},
        checkpoint = {every = 0}})).losses, one4.losses)
    check('tp=2 x ep=2, sequence parallel', recipes.run('sft', dpc.recipe(dir .. '/tpepsp', {parallel = {tp = 2, ep = 2,
        sequence_parallel = true}, checkpoint = {every = 0}})).losses, one4.losses)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('tp=2 x ep=2 checkpoints: the written model is the one-rank file byte for byte; stopped and resumed, bit for '
    .. 'bit; the checkpoint\'s pieces load at one rank, ep=4, tp=4 and ep=2 x etp=2 with the run\'s weights bit for bit',
    function()
    local data_parallel = require 'lunar.train.data_parallel'
    local dir = dpc.tmpdir()
    local dp = data_parallel.setup({parallel = {tp = 2, ep = 2}})
    local export = require 'lunar.train.export'
    for i, cfg in ipairs({dpc.preset.common.model.config, dpc.glm4_config}) do
        -- written as it is gathered (no rank holds the whole model): one file, and in 0.3 MB shards
        local split = lunar.model.new(cfg, {seed = 5, tp = dp.tp, ep = dp.ep})
        export.write_hf(dp, split, dir .. '/tpep' .. i)
        export.write_hf(dp, split, dir .. '/tpep_shards' .. i, {max_shard_bytes = 300000})
        if d.rank() == 0 then
            local one = lunar.model.new(cfg, {seed = 5})
            one:save_hf(dir .. '/one' .. i)
            dpc.same_model_files(dir .. '/tpep' .. i, dir .. '/one' .. i)
            one:save_hf(dir .. '/one_shards' .. i, {max_shard_bytes = 300000})
            local files = {'config.json', 'model.safetensors.index.json'}
            for f in io.popen(('ls %q'):format(dir .. '/one_shards' .. i)):lines() do
                if f:match('^model%-') then files[#files + 1] = f end
            end
            assert(#files > 4, 'several shards: ' .. #files)
            dpc.same_model_files(dir .. '/tpep_shards' .. i, dir .. '/one_shards' .. i, files)
        end
    end
    -- stop after step 5 (checkpoint at 3), resume: steps 4-8 as the uninterrupted run
    local over = {train = {steps = 8}, checkpoint = {every = 3}, parallel = {tp = 2, ep = 2}}
    dpc.stop_and_resume(T, 'sft', dir, over, recipes.run('sft', dpc.recipe(dir .. '/whole', over)))
    -- the finished run started again with its output gone writes it again, whole: the same bytes
    d.barrier()
    if d.rank() == 0 then os.execute(('mv %q %q'):format(dir .. '/whole/final', dir .. '/first')) end
    d.barrier()
    assert(recipes.run('sft', dpc.recipe(dir .. '/whole', over)).finished, 'nothing left to train')
    if d.rank() == 0 then dpc.same_model_files(dir .. '/whole/final', dir .. '/first') end
    -- the step-3 checkpoint against the run's weights at step 3: whole on one rank, spread at ep=4
    local at3 = dpc.recipe(dir .. '/at3', over)
    at3.stop_after = 3
    local run3 = recipes.run('sft', at3).model
    local ck = dir .. '/at3/ckpt/step_000003/model'
    local one = lunar.model.load(ck, {strict = true})
    local ep4 = lunar.model.load(ck, {ep = d.layout{ep = 4}:group('ep')})
    local slices = run3:tp_slices()
    local n = 0
    for name in run3.params:names() do
        local mine = run3.params:get(name)
        local sl = slices[name]
        for _, m in ipairs({one, ep4}) do
            if m.params:has(name) then
                local t = m.params:get(name)
                if sl then t = t:narrow(sl.dim, sl.start + 1, sl.len) end
                assert(lunar.ops.global_norm({lunar.ops.sub(t, mine)}) == 0, name .. ' differs in the checkpoint')
                n = n + 1
            end
        end
    end
    -- the checkpoint's model is each rank's pieces and a manifest (no rank gathered it): the ranks
    -- of dp index 0 wrote the split and expert tensors, rank 0 the whole ones
    if d.rank() == 0 then
        assert(require('lunar.core').fs.stat(ck .. '/manifest.json') and require('lunar.core').fs.stat(ck .. '/rank_00000.safetensors')
            and require('lunar.core').fs.stat(ck .. '/rank_00001.safetensors'), 'the pieces and the manifest')
        assert(not require('lunar.core').fs.stat(ck .. '/model.safetensors') and not require('lunar.core').fs.stat(ck .. '/rank_00002.safetensors'),
            'nothing gathered, nothing written twice')
    end
    -- every other layout reads its blocks from the pieces: ep=4, tp=4, ep=2 x etp=2 against one rank
    local function same_as_one(m, label)
        local slices = m:tp_slices('tp')
        for name, sl in pairs(m:tp_slices('etp')) do slices[name] = sl end
        for name in m.params:names() do
            local t = one.params:get(name)
            local sl = slices[name]
            if sl then t = t:narrow(sl.dim, sl.start + 1, sl.len) end
            assert(lunar.ops.global_norm({lunar.ops.sub(m.params:get(name), t)}) == 0,
                ('%s: the %s load differs from the one-rank load'):format(name, label))
        end
    end
    same_as_one(ep4, 'ep=4')
    same_as_one(lunar.model.load(ck, {tp = d.layout{tp = 4}:group('tp')}), 'tp=4')
    local lay = d.layout{ep = 2, etp = 2}
    same_as_one(lunar.model.load(ck, {ep = lay:group('ep'), etp = lay:group('etp')}), 'ep=2 x etp=2')
    assert(n > 100, 'compared ' .. n)
    -- a piece missing is named
    d.barrier()
    if d.rank() == 0 then
        os.execute(('cp -r %q %q'):format(ck, dir .. '/broken'))
        os.remove(dir .. '/broken/rank_00001.safetensors')
        T.raises(function() lunar.model.load(dir .. '/broken') end, 'lists rank_00001.safetensors, which is missing')
        -- a manifest that does not describe the pieces is refused naming the tensor: pieces that
        -- overlap (and leave rows nobody holds, the same count of elements), a dtype the file does
        -- not hold, a missing field
        local function edited(label, edit, wants)
            local sub = dir .. '/' .. label
            os.execute(('rm -rf %q && cp -r %q %q'):format(sub, ck, sub))
            local man = lunar.io.read_json(sub .. '/manifest.json')
            for _, t in ipairs(man.tensors) do if t.name == 'model.embed_tokens.weight' then edit(t) end end
            lunar.io.write_json(sub .. '/manifest.json', man)
            T.raises(function() lunar.model.load(sub) end, wants)
        end
        edited('overlap', function(t) t.pieces[2].start = t.pieces[2].start - 100 end,
            'tensor model.embed_tokens.weight: pieces overlap along dim 1 at 3100..3200')
        edited('dtype', function(t) t.dtype = 'bf16' end,
            'model.embed_tokens.weight is f32 (3200, 128), manifest.json says bf16 (3200, 128)')
        edited('fields', function(t) t.pieces = nil end, 'tensor model.embed_tokens.weight: no pieces')
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('the LoRA recipe at tp=2 x ep=2: the losses of one rank, the adapters one rank writes, a resume bit for bit',
    function()
    local dir = dpc.tmpdir()
    local over = {train = {steps = 20}, checkpoint = {every = 3}, parallel = {tp = 2, ep = 2}}
    local one = dpc.single(dir .. '/one.' .. d.rank(), {kind = 'lora', train = {steps = 20}, checkpoint = {every = 0},
        data = {micro_batch = 4}})
    local whole = recipes.run('lora', dpc.recipe(dir .. '/whole', over))
    dpc.same_losses(T, 'LoRA at tp=2 x ep=2', whole.losses, one.losses, 20)
    -- the adapters written from the split run: whole, every expert's, one rank's weights up to the
    -- rounding of 8 steps (compared tensor by tensor)
    if d.rank() == 0 then
        local f = lunar.io.load_checkpoint(dir .. '/whole/final/adapter_model.safetensors')
        local g = lunar.io.load_checkpoint(dir .. '/one.0/final/adapter_model.safetensors')
        local n, worst = 0, 0
        for name, t in pairs(g) do
            assert(f[name], name .. ' is missing from the adapters written at tp=2 x ep=2')
            T.equal(f[name]:size(), t:size(), name .. ' shape')
            local rel = dpc.rel_l2(f[name], t)
            assert(rel <= 1e-3, ('%s: relative L2 %.3g from one rank\'s'):format(name, rel))
            n, worst = n + 1, math.max(worst, rel)
        end
        for name in pairs(f) do assert(g[name], name .. ' written at tp=2 x ep=2 but not by one rank') end
        assert(n > 50, 'compared ' .. n .. ' adapter tensors')
        print(('  LoRA at tp=2 x ep=2 (20 steps): %d adapter tensors written whole, within %.2g of one rank\'s'):format(n, worst))
    end
    -- stopped after step 5 (checkpoint at 3), resumed: the same losses bit for bit
    dpc.stop_and_resume(T, 'lora', dir, over, whole)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('the whole model\'s parameter and adapter counts from any layout\'s blocks (the report\'s model line)',
    function()
    local data_parallel = require 'lunar.train.data_parallel'
    local cfg = dpc.preset.common.model.config
    local targets = dpc.preset.lora.peft.targets
    local one = lunar.model.new(cfg, {seed = 1})
    local want, want_lora = one.params:count(), lunar.peft.apply(one, {targets = targets}).params:count()
    for _, p in ipairs({{tp = 2, ep = 2}, {tp = 4}, {ep = 2, etp = 2}, {ep = 4}, {tp = 2}}) do
        local dp = data_parallel.setup({parallel = p})
        local m = lunar.model.new(cfg, {seed = 1, tp = dp.tp, ep = dp.ep, etp = dp.etp})
        local label = ('tp %d ep %d etp %d'):format(p.tp or 1, p.ep or 1, p.etp or 1)
        assert(m.params:count() < want or (p.tp or 1) * (p.ep or 1) * (p.etp or 1) == 1, label .. ': a rank holds part')
        T.equal(dp:whole_count(m.params, m), want, label .. ': parameters')
        if not p.etp then
            T.equal(dp:whole_count(lunar.peft.apply(m, {targets = targets}).params, m), want_lora, label .. ': adapters')
        end
    end
end)

os.exit(T:run())
