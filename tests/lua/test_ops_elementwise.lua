-- test_ops_elementwise.lua: binary ops (broadcasting, scalar forms, comparisons, in place), unary
-- ops and their backward, SwiGLU and masked_fill against plain Lua references.
--
-- Tolerances: f32 results vs the f64 Lua reference at rtol 1e-5, atol 1e-6 (one f32 rounding,
-- libm functions within a few ulp); bf16 results vs the reference over the same bf16 inputs at
-- rtol 2^-8 (one rounding to 8 significant bits) and atol 1e-6. Gradient checks: central
-- differences of an f32 forward, eps 1e-3, rtol 1e-2, atol 1e-3.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('ops.elementwise')
local ops = lunar.ops

lunar.manual_seed(42)

local F32 = {rtol = 1e-5, atol = 1e-6}
local BF16 = {rtol = 2 ^ -8, atol = 1e-6}

local function with_msg(tol, msg) return {rtol = tol.rtol, atol = tol.atol, msg = msg} end
local function shape_str(s) return '(' .. table.concat(s, ', ') .. ')' end

-- numpy broadcasting of flat row-major values from shape `from` to shape `to`, written
-- independently of lunar's expand
local function bcast(vals, from, to)
    local nd, off = #to, #to - #from
    local fs, s = {}, 1
    for i = #from, 1, -1 do
        fs[i] = from[i] == 1 and 0 or s
        s = s * from[i]
    end
    local total = 1
    for i = 1, nd do total = total * to[i] end
    local out = {}
    for lin = 0, total - 1 do
        local rem, src = lin, 0
        for d = nd, 1, -1 do
            local i = rem % to[d]
            rem = (rem - i) / to[d]
            if d - off >= 1 then src = src + i * fs[d - off] end
        end
        out[lin + 1] = vals[src + 1]
    end
    return out
end

local function bshape(a, b)
    local n = math.max(#a, #b)
    local out = {}
    for i = 1, n do
        local x, y = a[i - (n - #a)] or 1, b[i - (n - #b)] or 1
        out[i] = x == 1 and y or x
    end
    return out
end

local function map2(xs, ys, f)
    local out = {}
    for i = 1, #xs do out[i] = f(xs[i], ys[i]) end
    return out
end

local function map1(xs, f)
    local out = {}
    for i = 1, #xs do out[i] = f(xs[i]) end
    return out
end

local function b2n(c) return c and 1 or 0 end

local binary_ref = {
    add = function(x, y) return x + y end,
    sub = function(x, y) return x - y end,
    mul = function(x, y) return x * y end,
    div = function(x, y) return x / y end,
    pow = function(x, y) return x ^ y end,
    maximum = function(x, y) return x > y and x or y end,
    minimum = function(x, y) return x < y and x or y end,
}
local compare_ref = {
    eq = function(x, y) return b2n(x == y) end,
    ne = function(x, y) return b2n(x ~= y) end,
    lt = function(x, y) return b2n(x < y) end,
    le = function(x, y) return b2n(x <= y) end,
    gt = function(x, y) return b2n(x > y) end,
    ge = function(x, y) return b2n(x >= y) end,
}

-- erf in f64: Taylor series (|z| < 5; converges with ~1e-12 absolute error for these inputs)
local function erf(z)
    if z > 5 then return 1 elseif z < -5 then return -1 end
    local sum, term, n = z, z, 0
    repeat
        n = n + 1
        term = -term * z * z / n
        local add = term / (2 * n + 1)
        sum = sum + add
    until math.abs(add) < 1e-17 * math.max(1, math.abs(sum))
    return sum * 2 / math.sqrt(math.pi)
end

local function sigmoid(x) return 1 / (1 + math.exp(-x)) end
local K = math.sqrt(2 / math.pi)

local unary_ref = {
    neg = function(x) return -x end,
    abs = math.abs,
    exp = math.exp,
    log = math.log,
    sqrt = math.sqrt,
    rsqrt = function(x) return 1 / math.sqrt(x) end,
    reciprocal = function(x) return 1 / x end,
    square = function(x) return x * x end,
    tanh = math.tanh,
    sigmoid = sigmoid,
    silu = function(x) return x * sigmoid(x) end,
    gelu = function(x) return 0.5 * x * (1 + erf(x / math.sqrt(2))) end,
    gelu_tanh = function(x) return 0.5 * x * (1 + math.tanh(K * (x + 0.044715 * x ^ 3))) end,
    relu = function(x) return x > 0 and x or 0 end,
    sin = math.sin,
    cos = math.cos,
}
local positive_domain = {log = true, sqrt = true, rsqrt = true, reciprocal = true}
local unary_names = {'neg', 'abs', 'exp', 'log', 'sqrt', 'rsqrt', 'reciprocal', 'square', 'tanh', 'sigmoid', 'silu',
                     'gelu', 'gelu_tanh', 'relu', 'sin', 'cos'}

-- a tensor of the given shape from Lua values (f32 unless dtype is given)
local function from_vals(vals, shape, dtype)
    return lunar.tensor(vals, dtype):view(shape)
end

local function randn_vals(n, scale)
    local t = lunar.randn(n):tolist_flat()
    for i = 1, n do t[i] = t[i] * (scale or 1) end
    return t
end

-- inputs for a unary op: positive for log/sqrt/rsqrt/reciprocal, away from 0 (kinks of abs
-- and relu) for the rest
local function unary_inputs(name, n)
    local v = randn_vals(n, 1.5)
    for i = 1, n do
        if positive_domain[name] then v[i] = 0.3 + math.abs(v[i])
        elseif math.abs(v[i]) < 0.1 then v[i] = v[i] < 0 and v[i] - 0.1 or v[i] + 0.1 end
    end
    return v
end

local shape_pairs = {
    {{1}, {1}}, {{3}, {3}}, {{17}, {1}}, {{1000}, {1000}}, {{3, 17}, {17}}, {{3, 1}, {1, 17}},
    {{1, 3, 1}, {17, 1, 5}}, {{1000}, {}}, {{17, 1000}, {1000}},
}

T:test('binary ops with broadcasting on shapes with sizes 1, 3, 17 and 1000', function()
    for _, sp in ipairs(shape_pairs) do
        local sa, sb = sp[1], sp[2]
        local so = bshape(sa, sb)
        local na, nb = 1, 1
        for _, s in ipairs(sa) do na = na * s end
        for _, s in ipairs(sb) do nb = nb * s end
        local av, bv = randn_vals(na), randn_vals(nb)
        local a, b = from_vals(av, sa), from_vals(bv, sb)
        local ea, eb = bcast(av, sa, so), bcast(bv, sb, so)
        for name, f in pairs(binary_ref) do
            local x, y, ex, ey = a, b, ea, eb
            if name == 'pow' then
                -- positive bases for real powers
                x = ops.abs(a) + 0.5
                ex = map1(ea, function(v) return math.abs(v) + 0.5 end)
            end
            local r = ops[name](x, y)
            local rs = r:size()
            assert(#rs == #so, name .. ' result dims')
            for i = 1, #so do assert(rs[i] == so[i], name .. ' result shape') end
            T.close(r, map2(ex, ey, f), with_msg(F32, name .. ' ' .. shape_str(sa) .. ' ' .. shape_str(sb)))
        end
    end
end)

T:test('comparisons give bool (or float on request), with ties', function()
    for _, sp in ipairs(shape_pairs) do
        local sa, sb = sp[1], sp[2]
        local so = bshape(sa, sb)
        local a = lunar.randint(-2, 3, sa):float()
        local b = lunar.randint(-2, 3, sb):float()
        local ea, eb = bcast(a:tolist_flat(), sa, so), bcast(b:tolist_flat(), sb, so)
        for name, f in pairs(compare_ref) do
            local r = ops[name](a, b)
            assert(r:dtype() == 'bool', name .. ' gives bool')
            T.equal(r:float(), map2(ea, eb, f), name .. ' ' .. shape_str(sa) .. ' ' .. shape_str(sb))
            local rf = ops[name](a, b, {dtype = 'f32'})
            assert(rf:dtype() == 'f32')
            T.equal(rf, map2(ea, eb, f), name .. ' as f32')
        end
    end
    -- integer tensors compare too
    local ids = lunar.tensor({0, 3, 7, 3}, 'i64')
    T.equal(ops.eq(ids, 3):float(), {0, 1, 0, 1}, 'i64 == 3')
end)

T:test('scalar forms on either side, and the tensor operators', function()
    local av = randn_vals(17 * 3)
    local a = from_vals(av, {3, 17})
    local pos = ops.abs(a) + 0.25
    local pv = pos:tolist_flat()
    local cases = {
        {a + 2.5, map1(av, function(x) return x + 2.5 end), 't + 2.5'},
        {2.5 + a, map1(av, function(x) return x + 2.5 end), '2.5 + t'},
        {a - 1, map1(av, function(x) return x - 1 end), 't - 1'},
        {2 - a, map1(av, function(x) return 2 - x end), '2 - t'},
        {2 * a, map1(av, function(x) return 2 * x end), '2 * t'},
        {a * -1.25, map1(av, function(x) return -1.25 * x end), 't * -1.25'},
        {a / 4, map1(av, function(x) return x / 4 end), 't / 4'},
        {3 / a, map1(av, function(x) return 3 / x end), '3 / t'},
        {pos ^ 2, map1(pv, function(x) return x * x end), 't ^ 2'},
        {pos ^ 0.5, map1(pv, math.sqrt), 't ^ 0.5'},
        {2 ^ a, map1(av, function(x) return 2 ^ x end), '2 ^ t'},
        {-a, map1(av, function(x) return -x end), '-t'},
        {ops.maximum(a, 0), map1(av, function(x) return math.max(x, 0) end), 'maximum(t, 0)'},
        {ops.minimum(0.5, a), map1(av, function(x) return math.min(x, 0.5) end), 'minimum(0.5, t)'},
        {ops.lt(0.5, a):float(), map1(av, function(x) return b2n(0.5 < x) end), 'lt(0.5, t)'},
        {ops.ge(a, 0.5):float(), map1(av, function(x) return b2n(x >= 0.5) end), 'ge(t, 0.5)'},
        {ops.le(0, a):float(), map1(av, function(x) return b2n(0 <= x) end), 'le(0, t)'},
        {ops.gt(0, a):float(), map1(av, function(x) return b2n(0 > x) end), 'gt(0, t)'},
    }
    for _, c in ipairs(cases) do T.close(c[1], c[2], with_msg(F32, c[3])) end
    -- tensor - tensor with broadcasting through the operators
    local u = lunar.randn(17)
    local uv = u:tolist_flat()
    local want = {}
    for i = 1, 3 do for j = 1, 17 do want[#want + 1] = av[(i - 1) * 17 + j] - uv[j] end end
    T.close(a - u, want, with_msg(F32, 't - u'))
    T.close((u - a) * -1, want, with_msg(F32, '(u - t) * -1'))
end)

T:test('non-contiguous inputs and outputs', function()
    local p = lunar.randn(17, 3)
    local a = p:t()                                  -- (3, 17), transposed
    local b = lunar.randn(3, 40):narrow(2, 5, 17)    -- (3, 17), row stride 40
    local ea, eb = a:tolist_flat(), b:tolist_flat()
    local big = lunar.zeros(17, 3)
    local out = big:t()                              -- non-contiguous out
    ops.mul(a, b, {out = out})
    T.close(out, map2(ea, eb, binary_ref.mul), with_msg(F32, 'mul into a transposed out'))
    T.close(big:t(), map2(ea, eb, binary_ref.mul), with_msg(F32, 'written through the view'))
    -- comparisons into a non-contiguous bool out
    local bo = lunar.empty(17, 3, {dtype = 'bool'}):t()
    ops.gt(a, b, {out = bo})
    T.equal(bo:float(), map2(ea, eb, compare_ref.gt), 'gt into a transposed bool out')
    -- unary on a strided view into a narrowed out
    local parent = lunar.zeros(3, 20)
    ops.exp(a, {out = parent:narrow(2, 2, 17)})
    T.close(parent:narrow(2, 2, 17), map1(ea, math.exp), with_msg(F32, 'exp into a narrowed out'))
    T.equal(parent:narrow(2, 1, 1), {0, 0, 0}, 'outside the narrowed out')
    -- an expanded input broadcast along a dim that has stride 0
    local col = lunar.randn(3, 1)
    local e = col:expand(3, 17)
    local ev = bcast(col:tolist_flat(), {3, 1}, {3, 17})
    T.close(ops.add(e, b), map2(ev, eb, binary_ref.add), with_msg(F32, 'expanded input'))
end)

T:test('bf16 inputs give bf16 results; mixed float dtypes give f32; in-place ops keep their dtype', function()
    local a, b = lunar.randn(3, 17):bf16(), lunar.randn(17):bf16()
    local ea = a:float():tolist_flat()
    local eb = bcast(b:float():tolist_flat(), {17}, {3, 17})
    for _, name in ipairs({'add', 'sub', 'mul', 'div', 'maximum', 'minimum'}) do
        local r = ops[name](a, b)
        assert(r:dtype() == 'bf16', name .. ' keeps bf16')
        T.close(r, map2(ea, eb, binary_ref[name]), with_msg(BF16, name .. ' bf16'))
    end
    assert((a + 1):dtype() == 'bf16', 'bf16 + number stays bf16')
    local m = a + b:float()
    assert(m:dtype() == 'f32', 'bf16 + f32 is f32')
    T.close(m, map2(ea, eb, binary_ref.add), with_msg(F32, 'bf16 + f32'))
    assert((lunar.tensor({1, 2}, 'i64') + 1):dtype() == 'f32', 'no float operand: f32')
    for _, name in ipairs(unary_names) do
        local v = unary_inputs(name, 17)
        local x = lunar.tensor(v):bf16()
        local r = ops[name](x)
        assert(r:dtype() == 'bf16')
        T.close(r, map1(x:float():tolist_flat(), unary_ref[name]), with_msg(BF16, name .. ' bf16'))
    end
    -- in place: the first operand is written, in its own dtype, even when it is a view
    local p = lunar.randn(17, 3)
    local pv = p:t():tolist_flat()
    local v = p:t()
    v:mul_(2)
    T.close(p:t(), map1(pv, function(x) return 2 * x end), with_msg(F32, 'mul_ through a view'))
    local ab = a:clone()
    ab:add_(b:float())
    assert(ab:dtype() == 'bf16')
    T.close(ab, map2(ea, eb, binary_ref.add), with_msg(BF16, 'add_ into bf16'))
    local c = lunar.randn(3, 17)
    local cv = c:tolist_flat()
    local u = lunar.randn(17)
    local uv = bcast(u:tolist_flat(), {17}, {3, 17})
    assert(c:sub_(u) == c, 'sub_ returns its first operand')
    c:div_(4)
    T.close(c, map2(cv, uv, function(x, y) return (x - y) / 4 end), with_msg(F32, 'sub_ then div_'))
end)

T:test('unary ops vs Lua on sizes 1, 3, 17, 1000 and 17000 (parallel path)', function()
    for _, n in ipairs({1, 3, 17, 1000, 17000}) do
        for _, name in ipairs(unary_names) do
            local v = unary_inputs(name, n)
            local x = lunar.tensor(v)
            if n == 1000 then x = x:view(40, 25):t() end   -- a transposed view
            local want = map1(x:tolist_flat(), unary_ref[name])
            T.close(ops[name](x), want, with_msg(F32, name .. ' n=' .. n))
            T.close(x[name](x), want, with_msg(F32, name .. ' as a method'))
        end
    end
    -- exact forms: gelu uses erf, gelu_tanh the tanh approximation (they differ by ~1e-3 at 1)
    local one = lunar.tensor({1})
    T.close(ops.gelu(one), {0.8413447460685429}, F32)
    T.close(ops.gelu_tanh(one), {0.8411919906082768}, F32)
    -- large inputs stay finite where the math is
    T.close(ops.sigmoid(lunar.tensor({-100, 100})), {0, 1}, F32)
    T.close(ops.silu(lunar.tensor({-100, -1000})), {0, 0}, F32)
    T.close(ops.silu_backward(lunar.ones(2), lunar.tensor({-100, -1000})), {0, 0}, F32)
    -- sigmoid and SiLU within 4 ulp (4 x 2^-23 relative) of the exact values over [-100, 100] in
    -- steps of 0.01, down to the smallest normal results; the ends and NaN exact
    local grid = {}
    for i = 0, 20000 do grid[#grid + 1] = -100 + i * 0.01 end
    local gx = lunar.tensor(grid)
    local xv, sv, siv = gx:tolist_flat(), ops.sigmoid(gx):tolist_flat(), ops.silu(gx):tolist_flat()
    local worst, worst_silu = 0, 0
    for i, v in ipairs(xv) do
        local e = sigmoid(v)
        if e > 1e-37 then
            worst = math.max(worst, math.abs(sv[i] - e) / e)
            if v ~= 0 then worst_silu = math.max(worst_silu, math.abs(siv[i] - v * e) / math.abs(v * e)) end
        end
    end
    assert(worst <= 4 * 2 ^ -23, ('sigmoid: worst relative error %.3g'):format(worst))
    assert(worst_silu <= 5 * 2 ^ -23, ('silu: worst relative error %.3g'):format(worst_silu))
    local ends = ops.sigmoid(lunar.tensor({-math.huge, math.huge, 0 / 0, 0})):tolist_flat()
    T.equal(ends[1], 0, 'sigmoid(-inf)')
    T.equal(ends[2], 1, 'sigmoid(inf)')
    assert(ends[3] ~= ends[3], 'sigmoid(NaN) is NaN')
    T.equal(ends[4], 0.5, 'sigmoid(0)')
end)

T:test('gradcheck of every unary backward (eps 1e-3, rtol 1e-2, atol 1e-3)', function()
    for _, name in ipairs(unary_names) do
        local x = lunar.tensor(unary_inputs(name, 17))
        local w = lunar.randn(17)
        local wv = w:tolist_flat()
        local dx = ops[name .. '_backward'](w, x)
        T.gradcheck{name = name, inputs = {x}, grads = {dx}, eps = 1e-3, rtol = 1e-2, atol = 1e-3,
            f = function(xs)
                local y = ops[name](xs[1]):tolist_flat()
                local s = 0
                for i = 1, #y do s = s + y[i] * wv[i] end
                return s
            end}
        -- the analytic derivative also matches the Lua formula directly
        local xv = x:tolist_flat()
        local h = 1e-6
        local want = {}
        for i = 1, #xv do
            want[i] = wv[i] * (unary_ref[name](xv[i] + h) - unary_ref[name](xv[i] - h)) / (2 * h)
        end
        T.close(dx, want, {rtol = 1e-4, atol = 1e-5, msg = name .. ' backward vs f64 differences'})
    end
end)

T:test('swiglu forward and backward (gradcheck eps 1e-3, rtol 1e-2, atol 1e-3)', function()
    for _, shape in ipairs({{1}, {3, 17}, {1000}}) do
        local g, u = lunar.randn(shape), lunar.randn(shape)
        local gv, uv = g:tolist_flat(), u:tolist_flat()
        local out = ops.swiglu(g, u)
        T.close(out, map2(gv, uv, function(x, y) return x * sigmoid(x) * y end), with_msg(F32, 'swiglu'))
        local w = lunar.randn(shape)
        local wv = w:tolist_flat()
        local dg, du = ops.swiglu_backward(w, g, u)
        T.gradcheck{name = 'swiglu', inputs = {g, u}, grads = {dg, du}, eps = 1e-3, rtol = 1e-2, atol = 1e-3,
            max_checks = 32,
            f = function(xs)
                local y = ops.swiglu(xs[1], xs[2]):tolist_flat()
                local s = 0
                for i = 1, #y do s = s + y[i] * wv[i] end
                return s
            end}
    end
    -- bf16 and non-contiguous operands
    local g, u = lunar.randn(17, 3):t(), lunar.randn(3, 17):bf16()
    local want = map2(g:tolist_flat(), u:float():tolist_flat(), function(x, y) return x * sigmoid(x) * y end)
    T.close(ops.swiglu(g, u), want, with_msg(F32, 'swiglu mixed'))
    local gb = g:bf16()
    want = map2(gb:float():tolist_flat(), u:float():tolist_flat(), function(x, y) return x * sigmoid(x) * y end)
    local ob = ops.swiglu(gb, u)
    assert(ob:dtype() == 'bf16')
    T.close(ob, want, with_msg(BF16, 'swiglu bf16'))
    T.raises(function() ops.swiglu(lunar.randn(3, 17), lunar.randn(3, 16)) end,
        "up 'tensor' has shape (3, 16), expected (3, 17)")
    -- gradients written over their inputs (dgate = gate, dup = up: buffer reuse in a backward
    -- pass) equal the out-of-place ones; the CPU kernel used to read gate after writing dgate
    for _, n in ipairs({3, 1000, 17000}) do
        local g0, u0, d0 = lunar.randn(n), lunar.randn(n), lunar.randn(n)
        local dg, du = ops.swiglu_backward(d0, g0, u0)
        local g1, u1 = g0:clone(), u0:clone()
        ops.swiglu_backward(d0, g1, u1, {dgate = g1, dup = u1})
        T.close(g1, dg:tolist_flat(), {rtol = 0, atol = 0, msg = 'in-place dgate'})
        T.close(u1, du:tolist_flat(), {rtol = 0, atol = 0, msg = 'in-place dup'})
    end
end)

T:test('masked_fill with broadcast masks, bool and u8, views, bf16, in place', function()
    local x = lunar.randn(3, 17)
    local xv = x:tolist_flat()
    local masks = {
        {lunar.randint(0, 2, {1, 17}):to('bool'), {1, 17}},
        {lunar.randint(0, 2, {3, 1}):to('u8'), {3, 1}},
        {lunar.randint(0, 2, {3, 17}):to('bool'), {3, 17}},
        {lunar.randint(0, 2, {17}):to('bool'), {17}},
    }
    for k, mm in ipairs(masks) do
        local mv = bcast(mm[1]:float():tolist_flat(), mm[2], {3, 17})
        for _, value in ipairs({-math.huge, 2.5}) do
            local want = {}
            for i = 1, #xv do want[i] = mv[i] ~= 0 and value or xv[i] end
            T.equal(ops.masked_fill(x, mm[1], value), want, 'mask ' .. k)
        end
    end
    -- transposed x, bf16 x, in place
    local xt = lunar.randn(17, 3):t()
    local m = masks[1][1]
    local mv = bcast(m:float():tolist_flat(), {1, 17}, {3, 17})
    local xtv = xt:tolist_flat()
    local want = {}
    for i = 1, #xtv do want[i] = mv[i] ~= 0 and 0 or xtv[i] end
    T.equal(ops.masked_fill(xt, m, 0), want, 'transposed x')
    local xb = x:bf16()
    local r = ops.masked_fill(xb, m, -1)
    assert(r:dtype() == 'bf16')
    local xbv = xb:float():tolist_flat()
    for i = 1, #xbv do want[i] = mv[i] ~= 0 and -1 or xbv[i] end
    T.equal(r:float(), want, 'bf16 x')
    local xi = x:clone()
    xi:masked_fill_(m, 7)
    for i = 1, #xv do want[i] = mv[i] ~= 0 and 7 or xv[i] end
    T.equal(xi, want, 'masked_fill_')
    T.raises(function() ops.masked_fill(x, lunar.ones(3, 17), 0) end, 'must be bool or u8, not f32')
    T.raises(function() ops.masked_fill(x, lunar.ones(2, 17, {dtype = 'bool'}), 0) end,
        "mask 'tensor' (2, 17) does not broadcast to out 'tensor' (3, 17)")
end)

T:test('errors name the op, the tensors and their shapes', function()
    local a, b = lunar.randn(3, 4), lunar.randn(5)
    a:set_name('act')
    b:set_name('bias')
    local err = T.raises(function() return a + b end, 'add: a (3, 4) and b (5) do not broadcast together')
    assert(err:find('test_ops_elementwise.lua:%d+:'), 'error points at the caller: ' .. err)
    T.raises(function() ops.mul(a, lunar.randn(4), {out = lunar.empty(2, 4)}) end,
        "mul: a 'act' (3, 4) does not broadcast to out 'tensor' (2, 4)")
    T.raises(function() ops.add(1, 2) end, 'expected a tensor operand')
    T.raises(function() ops.add(a, 'x') end, 'operands must be tensors or numbers')
    T.raises(function() ops.add(a, a, {out = lunar.empty(3, 4, {dtype = 'bool'})}) end,
        'add: out \'tensor\' must be a float tensor, not bool')
    T.raises(function() ops.exp(a, {out = lunar.empty(4, 3)}) end, "exp: x 'act' has shape (3, 4), expected (4, 3)")
    T.raises(function() ops.tanh_backward(lunar.randn(4, 3), a) end, "tanh_backward: dy 'tensor' has shape (4, 3)")
    local gone = lunar.randn(3)
    gone:set_name('gone')
    gone:free()
    T.raises(function() ops.sigmoid(gone) end, 'gone')
    T.raises(function() ops.add(lunar.randn(3), gone) end, 'gone')
    T.raises(function() lunar.core.ops.binary(a, a, a, 'frobnicate') end, "unknown binary op 'frobnicate'")
    T.raises(function() lunar.core.ops.unary(a, a, 'frobnicate') end, "unknown unary op 'frobnicate'")
end)

os.exit(T:run())
