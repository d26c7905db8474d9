-- lunar.nn.attention: softmax attention with an additive mask, HF's eager path
-- (glm5-architecture.md section 5 step 11; backward by the formulas of section 9.2).
--
--   o, saved = attention.forward(q, k, v, mask, scale)
--       q (B, NH, S, Dq); k (B, NHk, T, Dq); v (B, NHv, T, Dv); NHk and NHv divide NH: query head
--       h uses key head floor(h / (NH/NHk)) (NHk = NH: per head; NHk = 1: one key shared by all
--       heads; otherwise GQA's repeat_kv), likewise for v. mask (B, S, T) additive f32
--       (lunar.nn.masks) or nil; scale a number.
--       Sc = q k^T * scale + mask, P = softmax(Sc) in f32, o = P v -> o (B, NH, S, Dv) in v's
--       dtype. saved = {q, k, v, P, scale}; P (B, NH, S, T) f32 is kept for the backward.
--   dq, dk, dv = attention.backward(dout, saved)
--       dV = P^T dO, dP = dO V^T, dSc = P * (dP - rowsum(dP * P)), dQ = dSc K * scale,
--       dK = dSc^T Q * scale; dk and dv are summed over the query heads that share a key/value
--       head (so dk is (B, NHk, T, Dq), the shape of k). Masked entries have P = 0 and get no
--       gradient.
--   S = attention.scores(q, k, scale)  -> q k^T * scale, (B, NH, S, T) f32 (no mask)
--
--   o, saved = attention.forward(q, k, v, mask, scale, {keys =, dense = false})
--       the same, through the fused op (lunar.ops.attention: no (S, T) matrix; masked keys cost
--       nothing); opts.keys (B, S, K) i64 restricts each query to its listed keys (DSA). saved.P
--       is computed densely on first access (inspection). dense = true: the gemm path below.
--   o, saved = attention.forward_tokens(q, k, v, mask, scale, {keys =})   token-major
--       q (B, S, NH, Dq), k (B, T, NHk, Dq), v (B, T, NHk, Dv) -> o (B, S, NH, Dv);
--   dq, dk, dv = attention.backward_tokens(dout, saved)                    token-major
--   forward_dense / backward_dense: the gemm composition (P (B, NH, S, T) saved), which the
--       indexer KL loss uses because it needs P.
--
-- The dense path: every product is one batched gemm over B*NHk (or B*NHv) groups: q viewed as
-- (B*NHk, G*S, Dq) against k (B*NHk, T, Dq), so no key is ever repeated in memory and there are
-- no per-head loops.
local lunar_core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'

local M = {}

local function shape_str(t) return '(' .. table.concat(t:size(), ', ') .. ')' end

local function check(q, k, v, mask)
    local function is4(t, role)
        if not tensor.is_tensor(t) then tensor.fail(('attention: %s must be a tensor, got a %s'):format(role, type(t))) end
        if t:dim() ~= 4 then tensor.fail(('attention: %s must be 4-dim (B, heads, T, D), got %s'):format(role, shape_str(t))) end
    end
    is4(q, 'q'); is4(k, 'k'); is4(v, 'v')
    local qs, ks, vs = q:size(), k:size(), v:size()
    local B, NH, S, Dq = qs[1], qs[2], qs[3], qs[4]
    local T = ks[3]
    local bad
    if ks[1] ~= B or vs[1] ~= B then bad = 'batch sizes differ'
    elseif ks[4] ~= Dq then bad = 'q and k head dims differ'
    elseif vs[3] ~= T then bad = 'k and v lengths differ'
    elseif NH % ks[2] ~= 0 then bad = 'k heads do not divide q heads'
    elseif NH % vs[2] ~= 0 then bad = 'v heads do not divide q heads' end
    if bad then
        tensor.fail(('attention: %s: q %s, k %s, v %s'):format(bad, shape_str(q), shape_str(k), shape_str(v)))
    end
    if mask ~= nil then
        local ms = mask:size()
        if #ms ~= 3 or ms[1] ~= B or ms[2] ~= S or ms[3] ~= T then
            tensor.fail(('attention: mask %s must be (B, S, T) = (%d, %d, %d)'):format(shape_str(mask), B, S, T))
        end
    end
    return B, NH, S, T, Dq, ks[2], vs[2], vs[4]
end

-- x (B, NH, S, D) contiguous viewed as (B*NG, (NH/NG)*S, D)
local function grouped(x, B, NG, NH, S)
    return x:view({B * NG, (NH / NG) * S, x:size(4)})
end

local function scores(q, k, scale, B, NH, S, T, NHk)
    local Sc = lunar_core.empty({B, NH, S, T}, 'f32', q:device())
    ops.gemm(grouped(q, B, NHk, NH, S), k:view({B * NHk, T, k:size(4)}),
        {trans_b = true, alpha = scale, out = grouped(Sc, B, NHk, NH, S)})
    return Sc
end

function M.scores(q, k, scale)
    local B, NH, S, T, _, NHk = check(q, k, k, nil)
    return scores(q:contiguous(), k:contiguous(), scale, B, NH, S, T, NHk)
end

function M.forward_dense(q, k, v, mask, scale)
    local B, NH, S, T, _, NHk, NHv, Dv = check(q, k, v, mask)
    if type(scale) ~= 'number' then tensor.fail('attention: scale must be a number, got ' .. type(scale)) end
    q, k, v = q:contiguous(), k:contiguous(), v:contiguous()
    local Sc = scores(q, k, scale, B, NH, S, T, NHk)
    if mask ~= nil then ops.add_(Sc, mask:unsqueeze(2)) end
    local P = ops.softmax(Sc)
    Sc:free()
    -- HF casts the probabilities to the query dtype before P v
    local Pv = v:dtype() == 'f32' and P or P:to(v:dtype())
    local o = lunar_core.empty({B, NH, S, Dv}, v:dtype(), v:device())
    ops.gemm(grouped(Pv, B, NHv, NH, S), v:view({B * NHv, T, Dv}), {out = grouped(o, B, NHv, NH, S)})
    return o, {q = q, k = k, v = v, P = P, scale = scale, dims = {B, NH, S, T, NHk, NHv}, dense = true}
end

function M.backward_dense(dout, saved)
    local B, NH, S, T, NHk, NHv = unpack(saved.dims)
    local q, k, v, P = saved.q, saved.k, saved.v, saved.P
    local Dq, Dv = q:size(4), v:size(4)
    dout = dout:contiguous()
    -- dV = P^T dO (summed over the heads sharing a value head)
    local dv = lunar_core.empty({B, NHv, T, Dv}, v:dtype(), v:device())
    ops.gemm(grouped(P, B, NHv, NH, S), grouped(dout, B, NHv, NH, S), {trans_a = true, out = dv:view({B * NHv, T, Dv})})
    -- dP = dO V^T
    local dP = lunar_core.empty({B, NH, S, T}, 'f32', q:device())
    ops.gemm(grouped(dout, B, NHv, NH, S), v:view({B * NHv, T, Dv}), {trans_b = true, out = grouped(dP, B, NHv, NH, S)})
    local dS = ops.softmax_backward(dP, P)
    dP:free()
    -- dQ = dS K * scale, dK = dS^T Q * scale (summed over the heads sharing a key head)
    local dq = lunar_core.empty({B, NH, S, Dq}, q:dtype(), q:device())
    ops.gemm(grouped(dS, B, NHk, NH, S), k:view({B * NHk, T, Dq}), {alpha = saved.scale, out = grouped(dq, B, NHk, NH, S)})
    local dk = lunar_core.empty({B, NHk, T, Dq}, k:dtype(), k:device())
    ops.gemm(grouped(dS, B, NHk, NH, S), grouped(q, B, NHk, NH, S),
        {trans_a = true, alpha = saved.scale, out = dk:view({B * NHk, T, Dq})})
    dS:free()
    return dq, dk, dv
end

-- ---- fused path (lunar.ops.attention: no (S, T) matrix) -----------------------------------------

-- The probabilities of a fused forward, computed densely on first access of saved.P (for
-- inspection and tests; the backward never needs them).
local function dense_P(saved)
    local q, k = saved.q, saved.k
    if saved.layout == 'tokens' then q, k = q:transpose(2, 3), k:transpose(2, 3) end
    local mask = saved.mask
    if saved.keys ~= nil then
        local masks = require 'lunar.nn.masks'
        if mask == nil then
            mask = lunar_core.empty({q:size(1), q:size(3), k:size(3)}, 'f32', q:device()):fill_(0)
        end
        mask = masks.select(mask, saved.keys)
    end
    local Sc = M.scores(q, k, saved.scale)
    if mask ~= nil then ops.add_(Sc, mask:unsqueeze(2)) end
    return ops.softmax(Sc, {out = Sc})
end

local saved_mt = {__index = function(t, key)
    if key == 'P' then
        local P = dense_P(t)
        rawset(t, 'P', P)
        return P
    end
end}

local function check_tokens(q, k, v, mask, keys, scale)
    for _, x in ipairs({{q, 'q'}, {k, 'k'}, {v, 'v'}}) do
        if not tensor.is_tensor(x[1]) then tensor.fail(('attention: %s must be a tensor, got a %s'):format(x[2], type(x[1]))) end
        if x[1]:dim() ~= 4 then tensor.fail(('attention: %s must be 4-dim (B, T, heads, D), got %s'):format(x[2], shape_str(x[1]))) end
    end
    if type(scale) ~= 'number' then tensor.fail('attention: scale must be a number, got ' .. type(scale)) end
end

-- Token-major fused attention: q (B, S, NH, Dq), k (B, T, Hk, Dq), v (B, T, Hk, Dv) -> o (B, S, NH, Dv).
-- opts.keys (B, S, K) i64: each query attends only its listed keys (DSA), AND the mask.
function M.forward_tokens(q, k, v, mask, scale, opts)
    opts = opts or {}
    check_tokens(q, k, v, mask, opts.keys, scale)
    local o, lse = ops.attention(q, k, v, {keys = opts.keys, mask = mask, scale = scale})
    return o, setmetatable({q = q, k = k, v = v, o = o, lse = lse, mask = mask, keys = opts.keys, scale = scale,
                            layout = 'tokens'}, saved_mt)
end

-- -> dq, dk, dv in the layout of q, k, v (token-major), dk/dv summed over the sharing heads.
function M.backward_tokens(dout, saved)
    return ops.attention_backward(dout, saved.o, saved.lse, saved.q, saved.k, saved.v,
        {keys = saved.keys, mask = saved.mask, scale = saved.scale})
end

function M.forward(q, k, v, mask, scale, opts)
    local _, _, _, _, _, NHk, NHv = check(q, k, v, mask)
    if type(scale) ~= 'number' then tensor.fail('attention: scale must be a number, got ' .. type(scale)) end
    opts = opts or {}
    -- the fused op shares one head count between k and v
    if opts.dense or (NHk ~= NHv and opts.keys == nil) then return M.forward_dense(q, k, v, mask, scale) end
    if NHk ~= NHv then tensor.fail('attention: keys = needs k and v with the same number of heads') end
    local o, saved = M.forward_tokens(q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3), mask, scale,
        {keys = opts.keys})
    saved.layout_in = 'heads'
    return o:transpose(2, 3), saved
end

function M.backward(dout, saved)
    if saved.dense then return M.backward_dense(dout, saved) end
    local dq, dk, dv = M.backward_tokens(dout:transpose(2, 3), saved)
    return dq:transpose(2, 3), dk:transpose(2, 3), dv:transpose(2, 3)
end

return M
