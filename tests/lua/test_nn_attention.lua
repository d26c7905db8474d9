-- test_nn_attention.lua: lunar.nn.attention against a plain-Lua per-head reference (loops over
-- heads, queries and keys, softmax in double) on tiny sizes: per-head k and v, one k shared by all
-- heads, grouped k/v (GQA), causal and padded masks with fully masked rows, S ~= T, no mask,
-- non-contiguous inputs, bf16 inputs. Backward (dq, dk, dv) against central finite differences of
-- sum(o * r) (f32, eps 1e-2, rtol 2e-2, atol 2e-3), and dk/dv summed over the sharing heads.
local lunar = require 'lunar'
local ops = lunar.ops
local attention = require 'lunar.nn.attention'
local masks = require 'lunar.nn.masks'
local T = require('lunar.testing').suite('nn.attention')

lunar.manual_seed(5)

-- reference: o (B, NH, S, Dv) flat, from flat lists
local function ref_attention(q, k, v, mask, scale)
    local B, NH, S, Dq = unpack(q:size())
    local NHk, Tn = k:size(2), k:size(3)
    local NHv, Dv = v:size(2), v:size(4)
    local qf, kf, vf = q:contiguous():tolist_flat(), k:contiguous():tolist_flat(), v:contiguous():tolist_flat()
    local mf = mask and mask:tolist_flat()
    local out = {}
    for b = 0, B - 1 do
        for h = 0, NH - 1 do
            local hk, hv = math.floor(h / (NH / NHk)), math.floor(h / (NH / NHv))
            for s = 0, S - 1 do
                local sc, mx = {}, -math.huge
                for t = 0, Tn - 1 do
                    local dot = 0
                    for d = 0, Dq - 1 do
                        dot = dot + qf[((b * NH + h) * S + s) * Dq + d + 1] * kf[((b * NHk + hk) * Tn + t) * Dq + d + 1]
                    end
                    local x = dot * scale
                    if mf then
                        local mv = mf[(b * S + s) * Tn + t + 1]
                        -- f32 rounding: score + FMIN == FMIN
                        x = (mv == masks.FMIN) and masks.FMIN or x + mv
                    end
                    sc[t] = x
                    if x > mx then mx = x end
                end
                local z = 0
                for t = 0, Tn - 1 do sc[t] = math.exp(sc[t] - mx); z = z + sc[t] end
                for d = 0, Dv - 1 do
                    local acc = 0
                    for t = 0, Tn - 1 do acc = acc + sc[t] / z * vf[((b * NHv + hv) * Tn + t) * Dv + d + 1] end
                    out[#out + 1] = acc
                end
            end
        end
    end
    return out
end

local function padded_mask(B, Tn)
    -- row 1 left-padded by 2 (its first two query rows see no key), row 2 right-padded by 1
    local am = {}
    for b = 1, B do
        am[b] = {}
        for t = 1, Tn do am[b][t] = ((b == 1 and t <= 2) or (b == 2 and t == Tn)) and 0 or 1 end
    end
    return masks.build{B = B, T = Tn, attention_mask = lunar.tensor(am, 'i64')}
end

local CASES = {
    {name = 'per-head', B = 2, NH = 3, NHk = 3, NHv = 3, T = 5, Dq = 4, Dv = 6},
    {name = 'shared k', B = 2, NH = 3, NHk = 1, NHv = 3, T = 5, Dq = 4, Dv = 2},
    {name = 'GQA 4/2', B = 2, NH = 4, NHk = 2, NHv = 2, T = 4, Dq = 3, Dv = 5},
    {name = 'B 1, T 1', B = 1, NH = 2, NHk = 1, NHv = 1, T = 1, Dq = 2, Dv = 3},
    {name = 'T 17', B = 1, NH = 2, NHk = 2, NHv = 1, T = 17, Dq = 3, Dv = 2},
}

T:test('forward matches the per-head reference (causal, padded, no mask)', function()
    for _, c in ipairs(CASES) do
        local q = lunar.randn(c.B, c.NH, c.T, c.Dq)
        local k = lunar.randn(c.B, c.NHk, c.T, c.Dq)
        local v = lunar.randn(c.B, c.NHv, c.T, c.Dv)
        local scale = 1 / math.sqrt(c.Dq)
        local ms = {causal = masks.causal(c.B, c.T), none = false}
        if c.B >= 2 and c.T >= 3 then ms.padded = padded_mask(c.B, c.T) end
        for mname, m in pairs(ms) do
            local o = attention.forward(q, k, v, m or nil, scale)
            T.equal(o:size(), {c.B, c.NH, c.T, c.Dv}, c.name .. ' shape')
            T.close(o, ref_attention(q, k, v, m or nil, scale), {rtol = 1e-5, atol = 1e-6, msg = c.name .. ' ' .. mname})
        end
    end
end)

T:test('fully masked rows are uniform over all keys (HF eager)', function()
    local q, k, v = lunar.randn(2, 2, 4, 3), lunar.randn(2, 2, 4, 3), lunar.randn(2, 2, 4, 2)
    local m = padded_mask(2, 4)
    local _, saved = attention.forward(q, k, v, m, 0.5)
    for h = 1, 2 do
        for s = 1, 2 do
            for t = 1, 4 do T.close(saved.P:get(1, h, s, t), 0.25, {rtol = 1e-6, msg = 'uniform'}) end
        end
    end
    T.equal(saved.P:get(2, 1, 4, 4), 0, 'padding key has probability 0')
end)

T:test('S ~= T (queries against a longer key range) and non-contiguous inputs', function()
    local B, NH, S, Tn = 2, 2, 3, 5
    local qt = lunar.randn(B, S, NH, 4):transpose(2, 3)     -- (B, NH, S, 4) view
    local kt = lunar.randn(B, Tn, 1, 4):transpose(2, 3)
    local vt = lunar.randn(B, 7, Tn, 2):narrow(2, 3, NH)
    local m = lunar.zeros(B, S, Tn)
    ops.masked_fill_(m, ops.gt(lunar.rand(B, S, Tn), 0.6), masks.FMIN)
    local o = attention.forward(qt, kt, vt, m, 0.3)
    T.close(o, ref_attention(qt, kt, vt, m, 0.3), {rtol = 1e-5, atol = 1e-6})
end)

T:test('bf16 inputs: f32 softmax, output in bf16 close to the f32 reference', function()
    local q, k, v = lunar.randn(1, 2, 6, 8), lunar.randn(1, 2, 6, 8), lunar.randn(1, 2, 6, 4)
    local qb, kb, vb = q:bf16(), k:bf16(), v:bf16()
    local o = attention.forward(qb, kb, vb, masks.causal(1, 6), 0.35)
    assert(o:dtype() == 'bf16')
    T.close(o, ref_attention(qb, kb, vb, masks.causal(1, 6), 0.35), {rtol = 2e-2, atol = 2e-2})
end)

T:test('backward: dq, dk (per-head, shared, grouped), dv against finite differences', function()
    for _, c in ipairs(CASES) do
        local q = lunar.randn(c.B, c.NH, c.T, c.Dq)
        local k = lunar.randn(c.B, c.NHk, c.T, c.Dq)
        local v = lunar.randn(c.B, c.NHv, c.T, c.Dv)
        local m = (c.B >= 2 and c.T >= 3) and padded_mask(c.B, c.T) or masks.causal(c.B, c.T)
        local scale = 0.7
        -- fully masked rows (left padding) are uniform whatever q is, so finite differences see no
        -- dependence there while autograd (and this backward) propagates dSc = P (dP - rowsum);
        -- HF's loss never reaches those rows, so the projection skips them
        local valid = masks.query_valid(m):view({c.B, 1, c.T, 1})
        local r = ops.mul(lunar.randn(c.B, c.NH, c.T, c.Dv), valid)
        local o, saved = attention.forward(q, k, v, m, scale)
        local dq, dk, dv = attention.backward(r, saved)
        T.equal(dk:size(), k:size(), c.name .. ' dk shape')
        T.equal(dv:size(), v:size(), c.name .. ' dv shape')
        local function f() return ops.sum(ops.mul((attention.forward(q, k, v, m, scale)), r)):item() end
        T.gradcheck{name = c.name, eps = 1e-2, rtol = 2e-2, atol = 2e-3, f = f,
            inputs = {q, k, v}, grads = {dq, dk, dv}}
        assert(o)
    end
end)

T:test('shared-k gradient equals the per-head gradient summed over heads', function()
    local B, NH, Tn, D = 2, 3, 4, 5
    local q, k1, v = lunar.randn(B, NH, Tn, D), lunar.randn(B, 1, Tn, D), lunar.randn(B, NH, Tn, 3)
    local kx = lunar.empty(B, NH, Tn, D):copy_(k1:expand({B, NH, Tn, D}))
    local m = masks.causal(B, Tn)
    local r = lunar.randn(B, NH, Tn, 3)
    local o1, s1 = attention.forward(q, k1, v, m, 0.4)
    local o2, s2 = attention.forward(q, kx, v, m, 0.4)
    T.close(o1, o2, {rtol = 1e-6, atol = 1e-7})
    local dq1, dk1 = attention.backward(r, s1)
    local dq2, dk2 = attention.backward(r, s2)
    T.close(dq1, dq2, {rtol = 1e-5, atol = 1e-6})
    T.close(dk1, ops.sum(dk2, 2, {keepdim = true}), {rtol = 1e-5, atol = 1e-6})
end)

T:test('bad shapes name the problem', function()
    local q = lunar.randn(2, 4, 3, 5)
    T.raises(function() attention.forward(q, lunar.randn(2, 3, 3, 5), lunar.randn(2, 4, 3, 2), nil, 1) end,
        'k heads do not divide q heads')
    T.raises(function() attention.forward(q, lunar.randn(2, 4, 3, 6), lunar.randn(2, 4, 3, 2), nil, 1) end,
        'head dims differ')
    T.raises(function() attention.forward(q, lunar.randn(2, 4, 3, 5), lunar.randn(2, 4, 3, 2), lunar.zeros(2, 3, 4), 1) end,
        'mask (2, 3, 4) must be (B, S, T) = (2, 3, 3)')
    T.raises(function() attention.forward(lunar.randn(4, 3, 5), q, q, nil, 1) end, 'q must be 4-dim')
end)

os.exit(T:run())
