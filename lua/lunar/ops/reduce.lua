-- lunar.ops.reduce: reductions over one dim or over everything, their backward, cumsum, argmax
-- and the global norm of a list of tensors. Dims are 1-based; negative dims count from the end.
--
--   sum(x[, dim][, {keepdim=false, out=}])   mean, norm (L2) likewise; without dim: a 0-dim tensor.
--       Integer and bool x (CPU): sum gives i64 (a bool sum counts), max/min without dim keep the
--       dtype, all exact; mean and norm need a float x.
--   max(x[, dim][, opts])   without dim: 0-dim value; with dim: values, indices (i64, 0-based, first max)
--   min(x[, dim][, opts])   likewise (with dim, NaN entries are skipped unless the whole slice is NaN)
--   argmax(x[, dim][, opts]) / argmin      i64 indices, 0-based (without dim: into the flattened x)
--   sum_backward(dy, x, y, dim[, opts])    mean/max/min/norm_backward likewise -> dx (x's shape);
--       dim nil = the reduction was over everything; keepdim is read from dy's shape; y may be
--       nil except for norm; the gradient of max/min goes to the first extreme position.
--   cumsum(x, dim[, opts]), cumsum_backward(dy, dim[, opts])  (dim may be omitted for 1-dim x)
--   global_norm({t1, t2, ...}[, {tensor=false}]) -> sqrt(sum of all squares), a number (or a
--       0-dim f32 tensor with tensor=true), accumulated in a fixed order.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local sort = require 'lunar.ops.sort'
local C = core.ops
local fail = tensor.fail

local M = {}

local function label(x)
    local n = x:name()
    return n and ("'" .. n .. "' ") or ''
end

-- 1-based Lua dim (negative from the end) -> 0-based C dim
local function cdim(op, x, dim)
    local nd = x:dim()
    if type(dim) ~= 'number' or dim ~= math.floor(dim) then
        fail(('%s: dim must be an integer, got %s'):format(op, tostring(dim)))
    end
    if dim == 0 or dim > nd or dim < -nd then
        fail(('%s: dim %d out of range for the %d-dim tensor %s(dims are 1-based, negative from the end)'):format(
            op, dim, nd, label(x)))
    end
    return dim > 0 and dim - 1 or dim + nd
end

-- (dim, opts) | (opts) | ()
local function dim_opts(dim, opts)
    if type(dim) == 'table' then return nil, dim end
    return dim, opts or {}
end

-- shape of x reduced over the 0-based dim d (nil: all dims)
local function reduced_shape(x, d, keepdim)
    local s, out = x:size(), {}
    for i = 1, #s do
        if d == nil or i - 1 == d then
            if keepdim then out[#out + 1] = 1 end
        else
            out[#out + 1] = s[i]
        end
    end
    return out
end

local check = tensor.check

local FLOAT_DTYPES = tensor.FLOAT_DTYPES

local function reduction(op)
    return function(x, dim, opts)
        check(x, 'x', op)
        dim, opts = dim_opts(dim, opts)
        local d = dim ~= nil and cdim(op, x, dim) or nil
        -- an integer or bool sum is i64 (as in torch); max and min keep x's dtype
        local dt = x:dtype()
        if op == 'sum' and not FLOAT_DTYPES[dt] then dt = 'i64' end
        local out = opts.out or core.empty(reduced_shape(x, d, opts.keepdim), dt, x:device())
        return C.reduce(out, x, d, op)
    end
end

M.sum = reduction('sum')
M.mean = reduction('mean')
M.norm = reduction('norm')

local reduce_max, reduce_min = reduction('max'), reduction('min')

function M.max(x, dim, opts)
    check(x, 'x', 'max')
    dim, opts = dim_opts(dim, opts)
    if dim == nil then return reduce_max(x, opts) end
    local d = cdim('max', x, dim)
    local shape = reduced_shape(x, d, opts.keepdim)
    local values = opts.out or core.empty(shape, x:dtype(), x:device())
    local indices = opts.indices or core.empty(shape, 'i64', x:device())
    return C.max_dim(values, indices, x, d)
end

-- the extreme over the 0-based dim d through top-1 along the last dim
local function top1(op, x, d, keepdim, largest)
    local nd = x:dim()
    if x:size(d + 1) == 0 then
        local others = 1
        for i = 1, nd do if i ~= d + 1 then others = others * x:size(i) end end
        if others > 0 then
            fail(('%s: cannot take the %s of an empty extent (x %shas 0 elements along dim %d)'):format(
                op, op, label(x), d + 1))
        end
    end
    local xt = d == nd - 1 and x or x:transpose(d + 1, nd)
    local v, i = sort.topk(xt, 1, {largest = largest})
    if d ~= nd - 1 then v, i = v:transpose(d + 1, nd), i:transpose(d + 1, nd) end
    if not keepdim then v, i = v:squeeze(d + 1), i:squeeze(d + 1) end
    return v:contiguous(), i:contiguous()
end

function M.min(x, dim, opts)
    check(x, 'x', 'min')
    dim, opts = dim_opts(dim, opts)
    if dim == nil then return reduce_min(x, opts) end
    local v, i = top1('min', x, cdim('min', x, dim), opts.keepdim, false)
    if opts.out then v = opts.out:copy_(v) end
    if opts.indices then i = opts.indices:copy_(i) end
    return v, i
end

function M.argmax(x, dim, opts)
    check(x, 'x', 'argmax')
    dim, opts = dim_opts(dim, opts)
    local d = dim ~= nil and cdim('argmax', x, dim) or nil
    local indices = opts.out or core.empty(reduced_shape(x, d, opts.keepdim), 'i64', x:device())
    local _, i = C.max_dim(nil, indices, x, d)
    return i
end

function M.argmin(x, dim, opts)
    check(x, 'x', 'argmin')
    dim, opts = dim_opts(dim, opts)
    local _, i
    if dim == nil then
        local flat = x:reshape(x:numel())
        _, i = top1('argmin', flat, 0, false, false)
        if opts.keepdim then i = i:view(reduced_shape(x, nil, true)) end
    else
        _, i = top1('argmin', x, cdim('argmin', x, dim), opts.keepdim, false)
    end
    if opts.out then i = opts.out:copy_(i) end
    return i
end

local function backward(op)
    local name = op .. '_backward'
    return function(dy, x, y, dim, opts)
        if type(dim) == 'table' then dim, opts = nil, dim end
        opts = opts or {}
        check(dy, 'dy', name)
        check(x, 'x (the forward input)', name)
        local d = dim ~= nil and cdim(name, x, dim) or nil
        local dx = opts.out or core.empty(x:size(), x:dtype(), x:device())
        local needs_x = op ~= 'sum' and op ~= 'mean'
        if op == 'norm' and y == nil then fail('norm_backward: y (the forward output) is needed') end
        return C.reduce_backward(dx, dy, needs_x and x or nil, op == 'norm' and y or nil, d, op)
    end
end

M.sum_backward = backward('sum')
M.mean_backward = backward('mean')
M.max_backward = backward('max')
M.min_backward = backward('min')
M.norm_backward = backward('norm')

local function scan_dim(op, x, dim)
    if dim == nil then
        if x:dim() ~= 1 then fail(('%s: dim is required for the %d-dim tensor %s'):format(op, x:dim(), label(x))) end
        return 0
    end
    return cdim(op, x, dim)
end

function M.cumsum(x, dim, opts)
    check(x, 'x', 'cumsum')
    dim, opts = dim_opts(dim, opts)
    local d = scan_dim('cumsum', x, dim)
    local out = opts.out or core.empty(x:size(), x:dtype(), x:device())
    return C.cumsum(out, x, d)
end

function M.cumsum_backward(dy, dim, opts)
    check(dy, 'dy', 'cumsum_backward')
    dim, opts = dim_opts(dim, opts)
    local d = scan_dim('cumsum_backward', dy, dim)
    local dx = opts.out or core.empty(dy:size(), dy:dtype(), dy:device())
    return C.cumsum_backward(dx, dy, d)
end

function M.global_norm(list, opts)
    opts = opts or {}
    if type(list) ~= 'table' or tensor.is_tensor(list) then
        fail('global_norm: expected a list of tensors, got a ' .. (tensor.is_tensor(list) and 'tensor' or type(list)))
    end
    local device = opts.device or (list[1] and tensor.is_tensor(list[1]) and list[1]:device()) or 'cpu'
    local out = opts.out or core.empty({}, 'f32', device)
    C.global_norm(out, list)
    if opts.tensor then return out end
    return out:item()
end

return M
