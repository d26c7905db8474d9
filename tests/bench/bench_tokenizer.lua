-- bench_tokenizer.lua: encode_batch throughput of lunar's tokenizer.
--   lunar tests/bench/bench_tokenizer.lua [tokenizer=tests/fixtures/tokenizer/glm] [threads=2]
--         [file=PATH] [doc_bytes=4096] [reps=5]
-- The texts: the fixture corpus (tests/fixtures/tokenizer/corpus_glm.bin, ~11k texts of every
-- kind), or with file=PATH that file cut into documents of about doc_bytes at line ends. After
-- one warm-up pass, each output mode is timed reps times and the best pass is reported as one
-- JSON line. tests/bench/bench_tokenizer_hf.py runs this and HF tokenizers on the same texts
-- with the same threads and prints the ratios.
local lunar = require 'lunar'
local o = lunar.config.overrides()
local tokpath = o.tokenizer or 'tests/fixtures/tokenizer/glm'
local threads = tonumber(o.threads or 2)
local reps = tonumber(o.reps or 5)
lunar.threads(threads)

local function read_file(path)
    local f = assert(io.open(path, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

-- the texts of a fixture corpus (layout in tests/fixtures/tokenizer/make_tokenizer_fixtures.py)
local function fixture_texts(path)
    local d = read_file(path)
    local pos = 9
    local function u32()
        local a, b, c, e = d:byte(pos, pos + 3)
        pos = pos + 4
        return a + b * 256 + c * 65536 + e * 16777216
    end
    local hl = u32()
    local nvar = #lunar.io.decode_json(d:sub(pos, pos + hl - 1)).variants
    pos = pos + hl
    local texts = {}
    for _ = 1, u32() do
        local flags = d:byte(pos + 1)
        pos = pos + 2
        local len = u32()
        local text = d:sub(pos, pos + len - 1)
        pos = pos + len
        for _ = 1, nvar do pos = pos + 2 * u32() end
        if math.floor(flags / 2) % 2 == 1 then pos = pos + u32() end
        if flags % 2 == 0 then texts[#texts + 1] = text end
    end
    return texts
end

local function file_docs(path, doc_bytes)
    local s = read_file(path)
    local docs, i = {}, 1
    while i <= #s do
        local j = s:find('\n', i + doc_bytes, true) or #s
        docs[#docs + 1] = s:sub(i, j)
        i = j + 1
    end
    return docs
end

local texts = o.file and file_docs(o.file, tonumber(o.doc_bytes or 4096)) or
    fixture_texts('tests/fixtures/tokenizer/corpus_glm.bin')
local bytes = 0
for _, t in ipairs(texts) do bytes = bytes + #t end

local tok = lunar.tokenizer.load(tokpath)
local ntok = 0
for _, ids in ipairs(tok:encode_batch(texts)) do ntok = ntok + #ids end   -- warm-up (and the count)

local function time(fn)
    local best = math.huge
    for _ = 1, reps do
        collectgarbage()
        local t0 = lunar.clock()
        fn()
        best = math.min(best, lunar.clock() - t0)
    end
    return best
end

local modes = {
    {'table', function() tok:encode_batch(texts) end},
    {'flat', function() local ids, off = tok:encode_batch(texts, {flat = true}) ids:free() off:free() end},
}
for _, m in ipairs(modes) do
    local s = time(m[2])
    print(string.format('{"impl": "lunar", "mode": "%s", "threads": %d, "texts": %d, "bytes": %d, "tokens": %d, ' ..
        '"seconds": %.6f, "mb_per_s": %.2f, "tokens_per_s": %.0f}', m[1], threads, #texts, bytes, ntok, s,
        bytes / s / 1e6, ntok / s))
end
