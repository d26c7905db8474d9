-- lunar.ops.gemm: matrix products with f32 accumulation (OpenBLAS on CPU, cuBLAS on CUDA).
--   gemm(a, b, {trans_a=false, trans_b=false, alpha=1, beta=0, out=})
--       c = alpha * op(a) @ op(b) + beta * c, op(x) = x or its transpose (last two dims).
--       a, b are 2-D or 3-D (batched over dim 1; one of them may be 2-D, shared by the batch).
--       Without out, c is new (beta is ignored) with the inputs' dtype (f32 if they differ).
--   gemm_grouped(as, bs, {trans_a=, trans_b=, alpha=1, beta=0, out=})
--       n independent 2-D products (lists as, bs, and out, a list of c, or new tensors): the same
--       numbers as n gemm calls; the CPU runs moderately small ones side by side, one thread
--       each (MoE experts). Returns the list of c.
--   matmul(a, b, {out=})   like torch.matmul for 1-D, 2-D and 3-D operands (t:matmul(b) too)
-- Transposed and narrowed views go to BLAS without copies.
--
-- row_invariant = true (gemm and gemm_grouped, trans_a = false): every element of c is one dot
-- product in a fixed order that depends on K only (lunar_gemm_row_invariant in lunar/ops.h), so a
-- row of a gives the same bits whatever other rows are in its product, however the products are
-- grouped and whatever the threads. BLAS makes no such promise (it picks kernels by shape).
-- Generation's decode steps use it for every product of the step, where the rows of different
-- sequences meet; its kernels stream each b once, which is what few-row products need:
--   local ys = ops.gemm_grouped({x1, x2}, {W1, W2}, {trans_b = true, row_invariant = true})
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops

local M = {}

local floats = tensor.FLOAT_DTYPES

local function result_dtype(a, b)
    local da, db = a:dtype(), b:dtype()
    if da == db and floats[da] and da ~= 'f64' and not da:match('^f8') then return da end
    return 'f32'
end

local function shape_str(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

local check_tensor = tensor.check

-- a row-invariant product reads a by rows: a (M, K) as it is
local function check_row_invariant(op, ta)
    if ta then
        tensor.fail(('%s: row_invariant takes a as (M, K): trans_a must be false (pass a transposed view '
            .. 'instead, which is copied)'):format(op))
    end
end

function M.gemm(a, b, opts)
    opts = opts or {}
    check_tensor(a, 'a', 'gemm')
    check_tensor(b, 'b', 'gemm')
    local ta, tb = opts.trans_a and true or false, opts.trans_b and true or false
    local c, beta = opts.out, opts.beta or 0
    if opts.row_invariant then check_row_invariant('gemm', ta) end
    if not c then
        local na, nb = a:dim(), b:dim()
        if na < 2 or na > 3 or nb < 2 or nb > 3 then
            tensor.fail(('gemm: a %s and b %s must be 2-dim or 3-dim'):format(shape_str(a), shape_str(b)))
        end
        local m = a:size(ta and na or na - 1)
        local n = b:size(tb and nb - 1 or nb)
        local shape = {m, n}
        if na == 3 or nb == 3 then shape = {na == 3 and a:size(1) or b:size(1), m, n} end
        c = core.empty(shape, result_dtype(a, b), a:device())
        beta = 0
    end
    if opts.row_invariant then
        C.gemm_row_invariant({c}, {a}, {b}, tb, opts.alpha or 1, beta)
        return c
    end
    return C.gemm(c, a, b, ta, tb, opts.alpha or 1, beta)
end

function M.gemm_grouped(as, bs, opts)
    opts = opts or {}
    if type(as) ~= 'table' or type(bs) ~= 'table' then tensor.fail('gemm_grouped: a and b must be lists of tensors') end
    local ta, tb = opts.trans_a and true or false, opts.trans_b and true or false
    local cs, beta = opts.out, opts.beta or 0
    local ri = opts.row_invariant
    if ri then check_row_invariant('gemm_grouped', ta) end
    if not cs then
        cs, beta = {}, 0
        for i, a in ipairs(as) do
            local b = bs[i]
            check_tensor(a, 'a', 'gemm_grouped')
            check_tensor(b, 'b', 'gemm_grouped')
            if a:dim() ~= 2 or b:dim() ~= 2 then
                tensor.fail(('gemm_grouped: product %d: a %s and b %s must be 2-dim'):format(i, shape_str(a), shape_str(b)))
            end
            cs[i] = core.empty({a:size(ta and 2 or 1), b:size(tb and 1 or 2)}, result_dtype(a, b), a:device())
        end
    end
    if ri then return C.gemm_row_invariant(cs, as, bs, tb, opts.alpha or 1, beta) end
    return C.gemm_grouped(cs, as, bs, ta, tb, opts.alpha or 1, beta)
end

-- torch.matmul for up to 3 dims: 1-D operands become a row (a) or a column (b) that is
-- dropped from the result; 2-D @ 2-D is a plain product; a 3-D operand batches the other.
function M.matmul(a, b, opts)
    opts = opts or {}
    check_tensor(a, 'a', 'matmul')
    check_tensor(b, 'b', 'matmul')
    local na, nb = a:dim(), b:dim()
    if na < 1 or na > 3 or nb < 1 or nb > 3 then
        tensor.fail(('matmul: a %s and b %s must have 1 to 3 dims'):format(shape_str(a), shape_str(b)))
    end
    local a2 = na == 1 and a:unsqueeze(1) or a
    local b2 = nb == 1 and b:unsqueeze(2) or b
    if na == 1 and nb == 1 then
        -- dot product: (1, K) @ (K, 1) -> a 0-dim tensor
        local c = M.gemm(a2, b2)
        local out = c:view({})
        if opts.out then opts.out:copy_(out) return opts.out end
        return out
    end
    if na == 1 or nb == 1 then
        local c = M.gemm(a2, b2)
        local out = c:squeeze(na == 1 and c:dim() - 1 or c:dim())
        if opts.out then opts.out:copy_(out) return opts.out end
        return out
    end
    return M.gemm(a2, b2, {out = opts.out})
end

return M
