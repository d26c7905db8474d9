-- lunar.data.readers: JSONL chat, prompt/answer JSONL and plain text, with bad rows counted.
--
--   local rows, rep = data.read_chat(paths, {field = 'messages', roles = {...},
--       require_assistant = true, limit =, report =, show = 5})
--     rows[i] = {messages = {{role=, content=, ...}, ...}, tools = <the row's tools list or nil>,
--     id =, file =, line =, raw = <object>}. A row with tools or tool calls is decoded keeping
--     its objects' key order and its integers past 2^53 exact (lunar.pyjson), since the
--     templates write them out as JSON.
--     Rejected: invalid_utf8 (a line that is not UTF-8), invalid_json, not_object, missing_field
--     (no messages, a message without role or content), wrong_type (messages not an array, a
--     message not an object, role or content not a string, tools not an array),
--     empty_conversation (messages = []), bad_role (a role not in `roles`, default the ones the
--     GLM templates render: system/user/assistant/tool), no_assistant (no assistant turn to
--     train on, when require_assistant). An assistant message may have a null or missing content
--     when it has tool_calls.
--   local rows, rep = data.read_prompt_answer(paths, {prompt = 'question', answer = 'answer',
--       system = nil, limit =, report =})
--     rows[i] = {prompt =, answer =, system =, id =, file =, line =, raw =}; answer = false reads
--     prompts only. Field values must be strings (numbers are accepted and written as
--     integers or %.17g). GSM8K: {prompt='question', answer='answer'}; DAPO: {prompt='problem'}.
--   local rows, rep = data.read_jsonl_text(paths, {field = 'text'})   -- rows[i] = {text=, ...}
--   local rows, rep = data.read_text(paths_or_dir, {split = 'blank' | 'file' | 'line'})
--     rows[i] = {text =, file =, line = first line}: 'blank' splits at runs of blank
--     (whitespace-only) lines, 'file' makes each file one document (a directory: its regular
--     files in name order, not recursive), 'line' makes each non-blank line one document.
--     Empty files count as empty_text, documents that are not valid UTF-8 as invalid_utf8.
--   local docs, rep = data.tokenize(rows, fn, {max_len =, overlong = 'drop' | 'truncate' | 'split', report =})
--     fn(row) -> ids (a Lua list or a tensor of token ids) [, mask (list of 0/1, 1 = a token to
--     predict)]; docs[i] = {ids =, mask =, file =, line =, row = row}. Rejected: too_long (more
--     than max_len tokens when overlong = 'drop', the default), empty (no token), no_target (a
--     mask with no 1, or none in the max_len tokens kept: nothing to train on), tokenize_error
--     (fn raised; the message is the detail). A 'split' piece with no 1 in its mask is left out. With report = the reader's report, rejected rows
--     move from its good count to its bad counts. Kept but changed: 'truncate' keeps the first
--     max_len tokens, 'split' every max_len-token piece as its own document; either is counted
--     with its locations as rep.notes.truncated / rep.notes.split (rep:where_noted(what)).
--
-- paths: a file name or a list of them. Line numbers are 1-based lines of the file (blank lines
-- count). Every reader returns the report it filled (lunar.data.report); pass `report` to
-- accumulate several sources into one. `limit` stops after that many accepted rows.
local core = require 'lunar.core'
local tensor = require 'lunar.tensor'
local report = require 'lunar.data.report'
local pyjson = require 'lunar.pyjson'

local M = {}
local fail = tensor.fail
local decode = core.io.decode_json
local utf8_error = core.data.utf8_error
local NULL = core.io.null
local ARRAY_MT = core.io.array_mt

local function paths_of(p, what)
    if type(p) == 'string' then return {p} end
    if type(p) == 'table' and #p > 0 then
        for i, v in ipairs(p) do
            if type(v) ~= 'string' then fail(('%s: path %d is a %s, not a string'):format(what, i, type(v))) end
        end
        return p
    end
    fail(('%s: expected a path or a list of paths, got %s'):format(what, type(p) == 'table' and 'an empty list' or type(p)))
end

-- JSON arrays decode to tables with consecutive keys 1..n (an empty one carries ARRAY_MT);
-- objects to tables with string keys
local function is_array(v)
    if type(v) ~= 'table' then return false end
    if getmetatable(v) == ARRAY_MT then return true end
    local n = #v
    if n == 0 then return false end
    local count = 0
    for _ in pairs(v) do count = count + 1 end
    return count == n
end
M.is_array = is_array

local function is_object(v)
    return type(v) == 'table' and not is_array(v)
end

local function jtype(v)
    if v == NULL then return 'null' end
    if type(v) == 'table' then return is_array(v) and 'array' or 'object' end
    if type(v) == 'number' then return 'number' end
    if type(v) == 'boolean' then return 'boolean' end
    return type(v)
end
M.json_type = jtype

local function num_to_string(v)
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ('%d'):format(v) end
    return ('%.17g'):format(v)
end

-- Runs check(obj, line) on every non-blank line of every file; check returns a row table, or
-- nil, reason, detail. Adds file and line to each row.
local function read_jsonl(what, paths, opts, check)
    opts = opts or {}
    local rep = opts.report or report.new{show = opts.show, name = what}
    local rows, limit = {}, opts.limit
    for _, path in ipairs(paths_of(paths, what)) do
        local st = core.fs.stat(path)
        if st and st.type == 'dir' then fail(('%s: %s is a directory, not a JSONL file'):format(what, path)) end
        local f, err = io.open(path, 'rb')
        if not f then fail(('%s: cannot open %s'):format(what, err or path)) end
        local ln = 0
        for line in f:lines() do
            ln = ln + 1
            -- a UTF-8 byte-order mark (files saved by some Windows editors) is not part of the JSON
            if ln == 1 and line:sub(1, 3) == '\239\187\191' then line = line:sub(4) end
            local bad_byte = line:find('%S') and utf8_error(line)
            if bad_byte then
                -- JSON text is UTF-8 (Python's json and HF datasets refuse anything else)
                rep:bad('invalid_utf8', path, ln, ('byte %d of the line is not valid UTF-8'):format(bad_byte))
            elseif line:find('%S') then
                local ok, obj = pcall(decode, line, 'json')
                if not ok then
                    local msg = tostring(obj)
                    rep:bad('invalid_json', path, ln, msg:match('(invalid JSON.*)$') or msg:match('json: (.*)$') or msg)
                elseif not is_object(obj) then
                    rep:bad('not_object', path, ln, 'a JSON ' .. jtype(obj))
                else
                    local row, reason, detail = check(obj, line)
                    if row then
                        row.file, row.line = path, ln
                        rows[#rows + 1] = row
                        rep:good()
                    else
                        rep:bad(reason, path, ln, detail)
                    end
                end
                if limit and #rows >= limit then break end
            end
        end
        f:close()
        if limit and #rows >= limit then break end
    end
    return rows, rep
end
M.read_jsonl = read_jsonl

-- the roles the GLM templates render (an observation turn is written as a tool message)
local DEFAULT_ROLES = {system = true, user = true, assistant = true, tool = true}

-- does the row hold objects a template writes out as JSON (tool schemas, tool-call arguments)?
-- Their key order is part of the text, and cJSON's tables have none
local function has_json_objects(obj, msgs)
    if obj.tools ~= nil and obj.tools ~= NULL then return true end
    for _, m in ipairs(msgs) do
        if m.tool_calls ~= nil and m.tool_calls ~= NULL then return true end
    end
    return false
end

function M.read_chat(paths, opts)
    opts = opts or {}
    local field = opts.field or 'messages'
    local roles = DEFAULT_ROLES
    if opts.roles then
        roles = {}
        for _, r in ipairs(opts.roles) do roles[r] = true end
    end
    local need_assistant = opts.require_assistant ~= false
    return read_jsonl('read_chat', paths, opts, function(obj, line)
        local msgs = obj[field]
        if msgs == nil then return nil, 'missing_field', field end
        if not is_array(msgs) then return nil, 'wrong_type', ('%s is a %s, not an array'):format(field, jtype(msgs)) end
        if #msgs == 0 then return nil, 'empty_conversation', field .. ' is []' end
        local has_assistant = false
        for i, m in ipairs(msgs) do
            local where = ('%s[%d]'):format(field, i)
            if not is_object(m) then return nil, 'wrong_type', ('%s is a %s, not an object'):format(where, jtype(m)) end
            if m.role == nil then return nil, 'missing_field', where .. '.role' end
            if type(m.role) ~= 'string' then
                return nil, 'wrong_type', ('%s.role is a %s, not a string'):format(where, jtype(m.role))
            end
            if not roles[m.role] then return nil, 'bad_role', ('%s.role is %q'):format(where, m.role) end
            local c = m.content
            local tool_call = m.role == 'assistant' and m.tool_calls ~= nil and m.tool_calls ~= NULL
            if c == nil or c == NULL then
                if not tool_call then return nil, 'missing_field', where .. '.content' end
            elseif type(c) ~= 'string' then
                return nil, 'wrong_type', ('%s.content is a %s, not a string'):format(where, jtype(c))
            end
            if m.role == 'assistant' then has_assistant = true end
        end
        if need_assistant and not has_assistant then return nil, 'no_assistant', 'no assistant message' end
        if obj.tools ~= nil and obj.tools ~= NULL and not is_array(obj.tools) then
            return nil, 'wrong_type', ('tools is a %s, not an array'):format(jtype(obj.tools))
        end
        -- rows with tools or tool calls are read again keeping key order (as Python's json does)
        if has_json_objects(obj, msgs) then
            -- pyjson is as strict as Python's json (cJSON lets a raw control character in a
            -- string through): what it rejects is a bad row, not the end of the read
            local ok, ordered = pcall(pyjson.decode, line)
            if not ok then return nil, 'invalid_json', tostring(ordered) end
            obj = ordered
            msgs = obj[field]
        end
        local id = obj.id
        if id == NULL then id = nil end
        local tools = obj.tools
        if tools == NULL then tools = nil end
        return {messages = msgs, tools = tools, id = id, raw = obj}
    end)
end

-- a string field (numbers become strings); nil, reason, detail when missing or of another type
local function string_field(obj, key)
    local v = obj[key]
    if v == nil or v == NULL then return nil, 'missing_field', key end
    if type(v) == 'number' then return num_to_string(v) end
    if type(v) ~= 'string' then return nil, 'wrong_type', ('%s is a %s, not a string'):format(key, jtype(v)) end
    return v
end

function M.read_prompt_answer(paths, opts)
    opts = opts or {}
    local pk = opts.prompt or 'prompt'
    local ak = opts.answer == nil and 'answer' or opts.answer
    local sk = opts.system
    return read_jsonl('read_prompt_answer', paths, opts, function(obj)
        local prompt, r, d = string_field(obj, pk)
        if not prompt then return nil, r, d end
        local row = {prompt = prompt, raw = obj}
        if ak then
            row.answer, r, d = string_field(obj, ak)
            if not row.answer then return nil, r, d end
        end
        if sk and obj[sk] ~= nil and obj[sk] ~= NULL then
            row.system, r, d = string_field(obj, sk)
            if not row.system then return nil, r, d end
        end
        if obj.id ~= nil and obj.id ~= NULL then row.id = obj.id end
        return row
    end)
end

function M.read_jsonl_text(paths, opts)
    opts = opts or {}
    local key = opts.field or 'text'
    return read_jsonl('read_jsonl_text', paths, opts, function(obj)
        local text, r, d = string_field(obj, key)
        if not text then return nil, r, d end
        if text == '' then return nil, 'empty_text', key .. ' is ""' end
        local row = {text = text}
        if obj.id ~= nil and obj.id ~= NULL then row.id = obj.id end
        return row
    end)
end

local function is_dir(path)
    local ok = pcall(core.data.list_dir, path)
    return ok
end

local function slurp(path, what)
    local f, err = io.open(path, 'rb')
    if not f then fail(('%s: cannot open %s'):format(what, err or path)) end
    local s = f:read('*a')
    f:close()
    return s
end

function M.read_text(paths, opts)
    opts = opts or {}
    local split = opts.split or 'blank'
    if split ~= 'blank' and split ~= 'file' and split ~= 'line' then
        fail(("read_text: split must be 'blank', 'file' or 'line', got %s"):format(tostring(split)))
    end
    local rep = opts.report or report.new{show = opts.show, name = 'read_text'}
    local files = {}
    for _, p in ipairs(paths_of(paths, 'read_text')) do
        if is_dir(p) then
            local names = core.data.list_dir(p)
            for _, n in ipairs(names) do files[#files + 1] = p:gsub('/+$', '') .. '/' .. n end
        else
            files[#files + 1] = p
        end
    end
    local rows, limit = {}, opts.limit
    local function add(text, path, line)
        if limit and #rows >= limit then return end
        local bad_byte = utf8_error(text)
        if bad_byte then
            -- a document with bytes that are not text is counted, not guessed at
            rep:bad('invalid_utf8', path, line, ('byte %d of the document is not valid UTF-8'):format(bad_byte))
            return
        end
        rows[#rows + 1] = {text = text, file = path, line = line}
        rep:good()
    end
    for _, path in ipairs(files) do
        local s = slurp(path, 'read_text')
        if split == 'file' then
            if s:find('%S') then add(s, path, 1) else rep:bad('empty_text', path, 1, 'no text in the file') end
        else
            if not s:find('%S') then rep:bad('empty_text', path, 1, 'no text in the file') end
            -- walk the lines, keeping the exact text of each document (its lines joined by \n)
            local ln, start_line, buf = 0, nil, {}
            local function flush()
                if start_line then add(table.concat(buf, '\n'), path, start_line) end
                start_line, buf = nil, {}
            end
            local pos, n = 1, #s
            while pos <= n do
                local e = s:find('\n', pos, true)
                local line = s:sub(pos, (e or n + 1) - 1)
                pos = (e or n) + 1
                ln = ln + 1
                if line:sub(-1) == '\r' then line = line:sub(1, -2) end
                if not line:find('%S') then
                    flush()
                elseif split == 'line' then
                    add(line, path, ln)
                else
                    start_line = start_line or ln
                    buf[#buf + 1] = line
                end
            end
            flush()
        end
        if limit and #rows >= limit then break end
    end
    return rows, rep
end

-- is any of mask[from..to] 1 (a token to train on)?
local function has_target(mask, from, to)
    for k = from, to do if mask[k] ~= 0 then return true end end
    return false
end

function M.tokenize(rows, fn, opts)
    opts = opts or {}
    -- a report passed in is the reader's: its rows were counted good there, and a row rejected
    -- here moves to bad; a fresh report counts this stage's rows
    local rep = opts.report or report.new{show = opts.show, name = 'tokenize'}
    local continued = opts.report ~= nil
    local function bad(...)
        if continued then rep:ungood() end
        rep:bad(...)
    end
    local max_len, overlong = opts.max_len, opts.overlong or 'drop'
    if not require('lunar.data.pack').OVERLONG[overlong] then
        fail(("tokenize: overlong must be 'drop', 'truncate' or 'split', got %s"):format(tostring(overlong)))
    end
    local docs = {}
    for _, row in ipairs(rows) do
        local ok, ids, mask = pcall(fn, row)
        if not ok then
            bad('tokenize_error', row.file, row.line, tostring(ids))
        else
            if tensor.is_tensor(ids) then ids = ids:tolist_flat() end
            if tensor.is_tensor(mask) then mask = mask:tolist_flat() end
            if type(ids) ~= 'table' then
                bad('tokenize_error', row.file, row.line, 'the tokenize function returned a ' .. type(ids))
            elseif mask and #mask ~= #ids then
                bad('tokenize_error', row.file, row.line, ('%d ids but %d mask values'):format(#ids, #mask))
            elseif #ids == 0 then
                bad('empty', row.file, row.line, 'no tokens')
            elseif max_len and #ids > max_len and overlong == 'drop' then
                bad('too_long', row.file, row.line, ('%d tokens > max_len %d'):format(#ids, max_len))
            elseif mask and not has_target(mask, 1, #ids) then
                bad('no_target', row.file, row.line, 'no token to train on (the mask is 0 everywhere)')
            elseif max_len and #ids > max_len then
                -- truncate keeps the first piece; split keeps every piece with a token to train on
                -- as a document. A piece with none would only cost compute; a row left with none
                -- (a prompt longer than max_len) is rejected, not trained on as nothing
                local n = #ids
                local last = overlong == 'split' and n or max_len
                local kept = 0
                for from = 1, last, max_len do
                    local to = math.min(from + max_len - 1, n)
                    if not mask or has_target(mask, from, to) then
                        local ci, cm = {}, mask and {}
                        for k = from, to do
                            ci[#ci + 1] = ids[k]
                            if cm then cm[#cm + 1] = mask[k] end
                        end
                        docs[#docs + 1] = {ids = ci, mask = cm, file = row.file, line = row.line, row = row}
                        kept = kept + 1
                    end
                end
                if kept == 0 then
                    bad('no_target', row.file, row.line, ('no token to train on in the first %d of its %d tokens '
                        .. '(the prompt is longer than max_len)'):format(max_len, n))
                else
                    rep:note(overlong == 'split' and 'split' or 'truncated', row.file, row.line,
                        ('%d tokens > max_len %d'):format(n, max_len))
                    if not continued then rep:good() end
                end
            else
                docs[#docs + 1] = {ids = ids, mask = mask, file = row.file, line = row.line, row = row}
                if not continued then rep:good() end
            end
        end
    end
    return docs, rep
end

return M
