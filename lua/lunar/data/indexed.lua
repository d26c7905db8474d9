-- lunar.data.indexed: Megatron-LM indexed datasets (<prefix>.bin + <prefix>.idx), the format of
-- Megatron's preprocess_data.py (layout in host/include/lunar/indexed.h).
--
--   local ds = data.indexed_open(prefix)        -- validates both files; errors name the file
--   ds:num_documents(), ds:num_sequences(), ds:total_tokens(), ds:dtype() ('int32', 'uint16'...)
--   ds:document(i)            -- tokens of document i (1-based) as a CPU tensor: a zero-copy view
--                             -- of the mapping for u8/i8/i32/i64/f32/f64, an i32 copy for
--                             -- uint16/int16; views stay valid after ds:close()
--   ds:sequence(i[, start, length])  -- the same for sequence i, or its tokens start.. (1-based)
--   ds:length(i)              -- tokens in document i; ds:sequence_length(i) for sequence i
--   ds:tokens(i)              -- document i as a Lua list of ids (what the packer reads)
--   ds:count()                -- = num_documents() (the loader's source protocol: count,
--                             -- length, tokens)
--   ds:lengths(), ds:pointers(), ds:document_indices(), ds:modes()   -- the raw index arrays as
--                             -- tensors (i32, i64, i64, i8 or nil), values exactly as stored
--   ds:close()
--
--   local w = data.indexed_writer(prefix, {dtype = 'int32'})   -- or dtype = 'auto' + vocab_size
--   w:add(ids)                -- one sequence: a Lua list of integers or an integer tensor
--   w:end_document()          -- Megatron's end_document: close the current document
--   w:add_document(ids)       -- add + end_document (the usual case: a document = a sequence)
--   w:counts()                -- sequences, documents, tokens so far
--   w:finish()                -- writes <prefix>.idx, then renames both files into place
--   w:abort()                 -- removes the temporary files (also done if w is collected)
--
--   data.megatron_dtype(vocab_size) -> 'uint16' when vocab_size < 65500, else 'int32'
--   (Megatron's rule; GLM needs int32)
--
-- A sequence's values must fit the dtype (the error names the sequence, the token and its
-- value, and the writer stays usable). Sequences added after the last end_document form one
-- more document at finish. For the same documents the files are byte-identical to Megatron's.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'

local C = core.data
local fail = tensor.fail

local M = {}

local DTYPE_CODES = {uint8 = 1, int8 = 2, int16 = 3, int32 = 4, int64 = 5, float64 = 6, float32 = 7, uint16 = 8}
M.DTYPE_CODES = DTYPE_CODES

function M.megatron_dtype(vocab_size)
    if type(vocab_size) ~= 'number' then fail('megatron_dtype: vocab_size must be a number, got ' .. type(vocab_size)) end
    return vocab_size < 65500 and 'uint16' or 'int32'
end

local Dataset = {}
Dataset.__index = Dataset

local function check_index(self, i, n, what)
    if type(i) ~= 'number' or i ~= math.floor(i) or i < 1 or i > n then
        fail(('%s: %s %s is out of range 1..%d'):format(self._prefix, what, tostring(i), n))
    end
end

function M.indexed_open(prefix)
    if type(prefix) ~= 'string' then fail('indexed_open: expected a path prefix, got ' .. type(prefix)) end
    prefix = prefix:gsub('%.bin$', ''):gsub('%.idx$', '')
    local h = C.indexed_open(prefix)
    return setmetatable({_h = h, _prefix = prefix, _ndocs = h:document_count(), _nseq = h:sequence_count()}, Dataset)
end

function Dataset:num_documents() return self._ndocs end
function Dataset:num_sequences() return self._nseq end
function Dataset:count() return self._ndocs end
function Dataset:total_tokens() return self._h:total_tokens() end
function Dataset:dtype() return self._h:dtype() end
function Dataset:prefix() return self._prefix end
function Dataset:multimodal() return self._h:multimodal() end
function Dataset:lengths() return self._h:lengths() end
function Dataset:pointers() return self._h:pointers() end
function Dataset:document_indices() return self._h:document_indices() end
function Dataset:modes() return self._h:modes() end

function Dataset:close()
    self._h:close()
end

-- per-document token counts and first token numbers, computed once
function Dataset:_doc_table()
    if self._doc_len then return end
    local seq_len = self._h:lengths():tolist_flat()
    local di = self._h:document_indices():tolist_flat()
    local first_of_seq, acc = {}, 0
    for s = 1, #seq_len do
        first_of_seq[s] = acc
        acc = acc + seq_len[s]
    end
    local len, first = {}, {}
    for d = 1, self._ndocs do
        local s0, s1 = di[d], di[d + 1]   -- sequences [s0, s1), 0-based
        local n = 0
        for s = s0 + 1, s1 do n = n + seq_len[s] end
        len[d] = n
        first[d] = s1 > s0 and first_of_seq[s0 + 1] or 0
    end
    self._doc_len, self._doc_first = len, first
end

function Dataset:length(i)
    check_index(self, i, self._ndocs, 'document')
    self:_doc_table()
    return self._doc_len[i]
end

-- all document lengths as a Lua list (the packer's input)
function Dataset:document_lengths()
    self:_doc_table()
    local out = {}
    for i = 1, self._ndocs do out[i] = self._doc_len[i] end
    return out
end

function Dataset:sequence_length(i)
    check_index(self, i, self._nseq, 'sequence')
    return self._h:length(i - 1)
end

function Dataset:document(i)
    check_index(self, i, self._ndocs, 'document')
    return self._h:document(i - 1)
end

function Dataset:sequence(i, start, length)
    check_index(self, i, self._nseq, 'sequence')
    local n = self._h:length(i - 1)
    start = start or 1
    length = length or (n - start + 1)
    if start < 1 or length < 0 or start + length - 1 > n then
        fail(('%s: tokens %d..%d of sequence %d are out of range (length %d)'):format(self._prefix, start,
            start + length - 1, i, n))
    end
    return self._h:sequence(i - 1, start - 1, length)
end

function Dataset:tokens(i)
    check_index(self, i, self._ndocs, 'document')
    self:_doc_table()
    return self._h:tokens(self._doc_first[i], self._doc_len[i])
end

function Dataset:__tostring() return tostring(self._h) end

-- ---- writer ------------------------------------------------------------------------------------

local INT_DTYPES = {i64 = true, i32 = true, i8 = true, u8 = true}

local Writer = {}
Writer.__index = Writer

function M.indexed_writer(prefix, opts)
    if type(prefix) ~= 'string' then fail('indexed_writer: expected a path prefix, got ' .. type(prefix)) end
    opts = opts or {}
    local dtype = opts.dtype or 'int32'
    if dtype == 'auto' then
        if not opts.vocab_size then fail("indexed_writer: dtype = 'auto' needs vocab_size") end
        dtype = M.megatron_dtype(opts.vocab_size)
    end
    local code = DTYPE_CODES[dtype]
    if not code then
        fail(('indexed_writer: dtype %s is not one of uint8 int8 int16 int32 int64 float64 float32 uint16 auto')
            :format(tostring(dtype)))
    end
    return setmetatable({_h = C.indexed_writer(prefix, code), prefix = prefix, dtype = dtype}, Writer)
end

function Writer:add(ids)
    if tensor.is_tensor(ids) then
        if ids:dim() ~= 1 then fail(('indexed writer: a sequence must be 1-D, got %d dims'):format(ids:dim())) end
        if not INT_DTYPES[ids:dtype()] then
            fail(('indexed writer: token ids must be an integer tensor, got %s'):format(ids:dtype()))
        end
        if ids:dtype() ~= 'i64' or ids:device() ~= 'cpu' or not ids:is_contiguous() then
            ids = ids:to{dtype = 'i64', device = 'cpu'}:contiguous()
        end
    elseif type(ids) ~= 'table' then
        fail('indexed writer: add expects a list of token ids or a tensor, got ' .. type(ids))
    end
    self._h:add(ids)
    return self
end

function Writer:end_document()
    self._h:end_document()
    return self
end

function Writer:add_document(ids)
    self:add(ids)
    return self:end_document()
end

function Writer:counts() return self._h:counts() end
function Writer:finish() self._h:finish() end
function Writer:abort() self._h:abort() end

return M
