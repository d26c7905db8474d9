-- test_data_pack.lua: lunar.data.packer against a plain reference written here (quadratic first
-- fit, token-by-token rows) on odd sizes: rows and boundaries, tokens, labels (HF convention),
-- shifted targets, positions, cu_seqlens, padding to a multiple, the three over-long policies,
-- loss masks, and the efficiency; plus consistency with require('lunar.nn.masks').packed_positions and
-- with the model's label shift. Best fit decreasing against a quadratic reference (per buffer, as
-- sets of rows, since its rows are shuffled), its row order (shuffled inside buffers, by seed and
-- epoch), and its efficiency on the shipped SFT data.
local lunar = require 'lunar'
local data = lunar.data
local T = require('lunar.testing').suite('data.pack')

local rng = lunar.rng(5)

local function ints(n, lo, hi)
    if n == 0 then return {} end
    return rng:randint_(lunar.empty({n}, 'i64'), lo, hi + 1):tolist_flat()
end

local function eq(a, b, msg)
    if a ~= b then error(('%s: got %s, expected %s'):format(msg or 'value', tostring(a), tostring(b)), 2) end
end

local function list_eq(a, b, msg)
    eq(#a, #b, (msg or 'list') .. ' length')
    for i = 1, #b do eq(a[i], b[i], ('%s[%d]'):format(msg or 'list', i)) end
end

-- the reference: pieces, quadratic first fit, rows built token by token
local function reference(docs, o)
    local Tn, m, pad = o.seq_len, o.pad_to_multiple or 1, o.pad_id or 0
    local pieces, st = {}, {truncated = 0, dropped = 0, split = 0, empty = 0, real = 0}
    for d, doc in ipairs(docs) do
        local n = #doc.ids
        if n == 0 then
            st.empty = st.empty + 1
        elseif n <= Tn then
            pieces[#pieces + 1] = {d, 0, n}
        elseif o.overlong == 'drop' then
            st.dropped = st.dropped + 1
        elseif o.overlong == 'split' then
            st.split = st.split + 1
            local s = 0
            while s < n do
                pieces[#pieces + 1] = {d, s, math.min(Tn, n - s)}
                s = s + Tn
            end
        else
            st.truncated = st.truncated + 1
            pieces[#pieces + 1] = {d, 0, Tn}
        end
    end
    local rows, room = {}, {}
    for _, p in ipairs(pieces) do
        local size = math.ceil(p[3] / m) * m
        local r = nil
        for i = 1, #rows do
            if room[i] >= size then r = i break end
        end
        if not r then
            r = #rows + 1
            rows[r], room[r] = {}, Tn
        end
        room[r] = room[r] - size
        rows[r][#rows[r] + 1] = {p[1], p[2], p[3], size}
        st.real = st.real + p[3]
    end
    local out = {ids = {}, labels = {}, targets = {}, pos = {}, cu = {}}
    for r, row in ipairs(rows) do
        local cu, t = {0}, 0
        for _, seg in ipairs(row) do
            local doc = docs[seg[1]]
            for k = 0, seg[4] - 1 do
                local real = k < seg[3]
                local j = seg[2] + k + 1
                local tok = real and doc.ids[j] or pad
                local tgt = function(jj) return doc.mask == nil or doc.mask[jj] == 1 end
                out.ids[#out.ids + 1] = tok
                out.pos[#out.pos + 1] = k
                out.labels[#out.labels + 1] = (real and k > 0 and tgt(j)) and tok or -100
                out.targets[#out.targets + 1] = (real and k + 1 < seg[3] and tgt(j + 1)) and doc.ids[j + 1] or -100
            end
            t = t + seg[4]
            cu[#cu + 1] = t
        end
        for k = 0, Tn - t - 1 do
            out.ids[#out.ids + 1] = pad
            out.pos[#out.pos + 1] = k
            out.labels[#out.labels + 1] = -100
            out.targets[#out.targets + 1] = -100
        end
        if t < Tn then cu[#cu + 1] = Tn end
        out.cu[r] = cu
    end
    out.rows, out.stats = rows, st
    out.efficiency = #rows > 0 and st.real / (#rows * Tn) or 0
    return out
end

local function make_docs(n, maxlen, with_mask)
    local lens = ints(n, 0, maxlen)
    local docs = {}
    for i = 1, n do
        local d = {ids = ints(lens[i], 0, 1000)}
        if with_mask then d.mask = ints(lens[i], 0, 1) end
        docs[i] = d
    end
    return docs
end

local function check(docs, o, tag)
    o.quiet = true
    o.packing = 'first_fit'   -- what the reference does
    local ref = reference(docs, o)
    local P = data.packer(o)
    local batch, plan = P:pack(docs)
    eq(#plan.rows, #ref.rows, tag .. ' rows')
    for r, row in ipairs(ref.rows) do
        eq(#plan.rows[r], #row, tag .. ' segments of row ' .. r)
        for s, seg in ipairs(row) do
            local got = plan.rows[r][s]
            list_eq({got.doc, got.start, got.len, got.size}, seg, ('%s row %d segment %d'):format(tag, r, s))
        end
    end
    local st = plan.stats
    eq(st.truncated, ref.stats.truncated, tag .. ' truncated')
    eq(st.dropped, ref.stats.dropped, tag .. ' dropped')
    eq(st.split, ref.stats.split, tag .. ' split')
    eq(st.empty, ref.stats.empty, tag .. ' empty')
    eq(st.real_tokens, ref.stats.real, tag .. ' real tokens')
    if math.abs(st.efficiency - ref.efficiency) > 1e-12 then error(tag .. ' efficiency') end
    if #ref.rows == 0 then
        eq(batch, nil, tag .. ' no batch')
        return
    end
    local B, Tn = #ref.rows, o.seq_len
    list_eq(batch.input_ids:size(), {B, Tn}, tag .. ' shape')
    list_eq(batch.input_ids:tolist_flat(), ref.ids, tag .. ' input_ids')
    list_eq(batch.labels:tolist_flat(), ref.labels, tag .. ' labels')
    list_eq(batch.targets:tolist_flat(), ref.targets, tag .. ' targets')
    list_eq(batch.position_ids:tolist_flat(), ref.pos, tag .. ' position_ids')
    local cus = B == 1 and {batch.cu_seqlens} or batch.cu_seqlens
    eq(#cus, B, tag .. ' cu_seqlens count')
    for r = 1, B do
        list_eq(cus[r]:tolist_flat(), ref.cu[r], tag .. ' cu_seqlens row ' .. r)
        list_eq(batch.cu_lists[r], ref.cu[r], tag .. ' cu_lists row ' .. r)
    end
    -- positions are what the model derives from cu_seqlens
    list_eq(require('lunar.nn.masks').packed_positions(cus):tolist_flat(), ref.pos, tag .. ' packed_positions')
    -- HF's shift of labels gives the targets
    local lab, tg = ref.labels, batch.targets:tolist_flat()
    for i = 1, #lab do
        local within = (i % Tn) ~= 0
        eq(tg[i], within and lab[i + 1] or -100, tag .. ' shifted labels at ' .. i)
    end
    local nt = 0
    for _, v in ipairs(ref.targets) do if v ~= -100 then nt = nt + 1 end end
    eq(batch.num_targets, nt, tag .. ' num_targets')
    eq(batch.num_tokens, ref.stats.real, tag .. ' num_tokens')
end

T:test('first fit, boundaries, labels, positions and efficiency against the reference (odd sizes)', function()
    for _, seq_len in ipairs({1, 3, 17, 64}) do
        for _, n in ipairs({1, 3, 17, 100}) do
            for _, mode in ipairs({'truncate', 'drop', 'split'}) do
                local docs = make_docs(n, math.floor(seq_len * 1.5) + 1, n % 2 == 1)
                check(docs, {seq_len = seq_len, overlong = mode, pad_id = 7},
                    ('T=%d n=%d %s'):format(seq_len, n, mode))
            end
        end
    end
end)

T:test('pad_to_multiple rounds every segment; seq_len must be a multiple', function()
    for _, m in ipairs({2, 4, 8}) do
        local docs = make_docs(37, 50, true)
        check(docs, {seq_len = 48, pad_to_multiple = m, overlong = 'split'}, 'multiple ' .. m)
        local batch = data.packer{seq_len = 48, pad_to_multiple = m, quiet = true}:pack(docs)
        for _, cu in ipairs(batch.cu_lists) do
            for _, b in ipairs(cu) do eq(b % m, 0, 'boundary multiple of ' .. m) end
        end
    end
    local ok, err = pcall(data.packer, {seq_len = 10, pad_to_multiple = 4})
    assert(not ok and err:find('seq_len 10 is not a multiple of pad_to_multiple 4'), err)
    ok, err = pcall(data.packer, {seq_len = 10, overlong = 'wrap'})
    assert(not ok and err:find("overlong must be"), err)
end)

T:test('a hand-checked example', function()
    -- T = 6: {1,2,3,4} fills row 1 to 4, {5,6,7} opens row 2, {8,9} fits row 1, {10} fits row 2
    local docs = {{ids = {1, 2, 3, 4}}, {ids = {5, 6, 7}, mask = {0, 1, 1}}, {ids = {8, 9}}, {ids = {10}}}
    local batch, plan = data.packer{seq_len = 6, packing = 'first_fit', quiet = true}:pack(docs)
    eq(#plan.rows, 2, 'rows')
    list_eq(batch.input_ids:tolist_flat(), {1, 2, 3, 4, 8, 9, 5, 6, 7, 10, 0, 0}, 'ids')
    list_eq(batch.position_ids:tolist_flat(), {0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 0, 1}, 'positions')
    list_eq(batch.labels:tolist_flat(), {-100, 2, 3, 4, -100, 9, -100, 6, 7, -100, -100, -100}, 'labels')
    list_eq(batch.targets:tolist_flat(), {2, 3, 4, -100, 9, -100, 6, 7, -100, -100, -100, -100}, 'targets')
    list_eq(batch.cu_lists[1], {0, 4, 6}, 'cu row 1')
    list_eq(batch.cu_lists[2], {0, 3, 4, 6}, 'cu row 2')
    eq(batch.cu_seqlens[1]:dtype(), 'i32', 'cu dtype')
    eq(plan.stats.efficiency, 10 / 12, 'efficiency')
    eq(batch.num_targets, 6, 'targets count')
end)

T:test('sources: token tensors, plain lists and a Megatron dataset give the same rows', function()
    local docs = make_docs(23, 30, false)
    local lists, tens = {}, {}
    for i, d in ipairs(docs) do
        lists[i] = d.ids
        tens[i] = {ids = lunar.tensor(#d.ids > 0 and d.ids or {0}, 'i64'):narrow(1, 1, #d.ids)}
    end
    local P = data.packer{seq_len = 32, quiet = true}
    local a = P:pack(docs)
    local b = P:pack(lists)
    local c = P:pack(tens)
    local prefix = os.tmpname()
    local w = data.indexed_writer(prefix, {dtype = 'int32'})
    for _, d in ipairs(docs) do w:add_document(d.ids) end
    w:finish()
    local ds = data.indexed_open(prefix)
    local plan = P:plan(ds:document_lengths())
    local d = P:batch(plan, 1, #plan.rows, ds)
    for _, x in ipairs({b, c, d}) do
        list_eq(x.input_ids:tolist_flat(), a.input_ids:tolist_flat(), 'ids')
        list_eq(x.labels:tolist_flat(), a.labels:tolist_flat(), 'labels')
    end
    ds:close()
    os.remove(prefix)
    os.remove(prefix .. '.bin')
    os.remove(prefix .. '.idx')
end)

T:test('the efficiency line is printed', function()
    local P = data.packer{seq_len = 8}
    local old = print
    local lines = {}
    print = function(s) lines[#lines + 1] = s end   -- luacheck: ignore
    local ok, err = pcall(P.plan, P, {3, 9, 5, 0}, nil)
    print = old   -- luacheck: ignore
    assert(ok, err)
    eq(#lines, 1, 'one line')
    assert(lines[1]:find('4 documents %-> 2 rows of 8: 16 tokens in 16 slots, efficiency 100.00%%; 1 truncated %(1 tokens cut%), 1 empty'),
        lines[1])
end)

T:test('lunar.model on packed batches (B = 1 and B = 2) gives the loss of the documents run one by one', function()
    local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
    local m = lunar.model.new(here .. '/../fixtures/models/glm5_packed/config.json', {seed = 1})
    local docs = {{ids = {1, 2, 3, 4, 5}}, {ids = {6, 7, 8}, mask = {0, 1, 1}}, {ids = {9, 10, 11, 12}}}
    local sum, n = 0, 0
    for _, d in ipairs(docs) do
        local b = data.packer{seq_len = #d.ids, quiet = true}:pack({d})
        b.cu_seqlens, b.position_ids = nil, nil   -- a plain unpacked row
        sum = sum + m:forward(b, {loss = true}).loss * b.num_targets
        n = n + b.num_targets
    end
    local ref = sum / n
    local one = data.packer{seq_len = 16, quiet = true}:pack(docs)
    local two = data.loader{source = docs, seq_len = 8, micro_batch = 2, shuffle = false, quiet = true}:next()
    eq(two.input_ids:size(1), 2, 'two rows')
    for _, b in ipairs({one, two}) do
        local loss = m:forward(b, {loss = true}).loss
        -- f32 model: the packed and unpacked runs differ only by summation order
        assert(math.abs(loss - ref) <= 1e-6 * math.abs(ref), ('packed loss %.9g vs %.9g'):format(loss, ref))
    end
end)

-- ---- best fit decreasing ------------------------------------------------------------------------

-- the reference: per buffer of `buffer` documents, pieces longest first (ties in order), each into
-- the open row with the least room that fits, among equals the row that got to that room last
local function reference_bfd(lengths, o)
    local Tn, m, buffer = o.seq_len, o.pad_to_multiple or 1, o.pack_buffer
    local out = {}
    for first = 1, #lengths, buffer do
        local pieces = {}
        for d = first, math.min(first + buffer - 1, #lengths) do
            local n = lengths[d]
            if n > Tn and o.overlong == 'split' then
                for s = 0, n - 1, Tn do pieces[#pieces + 1] = {d, s, math.min(Tn, n - s), #pieces} end
            elseif n > Tn and o.overlong == 'drop' then
                n = 0
            elseif n > 0 then
                pieces[#pieces + 1] = {d, 0, math.min(n, Tn), #pieces}
            end
        end
        table.sort(pieces, function(a, b)
            if a[3] ~= b[3] then return a[3] > b[3] end
            return a[4] < b[4]
        end)
        local rows, room, since, clock = {}, {}, {}, 0
        for _, p in ipairs(pieces) do
            local size = math.ceil(p[3] / m) * m
            local r
            for i = 1, #rows do
                local better = r == nil or room[i] < room[r] or (room[i] == room[r] and since[i] > since[r])
                if room[i] >= size and better then r = i end
            end
            if not r then
                r = #rows + 1
                rows[r], room[r] = {}, Tn
            end
            clock = clock + 1
            room[r], since[r] = room[r] - size, clock
            rows[r][#rows[r] + 1] = ('%d:%d:%d:%d'):format(p[1], p[2], p[3], size)
        end
        local keys = {}
        for i, row in ipairs(rows) do keys[i] = table.concat(row, ',') end
        out[#out + 1] = keys
    end
    return out
end

local function row_key(row)
    local t = {}
    for i, seg in ipairs(row) do t[i] = ('%d:%d:%d:%d'):format(seg.doc, seg.start, seg.len, seg.size) end
    return table.concat(t, ',')
end

local function sorted(list)
    local c = {}
    for i, v in ipairs(list) do c[i] = v end
    table.sort(c)
    return c
end

T:test('best fit decreasing: the rows of every buffer against the reference (odd sizes)', function()
    for _, seq_len in ipairs({1, 5, 17, 64}) do
        for _, n in ipairs({1, 4, 23, 150}) do
            for _, buffer in ipairs({1, 3, 10, 1000}) do
                for _, mode in ipairs({'truncate', 'drop', 'split'}) do
                    local m = seq_len % 4 == 0 and 4 or 1
                    local lengths = ints(n, 0, math.floor(seq_len * 1.5) + 1)
                    local o = {seq_len = seq_len, pad_to_multiple = m, overlong = mode, pack_buffer = buffer}
                    local tag = ('T=%d n=%d buffer=%d %s'):format(seq_len, n, buffer, mode)
                    local ref = reference_bfd(lengths, o)
                    local plan = data.packer{seq_len = seq_len, pad_to_multiple = m, overlong = mode, packing = 'bfd',
                        pack_buffer = buffer, seed = 3, quiet = true}:plan(lengths)
                    local r = 0
                    for b, keys in ipairs(ref) do
                        local got = {}
                        for i = 1, #keys do got[i] = row_key(plan.rows[r + i]) end
                        list_eq(sorted(got), sorted(keys), ('%s buffer %d'):format(tag, b))
                        r = r + #keys
                    end
                    eq(#plan.rows, r, tag .. ' rows')
                end
            end
        end
    end
end)

T:test('best fit decreasing: a hand-checked example, and bad settings', function()
    -- T = 10, lengths 2 5 4 7 1 3 8: first fit needs 4 rows ([2 5 1] [4 3] [7] [8]); best fit
    -- decreasing places 8 7 5 into new rows, 4 into the 5's row (the only room), 3 beside the 7,
    -- 2 beside the 8 and 1 into the last slot: 3 full rows
    local lengths = {2, 5, 4, 7, 1, 3, 8}
    local ff = data.packer{seq_len = 10, packing = 'first_fit', quiet = true}:plan(lengths)
    eq(#ff.rows, 4, 'first fit rows')
    local plan = data.packer{seq_len = 10, quiet = true}:plan(lengths)   -- bfd is the default
    eq(#plan.rows, 3, 'bfd rows')
    eq(plan.stats.efficiency, 1, 'bfd efficiency')
    local keys = {}
    for i, row in ipairs(plan.rows) do keys[i] = row_key(row) end
    list_eq(sorted(keys), {'2:0:5:5,3:0:4:4,5:0:1:1', '4:0:7:7,6:0:3:3', '7:0:8:8,1:0:2:2'}, 'rows')
    T.raises(function() data.packer{seq_len = 10, packing = 'best'} end,
        "packing must be 'bfd' (best fit decreasing) or 'first_fit', got best")
    T.raises(function() data.packer{seq_len = 10, pack_buffer = 0} end, 'pack_buffer must be a positive integer, got 0')
    T.raises(function() data.packer{seq_len = 10, seed = -1} end, 'seed must be a non-negative integer, got -1')
    T.raises(function() data.packer{seq_len = 10, quiet = true}:plan({1, 2}, nil, 0.5) end,
        'epoch must be a non-negative integer, got 0.5')
end)

T:test('best fit decreasing: rows shuffled inside their buffer, by seed and epoch', function()
    local lengths = ints(3000, 1, 300)
    local function plan(seed, epoch, buffer)
        return data.packer{seq_len = 256, overlong = 'split', pack_buffer = buffer or 500, seed = seed, quiet = true}
            :plan(lengths, nil, epoch)
    end
    local a = plan(1, 0)
    local function keys(p)
        local k = {}
        for i, row in ipairs(p.rows) do k[i] = row_key(row) end
        return k
    end
    local ka = keys(a)
    list_eq(keys(plan(1, 0)), ka, 'the same seed and epoch')
    for _, other in ipairs({plan(2, 0), plan(1, 1)}) do
        -- the same rows, in another order
        local ko = keys(other)
        list_eq(sorted(ko), sorted(ka), 'the same rows')
        local moved = 0
        for i, k in ipairs(ka) do if ko[i] ~= k then moved = moved + 1 end end
        assert(moved > #a.rows / 2, ('only %d of %d rows moved'):format(moved, #a.rows))
    end
    -- each row holds the documents of one buffer, and the buffers follow each other
    local last = 0
    local ascents, pairs_ = 0, 0
    for i, row in ipairs(a.rows) do
        local b = math.floor((row[1].doc - 1) / 500)
        for _, seg in ipairs(row) do eq(math.floor((seg.doc - 1) / 500), b, 'buffer of row ' .. i) end
        assert(b >= last, ('row %d of buffer %d after buffer %d'):format(i, b, last))
        if b == last and i > 1 and row[1].len > a.rows[i - 1][1].len then ascents = ascents + 1 end
        if b == last and i > 1 then pairs_ = pairs_ + 1 end
        last = b
    end
    -- in placement order the longest piece of each row would only fall; shuffled it rises about
    -- as often as it falls
    assert(ascents > 0.3 * pairs_, ('the longest piece rises in %d of %d neighbouring rows'):format(ascents, pairs_))
end)

-- the shipped SFT data (the tiny preset's), as the trainer tokenizes it, untruncated
local function shipped_lengths()
    local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
    local root = here .. '/../../'
    local tok = lunar.tokenizer.load(root .. 'recipes/presets/tiny/tokenizer.json')
    local rows = data.read_chat({root .. 'examples/data/sft/gsm8k_train_chat_first1000.jsonl',
        root .. 'examples/data/sft/oasst_en100_conversations.jsonl'}, {show = 0})
    local docs = data.tokenize(rows, function(row)
        return lunar.chat.tokenize(tok, row.messages, {template = 'glm5', tools = row.tools})
    end, {max_len = 1e9})
    local lengths = {}
    for i, d in ipairs(docs) do lengths[i] = #d.ids end
    return lengths
end

T:test('best fit decreasing on the shipped SFT data: >= 99% at 4096 tokens, >= 97% at 512', function()
    local lengths = shipped_lengths()
    eq(#lengths, 1547, 'shipped documents')
    for _, case in ipairs({{4096, 0.99}, {512, 0.97}}) do
        local seq_len, floor = case[1], case[2]
        for epoch = 0, 2 do
            local order = data.permutation(#lengths, 1, epoch)
            local bfd = data.packer{seq_len = seq_len, seed = 1, quiet = true}:plan(lengths, order, epoch)
            local ff = data.packer{seq_len = seq_len, packing = 'first_fit', quiet = true}:plan(lengths, order)
            local e, f = bfd.stats.efficiency, ff.stats.efficiency
            assert(e >= floor, ('seq_len %d epoch %d: bfd efficiency %.4f < %.2f (first fit %.4f)'):format(seq_len,
                epoch, e, floor, f))
            assert(e > f, ('seq_len %d epoch %d: bfd %.4f is not above first fit %.4f'):format(seq_len, epoch, e, f))
            eq(bfd.stats.real_tokens, ff.stats.real_tokens, 'the same tokens')
        end
    end
end)

os.exit(T:run())
