-- test_gpu_reduce_softmax_sort.lua: the CUDA reduce, softmax/cross-entropy and sort kernels
-- against the CPU backend (the reference). Skipped (exit 77) without a CUDA device.
--
-- Tolerances: f32 rtol 1e-5 / atol 1e-5 (both backends sum in f64 for reductions, f32 trees for
-- softmax); bf16 outputs rtol 1e-2 (one bf16 rounding apart at most); sort and argmax results
-- must be identical (same total order on both backends).
local lunar = require 'lunar'
require('lunar.testing').require_cuda()
local T = require('lunar.testing').suite('gpu.reduce_softmax_sort')
local ops = lunar.ops

lunar.manual_seed(5)

local function both(fn, ...)
    local args_gpu = {}
    for i, a in ipairs({...}) do args_gpu[i] = lunar.is_tensor(a) and a:to('cuda') or a end
    local c = {fn(...)}
    local g = {fn(unpack(args_gpu))}
    for i = 1, #g do if lunar.is_tensor(g[i]) then g[i] = g[i]:to('cpu') end end
    return c, g
end

local function check(name, fn, tol, ...)
    local c, g = both(fn, ...)
    for i = 1, #c do
        if lunar.is_tensor(c[i]) then
            T.close(g[i], c[i], {rtol = tol, atol = tol, msg = name .. ' output ' .. i})
        else
            T.close(g[i], c[i], {rtol = tol, atol = tol, msg = name .. ' output ' .. i})
        end
    end
end

T:test('reductions over every dim, long rows, bf16', function()
    for _, shape in ipairs({{3, 17, 5}, {2, 100003}, {1000, 3}, {1, 1, 1}}) do
        local x = lunar.randn(shape)
        for _, op in ipairs({'sum', 'mean', 'max', 'min', 'norm'}) do
            check(op .. ' all', function(t) return ops[op](t) end, 1e-5, x)
            for d = 1, #shape do
                check(op .. ' dim ' .. d, function(t) return ops[op](t, d) end, 1e-5, x)
                local y = ops[op](x, d)
                local w = lunar.randn(y:size())
                check(op .. '_backward dim ' .. d, function(a, b, c) return ops[op .. '_backward'](a, b, c, d) end,
                    1e-5, w, x, y)
            end
        end
        for d = 1, #shape do
            check('max_dim ' .. d, function(t) return ops.max(t, d) end, 0, x)
            check('cumsum ' .. d, function(t) return ops.cumsum(t, d) end, 1e-5, x)
            check('cumsum_backward ' .. d, function(t) return ops.cumsum_backward(t, d) end, 1e-5, x)
        end
        check('bf16 sum', function(t) return ops.sum(t, 1) end, 1e-2, x:bf16())
    end
    check('global_norm', function(a, b, c) return ops.global_norm({a, b, c}, {tensor = true}) end, 1e-6,
        lunar.randn(1000, 7), lunar.randn(3):bf16(), lunar.randn(100001))
end)

T:test('softmax, log_softmax, cross-entropy (V = 1, 17, 1000, 50000), bf16', function()
    for _, v in ipairs({1, 17, 1000, 50000}) do
        local x = lunar.randn(5, v)
        check('softmax', ops.softmax, 1e-5, x)
        check('log_softmax', ops.log_softmax, 1e-5, x)
        local w = lunar.randn(5, v)
        check('softmax_backward', ops.softmax_backward, 1e-5, w, ops.softmax(x))
        check('log_softmax_backward', ops.log_softmax_backward, 1e-5, w, ops.log_softmax(x))
        local t = lunar.randint(0, v, {5})
        t:set(2, -100)
        check('cross_entropy', ops.cross_entropy, 1e-5, x, t)
        local _, _, lse = ops.cross_entropy(x, t)
        check('cross_entropy_backward', ops.cross_entropy_backward, 1e-5, lunar.randn(5), x, lse, t)
        check('entropy', ops.entropy, 1e-5, x, lse)
        check('bf16 softmax', ops.softmax, 1e-2, x:bf16())
    end
end)

T:test('topk, argsort, sort: identical to the CPU, small and long rows', function()
    for _, shape in ipairs({{4, 17}, {3, 4096}, {2, 5000}, {1, 70000}}) do
        local x = lunar.randint(-20, 20, shape):float()
        check('argsort', function(t) return ops.argsort(t) end, 0, x)
        check('argsort desc', function(t) return ops.argsort(t, {descending = true}) end, 0, x)
        check('topk', function(t) return ops.topk(t, 7) end, 0, x)
        check('topk smallest', function(t) return ops.topk(t, 3, {largest = false}) end, 0, x)
        check('sort bf16', function(t) return ops.sort(t) end, 0, x:bf16())
    end
end)

os.exit(T:run())
