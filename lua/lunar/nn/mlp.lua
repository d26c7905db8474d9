-- lunar.nn.MLP: the gated MLP of GLM / Llama: y = down(act(gate(x)) * up(x)), no biases.
-- act is a hidden_act of transformers' ACT2FN that lunar implements (MLP.ACTIVATIONS):
--   silu               x sigmoid(x) (SwiGLU, the real models; one fused op)
--   gelu               exact GELU, x Phi(x) with the erf (HF's unit-test config)
--   gelu_pytorch_tanh  GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
--   gelu_new           the same formula (HF writes it out in Python, torch has it built in)
--   relu               max(x, 0); its derivative at 0 is 0, as torch's
-- x (N, H) -> y (N, H); gate/up (I, H), down (H, I) under `name` (".gate_proj" ...).
local ops = require 'lunar.ops'
local Linear = require 'lunar.nn.linear'
local mappings = require 'lunar.parallel.mappings'

local MLP = {}
MLP.__index = MLP

-- hidden_act -> the elementwise op (lunar.ops) that computes it; silu goes through swiglu
local ACTIVATIONS = {silu = 'silu', gelu = 'gelu', gelu_pytorch_tanh = 'gelu_tanh', gelu_new = 'gelu_tanh',
                     relu = 'relu'}
MLP.ACTIVATIONS = ACTIVATIONS
MLP.ACTIVATION_NAMES = {'silu', 'gelu', 'gelu_pytorch_tanh', 'gelu_new', 'relu'}

-- raises (at the caller of the caller) unless act is a hidden_act lunar implements
function MLP.check_act(act, where)
    if not ACTIVATIONS[act] then
        error(('%s: hidden_act %q is not supported (%s)'):format(where, tostring(act),
            table.concat(MLP.ACTIVATION_NAMES, ', ')), 3)
    end
end

-- opts.limit: the SwiGLU clamp (cfg.swiglu_limit; nil: none). opts.input, opts.output (lunar.parallel.mappings, the identity by default): under tensor
-- parallel this rank holds a block of gate/up's rows (column parallel) and the same block of
-- down's columns (row parallel); its parallel context (lunar.parallel.context) gives the
-- mappings that all-reduce the output's partial sums and the input gradient's over tp
-- (Megatron's column / row rule), or leave them to the caller (lunar.nn.MoE adds its routed rows
-- first; under sequence parallel the decoder layer reduce-scatters them)
function MLP.new(store, name, act, opts)
    MLP.check_act(act, 'MLP ' .. name)
    opts = opts or {}
    return setmetatable({
        name = name, act = act, limit = opts.limit,
        input = opts.input or mappings.identity, output = opts.output or mappings.identity,
        gate = Linear.new(store, name .. '.gate_proj'),
        up = Linear.new(store, name .. '.up_proj'),
        down = Linear.new(store, name .. '.down_proj'),
    }, MLP)
end

-- SwiGLU limits (GLM-5.3-Flash's swiglu_limit L): the gate clamped above, min(g, L), the up
-- projection to [-L, L], before the activation; nil: no clamp
local function clamped(g, u, limit)
    return ops.minimum(g, limit), ops.maximum(ops.minimum(u, limit), -limit)
end

-- a = act(g) * u (g, u clamped first when limit is set)
local function activate(act, g, u, limit)
    if limit then g, u = clamped(g, u, limit) end
    if act == 'silu' then return ops.swiglu(g, u) end
    local a = ops[ACTIVATIONS[act]](g)
    return ops.mul(a, u, {out = a})
end

-- dg, du of a = act(g) * u; with limit, of the clamped form: torch's clamp passes no gradient
-- where the input is at or beyond a bound (g >= L; u <= -L or u >= L)
local function activate_backward(act, da, g, u, limit)
    local gc, uc = g, u
    if limit then gc, uc = clamped(g, u, limit) end
    local dg, du
    if act == 'silu' then
        dg, du = ops.swiglu_backward(da, gc, uc)
    else
        local op = ACTIVATIONS[act]
        dg = ops.mul(da, uc)
        ops[op .. '_backward'](dg, gc, {out = dg})
        du = ops[op](gc)
        ops.mul(du, da, {out = du})
    end
    if limit then
        ops.mul_(dg, ops.lt(g, limit, {dtype = dg:dtype()}))
        ops.mul_(du, ops.lt(u, limit, {dtype = du:dtype()}))
        ops.mul_(du, ops.gt(u, -limit, {dtype = du:dtype()}))
    end
    return dg, du
end
MLP.activate, MLP.activate_backward = activate, activate_backward

-- forward(x[, opts]): opts go to the three Linears (row_invariant)
function MLP:forward(x, opts)
    x = self.input:forward(x)
    local g, sg = self.gate:forward(x, opts)
    local u, su = self.up:forward(x, opts)
    local a = activate(self.act, g, u, self.limit)
    local y, sd = self.down:forward(a, opts)
    return self.output:forward(y), {g = g, u = u, sg = sg, su = su, sd = sd}
end

function MLP:backward(dy, saved, need_dx)
    dy = self.output:backward(dy)
    local da = self.down:backward(dy, saved.sd)
    local dg, du = activate_backward(self.act, da, saved.g, saved.u, self.limit)
    local dx1 = self.gate:backward(dg, saved.sg, need_dx)
    local dx2 = self.up:backward(du, saved.su, need_dx)
    if need_dx == false then return nil end
    return self.input:backward(ops.add_(dx1, dx2))
end

return MLP
