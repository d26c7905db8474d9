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
--   --              forwards run the model's head on these rows only: opts.head_positions), and
--   --              mb.targets (P) i64 the token each predicts (opts.head_targets)
--   --   mb.index   (S, R) i64: each response token's logprob's place in mb.positions' outputs
--   --   mb.mask    (S, R) f32: 1 at a response token that trains, 0 at padding and at the
--   --              tokens of a sample that trains nothing
--   --   mb.advantages (S) f32: each sample's advantage (set_advantages, once they are known)
--   --   mb.samples the samples, in order
--
-- A micro-batch is one packed row (cu_seqlens: each sample attends to itself only, positions
-- restart), so no compute goes to padding. With opts.share_prompts the samples of a group that
-- follow each other share one copy of their prompt in the row (micro_shared below): the prompt's
-- tokens are computed once for the n samples instead of n times, the same values (a response sees
-- its prompt and itself as it would alone), and their gradients sum over the samples as they would. Mini-batches split the step's groups evenly (a group is
-- never split: its samples share one advantage baseline); micro-batches take consecutive samples.
--
-- The logprob of response token j of a sample whose prompt has P tokens and that starts at packed
-- offset o is the model's output at position o + P + j - 1 (the position that predicts it).
-- Routing replay: generation routed every token it fed, the prompt and all of the response but its
-- last token (which it never fed); that last position gets K distinct placeholder experts: its
-- output predicts nothing and, attention being causal, reaches no other position.
local core = require 'lunar.core'
local masks = require 'lunar.nn.masks'

local M = {}

-- (1, K) i64: K distinct experts 0 .. K-1, the routes of a position generation never fed
local function placeholder_routes(K)
    local list = {}
    for e = 0, K - 1 do list[e + 1] = e end
    return core.from_flat(list, {1, K}, 'i64', 'cpu')
end

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
    local index, mask, positions, targets = {}, {}, {}, {}
    for i, s in ipairs(samples) do
        local at = cu[i] + #s.prompt_ids - 1
        for j = 1, R do
            local k = (i - 1) * R + j
            if j <= #s.ids then
                positions[#positions + 1] = at + j - 1
                targets[#targets + 1] = s.ids[j]
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
        targets = core.from_flat(targets, {#targets}, 'i64', 'cpu'),
        index = core.from_flat(index, {S * R}, 'i64', 'cpu'),
        mask = core.from_flat(mask, {S, R}, 'f32', 'cpu')}
    if opts.routing then
        local K = opts.experts_per_token
        local placeholder = placeholder_routes(K)
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

-- whether two samples can share a prompt copy: the same ids and, with routes recorded, the same
-- routes over it
local function same_prompt(a, b, opts)
    if a.prompt_ids ~= b.prompt_ids then
        if #a.prompt_ids ~= #b.prompt_ids then return false end
        for i = 1, #a.prompt_ids do if a.prompt_ids[i] ~= b.prompt_ids[i] then return false end end
    end
    if opts.routing then
        local P = #a.prompt_ids
        for _, layer in ipairs(opts.moe_layers) do
            local ra, rb = a.routing and a.routing[layer], b.routing and b.routing[layer]
            if not ra or not rb or ra:size(1) < P or rb:size(1) < P then return false end
            local x, y = ra:narrow(1, 1, P):tolist_flat(), rb:narrow(1, 1, P):tolist_flat()
            for i = 1, #x do if x[i] ~= y[i] then return false end end
        end
    end
    return true
end

-- One micro-batch with each prompt packed once (a run: the samples that share it), then the run's
-- responses: a response
-- attends its prompt and itself (positions continue from the prompt's), through key lists
-- (batch.key_lists, one list per query) and the mask built from mb.layout. The logprob of a
-- response's first token is read at its prompt's last position, shared by the run.
local function micro_shared(samples, opts)
    local runs = {}
    for _, s in ipairs(samples) do
        local run
        for r = #runs, 1, -1 do
            if same_prompt(runs[r][1], s, opts) then run = runs[r] break end
        end
        if run then run[#run + 1] = s else runs[#runs + 1] = {s} end
    end
    local ids, pos, R = {}, {}, 0
    local rows = {}        -- per packed position: its keys as {first, last} ranges (0-based, inclusive)
    local docs, unmask = {0}, {}
    local positions, targets, index, mask = {}, {}, {}, {}
    local segments = {}    -- for the routes: {sample, first row of its routes, rows, packed offset}
    local S = #samples
    local k = 0            -- samples so far
    for _, run in ipairs(runs) do
        local first = run[1]
        local P, p0 = #first.prompt_ids, #ids
        for t = 1, P do
            ids[#ids + 1] = first.prompt_ids[t]
            pos[#pos + 1] = t - 1
            rows[#rows + 1] = {p0, p0 + t - 1}
        end
        docs[#docs + 1] = #ids
        segments[#segments + 1] = {first, 1, P, p0}
        for _, s in ipairs(run) do
            k = k + 1
            local r0, n = #ids, #s.ids
            if n > R then R = n end
            for j = 1, n do
                ids[#ids + 1] = s.ids[j]
                pos[#pos + 1] = P + j - 1
                rows[#rows + 1] = {p0, p0 + P - 1, r0, r0 + j - 1}
            end
            if n > 0 then
                docs[#docs + 1] = #ids
                unmask[#unmask + 1] = {r0, n, p0, P}
            end
            segments[#segments + 1] = {s, P + 1, n, r0}
            s.__packed = {r0 = r0, last_prompt = p0 + P - 1}
        end
    end
    -- (S, R) index into the head's positions, per sample in order
    for i, s in ipairs(samples) do
        local at = s.__packed
        for j = 1, R do
            local kk = (i - 1) * R + j
            if j <= #s.ids then
                positions[#positions + 1] = j == 1 and at.last_prompt or at.r0 + j - 2
                targets[#targets + 1] = s.ids[j]
                index[kk], mask[kk] = #positions - 1, s.train and 1 or 0
            else
                index[kk], mask[kk] = 0, 0
            end
        end
        s.__packed = nil
    end
    if #positions == 0 then error('rl.batch: a micro-batch of samples without a response token', 2) end
    local T = #ids
    local K = 0
    for _, r in ipairs(rows) do
        local n = r[2] - r[1] + 1 + (r[3] and (r[4] - r[3] + 1) or 0)
        if n > K then K = n end
    end
    local lists = {}
    for t, r in ipairs(rows) do
        local o, c = (t - 1) * K, 0
        for key = r[1], r[2] do c = c + 1; lists[o + c] = key end
        if r[3] then for key = r[3], r[4] do c = c + 1; lists[o + c] = key end end
        for j = c + 1, K do lists[o + j] = -1 end
    end
    local mb = {samples = samples, S = S, R = R, T = T, P = #positions,
        batch = {input_ids = core.from_flat(ids, {1, T}, 'i64', 'cpu'),
                 position_ids = core.from_flat(pos, {1, T}, 'i64', 'cpu'),
                 key_lists = core.from_flat(lists, {1, T, K}, 'i64', 'cpu'), max_visible = K,
                 key_lists_exact = true},   -- the lists are the visible keys: the mask adds nothing
        layout = {docs = core.from_flat(docs, {#docs}, 'i64', 'cpu'), unmask = unmask},
        positions = core.from_flat(positions, {#positions}, 'i64', 'cpu'),
        targets = core.from_flat(targets, {#targets}, 'i64', 'cpu'),
        index = core.from_flat(index, {S * R}, 'i64', 'cpu'),
        mask = core.from_flat(mask, {S, R}, 'f32', 'cpu')}
    if opts.routing then
        local Kx = opts.experts_per_token
        local placeholder = placeholder_routes(Kx)
        local routing = {}
        for _, layer in ipairs(opts.moe_layers) do
            local out = core.empty({T, Kx}, 'i64', 'cpu')
            for _, seg in ipairs(segments) do
                local s, from, n, at = seg[1], seg[2], seg[3], seg[4]
                if n > 0 then
                    local rt = s.routing and s.routing[layer]
                    local dst = out:narrow(1, at + 1, n)
                    local have = rt and math.max(0, math.min(rt:size(1) - from + 1, n)) or 0
                    if have > 0 then dst:narrow(1, 1, have):copy_(rt:narrow(1, from, have)) end
                    if have < n then dst:narrow(1, have + 1, n - have):copy_(placeholder:expand(n - have, Kx)) end
                end
            end
            routing[layer] = out
        end
        if opts.replay then mb.batch.routing = routing else mb.recorded = routing end
    end
    return mb
end

-- block_mask(mb, device) -> the (1, T, T) mask of a micro-batch's packed row: block-diagonal
-- causal over its documents, and with shared prompts each response's rows also see its prompt
function M.block_mask(mb, device)
    if not mb.layout then
        return masks.build{B = 1, T = mb.T, cu_seqlens = mb.batch.cu_seqlens, device = device}
    end
    local m = masks.build{B = 1, T = mb.T, cu_seqlens = mb.layout.docs, device = device}
    for _, u in ipairs(mb.layout.unmask) do
        m:select(1, 1):narrow(1, u[1] + 1, u[2]):narrow(2, u[3] + 1, u[4]):fill_(0)
    end
    return m
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

-- build(groups, opts) -> mini-batches (see the header); the groups' samples in group order (n
-- each). Data parallel (lunar.rl.parallel): opts.total is the step's group count over every rank
-- and each group's g.position its place among them; mini-batch m takes the groups whose place
-- falls in it (the cut one rank makes of all of them), and opts.keep_empty keeps a mini-batch
-- this rank holds no group of (the optimizer step is every rank's).
function M.build(groups, opts)
    local total = opts.total or #groups
    local k = opts.mini_batches
    local out = {}
    for m = 1, k do
        -- (m * total / k, not m * (total / k): the rounded quotient can floor the last bound below
        -- total and leave a group out)
        local first, last = math.floor((m - 1) * total / k) + 1, math.floor(m * total / k)
        local samples = {}
        for gi, g in ipairs(groups) do
            local at = g.position or gi
            if at >= first and at <= last then
                for _, s in ipairs(g.samples) do samples[#samples + 1] = s end
            end
        end
        local micros = {}
        for i = 1, #samples, opts.micro_batch do
            local part = {}
            for j = i, math.min(#samples, i + opts.micro_batch - 1) do part[#part + 1] = samples[j] end
            micros[#micros + 1] = opts.share_prompts and micro_shared(part, opts) or micro(part, opts)
        end
        if #samples > 0 or opts.keep_empty then out[#out + 1] = {micro = micros, samples = samples} end
    end
    return out
end

-- a micro-batch that trains nothing (mb.dummy): one sample of one prompt token and one response
-- token, its mask 0, its advantage 0 (data parallel pads the ranks' mini-batches with them so
-- that every rank runs as many forwards and backwards; lunar.rl.parallel)
function M.dummy(opts)
    local s = {prompt_ids = {0}, ids = {0}, logprobs = {0}, train = false, advantage = 0, reward = 0, dummy = true}
    local mb = micro({s}, opts)
    mb.dummy = true
    mb.advantages = core.from_flat({0}, {1}, 'f32', 'cpu')
    return mb
end

return M
