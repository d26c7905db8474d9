-- lunar.data.loader: deterministic shuffling by (seed, epoch), packed micro-batches, and the exact
-- position in the data saved and restored.
--
--   data.permutation(n, seed, epoch) -> a shuffled list of 1..n. Fisher-Yates driven by uniform
--       f64 draws of lunar.rng(seed):split('data order'):split(epoch) (Philox: the same on every
--       machine and thread count). epoch is a non-negative integer.
--
--   local L = data.loader{source =, seq_len =, micro_batch = 1, seed = 0, shuffle = true,
--       pad_to_multiple = 1, overlong = 'truncate', packing = 'bfd', pack_buffer = 10000,
--       pad_id = 0, dp_rank = 0, dp_size = 1, epochs = nil, pad_last = false, quiet = false}
--     source: a list of documents ({ids =, mask =} or lists of ids) or an object with :count(),
--     :length(i) (or :document_lengths()), :tokens(i) [, :mask(i)] such as a Megatron dataset.
--     Each epoch e (0, 1, ...) packs the documents in the order permutation(n, seed, e) (1..n
--     without shuffle) with lunar.data.packer (packing: 'bfd', best fit decreasing over buffers
--     of pack_buffer documents, its rows shuffled inside each buffer by (seed, e) also without
--     shuffle; or 'first_fit' over the whole order) and then visits the rows in a second
--     shuffled order (stream 'row order'). Rows form one stream across epochs: a micro-batch
--     that reaches the end of an epoch continues with the next one. With dp_size > 1 each step
--     takes micro_batch * dp_size rows and rank dp_rank gets its slice.
--   L:next() -> batch (see lunar.data.pack: input_ids, labels, targets, position_ids,
--       cu_seqlens, num_tokens, num_targets) plus batch.epoch (epoch of its first row) and
--       batch.step (1, 2, ...); nil once `epochs` epochs are consumed. With pad_last (and
--       epochs), the rows left at the end that do not fill micro_batch * dp_size come as a last
--       batch filled up with rows of padding (no target; a rank may get padding only), so that
--       every row is taken once and every rank gets as many batches (an evaluation)
--   L:state() -> {version = 1, epoch =, row =, step =, config = {...}}: a plain table (JSON-able)
--       with the position (the next row of epoch `epoch`, 0-based count of rows taken) and the
--       settings that fix the order. The plan of an epoch is recomputed from (seed, epoch), so
--       this is the whole state.
--   L:set_state(s) -- continue from s; the settings must match (the error names the first that
--       differs), so a resumed run sees exactly the batches the original run would have seen.
--   L:plan(epoch) -> the packing plan of an epoch (plan.stats.efficiency ...);
--   L:rows_per_epoch(epoch) -> #plan.rows
local lunar_core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local pack = require 'lunar.data.pack'

local fail = tensor.fail
local M = {}

local function check_nonneg_int(v, what)
    if type(v) ~= 'number' or v < 0 or v ~= math.floor(v) then
        fail(('%s must be a non-negative integer, got %s'):format(what, tostring(v)))
    end
    return v
end

-- the documents 1..n in the order of epoch `epoch` (pack.shuffle_in_place on stream (seed, epoch))
function M.permutation(n, seed, epoch)
    check_nonneg_int(n, 'permutation: n')
    check_nonneg_int(seed or 0, 'permutation: seed')
    check_nonneg_int(epoch or 0, 'permutation: epoch')
    local perm = {}
    for i = 1, n do perm[i] = i end
    if n < 2 then return perm end
    return pack.shuffle_in_place(perm, lunar_core.rng_new(seed or 0):split('data order'):split(epoch or 0))
end

-- the same shuffle for the rows of an epoch, on its own stream
local function row_order(n, seed, epoch, shuffle)
    local order = {}
    for i = 1, n do order[i] = i end
    if not shuffle or n < 2 then return order end
    return pack.shuffle_in_place(order, lunar_core.rng_new(seed):split('row order'):split(epoch))
end

local Loader = {}
Loader.__index = Loader

local function source_lengths(src)
    if type(src) ~= 'table' then fail('loader: source must be a list of documents or a dataset, got ' .. type(src)) end
    if type(src.document_lengths) == 'function' then return src:document_lengths() end
    if type(src.count) == 'function' then
        if type(src.length) ~= 'function' or type(src.tokens) ~= 'function' then
            fail('loader: a dataset source needs :count(), :length(i) and :tokens(i)')
        end
        local out = {}
        for i = 1, src:count() do out[i] = src:length(i) end
        return out
    end
    local out = {}
    for i = 1, #src do
        local d = src[i]
        if tensor.is_tensor(d) then
            out[i] = d:numel()
        else
            local ids = type(d) == 'table' and d.ids or d
            if tensor.is_tensor(ids) then out[i] = ids:numel()
            elseif type(ids) == 'table' then out[i] = #ids
            else fail(('loader: document %d is a %s, not a list of ids or {ids = ...}'):format(i, type(d))) end
        end
    end
    return out
end

function M.loader(opts)
    opts = opts or {}
    local self = setmetatable({}, Loader)
    self.source = opts.source
    self.lengths = source_lengths(opts.source)
    local total = 0
    for _, n in ipairs(self.lengths) do total = total + n end
    local seed = check_nonneg_int(opts.seed or 0, 'loader: seed')
    self.packer = pack.packer{seq_len = opts.seq_len, pad_to_multiple = opts.pad_to_multiple,
        overlong = opts.overlong, packing = opts.packing, pack_buffer = opts.pack_buffer, seed = seed,
        pad_id = opts.pad_id, quiet = true}
    self.quiet = opts.quiet
    self.micro_batch = opts.micro_batch or 1
    self.dp_rank, self.dp_size = opts.dp_rank or 0, opts.dp_size or 1
    if type(self.micro_batch) ~= 'number' or self.micro_batch < 1 or self.micro_batch ~= math.floor(self.micro_batch) then
        fail('loader: micro_batch must be a positive integer, got ' .. tostring(self.micro_batch))
    end
    if self.dp_size < 1 or self.dp_rank < 0 or self.dp_rank >= self.dp_size then
        fail(('loader: dp_rank %s is not in 0..dp_size-1 (dp_size %s)'):format(tostring(self.dp_rank),
            tostring(self.dp_size)))
    end
    self.epochs = opts.epochs
    self.pad_last = opts.pad_last and true or false
    -- everything that fixes the sequence of batches (compared by set_state)
    self.config = {
        seed = seed,
        shuffle = opts.shuffle ~= false,
        seq_len = self.packer.seq_len,
        pad_to_multiple = self.packer.multiple,
        overlong = self.packer.overlong,
        packing = self.packer.packing,
        pack_buffer = self.packer.buffer,   -- nil for first fit, which has no buffer
        pad_id = self.packer.pad_id,
        micro_batch = self.micro_batch,
        dp_size = self.dp_size,
        documents = #self.lengths,
        tokens = total,
    }
    self.epoch, self.row, self.step = 0, 0, 0
    return self
end

function Loader:plan(epoch)
    epoch = epoch or self.epoch
    if self._plan_epoch ~= epoch then
        local c = self.config
        local order = c.shuffle and M.permutation(#self.lengths, c.seed, epoch) or nil
        local saved = self.packer.quiet
        self.packer.quiet = true
        local plan = self.packer:plan(self.lengths, order, epoch)
        self.packer.quiet = saved
        plan.order = row_order(#plan.rows, c.seed, epoch, c.shuffle)
        if #plan.rows == 0 then fail('loader: the data packs into no row (every document empty or dropped)') end
        if not self.quiet then print(('epoch %d: %s'):format(epoch, pack.summary(plan.stats, c.seq_len))) end
        self._plan, self._plan_epoch = plan, epoch
    end
    return self._plan
end

function Loader:rows_per_epoch(epoch) return #self:plan(epoch).rows end

function Loader:next()
    local mb, world = self.micro_batch, self.dp_size
    local want = mb * world
    local rows, first_epoch = {}, nil
    local epoch, row = self.epoch, self.row
    while #rows < want do
        if self.epochs and epoch >= self.epochs then
            if not (self.pad_last and #rows > 0) then return nil end
            while #rows < want do rows[#rows + 1] = {} end   -- a row of padding: no segment
            break
        end
        local plan = self:plan(epoch)
        if row >= #plan.rows then
            epoch, row = epoch + 1, 0
        else
            first_epoch = first_epoch or epoch
            row = row + 1
            rows[#rows + 1] = plan.rows[plan.order[row]]
        end
    end
    self.epoch, self.row = epoch, row
    if (not self.epochs or epoch < self.epochs) and row >= #self:plan(epoch).rows then
        -- normalise "end of epoch e" to "start of epoch e + 1" so that states compare equal
        self.epoch, self.row = epoch + 1, 0
    end
    self.step = self.step + 1
    local mine = {}
    for i = 1, mb do mine[i] = rows[self.dp_rank * mb + i] end
    local batch = self.packer:batch({rows = mine}, 1, mb, self.source)
    batch.epoch = first_epoch
    batch.step = self.step
    return batch
end

function Loader:state()
    local cfg = {}
    for k, v in pairs(self.config) do cfg[k] = v end
    return {version = 1, epoch = self.epoch, row = self.row, step = self.step, config = cfg}
end

-- what must match for a saved position to mean the same rows. The position counts rows of the
-- whole epoch's plan (every rank's), so micro_batch and dp_size may differ: the batches go on
-- from the same row (a run resumed in another layout; its global batch is micro_batch x dp_size
-- rows per call then)
local CONFIG_KEYS = {'seed', 'shuffle', 'seq_len', 'pad_to_multiple', 'overlong', 'packing', 'pack_buffer', 'pad_id',
    'documents', 'tokens'}

function Loader:set_state(s)
    if type(s) ~= 'table' or s.version ~= 1 then fail('loader:set_state: not a loader state (version 1)') end
    local cfg = {}
    for k, v in pairs(s.config or {}) do cfg[k] = v end
    -- a state saved before the packing setting existed was packed by first fit
    if cfg.packing == nil then cfg.packing = 'first_fit' end
    for _, k in ipairs(CONFIG_KEYS) do
        if cfg[k] ~= self.config[k] then
            fail(('loader:set_state: the saved state has %s = %s but this loader has %s: the batches would differ')
                :format(k, tostring(cfg[k]), tostring(self.config[k])))
        end
    end
    self.epoch = check_nonneg_int(s.epoch, 'loader:set_state: epoch')
    self.row = check_nonneg_int(s.row, 'loader:set_state: row')
    self.step = check_nonneg_int(s.step or 0, 'loader:set_state: step')
    if self.row > #self:plan(self.epoch).rows then
        fail(('loader:set_state: row %d is past the end of epoch %d (%d rows)'):format(self.row, self.epoch,
            #self:plan(self.epoch).rows))
    end
end

return M
