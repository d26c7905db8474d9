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
    return setmetatable({parts = parts, accum = parts[1].opt.accum}, Partitioned)
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

-- ---- checkpoints --------------------------------------------------------------------------------
-- state_dict() is what rank 0 writes: every part's scalars, and the tensors of a replicated part
-- that every rank holds alike (the dense AdamW). shard_state() is this rank's own tensors: the
-- pieces of the sharded parts, and the whole state of a replicated part whose parameters differ
-- between ranks (the experts: `across` set), with its step counts as step.<name>.
-- load_state_dict(sd, {shard = this rank's tensors}) takes both back.

function Partitioned:state_dict()
    local sd = {tensors = {}, scalars = {partitioned = {}}}
    for _, p in ipairs(self.parts) do
        local s = p.opt:state_dict()
        if not p.opt.shard_state and not p.across then
            for k, v in pairs(s.tensors) do sd.tensors[k] = v end
        end
        if not p.opt.shard_state and p.across then s.scalars.param_steps = nil end
        sd.scalars.partitioned[p.name] = s.scalars
    end
    return sd
end

function Partitioned:shard_state()
    local out = {}
    for _, p in ipairs(self.parts) do
        if p.opt.shard_state then
            for k, v in pairs(p.opt:shard_state()) do out[k] = v end
        elseif p.across then
            local s = p.opt:state_dict()
            for k, v in pairs(s.tensors) do out[k] = v end
            for name, n in pairs(s.scalars.param_steps or {}) do out['step.' .. name] = core.from_flat({n}, {1}, 'i64', 'cpu') end
        end
    end
    return out
end

function Partitioned:load_state_dict(sd, o)
    o = o or {}
    local saved = type(sd) == 'table' and type(sd.scalars) == 'table' and sd.scalars.partitioned
    if type(saved) ~= 'table' then
        fail('the optimizer state was written without expert parallel (one optimizer, not a dense and an expert part)')
    end
    for _, p in ipairs(self.parts) do
        local sc = saved[p.name]
        if type(sc) ~= 'table' then fail(('the optimizer state has no part %s'):format(tostring(p.name))) end
        local mine = p.opt.filter or function() return true end
        if p.opt.shard_state then
            p.opt:load_state_dict({tensors = {}, scalars = sc}, {shard = o.shard, names_differ = p.across ~= nil})
        else
            local from = p.across and (o.shard or fail('this rank\'s optimizer shard is missing')) or sd.tensors or {}
            local tensors, steps = {}, {}
            for k, v in pairs(from) do
                local kind, name = k:match('^([%w_]+)%.(.+)$')
                if name and mine(name) then
                    if kind == 'step' then steps[name] = v:item() else tensors[k] = v end
                end
            end
            local s = {}
            for k, v in pairs(sc) do s[k] = v end
            if p.across then s.param_steps = steps end
            p.opt:load_state_dict({tensors = tensors, scalars = s})
        end
    end
    return self
end

return M
