-- lunar.generate.cache: the key/value cache of generation, in fixed-size blocks carved once from
-- a byte budget (paged, as vLLM pages its cache). docs/generation.md explains the layout.
--
--   local Cache = require 'lunar.generate.cache'
--   local cache = Cache.new(model, {budget_bytes = 256 * 2^20, block_size = 16, max_seq_len = 4096})
--   print(cache:summary())        -- bytes per token, tokens the budget holds, blocks
--   local s = cache:new_sequence()                  -- an empty sequence (an id)
--   decode.prefill(cache, {s}, {{1, 2, 3}})         -- lunar.generate.decode writes and reads it
--   local t = cache:fork(s)                         -- a second sample of the same prompt
--   cache:free(s); cache:free(t)                    -- their blocks are free again at once
--   cache:release()                                 -- gives the memory back
--
-- What a token keeps, per layer (the model's own dtype; GLM-5 = GlmMoeDsa, Glm4Moe = GLM-4.x):
--   GLM-5 (MLA)   kv: the compressed latent after kv_a_layernorm (kv_lora_rank) followed by the
--                 rotary key after RoPE (qk_rope_head_dim), one row of kv_lora_rank +
--                 qk_rope_head_dim; never the expanded keys and values (decode absorbs kv_b_proj).
--                 ik: the DSA indexer's key after its LayerNorm and RoPE (index_head_dim), on
--                 layers that run their own indexer ('full'); IndexShare ('shared') layers
--                 have none. The MTP layer is not used by generation and has no cache.
--   GLM-4.x (GQA) k: the keys after qk-norm and partial RoPE (num_key_value_heads x head_dim);
--                 v: the values (num_key_value_heads x head_dim).
-- Each of these is one (blocks * block_size, width) tensor in one arena allocated by new(); a
-- block is block_size consecutive rows of every such tensor. bytes_per_token() is the sum of the
-- widths times the dtype's size.
--
-- Sequences own lists of blocks (their block table); token j of a sequence is row j % block_size
-- of its block j // block_size. A block is zeroed when it is handed to a sequence (rows are
-- written by index_add_ into zeros, lunar having no row copy by index), returned to the free
-- list when its last owner is freed, and may be shared: fork() gives the new sequence the full
-- blocks of the old one and a copy of its partly filled last block, so nothing shared is ever
-- written (a sequence only writes past its length, in its last block or a fresh one).
--
--   Cache.new(model, opts)             opts: budget_bytes (required), block_size (16),
--                                      max_seq_len (the config's max_position_embeddings): the
--                                      longest sequence; a budget that cannot hold one such
--                                      sequence is an error saying how many bytes it needs.
--   Cache.plan(model, opts)            -> {bytes_per_token, block_size, blocks, tokens, bytes, overhead_bytes
--                                      (the budget no block can use: alignment of each tensor),
--                                      layers = {{kv = width, ik = width} | {k =, v =}, ...}}
--                                      without allocating anything (the same checks as new)
--   cache:bytes_per_token()            bytes one token takes over all layers
--   cache:capacity()                   tokens the budget holds (blocks * block_size)
--   cache:summary()                    one line with both and the budget
--   cache:new_sequence() -> id         cache:free(id)      cache:fork(id) -> id
--   cache:length(id)                   tokens cached for the sequence
--   cache:free_blocks()                blocks not owned by any sequence
--   cache:blocks_needed(id, n)         new blocks that n more tokens of sequence id take
--   cache:sequences()                  the live sequence ids, ascending
--   cache:release()                    frees the arena; the cache is unusable afterwards
-- For lunar.generate (not for users): cache:append(ids, counts) reserves the next tokens,
-- cache:view(ids) describes the sequences' blocks for one step (cache:mask(view) its dense
-- mask), cache:write / gather move rows.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local ops = require 'lunar.ops'
local masks = require 'lunar.nn.masks'

local fail = tensor.fail

local Cache = {}
Cache.__index = Cache

local DTYPE_BYTES = {f64 = 8, f32 = 4, bf16 = 2, f16 = 2, f8e4m3 = 1, f8e5m2 = 1}
local ALIGN = 64          -- the arena aligns each tensor to 64 bytes (host/core/arena.c)

local function is_int(v) return type(v) == 'number' and v == math.floor(v) end

-- The rows a token keeps per layer: a list, per decoder layer, of {name, width} pairs.
local function layer_layout(model)
    local layout = {}
    for i, L in ipairs(model.layers) do
        local a = L.attn
        local rows
        if model.cfg.model_type == 'glm_moe_dsa' then
            rows = {{'kv', a.Rkv + a.Dr}}
            if a.indexer_type == 'full' then rows[2] = {'ik', a.indexer.Di} end
        else
            rows = {{'k', a.nkv * a.hd}, {'v', a.nkv * a.hd}}
        end
        layout[i] = rows
    end
    return layout
end

local function mib(b) return ('%.1f MiB'):format(b / 2^20) end

function Cache.plan(model, opts)
    opts = opts or {}
    if type(model) ~= 'table' or not model.layers or not model.cfg then
        fail('kv cache: the first argument must be a lunar model (lunar.model.load / new)')
    end
    if model.cfg.model_type == 'glm5_next' then
        fail('kv cache: GLM-5.3-Flash (glm5_next) has no cache in this version of lunar (its KDA states and '
            .. 'pooled keys are not built yet)')
    end
    local budget = opts.budget_bytes
    if not is_int(budget) or budget <= 0 then
        fail(('kv cache: budget_bytes must be a positive whole number of bytes, got %s'):format(tostring(budget)))
    end
    local bs = opts.block_size or 16
    if not is_int(bs) or bs < 1 then
        fail(('kv cache: block_size must be a positive integer, got %s'):format(tostring(bs)))
    end
    local max_pos = model.cfg.max_position_embeddings
    local max_len = opts.max_seq_len or max_pos
    if not is_int(max_len) or max_len < 1 then
        fail(('kv cache: max_seq_len must be a positive integer, got %s'):format(tostring(max_len)))
    end
    if max_pos and max_len > max_pos then
        fail(('kv cache: max_seq_len %d exceeds the model\'s max_position_embeddings %d'):format(max_len, max_pos))
    end
    local dtype = model.dtype
    local es = DTYPE_BYTES[dtype]
    if not es then fail(('kv cache: no cache for models of dtype %s'):format(tostring(dtype))) end
    local layout = layer_layout(model)
    local width, ntensors = 0, 0
    local layers = {}
    for i, rows in ipairs(layout) do
        layers[i] = {}
        for _, r in ipairs(rows) do
            width, ntensors = width + r[2], ntensors + 1
            layers[i][r[1]] = r[2]
        end
    end
    local bpt = width * es
    local block_bytes = bpt * bs
    local overhead = ntensors * ALIGN
    local blocks = math.floor((budget - overhead) / block_bytes)
    if blocks < 0 then blocks = 0 end
    local need_blocks = math.ceil(max_len / bs)
    if blocks < need_blocks then
        fail(('kv cache: budget_bytes = %d (%s) holds %d tokens (%d bytes per token, blocks of %d tokens); '
            .. 'one sequence of max_seq_len = %d tokens needs %d bytes (%s)'):format(budget, mib(budget),
            blocks * bs, bpt, bs, max_len, need_blocks * block_bytes + overhead, mib(need_blocks * block_bytes + overhead)))
    end
    return {bytes_per_token = bpt, block_size = bs, blocks = blocks, tokens = blocks * bs, max_seq_len = max_len,
            bytes = blocks * block_bytes, budget_bytes = budget, overhead_bytes = overhead, dtype = dtype, layers = layers,
            layout = layout}
end

function Cache.new(model, opts)
    local plan = Cache.plan(model, opts)
    local P = plan.blocks * plan.block_size
    local bytes = 0
    for _, rows in ipairs(plan.layout) do
        for _, r in ipairs(rows) do
            bytes = bytes + math.ceil(P * r[2] * DTYPE_BYTES[plan.dtype] / ALIGN) * ALIGN
        end
    end
    local arena = core.arena_new('kv_cache', bytes, model:device())
    local layers = {}
    for i, rows in ipairs(plan.layout) do
        local t = {}
        for _, r in ipairs(rows) do
            t[r[1]] = arena:tensor({P, r[2]}, plan.dtype, ('kv_cache.%d.%s'):format(i - 1, r[1]))
        end
        layers[i] = t
    end
    local self = setmetatable({
        model = model, plan = plan, arena = arena, layers = layers,
        block_size = plan.block_size, nblocks = plan.blocks, max_seq_len = plan.max_seq_len,
        free_list = {}, refs = {}, seqs = {}, next_id = 1,
    }, Cache)
    -- the free list is a stack: block 0 is handed out first
    for b = plan.blocks - 1, 0, -1 do self.free_list[#self.free_list + 1] = b end
    for b = 0, plan.blocks - 1 do self.refs[b] = 0 end
    return self
end

function Cache:bytes_per_token() return self.plan.bytes_per_token end
function Cache:capacity() return self.nblocks * self.block_size end
function Cache:free_blocks() return #self.free_list end

function Cache:summary()
    local p = self.plan
    return ('kv cache: %d bytes per token (%s), budget %s holds %d tokens in %d blocks of %d; max_seq_len %d'):format(
        p.bytes_per_token, p.dtype, mib(p.budget_bytes), p.tokens, p.blocks, p.block_size, p.max_seq_len)
end

local function seq_of(self, id, who)
    if not self.arena then fail(('%s: the kv cache was released'):format(who)) end
    local s = self.seqs[id]
    if not s then fail(('%s: %s is not a live sequence of this kv cache'):format(who, tostring(id))) end
    return s
end

function Cache:new_sequence()
    if not self.arena then fail('kv cache: new_sequence: the cache was released') end
    local id = self.next_id
    self.next_id = id + 1
    self.seqs[id] = {blocks = {}, len = 0}
    return id
end

function Cache:sequences()
    local ids = {}
    for id in pairs(self.seqs) do ids[#ids + 1] = id end
    table.sort(ids)
    return ids
end

function Cache:length(id) return seq_of(self, id, 'kv cache: length').len end

function Cache:blocks_needed(id, n)
    local s = seq_of(self, id, 'kv cache: blocks_needed')
    return math.ceil((s.len + n) / self.block_size) - #s.blocks
end

-- a block from the free list, zeroed in every cache tensor
local function take_block(self)
    local b = table.remove(self.free_list)
    self.refs[b] = 1
    local bs = self.block_size
    for _, t in ipairs(self.layers) do
        for _, x in pairs(t) do x:narrow(1, b * bs + 1, bs):fill_(0) end
    end
    return b
end

local function drop_block(self, b)
    local r = self.refs[b] - 1
    self.refs[b] = r
    if r == 0 then self.free_list[#self.free_list + 1] = b end
end

function Cache:free(id)
    local s = seq_of(self, id, 'kv cache: free')
    for _, b in ipairs(s.blocks) do drop_block(self, b) end
    self.seqs[id] = nil
end

function Cache:fork(id)
    local s = seq_of(self, id, 'kv cache: fork')
    local bs = self.block_size
    local partial = s.len % bs ~= 0
    if partial and #self.free_list == 0 then
        fail(('kv cache: fork of sequence %d needs a free block for its partly filled last block; none is free'):format(id))
    end
    local nid = self:new_sequence()
    local n = self.seqs[nid]
    for i, b in ipairs(s.blocks) do
        if i == #s.blocks and partial then
            local c = take_block(self)
            for _, t in ipairs(self.layers) do
                for _, x in pairs(t) do x:narrow(1, c * bs + 1, bs):copy_(x:narrow(1, b * bs + 1, bs)) end
            end
            n.blocks[i] = c
        else
            self.refs[b] = self.refs[b] + 1
            n.blocks[i] = b
        end
    end
    n.len = s.len
    return nid
end

function Cache:release()
    if self.arena then
        self.arena:free()
        self.arena, self.layers, self.seqs, self.free_list = nil, {}, {}, {}
    end
end

-- ---- for lunar.generate.decode -------------------------------------------------------------

-- append(ids, counts, who) -> slots (Lua list, 0-based rows of every cache tensor, sequence by
-- sequence), starts (each sequence's first new position). Checks everything before taking a
-- block, so a refused append changes nothing.
function Cache:append(ids, counts, who)
    local bs, need, seen = self.block_size, 0, {}
    for i, id in ipairs(ids) do
        local s = seq_of(self, id, who)
        if seen[id] then fail(('%s: sequence %d appears twice in one call'):format(who, id)) end
        seen[id] = true
        local n = counts[i]
        if s.len + n > self.max_seq_len then
            fail(('%s: sequence %d would hold %d tokens, more than the kv cache\'s max_seq_len %d'):format(
                who, id, s.len + n, self.max_seq_len))
        end
        need = need + math.ceil((s.len + n) / bs) - #s.blocks
    end
    if need > #self.free_list then
        fail(('%s: the kv cache has %d free blocks of %d tokens, these sequences need %d more (free finished sequences, or give a larger budget_bytes)'):format(
            who, #self.free_list, bs, need))
    end
    local slots, starts = {}, {}
    for i, id in ipairs(ids) do
        local s = self.seqs[id]
        starts[i] = s.len
        for p = s.len, s.len + counts[i] - 1 do
            local j = math.floor(p / bs) + 1
            if j > #s.blocks then s.blocks[j] = take_block(self) end
            slots[#slots + 1] = s.blocks[j] * bs + p % bs
        end
        s.len = s.len + counts[i]
    end
    return slots, starts
end

-- view(ids) -> what one step needs to read the sequences' cache: {B, nblk, Lpad, lens (Lua),
-- max_len, block_ids (B * nblk) i64, table (B, nblk) (the same ids: the paged attention's block
-- table), lengths (B) i64}, on the cache's device. A sequence with fewer blocks repeats its
-- first one (never read: its length ends before). cache:mask(view) adds the (B, 1, Lpad) f32
-- mask of dense reads (0 at positions < length, finfo.min after).
function Cache:view(ids)
    local bs, dev = self.block_size, self.model:device()
    local B, nblk, lens, max_len = #ids, 0, {}, 0
    for i, id in ipairs(ids) do
        local s = self.seqs[id]
        lens[i] = s.len
        if s.len > max_len then max_len = s.len end
        if #s.blocks > nblk then nblk = #s.blocks end
    end
    local flat = {}
    for i, id in ipairs(ids) do
        local blocks = self.seqs[id].blocks
        for j = 1, nblk do flat[(i - 1) * nblk + j] = blocks[j] or blocks[1] end
    end
    local block_ids = core.from_flat(flat, {B * nblk}, 'i64', dev)
    return {B = B, nblk = nblk, Lpad = nblk * bs, lens = lens, max_len = max_len, block_ids = block_ids,
            table = block_ids:view(B, nblk), lengths = core.from_flat(lens, {B}, 'i64', dev)}
end

-- mask(view) -> (B, 1, Lpad) f32: 0 at each sequence's positions < its length, finfo.min after
-- (made once per view, for reads of gathered blocks)
function Cache:mask(v)
    if not v.mask then
        local dev = self.model:device()
        local len_t = core.from_flat(v.lens, {v.B, 1, 1}, 'f32', dev)
        local pos = core.empty({1, 1, v.Lpad}, 'f32', dev):arange_(0, 1)
        v.mask = core.empty({v.B, 1, v.Lpad}, 'f32', dev):fill_(0)
        ops.masked_fill_(v.mask, ops.ge(pos, len_t), masks.FMIN)
    end
    return v.mask
end

-- write(t, slots, rows): rows (N, width) into rows `slots` ((N) i64, zero since their block
-- was taken) of the cache tensor t
function Cache:write(t, slots, rows)
    ops.index_add_(t, 1, slots, rows)
end

-- gather(t, view) -> (B, Lpad, width): each sequence's blocks of cache tensor t, in order
function Cache:gather(t, v)
    local bs, W = self.block_size, t:size(2)
    local g = ops.index_select(t:view(self.nblocks, bs * W), 1, v.block_ids)
    return g:view(v.B, v.Lpad, W)
end

return Cache
