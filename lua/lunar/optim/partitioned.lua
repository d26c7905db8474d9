-- lunar.optim.partitioned: one optimizer step over parts of a parameter store whose gradients
-- are reduced over different groups, with one global gradient norm for clipping. Expert parallel
-- is the case: the routed experts a rank holds are reduced over edp (the ranks holding the same
-- experts), the other parameters over dp, and each part has an optimizer of its own (AdamW, or
-- lunar.optim.distributed over its own gradient buffer).
--
--   local opt = partitioned.new{
--       {name = 'dense', opt = dense_opt},                          -- the norm of its part: opt:grad_sq()
--       {name = 'experts', opt = expert_opt, across = ep_group},    -- ... summed over ep as well
--   }
--   local info = opt:step{loss = global_loss, micro_batches = 1}    -- the info of the first part
--   opt:zero_grad()
--
-- A part's grad_sq() is the sum of squares of the gradients its optimizer sees, each counted once
-- over that optimizer's group; `across` sums it over the ranks that hold the other pieces of the
-- part (the other experts), so the norm is the one a single rank holding everything computes. The
-- parts step with that norm, so they clip with the same coefficient, and skip (a non-finite loss
-- or norm) together.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local dist = require 'lunar.dist'

local fail = tensor.fail

local M = {}

local Partitioned = {}
Partitioned.__index = Partitioned
M.Partitioned = Partitioned

local function f32(x) return core.from_flat({x}, {}, 'f32', 'cpu'):item() end

function M.new(parts)
    if type(parts) ~= 'table' or #parts == 0 then fail('partitioned.new: expected a list of {name =, opt =, across =}') end
    for i, p in ipairs(parts) do
        if type(p.opt) ~= 'table' or type(p.opt.grad_sq) ~= 'function' then
            fail(('partitioned.new: part %d (%s) has no optimizer with grad_sq()'):format(i, tostring(p.name)))
        end
    end
    local first = parts[1].opt
    return setmetatable({parts = parts, accum = first.accum, clip = first.clip, schedule = first.schedule}, Partitioned)
end

function Partitioned:grad_sq()
    local sq = 0
    for _, p in ipairs(self.parts) do
        local s = p.opt:grad_sq()
        if p.across and p.across:size() > 1 then
            s = dist.all_reduce(core.from_flat({s}, {1}, 'f64', 'cpu'), {group = p.across}):item()
        end
        sq = sq + s
    end
    return sq
end

function Partitioned:step(o)
    o = o or {}
    local accum = o.micro_batches or self.accum
    local norm = f32(math.sqrt(self:grad_sq()) / accum)
    local info
    for _, p in ipairs(self.parts) do
        local i = p.opt:step{loss = o.loss, micro_batches = accum, grad_norm = norm}
        info = info or i
    end
    return info
end

function Partitioned:zero_grad() for _, p in ipairs(self.parts) do p.opt:zero_grad() end end

function Partitioned:current_lr() return self.parts[1].opt:current_lr() end

-- bytes of the state this rank holds, counted from the tensors (and the plan, when every part has one)
function Partitioned:state_bytes()
    local n = 0
    for _, p in ipairs(self.parts) do n = n + p.opt:state_bytes() end
    return n
end

function Partitioned:planned_state_bytes()
    local n = 0
    for _, p in ipairs(self.parts) do
        if not p.opt.planned_state_bytes then return nil end
        n = n + p.opt:planned_state_bytes()
    end
    return n
end

return M
