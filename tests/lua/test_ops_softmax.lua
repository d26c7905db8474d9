-- test_ops_softmax.lua: softmax, log_softmax and the fused cross-entropy against plain-Lua
-- references (max-subtracted, in f64), forward and backward.
--
-- Tolerances: f32 vs the f64 reference rtol 1e-5 / atol 1e-6 for probabilities and 1e-5 for
-- log-probs (expf and the final f32 rounding); bf16 rtol 1e-2 / atol 1e-2; gradchecks eps 1e-2,
-- rtol 1e-2, atol 1e-3 (central differences of f32 outputs summed in f64).
local lunar = require 'lunar'
local T = require('lunar.testing').suite('ops.softmax')
local ops = lunar.ops

lunar.manual_seed(77)
math.randomseed(77)

-- rows of the last dim of flat values
local function rows_of(x)
    local vals, v = x:tolist_flat(), x:size(x:dim())
    local rows = {}
    for r = 0, #vals / v - 1 do
        local row = {}
        for j = 1, v do row[j] = vals[r * v + j] end
        rows[#rows + 1] = row
    end
    return rows
end

local function ref_log_softmax_row(row)
    local m = -math.huge
    for _, v in ipairs(row) do if v > m then m = v end end
    local s = 0
    for _, v in ipairs(row) do s = s + math.exp(v - m) end
    local out = {}
    for j, v in ipairs(row) do out[j] = v - m - math.log(s) end
    return out, m + math.log(s)
end

local function ref(x, log)
    local out = {}
    for _, row in ipairs(rows_of(x)) do
        for _, v in ipairs(ref_log_softmax_row(row)) do out[#out + 1] = log and v or math.exp(v) end
    end
    return out
end

local function weighted(y, w)
    local a, b = y:tolist_flat(), w:tolist_flat()
    local s = 0
    for i = 1, #a do s = s + a[i] * b[i] end
    return s
end

local SHAPES = {{1, 1}, {3, 17}, {17, 1000}, {2, 3, 17}, {4, 1}, {1000}}

T:test('softmax and log_softmax match the reference on shapes with 1, 3, 17, 1000', function()
    for _, shape in ipairs(SHAPES) do
        local x = lunar.randn(shape)
        local y = ops.softmax(x)
        T.close(y, ref(x, false), {rtol = 1e-5, atol = 1e-6, msg = 'softmax ' .. table.concat(shape, 'x')})
        T.close(ops.log_softmax(x), ref(x, true), {rtol = 1e-5, atol = 1e-5, msg = 'log_softmax'})
        local sums = ops.sum(y, -1)
        T.close(sums, lunar.ones(sums:size()), {rtol = 1e-5, atol = 1e-6, msg = 'rows sum to 1'})
    end
    -- another dim: the same as transposing to the end
    local x = lunar.randn(5, 7, 3)
    local y = ops.softmax(x, 2)
    local want = ops.softmax(x:transpose(2, 3):contiguous()):transpose(2, 3)
    T.close(y, want, {rtol = 0, atol = 0})
    T.close(ops.log_softmax(x, 1):transpose(1, 3), ref(x:transpose(1, 3), true), {rtol = 1e-5, atol = 1e-5})
end)

T:test('large logits (1e4) do not overflow', function()
    local x = lunar.tensor({{1e4, 1e4 - 1, 1e4 - 5, -1e4}, {-1e4, -1e4 + 2, -1e4, -1e4}})
    local y = ops.softmax(x)
    T.close(y, ref(x, false), {rtol = 1e-5, atol = 1e-6})
    T.close(ops.log_softmax(x), ref(x, true), {rtol = 1e-5, atol = 1e-4})
    for _, v in ipairs(ops.log_softmax(x):tolist_flat()) do assert(v == v and v > -math.huge, 'finite') end
end)

T:test('non-contiguous inputs and outputs, in place, bf16 (rtol 1e-2)', function()
    local base = lunar.randn(9, 17)
    local xt = base:t()                      -- (17, 9), rows strided
    local xn = base:narrow(2, 4, 10)         -- (9, 10)
    for _, x in ipairs({xt, xn}) do
        T.close(ops.softmax(x), ref(x, false), {rtol = 1e-5, atol = 1e-6})
        T.close(ops.log_softmax(x), ref(x, true), {rtol = 1e-5, atol = 1e-5})
    end
    local out = lunar.zeros(10, 9)
    ops.softmax(xn, {out = out:t()})
    T.close(out:t(), ref(xn, false), {rtol = 1e-5, atol = 1e-6, msg = 'into a transposed view'})
    local y = xn:clone()
    ops.log_softmax(y, {out = y})
    T.close(y, ref(xn, true), {rtol = 1e-5, atol = 1e-5, msg = 'in place'})
    local xb = lunar.randn(3, 17):bf16()
    local yb = ops.softmax(xb)
    assert(yb:dtype() == 'bf16')
    T.close(yb, ref(xb, false), {rtol = 1e-2, atol = 1e-2, msg = 'bf16'})
    T.close(ops.log_softmax(xb), ref(xb, true), {rtol = 1e-2, atol = 1e-2, msg = 'bf16 log'})
    local gb = ops.softmax_backward(lunar.randn(3, 17):bf16(), yb)
    assert(gb:dtype() == 'bf16')
end)

T:test('gradcheck softmax and log_softmax (and along dim 1)', function()
    for _, case in ipairs({{'softmax', {3, 17}}, {'log_softmax', {3, 17}}, {'softmax', {2, 1}}, {'log_softmax', {1, 5}}}) do
        local op, shape = case[1], case[2]
        local x = lunar.randn(shape)
        local y = ops[op](x)
        local w = lunar.randn(shape)
        local dx = ops[op .. '_backward'](w, y)
        T.gradcheck{name = op, inputs = {x}, grads = {dx}, eps = 1e-2, rtol = 1e-2, atol = 1e-3,
            f = function(inp) return weighted(ops[op](inp[1]), w) end}
    end
    local x, w = lunar.randn(4, 3), lunar.randn(4, 3)
    local dx = ops.log_softmax_backward(w, ops.log_softmax(x, 1), 1)
    T.gradcheck{name = 'log_softmax dim 1', inputs = {x}, grads = {dx}, eps = 1e-2, rtol = 1e-2, atol = 1e-3,
        f = function(inp) return weighted(ops.log_softmax(inp[1], 1), w) end}
end)

-- cross-entropy reference: log_softmax + gather in Lua
local function ref_ce(logits, targets, ignore)
    local loss, lp, lse = {}, {}, {}
    local t = targets:tolist_flat()
    for r, row in ipairs(rows_of(logits)) do
        local ls, l = ref_log_softmax_row(row)
        lse[r] = l
        if t[r] == ignore then
            loss[r], lp[r] = 0, 0
        else
            lp[r] = ls[t[r] + 1]
            loss[r] = -lp[r]
        end
    end
    return loss, lp, lse
end

local function random_targets(n, v, ignore, every)
    local t = {}
    for i = 1, n do t[i] = (i % every == 0) and ignore or math.random(0, v - 1) end
    return lunar.tensor(t, 'i64')
end

T:test('cross_entropy matches log_softmax + gather, ignored rows, V = 1000 and V = 1', function()
    for _, case in ipairs({{7, 1000, -100, 3}, {17, 3, -100, 4}, {3, 17, 5, 2}, {1, 1, -100, 2}, {5, 1, -100, 2}}) do
        local n, v, ignore, every = case[1], case[2], case[3], case[4]
        local logits = lunar.randn(n, v)
        local targets = random_targets(n, v, ignore, every)
        local loss, lp, lse = ops.cross_entropy(logits, targets, {ignore_index = ignore})
        local rl, rlp, rlse = ref_ce(logits, targets, ignore)
        local msg = ('N=%d V=%d'):format(n, v)
        T.close(loss, rl, {rtol = 1e-5, atol = 1e-5, msg = 'loss ' .. msg})
        T.close(lp, rlp, {rtol = 1e-5, atol = 1e-5, msg = 'logprobs ' .. msg})
        T.close(lse, rlse, {rtol = 1e-5, atol = 1e-5, msg = 'lse ' .. msg})
        assert(loss:dtype() == 'f32' and lse:dtype() == 'f32')
    end
    -- V = 1: every log-prob is 0 and the gradient vanishes
    local logits = lunar.randn(4, 1)
    local tg = lunar.tensor({0, 0, -100, 0}, 'i32')
    local loss, lp, lse = ops.cross_entropy(logits, tg)
    T.equal(loss, {0, 0, 0, 0}, 'V=1 loss')
    T.equal(lp, {0, 0, 0, 0}, 'V=1 logprobs')
    T.close(lse, logits:view(4), {rtol = 0, atol = 0})
    T.close(ops.cross_entropy_backward(1, logits, lse, tg), lunar.zeros(4, 1), {atol = 1e-7})
end)

T:test('cross_entropy with large logits (1e4), 3-D logits, bf16, non-contiguous', function()
    local logits = lunar.tensor({{1e4, 0, -1e4}, {1e4, 1e4, 1e4 - 3}, {-1e4, -1e4 + 1, -1e4}})
    local targets = lunar.tensor({1, 2, 0}, 'i64')
    local loss, lp, lse = ops.cross_entropy(logits, targets)
    local rl, rlp, rlse = ref_ce(logits, targets, -100)
    T.close(loss, rl, {rtol = 1e-5, atol = 1e-3})
    T.close(lp, rlp, {rtol = 1e-5, atol = 1e-3})
    T.close(lse, rlse, {rtol = 1e-6, atol = 0})
    local dl = ops.cross_entropy_backward(1, logits, lse, targets)
    for _, v in ipairs(dl:tolist_flat()) do assert(v == v and math.abs(v) <= 1, 'finite gradient') end
    -- (B, T, V) logits with (B, T) targets
    local l3 = lunar.randn(2, 5, 17)
    local t3 = random_targets(10, 17, -100, 4):view(2, 5)
    local loss3, lp3, lse3 = ops.cross_entropy(l3, t3)
    assert(loss3:dim() == 2 and loss3:size(2) == 5)
    local r3 = ref_ce(l3, t3, -100)
    T.close(loss3, r3, {rtol = 1e-5, atol = 1e-5, msg = '3-D'})
    local d3 = ops.cross_entropy_backward(lunar.ones(2, 5), l3, lse3, t3)
    assert(d3:dim() == 3)
    -- bf16 logits: f32 statistics, bf16 gradient
    local lb = lunar.randn(6, 33):bf16()
    local tb = random_targets(6, 33, -100, 5)
    local lossb, _, lseb = ops.cross_entropy(lb, tb)
    T.close(lossb, ref_ce(lb, tb, -100), {rtol = 1e-5, atol = 1e-5, msg = 'bf16 logits (exact inputs, f32 math)'})
    local db = ops.cross_entropy_backward(1, lb, lseb, tb)
    assert(db:dtype() == 'bf16')
    -- transposed logits and a non-contiguous output gradient
    local lt = lunar.randn(17, 6):t()
    local tt = random_targets(6, 17, -100, 3)
    local losst, _, lset = ops.cross_entropy(lt, tt)
    T.close(losst, ref_ce(lt, tt, -100), {rtol = 1e-5, atol = 1e-5, msg = 'transposed logits'})
    local out = lunar.zeros(17, 6)
    ops.cross_entropy_backward(1, lt, lset, tt, {out = out:t()})
    T.close(out:t(), ops.cross_entropy_backward(1, lt:contiguous(), lset, tt), {rtol = 0, atol = 0})
end)

T:test('cross_entropy_backward: reference (softmax - onehot) * dloss and gradcheck', function()
    local n, v = 6, 17
    local logits = lunar.randn(n, v)
    local targets = random_targets(n, v, -100, 4)
    local w = lunar.randn(n)
    local _, _, lse = ops.cross_entropy(logits, targets)
    local dl = ops.cross_entropy_backward(w, logits, lse, targets)
    local want, t, wv = {}, targets:tolist_flat(), w:tolist_flat()
    for r, row in ipairs(rows_of(logits)) do
        local ls = ref_log_softmax_row(row)
        for j = 1, v do
            want[#want + 1] = t[r] == -100 and 0 or wv[r] * (math.exp(ls[j]) - ((j - 1 == t[r]) and 1 or 0))
        end
    end
    T.close(dl, want, {rtol = 1e-5, atol = 1e-6})
    T.gradcheck{name = 'cross_entropy', inputs = {logits}, grads = {dl}, eps = 1e-2, rtol = 1e-2, atol = 1e-3,
        f = function(inp) return weighted(ops.cross_entropy(inp[1], targets), w) end}
    -- logprobs have the opposite gradient
    T.gradcheck{name = 'logprobs', inputs = {logits}, grads = {ops.cross_entropy_backward(w, logits, lse, targets)},
        eps = 1e-2, rtol = 1e-2, atol = 1e-3,
        f = function(inp) local _, lp = ops.cross_entropy(inp[1], targets) return -weighted(lp, w) end}
end)

T:test('entropy: -sum p log p of each row against the f64 reference, -inf logits included', function()
    for _, shape in ipairs({{7, 300}, {3, 1}, {5, 6400}}) do
        local x = ops.mul(lunar.randn(shape[1], shape[2]), 4)
        local vals = x:tolist_flat()
        -- a masked token in row 1, a row of one dominant logit (entropy near 0)
        if shape[2] > 2 then
            vals[2] = -math.huge
            for j = 1, shape[2] do vals[shape[2] + j] = j == 3 and 60 or 0 end
        end
        x = lunar.tensor(vals):view(shape[1], shape[2])
        local _, _, lse = ops.cross_entropy(x, lunar.zeros(shape[1], {dtype = 'i64'}))
        local want = {}
        for r, row in ipairs(rows_of(x)) do
            local lp = ref_log_softmax_row(row)
            local h = 0
            for _, l in ipairs(lp) do if l > -math.huge then h = h - math.exp(l) * l end end
            want[r] = h
        end
        local got = ops.entropy(x, lse)
        T.equal(got:size(), {shape[1]}, 'shape')
        T.close(got, want, {rtol = 1e-5, atol = 1e-6, msg = 'entropy of (' .. shape[1] .. ', ' .. shape[2] .. ')'})
        for _, h in ipairs(got:tolist_flat()) do assert(h == h, 'no NaN from a -inf logit') end
    end
    -- bf16 logits: computed in f32 from the rounded values
    local x = lunar.randn(4, 50)
    local xb = x:to('bf16')
    local _, _, lse = ops.cross_entropy(xb, lunar.zeros(4, {dtype = 'i64'}))
    local _, _, lse32 = ops.cross_entropy(xb:float(), lunar.zeros(4, {dtype = 'i64'}))
    T.close(ops.entropy(xb, lse), ops.entropy(xb:float(), lse32), {rtol = 1e-5, atol = 1e-6, msg = 'bf16'})
    T.raises(function() ops.entropy(lunar.randn(2, 3), lunar.zeros(3)) end, 'lse')
end)

T:test('sample_rows: the first id whose running weight exceeds u of the total; logprobs as cross_entropy', function()
    local B, V = 64, 1000
    local z = ops.mul(lunar.randn(B, V), 3)
    local flat = z:tolist_flat()
    flat[5] = -math.huge                                 -- a token of weight 0 is never drawn
    z = lunar.tensor(flat):view(B, V)
    local us = {}
    for b = 1, B do us[b] = (b - 1) / B end
    us[B] = 1 - 2 ^ -24                                  -- the largest u the sampler makes
    local tokens, logprobs = ops.sample_rows(z, lunar.tensor(us))
    local tok = tokens:tolist_flat()
    -- the reference: f64 running sums of the softmax in id order
    for b, row in ipairs(rows_of(z)) do
        local lp = ref_log_softmax_row(row)
        local run, want = 0, nil
        for j = 1, V do
            run = run + math.exp(lp[j])
            if run > us[b] then want = j - 1 break end
        end
        want = want or V - 1
        assert(tok[b] == want or math.abs(run - us[b]) < 1e-6,
            ('row %d: drew %d, the f64 reference %d (not at a rounding boundary)'):format(b, tok[b], want))
        assert(tok[b] ~= 4 or b ~= 1, 'a -inf logit was drawn')
    end
    local _, want_lp = ops.cross_entropy(z, tokens)
    T.equal(logprobs, want_lp, 'logprobs: the cross-entropy formula, bit for bit')
    T.raises(function() ops.sample_rows(lunar.randn(2, 3), lunar.zeros(3)) end, 'u')
end)

T:test('errors name the op, the tensor and the problem', function()
    local logits = lunar.randn(4, 5)
    logits:set_name('lm_logits')
    T.raises(function() ops.cross_entropy(logits, lunar.tensor({0, 1, 7, 2}, 'i64')) end,
        'target 7 of row 2 is out of range [0, 5)')
    T.raises(function() ops.cross_entropy(logits, lunar.tensor({0, 1, 2, 3}, 'f32')) end, 'must be i32 or i64')
    T.raises(function() ops.cross_entropy(logits, lunar.tensor({0, 1, 2}, 'i64')) end, 'targets has shape (3), expected (4)')
    T.raises(function() ops.cross_entropy(lunar.zeros(4, 5, {dtype = 'i32'}), lunar.tensor({0, 1, 2, 3}, 'i64')) end,
        'must be a float tensor')
    T.raises(function() ops.cross_entropy(lunar.zeros(3, 0), lunar.tensor({0, 1, 2}, 'i64')) end, 'V >= 1')
    local _, _, lse = ops.cross_entropy(logits, lunar.tensor({0, 1, 2, 3}, 'i64'))
    T.raises(function() ops.cross_entropy_backward(lunar.ones(3), logits, lse, lunar.tensor({0, 1, 2, 3}, 'i64')) end,
        'dloss')
    T.raises(function() ops.softmax(lunar.tensor(3)) end, '0-dim')
    T.raises(function() ops.softmax(logits, 3) end, 'dim 3 out of range')
    T.raises(function() ops.softmax_backward(lunar.randn(4, 4), ops.softmax(logits)) end, "dy 'tensor' has shape (4, 4)")
    T.raises(function() ops.softmax(logits, {out = lunar.empty({5, 4})}) end, 'has shape (5, 4), expected (4, 5)')
    local gone = lunar.randn(2, 3)
    gone:set_name('old_logits')
    gone:free()
    T.raises(function() ops.softmax(gone) end, 'old_logits')
end)

os.exit(T:run())
