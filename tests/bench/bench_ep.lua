-- bench_ep.lua: what expert parallel sends. The tiny preset's model at ep = the number of ranks
-- (edp = 1) or ep=2 on 4 ranks (edp = 2), one forward and backward of 2 rows of 512 tokens per
-- rank, repeated: the bytes each rank sends to the other members of its ep group in the MoE
-- layers' all_to_alls (counted at the call, per destination), against the formula, and the
-- gradient reduction's bytes. Not part of ctest; a note for docs/parallel.md.
--   mpirun --allow-run-as-root --oversubscribe -np 2 -x LUNAR_THREADS=1 ./build/lunar tests/bench/bench_ep.lua [ep] [steps]
--
-- Formula, per MoE layer and step, for N tokens a rank and K experts a token: a (token, expert)
-- row goes to another member with probability (ep - 1) / ep when the routes spread evenly, and
-- four H-wide f32 tensors cross per such row (x out, the expert output back, dy out, dx back),
-- plus one f32 each way for the routing weight and its gradient and E / ep counts per member:
--   4 * N * K * (ep - 1) / ep * H * 4 bytes (+ the small terms).
-- The measured figure differs by how unevenly the router spreads the rows. The gradients: a ring
-- reduce-scatter and all-gather over dp of the dense part and over edp of this rank's experts,
-- 2 * (g - 1) / g * P * 4 bytes for a group of g and P elements (what the ring algorithm sends;
-- MPI may choose another).
local lunar = require 'lunar'
local data = require 'lunar.data'
local trainer = require 'lunar.train.trainer'
local data_parallel = require 'lunar.train.data_parallel'

local d = lunar.dist
local world = d.world()
local np, rank = world:size(), world:rank()
local EP = tonumber(arg and arg[1]) or np
local steps = tonumber(arg and arg[2]) or 3

-- count what each all_to_all sends to the other members
local sent = {rows = 0, bytes = 0}
local all_to_all = d.all_to_all
d.all_to_all = function(t, send, recv, opts)
    local me = opts.group:rank()
    local per_row = t:dim() > 0 and t:size(1) > 0 and (t:numel() / t:size(1)) or (t:dim() > 1 and t:size(2) or 1)
    local bytes = ({f64 = 8, i64 = 8, f32 = 4, bf16 = 2, f16 = 2})[t:dtype()] or 4
    for j, n in ipairs(send) do
        if j - 1 ~= me then sent.bytes = sent.bytes + n * per_row * bytes end
    end
    return all_to_all(t, send, recv, opts)
end

local preset = dofile('recipes/presets/tiny.lua')
local cfg = preset.common.model.config
local dp = data_parallel.setup({parallel = {ep = EP, bucket_mb = 1}})
local tok = lunar.tokenizer.load('recipes/presets/tiny/tokenizer.json')
local docs = trainer.load_documents({data = {kind = 'chat', template = 'glm5', seq_len = 512, overlong = 'truncate',
    limit = 200, train = {'examples/data/sft/gsm8k_train_chat_first1000.jsonl'}}}, tok)
local loader = data.loader{source = docs, seq_len = 512, micro_batch = 2, seed = 1, dp_rank = dp.rank, dp_size = dp.size,
                           quiet = true}
local model = lunar.model.new(cfg, {seed = 1, ep = dp.ep})
local opt = dp:optimizer(model.params, model, {lr = 1e-3})

local moe_layers = 0
for _, L in ipairs(model.layers) do if L.mlp_type == 'sparse' then moe_layers = moe_layers + 1 end end
local H, K, E = cfg.hidden_size, cfg.num_experts_per_tok, cfg.n_routed_experts

local totals = {bytes = 0, formula = 0, time = 0}
for s = 0, steps do
    local b = loader:next()
    sent.bytes = 0
    d.barrier()
    local t0 = lunar.clock()
    lunar.scope(function()
        model:forward(b, {loss = true, num_items_in_batch = math.max(b.num_targets, 1)})
        dp:before_backward(true)
        model:backward()
        dp:after_backward(true)
    end)
    local t = lunar.clock() - t0
    opt:zero_grad()
    local N = b.input_ids:numel()   -- tokens of this rank's rows (padding included: it is routed too)
    local formula = moe_layers * 4 * N * K * (EP - 1) / EP * H * 4
    if s > 0 then   -- the first step is a warm-up
        totals.bytes, totals.formula, totals.time = totals.bytes + sent.bytes, totals.formula + formula, totals.time + t
    end
end

local function mib(x) return ('%.2f MiB'):format(x / 2 ^ 20) end
local mine = {totals.bytes / steps, totals.formula / steps, totals.time / steps}
local all = d.all_gather(lunar.tensor(mine, 'f64'), {group = world}):tolist_flat()
local dense, experts = dp.buffer.total, dp.expert_buffer and dp.expert_buffer.total or 0
local g_dp, g_edp = dp.size, dp.edp and dp.edp:size() or 1
if rank == 0 then
    print(('expert parallel: %d ranks, ep=%d, edp=%d; tiny preset (H %d, %d experts, top-%d, %d MoE layers with the MTP '
        .. 'layer off the LM loss path), 2 rows of 512 tokens a rank, mean of %d steps after a warm-up'):format(np, EP,
        g_edp, H, E, K, moe_layers, steps))
    for r = 0, np - 1 do
        print(('  rank %d: all_to_all sent %s to other ep members a step, formula %s (ratio %.2f); forward+backward %.0f ms')
            :format(r, mib(all[r * 3 + 1]), mib(all[r * 3 + 2]), all[r * 3 + 1] / all[r * 3 + 2], 1000 * all[r * 3 + 3]))
    end
    print(('  gradients: dense %d elements over dp=%d (ring: %s a rank), experts %d elements a rank over edp=%d (ring: %s)')
        :format(dense, g_dp, mib(2 * (g_dp - 1) / g_dp * dense * 4), experts, g_edp,
        mib(2 * (g_edp - 1) / g_edp * experts * 4)))
end
os.exit(0)
