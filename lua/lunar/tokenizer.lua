-- lunar.tokenizer: byte-level BPE tokenizers read from Hugging Face tokenizer.json files
-- (host/tokenizer; docs/tokenizer.md).
--
--   local tok = lunar.tokenizer.load('path/to/tokenizer.json')   -- or the directory holding it
--   local ids = tok:encode('[gMASK]<sop><|user|>\nhi')             -- {154822, 154824, ...}, 0-based
--   local t = tok:encode('hello', {tensor = true})                -- 1-D i64 tensor
--   local s = tok:decode(ids, {skip_special = true})
--   local batch = tok:encode_batch({'a', 'b'})                    -- OpenMP over the texts
--   local flat, offsets = tok:encode_batch(texts, {flat = true})  -- two i64 tensors
--
-- Special tokens written in the text are recognised by default (HF's default); {special = false}
-- encodes them as plain text (HF's encode_special_tokens = True). Non-special added tokens such
-- as <think> are recognised either way, as in HF. encode adds no BOS/EOS (GLM's chat template
-- writes [gMASK]<sop> itself). Texts are bytes: invalid UTF-8 is encoded losslessly and
-- decode(encode(x)) == x for every string.
local core = require 'lunar.core'

local M = {}

local function fail(msg) error(core.user_where() .. msg, 0) end

local Tokenizer = {}
Tokenizer.__index = Tokenizer

-- tok.eos: the id of the end-of-text token ('<|endoftext|>' in GLM's vocabularies; else
-- '</s>' or '<|eos|>'), nil when the vocabulary has none. Documents end with it in pretraining.
local EOS_CANDIDATES = {'<|endoftext|>', '</s>', '<|eos|>', '<eos>'}

function M.load(path)
    if type(path) ~= 'string' then fail('tokenizer.load: expected a path, got ' .. type(path)) end
    local tok = setmetatable({_t = core.tokenizer_load(path)}, Tokenizer)
    for _, s in ipairs(EOS_CANDIDATES) do
        local id = tok._t:token_to_id(s)
        if id then tok.eos = id break end
    end
    return tok
end

local function check_opts(opts, what, allowed)
    if opts == nil then return {} end
    if type(opts) ~= 'table' then fail(what .. ': options must be a table, got ' .. type(opts)) end
    for k in pairs(opts) do
        if not allowed[k] then fail(what .. ": unknown option '" .. tostring(k) .. "'") end
    end
    return opts
end

local ENC = {special = true, tensor = true}
local BATCH = {special = true, tensor = true, flat = true}
local DEC = {skip_special = true, skip_unknown = true}

-- tok:encode(text, {special = true, tensor = false}) -> {ids} or a 1-D i64 tensor
function Tokenizer:encode(text, opts)
    opts = check_opts(opts, 'encode', ENC)
    if type(text) ~= 'string' then fail('encode: expected a string, got ' .. type(text)) end
    return self._t:encode(text, opts.special == false, opts.tensor)
end

-- tok:encode_batch(texts, {special=, tensor=, flat=}) -> {{ids}, ...}, {tensor, ...}, or (with
-- flat) ids, offsets: the ids of texts[i] are ids[offsets[i] .. offsets[i+1]) (0-based offsets)
function Tokenizer:encode_batch(texts, opts)
    opts = check_opts(opts, 'encode_batch', BATCH)
    if type(texts) ~= 'table' then fail('encode_batch: expected a table of strings, got ' .. type(texts)) end
    local mode = opts.flat and 'flat' or (opts.tensor and 'tensor' or 'table')
    return self._t:encode_batch(texts, opts.special == false, mode)
end

-- tok:decode(ids, {skip_special = false, skip_unknown = false}) -> string; ids: a table of ids or
-- an integer tensor. An id the vocabulary does not have is an error, or, with skip_unknown, left
-- out, as Hugging Face tokenizers' decode does (a model whose embedding is padded past the
-- vocabulary, as GLM-5's is, may sample such an id)
function Tokenizer:decode(ids, opts)
    opts = check_opts(opts, 'decode', DEC)
    if type(ids) == 'userdata' and ids.tolist_flat then
        ids = opts.skip_unknown and ids:to('cpu'):to('i64'):contiguous():tolist_flat()
            or ids:to('cpu'):to('i64'):contiguous()
    elseif type(ids) ~= 'table' then
        fail('decode: expected a table of ids or a tensor, got ' .. type(ids))
    end
    if opts.skip_unknown then
        local known = {}
        for _, id in ipairs(ids) do
            if type(id) ~= 'number' or self._t:id_to_token(id) ~= nil then known[#known + 1] = id end
        end
        ids = known
    end
    return self._t:decode(ids, opts.skip_special)
end

function Tokenizer:token_to_id(s) return self._t:token_to_id(s) end
function Tokenizer:id_to_token(id) return self._t:id_to_token(id) end
function Tokenizer:is_special(id) return self._t:is_special(id) end
-- the largest id of the vocab and the added tokens, plus one
function Tokenizer:vocab_size() return self._t:vocab_size() end
-- {{id=, content=, special=, lstrip=, rstrip=, single_word=, normalized=}, ...} in id order
function Tokenizer:added_tokens() return self._t:added_tokens() end
function Tokenizer:path() return self._t:path() end
function Tokenizer:free() self._t:free() end

-- {content = id} of the special added tokens ('<|endoftext|>', '[gMASK]', '<|user|>', ...)
function Tokenizer:special_ids()
    local out = {}
    for _, a in ipairs(self._t:added_tokens()) do
        if a.special then out[a.content] = a.id end
    end
    return out
end

function Tokenizer:__tostring() return tostring(self._t) end

M.Tokenizer = Tokenizer
return M
