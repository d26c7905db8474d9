-- lunar.data: the data pipeline, from files to packed micro-batches.
--
--   local data = require('lunar').data
--   -- readers (lunar.data.readers): bad rows are counted per reason with file:line, never fatal
--   local rows, rep = data.read_chat('sft.jsonl')                 -- {"messages": [...]}
--   local rows, rep = data.read_prompt_answer('gsm8k.jsonl', {prompt = 'question', answer = 'answer'})
--   local rows, rep = data.read_text('book.txt', {split = 'blank'})
--   local docs, rep = data.tokenize(rows, function(row) return ids, mask end, {max_len = 4096})
--   rep:print()                                                   -- lunar.data.report
--   -- Megatron .bin/.idx (lunar.data.indexed)
--   local ds = data.indexed_open('out/corpus_text_document'); ds:document(1)
--   local w = data.indexed_writer(prefix, {dtype = 'int32'}); w:add_document(ids); w:finish()
--   data.preprocess{input =, output_prefix =, tokenizer = 'bytes', format = 'text'}
--   -- packing (lunar.data.pack) and loading (lunar.data.loader)
--   local batch, plan = data.packer{seq_len = 512}:pack(docs)     -- plan.stats.efficiency
--   local L = data.loader{source = docs or ds, seq_len = 512, micro_batch = 4, seed = 1}
--   local batch = L:next(); local s = L:state(); L:set_state(s)
--   data.permutation(n, seed, epoch)
--
-- Each submodule documents its API at its top. Indices into datasets and lists are 1-based;
-- token ids, offsets inside cu_seqlens and positions are 0-based values, as everywhere in lunar.
local M = {}

local readers = require 'lunar.data.readers'
local indexed = require 'lunar.data.indexed'
local pack = require 'lunar.data.pack'
local loader = require 'lunar.data.loader'
local preprocess = require 'lunar.data.preprocess'
local report = require 'lunar.data.report'

M.report = report.new
M.read_chat = readers.read_chat
M.read_prompt_answer = readers.read_prompt_answer
M.read_jsonl_text = readers.read_jsonl_text
M.read_text = readers.read_text
M.tokenize = readers.tokenize

M.indexed_open = indexed.indexed_open
M.indexed_writer = indexed.indexed_writer
M.megatron_dtype = indexed.megatron_dtype

M.packer = pack.packer
function M.pack(docs, opts) return pack.packer(opts):pack(docs) end

M.permutation = loader.permutation
M.loader = loader.loader

M.preprocess = preprocess.run
M.byte_tokenizer = preprocess.byte_tokenizer
M.load_tokenizer = preprocess.load_tokenizer

return M
