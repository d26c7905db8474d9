-- lunar.ops.adamw: one AdamW step, torch.optim.AdamW semantics (decoupled weight decay).
--   adamw_step(param, grad, m, v, {lr=, step=, beta1=0.9, beta2=0.999, eps=1e-8,
--              weight_decay=0.01, grad_scale=1, master=})  -> param
-- Updates param, m, v (and master) in place. step is the 1-based step number used for the bias
-- corrections. grad is multiplied by grad_scale first (e.g. 1 / clip factor). m, v, master are
-- f32; a bf16 param needs an f32 master copy, which is updated and rounded into param.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local C = core.ops

local M = {}

function M.adamw_step(param, grad, m, v, opts)
    tensor.check(param, 'param', 'adamw_step')
    if type(opts) ~= 'table' then tensor.fail('adamw_step: expected an options table {lr=, step=, ...}') end
    if type(opts.lr) ~= 'number' then tensor.fail('adamw_step: opts.lr (a number) is required') end
    if type(opts.step) ~= 'number' or opts.step < 1 or opts.step ~= math.floor(opts.step) then
        tensor.fail('adamw_step: opts.step must be an integer >= 1 (1-based), got ' .. tostring(opts.step))
    end
    return C.adamw_step(param, opts.master, m, v, grad, opts.lr, opts.beta1 or 0.9, opts.beta2 or 0.999,
        opts.eps or 1e-8, opts.weight_decay or 0.01, opts.step, opts.grad_scale or 1)
end

return M
