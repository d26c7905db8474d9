-- lunar.rl.policy: the forwards and the update of one rollout step: reference and old logprobs
-- (once per rollout batch), then rl.epochs passes over its mini-batches, one optimizer step each.
--
--   local policy = require 'lunar.rl.policy'
--   local old = policy.old_logprobs(run, minis)   -- mb.old (S, R) for every micro-batch (+ mb.ref)
--   local stats = policy.update(run, minis)       -- the loss, clip fractions, ratios, entropy, ...
--
-- Every forward divides the logits by rollout.temperature (the distribution generation sampled
-- from) and reads the logprob of each response token; the old logprobs come from the same packed
-- micro-batches the update uses, so at the first inner step the ratio is exactly 1. The
-- reference policy of the KL term is the starting weights: for LoRA the base with the adapters
-- set aside for that forward (no second copy of the model), for full fine-tuning a frozen copy
-- built from the same checkpoint or seed.
local lunar = require 'lunar'
local core = require 'lunar.core'
local ops = lunar.ops
local loss = require 'lunar.rl.loss'
local lora = require 'lunar.nn.lora'
local rlbatch = require 'lunar.rl.batch'
local rlpar = require 'lunar.rl.parallel'
local schedule = require 'lunar.parallel.schedule'

local METRIC_SET = {}
for _, m in ipairs(loss.METRICS) do METRIC_SET[m[1]] = true end

-- the micro-batches' metrics m (lunar.rl.loss.policy's) into acc: {name = {v =, w =}} (loss.METRICS
-- says how each combines). 'sum' and 'mean' add into v (a mean weighted by the micro-batch's
-- tokens, w their total); 'min' and 'max' keep the largest of v (of -v for a minimum); w > 0
-- says the metric was seen.
local function add_metrics(acc, m)
    for k, v in pairs(m) do
        if type(v) == 'number' and not METRIC_SET[k] then error('lunar.rl.loss.METRICS does not list the metric ' .. k) end
    end
    for _, spec in ipairs(loss.METRICS) do
        local k, how, v = spec[1], spec[2], m[spec[1]]
        if type(v) == 'number' then
            local a = acc[k] or {v = (how == 'min' or how == 'max') and -math.huge or 0, w = 0}
            acc[k] = a
            if how == 'mean' then
                local w = m.tokens or 1
                a.v, a.w = a.v + v * w, a.w + w
            elseif how == 'sum' then a.v, a.w = a.v + v, a.w + 1
            else a.v, a.w = math.max(a.v, how == 'min' and -v or v), a.w + 1 end
        end
    end
end

-- the metrics' values from acc, combined over the data-parallel ranks first (dp: the sums and
-- weights added, the extremes' largest taken): {name = number}
local function metric_values(acc, dp)
    local sums, highs = {}, {}
    for _, spec in ipairs(loss.METRICS) do
        local high = spec[2] == 'min' or spec[2] == 'max'
        local a = acc[spec[1]] or {v = high and -math.huge or 0, w = 0}
        if high then highs[#highs + 1] = a.v else sums[#sums + 1] = a.v end
        sums[#sums + 1] = a.w
    end
    sums, highs = {dp:sum(unpack(sums))}, {dp:max(unpack(highs))}
    local i, j = 0, 0
    for _, spec in ipairs(loss.METRICS) do
        local v
        if spec[2] == 'min' or spec[2] == 'max' then j = j + 1; v = highs[j] else i = i + 1; v = sums[i] end
        i = i + 1
        acc[spec[1]] = {v = v, w = sums[i]}
    end
    local out = {}
    for _, spec in ipairs(loss.METRICS) do
        local a, how = acc[spec[1]], spec[2]
        if a and a.w > 0 then out[spec[1]] = how == 'mean' and a.v / a.w or how == 'min' and -a.v or a.v end
    end
    return out
end

local M = {}

-- (S, R) of the (P) values a forward gave at mb.positions, at each response token
local function gather(mb, values)
    return ops.index_select(values:view(mb.P), 1, mb.index):view(mb.S, mb.R)
end

-- the (P) gradient of those values from the (S, R) gradient of the gathered ones
local function scatter(mb, grad)
    local out = core.empty({mb.P}, 'f32', grad:device()):fill_(0)
    ops.index_add_(out, 1, mb.index, ops.mul(grad, mb.mask):contiguous():view(mb.S * mb.R))
    return out
end

local function on(t, dev) if t:device() ~= dev then return t:to(dev) end return t end

-- fn(mb) with the micro-batch's packed-row mask built once for the forwards it makes (inside the
-- caller's scope, which frees it)
local function with_mask(model, mb, fn)
    mb.batch.block_mask = rlbatch.block_mask(mb, model:device())
    local ok, err = pcall(fn, mb)
    mb.batch.block_mask = nil
    if not ok then error(err, 0) end
end

-- a forward of one micro-batch whose head runs at its response positions only
local function forward(model, mb, opts)
    opts.head_positions, opts.head_targets = mb.positions, mb.targets
    return model:forward(mb.batch, opts)
end

-- fn() with the model's adapters set aside (the LoRA reference policy)
local function without_adapters(model, fn)
    local store = model.params
    local set = store.lora
    if not set then return fn() end
    lora.detach(store)
    local ok, a, b = pcall(fn)
    lora.attach(store, set)
    if not ok then error(a, 0) end
    return a, b
end

-- logprobs (S, R) of one micro-batch under `model` (no backward kept)
local function logprobs_of(model, mb, temperature)
    local out = forward(model, mb, {logprobs = true, temperature = temperature, keep = false})
    return gather(mb, out.logprobs)
end

-- mb.old from a forward of the policy before any update (`out`), and what it says of the rollout:
-- the rollout/training logprob gap and, when routes are recorded but not replayed, the router
-- agreement, summed into `acc`
local function record_old(acc, mb, out)
    mb.old = gather(mb, out.logprobs)
    core.scope_keep(mb.old)
    -- the rollout's logprobs of the same tokens
    local flat = {}
    for i, s in ipairs(mb.samples) do
        for j = 1, mb.R do flat[(i - 1) * mb.R + j] = s.logprobs[j] or 0 end
    end
    mb.rollout = core.from_flat(flat, {mb.S, mb.R}, 'f32', 'cpu')
    core.scope_keep(mb.rollout)
    local diff = ops.mul(ops.abs(ops.sub(on(mb.old, 'cpu'), mb.rollout)), mb.mask)
    acc.gap_sum = acc.gap_sum + ops.sum(diff):item()
    acc.gap_n = acc.gap_n + ops.sum(mb.mask):item()
    acc.gap_max = math.max(acc.gap_max, ops.max(diff):item())
    if mb.recorded and not mb.dummy then
        local a, n = M.router_agreement(mb, out.routing)
        acc.agree, acc.routed = acc.agree + a, acc.routed + n
    end
end

-- old_logprobs(run, minis) -> acc: mb.ref (when the KL term is on) for every micro-batch and mb.old
-- for those of every mini-batch but the first: the policy has not changed yet when the first
-- mini-batch trains, so its training forward gives its old logprobs (the same forward, the same
-- bits: the ratio there is exactly 1) and one forward of it is saved. With the KL in the reward
-- every mb.old is needed before the advantages, so all are computed here. stats(acc) gives the
-- rollout/training gap once the update has run.
function M.old_logprobs(run, minis)
    local cfg, model = run.cfg, run.model
    local T = cfg.rollout.temperature
    local acc = {gap_sum = 0, gap_n = 0, gap_max = 0, agree = 0, routed = 0}
    local defer = not cfg.rl.kl_in_reward
    if run.adapters then run.adapters:eval() end
    for m, mini in ipairs(minis) do
        for _, mb in ipairs(mini.micro) do
            mb.old_pending = defer and m == 1 or nil
            if not mb.old_pending or run.ref_policy then
                lunar.scope(function()
                    with_mask(model, mb, function()
                        if not mb.old_pending then
                            record_old(acc, mb, forward(model, mb, {logprobs = true, temperature = T, keep = false}))
                        end
                        if run.ref_policy then
                            mb.ref = run.ref_policy(mb)
                            core.scope_keep(mb.ref)
                        end
                    end)
                end)
            end
        end
    end
    if run.adapters then run.adapters:train() end
    return acc
end

-- the rollout/training logprob gap (mean |rollout - old| over the trained tokens, and its max)
-- and the router agreement (routes recorded, not replayed) of a step's old_logprobs and update
-- (dp: summed over the data-parallel ranks)
function M.stats(acc, dp)
    acc.gap_sum, acc.gap_n, acc.agree, acc.routed = rlpar.sum(dp, acc.gap_sum, acc.gap_n, acc.agree, acc.routed)
    acc.gap_max = rlpar.max(dp, acc.gap_max)
    return {gap = acc.gap_n > 0 and acc.gap_sum / acc.gap_n or 0, gap_max = acc.gap_max,
            router_agreement = acc.routed > 0 and acc.agree / acc.routed or nil}
end

-- KL in the reward (rl-algorithms 1.4): each sample's reward loses kl_coef times the sum over
-- its trained tokens of k1 = old - ref, before the advantages are computed
function M.kl_into_rewards(minis, rl)
    for _, mini in ipairs(minis) do
        for _, mb in ipairs(mini.micro) do
            local kl = ops.sum(ops.mul(ops.sub(on(mb.old, 'cpu'), on(mb.ref, 'cpu')), mb.mask), 2):tolist_flat()
            for i, s in ipairs(mb.samples) do
                s.kl_penalty = rl.kl_coef * kl[i]
                s.reward = s.reward - s.kl_penalty
            end
        end
    end
end

-- the reference policy's logprobs (S, R) of a micro-batch
function M.reference(run)
    local T = run.cfg.rollout.temperature
    if run.adapters then
        return function(mb) return without_adapters(run.model, function() return logprobs_of(run.model, mb, T) end) end
    end
    return function(mb) return logprobs_of(run.ref_model, mb, T) end
end

-- the fraction of (token, layer) pairs whose expert set in the training forward equals the one
-- generation chose (routes recorded, not replayed): count agreeing, count compared
function M.router_agreement(mb, routing)
    local agree, n = 0, 0
    for layer, r in pairs(routing or {}) do
        local train = r.idx and r.idx:to('cpu'):tolist_flat()
        if train then
            local K = r.idx:size(2)
            local gen = mb.recorded and mb.recorded[layer]
            gen = gen and gen:tolist_flat()
            if gen then
                for t = 0, mb.T - 1 do
                    local set = {}
                    for k = 1, K do set[gen[t * K + k]] = true end
                    local same = true
                    for k = 1, K do if not set[train[t * K + k]] then same = false break end end
                    if same then agree = agree + 1 end
                    n = n + 1
                end
            end
        end
    end
    return agree, n
end

-- one mini-batch: forward + backward of its micro-batches, one optimizer step -> its stats
local function mini_step(run, mini, advantages_of, acc)
    local cfg, model = run.cfg, run.model
    local rl = cfg.rl
    local masks = {}
    for _, mb in ipairs(mini.micro) do if not mb.dummy then masks[#masks + 1] = mb.mask end end
    local lcfg = {eps_low = rl.eps_low, eps_high = rl.eps_high, dual_clip = rl.dual_clip or nil,
                  reduction = rl.loss_reduction,
                  norm_length = rl.loss_reduction == 'seq-mean-token-sum-norm' and cfg.rollout.max_new_tokens or nil,
                  kl = (rl.kl_coef or 0) > 0 and not rl.kl_in_reward and {coef = rl.kl_coef, estimator = rl.kl_estimator}
                      or nil,
                  entropy_coef = rl.entropy_coef or 0, tis_cap = rl.tis_cap or nil}
    -- (data parallel: the global mini-batch's tokens or sequences; lunar.rl.parallel)
    local norm = rlpar.normaliser(run.dp, masks, lcfg)
    local dp = run.dp
    local want_entropy = true
    local total, metrics = 0, {}
    -- (the micro-batch's packed-row mask is built once for its forward and backward)
    schedule.forward_backward(run.schedule, mini.micro, {
        forward = function(mb)
            mb.batch.block_mask = rlbatch.block_mask(mb, model:device())
            local dev = model:device()
            local out, saved = forward(model, mb, {logprobs = true, entropy = want_entropy,
                temperature = cfg.rollout.temperature})
            local lp = gather(mb, out.logprobs)
            if mb.old_pending then                 -- the policy's first update: these are the old ones
                record_old(acc, mb, out)
                mb.old_pending = nil
            end
            local ent = out.entropy and gather(mb, out.entropy) or nil
            local inputs = {logprobs = lp, old_logprobs = on(mb.old, dev), advantages = on(advantages_of(mb), dev),
                            mask = on(mb.mask, dev), entropy = ent,
                            ref_logprobs = mb.ref and on(mb.ref, dev) or nil,
                            rollout_logprobs = rl.tis_cap and on(mb.rollout, dev) or nil}
            local value, grads, m = loss.policy(inputs, lcfg, norm)
            total = total + value
            add_metrics(metrics, m)
            return {saved = saved, grads = grads}
        end,
        backward = function(mb, st)
            model:backward({dlogprobs = scatter(mb, st.grads.dlogprobs),
                            dentropy = st.grads.dentropy and scatter(mb, st.grads.dentropy) or nil}, st.saved)
        end,
        cleanup = function(mb) mb.batch.block_mask = nil end,
    })
    -- the ranks' shares of the global loss, and the metrics over every rank's micro-batches
    total = dp:sum(total)
    local values = metric_values(metrics, dp)
    local info = run.opt:step{loss = total, micro_batches = 1}
    run.opt:zero_grad()
    local stats = {loss = total, grad_norm = info.grad_norm, lr = info.lr, skipped = info.skipped}
    for k, v in pairs(values) do stats[k] = v end
    return stats
end

-- update(run, minis, advantages_of, old) -> the step's stats: means over its optimizer steps
-- (old: what old_logprobs returned, which the first mini-batch's old logprobs complete)
function M.update(run, minis, advantages_of, old)
    old = old or {gap_sum = 0, gap_n = 0, gap_max = 0, agree = 0, routed = 0}
    local acc, n = {}, 0
    local last
    for _ = 1, run.cfg.rl.epochs do
        for _, mini in ipairs(minis) do
            local s = mini_step(run, mini, advantages_of, old)
            n = n + 1
            for k, v in pairs(s) do if type(v) == 'number' then acc[k] = (acc[k] or 0) + v end end
            if s.skipped then acc.skipped_steps = (acc.skipped_steps or 0) + 1 end
            last = s
        end
    end
    local out = {}
    for k, v in pairs(acc) do out[k] = v / math.max(n, 1) end
    out.skipped_steps = acc.skipped_steps or 0
    out.lr = last and last.lr
    out.optimizer_steps = n
    return out
end

return M
