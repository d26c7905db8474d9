-- bench_model.lua: forward+backward throughput of a GLM model checkpoint on CPU (f32).
--   lunar tests/bench/bench_model.lua DIR [seq=1024] [batch=1] [steps=3] [warmup=1]
-- Prints one JSON line: tokens/s over the timed steps, seconds per step, peak RSS (MiB).
-- Driven by tests/bench/bench_glm5_vs_hf.py, which runs transformers on the same checkpoint.
local lunar = require 'lunar'
local dir = arg[1]
local o = lunar.config.overrides()
local seq, batch, steps, warmup = o.seq or 1024, o.batch or 1, o.steps or 3, o.warmup or 1

local now = lunar.clock

local function peak_rss_mib()
    local f = io.open('/proc/self/status')
    for line in f:lines() do
        local kb = line:match('^VmHWM:%s+(%d+)')
        if kb then f:close() return tonumber(kb) / 1024 end
    end
    f:close()
end

local model = lunar.model.load(dir)
local V = model.cfg.vocab_size
local ids = lunar.randint(0, V, {batch, seq}, {rng = lunar.rng(7)})
local data = {input_ids = ids, labels = ids}
local times = {}
for s = 1, warmup + steps do
    local t0 = now()
    lunar.scope(function()
        model:forward(data, {loss = true})
        model:backward()
    end)
    local dt = now() - t0
    if s > warmup then times[#times + 1] = dt end
end
local total = 0
for _, t in ipairs(times) do total = total + t end
local per = total / #times
print(string.format('{"impl": "lunar", "seq": %d, "batch": %d, "threads": %d, "sec_per_step": %.4f, ' ..
    '"tokens_per_s": %.1f, "peak_rss_mib": %.1f}', seq, batch, lunar.threads(), per, seq * batch / per, peak_rss_mib()))
