-- test_ops_adamw.lua: AdamW steps against a plain-Lua f64 reference of torch.optim.AdamW's math
-- (10 steps), against a torch fixture (tests/fixtures/adamw_torch.json, made by
-- tests/fixtures/make_rope_adamw.py), with f32 / bf16+master params and strided tensors.
--
-- Tolerances: vs the f64 reference after 10 steps rtol 1e-5, atol 1e-6 (the kernel runs in f32);
-- vs torch: m and v bit for bit (same f32 operations, lerp and addcmul as FMAs), params within
-- 2 ulps (rtol 2.5e-7: torch's vectorised CPU sqrt is not correctly rounded, ours is);
-- a bf16 param must equal the bf16 rounding of its f32 master exactly.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.adamw')

lunar.manual_seed(99)

local function read_json(name)
    local dir = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
    local f = assert(io.open(dir .. '/../fixtures/' .. name, 'r'))
    local s = f:read('*a')
    f:close()
    -- our fixtures hold only objects, arrays, numbers and plain strings
    s = s:gsub('%[', '{'):gsub('%]', '}'):gsub('"([%w_]+)"%s*:', '["%1"]=')
    return assert(loadstring('return ' .. s))()
end

-- one step of the reference on Lua lists (in place)
local function ref_step(p, g, m, v, hp)
    local lr, b1, b2, eps, wd, t = hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.step
    local gs = hp.grad_scale or 1
    local bc1, bc2 = 1 - b1 ^ t, 1 - b2 ^ t
    for i = 1, #p do
        local gi = g[i] * gs
        p[i] = p[i] * (1 - lr * wd)
        m[i] = b1 * m[i] + (1 - b1) * gi
        v[i] = b2 * v[i] + (1 - b2) * gi * gi
        p[i] = p[i] - lr / bc1 * m[i] / (math.sqrt(v[i]) / math.sqrt(bc2) + eps)
    end
end

local HP = {
    {lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01},
    {lr = 3e-2, beta1 = 0.9, beta2 = 0.95, eps = 1e-6, weight_decay = 0.1, grad_scale = 0.37},
    {lr = 1e-1, beta1 = 0.5, beta2 = 0.9, eps = 1e-8, weight_decay = 0},
}

T:test('10 steps match the f64 reference (f32 params, sizes 1, 3, 17, 1000)', function()
    for _, shape in ipairs({{1}, {3}, {17}, {1000}, {3, 17}}) do
        for hi, hp in ipairs(HP) do
            local p = lunar.randn(shape)
            local m, v = lunar.zeros(shape), lunar.zeros(shape)
            local rp, rm, rv = p:tolist_flat(), m:tolist_flat(), v:tolist_flat()
            for step = 1, 10 do
                local g = lunar.randn(shape)
                local opts = {lr = hp.lr, beta1 = hp.beta1, beta2 = hp.beta2, eps = hp.eps,
                              weight_decay = hp.weight_decay, grad_scale = hp.grad_scale, step = step}
                local ret = ops.adamw_step(p, g, m, v, opts)
                assert(ret == p)
                ref_step(rp, g:tolist_flat(), rm, rv, opts)
            end
            local what = ('shape %s hp %d'):format(table.concat(shape, 'x'), hi)
            T.close(p, rp, {rtol = 1e-5, atol = 1e-6, msg = what .. ' param'})
            T.close(m, rm, {rtol = 1e-5, atol = 1e-7, msg = what .. ' m'})
            T.close(v, rv, {rtol = 1e-5, atol = 1e-9, msg = what .. ' v'})
        end
    end
end)

T:test('defaults: beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0.01, grad_scale 1', function()
    local p = lunar.randn(17)
    local g = lunar.randn(17)
    local q = p:clone()
    local m1, v1, m2, v2 = lunar.zeros(17), lunar.zeros(17), lunar.zeros(17), lunar.zeros(17)
    ops.adamw_step(p, g, m1, v1, {lr = 0.01, step = 1})
    ops.adamw_step(q, g, m2, v2, {lr = 0.01, step = 1, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01,
                                  grad_scale = 1})
    T.equal(p, q, 'explicit defaults')
end)

T:test('matches torch.optim.AdamW step by step (fixture)', function()
    for ci, c in ipairs(read_json('adamw_torch.json').cases) do
        local p = lunar.tensor(c.param0)
        local m, v = lunar.zeros(c.n), lunar.zeros(c.n)
        for step = 1, #c.grads do
            ops.adamw_step(p, lunar.tensor(c.grads[step]), m, v, {lr = c.lr, beta1 = c.beta1, beta2 = c.beta2,
                eps = c.eps, weight_decay = c.weight_decay, grad_scale = c.grad_scale, step = step})
            T.close(p, c.params[step], {rtol = 2.5e-7, atol = 1e-9, msg = ('case %d step %d'):format(ci, step)})
            -- continue from torch's values, so that one-ulp differences do not compound
            p = lunar.tensor(c.params[step])
        end
        T.equal(m, c.m, ('case %d m'):format(ci))
        T.equal(v, c.v, ('case %d v'):format(ci))
    end
end)

T:test('bf16 param with an f32 master: master follows the f32 update, param is its rounding', function()
    local n = 1000
    local p32 = lunar.randn(n)
    local master = p32:clone()
    local param = p32:bf16()
    local m, v = lunar.zeros(n), lunar.zeros(n)
    local mf, vf = lunar.zeros(n), lunar.zeros(n)
    for step = 1, 10 do
        local g = lunar.randn(n)
        local gb = g:bf16()
        local opts = {lr = 1e-2, step = step, weight_decay = 0.1, master = master}
        ops.adamw_step(param, gb, m, v, opts)
        -- the same step on an f32 param with the same (bf16-valued) gradient
        ops.adamw_step(p32, gb:float(), mf, vf, {lr = 1e-2, step = step, weight_decay = 0.1})
        assert(param:dtype() == 'bf16')
        T.equal(param, master:bf16(), 'param = bf16(master) at step ' .. step)
    end
    T.equal(master, p32, 'master = the f32 update')
    T.equal(m, mf, 'm')
    -- an f32 param with a master copy ends up equal to it
    local p2, ms2 = lunar.randn(5), nil
    ms2 = p2:clone()
    ops.adamw_step(p2, lunar.randn(5), lunar.zeros(5), lunar.zeros(5), {lr = 0.1, step = 1, master = ms2})
    T.equal(p2, ms2, 'f32 param = master')
end)

T:test('strided param, grad and state are updated in place', function()
    local rows, cols = 17, 3
    local pbig = lunar.randn(cols, rows)
    local p = pbig:t()                               -- (17, 3) transposed view
    local g = lunar.randn(rows, 2 * cols):narrow(2, 1, cols)
    local mbig, vbig = lunar.zeros(rows, cols, 2), lunar.zeros(rows, cols, 2)
    local m, v = mbig:select(3, 1), vbig:select(3, 2)
    local rp, rm, rv = p:tolist_flat(), m:tolist_flat(), v:tolist_flat()
    local opts = {lr = 0.05, step = 1, weight_decay = 0.1}
    ops.adamw_step(p, g, m, v, opts)
    ref_step(rp, g:tolist_flat(), rm, rv, {lr = 0.05, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.1, step = 1})
    T.close(pbig:t(), rp, {rtol = 1e-5, atol = 1e-6, msg = 'param written through the view'})
    T.close(m, rm, {rtol = 1e-5, atol = 1e-7})
    T.close(v, rv, {rtol = 1e-5, atol = 1e-9})
    T.equal(mbig:select(3, 2), lunar.zeros(rows, cols), 'untouched half of the m buffer')
end)

T:test('bad arguments are reported', function()
    local p = lunar.randn(4)
    p:set_name('w')
    local g, m, v = lunar.randn(4), lunar.zeros(4), lunar.zeros(4)
    T.raises(function() ops.adamw_step(p:bf16(), g, m, v, {lr = 1, step = 1}) end,
        'is bf16: pass an f32 master copy (master=) or use an f32 param')
    T.raises(function() ops.adamw_step(p, g, m:bf16(), v, {lr = 1, step = 1}) end, "m 'tensor' must be f32, not bf16")
    T.raises(function() ops.adamw_step(p, lunar.randn(5), m, v, {lr = 1, step = 1}) end,
        "grad 'tensor' has shape (5), expected (4)")
    T.raises(function() ops.adamw_step(p, g, m, lunar.zeros(2, 2), {lr = 1, step = 1}) end, "v 'tensor' has shape (2, 2)")
    T.raises(function() ops.adamw_step(p, g, m, v, {lr = 1, step = 1, master = lunar.zeros(3)}) end, 'master')
    T.raises(function() ops.adamw_step(p, g, m, v, {lr = 1, step = 0}) end, 'step must be an integer >= 1')
    T.raises(function() ops.adamw_step(p, g, m, v, {step = 1}) end, 'opts.lr (a number) is required')
    T.raises(function() ops.adamw_step(p, g, m, v, {lr = 1, step = 1, beta2 = 1}) end, 'betas must be in [0, 1)')
    T.raises(function() ops.adamw_step(p, lunar.zeros(4, 'i32'), m, v, {lr = 1, step = 1}) end, 'must be a float tensor')
end)

os.exit(T:run())
