-- test_data_indexed.lua: Megatron .bin/.idx. The golden pair (tests/fixtures, copied from the
-- shared golden data, made by make_golden.py) read field by field and rewritten byte for byte;
-- write/read round trips for every dtype, multi-sequence documents and empty sequences; value
-- range errors that leave the writer usable; one malformed file per check (the message names the
-- file and the problem); views outliving the dataset; preprocess (API and the command line) on a
-- small text and a JSONL file with bad rows.
local lunar = require 'lunar'
local data = lunar.data
local T = require('lunar.testing').suite('data.indexed')

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local GOLDEN = here .. '/../fixtures/tiny_megatron_text_document'
local GOLDEN_TOKENS = {{151331, 151333, 10, 11, 12, 151329}, {20, 21, 151329}, {30, 31, 32, 33, 151329}}

local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir -p '" .. dir .. "'")

local function slurp(p)
    local f = assert(io.open(p, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

local function spit(p, s)
    local f = assert(io.open(p, 'wb'))
    f:write(s)
    f:close()
end

local function eq(a, b, msg)
    if a ~= b then error(('%s: got %s, expected %s'):format(msg or 'value', tostring(a), tostring(b)), 2) end
end

local function list_eq(a, b, msg)
    eq(#a, #b, (msg or 'list') .. ' length')
    for i = 1, #b do eq(a[i], b[i], ('%s[%d]'):format(msg or 'list', i)) end
end

local function raises(fn, pattern)
    local ok, err = pcall(fn)
    if ok then error('expected an error matching ' .. pattern, 2) end
    if not tostring(err):find(pattern) then error(('error %q does not match %q'):format(tostring(err), pattern), 2) end
    return err
end

-- little-endian encoders for building files by hand, independent of the writer
local function u64(v)
    local b = {}
    for i = 1, 8 do
        b[i] = string.char(v % 256)
        v = math.floor(v / 256)
    end
    return table.concat(b)
end
local function i32(v)
    if v < 0 then v = v + 2 ^ 32 end
    local b = {}
    for i = 1, 4 do
        b[i] = string.char(v % 256)
        v = math.floor(v / 256)
    end
    return table.concat(b)
end

T:test('golden pair: header, arrays and tokens read exactly', function()
    local ds = data.indexed_open(GOLDEN)
    eq(ds:dtype(), 'int32', 'dtype')
    eq(ds:num_sequences(), 3, 'S')
    eq(ds:num_documents(), 3, 'documents')
    eq(ds:total_tokens(), 14, 'tokens')
    eq(ds:multimodal(), false, 'multimodal')
    list_eq(ds:lengths():tolist_flat(), {6, 3, 5}, 'lengths')
    eq(ds:lengths():dtype(), 'i32', 'lengths dtype')
    list_eq(ds:pointers():tolist_flat(), {0, 24, 36}, 'pointers')
    list_eq(ds:document_indices():tolist_flat(), {0, 1, 2, 3}, 'document indices')
    eq(ds:modes(), nil, 'modes')
    for d = 1, 3 do
        local t = ds:document(d)
        eq(t:dtype(), 'i32', 'doc dtype')
        list_eq(t:tolist_flat(), GOLDEN_TOKENS[d], 'document ' .. d)
        list_eq(ds:tokens(d), GOLDEN_TOKENS[d], 'tokens ' .. d)
        eq(ds:length(d), #GOLDEN_TOKENS[d], 'length')
        list_eq(ds:sequence(d):tolist_flat(), GOLDEN_TOKENS[d], 'sequence ' .. d)
    end
    list_eq(ds:sequence(1, 3, 2):tolist_flat(), {10, 11}, 'span of a sequence')
    list_eq(ds:sequence(3, 6, 0):tolist_flat(), {}, 'empty span at the end')
    raises(function() ds:document(4) end, 'document 4 is out of range 1..3')
    raises(function() ds:sequence(1, 5, 3) end, 'tokens 5..7 of sequence 1 are out of range')
    ds:close()
end)

T:test('golden pair rewritten byte-identically (and through the .bin/.idx suffix)', function()
    local ds = data.indexed_open(GOLDEN .. '.idx')
    local out = dir .. '/golden_copy'
    local w = data.indexed_writer(out, {dtype = ds:dtype()})
    for d = 1, ds:num_documents() do w:add_document(ds:document(d)) end
    local s, docs, toks = w:counts()
    eq(s, 3, 'sequences')
    eq(docs, 3, 'documents')
    eq(toks, 14, 'tokens')
    w:finish()
    eq(slurp(out .. '.bin'), slurp(GOLDEN .. '.bin'), '.bin bytes')
    eq(slurp(out .. '.idx'), slurp(GOLDEN .. '.idx'), '.idx bytes')
    -- from Lua lists as well
    local out2 = dir .. '/golden_copy2'
    w = data.indexed_writer(out2, {dtype = 'auto', vocab_size = 151552})
    for _, doc in ipairs(GOLDEN_TOKENS) do w:add(doc):end_document() end
    w:finish()
    eq(slurp(out2 .. '.idx'), slurp(GOLDEN .. '.idx'), '.idx bytes from lists')
    eq(slurp(out2 .. '.bin'), slurp(GOLDEN .. '.bin'), '.bin bytes from lists')
    -- and the index built by hand from the format description
    local idx = 'MMIDIDX\0\0' .. u64(1) .. string.char(4) .. u64(3) .. u64(4) .. i32(6) .. i32(3) .. i32(5)
        .. u64(0) .. u64(24) .. u64(36) .. u64(0) .. u64(1) .. u64(2) .. u64(3)
    eq(slurp(GOLDEN .. '.idx'), idx, 'golden .idx vs the format description')
end)

local RANGES = {
    uint8 = {0, 255}, int8 = {-128, 127}, int16 = {-32768, 32767}, uint16 = {0, 65535},
    int32 = {-2147483648, 2147483647}, int64 = {-2 ^ 53, 2 ^ 53}, float32 = {-16777216, 16777216},
    float64 = {-2 ^ 53, 2 ^ 53},
}
local VIEW_DTYPE = {uint8 = 'u8', int8 = 'i8', int16 = 'i32', uint16 = 'i32', int32 = 'i32', int64 = 'i64',
    float32 = 'f32', float64 = 'f64'}

T:test('round trip for every dtype, multi-sequence documents, empty sequences', function()
    local rng = lunar.rng(11)
    for name, range in pairs(RANGES) do
        local lo, hi = range[1], range[2]
        -- documents: {sequences...}; document 2 has three sequences, one of them empty
        local docs = {}
        local shapes = {{5}, {2, 0, 7}, {1}, {17}, {3, 4}}
        for d, seqs in ipairs(shapes) do
            docs[d] = {}
            for s, n in ipairs(seqs) do
                local vals = {}
                if n > 0 then
                    local span = math.min(hi - lo, 2 ^ 31)
                    vals = rng:randint_(lunar.empty({n}, 'i64'), 0, span):tolist_flat()
                    for k = 1, n do vals[k] = lo + vals[k] end
                end
                if d == 1 then vals[1], vals[2] = lo, hi end   -- the extremes
                docs[d][s] = vals
            end
        end
        local prefix = dir .. '/rt_' .. name
        local w = data.indexed_writer(prefix, {dtype = name})
        for _, seqs in ipairs(docs) do
            for _, v in ipairs(seqs) do w:add(v) end
            w:end_document()
        end
        w:finish()
        local ds = data.indexed_open(prefix)
        eq(ds:dtype(), name, 'dtype')
        eq(ds:num_documents(), #docs, name .. ' documents')
        eq(ds:num_sequences(), 8, name .. ' sequences')
        local si = 0
        for d, seqs in ipairs(docs) do
            local all = {}
            for _, v in ipairs(seqs) do
                si = si + 1
                eq(ds:sequence_length(si), #v, name .. ' sequence length')
                local t = ds:sequence(si)
                eq(t:dtype(), VIEW_DTYPE[name], name .. ' view dtype')
                list_eq(t:tolist_flat(), v, ('%s sequence %d'):format(name, si))
                for _, x in ipairs(v) do all[#all + 1] = x end
            end
            list_eq(ds:document(d):tolist_flat(), all, ('%s document %d'):format(name, d))
            list_eq(ds:tokens(d), all, ('%s tokens %d'):format(name, d))
        end
        list_eq(ds:document_indices():tolist_flat(), {0, 1, 4, 5, 6, 8}, name .. ' document indices')
        -- pointers are the running sum of length x itemsize
        local ptr, acc = ds:pointers():tolist_flat(), 0
        local lens = ds:lengths():tolist_flat()
        local size = ({uint8 = 1, int8 = 1, int16 = 2, uint16 = 2, int32 = 4, int64 = 8, float32 = 4, float64 = 8})[name]
        for i = 1, #lens do
            eq(ptr[i], acc, name .. ' pointer ' .. i)
            acc = acc + lens[i] * size
        end
        eq(#slurp(prefix .. '.bin'), acc, name .. ' .bin size')
        ds:close()
    end
end)

T:test('values out of range: the error names the value, and the writer stays usable', function()
    local w = data.indexed_writer(dir .. '/range', {dtype = 'uint16'})
    w:add_document({1, 2, 3})
    raises(function() w:add({5, 65536}) end, 'token 1 of sequence 1 is 65536, which uint16 cannot hold')
    raises(function() w:add({-1}) end, 'is %-1, which uint16 cannot hold')
    raises(function() w:add({1.5}) end, 'token 1 is not an integer')
    raises(function() w:add(lunar.tensor({1.5})) end, 'must be an integer tensor')
    w:add_document(lunar.tensor({7, 8}, 'i32'))
    w:add_document(lunar.tensor({{9, 10}, {11, 12}}, 'i64'):transpose():select(1, 1))   -- a strided view: {9, 11}
    w:finish()
    local ds = data.indexed_open(dir .. '/range')
    eq(ds:num_documents(), 3, 'documents')
    list_eq(ds:tokens(2), {7, 8}, 'doc 2')
    list_eq(ds:tokens(3), {9, 11}, 'doc 3')
    raises(function() w:add({1}) end, 'used after finish')
    raises(function() data.indexed_writer(dir .. '/x', {dtype = 'int7'}) end, 'dtype int7 is not one of')
    raises(function() data.indexed_writer(dir .. '/x', {dtype = 'auto'}) end, "needs vocab_size")
    eq(data.megatron_dtype(65499), 'uint16', 'auto dtype small')
    eq(data.megatron_dtype(151552), 'int32', 'auto dtype GLM')
end)

T:test('finish auto-closes a last document; abort and collection leave no file', function()
    local w = data.indexed_writer(dir .. '/auto', {dtype = 'int32'})
    w:add({1, 2})
    w:add({3})
    w:finish()
    local ds = data.indexed_open(dir .. '/auto')
    eq(ds:num_documents(), 1, 'one document of two sequences')
    list_eq(ds:tokens(1), {1, 2, 3}, 'tokens')
    w = data.indexed_writer(dir .. '/aborted', {dtype = 'int32'})
    w:add_document({1})
    w:abort()
    eq(io.open(dir .. '/aborted.bin'), nil, 'no .bin after abort')
    eq(io.open(dir .. '/aborted.idx'), nil, 'no .idx after abort')
    local p = io.popen("ls '" .. dir .. "'")
    local listing = p:read('*a')
    p:close()
    eq(listing:find('aborted'), nil, 'no temporary left behind')
    -- an empty dataset
    w = data.indexed_writer(dir .. '/empty', {dtype = 'int32'})
    w:finish()
    ds = data.indexed_open(dir .. '/empty')
    eq(ds:num_documents(), 0, 'empty dataset')
    eq(ds:total_tokens(), 0, 'no tokens')
end)

T:test('views outlive the dataset; writes into a view never reach the file', function()
    local ds = data.indexed_open(GOLDEN)
    local d1 = ds:document(1)
    ds:close()
    collectgarbage()
    list_eq(d1:tolist_flat(), GOLDEN_TOKENS[1], 'view after close')
    d1:set(1, 7)
    eq(d1:get(1), 7, 'copy-on-write')
    local again = data.indexed_open(GOLDEN)
    eq(again:document(1):get(1), 151331, 'file unchanged')
    raises(function() again._h:close(); again:document(1) end, 'used after close')
end)

T:test('malformed files: each error names the file and the problem', function()
    local idx, bin = slurp(GOLDEN .. '.idx'), slurp(GOLDEN .. '.bin')
    local function case(name, idx_bytes, bin_bytes, pattern)
        local p = dir .. '/bad_' .. name
        spit(p .. '.idx', idx_bytes)
        spit(p .. '.bin', bin_bytes)
        local err = raises(function() data.indexed_open(p) end, pattern)
        if not err:find('bad_' .. name, 1, true) then error('error does not name the file: ' .. err) end
    end
    case('magic', 'XMIDIDX' .. idx:sub(8), bin, 'bad magic')
    case('version', idx:sub(1, 9) .. u64(2) .. idx:sub(18), bin, 'version 2')
    case('dtype', idx:sub(1, 17) .. string.char(9) .. idx:sub(19), bin, 'dtype code 9')
    case('short', idx:sub(1, 20), bin, 'too short')
    case('truncated', idx:sub(1, 90), bin, 'need')
    case('counts', idx:sub(1, 17) .. string.char(4) .. u64(2 ^ 40) .. idx:sub(27), bin, 'truncated')
    case('binsize', idx, bin:sub(1, 52), 'the two files do not belong together')
    case('pointer', idx:sub(1, 34 + 12 + 8) .. u64(28) .. idx:sub(34 + 12 + 17), bin, 'starts at byte 28')
    case('doc0', idx:sub(1, 34 + 36) .. u64(1) .. idx:sub(34 + 45), bin, 'document_indices%[0%] is 1')
    case('docorder', idx:sub(1, 34 + 36 + 16) .. u64(0) .. idx:sub(34 + 36 + 25), bin, 'out of order')
    case('neglen', idx:sub(1, 34) .. i32(-1) .. idx:sub(39), bin, 'negative length')
    raises(function() data.indexed_open(dir .. '/missing') end, 'missing.idx: cannot open')
    -- multimodal: S extra mode bytes are accepted and read
    local p = dir .. '/mm'
    spit(p .. '.idx', idx .. string.char(0, 1, 0))
    spit(p .. '.bin', bin)
    local ds = data.indexed_open(p)
    eq(ds:multimodal(), true, 'multimodal')
    list_eq(ds:modes():tolist_flat(), {0, 1, 0}, 'modes')
end)

local TEXT = 'First doc line one.\nline two\n\n\n  \nSecond doc.\n\nThird\r\nwith CRLF\r\n'

T:test('preprocess: text split by blank lines, bytes tokenizer, eod appended', function()
    local src = dir .. '/small.txt'
    spit(src, TEXT)
    local res = data.preprocess{input = src, output_prefix = dir .. '/pp/small', tokenizer = 'bytes', quiet = true}
    eq(res.prefix, dir .. '/pp/small_text_document', 'Megatron naming')
    eq(res.documents, 3, 'documents')
    eq(res.dtype, 'uint16', 'auto dtype for 257 ids')
    local ds = data.indexed_open(res.prefix)
    local expect = {'First doc line one.\nline two', 'Second doc.', 'Third\nwith CRLF'}
    local tok = data.byte_tokenizer()
    local total = 0
    for d = 1, 3 do
        local ids = ds:tokens(d)
        eq(ids[#ids], 256, 'eod at the end')
        eq(tok:decode(ids), expect[d], 'document ' .. d)
        list_eq(ids, (function() local t = tok:encode(expect[d]); t[#t + 1] = 256; return t end)(), 'ids ' .. d)
        total = total + #ids
    end
    eq(res.tokens, total, 'token count')
    -- one document per line, no eod, int32
    res = data.preprocess{input = src, output_prefix = dir .. '/pp/lines', split = 'line', append_eod = false,
        dtype = 'int32', quiet = true}
    ds = data.indexed_open(res.prefix)
    eq(ds:num_documents(), 5, 'line documents')
    eq(ds:dtype(), 'int32', 'dtype')
    eq(tok:decode(ds:tokens(2)), 'line two', 'second line')
end)

T:test('preprocess: JSONL with bad rows counted by line; the command line end to end', function()
    local src = dir .. '/docs.jsonl'
    spit(src, table.concat({
        '{"text": "alpha"}',
        '{"text": ',                 -- 2 invalid
        '',
        '{"body": "no text"}',       -- 4 missing
        '{"text": 42}',              -- 5 a number: accepted as "42"
        '{"text": ["x"]}',           -- 6 wrong type
        '{"text": ""}',              -- 7 empty
        '[1, 2]',                    -- 8 not an object
        '{"text": "omega \\u00e9"}',
    }, '\n') .. '\n')
    local res = data.preprocess{input = src, output_prefix = dir .. '/pp/j', format = 'jsonl', quiet = true}
    eq(res.documents, 3, 'accepted')
    local rep = res.report
    list_eq(rep:lines('invalid_json'), {2}, 'invalid json lines')
    list_eq(rep:lines('missing_field'), {4}, 'missing field lines')
    list_eq(rep:lines('wrong_type'), {6}, 'wrong type lines')
    list_eq(rep:lines('empty_text'), {7}, 'empty text lines')
    list_eq(rep:lines('not_object'), {8}, 'not object lines')
    eq(rep.n_bad, 5, 'bad rows')
    local ds = data.indexed_open(res.prefix)
    local tok = data.byte_tokenizer()
    eq(tok:decode(ds:tokens(2)), '42', 'number as text')
    eq(tok:decode(ds:tokens(3)), 'omega \195\169', 'utf-8 bytes')
    -- without format=, a .jsonl input is read as JSONL (the same documents), not as text
    assert(src:match('%.jsonl$'), src)
    local res2 = data.preprocess{input = src, output_prefix = dir .. '/pp/j2', quiet = true}
    eq(res2.documents, 3, 'jsonl by its name')
    eq(tok:decode(data.indexed_open(res2.prefix):tokens(3)), 'omega \195\169', 'the same documents')

    -- the command line: find our own executable and run the recipe
    local p = io.popen('readlink /proc/' .. (io.open('/proc/self/stat'):read('*l'):match('^(%d+)')) .. '/exe')
    local exe = p:read('*l')
    p:close()
    local root = here .. '/../..'
    local out = dir .. '/cli/corpus'
    local cmd = ("cd '%s' && '%s' recipes/tools/preprocess.lua input='%s' output_prefix='%s' tokenizer=bytes format=jsonl "
        .. "field=text 2>&1"):format(root, exe, src, out)
    p = io.popen(cmd)
    local text = p:read('*a')
    p:close()
    if not text:find('3 documents', 1, true) then error('unexpected output: ' .. text) end
    if not text:find('invalid_json: 1', 1, true) then error('bad rows not reported: ' .. text) end
    eq(slurp(out .. '_text_document.bin'), slurp(res.prefix .. '.bin'), 'CLI .bin = API .bin')
    eq(slurp(out .. '_text_document.idx'), slurp(res.prefix .. '.idx'), 'CLI .idx = API .idx')
    p = io.popen(("cd '%s' && '%s' recipes/tools/preprocess.lua input=x output_prefix=y bogus=1 2>&1"):format(root, exe))
    text = p:read('*a')
    p:close()
    if not text:find('unknown option "bogus"', 1, true) then error('unknown option not rejected: ' .. text) end
end)

local rc = T:run()
os.execute("rm -rf '" .. dir .. "'")
os.exit(rc)
