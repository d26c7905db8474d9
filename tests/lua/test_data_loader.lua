-- test_data_loader.lua: deterministic shuffling by (seed, epoch) and the micro-batch loader:
-- permutations are permutations, repeatable and different per seed and epoch; every document is
-- seen exactly once per epoch; a state saved at any step (also mid-epoch and through a JSON round
-- trip) and restored in a fresh loader gives exactly the same following batches, across epoch
-- boundaries; data-parallel ranks split each step's rows; with pad_last an epoch's rows are all
-- taken once over the ranks, the last batch filled with padding; a mismatched state is refused. Both
-- packings (best fit decreasing over buffers, first fit): every token of every document once per
-- epoch, the same batches for the same seed, resuming mid-epoch, a state from before the packing
-- setting, the efficiency line.
local lunar = require 'lunar'
local data = lunar.data
local T = require('lunar.testing').suite('data.loader')

local function eq(a, b, msg)
    if a ~= b then error(('%s: got %s, expected %s'):format(msg or 'value', tostring(a), tostring(b)), 2) end
end

local function list_eq(a, b, msg)
    eq(#a, #b, (msg or 'list') .. ' length')
    for i = 1, #b do eq(a[i], b[i], ('%s[%d]'):format(msg or 'list', i)) end
end

local function is_perm(p, n)
    eq(#p, n, 'permutation length')
    local seen = {}
    for _, v in ipairs(p) do
        assert(v >= 1 and v <= n and v == math.floor(v), 'value out of range: ' .. tostring(v))
        assert(not seen[v], 'repeated value ' .. v)
        seen[v] = true
    end
end

T:test('permutation: a permutation, deterministic, different per seed and epoch', function()
    for _, n in ipairs({0, 1, 2, 3, 17, 1000}) do
        local p = data.permutation(n, 42, 0)
        is_perm(p, n)
        list_eq(data.permutation(n, 42, 0), p, 'repeatable n=' .. n)
    end
    local a, b, c = data.permutation(1000, 42, 0), data.permutation(1000, 42, 1), data.permutation(1000, 43, 0)
    local same_b, same_c, fixed = 0, 0, 0
    for i = 1, 1000 do
        if a[i] == b[i] then same_b = same_b + 1 end
        if a[i] == c[i] then same_c = same_c + 1 end
        if a[i] == i then fixed = fixed + 1 end
    end
    assert(same_b < 20 and same_c < 20 and fixed < 20, ('too similar: %d %d %d'):format(same_b, same_c, fixed))
    -- roughly uniform: over many small shuffles each value lands in each slot about equally often
    local counts = {}
    for e = 0, 2999 do
        local p = data.permutation(3, 7, e)
        local k = table.concat(p, '')
        counts[k] = (counts[k] or 0) + 1
    end
    local kinds = 0
    for _, c2 in pairs(counts) do
        kinds = kinds + 1
        assert(c2 > 400 and c2 < 600, 'ordering frequency ' .. c2 .. ' of 3000 is far from 500')
    end
    eq(kinds, 6, 'all 6 orderings of 3')
end)

local function make_docs(n)
    local r = lunar.rng(9)
    local lens = r:randint_(lunar.empty({n}, 'i64'), 1, 40):tolist_flat()
    local docs = {}
    for i = 1, n do
        local ids = {}
        for k = 1, lens[i] do ids[k] = i * 100 + k end   -- token ids tell the document
        docs[i] = {ids = ids}
    end
    return docs
end

local function snapshot(b)
    return {ids = b.input_ids:tolist_flat(), labels = b.labels:tolist_flat(), pos = b.position_ids:tolist_flat(),
        epoch = b.epoch, step = b.step}
end

local function same(x, y, msg)
    list_eq(x.ids, y.ids, msg .. ' ids')
    list_eq(x.labels, y.labels, msg .. ' labels')
    list_eq(x.pos, y.pos, msg .. ' positions')
    eq(x.epoch, y.epoch, msg .. ' epoch')
    eq(x.step, y.step, msg .. ' step')
end

local CFG = {seq_len = 48, micro_batch = 3, seed = 1234, quiet = true}

local function loader(docs, extra)
    local o = {source = docs}
    for k, v in pairs(CFG) do o[k] = v end
    for k, v in pairs(extra or {}) do o[k] = v end
    return data.loader(o)
end

T:test('each epoch visits every document exactly once, in a new order', function()
    local docs = make_docs(61)
    local L = loader(docs)
    local rows = L:rows_per_epoch(0)
    local seen, firsts = {}, {}
    -- walk two epochs' worth of rows through the batches
    local need = 2 * rows
    local taken = 0
    while taken < need do
        local b = L:next()
        local ids = b.input_ids:tolist_flat()
        for r = 1, 3 do
            taken = taken + 1
            if taken > need then break end
            local e = taken <= rows and 0 or 1
            seen[e] = seen[e] or {}
            local row_ids = {unpack(ids, (r - 1) * 48 + 1, r * 48)}
            for t, id in ipairs(row_ids) do
                if b.position_ids:get(r, t) == 0 and id ~= 0 then
                    local d = math.floor(id / 100)
                    assert(not seen[e][d], ('document %d twice in epoch %d'):format(d, e))
                    seen[e][d] = true
                    firsts[e] = firsts[e] or {}
                    firsts[e][#firsts[e] + 1] = d
                end
            end
        end
    end
    for e = 0, 1 do
        local n = 0
        for _ in pairs(seen[e]) do n = n + 1 end
        eq(n, 61, 'documents in epoch ' .. e)
    end
    local diff = 0
    for i = 1, math.min(#firsts[0], #firsts[1]) do if firsts[0][i] ~= firsts[1][i] then diff = diff + 1 end end
    assert(diff > 10, 'epochs 0 and 1 should be in different orders')
    -- the same seed gives the same batches; another seed does not
    local A, B, C = loader(docs), loader(docs), loader(docs, {seed = 99})
    local differ = false
    for _ = 1, 5 do
        local a, b, c = snapshot(A:next()), snapshot(B:next()), snapshot(C:next())
        same(a, b, 'same seed')
        for i = 1, #a.ids do if a.ids[i] ~= c.ids[i] then differ = true end end
    end
    assert(differ, 'another seed should give other batches')
end)

T:test('state saved at every step and restored gives identical following batches (across epochs)', function()
    local docs = make_docs(40)
    local L = loader(docs)
    local rows = L:rows_per_epoch(0)
    local steps = math.ceil(3 * rows / 3) + 2   -- about three epochs
    local states, batches = {}, {}
    for s = 1, steps do
        states[s] = L:state()
        batches[s] = snapshot(L:next())
    end
    assert(batches[steps].epoch >= 2, 'the run should cross two epoch boundaries')
    for _, s in ipairs({1, 2, math.floor(steps / 2), steps - 3}) do
        -- through JSON, as a checkpoint stores it
        local st = lunar.io.decode_json(lunar.io.encode_json(states[s]))
        local R = loader(docs)
        R:set_state(st)
        for k = s, math.min(s + 5, steps) do same(snapshot(R:next()), batches[k], ('resumed at %d, batch %d'):format(s, k)) end
    end
    -- the state after a batch is the state the next loader starts from
    local st = L:state()
    local R = loader(docs)
    R:set_state(st)
    same(snapshot(R:next()), snapshot(L:next()), 'continuation')
end)

T:test('epochs limit, data-parallel slices, refused states', function()
    local docs = make_docs(30)
    local L = loader(docs, {epochs = 1, micro_batch = 2})
    local rows = L:rows_per_epoch(0)
    local n = 0
    while L:next() do n = n + 1 end
    eq(n, math.floor(rows / 2), 'full micro-batches in one epoch')
    -- two ranks: together they see the rows of one single-rank run with micro_batch 4
    local one = loader(docs, {micro_batch = 4})
    local r0 = loader(docs, {micro_batch = 2, dp_size = 2, dp_rank = 0})
    local r1 = loader(docs, {micro_batch = 2, dp_size = 2, dp_rank = 1})
    for _ = 1, 4 do
        local a, b, c = one:next(), r0:next(), r1:next()
        local ids = a.input_ids:tolist_flat()
        local half = #ids / 2
        list_eq(b.input_ids:tolist_flat(), {unpack(ids, 1, half)}, 'rank 0 slice')
        list_eq(c.input_ids:tolist_flat(), {unpack(ids, half + 1, #ids)}, 'rank 1 slice')
    end
    local st = loader(docs):state()
    local ok, err = pcall(function() loader(docs, {seed = 5}):set_state(st) end)
    assert(not ok and err:find('seed = 1234 but this loader has 5'), err)
    ok, err = pcall(function() loader(make_docs(31)):set_state(st) end)
    assert(not ok and err:find('documents = 30 but this loader has 31'), err)
    ok, err = pcall(function() loader(docs):set_state({version = 7}) end)
    assert(not ok and err:find('not a loader state'), err)
end)

T:test('pad_last: every row of the epoch once over the ranks, the last batch filled up with padding', function()
    local docs = make_docs(30)
    local rows = loader(docs):rows_per_epoch(0)
    local tokens = 0
    for _, d in ipairs(docs) do tokens = tokens + #d.ids end
    for _, dp in ipairs({1, 2, 3, 4}) do
        for _, mb in ipairs({1, 2, 5}) do
            local seen, batches, targets = 0, nil, {}
            for r = 0, dp - 1 do
                local L = loader(docs, {epochs = 1, pad_last = true, micro_batch = mb, dp_size = dp, dp_rank = r,
                                        shuffle = false})
                local n = 0
                while true do
                    local b = L:next()
                    if not b then break end
                    n = n + 1
                    eq(b.input_ids:size(1), mb, 'rows a batch')
                    seen = seen + b.num_tokens
                end
                batches = batches or n
                eq(n, batches, ('dp %d mb %d rank %d: batches'):format(dp, mb, r))
            end
            eq(batches, math.ceil(rows / (mb * dp)), ('dp %d mb %d: rounds'):format(dp, mb))
            eq(seen, tokens, ('dp %d mb %d: every token once'):format(dp, mb))
        end
    end
    -- without pad_last the rows short of a whole batch are left out
    local L = loader(docs, {epochs = 1, micro_batch = 5, shuffle = false})
    local n = 0
    while L:next() do n = n + 1 end
    eq(n, math.floor(rows / 5), 'whole batches only')
end)

T:test('a Megatron dataset as the source', function()
    local docs = make_docs(25)
    local prefix = os.tmpname()
    local w = data.indexed_writer(prefix, {dtype = 'int32'})
    for _, d in ipairs(docs) do w:add_document(d.ids) end
    w:finish()
    local ds = data.indexed_open(prefix)
    local A, B = loader(docs), loader(ds)
    for _ = 1, 6 do same(snapshot(B:next()), snapshot(A:next()), 'dataset vs list') end
    ds:close()
    os.remove(prefix)
    os.remove(prefix .. '.bin')
    os.remove(prefix .. '.idx')
end)

-- documents whose every token tells its document and place: id = doc * 1000 + k
local function numbered_docs(n, maxlen, seed)
    local lens = lunar.rng(seed):randint_(lunar.empty({n}, 'i64'), 1, maxlen + 1):tolist_flat()
    local docs = {}
    for i = 1, n do
        local ids = {}
        for k = 1, lens[i] do ids[k] = i * 1000 + k end
        docs[i] = {ids = ids}
    end
    return docs
end

local PACKINGS = {
    {packing = 'bfd', pack_buffer = 7},
    {packing = 'bfd'},                      -- one buffer holds everything
    {packing = 'first_fit'},
}

T:test('both packings: every token of every document exactly once per epoch (split, padding, buffers)', function()
    local docs = numbered_docs(90, 130, 4)
    for _, pk in ipairs(PACKINGS) do
        local tag = pk.packing .. ' buffer ' .. tostring(pk.pack_buffer)
        local L = loader(docs, {packing = pk.packing, pack_buffer = pk.pack_buffer, overlong = 'split',
            pad_to_multiple = 4, micro_batch = 1})
        for e = 0, 1 do
            local rows = L:rows_per_epoch(e)
            local seen, count = {}, 0
            for _ = 1, rows do
                local b = L:next()
                eq(b.epoch, e, tag .. ' epoch of the batch')
                for _, id in ipairs(b.input_ids:tolist_flat()) do
                    if id ~= 0 then
                        assert(not seen[id], ('%s: token %d twice in epoch %d'):format(tag, id, e))
                        seen[id] = true
                        count = count + 1
                    end
                end
            end
            local total = 0
            for i, d in ipairs(docs) do
                for k = 1, #d.ids do assert(seen[i * 1000 + k], ('%s: token %d of document %d missing in epoch %d')
                    :format(tag, k, i, e)) end
                total = total + #d.ids
            end
            eq(count, total, tag .. ' tokens in epoch ' .. e)
        end
    end
end)

T:test('both packings: same seed same batches; resumed mid-epoch (through JSON) equals the run', function()
    local docs = numbered_docs(70, 60, 5)
    for _, pk in ipairs(PACKINGS) do
        local tag = pk.packing .. ' buffer ' .. tostring(pk.pack_buffer)
        local extra = {packing = pk.packing, pack_buffer = pk.pack_buffer, overlong = 'split'}
        local L, A, C = loader(docs, extra), loader(docs, extra), loader(docs, {packing = pk.packing,
            pack_buffer = pk.pack_buffer, overlong = 'split', seed = 77})
        local rows = L:rows_per_epoch(0)
        local steps = math.ceil(2.5 * rows / CFG.micro_batch)   -- into the third epoch
        local states, batches, differ = {}, {}, false
        for s = 1, steps do
            states[s] = L:state()
            batches[s] = snapshot(L:next())
            same(snapshot(A:next()), batches[s], tag .. ' same seed, step ' .. s)
            local c = snapshot(C:next())
            for i = 1, #c.ids do if c.ids[i] ~= batches[s].ids[i] then differ = true end end
        end
        assert(differ, tag .. ': another seed should give other batches')
        for _, s in ipairs({2, math.floor(rows / CFG.micro_batch / 2), math.floor(rows / CFG.micro_batch) + 2,
                            steps - 2}) do
            local st = lunar.io.decode_json(lunar.io.encode_json(states[s]))
            assert(st.row > 0, tag .. ': a mid-epoch state')
            local R = loader(docs, extra)
            R:set_state(st)
            for k = s, steps do
                same(snapshot(R:next()), batches[k], ('%s resumed at %d, batch %d'):format(tag, s, k))
            end
        end
    end
end)

T:test('packing settings in the state: refused when they differ; a state without them was first fit', function()
    local docs = make_docs(30)
    local bfd = loader(docs):state()
    eq(bfd.config.packing, 'bfd', 'the default packing')
    eq(bfd.config.pack_buffer, 10000, 'the default buffer')
    T.raises(function() loader(docs, {packing = 'first_fit'}):set_state(bfd) end,
        'the saved state has packing = bfd but this loader has first_fit')
    T.raises(function() loader(docs, {pack_buffer = 8}):set_state(bfd) end,
        'the saved state has pack_buffer = 10000 but this loader has 8')
    -- a state written before the setting existed: first fit, which resumes as such
    local old = loader(docs, {packing = 'first_fit'})
    old:next()
    local st = old:state()
    st.config.packing, st.config.pack_buffer = nil, nil
    local R = loader(docs, {packing = 'first_fit'})
    R:set_state(st)
    same(snapshot(R:next()), snapshot(old:next()), 'an old first-fit state')
    T.raises(function() loader(docs):set_state(st) end,
        'the saved state has packing = first_fit but this loader has bfd')
    T.raises(function() loader(docs, {packing = 'worst_fit'}) end,
        "packing must be 'bfd' (best fit decreasing) or 'first_fit', got worst_fit")
    -- the loader prints each epoch's packing and its efficiency
    local old_print, lines = print, {}
    print = function(x) lines[#lines + 1] = x end   -- luacheck: ignore
    local ok, err = pcall(function() loader(docs, {quiet = false}):next() end)
    print = old_print   -- luacheck: ignore
    assert(ok, err)
    eq(#lines, 1, 'one line')
    local line = '^epoch 0: packing %(bfd%): 30 documents %-> %d+ rows of 48: %d+ tokens in %d+ slots, efficiency'
    assert(lines[1]:find(line), lines[1])
end)

os.exit(T:run())
