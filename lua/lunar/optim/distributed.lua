-- lunar.optim.distributed: AdamW with its state sharded over a data-parallel group (Megatron's
-- distributed optimizer, ZeRO stage 1).
--
--   local gb = grad_buffer.new(store, {group = dp, shard = true})
--   local opt = distributed.new(store, gb, adamw_opts)     -- the options of optim.AdamW.new
--   ... backward into gb (gb:arm() before the last, gb:finish() after) ...
--   local info = opt:step{loss = global_loss}               -- the same info as AdamW:step
--   opt:zero_grad()
--
-- Rank r owns the elements [r * shard, (r + 1) * shard) of the flattened trainable parameters
-- (grad_buffer's layout); a parameter that straddles a boundary is split into pieces. For each
-- piece it owns, a rank keeps exp_avg and exp_avg_sq (f32) and, for a parameter that is not f32,
-- the f32 master copy, so the optimizer state of a rank is 1/dp of one rank's (plus the padding
-- of the last slice). A step:
--   1. the gradients were reduce-scattered by the buffer: gb.shard_grad is the sum over the group
--      of this rank's slice (each rank divided its loss by the global token count, so the sum is
--      the gradient of the global mean);
--   2. the global gradient norm: the squares of every slice summed over the group (one f64
--      all-reduce), so clipping sees the same norm as one rank with the whole batch;
--   3. AdamW (lunar.ops.adamw_step, the update of optim.AdamW) on this rank's pieces, with the
--      lr, decay and step count of each parameter as AdamW has them;
--   4. the updated slices all-gathered into every rank's parameters.
-- The loss it is given must be the global one (the same on every rank): a non-finite loss or
-- norm is skipped on every rank together.
--
-- Checkpoints: state_dict() is what every rank shares (the counters, the schedule, and the
-- manifest: the flat layout and each rank's pieces, {name, start, len} with start 0-based in the
-- flattened parameter); shard_state() is this rank's tensors (exp_avg.<name>, exp_avg_sq.<name>,
-- master.<name> of its pieces, step.<name> their update counts), written to a file of its own.
-- load_state_dict(sd, {shard = tensors}) takes both back; the manifest must describe this
-- layout. In another layout (dp, tp, ep, etp) lunar.optim.reshard reads the shards instead,
-- through the places shard_state writes beside each piece.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local dist = require 'lunar.dist'
local AdamW = require 'lunar.optim.adamw'
local grad_buffer = require 'lunar.optim.grad_buffer'
local reshard = require 'lunar.optim.reshard'

local fail = tensor.fail

local M = {}

local Dist = setmetatable({}, {__index = AdamW})
Dist.__index = Dist
M.DistributedAdamW = Dist

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end
local function f32(x) return core.from_flat({x}, {}, 'f32', 'cpu'):item() end

-- the pieces of rank `rank`'s slice: {entry =, name =, start = 0-based offset in the parameter,
-- len =, at = 0-based offset in the slice}
local function pieces_of(buffer, rank)
    local lo, hi = rank * buffer.shard_elems, (rank + 1) * buffer.shard_elems
    local list = {}
    for _, e in ipairs(buffer.entries) do
        local a, z = math.max(e.offset, lo), math.min(e.offset + e.numel, hi)
        if z > a then list[#list + 1] = {entry = e, name = e.name, start = a - e.offset, len = z - a, at = a - lo} end
    end
    return list
end

-- new(store, buffer, adamw_opts) -> optimizer (buffer: a grad_buffer made with shard = true)
function M.new(store, buffer, o)
    if type(buffer) ~= 'table' or not buffer.shard then
        fail('distributed.new: expected a grad_buffer made with shard = true')
    end
    local self = AdamW.new(store, o)
    setmetatable(self, Dist)
    self.buffer = buffer
    self.group = buffer.group
    -- where each parameter's block sits in the whole tensor ({name = {dim =, start =, len =}} of
    -- the ones split by tp or etp): written with the shards so that another layout can read them
    self.slices = o.slices or {}
    self.pieces = pieces_of(buffer, buffer.rank)
    for _, pc in ipairs(self.pieces) do
        pc.param = pc.entry.param:view(pc.entry.numel):narrow(1, pc.start + 1, pc.len)
        pc.grad = buffer.shard_grad:narrow(1, pc.at + 1, pc.len)
    end
    return self
end

local function new_piece_state(pc)
    local st = {step = 0}
    st.exp_avg = core.persist(core.empty({pc.len}, 'f32', pc.param:device()):fill_(0))
    st.exp_avg_sq = core.persist(core.empty({pc.len}, 'f32', pc.param:device()):fill_(0))
    if pc.param:dtype() ~= 'f32' then st.master = core.persist(core.convert(pc.param, 'f32')) end
    return st
end

function Dist:step(o)
    o = o or {}
    local accum = o.micro_batches or self.accum
    local info = {step = self.step_count, skipped = false}
    core.sync_check(self.buffer.device)
    local loss = o.loss
    if tensor.is_tensor(loss) then loss = loss:item() end
    local function skip(reason) return self:_skip(info, reason) end
    if loss ~= nil and not finite(loss) then return skip('loss') end
    -- the global norm: this slice's sum of squares, summed over the group (untouched parameters
    -- and the padding are zeros in every slice)
    local norm = o.grad_norm
    if norm == nil then norm = f32(math.sqrt(self:grad_sq()) / accum) end
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
    for _, pc in ipairs(self.pieces) do
        if self.buffer:has_grad(pc.entry) then
            local st = self.state[pc.name]
            if not st then
                st = new_piece_state(pc)
                self.state[pc.name] = st
            end
            st.step = st.step + 1
            local s = self:setting(pc.name)
            ops.adamw_step(pc.param, pc.grad, st.exp_avg, st.exp_avg_sq, {lr = s.lr * factor, step = st.step,
                beta1 = self.beta1, beta2 = self.beta2, eps = self.eps, weight_decay = s.weight_decay,
                grad_scale = gscale, master = st.master})
        end
    end
    local pieces = self.pieces
    self.buffer:gather_params(function(slice)
        for _, pc in ipairs(pieces) do slice:narrow(1, pc.at + 1, pc.len):copy_(pc.param) end
    end)
    self.step_count = self.step_count + 1
    info.step = self.step_count
    info.lr = self.lr * factor
    return info
end

function Dist:zero_grad() self.buffer.flat:fill_(0) end

-- the sum of squares of the group's gradients (every slice's, summed over the group). Tensor
-- parallel (adamw opts.tp = {group =, split = {name = true}}): the split parameters' pieces are
-- summed over tp as well, the whole ones counted once.
function Dist:grad_sq()
    if not self.tp then
        local mine = ops.global_norm({self.buffer.shard_grad})
        return dist.all_reduce(core.from_flat({mine * mine}, {1}, 'f64', 'cpu'), {group = self.group}):item()
    end
    local whole, split = {}, {}
    for _, pc in ipairs(self.pieces) do
        if self.tp.split[pc.name] then split[#split + 1] = pc.grad else whole[#whole + 1] = pc.grad end
    end
    local w = #whole > 0 and ops.global_norm(whole) or 0
    local s = #split > 0 and ops.global_norm(split) or 0
    local t = dist.all_reduce(core.from_flat({w * w, s * s}, {2}, 'f64', 'cpu'), {group = self.group}):tolist_flat()
    return t[1] + dist.all_reduce(core.from_flat({t[2]}, {1}, 'f64', 'cpu'), {group = self.tp.group}):item()
end

-- bytes of the optimizer state this rank holds, counted from its tensors
function Dist:state_bytes()
    local n = 0
    for _, st in pairs(self.state) do
        for _, k in ipairs({'exp_avg', 'exp_avg_sq', 'master'}) do
            if st[k] then n = n + grad_buffer.nbytes(st[k]) end
        end
    end
    return n
end

-- what the state will hold once every piece of this rank has been updated
function Dist:planned_state_bytes()
    local n = 0
    for _, pc in ipairs(self.pieces) do n = n + pc.len * (8 + (pc.param:dtype() ~= 'f32' and 4 or 0)) end
    return n
end

-- ---- checkpoints --------------------------------------------------------------------------------

-- the layout every rank can check against: {dp =, numel =, padded =, shard =, ranks = {{rank =,
-- pieces = {{name =, start =, len =}, ...}}, ...}}
function Dist:manifest()
    local b = self.buffer
    local ranks = {}
    for r = 0, b.size - 1 do
        local list = {}
        for i, pc in ipairs(pieces_of(b, r)) do list[i] = {name = pc.name, start = pc.start, len = pc.len} end
        ranks[r + 1] = {rank = r, lo = r * b.shard_elems, hi = (r + 1) * b.shard_elems, pieces = list}
    end
    return {dp = b.size, numel = b.total, padded = b.padded, shard = b.shard_elems, ranks = ranks}
end

function Dist:state_dict()
    local sd = AdamW.state_dict(self)
    sd.tensors = {}
    sd.scalars.param_steps = nil
    sd.scalars.distributed = self:manifest()
    return sd
end

-- this rank's tensors: {['exp_avg.<name>'] =, ['exp_avg_sq.<name>'] =, ['master.<name>'] =,
-- ['step.<name>'] = (1) i64, ['place.<name>'] = the piece in global coordinates
-- (lunar.optim.reshard.place: what another layout needs to read it)}
function Dist:shard_state()
    local tensors = {}
    local buffer_id = reshard.buffer_id(self.group)
    for _, pc in ipairs(self.pieces) do
        local st = self.state[pc.name]
        if st then
            tensors['exp_avg.' .. pc.name] = st.exp_avg
            tensors['exp_avg_sq.' .. pc.name] = st.exp_avg_sq
            if st.master then tensors['master.' .. pc.name] = st.master end
            tensors['step.' .. pc.name] = core.from_flat({st.step}, {1}, 'i64', 'cpu')
            tensors['place.' .. pc.name] = reshard.place(pc.start, pc.len, pc.entry.param:size(),
                self.slices[pc.name], buffer_id)
        end
    end
    return tensors
end

-- the first difference between a saved manifest and this layout, or nil
local function layout_difference(saved, now, rank, names_differ)
    if type(saved) ~= 'table' then return 'it was written without a distributed optimizer' end
    if saved.dp ~= now.dp then return ('it was written at dp=%s, this run has dp=%d'):format(tostring(saved.dp), now.dp) end
    if saved.numel ~= now.numel then
        return ('its parameters have %s elements, this model\'s %d'):format(tostring(saved.numel), now.numel)
    end
    local a, b = saved.ranks and saved.ranks[rank + 1], now.ranks[rank + 1]
    if not a or #a.pieces ~= #b.pieces then return ('rank %d holds other pieces'):format(rank) end
    for i, pc in ipairs(b.pieces) do
        local q = a.pieces[i]
        if (q.name ~= pc.name and not names_differ) or q.start ~= pc.start or q.len ~= pc.len then
            return ('rank %d: piece %d is %s [%s, +%s) in the checkpoint, %s [%d, +%d) here'):format(rank, i,
                tostring(q.name), tostring(q.start), tostring(q.len), pc.name, pc.start, pc.len)
        end
    end
    return nil
end

-- load_state_dict(sd, {shard = tensors of this rank's file, names_differ =}): names_differ (expert
-- parallel: the manifest is rank 0's, whose experts have other names) compares the pieces' places
-- and sizes only
function Dist:load_state_dict(sd, o)
    o = o or {}
    if type(sd) ~= 'table' or type(sd.scalars) ~= 'table' then
        fail('DistributedAdamW:load_state_dict: expected {tensors = {...}, scalars = {...}}')
    end
    local why = layout_difference(sd.scalars.distributed, self:manifest(), self.buffer.rank, o.names_differ)
    if why then
        fail(('the optimizer state does not fit this run\'s parameters: %s (in the layout that wrote it, the '
            .. 'model or its trainable parameters differ; a state from another layout is read by lunar.optim.reshard)')
            :format(why))
    end
    local shard = o.shard
    if type(shard) ~= 'table' then fail('DistributedAdamW:load_state_dict: this rank\'s shard tensors are missing') end
    local fresh = {}
    for _, pc in ipairs(self.pieces) do
        local m, v = shard['exp_avg.' .. pc.name], shard['exp_avg_sq.' .. pc.name]
        local place = shard['place.' .. pc.name]
        if place then
            local ok, why = reshard.same_place(place, pc.start, pc.len, self.slices[pc.name])
            if not ok then
                fail(('the optimizer shard of rank %d: %s: %s'):format(self.buffer.rank, pc.name, why))
            end
        end
        if m or v then
            if not (m and v) then
                fail(('the optimizer shard of rank %d has %s but not %s'):format(self.buffer.rank,
                    m and ('exp_avg.' .. pc.name) or ('exp_avg_sq.' .. pc.name),
                    m and ('exp_avg_sq.' .. pc.name) or ('exp_avg.' .. pc.name)))
            end
            for _, t in ipairs({m, v}) do
                if t:numel() ~= pc.len then
                    fail(('the optimizer shard of rank %d: %s has %d elements, the piece %d'):format(self.buffer.rank,
                        pc.name, t:numel(), pc.len))
                end
            end
            local steps = shard['step.' .. pc.name]
            local st = {step = steps and steps:item() or (sd.scalars.step or 0)}
            st.exp_avg = core.persist(core.convert(m, 'f32', pc.param:device()))
            st.exp_avg_sq = core.persist(core.convert(v, 'f32', pc.param:device()))
            local master = shard['master.' .. pc.name]
            if pc.param:dtype() ~= 'f32' then
                st.master = core.persist(master and core.convert(master, 'f32', pc.param:device())
                    or core.convert(pc.param, 'f32'))
            end
            fresh[pc.name] = st
        end
    end
    self.state = fresh
    local sc = sd.scalars
    self.step_count = sc.step or 0
    self.skipped = sc.skipped or 0
    self.nonfinite_loss = sc.nonfinite_loss or 0
    self.nonfinite_grad = sc.nonfinite_grad or 0
    return self
end

return M
