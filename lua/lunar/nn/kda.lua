-- lunar.nn.KDA: GLM-5.3-Flash's linear attention layer (Kimi Delta Attention; HF's
-- Glm5NextTextLinearAttention), forward and backward. x (N, H) -> y (N, H), rows in segments
-- (documents or batch rows) that each start from their own state.
--
--   xm = x * valid                                   (pad rows zeroed: their q, k, v are 0)
--   q, k, v = silu(conv(q_proj xm)), silu(conv(k_proj xm)), silu(conv(v_proj xm))   (N, Hk, Dk)
--   q = l2norm(q) / sqrt(Dk), k = l2norm(k)          (x / sqrt(sum x^2 + 1e-6), FLA's form)
--   g = lb sigmoid(e^A_log (f_b f_a xm + dt_bias))   (or -e^A_log softplus(...) when lb is nil)
--   beta = sigmoid(b_proj xm)
--   o = KDA(q, k, v, g, beta) per segment (lunar.ops.kda: chunked WY form)
--   y = o_proj(o_norm(o) * sigmoid(g_b g_a xm))      (the gated RMSNorm per head, f32)
--
-- Parameters (checkpoint names, under prefix): q_proj, k_proj, v_proj (Q, H); q_conv1d,
-- k_conv1d, v_conv1d (Q, 1, Kc) f32; f_a_proj (Dk, H), f_b_proj (Q, Dk), dt_bias (Q) f32,
-- A_log (Hk) f32; b_proj (Hk, H); g_a_proj (Dk, H), g_b_proj (Q, Dk); o_norm (Dk); o_proj (H, Q).
--
-- forward(x, ctx): ctx.seg the (nseg + 1) i64 segment offsets of the rows, ctx.valid (N, 1) 1/0
-- in x's dtype or nil, ctx.state0 (nseg, Hk, Dk, Dk) and ctx.hist = {q =, k =, v = (nseg, Kc - 1, Q)} a cache's
-- recurrent and conv states or nil, ctx.want_state: also return the states after each segment
-- (saved.state, saved.hist_out) for the cache; ctx.linear: the projections' options (a decode
-- step asks for row-invariant products). The KDA math is f32 whatever x's dtype.
local core = require 'lunar.core'
local ops = require 'lunar.ops'
local Linear = require 'lunar.nn.linear'
local context = require 'lunar.parallel.context'

local KDA = {}
KDA.__index = KDA

-- opts.par (lunar.parallel.context): under tensor parallel this rank's heads (q/k/v, their convs,
-- f_b, dt_bias, A_log, b and g_b by heads, o_proj by their columns) and the mappings that reduce
-- the partial sums; f_a, g_a and o_norm stay whole
function KDA.new(store, prefix, cfg, opts)
    local par = opts and opts.par or context.NONE
    local io = par:block('attention')
    local self = setmetatable({store = store, name = prefix, par = par, input = io.input, output = io.output}, KDA)
    self.Hk, self.Dk = par:heads(cfg, 'linear_num_heads', 'KDA ' .. prefix), cfg.linear_head_dim
    self.Q = self.Hk * self.Dk
    self.Kc = cfg.linear_conv_kernel_dim
    self.lb = cfg.linear_lower_bound   -- nil: the softplus gate
    self.eps = cfg.rms_norm_eps
    if cfg.hidden_act ~= 'silu' then
        error(('%s: hidden_act %q: the KDA short conv supports silu only'):format(prefix, tostring(cfg.hidden_act)), 0)
    end
    for _, n in ipairs({'q_proj', 'k_proj', 'v_proj', 'f_a_proj', 'f_b_proj', 'b_proj', 'g_a_proj', 'g_b_proj', 'o_proj'}) do
        self[n] = Linear.new(store, prefix .. '.' .. n)
    end
    self.conv_names = {q = prefix .. '.q_conv1d.weight', k = prefix .. '.k_conv1d.weight', v = prefix .. '.v_conv1d.weight'}
    self.dt_bias, self.A_log = prefix .. '.dt_bias', prefix .. '.A_log'
    self.o_norm = prefix .. '.o_norm.weight'
    return self
end

-- tensor parallel: the whole parameters whose gradients cover this rank's heads only
function KDA:tp_partial()
    return self.par:partial({self.f_a_proj.name .. '.weight', self.g_a_proj.name .. '.weight', self.o_norm})
end

local function conv_weight(self, which)
    return self.store:get(self.conv_names[which]):view(self.Q, self.Kc)
end

-- l2norm over the last dim of x (M, D) times s: rmsnorm with eps / D, then s / sqrt(D)
local function l2norm(x, D, s)
    local y, rstd = ops.rmsnorm(x, nil, 1e-6 / D)
    return ops.mul(y, s / math.sqrt(D)), rstd
end

local function l2norm_backward(dy, x, rstd, D, s)
    return ops.rmsnorm_backward(ops.mul(dy, s / math.sqrt(D)), x, nil, rstd)
end

-- q, k (normed), v (N, Hk, Dk) of xm through the projections, conv(which, p) -> the conv's
-- output, and SiLU; sv gets each one's saved state
local function qkv(self, xm, lo, conv, sv)
    local N, Hk, Dk = xm:size(1), self.Hk, self.Dk
    local act = {}
    for _, w in ipairs({'q', 'k', 'v'}) do
        local p, sp = self[w .. '_proj']:forward(xm, lo)
        local c = conv(w, p)
        sv[w] = {sp = sp, p = p, c = c}
        act[w] = ops.silu(c)
    end
    local qn, q_rstd = l2norm(act.q:view(N * Hk, Dk), Dk, 1 / math.sqrt(Dk))
    local kn, k_rstd = l2norm(act.k:view(N * Hk, Dk), Dk, 1)
    sv.q.act, sv.q.rstd, sv.k.act, sv.k.rstd = act.q, q_rstd, act.k, k_rstd
    return qn:view(N, Hk, Dk), kn:view(N, Hk, Dk), act.v:view(N, Hk, Dk)
end

-- the forget gate g (N, Hk, Dk) (a log decay per channel) and beta (N, Hk) of xm
local function gate_and_beta(self, xm, lo, sv)
    local N, Hk, Dk = xm:size(1), self.Hk, self.Dk
    local fa, s_fa = self.f_a_proj:forward(xm, lo)
    local f, s_fb = self.f_b_proj:forward(fa, lo)
    f = ops.add(f:float(), self.store:get(self.dt_bias))
    local A = ops.exp(self.store:get(self.A_log)):view(1, Hk, 1)
    local z = ops.mul(f:view(N, Hk, Dk), A)
    local g
    if self.lb ~= nil then
        g = ops.mul(ops.sigmoid(z), self.lb)
    else
        g = ops.neg(ops.mul(self:_softplus(f:view(N, Hk, Dk)), A))
    end
    sv.gate = {s_fa = s_fa, s_fb = s_fb, f = f, A = A, z = z}
    local bl, s_b = self.b_proj:forward(xm, lo)
    sv.beta = {s_b = s_b, logit = bl}
    return g, ops.sigmoid(bl:float())
end

-- the gated output norm (f32) of the rule's output o (N, Hk, Dk), then o_proj (in dt)
local function gated_output(self, o, xm, dt, lo, sv)
    local N, Hk, Dk, Q = xm:size(1), self.Hk, self.Dk, self.Q
    local ga, s_ga = self.g_a_proj:forward(xm, lo)
    local gate, s_gb = self.g_b_proj:forward(ga, lo)
    local on, o_rstd = ops.rmsnorm(o:view(N * Hk, Dk), self.store:get(self.o_norm):float(), self.eps)
    local sg = ops.sigmoid(gate:float():view(N * Hk, Dk))
    local y_in = ops.mul(on, sg):view(N, Q):to(dt)
    local y, s_o = self.o_proj:forward(y_in, lo)
    sv.out = {s_ga = s_ga, s_gb = s_gb, o = o, o_rstd = o_rstd, on = on, gate = gate, sg = sg, s_o = s_o}
    return self.output:forward(y)   -- (tensor parallel: the heads' partial sums reduced)
end

function KDA:forward(x, ctx)
    local sv = {ctx = ctx, N = x:size(1)}
    local lo = ctx.linear
    x = self.input:forward(x)
    local xm = ctx.valid and ops.mul(x, ctx.valid) or x
    sv.xm = xm
    -- projections and the short conv, each of q, k, v on its own (the conv is depthwise)
    local q, k, v = qkv(self, xm, lo, function(w, p)
        return ops.conv1d_causal(p, conv_weight(self, w), ctx.seg, {hist = ctx.hist and ctx.hist[w]})
    end, sv)
    local g, beta = gate_and_beta(self, xm, lo, sv)
    local o, state = ops.kda(q, k, v, g, beta, ctx.seg, {state0 = ctx.state0, state = ctx.want_state})
    sv.kda = {q = q, k = k, v = v, g = g, beta = beta}
    sv.state = state
    if ctx.want_state then sv.hist_out = self:_conv_states(sv, ctx) end
    return gated_output(self, o, xm, x:dtype(), lo, sv), sv
end

-- step(x, cache, slots, lopts) -> y: one new token per row of x (B, H), each row's sequence held
-- in slot slots[b] (a (B) i64 tensor) of a generation cache's tensors cache = {state = (S, Hk,
-- Dk, Dk), conv_q =, conv_k =, conv_v = (S, Kc - 1, Q)}, all updated in place (lunar.ops
-- conv1d_step and kda_step: the same math as forward on one-row segments from those states)
function KDA:step(x, cache, slots, lo)
    local sv = {}
    x = self.input:forward(x)
    local q, k, v = qkv(self, x, lo, function(w, p)
        return ops.conv1d_step(p, conv_weight(self, w), self.Kc > 1 and cache['conv_' .. w] or nil, slots)
    end, sv)
    local g, beta = gate_and_beta(self, x, lo, sv)
    local o = ops.kda_step(q, k, v, g, beta, cache.state, slots)
    return gated_output(self, o, x, x:dtype(), lo, sv)
end

-- softplus(f) with torch's threshold: f above 20 stays f
function KDA:_softplus(f)
    local sp = ops.log(ops.add(ops.exp(ops.minimum(f, 20)), 1))
    local big = ops.gt(f, 20)
    return ops.add(ops.masked_fill(sp, big, 0), ops.masked_fill(f, ops.le(f, 20), 0))
end

-- the conv state after each segment: its last Kc - 1 inputs (with the history before it when
-- the segment is shorter), (nseg, Kc - 1, Q) per q, k, v: one row gather from [hist; inputs; 0]
function KDA:_conv_states(sv, ctx)
    local seg = ctx.seg:to('cpu'):tolist_flat()
    local nseg, W, Q, N = #seg - 1, self.Kc - 1, self.Q, sv.N
    local hist = ctx.hist
    local base = hist and nseg * W or 0          -- the inputs' first row in the stacked rows
    local zero = base + N                        -- the zero row
    local idx = {}
    for s = 1, nseg do
        local first, n = seg[s], seg[s + 1] - seg[s]
        for i = 1, W do
            local t = n - W + i - 1   -- offset from the segment's first row
            if t >= 0 then idx[#idx + 1] = base + first + t
            elseif hist then idx[#idx + 1] = (s - 1) * W + W + t
            else idx[#idx + 1] = zero end
        end
    end
    local out = {}
    for _, w in ipairs({'q', 'k', 'v'}) do
        local p = sv[w].p
        local rows = core.empty({zero + 1, Q}, 'f32', p:device())
        if hist then rows:narrow(1, 1, base):copy_(hist[w]:contiguous():view(base, Q)) end
        rows:narrow(1, base + 1, N):copy_(p)
        rows:narrow(1, zero + 1, 1):fill_(0)
        out[w] = ops.index_select(rows, 1, core.from_flat(idx, {#idx}, 'i64', p:device())):view(nseg, W, Q)
    end
    return out
end

function KDA:backward(dy, sv)
    local N, Hk, Dk, Q = sv.N, self.Hk, self.Dk, self.Q
    local ctx = sv.ctx
    local so = sv.out
    local dy_in = self.o_proj:backward(self.output:backward(dy), so.s_o):float():view(N * Hk, Dk)
    -- y_in = on * sg
    local don = ops.mul(dy_in, so.sg)
    local dgate = ops.sigmoid_backward(ops.mul(dy_in, so.on), so.gate:float():view(N * Hk, Dk))
    local w = self.store:get(self.o_norm)
    local gw = self.store:grad(self.o_norm)
    local o2 = so.o:view(N * Hk, Dk)
    if gw then ops.rmsnorm_backward_params(gw, don, o2, so.o_rstd) end
    local do_ = ops.rmsnorm_backward(don, o2, w:float(), so.o_rstd):view(N, Hk, Dk)
    local dga = self.g_b_proj:backward(dgate:view(N, Q):to(so.gate:dtype()), so.s_gb)
    local dxm = self.g_a_proj:backward(dga, so.s_ga)
    -- the delta rule
    local kd = sv.kda
    local dq, dk, dv, dg, dbeta = ops.kda_backward(do_, kd.q, kd.k, kd.v, kd.g, kd.beta, ctx.seg,
                                                   {state0 = ctx.state0})
    -- beta = sigmoid(b_proj xm)
    local dbl = ops.sigmoid_backward(dbeta, sv.beta.logit:float())
    ops.add_(dxm, self.b_proj:backward(dbl:to(sv.beta.logit:dtype()), sv.beta.s_b))
    -- the forget gate
    local sg = sv.gate
    local dz
    if self.lb ~= nil then
        dz = ops.sigmoid_backward(ops.mul(dg, self.lb), sg.z)   -- d/dz of lb sigmoid(z)
    else
        -- g = -A softplus(f): dg/df = -A sigmoid(f) (1 where f > 20), dg/dA = -softplus(f)
        local f3 = sg.f:view(N, Hk, Dk)
        local dsp = ops.masked_fill(ops.sigmoid(f3), ops.gt(f3, 20), 1)
        local df = ops.mul(ops.mul(ops.neg(dg), sg.A), dsp)
        local dA = ops.sum(ops.sum(ops.mul(ops.neg(dg), self:_softplus(f3)), 3), 1)   -- (Hk)
        self:_gate_params_backward(df:view(N, Q), dA, sg, dxm)
        return self:_qkv_backward(dq, dk, dv, sv, dxm)
    end
    local df = ops.mul(dz, sg.A)                                   -- z = A f
    local dA = ops.sum(ops.sum(ops.mul(dz, sg.f:view(N, Hk, Dk)), 3), 1)
    self:_gate_params_backward(df:view(N, Q), dA, sg, dxm)
    return self:_qkv_backward(dq, dk, dv, sv, dxm)
end

-- df (N, Q) the gradient of f = f_b f_a xm + dt_bias, dA (Hk) that of A = e^A_log
function KDA:_gate_params_backward(df, dA, sg, dxm)
    local gb = self.store:grad(self.dt_bias)
    if gb then ops.add_(gb, ops.sum(df, 1)) end
    local ga = self.store:grad(self.A_log)
    if ga then ops.add_(ga, ops.mul(dA, sg.A:view(self.Hk))) end
    local dfa = self.f_b_proj:backward(df:to(dxm:dtype()), sg.s_fb)
    ops.add_(dxm, self.f_a_proj:backward(dfa, sg.s_fa))
end

function KDA:_qkv_backward(dq, dk, dv, sv, dxm)
    local N, Hk, Dk, Q = sv.N, self.Hk, self.Dk, self.Q
    local ctx = sv.ctx
    local dact = {
        q = l2norm_backward(dq:view(N * Hk, Dk), sv.q.act:view(N * Hk, Dk), sv.q.rstd, Dk, 1 / math.sqrt(Dk)),
        k = l2norm_backward(dk:view(N * Hk, Dk), sv.k.act:view(N * Hk, Dk), sv.k.rstd, Dk, 1),
        v = dv,
    }
    for _, w in ipairs({'q', 'k', 'v'}) do
        local s = sv[w]
        local dc = ops.silu_backward(dact[w]:view(N, Q), s.c)
        local gw = self.store:grad(self.conv_names[w])
        local dp = ops.conv1d_causal_backward(dc, s.p, conv_weight(self, w), ctx.seg,
                                              {hist = ctx.hist and ctx.hist[w], dw = gw and gw:view(Q, self.Kc)})
        ops.add_(dxm, self[w .. '_proj']:backward(dp:to(s.p:dtype()), s.sp))
    end
    -- (tensor parallel: this rank's heads' share of dx, summed over tp)
    if ctx.valid then return self.input:backward(ops.mul(dxm, ctx.valid)) end
    return self.input:backward(dxm)
end

return KDA
