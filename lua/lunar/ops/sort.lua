-- lunar.ops.sort: top-k, argsort and sort along one dim (the last unless opts.dim is given).
-- Indices are i64 and 0-based (they index data, like torch). Equal values keep index order
-- (lower index first) in both directions; NaN sorts above +inf.
--
--   topk(x, k[, dim][, {largest=true, dim=-1, out=, indices=}]) -> values, indices (sorted)
--   argsort(x[, dim][, {descending=false, dim=-1, out=}])       -> indices (stable)
--   sort(x[, dim][, {descending=false, dim=-1}])                -> values, indices (stable)
-- The dim may be given positionally (as in the reduce and softmax families) or as opts.dim.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops
local fail = tensor.fail

local M = {}

-- ([dim][, opts]) -> opts with opts.dim set from a positional dim (a copy: the caller's table
-- is not modified)
local function dim_opts(op, dim, opts)
    if type(dim) ~= 'number' then return dim or {} end
    opts = opts or {}
    if opts.dim ~= nil then fail(op .. ': dim given twice (positionally and as opts.dim)') end
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.dim = dim
    return o
end

-- the 1-based dim of opts.dim (default last) and a function moving it to the end
local function mover(op, x, opts)
    tensor.check(x, 'x', op)
    local nd = x:dim()
    if nd == 0 then fail(op .. ': x is 0-dim; it needs a dim to sort along') end
    local d = opts.dim or nd
    if type(d) ~= 'number' or d == 0 or d > nd or d < -nd or d ~= math.floor(d) then
        fail(('%s: dim %s out of range for a %d-dim tensor (dims are 1-based)'):format(op, tostring(opts.dim), nd))
    end
    if d < 0 then d = d + nd + 1 end
    return function(t) if d == nd then return t end return t:transpose(d, nd) end, d
end

function M.topk(x, k, dim, opts)
    opts = dim_opts('topk', dim, opts)
    local move, d = mover('topk', x, opts)
    if type(k) ~= 'number' or k ~= math.floor(k) then fail('topk: k must be an integer, got ' .. tostring(k)) end
    local shape = x:size()
    if k < 0 or k > shape[d] then
        fail(('topk: k = %d out of range [0, %d] for x %s(%s)'):format(k, shape[d],
            x:name() and ("'" .. x:name() .. "' ") or '', table.concat(shape, ', ')))
    end
    shape[d] = k
    local values = opts.out or core.empty(shape, x:dtype(), x:device())
    local indices = opts.indices or core.empty(shape, 'i64', x:device())
    C.topk(move(values), move(indices), move(x), k, opts.largest ~= false)
    return values, indices
end

function M.argsort(x, dim, opts)
    opts = dim_opts('argsort', dim, opts)
    local move = mover('argsort', x, opts)
    local indices = opts.out or core.empty(x:size(), 'i64', x:device())
    C.argsort(move(indices), move(x), opts.descending and true or false)
    return indices
end

-- a stable sort is the top-n in the requested direction
function M.sort(x, dim, opts)
    opts = dim_opts('sort', dim, opts)
    local _, d = mover('sort', x, opts)
    return M.topk(x, x:size(d), {largest = opts.descending and true or false, dim = d, out = opts.out,
                                 indices = opts.indices})
end

return M
