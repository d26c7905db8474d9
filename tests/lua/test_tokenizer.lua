-- lunar.tokenizer against Hugging Face tokenizers: the ids HF gave for every text of the
-- fixture corpora (tests/fixtures/tokenizer, made by make_tokenizer_fixtures.py), lossless
-- decode, special tokens, the plain ByteLevel pre-tokenizer with added-token flags, and errors
-- for malformed tokenizer.json files.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('tokenizer')

local DIR = 'tests/fixtures/tokenizer/'

-- equality of numbers, strings, booleans, nil, or arrays of numbers
local function eq(a, b, msg)
    if type(a) == 'table' or type(b) == 'table' then return T.equal(a, b, msg) end
    if a ~= b then error(('%s: %s vs %s'):format(msg or 'eq', tostring(a), tostring(b)), 2) end
end

-- ---- fixture reader (layout in make_tokenizer_fixtures.py) ----------------------------------------

local function read_file(path)
    local f = assert(io.open(path, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

local function write_file(path, s)
    local f = assert(io.open(path, 'wb'))
    f:write(s)
    f:close()
end

local function read_corpus(path)
    local d = read_file(path)
    assert(d:sub(1, 8) == 'LTOKFIX1', path .. ': bad magic')
    local pos = 9
    local function u32()
        local a, b, c, e = d:byte(pos, pos + 3)
        pos = pos + 4
        return a + b * 256 + c * 65536 + e * 16777216
    end
    local hl = u32()
    local head = lunar.io.decode_json(d:sub(pos, pos + hl - 1))
    pos = pos + hl
    local n = u32()
    local samples = {}
    for i = 1, n do
        local cat, flags = d:byte(pos, pos + 1)
        pos = pos + 2
        local len = u32()
        local s = {cat = head.categories[cat + 1], no_special = flags % 2 == 1, text = d:sub(pos, pos + len - 1), ids = {}}
        pos = pos + len
        for v = 1, #head.variants do
            local k = u32()
            local ids = {}
            for j = 1, k do
                local lo, hi = d:byte(pos, pos + 1)
                ids[j] = lo + hi * 256
                pos = pos + 2
            end
            s.ids[v] = ids
        end
        if math.floor(flags / 2) % 2 == 1 then
            local l = u32()
            s.decoded = d:sub(pos, pos + l - 1)
            pos = pos + l
        end
        samples[i] = s
    end
    assert(pos == #d + 1, path .. ': trailing bytes')
    return samples, head
end

local function show(s)
    return (s:gsub('[^\32-\126]', function(c) return ('\\x%02x'):format(c:byte()) end))
end

local function same(a, b)
    if #a ~= #b then return false end
    for i = 1, #a do if a[i] ~= b[i] then return false end end
    return true
end

-- compare got[i] with want(i) for every sample; report the first few mismatches
local function check_all(samples, got, want, what)
    local bad, first = 0, {}
    for i, s in ipairs(samples) do
        local w = want(s)
        if not same(got[i], w) then
            bad = bad + 1
            if #first < 5 then
                first[#first + 1] = ('  [%d] %s %q\n    got  %s\n    want %s'):format(i, s.cat, show(s.text):sub(1, 120),
                    table.concat(got[i], ' '):sub(1, 200), table.concat(w, ' '):sub(1, 200))
            end
        end
    end
    if bad > 0 then error(('%s: %d of %d texts differ from HF:\n%s'):format(what, bad, #samples, table.concat(first, '\n')), 2) end
end

local glm_samples, glm_head = read_corpus(DIR .. 'corpus_glm.bin')
local glm = lunar.tokenizer.load(DIR .. 'glm')

local function split_by_mode(samples)
    local on, off = {}, {}
    for _, s in ipairs(samples) do
        if s.no_special then off[#off + 1] = s else on[#on + 1] = s end
    end
    return on, off
end

local function texts_of(samples)
    local t = {}
    for i, s in ipairs(samples) do t[i] = s.text end
    return t
end

-- ---- the GLM-style tokenizer ---------------------------------------------------------------------

T:test('corpus covers every category with >= 10,000 texts', function()
    local counts, distinct = {}, {}
    for _, s in ipairs(glm_samples) do
        counts[s.cat] = (counts[s.cat] or 0) + 1
        if not s.no_special then distinct[#distinct + 1] = s end
    end
    eq(#distinct >= 10000, true, 'distinct texts: ' .. #distinct)
    for _, c in ipairs(glm_head.categories) do
        eq((counts[c] or 0) > 0, true, 'category ' .. c)
    end
end)

T:test('encode_batch: identical ids to HF on every text (special tokens allowed and disallowed)', function()
    local on, off = split_by_mode(glm_samples)
    check_all(on, glm:encode_batch(texts_of(on)), function(s) return s.ids[1] end, 'encode_batch')
    check_all(off, glm:encode_batch(texts_of(off), {special = false}), function(s) return s.ids[1] end,
        'encode_batch special=false')
end)

T:test('encode: identical ids to HF, text by text', function()
    local got = {}
    for i, s in ipairs(glm_samples) do got[i] = glm:encode(s.text, {special = not s.no_special}) end
    check_all(glm_samples, got, function(s) return s.ids[1] end, 'encode')
end)

T:test('the linear and the heap merge loops give the same ids', function()
    local on = split_by_mode(glm_samples)
    local sub = {}
    for i = 1, #on, 7 do sub[#sub + 1] = on[i] end
    for _, s in ipairs(on) do if s.cat == 'long' then sub[#sub + 1] = s end end
    for _, lm in ipairs({0, 1, 1000000}) do
        glm._t:set_linear_max(lm)
        local ok, err = pcall(check_all, sub, glm:encode_batch(texts_of(sub)), function(s) return s.ids[1] end,
            'linear_max ' .. lm)
        glm._t:set_linear_max(48)
        if not ok then error(err, 0) end
    end
end)

T:test('decode(encode(x)) == x on every text, invalid UTF-8 included', function()
    local bad = {}
    for _, s in ipairs(glm_samples) do
        local back = glm:decode(glm:encode(s.text, {special = not s.no_special}))
        if back ~= s.text and #bad < 5 then bad[#bad + 1] = s.cat .. ': ' .. show(s.text):sub(1, 80) end
    end
    eq(#bad, 0, 'round trip failed for:\n' .. table.concat(bad, '\n'))
end)

T:test('decode with skip_special matches HF decode(skip_special_tokens=True)', function()
    local n = 0
    for _, s in ipairs(glm_samples) do
        if s.decoded then
            n = n + 1
            local d = glm:decode(s.ids[1], {skip_special = true})
            if d ~= s.decoded then error(('skip_special: %q\n got  %q\n want %q'):format(s.text, d, s.decoded)) end
        end
    end
    eq(n > 500, true, 'texts with a decoded reference: ' .. n)
end)

T:test('special and added tokens: ids, flags, special=false', function()
    -- the table the fixture was made from (in the shared data next to the repository, when present)
    local okj, spec = pcall(lunar.io.read_json, '../shared/data/tokenizer/glm_special_tokens.json')
    if not okj then spec = nil end
    local added = glm:added_tokens()
    local first = added[1].id
    eq(first, 6256, 'added tokens start right after the ordinary vocab')
    local sids = glm:special_ids()
    if spec then
        for i, t in ipairs(spec.tokens) do
            eq(added[i].content, t.token)
            eq(added[i].id, first + i - 1, t.token)
            eq(glm:token_to_id(t.token), first + i - 1, t.token)
            eq(added[i].special, t.hf_special_flag ~= false, t.token .. ' special flag')
            eq(sids[t.token] ~= nil, added[i].special, t.token)
        end
    end
    eq(glm:is_special(glm:token_to_id('<|user|>')), true)
    eq(glm:is_special(glm:token_to_id('<think>')), false)
    eq(glm:encode('<|user|>'), {glm:token_to_id('<|user|>')})
    eq(#glm:encode('<|user|>', {special = false}) > 1, true, 'special=false splits <|user|> as text')
    eq(glm:encode('<think>', {special = false}), {glm:token_to_id('<think>')}, 'non-special tokens stay whole')
    -- leftmost-longest: [gMASK] is not [MASK] preceded by 'g'
    eq(glm:encode('[gMASK]'), {glm:token_to_id('[gMASK]')})
    local ids = glm:encode('a[MASK]b')
    eq(ids[2], glm:token_to_id('[MASK]'))
    eq(glm:decode({glm:token_to_id('[gMASK]'), glm:token_to_id('<sop>')}), '[gMASK]<sop>')
    eq(glm:decode({glm:token_to_id('[gMASK]'), glm:token_to_id('<think>')}, {skip_special = true}), '<think>')
    eq(glm:encode(''), {})
end)

T:test('Lua API: tensors, flat batches, token strings, errors', function()
    local text = 'Hello world 12345 你好 👍🏽'
    local ids = glm:encode(text)
    local t = glm:encode(text, {tensor = true})
    eq(t:dtype(), 'i64')
    eq(t:tolist_flat(), ids)
    eq(glm:decode(t), text)
    eq(glm:decode(t:to('i32')), text)
    local texts = {text, '', 'abc', '<|user|>x'}
    local flat, off = glm:encode_batch(texts, {flat = true})
    local tabs = glm:encode_batch(texts)
    local tens = glm:encode_batch(texts, {tensor = true})
    local o = off:tolist_flat()
    eq(#o, #texts + 1)
    local f = flat:tolist_flat()
    for i, tx in ipairs(texts) do
        local want = glm:encode(tx)
        eq(tabs[i], want, 'table ' .. i)
        eq(tens[i]:tolist_flat(), want, 'tensor ' .. i)
        local got = {}
        for k = o[i] + 1, o[i + 1] do got[#got + 1] = f[k] end
        eq(got, want, 'flat ' .. i)
    end
    -- token strings round-trip for every id
    for id = 0, glm:vocab_size() - 1 do
        local s = glm:id_to_token(id)
        eq(glm:token_to_id(s), id)
    end
    eq(glm:id_to_token(glm:vocab_size()), nil)
    eq(glm:token_to_id('no such token here'), nil)
    eq(glm:id_to_token(glm:token_to_id('Ġthe') or 0) ~= nil, true)
    T.raises(function() glm:decode({1, 99999}) end, 'id 99999 at position 2 is not in the vocabulary')
    T.raises(function() glm:decode({-1}) end, 'id -1')
    -- skip_unknown leaves such ids out, as HF tokenizers' decode does (a padded embedding's rows)
    eq(glm:decode({1, 99999, 2, -1}, {skip_unknown = true}), glm:decode({1, 2}))
    eq(glm:decode(lunar.tensor({1, 99999, 2}, {dtype = 'i64'}), {skip_unknown = true}), glm:decode({1, 2}))
    T.raises(function() glm:encode(12) end, 'expected a string')
    T.raises(function() glm:encode('x', {specail = true}) end, "unknown option 'specail'")
    T.raises(function() glm:encode_batch({'a', 3}) end, 'texts[2]')
    local tok2 = lunar.tokenizer.load(DIR .. 'glm/tokenizer.json')
    tok2:free()
    T.raises(function() tok2:encode('x') end, 'used after free')
end)

-- ---- the plain ByteLevel tokenizer with added-token flags ------------------------------------------

T:test('ByteLevel pre-tokenizer, lstrip/rstrip/single_word/normalized, three configurations', function()
    local samples, head = read_corpus(DIR .. 'corpus_bytelevel.bin')
    local json = read_file(DIR .. 'bytelevel/tokenizer.json')
    local variants = {default = json}
    local n
    variants.add_prefix_space, n = json:gsub('"add_prefix_space": false', '"add_prefix_space": true', 1)
    eq(n, 1)
    variants.ignore_merges, n = json:gsub('"ignore_merges": false', '"ignore_merges": true', 1)
    eq(n, 1)
    for v, name in ipairs(head.variants) do
        local path = os.tmpname()
        write_file(path, variants[name])
        local tok = lunar.tokenizer.load(path)
        os.remove(path)
        local on, off = split_by_mode(samples)
        check_all(on, tok:encode_batch(texts_of(on)), function(s) return s.ids[v] end, name)
        check_all(off, tok:encode_batch(texts_of(off), {special = false}), function(s) return s.ids[v] end,
            name .. ' special=false')
        if name == 'default' then
            for _, s in ipairs(on) do
                -- (no round trip here: lstrip/rstrip tokens swallow whitespace, and the added token
                -- 'Ġx' decodes to ' x' as HF's ByteLevel decoder maps its characters)
                if s.decoded then eq(tok:decode(s.ids[v], {skip_special = true}), s.decoded, 'skip_special') end
            end
        end
    end
end)

-- ---- malformed files ------------------------------------------------------------------------------

-- a minimal byte-level BPE tokenizer.json: the 256 byte characters, merges h+e, l+l, he+ll
local function byte_chars()
    local bs, cs = {}, {}
    for b = 0, 255 do
        if (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or b >= 174 then bs[#bs + 1] = b end
    end
    local have = {}
    for _, b in ipairs(bs) do have[b] = true end
    local map, extra = {}, 0
    for b = 0, 255 do
        if have[b] then map[b] = b else map[b] = 256 + extra; extra = extra + 1 end
    end
    local function utf8(cp)
        if cp < 128 then return string.char(cp) end
        return string.char(192 + math.floor(cp / 64), 128 + cp % 64)
    end
    for b = 0, 255 do cs[b] = utf8(map[b]) end
    return cs
end

local function tiny_json(edit)
    local cs = byte_chars()
    local vocab = {}
    for b = 0, 255 do vocab[cs[b]] = b end
    vocab.he, vocab.ll, vocab.hell = 256, 257, 258
    local j = {
        version = '1.0',
        normalizer = lunar.io.null,
        pre_tokenizer = {type = 'Sequence', pretokenizers = {
            {type = 'Split', pattern = {Regex = [[\p{L}+|\s+|[^\s\p{L}]+]]}, behavior = 'Isolated', invert = false},
            {type = 'ByteLevel', add_prefix_space = false, trim_offsets = true, use_regex = false}}},
        decoder = {type = 'ByteLevel'},
        model = {type = 'BPE', vocab = vocab, merges = {'h e', {'l', 'l'}, 'he ll'}},
        added_tokens = {{id = 259, content = '<|x|>', special = true, lstrip = false, rstrip = false,
                         single_word = false, normalized = false}},
    }
    if edit then edit(j) end
    return lunar.io.encode_json(j)
end

local function load_text(text)
    local path = os.tmpname() .. '_tokenizer.json'
    write_file(path, text)
    local ok, res = pcall(lunar.tokenizer.load, path)
    os.remove(path)
    return ok, res, path
end

T:test('a hand-made tokenizer.json: merges in both forms, ids worked out by hand', function()
    local ok, tok = load_text(tiny_json())
    eq(ok, true, tostring(tok))
    -- "hello": h e l l o -> he l l o -> he ll o -> hell o
    eq(tok:encode('hello'), {258, string.byte('o')})
    eq(tok:encode('hello<|x|>he'), {258, string.byte('o'), 259, 256})
    -- ' ' is byte 32, whose character is U+0120 'Ġ' (id 32 as well: the vocab is byte-indexed)
    eq(tok:encode('ll ll'), {257, 32, 257})
    eq(tok:decode({258, 32, 259}), 'hell <|x|>')
    eq(tok:vocab_size(), 260)
end)

T:test('malformed tokenizer.json: errors name the file and the key', function()
    local cases = {
        {function(j) j.model = nil end, 'model: missing'},
        {function(j) j.model.type = 'WordPiece' end, "model.type: 'WordPiece' is not supported"},
        {function(j) j.model.vocab = nil end, 'model.vocab: missing'},
        {function(j) j.model.vocab.he = 1.5 end, "model.vocab['he']: id 1.5 is not a non-negative integer"},
        {function(j) j.model.vocab.he = 'x' end, "model.vocab['he']: expected an integer id"},
        {function(j) j.model.vocab.he = 5 end, 'id 5 is given to both'},
        {function(j) j.model.merges = nil end, 'model.merges: missing'},
        {function(j) j.model.merges[2] = 'l l l' end, "model.merges[1]: 'l l l' is not two tokens"},
        {function(j) j.model.merges[3] = 'he zz' end, "model.merges[2]: 'zz' is not in model.vocab"},
        {function(j) j.model.merges[1] = {'h'} end, 'model.merges[0]: expected "a b" or ["a", "b"]'},
        {function(j) j.model.byte_fallback = true end, 'model.byte_fallback: true is not supported'},
        {function(j) j.model.dropout = 0.1 end, 'model.dropout'},
        {function(j) j.model.continuing_subword_prefix = '##' end, "model.continuing_subword_prefix: '##'"},
        {function(j) j.model.unk_token = '<unk>' end, "model.unk_token: '<unk>' is not in model.vocab"},
        {function(j) j.normalizer = {type = 'NFC'} end, "normalizer: type 'NFC' is not supported"},
        {function(j) j.pre_tokenizer = {type = 'Whitespace'} end, "pre_tokenizer.type: 'Whitespace' is not supported"},
        {function(j) j.pre_tokenizer = lunar.io.null end, 'pre_tokenizer: null is not supported'},
        {function(j) j.pre_tokenizer.pretokenizers[1].behavior = 'Removed' end,
            "pre_tokenizer.pretokenizers[0].behavior: 'Removed' is not supported"},
        {function(j) j.pre_tokenizer.pretokenizers[1].pattern = {Regex = '(unclosed'} end,
            'pre_tokenizer.pretokenizers[0].pattern.Regex: PCRE2 cannot compile'},
        {function(j) j.pre_tokenizer.pretokenizers[1].invert = true end, 'pre_tokenizer.pretokenizers[0].invert'},
        {function(j) j.pre_tokenizer.pretokenizers[2] = {type = 'Digits'} end,
            "pre_tokenizer.pretokenizers[1].type: 'Digits' is not supported"},
        {function(j) table.remove(j.pre_tokenizer.pretokenizers, 2) end, 'must end with ByteLevel'},
        {function(j) j.decoder = {type = 'WordPiece'} end, "decoder: type 'WordPiece' is not supported"},
        {function(j) j.decoder = nil end, "decoder: type 'null' is not supported"},
        {function(j) j.added_tokens[1].content = nil end, 'added_tokens[0].content: expected a string'},
        {function(j) j.added_tokens[1].id = nil end, 'added_tokens[0].id: missing'},
        {function(j) j.added_tokens[1].special = 'yes' end, 'added_tokens[0].special: expected true or false'},
        {function(j) j.added_tokens[1].id = 256 end, "added_tokens: id 256 of '<|x|>' is the model token 'he'"},
        {function(j) j.added_tokens[1].content = 'he' end, "added_tokens[0]: 'he' has id 259 but model.vocab gives it 256"},
        {function(j) j.added_tokens[2] = {id = 259, content = '<|y|>'} end, 'added_tokens: id 259 is given to both'},
        {function(j) j.added_tokens[2] = {id = 260, content = '<|x|>'} end, "added_tokens[1]: '<|x|>' appears twice"},
    }
    for i, c in ipairs(cases) do
        local ok, err, path = load_text(tiny_json(c[1]))
        eq(ok, false, 'case ' .. i .. ' (' .. c[2] .. ') loaded')
        err = tostring(err)
        if not err:find(path, 1, true) then error('case ' .. i .. ': the message does not name the file: ' .. err) end
        if not err:find(c[2], 1, true) then error('case ' .. i .. ': expected "' .. c[2] .. '" in: ' .. err) end
    end
    local ok, err, path = load_text('{"model": {"type": "BPE", ')
    eq(ok, false)
    eq(tostring(err):find(path, 1, true) ~= nil and tostring(err):find('invalid JSON at line 1', 1, true) ~= nil, true,
        tostring(err))
    T.raises(function() lunar.tokenizer.load('/nonexistent/tokenizer.json') end, '/nonexistent/tokenizer.json: cannot open')
    T.raises(function() lunar.tokenizer.load('tests/fixtures') end, 'tests/fixtures: the directory has no tokenizer.json')
end)

-- ---- Unicode 15 and 16 (tests/fixtures/tokenizer/make_unicode16_fixtures.py) ------------------------

-- the Split regex of the fixture's "words" variant (WORDS_REGEX of the script)
local WORDS_REGEX = [=[\b\p{Lu}\p{Ll}*|\b\p{L}+|\d+|\w+|\s+|[^\w\s]]=]

T:test('every code point new in Unicode 15.0, 15.1 and 16.0: after a space, before \'s, between digits, in a word, before a single_word token', function()
    local samples, head = read_corpus(DIR .. 'unicode16/corpus.bin')
    eq(#samples > 10300, true, 'texts: ' .. #samples)
    local j = lunar.io.decode_json(read_file(DIR .. 'unicode16/tokenizer.json'))
    for v, name in ipairs(head.variants) do
        if name == 'words' then j.pre_tokenizer.pretokenizers[1].pattern.Regex = WORDS_REGEX end
        local path = os.tmpname()
        write_file(path, lunar.io.encode_json(j))
        local tok = lunar.tokenizer.load(path)
        os.remove(path)
        check_all(samples, tok:encode_batch(texts_of(samples)), function(s) return s.ids[v] end, name)
    end
end)

T:test('pre-tokenizer regexes: what lunar cannot match as HF does is an error naming it', function()
    local cases = {
        {[[\p{Han}+]], "the property '\\p{Han}' is not supported"},
        {[[\X]], '\\X (a grapheme cluster) is not supported'},
        {[=[[[:alpha:]]]=], 'POSIX bracket classes'},
        {[=[[a[bc]]]=], 'nested character classes'},
        {[=[[\w&&[^a]]]=], 'class intersection (&&)'},
        {[[(?i:é)]], 'the non-ASCII character U+00E9 under (?i)'},
        {[=[(?i)[\p{L}x]]=], 'in a character class under (?i)'},
        {[[(?i:'ss)]], "'ss' under (?i)"},
        {[[(?i)x(?-i)ss|(?i:fl)]], "'fl' under (?i)"},
    }
    for i, c in ipairs(cases) do
        local ok, err, path = load_text(tiny_json(function(j) j.pre_tokenizer.pretokenizers[1].pattern.Regex = c[1] end))
        eq(ok, false, 'case ' .. i .. ' (' .. c[1] .. ') loaded')
        err = tostring(err)
        if not err:find(path .. ': pre_tokenizer.pretokenizers[0].pattern.Regex: ', 1, true) then
            error('case ' .. i .. ': the message does not name the file and the key: ' .. err)
        end
        if not err:find(c[2], 1, true) then error('case ' .. i .. ': expected "' .. c[2] .. '" in: ' .. err) end
    end
    -- what lunar does take, with ids worked out by hand (merges h+e, l+l, he+ll; byte ids)
    local function with_regex(re)
        local ok, tok = load_text(tiny_json(function(j) j.pre_tokenizer.pretokenizers[1].pattern.Regex = re end))
        eq(ok, true, tostring(tok))
        return tok
    end
    local tok = with_regex([[(?i:he)|\p{Letter}+|\s+|[^\s\p{L}]+]])      -- (?i) on ASCII; a long property name
    eq(tok:encode('hell'), {256, 257}, 'he | ll')
    eq(tok:encode('HEll'), {72, 69, 257}, 'HE | ll')
    tok = with_regex([[\h+|[^\h]+]])                                     -- Oniguruma's \h: a hex digit
    eq(tok:encode('hell'), {104, 101, 257}, 'h | e | ll')
    tok = with_regex([[\b\w|\w+|\W+]])                                    -- \b of Oniguruma's \w
    eq(tok:encode('hell he'), {104, 101, 257, 32, 104, 101}, 'h | ell | " " | h | e')
end)

-- ---- every Unicode code point (developer check: LUNAR_TOK_SWEEP=<file from --sweep>) ---------------

T:test('every code point after a letter, digit, space, apostrophe and newline (LUNAR_TOK_SWEEP)', function()
    local path = os.getenv('LUNAR_TOK_SWEEP')
    if not path then
        print('      (LUNAR_TOK_SWEEP not set: skipped)')
        return
    end
    local samples = read_corpus(path)
    check_all(samples, glm:encode_batch(texts_of(samples)), function(s) return s.ids[1] end, 'sweep')
end)

os.exit(T:run())
