-- test_gpu_gemm_elementwise.lua: the CUDA gemm (cuBLAS) and elementwise kernels against the CPU
-- backend (the reference), on the same input values. Skipped (exit 77) without a CUDA device.
--
-- Tolerances: f32 gemm rtol/atol 1e-4 (both accumulate in f32, in different orders; cuBLAS
-- COMPUTE_32F does not use TF32); f32 elementwise rtol 1e-5, atol 1e-6 (CUDA libm is within 2
-- ulp); bf16/f16 results rtol 1e-2, atol 1e-3 (one low-precision rounding apart at most, the CPU
-- computes in f32 from the same rounded inputs).
local lunar = require 'lunar'
require('lunar.testing').require_cuda()
local T = require('lunar.testing').suite('gpu.gemm_elementwise')
local ops = lunar.ops

lunar.manual_seed(11)

local LOW = {rtol = 1e-2, atol = 1e-3}
local function tol_for(dt, f32tol) return dt == 'f32' and f32tol or LOW end
local function with_msg(t, msg) return {rtol = t.rtol, atol = t.atol, msg = msg} end

-- a tensor of dtype dt on cuda and the same values on the cpu
local function pair(x, dt)
    local c = x:to(dt)
    return c, c:to('cuda')
end

T:test('gemm: f32/bf16/f16 inputs, trans flags, views, batches, beta, c dtypes', function()
    for _, dt in ipairs({'f32', 'bf16', 'f16'}) do
        local tol = tol_for(dt, {rtol = 1e-4, atol = 1e-4})
        for _, s in ipairs({{1, 1, 1}, {3, 17, 5}, {17, 1000, 3}, {128, 64, 96}}) do
            local m, k, n = s[1], s[2], s[3]
            for _, ta in ipairs({false, true}) do
                for _, tb in ipairs({false, true}) do
                    local ac, ag = pair(ta and lunar.randn(k, m) or lunar.randn(m, k), dt)
                    local bc, bg = pair(tb and lunar.randn(n, k) or lunar.randn(k, n), dt)
                    local opts = {trans_a = ta, trans_b = tb}
                    local msg = ('%s %dx%dx%d ta=%s tb=%s'):format(dt, m, k, n, tostring(ta), tostring(tb))
                    T.close(ops.gemm(ag, bg, opts):cpu(), ops.gemm(ac, bc, opts), with_msg(tol, msg))
                    -- transposed views instead of flags
                    local vg = ops.gemm(ta and ag:t() or ag, tb and bg:t() or bg)
                    T.close(vg:cpu(), ops.gemm(ac, bc, opts), with_msg(tol, msg .. ' views'))
                end
            end
            -- f32 out with low-precision inputs, accumulation, a transposed out
            local ac, ag = pair(lunar.randn(m, k), dt)
            local bc, bg = pair(lunar.randn(k, n), dt)
            local c0 = lunar.randn(n, m)
            local cc, cg = c0:clone():t(), c0:to('cuda'):t()
            ops.gemm(ac, bc, {out = cc, alpha = 0.5, beta = 2})
            ops.gemm(ag, bg, {out = cg, alpha = 0.5, beta = 2})
            T.close(cg:cpu(), cc, with_msg(tol, dt .. ' f32 transposed out with beta'))
        end
        -- batched: 3-D @ 3-D, 3-D @ shared 2-D (stacked rows), shared 2-D @ 3-D, stride-0 batch
        local a3c, a3g = pair(lunar.randn(4, 33, 17), dt)
        local b3c, b3g = pair(lunar.randn(4, 17, 9), dt)
        local b2c, b2g = pair(lunar.randn(17, 9), dt)
        local a2c, a2g = pair(lunar.randn(33, 17), dt)
        T.close(ops.gemm(a3g, b3g):cpu(), ops.gemm(a3c, b3c), with_msg(tol, dt .. ' batched'))
        T.close(ops.gemm(a3g, b2g):cpu(), ops.gemm(a3c, b2c), with_msg(tol, dt .. ' shared b'))
        T.close(ops.gemm(a2g, b3g):cpu(), ops.gemm(a2c, b3c), with_msg(tol, dt .. ' shared a'))
        local ec, eg = a2c:view(1, 33, 17):expand(4, 33, 17), a2g:view(1, 33, 17):expand(4, 33, 17)
        T.close(ops.gemm(eg, b3g):cpu(), ops.gemm(ec, b3c), with_msg(tol, dt .. ' stride-0 batch'))
        local pc, pg = a3c:transpose(2, 3), a3g:transpose(2, 3)
        T.close(ops.gemm(pg, b2g, {trans_a = true}):cpu(), ops.gemm(pc, b2c, {trans_a = true}),
            with_msg(tol, dt .. ' batched transposed views'))
    end
end)

local binary_names = {'add', 'sub', 'mul', 'div', 'maximum', 'minimum', 'pow'}
local compare_names = {'eq', 'ne', 'lt', 'le', 'gt', 'ge'}
local unary_names = {'neg', 'abs', 'exp', 'log', 'sqrt', 'rsqrt', 'reciprocal', 'square', 'tanh', 'sigmoid', 'silu',
                     'gelu', 'gelu_tanh', 'relu', 'sin', 'cos'}
local positive = {log = true, sqrt = true, rsqrt = true, reciprocal = true, pow = true}

T:test('binary, scalar and comparison ops with broadcasting, every float dtype', function()
    for _, dt in ipairs({'f32', 'bf16', 'f16'}) do
        local tol = tol_for(dt, {rtol = 1e-5, atol = 1e-6})
        for _, sp in ipairs({{{3, 17}, {17}}, {{1000}, {1000}}, {{3, 1}, {1, 17}}, {{40000}, {1}}}) do
            local x = lunar.randn(sp[1])
            local ac, ag = pair(x, dt)
            local pc, pg = pair(ops.abs(x) + 0.5, dt)
            local bc, bg = pair(lunar.randn(sp[2]), dt)
            for _, name in ipairs(binary_names) do
                local l, lg = ac, ag
                if positive[name] then l, lg = pc, pg end
                T.close(ops[name](lg, bg):cpu(), ops[name](l, bc), with_msg(tol, dt .. ' ' .. name))
                T.close(ops[name](lg, 1.5):cpu(), ops[name](l, 1.5), with_msg(tol, dt .. ' ' .. name .. ' scalar'))
                if name ~= 'pow' then
                    T.close(ops[name](2.5, lg):cpu(), ops[name](2.5, l), with_msg(tol, dt .. ' scalar ' .. name))
                end
            end
            local ic, ig = pair(lunar.randint(-2, 3, sp[1]):float(), dt)
            local jc, jg = pair(lunar.randint(-2, 3, sp[2]):float(), dt)
            for _, name in ipairs(compare_names) do
                T.equal(ops[name](ig, jg):cpu():float(), ops[name](ic, jc):float(), dt .. ' ' .. name)
                T.equal(ops[name](ig, 0):cpu():float(), ops[name](ic, 0):float(), dt .. ' ' .. name .. ' scalar')
                T.equal(ops[name](ig, jg, {dtype = dt}):cpu():float(), ops[name](ic, jc):float(),
                    dt .. ' ' .. name .. ' float out')
            end
            -- in place (same shapes)
            local cc, cg = ac:clone(), ag:clone()
            cc:add_(pc)
            cg:add_(pg)
            T.close(cg:cpu(), cc, with_msg(tol, dt .. ' add_'))
        end
    end
end)

T:test('unary ops and their backward, swiglu, masked_fill, every float dtype', function()
    for _, dt in ipairs({'f32', 'bf16', 'f16'}) do
        local tol = tol_for(dt, {rtol = 1e-5, atol = 1e-6})
        for _, n in ipairs({1, 17, 1000, 70000}) do
            local x = lunar.randn(n) * 2
            for _, name in ipairs(unary_names) do
                local xc, xg = pair(positive[name] and ops.abs(x) + 0.3 or x, dt)
                local dyc, dyg = pair(lunar.randn(n), dt)
                T.close(ops[name](xg):cpu(), ops[name](xc), with_msg(tol, dt .. ' ' .. name))
                T.close(ops[name .. '_backward'](dyg, xg):cpu(), ops[name .. '_backward'](dyc, xc),
                    with_msg(tol, dt .. ' ' .. name .. '_backward'))
            end
            local gc, gg = pair(lunar.randn(n), dt)
            local uc, ug = pair(lunar.randn(n), dt)
            local dc, dg = pair(lunar.randn(n), dt)
            T.close(ops.swiglu(gg, ug):cpu(), ops.swiglu(gc, uc), with_msg(tol, dt .. ' swiglu'))
            local c1, c2 = ops.swiglu_backward(dc, gc, uc)
            local g1, g2 = ops.swiglu_backward(dg, gg, ug)
            T.close(g1:cpu(), c1, with_msg(tol, dt .. ' swiglu dgate'))
            T.close(g2:cpu(), c2, with_msg(tol, dt .. ' swiglu dup'))
            local mc = lunar.randint(0, 2, {n}):to('bool')
            T.equal(ops.masked_fill(gg, mc:to('cuda'), -1e4):cpu():float(), ops.masked_fill(gc, mc, -1e4):float(),
                dt .. ' masked_fill')
        end
    end
end)

os.exit(T:run())
