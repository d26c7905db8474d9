-- lunar.parallel.schedule: how the micro-batches of one optimizer step go through the forward and
-- backward passes (Megatron's forward_backward functions). Every trainer (pretrain, SFT, LoRA and
-- the RL recipes' policy updates) runs its step through forward_backward.
--
--   local schedule = require 'lunar.parallel.schedule'
--   local sched = schedule.new{grads = dp}          -- grads: the gradient reduction (or nil)
--   schedule.forward_backward(sched, microbatches, {
--       forward = function(mb, i) ... return state end,   -- the micro-batch's forward and loss
--       backward = function(mb, state, i) ... end,       -- its backward (state: what forward gave)
--       cleanup = function(mb, i) ... end,               -- optional: once the micro-batch is done
--   })
--
-- Schedules:
--   sequential (no pipeline, the default): each micro-batch's forward then its backward, in
--   order, each micro-batch inside one lunar.scope (its activations are freed before the next
--   one starts). The gradient reduction is told which backward is the step's last
--   (grads:before_backward(last), grads:after_backward(last)), so that its buckets start while
--   that backward runs (Megatron's forward_backward_no_pipelining).
--
-- forward returns the micro-batch's state (the model's saved activations and whatever its
-- backward needs); nothing of it is kept in the model, so a schedule may hold several
-- micro-batches in flight. cleanup runs after the backward, and when forward or backward fail
-- (the error is raised again after it).
local lunar = require 'lunar'
local tensor = require 'lunar.tensor'

local fail = tensor.fail

local M = {}

local KINDS = {sequential = true}

-- new{kind = 'sequential', grads =} -> a schedule
function M.new(o)
    o = o or {}
    local kind = o.kind or 'sequential'
    if not KINDS[kind] then fail(('schedule: unknown kind %q (sequential)'):format(tostring(kind))) end
    return {kind = kind, grads = o.grads}
end

local function run_one(sched, step, mb, i, last)
    local state = step.forward(mb, i)
    local g = sched.grads
    if g then g:before_backward(last) end
    step.backward(mb, state, i)
    if g then g:after_backward(last) end
end

local function sequential(sched, microbatches, step)
    local n = #microbatches
    for i, mb in ipairs(microbatches) do
        lunar.scope(function()
            if not step.cleanup then return run_one(sched, step, mb, i, i == n) end
            local ok, err = pcall(run_one, sched, step, mb, i, i == n)
            step.cleanup(mb, i)
            if not ok then error(err, 0) end
        end)
    end
end

-- forward_backward(sched, microbatches, step): the step's forwards and backwards (see the header)
function M.forward_backward(sched, microbatches, step)
    if type(step) ~= 'table' or type(step.forward) ~= 'function' or type(step.backward) ~= 'function' then
        fail('schedule.forward_backward: step must be a table with forward and backward functions')
    end
    if sched.kind == 'sequential' then return sequential(sched, microbatches, step) end
end

return M
