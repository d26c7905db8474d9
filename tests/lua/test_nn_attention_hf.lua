-- test_nn_attention_hf.lua: module-level parity with transformers 5.25.0 (fp32 eager), from the
-- committed fixture tests/fixtures/modules/attention_hf.json (tests/ref/make_module_refs.py):
--   * GLM-5 MLA layer 0 with its DSA indexer (index_topk 3 < T 6, so keys are dropped),
--     attention_bias on, a right-padded row; layer 1 a "shared" IndexShare layer reusing
--     layer 0's top-k; outputs, selected keys, dx and every parameter gradient (the indexer's
--     parameters get none, as under HF's no_grad);
--   * Glm4Moe GQA attention (4 heads over 2 KV heads, head_dim 8, partial rotary 0.5, QKV
--     bias, QK-norm), left-padded row.
-- Tolerances: outputs rtol 1e-5 / atol 1e-5 relative to the largest |value|; gradients relative
-- L2 error below 1e-5.
local lunar = require 'lunar'
local nn = require 'lunar.nn'
local ops = lunar.ops
local T = require('lunar.testing').suite('nn.attention_hf')

local function read_json(rel)
    local dir = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
    local f = assert(io.open(dir .. '/../fixtures/' .. rel, 'r'))
    local s = f:read('*a')
    f:close()
    s = s:gsub('%[', '{'):gsub('%]', '}'):gsub('"([%w_]+)"%s*:', '["%1"]='):gsub('=null', '=nil')
    return assert(loadstring('return ' .. s))()
end

local FX = read_json('modules/attention_hf.json')

local function tensor_of(e, dtype) return lunar.tensor(e.data, dtype or 'f32'):view(e.shape) end

local function store_of(params)
    local s = nn.params.new()
    for _, p in ipairs(params) do s:add(p.name, tensor_of(p)) end
    return s
end

local function max_abs(list)
    local m = 0
    for _, v in ipairs(list) do m = math.max(m, math.abs(v)) end
    return m
end

local function rel_l2(a, b)
    local af = a:contiguous():tolist_flat()
    local num, den = 0, 0
    for i = 1, #b do num = num + (af[i] - b[i]) ^ 2; den = den + b[i] ^ 2 end
    return math.sqrt(num / math.max(den, 1e-30))
end

local function check_grads(s, params, what)
    for _, p in ipairs(params) do
        if p.grad == nil then
            assert(s.grads[p.name] == nil, what .. ': ' .. p.name .. ' must get no gradient')
        else
            local g = s.grads[p.name]
            assert(g, what .. ': ' .. p.name .. ' got no gradient')
            local e = rel_l2(g, p.grad)
            if e > 1e-5 then error(('%s: gradient of %s: relative L2 error %.3g'):format(what, p.name, e)) end
        end
    end
end

local function batch_of(c, rot_dim)
    local B, Tn = c.B, c.T
    local pos = {}
    for b = 1, B do for t = 1, Tn do pos[#pos + 1] = t - 1 end end
    local am = lunar.tensor(c.attention_mask, 'i64'):view({B, Tn})
    local mask = nn.masks.build{B = B, T = Tn, attention_mask = am}
    T.equal(mask, lunar.tensor(c.mask), 'the mask equals create_causal_mask (in f32)')
    return {B = B, T = Tn, positions = lunar.tensor(pos, 'i64'):view({B, Tn}), mask = mask, attention_mask = am,
            inv_freq = ops.rope_inv_freq(rot_dim, c.rope_theta)}
end

T:test('GLM-5 MLA + DSA indexer + IndexShare layer match HF', function()
    local c = FX.mla
    local cfg = c.config
    cfg.attention_bias = c.attention_bias
    local s = store_of(c.params)
    local l0 = nn.MLA.new(s, 'model.layers.0.self_attn', cfg, {indexer = 'full'})
    local l1 = nn.MLA.new(s, 'model.layers.1.self_attn', cfg, {indexer = 'shared'})
    for _, p in ipairs(c.params) do
        if p.name:find('indexer', 1, true) then s:set_trainable(p.name, false) end
    end
    local batch = batch_of(c, cfg.qk_rope_head_dim)
    local N = c.B * c.T
    local x0, x1 = tensor_of(c.x0):view({N, 16}), tensor_of(c.x1):view({N, 16})
    local out0, s0, topk = l0:forward(x0, batch)
    local out1, s1, topk1 = l1:forward(x1, batch, topk)
    assert(topk1 == topk, 'the shared layer returns the indices it reused')
    T.close(out0, c.out0.data, {rtol = 1e-5, atol = 1e-5 * max_abs(c.out0.data), msg = 'out0'})
    T.close(out1, c.out1.data, {rtol = 1e-5, atol = 1e-5 * max_abs(c.out1.data), msg = 'out1'})
    -- selected keys: compare the causally visible ones (masked winners tie at finfo.min)
    local mine, ref = topk:tolist(), c.topk.data
    local k = c.topk.shape[3]
    for b = 1, c.B do
        for q = 1, c.T do
            local function visible_set(list)
                local set, n = {}, 0
                for _, t in ipairs(list) do
                    if batch.mask:get(b, q, t + 1) == 0 then set[t] = true; n = n + 1 end
                end
                return set, n
            end
            local hf = {}
            for j = 1, k do hf[j] = ref[((b - 1) * c.T + (q - 1)) * k + j] end
            local a, na = visible_set(mine[b][q])
            local h, nh = visible_set(hf)
            assert(na == nh, ('row %d query %d: %d visible selected keys, HF %d'):format(b, q, na, nh))
            for t in pairs(h) do assert(a[t], ('row %d query %d: HF selects key %d'):format(b, q, t)) end
        end
    end
    -- backward of sum(out0 * r0) + sum(out1 * r1)
    local dx0 = l0:backward(tensor_of(c.r0):view({N, 16}), s0)
    local dx1 = l1:backward(tensor_of(c.r1):view({N, 16}), s1)
    assert(rel_l2(dx0, c.dx0.data) < 1e-5, 'dx0 ' .. rel_l2(dx0, c.dx0.data))
    assert(rel_l2(dx1, c.dx1.data) < 1e-5, 'dx1 ' .. rel_l2(dx1, c.dx1.data))
    check_grads(s, c.params, 'MLA')
    -- trainable indexer parameters still get nothing from the LM loss
    for _, p in ipairs(c.params) do
        if p.name:find('indexer', 1, true) then s:set_trainable(p.name, true) end
    end
    s:zero_grad()
    local _, s0b = l0:forward(x0, batch)
    l0:backward(tensor_of(c.r0):view({N, 16}), s0b)
    for _, p in ipairs(c.params) do
        if p.name:find('indexer', 1, true) then assert(s.grads[p.name] == nil, p.name .. ' got a gradient') end
    end
end)

T:test('Glm4Moe GQA attention (partial rotary, QKV bias, QK-norm) matches HF', function()
    local c = FX.gqa
    local cfg = c.config
    cfg.attention_bias, cfg.use_qk_norm = c.attention_bias, c.use_qk_norm
    local s = store_of(c.params)
    local attn = nn.GQA.new(s, 'model.layers.0.self_attn', cfg)
    local batch = batch_of(c, attn.rot_dim)
    local N = c.B * c.T
    local x = tensor_of(c.x):view({N, 16})
    local out, saved = attn:forward(x, batch)
    -- the left-padded query row is uniform over all keys in HF as here: compare every row
    T.close(out, c.out.data, {rtol = 1e-5, atol = 1e-5 * max_abs(c.out.data), msg = 'out'})
    local dx = attn:backward(tensor_of(c.r):view({N, 16}), saved)
    assert(rel_l2(dx, c.dx.data) < 1e-5, 'dx ' .. rel_l2(dx, c.dx.data))
    check_grads(s, c.params, 'GQA')
end)

os.exit(T:run())
