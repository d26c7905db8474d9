-- test_ops_mask.lua: causal and block-diagonal masks against a direct Lua reference.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('ops.mask')

local function ref_causal(tq, tk, offset)
    local out = {}
    for q = 1, tq do for k = 1, tk do out[#out + 1] = (k - 1 <= q - 1 + offset) and 1 or 0 end end
    return out
end

T:test('causal mask, bool and float, several shapes and offsets', function()
    for _, c in ipairs({{1, 1, 0}, {3, 3, 0}, {4, 7, 3}, {17, 17, 0}, {5, 3, -1}}) do
        local tq, tk, off = c[1], c[2], c[3]
        local b = lunar.ops.causal_mask(tq, tk, {offset = off})
        assert(b:dtype() == 'bool')
        T.equal(b:to('f32'), ref_causal(tq, tk, off), ('bool %dx%d offset %d'):format(tq, tk, off))
        local f = lunar.ops.causal_mask(tq, tk, {offset = off, dtype = 'f32'})
        local want = {}
        for i, v in ipairs(ref_causal(tq, tk, off)) do want[i] = v == 1 and 0 or -math.huge end
        T.equal(f, want, 'float mask')
    end
end)

T:test('block mask equals the causal mask of each document', function()
    local cu = lunar.tensor({0, 3, 4, 9}, 'i32')
    local m = lunar.ops.block_mask(cu)
    local t = 9
    local docs = {{0, 3}, {3, 4}, {4, 9}}
    local function doc(i) for d, r in ipairs(docs) do if i >= r[1] and i < r[2] then return d end end end
    local want = {}
    for q = 0, t - 1 do for k = 0, t - 1 do want[#want + 1] = (doc(q) == doc(k) and k <= q) and 1 or 0 end end
    T.equal(m:to('f32'), want, 'block causal')
    local nc = lunar.ops.block_mask(cu, {causal = false, dtype = 'bf16'})
    local want2 = {}
    for q = 0, t - 1 do for k = 0, t - 1 do want2[#want2 + 1] = doc(q) == doc(k) and 0 or -math.huge end end
    T.equal(nc:float(), want2, 'block non-causal, bf16')
    -- a non-contiguous output view is filled through a temporary
    local big = lunar.zeros(9, 18, {dtype = 'bool'})
    lunar.ops.block_mask(cu, {out = big:narrow(2, 10, 9)})
    T.equal(big:narrow(2, 10, 9):to('f32'), want, 'into a view')
end)

T:test('bad cu_seqlens are rejected with a clear message', function()
    T.raises(function() lunar.ops.block_mask(lunar.tensor({0, 5, 3}, 'i64'), {out = lunar.empty({3, 3}, 'bool')}) end,
        'decreases')
    T.raises(function() lunar.ops.block_mask(lunar.tensor({1, 3}, 'i64'), {out = lunar.empty({3, 3}, 'bool')}) end,
        'must start at 0')
    T.raises(function() lunar.ops.block_mask(lunar.tensor({0, 3}, 'f32')) end, 'must be i32 or i64')
end)

os.exit(T:run())
