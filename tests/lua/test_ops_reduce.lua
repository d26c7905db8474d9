-- test_ops_reduce.lua: sum, mean, max, min, norm, their backward, max/argmax with indices,
-- cumsum and global_norm against plain-Lua references (loops over tolist_flat values, in f64).
--
-- Tolerances: f32 results vs the f64 reference rtol 1e-5 (the CPU accumulates in f64, so this
-- only covers the final f32 rounding and expf); bf16 inputs and outputs rtol 1e-2 (8-bit
-- mantissa); gradchecks eps 1e-2, rtol 1e-2, atol 1e-3 (central differences of f32 outputs).
local lunar = require 'lunar'
local T = require('lunar.testing').suite('ops.reduce')
local ops = lunar.ops

lunar.manual_seed(1234)
math.randomseed(1234)

local function prod(t, a, b)
    local p = 1
    for i = a, b do p = p * t[i] end
    return p
end

-- outer, n, inner of shape around the 1-based dim d (nil: everything)
local function split(shape, d)
    if d == nil then return 1, prod(shape, 1, #shape), 1 end
    if d < 0 then d = d + #shape + 1 end
    return prod(shape, 1, d - 1), shape[d], prod(shape, d + 1, #shape)
end

-- column (o, i) of flat values over the reduced extent
local function column(vals, o, i, n, inner)
    local c = {}
    for j = 0, n - 1 do c[j + 1] = vals[(o * n + j) * inner + i + 1] end
    return c
end

local ref_op = {
    sum = function(c) local s = 0 for _, v in ipairs(c) do s = s + v end return s end,
    mean = function(c) local s = 0 for _, v in ipairs(c) do s = s + v end return s / #c end,
    norm = function(c) local s = 0 for _, v in ipairs(c) do s = s + v * v end return math.sqrt(s) end,
    max = function(c) local m, k = c[1], 1 for j, v in ipairs(c) do if v > m then m, k = v, j end end return m, k - 1 end,
    min = function(c) local m, k = c[1], 1 for j, v in ipairs(c) do if v < m then m, k = v, j end end return m, k - 1 end,
}

-- reference reduction: values (and 0-based arg indices for max/min) in row-major order
local function ref_reduce(x, d, op)
    local vals, shape = x:tolist_flat(), x:size()
    local outer, n, inner = split(shape, d)
    local out, idx = {}, {}
    for o = 0, outer - 1 do
        for i = 0, inner - 1 do
            local v, k = ref_op[op](column(vals, o, i, n, inner))
            out[#out + 1], idx[#idx + 1] = v, k
        end
    end
    return out, idx
end

local function shape_str(t) return table.concat(t:size(), 'x') end

-- a tensor of distinct values (spaced >= 0.05) in random order, for max/min/argmax checks
local function distinct(shape)
    local n = prod(shape, 1, #shape)
    local v = {}
    for i = 1, n do v[i] = (i - n / 2) * 0.05 end
    for i = n, 2, -1 do local j = math.random(i); v[i], v[j] = v[j], v[i] end
    return lunar.tensor(v):view(shape)
end

local OPS = {'sum', 'mean', 'max', 'min', 'norm'}

T:test('integer and bool tensors: sum (to i64), max and min, exact', function()
    -- counting the tokens that are not ignore_index: a bool sum
    local labels = lunar.tensor({{-100, 5, 7}, {3, -100, -100}}, 'i64')
    local n = ops.sum(labels:ne(-100))
    assert(n:dtype() == 'i64', 'a bool sum is i64, got ' .. n:dtype())
    T.equal(n:item(), 3, 'count of kept tokens')
    T.equal(ops.sum(labels, 1), {-97, -95, -93}, 'i64 sum over dim 1')
    T.equal(ops.sum(labels, 2, {keepdim = true}):size(), {2, 1}, 'keepdim')
    T.equal(ops.sum(labels, 2), {-88, -197}, 'i64 sum over dim 2')
    -- past 2^53, where an f64 sum would round: exact in i64
    local big = lunar.tensor({2 ^ 53, 1, 1}, 'i64')
    T.equal(ops.sum(big):tolist_flat()[1] - 2 ^ 53, 2, 'exact past 2^53')
    local i32 = lunar.tensor({{4, -9}, {2, 8}}, 'i32')
    local mx, mn = ops.max(i32), ops.min(i32)
    assert(mx:dtype() == 'i32' and mn:dtype() == 'i32', 'max and min keep the dtype')
    T.equal(mx:item(), 8, 'i32 max')
    T.equal(mn:item(), -9, 'i32 min')
    T.equal(ops.sum(lunar.zeros(0, 'u8')):item(), 0, 'empty sum')
    T.raises(function() ops.sum(labels, {out = lunar.empty({})}) end, "must be an integer tensor for an integer x")
end)

T:test('every reduction over every dim of 3-D tensors and over everything, keepdim or not', function()
    for _, shape in ipairs({{3, 17, 5}, {1, 3, 1}, {2, 1, 4}}) do
        local x = lunar.randn(shape)
        for _, op in ipairs(OPS) do
            for d = -1, 3 do
                if d ~= 0 then
                    local want = ref_reduce(x, d, op)
                    local y = ops[op](x, d)
                    local yk = ops[op](x, d, {keepdim = true})
                    local dd = d < 0 and d + 4 or d
                    assert(y:dim() == 2 and yk:dim() == 3 and yk:size(dd) == 1, op .. ' shape ' .. shape_str(y))
                    T.close(y, want, {rtol = 1e-5, atol = 1e-6, msg = ('%s dim %d of %s'):format(op, d, shape_str(x))})
                    T.close(yk, want, {rtol = 1e-5, atol = 1e-6, msg = op .. ' keepdim'})
                end
            end
            local all = ops[op](x)
            assert(all:dim() == 0, op .. ' over everything is 0-dim')
            T.close(all, ref_reduce(x, nil, op), {rtol = 1e-5, atol = 1e-6, msg = op .. ' all'})
            T.close(x[op](x, {keepdim = true}), ref_reduce(x, nil, op), {rtol = 1e-5, atol = 1e-6})
        end
    end
    local x = lunar.tensor({{1, 2}, {3, 4}})
    assert(x:sum():item() == 10 and x:mean():item() == 2.5 and x:max():item() == 4 and x:min():item() == 1)
end)

T:test('sizes 1, 3, 17, 1000 and long rows (sliced and parallel paths)', function()
    for _, n in ipairs({1, 3, 17, 1000, 5000, 70001}) do
        local x = lunar.randn(n)
        for _, op in ipairs(OPS) do
            T.close(ops[op](x), ref_reduce(x, nil, op), {rtol = 1e-5, atol = 1e-5, msg = op .. ' n=' .. n})
        end
        local m = lunar.randn(3, n)
        T.close(ops.sum(m, 2), ref_reduce(m, 2, 'sum'), {rtol = 1e-5, atol = 1e-4, msg = 'rows n=' .. n})
        T.close(ops.norm(m, 1), ref_reduce(m, 1, 'norm'), {rtol = 1e-5, atol = 1e-6, msg = 'cols n=' .. n})
    end
    local big = lunar.randn(1000, 20)
    for d = 1, 2 do
        for _, op in ipairs(OPS) do T.close(ops[op](big, d), ref_reduce(big, d, op), {rtol = 1e-5, atol = 1e-5}) end
    end
end)

T:test('sums do not depend on the thread count', function()
    local x = lunar.randn(200003)
    local m = lunar.randn(5, 40000)
    local old = lunar.threads()
    lunar.threads(1)
    local a, ra = ops.sum(x):item(), ops.sum(m, 2):tolist_flat()
    local g1 = ops.global_norm({x, m})
    lunar.threads(2)
    local b, rb = ops.sum(x):item(), ops.sum(m, 2):tolist_flat()
    local g2 = ops.global_norm({x, m})
    lunar.threads(old)
    assert(a == b and g1 == g2, 'thread count changed a sum')
    T.equal(ra, rb, 'row sums')
end)

T:test('non-contiguous inputs and outputs', function()
    local base = lunar.randn(6, 17, 9)
    local views = {base:transpose(1, 3), base:narrow(2, 3, 11), base:narrow(3, 2, 5):transpose(2, 3), base:select(2, 4)}
    for _, x in ipairs(views) do
        assert(not x:is_contiguous())
        for _, op in ipairs(OPS) do
            for d = 1, x:dim() do
                T.close(ops[op](x, d), ref_reduce(x, d, op), {rtol = 1e-5, atol = 1e-6, msg = op .. ' view ' .. shape_str(x)})
            end
            T.close(ops[op](x), ref_reduce(x, nil, op), {rtol = 1e-5, atol = 1e-5})
        end
    end
    -- outputs written through views
    local x = lunar.randn(4, 7)
    local big = lunar.zeros(7, 3)
    ops.sum(x, 1, {out = big:select(2, 2)})
    T.close(big:select(2, 2), ref_reduce(x, 1, 'sum'), {rtol = 1e-5, atol = 1e-6})
    T.equal(big:select(2, 1), lunar.zeros(7), 'neighbours untouched')
    local vals, idx = lunar.zeros(4, 2), lunar.zeros(4, 2, {dtype = 'i32'})
    local xd = distinct({4, 5})
    ops.max(xd, 2, {out = vals:select(2, 2), indices = idx:select(2, 1)})
    local rv, ri = ref_reduce(xd, 2, 'max')
    T.close(vals:select(2, 2), rv, {rtol = 0, atol = 0})
    T.equal(idx:select(2, 1):to('f64'), ri, 'i32 indices into a view')
end)

T:test('bf16 inputs (rtol 1e-2)', function()
    local x = lunar.randn(5, 33):bf16()
    for _, op in ipairs(OPS) do
        for d = 1, 2 do
            local y = ops[op](x, d)
            assert(y:dtype() == 'bf16')
            T.close(y, ref_reduce(x, d, op), {rtol = 1e-2, atol = 1e-2, msg = 'bf16 ' .. op})
        end
    end
    local v, i = ops.max(x, 2)
    local rv, ri = ref_reduce(x, 2, 'max')
    T.close(v, rv, {rtol = 0, atol = 0})
    T.equal(i, ri, 'bf16 argmax')
end)

T:test('max / min / argmax with indices: first extreme on ties, NaN propagates', function()
    local x = lunar.tensor({{1, 7, 7, 2}, {5, 5, 5, 5}, {-3, -9, 4, -9}})
    local v, i = ops.max(x, 2)
    T.equal(v, {7, 5, 4}, 'max values')
    T.equal(i, {1, 0, 2}, 'max indices (0-based, first)')
    assert(i:dtype() == 'i64')
    v, i = ops.min(x, 2)
    T.equal(v, {1, 5, -9}, 'min values')
    T.equal(i, {0, 0, 1}, 'min indices')
    v, i = ops.max(x, 1, {keepdim = true})
    T.equal(v, {5, 7, 7, 5}, 'max over dim 1')
    T.equal(i, {1, 0, 0, 1}, 'argmax over dim 1')
    assert(#v:size() == 2 and v:size(1) == 1)
    T.equal(ops.argmax(x, 2), {1, 0, 2}, 'argmax')
    T.equal(ops.argmin(x, -1), {0, 0, 1}, 'argmin')
    T.equal(ops.argmax(x), {1}, 'flat argmax')
    T.equal(ops.argmin(x), {9}, 'flat argmin')
    assert(ops.argmax(x):dim() == 0)
    -- random shapes against the reference, every dim
    local xd = distinct({3, 17, 4})
    for d = 1, 3 do
        local vv, ii = ops.max(xd, d)
        local rv, ri = ref_reduce(xd, d, 'max')
        T.close(vv, rv, {rtol = 0, atol = 0})
        T.equal(ii, ri, 'argmax dim ' .. d)
        vv, ii = ops.min(xd, d)
        rv, ri = ref_reduce(xd, d, 'min')
        T.close(vv, rv, {rtol = 0, atol = 0})
        T.equal(ii, ri, 'argmin dim ' .. d)
    end
    local nan = lunar.tensor({1, 0 / 0, 3, 0 / 0})
    assert(ops.max(nan):item() ~= ops.max(nan):item(), 'max propagates NaN')
    assert(ops.min(nan):item() ~= ops.min(nan):item(), 'min propagates NaN')
    T.equal(ops.argmax(nan), {1}, 'argmax of the first NaN')
end)

-- loss = sum(w * y) in f64 from the op's f32 output
local function weighted(y, w)
    local a, b = y:tolist_flat(), w:tolist_flat()
    local s = 0
    for i = 1, #a do s = s + a[i] * b[i] end
    return s
end

T:test('gradcheck of sum, mean, max, min, norm over each dim and everything', function()
    for _, op in ipairs(OPS) do
        for _, d in ipairs({1, 2, 3, -1, false}) do
            local dim = d or nil
            local x = (op == 'max' or op == 'min') and distinct({3, 4, 5}) or lunar.randn(3, 4, 5)
            local y = ops[op](x, dim)
            local w = lunar.randn(y:size())
            local dx = ops[op .. '_backward'](w, x, y, dim)
            T.gradcheck{name = op .. ' dim ' .. tostring(dim), inputs = {x}, grads = {dx}, eps = 1e-2, rtol = 1e-2, atol = 1e-3,
                f = function(inp) return weighted(ops[op](inp[1], dim), w) end}
            -- keepdim gradient shape works too
            local yk = ops[op](x, dim, {keepdim = true})
            local dxk = ops[op .. '_backward'](w:view(yk:size()), x, yk, dim)
            T.close(dxk, dx, {rtol = 0, atol = 0})
        end
    end
    -- max/min ties: the whole gradient goes to the first extreme
    local x = lunar.tensor({{2, 5, 5}, {1, 1, 0}})
    T.equal(ops.max_backward(lunar.tensor({10, 20}), x, nil, 2), {0, 10, 0, 20, 0, 0}, 'max ties')
    T.equal(ops.min_backward(lunar.tensor({10, 20}), x, nil, 2), {10, 0, 0, 0, 0, 20}, 'min ties')
    -- norm at zero has gradient 0, like torch
    local z = lunar.zeros(2, 3)
    T.equal(ops.norm_backward(lunar.ones(2), z, ops.norm(z, 2), 2), lunar.zeros(2, 3), 'norm at 0')
end)

local function ref_cumsum(x, d, reverse)
    local vals, shape = x:tolist_flat(), x:size()
    local outer, n, inner = split(shape, d)
    local out = {}
    for o = 0, outer - 1 do
        for i = 0, inner - 1 do
            local s = 0
            for jj = 0, n - 1 do
                local j = reverse and n - 1 - jj or jj
                local e = (o * n + j) * inner + i + 1
                s = s + vals[e]
                out[e] = s
            end
        end
    end
    return out
end

T:test('cumsum and its backward (reverse cumsum) over every dim, views, bf16', function()
    local x = lunar.randn(4, 17, 3)
    for d = -1, 3 do
        if d ~= 0 then
            T.close(ops.cumsum(x, d), ref_cumsum(x, d, false), {rtol = 1e-5, atol = 1e-5, msg = 'cumsum dim ' .. d})
            T.close(ops.cumsum_backward(x, d), ref_cumsum(x, d, true), {rtol = 1e-5, atol = 1e-5, msg = 'backward dim ' .. d})
        end
    end
    for _, n in ipairs({1, 3, 17, 1000}) do
        local v = lunar.randn(n)
        T.close(v:cumsum(), ref_cumsum(v, 1, false), {rtol = 1e-5, atol = 1e-4, msg = 'n=' .. n})
    end
    local xt = x:transpose(1, 2):narrow(3, 2, 2)
    local out = lunar.zeros(4, 17, 2):transpose(1, 2)
    ops.cumsum(xt, 1, {out = out})
    T.close(out, ref_cumsum(xt, 1, false), {rtol = 1e-5, atol = 1e-5, msg = 'view in, view out'})
    local xb = x:bf16()
    T.close(ops.cumsum(xb, 2), ref_cumsum(xb, 2, false), {rtol = 1e-2, atol = 2e-2, msg = 'bf16'})
    -- in place: out aliases x
    local y = x:clone()
    ops.cumsum(y, 2, {out = y})
    T.close(y, ref_cumsum(x, 2, false), {rtol = 1e-5, atol = 1e-5, msg = 'in place'})
    -- gradcheck
    local w = lunar.randn(4, 17, 3)
    for d = 1, 3 do
        local dx = ops.cumsum_backward(w, d)
        T.gradcheck{name = 'cumsum dim ' .. d, inputs = {x}, grads = {dx}, eps = 1e-2, rtol = 1e-2, atol = 1e-3,
            f = function(inp) return weighted(ops.cumsum(inp[1], d), w) end}
    end
end)

T:test('global_norm over a list: views, bf16, empty list, tensor result', function()
    local a, b, c = lunar.randn(17, 3), lunar.randn(1000), lunar.randn(5, 8):t()
    local d = lunar.randn(3, 9):bf16()
    local s = 0
    for _, t in ipairs({a, b, c, d}) do for _, v in ipairs(t:tolist_flat()) do s = s + v * v end end
    local g = ops.global_norm({a, b, c, d})
    assert(type(g) == 'number')
    T.close(g, math.sqrt(s), {rtol = 1e-6, atol = 0})
    local gt = ops.global_norm({a, b, c, d}, {tensor = true})
    assert(gt:dtype() == 'f32' and gt:numel() == 1)
    T.close(gt, math.sqrt(s), {rtol = 1e-6, atol = 0})
    assert(ops.global_norm({}) == 0)
    -- many tensors (more than the per-op temporary limit of prep)
    local many, s2 = {}, 0
    for i = 1, 40 do
        many[i] = lunar.randn(3, 2):t()
        for _, v in ipairs(many[i]:tolist_flat()) do s2 = s2 + v * v end
    end
    T.close(ops.global_norm(many), math.sqrt(s2), {rtol = 1e-6, atol = 0})
end)

T:test('errors name the op, the tensor and the problem', function()
    local x = lunar.randn(2, 3, 4)
    x:set_name('acts')
    T.raises(function() ops.sum(x, 4) end, 'dim 4 out of range')
    T.raises(function() ops.mean(x, 0) end, 'dim 0 out of range')
    T.raises(function() ops.max(x, -4) end, 'out of range')
    T.raises(function() ops.sum(x, 2, {out = lunar.empty({2, 5})}) end, "expected (2, 1, 4) or (2, 4)")
    T.raises(function() ops.sum(x, {out = lunar.empty({2})}) end, 'expected one element')
    T.raises(function() ops.mean(lunar.zeros(3, {dtype = 'i64'})) end, 'must be a float tensor')
    T.raises(function() ops.norm(lunar.zeros(3, {dtype = 'bool'})) end, 'must be a float tensor')
    T.raises(function() ops.max(lunar.zeros(0, 3), 1) end, 'empty')
    -- min and argmin run through topk; their errors must still name min / argmin, not topk
    local e = T.raises(function() ops.min(lunar.zeros(0, 3), 1) end, 'min: cannot take the min of an empty extent')
    assert(not e:find('topk'), e)
    T.raises(function() ops.argmin(lunar.zeros(4, 0), 2) end, 'argmin: cannot take the argmin of an empty extent')
    T.raises(function() ops.argmin(lunar.zeros(0)) end, 'argmin: cannot take the argmin of an empty extent')
    T.raises(function() ops.min(lunar.zeros(0)) end, 'empty')
    T.equal(ops.min(lunar.zeros(0, 3), 2), lunar.zeros(0), 'no rows: nothing to reduce, no error')
    T.raises(function() ops.sum_backward(lunar.randn(2, 5), x, nil, 2) end, "dy")
    T.raises(function() ops.norm_backward(lunar.randn(2, 4), x, nil, 2) end, 'y (the forward output) is needed')
    T.raises(function() ops.cumsum(x) end, 'dim is required')
    T.raises(function() ops.cumsum(x, 2, {out = lunar.empty({2, 3})}) end, 'has shape (2, 3), expected (2, 3, 4)')
    T.raises(function() ops.global_norm({x, 'nope'}) end, 'entry 2 of the list is a string')
    T.raises(function() ops.global_norm({x, lunar.zeros(2, {dtype = 'i32'})}) end, 'tensor 2 of the list')
    local gone = lunar.randn(3)
    gone:set_name('freed_grad')
    gone:free()
    -- the binding's check names the op (as Lua called it: the wrapper after a tail call), the
    -- tensor and its shape (not the C function's argument number, which is not the caller's)
    T.raises(function() ops.sum(gone) end, "sum: tensor 'freed_grad' (3) used after free()")
    T.raises(function() gone:fill_(1) end, "fill_: tensor 'freed_grad' (3) used after free()")
    T.raises(function() ops.sum(x, 1, {out = 'nope'}) end, 'sum: expected a tensor, got string')
    T.raises(function() ops.global_norm({x, gone}) end, 'freed_grad')
    -- a sum of all of x into a 0-dim tensor equals item()
    T.close(ops.sum(lunar.zeros(0)), {0}, {atol = 0})
    T.equal(ops.sum(lunar.zeros(3, 0), 2), lunar.zeros(3), 'empty extent sums to 0')
end)

os.exit(T:run())
