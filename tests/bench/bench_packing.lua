-- bench_packing.lua: packing efficiency (real tokens / row slots) and planning time of first fit
-- and best fit decreasing on the shipped SFT data (the tiny preset's: GSM8K and OASST rendered
-- with the GLM-5 template and tokenized with the preset's tokenizer), per seq_len and buffer, for
-- the orders of epochs 0..2 of data.seed (what the loader packs). Documents longer than seq_len
-- are truncated, as the tiny SFT preset does.
--   lunar tests/bench/bench_packing.lua [seed=1] [epochs=3]
local lunar = require 'lunar'
local data = lunar.data
local o = lunar.config.overrides()
local seed, epochs = o.seed or 1, o.epochs or 3

local tok = lunar.tokenizer.load('recipes/presets/tiny/tokenizer.json')
local rows = data.read_chat({'examples/data/sft/gsm8k_train_chat_first1000.jsonl',
    'examples/data/sft/oasst_en100_conversations.jsonl'}, {show = 0})
local docs = data.tokenize(rows, function(row)
    return lunar.chat.tokenize(tok, row.messages, {template = 'glm5', tools = row.tools})
end, {max_len = 1e9})
local lengths, total = {}, 0
for i, d in ipairs(docs) do
    lengths[i] = #d.ids
    total = total + #d.ids
end
print(('%d documents, %d tokens'):format(#lengths, total))

local ways = {{packing = 'first_fit'}, {packing = 'bfd', pack_buffer = 256}, {packing = 'bfd', pack_buffer = 1000},
    {packing = 'bfd', pack_buffer = require('lunar.data.pack').DEFAULT_BUFFER}}
for _, seq_len in ipairs({512, 4096}) do
    for _, w in ipairs(ways) do
        local effs, nrows, secs = {}, {}, 0
        for e = 0, epochs - 1 do
            local order = data.permutation(#lengths, seed, e)
            local P = data.packer{seq_len = seq_len, packing = w.packing, pack_buffer = w.pack_buffer, seed = seed,
                quiet = true}
            local t0 = lunar.clock()
            local plan = P:plan(lengths, order, e)
            secs = secs + lunar.clock() - t0
            effs[#effs + 1] = ('%.2f'):format(100 * plan.stats.efficiency)
            nrows[#nrows + 1] = #plan.rows
        end
        print(('{"seq_len": %d, "packing": "%s", "pack_buffer": %s, "efficiency_pct": [%s], "rows": [%s], ' ..
            '"plan_ms": %.2f}'):format(seq_len, w.packing, w.pack_buffer and tostring(w.pack_buffer) or 'null',
            table.concat(effs, ', '), table.concat(nrows, ', '), 1000 * secs / epochs))
    end
end
