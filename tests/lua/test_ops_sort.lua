-- test_ops_sort.lua: topk, argsort and sort against a plain-Lua reference that sorts (value,
-- index) pairs, so equal values must come out in index order (stable) in both directions.
-- Values are compared exactly (sorting moves values, it does not compute them); NaN sorts above
-- +inf and -0 ties with +0.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('ops.sort')
local ops = lunar.ops

lunar.manual_seed(99)
math.randomseed(99)

-- rank of a value for the reference order: NaN above everything
local function before(a, b, descending)
    local an, bn = a.v ~= a.v, b.v ~= b.v
    if an or bn then
        if an and bn then return a.i < b.i end
        if descending then return an else return bn end
    end
    if a.v == b.v then return a.i < b.i end
    if descending then return a.v > b.v end
    return a.v < b.v
end

-- reference: for each row of the last dim, the first k (value, 0-based index) in order
local function ref_topk(x, k, largest)
    local vals, n = x:tolist_flat(), x:size(x:dim())
    local ov, oi = {}, {}
    for r = 0, #vals / n - 1 do
        local row = {}
        for j = 1, n do row[j] = {v = vals[r * n + j], i = j - 1} end
        table.sort(row, function(a, b) return before(a, b, largest) end)
        for j = 1, k do ov[#ov + 1], oi[#oi + 1] = row[j].v, row[j].i end
    end
    return ov, oi
end

-- random values with many ties (small integer range) or continuous
local function rand_tensor(shape, ties)
    if not ties then return lunar.randn(shape) end
    local n = 1
    for _, s in ipairs(shape) do n = n * s end
    local v = {}
    for i = 1, n do v[i] = math.random(-3, 3) * 0.5 end
    return lunar.tensor(v):view(shape)
end

local SHAPES = {{1}, {3}, {17}, {1000}, {4, 17}, {2, 3, 17}, {5, 1}}

T:test('argsort and sort, ascending and descending, stable on ties', function()
    for _, shape in ipairs(SHAPES) do
        for _, ties in ipairs({false, true}) do
            local x = rand_tensor(shape, ties)
            local n = shape[#shape]
            for _, desc in ipairs({false, true}) do
                local msg = ('%s ties=%s desc=%s'):format(table.concat(shape, 'x'), tostring(ties), tostring(desc))
                local rv, ri = ref_topk(x, n, desc)
                local idx = ops.argsort(x, {descending = desc})
                assert(idx:dtype() == 'i64')
                T.equal(idx, ri, 'argsort ' .. msg)
                local v, i = ops.sort(x, {descending = desc})
                T.equal(v, rv, 'sort values ' .. msg)
                T.equal(i, ri, 'sort indices ' .. msg)
            end
        end
    end
end)

T:test('topk largest and smallest for k = 1, 3, n', function()
    for _, shape in ipairs({{17}, {4, 17}, {3, 1000}, {2, 3, 5}, {6, 3}}) do
        local n = shape[#shape]
        for _, ties in ipairs({false, true}) do
            local x = rand_tensor(shape, ties)
            for _, k in ipairs({1, 3, n}) do
                for _, largest in ipairs({true, false}) do
                    local rv, ri = ref_topk(x, k, largest)
                    local v, i = ops.topk(x, k, {largest = largest})
                    local msg = ('%s k=%d largest=%s ties=%s'):format(table.concat(shape, 'x'), k, tostring(largest),
                        tostring(ties))
                    assert(v:size(#shape) == k and i:size(#shape) == k)
                    T.equal(v, rv, 'values ' .. msg)
                    T.equal(i, ri, 'indices ' .. msg)
                end
            end
        end
    end
    local v, i = ops.topk(lunar.tensor({5, 1, 5, 9, 1}), 3)
    T.equal(v, {9, 5, 5}, 'values')
    T.equal(i, {3, 0, 2}, 'ties go to the lower index first')
    v, i = ops.topk(lunar.tensor({5, 1, 5, 9, 1}), 3, {largest = false})
    T.equal(v, {1, 1, 5}, 'smallest values')
    T.equal(i, {1, 4, 0}, 'smallest indices')
    local _, none = ops.topk(lunar.randn(3, 4), 0)
    assert(none:size(2) == 0)
end)

T:test('non-contiguous inputs and outputs, other dims', function()
    local base = rand_tensor({9, 17}, true)
    for _, x in ipairs({base:t(), base:narrow(2, 3, 11), base:narrow(1, 2, 4):t()}) do
        assert(not x:is_contiguous())
        local n = x:size(2)
        local rv, ri = ref_topk(x, n, true)
        T.equal(ops.argsort(x, {descending = true}), ri, 'argsort of a view')
        local v, i = ops.topk(x, 3)
        local tv, ti = ref_topk(x, 3, true)
        T.equal(v, tv, 'topk values of a view')
        T.equal(i, ti, 'topk indices of a view')
        local sv = ops.sort(x, {descending = true})
        T.equal(sv, rv, 'sort of a view')
    end
    -- outputs written through views (values and i32 indices)
    local x = rand_tensor({5, 17}, true)
    local vals, idx = lunar.zeros(3, 5), lunar.zeros(3, 5, {dtype = 'i32'})
    ops.topk(x, 3, {out = vals:t(), indices = idx:t()})
    local tv, ti = ref_topk(x, 3, true)
    T.equal(vals:t(), tv, 'values into a transposed view')
    T.equal(idx:t():to('i64'), ti, 'i32 indices into a transposed view')
    local big = lunar.zeros(5, 20, {dtype = 'i64'})
    ops.argsort(x, {out = big:narrow(2, 2, 17)})
    local _, ri = ref_topk(x, 17, false)
    T.equal(big:narrow(2, 2, 17), ri, 'argsort into a narrowed view')
    -- along dim 1 = along the last dim of the transpose
    local y = rand_tensor({7, 4}, true)
    local a = ops.argsort(y, {dim = 1})
    local _, r1 = ref_topk(y:t(), 7, false)
    T.equal(a:t(), r1, 'argsort along dim 1')
    local v1 = ops.topk(y, 2, {dim = 1})
    T.equal(v1:t(), ref_topk(y:t(), 2, true), 'topk along dim 1')
    -- a positional dim, as the reduce and softmax families take it (and torch): x:topk(k, dim)
    T.equal(ops.topk(y, 2, 1), v1, 'topk(x, k, dim)')
    T.equal(y:topk(2, 1, {largest = false}), ops.topk(y, 2, {dim = 1, largest = false}), 'x:topk(k, dim, opts)')
    T.equal(ops.argsort(y, 1), a, 'argsort(x, dim)')
    T.equal(y:argsort(-2, {descending = true}), ops.argsort(y, {dim = 1, descending = true}), 'argsort(x, dim, opts)')
    T.equal(y:sort(1), ops.sort(y, {dim = 1}), 'sort(x, dim)')
    T.raises(function() ops.topk(y, 2, 1, {dim = 2}) end, 'dim given twice')
end)

T:test('bf16 and integer inputs, NaN and signed zeros', function()
    local xb = lunar.randn(4, 33):bf16()
    local v, i = ops.topk(xb, 5)
    assert(v:dtype() == 'bf16')
    local rv, ri = ref_topk(xb, 5, true)
    T.equal(v, rv, 'bf16 values')
    T.equal(i, ri, 'bf16 indices')
    local xi = lunar.tensor({{40, -7, 40, 3, 100000}}, 'i64')
    local si, ii = ops.sort(xi)
    assert(si:dtype() == 'i64')
    T.equal(si, {-7, 3, 40, 40, 100000}, 'i64 values')
    T.equal(ii, {1, 3, 0, 2, 4}, 'i64 indices')
    T.equal(ops.argsort(lunar.tensor({3, 1, 2}, 'i32'), {descending = true}), {0, 2, 1}, 'i32 argsort')
    local nan = 0 / 0
    local xn = lunar.tensor({1, nan, -math.huge, math.huge, nan, -0.0, 0.0, -1})
    T.equal(ops.argsort(xn), {2, 7, 5, 6, 0, 3, 1, 4}, 'ascending: NaN last, -0 ties +0')
    T.equal(ops.argsort(xn, {descending = true}), {1, 4, 3, 0, 5, 6, 7, 2}, 'descending: NaN first')
    local _, ti = ops.topk(xn, 2)
    T.equal(ti, {1, 4}, 'topk takes NaN as the largest')
end)

T:test('long rows (n = 20000) match the reference', function()
    local x = rand_tensor({2, 20000}, true)
    local _, ri = ref_topk(x, 20000, true)
    T.equal(ops.argsort(x, {descending = true}), ri, 'argsort')
    local tv, ti = ref_topk(x, 50, false)
    local v, i = ops.topk(x, 50, {largest = false})
    T.equal(v, tv, 'topk values')
    T.equal(i, ti, 'topk indices')
end)

T:test('errors name the op, the tensor and the problem', function()
    local x = lunar.randn(3, 5)
    x:set_name('scores')
    T.raises(function() ops.topk(x, 6) end, "k = 6 out of range [0, 5] for x 'scores'")
    T.raises(function() ops.topk(x, -1) end, 'k = -1 out of range')
    T.raises(function() ops.topk(x, 1.5) end, 'k must be an integer')
    T.raises(function() ops.argsort(lunar.tensor(3)) end, '0-dim')
    T.raises(function() ops.argsort(lunar.zeros(3, {dtype = 'bool'})) end, 'is bool')
    T.raises(function() ops.argsort(x, {out = lunar.zeros(3, 5)}) end, 'must be i32 or i64')
    T.raises(function() ops.argsort(x, {out = lunar.zeros(3, 4, {dtype = 'i64'})}) end, 'has shape (3, 4), expected (3, 5)')
    T.raises(function() ops.topk(x, 2, {out = lunar.zeros(3, 3)}) end, 'values')
    T.raises(function() ops.sort(x, {dim = 3}) end, 'dim 3 out of range')
    local gone = lunar.randn(4)
    gone:set_name('router_logits')
    gone:free()
    T.raises(function() ops.topk(gone, 1) end, 'router_logits')
end)

os.exit(T:run())
