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
--   GLM-5.3-Flash (glm5_next; its layout is lunar.generate.flash's): on NoPE MLA layers the
--                 latent (kv_lora_rank); on full DSA layers one pooled indexer key per complete
--                 pool of index_kpool tokens (f32, written once when the pool completes); and per
--                 sequence, not per token: each KDA layer's recurrent state and conv history, each
--                 full DSA layer's raw keys and gates of the pool still filling (f32).
-- Each per-token entry is one (blocks * block_size, width) tensor in one arena allocated by
-- new(), a pooled one (blocks * block_size / every, width); a block is block_size consecutive
-- tokens of every such tensor. A per-sequence entry is one (max_sequences, ...) tensor: a
-- sequence holds one slot of each from new_sequence to free. bytes_per_token() is the sum of the
-- per-token widths times the dtype's size (a pooled width counts 1 / every);
-- bytes_per_sequence() the per-sequence entries' bytes.
--
-- Sequences own lists of blocks (their block table); token j of a sequence is row j % block_size
-- of its block j // block_size. A block is zeroed when it is handed to a sequence (rows are
-- written by index_add_ into zeros, lunar having no row copy by index), returned to the free
-- list when its last owner is freed, and may be shared: fork() gives the new sequence the full
-- blocks of the old one and a copy of its partly filled last block, so nothing shared is ever
-- written (a sequence only writes past its length, in its last block or a fresh one).
--
--   Cache.new(model, opts)             opts: budget_bytes (required), block_size (16, or the
--                                      least multiple of 16 that every pooled entry's `every`
--                                      divides), max_seq_len (the config's
--                                      max_position_embeddings): the longest sequence;
--                                      max_sequences: the sequences alive at once (required
--                                      when the model keeps per-sequence state, unused
--                                      otherwise); a budget that cannot hold one such sequence (and
--                                      the slots) is an error saying how many bytes it needs.
--   Cache.plan(model, opts)            -> {bytes_per_token, block_size, blocks, tokens, bytes, overhead_bytes
--                                      (the budget no block can use: alignment of each tensor),
--                                      layers = {{kv = width, ik = width} | {k =, v =}, ...}}
--                                      without allocating anything (the same checks as new)
--   cache:bytes_per_token()            bytes one token takes over all layers
--   cache:bytes_per_sequence()         bytes a sequence's own state takes (0 without any)
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

-- What a token keeps per layer: a list, per decoder layer, of entries {name, width} (one row of
-- `width` per token, in the model's dtype), or a family's own (lunar.generate.flash): {name,
-- width, per = 'pool', every = n, dtype =} one row per n tokens, {name, shape = {...}, per =
-- 'sequence', dtype =} one tensor of that shape per sequence.
local function layer_layout(model)
    if model.decode_module then return require(model.decode_module).cache_layout(model) end
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

local function numel(shape)
    local n = 1
    for _, d in ipairs(shape) do n = n * d end
    return n
end

local function gcd(a, b) while b ~= 0 do a, b = b, a % b end return a end

function Cache.plan(model, opts)
    opts = opts or {}
    if type(model) ~= 'table' or not model.layers or not model.cfg then
        fail('kv cache: the first argument must be a lunar model (lunar.model.load / new)')
    end
    local budget = opts.budget_bytes
    if not is_int(budget) or budget <= 0 then
        fail(('kv cache: budget_bytes must be a positive whole number of bytes, got %s'):format(tostring(budget)))
    end
    local dtype = model.dtype
    local es = DTYPE_BYTES[dtype]
    if not es then fail(('kv cache: no cache for models of dtype %s'):format(tostring(dtype))) end
    local layout = layer_layout(model)
    -- the pooled entries' strides: the default block size is a multiple of every one
    local every = 1
    for _, rows in ipairs(layout) do
        for _, r in ipairs(rows) do
            if r.per == 'pool' then every = every * r.every / gcd(every, r.every) end
        end
    end
    local bs = opts.block_size or 16 * every / gcd(16, every)
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
    local block_bytes, seq_bytes, ntensors = 0, 0, 0
    local layers = {}
    for i, rows in ipairs(layout) do
        layers[i] = {}
        for _, r in ipairs(rows) do
            local name = r[1]
            local size = DTYPE_BYTES[r.dtype or dtype]
            ntensors = ntensors + 1
            if r.per == 'sequence' then
                seq_bytes = seq_bytes + numel(r.shape) * size
                layers[i][name] = r.shape
            elseif r.per == 'pool' then
                if bs % r.every ~= 0 then
                    fail(('kv cache: block_size %d is not a multiple of %d, the tokens of one pooled %s row (index_kpool)'):format(
                        bs, r.every, name))
                end
                block_bytes = block_bytes + r[2] * size * bs / r.every
                layers[i][name] = r[2]
            else
                block_bytes = block_bytes + r[2] * size * bs
                layers[i][name] = r[2]
            end
        end
    end
    local nseq = opts.max_sequences
    if seq_bytes > 0 then
        if not is_int(nseq) or nseq < 1 then
            fail(('kv cache: this model keeps %d bytes of state per sequence; max_sequences (the sequences alive '
                .. 'at once) must be a positive integer, got %s'):format(seq_bytes, tostring(nseq)))
        end
    else
        nseq = 0   -- (a model without per-sequence state has no slots to count)
    end
    local bpt = block_bytes / bs
    local overhead = ntensors * ALIGN
    local blocks = math.floor((budget - overhead - nseq * seq_bytes) / block_bytes)
    if blocks < 0 then blocks = 0 end
    local need_blocks = math.ceil(max_len / bs)
    if blocks < need_blocks then
        local need = need_blocks * block_bytes + overhead + nseq * seq_bytes
        fail(('kv cache: budget_bytes = %d (%s) holds %d tokens (%s bytes per token, blocks of %d tokens%s); '
            .. 'one sequence of max_seq_len = %d tokens needs %d bytes (%s)'):format(budget, mib(budget),
            blocks * bs, tostring(bpt), bs,
            nseq > 0 and (', after %d sequence slots of %d bytes'):format(nseq, seq_bytes) or '',
            max_len, need, mib(need)))
    end
    return {bytes_per_token = bpt, bytes_per_sequence = seq_bytes, max_sequences = nseq, block_size = bs,
            blocks = blocks, tokens = blocks * bs, max_seq_len = max_len,
            bytes = blocks * block_bytes + nseq * seq_bytes, budget_bytes = budget, overhead_bytes = overhead,
            dtype = dtype, layers = layers, layout = layout}
end

function Cache.new(model, opts)
    local plan = Cache.plan(model, opts)
    local P, S = plan.blocks * plan.block_size, plan.max_sequences
    -- each entry's tensor shape and dtype
    local shapes = {}
    local bytes = 0
    for i, rows in ipairs(plan.layout) do
        shapes[i] = {}
        for k, r in ipairs(rows) do
            local dt = r.dtype or plan.dtype
            local shape
            if r.per == 'sequence' then
                shape = {S}
                for _, d in ipairs(r.shape) do shape[#shape + 1] = d end
            elseif r.per == 'pool' then shape = {P / r.every, r[2]}
            else shape = {P, r[2]} end
            shapes[i][k] = {shape = shape, dtype = dt}
            bytes = bytes + math.ceil(numel(shape) * DTYPE_BYTES[dt] / ALIGN) * ALIGN
        end
    end
    local arena = core.arena_new('kv_cache', bytes, model:device())
    local layers, paged, states = {}, {}, {}
    for i, rows in ipairs(plan.layout) do
        local t = {}
        for k, r in ipairs(rows) do
            local sh = shapes[i][k]
            local x = arena:tensor(sh.shape, sh.dtype, ('kv_cache.%d.%s'):format(i - 1, r[1]))
            t[r[1]] = x
            if r.per == 'sequence' then states[#states + 1] = x
            else paged[#paged + 1] = {t = x, rows = r.per == 'pool' and plan.block_size / r.every or plan.block_size} end
        end
        layers[i] = t
    end
    local self = setmetatable({
        model = model, plan = plan, arena = arena, layers = layers, paged = paged, states = states,
        block_size = plan.block_size, nblocks = plan.blocks, max_seq_len = plan.max_seq_len,
        free_list = {}, refs = {}, seqs = {}, next_id = 1, free_slots = {},
    }, Cache)
    -- the free list is a stack: block 0 is handed out first
    for b = plan.blocks - 1, 0, -1 do self.free_list[#self.free_list + 1] = b end
    for b = 0, plan.blocks - 1 do self.refs[b] = 0 end
    for q = S - 1, 0, -1 do self.free_slots[#self.free_slots + 1] = q end
    return self
end

function Cache:bytes_per_token() return self.plan.bytes_per_token end
function Cache:bytes_per_sequence() return self.plan.bytes_per_sequence end
function Cache:capacity() return self.nblocks * self.block_size end
function Cache:free_blocks() return #self.free_list end

function Cache:summary()
    local p = self.plan
    local line = ('kv cache: %s bytes per token (%s), budget %s holds %d tokens in %d blocks of %d; max_seq_len %d'):format(
        tostring(p.bytes_per_token), p.dtype, mib(p.budget_bytes), p.tokens, p.blocks, p.block_size, p.max_seq_len)
    if p.bytes_per_sequence > 0 then
        line = line .. ('; %d bytes of state per sequence (%s), %d sequences'):format(p.bytes_per_sequence,
            mib(p.bytes_per_sequence), p.max_sequences)
    end
    return line
end

local function seq_of(self, id, who)
    if not self.arena then fail(('%s: the kv cache was released'):format(who)) end
    local s = self.seqs[id]
    if not s then fail(('%s: %s is not a live sequence of this kv cache'):format(who, tostring(id))) end
    return s
end

function Cache:new_sequence()
    if not self.arena then fail('kv cache: new_sequence: the cache was released') end
    local slot
    if #self.states > 0 then
        if #self.free_slots == 0 then
            fail(('kv cache: new_sequence: all %d sequence slots are taken (max_sequences); free a sequence first'):format(
                self.plan.max_sequences))
        end
        slot = table.remove(self.free_slots)
    end
    local id = self.next_id
    self.next_id = id + 1
    self.seqs[id] = {blocks = {}, len = 0, slot = slot}
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

-- a block from the free list, zeroed in every paged cache tensor
local function take_block(self)
    local b = table.remove(self.free_list)
    self.refs[b] = 1
    for _, p in ipairs(self.paged) do p.t:narrow(1, b * p.rows + 1, p.rows):fill_(0) end
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
    if s.slot then self.free_slots[#self.free_slots + 1] = s.slot end
    self.seqs[id] = nil
end

function Cache:fork(id)
    local s = seq_of(self, id, 'kv cache: fork')
    local bs = self.block_size
    local partial = s.len % bs ~= 0
    if partial and #self.free_list == 0 then
        fail(('kv cache: fork of sequence %d needs a free block for its partly filled last block; none is free'):format(id))
    end
    if #self.states > 0 and #self.free_slots == 0 then
        fail(('kv cache: fork of sequence %d needs a free sequence slot for its state; all %d are taken (max_sequences)'):format(
            id, self.plan.max_sequences))
    end
    local nid = self:new_sequence()
    local n = self.seqs[nid]
    for _, x in ipairs(self.states) do x:select(1, n.slot + 1):copy_(x:select(1, s.slot + 1)) end
    for i, b in ipairs(s.blocks) do
        if i == #s.blocks and partial then
            local c = take_block(self)
            for _, p in ipairs(self.paged) do
                p.t:narrow(1, c * p.rows + 1, p.rows):copy_(p.t:narrow(1, b * p.rows + 1, p.rows))
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
        self.paged, self.states, self.free_slots = {}, {}, {}
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

-- gather(t, view) -> (B, Lpad, width): each sequence's blocks of cache tensor t, in order (a
-- pooled tensor: (B, Lpad / every, width))
function Cache:gather(t, v)
    local rows, W = t:size(1) / self.nblocks, t:size(2)
    local g = ops.index_select(t:view(self.nblocks, rows * W), 1, v.block_ids)
    return g:view(v.B, v.nblk * rows, W)
end

-- slot(id) -> the sequence's slot (0-based) in the per-sequence tensors
function Cache:slot(id) return self.seqs[id].slot end

-- pool_row(id, p, every) -> the row (0-based) of pool p (0-based) of the sequence in a pooled
-- tensor of stride `every`; the pool's block must be the sequence's already
function Cache:pool_row(id, p, every)
    local bs = self.block_size
    local s = self.seqs[id]
    local first = p * every
    return s.blocks[math.floor(first / bs) + 1] * (bs / every) + (first % bs) / every
end

return Cache
