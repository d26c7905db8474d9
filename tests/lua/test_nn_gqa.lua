-- test_nn_gqa.lua: lunar.nn.GQA (Glm4Moe attention) on tiny configs (H 16, NH 4, head_dim 8,
-- partial rotary 0.5): forward against a per-head composition that repeats the KV heads
-- explicitly (repeat_kv), for nkv = 4, 2, 1, with and without QKV bias and QK-norm; full-module
-- gradchecks of dx and every parameter (f32, eps 1e-2, rtol 2e-2, atol 2e-3 on a random
-- projection of the output); packed documents against separate runs; config errors.
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local masks = nn.masks
local T = require('lunar.testing').suite('nn.gqa')

lunar.manual_seed(44)

local function config(nkv, bias, qk_norm)
    return {hidden_size = 16, num_attention_heads = 4, num_key_value_heads = nkv, head_dim = 8,
            partial_rotary_factor = 0.5, attention_bias = bias, use_qk_norm = qk_norm, rms_norm_eps = 1e-5}
end

local function store_for(cfg, name)
    local s = nn.params.new()
    local H, NH, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    local function w(n, o, i) s:add(name .. '.' .. n .. '.weight', ops.mul(lunar.randn(o, i), 0.4)) end
    local function b(n, o) s:add(name .. '.' .. n .. '.bias', ops.mul(lunar.randn(o), 0.1)) end
    w('q_proj', NH * hd, H); w('k_proj', nkv * hd, H); w('v_proj', nkv * hd, H); w('o_proj', H, NH * hd)
    if cfg.attention_bias then b('q_proj', NH * hd); b('k_proj', nkv * hd); b('v_proj', nkv * hd) end
    if cfg.use_qk_norm then
        for _, n in ipairs({'q_norm', 'k_norm'}) do s:add(name .. '.' .. n .. '.weight', ops.add(ops.mul(lunar.randn(hd), 0.1), 1)) end
    end
    return s
end

local function make_batch(B, Tn, rot, am)
    local pos = {}
    for _ = 1, B do for t = 1, Tn do pos[#pos + 1] = t - 1 end end
    return {B = B, T = Tn, positions = lunar.tensor(pos, 'i64'):view({B, Tn}),
            mask = masks.build{B = B, T = Tn, attention_mask = am and lunar.tensor(am, 'i64')},
            inv_freq = ops.rope_inv_freq(rot, 10000)}
end

-- per-head composition with explicitly repeated KV heads
local function reference(s, name, cfg, x, batch)
    local B, Tn, NH, nkv, hd = batch.B, batch.T, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    local function lin(n, inp)
        local y = ops.matmul(inp, s:get(name .. '.' .. n .. '.weight'):t())
        if s:has(name .. '.' .. n .. '.bias') then y = ops.add(y, s:get(name .. '.' .. n .. '.bias')) end
        return y
    end
    local function heads(y, n, norm)
        local v = y:view({B * Tn * n, hd})
        if norm then v = (ops.rmsnorm(v, s:get(name .. '.' .. norm .. '.weight'), cfg.rms_norm_eps)) end
        return v:view({B, Tn, n, hd})
    end
    local q = heads(lin('q_proj', x), NH, cfg.use_qk_norm and 'q_norm')
    local k = heads(lin('k_proj', x), nkv, cfg.use_qk_norm and 'k_norm')
    local v = lin('v_proj', x):view({B, Tn, nkv, hd})
    q = ops.rope(q, batch.positions, batch.inv_freq, {layout = 'half'})
    k = ops.rope(k, batch.positions, batch.inv_freq, {layout = 'half'})
    local o = lunar.empty(B, Tn, NH, hd)
    for b = 1, B do
        for h = 1, NH do
            local g = math.floor((h - 1) / (NH / nkv)) + 1      -- repeat_kv
            local sc = ops.matmul(q:select(1, b):select(2, h), k:select(1, b):select(2, g):t())
            local p = ops.softmax(ops.add(ops.mul(sc, hd ^ -0.5), batch.mask:select(1, b)))
            o:select(1, b):select(2, h):copy_(ops.matmul(p, v:select(1, b):select(2, g)))
        end
    end
    return ops.matmul(o:view({B * Tn, NH * hd}), s:get(name .. '.o_proj.weight'):t())
end

local VARIANTS = {{4, false, false}, {2, true, true}, {1, true, false}, {2, false, true}}

T:test('forward equals the repeat_kv composition', function()
    for _, vr in ipairs(VARIANTS) do
        local cfg = config(vr[1], vr[2], vr[3])
        local s = store_for(cfg, 'a')
        local m = nn.GQA.new(s, 'a', cfg)
        T.equal(m.rot_dim, 4, 'rot_dim')
        local batch = make_batch(2, 5, 4, {{1, 1, 1, 1, 1}, {1, 1, 1, 1, 0}})
        local x = lunar.randn(10, 16)
        T.close(m:forward(x, batch), reference(s, 'a', cfg, x, batch), {rtol = 1e-4, atol = 1e-5,
            msg = ('nkv %d bias %s qk_norm %s'):format(vr[1], tostring(vr[2]), tostring(vr[3]))})
    end
end)

T:test('gradcheck: dx and every parameter', function()
    for _, vr in ipairs(VARIANTS) do
        local cfg = config(vr[1], vr[2], vr[3])
        local s = store_for(cfg, 'a')
        local m = nn.GQA.new(s, 'a', cfg)
        local batch = make_batch(2, 4, 4, {{1, 1, 1, 1}, {1, 1, 1, 0}})
        local x = lunar.randn(8, 16)
        local r = lunar.randn(8, 16)
        s:zero_grad()
        local _, saved = m:forward(x, batch)
        local dx = m:backward(r, saved)
        local inputs, grads = {x}, {dx}
        for pname in s:names() do
            inputs[#inputs + 1] = s:get(pname)
            grads[#grads + 1] = s:grad(pname):clone()
        end
        T.gradcheck{name = 'gqa nkv ' .. vr[1], eps = 1e-2, rtol = 2e-2, atol = 2e-3, max_checks = 32,
            inputs = inputs, grads = grads, f = function() return ops.sum(ops.mul((m:forward(x, batch)), r)):item() end}
    end
end)

T:test('packed documents (cu_seqlens) match separate runs', function()
    local cfg = config(2, true, true)
    local s = store_for(cfg, 'a')
    local m = nn.GQA.new(s, 'a', cfg)
    local cu = lunar.tensor({0, 3, 4, 7}, 'i64')
    local x = lunar.randn(7, 16)
    local packed = {B = 1, T = 7, positions = masks.packed_positions(cu), mask = masks.build{B = 1, T = 7, cu_seqlens = cu},
                    inv_freq = ops.rope_inv_freq(4, 10000)}
    local out = m:forward(x, packed)
    local start = 1
    for _, n in ipairs({3, 1, 3}) do
        T.close(out:narrow(1, start, n), (m:forward(x:narrow(1, start, n):contiguous(), make_batch(1, n, 4))),
            {rtol = 1e-5, atol = 1e-6, msg = 'document at ' .. start})
        start = start + n
    end
end)

T:test('config and input errors', function()
    local s = nn.params.new()
    T.raises(function() nn.GQA.new(s, 'a', config(3, false, false)) end, 'num_key_value_heads 3 does not divide')
    local c = config(2, false, false)
    c.partial_rotary_factor = 0.1
    T.raises(function() nn.GQA.new(s, 'a', c) end, 'rotary dim 0')
    c = config(2, false, false)
    c.rope_parameters, c.partial_rotary_factor = {partial_rotary_factor = 1.0}, nil
    T.equal(nn.GQA.new(s, 'a', c).rot_dim, 8, 'partial_rotary_factor from rope_parameters')
    local st = store_for(config(2, false, false), 'a')
    local m = nn.GQA.new(st, 'a', config(2, false, false))
    T.raises(function() m:forward(lunar.randn(10, 16), make_batch(2, 5, 8)) end, 'inv_freq has 4 entries, expected rot_dim/2 = 2')
end)

os.exit(T:run())
