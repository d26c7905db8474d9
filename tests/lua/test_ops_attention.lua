-- test_ops_attention.lua: the fused attention ops (lunar.ops.attention / attention_backward) and
-- the DSA index score (lunar.ops.index_scores).
--
-- Forward against a plain-Lua reference (loops over queries, heads and keys, softmax in double)
-- on tiny sizes: T = 1, 3, 17, S ~= T, per-head keys and GQA groups, causal and padded masks
-- (fully masked rows are uniform over all T keys), no mask, DSA key lists with repeated, negative
-- and masked entries. Forward and backward against the dense composition
-- (nn.attention.forward_dense / backward_dense under masks.select) at rtol 1e-5 / 1e-4; backward
-- against central finite differences (f32, eps 1e-2, rtol 2e-2, atol 2e-3). Masked keys are never
-- read (NaN keys and values hidden by the mask leave the output finite). The backward is
-- bit-identical for 1 and 2 threads. Non-contiguous inputs and outputs, bf16 inputs, errors.
-- index_scores: against plain Lua (rtol 1e-5, atol 1e-5), masked keys exactly the mask value,
-- the fused top-k the set ops.topk of the scores gives (ties to the lower key), in key order;
-- against the gemm composition of nn.dsa's keep path at B 2, T 150 (rtol/atol 1e-5).
local lunar = require 'lunar'
local ops = lunar.ops
local attention = require 'lunar.nn.attention'
local masks = require 'lunar.nn.masks'
local core = require 'lunar.core'
local T = require('lunar.testing').suite('ops.attention')

lunar.manual_seed(11)

local FMIN = masks.FMIN

-- plain-Lua reference: o (B, S, NH, Dv) flat and lse (B, NH, S) flat
local function ref_attention(q, k, v, keys, mask, scale)
    local B, S, NH, Dq = unpack(q:size())
    local Tn, Hk, Dv = k:size(2), k:size(3), v:size(4)
    local G = NH / Hk
    local qf, kf, vf = q:contiguous():tolist_flat(), k:contiguous():tolist_flat(), v:contiguous():tolist_flat()
    local mf = mask and mask:contiguous():tolist_flat()
    local kl = keys and keys:contiguous():tolist_flat()
    local K = keys and keys:size(3)
    local o, lse = {}, {}
    for b = 0, B - 1 do
        for s = 0, S - 1 do
            local cand = {}
            if kl then
                for j = 0, K - 1 do
                    local t = kl[(b * S + s) * K + j + 1]
                    if t >= 0 then cand[t] = true end
                end
            else
                for t = 0, Tn - 1 do cand[t] = true end
            end
            local att = {}
            for t = 0, Tn - 1 do
                local m = mf and mf[(b * S + s) * Tn + t + 1] or 0
                if cand[t] and m > FMIN then att[#att + 1] = {t, m} end
            end
            for h = 0, NH - 1 do
                local g = math.floor(h / G)
                local ps, lsev = {}, FMIN
                if #att == 0 then
                    for t = 0, Tn - 1 do ps[#ps + 1] = {t, 1 / Tn} end
                else
                    local xs, mx = {}, -math.huge
                    for i, e in ipairs(att) do
                        local dot = 0
                        for d = 0, Dq - 1 do
                            dot = dot + qf[((b * S + s) * NH + h) * Dq + d + 1] * kf[((b * Tn + e[1]) * Hk + g) * Dq + d + 1]
                        end
                        xs[i] = dot * scale + e[2]
                        mx = math.max(mx, xs[i])
                    end
                    local z = 0
                    for i = 1, #xs do z = z + math.exp(xs[i] - mx) end
                    for i, e in ipairs(att) do ps[i] = {e[1], math.exp(xs[i] - mx) / z} end
                    lsev = mx + math.log(z)
                end
                for d = 0, Dv - 1 do
                    local acc = 0
                    for _, e in ipairs(ps) do acc = acc + e[2] * vf[((b * Tn + e[1]) * Hk + g) * Dv + d + 1] end
                    o[((b * S + s) * NH + h) * Dv + d + 1] = acc
                end
                lse[(b * NH + h) * S + s + 1] = lsev
            end
        end
    end
    return o, lse
end

-- (B, T, T) mask: causal, rows of batch 1 left-padded by 2 (queries 1..2 see no key)
local function padded_mask(B, Tn)
    local am = {}
    for b = 1, B do
        am[b] = {}
        for t = 1, Tn do am[b][t] = (b == 1 and t <= 2) and 0 or 1 end
    end
    return masks.build{B = B, T = Tn, attention_mask = lunar.tensor(am, 'i64')}
end

-- (B, S, K) random key lists; with `messy`, some entries are -1 and some repeat
local function random_keys(B, S, Tn, K, messy)
    local flat = {}
    for _ = 1, B * S do
        local perm = {}
        for t = 0, Tn - 1 do perm[t + 1] = t end
        for i = Tn, 2, -1 do
            local j = math.random(i)
            perm[i], perm[j] = perm[j], perm[i]
        end
        for j = 1, K do
            local t = perm[(j - 1) % Tn + 1]
            if messy and j % 4 == 0 then t = -1 end
            if messy and j % 5 == 0 then t = flat[#flat] >= 0 and flat[#flat] or t end
            flat[#flat + 1] = t
        end
    end
    return core.from_flat(flat, {B, S, K}, 'i64')
end

local CASES = {
    {name = 'T 1', B = 1, S = 1, T = 1, NH = 2, Hk = 1, Dq = 2, Dv = 3, K = 1},
    {name = 'T 3 per head', B = 2, S = 3, T = 3, NH = 2, Hk = 2, Dq = 4, Dv = 3, K = 2},
    {name = 'T 17 GQA 4/2', B = 2, S = 17, T = 17, NH = 4, Hk = 2, Dq = 5, Dv = 3, K = 6},
    {name = 'T 17 one key head', B = 1, S = 17, T = 17, NH = 3, Hk = 1, Dq = 9, Dv = 17, K = 17},
    {name = 'S 5 T 7', B = 2, S = 5, T = 7, NH = 3, Hk = 3, Dq = 6, Dv = 4, K = 3},
}

local function case_inputs(c)
    return lunar.randn(c.B, c.S, c.NH, c.Dq), lunar.randn(c.B, c.T, c.Hk, c.Dq), lunar.randn(c.B, c.T, c.Hk, c.Dv)
end

local function case_masks(c)
    local ms = {none = false}
    if c.S == c.T then
        ms.causal = masks.causal(c.B, c.T)
        if c.B >= 2 and c.T >= 3 then ms.padded = padded_mask(c.B, c.T) end
    else
        local m = lunar.zeros(c.B, c.S, c.T)
        ops.masked_fill_(m, ops.gt(lunar.rand(c.B, c.S, c.T), 0.6), FMIN)
        ms.random = m
    end
    return ms
end

T:test('forward matches the plain-Lua reference (masks, key lists, GQA, padded rows)', function()
    for _, c in ipairs(CASES) do
        local q, k, v = case_inputs(c)
        local scale = c.Dq ^ -0.5
        for mname, m in pairs(case_masks(c)) do
            for _, kname in ipairs({'all', 'list', 'messy'}) do
                local keys = kname ~= 'all' and random_keys(c.B, c.S, c.T, c.K, kname == 'messy') or nil
                local msg = ('%s, mask %s, keys %s'):format(c.name, mname, kname)
                local o, lse = ops.attention(q, k, v, {keys = keys, mask = m or nil, scale = scale})
                T.equal(o:size(), {c.B, c.S, c.NH, c.Dv}, msg .. ' o shape')
                T.equal(lse:size(), {c.B, c.NH, c.S}, msg .. ' lse shape')
                local ro, rl = ref_attention(q, k, v, keys, m or nil, scale)
                T.close(o, ro, {rtol = 1e-5, atol = 1e-6, msg = msg .. ' o'})
                T.close(lse, rl, {rtol = 1e-5, atol = 1e-5, msg = msg .. ' lse'})
            end
        end
    end
end)

-- the selection as a mask, for the dense composition
local function select_mask(c, m, keys)
    if keys == nil then return m end
    return masks.select(m or lunar.zeros(c.B, c.S, c.T), keys)
end

local function heads(x) return x:transpose(2, 3) end

T:test('forward and backward equal the dense composition (nn.attention dense path)', function()
    for _, c in ipairs(CASES) do
        local q, k, v = case_inputs(c)
        local scale = 0.7
        for mname, m in pairs(case_masks(c)) do
            for _, kname in ipairs({'all', 'list'}) do
                local keys = kname == 'list' and random_keys(c.B, c.S, c.T, c.K, false) or nil
                local msg = ('%s, mask %s, keys %s'):format(c.name, mname, kname)
                local amask = select_mask(c, m or nil, keys)
                local od, sd = attention.forward_dense(heads(q), heads(k), heads(v), amask, scale)
                local o, lse = ops.attention(q, k, v, {keys = keys, mask = m or nil, scale = scale})
                T.close(o, heads(od), {rtol = 1e-5, atol = 1e-6, msg = msg .. ' o'})
                local dout = lunar.randn(c.B, c.S, c.NH, c.Dv)
                local dqd, dkd, dvd = attention.backward_dense(heads(dout), sd)
                local dq, dk, dv = ops.attention_backward(dout, o, lse, q, k, v, {keys = keys, mask = m or nil, scale = scale})
                T.close(dq, heads(dqd), {rtol = 1e-4, atol = 1e-5, msg = msg .. ' dq'})
                T.close(dk, heads(dkd), {rtol = 1e-4, atol = 1e-5, msg = msg .. ' dk'})
                T.close(dv, heads(dvd), {rtol = 1e-4, atol = 1e-5, msg = msg .. ' dv'})
            end
        end
    end
end)

T:test('backward against finite differences (dq, dk, dv; GQA, key lists, padded)', function()
    for _, c in ipairs(CASES) do
        local q, k, v = case_inputs(c)
        local m = case_masks(c).padded or case_masks(c).causal or case_masks(c).random
        local keys = random_keys(c.B, c.S, c.T, c.K, true)
        local scale = 0.6
        -- fully masked rows are uniform whatever q and k are: finite differences see nothing
        -- there while the backward (like autograd) propagates dS = P (dP - D); HF's loss never
        -- reaches those rows, so the projection skips them
        local o, lse = ops.attention(q, k, v, {keys = keys, mask = m, scale = scale})
        local valid = ops.gt(lse:select(2, 1), FMIN, {dtype = 'f32'})   -- lse = finfo.min on those rows
        local r = ops.mul(lunar.randn(c.B, c.S, c.NH, c.Dv), valid:view({c.B, c.S, 1, 1}))
        local dq, dk, dv = ops.attention_backward(r, o, lse, q, k, v, {keys = keys, mask = m, scale = scale})
        local function f()
            return ops.sum(ops.mul((ops.attention(q, k, v, {keys = keys, mask = m, scale = scale})), r)):item()
        end
        T.gradcheck{name = c.name, eps = 1e-2, rtol = 2e-2, atol = 2e-3, f = f, inputs = {q, k, v}, grads = {dq, dk, dv}}
    end
end)

T:test('keys outside the causal blocks and unlisted sparse keys are never read (NaN there)', function()
    -- causal: the first block of 64 query rows never reads keys 64..79
    local B, Tn, NH = 1, 80, 2
    local q, k, v = lunar.randn(B, Tn, NH, 4), lunar.randn(B, Tn, 1, 4), lunar.randn(B, Tn, 1, 3)
    k:narrow(2, 65, 16):fill_(0 / 0)
    v:narrow(2, 65, 16):fill_(0 / 0)
    local m = masks.causal(B, Tn)
    local o, lse = ops.attention(q, k, v, {mask = m})
    local early = o:narrow(2, 1, 64)
    T.equal(ops.sum(ops.ne(early, early, {dtype = 'f32'})):item(), 0, 'rows 0..63 finite')
    local dq = ops.attention_backward(lunar.randn(B, Tn, NH, 3), o, lse, q, k, v, {mask = m})
    local dq0 = dq:narrow(2, 1, 64)
    T.equal(ops.sum(ops.ne(dq0, dq0, {dtype = 'f32'})):item(), 0, 'dq of rows 0..63 finite')
    -- sparse key lists (3 keys out of 300): only the listed rows of k and v are read
    local S2, T2 = 4, 300
    local q2, k2, v2 = lunar.randn(1, S2, NH, 4), lunar.randn(1, T2, 1, 4):fill_(0 / 0), lunar.randn(1, T2, 1, 3):fill_(0 / 0)
    local keys = core.from_flat({5, 150, 290, 7, 150, 299, 0, 1, 2, 42, 200, 250}, {1, S2, 3}, 'i64')
    local kref, vref = lunar.randn(1, T2, 1, 4), lunar.randn(1, T2, 1, 3)
    for _, t in ipairs(keys:tolist_flat()) do
        k2:narrow(2, t + 1, 1):copy_(kref:narrow(2, t + 1, 1))
        v2:narrow(2, t + 1, 1):copy_(vref:narrow(2, t + 1, 1))
    end
    local o2, l2 = ops.attention(q2, k2, v2, {keys = keys})
    T.close(o2, (ref_attention(q2, kref, vref, keys, nil, 0.5)), {rtol = 1e-5, atol = 1e-6, msg = 'sparse lists'})
    local _, dk2, dv2 = ops.attention_backward(lunar.randn(1, S2, NH, 3), o2, l2, q2, k2, v2, {keys = keys})
    T.equal(dk2:narrow(2, 4, 1), lunar.zeros(1, 1, 1, 4), 'an unlisted key gets zero gradient')
    T.equal(ops.sum(ops.ne(dv2, dv2, {dtype = 'f32'})):item(), 0, 'dv finite')
    -- the same selection through the mask gives the same numbers
    local q3, k3, v3 = lunar.randn(2, 9, NH, 4), lunar.randn(2, 9, 1, 4), lunar.randn(2, 9, 1, 3)
    local sel = core.from_flat({0, 1, 2, 3, 5, 6, 7, 8}, {1, 1, 8}, 'i64'):expand({2, 9, 8}):contiguous()
    local mc = masks.causal(2, 9)
    local a1 = ops.attention(q3, k3, v3, {keys = sel, mask = mc})
    local a2 = ops.attention(q3, k3, v3, {mask = masks.select(mc, sel)})
    T.close(a1, a2, {rtol = 1e-6, atol = 1e-7, msg = 'key list = the selection in the mask'})
end)

T:test('very sparse key lists (shrunk blocks, gathered keys) equal the dense composition', function()
    local B, S, Tn, NH, Hk = 2, 70, 512, 4, 2
    local q, k, v = lunar.randn(B, S, NH, 8), lunar.randn(B, Tn, Hk, 8), lunar.randn(B, Tn, Hk, 5)
    local keys = random_keys(B, S, Tn, 2, false)
    local m = lunar.zeros(B, S, Tn)
    ops.masked_fill_(m, ops.gt(lunar.rand(B, S, Tn), 0.8), FMIN)
    local amask = masks.select(m, keys)
    local od, sd = attention.forward_dense(heads(q), heads(k), heads(v), amask, 0.5)
    local o, lse = ops.attention(q, k, v, {keys = keys, mask = m, scale = 0.5})
    T.close(o, heads(od), {rtol = 1e-5, atol = 1e-6, msg = 'o'})
    local dout = lunar.randn(B, S, NH, 5)
    local dqd, dkd, dvd = attention.backward_dense(heads(dout), sd)
    local dq, dk, dv = ops.attention_backward(dout, o, lse, q, k, v, {keys = keys, mask = m, scale = 0.5})
    T.close(dq, heads(dqd), {rtol = 1e-4, atol = 1e-5, msg = 'dq'})
    T.close(dk, heads(dkd), {rtol = 1e-4, atol = 1e-5, msg = 'dk'})
    T.close(dv, heads(dvd), {rtol = 1e-4, atol = 1e-5, msg = 'dv'})
end)

T:test('backward is the same bit for bit with 1 and 2 threads', function()
    local saved = lunar.threads()
    local B, Tn, NH = 1, 64, 4
    local q, k, v = lunar.randn(B, Tn, NH, 16), lunar.randn(B, Tn, 2, 16), lunar.randn(B, Tn, 2, 8)
    local m, keys = masks.causal(B, Tn), random_keys(B, Tn, Tn, 20, false)
    local dout = lunar.randn(B, Tn, NH, 8)
    local res = {}
    for _, n in ipairs({1, 2}) do
        lunar.threads(n)
        local o, lse = ops.attention(q, k, v, {keys = keys, mask = m})
        res[n] = {o, ops.attention_backward(dout, o, lse, q, k, v, {keys = keys, mask = m})}
    end
    lunar.threads(saved)
    for i = 1, 4 do T.equal(res[2][i], res[1][i], 'output ' .. i) end
end)

T:test('non-contiguous inputs and outputs, bf16 inputs', function()
    local B, S, Tn, NH = 2, 5, 5, 2
    local q = lunar.randn(B, NH, S, 6):transpose(2, 3)              -- (B, S, NH, 6) view
    local k = lunar.randn(B, Tn, 3, 6):narrow(3, 2, 1)              -- (B, T, 1, 6) view
    local v = lunar.randn(B, 4, Tn, 1):permute(1, 3, 2, 4)          -- (B, T, 4, 1) -> narrow
    v = v:narrow(3, 1, 1)
    local m = masks.causal(B, Tn)
    local ro, rl = ref_attention(q, k, v, nil, m, 0.4)
    local obuf = lunar.zeros(B, NH, S, 1)
    local o, lse = ops.attention(q, k, v, {mask = m, scale = 0.4, out = obuf:transpose(2, 3)})
    T.close(o, ro, {rtol = 1e-5, atol = 1e-6, msg = 'strided out'})
    T.close(obuf:transpose(2, 3), ro, {rtol = 1e-5, atol = 1e-6, msg = 'written through the view'})
    T.close(lse, rl, {rtol = 1e-5, atol = 1e-5})
    local ob = ops.attention(q:bf16(), k:bf16(), v:bf16(), {mask = m, scale = 0.4})
    assert(ob:dtype() == 'bf16')
    T.close(ob, (ref_attention(q:bf16(), k:bf16(), v:bf16(), nil, m, 0.4)), {rtol = 2e-2, atol = 2e-2, msg = 'bf16'})
end)

T:test('bad inputs name the problem', function()
    local q, k, v = lunar.randn(1, 3, 4, 5), lunar.randn(1, 3, 3, 5), lunar.randn(1, 3, 3, 2)
    T.raises(function() ops.attention(q, k, v) end, "attention_forward: k")
    T.raises(function() ops.attention(q, lunar.randn(1, 3, 2, 6), lunar.randn(1, 3, 2, 2)) end, 'Dq = 5')
    T.raises(function() ops.attention(q, lunar.randn(1, 3, 2, 5), lunar.randn(1, 4, 2, 2)) end, 'attention_forward: v')
    local k2, v2 = lunar.randn(1, 3, 2, 5), lunar.randn(1, 3, 2, 2)
    T.raises(function() ops.attention(q, k2, v2, {mask = lunar.zeros(1, 3, 4)}) end, 'mask')
    T.raises(function() ops.attention(q, k2, v2, {keys = core.from_flat({0, 1, 3}, {1, 3, 1}, 'i64')}) end,
        'holds 3 (at flat position 2) but there are only T = 3 keys')
    T.raises(function() ops.attention(q, k2, v2, {keys = lunar.zeros(1, 3, 1)}) end, 'keys')
    T.raises(function() ops.attention(lunar.randn(3, 4, 5), k2, v2) end, 'q must be 4-dim')
    local dead = lunar.randn(1, 3, 2, 5)
    dead:free()
    T.raises(function() ops.attention(q, dead, v2) end, 'free')
    local o, lse = ops.attention(q, k2, v2)
    T.raises(function() ops.attention_backward(lunar.randn(1, 3, 4, 3), o, lse, q, k2, v2) end, 'dout')
    T.raises(function() ops.index_scores(lunar.randn(1, 3, 2, 4), lunar.randn(1, 3, 5), lunar.randn(1, 3, 2)) end,
        'index_scores: ki')
    T.raises(function() ops.index_scores(lunar.randn(1, 3, 2, 4), lunar.randn(1, 3, 4), lunar.randn(1, 3, 2), {topk = 4}) end,
        'topk')
end)

T:test('no query heads (NH = 0) is refused, forward and backward, on every device', function()
    -- the CPU used to return and CUDA to fail with "invalid configuration argument" (no block to launch)
    local want = "q 'q0' has shape (1, 3, 0, 5), expected (B, S, NH, Dq) with NH >= 1 query heads"
    local devs = {'cpu'}
    if lunar.device_count('cpu') > 1 then devs[2] = 'cpu:1' end
    if lunar.device_count('cuda') > 0 then devs[#devs + 1] = 'cuda' end
    for _, dev in ipairs(devs) do
        local q = lunar.randn(1, 3, 0, 5, {device = dev}):set_name('q0')
        local k, v = lunar.randn(1, 3, 2, 5, {device = dev}), lunar.randn(1, 3, 2, 2, {device = dev})
        T.raises(function() ops.attention(q, k, v) end, 'attention_forward: ' .. want)
        local o, lse = lunar.empty({1, 3, 0, 2}, {device = dev}), lunar.empty({1, 0, 3}, {device = dev})
        T.raises(function() ops.attention_backward(lunar.empty({1, 3, 0, 2}, {device = dev}), o, lse, q, k, v) end,
            'attention_backward: ' .. want)
    end
end)

-- plain-Lua index score: (B, S, T) nested lists
local function ref_index(qi, ki, w, mask, scale)
    local B, S, Hi, Di = unpack(qi:size())
    local Tn = ki:size(2)
    local qf, kf, wf = qi:contiguous():tolist_flat(), ki:contiguous():tolist_flat(), w:contiguous():tolist_flat()
    local mf = mask and mask:contiguous():tolist_flat()
    local out = {}
    for b = 0, B - 1 do
        for s = 0, S - 1 do
            for t = 0, Tn - 1 do
                local m = mf and mf[(b * S + s) * Tn + t + 1] or 0
                local val = m
                if m > FMIN then
                    local acc = 0
                    for h = 0, Hi - 1 do
                        local dot = 0
                        for d = 0, Di - 1 do
                            dot = dot + qf[((b * S + s) * Hi + h) * Di + d + 1] * kf[(b * Tn + t) * Di + d + 1]
                        end
                        acc = acc + wf[(b * S + s) * Hi + h + 1] * math.max(0, dot * scale)
                    end
                    val = acc + m
                end
                out[#out + 1] = val
            end
        end
    end
    return out
end

-- each row of a (..., K) index tensor sorted ascending, flat
local function sorted_rows(t)
    local f, K, out = t:contiguous():tolist_flat(), t:size(t:dim()), {}
    for r = 0, #f / K - 1 do
        local row = {}
        for j = 1, K do row[j] = f[r * K + j] end
        table.sort(row)
        for j = 1, K do out[#out + 1] = row[j] end
    end
    return out
end

T:test('index_scores: plain-Lua reference, masked keys, fused top-k = topk of the scores', function()
    for _, c in ipairs({{B = 1, S = 1, T = 1, Hi = 2, Di = 3, k = 1}, {B = 2, S = 3, T = 3, Hi = 3, Di = 4, k = 2},
                        {B = 2, S = 17, T = 17, Hi = 4, Di = 8, k = 5}, {B = 1, S = 40, T = 300, Hi = 2, Di = 5, k = 7},
                        {B = 1, S = 5, T = 9, Hi = 1, Di = 3, k = 9}}) do
        local qi, ki, w = lunar.randn(c.B, c.S, c.Hi, c.Di), lunar.randn(c.B, c.T, c.Di), lunar.randn(c.B, c.S, c.Hi)
        local ms = {none = false, random = lunar.zeros(c.B, c.S, c.T)}
        ops.masked_fill_(ms.random, ops.gt(lunar.rand(c.B, c.S, c.T), 0.5), FMIN)
        if c.S == c.T then ms.padded = c.B >= 2 and c.T >= 3 and padded_mask(c.B, c.T) or masks.causal(c.B, c.T) end
        for mname, m in pairs(ms) do
            local msg = ('B %d S %d T %d, mask %s'):format(c.B, c.S, c.T, mname)
            local scores, topk = ops.index_scores(qi, ki, w, {mask = m or nil, scale = 0.5, topk = c.k})
            T.close(scores, ref_index(qi, ki, w, m or nil, 0.5), {rtol = 1e-5, atol = 1e-5, msg = msg})
            if m then
                local sf, mf = scores:tolist_flat(), m:tolist_flat()
                for i = 1, #mf do if mf[i] == FMIN then assert(sf[i] == FMIN, msg .. ': masked score is the mask value') end end
            end
            local _, want = ops.topk(scores, c.k)
            want = sorted_rows(want)
            T.equal(topk, want, msg .. ' topk (the set of ops.topk, in increasing key order)')
            local none, only = ops.index_scores(qi, ki, w, {mask = m or nil, scale = 0.5, topk = c.k, scores = false})
            assert(none == nil)
            T.equal(only, want, msg .. ' topk without scores')
        end
    end
    -- non-contiguous inputs and output, bf16 inputs
    local q4 = lunar.randn(1, 4, 6, 3):transpose(2, 3)               -- (1, 6, 4, 3) view
    local ki3 = lunar.randn(1, 3, 6):transpose(2, 3)                 -- (1, 6, 3) view
    local w = lunar.randn(1, 4, 6):transpose(2, 3)                   -- (1, 6, 4) view
    local m = masks.causal(1, 6)
    local obuf = lunar.zeros(1, 6, 6)
    ops.index_scores(q4, ki3, w, {mask = m, out = obuf:transpose(2, 3)})
    T.close(obuf:transpose(2, 3), ref_index(q4, ki3, w, m, 3 ^ -0.5), {rtol = 1e-5, atol = 1e-5, msg = 'views'})
    T.close(ops.index_scores(q4:bf16(), ki3:bf16(), w, {mask = m}), ref_index(q4:bf16(), ki3:bf16(), w, m, 3 ^ -0.5),
        {rtol = 1e-4, atol = 1e-4, msg = 'bf16 inputs'})
end)

T:test('index_scores equals the gemm composition of nn.dsa (keep path) at a larger size', function()
    local B, S, Hi, Di = 2, 150, 4, 32
    local qi, ki, w = lunar.randn(B, S, Hi, Di), lunar.randn(B, S, Di), lunar.randn(B, S, Hi)
    local m = masks.causal(B, S)
    local A = ops.relu(ops.gemm(qi:view({B, S * Hi, Di}), ki, {trans_b = true, alpha = Di ^ -0.5}))
    local I = ops.gemm(w:view({B * S, 1, Hi}), A:view({B * S, Hi, S})):view({B, S, S})
    local want = ops.add(I, m)
    local got, topk = ops.index_scores(qi, ki, w, {mask = m, topk = 40})
    T.close(got, want, {rtol = 1e-5, atol = 1e-5})
    local _, ref = ops.topk(want, 40)
    local gf, rf = topk:tolist_flat(), sorted_rows(ref)
    local same = 0
    for i = 1, #gf do same = same + (gf[i] == rf[i] and 1 or 0) end
    assert(same >= #gf - 8, 'the top-k sets agree (up to near ties): ' .. same .. ' of ' .. #gf)
end)

os.exit(T:run())
