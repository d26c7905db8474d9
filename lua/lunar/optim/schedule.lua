-- lunar.optim.schedule: learning-rate schedules as pure functions of the optimizer step.
--
--   local s = schedule.new{lr = 3e-4, warmup = 100, total = 1000, decay = 'cosine', min_lr = 3e-5}
--   s:lr(step)        -- the learning rate of the update made after `step` completed updates (0-based)
--   s:factor(step)    -- lr(step) / lr: parameter groups with their own lr scale by this
--
-- decay: 'cosine' (default), 'linear' or 'constant'. With warmup w > 0 the rate rises linearly
-- from 0: lr * step / w for step < w (so the first update uses 0, as transformers'
-- get_*_schedule_with_warmup and Megatron's scheduler do). After warmup, progress p =
-- (step - w) / (total - w) clamped to [0, 1]:
--   cosine    lr * (r + (1 - r) * 0.5 * (1 + cos(pi * p)))      r = min_lr / lr
--   linear    lr * (r + (1 - r) * (1 - p))
--   constant  lr
-- and min_lr from `total` on (factor r). The schedule holds no state: the optimizer's step count is its state.
local tensor = require 'lunar.tensor'

local M = {}
local Schedule = {}
Schedule.__index = Schedule
M.Schedule = Schedule

local kinds = {cosine = true, linear = true, constant = true}

local function num(o, key, default, min)
    local v = o[key]
    if v == nil then v = default end
    if type(v) ~= 'number' or v ~= v or (min and v < min) then
        tensor.fail(('schedule: %s must be a number%s, got %s'):format(key, min and (' >= ' .. min) or '', tostring(v)))
    end
    return v
end

function M.new(o)
    o = o or {}
    if type(o) ~= 'table' then tensor.fail('schedule: expected an options table, got a ' .. type(o)) end
    local decay = o.decay or 'cosine'
    if not kinds[decay] then
        tensor.fail(('schedule: decay must be cosine, linear or constant, got %s'):format(tostring(decay)))
    end
    local lr = num(o, 'lr', nil, 0)
    local warmup = num(o, 'warmup', 0, 0)
    local total = num(o, 'total', decay == 'constant' and math.huge or nil, 0)
    local min_lr = num(o, 'min_lr', 0, 0)
    if min_lr > lr then tensor.fail(('schedule: min_lr %g exceeds lr %g'):format(min_lr, lr)) end
    if decay ~= 'constant' and total <= warmup then
        tensor.fail(('schedule: total %s must exceed warmup %s'):format(tostring(total), tostring(warmup)))
    end
    return setmetatable({lr0 = lr, warmup = warmup, total = total, min_lr = min_lr, decay = decay,
                         min_ratio = lr > 0 and min_lr / lr or 0}, Schedule)
end

-- lr(step) / lr, computed in ratio space (min_ratio = min_lr / lr), so that a group with its own
-- lr gets group_lr * factor(step) exactly as torch's LambdaLR computes base_lr * lambda(step)
function Schedule:factor(step)
    local w = self.warmup
    if step < w then return step / w end
    if self.decay == 'constant' then return 1 end
    local p = (step - w) / (self.total - w)
    local lo = self.min_ratio
    if p >= 1 then return lo end
    if p < 0 then p = 0 end
    if self.decay == 'cosine' then return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p)) end
    return lo + (1 - lo) * (1 - p)
end

function Schedule:lr(step) return self.lr0 * self:factor(step) end

-- the constant schedule of a plain learning rate
function M.constant(lr) return M.new{lr = lr, decay = 'constant'} end

return M
