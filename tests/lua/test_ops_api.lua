-- test_ops_api.lua: what every op of lunar.ops shares: a non-tensor argument is an error that
-- names the op (not "attempt to index a nil value" inside the library) and points at the
-- caller's line, and ops with a dim take a positional 1-based dim.
local lunar = require 'lunar'
local ops = lunar.ops
local T = require('lunar.testing').suite('ops.api')

T:test('a missing tensor argument names the op and points at the caller', function()
    local names = {}
    for name, f in pairs(ops) do
        if type(f) == 'function' and name ~= 'rope_inv_freq' and name ~= 'causal_mask' then names[#names + 1] = name end
    end
    table.sort(names)
    assert(#names > 50, 'the op list')
    for _, name in ipairs(names) do
        local ok, err = pcall(function() return ops[name](nil) end)
        err = tostring(err)
        assert(not ok, name .. ' accepted nil')
        assert(not err:find('attempt to', 1, true), name .. ': ' .. err)
        local base = name:gsub('_$', '')
        assert(err:find(base, 1, true), name .. ': the error does not name the op: ' .. err)
        assert(err:find('test_ops_api.lua:', 1, true), name .. ': the error does not point at the caller: ' .. err)
    end
end)

T:test('dims are 1-based and may be given positionally in every family', function()
    local x = lunar.tensor({{3, 1, 2}, {0, 5, 4}})
    T.equal(ops.sum(x, 2), {6, 9}, 'sum')
    T.equal(ops.softmax(x, 1), ops.softmax(x:t()):t(), 'softmax')
    T.equal(ops.cumsum(x, -1), {3, 4, 6, 0, 5, 9}, 'cumsum')
    T.equal(ops.argsort(x, 2), {1, 2, 0, 0, 2, 1}, 'argsort')
    T.equal(ops.index_select(x, 2, lunar.tensor({2, 0}, 'i64')), {2, 3, 4, 0}, 'index_select')
end)

T:test('an output that shares memory with an input is computed from the input values', function()
    -- the kernels used to read elements they had already written (silently wrong results)
    local n = 100000
    local x = lunar.arange(n)
    ops.add(x:narrow(1, 2, n - 1), 1, {out = x:narrow(1, 1, n - 1)})   -- partial overlap
    local want = {}
    for i = 1, n - 1 do want[i] = i + 1 end
    want[n] = n - 1
    T.equal(x, want, 'shifted add')
    local s = lunar.tensor({{3, 1, 2}, {9, 7, 8}})
    ops.sort(s, {out = s})
    T.equal(s, {1, 2, 3, 7, 8, 9}, 'sort in place')
    local g = lunar.tensor({{1, 2, 3}, {4, 5, 6}})
    ops.gather(g, 2, lunar.tensor({{2, 0, 1}, {1, 2, 0}}, 'i64'), {out = g})
    T.equal(g, {3, 1, 2, 5, 6, 4}, 'gather in place')
    local d = lunar.tensor({1, 2, 3, 4})
    ops.scatter_(d, 1, lunar.tensor({3, 2, 1, 0}, 'i64'), d)
    T.equal(d, {4, 3, 2, 1}, 'scatter with src = dst')
    -- elementwise and row-wise ops still run in place, without a temporary
    local y, z = lunar.randn(64, 64), lunar.randn(64, 64)
    local stats = lunar.memory_stats()
    local before = stats.allocs + stats.reuses
    y:add_(z)
    ops.softmax(y, {out = y})
    ops.rmsnorm(y, nil, {out = y, rstd = lunar.empty({64})})
    stats = lunar.memory_stats()
    assert(stats.allocs + stats.reuses == before + 1, 'in-place ops allocate nothing (but rstd)')
end)

os.exit(T:run())
