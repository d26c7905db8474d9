-- lunar.ops.index: embedding lookups, index_select / index_add_, gather / scatter_ / scatter_add_.
--   embedding(ids, weight, {out=})              -> ids.shape + (C)
--   embedding_backward(dweight, dout, ids)      -> dweight            (dweight += scatter of dout)
--   index_select(src, dim, index, {out=})       -> src with size #index along dim
--   index_add_(dst, dim, index, src, {alpha=1}) -> dst                (dst[index[j]] += alpha * src[j])
--   gather(src, dim, index, {out=})             -> index.shape        (torch.gather)
--   scatter_(dst, dim, index, src)              -> dst                (torch.Tensor.scatter_)
--   scatter_add_(dst, dim, index, src)          -> dst                (torch.Tensor.scatter_add_)
--   index_select_sum(src, index, {out=, accumulate=false})
--                                               -> (N, C)             (out[n] = sum_k src[index[n, k]])
--   bincount(values, bins, {out=})              -> (bins) i64         (occurrences of 0 .. bins-1)
-- Index values (token ids, row ids) are 0-based, as in checkpoints; dims are 1-based (negative
-- counts from the end). Out-of-range values raise an error naming the op, value and range.
-- Accumulation is deterministic on the CPU. For scatter_ with repeated indices the last one
-- in index order wins on the CPU. index_select_sum takes src (R, C) and index (N, K) and sums
-- each row's K sources in k order in f32, rounding once: the MoE layer's combine.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops

local M = {}

-- the C op's 0-based dim for the 1-based (or negative) dim of t, checked here so that the error
-- speaks in the caller's numbering
local function cdim(dim, name, t)
    if type(dim) ~= 'number' or dim == 0 or dim ~= math.floor(dim) then
        tensor.fail(('%s: dim must be a non-zero integer (dims are 1-based), got %s'):format(name, tostring(dim)))
    end
    local n = t:dim()
    if dim > n or dim < -n then
        tensor.fail(('%s: dim %d out of range for a %d-dim tensor of shape (%s) (dims are 1-based)'):format(name, dim,
            n, table.concat(t:size(), ', ')))
    end
    return dim > 0 and dim - 1 or dim
end

local check = tensor.check

function M.embedding(ids, weight, opts)
    check(ids, 'ids', 'embedding')
    check(weight, 'weight', 'embedding')
    opts = opts or {}
    local shape = ids:size()
    shape[#shape + 1] = weight:dim() == 2 and weight:size(2) or 0
    local out = opts.out or core.empty(shape, weight:dtype(), weight:device())
    return C.embedding_forward(out, ids, weight)
end

function M.embedding_backward(dweight, dout, ids)
    check(dweight, 'dweight', 'embedding_backward')
    return C.embedding_backward(dweight, dout, ids)
end

function M.index_select(src, dim, index, opts)
    check(src, 'src', 'index_select')
    check(index, 'index', 'index_select')
    opts = opts or {}
    local d = cdim(dim, 'index_select', src)
    local out = opts.out
    if not out then
        local shape = src:size()
        local k = d >= 0 and d + 1 or #shape + d + 1
        if k >= 1 and k <= #shape then shape[k] = index:numel() end
        out = core.empty(shape, src:dtype(), src:device())
    end
    return C.index_select(out, src, d, index)
end

function M.index_add_(dst, dim, index, src, opts)
    check(dst, 'dst', 'index_add_')
    opts = opts or {}
    return C.index_add(dst, cdim(dim, 'index_add_', dst), index, src, opts.alpha or 1)
end

function M.gather(src, dim, index, opts)
    check(src, 'src', 'gather')
    check(index, 'index', 'gather')
    opts = opts or {}
    local out = opts.out or core.empty(index:size(), src:dtype(), src:device())
    return C.gather(out, src, cdim(dim, 'gather', src), index)
end

function M.scatter_(dst, dim, index, src)
    check(dst, 'dst', 'scatter_')
    return C.scatter(dst, cdim(dim, 'scatter_', dst), index, src)
end

function M.scatter_add_(dst, dim, index, src)
    check(dst, 'dst', 'scatter_add_')
    return C.scatter_add(dst, cdim(dim, 'scatter_add_', dst), index, src)
end

function M.index_select_sum(src, index, opts)
    check(src, 'src', 'index_select_sum')
    check(index, 'index', 'index_select_sum')
    opts = opts or {}
    local out = opts.out
    if not out then
        if opts.accumulate then tensor.fail('index_select_sum: accumulate = true needs out =') end
        out = core.empty({index:dim() == 2 and index:size(1) or 0, src:dim() == 2 and src:size(2) or 0},
                         src:dtype(), src:device())
    end
    return C.index_select_sum(out, src, index, opts.accumulate == true)
end

function M.bincount(values, bins, opts)
    check(values, 'values', 'bincount')
    opts = opts or {}
    if type(bins) ~= 'number' or bins < 0 or bins ~= math.floor(bins) then
        tensor.fail('bincount: bins must be a non-negative integer, got ' .. tostring(bins))
    end
    return C.bincount(opts.out or core.empty({bins}, 'i64', values:device()), values)
end

return M
