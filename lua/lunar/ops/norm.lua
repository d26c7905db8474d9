-- lunar.ops.norm: RMSNorm and LayerNorm over the last dim, explicit forward / backward.
--   rmsnorm(x, w, eps=1e-6, {out=, rstd=})                 -> out, rstd      (w may be nil)
--   rmsnorm_backward(dout, x, w, rstd, {out=})              -> dx
--   rmsnorm_backward_params(dw, dout, x, rstd)              -> dw             (dw += ...)
--   layernorm(x, w, b, eps=1e-5, {out=, mean=, rstd=})      -> out, mean, rstd (w, b may be nil)
--   layernorm_backward(dout, x, w, mean, rstd, {out=})      -> dx
--   layernorm_backward_params(dw, db, dout, x, mean, rstd)  -> dw, db         (+=; either may be nil)
-- The statistics (rstd, mean) are f32 with x's shape minus the last dim. RMSNorm follows HF's
-- Glm/DeepSeek RMSNorm: variance = mean(x^2) in f32, x * rsqrt(variance + eps), then * w.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops
local check = tensor.check

local M = {}

local function stat_shape(x)
    local s = x:size()
    s[#s] = nil
    return s
end

local function stat(x) return core.empty(stat_shape(x), 'f32', x:device()) end

function M.rmsnorm(x, w, eps, opts)
    check(x, 'x', 'rmsnorm')
    if type(eps) == 'table' then opts, eps = eps, nil end
    opts = opts or {}
    local out = opts.out or core.empty(x:size(), x:dtype(), x:device())
    local rstd = opts.rstd or stat(x)
    C.rmsnorm_forward(out, rstd, x, w, eps or 1e-6)
    return out, rstd
end

function M.rmsnorm_backward(dout, x, w, rstd, opts)
    check(x, 'x', 'rmsnorm_backward')
    opts = opts or {}
    local dx = opts.out or core.empty(x:size(), x:dtype(), x:device())
    return C.rmsnorm_backward_input(dx, dout, x, w, rstd)
end

function M.rmsnorm_backward_params(dw, dout, x, rstd)
    check(dw, 'dw', 'rmsnorm_backward_params')
    return C.rmsnorm_backward_params(dw, dout, x, rstd)
end

function M.layernorm(x, w, b, eps, opts)
    check(x, 'x', 'layernorm')
    if type(eps) == 'table' then opts, eps = eps, nil end
    opts = opts or {}
    local out = opts.out or core.empty(x:size(), x:dtype(), x:device())
    local mean = opts.mean or stat(x)
    local rstd = opts.rstd or stat(x)
    C.layernorm_forward(out, mean, rstd, x, w, b, eps or 1e-5)
    return out, mean, rstd
end

function M.layernorm_backward(dout, x, w, mean, rstd, opts)
    check(x, 'x', 'layernorm_backward')
    opts = opts or {}
    local dx = opts.out or core.empty(x:size(), x:dtype(), x:device())
    return C.layernorm_backward_input(dx, dout, x, w, mean, rstd)
end

function M.layernorm_backward_params(dw, db, dout, x, mean, rstd)
    check(dout, 'dout', 'layernorm_backward_params')
    return C.layernorm_backward_params(dw, db, dout, x, mean, rstd)
end

return M
