-- test_model_hf.lua: the GLM models against transformers 5.25.0 (tests/fixtures/models, made by
-- tests/ref/make_reference.py), in f32 on CPU:
--   logits: max |lunar - hf| / max |hf| < 1e-5 (padded rows: real positions only)
--   loss: relative error < 1e-6
--   every parameter gradient: relative L2 error < 1e-4; parameters HF gives no gradient get none
--   DSA top-k (visible keys) and router choices identical; MTP loss and gradients (lunar's own
--   reference in the fixture); routing replay (R3); import -> export bit identity; capture hooks.
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local ops = lunar.ops
local T = require('lunar.testing').suite('model.hf')

local ROOT = 'tests/fixtures/models/'

local function load_case(name)
    local dir = ROOT .. name
    local model = lunar.model.load(dir)
    local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
    local batch = {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids,
                   attention_mask = ref.attention_mask, cu_seqlens = ref.cu_seqlens}
    return model, ref, batch, dir
end

local function rel_l2(a, b)
    local d = ops.norm(ops.sub(a:float(), b:float())):item()
    local n = ops.norm(b:float()):item()
    return n > 0 and d / n or d
end

-- logits error over the positions that count (attention_mask == 1 when present)
local function logits_error(out_logits, ref)
    local l, r = out_logits:float(), ref.logits:float()
    if ref.attention_mask then
        local keep = ops.eq(ref.attention_mask, 0):unsqueeze(3)
        l = ops.masked_fill(l, keep, 0)
        r = ops.masked_fill(r, keep, 0)
    end
    return ops.max(ops.abs(ops.sub(l, r))):item() / ops.max(ops.abs(r)):item()
end

local function check_grads(model, ref, prefix, what)
    local n, worst, wname = 0, 0, '-'
    for name, g in pairs(model:gradients()) do
        local r = ref[prefix .. name]
        if r then
            n = n + 1
            local e = rel_l2(g, r)
            if e > worst then worst, wname = e, name end
        else
            -- HF gives no gradient (indexer, MTP tensors for the main loss): ours must be zero
            assert(ops.max(ops.abs(g)):item() == 0, what .. ': ' .. name .. ' has a gradient HF does not give')
        end
    end
    for name in pairs(ref) do
        local p = name:match('^' .. prefix:gsub('%.', '%%.') .. '(.*)$')
        if p then
            assert(model:gradients()[p], what .. ': no gradient for ' .. p)
        end
    end
    assert(worst < 1e-4, ('%s: gradient %s relative L2 error %.3g'):format(what, wname, worst))
    return n, worst
end

-- the visible selected keys of each query, sorted (the fixture's convention; -1 pads)
local function visible_topk(topk, mask)
    local B, S, k = topk:size(1), topk:size(2), topk:size(3)
    local idx = topk:tolist()
    local m = mask
    local out = {}
    for b = 1, B do
        for s = 1, S do
            local keys = {}
            for j = 1, k do
                local t = idx[b][s][j]
                if m:get(b, s, t + 1) == 0 then keys[#keys + 1] = t end
            end
            table.sort(keys)
            for j = 1, k do out[#out + 1] = keys[j] or -1 end
        end
    end
    return out
end

local CASES = {'glm5_dsa', 'glm5_mtp', 'glm5_packed', 'glm5_padded', 'glm5_gelu_tied', 'glm4moe'}

for _, case in ipairs(CASES) do
    T:test(case .. ': logits, loss and every gradient match transformers', function()
        local model, ref, batch = load_case(case)
        local out = model:forward(batch, {loss = true})
        local le = logits_error(out.logits, ref)
        assert(le < 1e-5, ('logits error %.3g'):format(le))
        local loss_err = math.abs(out.loss - ref.loss:item()) / math.abs(ref.loss:item())
        assert(loss_err < 1e-6, ('loss %.9g vs %.9g (rel %.3g)'):format(out.loss, ref.loss:item(), loss_err))
        model:backward()
        local n, worst = check_grads(model, ref, 'grad.', case)
        print(('      %s: logits %.2g, loss %.2g, %d gradients, worst rel L2 %.2g'):format(case, le, loss_err, n, worst))
        -- DSA selection and router choices
        local prepared = model:prepare(batch)
        local compared = 0
        for name, t in pairs(ref) do
            local layer = name:match('^topk%.(%d+)$')
            if layer and out.topk[tonumber(layer)] then
                local got = visible_topk(out.topk[tonumber(layer)], prepared.mask)
                local want = t:tolist_flat()
                local rows = t:size(1) * t:size(2)
                local kref = t:size(3)
                local kgot = out.topk[tonumber(layer)]:size(3)
                assert(kref == kgot, ('%s topk layer %s: k %d vs %d'):format(case, layer, kgot, kref))
                T.equal(got, want, case .. ' topk layer ' .. layer)
                compared = compared + rows
            end
            layer = name:match('^routing%.(%d+)$')
            if layer then
                local r = out.routing[tonumber(layer)]
                assert(r, case .. ': no routing for layer ' .. layer)
                local got = ops.sort(r.idx:float())
                T.equal(got, t:float(), case .. ' routing layer ' .. layer)
                T.close(ops.gather(r.weights, 2, ops.argsort(r.idx:float())), ref['routing_weights.' .. layer],
                    {rtol = 1e-5, atol = 1e-6, msg = case .. ' routing weights ' .. layer})
            end
        end
        if case:match('^glm5') then assert(compared > 0, case .. ': no DSA top-k compared') end
    end)
end

T:test('glm5_mtp: MTP loss and its gradients (lunar reference)', function()
    local model, ref, batch = load_case('glm5_mtp')
    local out = model:forward(batch, {loss = true, mtp = true})
    local e = math.abs(out.mtp_loss - ref['mtp.loss']:item()) / ref['mtp.loss']:item()
    assert(e < 1e-6, ('mtp loss %.9g vs %.9g'):format(out.mtp_loss, ref['mtp.loss']:item()))
    model:backward({loss_scale = 0, mtp_scale = 1})
    local n = 0
    for name, g in pairs(model:gradients()) do
        local r = ref['mtp.grad.' .. name]
        if r then
            n = n + 1
            assert(rel_l2(g, r) < 1e-4, name .. ' MTP gradient')
        end
    end
    assert(n > 50, 'MTP gradients compared: ' .. n)
    -- without mtp the MTP tensors get no gradient and the main loss is unchanged
    model:zero_grad()
    local out2 = model:forward(batch, {loss = true})
    assert(out2.loss == out.loss)
    model:backward()
    assert(ops.max(ops.abs(model:gradients()['model.layers.2.eh_proj.weight'] or lunar.zeros(1))):item() == 0)
end)

T:test('routing replay (R3): same choices reproduce the forward, forced choices are used and the router learns', function()
    local model, ref, batch = load_case('glm5_dsa')
    local out = model:forward(batch, {loss = true})
    local replay = {}
    for layer, r in pairs(out.routing) do replay[layer] = r.idx end
    model:backward()
    local g1 = model:gradients()['model.layers.1.mlp.gate.weight']:clone()
    model:zero_grad()
    local b2 = {}
    for k, v in pairs(batch) do b2[k] = v end
    b2.routing = replay
    local out2 = model:forward(b2, {loss = true})
    assert(out2.loss == out.loss, 'replaying the recorded choices gives the same loss')
    model:backward()
    T.close(model:gradients()['model.layers.1.mlp.gate.weight'], g1, {rtol = 0, atol = 0})
    -- force every token of layer 1 to experts 0 and 1
    local forced = lunar.zeros(replay[1]:size(), {dtype = 'i64'})
    forced:select(2, 2):fill_(1)
    b2.routing = {[1] = forced}
    model:zero_grad()
    local out3 = model:forward(b2, {loss = true})
    T.equal(out3.routing[1].idx, forced, 'forced experts used')
    model:backward()
    assert(ops.norm(model:gradients()['model.layers.1.mlp.gate.weight']):item() > 0, 'router gradient under replay')
    local untouched = model:gradients()['model.layers.1.mlp.experts.5.up_proj.weight']
    assert(not untouched or ops.max(ops.abs(untouched)):item() == 0, 'experts not chosen get no gradient')
end)

T:test('import -> export -> import is bit-identical, tensor by tensor', function()
    for _, case in ipairs({'glm5_dsa', 'glm5_gelu_tied', 'glm4moe', 'glm5_mtp'}) do
        local model, _, _, dir = load_case(case)
        local out_dir = os.tmpname()
        os.remove(out_dir)
        model:save_hf(out_dir)
        local a = io_.load_checkpoint(dir .. '/model.safetensors')
        local b = io_.load_checkpoint(out_dir)
        local na, nb = 0, 0
        for name, t in pairs(a) do
            na = na + 1
            local u = b[name]
            assert(u, case .. ': export lost ' .. name)
            assert(u:dtype() == t:dtype(), name .. ' dtype')
            T.equal(u:size(), t:size(), name .. ' shape')
            T.equal(u, t, name .. ' bytes')
        end
        for _ in pairs(b) do nb = nb + 1 end
        assert(na == nb, ('%s: %d tensors in, %d out'):format(case, na, nb))
        local cfg2 = lunar.model.config.load(out_dir .. '/config.json')
        assert(cfg2.architecture == model.cfg.architecture and cfg2.num_hidden_layers == model.cfg.num_hidden_layers)
        os.execute(('rm -rf %q'):format(out_dir))
    end
end)

T:test('a bf16 checkpoint exports in bf16 with the same bytes; training changes what is written', function()
    local model = load_case('glm5_gelu_tied')
    local dir = os.tmpname()
    os.remove(dir)
    model:save_hf(dir, {dtype = 'bf16'})
    local m2 = lunar.model.load(dir)
    local dir2 = os.tmpname()
    os.remove(dir2)
    m2:save_hf(dir2)
    local a, b = io_.load_checkpoint(dir), io_.load_checkpoint(dir2)
    for name, t in pairs(a) do
        if t:dtype() == 'bf16' then T.equal(b[name], t, name) end
        assert(b[name]:dtype() == t:dtype(), name)
    end
    os.execute(('rm -rf %q %q'):format(dir, dir2))
end)

T:test('capture any layer input/output by name', function()
    local model, _, batch = load_case('glm5_dsa')
    local rec = model:record('^model%.layers%.2%.')
    model:forward(batch, {keep = false})
    assert(rec['model.layers.2.self_attn'].input and rec['model.layers.2.self_attn'].output)
    assert(rec['model.layers.2.mlp'].output:size(2) == model.cfg.hidden_size)
    assert(rec['model.layers.1.mlp'] == nil)
end)

T:test('bad checkpoints: missing and unexpected tensors, shape mismatch', function()
    local model, _, _, dir = load_case('glm5_gelu_tied')
    local tensors = io_.load_checkpoint(dir .. '/model.safetensors')
    local tmp = os.tmpname()
    os.remove(tmp)
    os.execute(('mkdir -p %q && cp %q/config.json %q/'):format(tmp, dir, tmp))
    local function save(t) io_.save_checkpoint(tmp, t) end
    local copy = {}
    for k, v in pairs(tensors) do copy[k] = v end
    copy['model.norm.weight'] = nil
    save(copy)
    T.raises(function() lunar.model.load(tmp) end, 'model.norm.weight')
    copy['model.norm.weight'] = tensors['model.norm.weight']
    copy['model.layers.0.mlp.bogus.weight'] = lunar.zeros(2)
    save(copy)
    T.raises(function() lunar.model.load(tmp) end, 'model.layers.0.mlp.bogus.weight')
    copy['model.layers.0.mlp.bogus.weight'] = nil
    copy['model.norm.weight'] = lunar.zeros(3)
    save(copy)
    T.raises(function() lunar.model.load(tmp) end, 'has shape (3)')
    os.execute(('rm -rf %q'):format(tmp))
    assert(model)
end)

T:test('new(config, seed) is deterministic and trains end to end', function()
    local cfg = lunar.model.config.load(ROOT .. 'glm5_dsa/config.json')
    local a = lunar.model.new(cfg, {seed = 5})
    local b = lunar.model.new(cfg, {seed = 5})
    T.equal(a:parameters()['model.layers.1.mlp.experts.2.up_proj.weight'],
        b:parameters()['model.layers.1.mlp.experts.2.up_proj.weight'], 'same seed, same weights')
    local ids = lunar.randint(0, cfg.vocab_size, {2, 8}, {rng = lunar.rng(1)})
    local out = a:forward({input_ids = ids, labels = ids}, {loss = true})
    a:backward()
    assert(out.loss > 0 and a:gradients()['lm_head.weight'])
end)

os.exit(T:run())
