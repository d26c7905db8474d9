-- test_gpu_gemm_row_invariant.lua: the row-invariant products (ops.gemm / gemm_grouped with
-- row_invariant = true, kernels/cuda/gemm_row_invariant.cu) on CUDA:
--   * f32 within the error bound of the device's order against f64 (trans_b: 32 lanes of K/32
--     terms and a 5-level butterfly, (K/32 + 6) u sum |a b|; not trans_b: one sum of K terms,
--     (K + 2) u sum |a b|), and the CPU's result within rtol 1e-4, atol 1e-4 sqrt(K); bf16 and
--     f16 inputs against the CPU on the same rounded values (one rounding of the result apart);
--   * row invariance on the device, bit for bit: a row alone, among 1 .. M rows, grouped with
--     other products (more than one launch's worth), batched, in both forms, at shapes past the
--     kernels' edges (rows past a group of 4, K not a multiple of 32, N past a block).
-- Skipped (77) without a CUDA device; LUNAR_GPU_DRY_RUN=1 runs it with the CPU standing in.
local testing = require 'lunar.testing'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
if not DRY then testing.require_cuda() end
local GPU = DRY and 'cpu' or 'cuda:0'
local lunar = require 'lunar'
local ops = lunar.ops
local T = testing.suite('gpu.gemm_row_invariant (on ' .. GPU .. ')')

lunar.manual_seed(29)

local U = 1.2e-7
local SHAPES = {{1, 1, 1}, {3, 7, 13}, {4, 256, 512}, {5, 130, 64}, {9, 300, 33}, {17, 9, 1408}, {64, 64, 256}}

local function ri(a, b, tb, o)
    o = o or {}
    o.trans_b, o.row_invariant = tb, true
    return ops.gemm(a, b, o)
end

-- the largest amount by which |c - a op(b)| exceeds factor * u * (|a| op(|b|)), in f64 on the CPU
local function over_bound(c, a, b, tb, factor)
    local a64, b64 = a:to('cpu'):to('f64'), b:to('cpu'):to('f64')
    local ref = ops.gemm(a64, b64, {trans_b = tb})
    local mag = ops.gemm(ops.abs(a64), ops.abs(b64), {trans_b = tb})
    local err = ops.abs(ops.sub(c:to('cpu'):to('f64'), ref))
    return ops.max(ops.sub(err, ops.mul(mag, factor * U))):item()
end

T:test('f32 within the bound of its order, bf16 and f16 against the CPU', function()
    for _, tb in ipairs({true, false}) do
        for _, s in ipairs(SHAPES) do
            local M, N, K = s[1], s[2], s[3]
            local a = lunar.randn(M, K)
            local b = tb and lunar.randn(N, K) or lunar.randn(K, N)
            local what = ('trans_b %s %dx%dx%d'):format(tostring(tb), M, N, K)
            local cg = ri(a:to(GPU), b:to(GPU), tb)
            local factor = tb and (math.ceil(K / 32) + 6) or (K + 2)
            if DRY then factor = tb and (math.ceil(K / 8) + 4) or (K + 2) end
            local worst = over_bound(cg, a, b, tb, factor)
            assert(worst <= 0, ('%s: over the bound by %.3g'):format(what, worst))
            T.close(cg:to('cpu'), ri(a, b, tb), {rtol = 1e-4, atol = 1e-4 * math.sqrt(K), msg = what .. ' vs cpu'})
            for _, dt in ipairs({'bf16', 'f16'}) do
                local al, bl = a:to(dt), b:to(dt)
                local want = ri(al, bl, tb)
                T.close(ri(al:to(GPU), bl:to(GPU), tb):to('cpu'):float(), want:float(),
                    {rtol = 1e-2, atol = 1e-2, msg = what .. ' ' .. dt})
            end
        end
    end
end)

T:test('a row gets the same bits alone, among rows, grouped and batched', function()
    for _, tb in ipairs({true, false}) do
        for _, s in ipairs(SHAPES) do
            local M, N, K = s[1], s[2], s[3]
            local a = lunar.randn(M + 3, K):to(GPU):narrow(1, 2, M)
            local b = (tb and lunar.randn(N, K) or lunar.randn(K, N)):to(GPU)
            local what = ('trans_b %s %dx%dx%d'):format(tostring(tb), M, N, K)
            local c = ri(a, b, tb):to('cpu')
            for r = 1, M do T.equal(ri(a:narrow(1, r, 1), b, tb):to('cpu'), c:narrow(1, r, 1), what .. ' row ' .. r) end
            for first = 2, math.min(M, 4) do
                T.equal(ri(a:narrow(1, first, M - first + 1), b, tb):to('cpu'), c:narrow(1, first, M - first + 1),
                    what .. ' rows from ' .. first)
            end
            -- grouped: every row its own product, between products of other shapes (over 32 of
            -- them: several launches)
            local as, bs = {}, {}
            for r = 1, M do
                as[#as + 1], bs[#bs + 1] = a:narrow(1, r, 1), b
                as[#as + 1], bs[#bs + 1] = lunar.randn(1 + r % 5, K):to(GPU), b
            end
            for _ = #as, 34 do as[#as + 1], bs[#bs + 1] = lunar.randn(2, K):to(GPU), b end
            local cs = ops.gemm_grouped(as, bs, {trans_b = tb, row_invariant = true})
            for r = 1, M do T.equal(cs[2 * r - 1]:to('cpu'), c:narrow(1, r, 1), what .. ' grouped row ' .. r) end
            local a3 = a:contiguous():view(1, M, K):expand(3, M, K):contiguous()
            T.equal(ri(a3, b, tb):select(1, 3):to('cpu'), c, what .. ' batched')
        end
    end
end)

os.exit(T:run())
