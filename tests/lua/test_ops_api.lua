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

os.exit(T:run())
