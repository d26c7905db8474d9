-- lunar.data.preprocess: text or JSONL -> a Megatron indexed dataset (what Megatron's
-- tools/preprocess_data.py does); the command line is recipes/tools/preprocess.lua.
--
--   local res = data.preprocess{input = 'a.txt' | {...} | 'dir/', output_prefix = 'out/shakespeare',
--       tokenizer = 'bytes' | '<tokenizer.json>' | <tokenizer object>,
--       format = 'text' | 'jsonl' (default: jsonl when every input ends in .jsonl / .json),
--       field = 'text', split = 'blank' | 'file' | 'line', append_eod = true, dtype = 'auto',
--       limit = nil, quiet = false}
--   -> {prefix = '<output_prefix>_<field>_document', documents =, tokens =, dtype =, report =,
--       seconds =}
--   Files: <prefix>.bin and <prefix>.idx (Megatron's naming: output_prefix, the JSON key, the
--   'document' level). One document = one sequence. append_eod adds the tokenizer's eos id at the
--   end of every document (Megatron's --append-eod; on by default here). dtype 'auto' = uint16
--   when the vocabulary has fewer than 65500 ids, else int32 (Megatron's rule). Bad rows and
--   empty documents are counted in res.report (with file and line), never fatal.
--
--   data.byte_tokenizer() -> a tokenizer of bytes: ids 0..255 are the bytes of the UTF-8 text,
--       eos = 256, vocab_size = 257; tok:encode(text) -> ids, tok:decode(ids) -> text.
--   data.load_tokenizer(spec) -> 'bytes', a tokenizer object (returned as is), or a path handed
--       to lunar.tokenizer (its load / from_file function).
--   Tokenizer interface used here: tok:encode(text) -> ids (a Lua list or a tensor), tok.eos (a
--   number; tok.eos_id or tok:eos() are accepted too), tok.vocab_size (number or method) for
--   dtype 'auto'.
local tensor = require 'lunar.tensor'
local readers = require 'lunar.data.readers'
local indexed = require 'lunar.data.indexed'
local report = require 'lunar.data.report'

local fail = tensor.fail
local M = {}

local ByteTok = {}
ByteTok.__index = ByteTok

function M.byte_tokenizer()
    return setmetatable({name = 'bytes', vocab_size = 257, eos = 256}, ByteTok)
end

function ByteTok:encode(text)
    local ids, n = {}, #text
    for i = 1, n, 4096 do
        local chunk = {text:byte(i, math.min(i + 4095, n))}
        for k = 1, #chunk do ids[i + k - 1] = chunk[k] end
    end
    return ids
end

function ByteTok:decode(ids)
    if tensor.is_tensor(ids) then ids = ids:tolist_flat() end
    local parts = {}
    for i = 1, #ids do
        local v = ids[i]
        parts[i] = v < 256 and string.char(v) or ''
    end
    return table.concat(parts)
end

function M.load_tokenizer(spec)
    if spec == 'bytes' then return M.byte_tokenizer() end
    if type(spec) == 'table' then return spec end
    if type(spec) ~= 'string' or spec == '' then fail('preprocess: tokenizer must be "bytes", a path or a tokenizer object') end
    local ok, tk = pcall(require, 'lunar.tokenizer')
    if not ok then
        fail(('preprocess: tokenizer=%s needs lunar.tokenizer, which this build does not have (%s); tokenizer=bytes '
            .. 'works without it'):format(spec, tostring(tk)))
    end
    local load = type(tk) == 'table' and (tk.load or tk.from_file or tk.open) or nil
    if not load then fail('preprocess: lunar.tokenizer has no load(path) function') end
    return load(spec)
end

local function field_of(tok, name)
    local v = tok[name]
    if type(v) == 'function' then v = v(tok) end
    return v
end

local function eos_of(tok)
    local e = field_of(tok, 'eos')
    if e == nil then e = field_of(tok, 'eos_id') end
    if type(e) == 'table' then e = e[1] end   -- several eos ids: the first one ends documents
    return e
end

function M.run(opts)
    opts = opts or {}
    local t0 = require('lunar.core').clock()
    if opts.input == nil or opts.input == '' then fail('preprocess: input= is required (a file, a list or a directory)') end
    if type(opts.output_prefix) ~= 'string' or opts.output_prefix == '' then fail('preprocess: output_prefix= is required') end
    -- default format: jsonl when every input file is named *.jsonl / *.json (Megatron's tool
    -- reads JSONL only), else text
    local format = opts.format
    if format == nil then
        local inputs = type(opts.input) == 'table' and opts.input or {opts.input}
        format = #inputs > 0 and 'jsonl' or 'text'
        for _, p in ipairs(inputs) do
            if type(p) ~= 'string' or not (p:match('%.jsonl$') or p:match('%.json$')) then format = 'text' end
        end
    end
    if format ~= 'text' and format ~= 'jsonl' then fail(("preprocess: format must be 'text' or 'jsonl', got %s"):format(tostring(format))) end
    local key = opts.field or 'text'
    local tok = M.load_tokenizer(opts.tokenizer or 'bytes')
    local append_eod = opts.append_eod ~= false
    local eos = eos_of(tok)
    if append_eod and type(eos) ~= 'number' then fail('preprocess: append_eod needs the tokenizer\'s eos id (tok.eos)') end
    local dtype = opts.dtype or 'auto'
    local vocab
    if dtype == 'auto' then
        vocab = field_of(tok, 'vocab_size')
        if type(vocab) ~= 'number' then dtype = 'int32' end
    end
    local rep = report.new{show = opts.show, name = 'preprocess'}
    local limit = (opts.limit or 0) > 0 and opts.limit or nil
    local rows
    if format == 'text' then
        rows = readers.read_text(opts.input, {split = opts.split or 'blank', report = rep, limit = limit})
    else
        rows = readers.read_jsonl_text(opts.input, {field = key, report = rep, limit = limit})
    end
    local prefix = ('%s_%s_document'):format(opts.output_prefix, key)
    local dir = prefix:match('^(.*)/[^/]*$')
    if dir and dir ~= '' then os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "'") end
    local w = indexed.indexed_writer(prefix, {dtype = dtype, vocab_size = vocab})
    local ok, err = pcall(function()
        for _, row in ipairs(rows) do
            local okt, ids = pcall(tok.encode, tok, row.text)
            if not okt then
                rep:ungood()
                rep:bad('tokenize_error', row.file, row.line, tostring(ids))
            else
                if tensor.is_tensor(ids) then ids = ids:tolist_flat() end
                if #ids == 0 then
                    rep:ungood()
                    rep:bad('empty', row.file, row.line, 'no tokens')
                else
                    if append_eod then ids[#ids + 1] = eos end
                    local okw, e = pcall(w.add_document, w, ids)
                    if not okw then
                        rep:ungood()
                        rep:bad('bad_token', row.file, row.line, tostring(e):match('token %d+ .*$') or tostring(e))
                    end
                end
            end
        end
    end)
    if not ok then
        w:abort()
        error(err, 0)
    end
    local nseq, ndocs, ntok = w:counts()
    w:finish()
    local res = {prefix = prefix, documents = ndocs, sequences = nseq, tokens = ntok, dtype = w.dtype, report = rep,
        seconds = require('lunar.core').clock() - t0}
    if not opts.quiet then
        print(('preprocess: %d documents, %d tokens (%s, tokenizer %s%s) -> %s.{bin,idx} in %.2f s'):format(ndocs, ntok,
            w.dtype, tok.name or tostring(opts.tokenizer), append_eod and ', eod appended' or '', prefix, res.seconds))
        rep:print()
    end
    return res
end

return M
