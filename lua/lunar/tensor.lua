-- lunar.tensor: constructors and the Lua half of the tensor methods (the C half is in
-- host/lua/lua_tensor.c). Printing lives in lunar.print.
local core = require 'lunar.core'

local M = {api = {}}
local api = M.api
local methods = core.tensor_methods
local mt = core.tensor_mt

function M.is_tensor(x)
    return type(x) == 'userdata' and getmetatable(x) == mt
end
api.is_tensor = M.is_tensor

local function fail(msg) error(core.user_where() .. msg, 0) end

-- the float dtypes (the others are integers and bool)
M.FLOAT_DTYPES = {f32 = true, f64 = true, bf16 = true, f16 = true, f8e4m3 = true, f8e5m2 = true}
M.fail = fail

-- x must be a tensor: the error names the op and the argument's role (the op wrappers check
-- their tensor arguments first, so a wrong one is not "attempt to index a nil value")
function M.check(x, role, op)
    if not M.is_tensor(x) then fail(('%s: %s must be a tensor, got a %s'):format(op, role, type(x))) end
    return x
end

-- (sizes..., opts) | ({sizes}, opts); opts = {dtype=, device=, name=, rng=} or dtype[, device]
local function shape_and_opts(...)
    local n = select('#', ...)
    local args = {...}
    local shape, i = {}, 1
    if type(args[1]) == 'table' and not M.is_tensor(args[1]) then
        for k = 1, #args[1] do shape[k] = args[1][k] end
        i = 2
    else
        while i <= n and type(args[i]) == 'number' do shape[#shape + 1] = args[i]; i = i + 1 end
    end
    local opts = args[i]
    if type(opts) == 'string' then
        opts = {dtype = opts, device = args[i + 1]}
    elseif opts == nil then
        opts = {}
    elseif type(opts) ~= 'table' then
        fail(('expected sizes then an options table, got a %s'):format(type(opts)))
    end
    for k, s in ipairs(shape) do
        if type(s) ~= 'number' or s < 0 or s ~= math.floor(s) then
            fail(('size %d is %s, not a non-negative integer'):format(k, tostring(s)))
        end
    end
    return shape, opts
end
M.shape_and_opts = shape_and_opts

local function named(t, opts)
    if opts.name then t:set_name(opts.name) end
    return t
end

function api.empty(...)
    local shape, o = shape_and_opts(...)
    return named(core.empty(shape, o.dtype, o.device), o)
end

function api.zeros(...)
    local shape, o = shape_and_opts(...)
    return named(core.empty(shape, o.dtype, o.device):fill_(0), o)
end

function api.ones(...)
    local shape, o = shape_and_opts(...)
    return named(core.empty(shape, o.dtype, o.device):fill_(1), o)
end

-- lunar.full({2, 3}, 7.5, opts)
function api.full(shape, value, opts)
    opts = opts or {}
    if type(opts) == 'string' then opts = {dtype = opts} end
    return named(core.empty(shape, opts.dtype, opts.device):fill_(value), opts)
end

-- lunar.arange(n) = 0..n-1; lunar.arange(a, b[, step]) = a, a+step, ... < b (torch semantics)
function api.arange(a, b, step, opts)
    if type(b) == 'table' or type(b) == 'string' then opts, b, step = b, nil, nil end
    if type(step) == 'table' or type(step) == 'string' then opts, step = step, nil end
    if type(opts) == 'string' then opts = {dtype = opts} end
    opts = opts or {}
    local start, stop = a, b
    if stop == nil then start, stop = 0, a end
    step = step or 1
    if step == 0 then fail('arange: step is 0') end
    local n = math.max(0, math.ceil((stop - start) / step))
    return named(core.empty({n}, opts.dtype, opts.device):arange_(start, step), opts)
end

local function rng_of(o) return o.rng or require('lunar').default_rng() end

function api.rand(...)
    local shape, o = shape_and_opts(...)
    return named(rng_of(o):uniform_(core.empty(shape, o.dtype, o.device), 0, 1), o)
end

function api.randn(...)
    local shape, o = shape_and_opts(...)
    return named(rng_of(o):normal_(core.empty(shape, o.dtype, o.device), 0, 1), o)
end

-- lunar.randint(lo, hi, shape, opts): integers in [lo, hi), i64 by default
function api.randint(lo, hi, shape, opts)
    opts = opts or {}
    if type(opts) == 'string' then opts = {dtype = opts} end
    return named(rng_of(opts):randint_(core.empty(shape, opts.dtype or 'i64', opts.device), lo, hi), opts)
end

-- lunar.tensor({{1, 2}, {3, 4}}, opts): from nested Lua tables (rows of equal length); f32
-- unless opts.dtype says otherwise, bool when every element is a boolean (as torch.tensor)
function api.tensor(data, opts)
    if type(opts) == 'string' then opts = {dtype = opts} end
    opts = opts or {}
    if type(data) == 'number' or type(data) == 'boolean' then
        local dt = opts.dtype or (type(data) == 'boolean' and 'bool' or nil)
        return named(core.from_flat({data}, {}, dt, opts.device), opts)
    end
    if type(data) ~= 'table' then fail('tensor: expected a number or a nested table, got ' .. type(data)) end
    local shape, flat = {}, {}
    local node = data
    while type(node) == 'table' do
        shape[#shape + 1] = #node
        node = node[1]
    end
    local function walk(t, depth, path)
        if depth > #shape then
            if type(t) ~= 'number' and type(t) ~= 'boolean' then
                fail(('tensor: element %s is a %s, not a number'):format(path, type(t)))
            end
            flat[#flat + 1] = t
            return
        end
        if type(t) ~= 'table' or #t ~= shape[depth] then
            fail(('tensor: ragged nested table at %s (expected %d entries)'):format(path, shape[depth]))
        end
        for i = 1, #t do walk(t[i], depth + 1, path .. '[' .. i .. ']') end
    end
    walk(data, 1, 'data')
    local dt = opts.dtype
    if not dt and #flat > 0 then
        local all_bool = true
        for i = 1, #flat do if type(flat[i]) ~= 'boolean' then all_bool = false break end end
        if all_bool then dt = 'bool' end
    end
    return named(core.from_flat(flat, shape, dt, opts.device), opts)
end

-- ---- methods -------------------------------------------------------------------------------

function methods.shape(t) return t:size() end

function methods.t(t) return t:transpose() end

function methods.zero_(t) return t:fill_(0) end

-- t itself, after checking it is still usable: a method that returns its tensor unchanged must
-- still raise for a freed tensor or a view of a reset arena, as a copy would
local function live(t, op)
    local ok, why = t:is_valid()
    if not ok then fail(('%s: %s'):format(op, why)) end
    return t
end

-- t:to('cuda'), t:to('bf16'), t:to('cuda:1', 'bf16'), t:to({device=, dtype=}): returns t itself
-- when nothing changes (like torch), else a new contiguous tensor.
function methods.to(t, a, b)
    local dtype, device
    local function take(x)
        if x == nil then return end
        if type(x) == 'table' then dtype = x.dtype or dtype; device = x.device or device return end
        if x:match('^cpu') or x:match('^cuda') then device = x else dtype = x end
    end
    take(a)
    take(b)
    if (dtype == nil or dtype == t:dtype()) and (device == nil or core.device_name(device) == t:device()) then
        return live(t, 'to')
    end
    return core.convert(t, dtype, device)
end

function methods.float(t) return t:to('f32') end
function methods.double(t) return t:to('f64') end
function methods.bf16(t) return t:to('bf16') end
function methods.half(t) return t:to('f16') end
function methods.long(t) return t:to('i64') end
function methods.int(t) return t:to('i32') end
function methods.bool(t) return t:to('bool') end
function methods.cpu(t) return t:to('cpu') end
function methods.cuda(t, idx) return t:to(idx and ('cuda:' .. idx) or 'cuda') end

function methods.clone(t) return core.convert(t) end

function methods.contiguous(t)
    if t:is_contiguous() then return live(t, 'contiguous') end
    return core.convert(t)
end

-- reshape: a view when the strides allow it, else a contiguous copy
function methods.reshape(t, ...)
    local ok, v = pcall(methods.view, t, ...)
    if ok then return v end
    return methods.view(core.convert(t), ...)
end

function methods.flatten(t) return t:reshape(t:numel()) end

-- nested Lua tables, like torch's tolist()
function methods.tolist(t)
    local flat = t:tolist_flat()
    local shape = t:size()
    if #shape == 0 then return flat[1] end
    local pos = 0
    local function build(d)
        local out = {}
        for i = 1, shape[d] do
            if d == #shape then pos = pos + 1; out[i] = flat[pos] else out[i] = build(d + 1) end
        end
        return out
    end
    return build(1)
end

function methods.equal(a, b)
    if not M.is_tensor(b) then return false end
    local sa, sb = a:size(), b:size()
    if #sa ~= #sb then return false end
    for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
    local fa, fb = a:tolist_flat(), b:tolist_flat()
    for i = 1, #fa do if fa[i] ~= fb[i] then return false end end
    return true
end

-- t[i]: select along dim 1 (a number for 1-dim tensors); t.method: methods
mt.__index = function(t, k)
    if type(k) == 'number' then
        if t:dim() == 1 then return t:get(k) end
        return t:select(1, k)
    end
    return methods[k]
end

mt.__newindex = function(t, k, v)
    if type(k) ~= 'number' then fail('cannot set field ' .. tostring(k) .. ' on a tensor') end
    if t:dim() == 1 then t:set(k, v) return end
    local row = t:select(1, k)
    if M.is_tensor(v) then row:copy_(v) else row:fill_(v) end
end

mt.__len = function(t) return t:dim() > 0 and t:size(1) or 0 end

function M.install(lunar)
    local print_mod = require 'lunar.print'
    mt.__tostring = print_mod.tostring
    -- arithmetic metamethods come from the elementwise ops, when that family is built
    local ops = lunar.ops
    local function binop(name)
        return function(a, b)
            local f = ops[name]
            if not f then fail('tensor ' .. name .. ' is not available (elementwise ops not built)') end
            return f(a, b)
        end
    end
    mt.__add = binop('add')
    mt.__sub = binop('sub')
    mt.__mul = binop('mul')
    mt.__div = binop('div')
    mt.__pow = binop('pow')
    mt.__unm = function(a)
        if not ops.neg then fail('tensor negation is not available (elementwise ops not built)') end
        return ops.neg(a)
    end
    -- every op in lunar.ops that takes a tensor first is also a method (x:silu(), x:sum(2), ...)
    for name, f in pairs(ops) do
        if methods[name] == nil and type(f) == 'function' then methods[name] = f end
    end
end

return M
