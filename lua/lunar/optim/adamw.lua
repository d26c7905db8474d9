-- lunar.optim.AdamW: AdamW over a parameter store (lunar.nn.params), torch.optim.AdamW's update
-- (lunar.ops.adamw_step) with parameter groups, no-decay rules, an LR schedule, gradient clipping
-- by global norm, gradient accumulation and skipped non-finite steps.
--
--   local opt = optim.AdamW.new(store, {
--       lr = 3e-4, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1,
--       no_decay = {norms = true, biases = true, embeddings = false, patterns = {'router'}},
--       groups = {{match = {'lm_head'}, lr = 1e-4, weight_decay = 0}},   -- first match wins
--       schedule = {warmup = 100, total = 1000, decay = 'cosine', min_lr = 3e-5},  -- or a Schedule
--       clip = 1.0,            -- max global grad norm (nil or 0: no clipping)
--       accum = 1,             -- micro-batches summed into the gradients per step
--       filter = nil,          -- function(name) -> bool: only these parameters (default: all)
--   })
--   ... forward/backward of each micro-batch (the modules accumulate, +=) ...
--   local info = opt:step{loss = loss}  -- {step=, lr=, grad_norm=, clip_coef=, skipped=, reason=}
--   opt:step{loss =, grad_norm = n}     -- a norm computed elsewhere (over several optimizers' parameters)
--   opt:zero_grad()
--
-- Which tensors: every trainable parameter of the store that has a gradient tensor when step()
-- runs (a frozen one, or one that never got a gradient, is left alone and gets no state, like a
-- torch parameter whose .grad is None).
--
-- State per parameter, created at its first update: exp_avg and exp_avg_sq (f32), an f32 master
-- copy for a parameter that is not f32 (bf16 weights are updated in f32 and rounded back), and its
-- own step count for the bias corrections. f32 parameters are updated in place.
--
-- Gradient accumulation: the modules sum the micro-batch gradients; step() multiplies them by
-- 1/accum (opts.micro_batches overrides per call) inside the update, so the model's loss need not
-- be divided. grad_norm is the global L2 norm of the scaled gradients (lunar.ops.global_norm);
-- with clip > 0 the gradients are further multiplied by min(1, clip / (grad_norm + 1e-6)), as
-- torch.nn.utils.clip_grad_norm_ does (in f32).
--
-- Non-finite steps: when opts.loss is NaN/inf, or the gradient norm is, nothing is updated, the
-- schedule does not advance, and the step is counted (opt.skipped, opt.nonfinite_loss,
-- opt.nonfinite_grad); info.skipped = true and info.reason says why.
--
-- Check point: step() first checks each device of its parameters (lunar.sync_check), so a bad
-- index value that a forward or backward met on a GPU fails before any parameter changes.
--
-- Decay: a parameter gets the weight decay of its group (opts.weight_decay for the default group)
-- unless a no-decay rule matches it: norms (names ending in "norm.weight" / "norm.bias", e.g.
-- input_layernorm, q_a_layernorm, model.norm, k_norm), biases (".bias"), embeddings
-- ("embed_tokens.weight"), or any Lua pattern of no_decay.patterns. A group that sets
-- weight_decay explicitly overrides the rules for its members.
--
-- Checkpoints: opt:state_dict() -> {tensors = {['exp_avg.<name>'] =, ['exp_avg_sq.<name>'] =,
-- ['master.<name>'] =}, scalars = {step =, skipped =, ..., param_steps = {[name] = n}}}; the
-- tensors are the live state (write them before the next step). opt:load_state_dict(sd) copies a
-- saved state back (names and shapes checked).
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local schedule = require 'lunar.optim.schedule'

local fail = tensor.fail

local AdamW = {}
AdamW.__index = AdamW

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

-- x rounded to f32 (torch computes the clipping coefficient with f32 tensor ops)
local function f32(x) return core.from_flat({x}, {}, 'f32', 'cpu'):item() end

local function as_list(v)
    if v == nil then return {} end
    if type(v) == 'string' then return {v} end
    return v
end

local function matches_any(name, patterns)
    for _, p in ipairs(patterns) do if name:find(p) then return true end end
    return false
end

-- The no-decay predicate of opts.no_decay (defaults: norms and biases, not embeddings).
local function no_decay_rule(nd)
    nd = nd or {}
    if type(nd) ~= 'table' then fail('AdamW: no_decay must be a table {norms=, biases=, embeddings=, patterns=}') end
    local norms = nd.norms ~= false
    local biases = nd.biases ~= false
    local embeddings = nd.embeddings == true
    local patterns = as_list(nd.patterns)
    return function(name)
        if norms and (name:find('norm%.weight$') or name:find('norm%.bias$')) then return true end
        if biases and name:find('%.bias$') then return true end
        if embeddings and name:find('embed_tokens%.weight$') then return true end
        return matches_any(name, patterns)
    end
end

local function number_opt(o, key, default, min, max)
    local v = o[key]
    if v == nil then v = default end
    if type(v) ~= 'number' or v ~= v or (min and v < min) or (max and v > max) then
        fail(('AdamW: %s must be a number%s, got %s'):format(key,
            (min and max) and (' in [' .. min .. ', ' .. max .. ']') or (min and (' >= ' .. min) or ''), tostring(v)))
    end
    return v
end

-- AdamW.new(store, opts) (see the header for opts)
function AdamW.new(store, o)
    o = o or {}
    if type(store) ~= 'table' or type(store.names) ~= 'function' then
        fail('AdamW.new: expected a parameter store (lunar.nn.params), got a ' .. type(store))
    end
    -- betas given are both given: {0.9} must not quietly mean {0.9, 0.999}
    if o.betas ~= nil and (type(o.betas) ~= 'table' or #o.betas ~= 2) then
        fail(('AdamW.new: betas must be two numbers {beta1, beta2}, got %s'):format(type(o.betas) == 'table'
            and ('%d'):format(#o.betas) .. ' number' .. (#o.betas == 1 and '' or 's') or tostring(o.betas)))
    end
    local betas = o.betas or {o.beta1 or 0.9, o.beta2 or 0.999}
    if o.filter ~= nil and type(o.filter) ~= 'function' then fail('AdamW.new: filter must be a function of the name') end
    local self = setmetatable({
        store = store, filter = o.filter, tp = o.tp,
        beta1 = number_opt({b = betas[1]}, 'b', 0.9, 0, 1),
        beta2 = number_opt({b = betas[2]}, 'b', 0.999, 0, 1),
        eps = number_opt(o, 'eps', 1e-8, 0),
        weight_decay = number_opt(o, 'weight_decay', 0.01, 0),
        clip = number_opt(o, 'clip', 0, 0),
        accum = number_opt(o, 'accum', 1, 1),
        no_decay = no_decay_rule(o.no_decay),
        groups = {},
        state = {},            -- name -> {exp_avg=, exp_avg_sq=, master=, step=}
        settings = {},         -- name -> {group=, lr=, weight_decay=} (cached)
        step_count = 0,        -- successful updates (the schedule's state)
        skipped = 0, nonfinite_loss = 0, nonfinite_grad = 0,
    }, AdamW)
    local sch = o.schedule
    if sch == nil then
        self.schedule = schedule.constant(number_opt(o, 'lr', nil, 0))
    elseif getmetatable(sch) == schedule.Schedule then
        self.schedule = sch
    elseif type(sch) == 'table' then
        local so = {}
        for k, v in pairs(sch) do so[k] = v end
        so.lr = so.lr or o.lr
        self.schedule = schedule.new(so)
    else
        fail('AdamW: schedule must be a table of schedule options or a lunar.optim.schedule object')
    end
    self.lr = self.schedule.lr0
    for i, g in ipairs(o.groups or {}) do
        if type(g) ~= 'table' then fail(('AdamW: group %d must be a table {match=, lr=, weight_decay=}'):format(i)) end
        local match = as_list(g.match)
        if #match == 0 then fail(('AdamW: group %d has no match patterns'):format(i)) end
        self.groups[i] = {name = g.name or ('group' .. i), match = match,
                          lr = g.lr ~= nil and number_opt(g, 'lr', nil, 0) or nil,
                          weight_decay = g.weight_decay ~= nil and number_opt(g, 'weight_decay', nil, 0) or nil}
    end
    return self
end

-- {group=, lr=, weight_decay=} of a parameter: its group's base lr (before the schedule) and decay.
function AdamW:setting(name)
    local s = self.settings[name]
    if s then return s end
    local grp
    for _, g in ipairs(self.groups) do
        if matches_any(name, g.match) then grp = g break end
    end
    local wd
    if grp and grp.weight_decay ~= nil then
        wd = grp.weight_decay
    elseif self.no_decay(name) then
        wd = 0
    else
        wd = self.weight_decay
    end
    s = {group = grp and grp.name or 'default', lr = grp and grp.lr or self.lr, weight_decay = wd}
    self.settings[name] = s
    return s
end

-- the parameters that step() would update now: names, params, grads (registration order)
function AdamW:_targets()
    local store = self.store
    local names, ps, gs = {}, {}, {}
    for name in store:names() do
        local g = store:is_trainable(name) and (not self.filter or self.filter(name)) and store.grads[name]
        if g then
            names[#names + 1] = name
            ps[#ps + 1] = store:get(name)
            gs[#gs + 1] = g
        end
    end
    return names, ps, gs
end

local function new_state(p)
    local st = {step = 0}
    st.exp_avg = core.persist(core.empty(p:size(), 'f32', p:device()):fill_(0))
    st.exp_avg_sq = core.persist(core.empty(p:size(), 'f32', p:device()):fill_(0))
    if p:dtype() ~= 'f32' then st.master = core.persist(core.convert(p, 'f32')) end
    return st
end

-- the learning rate the next update uses (default group)
function AdamW:current_lr() return self.lr * self.schedule:factor(self.step_count) end

-- step{loss =, micro_batches =} -> info (see the header)
-- a step not applied (a non-finite loss or gradient norm): counted, and said in info
function AdamW:_skip(info, reason)
    self.skipped = self.skipped + 1
    if reason == 'loss' then self.nonfinite_loss = self.nonfinite_loss + 1
    else self.nonfinite_grad = self.nonfinite_grad + 1 end
    info.skipped, info.reason = true, reason
    info.lr = self:current_lr()
    return info
end

function AdamW:step(o)
    o = o or {}
    local accum = o.micro_batches or self.accum
    local info = {step = self.step_count, skipped = false}
    local names, ps, gs = self:_targets()
    -- the step's check point (lunar.sync_check, one read per device): a bad index value that the
    -- forward or backward met on a device fails here, before any parameter changes
    local checked = {}
    for _, p in ipairs(ps) do
        local dev = p:device()
        if not checked[dev] then
            checked[dev] = true
            core.sync_check(dev)
        end
    end
    local loss = o.loss
    if tensor.is_tensor(loss) then loss = loss:item() end
    local function skip(reason) return self:_skip(info, reason) end
    if loss ~= nil and not finite(loss) then return skip('loss') end
    local norm = o.grad_norm
    if norm == nil and self.tp then norm = f32(math.sqrt(self:grad_sq()) / accum) end
    if norm == nil then norm = f32((#gs > 0 and ops.global_norm(gs) or 0) / accum) end
    info.grad_norm = norm
    if not finite(norm) then return skip('grad_norm') end
    local coef = 1
    if self.clip > 0 then
        coef = f32(self.clip / f32(norm + 1e-6))
        if coef > 1 then coef = 1 end
    end
    info.clip_coef = coef
    local gscale = coef / accum
    local factor = self.schedule:factor(self.step_count)
    for i, name in ipairs(names) do
        local p = ps[i]
        local st = self.state[name]
        if not st then
            st = new_state(p)
            self.state[name] = st
        end
        st.step = st.step + 1
        local s = self:setting(name)
        ops.adamw_step(p, gs[i], st.exp_avg, st.exp_avg_sq, {lr = s.lr * factor, step = st.step,
            beta1 = self.beta1, beta2 = self.beta2, eps = self.eps, weight_decay = s.weight_decay,
            grad_scale = gscale, master = st.master})
    end
    self.step_count = self.step_count + 1
    info.step = self.step_count
    info.lr = self.lr * factor
    return info
end

function AdamW:zero_grad() self.store:zero_grad() end

-- the sum of squares of the gradients step() would use (before the 1 / micro_batches scaling).
-- With opts.tp = {group =, split = {name = true}} (tensor parallel) the split parameters' blocks
-- are summed over tp, the whole ones counted once: the norm of the whole model.
function AdamW:grad_sq()
    local names, _, gs = self:_targets()
    if not self.tp then
        local n = #gs > 0 and ops.global_norm(gs) or 0
        return n * n
    end
    local whole, split = {}, {}
    for i, name in ipairs(names) do
        if self.tp.split[name] then split[#split + 1] = gs[i] else whole[#whole + 1] = gs[i] end
    end
    local w = #whole > 0 and ops.global_norm(whole) or 0
    local s = #split > 0 and ops.global_norm(split) or 0
    local dist = require 'lunar.dist'
    return w * w + dist.all_reduce(core.from_flat({s * s}, {1}, 'f64', 'cpu'), {group = self.tp.group}):item()
end

local STATE_BYTES = {f32 = 4, f64 = 8, bf16 = 2, f16 = 2}

-- bytes of the optimizer state, counted from its tensors (moments and master copies)
function AdamW:state_bytes()
    local n = 0
    for _, st in pairs(self.state) do
        for _, k in ipairs({'exp_avg', 'exp_avg_sq', 'master'}) do
            if st[k] then n = n + st[k]:numel() * (STATE_BYTES[st[k]:dtype()] or 4) end
        end
    end
    return n
end

-- ---- checkpoints --------------------------------------------------------------------------------

local kinds = {'exp_avg', 'exp_avg_sq', 'master'}

function AdamW:state_dict()
    local tensors, steps = {}, {}
    for name, st in pairs(self.state) do
        for _, k in ipairs(kinds) do
            if st[k] then tensors[k .. '.' .. name] = st[k] end
        end
        steps[name] = st.step
    end
    return {tensors = tensors, scalars = {
        step = self.step_count, skipped = self.skipped, nonfinite_loss = self.nonfinite_loss,
        nonfinite_grad = self.nonfinite_grad, param_steps = steps,
        lr = self.lr, beta1 = self.beta1, beta2 = self.beta2, eps = self.eps, weight_decay = self.weight_decay,
        clip = self.clip, schedule = {warmup = self.schedule.warmup, total = self.schedule.total ~= math.huge and
            self.schedule.total or nil, decay = self.schedule.decay, min_lr = self.schedule.min_lr},
    }}
end

local function same_shape(a, b)
    local sa, sb = a:size(), b:size()
    if #sa ~= #sb then return false end
    for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
    return true
end

-- load_state_dict(sd[, {strict = true}]): sd as state_dict() returns (tensors may be file views,
-- in any float dtype; they are copied). strict: a state for a parameter the store does not have
-- is an error.
function AdamW:load_state_dict(sd, o)
    o = o or {}
    if type(sd) ~= 'table' or type(sd.tensors) ~= 'table' or type(sd.scalars) ~= 'table' then
        fail('AdamW:load_state_dict: expected {tensors = {...}, scalars = {...}}')
    end
    local sc = sd.scalars
    local steps = sc.param_steps or {}
    local fresh = {}
    local keys = {}
    for key in pairs(sd.tensors) do keys[#keys + 1] = key end
    table.sort(keys)
    for _, key in ipairs(keys) do
        local t = sd.tensors[key]
        local kind, name = key:match('^([%w_]+)%.(.+)$')
        if kind ~= 'exp_avg' and kind ~= 'exp_avg_sq' and kind ~= 'master' then
            fail(('AdamW:load_state_dict: unknown optimizer tensor %s (expected exp_avg., exp_avg_sq. or master.)'):format(key))
        end
        if not self.store:has(name) then
            if o.strict ~= false then
                fail(('AdamW:load_state_dict: optimizer state for %s, which the parameter store does not have'):format(name))
            end
        else
            local p = self.store:get(name)
            if not same_shape(p, t) then
                fail(('AdamW:load_state_dict: %s has shape (%s), parameter %s has (%s)'):format(key,
                    table.concat(t:size(), ', '), name, table.concat(p:size(), ', ')))
            end
            local st = fresh[name] or {step = steps[name] or sc.step or 0}
            fresh[name] = st
            st[kind] = core.persist(core.convert(t, 'f32', p:device()))
        end
    end
    for name, st in pairs(fresh) do
        if not st.exp_avg or not st.exp_avg_sq then
            fail(('AdamW:load_state_dict: %s has %s but not %s'):format(name, st.exp_avg and 'exp_avg' or 'exp_avg_sq',
                st.exp_avg and 'exp_avg_sq' or 'exp_avg'))
        end
        local p = self.store:get(name)
        if p:dtype() ~= 'f32' and not st.master then st.master = core.persist(core.convert(p, 'f32')) end
        if p:dtype() == 'f32' and st.master then
            p:copy_(st.master)      -- an f32 parameter is its own master: take the saved value
            st.master = nil
        end
    end
    self.state = fresh
    self.step_count = sc.step or 0
    self.skipped = sc.skipped or 0
    self.nonfinite_loss = sc.nonfinite_loss or 0
    self.nonfinite_grad = sc.nonfinite_grad or 0
    return self
end

return AdamW
