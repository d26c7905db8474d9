-- lunar.ops.kda: KDA's gated delta rule and its short causal convolution (GLM-5.3-Flash's linear
-- attention; contracts in host/include/lunar/ops.h). Token rows in segments: seg (nseg + 1) i64
-- offsets rising from 0 to N, one segment per document or batch row, each with its own state.
--   kda(q, k, v, g, beta, seg, {state0=, state=true, out=})     -> o, state
--       q, k, g (N, H, Dk), v (N, H, Dv), beta (N, H); per segment and head, from state0 (nseg,
--       H, Dk, Dv) or zeros: S <- diag(e^g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.
--       o (N, H, Dv) f32; state = true also returns the state after each segment.
--   kda_backward(dout, q, k, v, g, beta, seg, {state0=, dstate=, dstate0=true})
--       -> dq, dk, dv, dg, dbeta, dstate0 (f32; dstate0 only when asked)
--   conv1d_causal(x, w, seg, {hist=, out=})                     -> y
--       x (N, C), w (C, K): y[t] = sum_j w[:, j] x[t - K + 1 + j] within each segment, the rows
--       before its first from hist (nseg, K - 1, C) or zeros. y f32.
--   conv1d_causal_backward(dy, x, w, seg, {hist=, dw=})         -> dx, dw (dw accumulated into)
-- A decode step, one new row per sequence, each from and back to its slot (a cache's state):
--   conv1d_step(x, w, hist, slots, {out=})                      -> y (B, C) f32
--       x (B, C), w (C, K), hist (slots, K - 1, C) f32 (nil when K = 1): its rows slots (B) i64
--       shift by one and take x, updated in place; y the bits of conv1d_causal on one-row segments.
--   kda_step(q, k, v, g, beta, state, slots, {out=})            -> o (B, H, Dv) f32
--       state (slots, H, Dk, Dv) f32: its rows slots (B) i64 take one token, in place.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops
local check = tensor.check

local M = {}

local function f32_like(t, shape) return core.empty(shape or t:size(), 'f32', t:device()) end

function M.kda(q, k, v, g, beta, seg, opts)
    opts = opts or {}
    check(q, 'q', 'kda')
    check(v, 'v', 'kda')
    check(seg, 'seg', 'kda')
    if q:dim() ~= 3 or v:dim() ~= 3 or seg:dim() ~= 1 then
        tensor.fail(('kda: q (N, H, Dk), v (N, H, Dv) and seg (nseg + 1) expected, got q (%s), v (%s), seg (%s)'):format(
            table.concat(q:size(), ', '), table.concat(v:size(), ', '), table.concat(seg:size(), ', ')))
    end
    local o = opts.out or f32_like(q, {q:size(1), q:size(2), v:size(3)})
    local state
    if opts.state then state = f32_like(q, {seg:size(1) - 1, q:size(2), q:size(3), v:size(3)}) end
    return C.kda_forward(o, state, q, k, v, g, beta, seg, opts.state0)
end

function M.kda_backward(dout, q, k, v, g, beta, seg, opts)
    opts = opts or {}
    check(q, 'q', 'kda_backward')
    check(beta, 'beta', 'kda_backward')
    check(seg, 'seg', 'kda_backward')
    local dstate0
    if opts.dstate0 then dstate0 = f32_like(q, {seg:size(1) - 1, q:size(2), q:size(3), v:size(3)}) end
    return C.kda_backward(f32_like(q), f32_like(q), f32_like(v), f32_like(q), f32_like(beta), dstate0, dout,
                          opts.dstate, q, k, v, g, beta, seg, opts.state0)
end

function M.conv1d_causal(x, w, seg, opts)
    opts = opts or {}
    check(x, 'x', 'conv1d_causal')
    return C.conv1d_causal_forward(opts.out or f32_like(x), x, w, seg, opts.hist)
end

function M.conv1d_step(x, w, hist, slots, opts)
    opts = opts or {}
    check(x, 'x', 'conv1d_step')
    return C.conv1d_step(opts.out or f32_like(x), hist, x, w, slots)
end

function M.kda_step(q, k, v, g, beta, state, slots, opts)
    opts = opts or {}
    check(q, 'q', 'kda_step')
    check(v, 'v', 'kda_step')
    return C.kda_step(opts.out or f32_like(v), state, q, k, v, g, beta, slots)
end

function M.conv1d_causal_backward(dy, x, w, seg, opts)
    opts = opts or {}
    check(x, 'x', 'conv1d_causal_backward')
    return C.conv1d_causal_backward(f32_like(x), opts.dw, dy, x, w, seg, opts.hist)
end

return M
