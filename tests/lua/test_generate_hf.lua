-- test_generate_hf.lua: lunar's KV-cached greedy decoding gives the token ids of transformers
-- 5.25.0 `generate` (greedy, f32, CPU, its own KV cache) on fixture checkpoints:
-- tests/fixtures/generate/hf_greedy.json, made by tests/ref/make_generate_refs.py. GLM-5 cases
-- have prompts longer than index_topk (DSA drops keys at every step), glm4moe is GLM-4.x, flash_a
-- and flash_b GLM-5.3-Flash (KDA state, k-pool DSA with and without the tail, mHC). HF ran
-- each prompt alone; lunar prefills all of a case's prompts in one packed batch and decodes them
-- together, with a plain greedy loop over lunar.generate.decode.
local lunar = require 'lunar'
local ops = lunar.ops
local io_ = require 'lunar.io'
local Cache = require 'lunar.generate.cache'
local decode = require 'lunar.generate.decode'
local T = require('lunar.testing').suite('generate.hf')

local REF = io_.read_json('tests/fixtures/generate/hf_greedy.json')

local function argmax(row)
    local _, i = ops.topk(row, 1)
    return i:item()
end

local function greedy(model, prompts, n_new, block_size)
    -- (max_sequences: GLM-5.3-Flash keeps each sequence's KDA state in a slot; the others ignore it)
    local cache = Cache.new(model, {budget_bytes = 2^20, block_size = block_size, max_seq_len = 128,
                                    max_sequences = #prompts})
    local seqs = {}
    for i = 1, #prompts do seqs[i] = cache:new_sequence() end
    local logits = decode.prefill(cache, seqs, prompts).logits
    local gen = {}
    for i = 1, #prompts do gen[i] = {} end
    for s = 1, n_new do
        local toks = {}
        for i = 1, #prompts do
            toks[i] = argmax(logits:select(1, i))
            gen[i][s] = toks[i]
        end
        if s < n_new then logits = decode.step(cache, seqs, toks).logits end
    end
    cache:release()
    return gen
end

for _, case in ipairs({'glm5_dsa', 'glm5_bf16', 'glm4moe', 'flash_a', 'flash_b'}) do
    T:test(case .. ': greedy ids equal transformers generate', function()
        local ref = REF.cases[case]
        assert(ref, 'no reference for ' .. case)
        local model = lunar.model.load('tests/fixtures/models/' .. case)
        local prompts = {}
        for i, row in ipairs(ref.prompts) do
            prompts[i] = row.prompt
            if ref.index_topk ~= lunar.core.io.null then
                assert(#row.prompt > ref.index_topk, 'prompt not longer than index_topk')
            end
        end
        local gen = greedy(model, prompts, REF.max_new_tokens, model.cfg.index_kpool and 8 or 4)
        for i, row in ipairs(ref.prompts) do
            assert(#gen[i] == #row.generated)
            for s, t in ipairs(row.generated) do
                assert(gen[i][s] == t, ('%s prompt %d (%d tokens): token %d is %d, transformers %d'):format(
                    case, i, #row.prompt, s, gen[i][s], t))
            end
        end
        print(('  %s: %d prompts x %d tokens equal'):format(case, #prompts, REF.max_new_tokens))
    end)
end

os.exit(T:run())
