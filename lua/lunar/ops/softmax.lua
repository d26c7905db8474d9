-- lunar.ops.softmax: softmax and log-softmax (over the last dim unless a dim is given) and the
-- fused cross-entropy with per-token log-probs.
--
--   softmax(x[, dim][, {out=}]), log_softmax(x[, dim][, opts])
--   softmax_backward(dy, y[, dim][, opts]) -> dx, log_softmax_backward(dy, y[, dim][, opts])
--       (y is the forward output)
--   cross_entropy(logits, targets[, {ignore_index=-100}]) -> loss, logprobs, lse
--       logits (..., V) float, targets (...) i32/i64; the outputs are f32 with targets' shape:
--       lse = logsumexp(logits), logprobs = logits[target] - lse, loss = -logprobs, and 0 in
--       loss and logprobs where the target is ignore_index.
--   cross_entropy_backward(dloss, logits, lse, targets[, {ignore_index=-100, out=}]) -> dlogits
--   entropy(logits (N, V), lse (N)) -> (N) f32 entropy of each row's softmax
--   sample_rows(z (N, V), u (N)) -> tokens, logprobs: one categorical draw per row (CPU)
--       dloss is a tensor of targets' shape or a number (the same weight for every row).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops
local fail = tensor.fail

local M = {}

-- (dim, opts) | (opts) | (): the 1-based dim (default last), moved to the end by a transpose
local function last_dim_views(op, x, dim, opts)
    tensor.check(x, op:find('_backward', 1, true) and 'y' or 'x', op)
    if type(dim) == 'table' then dim, opts = nil, dim end
    opts = opts or {}
    local nd = x:dim()
    if nd == 0 then fail(op .. ': the input is 0-dim; it needs a dim to normalise over') end
    local d = dim or nd
    if type(d) ~= 'number' or d == 0 or d > nd or d < -nd or d ~= math.floor(d) then
        fail(('%s: dim %s out of range for a %d-dim tensor (dims are 1-based)'):format(op, tostring(dim), nd))
    end
    if d < 0 then d = d + nd + 1 end
    local function move(t) if d == nd then return t end return t:transpose(d, nd) end
    return move, opts
end

local function forward(op, log)
    return function(x, dim, opts)
        local move
        move, opts = last_dim_views(op, x, dim, opts)
        local out = opts.out or core.empty(x:size(), x:dtype(), x:device())
        C.softmax_forward(move(out), move(x), log)
        return out
    end
end

local function backward(op, log)
    return function(dy, y, dim, opts)
        local move
        tensor.check(dy, 'dy', op)
        move, opts = last_dim_views(op, y, dim, opts)
        local dx = opts.out or core.empty(y:size(), y:dtype(), y:device())
        C.softmax_backward(move(dx), move(dy), move(y), log)
        return dx
    end
end

M.softmax = forward('softmax', false)
M.log_softmax = forward('log_softmax', true)
M.softmax_backward = backward('softmax_backward', false)
M.log_softmax_backward = backward('log_softmax_backward', true)

-- logits (..., V) -> (N, V) and targets (...) -> (N) views (copies when the strides do not allow)
local function flat_rows(op, logits, targets)
    tensor.check(logits, 'logits', op)
    tensor.check(targets, 'targets', op)
    local nd = logits:dim()
    if nd < 1 then fail(op .. ': logits is 0-dim; expected (..., V)') end
    local v = logits:size(nd)
    local n = 1
    for i = 1, nd - 1 do n = n * logits:size(i) end
    local ls, ts = logits:size(), targets:size()
    local ok = #ts == nd - 1
    for i = 1, nd - 1 do ok = ok and ts[i] == ls[i] end
    if not ok then
        table.remove(ls)
        fail(('%s: targets has shape (%s), expected (%s) (logits (..., V) and targets (...))'):format(op,
            table.concat(ts, ', '), table.concat(ls, ', ')))
    end
    if nd == 2 then return logits, targets, n end
    return logits:reshape(n, v), targets:reshape(n), n
end

function M.cross_entropy(logits, targets, opts)
    opts = opts or {}
    local l2, t2, n = flat_rows('cross_entropy', logits, targets)
    local shape = targets:size()
    local loss = core.empty(shape, 'f32', logits:device())
    local logprobs = core.empty(shape, 'f32', logits:device())
    local lse = core.empty(shape, 'f32', logits:device())
    C.cross_entropy_forward(loss:view(n), logprobs:view(n), lse:view(n), l2, t2, opts.ignore_index or -100)
    return loss, logprobs, lse
end

-- entropy(logits (N, V), lse (N)) -> (N) f32: -sum_v p log p of each row's softmax, log p = logits -
-- lse (lse from cross_entropy on the same logits), in one pass
function M.entropy(logits, lse)
    if not tensor.is_tensor(logits) or logits:dim() ~= 2 then
        fail('entropy: logits must be an (N, V) tensor')
    end
    local n = logits:size(1)
    tensor.check(lse, 'lse', 'entropy')
    if lse:numel() ~= n then
        fail(('entropy: lse has %d elements, expected one per row of logits (%d)'):format(lse:numel(), n))
    end
    local out = core.empty({n}, 'f32', logits:device())
    C.entropy_forward(out, logits:contiguous(), lse:contiguous():view(n))
    return out
end

-- sample_rows(z (N, V) f32, u (N) f32 in [0, 1)) -> tokens (N) i64, logprobs (N) f32: one draw per
-- row of softmax(z), the first id whose running weight exceeds u of the total (CPU backend only)
function M.sample_rows(z, u)
    if not tensor.is_tensor(z) or z:dim() ~= 2 then fail('sample_rows: z must be an (N, V) tensor') end
    local n = z:size(1)
    local tokens = core.empty({n}, 'i64', z:device())
    local logprobs = core.empty({n}, 'f32', z:device())
    C.sample_rows(tokens, logprobs, z:contiguous(), u:contiguous():view(n))
    return tokens, logprobs
end

-- a per-row tensor (targets' shape, or flat (N)) as an (N) view
local function row_vector(role, t, targets, n)
    if t:numel() ~= n then
        fail(('cross_entropy_backward: %s has shape (%s), expected (%s) like targets'):format(role,
            table.concat(t:size(), ', '), table.concat(targets:size(), ', ')))
    end
    return t:reshape(n)
end

function M.cross_entropy_backward(dloss, logits, lse, targets, opts)
    opts = opts or {}
    local l2, t2, n = flat_rows('cross_entropy_backward', logits, targets)
    if type(dloss) == 'number' then
        dloss = core.empty({n}, 'f32', logits:device()):fill_(dloss)
    elseif tensor.is_tensor(dloss) then
        dloss = row_vector('dloss', dloss, targets, n)
    else
        fail('cross_entropy_backward: dloss must be a tensor or a number, got a ' .. type(dloss))
    end
    if not tensor.is_tensor(lse) then fail('cross_entropy_backward: lse must be a tensor (from cross_entropy)') end
    lse = row_vector('lse', lse, targets, n)
    local dlogits = opts.out or core.empty(logits:size(), logits:dtype(), logits:device())
    if opts.out then
        local a, b = table.concat(dlogits:size(), 'x'), table.concat(logits:size(), 'x')
        if a ~= b then fail(('cross_entropy_backward: out has shape %s, expected %s (logits)'):format(a, b)) end
    end
    local d2, fresh = dlogits, false
    if dlogits:dim() ~= 2 then
        local ok, v = pcall(dlogits.view, dlogits, n, logits:size(-1))
        if ok then d2 = v else d2, fresh = core.empty({n, logits:size(-1)}, dlogits:dtype(), dlogits:device()), true end
    end
    C.cross_entropy_backward(d2, dloss, l2, lse, t2, opts.ignore_index or -100)
    if fresh then dlogits:copy_(d2:view(dlogits:size())) end
    return dlogits
end

return M
