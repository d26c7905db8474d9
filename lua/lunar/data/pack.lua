-- lunar.data.pack: packing documents into fixed-length rows with per-document boundaries.
--
--   local P = data.packer{seq_len = 4096, pad_to_multiple = 1, overlong = 'truncate',
--                         packing = 'bfd', pack_buffer = 10000, seed = 0, pad_id = 0, quiet = false}
--   local plan = P:plan(lengths[, order[, epoch]])
--       lengths: list of token counts per document (index = document number); order: the
--       documents to place, in that order (default 1..#lengths; the loader passes a shuffled
--       order). Two ways to fill the rows, both functions of the lengths and the order alone:
--         'bfd' (best fit decreasing, the default): the order is cut into buffers of
--           pack_buffer documents; inside a buffer the pieces go, longest first, each into the
--           open row it fills most tightly (the least room that still fits; a new row when none
--           fits). The rows of a buffer are then shuffled (stream rng(seed):split('packed rows')
--           :split(epoch):split(buffer)), since in placement order they would run from the
--           longest documents to the shortest. Rows do not stay open across buffers.
--         'first_fit': each piece, in the order given, goes into the first row that still has
--           room; one pass over the whole order, rows in the order they were opened.
--       Both are O(n log n) through trees of remaining room. Prints the packing efficiency
--       unless quiet.
--       plan.rows[r] = {{doc =, start = (0-based token offset in the document), len =,
--                        size = len rounded up to pad_to_multiple}, ...}
--       plan.stats = {packing, documents, pieces, rows, real_tokens, slots, efficiency (real / slots),
--                     truncated, truncated_tokens, dropped, dropped_tokens, split, empty}
--   local batch = P:batch(plan, first_row, count, source)
--       source: a Lua list of documents ({ids =, mask =} tables, or plain lists of ids), or any
--       object with :tokens(i) -> list of ids (and optionally :mask(i) -> list of 0/1), like a
--       Megatron dataset. Returns
--         input_ids    (B, T) i64   tokens; pad_id in padding
--         labels       (B, T) i64   Hugging Face convention (the model shifts): the token where
--                                   it is a target, -100 at the first token of every document
--                                   (so no target crosses a boundary), where mask is 0, and in
--                                   padding
--         targets      (B, T) i64   already shifted: targets[t] = input_ids[t + 1] inside a
--                                   document (where mask[t + 1] is 1), -100 at each document's
--                                   last token and in padding
--         position_ids (B, T) i64   0, 1, ... restarting at every document (and in the tail)
--         cu_seqlens   list of B i32 tensors of 0-based boundaries (0, ..., T), one per row;
--                      for B = 1 the row's tensor itself (what lunar.model's batch takes). The
--                      padding at a row's end is one more segment.
--         cu_lists     the same boundaries as Lua lists
--         num_tokens   real tokens; num_targets   entries of targets that are not -100
--   local batch, plan = P:pack(docs)     -- plan over all docs in order + every row as one batch
--
-- mask (optional, per document, same length as ids): 1 where the token is to be predicted
-- (assistant tokens in SFT), 0 where not (the prompt). Documents longer than seq_len are
-- truncated to their first seq_len tokens ('truncate'), dropped ('drop') or cut into pieces of
-- seq_len tokens ('split'), and counted. pad_to_multiple = m rounds each piece's slot count up
-- to a multiple of m (seq_len must be a multiple of m); the extra slots are padding inside the
-- piece's segment.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'

local fail = tensor.fail
local M = {}

local Packer = {}
Packer.__index = Packer

local OVERLONG = {truncate = true, drop = true, split = true}
M.OVERLONG = OVERLONG   -- the modes for a document longer than seq_len (also data.tokenize's)
local PACKING = {bfd = true, first_fit = true}
M.PACKING = PACKING     -- the ways to fill rows
M.DEFAULT_BUFFER = 10000   -- documents per best-fit-decreasing buffer

-- shuffle_in_place(list, stream): Fisher-Yates on the stream's n - 1 f64 draws u in [0, 1),
-- j = floor(u * i) + 1 in 1..i for i = n down to 2 (the loader's document and row orders and the
-- packing buffers' rows all shuffle this way, so a given stream gives the same order anywhere)
function M.shuffle_in_place(list, stream)
    local n = #list
    if n < 2 then return list end
    local u = stream:uniform_(core.empty({n - 1}, 'f64'), 0, 1)
    local draws = u:tolist_flat()
    u:free()
    local k = 0
    for i = n, 2, -1 do
        k = k + 1
        local j = math.min(math.floor(draws[k] * i) + 1, i)
        list[i], list[j] = list[j], list[i]
    end
    return list
end

local function posint(v, what)
    if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
        fail(('packer: %s must be a positive integer, got %s'):format(what, tostring(v)))
    end
    return v
end

function M.packer(opts)
    opts = opts or {}
    local self = setmetatable({}, Packer)
    self.seq_len = posint(opts.seq_len, 'seq_len')
    self.multiple = posint(opts.pad_to_multiple or 1, 'pad_to_multiple')
    if self.seq_len % self.multiple ~= 0 then
        fail(('packer: seq_len %d is not a multiple of pad_to_multiple %d'):format(self.seq_len, self.multiple))
    end
    self.overlong = opts.overlong or 'truncate'
    if not OVERLONG[self.overlong] then
        fail(("packer: overlong must be 'truncate', 'drop' or 'split', got %s"):format(tostring(self.overlong)))
    end
    self.packing = opts.packing or 'bfd'
    if not PACKING[self.packing] then
        fail(("packer: packing must be 'bfd' (best fit decreasing) or 'first_fit', got %s"):format(
            tostring(self.packing)))
    end
    -- the buffer and the seed shape only best fit decreasing's rows: first fit has none
    if self.packing == 'bfd' then
        self.buffer = posint(opts.pack_buffer or M.DEFAULT_BUFFER, 'pack_buffer')
        self.seed = opts.seed or 0
        if type(self.seed) ~= 'number' or self.seed < 0 or self.seed ~= math.floor(self.seed) then
            fail(('packer: seed must be a non-negative integer, got %s'):format(tostring(self.seed)))
        end
    end
    self.pad_id = opts.pad_id or 0
    self.quiet = opts.quiet
    return self
end

local function stats_summary(s, T)
    local t = ('packing (%s): %d documents -> %d rows of %d: %d tokens in %d slots, efficiency %.2f%%'):format(
        s.packing, s.documents, s.rows, T, s.real_tokens, s.slots, 100 * s.efficiency)
    local extra = {}
    if s.truncated > 0 then extra[#extra + 1] = ('%d truncated (%d tokens cut)'):format(s.truncated, s.truncated_tokens) end
    if s.dropped > 0 then extra[#extra + 1] = ('%d dropped (%d tokens)'):format(s.dropped, s.dropped_tokens) end
    if s.split > 0 then extra[#extra + 1] = ('%d split'):format(s.split) end
    if s.empty > 0 then extra[#extra + 1] = ('%d empty'):format(s.empty) end
    if #extra > 0 then t = t .. '; ' .. table.concat(extra, ', ') end
    return t
end
M.summary = stats_summary

-- First fit over pieces 1..np (lengths plen) in their order: a max-tree over the remaining room
-- of rows 1..size (unopened rows have T) finds the first row with room. Returns rows as lists of
-- piece numbers.
local function first_fit(plen, np, T, m)
    local size = 1
    while size < np do size = size * 2 end
    local tree = {}
    for i = 1, 2 * size - 1 do tree[i] = T end
    local rows = {}
    for p = 1, np do
        local need = math.ceil(plen[p] / m) * m
        local node = 1
        while node < size do
            node = tree[2 * node] >= need and 2 * node or 2 * node + 1
        end
        local r = node - size + 1
        tree[node] = tree[node] - need
        node = math.floor(node / 2)
        while node >= 1 do
            local a, b = tree[2 * node], tree[2 * node + 1]
            tree[node] = a > b and a or b
            node = math.floor(node / 2)
        end
        if r > #rows then rows[r] = {} end
        local row = rows[r]
        row[#row + 1] = p
    end
    return rows
end

-- The open rows of one buffer, grouped by their remaining room (0..T): rooms[c] is a stack of
-- the rows with room c, and a count tree over the rooms finds the least room >= need in
-- O(log T). Which row of a room is taken (the last one put there) is fixed, so the result is too.
local Rooms = {}
Rooms.__index = Rooms

local function rooms_new(T)
    local size = 1
    while size < T + 1 do size = size * 2 end
    local count = {}
    for i = 1, 2 * size - 1 do count[i] = 0 end
    return setmetatable({size = size, count = count, stacks = {}}, Rooms)
end

function Rooms:add(room, delta)
    local node = self.size + room
    while node >= 1 do
        self.count[node] = self.count[node] + delta
        node = math.floor(node / 2)
    end
end

function Rooms:put(r, room)
    if room == 0 then return end   -- a full row takes nothing more
    local st = self.stacks[room]
    if not st then
        st = {}
        self.stacks[room] = st
    end
    st[#st + 1] = r
    self:add(room, 1)
end

-- the row with the least room >= need, taken out of the set (nil when no row has that room)
function Rooms:take(need)
    local count, size = self.count, self.size
    local node = size + need
    if count[node] == 0 then
        -- climb until a right sibling holds a row, then descend to its leftmost non-empty leaf
        while true do
            if node == 1 then return nil end
            if node % 2 == 0 and count[node + 1] > 0 then
                node = node + 1
                break
            end
            node = math.floor(node / 2)
        end
        while node < size do
            node = count[2 * node] > 0 and 2 * node or 2 * node + 1
        end
    end
    local room = node - size
    local st = self.stacks[room]
    local r = st[#st]
    st[#st] = nil
    self:add(room, -1)
    return r, room
end

-- Best fit decreasing, buffer by buffer: buffer b holds pieces bfirst[b] .. bfirst[b + 1] - 1
-- (those of `pack_buffer` consecutive documents of the order). Returns rows as lists of piece
-- numbers, each buffer's rows shuffled.
local function best_fit_decreasing(plen, np, bfirst, T, m, seed, epoch)
    local rows = {}
    local stream = core.rng_new(seed):split('packed rows'):split(epoch)
    for b = 1, #bfirst do
        local first, last = bfirst[b], (bfirst[b + 1] or np + 1) - 1
        local idx = {}
        for p = first, last do idx[#idx + 1] = p end
        -- longest first; equal lengths keep their order, so the sort is a function of the input
        table.sort(idx, function(x, y)
            if plen[x] ~= plen[y] then return plen[x] > plen[y] end
            return x < y
        end)
        local rooms = rooms_new(T)
        local brows = {}
        for _, p in ipairs(idx) do
            local need = math.ceil(plen[p] / m) * m
            local r, room = rooms:take(need)
            if not r then
                brows[#brows + 1] = {}
                r, room = #brows, T
            end
            local row = brows[r]
            row[#row + 1] = p
            rooms:put(r, room - need)
        end
        -- the buffer's rows shuffled on the buffer's own stream
        if #brows > 1 then M.shuffle_in_place(brows, stream:split(b - 1)) end
        for i = 1, #brows do rows[#rows + 1] = brows[i] end
    end
    return rows
end

function Packer:plan(lengths, order, epoch)
    if type(lengths) ~= 'table' then fail('packer:plan: lengths must be a list, got ' .. type(lengths)) end
    local T, m, mode = self.seq_len, self.multiple, self.overlong
    epoch = epoch or 0
    if type(epoch) ~= 'number' or epoch < 0 or epoch ~= math.floor(epoch) then
        fail(('packer:plan: epoch must be a non-negative integer, got %s'):format(tostring(epoch)))
    end
    local n = order and #order or #lengths
    local st = {packing = self.packing, documents = n, pieces = 0, rows = 0, real_tokens = 0, slots = 0,
        efficiency = 0, truncated = 0, truncated_tokens = 0, dropped = 0, dropped_tokens = 0, split = 0, empty = 0}
    -- pieces in placement order
    local pdoc, pstart, plen = {}, {}, {}
    local np = 0
    local bfirst = {}   -- bfd: the first piece of each buffer
    local function piece(doc, start, len)
        np = np + 1
        pdoc[np], pstart[np], plen[np] = doc, start, len
    end
    for k = 1, n do
        local doc = order and order[k] or k
        local len = lengths[doc]
        if self.packing == 'bfd' and (k - 1) % self.buffer == 0 then bfirst[#bfirst + 1] = np + 1 end
        if type(len) ~= 'number' or len < 0 or len ~= math.floor(len) then
            fail(('packer:plan: length of document %s is %s'):format(tostring(doc), tostring(len)))
        end
        if len == 0 then
            st.empty = st.empty + 1
        elseif len <= T then
            piece(doc, 0, len)
        elseif mode == 'truncate' then
            st.truncated = st.truncated + 1
            st.truncated_tokens = st.truncated_tokens + len - T
            piece(doc, 0, T)
        elseif mode == 'drop' then
            st.dropped = st.dropped + 1
            st.dropped_tokens = st.dropped_tokens + len
        else
            st.split = st.split + 1
            for s = 0, len - 1, T do piece(doc, s, math.min(T, len - s)) end
        end
    end
    st.pieces = np
    local rows
    if self.packing == 'first_fit' then
        rows = first_fit(plen, np, T, m)
    else
        rows = best_fit_decreasing(plen, np, bfirst, T, m, self.seed, epoch)
    end
    local nrows = #rows
    for r = 1, nrows do
        local row = rows[r]
        for s = 1, #row do
            local p = row[s]
            row[s] = {doc = pdoc[p], start = pstart[p], len = plen[p], size = math.ceil(plen[p] / m) * m}
            st.real_tokens = st.real_tokens + plen[p]
        end
    end
    st.rows = nrows
    st.slots = nrows * T
    st.efficiency = nrows > 0 and st.real_tokens / st.slots or 0
    local plan = {rows = rows, stats = st, seq_len = T}
    if not self.quiet then print(stats_summary(st, T)) end
    return plan
end

-- tokens and mask of document d from a source
local function fetch(source, d)
    if type(source.tokens) == 'function' then
        return source:tokens(d), type(source.mask) == 'function' and source:mask(d) or nil
    end
    local doc = source[d]
    if doc == nil then fail(('packer: document %s is not in the source'):format(tostring(d))) end
    if tensor.is_tensor(doc) then return doc:tolist_flat() end
    if doc.ids then
        local ids, mask = doc.ids, doc.mask
        if tensor.is_tensor(ids) then ids = ids:tolist_flat() end
        if tensor.is_tensor(mask) then mask = mask:tolist_flat() end
        return ids, mask
    end
    return doc
end

-- mask values: 1/0 or true/false; nil mask = every token is a target
local function on(dm, j)
    if dm == nil then return true end
    local v = dm[j]
    return v ~= 0 and v ~= false and v ~= nil
end

function Packer:batch(plan, first, count, source)
    local T, pad = self.seq_len, self.pad_id
    first = first or 1
    count = count or (#plan.rows - first + 1)
    if first < 1 or count < 1 or first + count - 1 > #plan.rows then
        fail(('packer:batch: rows %d..%d are outside the plan (%d rows)'):format(first, first + count - 1, #plan.rows))
    end
    local ids, labels, targets, pos = {}, {}, {}, {}
    local cu_lists, cu = {}, {}
    local cache = {}
    local ntok, ntg = 0, 0
    local o = 0   -- flat offset of the current row
    for r = first, first + count - 1 do
        local row = plan.rows[r]
        local bounds = {0}
        local t = 0
        for _, seg in ipairs(row) do
            local c = cache[seg.doc]
            if not c then
                local di, dm = fetch(source, seg.doc)
                c = {di, dm}
                cache[seg.doc] = c
            end
            local di, dm = c[1], c[2]
            if #di < seg.start + seg.len then
                fail(('packer:batch: document %s has %d tokens, the plan needs %d'):format(tostring(seg.doc), #di,
                    seg.start + seg.len))
            end
            local base, len = seg.start, seg.len
            for k = 0, len - 1 do
                local j = base + k + 1          -- 1-based index into the document
                local i = o + t + k + 1
                local tok = di[j]
                ids[i] = tok
                pos[i] = k
                local is_target = on(dm, j)
                labels[i] = (k > 0 and is_target) and tok or -100
                if k < len - 1 and on(dm, j + 1) then
                    targets[i] = di[j + 1]
                    ntg = ntg + 1
                else
                    targets[i] = -100
                end
            end
            for k = len, seg.size - 1 do
                local i = o + t + k + 1
                ids[i], pos[i], labels[i], targets[i] = pad, k, -100, -100
            end
            ntok = ntok + len
            t = t + seg.size
            bounds[#bounds + 1] = t
        end
        for k = 0, T - t - 1 do
            local i = o + t + k + 1
            ids[i], pos[i], labels[i], targets[i] = pad, k, -100, -100
        end
        if t < T then bounds[#bounds + 1] = T end
        cu_lists[#cu_lists + 1] = bounds
        cu[#cu + 1] = core.from_flat(bounds, {#bounds}, 'i32')
        o = o + T
    end
    local shape = {count, T}
    return {
        input_ids = core.from_flat(ids, shape, 'i64'),
        labels = core.from_flat(labels, shape, 'i64'),
        targets = core.from_flat(targets, shape, 'i64'),
        position_ids = core.from_flat(pos, shape, 'i64'),
        cu_seqlens = count == 1 and cu[1] or cu,
        cu_lists = cu_lists,
        num_tokens = ntok,
        num_targets = ntg,
    }
end

function Packer:pack(docs)
    local lengths = {}
    for i = 1, #docs do
        local d = docs[i]
        local ids = type(d) == 'table' and d.ids or d
        lengths[i] = tensor.is_tensor(ids) and ids:numel() or #ids
    end
    local plan = self:plan(lengths)
    if #plan.rows == 0 then return nil, plan end
    return self:batch(plan, 1, #plan.rows, docs), plan
end

return M
