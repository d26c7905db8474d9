-- lunar.testing: a small test harness for lunar's own tests and for recipe authors.
--
--   local T = require('lunar.testing').suite('ops')
--   T:test('add', function() T.close(a + b, expected, {rtol = 1e-6}) end)
--   os.exit(T:run())
--
-- T.close compares tensors (or numbers) elementwise with |a - b| <= atol + rtol * |b| and on
-- failure reports the worst element, its index and both values. T.gradcheck compares an
-- analytic gradient with central finite differences.
local M = {}

local Suite = {}
Suite.__index = Suite

function M.suite(name)
    return setmetatable({name = name, cases = {}}, Suite)
end

-- For tests that need a GPU: exits with 77 (ctest's "skipped") when there is no CUDA device.
function M.require_cuda()
    local ok, why = require('lunar').cuda_status()
    if not ok then
        print(why .. ': skipped')
        os.exit(77)
    end
end

function Suite:test(desc, fn)
    self.cases[#self.cases + 1] = {desc = desc, fn = fn}
end

-- Runs every case (or those whose description contains $LUNAR_TEST_FILTER); returns the exit
-- code (0 all passed, 1 otherwise).
function Suite:run()
    local filter = os.getenv('LUNAR_TEST_FILTER')
    local failed, passed = 0, 0
    local t0 = os.clock()
    for _, c in ipairs(self.cases) do
        if not filter or c.desc:find(filter, 1, true) then
            local ok, err = xpcall(c.fn, debug.traceback)
            if ok then
                passed = passed + 1
                io.write(('ok    %s: %s\n'):format(self.name, c.desc))
            else
                failed = failed + 1
                io.write(('FAIL  %s: %s\n      %s\n'):format(self.name, c.desc, tostring(err):gsub('\n', '\n      ')))
            end
            io.flush()
        end
    end
    io.write(('%s: %d passed, %d failed (%.2fs cpu)\n'):format(self.name, passed, failed, os.clock() - t0))
    return failed == 0 and 0 or 1
end

local function is_tensor(x) return type(x) == 'userdata' and x.tolist_flat ~= nil end

local function flat(x)
    if is_tensor(x) then return x:tolist_flat(), x:size() end
    if type(x) == 'number' then return {x}, {} end
    if type(x) == 'table' then
        local out = {}
        local function walk(t) for _, v in ipairs(t) do if type(v) == 'table' then walk(v) else out[#out + 1] = v end end end
        walk(x)
        return out, {#out}
    end
    error('cannot compare a ' .. type(x), 3)
end

-- close(actual, expected, {rtol=, atol=, msg=, equal_nan=})
function M.close(actual, expected, opts)
    opts = opts or {}
    local rtol, atol = opts.rtol or 1e-5, opts.atol or 1e-6
    local a, sa = flat(actual)
    local b, sb = flat(expected)
    local prefix = opts.msg and (opts.msg .. ': ') or ''
    if #a ~= #b then
        error(('%ssize mismatch: %d elements (%s) vs %d expected (%s)'):format(prefix, #a, table.concat(sa, 'x'), #b,
            table.concat(sb, 'x')), 2)
    end
    local worst, wi, wexcess = 0, nil, 0
    for i = 1, #a do
        local x, y = a[i], b[i]
        local bad
        if x ~= x or y ~= y then
            bad = not (opts.equal_nan ~= false and x ~= x and y ~= y)
            if bad then wi = i; break end
        elseif x == y then
            bad = false
        else
            local d = math.abs(x - y)
            local tol = atol + rtol * math.abs(y)
            if d > tol and d - tol > wexcess then wexcess = d - tol; wi = i; worst = d end
        end
    end
    if wi then
        error(('%snot close at flat index %d: got %.9g, expected %.9g (|diff| %.3g, rtol %g, atol %g)'):format(
            prefix, wi, a[wi], b[wi], math.abs(a[wi] - b[wi]), rtol, atol), 2)
    end
    return worst
end

function M.equal(actual, expected, msg)
    local a = flat(actual)
    local b = flat(expected)
    if #a ~= #b then error((msg or 'equal') .. (': %d vs %d elements'):format(#a, #b), 2) end
    for i = 1, #a do
        if a[i] ~= b[i] and not (a[i] ~= a[i] and b[i] ~= b[i]) then
            error(('%s: differ at flat index %d: %.17g vs %.17g'):format(msg or 'equal', i, a[i], b[i]), 2)
        end
    end
end

-- raises(fn, pattern): fn must raise an error whose message contains pattern (plain text).
-- Returns the message.
function M.raises(fn, pattern)
    local ok, err = pcall(fn)
    if ok then error('expected an error containing "' .. pattern .. '", got none', 2) end
    err = tostring(err)
    if not err:find(pattern, 1, true) then
        error(('expected an error containing "%s", got: %s'):format(pattern, err), 2)
    end
    return err
end

-- gradcheck{f = function(inputs) -> f64 number loss, inputs = {tensors}, grads = {tensors}
-- (analytic d loss / d input), eps =, rtol =, atol =, max_checks =}: perturbs up to max_checks
-- entries of each input (chosen evenly) and compares central differences with the analytic
-- gradient. Inputs must be f32 or f64 CPU tensors.
function M.gradcheck(spec)
    local eps = spec.eps or 1e-3
    local rtol, atol = spec.rtol or 1e-2, spec.atol or 1e-3
    local max_checks = spec.max_checks or 64
    for k, x in ipairs(spec.inputs) do
        local g = spec.grads[k]
        if g then
            local n = x:numel()
            local flat_view = x:view(n)
            local step = math.max(1, math.floor(n / max_checks))
            local gflat = g:contiguous():tolist_flat()
            for i = 1, n, step do
                local orig = flat_view:get(i)
                flat_view:set(i, orig + eps)
                local lp = spec.f(spec.inputs)
                flat_view:set(i, orig - eps)
                local lm = spec.f(spec.inputs)
                flat_view:set(i, orig)
                local num = (lp - lm) / (2 * eps)
                local ana = gflat[i]
                if math.abs(num - ana) > atol + rtol * math.abs(num) then
                    error(('%sgradient of input %d at flat index %d: analytic %.6g, numeric %.6g'):format(
                        spec.name and (spec.name .. ': ') or '', k, i, ana, num), 2)
                end
            end
        end
    end
end

-- the checks are also reachable from a suite (T.close, T.raises, ...)
for k, v in pairs(M) do if k ~= 'suite' and Suite[k] == nil then Suite[k] = v end end

return M
