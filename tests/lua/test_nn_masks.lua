-- test_nn_masks.lua: lunar.nn.masks against a plain-Lua reference of HF's eager masks: causal,
-- padding (left and right), packed documents (cu_seqlens, one row or one list per row), packed
-- positions, the DSA top-k selection and the valid-query vector. Exact equality (the values are
-- 0 and f32 finfo.min).
local lunar = require 'lunar'
local masks = require 'lunar.nn.masks'
local T = require('lunar.testing').suite('nn.masks')

local FMIN = masks.FMIN

-- reference: visible(b, s, t) -> bool, for B rows of T
local function ref_mask(B, Tn, visible)
    local out = {}
    for b = 1, B do
        for s = 1, Tn do
            for t = 1, Tn do out[#out + 1] = visible(b, s, t) and 0 or FMIN end
        end
    end
    return out
end

-- document id of each 1-based position, from a 0-based offsets list
local function doc_of(cu)
    local d = {}
    for i = 1, #cu - 1 do for t = cu[i] + 1, cu[i + 1] do d[t] = i end end
    return d
end

T:test('FMIN is f32 finfo.min', function()
    T.equal(lunar.tensor({FMIN}):get(1), FMIN, 'round trip through f32')
    T.equal(FMIN, -(2 - 2 ^ -23) * 2 ^ 127, 'value')
end)

T:test('causal', function()
    for _, sz in ipairs({{1, 1}, {2, 3}, {3, 17}}) do
        local B, Tn = sz[1], sz[2]
        local m = masks.causal(B, Tn)
        T.equal(m:size(), {B, Tn, Tn}, 'shape')
        assert(m:dtype() == 'f32', 'dtype')
        T.equal(m, ref_mask(B, Tn, function(_, s, t) return t <= s end), 'causal ' .. B .. 'x' .. Tn)
    end
end)

T:test('padding: left and right, pad keys hidden, rows without keys all FMIN', function()
    local am = {{0, 0, 1, 1, 1}, {1, 1, 1, 0, 0}, {1, 1, 1, 1, 1}}
    for _, dt in ipairs({'i64', 'f32', 'bool'}) do
        local m = masks.build{B = 3, T = 5, attention_mask = lunar.tensor(am, dt)}
        T.equal(m, ref_mask(3, 5, function(b, s, t) return t <= s and am[b][t] ~= 0 end), 'padding ' .. dt)
    end
    -- left padding: query rows 1 and 2 of row 1 see no key at all
    local m = masks.build{B = 3, T = 5, attention_mask = lunar.tensor(am, 'i64')}
    for t = 1, 5 do T.equal(m:get(1, 1, t), FMIN, 'fully masked row') end
    T.raises(function() masks.build{B = 2, T = 5, attention_mask = lunar.tensor(am, 'i64')} end, 'attention_mask must be (B, T)')
end)

T:test('packed documents: block-diagonal causal, positions restart', function()
    local cu = {0, 3, 4, 9}
    local m = masks.build{B = 1, T = 9, cu_seqlens = lunar.tensor(cu, 'i64')}
    local d = doc_of(cu)
    T.equal(m, ref_mask(1, 9, function(_, s, t) return t <= s and d[s] == d[t] end), 'packed')
    T.equal(masks.packed_positions(lunar.tensor(cu, 'i64')), {0, 1, 2, 0, 0, 1, 2, 3, 4}, 'positions')
    -- packed plus padding at the end (a padding "document")
    local am = {{1, 1, 1, 1, 1, 1, 1, 0, 0}}
    m = masks.build{B = 1, T = 9, cu_seqlens = lunar.tensor(cu, 'i64'), attention_mask = lunar.tensor(am, 'i64')}
    T.equal(m, ref_mask(1, 9, function(_, s, t) return t <= s and d[s] == d[t] and am[1][t] == 1 end), 'packed+pad')
    -- one list per row
    local cus = {{0, 2, 6}, {0, 1, 2, 3, 6}}
    m = masks.build{B = 2, T = 6, cu_seqlens = {lunar.tensor(cus[1], 'i64'), lunar.tensor(cus[2], 'i32')}}
    local ds = {doc_of(cus[1]), doc_of(cus[2])}
    T.equal(m, ref_mask(2, 6, function(b, s, t) return t <= s and ds[b][s] == ds[b][t] end), 'per-row packed')
    T.equal(masks.packed_positions({lunar.tensor(cus[1], 'i64'), lunar.tensor(cus[2], 'i64')}),
        {0, 1, 0, 1, 2, 3, 0, 0, 0, 0, 1, 2}, 'per-row positions')
    T.raises(function() masks.build{B = 2, T = 9, cu_seqlens = lunar.tensor(cu, 'i64')} end, 'one packed row')
    T.raises(function() masks.build{B = 1, T = 8, cu_seqlens = lunar.tensor(cu, 'i64')} end, 'end at T = 8')
    T.raises(function() masks.build{B = 1, T = 9, cu_seqlens = lunar.tensor({0, 5, 3, 9}, 'i64')} end, 'non-decreasing')
end)

T:test('select: keys outside top-k become FMIN, masked keys stay masked', function()
    local m = masks.causal(2, 4)
    local topk = lunar.tensor({{{0, 1}, {1, 0}, {2, 0}, {3, 1}}, {{0, 3}, {1, 3}, {2, 1}, {0, 3}}}, 'i64')
    local sel = masks.select(m, topk)
    local tk = topk:tolist()
    T.equal(sel, ref_mask(2, 4, function(b, s, t)
        local chosen = false
        for _, i in ipairs(tk[b][s]) do if i == t - 1 then chosen = true end end
        return t <= s and chosen
    end), 'selection')
end)

T:test('query_valid', function()
    local am = lunar.tensor({{0, 1, 1}, {1, 1, 0}}, 'i64')
    local m = masks.build{B = 2, T = 3, attention_mask = am}
    T.equal(masks.query_valid(m), {0, 1, 1, 1, 1, 1}, 'rows with a visible key')
    T.equal(masks.query_valid(m, am), {0, 1, 1, 1, 1, 0}, 'and not padding')
end)

os.exit(T:run())
