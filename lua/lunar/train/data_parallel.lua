-- lunar.train.data_parallel: what the training loop does differently when a recipe runs on
-- several ranks (mpirun -np N with parallel.tp = pp = cp = ep = 1: data parallel over N ranks).
--
--   local dp = data_parallel.setup(cfg)      -- nil on one rank
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
local AdamW = require 'lunar.optim.adamw'
local grad_buffer = require 'lunar.optim.grad_buffer'
local distributed = require 'lunar.optim.distributed'

local M = {}

local DP = {}
DP.__index = DP

-- setup(cfg) -> the data-parallel state, or nil when the run has one rank (or cfg.single_rank:
-- this process trains alone even under a launcher, as the tests' one-rank reference does)
function M.setup(cfg)
    local env = dist.env()
    if env.size <= 1 or cfg.single_rank then return nil end
    local p = cfg.parallel or {}
    local lay = dist.layout{tp = p.tp or 1, pp = p.pp or 1, cp = p.cp or 1, ep = p.ep or 1}
    local g = lay:group('dp')
    local bucket_mb = p.bucket_mb or 16
    return setmetatable({layout = lay, group = g, rank = g:rank(), size = g:size(),
        world_rank = dist.rank(), distributed = p.distributed_optimizer ~= false,
        bucket_elems = math.max(1, math.floor(bucket_mb * 2 ^ 20 / 4))}, DP)
end

function DP:is_main() return self.world_rank == 0 end

-- the optimizer over `store` (the model's parameters, or the LoRA adapters'), with its gradient
-- buffer watching `model`'s backward
function DP:optimizer(store, model, adamw_opts)
    self.buffer = grad_buffer.new(store, {group = self.group, shard = self.distributed,
                                          bucket_elems = self.bucket_elems, model = model})
    self.buffer:watch(model)
    if self.distributed then return distributed.new(store, self.buffer, adamw_opts) end
    return AdamW.new(store, adamw_opts)
end

-- numbers summed over the ranks (f64)
function DP:sum(...)
    local v = {...}
    local t = dist.all_reduce(core.from_flat(v, {#v}, 'f64', 'cpu'), {group = self.group})
    return unpack(t:tolist_flat())
end

function DP:sum_counts(targets, tokens) return self:sum(targets, tokens) end

function DP:before_backward(last) if last then self.buffer:arm() end end
function DP:after_backward(last) if last then self.buffer:finish() end end

-- true on every rank when any rank was asked to stop (a signal reaches the ranks at different
-- steps; they must write the checkpoint and stop at the same one)
function DP:any(flag)
    local t = dist.all_reduce(core.from_flat({flag and 1 or 0}, {1}, 'i32', 'cpu'), {op = 'max', group = self.group})
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

local function mib(bytes) return ('%.2f MiB'):format(bytes / 2 ^ 20) end

-- rank 0 prints the layout and every rank's parameter, gradient and optimizer bytes
function DP:report(cfg, params_store, opt, log)
    local pbytes = 0
    for name in params_store:names() do pbytes = pbytes + grad_buffer.nbytes(params_store:get(name)) end
    local obytes = opt.planned_state_bytes and opt:planned_state_bytes() or nil
    if not obytes then
        -- replicated AdamW: two f32 moments (and an f32 master of a non-f32 parameter) per element
        obytes = 0
        for _, e in ipairs(self.buffer.entries) do
            obytes = obytes + e.numel * (8 + (e.param:dtype() ~= 'f32' and 4 or 0))
        end
    end
    local mine = {pbytes, self.buffer:bytes().grads, obytes}
    local all = dist.all_gather(core.from_flat(mine, {3}, 'f64', 'cpu'), {group = self.group}):tolist_flat()
    local b = self.buffer
    log(cfg, 'data parallel: %d ranks (%s), global batch %d rows = micro_batch %d x grad_accum %d x dp %d',
        self.size, self.layout.key, cfg.data.micro_batch * cfg.train.grad_accum * self.size, cfg.data.micro_batch,
        cfg.train.grad_accum, self.size)
    log(cfg, '  gradients: %d elements in %d bucket%s of ~%s, %s; optimizer %s', b.total, #b.buckets,
        #b.buckets == 1 and '' or 's', mib(self.bucket_elems * 4),
        self.distributed and 'reduce-scattered' or 'all-reduced',
        self.distributed and ('sharded: %d elements per rank'):format(b.shard_elems) or 'replicated on every rank')
    for r = 0, self.size - 1 do
        log(cfg, '  rank %d: parameters %s, gradients %s, optimizer state %s%s', r, mib(all[r * 3 + 1]),
            mib(all[r * 3 + 2]), mib(all[r * 3 + 3]), self.distributed and ' (when every parameter has state)' or '')
    end
end

return M
