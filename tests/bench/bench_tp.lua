-- bench_tp.lua: what tensor parallel sends. The tiny preset's model at tp = the number of ranks
-- (or tp=2 x dp=2 on 4 ranks: `bench_tp.lua 2`), optionally with ep (`bench_tp.lua 2 2`: tp=2 x
-- ep=2), one forward and backward of 2 rows of 512 tokens per dp rank, repeated: the bytes each
-- rank sends in the all-reduces over its tp group (counted at the call, as a ring all-reduce sends
-- them), against the formula. Not part of ctest; a note for docs/parallel.md.
--   mpirun --allow-run-as-root --oversubscribe -np 2 -x LUNAR_THREADS=1 ./build/lunar tests/bench/bench_tp.lua [tp] [ep] [split_indexer] [steps]
--
-- Formula, per step, for N tokens a tp group: every decoder layer all-reduces one (N, H) f32
-- tensor after its attention (o_proj's partial sums) and one after its MLP (down_proj's; an MoE
-- layer's shared experts, with the routed rows of each tp rank's share added in under tp x ep),
-- and the backward one (N, H) input gradient for each of the two blocks; with the vocabulary split,
-- the embedding's rows and the LM head's input gradient one (N, H) each:
--   (L * 4 + 2) * N * H * 4 bytes * 2 * (tp - 1) / tp   (a ring all-reduce of S bytes sends 2 (tp-1)/tp S)
-- and with `split_indexer` (the third argument, 1) every layer with its own DSA indexer all-reduces
-- its (B, T, T) f32 scores:
--   + Li * B * T * T * 4 bytes * 2 * (tp - 1) / tp
-- plus, once a step, the tp-partial gradients (MLA's q_a / kv_a projections and norms; the MoE
-- routers under tp x ep), and the all_gathers counted apart: the cross-entropy's (N, 2) f32 and,
-- under tp x ep, each MoE layer's routes (N x K x 2 f64). The MTP layer is off the LM loss path.
local lunar = require 'lunar'
local data = require 'lunar.data'
local trainer = require 'lunar.train.trainer'
local data_parallel = require 'lunar.train.data_parallel'

local d = lunar.dist
local world = d.world()
local np, rank = world:size(), world:rank()
local TP = tonumber(arg and arg[1]) or np
local EP = tonumber(arg and arg[2]) or 1
local split_indexer = (tonumber(arg and arg[3]) or 0) == 1
local steps = tonumber(arg and arg[4]) or 3

local nbytes = require('lunar.optim.grad_buffer').nbytes
local dp = data_parallel.setup({parallel = {tp = TP, ep = EP, bucket_mb = 1}})
local tp = dp.tp

-- count what the tp group's all-reduces send (ring) and its all_gathers (the routes)
local sent = {act = 0, grads = 0, gathers = 0, phase = 'act'}
local all_reduce, all_gather = d.all_reduce, d.all_gather
d.all_reduce = function(t, opts)
    if opts and opts.group == tp then
        sent[sent.phase] = sent[sent.phase] + 2 * (TP - 1) / TP * nbytes(t)
    end
    return all_reduce(t, opts)
end
d.all_gather = function(t, opts)
    if opts and opts.group == tp then sent.gathers = sent.gathers + (TP - 1) * nbytes(t) end
    return all_gather(t, opts)
end

local preset = dofile('recipes/presets/tiny.lua')
local cfg = preset.common.model.config
local tok = lunar.tokenizer.load('recipes/presets/tiny/tokenizer.json')
local docs = trainer.load_documents({data = {kind = 'chat', template = 'glm5', seq_len = 512, overlong = 'truncate',
    limit = 200, train = {'examples/data/sft/gsm8k_train_chat_first1000.jsonl'}}}, tok)
local loader = data.loader{source = docs, seq_len = 512, micro_batch = 2, seed = 1, dp_rank = dp.rank, dp_size = dp.size,
                           quiet = true}
local model = lunar.model.new(cfg, {seed = 1, tp = tp, ep = dp.ep, split_indexer = split_indexer})
local partial = 0   -- elements of the tp-partial gradients a step produces (the MTP layer's get none)

local H, L = cfg.hidden_size, cfg.num_hidden_layers
local indexers = 0   -- layers that run their own indexer, split (the MTP layer is off the loss path)
for _, Lr in ipairs(model.layers) do if Lr.attn.indexer and Lr.attn.indexer.tp then indexers = indexers + 1 end end
local totals = {act = 0, grads = 0, gathers = 0, formula = 0, time = 0}
for s = 0, steps do
    local b = loader:next()
    sent.act, sent.grads, sent.gathers, sent.phase = 0, 0, 0, 'act'
    d.barrier()
    local t0 = lunar.clock()
    lunar.scope(function()
        model:forward(b, {loss = true, num_items_in_batch = math.max(b.num_targets, 1)})
        model:backward()
        sent.phase = 'grads'
        if s == 0 then
            for _, n in ipairs(model:tp_partial_grads()) do
                if model.params.grads[n] then partial = partial + model.params.grads[n]:numel() end
            end
        end
        model:reduce_tp_grads()
    end)
    local t = lunar.clock() - t0
    model:zero_grad()
    local N = b.input_ids:numel()
    local Bq, Tq = b.input_ids:size(1), b.input_ids:size(2)
    local formula = ((L * 4 + (model.vocab and 2 or 0)) * N * H + indexers * Bq * Tq * Tq) * 4 * 2 * (TP - 1) / TP
    if s > 0 then   -- the first step is a warm-up
        for _, k in ipairs({'act', 'grads', 'gathers'}) do totals[k] = totals[k] + sent[k] end
        totals.formula, totals.time = totals.formula + formula, totals.time + t
    end
end

local function mib(x) return ('%.2f MiB'):format(x / 2 ^ 20) end
local mine = {totals.act / steps, totals.formula / steps, totals.grads / steps, totals.gathers / steps, totals.time / steps}
local all = d.all_gather(lunar.tensor(mine, 'f64'), {group = world}):tolist_flat()
if rank == 0 then
    print(('tensor parallel: %d ranks, tp=%d, ep=%d, dp=%d; tiny preset (H %d, %d layers, %d with a split indexer, '
        .. 'vocabulary %s), 2 rows of 512 tokens a dp rank, mean of %d steps after a warm-up'):format(np, TP, EP, dp.size,
        H, L, indexers, model.vocab and 'split' or 'whole', steps))
    for r = 0, np - 1 do
        local v = {unpack(all, r * 5 + 1, r * 5 + 5)}
        print(('  rank %d: activation all-reduces %s a step, formula %s (ratio %.3f); tp-partial gradients %s '
            .. '(formula %s); all_gathers (cross-entropy, routes) %s; forward+backward %.0f ms'):format(r, mib(v[1]), mib(v[2]),
            v[1] / v[2], mib(v[3]), mib(2 * (TP - 1) / TP * partial * 4), mib(v[4]), 1000 * v[5]))
    end
end
os.exit(0)
