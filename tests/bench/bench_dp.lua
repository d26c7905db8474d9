-- bench_dp.lua: the data-parallel gradient reduction of the tiny preset's model, how much of it
-- backward hides, and the bytes each rank sends. Not part of ctest; a note for docs/parallel.md.
--   mpirun --allow-run-as-root --oversubscribe -np 2 -x LUNAR_THREADS=1 ./build/lunar tests/bench/bench_dp.lua [bucket_mb] [steps]
--
-- Each step runs the forward and backward of a micro-batch (2 rows of 512 tokens per rank) twice:
--   overlapped: buckets start during backward (grad_buffer:arm() before it), then the wait;
--   blocking:   backward first, then every bucket started and waited for.
-- The hidden fraction is 1 - (overlapped wait) / (blocking reduction). Bytes per rank: a ring
-- reduce-scatter and a ring all-gather of P parameters each send (dp - 1) / dp x P elements (the
-- distributed optimizer: f32 gradients, then the parameters in their dtype); an all-reduce sends
-- twice that. The counts are what the ring algorithm sends; MPI may choose another algorithm.
local lunar = require 'lunar'
local data = require 'lunar.data'
local trainer = require 'lunar.train.trainer'
local grad_buffer = require 'lunar.optim.grad_buffer'

local d = lunar.dist
local world = d.world()
local np, rank = world:size(), world:rank()
local bucket_mb = tonumber(arg and arg[1]) or 1
local steps = tonumber(arg and arg[2]) or 5

local preset = dofile('recipes/presets/tiny.lua')
local tok = lunar.tokenizer.load('recipes/presets/tiny/tokenizer.json')
local docs = trainer.load_documents({data = {kind = 'chat', template = 'glm5', seq_len = 512, overlong = 'truncate',
    limit = 200, train = {'examples/data/sft/gsm8k_train_chat_first1000.jsonl'}}}, tok)
local loader = data.loader{source = docs, seq_len = 512, micro_batch = 2, seed = 1, dp_rank = rank, dp_size = np,
                           quiet = true}
local model = lunar.model.new(preset.common.model.config, {seed = 1})
local buffer = grad_buffer.new(model.params, {group = world, shard = true, model = model,
                                              bucket_elems = math.floor(bucket_mb * 2 ^ 20 / 4)})
buffer:watch(model)

local function step(overlap)
    local b = loader:next()
    local out
    lunar.scope(function()
        out = model:forward(b, {loss = true, num_items_in_batch = math.max(b.num_targets, 1)})
        d.barrier()
        local t0 = lunar.clock()
        if overlap then buffer:arm() end
        model:backward()
        local t1 = lunar.clock()
        if not overlap then buffer:arm() end
        local early = buffer:finish()
        local t2 = lunar.clock()
        out = {backward = t1 - t0, wait = t2 - t1, early = early}
    end)
    buffer.flat:fill_(0)
    return out
end

step(true)   -- warm-up
local sum = {overlapped = {backward = 0, wait = 0, early = 0}, blocking = {backward = 0, wait = 0, early = 0}}
for _ = 1, steps do
    for _, mode in ipairs({'overlapped', 'blocking'}) do
        local r = step(mode == 'overlapped')
        for k, v in pairs(r) do sum[mode][k] = sum[mode][k] + v / steps end
    end
end

local P = buffer.padded
local ring = (np - 1) / np * P * 4
if rank == 0 then
    print(('dp=%d, %d parameters (%d padded), %d buckets of ~%g MiB, %d steps'):format(np, buffer.total, P,
        #buffer.buckets, bucket_mb, steps))
    for _, mode in ipairs({'overlapped', 'blocking'}) do
        local s = sum[mode]
        print(('  %-10s backward %.1f ms, then waiting for the reduction %.1f ms (%.1f buckets started in backward)')
            :format(mode, 1e3 * s.backward, 1e3 * s.wait, s.early))
    end
    print(('  hidden behind backward: %.0f%% of the blocking reduction'):format(
        100 * (1 - sum.overlapped.wait / sum.blocking.wait)))
    print(('  bytes a rank sends per step (ring): reduce-scatter %.2f MiB + all-gather %.2f MiB = %.2f MiB '
        .. '(an all-reduce: %.2f MiB)'):format(ring / 2 ^ 20, ring / 2 ^ 20, 2 * ring / 2 ^ 20, 2 * ring / 2 ^ 20))
end
os.exit(0)
