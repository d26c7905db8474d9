-- lunar.nn.MLP: the gated MLP of GLM / Llama: y = down(act(gate(x)) * up(x)), no biases.
-- act is 'silu' (SwiGLU, the real models) or 'gelu' (exact erf GELU, HF's unit-test config).
-- x (N, H) -> y (N, H); gate/up (I, H), down (H, I) under `name` (".gate_proj" ...).
local ops = require 'lunar.ops'
local Linear = require 'lunar.nn.linear'

local MLP = {}
MLP.__index = MLP

function MLP.new(store, name, act)
    if act ~= 'silu' and act ~= 'gelu' then
        error(('MLP %s: hidden_act %q is not supported (silu, gelu)'):format(name, tostring(act)), 2)
    end
    return setmetatable({
        name = name, act = act,
        gate = Linear.new(store, name .. '.gate_proj'),
        up = Linear.new(store, name .. '.up_proj'),
        down = Linear.new(store, name .. '.down_proj'),
    }, MLP)
end

-- a = act(g) * u
local function activate(act, g, u)
    if act == 'silu' then return ops.swiglu(g, u) end
    return ops.mul(ops.gelu(g), u)
end

-- dg, du of a = act(g) * u
local function activate_backward(act, da, g, u)
    if act == 'silu' then return ops.swiglu_backward(da, g, u) end
    local dg = ops.gelu_backward(ops.mul(da, u), g)
    local du = ops.mul(da, ops.gelu(g))
    return dg, du
end
MLP.activate, MLP.activate_backward = activate, activate_backward

function MLP:forward(x)
    local g, sg = self.gate:forward(x)
    local u, su = self.up:forward(x)
    local a = activate(self.act, g, u)
    local y, sd = self.down:forward(a)
    return y, {g = g, u = u, sg = sg, su = su, sd = sd}
end

function MLP:backward(dy, saved, need_dx)
    local da = self.down:backward(dy, saved.sd)
    local dg, du = activate_backward(self.act, da, saved.g, saved.u)
    local dx1 = self.gate:backward(dg, saved.sg, need_dx)
    local dx2 = self.up:backward(du, saved.su, need_dx)
    if need_dx == false then return nil end
    return ops.add_(dx1, dx2)
end

return MLP
