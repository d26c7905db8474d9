-- tests/mpi/dp_common.lua: what the data-parallel tests share (loaded with dofile; not a test).
--
-- one_step(T, distributed): one training step of the tiny GLM-5 model (f32, real chat data,
-- packed rows with padding) on every rank of the world as data parallel, against the same step
-- on the whole global batch computed by each rank alone (no collective): the loss, every
-- parameter gradient and every parameter after the update within 1e-5 relative L2 (the updates
-- themselves within 1e-3, see below).
local lunar = require 'lunar'
local data = require 'lunar.data'
local trainer = require 'lunar.train.trainer'
local grad_buffer = require 'lunar.optim.grad_buffer'
local distributed = require 'lunar.optim.distributed'
local moe_load = require 'lunar.train.moe_load'

local d = lunar.dist
local M = {}

M.preset = dofile('recipes/presets/tiny.lua')
M.tokenizer = 'recipes/presets/tiny/tokenizer.json'
M.data = {kind = 'chat', train = {'examples/data/sft/gsm8k_train_chat_first1000.jsonl'}, template = 'glm5',
          seq_len = 256, limit = 48, overlong = 'truncate'}

local function rel_l2(a, b)
    local diff = lunar.ops.global_norm({lunar.ops.sub(a, b)})
    local ref = lunar.ops.global_norm({b})
    if ref == 0 then return diff end
    return diff / ref
end
M.rel_l2 = rel_l2

local docs
local function documents()
    if not docs then
        local tok = lunar.tokenizer.load(M.tokenizer)
        docs = trainer.load_documents({data = M.data}, tok)
    end
    return docs
end

local ADAMW = {lr = 1e-3, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1, clip = 1.0,
               schedule = {warmup = 0, total = 10, decay = 'cosine', min_lr = 1e-4}}

-- the checks of one step; returns a table of measured numbers for the caller's messages
-- (config: changes to the tiny preset's model config)
function M.one_step(T, distributed_on, micro_batch, config)
    micro_batch = micro_batch or 2
    local world = d.world()
    local np, rank = world:size(), world:rank()
    local cfg = {}
    for k, v in pairs(M.preset.common.model.config) do cfg[k] = v end
    for k, v in pairs(config or {}) do cfg[k] = v end
    -- the reference: the whole global batch (micro_batch x np rows) on this rank alone
    local full = data.loader{source = documents(), seq_len = M.data.seq_len, micro_batch = micro_batch * np, seed = 3}
    local ref_batch = full:next()
    local A = lunar.model.new(cfg, {seed = 11})
    local outA = A:forward(ref_batch, {loss = true, num_items_in_batch = ref_batch.num_targets})
    A:backward()
    -- the rows hold several documents (packed) and padding
    local packed, slots = false, ref_batch.input_ids:numel()
    for _, cu in ipairs(ref_batch.cu_seqlens) do if cu:numel() > 2 then packed = true end end
    assert(packed, 'no row holds several documents')
    assert(ref_batch.num_tokens < slots, 'no padding in the batch')

    -- data parallel: this rank's share
    local mine = data.loader{source = documents(), seq_len = M.data.seq_len, micro_batch = micro_batch, seed = 3,
                             dp_rank = rank, dp_size = np}
    local b = mine:next()
    local B = lunar.model.new(cfg, {seed = 11})
    local buffer = grad_buffer.new(B.params, {group = world, shard = distributed_on, bucket_elems = 2 ^ 18, model = B})
    buffer:watch(B)
    local targets = d.all_reduce(lunar.tensor({b.num_targets}, 'f64'), {group = world}):item()
    T.equal(targets, ref_batch.num_targets, 'global target count')
    local outB = B:forward(b, {loss = true, num_items_in_batch = targets})
    buffer:arm()
    B:backward()
    local early = buffer:finish()
    assert(early > 0, 'no bucket started during backward')
    local loss = d.all_reduce(lunar.tensor({outB.loss}, 'f64'), {group = world}):item()
    local loss_rel = math.abs(loss - outA.loss) / math.abs(outA.loss)
    assert(loss_rel <= 1e-5, ('loss %.9g, one rank %.9g (rel %.3g)'):format(loss, outA.loss, loss_rel))

    -- every gradient (gathered from the shards with the distributed optimizer)
    local full_grads = buffer.flat
    if distributed_on then full_grads = d.all_gather(buffer.shard_grad, {group = world}) end
    local worst, worst_name, n = 0, nil, 0
    for _, e in ipairs(buffer.entries) do
        local ga = A.params.grads[e.name]
        local gb = full_grads:narrow(1, e.offset + 1, e.numel):view(e.shape)
        if ga then
            n = n + 1
            local r = rel_l2(gb, ga)
            if r > worst then worst, worst_name = r, e.name end
            assert(buffer:has_grad(e), e.name .. ' has a gradient on one rank but not here')
        else
            assert(not buffer:has_grad(e), e.name .. ' has a gradient here but not on one rank')
            T.equal(lunar.ops.global_norm({gb}), 0, e.name .. ' gradient without a backward')
        end
    end
    assert(n > 100, 'compared ' .. n .. ' gradients')
    assert(worst <= 1e-5, ('gradient of %s: relative L2 %.3g'):format(tostring(worst_name), worst))

    -- the optimizer step: the same update of every parameter
    local before = {}
    for name in A.params:names() do before[name] = A.params:get(name):clone() end
    local optA = lunar.optim.AdamW.new(A.params, ADAMW)
    local optB = distributed_on and distributed.new(B.params, buffer, ADAMW) or lunar.optim.AdamW.new(B.params, ADAMW)
    local infoA = optA:step{loss = outA.loss, micro_batches = 1}
    local infoB = optB:step{loss = loss, micro_batches = 1}
    assert(math.abs(infoA.grad_norm - infoB.grad_norm) <= 1e-5 * infoA.grad_norm,
        ('grad norm %.9g, one rank %.9g'):format(infoB.grad_norm, infoA.grad_norm))
    -- the parameters within 1e-5; their updates (about lr = 1e-3 of a parameter ~0.02) within
    -- 1e-3: AdamW's first update is about g / |g| per element, which turns the rounding of a
    -- gradient near zero into a visible change of that element
    local worst_p, worst_pname, worst_u, worst_uname, moved = 0, nil, 0, nil, 0
    for name in A.params:names() do
        local pa, pb = A.params:get(name), B.params:get(name)
        local da = lunar.ops.sub(pa, before[name])
        local db = lunar.ops.sub(pb, before[name])
        local rp = rel_l2(pb, pa)
        if rp > worst_p then worst_p, worst_pname = rp, name end
        if lunar.ops.global_norm({da}) > 0 then
            moved = moved + 1
            local r = rel_l2(db, da)
            if r > worst_u then worst_u, worst_uname = r, name end
        else
            T.equal(lunar.ops.global_norm({db}), 0, name .. ' moved here but not on one rank')
        end
    end
    assert(moved > 100, 'only ' .. moved .. ' parameters moved')
    assert(worst_p <= 1e-5, ('parameter %s after the step: relative L2 %.3g'):format(tostring(worst_pname), worst_p))
    assert(worst_u <= 1e-3, ('update of %s: relative L2 %.3g'):format(tostring(worst_uname), worst_u))
    return {loss_rel = loss_rel, grad_rel = worst, param_rel = worst_p, param_name = worst_pname, update_rel = worst_u,
            update_name = worst_uname, buckets = #buffer.buckets,
            early = early, optimizer = optB, reference = optA}
end

-- layout_step(T, spec[, config]): the forward and backward of one step in the layout `spec`
-- (lunar.dist.layout; the model built over it, the global batch split over dp) against the whole
-- global batch on this rank alone: the loss and every gradient this rank holds (a tensor-parallel
-- block against its block of the whole gradient), reduced as the layout reduces them (dense
-- parameters over dp, routed experts over edp), within 1e-5 relative L2. config: changes to the
-- tiny preset's model config, or a whole config (with model_type). Returns the measured numbers.
-- replay = true: both sides replay the routes another model chose for the global batch (R3).
function M.layout_step(T, spec, config, micro_batch, replay, opts)
    micro_batch = micro_batch or 2
    local sp, si = spec.sequence_parallel, spec.split_indexer
    local lspec = {}
    for k, v in pairs(spec) do if k ~= 'sequence_parallel' and k ~= 'split_indexer' then lspec[k] = v end end
    local lay = d.layout(lspec)
    local dp, ep, tp, etp = lay:group('dp'), lay:group('ep'), lay:group('tp'), lay:group('etp')
    local cfg = {}
    if not (config and config.model_type) then   -- changes to the tiny preset's, or a whole config
        for k, v in pairs(M.preset.common.model.config) do cfg[k] = v end
    end
    for k, v in pairs(config or {}) do cfg[k] = v end
    local full = data.loader{source = documents(), seq_len = M.data.seq_len, micro_batch = micro_batch * dp:size(), seed = 3}
    local ref_batch = full:next()
    local routes
    if replay then   -- routes another model chose: not the ones these weights would choose
        routes = {}
        for layer, r in pairs(lunar.model.new(cfg, {seed = 12}):forward(ref_batch).routing) do routes[layer] = r.idx end
        ref_batch.routing = routes
    end
    local A = lunar.model.new(cfg, {seed = 11})
    A:moe_load_reset()
    local outA = A:forward(ref_batch, {loss = true, num_items_in_batch = ref_batch.num_targets})
    A:backward()

    local mine = data.loader{source = documents(), seq_len = M.data.seq_len, micro_batch = micro_batch, seed = 3,
                             dp_rank = dp:rank(), dp_size = dp:size()}
    local b = mine:next()
    if replay then   -- this rank's rows of the global batch: rows [dp_rank * micro_batch, +micro_batch)
        local per = micro_batch * M.data.seq_len
        b.routing = {}
        for layer, idx in pairs(routes) do b.routing[layer] = idx:narrow(1, dp:rank() * per + 1, per):contiguous() end
        ref_batch.routing = nil
        local natural = lunar.model.new(cfg, {seed = 11}):forward(ref_batch)
        ref_batch.routing = routes
        local differ = 0
        for layer, r in pairs(natural.routing) do
            differ = differ + lunar.ops.sum(lunar.ops.ne(r.idx, routes[layer])):item()
        end
        assert(differ > 0, 'the replayed routes are the ones the model would choose')
    end
    local B = lunar.model.new(cfg, {seed = 11, ep = ep, tp = tp, etp = etp, sequence_parallel = sp, split_indexer = si})
    assert((B.sp ~= nil) == (sp == true and tp:size() > 1), 'sequence parallel on exactly when asked (tp > 1)')
    local targets = d.all_reduce(lunar.tensor({b.num_targets}, 'f64'), {group = dp}):item()
    T.equal(targets, ref_batch.num_targets, 'global target count')
    B:moe_load_reset()
    local outB = B:forward(b, {loss = true, num_items_in_batch = targets})
    B:backward()
    B:reduce_tp_grads()
    local loss = d.all_reduce(lunar.tensor({outB.loss}, 'f64'), {group = dp}):item()
    local loss_rel = math.abs(loss - outA.loss) / math.abs(outA.loss)
    assert(loss_rel <= 1e-5, ('loss %.9g, one rank %.9g (rel %.3g)'):format(loss, outA.loss, loss_rel))
    -- the experts' load summed over the layout's groups is the one-rank load of the global batch:
    -- the same total, and each expert's count within 2 (a near-tie the rounding flips moves a route)
    local _, loadA = moe_load.step_metrics(A, nil)
    local _, loadB = moe_load.step_metrics(B, {group = dp, tp = tp:size() > 1 and tp or nil})
    T.equal(#loadB, #loadA, 'MoE layers counted')
    for i, la in ipairs(loadA) do
        local ta, tb = 0, 0
        for e, c in ipairs(la.counts) do
            ta, tb = ta + c, tb + loadB[i].counts[e]
            assert(math.abs(c - loadB[i].counts[e]) <= 2, ('layer %d expert %d: %d routes, one rank %d'):format(la.layer,
                e - 1, loadB[i].counts[e], c))
        end
        T.equal(tb, ta, ('layer %d: routes of the global batch'):format(la.layer))
        T.equal(ta, ref_batch.input_ids:numel() * A.cfg.num_experts_per_tok, 'every token routed K times')
    end

    -- the experts this rank holds: its ep range, each exactly once
    local E = A.cfg.n_routed_experts
    local held, dense = {}, {}
    for name in B.params:names() do
        local e = name:match('%.mlp%.experts%.(%d+)%.')
        if e then held[#held + 1] = name else dense[#dense + 1] = name end
    end
    -- tensor parallel (and expert tensor parallel): where this rank's block of each split tensor
    -- sits in the whole one
    local slices = B:tp_slices('tp')
    for name, sl in pairs(B:tp_slices('etp')) do slices[name] = sl end
    local per_layer = 0
    -- (decoder layer 1 of any family: model.layers.1 or GLM-5.3-Flash's model.language_model.layers.1)
    for name in B.params:names() do
        if name:match('^model%.[%w_.]-layers%.1%.mlp%.experts%.%d+%.gate_proj') then per_layer = per_layer + 1 end
    end
    T.equal(per_layer, E / ep:size(), 'experts held per layer')
    -- dense gradients reduced over dp, the experts' over edp (all dense first: the same order everywhere)
    for _, name in ipairs(dense) do
        local g = B.params.grads[name]
        if g then d.all_reduce(g, {group = dp}) end
    end
    -- (with tp and no ep the experts are whole on every rank and see the tp group's same tokens:
    -- their gradients are the same on the tp ranks and add up over dp only)
    local expert_group = (ep:size() > 1 or etp:size() > 1) and lay:group('edp') or dp
    for _, name in ipairs(held) do
        local g = B.params.grads[name]
        if g then d.all_reduce(g, {group = expert_group}) end
    end
    local pairs_, largest = {}, 0
    for _, list in ipairs({dense, held}) do
        for _, name in ipairs(list) do
            local ga, gb = A.params.grads[name], B.params.grads[name]
            assert((ga == nil) == (gb == nil), name .. ': a gradient on one side only')
            -- (the largest of the whole gradients, before each is cut to this rank's block: the
            -- same floor on every rank)
            if ga then largest = math.max(largest, lunar.ops.global_norm({ga})) end
            local sl = slices[name]
            if ga and sl then ga = ga:narrow(sl.dim, sl.start + 1, sl.len) end
            if ga then pairs_[#pairs_ + 1] = {name, ga, gb} end
        end
    end
    -- opts.norm_floor: each error against the larger of its gradient's norm and norm_floor times
    -- the largest gradient's (GLM-5.3-Flash: the mHC scales and bases, those of layer 0 above all,
    -- whose streams are still equal copies, have gradients that cancel to 1e-4 .. 1e-5 of the
    -- largest, where fp32 rounding of their terms is the whole error)
    local floor = (opts and opts.norm_floor or 0) * largest
    local worst, worst_name, n = 0, nil, 0
    for _, p in ipairs(pairs_) do
        local name, ga, gb = p[1], p[2], p[3]
        n = n + 1
        local r = lunar.ops.global_norm({lunar.ops.sub(gb, ga)}) / math.max(lunar.ops.global_norm({ga}), floor, 1e-300)
        if r > worst then worst, worst_name = r, name end
    end
    assert(n > 50, 'compared ' .. n .. ' gradients')
    assert(worst <= 1e-5, ('gradient of %s: relative L2 %.3g'):format(tostring(worst_name), worst))
    return {loss_rel = loss_rel, grad_rel = worst, grad_name = worst_name, compared = n}
end

-- rank 0 prints what layout_step measured
function M.report(label, m)
    if d.rank() == 0 then
        print(('  %s: loss rel %.2g, worst gradient rel %.2g (%s), %d gradients'):format(label, m.loss_rel, m.grad_rel,
            tostring(m.grad_name), m.compared))
    end
end

-- the model files of two HF directories are the same bytes: model.safetensors and config.json,
-- or the files listed (a sharded export's shards and index)
function M.same_model_files(a, b, files)
    for _, f in ipairs(files or {'model.safetensors', 'config.json'}) do
        local x = assert(io.open(a .. '/' .. f, 'rb')):read('*a')
        local y = assert(io.open(b .. '/' .. f, 'rb')):read('*a')
        assert(#x > 0 and x == y, ('%s/%s differs from %s/%s'):format(a, f, b, f))
    end
end

-- the recipe `kind` with `over` (M.recipe under dir/cut) stopped after step 5, its last checkpoint
-- at step 3, then run again: it resumes from step 3 and its later losses are `whole`'s (the same
-- settings uninterrupted) bit for bit. Returns the resumed run's result.
function M.stop_and_resume(T, kind, dir, over, whole)
    local recipes = dofile('recipes/common.lua')
    local cut = M.recipe(dir .. '/cut', over)
    cut.stop_after = 5
    T.equal(#recipes.run(kind, cut).losses, 5, 'steps before the stop')
    cut.stop_after = false
    local second = recipes.run(kind, cut)
    T.equal(second.start_step, 3, 'resumed from the checkpoint of step 3')
    for i = 4, #whole.losses do
        assert(whole.losses[i] == second.losses[i - 3], ('%s step %d: loss %.17g uninterrupted, %.17g resumed'):format(
            kind, i, whole.losses[i], second.losses[i - 3]))
    end
    return second
end

-- a run's n losses against one rank's, each within 1e-5 relative; returns the worst
function M.same_losses(T, label, got, want, n)
    T.equal(#got, n, label .. ': steps')
    local worst = 0
    for i = 1, n do
        local rel = math.abs(got[i] - want[i]) / math.abs(want[i])
        assert(rel <= 1e-5, ('%s, step %d: loss %.9g, one rank %.9g (rel %.3g)'):format(label, i, got[i], want[i], rel))
        worst = math.max(worst, rel)
    end
    if d.rank() == 0 then print(('  %s: %d steps, worst loss rel %.2g'):format(label, n, worst)) end
    return worst
end

-- a GLM-4.x MoE config (GQA with q/k norms and biases, a dense first layer, MoE with a shared
-- expert) small enough for the tests, with the tiny tokenizer's vocabulary; its heads, key-value
-- heads and MLP widths divide by 4
M.glm4_config = {
    architectures = {'Glm4MoeForCausalLM'}, model_type = 'glm4_moe', attention_bias = true, use_qk_norm = true,
    hidden_size = 64, head_dim = 16, num_attention_heads = 8, num_key_value_heads = 4, intermediate_size = 96,
    moe_intermediate_size = 32, n_routed_experts = 8, num_experts_per_tok = 2, n_shared_experts = 1, n_group = 2,
    topk_group = 1, norm_topk_prob = true, routed_scaling_factor = 2.5, first_k_dense_replace = 1,
    num_hidden_layers = 3, num_nextn_predict_layers = 0, hidden_act = 'silu', rms_norm_eps = 1e-5,
    rope_parameters = {rope_type = 'default', rope_theta = 10000, partial_rotary_factor = 0.5},
    max_position_embeddings = 1024, vocab_size = 6400, pad_token_id = 6256, initializer_range = 0.02,
    tie_word_embeddings = false,
}

-- a small sft recipe (real data) under dir, with overrides
-- b's settings over a's (nested tables merged, lists replaced); returns a
function M.merge(a, b)
    for k, v in pairs(b or {}) do
        if type(v) == 'table' and type(a[k]) == 'table' and #v == 0 then M.merge(a[k], v) else a[k] = v end
    end
    return a
end

function M.recipe(dir, extra)
    local o = {quiet = true, expect_loss_fall = false,
        data = {limit = 64, seq_len = 256, micro_batch = 2, max_rejected = 0.5},
        train = {steps = 20, log_every = 100}, optim = {warmup = 2},
        checkpoint = {dir = dir .. '/ckpt', every = 100, keep_last = 3},
        metrics = {dir = dir, tensorboard = false}, output = {dir = dir .. '/final'},
        parallel = {bucket_mb = 1}}
    return M.merge(o, extra)
end

-- the one-rank reference's batch for a run whose data-parallel ranks (dp groups) each read
-- micro_batch rows: the same micro-batches one after the other (grad_accum of them a step), so
-- each forward has the shapes of a rank's and gives its bits. One micro-batch of all the rows
-- (micro_batch x dp) reads the same rows too, but its products have other shapes (BLAS picks
-- kernels by shape): the rounding differs in the last bits, and an MoE router's near-tie that
-- it flips parts two 20-step runs by 1e-5 and more from then on
function M.same_micro_batches(micro_batch, groups)
    return {data = {micro_batch = micro_batch}, train = {grad_accum = groups}}
end

-- the sft recipe (or extra.kind's: M.recipe under dir, with extra) on this rank alone: the
-- one-rank reference
function M.single(dir, extra)
    local recipes = dofile('recipes/common.lua')
    local kind = extra and extra.kind or 'sft'
    if extra then extra.kind = nil end
    local cfg = recipes.recipe(kind, M.recipe(dir, extra))
    recipes.validate(cfg)
    cfg.single_rank = true
    return trainer.run(recipes.clean(cfg))
end

function M.tmpdir()
    local dir
    if d.rank() == 0 then
        dir = os.tmpname()
        os.remove(dir)
        os.execute(('mkdir -p %q'):format(dir))
    end
    -- every rank uses rank 0's directory: its name goes over as bytes
    local bytes = {}
    for i = 1, 64 do bytes[i] = dir and (dir:byte(i) or 0) or 0 end
    local t = d.broadcast(lunar.tensor(bytes, 'i64'), {root = 0})
    local chars = {}
    for _, c in ipairs(t:tolist_flat()) do if c > 0 then chars[#chars + 1] = string.char(c) end end
    return table.concat(chars)
end

return M
