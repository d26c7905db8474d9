-- lunar.train.moe_load: the experts' load in a training step, as metrics. Each MoE decoder layer
-- counts the (token, expert) routes of the rows this rank routes (lunar.model's moe_load); the
-- counts add up over dp, and over tp too when the tp ranks route different tokens (tp x ep),
-- so every rank sees the global batch's load. Per layer, the load ratio is the busiest expert's
-- routes over the mean (1 = even; E = all to one expert). Metrics (metrics.jsonl, TensorBoard
-- train/...): moe_load_max (the largest ratio of any layer), moe_load_mean (over the layers),
-- moe_idle_experts (the (layer, expert) pairs that got no route in the step).
local core = require 'lunar.core'
local dist = require 'lunar.dist'

local M = {}

-- the step's metrics and the global counts ({layer =, counts =} per MoE layer), or nil for a
-- model without MoE layers; collective under data parallel (every rank calls it)
function M.step_metrics(model, dp)
    local load = model:moe_load()
    if not load then return nil end
    local flat = {}
    for _, l in ipairs(load) do for _, c in ipairs(l.counts) do flat[#flat + 1] = c end end
    if dp and dp.group then   -- (one process: nothing to add)
        local t = core.from_flat(flat, {#flat}, 'f64', 'cpu')
        dist.all_reduce(t, {group = dp.group})
        if dp.tp and model:moe_load_over_tp() then dist.all_reduce(t, {group = dp.tp}) end
        flat = t:tolist_flat()
    end
    local worst, sum, idle, k = 0, 0, 0, 0
    local global = {}
    for i, l in ipairs(load) do
        local E = #l.counts
        local total, most, counts = 0, 0, {}
        for e = 1, E do
            local c = flat[k + e]
            counts[e], total, most = c, total + c, math.max(most, c)
            if c == 0 then idle = idle + 1 end
        end
        k = k + E
        global[i] = {layer = l.layer, counts = counts}
        local ratio = total > 0 and most * E / total or 0
        worst, sum = math.max(worst, ratio), sum + ratio
    end
    return {moe_load_max = worst, moe_load_mean = sum / #load, moe_idle_experts = idle}, global
end

return M
