-- lunar.train.data_parallel: what the training loop does differently when a recipe runs on
-- several ranks (mpirun -np N: data parallel over N / tp ranks, the heads and MLP widths split
-- over parallel.tp, the routed experts spread over parallel.ep and their matrices over
-- parallel.etp; pp = cp = 1; docs/parallel.md).
--
--   local dp = data_parallel.setup(cfg)      -- one process: data_parallel.single()
--   local opt = dp:optimizer(store, model, adamw_opts)
--   targets, tokens = dp:sum_counts(targets, tokens)
--   dp:before_backward(is_last); model:backward(); dp:after_backward(is_last)
--   loss = dp:sum(loss)
--
-- The global batch of a step is data.micro_batch x train.grad_accum x dp rows (Megatron's
-- convention): the loader hands rank r the rows [r * micro_batch, (r + 1) * micro_batch) of each
-- run of micro_batch x dp rows, so the step reads the same rows as one rank with micro_batch x dp
-- rows per micro-batch (or grad_accum x dp micro-batches). Every rank divides its loss by the
-- target count of the whole global batch (summed over the ranks before the forward), so the sum
-- of the ranks' gradients is the gradient of the global mean loss, and the step's loss is the sum
-- of the ranks' losses: the numbers one rank computes for the same rows, up to rounding.
--
-- Gradients go through lunar.optim.grad_buffer (one flat buffer, buckets reduced while backward
-- runs). With parallel.distributed_optimizer (the default) the buffer reduce-scatters and the
-- optimizer is lunar.optim.distributed (AdamW state sharded over the ranks, parameters
-- all-gathered after the update); without it the buffer all-reduces and every rank runs the same
-- AdamW on the same gradients.
local lunar = require 'lunar'
local core = require 'lunar.core'
local dist = require 'lunar.dist'
local lora = require 'lunar.nn.lora'
local AdamW = require 'lunar.optim.adamw'
local grad_buffer = require 'lunar.optim.grad_buffer'
local distributed = require 'lunar.optim.distributed'
local partitioned = require 'lunar.optim.partitioned'
local state = require 'lunar.parallel.state'

local M = {}

local DP = {}
DP.__index = DP

-- setup(cfg) -> the data-parallel state of the run: its layout (lunar.parallel.state) and what the
-- trainer does with it. On one rank (or with cfg.single_rank: this process trains alone even
-- under a launcher, as the tests' one-rank reference does) a state of one process, which does
-- what one rank does and never communicates (M.single).
function M.setup(cfg)
    local env = dist.env()
    if env.size <= 1 or cfg.single_rank then return M.single() end
    local p = cfg.parallel or {}
    local ps = state.new(p)
    local bucket_mb = p.bucket_mb or 16
    local self = setmetatable({layout = ps.layout, state = ps, group = ps.dp, rank = ps.dp:rank(), size = ps.dp:size(),
        world_rank = dist.rank(), distributed = p.distributed_optimizer ~= false,
        bucket_elems = math.max(1, math.floor(bucket_mb * 2 ^ 20 / 4)),
        ep = ps.ep, edp = ps.edp, etp = ps.etp, tp = ps.tp,
        sequence_parallel = ps.sequence_parallel, split_indexer = ps.split_indexer}, DP)
    return self
end

-- the options lunar.model.new / load take of the layout (tp, ep, etp groups; sequence parallel,
-- the split indexer)
function DP:model_opts() return self.state:model_opts() end

-- the layout a checkpoint records (and a resumed run compares; lunar.optim.reshard)
function DP:layout_record()
    return {dp = self.size, distributed_optimizer = self.distributed, ep = self.ep and self.ep:size() or nil,
            tp = self.tp and self.tp:size() or nil, etp = self.etp and self.etp:size() or nil,
            split_indexer = self.split_indexer or nil}
end

-- the checkpoint manager's group (every rank writes into one directory)
function DP:checkpoint_group() return dist.world() end

-- the devices the run's FLOP/s are counted over (metrics' flops_devices)
function DP:devices() return dist.world_size() end

-- expert parallel: the routed experts' parameters (and their adapters), reduced over edp
local function is_expert(name) return name:find('.mlp.experts.', 1, true) ~= nil end
M.is_expert = is_expert

function DP:is_main() return self.world_rank == 0 end

-- the optimizer over `store` (the model's parameters, or the LoRA adapters'), with its gradient
-- buffer watching `model`'s backward
-- (expert parallel: one buffer and optimizer for the routed experts over edp, one for the rest
-- over dp, stepped together with one gradient norm by lunar.optim.partitioned)
function DP:optimizer(store, model, adamw_opts)
    local experts = false
    if self.ep then
        for name in store:names() do
            if store:is_trainable(name) and is_expert(name) then experts = true break end
        end
    end
    -- tensor parallel: the gradients that are this rank's share (reduced over tp as they complete)
    -- and the split parameters (their blocks' squares add up over tp in the clipping norm)
    local tp_buf, tp_opt
    if self.tp then
        local partial, split = {}, {}
        for _, n in ipairs(model:tp_partial_grads()) do partial[n] = true end
        for n in pairs(model:tp_slices()) do split[n] = true end
        if model.params.lora then   -- LoRA: the adapters' blocks
            for n in pairs(lora.tp_slices(model.params.lora)) do split[n] = true end
        end
        tp_buf, tp_opt = {group = self.tp, partial = partial}, {group = self.tp, split = split}
    end
    -- expert tensor parallel: the experts' blocks' squares add up over etp in the clipping norm
    local etp_opt
    if self.etp then
        local split = {}
        for n in pairs(model:tp_slices('etp')) do split[n] = true end
        etp_opt = {group = self.etp, split = split}
    end
    -- where each split parameter's block sits in the whole one (the distributed optimizer writes
    -- it beside its state, for another layout to read: lunar.optim.reshard)
    local slices = {}
    for n, sl in pairs(model:tp_slices('tp')) do slices[n] = sl end
    for n, sl in pairs(model:tp_slices('etp')) do slices[n] = sl end
    if model.params.lora then for n, sl in pairs(lora.tp_slices(model.params.lora)) do slices[n] = sl end end
    local function part(group, filter, norm_opt)
        local buffer = grad_buffer.new(store, {group = group, shard = self.distributed, bucket_elems = self.bucket_elems,
                                               model = model, filter = filter, tp = tp_buf})
        buffer:watch(model)
        local o = {}
        for k, v in pairs(adamw_opts) do o[k] = v end
        o.filter, o.tp, o.slices = filter, norm_opt, slices
        local opt = self.distributed and distributed.new(store, buffer, o) or AdamW.new(store, o)
        return buffer, opt
    end
    -- A gradient buffer holds parameters of one dtype (it gathers them back flat), so a model that
    -- mixes dtypes (bf16 weights with the f32 routers) gets one part per dtype: the dtype of the
    -- most elements keeps the plain name, the others are named after theirs ('dense_f32').
    local function dtypes_of(class)
        local count, list = {}, {}
        for name in store:names() do
            if store:is_trainable(name) and (not class or class(name)) then
                local dt = store:get(name):dtype()
                if not count[dt] then list[#list + 1] = dt; count[dt] = 0 end
                count[dt] = count[dt] + store:get(name):numel()
            end
        end
        table.sort(list, function(a, b) if count[a] ~= count[b] then return count[a] > count[b] end return a < b end)
        return list
    end
    local parts = {}
    local function add(name, group, class, norm_opt, across)
        local dts = dtypes_of(class)
        -- a class with nothing to train (LoRA on the routed experts only: no dense adapter) gets
        -- no part; it is empty on every rank alike (the dense parameters are the same everywhere,
        -- and DP:check_adapters makes every ep member adapt the same projections)
        if #dts == 0 then return end
        for i, dt in ipairs(dts) do
            local filter = class
            if #dts > 1 then
                filter = function(n) return (not class or class(n)) and store:get(n):dtype() == dt end
            end
            local buffer, opt = part(group, filter, norm_opt)
            parts[#parts + 1] = {name = i == 1 and name or (name .. '_' .. dt), opt = opt, across = across,
                                 buffer = buffer}
        end
    end
    if experts then
        add('dense', self.group, function(name) return not is_expert(name) end, tp_opt)
        add('experts', self.edp, is_expert, etp_opt, self.ep)
    else
        add('dense', self.group, nil, tp_opt)
    end
    self.buffers, self.buffer, self.expert_buffer = {}, nil, nil
    for _, p in ipairs(parts) do
        self.buffers[#self.buffers + 1] = p.buffer
        if p.across then self.expert_buffer = self.expert_buffer or p.buffer else self.buffer = self.buffer or p.buffer end
    end
    if #parts == 0 then core.user_error('the model has no trainable parameter') end
    -- (a part reduced across ep alone still sums its norm over ep: partitioned does that)
    if #parts == 1 and not parts[1].across then return parts[1].opt end
    return partitioned.new(parts)
end

-- the elements of the whole model's tensors in `store` (the model's parameters or the LoRA
-- adapters'), counted from this rank's blocks: a tp or etp block stands for its group's blocks,
-- and the routed experts of the ep members add up (collective over ep)
function DP:whole_count(store, model)
    local factor = {}
    if self.tp then
        for n in pairs(model:tp_slices('tp')) do factor[n] = self.tp:size() end
        if model.params.lora then for n in pairs(lora.tp_slices(model.params.lora)) do factor[n] = self.tp:size() end end
    end
    if self.etp then for n in pairs(model:tp_slices('etp')) do factor[n] = self.etp:size() end end
    local dense, experts = 0, 0
    for name in store:names() do
        local n = store:get(name):numel() * (factor[name] or 1)
        if self.ep and is_expert(name) then experts = experts + n else dense = dense + n end
    end
    if self.ep then experts = dist.all_reduce(core.from_flat({experts}, {1}, 'f64', 'cpu'), {group = self.ep}):item() end
    return dense + experts
end

-- the elements of store as the whole model has them: dp:whole_count (a split model's blocks
-- stand for the whole; store:count() on one process)
function M.count(dp, store, model) return dp and dp:whole_count(store, model) or store:count() end

-- the largest peak memory of any rank (collective over the world): the process's peak resident
-- memory, or the peak of lunar's pool on `device` (not 'cpu')
function DP:peak_memory(device)
    local v
    if device and device ~= 'cpu' then
        local st = lunar.memory_stats(device)
        v = st and st.peak_in_use
    else
        v = require('lunar.train.metrics').process_peak_bytes()
    end
    return dist.all_reduce(core.from_flat({v or 0}, {1}, 'f64', 'cpu'), {group = dist.world(), op = 'max'}):item()
end

-- numbers over the ranks (f64): their largest
function DP:max(...)
    local v = {...}
    local t = dist.all_reduce(core.from_flat(v, {#v}, 'f64', 'cpu'), {group = self.group, op = 'max'})
    return unpack(t:tolist_flat())
end

-- numbers summed over the ranks (f64)
function DP:sum(...)
    local v = {...}
    local t = dist.all_reduce(core.from_flat(v, {#v}, 'f64', 'cpu'), {group = self.group})
    return unpack(t:tolist_flat())
end

function DP:sum_counts(targets, tokens) return self:sum(targets, tokens) end

function DP:before_backward(last)
    if last then for _, b in ipairs(self.buffers) do b:arm() end end
end
function DP:after_backward(last)
    if last then for _, b in ipairs(self.buffers) do b:finish() end end
end

-- true on every rank when any rank was asked to stop (a signal reaches the ranks at different
-- steps; they must write the checkpoint and stop at the same one)
function DP:any(flag)
    local t = dist.all_reduce(core.from_flat({flag and 1 or 0}, {1}, 'i32', 'cpu'), {op = 'max', group = dist.world()})
    return t:item() ~= 0
end

-- the step of the checkpoint each rank resumes (or -1) must be the same everywhere
function DP:check_same_checkpoint(st)
    local step = st and st.step or -1
    local t = dist.all_gather(core.from_flat({step}, {1}, 'i64', 'cpu'), {group = dist.world()}):tolist_flat()
    for r, s in ipairs(t) do
        if s ~= step then
            core.user_error(('rank %d resumes %s but rank %d resumes %s: every rank must see the same checkpoint '
                .. 'directory (a shared file system)'):format(self.world_rank, step >= 0 and ('step ' .. step) or
                'nothing', r - 1, s >= 0 and ('step ' .. s) or 'nothing'))
        end
    end
end

-- a block of a tensor split along dim (1 or 2) over group, whole again (the blocks in group order;
-- columns through the transposes' rows)
local function unsplit(t, dim, group)
    if dim == 1 then return dist.all_gather(t:contiguous(), {group = group}) end
    return dist.all_gather(t:t():contiguous(), {group = group}):t():contiguous()
end
M.unsplit = unsplit

-- the model whole, for writing it (collective: every rank calls it; each ep group gathers its
-- members' experts, each tp (etp) group its members' blocks). On world rank 0, the writer: a view
-- of `model` whose store holds this rank's parameters, the other members' experts and the split
-- tensors whole, in the one-rank order; save_hf writes what one rank would. The other ranks free
-- each gathered tensor at once (they only take part) and get `model` back.
function DP:gathered_model(model)
    if not self.ep and not self.tp then return model end
    local Params = require 'lunar.nn.params'
    local mspec = require 'lunar.model.spec'
    local ep = self.ep and self.ep:size() or 1
    local El = (model.cfg.n_routed_experts or 0) / ep
    local keep = dist.rank() == 0
    local others = {}
    -- tensor parallel: each split tensor whole again (its blocks all-gathered over tp, in spec order)
    if self.tp then
        local slices = model:tp_slices()
        for _, name in ipairs(model.params.order) do
            local sl = slices[name]
            if sl then
                local w = unsplit(model.params:get(name), sl.dim, self.tp)
                if keep then others[name] = w else w:free() end
            end
        end
    end
    local eslices = self.etp and model:tp_slices('etp') or {}
    for name in model.params:names() do
        local prefix, e, rest = name:match('^(.*%.mlp%.experts%.)(%d+)(%..*)$')
        if prefix and self.ep then
            local le = tonumber(e) % El
            local t = model.params:get(name):contiguous()
            -- expert tensor parallel: the expert whole first (its blocks over etp)
            if eslices[name] then t = unsplit(t, eslices[name].dim, self.etp) end
            local all = dist.all_gather(t, {group = self.ep})         -- (ep * rows, ...) in ep order
            local rows = t:size(1)
            if keep then
                for r = 0, ep - 1 do
                    others[prefix .. (r * El + le) .. rest] = all:narrow(1, r * rows + 1, rows)
                end
            else
                all:free()
            end
        end
    end
    local set = model.params.lora
    local adapters = set and self:_gathered_adapters(set, El)
    if not keep then return model end
    local full = Params.new()
    local spec = mspec.of(model.cfg, {mtp = #model.mtp > 0})   -- without its MTP layer when the model has none
    for _, s in ipairs(spec) do
        local t = others[s.name] or (model.params:has(s.name) and model.params:get(s.name))
        if not t then core.user_error(('gathering the experts: %s is missing'):format(s.name)) end
        full:add(s.name, t, model.params:has(s.name) and model.params:is_trainable(s.name) or false)
    end
    full.lora = adapters or nil
    return setmetatable({params = full, cfg = model.cfg, source = model.source}, {__index = model})
end

-- LoRA under tp / ep / etp: what a checkpoint's adapters need, without gathering the base model
-- (collective, like gathered_model): the adapters whole, over a store that holds every base
-- weight's name and shape only (lunar.peft.save reads the names and shapes to lay the adapter
-- file out as PEFT expects; each shape is one element broadcast, no memory)
function DP:adapters_view(model)
    if not self.ep and not self.tp then return model end
    local Params = require 'lunar.nn.params'
    local shapes = Params.new()
    for _, s in ipairs(require('lunar.model.spec').of(model.cfg, {mtp = #model.mtp > 0})) do
        local one = core.empty({1, 1, 1}, 'f32', 'cpu')
        local view = #s.shape == 3 and one:expand(s.shape[1], s.shape[2], s.shape[3])
            or #s.shape == 2 and one:view(1, 1):expand(s.shape[1], s.shape[2]) or one:view(1):expand(s.shape[1])
        shapes:add(s.name, view, false)
    end
    shapes.lora = self:_gathered_adapters(model.params.lora, (model.cfg.n_routed_experts or 0) / (self.ep and self.ep:size() or 1))
    return setmetatable({params = shapes, cfg = model.cfg, source = model.source}, {__index = model})
end

-- expert parallel with LoRA: every member of an ep group must adapt the same projections of its
-- experts (El per member; the adapters are gathered by local index); a target naming single
-- experts would not
function DP:check_adapters(set, model)
    if not self.ep then return end
    local El = model.cfg.n_routed_experts / self.ep:size()
    local h, n = 0, 0
    for _, name in ipairs(set.order) do
        local layer, e, rest = name:match('^model%.layers%.(%d+)%.mlp%.experts%.(%d+)%.(.*)$')
        if layer then
            local key = ('%s/%d/%s'):format(layer, tonumber(e) % El, rest)
            for i = 1, #key do h = (h * 31 + key:byte(i)) % 2147483647 end
            n = n + 1
        end
    end
    local t = dist.all_gather(core.from_flat({n, h}, {2}, 'f64', 'cpu'), {group = self.ep}):tolist_flat()
    for k = 3, #t, 2 do
        if t[k] ~= t[1] or t[k + 1] ~= t[2] then
            core.user_error(('parallel.ep=%d with LoRA: the ranks of an ep group adapt different experts (%d adapters on '
                .. 'member 0, %d on member %d): target the projections by name (gate_proj, up_proj, down_proj) so that '
                .. 'every expert has its adapter'):format(self.ep:size(), t[1], t[k], (k - 1) / 2))
        end
    end
end

-- the LoRA adapter set with the adapters of every rank's experts and the tensor-parallel adapters
-- whole (collective, as above): the modules in the order lunar.peft.apply makes them (sorted by
-- name)
function DP:_gathered_adapters(set, El)
    local ep = self.ep and self.ep:size() or 1
    local whole = lora.new_set{seed = set.seed, dtype = set.dtype}
    whole.config, whole.draws, whole.training = set.config, set.draws, set.training
    local found = {}   -- module name -> {ad = an adapter to copy settings from, A =, B =}
    -- the experts' adapters in an order every member shares: layer, local index, projection (the
    -- names hold other expert ids on each member, so their sorted order is not shared)
    local experts = {}
    for _, name in ipairs(set.order) do
        local prefix, e, rest = name:match('^(.*%.mlp%.experts%.)(%d+)(%..*)$')
        if prefix and self.ep then
            experts[#experts + 1] = {name = name, prefix = prefix, le = tonumber(e) % El, rest = rest}
        else
            local ad = set.modules[name]
            local A, B = set.params:get(ad.a_name), set.params:get(ad.b_name)
            -- tensor parallel: B's rows of a column-parallel module, A's columns of a row-parallel one
            if ad.tp and ad.tp.dim == 1 then B = unsplit(B, 1, self.tp) elseif ad.tp then A = unsplit(A, 2, self.tp) end
            found[name] = {ad = ad, A = A, B = B}
        end
    end
    table.sort(experts, function(a, b)
        if a.prefix ~= b.prefix then return a.prefix < b.prefix end
        if a.le ~= b.le then return a.le < b.le end
        return a.rest < b.rest
    end)
    for _, x in ipairs(experts) do
        local ad = set.modules[x.name]
        local A, B = set.params:get(ad.a_name), set.params:get(ad.b_name)
        local As = dist.all_gather(A:contiguous(), {group = self.ep})     -- (ep * r, in)
        local Bs = dist.all_gather(B:t():contiguous(), {group = self.ep}) -- (ep * r, out): B^T blocks
        local r = A:size(1)
        for k = 0, ep - 1 do
            found[x.prefix .. (k * El + x.le) .. x.rest] = {ad = ad, A = As:narrow(1, k * r + 1, r),
                                                            B = Bs:narrow(1, k * r + 1, r):t()}
        end
    end
    local names = {}
    for name in pairs(found) do names[#names + 1] = name end
    table.sort(names)
    for _, name in ipairs(names) do
        local f = found[name]
        whole:add(name, f.B:size(1), f.A:size(2), {r = f.ad.r, alpha = f.ad.alpha, dropout = f.ad.dropout,
            rslora = f.ad.rslora, A = f.A, B = f.B, device = f.A:device()})
    end
    return whole
end

local function mib(bytes) return ('%.2f MiB'):format(bytes / 2 ^ 20) end

-- rank 0 prints the layout and every rank's parameter, gradient and optimizer bytes
function DP:report(cfg, params_store, opt, log, model)
    local pbytes = 0
    for name in params_store:names() do pbytes = pbytes + grad_buffer.nbytes(params_store:get(name)) end
    local obytes = opt.planned_state_bytes and opt:planned_state_bytes() or nil
    if not obytes then
        -- replicated AdamW: two f32 moments (and an f32 master of a non-f32 parameter) per element
        obytes = 0
        for _, b in ipairs(self.buffers) do
            for _, e in ipairs(b.entries) do
                obytes = obytes + e.numel * (8 + (e.param:dtype() ~= 'f32' and 4 or 0))
            end
        end
    end
    local gbytes = 0
    for _, b in ipairs(self.buffers) do gbytes = gbytes + b:bytes().grads end
    local mine = {pbytes, gbytes, obytes}
    local all = dist.all_gather(core.from_flat(mine, {3}, 'f64', 'cpu'), {group = dist.world()}):tolist_flat()
    local b = self.buffer
    local world = dist.world_size() ~= self.size and (', world ' .. dist.world_size()) or ''
    if cfg.rl then   -- (the RL recipes' batch is their prompts, split by lunar.rl.parallel)
        log(cfg, 'data parallel: %d ranks (%s%s)', self.size, self.layout.key, world)
    else
        log(cfg, 'data parallel: %d ranks (%s%s), global batch %d rows = micro_batch %d x grad_accum %d x dp %d',
            self.size, self.layout.key, world, cfg.data.micro_batch * cfg.train.grad_accum * self.size,
            cfg.data.micro_batch, cfg.train.grad_accum, self.size)
    end
    if b then
        log(cfg, '  gradients: %d elements in %d bucket%s of ~%s, %s; optimizer %s', b.total, #b.buckets,
            #b.buckets == 1 and '' or 's', mib(self.bucket_elems * 4),
            self.distributed and 'reduce-scattered' or 'all-reduced',
            self.distributed and ('sharded: %d elements per rank'):format(b.shard_elems) or 'replicated on every rank')
    else
        log(cfg, '  gradients: only the routed experts\' (nothing else is trained)')
    end
    if self.expert_buffer then
        local eb = self.expert_buffer
        log(cfg, '  expert parallel: ep=%d (ep groups of ranks %s)%s, edp=%d; the routed experts this rank holds: %d '
            .. 'elements in %d bucket%s, %s over edp', self.ep:size(), table.concat(self.ep:ranks(), ','),
            self.etp and (', etp=%d (etp groups of ranks %s: each expert\'s matrices split)'):format(self.etp:size(),
                table.concat(self.etp:ranks(), ',')) or '',
            self.edp:size(), eb.total, #eb.buckets, #eb.buckets == 1 and '' or 's',
            self.distributed and 'reduce-scattered' or 'all-reduced')
    end
    if self.tp then
        local vocab = model and model.vocab
        log(cfg, '  tensor parallel: tp=%d (tp groups of ranks %s): attention heads and MLP widths split, their '
            .. 'partial sums all-reduced over tp; %s', self.tp:size(), table.concat(self.tp:ranks(), ','),
            (vocab and ('the vocabulary split (%d rows of the embedding and LM head a rank, vocab-parallel '
                .. 'cross-entropy)'):format(vocab.count) or 'the vocabulary whole on every rank (tp does not '
                .. 'divide vocab_size)') .. (self.sequence_parallel and '; sequence parallel: the norms and the '
                .. 'residual on each rank\'s share of the rows' or ''))
    end
    for r = 0, dist.world_size() - 1 do
        log(cfg, '  rank %d: parameters %s, gradients %s, optimizer state %s%s', r, mib(all[r * 3 + 1]),
            mib(all[r * 3 + 2]), mib(all[r * 3 + 3]), self.distributed and ' (when every parameter has state)' or '')
    end
end

-- ---- one process ----------------------------------------------------------------------------------

-- the state of a run on one process: the numbers one rank has, no collective, the plain AdamW
local Single = {single = true, size = 1, rank = 0, world_rank = 0, distributed = false}
Single.__index = Single

function M.single() return setmetatable({}, Single) end

function Single:is_main() return true end
function Single:model_opts() return {} end
function Single:sum(...) return ... end
function Single:max(...) return ... end
function Single:sum_counts(targets, tokens) return targets, tokens end
function Single:any(flag) return flag and true or false end
function Single:peak_memory() return nil end
function Single:before_backward() end
function Single:after_backward() end
function Single:optimizer(store, _, adamw_opts) return AdamW.new(store, adamw_opts) end
function Single:report() end
function Single:check_same_checkpoint() end
function Single:check_adapters() end
function Single:gathered_model(model) return model end
function Single:adapters_view(model) return model end
function Single:whole_count(store) return store:count() end
function Single:layout_record() return nil end
function Single:checkpoint_group() return nil end
function Single:devices() return nil end

return M
