-- test_data_pack.lua: lunar.data.packer against a plain reference written here (quadratic first
-- fit, token-by-token rows) on odd sizes: rows and boundaries, tokens, labels (HF convention),
-- shifted targets, positions, cu_seqlens, padding to a multiple, the three over-long policies,
-- loss masks, and the efficiency; plus consistency with require('lunar.nn.masks').packed_positions and
-- with the model's label shift.
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
    local batch, plan = data.packer{seq_len = 6, quiet = true}:pack(docs)
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

os.exit(T:run())
