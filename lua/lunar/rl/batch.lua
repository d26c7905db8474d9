-- lunar.rl.batch: the training batches of one rollout step, built from its samples.
--
--   local rlbatch = require 'lunar.rl.batch'
--   local mini = rlbatch.build(samples, {mini_batches = 2, micro_batch = 8, groups = 16, n = 8,
--       routing = true, experts_per_token = K, moe_layers = {...}})
--   -- mini[m] = {micro = {mb, ...}}; each mb is one packed row of its samples:
--   --   mb.batch   the model's batch: input_ids (1, T), labels (1, T) (prompt tokens -100),
--   --              cu_seqlens (S + 1), routing {[layer] = (T, K) i64} (opts.replay: the
--   --              routes generation recorded; without replay they are mb.recorded)
--   --   mb.positions (P) i64: the packed positions that predict a response token, in order (the
--   --              forwards run the model's head on these rows only: opts.head_positions)
--   --   mb.index   (S, R) i64: each response token's logprob's place in mb.positions' outputs
--   --   mb.mask    (S, R) f32: 1 at a response token that trains, 0 at padding and at the
--   --              tokens of a sample that trains nothing
--   --   mb.advantages (S) f32: each sample's advantage (set_advantages, once they are known)
--   --   mb.samples the samples, in order
--
-- A micro-batch is one packed row (cu_seqlens: each sample attends to itself only, positions
-- restart), so no compute goes to padding. Mini-batches split the step's groups evenly (a group is
-- never split: its samples share one advantage baseline); micro-batches take consecutive samples.
--
-- The logprob of response token j of a sample whose prompt has P tokens and that starts at packed
-- offset o is the model's output at position o + P + j - 1 (the position that predicts it).
-- Routing replay: generation routed every token it fed, the prompt and all of the response but its
-- last token (which it never fed); that last position gets K distinct placeholder experts: its
-- output predicts nothing and, attention being causal, reaches no other position.
local core = require 'lunar.core'

local M = {}

-- one micro-batch: the packed row of `samples`
local function micro(samples, opts)
    local ids, labels, cu = {}, {}, {0}
    local R = 0
    for _, s in ipairs(samples) do
        for _, t in ipairs(s.prompt_ids) do ids[#ids + 1] = t; labels[#labels + 1] = -100 end
        for _, t in ipairs(s.ids) do ids[#ids + 1] = t; labels[#labels + 1] = t end
        cu[#cu + 1] = #ids
        if #s.ids > R then R = #s.ids end
    end
    local T, S = #ids, #samples
    local index, mask, positions = {}, {}, {}
    for i, s in ipairs(samples) do
        local at = cu[i] + #s.prompt_ids - 1
        for j = 1, R do
            local k = (i - 1) * R + j
            if j <= #s.ids then
                positions[#positions + 1] = at + j - 1
                index[k], mask[k] = #positions - 1, s.train and 1 or 0
            else
                index[k], mask[k] = 0, 0
            end
        end
    end
    if #positions == 0 then error('rl.batch: a micro-batch of samples without a response token', 2) end
    local mb = {samples = samples, S = S, R = R, T = T, P = #positions,
        batch = {input_ids = core.from_flat(ids, {1, T}, 'i64', 'cpu'),
                 labels = core.from_flat(labels, {1, T}, 'i64', 'cpu'),
                 cu_seqlens = core.from_flat(cu, {S + 1}, 'i64', 'cpu')},
        positions = core.from_flat(positions, {#positions}, 'i64', 'cpu'),
        index = core.from_flat(index, {S * R}, 'i64', 'cpu'),
        mask = core.from_flat(mask, {S, R}, 'f32', 'cpu')}
    if opts.routing then
        local K = opts.experts_per_token
        local list = {}
        for e = 0, K - 1 do list[e + 1] = e end
        local placeholder = core.from_flat(list, {1, K}, 'i64', 'cpu')
        local routing = {}
        for _, layer in ipairs(opts.moe_layers) do
            local rows = core.empty({T, K}, 'i64', 'cpu')
            for i, s in ipairs(samples) do
                local rt = s.routing and s.routing[layer]
                local n = cu[i + 1] - cu[i]
                local dst = rows:narrow(1, cu[i] + 1, n)
                local have = rt and math.min(rt:size(1), n) or 0
                if have > 0 then dst:narrow(1, 1, have):copy_(rt:narrow(1, 1, have)) end
                if have < n then dst:narrow(1, have + 1, n - have):copy_(placeholder:expand(n - have, K)) end
            end
            routing[layer] = rows
        end
        -- replayed by the training forwards, or kept to measure how often they route the same
        if opts.replay then mb.batch.routing = routing else mb.recorded = routing end
    end
    return mb
end

-- set_advantages(minis): mb.advantages from each sample's s.advantage
function M.set_advantages(minis)
    for _, mini in ipairs(minis) do
        for _, mb in ipairs(mini.micro) do
            local adv = {}
            for i, s in ipairs(mb.samples) do adv[i] = s.advantage end
            mb.advantages = core.from_flat(adv, {mb.S}, 'f32', 'cpu')
        end
    end
end

-- build(samples, opts) -> mini-batches (see the header); samples are in group order (n each)
function M.build(groups, opts)
    local per_mini = #groups / opts.mini_batches
    local out = {}
    for m = 1, opts.mini_batches do
        local first, last = math.floor((m - 1) * per_mini) + 1, math.floor(m * per_mini)
        local samples = {}
        for gi = first, last do
            for _, s in ipairs(groups[gi].samples) do samples[#samples + 1] = s end
        end
        local micros = {}
        for i = 1, #samples, opts.micro_batch do
            local part = {}
            for j = i, math.min(#samples, i + opts.micro_batch - 1) do part[#part + 1] = samples[j] end
            micros[#micros + 1] = micro(part, opts)
        end
        if #samples > 0 then out[#out + 1] = {micro = micros, samples = samples} end
    end
    return out
end

return M
