-- lunar.nn.lora: low-rank adapters (LoRA) on the linear maps of a model.
--
-- An adapter on the module `name` (whose weight W (out, in) is `name .. '.weight'` in the model's
-- parameter store) owns A (r, in) and B (out, r), stored as `name .. '.lora_A.weight'` and
-- `name .. '.lora_B.weight'` in the adapter set's own parameter store (set.params), so only they
-- get gradients and optimizer state, and the model's store, its exports and its names are
-- untouched. With scale s = alpha / r (alpha / sqrt(r) with rslora):
--
--   y = x W^T + s * dropout(x) A^T B^T
--
-- dropout is inverted dropout with probability p, active while the set is training; its masks
-- are Philox draws numbered in call order (set.draws), so a run is reproducible and a mask is
-- recomputed in backward instead of being kept.
--
-- The modules find adapters through their store: store.lora = set (attach), and
-- store:adapter(name) returns the adapter of a module or nil. lunar.nn.Linear and the MoE
-- experts' gemms call
--
--   local saved = lora.forward(ad, x, y)                -- y += s * dropout(x) A^T B^T
--   lora.backward(ad, dy, saved, x, dx[, which])       -- dA, dB += ...; dx += (if dx)
--
-- where x is the module's input, given again to backward (the MoE recomputes it rather than
-- keeping it), and which = 'params' | 'input' restricts backward to one half (default both).
-- lunar.peft builds sets from target patterns and reads and writes PEFT's file format.
--
-- Tensor parallel (ad.tp = {dim =, start =, len =, full =}: the block of the module's weight this
-- rank holds; ad.tp_partial: the module's weight is whole but its gradient is this rank's share):
-- on a column-parallel module (weight rows split, dim 1) B holds the same rows and A is whole, so
-- x A^T is the same on every rank and B's rows give this rank's outputs; on a row-parallel one
-- (columns split, dim 2) A holds the same columns and B is whole, and the partial x_r A_r^T B^T
-- add up over tp with the module's partial outputs (one all-reduce, the module's). A of a column-
-- parallel module, B of a row-parallel one and both of a tp-partial module get only this rank's
-- share of their gradient (M.tp_partial); their sum over tp is the gradient.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local Params = require 'lunar.nn.params'

local fail = tensor.fail

local M = {}

local Set = {}
Set.__index = Set
M.Set = Set

-- lora.new_set{seed = 0, dtype = 'f32'} -> an empty adapter set (training mode)
function M.new_set(opts)
    opts = opts or {}
    local seed = opts.seed or 0
    return setmetatable({
        params = Params.new(),   -- adapter tensors, all trainable
        modules = {},            -- module name -> adapter
        order = {},              -- module names in the order they were added
        training = true,
        seed = seed,
        rng = core.rng_new(seed):split('lora_dropout'),
        draws = 0,               -- dropout masks drawn so far (part of the resumable state)
        dtype = opts.dtype or 'f32',
    }, Set)
end

-- set:add(name, out_features, in_features, {r =, alpha =, dropout = 0, rslora = false, A =, B =,
-- init_rng =, device =, a_cols =}) -> adapter. A, B: tensors to copy (a loaded adapter); otherwise A
-- is kaiming-uniform like PEFT (bound 1/sqrt(in), from init_rng split by the module name) and B
-- zero. a_cols = {start =, len =, full =}: A is columns [start, start + len) of the A a module with
-- `full` inputs would draw (a row-parallel module's block; in_features = len).
function Set:add(name, out_f, in_f, o)
    if self.modules[name] then fail(('lora: module %s already has an adapter'):format(name)) end
    local r, alpha, p = o.r, o.alpha, o.dropout or 0
    if type(r) ~= 'number' or r < 1 or r ~= math.floor(r) then
        fail(('lora %s: r must be a positive integer, got %s'):format(name, tostring(r)))
    end
    if type(alpha) ~= 'number' or alpha ~= alpha then fail(('lora %s: alpha must be a number, got %s'):format(name, tostring(alpha))) end
    if type(p) ~= 'number' or p < 0 or p >= 1 then
        fail(('lora %s: dropout must be in [0, 1), got %s'):format(name, tostring(p)))
    end
    local dev = o.device or 'cpu'
    local A = core.empty({r, in_f}, self.dtype, dev)
    local B = core.empty({out_f, r}, self.dtype, dev)
    if o.A then
        A:copy_(o.A)
        B:copy_(o.B)
    else
        local full = o.a_cols and o.a_cols.full or in_f
        local bound = 1 / math.sqrt(full)     -- kaiming_uniform_(a = sqrt(5)): gain sqrt(1/3) * sqrt(3 / in)
        local rng = o.init_rng or core.rng_new(self.seed):split('lora_init')
        if o.a_cols then
            local whole = core.empty({r, full}, self.dtype, dev)
            rng:split(name):uniform_(whole, -bound, bound)
            A:copy_(whole:narrow(2, o.a_cols.start + 1, o.a_cols.len))
            whole:free()
        else
            rng:split(name):uniform_(A, -bound, bound)
        end
        B:fill_(0)
    end
    local ad = {
        name = name, set = self, r = r, alpha = alpha, dropout = p, rslora = o.rslora and true or false,
        scale = o.rslora and alpha / math.sqrt(r) or alpha / r,
        a_name = name .. '.lora_A.weight', b_name = name .. '.lora_B.weight',
        out_features = out_f, in_features = in_f,
    }
    self.params:add(ad.a_name, A, true)
    self.params:add(ad.b_name, B, true)
    self.modules[name] = ad
    self.order[#self.order + 1] = name
    return ad
end

function Set:get(name) return self.modules[name] end
function Set:train(on) self.training = on ~= false; return self end
function Set:eval() self.training = false; return self end

-- {seed =, draws =}: what a checkpoint needs to continue the dropout stream
function Set:rng_state() return {seed = self.seed, draws = self.draws} end
function Set:set_rng_state(s)
    self.seed, self.draws = s.seed, s.draws
    self.rng = core.rng_new(s.seed):split('lora_dropout')
end

-- tensor parallel: the adapter tensors whose gradient is this rank's share (see the header), in
-- the set's order
function M.tp_partial(set)
    local out = {}
    for _, name in ipairs(set.order) do
        local ad = set.modules[name]
        if ad.tp_partial or (ad.tp and ad.tp.dim == 1) then out[#out + 1] = ad.a_name end
        if ad.tp_partial or (ad.tp and ad.tp.dim == 2) then out[#out + 1] = ad.b_name end
    end
    return out
end

-- tensor parallel: {name = {dim =, start =, len =, full =}} of the adapter tensors split over tp
-- (B's rows of a column-parallel module, A's columns of a row-parallel one)
function M.tp_slices(set)
    local out = {}
    for _, name in ipairs(set.order) do
        local ad = set.modules[name]
        if ad.tp then out[ad.tp.dim == 1 and ad.b_name or ad.a_name] = ad.tp end
    end
    return out
end

-- W + scale * B A for one adapter, in f32 (out, in)
function M.delta(ad)
    local P = ad.set.params
    return ops.gemm(P:get(ad.b_name):to('f32'), P:get(ad.a_name):to('f32'), {alpha = ad.scale})
end

-- store.lora = set; the modules of that store then run the adapters
function M.attach(store, set)
    if store.lora and store.lora ~= set then fail('lora: the parameter store already has an adapter set (detach it first)') end
    store.lora = set
    return set
end

function M.detach(store) store.lora = nil end

-- the dropout mask of draw k for an input of x's shape: 0 or 1 / (1 - p), f32
local function mask_of(ad, k, x)
    local u = core.empty(x:size(), 'f32', x:device())
    ad.set.rng:split(k):uniform_(u)
    return ops.mul(ops.ge(u, ad.dropout, {dtype = 'f32'}), 1 / (1 - ad.dropout), {out = u})
end

local function as(x, dt) if x:dtype() ~= dt then return x:to(dt) end return x end

-- out += s * dropout(x) A^T B^T; x (n, in), out (n, out). Returns what backward needs.
-- opts.row_invariant: both products row-invariant (lunar.ops.gemm; generation's decode steps)
function M.forward(ad, x, out, opts)
    local ri = opts and opts.row_invariant or nil
    local set = ad.set
    local A, B = set.params:get(ad.a_name), set.params:get(ad.b_name)
    local xd = as(x, A:dtype())
    local draw
    if ad.dropout > 0 and set.training then
        set.draws = set.draws + 1
        draw = set.draws
        xd = ops.mul(xd, mask_of(ad, draw, x))
    end
    local xa = ops.gemm(xd, A, {trans_b = true, row_invariant = ri})                  -- (n, r)
    local d = ops.gemm(xa, B, {trans_b = true, alpha = ad.scale, row_invariant = ri})  -- (n, out)
    ops.add_(out, d)
    d:free()
    return {xa = xa, draw = draw}
end

-- Gradients of the adapter path for the output gradient dy (n, out) and the input x (n, in) of
-- forward: dB += s dy^T xa, dA += (s dy B)^T dropout(x) (which ~= 'input'); dx += mask * (s dy B) A
-- (dx given and which ~= 'params').
function M.backward(ad, dy, saved, x, dx, which)
    local P = ad.set.params
    local A, B = P:get(ad.a_name), P:get(ad.b_name)
    local dt = A:dtype()
    local dyc = as(dy, dt)
    local mask = saved.draw and mask_of(ad, saved.draw, x) or nil
    local dxa = ops.gemm(dyc, B, {alpha = ad.scale})                -- (n, r)
    if which ~= 'input' then
        local gB = P:grad(ad.b_name)
        if gB then ops.gemm(dyc, saved.xa, {trans_a = true, alpha = ad.scale, beta = 1, out = gB}) end
        local gA = P:grad(ad.a_name)
        if gA then
            local xd = as(x, dt)
            if mask then xd = ops.mul(xd, mask) end
            ops.gemm(dxa, xd, {trans_a = true, beta = 1, out = gA})
        end
    end
    if which ~= 'params' and dx then
        local t = ops.gemm(dxa, A)                                   -- (n, in)
        if mask then ops.mul(t, mask, {out = t}) end
        ops.add_(dx, t)
        t:free()
    end
    dxa:free()
    if mask then mask:free() end
end

return M
