-- test_ops_gemm_grouped.lua: lunar.ops.gemm_grouped against one lunar.ops.gemm per product: bit
-- for bit with one thread (each product is one BLAS call either way), within rtol 1e-5 / atol
-- 2e-4 with two (sums of up to 650 products of N(0,1); OpenBLAS's threaded kernels may round
-- differently from the single-threaded one run side by side); moderately small products (side by
-- side) and a large one (one at a time); views (narrowed rows, transposed), trans flags, alpha and beta; products the grouped path cannot take (bf16, a transposed
-- output, an output overlapping its input) go through gemm; errors name the product.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.gemm_grouped')

lunar.manual_seed(17)

local function check_same(as, bs, cs0, opts)
    local cs1 = {}
    for i, c in ipairs(cs0) do cs1[i] = c:clone() end
    local o1 = {}
    for k, v in pairs(opts) do o1[k] = v end
    o1.out = cs0
    ops.gemm_grouped(as, bs, o1)
    for i = 1, #as do
        local o2 = {}
        for k, v in pairs(opts) do o2[k] = v end
        o2.out = cs1[i]
        ops.gemm(as[i], bs[i], o2)
        if lunar.threads() == 1 then T.equal(cs0[i], cs1[i], 'product ' .. i)
        else T.close(cs0[i], cs1[i], {rtol = 1e-5, atol = 2e-4, msg = 'product ' .. i}) end
    end
end

T:test('equals one gemm per product (sizes, views, flags, alpha, beta; 1 and 2 threads)', function()
    local saved = lunar.threads()
    for _, nt in ipairs({1, 2}) do
    lunar.threads(nt)
    for _, sizes in ipairs({{{1, 1, 1}}, {{3, 17, 5}, {17, 3, 1}, {64, 33, 70}}, {{300, 200, 128}, {1, 256, 7}, {90, 64, 512}},
                            {{650, 650, 650}, {20, 30, 40}}}) do
        for fi, flags in ipairs({{false, true}, {true, false}, {false, false}}) do
            if sizes[1][1] == 650 and fi > 1 then break end
            local ta, tb = flags[1], flags[2]
            local as, bs, cs = {}, {}, {}
            local big = lunar.randn(1400, 700)
            for i, s in ipairs(sizes) do
                local m, n, k = s[1], s[2], s[3]
                -- a as a row range of a bigger tensor (like the MoE's sorted token blocks)
                as[i] = ta and big:narrow(1, i, k):narrow(2, 1, m) or big:narrow(1, 3 * i, m):narrow(2, 1, k)
                bs[i] = tb and lunar.randn(n, k) or lunar.randn(k, n)
                cs[i] = lunar.randn(m, n)
            end
            check_same(as, bs, cs, {trans_a = ta, trans_b = tb, alpha = 0.5, beta = 1})
            check_same(as, bs, cs, {trans_a = ta, trans_b = tb})
        end
    end
    -- transposed views of b flip its flag on the way to BLAS
    local as, bs, cs = {lunar.randn(5, 6), lunar.randn(7, 6)}, {lunar.randn(4, 6):t(), lunar.randn(6, 3)}, {lunar.zeros(5, 4), lunar.zeros(7, 3)}
    check_same(as, bs, cs, {})
    end
    lunar.threads(saved)
end)

T:test('new outputs, and products the grouped path cannot take', function()
    local a1, b1, a2, b2 = lunar.randn(4, 5), lunar.randn(5, 3), lunar.randn(2, 5), lunar.randn(5, 6)
    local cs = ops.gemm_grouped({a1, a2}, {b1, b2})
    T.equal(cs[1], ops.gemm(a1, b1), 'first')
    T.equal(cs[2], ops.gemm(a2, b2), 'second')
    -- bf16 inputs, a transposed output, an output that overlaps an input
    local cb = ops.gemm_grouped({a1:bf16(), a2}, {b1:bf16(), b2})
    T.close(cb[1], ops.gemm(a1:bf16(), b1:bf16()), {rtol = 0, atol = 0, msg = 'bf16'})
    local ct = lunar.zeros(3, 4)
    ops.gemm_grouped({a1, a2}, {b1, b2}, {out = {ct:t(), lunar.zeros(2, 6)}})
    T.equal(ct:t(), ops.gemm(a1, b1), 'transposed out')
    local x = lunar.randn(4, 4)
    local want = ops.gemm(x, lunar.eye and lunar.eye(4) or ops.gemm(x, x))
    local y = x:clone()
    ops.gemm_grouped({y}, {x:clone()}, {out = {y}})
    T.close(y, ops.gemm(x, x), {rtol = 1e-6, atol = 1e-6, msg = 'out overlapping a'})
    assert(want)
end)

T:test('errors name the product', function()
    local a, b = lunar.randn(4, 5), lunar.randn(5, 3)
    T.raises(function() ops.gemm_grouped({a, a}, {b, lunar.randn(6, 3)}) end, 'gemm_grouped: product 2')
    T.raises(function() ops.gemm_grouped({a, a}, {b, lunar.randn(6, 3)}, {out = {lunar.zeros(4, 3), lunar.zeros(4, 3)}}) end,
        'inner dims differ')
    T.raises(function() ops.gemm_grouped({a}, {b, b}, {out = {lunar.zeros(4, 3)}}) end, 'b has 2 tensors')
    local dead = lunar.randn(5, 3)
    dead:free()
    T.raises(function() ops.gemm_grouped({a}, {dead}, {out = {lunar.zeros(4, 3)}}) end, 'free')
end)

os.exit(T:run())
