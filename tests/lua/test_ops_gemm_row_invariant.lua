-- test_ops_gemm_row_invariant.lua: lunar.ops.gemm / gemm_grouped with row_invariant = true, the
-- products of generation's decode steps (lunar_gemm_row_invariant in lunar/ops.h):
--   * against an f64 reference within the error bound of its summation order (trans_b: 8 lanes
--     of K/8 terms and a 3-level tree, |err| <= (K/8 + 4) u sum |a b|; not trans_b: one sum of K
--     terms, (K + 2) u sum |a b|; u = 2^-23 with a margin);
--   * row invariance, bit for bit: each row computed alone (a 1-row product), among many rows at
--     any place, in a product grouped with others, batched (3-D), with 1 and 2 threads, gives
--     the same bits, at shapes that cover the kernels' edges (rows past a tile, K not a multiple
--     of 8, columns past a tile) in both forms (b (N, K) transposed, b (K, N));
--   * views (narrowed rows, a transposed a that is copied, strided heads), alpha and beta, bf16;
--   * errors name the product and the reason.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.gemm_row_invariant')

lunar.manual_seed(23)

local U = 1.2e-7

-- |c - a op(b)| <= bound elementwise, the reference and the bound in f64
local function check_bound(c, a, b, tb, msg)
    local K = a:size(a:dim())
    local a64, b64 = a:to('f64'), b:to('f64')
    local ref = ops.gemm(a64, b64, {trans_b = tb})
    local mag = ops.gemm(ops.abs(a64), ops.abs(b64), {trans_b = tb})
    local factor = tb and (math.ceil(K / 8) + 4) or (K + 2)
    local err = ops.abs(ops.sub(c:to('f64'), ref))
    local over = ops.sub(err, ops.add(ops.mul(mag, factor * U), 1e-30))
    local worst = ops.max(over):item()
    if worst > 0 then error(('%s: error over the bound by %.3g'):format(msg, worst), 2) end
end

local SHAPES = {{1, 1, 1}, {1, 5, 3}, {3, 7, 13}, {4, 256, 512}, {5, 130, 64}, {7, 17, 9}, {13, 48, 33},
                {19, 100, 200}, {40, 8, 1408}}

T:test('within the error bound of the fixed order, both forms', function()
    for _, tb in ipairs({true, false}) do
        for _, s in ipairs(SHAPES) do
            local M, N, K = s[1], s[2], s[3]
            local a = lunar.randn(M, K)
            local b = tb and lunar.randn(N, K) or lunar.randn(K, N)
            local c = ops.gemm(a, b, {trans_b = tb, row_invariant = true})
            T.equal(c:size(), {M, N}, 'shape')
            check_bound(c, a, b, tb, ('trans_b %s %dx%dx%d'):format(tostring(tb), M, N, K))
        end
    end
end)

T:test('a row gets the same bits alone, among rows, grouped, batched, with 1 or 2 threads', function()
    local saved = lunar.threads()
    for _, tb in ipairs({true, false}) do
        for _, s in ipairs(SHAPES) do
            local M, N, K = s[1], s[2], s[3]
            local big = lunar.randn(M + 5, K)
            local a = big:narrow(1, 3, M)                 -- rows of a bigger tensor, as the MoE's
            local b = tb and lunar.randn(N, K) or lunar.randn(K, N)
            local what = ('trans_b %s %dx%dx%d'):format(tostring(tb), M, N, K)
            lunar.threads(2)
            local c = ops.gemm(a, b, {trans_b = tb, row_invariant = true})
            -- every row alone, and every row in a product of 1 .. M rows at every place
            for r = 1, M do
                local alone = ops.gemm(a:narrow(1, r, 1), b, {trans_b = tb, row_invariant = true})
                T.equal(alone, c:narrow(1, r, 1), what .. ' row ' .. r .. ' alone')
            end
            for first = 1, math.min(M, 3) do
                local n = M - first + 1
                local part = ops.gemm(a:narrow(1, first, n), b, {trans_b = tb, row_invariant = true})
                T.equal(part, c:narrow(1, first, n), what .. ' rows from ' .. first)
            end
            -- one thread
            lunar.threads(1)
            T.equal(ops.gemm(a, b, {trans_b = tb, row_invariant = true}), c, what .. ' one thread')
            lunar.threads(2)
            -- grouped with other products, each row block of a as its own product
            local as, bs = {}, {}
            for r = 1, M do as[#as + 1], bs[#bs + 1] = a:narrow(1, r, 1), b end
            as[#as + 1], bs[#bs + 1] = lunar.randn(3, K), b
            as[#as + 1], bs[#bs + 1] = a, b
            local cs = ops.gemm_grouped(as, bs, {trans_b = tb, row_invariant = true})
            for r = 1, M do T.equal(cs[r], c:narrow(1, r, 1), what .. ' grouped row ' .. r) end
            T.equal(cs[#cs], c, what .. ' grouped whole')
            -- batched: the same a in every batch, b shared (2-D) and per batch (3-D)
            local a3 = a:view(1, M, K):expand(3, M, K):contiguous()
            T.equal(ops.gemm(a3, b, {trans_b = tb, row_invariant = true}):select(1, 2), c, what .. ' batched')
            local b3 = b:view(1, b:size(1), b:size(2)):expand(2, b:size(1), b:size(2)):contiguous()
            T.equal(ops.gemm(a3:narrow(1, 1, 2), b3, {trans_b = tb, row_invariant = true}):select(1, 2), c,
                what .. ' batched b')
        end
    end
    lunar.threads(saved)
end)

T:test('views, alpha and beta, out, bf16', function()
    -- heads of a (B, NH, D) tensor as a batched (NH, B, D) product, the decode step's form
    local q = lunar.randn(5, 4, 24)
    local W = lunar.randn(4, 24, 16)
    local qt = q:transpose(1, 2)
    local c = ops.gemm(qt, W, {row_invariant = true})
    check_bound(c, qt:contiguous(), W, false, 'strided heads')
    T.equal(c:select(1, 3), ops.gemm(q:select(2, 3), W:select(1, 3), {row_invariant = true}), 'a head alone')
    -- an a with no unit stride along K is copied: the same bits
    local at = lunar.randn(33, 6):t()
    local b = lunar.randn(10, 33)
    T.equal(ops.gemm(at, b, {trans_b = true, row_invariant = true}),
        ops.gemm(at:contiguous(), b, {trans_b = true, row_invariant = true}), 'transposed a')
    -- a transposed b view reads as the other form
    local bt = lunar.randn(33, 10)
    T.equal(ops.gemm(at, bt:t(), {trans_b = true, row_invariant = true}),
        ops.gemm(at, bt:t():contiguous(), {trans_b = true, row_invariant = true}), 'transposed b')
    -- alpha, beta into a given out (also a transposed one)
    local a2 = lunar.randn(6, 33)
    local plain = ops.gemm(a2, b, {trans_b = true, row_invariant = true})
    local c0 = lunar.randn(6, 10)
    local out = c0:clone()
    ops.gemm(a2, b, {trans_b = true, row_invariant = true, out = out, alpha = 0.5, beta = 2})
    T.close(out, ops.add(ops.mul(plain, 0.5), ops.mul(c0, 2)), {rtol = 1e-6, atol = 1e-6, msg = 'alpha, beta'})
    local ot = lunar.zeros(10, 6)
    ops.gemm(a2, b, {trans_b = true, row_invariant = true, out = ot:t()})
    T.equal(ot:t(), plain, 'transposed out')
    -- beta = 0 never reads out (NaN there stays out of the result)
    local nan = lunar.zeros(6, 10):fill_(0 / 0)
    ops.gemm(a2, b, {trans_b = true, row_invariant = true, out = nan})
    T.equal(nan, plain, 'beta 0 ignores out')
    -- bf16 inputs: computed in f32 from the rounded values, the result rounded once
    local cb = ops.gemm(a2:bf16(), b:bf16(), {trans_b = true, row_invariant = true})
    assert(cb:dtype() == 'bf16', 'bf16 result')
    T.equal(cb, ops.gemm(a2:bf16():float(), b:bf16():float(), {trans_b = true, row_invariant = true}):bf16(), 'bf16')
    -- empty products and K = 0
    T.equal(ops.gemm(lunar.randn(0, 4), lunar.randn(3, 4), {trans_b = true, row_invariant = true}):size(), {0, 3}, 'M 0')
    local k0 = lunar.randn(2, 3)
    ops.gemm(lunar.randn(2, 0), lunar.randn(3, 0), {trans_b = true, row_invariant = true, out = k0})
    T.equal(k0, lunar.zeros(2, 3), 'K 0')
end)

T:test('errors name the product', function()
    local a, b = lunar.randn(4, 5), lunar.randn(3, 5)
    T.raises(function() ops.gemm(a, b, {trans_a = true, row_invariant = true}) end, 'trans_a must be false')
    T.raises(function() ops.gemm(a, lunar.randn(3, 6), {trans_b = true, row_invariant = true}) end,
        'a and b have different K')
    T.raises(function()
        ops.gemm_grouped({a, a}, {b, lunar.randn(3, 6)}, {trans_b = true, row_invariant = true})
    end, 'product 2')
    T.raises(function()
        ops.gemm_grouped({a}, {b}, {trans_b = true, row_invariant = true, out = {lunar.zeros(4, 4)}})
    end, 'c is not (M, N)')
    T.raises(function()
        ops.gemm(lunar.randn(2, 4, 5), lunar.randn(3, 3, 5), {trans_b = true, row_invariant = true})
    end, 'batch sizes differ')
    T.raises(function()
        ops.gemm_grouped({a}, {b, b}, {trans_b = true, row_invariant = true, out = {lunar.zeros(4, 3)}})
    end, 'b has 2 tensors')
    local dead = lunar.randn(3, 5)
    dead:free()
    T.raises(function() ops.gemm(a, dead, {trans_b = true, row_invariant = true}) end, 'free')
end)

os.exit(T:run())
