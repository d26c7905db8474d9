-- test_data_readers.lua: the JSONL chat, prompt/answer and plain-text readers. Good rows come back
-- with their file and line; every kind of bad row (invalid JSON, not an object, missing fields,
-- wrong types, empty conversations, unknown roles, no assistant turn, empty text, over-long after
-- tokenization, a failing tokenizer) is counted per reason with its line numbers, the first N
-- shown, and never raises.
local lunar = require 'lunar'
local data = lunar.data
local T = require('lunar.testing').suite('data.readers')

local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir -p '" .. dir .. "'")

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

local CHAT = {
    [=[{"id": "a", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]=],
    [=[{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]=],   -- 2 invalid (unclosed)
    [=[{"messages": []}]=],                                                                        -- 3 empty conversation
    [=[{"conversation": [{"role": "user", "content": "q"}]}]=],                                    -- 4 missing messages
    [=[{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}]=],                 -- 5 missing content
    [=[{"messages": [{"content": "x"}]}]=],                                                        -- 6 missing role
    '',                                                                                          -- 7 blank: skipped
    [=[{"messages": "hello"}]=],                                                                   -- 8 wrong type
    [=[{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}]=],   -- 9 wrong type
    [=[{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "a"}]}]=], -- 10 bad role
    [=[{"messages": [{"role": "user", "content": "only a question"}]}]=],                          -- 11 no assistant
    [=[["messages"] ]=],                                                                           -- 12 not an object
    [=[{"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": null, "tool_calls": [{"name": "w"}]}, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "sunny"}]}]=],
    [=[{"messages": {}}]=],                                                                        -- 14 object, not array
    [=[not json at all]=],                                                                         -- 15 invalid
    [=[{"messages": []}]=],                                                                        -- 16 empty conversation
    [=[{"messages": [1, 2]}]=],                                                                    -- 17 message not an object
}

T:test('chat JSONL: good rows with file and line, bad rows counted per reason with lines', function()
    local path = dir .. '/chat.jsonl'
    spit(path, table.concat(CHAT, '\n') .. '\n')
    local rows, rep = data.read_chat(path)
    eq(#rows, 2, 'good rows')
    eq(rows[1].line, 1, 'line of row 1')
    eq(rows[1].file, path, 'file of row 1')
    eq(rows[1].id, 'a', 'id')
    eq(#rows[1].messages, 3, 'messages')
    eq(rows[1].messages[3].content, 'hello', 'content')
    eq(rows[2].line, 13, 'tool-call row')
    eq(rep.n_good, 2, 'n_good')
    eq(rep.n_bad, 14, 'n_bad')
    list_eq(rep:lines('invalid_json'), {2, 15}, 'invalid_json')
    list_eq(rep:lines('empty_conversation'), {3, 16}, 'empty_conversation')
    list_eq(rep:lines('missing_field'), {4, 5, 6}, 'missing_field')
    list_eq(rep:lines('wrong_type'), {8, 9, 14, 17}, 'wrong_type')
    list_eq(rep:lines('bad_role'), {10}, 'bad_role')
    list_eq(rep:lines('no_assistant'), {11}, 'no_assistant')
    list_eq(rep:lines('not_object'), {12}, 'not_object')
    eq(rep:where('missing_field')[2].detail, 'messages[1].content', 'detail names the field')
    eq(rep:where('wrong_type')[2].detail, 'messages[1].content is a number, not a string', 'wrong type detail')
    assert(rep:where('invalid_json')[1].detail:find('invalid JSON'), rep:where('invalid_json')[1].detail)
    local text = rep:summary()
    assert(text:find('2 rows accepted, 14 rejected', 1, true), text)
    assert(text:find('empty_conversation: 2  e.g. ' .. path .. ':3 (messages is []); ' .. path .. ':16', 1, true), text)
    -- show = 1: the first location only, and how many more
    local _, rep1 = data.read_chat(path, {show = 1})
    eq(#rep1:where('missing_field'), 1, 'first N shown')
    assert(rep1:summary():find('missing_field: 3  e.g. ' .. path .. ':4 (messages), and 2 more', 1, true), rep1:summary())
    -- options: no assistant needed, custom roles, a limit, several files into one report
    rows = data.read_chat(path, {require_assistant = false})
    eq(#rows, 3, 'without require_assistant')
    rows, rep = data.read_chat(path, {roles = {'user', 'assistant', 'wizard', 'system', 'tool'}})
    eq(#rows, 3, 'wizard allowed')
    rows = data.read_chat({path, path}, {limit = 3})
    eq(#rows, 3, 'limit')
    eq(rows[3].line, 1, 'second file, first line')
    local shared = data.report()
    data.read_chat(path, {report = shared})
    data.read_chat(path, {report = shared})
    eq(shared.n_bad, 28, 'accumulated')
    eq(shared.counts.invalid_json, 4, 'accumulated invalid_json')
    -- a missing file is an error (not a bad row)
    local ok, err = pcall(data.read_chat, dir .. '/nope.jsonl')
    assert(not ok and err:find('nope.jsonl'), err)
end)

T:test('prompt/answer JSONL with configurable fields (GSM8K, DAPO shapes)', function()
    local path = dir .. '/qa.jsonl'
    spit(path, table.concat({
        [=[{"question": "1+1?", "answer": "It is 2.\n#### 2"}]=],
        [=[{"question": "no answer"}]=],                       -- 2 missing answer
        [=[{"question": ["list"], "answer": "x"}]=],          -- 3 wrong type
        [=[{"question": "n", "answer": 42}]=],                -- 4 number answer: accepted
        [=[{"question": "q", "answer": "a"]=],                -- 5 invalid
        [=[{"question": null, "answer": "a"}]=],              -- 6 null = missing
    }, '\n'))   -- no final newline
    local rows, rep = data.read_prompt_answer(path, {prompt = 'question', answer = 'answer'})
    eq(#rows, 2, 'rows')
    eq(rows[1].prompt, '1+1?', 'prompt')
    eq(rows[1].answer, 'It is 2.\n#### 2', 'answer')
    eq(rows[2].answer, '42', 'numeric answer as text')
    eq(rows[2].line, 4, 'line')
    list_eq(rep:lines('missing_field'), {2, 6}, 'missing_field')
    eq(rep:where('missing_field')[1].detail, 'answer', 'names the field')
    list_eq(rep:lines('wrong_type'), {3}, 'wrong_type')
    list_eq(rep:lines('invalid_json'), {5}, 'invalid_json')
    -- DAPO-like rows: problem + answer + integer id; prompts only
    local dapo = dir .. '/dapo.jsonl'
    spit(dapo, '{"id": 0, "problem": "P0", "answer": "-3"}\n{"id": 1, "problem": "P1", "answer": "7"}\n')
    rows = data.read_prompt_answer(dapo, {prompt = 'problem'})
    eq(rows[2].id, 1, 'id')
    eq(rows[1].answer, '-3', 'answer')
    rows = data.read_prompt_answer(path, {prompt = 'question', answer = false})
    eq(#rows, 3, 'prompts only (rows 1, 2, 4)')
end)

T:test('plain text: blank-line documents, one per line, one per file (a directory)', function()
    local sub = dir .. '/texts'
    os.execute("mkdir -p '" .. sub .. "/nested'")
    spit(sub .. '/b.txt', 'para one\nstill one\n\n   \n\npara two\n')
    spit(sub .. '/a.txt', 'alpha\r\n\r\nbeta')
    spit(sub .. '/c.txt', '  \n\n')
    spit(sub .. '/nested/z.txt', 'not read')
    local rows, rep = data.read_text(sub .. '/b.txt')
    eq(#rows, 2, 'blank split')
    eq(rows[1].text, 'para one\nstill one', 'doc 1')
    eq(rows[2].text, 'para two', 'doc 2')
    eq(rows[2].line, 6, 'first line of doc 2')
    rows = data.read_text(sub .. '/b.txt', {split = 'line'})
    eq(#rows, 3, 'line split')
    eq(rows[2].line, 2, 'line numbers')
    rows, rep = data.read_text(sub, {split = 'file'})
    eq(#rows, 2, 'one per file (empty c.txt counted, nested dir skipped)')
    eq(rows[1].file, sub .. '/a.txt', 'name order')
    eq(rows[1].text, 'alpha\r\n\r\nbeta', 'file text verbatim')
    list_eq(rep:lines('empty_text'), {1}, 'empty file')
    eq(rep:where('empty_text')[1].file, sub .. '/c.txt', 'empty file named')
    rows = data.read_text(sub)
    eq(#rows, 4, 'blank split over a directory')
    eq(rows[1].text, 'alpha', 'CR stripped in line splitting')
    local ok, err = pcall(data.read_text, sub, {split = 'words'})
    assert(not ok and err:find("split must be"), err)
end)

T:test('read_chat: tools and tool-call arguments keep their key order; unknown roles are bad rows', function()
    local path = dir .. '/tools.jsonl'
    spit(path, table.concat({
        '{"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"zeta": 1, "alpha": 2}}}], '
            .. '"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": '
            .. '[{"type": "function", "function": {"name": "lookup", "arguments": {"zeta": "z", "alpha": "a"}}}]}, '
            .. '{"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]}',
        '{"messages": [{"role": "user", "content": "q"}, {"role": "observation", "content": "x"}, '
            .. '{"role": "assistant", "content": "a"}]}',
        '{"tools": {"name": "f"}, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
        -- a raw tab inside a string: invalid JSON (Python's json rejects it; cJSON lets it through)
        '{"tools": [], "messages": [{"role": "user", "content": "a\tb"}, {"role": "assistant", "content": "a"}]}',
    }, '\n'))
    local rows, rep = data.read_chat(path)
    eq(#rows, 1, 'rows')
    list_eq(rep:lines('bad_role'), {2}, 'observation is not a role the templates render')
    list_eq(rep:lines('wrong_type'), {3}, 'tools must be a list')
    list_eq(rep:lines('invalid_json'), {4}, 'a row only the strict decoder rejects is a bad row')
    -- a byte-order mark before the first row is skipped
    local bom = dir .. '/bom.jsonl'
    spit(bom, '\239\187\191{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    eq(#data.read_chat(bom), 1, 'BOM')
    eq(#rows[1].tools, 1, 'the row keeps its tools')
    local text = lunar.chat.render(rows[1].messages, {tools = rows[1].tools})
    local function before(a, b, what)
        local i, j = text:find(a, 1, true), text:find(b, 1, true)
        assert(i and j and i < j, what .. ': ' .. text)
    end
    before('"zeta": 1', '"alpha": 2', 'tool schema key order')
    before('<arg_key>zeta</arg_key>', '<arg_key>alpha</arg_key>', 'tool-call argument order')
end)

T:test('tokenize: over-long and empty samples counted with their lines, truncation, errors', function()
    local path = dir .. '/qa2.jsonl'
    local lines = {}
    for i = 1, 9 do lines[i] = ('{"prompt": "%s", "answer": "x"}'):format(('w'):rep(i * 3)) end
    lines[5] = '{"prompt": "", "answer": "x"}'
    lines[7] = '{"prompt": "boom", "answer": "x"}'
    spit(path, table.concat(lines, '\n'))
    local rows, rep = data.read_prompt_answer(path)
    eq(#rows, 9, 'rows')
    local tok = data.byte_tokenizer()
    local fn = function(row)
        if row.prompt == 'boom' then error('tokenizer exploded') end
        local ids = tok:encode(row.prompt)
        local mask = {}
        for i = 1, #ids do mask[i] = i > 2 and 1 or 0 end
        return ids, mask
    end
    local docs, trep = data.tokenize(rows, fn, {max_len = 15, report = rep})
    -- lengths 3,6,9,12,0,18,boom,24,27
    eq(#docs, 4, 'kept')
    eq(trep, rep, 'the reader\'s report continued')
    eq(rep.n_good, 4, 'rejected rows moved from good to bad')
    eq(rep.n_bad, 5, 'bad rows')
    list_eq(trep:lines('too_long'), {6, 8, 9}, 'too_long lines')
    list_eq(trep:lines('empty'), {5}, 'empty lines')
    list_eq(trep:lines('tokenize_error'), {7}, 'tokenize_error lines')
    assert(trep:where('tokenize_error')[1].detail:find('tokenizer exploded'), 'error message kept')
    eq(trep:where('too_long')[1].detail, '18 tokens > max_len 15', 'detail')
    eq(docs[4].line, 4, 'doc line')
    eq(#docs[4].mask, 12, 'mask kept')
    docs = data.tokenize(rows, fn, {max_len = 15, overlong = 'truncate'})
    eq(#docs, 7, 'truncate keeps them')
    eq(#docs[5].ids, 15, 'truncated ids')
    eq(#docs[5].mask, 15, 'truncated mask')
    local _, rt = data.tokenize(rows, fn, {max_len = 15, overlong = 'truncate'})
    eq(rt.notes.truncated, 3, 'truncations counted')
    local tl = {}
    for i, e in ipairs(rt:where_noted('truncated')) do tl[i] = e.line end
    list_eq(tl, {6, 8, 9}, 'truncated lines')
    assert(rt:summary():find('kept but truncated: 3', 1, true), rt:summary())
    -- split: every 15-token piece is a document (18 -> 15 + 3, 24 -> 15 + 9, 27 -> 15 + 12)
    local sd, rs = data.tokenize(rows, fn, {max_len = 15, overlong = 'split'})
    eq(#sd, 10, 'split keeps every piece')
    local lens = {}
    for i, doc in ipairs(sd) do lens[i] = #doc.ids end
    list_eq(lens, {3, 6, 9, 12, 15, 3, 15, 9, 15, 12}, 'piece lengths')
    eq(#sd[6].mask, 3, 'the mask is split with the ids')
    list_eq({sd[5].mask[1], sd[6].mask[1]}, {0, 1}, 'the first piece holds the start (its prompt tokens), the next continues')
    eq(rs.notes.split, 3, 'splits counted')
end)

local rc = T:run()
os.execute("rm -rf '" .. dir .. "'")
os.exit(rc)
