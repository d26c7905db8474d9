-- lunar.nn.params: the named parameters of a model and their gradients.
--
-- Names are the checkpoint names verbatim ("model.layers.3.self_attn.q_a_proj.weight"). Each
-- parameter is trainable or frozen; a trainable one gets a gradient tensor of its shape, created
-- on first use (zero) and accumulated into by the modules' backward passes.
local lunar_core = require 'lunar.core'

local Params = {}
Params.__index = Params

function Params.new(opts)
    opts = opts or {}
    return setmetatable({
        tensors = {},          -- name -> tensor
        grads = {},            -- name -> gradient tensor (trainable only, created lazily)
        trainable = {},        -- name -> bool
        order = {},            -- names in registration order
        holders = {},          -- gradient buffers that hold some of the gradients (hold_grads)
        grad_dtype = opts.grad_dtype or 'f32',
    }, Params)
end

-- Registers a parameter (or replaces the tensor of an existing one). Returns the tensor.
function Params:add(name, t, trainable)
    if self.tensors[name] == nil then self.order[#self.order + 1] = name end
    lunar_core.persist(t)   -- parameters outlive any lunar.scope they were made in
    t:set_name(name)
    self.tensors[name] = t
    self.trainable[name] = trainable ~= false
    return t
end

function Params:has(name) return self.tensors[name] ~= nil end

function Params:get(name)
    local t = self.tensors[name]
    if not t then error('parameter ' .. name .. ' does not exist', 2) end
    return t
end

function Params:is_trainable(name) return self.trainable[name] == true end

function Params:set_trainable(name, on)
    if self.tensors[name] == nil then error('parameter ' .. name .. ' does not exist', 2) end
    self.trainable[name] = on and true or false
end

-- The gradient tensor of a trainable parameter (zeros on first use); nil if frozen. A parameter
-- that a gradient buffer holds (Params:hold_grads) gets the buffer's view.
function Params:grad(name)
    if not self.trainable[name] then return nil end
    for i = #self.holders, 1, -1 do
        local g = self.holders[i]:grad_of(name, self)
        if g then return g end
    end
    local g = self.grads[name]
    if not g then
        local t = self.tensors[name]
        g = lunar_core.empty(t:size(), self.grad_dtype, t:device()):fill_(0)
        g:set_name('grad.' .. name)
        lunar_core.persist(g)
        self.grads[name] = g
    end
    return g
end

-- The LoRA adapter (lunar.nn.lora) of module `name` ("model.layers.0.self_attn.q_a_proj"), or
-- nil: set when an adapter set is attached to this store (store.lora).
function Params:adapter(name)
    local set = self.lora
    return set and set.modules[name]
end

-- hold_grads(holder): from now on the gradients of the parameters `holder` holds are its views
-- (lunar.optim.grad_buffer: one flat buffer reduced in buckets). holder:grad_of(name, store) ->
-- the view of a parameter it holds (recording that the parameter got a gradient), else nil;
-- holder:zero() zeroes every gradient it holds.
function Params:hold_grads(holder)
    self.holders[#self.holders + 1] = holder
end

-- zero_grad(): every gradient zero, the buffers' whole (their views and padding) included
function Params:zero_grad()
    if #self.holders == 0 then
        for _, g in pairs(self.grads) do g:fill_(0) end
        return
    end
    for _, h in ipairs(self.holders) do h:zero() end
    for name, g in pairs(self.grads) do
        local held = false
        for _, h in ipairs(self.holders) do if h:holds(name) then held = true break end end
        if not held then g:fill_(0) end
    end
end

-- Iterates names in registration order.
function Params:names()
    local i = 0
    return function()
        i = i + 1
        return self.order[i]
    end
end

function Params:count()
    local n = 0
    for _, name in ipairs(self.order) do n = n + self.tensors[name]:numel() end
    return n
end

return Params
