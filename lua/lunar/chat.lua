-- lunar.chat: the GLM chat templates, rendered in plain Lua, and the SFT loss mask.
--
--   local chat = require 'lunar.chat'
--   chat.render(messages, {template = 'glm5', tools = {...}, add_generation_prompt = true,
--                          enable_thinking = false, clear_thinking = false}) -> text
--   chat.render_for_training(messages, opts) -> {{text=, train=false}, {text=, train=true}, ...}
--   chat.tokenize(tok, messages, opts)       -> ids, loss_mask (1 = train on this token)
--
-- Templates (docs: shared formats.md section 7; texts: data/tokenizer/*.jinja):
--   'glm45' (aliases glm46, glm4.5, glm-4.5, ...): GLM-4.5 / GLM-4.6, newlines after role tokens,
--           /nothink on user turns when enable_thinking is false.
--   'glm5'  (aliases glm47, glm4.7, glm-5, ...): GLM-4.7 / GLM-5, no newlines, '</think>' for
--           dropped reasoning, clear_thinking. The default.
-- The output is exactly what jinja2 renders from those templates the way transformers'
-- apply_chat_template does (trim_blocks, lstrip_blocks, tojson = json.dumps(ensure_ascii=False)),
-- checked on the fixtures of tests/fixtures/chat/. Inputs, as transformers prepares them:
--   * a message key whose value is null (pyjson.null / lunar.io.null) counts as absent
--     (apply_chat_template drops None-valued keys; jinja2 would print "None");
--   * reasoning is read from reasoning_content, else thinking, else reasoning (transformers 5);
--   * tool_calls = {{function = {name =, arguments =}} or {name =, arguments =}}; arguments is
--     an object, or a JSON string that is decoded first (as vLLM does: the templates call
--     arguments.items(), which fails on a string). Object key order, and integers beyond 2^53
--     (kept exact as pyjson.int, as Python's ints are): see lunar.pyjson.
--   * content is a string, a list of parts ({type='text', text=} or strings; other parts are
--     skipped) or absent; tool content may also be a list of strings or {output = string}.
--   * options left nil are jinja2's "undefined": enable_thinking = nil means thinking on.
-- Roles other than system/user/assistant/tool are an error (the templates silently drop them;
-- pass unknown_roles = 'skip' for that).
local pyjson = require 'lunar.pyjson'

local M = {}

local find, sub, byte, concat = string.find, string.sub, string.byte, table.concat
local null = pyjson.null

local ALIASES = {
    glm45 = 'glm45', glm46 = 'glm45', ['glm4.5'] = 'glm45', ['glm4.6'] = 'glm45', ['glm-4.5'] = 'glm45',
    ['glm-4.6'] = 'glm45',
    glm5 = 'glm5', glm47 = 'glm5', ['glm4.7'] = 'glm5', ['glm-4.7'] = 'glm5', ['glm-5'] = 'glm5',
}
M.TEMPLATES = {'glm45', 'glm5'}
M.DEFAULT_TEMPLATE = 'glm5'
M.EOS = '<|endoftext|>'
-- role tokens that end an assistant turn and are GLM stop ids (generation_config eos_token_id)
M.STOP_ROLE_TOKENS = {'<|user|>', '<|observation|>'}

local function fail(msg) error('chat: ' .. msg, 0) end

function M.template_name(name)
    local t = ALIASES[string.lower(name or M.DEFAULT_TEMPLATE)]
    if not t then
        fail(('unknown template %q (known: glm45 = GLM-4.5/4.6, glm5 = GLM-4.7/GLM-5)'):format(tostring(name)))
    end
    return t
end

---------------------------------------------------------------------------------------------------
-- Python string and truth semantics used by the templates

-- str.isspace() characters, as UTF-8: ASCII 9-13, 28-32, then U+0085 U+00A0 U+1680 U+2000-U+200A
-- U+2028 U+2029 U+202F U+205F U+3000
local ASCII_WS = {[9] = true, [10] = true, [11] = true, [12] = true, [13] = true, [28] = true, [29] = true,
                  [30] = true, [31] = true, [32] = true}
local WS2 = {['\194\133'] = true, ['\194\160'] = true}
local WS3 = {['\225\154\128'] = true, ['\226\128\168'] = true, ['\226\128\169'] = true, ['\226\128\175'] = true,
             ['\226\129\159'] = true, ['\227\128\128'] = true}
for c = 0x80, 0x8A do WS3['\226\128' .. string.char(c)] = true end

-- str.strip()
local function py_strip(s)
    local i, j = 1, #s
    while i <= j do
        if ASCII_WS[byte(s, i)] then i = i + 1
        elseif WS2[sub(s, i, i + 1)] then i = i + 2
        elseif WS3[sub(s, i, i + 2)] then i = i + 3
        else break end
    end
    while j >= i do
        if ASCII_WS[byte(s, j)] then j = j - 1
        elseif j - 1 >= i and WS2[sub(s, j - 1, j)] then j = j - 2
        elseif j - 2 >= i and WS3[sub(s, j - 2, j)] then j = j - 3
        else break end
    end
    return sub(s, i, j)
end
M._py_strip = py_strip

local function lstrip_nl(s) return (s:gsub('^\n+', '')) end
local function rstrip_nl(s) return (s:gsub('\n+$', '')) end
-- s.split(sep)[0] and s.split(sep)[-1]
local function before_first(s, sep)
    local a = find(s, sep, 1, true)
    return a and sub(s, 1, a - 1) or s
end
local function after_last(s, sep)
    local pos, a = nil, find(s, sep, 1, true)
    while a do
        pos = a
        a = find(s, sep, a + 1, true)
    end
    return pos and sub(s, pos + #sep) or s
end

-- Python truthiness
local function truthy(v)
    if v == nil or v == false or v == null or v == 0 or v == '' then return false end
    if type(v) == 'table' then return next(v) ~= nil end
    return true
end
-- jinja2 "x is defined and not x" (nil = undefined; null = None, defined and false)
local function defined_false(v) return v ~= nil and not truthy(v) end

-- a message field as the template sees it: null counts as absent
local function field(t, key)
    local v = t[key]
    if v == null then return nil end
    return v
end

-- the container's float marks (lunar.pyjson / lunar.io decoders set them)
local function float_mark(t, key)
    local mt = getmetatable(t)
    return mt and mt.__json_floats and mt.__json_floats[key] or false
end

-- str(v) for a scalar printed by {{ }}; where names it in errors
local function scalar_text(v, as_float, where)
    local tv = type(v)
    if tv == 'string' then return v end
    if tv == 'number' or pyjson.is_int(v) then return pyjson.number(v, as_float) end
    if tv == 'boolean' then return v and 'True' or 'False' end
    fail(where .. ': expected a string, got ' .. (v == null and 'null' or tv))
end

-- the templates' visible_text macro: strings as they are, text parts of a list concatenated
local function visible_text(content, where, as_float)
    if content == nil or content == null then return '' end   -- undefined: an empty loop
    if type(content) ~= 'table' or pyjson.is_int(content) then return scalar_text(content, as_float, where) end
    local mt = getmetatable(content)
    if pyjson.is_object(content) and (next(content) ~= nil or (mt and mt.__keys)) then
        fail(where .. ': content is an object; expected a string or a list of parts')
    end
    local out = {}
    for i = 1, #content do
        local item = content[i]
        if type(item) == 'string' then
            out[#out + 1] = item
        elseif pyjson.is_object(item) and item.type == 'text' then
            local text = field(item, 'text')
            if text ~= nil then out[#out + 1] = scalar_text(text, float_mark(item, 'text'), where .. ' part ' .. i) end
        end
    end
    return concat(out)
end

---------------------------------------------------------------------------------------------------
-- the templates

local TOOLS_HEAD = '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' ..
                   'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n'
local TOOLS_TAIL = '</tools>\n\nFor each function call, output the function name and arguments within the ' ..
                   'following XML format:\n'
local TOOLS_FORMAT = {
    glm45 = '<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n' ..
            '<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>',
    glm5 = '<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>' ..
           '<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>',
}

-- the arguments of a tool call as an object (JSON strings decoded)
local function call_arguments(tc, v5, where)
    local args = field(tc, 'arguments')
    if type(args) == 'string' then
        local ok, dec = pcall(pyjson.decode, args)
        if not ok then fail(where .. ': arguments is a string that is not JSON (' .. dec .. ')') end
        args = dec
        if not pyjson.is_object(args) then
            local kind = pyjson.is_array(args) and 'list' or args == null and 'null' or
                         pyjson.is_int(args) and 'number' or type(args)
            fail(where .. ': arguments decodes to a JSON ' .. kind .. ', not an object')
        end
    end
    if not v5 and not truthy(args) then return {} end   -- GLM-4.5: tc.arguments or {}
    if args == nil then fail(where .. ': no arguments (GLM-4.7/5 calls arguments.items())') end
    if not pyjson.is_object(args) then fail(where .. ': arguments must be an object (or a JSON string of one)') end
    return args
end

-- appends the assistant turn after '<|assistant|>' (think block, content, tool calls)
local function assistant_body(out, m, idx, last_user, v5, o, where)
    local content = visible_text(field(m, 'content'), where, float_mark(m, 'content'))
    local rc = field(m, 'reasoning_content')
    if rc == nil then rc = field(m, 'thinking') end
    if rc == nil then rc = field(m, 'reasoning') end
    local reasoning = ''
    if type(rc) == 'string' then
        reasoning = rc
    elseif find(content, '</think>', 1, true) then
        -- reasoning written inline as <think>...</think> in the content
        reasoning = lstrip_nl(after_last(rstrip_nl(before_first(content, '</think>')), '<think>'))
        content = lstrip_nl(after_last(content, '</think>'))
    end
    local keep = idx > last_user or (v5 and defined_false(o.clear_thinking))
    if keep and reasoning ~= '' then
        out[#out + 1] = (v5 and '<think>' or '\n<think>') .. py_strip(reasoning) .. '</think>'
    else
        out[#out + 1] = v5 and '</think>' or '\n<think></think>'
    end
    local c = py_strip(content)
    if c ~= '' then out[#out + 1] = (v5 and '' or '\n') .. c end

    local calls = field(m, 'tool_calls')
    if not truthy(calls) then return end
    if not pyjson.is_array(calls) then fail(where .. ': tool_calls must be a list') end
    for j = 1, #calls do
        local cw = where .. ' tool call ' .. j
        local tc = calls[j]
        if type(tc) ~= 'table' or tc == null then fail(cw .. ': expected an object') end
        local fn = field(tc, 'function')
        if truthy(fn) then
            if type(fn) ~= 'table' then fail(cw .. ': function must be an object') end
            tc = fn
        end
        local name = field(tc, 'name')
        if type(name) ~= 'string' then fail(cw .. ': the function name must be a string') end
        local args = call_arguments(tc, v5, cw)
        local parts = {v5 and '<tool_call>' or '\n<tool_call>', name, v5 and '' or '\n'}
        for _, k in ipairs(pyjson.keys(args)) do
            local v = args[k]
            local text = type(v) == 'string' and v or pyjson.dumps(v, float_mark(args, k))
            if v5 then
                parts[#parts + 1] = '<arg_key>' .. k .. '</arg_key><arg_value>' .. text .. '</arg_value>'
            else
                parts[#parts + 1] = '<arg_key>' .. k .. '</arg_key>\n<arg_value>' .. text .. '</arg_value>\n'
            end
        end
        parts[#parts + 1] = '</tool_call>'
        out[#out + 1] = concat(parts)
    end
end

local function tool_turn(out, messages, i, v5, where)
    local m = messages[i]
    local content = field(m, 'content')
    local open = v5 and '<tool_response>' or '\n<tool_response>\n'
    local close = v5 and '</tool_response>' or '\n</tool_response>'
    if type(content) == 'string' then
        local prev = messages[i - 1]
        if i == 1 or field(prev, 'role') ~= 'tool' then out[#out + 1] = '<|observation|>' end
        out[#out + 1] = open .. content .. close
        return
    end
    -- a list of results (or none): always opens its own <|observation|>
    out[#out + 1] = '<|observation|>'
    if content == nil then return end
    if type(content) ~= 'table' or not pyjson.is_array(content) and next(content) ~= nil then
        fail(where .. ': content must be a string or a list of results')
    end
    for j = 1, #content do
        local tr, text = content[j], nil
        if type(tr) == 'table' and tr ~= null and not pyjson.is_int(tr) then
            if tr.output == nil then fail(where .. ' result ' .. j .. ': an object without output') end
            text = scalar_text(tr.output, float_mark(tr, 'output'), where .. ' result ' .. j .. ' output')
        else
            text = scalar_text(tr, float_mark(content, j), where .. ' result ' .. j)
        end
        out[#out + 1] = open .. text .. close
    end
end

-- Renders the conversation; returns the text and the assistant bodies as byte ranges
-- {first, last, message = i} (the text after each '<|assistant|>' of an assistant message).
local function render(messages, o)
    o = o or {}
    local tname = M.template_name(o.template)
    local v5 = tname == 'glm5'
    if type(messages) ~= 'table' then fail('messages must be a list, got ' .. type(messages)) end
    local out, spans = {'[gMASK]<sop>'}, {}
    local len = 12
    local function flush_len(from)
        for k = from, #out do len = len + #out[k] end
    end

    local tools = o.tools
    if tools == null then tools = nil end
    if truthy(tools) then
        if not pyjson.is_array(tools) then fail('tools must be a list of tool schemas') end
        out[#out + 1] = TOOLS_HEAD
        for j = 1, #tools do
            if not pyjson.is_object(tools[j]) then fail('tool ' .. j .. ' must be an object (a JSON schema)') end
            out[#out + 1] = pyjson.dumps(tools[j]) .. '\n'
        end
        out[#out + 1] = TOOLS_TAIL .. TOOLS_FORMAT[tname]
        flush_len(2)
    end

    local last_user = -1
    for i = 1, #messages do
        local m = messages[i]
        if type(m) ~= 'table' or pyjson.is_array(m) then fail(('message %d: expected an object'):format(i)) end
        if field(m, 'role') == 'user' then last_user = i end
    end

    for i = 1, #messages do
        local m = messages[i]
        local role = field(m, 'role')
        local where = ('message %d (%s)'):format(i, tostring(role))
        local n0 = #out + 1
        if role == 'user' then
            local text = visible_text(field(m, 'content'), where, float_mark(m, 'content'))
            out[#out + 1] = (v5 and '<|user|>' or '<|user|>\n') .. text
            if not v5 and defined_false(o.enable_thinking) and sub(text, -8) ~= '/nothink' then
                out[#out + 1] = '/nothink'
            end
        elseif role == 'assistant' then
            out[#out + 1] = '<|assistant|>'
            flush_len(n0)
            n0 = #out + 1
            local first = len + 1
            assistant_body(out, m, i, last_user, v5, o, where)
            flush_len(n0)
            n0 = #out + 1
            spans[#spans + 1] = {first, len, message = i}
        elseif role == 'tool' then
            tool_turn(out, messages, i, v5, where)
        elseif role == 'system' then
            local text = visible_text(field(m, 'content'), where, float_mark(m, 'content'))
            out[#out + 1] = (v5 and '<|system|>' or '<|system|>\n') .. text
        elseif o.unknown_roles ~= 'skip' then
            fail(where .. ': the GLM templates render only system, user, assistant and tool messages ' ..
                 "(unknown_roles = 'skip' drops the others, as the templates do)")
        end
        flush_len(n0)
    end

    if truthy(o.add_generation_prompt) then
        if defined_false(o.enable_thinking) then
            out[#out + 1] = v5 and '<|assistant|></think>' or '<|assistant|>\n<think></think>'
        else
            out[#out + 1] = v5 and '<|assistant|><think>' or '<|assistant|>'
        end
    end
    return concat(out), spans
end

-- render(messages, opts) -> text
function M.render(messages, opts)
    return (render(messages, opts))
end

---------------------------------------------------------------------------------------------------
-- SFT view

-- render_for_training(messages, opts) -> segments, text
--
-- Segments {text = string, train = bool} in order; their concatenation is `text`: the rendered
-- conversation, plus opts.eos (default '<|endoftext|>'; false = nothing) when the text ends with
-- an assistant turn. train = true marks exactly the assistant spans. An assistant span:
--   * starts right after the '<|assistant|>' of an assistant message (so it holds GLM-4.5's
--     '\n<think>...</think>\n...' or GLM-5's '<think>...</think>...' / '</think>...', the content
--     and the tool calls; historical turns whose reasoning the template drops train on the
--     template's empty think block, as the text shows);
--   * ends with the token that stops generation after it: the next role token when that is
--     '<|user|>' or '<|observation|>' (both GLM eos ids), included in the span; the appended eos
--     when the assistant turn ends the text; otherwise (followed by '<|system|>', another
--     '<|assistant|>' or the generation prompt) the span ends with the turn and has no stop token.
-- Everything else (the [gMASK]<sop> prefix, tools block, system, user and tool turns, role tokens
-- that open a turn, the generation prompt) has train = false.
function M.render_for_training(messages, opts)
    opts = opts or {}
    local text, spans = render(messages, opts)
    local eos = opts.eos
    if eos == nil then eos = M.EOS end
    local segs, pos = {}, 1
    local function add(s, train)
        if s == '' then return end
        local last = segs[#segs]
        if last and last.train == train then
            last.text = last.text .. s
        else
            segs[#segs + 1] = {text = s, train = train}
        end
    end
    for _, sp in ipairs(spans) do
        local first, last = sp[1], sp[2]
        add(sub(text, pos, first - 1), false)
        local stop = ''
        if last == #text then
            if eos then stop = eos end
        else
            for _, tok in ipairs(M.STOP_ROLE_TOKENS) do
                if sub(text, last + 1, last + #tok) == tok then
                    stop = tok
                    last = last + #tok
                    break
                end
            end
        end
        add(sub(text, first, sp[2]) .. stop, true)
        pos = last + 1
    end
    add(sub(text, pos), false)
    local full = {}
    for k, s in ipairs(segs) do full[k] = s.text end
    return segs, concat(full)
end

-- tokenize(tok, messages, opts) -> ids, loss_mask
--
-- tok:encode(text) -> list of ids, adding no BOS/EOS of its own (lunar.tokenizer; HF
-- add_special_tokens=False). Each training segment is encoded on its own and the ids are
-- concatenated; loss_mask[i] = 1 for ids of train segments, else 0. This gives the ids of
-- encoding the whole text because every segment boundary touches an added token: a span starts
-- right after '<|assistant|>' and ends after '<|user|>' / '<|observation|>' / the eos, or right
-- before '<|system|>' / '<|assistant|>'. The tokenizer splits added tokens out before the regex
-- and BPE (formats.md 6.2) and GLM's added tokens have lstrip/rstrip false, so the text between
-- two added tokens is encoded independently of its neighbours; and no GLM added token contains
-- '<|' past its first character, so no added-token match can straddle a role token. (Encoding the
-- whole text and mapping offsets would need an offsets API the tokenizer does not promise.)
-- opts.check = true also encodes the whole text and fails if the ids differ.
function M.tokenize(tok, messages, opts)
    opts = opts or {}
    if type(tok) ~= 'table' and type(tok) ~= 'userdata' then fail('tokenize: expected a tokenizer') end
    local segs, text = M.render_for_training(messages, opts)
    local ids, mask = {}, {}
    for _, s in ipairs(segs) do
        local t = tok:encode(s.text)
        local flag = s.train and 1 or 0
        for i = 1, #t do
            ids[#ids + 1] = t[i]
            mask[#mask + 1] = flag
        end
    end
    if opts.check then
        local whole = tok:encode(text)
        local same = #whole == #ids
        for i = 1, #whole do
            if not same then break end
            same = whole[i] == ids[i]
        end
        if not same then
            fail('tokenize: encoding the segments separately gave other ids than encoding the whole text ' ..
                 '(the tokenizer merges across an added token?)')
        end
    end
    return ids, mask
end

return M
