-- lunar.chat: the GLM chat templates against jinja2 fixtures, the SFT segments and the loss mask.
-- Fixtures: tests/fixtures/chat/chat_fixtures.jsonl (make_chat_fixtures.py).
local T = require('lunar.testing').suite('chat')
local chat = require 'lunar.chat'
local pyjson = require 'lunar.pyjson'

local FIXTURES = os.getenv('LUNAR_CHAT_FIXTURES') or 'tests/fixtures/chat/chat_fixtures.jsonl'
local TEMPLATES = {'glm45', 'glm5'}

-- strings, numbers, booleans (T.equal compares numbers and tensors only)
local function eq(actual, expected, msg)
    if actual ~= expected then
        error(('%s: got %s, expected %s'):format(msg or 'eq', type(actual) == 'string' and ('%q'):format(actual)
            or tostring(actual), type(expected) == 'string' and ('%q'):format(expected) or tostring(expected)), 2)
    end
end

local function load_fixtures()
    local f = assert(io.open(FIXTURES, 'r'))
    local out = {}
    for line in f:lines() do
        if line ~= '' then out[#out + 1] = pyjson.decode(line) end
    end
    f:close()
    return out
end
local fixtures = load_fixtures()

local function opts_of(fx, tname)
    local o = {template = tname, tools = fx.tools}
    for k, v in pairs(fx.options or {}) do o[k] = v end
    return o
end

-- first differing byte, for failure messages
local function diff(a, b)
    local i = 1
    while i <= #a and i <= #b and a:byte(i) == b:byte(i) do i = i + 1 end
    return ('first difference at byte %d:\n  got      %q\n  expected %q'):format(i, a:sub(math.max(1, i - 40), i + 40),
        b:sub(math.max(1, i - 40), i + 40))
end

T:test('fixture file: >= 60 conversations, every feature present', function()
    eq(#fixtures >= 60, true)
    local seen = {}
    for _, fx in ipairs(fixtures) do
        seen[fx.source] = true
        if fx.tools then seen.tools = true end
        for _, m in ipairs(fx.messages) do
            if m.tool_calls then seen.tool_calls = true end
            if m.reasoning_content then seen.reasoning = true end
            if m.role == 'tool' then seen.tool = true end
        end
        for k, v in pairs(fx.options or {}) do seen[k .. '=' .. tostring(v)] = true end
    end
    for _, k in ipairs({'hand', 'random', 'sft/gsm8k_train_chat_first1000.jsonl', 'sft/oasst_en100_conversations.jsonl',
                        'tools', 'tool_calls', 'reasoning', 'tool', 'enable_thinking=false',
                        'clear_thinking=false', 'add_generation_prompt=true'}) do
        eq(seen[k], true, 'fixtures cover ' .. k)
    end
end)

T:test('a JSONL row read by lunar.data keeps integers beyond 2^53 exact, as jinja2 prints them', function()
    local data = require 'lunar.data'
    local line
    for l in io.lines(FIXTURES) do
        if l:find('"id": "tool_call_big_ints_row"', 1, true) then line = l end
    end
    eq(line ~= nil, true, 'the fixture tool_call_big_ints_row')
    local path = os.tmpname()
    local f = assert(io.open(path, 'w'))
    f:write(line, '\n')
    f:close()
    local rows = data.read_chat(path)
    os.remove(path)
    eq(#rows, 1)
    local fx = pyjson.decode(line)
    for _, tname in ipairs(TEMPLATES) do
        local got = chat.render(rows[1].messages, {template = tname, tools = rows[1].tools})
        if got ~= fx[tname].text then error(tname .. ': ' .. diff(got, fx[tname].text)) end
    end
    local args = rows[1].messages[2].tool_calls[1]['function'].arguments
    eq(pyjson.is_int(args.big) and args.big.text, '12345678901234567891')
    eq(pyjson.is_int(args.p53) and tostring(args.p53), '9007199254740993')
    eq(args.exact, 2 ^ 60, 'exact in a double: a number')
    eq(pyjson.dumps(pyjson.decode('[12345678901234567891, -98765432109876543210, 9007199254740993, 9007199254740992]')),
       '[12345678901234567891, -98765432109876543210, 9007199254740993, 9007199254740992]')
end)

for _, tname in ipairs(TEMPLATES) do
    T:test(tname .. ': identical text to jinja2 on every fixture', function()
        local n = 0
        for _, fx in ipairs(fixtures) do
            local want = fx[tname]
            local ok, got = pcall(chat.render, fx.messages, opts_of(fx, tname))
            if want.error then
                if ok then error(('%s: jinja2 fails (%s) but chat.render gave text'):format(fx.id, want.error)) end
            else
                if not ok then error(fx.id .. ': ' .. tostring(got)) end
                if got ~= want.text then error(fx.id .. ': ' .. diff(got, want.text)) end
                n = n + 1
            end
        end
        eq(n >= 60, true)
    end)

    T:test(tname .. ': training segments concatenate to the text and mark exactly the assistant spans', function()
        for _, fx in ipairs(fixtures) do
            local want = fx[tname]
            if not want.error then
                local segs, full = chat.render_for_training(fx.messages, opts_of(fx, tname))
                local text, parts = want.text, {}
                for k, s in ipairs(segs) do
                    parts[k] = s.text
                    eq(#s.text > 0, true, fx.id .. ': empty segment')
                    if k > 1 then eq(s.train ~= segs[k - 1].train, true, fx.id .. ': unmerged') end
                end
                eq(table.concat(parts), full)
                -- expected train ranges: the jinja2 spans (0-based, end exclusive), each extended by the
                -- stop token that follows: <|user|> / <|observation|>, or the eos appended at the end
                local expect_text, ranges = text, {}
                for _, sp in ipairs(want.spans) do
                    local a, b = sp[1], sp[2]
                    local rest = text:sub(b + 1)
                    if rest == '' then
                        expect_text = text .. '<|endoftext|>'
                        b = b + #'<|endoftext|>'
                    elseif rest:sub(1, 8) == '<|user|>' then
                        b = b + 8
                    elseif rest:sub(1, 15) == '<|observation|>' then
                        b = b + 15
                    end
                    ranges[#ranges + 1] = {a, b}
                end
                if full ~= expect_text then error(fx.id .. ': ' .. diff(full, expect_text)) end
                local got, pos = {}, 0
                for _, s in ipairs(segs) do
                    if s.train then got[#got + 1] = {pos, pos + #s.text} end
                    pos = pos + #s.text
                end
                -- adjacent spans (an assistant turn right after another) are one train segment
                local merged = {}
                for _, r in ipairs(ranges) do
                    local last = merged[#merged]
                    if last and last[2] == r[1] then last[2] = r[2] else merged[#merged + 1] = {r[1], r[2]} end
                end
                eq(#got, #merged, fx.id .. ': number of train segments')
                for k = 1, #got do
                    eq(got[k][1], merged[k][1], fx.id .. ': train segment start')
                    eq(got[k][2], merged[k][2], fx.id .. ': train segment end')
                end
            end
        end
    end)
end

-- A stub tokenizer shaped like GLM's: added tokens split out first (longest match), then a
-- pre-tokenizer (letters with an optional leading non-letter, digit runs of <= 3, punctuation runs
-- with trailing newlines, newline runs, spaces), each piece one id from a growing vocabulary.
-- encode_offsets also returns each token's byte range, for the reference mask.
local ADDED = {'<|endoftext|>', '[gMASK]', '<sop>', '<|system|>', '<|user|>', '<|assistant|>', '<|observation|>',
               '<think>', '</think>', '<tool_call>', '</tool_call>', '<tool_response>', '</tool_response>',
               '<arg_key>', '</arg_key>', '<arg_value>', '</arg_value>', '/nothink'}
local function stub_tokenizer()
    local tok = {vocab = {}, n = 0}
    for _, a in ipairs(ADDED) do
        tok.n = tok.n + 1
        tok.vocab[a] = tok.n
    end
    local function id(piece)
        if not tok.vocab[piece] then
            tok.n = tok.n + 1
            tok.vocab[piece] = tok.n
        end
        return tok.vocab[piece]
    end
    local function pretok(s, base, ids, offs)
        local i = 1
        while i <= #s do
            local _, e = s:find('^[^%w\r\n]?%a+', i)
            if not e then _, e = s:find('^%d%d?%d?', i) end
            if not e then _, e = s:find('^ ?[^%s%w]+[\r\n]*', i) end
            if not e then _, e = s:find('^%s*[\r\n]+', i) end
            if not e then _, e = s:find('^%s+', i) end
            if not e then e = i end
            ids[#ids + 1] = id(s:sub(i, e))
            offs[#offs + 1] = {base + i - 1, base + e}
            i = e + 1
        end
    end
    function tok:encode_offsets(text)
        local ids, offs, i, chunk = {}, {}, 1, 1
        while i <= #text do
            local best
            if text:sub(i, i) == '<' or text:sub(i, i) == '[' or text:sub(i, i) == '/' then
                for _, a in ipairs(ADDED) do
                    if text:sub(i, i + #a - 1) == a and (not best or #a > #best) then best = a end
                end
            end
            if best then
                pretok(text:sub(chunk, i - 1), chunk - 1, ids, offs)
                ids[#ids + 1] = self.vocab[best]
                offs[#offs + 1] = {i - 1, i - 1 + #best}
                i = i + #best
                chunk = i
            else
                i = i + 1
            end
        end
        pretok(text:sub(chunk), chunk - 1, ids, offs)
        return ids, offs
    end
    function tok:encode(text) return (self:encode_offsets(text)) end
    return tok
end

for _, tname in ipairs(TEMPLATES) do
    T:test(tname .. ': tokenize with a stub tokenizer: ids of the whole text, mask = tokens inside train spans',
        function()
            local tok = stub_tokenizer()
            for _, fx in ipairs(fixtures) do
                if not fx[tname].error then
                    local o = opts_of(fx, tname)
                    o.check = true
                    local ids, mask = chat.tokenize(tok, fx.messages, o)
                    local segs, full = chat.render_for_training(fx.messages, o)
                    local whole, offs = tok:encode_offsets(full)
                    eq(#ids, #whole, fx.id)
                    eq(#mask, #ids, fx.id)
                    -- the reference mask: a token is trained when its bytes lie in a train segment
                    local train_byte, pos = {}, 0
                    for _, s in ipairs(segs) do
                        for b = pos, pos + #s.text - 1 do train_byte[b] = s.train end
                        pos = pos + #s.text
                    end
                    local n_train = 0
                    for k = 1, #whole do
                        eq(ids[k], whole[k], fx.id .. ': id ' .. k)
                        local a, b = offs[k][1], offs[k][2]
                        local t = train_byte[a]
                        for x = a, b - 1 do
                            if train_byte[x] ~= t then error(fx.id .. ': token ' .. k .. ' straddles a boundary') end
                        end
                        eq(mask[k], t and 1 or 0, fx.id .. ': mask ' .. k)
                        n_train = n_train + mask[k]
                    end
                    -- every assistant turn trains at least its think marker
                    local n_asst = 0
                    for _, m in ipairs(fx.messages) do if m.role == 'assistant' then n_asst = n_asst + 1 end end
                    eq(n_train >= n_asst, true, fx.id)
                end
            end
        end)
end

T:test('tokenize: the stop tokens and the appended eos are trained, role openers are not', function()
    local tok = stub_tokenizer()
    local msgs = {{role = 'user', content = 'q'}, {role = 'assistant', content = 'a', tool_calls = {
        {['function'] = {name = 'f', arguments = '{"x": 1}'}}}}, {role = 'tool', content = 'r'},
        {role = 'assistant', content = 'done'}}
    local ids, mask = chat.tokenize(tok, msgs, {template = 'glm5'})
    local trained, untrained = {}, {}
    local inv = {}
    for k, v in pairs(tok.vocab) do inv[v] = k end
    for k = 1, #ids do
        local s = inv[ids[k]]
        if mask[k] == 1 then trained[#trained + 1] = s else untrained[#untrained + 1] = s end
    end
    eq(table.concat(trained), '</think>a<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>' ..
        '<|observation|></think>done<|endoftext|>')
    eq(table.concat(untrained), '[gMASK]<sop><|user|>q<|assistant|><tool_response>r</tool_response><|assistant|>')
    -- eos = false: nothing appended, so the last turn has no stop token
    local segs = chat.render_for_training(msgs, {template = 'glm5', eos = false})
    eq(segs[#segs].text, '</think>done')
    -- GLM-4.5: '<|user|>' after a turn is trained, the '\n' after it is not
    segs = chat.render_for_training({{role = 'user', content = 'q'}, {role = 'assistant', content = 'a'},
        {role = 'user', content = 'q2'}}, {template = 'glm45'})
    eq(#segs, 3)
    eq(segs[2].text, '\n<think></think>\na<|user|>')
    eq(segs[3].text, '\nq2')
end)

T:test('render: hand-checked examples (formats.md 7.3)', function()
    local m = {{role = 'system', content = 'You are helpful.'}, {role = 'user', content = 'What is 2+2?'}}
    eq(chat.render(m, {template = 'glm45', add_generation_prompt = true}),
        '[gMASK]<sop><|system|>\nYou are helpful.<|user|>\nWhat is 2+2?<|assistant|>')
    eq(chat.render(m, {template = 'glm-5', add_generation_prompt = true}),
        '[gMASK]<sop><|system|>You are helpful.<|user|>What is 2+2?<|assistant|><think>')
    eq(chat.render(m, {add_generation_prompt = true, enable_thinking = false}),
        '[gMASK]<sop><|system|>You are helpful.<|user|>What is 2+2?<|assistant|></think>')
    local sft = {{role = 'user', content = 'Hi'}, {role = 'assistant', content = 'Hello!'},
                 {role = 'user', content = '2+2?'}, {role = 'assistant', content = '4', reasoning_content = 'add'}}
    eq(chat.render(sft, {template = 'glm47'}),
        '[gMASK]<sop><|user|>Hi<|assistant|></think>Hello!<|user|>2+2?<|assistant|><think>add</think>4')
end)

T:test('render: tool schemas keep their key order (pyjson.object) and Python number formats', function()
    local tool = pyjson.object({{'type', 'function'}, {'function', pyjson.object({{'name', 'f'},
        {'parameters', pyjson.object({{'type', 'object'}, {'required', pyjson.array()}})}, {'scale', 1e-05}})}})
    local text = chat.render({{role = 'user', content = 'x'}}, {tools = {tool}})
    eq(text:find('{"type": "function", "function": {"name": "f", "parameters": {"type": "object", ' ..
        '"required": []}, "scale": 1e-05}}\n', 1, true) ~= nil, true)
    eq(pyjson.dumps(pyjson.decode('[1.0, 2, 1e16, 1E400, -0.0, 0.1, "\\u00e9\\n\\ud83d\\ude00"]')),
        '[1.0, 2, 1e+16, Infinity, -0.0, 0.1, "é\\n😀"]')
    eq(pyjson.dumps({b = 1, a = {true, pyjson.null}}), '{"a": [true, null], "b": 1}')
    eq(chat._py_strip('\227\128\128 x \194\160\n'), 'x')
end)

T:test('errors name the message and the problem', function()
    local function raises(msgs, o, pat)
        local ok, err = pcall(chat.render, msgs, o)
        eq(ok, false)
        if not tostring(err):find(pat, 1, true) then error(('expected %q in: %s'):format(pat, tostring(err))) end
    end
    raises({{role = 'human', content = 'x'}}, {}, "message 1 (human): the GLM templates render only")
    raises({{role = 'user', content = 'x'}}, {template = 'llama'}, 'unknown template "llama"')
    raises({{role = 'assistant', tool_calls = {{['function'] = {name = 'f', arguments = '{bad'}}}}}, {},
        'message 1 (assistant) tool call 1: arguments is a string that is not JSON')
    raises({{role = 'assistant', tool_calls = {{['function'] = {name = 'f'}}}}}, {template = 'glm5'},
        'no arguments')
    raises({{role = 'assistant', tool_calls = {{['function'] = {arguments = {}}}}}}, {}, 'function name')
    raises({{role = 'user', content = {a = 1}}}, {}, 'message 1 (user): content is an object')
    raises({{role = 'tool', content = {{x = 1}}}}, {}, 'result 1: an object without output')
    -- skipping unknown roles, as the templates do
    eq(chat.render({{role = 'developer', content = 'x'}, {role = 'user', content = 'y'}},
        {unknown_roles = 'skip'}), '[gMASK]<sop><|user|>y')
end)

T:test('tokenize: check = true catches a tokenizer that merges across segments', function()
    local merging = {encode = function(_, text)   -- fixed 3-byte pieces, blind to added tokens
        local ids = {}
        for i = 1, #text, 3 do ids[#ids + 1] = text:sub(i, i + 2) end
        return ids
    end}
    local msgs = {{role = 'user', content = 'a b'}, {role = 'assistant', content = 'c'}, {role = 'user', content = 'd'}}
    local ok, err = pcall(chat.tokenize, merging, msgs, {template = 'glm45', check = true})
    eq(ok, false)
    eq(tostring(err):find('other ids than encoding the whole text', 1, true) ~= nil, true)
end)

os.exit(T:run())
