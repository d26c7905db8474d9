-- lunar.nn.RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over the last dim (x (N, C)), as HF's
-- Llama/DeepSeek/GLM RMSNorm (statistics in f32).
local ops = require 'lunar.ops'

local RMSNorm = {}
RMSNorm.__index = RMSNorm

function RMSNorm.new(store, name, eps)
    return setmetatable({store = store, name = name, wname = name .. '.weight', eps = eps}, RMSNorm)
end

function RMSNorm:forward(x)
    local y, rstd = ops.rmsnorm(x, self.store:get(self.wname), self.eps)
    return y, {x = x, rstd = rstd}
end

function RMSNorm:backward(dy, saved, need_dx)
    local w = self.store:get(self.wname)
    local gw = self.store:grad(self.wname)
    if gw then ops.rmsnorm_backward_params(gw, dy, saved.x, saved.rstd) end
    if need_dx == false then return nil end
    return ops.rmsnorm_backward(dy, saved.x, w, saved.rstd)
end

return RMSNorm
