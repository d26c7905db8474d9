-- np: 2
-- Tensor parallel on 2 ranks, a GLM-4.x MoE model (GQA attention split by heads, dense and
-- shared-expert MLPs split column/row, routed experts and everything else replicated) and the
-- tiny GLM-5 (MLA split by heads, the DSA indexer whole, with and without dropping keys): one
-- step's loss and every gradient (each rank's block against its block of the whole gradient)
-- equal one rank's on the whole batch within 1e-5 relative L2; the vocabulary splits (embedding and
-- LM head rows, a vocab-parallel cross-entropy equal to the whole one, tied embeddings; a vocabulary
-- tp does not divide stays whole; RL's forwards, logprobs and entropy at the response positions at a
-- temperature, and their backward); a layout the heads do not divide fails naming the numbers.
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
        'tensor parallel (tp = 2) with the DSA indexer loss (indexer_loss_coeff 0.1; a recipe\'s '
        .. 'model.indexer_loss_coeff) is not implemented')
    local recipes = dofile('recipes/common.lua')
    local dir = dpc.tmpdir()
    T.raises(function() recipes.run('lora', dpc.recipe(dir .. '/b', {parallel = {tp = 2}, peft = {dropout = 0.1}})) end,
        'parallel.tp=2 with peft.dropout=0.1: LoRA dropout under tensor parallel is not implemented')
    T.raises(function() recipes.run('sft', dpc.recipe(dir .. '/c', {parallel = {tp = 2, distributed_optimizer = false}})) end,
        'parallel.tp=2 with parallel.distributed_optimizer=false is not implemented')
end)

local recipes = dofile('recipes/common.lua')
local data_parallel = require 'lunar.train.data_parallel'

T:test('the model written from tp=2 is the one-rank file, byte for byte (GLM-5 and GLM-4.x)', function()
    local dir = dpc.tmpdir()
    local dp = data_parallel.setup({parallel = {tp = 2}})
    for i, cfg in ipairs({dpc.preset.common.model.config, dpc.glm4_config}) do
        local whole = dp:gathered_model(lunar.model.new(cfg, {seed = 5, tp = dp.tp}))
        if d.rank() == 0 then
            whole:save_hf(dir .. '/tp' .. i)
            lunar.model.new(cfg, {seed = 5}):save_hf(dir .. '/one' .. i)
            dpc.same_model_files(dir .. '/tp' .. i, dir .. '/one' .. i)
        end
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('split_indexer: the DSA indexer\'s heads split over tp, every rank selecting the keys one rank selects', function()
    local tp = d.layout{tp = 2}:group('tp')
    local cfg = {}
    for k, v in pairs(dpc.preset.common.model.config) do cfg[k] = v end
    cfg.index_topk = 16
    local A = lunar.model.new(cfg, {seed = 3})
    local B = lunar.model.new(cfg, {seed = 3, tp = tp, split_indexer = true})
    local Hi = cfg.index_n_heads
    T.equal(lunar.model.new(cfg, {seed = 3, tp = tp}).params:get('model.layers.0.self_attn.indexer.weights_proj.weight')
        :size(1), Hi, 'whole unless asked')
    T.equal(B.params:get('model.layers.0.self_attn.indexer.weights_proj.weight'):size(1), Hi / 2, 'indexer heads a rank')
    local T_ = 48
    local ids = {}
    for i = 1, 2 * T_ do ids[i] = (i * 37) % 6000 + 1 end
    local batch = {input_ids = lunar.tensor(ids, 'i64'):view(2, T_)}
    local ta, tb = A:forward(batch).topk, B:forward(batch).topk
    local layers = 0
    for layer, t in pairs(ta) do
        -- the same keys (as sets: the order among equal scores may differ)
        local a = lunar.ops.sort(t:to('f32'), 3):tolist_flat()
        local b = lunar.ops.sort(tb[layer]:to('f32'), 3):tolist_flat()
        T.equal(#b, #a, 'top-k shape')
        for i = 1, #a do
            if a[i] ~= b[i] then error(('layer %d: key %d of the top-k differs: %d, one rank %d'):format(layer, i, b[i], a[i])) end
        end
        layers = layers + 1
    end
    assert(layers >= 2, 'indexer layers compared: ' .. layers)
end)

T:test('a sharded model keeps what it was read from: a fused bf16 checkpoint through tp=2 pieces writes back byte '
    .. 'for byte', function()
    local sharded = require 'lunar.model.sharded'
    local io_ = lunar.io
    local dir = dpc.tmpdir()
    local src = 'tests/fixtures/models/glm5_dsa'
    if d.rank() == 0 then
        -- the fixture with its experts fused (transformers 5's in-memory layout), in bf16, with metadata
        local w = io_.load_checkpoint(src)
        local cfg = io_.read_json(src .. '/config.json')
        local E, out, layers = cfg.n_routed_experts, {}, {}
        for name, t in pairs(w) do
            local pre = name:match('^(.*%.mlp%.experts)%.%d+%.[%w_]+%.weight$')
            if pre then layers[pre] = true else out[name] = t:to('bf16') end
        end
        for pre in pairs(layers) do
            local g0 = w[pre .. '.0.gate_proj.weight']
            local Im, H = g0:size(1), g0:size(2)
            local gu, dn = lunar.core.empty({E, 2 * Im, H}, 'bf16', 'cpu'), lunar.core.empty({E, H, Im}, 'bf16', 'cpu')
            for e = 0, E - 1 do
                gu:select(1, e + 1):narrow(1, 1, Im):copy_(w[('%s.%d.gate_proj.weight'):format(pre, e)])
                gu:select(1, e + 1):narrow(1, Im + 1, Im):copy_(w[('%s.%d.up_proj.weight'):format(pre, e)])
                dn:select(1, e + 1):copy_(w[('%s.%d.down_proj.weight'):format(pre, e)])
            end
            out[pre .. '.gate_up_proj'], out[pre .. '.down_proj'] = gu, dn
        end
        os.execute(('mkdir -p %q %q'):format(dir .. '/src', dir .. '/sh'))
        io_.write_json(dir .. '/src/config.json', cfg)
        io_.save_checkpoint(dir .. '/src', out, {metadata = {format = 'pt', note = 'fused'}})
    end
    d.barrier()
    local lay = d.layout{tp = 2}
    local m = lunar.model.load(dir .. '/src', {tp = lay:group('tp')})
    local pieces = sharded.shard_tensors(m, lay.plan, d.rank())
    if next(pieces) then io_.save_safetensors(dir .. '/sh/' .. sharded.file_name(d.rank()), pieces) end
    d.barrier()
    -- and the final export of the split model, gathered as it is written, is that file too
    require('lunar.train.export').write_hf(require('lunar.train.data_parallel').setup({parallel = {tp = 2}}), m,
        dir .. '/export')
    if d.rank() == 0 then
        sharded.write_manifest(m, dir .. '/sh', lay.plan)
        lunar.model.load(dir .. '/sh'):save_hf(dir .. '/back')
        local a = assert(io.open(dir .. '/src/model.safetensors', 'rb')):read('*a')
        for _, out in ipairs({'/back', '/export'}) do
            local b = assert(io.open(dir .. out .. '/model.safetensors', 'rb')):read('*a')
            assert(#a > 0 and a == b, out .. ': the model written differs from the fused bf16 file it was read from')
        end
        os.execute(('rm -rf %q'):format(dir))
    end
    d.barrier()
end)

T:test('the vocabulary splits over tp: embedding and LM head rows, a cross-entropy without whole logits', function()
    local vp = require 'lunar.nn.vocab_parallel'
    local tp = d.layout{tp = 2}:group('tp')
    local m = lunar.model.new(dpc.glm4_config, {tp = tp})
    local V = dpc.glm4_config.vocab_size
    T.equal(m.params:get('model.embed_tokens.weight'):size(), {V / 2, 64}, 'embedding rows a rank')
    T.equal(m.params:get('lm_head.weight'):size(), {V / 2, 64}, 'LM head rows a rank')
    -- the vocab-parallel cross-entropy against lunar.ops.cross_entropy on the whole logits:
    -- targets on either rank, one ignored, forward and backward
    local Vs, N = 12, 7
    local z = lunar.randn(N, Vs, {rng = lunar.rng(4)})                 -- the same on both ranks
    local tg = lunar.tensor({0, 11, 5, 6, -100, 3, 9}, 'i64')
    local v = {tp = tp, first = tp:rank() * Vs / 2, count = Vs / 2}
    local zl = z:narrow(2, v.first + 1, v.count):contiguous()
    local loss, lp, lse, ctx = vp.cross_entropy(zl, tg, v)
    local loss1, lp1, lse1 = lunar.ops.cross_entropy(z, tg)
    T.close(loss, loss1, {rtol = 1e-6, atol = 1e-6})
    T.close(lp, lp1, {rtol = 1e-6, atol = 1e-6})
    T.close(lse, lse1, {rtol = 1e-6, atol = 1e-6})
    local g = lunar.randn(N, {rng = lunar.rng(5)})
    local dz = vp.cross_entropy_backward(g, zl, lse, ctx)
    local dz1 = lunar.ops.cross_entropy_backward(g, z, lse1, tg)
    T.close(dz, dz1:narrow(2, v.first + 1, v.count), {rtol = 1e-5, atol = 1e-7})
    -- tied embeddings (one split tensor for both), and a vocabulary tp does not divide (whole)
    dpc.report('tp=2 GLM-5, tied embeddings', dpc.layout_step(T, {tp = 2}, {tie_word_embeddings = true}))
    local odd = {}
    for k, x in pairs(dpc.glm4_config) do odd[k] = x end
    odd.vocab_size = 6401
    T.equal(lunar.model.new(odd, {tp = tp}).params:get('lm_head.weight'):size(1), 6401, 'a vocabulary tp does not divide')
    dpc.report('tp=2 GLM-4.x, vocab_size 6401 (whole)', dpc.layout_step(T, {tp = 2}, odd))
end)

T:test('RL forwards with the vocabulary split: logprobs and entropy at the response positions, at a temperature, '
    .. 'and backward{dlogprobs, dentropy} equal one rank\'s', function()
    local tp = d.layout{tp = 2}:group('tp')
    local A = lunar.model.new(dpc.glm4_config, {seed = 6})
    local B = lunar.model.new(dpc.glm4_config, {seed = 6, tp = tp})
    assert(B.vocab, 'the vocabulary is split')
    local ids = {}
    for j = 1, 24 do ids[j] = (j * 53 + 7) % dpc.glm4_config.vocab_size end
    local batch = {input_ids = lunar.tensor({ids}, 'i64'), cu_seqlens = lunar.tensor({0, 10, 24}, 'i64')}
    local at = lunar.tensor({4, 5, 6, 7, 8, 15, 16, 17, 18, 19, 20, 21, 22}, 'i64')
    local tg = {}
    for i, p in ipairs(at:tolist_flat()) do tg[i] = ids[p + 2] end
    local P = #tg
    local opts = {logprobs = true, entropy = true, temperature = 0.8, head_positions = at,
                  head_targets = lunar.tensor(tg, 'i64')}
    local outA, outB = A:forward(batch, opts), B:forward(batch, opts)
    T.close(outB.logprobs, outA.logprobs, {rtol = 1e-5, atol = 1e-6})
    T.close(outB.entropy, outA.entropy, {rtol = 1e-5, atol = 1e-6})
    local dlp, dent = lunar.randn(P, {rng = lunar.rng(8)}), lunar.randn(P, {rng = lunar.rng(9)})
    A:backward{dlogprobs = dlp, dentropy = dent}
    B:backward{dlogprobs = dlp, dentropy = dent}
    B:reduce_tp_grads()
    local slices = B:tp_slices('tp')
    local worst, n = 0, 0
    for name in B.params:names() do
        local ga, gb = A.params.grads[name], B.params.grads[name]
        local sl = slices[name]
        if ga and sl then ga = ga:narrow(sl.dim, sl.start + 1, sl.len) end
        if ga then
            local diff = lunar.ops.sub(gb, ga)
            local r = math.sqrt(lunar.ops.sum(lunar.ops.mul(diff, diff)):item()) /
                math.max(math.sqrt(lunar.ops.sum(lunar.ops.mul(ga, ga)):item()), 1e-30)
            worst, n = math.max(worst, r), n + 1
        end
    end
    assert(n > 20, 'compared ' .. n .. ' gradients')
    assert(worst <= 1e-5, ('worst gradient relative L2 %.3g'):format(worst))
    -- the entropy alone (no labels): the whole row's through the split
    local eA = A:forward(batch, {entropy = true, keep = false}).entropy
    local eB = B:forward(batch, {entropy = true, keep = false}).entropy
    T.close(eB, eA, {rtol = 1e-5, atol = 1e-6})
    if d.rank() == 0 then print(('  vocab-parallel entropy: %d gradients, worst relative L2 %.2g'):format(n, worst)) end
end)

T:test('20 steps of the tiny SFT recipe at tp=2 give the losses of one rank; stopped and resumed, bit for bit', function()
    local dir = dpc.tmpdir()
    local one = dpc.single(dir .. '/one.' .. d.rank(), {})
    local tp = recipes.run('sft', dpc.recipe(dir .. '/tp', {parallel = {tp = 2}, checkpoint = {every = 0}}))
    local worst = dpc.same_losses(T, 'tp=2', tp.losses, one.losses, 20)
    -- the written model is the whole model: it loads on one rank, strictly, within rounding of one rank's
    if d.rank() == 0 then
        local m = lunar.model.load(dir .. '/tp/final', {strict = true})
        local r = one.model
        local worst_p = 0
        for name in r.params:names() do
            worst_p = math.max(worst_p, dpc.rel_l2(m.params:get(name), r.params:get(name)))
        end
        assert(worst_p <= 1e-3, ('the written model differs from one rank\'s by %.3g'):format(worst_p))
        print(('  20 steps at tp=2: worst loss rel %.2g; written weights within %.2g of one rank\'s'):format(worst, worst_p))
    end
    -- a run stopped after step 5 (checkpoint at 3) and resumed gives the same later losses
    local over = {train = {steps = 8}, checkpoint = {every = 3}, parallel = {tp = 2}}
    local whole = recipes.run('sft', dpc.recipe(dir .. '/whole', over))
    dpc.stop_and_resume(T, 'sft', dir, over, whole)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
