-- test_nn_mla.lua: lunar.nn.MLA (GLM-5 MLA attention of one layer) on a tiny config (H 16, NH 2,
-- Dn 4, Dr 4, Dv 6, Rq 8, Rkv 8, B 2, T 5): full-module gradchecks of dx and every parameter
-- (with and without attention_bias, plain causal, right padding, and sparse attention through a
-- fixed IndexShare top-k), forward against an independent composition (de-interleave the rope
-- weights, then half-split RoPE, per-head attention written with plain ops), packed documents
-- against separate runs (with DSA dropping keys), the softmax scale, and the error messages.
-- Finite differences: f32, eps 1e-2, rtol 2e-2, atol 2e-3 on a random projection of the output.
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local masks = nn.masks
local T = require('lunar.testing').suite('nn.mla')

lunar.manual_seed(21)

local CFG = {hidden_size = 16, num_attention_heads = 2, q_lora_rank = 8, kv_lora_rank = 8, qk_nope_head_dim = 4,
             qk_rope_head_dim = 4, v_head_dim = 6, index_n_heads = 8, index_head_dim = 8}

local function with(base, extra)
    local c = {}
    for k, v in pairs(base) do c[k] = v end
    for k, v in pairs(extra or {}) do c[k] = v end
    return c
end

-- random weights of an MLA layer (and its indexer when asked) with O(1) activations
local function mla_store(cfg, name, indexer)
    local s = nn.params.new()
    local H, NH, Rq, Rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    local Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    local function w(n, o, i) s:add(name .. '.' .. n .. '.weight', ops.mul(lunar.randn(o, i), 0.4)) end
    local function b(n, o) s:add(name .. '.' .. n .. '.bias', ops.mul(lunar.randn(o), 0.1)) end
    local function norm(n, d) s:add(name .. '.' .. n .. '.weight', ops.add(ops.mul(lunar.randn(d), 0.1), 1)) end
    w('q_a_proj', Rq, H); norm('q_a_layernorm', Rq); w('q_b_proj', NH * (Dn + Dr), Rq)
    w('kv_a_proj_with_mqa', Rkv + Dr, H); norm('kv_a_layernorm', Rkv); w('kv_b_proj', NH * (Dn + Dv), Rkv)
    w('o_proj', H, NH * Dv)
    if cfg.attention_bias then b('q_a_proj', Rq); b('kv_a_proj_with_mqa', Rkv + Dr); b('o_proj', H) end
    if indexer then
        local Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        w('indexer.wq_b', Hi * Di, Rq); w('indexer.wk', Di, H); w('indexer.weights_proj', Hi, H)
        norm('indexer.k_norm', Di); b('indexer.k_norm', Di)
        for _, n in ipairs({'wq_b.weight', 'wk.weight', 'weights_proj.weight', 'k_norm.weight', 'k_norm.bias'}) do
            s:set_trainable(name .. '.indexer.' .. n, false)
        end
    end
    return s
end

local function make_batch(B, Tn, Dr, am)
    local pos = {}
    for _ = 1, B do for t = 1, Tn do pos[#pos + 1] = t - 1 end end
    local amt = am and lunar.tensor(am, 'i64') or nil
    return {B = B, T = Tn, positions = lunar.tensor(pos, 'i64'):view({B, Tn}),
            mask = masks.build{B = B, T = Tn, attention_mask = amt}, attention_mask = amt,
            inv_freq = ops.rope_inv_freq(Dr, 10000)}
end

local function check_module(what, s, m, x, batch, prev)
    local r = lunar.randn(x:size(1), x:size(2))
    s:zero_grad()
    local _, saved = m:forward(x, batch, prev)
    local dx = m:backward(r, saved)
    local inputs, grads = {x}, {dx}
    for pname in s:names() do
        if s:is_trainable(pname) then
            inputs[#inputs + 1] = s:get(pname)
            grads[#grads + 1] = s:grad(pname):clone()
        end
    end
    T.gradcheck{name = what, eps = 1e-2, rtol = 2e-2, atol = 2e-3, max_checks = 48, inputs = inputs, grads = grads,
        f = function() return ops.sum(ops.mul((m:forward(x, batch, prev)), r)):item() end}
end

T:test('gradcheck: plain causal MLA, no bias', function()
    local cfg = with(CFG)
    local s = mla_store(cfg, 'a')
    local m = nn.MLA.new(s, 'a', cfg)
    assert(m.indexer_type == 'none' and m.indexer == nil)
    check_module('mla', s, m, lunar.randn(10, 16), make_batch(2, 5, 4))
end)

T:test('gradcheck: attention_bias, right padding, full indexer with T <= index_topk', function()
    local cfg = with(CFG, {attention_bias = true, index_topk = 8})
    local s = mla_store(cfg, 'a', true)
    local m = nn.MLA.new(s, 'a', cfg)
    assert(m.indexer_type == 'full')
    check_module('mla bias', s, m, lunar.randn(10, 16), make_batch(2, 5, 4, {{1, 1, 1, 1, 1}, {1, 1, 1, 0, 0}}))
    for pname in s:names() do
        if pname:find('indexer', 1, true) then assert(s.grads[pname] == nil, pname) end
    end
end)

T:test('gradcheck: sparse attention through a fixed IndexShare top-k (T 5 > k 2)', function()
    local cfg = with(CFG, {attention_bias = true, index_topk = 2})
    local s = mla_store(cfg, 'a')
    local m = nn.MLA.new(s, 'a', cfg, {indexer = 'shared'})
    -- key 0 plus one random key per query: every row keeps a visible key (a row with none is
    -- uniform whatever the scores, see test_nn_attention.lua)
    local topk = lunar.randint(0, 5, {2, 5, 2}, {dtype = 'i64'})
    topk:narrow(3, 1, 1):fill_(0)
    check_module('mla shared', s, m, lunar.randn(10, 16), make_batch(2, 5, 4), topk)
end)

-- independent forward: de-interleave the rope rows of q_b_proj and kv_a_proj so that half-split
-- RoPE applies (glm5-architecture.md 4.4: (b) = de-interleave then (a)), heads one at a time
local function reference_forward(s, name, cfg, x, batch, sel_mask)
    local B, Tn, NH = batch.B, batch.T, cfg.num_attention_heads
    local Dn, Dr, Dv, Rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    local Dqk = Dn + Dr
    local function lin(n, inp)
        local y = ops.matmul(inp, s:get(name .. '.' .. n .. '.weight'):t())
        if s:has(name .. '.' .. n .. '.bias') then y = ops.add(y, s:get(name .. '.' .. n .. '.bias')) end
        return y
    end
    local function rms(inp, n) return (ops.rmsnorm(inp, s:get(name .. '.' .. n .. '.weight'), 1e-6)) end
    -- permutation of a rope block: evens then odds
    local perm = {}
    for i = 0, Dr / 2 - 1 do perm[#perm + 1] = 2 * i end
    for i = 0, Dr / 2 - 1 do perm[#perm + 1] = 2 * i + 1 end
    local function deinterleave(y, first)   -- y (N, C): permute the Dr columns starting at first (0-based)
        local idx = {}
        for c = 0, y:size(2) - 1 do idx[c + 1] = c end
        for j = 1, Dr do idx[first + j] = first + perm[j] end
        return ops.index_select(y, 2, lunar.tensor(idx, 'i64'))
    end
    local q = lin('q_b_proj', rms(lin('q_a_proj', x), 'q_a_layernorm'))
    local ckv = lin('kv_a_proj_with_mqa', x)
    ckv = deinterleave(ckv, Rkv)
    local klat = rms(ckv:narrow(2, 1, Rkv):contiguous(), 'kv_a_layernorm')
    local kr = ops.rope(ckv:narrow(2, Rkv + 1, Dr):reshape({B, Tn, 1, Dr}), batch.positions, batch.inv_freq, {layout = 'half'})
    local kvb = lin('kv_b_proj', klat)
    local heads = {}
    for h = 1, NH do
        local qh = deinterleave(q:narrow(2, (h - 1) * Dqk + 1, Dqk):contiguous(), Dn)
        local qr = ops.rope(qh:narrow(2, Dn + 1, Dr):reshape({B, Tn, 1, Dr}), batch.positions, batch.inv_freq, {layout = 'half'})
        local kvh = kvb:narrow(2, (h - 1) * (Dn + Dv) + 1, Dn + Dv)
        local outs = {}
        for b = 1, B do
            local rows = function(t, n) return t:narrow(1, (b - 1) * Tn + 1, Tn):narrow(2, 1, n) end
            local sc = ops.add(ops.matmul(rows(qh, Dn), rows(kvh, Dn):t()),
                ops.matmul(qr:select(1, b):select(2, 1), kr:select(1, b):select(2, 1):t()))
            sc = ops.add(ops.mul(sc, Dqk ^ -0.5), sel_mask:select(1, b))
            local p = ops.softmax(sc)
            outs[b] = ops.matmul(p, kvh:narrow(1, (b - 1) * Tn + 1, Tn):narrow(2, Dn + 1, Dv))
        end
        heads[h] = outs
    end
    local o = lunar.empty(B * Tn, NH * Dv)
    for h = 1, NH do
        for b = 1, B do o:narrow(1, (b - 1) * Tn + 1, Tn):narrow(2, (h - 1) * Dv + 1, Dv):copy_(heads[h][b]) end
    end
    return lin('o_proj', o)
end

T:test('forward equals an independent composition (half-split RoPE on de-interleaved weights)', function()
    local cfg = with(CFG, {attention_bias = true, index_topk = 3})
    local s = mla_store(cfg, 'a')
    local x = lunar.randn(12, 16)
    local batch = make_batch(2, 6, 4, {{1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 0}})
    local plain = nn.MLA.new(s, 'a', cfg, {indexer = 'none'})
    T.close(plain:forward(x, batch), reference_forward(s, 'a', cfg, x, batch, batch.mask), {rtol = 1e-4, atol = 1e-5})
    local topk = lunar.randint(0, 6, {2, 6, 3}, {dtype = 'i64'})
    local shared = nn.MLA.new(s, 'a', cfg, {indexer = 'shared'})
    local out, _, back = shared:forward(x, batch, topk)
    assert(back == topk)
    T.close(out, reference_forward(s, 'a', cfg, x, batch, masks.select(batch.mask, topk)), {rtol = 1e-4, atol = 1e-5})
end)

T:test('packed documents (cu_seqlens) match separate runs, with DSA dropping keys', function()
    local cfg = with(CFG, {attention_bias = true, index_topk = 2})
    local s = mla_store(cfg, 'a', true)
    local m = nn.MLA.new(s, 'a', cfg)
    local lens = {4, 1, 3}
    local cu = lunar.tensor({0, 4, 5, 8}, 'i64')
    local x = lunar.randn(8, 16)
    local packed = {B = 1, T = 8, positions = masks.packed_positions(cu), mask = masks.build{B = 1, T = 8, cu_seqlens = cu},
                    inv_freq = ops.rope_inv_freq(4, 10000)}
    local out = m:forward(x, packed)
    local start = 1
    for _, n in ipairs(lens) do
        local xd = x:narrow(1, start, n):contiguous()
        T.close(out:narrow(1, start, n), (m:forward(xd, make_batch(1, n, 4))), {rtol = 1e-5, atol = 1e-6,
            msg = 'document at ' .. start})
        start = start + n
    end
end)

T:test('softmax scale (Dn+Dr)^-0.5, YaRN mscale^2 only for non-default rope', function()
    local s = nn.params.new()
    T.close(nn.MLA.new(s, 'a', CFG).scaling, 8 ^ -0.5, {rtol = 1e-12})
    T.close(nn.MLA.new(s, 'a', with(CFG, {rope_parameters = {rope_type = 'default', mscale_all_dim = 1, factor = 4}})).scaling,
        8 ^ -0.5, {rtol = 1e-12})
    local m = 0.1 * 0.707 * math.log(40) + 1
    T.close(nn.MLA.new(s, 'a', with(CFG, {rope_parameters = {rope_type = 'yarn', mscale_all_dim = 0.707, factor = 40}})).scaling,
        8 ^ -0.5 * m * m, {rtol = 1e-12})
end)

T:test('errors name the problem', function()
    local cfg = with(CFG, {index_topk = 2})
    local s = mla_store(cfg, 'a', true)
    T.raises(function() nn.MLA.new(s, 'a', with(CFG, {v_head_dim = 'x'})) end, 'config field v_head_dim must be a number')
    T.raises(function() nn.MLA.new(s, 'a', cfg, {indexer = 'sometimes'}) end, 'indexer must be full, shared or none')
    local m = nn.MLA.new(s, 'a', cfg, {indexer = 'shared'})
    T.raises(function() m:forward(lunar.randn(10, 16), make_batch(2, 5, 4)) end, 'needs the top-k of a previous full layer')
    T.raises(function() m:forward(lunar.randn(10, 15), make_batch(2, 5, 4)) end, 'x must be (B*T, H) = (10, 16)')
    T.raises(function() m:forward(lunar.randn(10, 16), make_batch(2, 5, 8)) end, 'inv_freq has 4 entries')
end)

os.exit(T:run())
