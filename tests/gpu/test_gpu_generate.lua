-- test_gpu_generate.lua: KV-cached generation (lunar.generate.cache, lunar.generate.decode) on
-- CUDA, f32, for glm5_dsa (DSA active), glm5_bf16 (the trained model) and glm4moe:
--   * greedy ids equal transformers' generate (tests/fixtures/generate/hf_greedy.json);
--   * every step's logits within 1e-5 of the largest |logit| of the same cached run on the CPU;
--   * the cache and the logits live on the device, and a decode step reads the device once per
--     MoE layer (the expert counts, as the training forward) and nowhere else; a prefill reads
--     the same plus once for the block mask's check of cu_seqlens, as a packed training forward.
-- Skipped (77) without a CUDA device. LUNAR_GPU_DRY_RUN=1 runs it with the CPU standing in (no
-- reads to count there); LUNAR_FAKE_CPU_DEVICES=1 LUNAR_GPU_STAND_IN=cpu:1 puts the debug device
-- in the GPU's place, which counts its reads as a GPU's.
local testing = require 'lunar.testing'
local DRY = os.getenv('LUNAR_GPU_DRY_RUN') == '1'
local STAND_IN = os.getenv('LUNAR_GPU_STAND_IN')
if not DRY and not STAND_IN then testing.require_cuda() end
local GPU = STAND_IN or (DRY and 'cpu' or 'cuda:0')
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local ops = lunar.ops
local Cache = require 'lunar.generate.cache'
local decode = require 'lunar.generate.decode'
local T = testing.suite('gpu.generate (on ' .. GPU .. ')')

local REF = io_.read_json('tests/fixtures/generate/hf_greedy.json')

local function argmax(row)
    local _, i = ops.topk(row, 1)
    return i:to('cpu'):item()
end

local function reads(fn)
    local s0 = lunar.transfer_stats()
    local r = fn()
    return lunar.transfer_stats().to_host - s0.to_host, r
end

-- greedy run: the logits of every step (on the host), the ids, and the most reads of a step
local function greedy(model, prompts, n_new)
    local cache = Cache.new(model, {budget_bytes = 2^20, block_size = 4, max_seq_len = 128})
    assert(cache.layers[1][next(cache.layers[1])]:device() == model:device(), 'the cache is not on the model\'s device')
    local seqs = {}
    for i = 1, #prompts do seqs[i] = cache:new_sequence() end
    local prefill_reads, out = reads(function() return decode.prefill(cache, seqs, prompts) end)
    local logits, steps, gen, step_reads = out.logits, {}, {}, 0
    for i = 1, #prompts do gen[i] = {} end
    for s = 1, n_new do
        assert(logits:device() == model:device())
        steps[s] = logits:to('cpu')
        local toks = {}
        for i = 1, #prompts do
            toks[i] = argmax(steps[s]:select(1, i))
            gen[i][s] = toks[i]
        end
        if s < n_new then
            local n
            n, out = reads(function() return decode.step(cache, seqs, toks) end)
            step_reads = math.max(step_reads, n)
            logits = out.logits
        end
    end
    cache:release()
    return gen, steps, prefill_reads, step_reads
end

for _, case in ipairs({'glm5_dsa', 'glm5_bf16', 'glm4moe'}) do
    T:test(case .. ': ids of transformers, logits of the cpu, reads only the expert counts', function()
        local ref = REF.cases[case]
        local prompts = {}
        for i, row in ipairs(ref.prompts) do prompts[i] = row.prompt end
        local dir = 'tests/fixtures/models/' .. case
        local model = lunar.model.load(dir, {device = GPU})
        local gen, steps, prefill_reads, step_reads = greedy(model, prompts, REF.max_new_tokens)
        for i, row in ipairs(ref.prompts) do
            for s, t in ipairs(row.generated) do
                assert(gen[i][s] == t, ('prompt %d token %d is %d, transformers %d'):format(i, s, gen[i][s], t))
            end
        end
        local _, cpu_steps = greedy(lunar.model.load(dir), prompts, REF.max_new_tokens)
        local worst = 0
        for s = 1, #steps do
            local e = ops.max(ops.abs(ops.sub(steps[s], cpu_steps[s]))):item() / ops.max(ops.abs(cpu_steps[s])):item()
            worst = math.max(worst, e)
        end
        assert(worst < 1e-5, ('logits differ from the cpu by %.3g of max |logit|'):format(worst))
        local moe = 0
        for _, L in ipairs(model.layers) do if L.mlp_type ~= 'dense' then moe = moe + 1 end end
        if GPU ~= 'cpu' then
            -- and the block mask's check of the packed row's cu_seqlens, as a packed training forward
            assert(prefill_reads <= moe + 1, ('prefill read the device %d times, %d MoE layers'):format(prefill_reads, moe))
            assert(step_reads <= moe, ('a decode step read the device %d times, %d MoE layers'):format(step_reads, moe))
        end
        print(('      %s: %d x %d ids equal, logits vs cpu %.2g, reads: prefill %d, step %d (%d MoE layers)'):format(
            case, #prompts, REF.max_new_tokens, worst, prefill_reads, step_reads, moe))
    end)
end

os.exit(T:run())
