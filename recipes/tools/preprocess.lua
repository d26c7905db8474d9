-- recipes/tools/preprocess.lua: text or JSONL -> a Megatron indexed dataset (.bin/.idx).
--
--   lunar recipes/tools/preprocess.lua input=data.txt output_prefix=out/corpus tokenizer=bytes \
--       format=text|jsonl field=text [split=blank|file|line] [append_eod=true] [dtype=auto] [limit=N]
--
-- Writes <output_prefix>_<field>_document.{bin,idx} (Megatron's naming), prints the counts and
-- the bad rows (with file and line). input may be a file, a directory (its files, in name
-- order) or a list [a.txt,b.txt]. tokenizer=bytes is the byte-level tokenizer (ids 0..255, eos
-- 256); any other value is a tokenizer.json path read by lunar.tokenizer. The work is done by
-- lunar.data.preprocess (documented there).
local lunar = require 'lunar'

local KNOWN = {input = true, output_prefix = true, tokenizer = true, format = true, field = true, split = true,
    append_eod = true, dtype = true, limit = true, quiet = true, show = true}

local opts = lunar.config.overrides()
for k in pairs(opts) do
    if not KNOWN[k] then
        local names = {}
        for n in pairs(KNOWN) do names[#names + 1] = n end
        table.sort(names)
        error(('preprocess: unknown option %q (known: %s)'):format(k, table.concat(names, ', ')), 0)
    end
end
if opts.input == nil or opts.output_prefix == nil then
    io.stderr:write('usage: lunar recipes/tools/preprocess.lua input=FILE|DIR output_prefix=PREFIX '
        .. '[tokenizer=bytes|tokenizer.json] [format=text|jsonl] [field=text] [split=blank|file|line] '
        .. '[append_eod=true] [dtype=auto|uint16|int32] [limit=N]\n')
    os.exit(2)
end
-- numbers that were meant as names (input=2024) stay names
for _, k in ipairs({'input', 'output_prefix', 'tokenizer', 'field'}) do
    if type(opts[k]) == 'number' then opts[k] = tostring(opts[k]) end
end
lunar.data.preprocess(opts)
