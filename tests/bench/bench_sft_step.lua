-- bench_sft_step.lua: tokens/s and peak memory of one SFT step (forward, backward, AdamW) of the
-- tiny preset's model on CPU, f32. Driven by tests/bench/bench_sft_vs_torch.py, which times the
-- PyTorch loop (transformers + torch.optim.AdamW) on the same config in the same run.
--   lunar tests/bench/bench_sft_step.lua [batch=4] [seq=512] [steps=5] [warmup=2] [config=path]
local lunar = require 'lunar'
local common = dofile('recipes/common.lua')
local o = lunar.config.overrides()
local B, T, steps, warmup = o.batch or 4, o.seq or 512, o.steps or 5, o.warmup or 2
local cfg = o.config and lunar.model.config.load(o.config) or common.recipe('sft', {}).model.config
local model = lunar.model.new(cfg, {seed = 1})
local opt = lunar.optim.AdamW.new(model.params, {lr = 1e-4, betas = {0.9, 0.95}, weight_decay = 0.1, clip = 1.0})
local ids = lunar.randint(0, (cfg.vocab_size or 6400) - 64, {B, T}, {rng = lunar.rng(7)})
local batch = {input_ids = ids, labels = ids}
local times = {}
for s = 1, warmup + steps do
    local t0 = lunar.clock()
    lunar.scope(function()
        model:forward(batch, {loss = true})
        model:backward()
    end)
    opt:step{loss = 1}
    opt:zero_grad()
    if s > warmup then times[#times + 1] = lunar.clock() - t0 end
end
local total = 0
for _, t in ipairs(times) do total = total + t end
local per = total / #times
local rss
for line in io.lines('/proc/self/status') do rss = rss or tonumber(line:match('^VmHWM:%s+(%d+)')) end
print(string.format('{"impl": "lunar", "batch": %d, "seq": %d, "threads": %d, "sec_per_step": %.4f, ' ..
    '"tokens_per_s": %.1f, "peak_rss_mib": %.1f}', B, T, lunar.threads(), per, B * T / per, rss / 1024))
