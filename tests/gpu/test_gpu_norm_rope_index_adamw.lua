-- test_gpu_norm_rope_index_adamw.lua: the CUDA norm, rope, index and adamw kernels against the
-- CPU backend (the reference) on the same input values. Skipped (exit 77) without a CUDA device.
--
-- Tolerances: f32 norms rtol/atol 1e-5 (block tree sums vs f32 lanes + f64, rsqrtf within 2 ulp),
-- parameter gradients rtol/atol 1e-4 (f32 partial sums vs f64 columns); rope f32 rtol/atol 1e-5;
-- gathers exact; accumulating index ops rtol/atol 1e-5 (embedding_backward uses atomics);
-- AdamW exact (both backends run kernels/adamw_math.h, every operation rounded alike);
-- bf16/f16 results rtol 2e-2, atol 2e-2 (RMSNorm on CUDA rounds x * rstd to the input dtype
-- before the weight, as HF does; the CPU rounds once).
local lunar = require 'lunar'
require('lunar.testing').require_cuda()
local T = require('lunar.testing').suite('gpu.norm_rope_index_adamw')
local ops = lunar.ops

lunar.manual_seed(23)

local LOW = {rtol = 2e-2, atol = 2e-2}
local function tol(dt, f32tol, msg)
    local t = dt == 'f32' and f32tol or LOW
    return {rtol = t.rtol, atol = t.atol, msg = msg}
end

local function pair(x, dt)
    local c = dt and x:to(dt) or x
    return c, c:to('cuda')
end

T:test('rmsnorm / layernorm forward, backward_input, backward_params', function()
    for _, dt in ipairs({'f32', 'bf16', 'f16'}) do
        for _, s in ipairs({{1, 1}, {3, 17}, {17, 1000}, {1000, 3}, {300, 6144}}) do
            local n, c = s[1], s[2]
            local msg = ('%s %dx%d'):format(dt, n, c)
            local xc, xg = pair(lunar.randn(n, c), dt)
            local wc, wg = pair(lunar.randn(c), dt)
            local bc, bg = pair(lunar.randn(c), dt)
            local dc, dg = pair(lunar.randn(n, c), dt)
            local oc, rc = ops.rmsnorm(xc, wc, 1e-6)
            local og, rg = ops.rmsnorm(xg, wg, 1e-6)
            T.close(og:cpu(), oc, tol(dt, {rtol = 1e-5, atol = 1e-5}, msg .. ' rmsnorm'))
            T.close(rg:cpu(), rc, {rtol = 1e-5, atol = 1e-6, msg = msg .. ' rstd'})
            T.close(ops.rmsnorm_backward(dg, xg, wg, rg):cpu(), ops.rmsnorm_backward(dc, xc, wc, rc),
                tol(dt, {rtol = 1e-4, atol = 1e-4}, msg .. ' rmsnorm dx'))
            local dwc, dwg = lunar.zeros(c), lunar.zeros(c, {device = 'cuda'})   -- f32 accumulators
            ops.rmsnorm_backward_params(dwc, dc, xc, rc)
            ops.rmsnorm_backward_params(dwg, dg, xg, rg)
            T.close(dwg:cpu(), dwc, {rtol = 1e-4, atol = 1e-3, msg = msg .. ' rmsnorm dw'})
            local loc, mc, lrc = ops.layernorm(xc, wc, bc, 1e-5)
            local log, mg, lrg = ops.layernorm(xg, wg, bg, 1e-5)
            T.close(log:cpu(), loc, tol(dt, {rtol = 1e-5, atol = 1e-5}, msg .. ' layernorm'))
            T.close(mg:cpu(), mc, {rtol = 1e-5, atol = 1e-6, msg = msg .. ' mean'})
            T.close(ops.layernorm_backward(dg, xg, wg, mg, lrg):cpu(), ops.layernorm_backward(dc, xc, wc, mc, lrc),
                tol(dt, {rtol = 1e-4, atol = 1e-4}, msg .. ' layernorm dx'))
            local lwc, lbc = ops.layernorm_backward_params(lunar.zeros(c), lunar.zeros(c), dc, xc, mc, lrc)
            local lwg, lbg = ops.layernorm_backward_params(lunar.zeros(c, {device = 'cuda'}),
                lunar.zeros(c, {device = 'cuda'}), dg, xg, mg, lrg)
            T.close(lwg:cpu(), lwc, {rtol = 1e-4, atol = 1e-3, msg = msg .. ' layernorm dw'})
            T.close(lbg:cpu(), lbc, {rtol = 1e-4, atol = 1e-3, msg = msg .. ' layernorm db'})
        end
    end
    -- no weight, strided input
    local xc, xg = pair(lunar.randn(40, 17):t())
    T.close(ops.rmsnorm(xg, nil, 1e-5):cpu(), ops.rmsnorm(xc, nil, 1e-5), {rtol = 1e-5, atol = 1e-5})
end)

T:test('rope: every layout, partial rotary, scale, forward and backward', function()
    for _, dt in ipairs({'f32', 'bf16'}) do
        for _, s in ipairs({{1, 1, 2, 2}, {17, 3, 16, 8}, {1000, 2, 64, 64}, {5, 4, 192, 64}}) do
            local tn, hn, d, r = s[1], s[2], s[3], s[4]
            local xc, xg = pair(lunar.randn(tn, hn, d), dt)
            local pc, pg = pair(lunar.randint(0, 200000, {tn}, 'i64'))
            local fc, fg = pair(ops.rope_inv_freq(r, 10000))
            for _, layout in ipairs({'half', 'interleaved', 'interleaved_to_half'}) do
                local opts = {layout = layout, scale = 0.8}
                local msg = ('%s %s T%d H%d D%d R%d'):format(dt, layout, tn, hn, d, r)
                T.close(ops.rope(xg, pg, fg, opts):cpu(), ops.rope(xc, pc, fc, opts),
                    tol(dt, {rtol = 1e-5, atol = 1e-5}, msg))
                T.close(ops.rope_backward(xg, pg, fg, opts):cpu(), ops.rope_backward(xc, pc, fc, opts),
                    tol(dt, {rtol = 1e-5, atol = 1e-5}, msg .. ' backward'))
            end
        end
    end
end)

T:test('embedding, index_select, index_add_, gather, scatter_, scatter_add_', function()
    for _, dt in ipairs({'f32', 'bf16'}) do
        local v, c, n = 1000, 17, 300
        local wc, wg = pair(lunar.randn(v, c), dt)
        local ic, ig = pair(lunar.randint(0, v, {n}, 'i64'))
        T.equal(ops.embedding(ig, wg):cpu(), ops.embedding(ic, wc), dt .. ' embedding')
        local dc, dg = pair(lunar.randn(n, c), dt)
        local ec = ops.embedding_backward(lunar.zeros(v, c):to(dt), dc, ic)
        local eg = ops.embedding_backward(lunar.zeros(v, c):to(dt):to('cuda'), dg, ig)
        T.close(eg:cpu(), ec, tol(dt, {rtol = 1e-5, atol = 1e-5}, dt .. ' embedding_backward'))
        local sc, sg = pair(lunar.randn(3, 1000, 5), dt)
        local kc, kg = pair(lunar.randint(0, 1000, {17}, 'i64'))
        T.equal(ops.index_select(sg, 2, kg):cpu(), ops.index_select(sc, 2, kc), dt .. ' index_select')
        local ac, ag = pair(lunar.randn(3, 17, 5), dt)
        local tc = lunar.zeros(3, 1000, 5):to(dt):index_add_(2, kc, ac, {alpha = 0.5})
        local tg = lunar.zeros(3, 1000, 5):to(dt):to('cuda'):index_add_(2, kg, ag, {alpha = 0.5})
        T.close(tg:cpu(), tc, tol(dt, {rtol = 1e-5, atol = 1e-5}, dt .. ' index_add_'))
        local gc, gg = pair(lunar.randint(0, 1000, {3, 40, 5}, 'i64'))
        T.equal(ops.gather(sg, 2, gg):cpu(), ops.gather(sc, 2, gc), dt .. ' gather')
        local uc, ug = pair(lunar.randn(3, 40, 5), dt)
        for _, acc in ipairs({false, true}) do
            local zc = lunar.zeros(3, 1000, 5):to(dt)
            local zg = zc:to('cuda')
            if acc then zc:scatter_add_(2, gc, uc); zg:scatter_add_(2, gg, ug)
            else zc:scatter_(2, gc, uc); zg:scatter_(2, gg, ug) end
            T.close(zg:cpu(), zc, tol(dt, {rtol = 1e-5, atol = 1e-5}, dt .. (acc and ' scatter_add_' or ' scatter_')))
        end
    end
    -- out-of-range values are caught on the device and raised at the next check point
    -- (tests/gpu/test_gpu_device_checks.lua has the details)
    local w = lunar.randn(10, 4):to('cuda')
    local function checked(fn) return function() fn(); lunar.sync_check('cuda') end end
    T.raises(checked(function() ops.embedding(lunar.tensor({1, 10}, 'i64'):to('cuda'), w) end), 'embedding_forward: index 10')
    T.raises(checked(function() ops.gather(w, 1, lunar.tensor({{0}, {-1}}, 'i64'):to('cuda')) end), 'gather: index -1')
    T.raises(checked(function() lunar.zeros(3):to('cuda'):scatter_add_(1, lunar.tensor({5}, 'i64'):to('cuda'),
        lunar.ones(1):to('cuda')) end), 'scatter_add: index 5')
end)

T:test('adamw: f32 param, bf16 param with f32 master and bf16 grad', function()
    local n = 100000
    local pc, pg = pair(lunar.randn(n))
    local mc, mg = pair(lunar.zeros(n))
    local vc, vg = pair(lunar.zeros(n))
    for step = 1, 5 do
        local gc, gg = pair(lunar.randn(n))
        local opts = {lr = 1e-2, step = step, weight_decay = 0.1, beta2 = 0.95, grad_scale = 0.5}
        ops.adamw_step(pc, gc, mc, vc, opts)
        ops.adamw_step(pg, gg, mg, vg, opts)
    end
    T.equal(pg:cpu(), pc, 'f32 param')
    T.equal(mg:cpu(), mc, 'm')
    T.equal(vg:cpu(), vc, 'v')
    local master = lunar.randn(n)
    local bc, bgpu = pair(master:bf16())
    local msc, mgpu = pair(master:clone())
    local m2c, m2g = pair(lunar.zeros(n))
    local v2c, v2g = pair(lunar.zeros(n))
    local gc, gg = pair(lunar.randn(n), 'bf16')
    ops.adamw_step(bc, gc, m2c, v2c, {lr = 1e-2, step = 1, master = msc})
    ops.adamw_step(bgpu, gg, m2g, v2g, {lr = 1e-2, step = 1, master = mgpu})
    T.equal(mgpu:cpu(), msc, 'master')
    T.equal(m2g:cpu(), m2c, 'm with a bf16 grad')
    T.equal(bgpu:cpu(), bc, 'bf16 param')
    T.equal(bgpu:cpu(), mgpu:cpu():bf16(), 'param = bf16(master)')
end)

os.exit(T:run())
