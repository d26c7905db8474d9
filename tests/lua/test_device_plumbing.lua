-- test_device_plumbing.lua: the models, modules and training loop with every tensor on the debug
-- device cpu:1 (LUNAR_FAKE_CPU_DEVICES=1, set by tests/CMakeLists.txt for this test; skipped, 77,
-- without it). cpu:1 is host memory run by the CPU kernels, but lunar treats it as a separate
-- device, as it treats a GPU: a tensor made on the default device (cpu) and mixed into a cpu:1 op
-- is the device-mismatch error it would be on CUDA, and every host read of cpu:1 memory is a
-- counted transfer (lunar.transfer_stats). So this finds, without a GPU, the places that would
-- fail or synchronise on one. Checks:
--   * the device: names, parsing, pools per device, copies both ways (strided, cast), mismatch
--     errors naming both devices, transfer counts;
--   * the six transformers fixtures (test_model_hf's cases), the indexer KL loss (sparse and
--     dense), routing replay, bf16 and MTP: logits, loss, routing, top-k and every gradient on
--     cpu:1 equal the cpu run bit for bit, and the host reads of a forward and backward stay
--     within the documented budget (loss value, routing counts once per MoE layer, cu_seqlens,
--     the forward's check point; none in the backward); with a check point after every index op
--     (the read-back per op that CUDA's index ops once made) the budget fails;
--   * index range errors on cpu:1 wait for a check point (lunar.sync_check, the forward's loss,
--     the optimizer step), which reads once and raises the op, the value and the range; on cpu
--     they fail at the op;
--   * LoRA adapters (dropout on), merge and PEFT save/load on cpu:1; AdamW state on the device;
--   * the SFT recipe (tiny preset, 2 steps of 2 packed rows): losses and weights equal the cpu
--     run bit for bit; a LoRA run (dropout on) resumed on cpu:1 from its checkpoint continues bit
--     for bit.
-- No tolerances: the same kernels run on the same values, so any difference is a bug.
local lunar = require 'lunar'
if lunar.device_count('cpu') < 2 then
    print('needs the debug device cpu:1 (LUNAR_FAKE_CPU_DEVICES=1): skipped')
    os.exit(77)
end
local io_ = require 'lunar.io'
local nn = require 'lunar.nn'
local ops = lunar.ops
local peft = require 'lunar.peft'
local T = require('lunar.testing').suite('device.plumbing')

local DEV = 'cpu:1'
local ROOT = 'tests/fixtures/models/'

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

local function same(a, b, what)
    assert(a:dtype() == b:dtype(), ('%s: dtype %s vs %s'):format(what, a:dtype(), b:dtype()))
    T.equal(a:size(), b:size(), what .. ' shape')
    T.equal(a, b, what)
end

local function on_dev(t, what)
    assert(t:device() == DEV, ('%s is on %s, not %s'):format(what, t:device(), DEV))
end

-- host reads (to_host transfers) while fn runs
local function reads(fn)
    local s0 = lunar.transfer_stats()
    local r = {fn()}
    local s1 = lunar.transfer_stats()
    return s1.to_host - s0.to_host, s1.from_host - s0.from_host, unpack(r)
end

-- ---- the device ---------------------------------------------------------------------------------

T:test('cpu:1: names, copies both ways, pools, mismatch errors, transfer counts', function()
    assert(lunar.device_count('cpu') == 2)
    local x = lunar.randn(5, 7, {rng = lunar.rng(3)})
    local y = x:to(DEV)
    on_dev(y, 'x:to(cpu:1)')
    assert(y:to(DEV) == y and x:to('cpu:0') == x, 'to() returns the tensor itself when nothing changes')
    same(y:to('cpu'), x, 'round trip')
    -- strided source and destination, with a cast, across devices
    local yt = x:t():to(DEV, 'bf16')
    same(yt:to('cpu'), x:t():to('bf16'), 'transposed bf16 copy')
    local dst = lunar.zeros(7, 10, {device = DEV}):narrow(2, 2, 5)
    dst:copy_(x:t())
    same(dst:to('cpu'), x:t(), 'copy_ into a strided cpu:1 view')
    assert(tostring(y):find('on cpu:1', 1, true), 'printing names the device')
    -- one pool per device
    local before = lunar.memory_stats(DEV).in_use
    local z = lunar.empty(1024, {device = DEV})
    assert(lunar.memory_stats(DEV).in_use > before, 'cpu:1 allocates from its own pool')
    z:free()
    local a = lunar.arena('dev', 4096, DEV)
    on_dev(a:tensor({8}, 'f32'), 'arena tensor')
    -- mixing devices is the mismatch error, naming both
    T.raises(function() ops.add(x, y) end, "is on cpu:1 but the op runs on cpu")
    T.raises(function() ops.gemm(y, x:t()) end, "is on cpu but the op runs on cpu:1")
    T.raises(function() lunar.zeros(2, {device = 'cpu:2'}) end, 'device cpu:2 not available')
    T.raises(function() lunar.zeros(2, {device = 'cpu:x'}) end, "unknown device 'cpu:x'")
    -- element reads and writes of device memory are transfers; host tensors cost none
    local n_to, n_from = reads(function() return y:get(1, 1), x:get(1, 1), y:set(1, 1, 2), y:sum():item() end)
    assert(n_to == 2 and n_from == 1, ('transfers: %d to the host, %d from it'):format(n_to, n_from))
end)

T:test('op wrappers make their tensors on the inputs\' device', function()
    local x = lunar.rand(4, 6, {rng = lunar.rng(1)})
    local y = x:to(DEV)
    for _, case in ipairs({
        {'pow(2, x)', function(t) return ops.pow(2, t) end},
        {'rsub', function(t) return ops.sub(1, t) end},
        {'maximum(x, number)', function(t) return ops.maximum(t, 0.5) end},
        {'topk', function(t) local v, i = ops.topk(t, 2); return ops.add(v, i:float()) end},
        {'global_norm', function(t) return ops.global_norm({t, t}, {tensor = true}) end},
        {'cross_entropy', function(t)
            local tg = lunar.tensor({1, 0, 5, -100}, {dtype = 'i64', device = t:device()})
            local loss, lp = ops.cross_entropy(t, tg)
            return ops.add(loss, lp)
        end},
    }) do
        local a, b = case[2](x), case[2](y)
        on_dev(b, case[1])
        same(b:to('cpu'), a, case[1])
    end
    on_dev(ops.rope_inv_freq(16, 10000, {device = DEV}), 'rope_inv_freq')
    on_dev(ops.causal_mask(5, 5, {device = DEV}), 'causal_mask')
    local cu = lunar.tensor({0, 2, 5}, {dtype = 'i64'})
    same(ops.block_mask(cu:to(DEV)):to('cpu'), ops.block_mask(cu), 'block_mask of device offsets')
end)

T:test('masks: built on the requested device from host or device offsets', function()
    local masks = nn.masks
    local cu1, cu2 = lunar.tensor({0, 3, 6}, {dtype = 'i64'}), lunar.tensor({0, 2, 6}, {dtype = 'i32'})
    local am = lunar.tensor({{1, 1, 1, 1, 1, 1}, {0, 1, 1, 1, 1, 1}})
    local ref = masks.build{B = 2, T = 6, cu_seqlens = {cu1, cu2}, attention_mask = am}
    for _, list in ipairs({{cu1, cu2}, {cu1:to(DEV), cu2:to(DEV)}}) do
        local m = masks.build{B = 2, T = 6, cu_seqlens = list, attention_mask = am:to(DEV), device = DEV}
        on_dev(m, 'mask')
        same(m:to('cpu'), ref, 'packed + padded mask')
    end
    local pos = masks.packed_positions({cu1, cu2}, {device = DEV})
    on_dev(pos, 'packed_positions')
    same(pos:to('cpu'), masks.packed_positions({cu1, cu2}), 'packed_positions')
    on_dev(masks.packed_positions(cu1:to(DEV)), 'packed_positions of device offsets')
    on_dev(masks.causal(2, 6, {device = DEV}), 'causal')
    local topk = lunar.tensor({{{0, 1}, {1, 2}, {0, 2}, {1, 3}, {2, 4}, {3, 5}}}, {dtype = 'i64'})
    local c = masks.causal(1, 6)
    same(masks.select(c:to(DEV), topk:to(DEV)):to('cpu'), masks.select(c, topk), 'select')
    same(masks.query_valid(ref:to(DEV), am:to(DEV)):to('cpu'), masks.query_valid(ref, am), 'query_valid')
end)

T:test('attention (head-major, fused and dense) and its backward on cpu:1', function()
    local att = nn.attention
    local r = lunar.rng(9)
    local q, k, v = lunar.randn(2, 4, 5, 8, {rng = r}), lunar.randn(2, 2, 5, 8, {rng = r}), lunar.randn(2, 2, 5, 6, {rng = r})
    local dout = lunar.randn(2, 4, 5, 6, {rng = r})
    local mask = nn.masks.causal(2, 5)
    local keys = lunar.tensor({{{0, 1}, {0, 1}, {1, 2}, {2, 3}, {3, 4}}, {{0, 1}, {1, 0}, {0, 2}, {1, 3}, {2, 4}}},
        {dtype = 'i64'})
    local function run(dev, opts)
        local function d(t) return t and t:to(dev) end
        local o, saved = att.forward(d(q), d(k), d(v), d(mask), 0.3, {keys = d(opts.keys), dense = opts.dense})
        local P = saved.P
        local dq, dk, dv = att.backward(d(dout), saved)
        return {o = o, P = P, dq = dq, dk = dk, dv = dv}
    end
    for _, opts in ipairs({{}, {keys = keys}, {dense = true}}) do
        local a, b = run('cpu', opts), run(DEV, opts)
        for name, t in pairs(a) do
            on_dev(b[name], name)
            same(b[name]:to('cpu'), t, name)
        end
    end
end)

-- ---- the models -----------------------------------------------------------------------------------

local CASES = {'glm5_dsa', 'glm5_mtp', 'glm5_packed', 'glm5_padded', 'glm5_gelu_tied', 'glm4moe'}

local function batch_of(ref, dev)
    local function d(t) return t and (dev and t:to(dev) or t) end
    return {input_ids = d(ref.input_ids), labels = d(ref.labels), position_ids = d(ref.position_ids),
            attention_mask = d(ref.attention_mask), cu_seqlens = d(ref.cu_seqlens)}
end

local function sparse_layers(model, mtp)
    local n = 0
    for _, L in ipairs(model.layers) do if L.mlp_type ~= 'dense' then n = n + 1 end end
    if mtp then n = n + #model.mtp end
    return n
end

-- forward (loss, MTP when the model has it) + backward on `dev`; the batch on `batch_dev` (nil:
-- the host, as a data loader makes it)
local function run_model(case, dev, opts)
    opts = opts or {}
    local dir = ROOT .. case
    local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
    local model = lunar.model.load(dir, {device = dev, dtype = opts.dtype, indexer_loss_coeff = opts.indexer_loss_coeff,
        indexer_loss = opts.indexer_loss})
    local batch = batch_of(ref, opts.batch_dev)
    batch.routing = opts.routing
    local mtp = #model.mtp > 0
    local n_to, n_from, out = reads(function()
        return model:forward(batch, {loss = true, mtp = mtp, num_items_in_batch = opts.num_items})
    end)
    local b_to, b_from, ixloss = reads(function() return model:backward({mtp_scale = mtp and 0.3 or 0}) end)
    return {model = model, out = out, ixloss = ixloss, to_host = n_to, from_host = n_from, bwd_to_host = b_to,
            bwd_from_host = b_from, ref = ref, mtp = mtp}
end

local function compare_runs(a, b, what)
    assert(a.out.loss == b.out.loss, ('%s: loss %.17g vs %.17g'):format(what, b.out.loss, a.out.loss))
    assert(a.out.mtp_loss == b.out.mtp_loss, what .. ': mtp loss')
    assert(a.ixloss == b.ixloss, what .. ': indexer loss')
    on_dev(b.out.logits, what .. ' logits')
    same(b.out.logits:to('cpu'), a.out.logits, what .. ' logits')
    same(b.out.hidden:to('cpu'), a.out.hidden, what .. ' hidden')
    for layer, r in pairs(a.out.routing) do
        on_dev(b.out.routing[layer].idx, 'routing idx')
        same(b.out.routing[layer].idx:to('cpu'), r.idx, what .. ' routing ' .. layer)
        same(b.out.routing[layer].weights:to('cpu'), r.weights, what .. ' routing weights ' .. layer)
    end
    for layer, t in pairs(a.out.topk) do same(b.out.topk[layer]:to('cpu'), t, what .. ' topk ' .. layer) end
    local n = 0
    for name, g in pairs(a.model:gradients()) do
        local h = b.model:gradients()[name]
        assert(h, what .. ': no gradient for ' .. name .. ' on ' .. DEV)
        on_dev(h, name .. ' gradient')
        same(h:to('cpu'), g, what .. ' grad ' .. name)
        n = n + 1
    end
    for name in pairs(b.model:gradients()) do assert(a.model:gradients()[name], what .. ': extra gradient ' .. name) end
    for name, p in pairs(b.model:parameters()) do on_dev(p, name) end
    return n
end

-- The host reads a forward may make: the loss value (plus the count of valid targets when the
-- caller gives no num_items_in_batch), for the MTP loss the same, the expert counts once per MoE
-- layer (they size the per-expert gemms), the indexer KL loss's two scalars per full layer,
-- cu_seqlens (once when it was given on the device, and once per row when the block mask checks
-- its device copy) and the forward's check point (one read of the device's index range record).
-- The backward reads nothing. Anything more is a new host round trip in the step.
local function read_budget(r, opts)
    opts = opts or {}
    local n = (opts.num_items and 1 or 2) + sparse_layers(r.model, r.mtp) + 1
    if r.mtp then n = n + 2 end
    if opts.indexer_layers then n = n + 2 * opts.indexer_layers end
    if r.ref.cu_seqlens then n = n + (opts.batch_dev and 1 or 0) + 1 end
    return n
end

-- nil when the forward's and the backward's reads are within the budget, else what is over
local function over_read_budget(r, what, opts)
    local budget = read_budget(r, opts)
    if r.to_host > budget then
        return ('%s: the forward read the device %d times, the budget is %d'):format(what, r.to_host, budget)
    end
    if r.bwd_to_host > 0 then return ('%s: the backward read the device %d times, the budget is 0'):format(what,
        r.bwd_to_host) end
    return nil
end

-- The copies to the device a forward may make: each batch tensor given on the host (a data
-- loader's), once, and the offsets of each packed row (the block mask is built on the device).
local function write_budget(r, opts)
    opts = opts or {}
    local n = 0
    if not opts.batch_dev then
        for _, k in ipairs({'input_ids', 'labels', 'position_ids', 'attention_mask'}) do
            if r.ref[k] then n = n + 1 end
        end
        for _ in pairs(opts.routing or {}) do n = n + 1 end
    end
    if r.ref.cu_seqlens then n = n + 1 end
    return n
end

for _, case in ipairs(CASES) do
    T:test(case .. ': forward, losses and every gradient on cpu:1 equal the cpu run bit for bit', function()
        local a = run_model(case, 'cpu')
        assert(a.to_host == 0 and a.from_host == 0, 'a cpu run makes no transfers')
        -- the batch on the host (as the loader makes it; the model moves it) and on the device
        for _, bdev in ipairs({false, DEV}) do
            local o = {batch_dev = bdev or nil, num_items = (bdev and 37 or nil)}
            local a2 = bdev and run_model(case, 'cpu', o) or a
            local b = run_model(case, DEV, o)
            local n = compare_runs(a2, b, case)
            local over = over_read_budget(b, case, o)
            assert(not over, over)
            assert(b.from_host <= write_budget(b, o), ('%s: the forward wrote to the device %d times, the budget is %d')
                :format(case, b.from_host, write_budget(b, o)))
            assert(b.bwd_from_host == 0, ('%s: the backward wrote to the device %d times'):format(case, b.bwd_from_host))
            assert(n > 20, case .. ': gradients compared ' .. n)
        end
    end)
end

T:test('indexer KL loss (sparse and dense), routing replay and bf16 on cpu:1', function()
    for _, variant in ipairs({'sparse', 'dense'}) do
        local o = {indexer_loss_coeff = 0.1, indexer_loss = variant}
        local a, b = run_model('glm5_dsa', 'cpu', o), run_model('glm5_dsa', DEV, o)
        assert(a.ixloss > 0)
        compare_runs(a, b, 'indexer loss ' .. variant)
        local over = over_read_budget(b, 'indexer loss ' .. variant, {indexer_layers = 2})
        assert(not over, over)
    end
    -- replay: the recorded choices given on the host drive the cpu:1 model
    local a = run_model('glm5_dsa', 'cpu')
    local replay = {}
    for layer, r in pairs(a.out.routing) do replay[layer] = r.idx end
    local b = run_model('glm5_dsa', DEV, {routing = replay})
    compare_runs(a, b, 'replay')
    assert(b.from_host <= write_budget(b, {routing = replay}), 'replay writes: ' .. b.from_host)
    -- bf16 parameters and activations
    local c, d = run_model('glm5_gelu_tied', 'cpu', {dtype = 'bf16'}), run_model('glm5_gelu_tied', DEV, {dtype = 'bf16'})
    assert(d.model:parameters()['model.embed_tokens.weight']:dtype() == 'bf16')
    compare_runs(c, d, 'bf16')
end)

T:test('a check point after every index op (the read-back per op CUDA once made) breaks the read budget', function()
    -- the same forward and backward with every index op followed by its check point, as each
    -- CUDA index op used to read its range flag back: the budget test must see it
    local a = run_model('glm5_dsa', DEV)
    assert(not over_read_budget(a, 'glm5_dsa'))
    assert(lunar.check_each_op() == false)
    lunar.check_each_op(true)
    local ok, b = pcall(run_model, 'glm5_dsa', DEV)
    lunar.check_each_op(false)
    assert(ok, b)
    assert(b.out.loss == a.out.loss, 'the checks change no value')
    local over = over_read_budget(b, 'glm5_dsa')
    assert(over and over:find('the forward read the device', 1, true), over)
    assert(b.bwd_to_host > 0, 'the backward\'s index ops check too: ' .. b.bwd_to_host)
end)

T:test('index range errors: at the op on cpu; on cpu:1 at the next check point, one read', function()
    local src = lunar.randn(5, 3, {rng = lunar.rng(2)}):set_name('table')
    local bad = lunar.tensor({1, 7, 0}, {dtype = 'i64'})
    local want = "index_select: index 7 (at flat position 1 of the index) out of range: src 'table' has 5 entries " ..
        "along dim 0 (0-based), valid 0..4"
    -- the host: at the op, no deferral note
    local err = T.raises(function() ops.index_select(src, 1, bad) end, want)
    assert(not err:find('check point', 1, true), err)
    lunar.sync_check('cpu')
    -- cpu:1: the op returns (the bad row reads as 0s), nothing is read until the check point
    local d, di = src:to(DEV), bad:to(DEV)
    local n_to, _, out = reads(function() return ops.index_select(d, 1, di) end)
    assert(n_to == 0, 'the op read the device ' .. n_to .. ' times')
    same(out:to('cpu'):select(1, 2), lunar.zeros(3), 'the skipped row')
    -- the first bad op is the one reported; later ones on the same device are not
    ops.scatter_add_(lunar.zeros(2, {device = DEV}), 1, lunar.tensor({3}, {dtype = 'i64', device = DEV}),
        lunar.ones(1, {device = DEV}))
    n_to = reads(function()
        err = T.raises(function() lunar.sync_check(DEV) end, want .. ' (found on cpu:1, which reports bad indices')
    end)
    assert(n_to == 1, 'the check point read the device ' .. n_to .. ' times')
    assert(err:find('LUNAR_CHECK_EACH_OP=1', 1, true), err)
    lunar.sync_check(DEV)   -- the check cleared it
    -- every op of the family defers (embedding, index_add, gather, scatter, embedding_backward)
    local ids = lunar.tensor({0, 9}, {dtype = 'i64', device = DEV})
    for _, case in ipairs({
        {'embedding_forward', function() ops.embedding(ids, d) end},
        {'embedding_backward', function() ops.embedding_backward(lunar.zeros(5, 3, {device = DEV}),
            lunar.ones(2, 3, {device = DEV}), ids) end},
        {'index_add', function() lunar.zeros(5, 3, {device = DEV}):index_add_(1, ids, lunar.ones(2, 3, {device = DEV})) end},
        {'gather', function() ops.gather(d, 1, lunar.tensor({{0, 9, 0}}, {dtype = 'i64', device = DEV})) end},
        {'scatter', function() lunar.zeros(5, 3, {device = DEV}):scatter_(1,
            lunar.tensor({{0, 9, 0}}, {dtype = 'i64', device = DEV}), lunar.ones(1, 3, {device = DEV})) end},
    }) do
        case[2]()
        T.raises(function() lunar.sync_check(DEV) end, case[1] .. ': index 9')
    end
    -- an op that fails for another reason (here an out it cannot write) records no range error, as
    -- on CUDA, where its kernel would never run
    T.raises(function() ops.index_select(d, 1, di, {out = lunar.zeros(1, 3, {device = DEV}):expand(3, 3)}) end,
        'cannot be written')
    lunar.sync_check(DEV)
    -- lunar.synchronize is a check point too
    ops.index_select(d, 1, di)
    T.raises(function() lunar.synchronize(DEV) end, want)
    -- check each op: the op itself fails, with one read
    lunar.check_each_op(true)
    local ok, e2 = pcall(ops.index_select, d, 1, di)
    lunar.check_each_op(false)
    assert(not ok and tostring(e2):find(want, 1, true), tostring(e2))
    assert(not tostring(e2):find('LUNAR_CHECK_EACH_OP=1 reports', 1, true), 'no advice to turn on what is on: ' .. tostring(e2))
    lunar.sync_check(DEV)
end)

T:test('a bad token id on cpu:1 fails the forward that met it; the optimizer step checks before updating', function()
    local dir = ROOT .. 'glm5_dsa'
    local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
    local model = lunar.model.load(dir, {device = DEV})
    local V = model.cfg.vocab_size
    local ids = ref.input_ids:clone()
    ids:set(1, 2, V + 3)
    local batch = batch_of(ref)
    batch.input_ids = ids
    T.raises(function() model:forward(batch, {loss = true}) end,
        ('embedding_forward: index %d (at flat position 1 of the index) out of range'):format(V + 3))
    -- a forward without a loss reads nothing; the optimizer step's check point raises it, before
    -- any parameter changes
    local opt = lunar.optim.AdamW.new(model.params, {lr = 1e-2})
    model:forward(batch_of(ref), {loss = true})
    model:backward()
    local w = model.params:get('model.embed_tokens.weight'):to('cpu')
    model:forward(batch, {keep = false})
    T.raises(function() opt:step() end, 'embedding_forward: index ' .. (V + 3))
    same(model.params:get('model.embed_tokens.weight'):to('cpu'), w, 'no update')
    opt:step()   -- the error was raised once; the next step goes on
end)

T:test('new(config, {device = cpu:1}) and save_hf from cpu:1 equal the cpu model\'s, byte for byte', function()
    local cfg = lunar.model.config.load(ROOT .. 'glm5_dsa/config.json')
    local a, b = lunar.model.new(cfg, {seed = 5}), lunar.model.new(cfg, {seed = 5, device = DEV})
    for name, p in pairs(a:parameters()) do
        on_dev(b:parameters()[name], name)
        same(b:parameters()[name]:to('cpu'), p, name)
    end
    local ids = lunar.randint(0, cfg.vocab_size, {2, 8}, {rng = lunar.rng(1)})
    local oa = a:forward({input_ids = ids, labels = ids}, {loss = true})
    local ob = b:forward({input_ids = ids, labels = ids}, {loss = true})
    assert(oa.loss == ob.loss)
    local m = lunar.model.load(ROOT .. 'glm5_mtp', {device = DEV})
    local d1, d2 = tmpdir(), tmpdir()
    lunar.model.load(ROOT .. 'glm5_mtp'):save_hf(d1)
    m:save_hf(d2)
    local f1 = io.open(d1 .. '/model.safetensors', 'rb'):read('*a')
    local f2 = io.open(d2 .. '/model.safetensors', 'rb'):read('*a')
    assert(#f1 > 0 and f1 == f2, 'the exports differ')
    os.execute(('rm -rf %q %q'):format(d1, d2))
end)

-- ---- LoRA and the optimizer -----------------------------------------------------------------------

local function lora_model(dev)
    lunar.manual_seed(4)
    local model = lunar.model.load(ROOT .. 'glm5_mtp', {device = dev})
    local set = peft.apply(model, {r = 4, alpha = 8, dropout = 0.2, seed = 3,
        targets = {'q_a_proj', 'kv_b_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'}})
    for _, name in ipairs(set.order) do
        local B = set.params:get(set.modules[name].b_name)
        B:copy_(ops.mul(lunar.randn(B:size(), {rng = lunar.rng(#name)}), 0.1))
    end
    return model, set
end

T:test('LoRA on cpu:1: adapters, dropout, AdamW, merge, PEFT save and load equal the cpu run', function()
    local ref = io_.load_checkpoint(ROOT .. 'glm5_mtp/reference.safetensors')
    local res = {}
    for _, dev in ipairs({'cpu', DEV}) do
        local model, set = lora_model(dev)
        local opt = lunar.optim.AdamW.new(set.params, {lr = 1e-2, clip = 0.5})
        local losses = {}
        for step = 1, 2 do
            local out = model:forward(batch_of(ref), {loss = true})
            model:backward()
            opt:step{loss = out.loss}
            opt:zero_grad()
            losses[step] = out.loss
        end
        local dir = tmpdir()
        peft.save(model, dir)
        local merged = lunar.model.load(ROOT .. 'glm5_mtp', {device = dev})
        peft.load(merged, dir)
        peft.merge(merged)
        res[dev] = {model = model, set = set, losses = losses, opt = opt, dir = dir, merged = merged,
                    bytes = io.open(dir .. '/adapter_model.safetensors', 'rb'):read('*a')}
    end
    local a, b = res.cpu, res[DEV]
    for i = 1, 2 do assert(a.losses[i] == b.losses[i], ('step %d: %.17g vs %.17g'):format(i, b.losses[i], a.losses[i])) end
    assert(b.set.draws == a.set.draws and b.set.draws > 0, 'dropout draws')
    for _, name in ipairs(a.set.order) do
        for _, w in ipairs({a.set.modules[name].a_name, a.set.modules[name].b_name}) do
            on_dev(b.set.params:get(w), w)
            same(b.set.params:get(w):to('cpu'), a.set.params:get(w), w)
        end
    end
    for k, t in pairs(b.opt:state_dict().tensors) do on_dev(t, 'optimizer state ' .. k) end
    assert(a.bytes == b.bytes, 'the PEFT files differ')
    for name, p in pairs(a.merged:parameters()) do same(b.merged:parameters()[name]:to('cpu'), p, 'merged ' .. name) end
    -- the optimizer state of the cpu run, loaded onto the cpu:1 run's parameters
    b.opt:load_state_dict(a.opt:state_dict())
    for k, t in pairs(b.opt:state_dict().tensors) do on_dev(t, 'loaded optimizer state ' .. k) end
    os.execute(('rm -rf %q %q'):format(a.dir, b.dir))
end)

-- ---- the recipes ----------------------------------------------------------------------------------

local common = dofile('recipes/common.lua')

local function recipe(kind, dev, dir, extra)
    local o = {quiet = true, expect_loss_fall = false, data = {limit = 8, seq_len = 128, micro_batch = 2, max_rejected = 0.5},
               checkpoint = {dir = dir .. '/ckpt', every = 1, keep_last = 2}, metrics = {dir = dir},
               output = {dir = false}, train = {steps = 2, log_every = 100, grad_accum = 1}, optim = {warmup = 1},
               model = {device = dev}}
    if kind == 'lora' then o.peft = {dropout = 0.1} end
    for k, v in pairs(extra or {}) do
        if type(v) == 'table' then for kk, vv in pairs(v) do o[k][kk] = vv end else o[k] = v end
    end
    return common.run(kind, o)
end

T:test('recipes: sft steps on cpu:1 equal the cpu run; a LoRA run resumed on cpu:1 continues bit for bit', function()
    local d1, d2 = tmpdir(), tmpdir()
    local a, b = recipe('sft', 'cpu', d1), recipe('sft', DEV, d2)
    for i = 1, 2 do
        assert(a.losses[i] == b.losses[i] and a.losses[i] > 0, ('sft step %d: %.17g vs %.17g'):format(i, b.losses[i],
            a.losses[i]))
    end
    for name in a.model.params:names() do
        on_dev(b.model.params:get(name), name)
        same(b.model.params:get(name):to('cpu'), a.model.params:get(name), 'sft ' .. name)
    end
    -- LoRA with dropout on cpu:1, and the same run resumed on cpu:1 from its step-1 checkpoint
    -- (base weights from the preset, adapters, optimizer state and dropout stream from the files)
    local d3, d4 = tmpdir(), tmpdir()
    local c = recipe('lora', DEV, d3)
    local r = recipe('lora', DEV, d4, {checkpoint = {resume = d3 .. '/ckpt/step_000001'}})
    assert(r.start_step == 1 and r.losses[1] == c.losses[2], ('resumed LoRA loss %.17g vs %.17g'):format(r.losses[1],
        c.losses[2]))
    for name in c.adapters.params:names() do
        on_dev(r.adapters.params:get(name), name)
        same(r.adapters.params:get(name):to('cpu'), c.adapters.params:get(name):to('cpu'), 'resumed ' .. name)
    end
    os.execute(('rm -rf %q %q %q %q'):format(d1, d2, d3, d4))
end)

os.exit(T:run())
