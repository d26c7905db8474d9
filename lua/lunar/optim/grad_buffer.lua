-- lunar.optim.grad_buffer: the gradients of a parameter store in one flat buffer, reduced over a
-- data-parallel group in buckets that start while backward is still running.
--
--   local gb = grad_buffer.new(store, {group = dp_group, shard = true, bucket_elems = 4 * 2^20, model = model})
--   gb:watch(model)                 -- lets each decoder layer's backward say its gradients are done
--   ... forward/backward of the micro-batches but the last ...
--   gb:arm()                        -- the next backward is the step's last: reduce as it goes
--   model:backward()
--   gb:finish()                     -- starts what is left, waits for every bucket
--   -- shard = false: every gradient is the sum over the group (an all-reduce per bucket)
--   -- shard = true:  gb.shard_grad (shard elements) is the sum of this rank's slice of the
--   --                flat buffer (a reduce-scatter per bucket); the rest is this rank's own
--
-- Layout: the trainable parameters in the order backward completes them, each at an offset of
-- the flat buffer (grad_dtype, f32 by default), padded to a multiple of the group size: with
-- opts.model, the decoder layers' parameters from the last layer to the first, then the others
-- (embedding, final norm, lm_head, the MTP layer) in registration order; without it, the
-- registration order. Rank r owns the elements [r * shard, (r + 1) * shard) (Megatron's
-- distributed optimizer, one contiguous slice per rank). Buckets are consecutive runs of about
-- bucket_elems elements from the start of the buffer; the last one also holds the padding. A
-- bucket starts as soon as all its parameters are complete, whatever the others do.
--
-- The store's gradients become views of the buffer (store:hold_grads): store:grad(name) hands out
-- the view (zero on first use) and records that the parameter got a gradient on this rank. A parameter "has a
-- gradient" for the optimizer when any rank of the group gave it one (finish() exchanges the
-- marks), which is what one rank computing the whole global batch would see (an expert that
-- received no token on one rank but some on another still gets its update).
--
-- Overlap: watch(model) asks the model to say when the backward of each decoder layer is done
-- (model:on_layer_backward), so when layer i is done its parameters count as complete; a bucket
-- starts (non-blocking MPI_Iallreduce / MPI_Ireduce_scatter, or NCCL on the tensor's stream)
-- once all its parameters are complete, and every layer boundary tests the pending requests, which
-- is what moves data in MPI implementations without a progress thread. Whatever the hooks did not
-- start (the embedding, the final norm and lm_head, which complete only at the end) starts in
-- finish(). The hooks change when a reduction starts, never what it reduces.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local dist = require 'lunar.dist'

local fail = tensor.fail

local M = {}

local DTYPE_BYTES = {f64 = 8, f32 = 4, bf16 = 2, f16 = 2, i64 = 8, i32 = 4, i8 = 1, u8 = 1, bool = 1, f8e4m3 = 1,
                     f8e5m2 = 1}
-- bytes of a tensor's elements
function M.nbytes(t) return t:numel() * (DTYPE_BYTES[t:dtype()] or 4) end
function M.dtype_bytes(dtype) return DTYPE_BYTES[dtype] or 4 end

local Buffer = {}
Buffer.__index = Buffer

local layer_of
local layer_names = setmetatable({}, {__mode = 'k'})   -- model -> {layer name = index}

M.DEFAULT_BUCKET_ELEMS = 4 * 2 ^ 20

-- new(store, {group =, shard = false, bucket_elems = 4M, model =, filter =, tp =}) -> buffer
-- tp = {group =, partial = {name = true}}: tensor parallel; each named gradient is only this
-- rank's share (model:tp_partial_grads()) and is all-reduced over tp when its parameter is
-- complete in the step's last backward, before its bucket starts.
-- filter(name) -> bool: the parameters this buffer holds (default: every trainable one). Several
-- buffers over disjoint parts of one store (expert parallel: the routed experts reduce over edp,
-- the rest over dp) each hand out their own views; a name no buffer holds gets the store's own
-- gradient.
function M.new(store, o)
    o = o or {}
    local g = o.group
    if not dist.is_group(g) then fail('grad_buffer.new: group must be a process group') end
    local size, rank = g:size(), g:rank()
    local entries, total, dtype, device = {}, 0, nil, nil
    for _, name in ipairs(M.completion_order(store, o.model)) do
        if store:is_trainable(name) and (not o.filter or o.filter(name)) then
            local p = store:get(name)
            if not p:is_contiguous() then
                fail(('grad_buffer: parameter %s is not contiguous; the flat gradient buffer needs contiguous parameters')
                    :format(name))
            end
            dtype, device = dtype or p:dtype(), device or p:device()
            if p:dtype() ~= dtype then
                fail(('grad_buffer: parameter %s is %s but the others are %s: the data-parallel optimizer gathers '
                    .. 'parameters of one dtype'):format(name, p:dtype(), dtype))
            end
            entries[#entries + 1] = {name = name, param = p, offset = total, numel = p:numel(), shape = p:size(),
                                     index = #entries + 1}
            total = total + p:numel()
        end
    end
    if #entries == 0 then fail('grad_buffer: the store has no trainable parameter') end
    local shard = math.ceil(total / size)
    local padded = shard * size
    local flat = core.persist(core.empty({padded}, store.grad_dtype or 'f32', device):fill_(0))
    flat:set_name('grad_buffer')
    local self = setmetatable({store = store, group = g, rank = rank, size = size, shard = o.shard and true or false,
        tp = o.tp,
        entries = entries, by_name = {}, total = total, padded = padded, shard_elems = shard,
        lo = rank * shard, hi = (rank + 1) * shard, flat = flat, param_dtype = dtype, device = device,
        touched = {}, armed = false, requests = {}, watched = false}, Buffer)
    for _, e in ipairs(entries) do
        -- a gradient the store already holds (none in a fresh run) carries over into the buffer
        local old = store.grads[e.name]
        e.grad = flat:narrow(1, e.offset + 1, e.numel):view(e.shape)
        if old then
            e.grad:copy_(old)
            self.touched[e.index] = true
            store.grads[e.name] = e.grad
        end
        self.by_name[e.name] = e
    end
    if self.shard then
        self.shard_grad = core.persist(core.empty({shard}, flat:dtype(), device):fill_(0))
        self.shard_grad:set_name('grad_buffer.shard')
    end
    self:_make_buckets(o.bucket_elems or M.DEFAULT_BUCKET_ELEMS)
    -- the store hands out views of the buffer from now on (frozen parameters still get nil)
    store:hold_grads(self)
    return self
end

-- the store's view of parameter `name`'s gradient when this buffer holds it (and the mark that it
-- got one on this rank), else nil (Params:hold_grads)
function Buffer:grad_of(name, store)
    local e = self.by_name[name]
    if not e then return nil end
    if not self.touched[e.index] then
        self.touched[e.index] = true
        store.grads[name] = e.grad
    end
    return e.grad
end

function Buffer:holds(name) return self.by_name[name] ~= nil end
function Buffer:zero() self.flat:fill_(0) end

-- the index in model.layers of the decoder layer that owns parameter `name` (its name starts with
-- the layer's name and a dot: "model.layers.3.mlp..." is layer "model.layers.3"), or nil
function layer_of(model, name)
    if type(model) ~= 'table' or type(model.layers) ~= 'table' then return nil end
    local index = layer_names[model]
    if not index then
        index = {}
        for i, L in ipairs(model.layers) do
            if type(L.name) == 'string' then index[L.name] = i end
        end
        layer_names[model] = index
    end
    local prefix = name:match('^(.-%.%d+)%.')
    return prefix and index[prefix]
end

-- the store's names in the order a backward of `model` completes their gradients (see the
-- header); the registration order without a model
function M.completion_order(store, model)
    local by_layer, rest = {}, {}
    for name in store:names() do
        local i = layer_of(model, name)
        if i then
            by_layer[i] = by_layer[i] or {}
            table.insert(by_layer[i], name)
        else
            rest[#rest + 1] = name
        end
    end
    local names = {}
    for i = (type(model) == 'table' and type(model.layers) == 'table') and #model.layers or 0, 1, -1 do
        for _, name in ipairs(by_layer[i] or {}) do names[#names + 1] = name end
    end
    for _, name in ipairs(rest) do names[#names + 1] = name end
    return names
end

-- consecutive runs of about `cap` elements from the start of the buffer
function Buffer:_make_buckets(cap)
    if type(cap) ~= 'number' or cap < 1 then fail('grad_buffer: bucket_elems must be a positive number') end
    local buckets, cur = {}, nil
    for i, e in ipairs(self.entries) do
        if not cur then cur = {lo = e.offset, entries = {}} end
        cur.entries[#cur.entries + 1] = e
        cur.hi = e.offset + e.numel
        e.bucket = #buckets + 1
        if cur.hi - cur.lo >= cap or i == #self.entries then
            if i == #self.entries then cur.hi = self.padded end
            buckets[#buckets + 1] = cur
            cur = nil
        end
    end
    for _, b in ipairs(buckets) do
        b.view = self.flat:narrow(1, b.lo + 1, b.hi - b.lo)
        if self.shard then
            -- each rank's piece of the bucket: the overlap with its slice
            b.counts = {}
            for j = 0, self.size - 1 do
                local a, z = math.max(b.lo, j * self.shard_elems), math.min(b.hi, (j + 1) * self.shard_elems)
                b.counts[j + 1] = math.max(0, z - a)
            end
            local mine = b.counts[self.rank + 1]
            if mine > 0 then
                b.out = self.shard_grad:narrow(1, math.max(b.lo, self.lo) - self.lo + 1, mine)
            else
                b.out = core.persist(core.empty({0}, self.flat:dtype(), self.device))
            end
        end
    end
    self.buckets = buckets
end

-- watch(model): each decoder layer's backward marks its parameters complete (see the header;
-- the model calls the function given to its on_layer_backward when a layer's backward is done)
function Buffer:watch(model)
    if self.watched or type(model) ~= 'table' or type(model.on_layer_backward) ~= 'function' then return self end
    self.watched = true
    local lists = {}
    for _, e in ipairs(self.entries) do
        local i = layer_of(model, e.name)
        if i then
            lists[i] = lists[i] or {}
            table.insert(lists[i], e)
        end
    end
    model:on_layer_backward(function(i)
        if self.armed and lists[i] then self:_complete(lists[i]) end
    end)
    return self
end

-- arm(): the next backward is the step's last; its completed buckets are reduced as it goes
function Buffer:arm()
    for _, b in ipairs(self.buckets) do b.missing, b.started = #b.entries, false end
    self.done = {}
    self.started = 0
    self.armed = true
end

function Buffer:_start(b)
    b.started = true
    local req
    if self.shard then
        req = dist.reduce_scatter_start(b.view, b.counts, {group = self.group, out = b.out})
    else
        req = dist.all_reduce_start(b.view, {group = self.group})
    end
    self.requests[#self.requests + 1] = req
end

-- entries complete: start the buckets that are whole (in bucket order; the completions come in
-- the same order on every rank, so the ranks start the same collectives in the same order), and
-- let MPI move the ones in flight
function Buffer:_complete(list)
    for _, e in ipairs(list) do
        if not self.done[e.index] then
            self.done[e.index] = true
            if self.tp and self.tp.partial[e.name] then dist.all_reduce(e.grad, {group = self.tp.group}) end
            local b = self.buckets[e.bucket]
            b.missing = b.missing - 1
        end
    end
    for _, b in ipairs(self.buckets) do
        if b.missing == 0 and not b.started then
            self:_start(b)
            self.started = self.started + 1
        end
    end
    for _, r in ipairs(self.requests) do r:test() end
end

-- finish(): starts what is left, waits for every bucket, and agrees on which parameters have a
-- gradient. Returns the number of buckets the hooks started before backward ended.
function Buffer:finish()
    if not self.armed then fail('grad_buffer:finish: arm() was not called before the last backward') end
    local early = self.started
    self:_complete(self.entries)
    self.armed = false
    for i, r in ipairs(self.requests) do
        r:wait()
        self.requests[i] = nil
    end
    -- which parameters got a gradient on any rank (u8 max over the group)
    local marks = {}
    for i = 1, #self.entries do marks[i] = self.touched[i] and 1 or 0 end
    local t = dist.all_reduce(core.from_flat(marks, {#marks}, 'u8', 'cpu'), {op = 'max', group = self.group})
    local any = t:tolist_flat()
    for i, e in ipairs(self.entries) do
        if any[i] ~= 0 and not self.touched[i] then
            self.touched[i] = true
            self.store.grads[e.name] = e.grad
        end
    end
    self.last_early = early
    return early
end

function Buffer:has_grad(e) return self.touched[e.index] == true end

-- the parameters, gathered after a sharded update: each rank's slice of `values` (param dtype,
-- padded elements) is its updated parameters; values is all-gathered and copied into every
-- parameter. Uses the gradient buffer when the dtypes agree (its gradients are spent by then)
-- and zeroes it again.
function Buffer:gather_params(fill_mine)
    local reuse = self.param_dtype == self.flat:dtype()
    local buf = reuse and self.flat or self.param_buf
    if not buf then
        buf = core.persist(core.empty({self.padded}, self.param_dtype, self.device):fill_(0))
        self.param_buf = buf
    end
    local mine = buf:narrow(1, self.lo + 1, self.shard_elems)
    fill_mine(mine)
    dist.all_gather(mine, {group = self.group, out = buf})
    for _, e in ipairs(self.entries) do
        e.param:view(e.numel):copy_(buf:narrow(1, e.offset + 1, e.numel))
    end
    if reuse then self.flat:fill_(0) end
end

-- bytes held: {grads = the flat buffer (+ the shard's reduced gradients), params = the store's
-- trainable parameters}
function Buffer:bytes()
    local g = M.nbytes(self.flat)
    if self.shard_grad then g = g + M.nbytes(self.shard_grad) end
    if self.param_buf then g = g + M.nbytes(self.param_buf) end
    return {grads = g}
end

return M
