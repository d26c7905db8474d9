-- lunar.pyjson: JSON the way Python's json module reads and writes it, for the chat templates.
--
--   local pyjson = require 'lunar.pyjson'
--   local v = pyjson.decode('{"b": 1, "a": [2.0, null]}')   -- objects keep their key order
--   pyjson.dumps(v)                  --> '{"b": 1, "a": [2.0, null]}'
--   pyjson.object({{'type', 'function'}, {'function', f}})  -- an ordered object built in Lua
--   pyjson.array({})                 -- an empty table that dumps as [] (not {})
--   pyjson.null, pyjson.is_null(v)
--
-- dumps(v) gives exactly json.dumps(v, ensure_ascii=False) (separators ', ' and ': ', no sorting),
-- which is what transformers' `tojson` filter produces in chat templates. Python keeps dict
-- insertion order; Lua tables have none, so:
--   * an object's key order is its metatable's __keys list (decode and object() set it); keys
--     without one are written in sorted order, after the listed ones;
--   * a table is an array when it is marked (array(), or lunar.io's array metatable) or when its
--     keys are exactly 1..n with n >= 1; an unmarked empty table is an object ({});
--   * a number is written as a Python float (1.0, 1e-05, 1e+16) when it is not integral, or when
--     its container marks it as a float in the metatable's __json_floats = {key = true} (decode
--     marks every number written with '.' or an exponent; lunar.io.decode_json does the same);
--     otherwise as an int;
--   * Python's ints have no size limit: decode keeps an integer literal that a double cannot hold
--     exactly (12345678901234567891, 2^53 + 1) as pyjson.int(digits), which dumps writes back
--     digit for digit; pyjson.is_int(v) tells one, v.text holds its digits (tostring(v) too).
-- null: pyjson.null (lunar.io.null when lunar's core is loaded, so both readers agree).
local M = {}

local byte, char, sub, find, format = string.byte, string.char, string.sub, string.find, string.format
local concat, floor, huge = table.concat, math.floor, math.huge

local io_null, io_array_mt
do
    local ok, core = pcall(require, 'lunar.core')
    if ok and type(core) == 'table' and core.io then
        io_null, io_array_mt = core.io.null, core.io.array_mt
    end
end

M.null = io_null or setmetatable({}, {__tostring = function() return 'pyjson.null' end})
function M.is_null(v) return v == M.null end

local ARRAY_MT = {__json_array = true}
local INT_MT = {__name = 'pyjson.int', __tostring = function(v) return v.text end}

-- an exact integer from its decimal digits ('-' allowed), for values beyond a double's 2^53
function M.int(text)
    if type(text) ~= 'string' or not text:match('^%-?%d+$') then
        error('pyjson.int: expected decimal digits, got ' .. tostring(text), 2)
    end
    return setmetatable({text = text}, INT_MT)
end

function M.is_int(v) return getmetatable(v) == INT_MT end

-- marks t (default {}) as a JSON array
function M.array(t) return setmetatable(t or {}, ARRAY_MT) end

-- ordered object from a list of {key, value} pairs (a repeated key keeps its first place and its
-- last value, like a Python dict)
function M.object(kv)
    local t, keys = {}, {}
    for _, p in ipairs(kv or {}) do
        local k, v = p[1], p[2]
        if type(k) ~= 'string' then error('pyjson.object: keys must be strings, got ' .. type(k), 2) end
        if t[k] == nil then keys[#keys + 1] = k end
        t[k] = v
    end
    return setmetatable(t, {__keys = keys})
end

-- marks t[key] as a Python float (1 is then written 1.0)
function M.mark_float(t, key)
    local mt = getmetatable(t)
    if mt == nil or mt == ARRAY_MT or mt == io_array_mt then
        local new = {}
        if mt then for k, v in pairs(mt) do new[k] = v end end
        mt = new
        setmetatable(t, mt)
    end
    mt.__json_floats = mt.__json_floats or {}
    mt.__json_floats[key] = true
    return t
end

function M.is_array(t)
    if type(t) ~= 'table' or t == M.null then return false end
    local mt = getmetatable(t)
    if mt then
        if mt.__keys or mt == INT_MT then return false end
        if mt.__json_array or mt == io_array_mt then return true end
    end
    local n, count = #t, 0
    for _ in pairs(t) do count = count + 1 end
    return n >= 1 and count == n
end

function M.is_object(t)
    return type(t) == 'table' and t ~= M.null and getmetatable(t) ~= INT_MT and not M.is_array(t)
end

-- the keys of an object in Python's order (see the header)
function M.keys(t)
    local mt = getmetatable(t)
    local listed, out, seen = mt and mt.__keys, {}, {}
    if listed then
        for _, k in ipairs(listed) do
            if t[k] ~= nil and not seen[k] then
                out[#out + 1] = k
                seen[k] = true
            end
        end
    end
    local rest = {}
    for k in pairs(t) do
        if not seen[k] then rest[#rest + 1] = k end
    end
    table.sort(rest, function(a, b)
        if type(a) == type(b) then return a < b end
        return type(a) == 'number'
    end)
    for _, k in ipairs(rest) do out[#out + 1] = k end
    return out
end

---------------------------------------------------------------------------------------------------
-- numbers

-- decimal string + 1 in the last place; returns digits, carry (true when 99..9 became 100..0)
local function dec_inc(d)
    local i = #d
    while i >= 1 and byte(d, i) == 57 do i = i - 1 end   -- trailing 9s
    if i == 0 then return '1' .. string.rep('0', #d - 1), true end
    return sub(d, 1, i - 1) .. char(byte(d, i) + 1) .. string.rep('0', #d - i), false
end

-- Shortest digits that read back to v (> 0, finite), chosen as Python's repr does: the fewest
-- digits, and among those the decimal nearest to v (ties to even). %.99e gives the first 100
-- exact digits (LuaJIT formats exactly); a tie at <= 17 digits needs an expansion of <= 18.
local function shortest(v)
    local d1, drest, e = format('%.99e', v):match('^(%d)%.(%d+)e([-+]%d+)$')
    local all, exp = d1 .. drest, tonumber(e)
    for p = 1, 17 do
        local head = sub(all, 1, p)
        local nextd = byte(all, p + 1) - 48
        local rest = find(all, '[1-9]', p + 2) ~= nil
        local up = nextd > 5 or (nextd == 5 and (rest or (byte(head, p) - 48) % 2 == 1))
        local inc, carry = dec_inc(head)
        local near = up and {inc, carry and exp + 1 or exp} or {head, exp}
        local far = up and {head, exp} or {inc, carry and exp + 1 or exp}
        for _, c in ipairs({near, far}) do
            if tonumber(c[1] .. 'e' .. (c[2] - p + 1)) == v then return c[1], c[2] end
        end
    end
    return sub(all, 1, 17), exp
end

-- Python's repr of a float: shortest round-trip digits, written in fixed notation when the
-- decimal exponent is in [-4, 16), else as d.ddde+XX.
local function float_repr(v)
    if v ~= v then return 'NaN' end
    if v == huge then return 'Infinity' end
    if v == -huge then return '-Infinity' end
    if v == 0 then return (1 / v < 0) and '-0.0' or '0.0' end
    local sign = v < 0 and '-' or ''
    local digits, exp = shortest(math.abs(v))
    digits = digits:gsub('0+$', '')
    if exp >= 16 or exp < -4 then
        local m = digits:sub(1, 1)
        if #digits > 1 then m = m .. '.' .. digits:sub(2) end
        return format('%s%se%s%02d', sign, m, exp < 0 and '-' or '+', math.abs(exp))
    end
    local nd = #digits
    if exp < 0 then
        return sign .. '0.' .. string.rep('0', -exp - 1) .. digits
    elseif nd <= exp + 1 then
        return sign .. digits .. string.rep('0', exp + 1 - nd) .. '.0'
    else
        return sign .. digits:sub(1, exp + 1) .. '.' .. digits:sub(exp + 2)
    end
end
M.float_repr = float_repr

local function int_repr(v)
    if v == 0 then return '0' end
    return format('%.0f', v)
end

-- the text json.dumps writes for number v (or a pyjson.int); as_float: the container marks it a float
function M.number(v, as_float)
    if getmetatable(v) == INT_MT then
        if as_float then return float_repr(tonumber(v.text)) end
        return v.text
    end
    if as_float or v ~= v or v == huge or v == -huge or v ~= floor(v) then return float_repr(v) end
    return int_repr(v)
end

---------------------------------------------------------------------------------------------------
-- dumps

local ESC = {['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f', ['\n'] = '\\n', ['\r'] = '\\r',
             ['\t'] = '\\t'}
for c = 0, 31 do
    local ch = char(c)
    if not ESC[ch] then ESC[ch] = format('\\u%04x', c) end
end

local function quote(s)
    return '"' .. s:gsub('[%z\1-\31"\\]', ESC) .. '"'
end
M.quote = quote

local dump

local function dump_key(k)
    if type(k) == 'string' then return quote(k) end
    if type(k) == 'number' then return '"' .. M.number(k) .. '"' end
    if type(k) == 'boolean' then return k and '"true"' or '"false"' end
    error('pyjson.dumps: cannot write a ' .. type(k) .. ' key', 0)
end

dump = function(v, as_float, depth, out)
    local tv = type(v)
    if v == nil or v == M.null then
        out[#out + 1] = 'null'
    elseif tv == 'boolean' then
        out[#out + 1] = v and 'true' or 'false'
    elseif tv == 'number' then
        out[#out + 1] = M.number(v, as_float)
    elseif tv == 'string' then
        out[#out + 1] = quote(v)
    elseif getmetatable(v) == INT_MT then
        out[#out + 1] = M.number(v, as_float)
    elseif tv == 'table' then
        if depth > 200 then error('pyjson.dumps: nested more than 200 levels (a cycle?)', 0) end
        local mt = getmetatable(v)
        local floats = mt and mt.__json_floats
        if M.is_array(v) then
            out[#out + 1] = '['
            for i = 1, #v do
                if i > 1 then out[#out + 1] = ', ' end
                dump(v[i], floats and floats[i], depth + 1, out)
            end
            out[#out + 1] = ']'
        else
            out[#out + 1] = '{'
            for i, k in ipairs(M.keys(v)) do
                if i > 1 then out[#out + 1] = ', ' end
                out[#out + 1] = dump_key(k)
                out[#out + 1] = ': '
                dump(v[k], floats and floats[k], depth + 1, out)
            end
            out[#out + 1] = '}'
        end
    else
        error('pyjson.dumps: cannot write a ' .. tv, 0)
    end
end

-- json.dumps(v, ensure_ascii=False)
function M.dumps(v, as_float)
    local out = {}
    dump(v, as_float, 0, out)
    return concat(out)
end

---------------------------------------------------------------------------------------------------
-- decode

local function utf8_char(cp)
    if cp < 0x80 then return char(cp) end
    if cp < 0x800 then return char(0xC0 + floor(cp / 64), 0x80 + cp % 64) end
    if cp < 0x10000 then
        return char(0xE0 + floor(cp / 4096), 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
    end
    return char(0xF0 + floor(cp / 262144), 0x80 + floor(cp / 4096) % 64, 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
end

local UNESC = {['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t'}

local function decode_error(s, i, msg)
    local line = 1
    for _ in sub(s, 1, i - 1):gmatch('\n') do line = line + 1 end
    error(format('JSON: %s at line %d, byte %d', msg, line, i), 0)
end

local function skip(s, i)
    local _, e = find(s, '^[ \t\r\n]*', i)
    return e + 1
end

local function parse_string(s, i)   -- s[i] == '"'
    local parts, j = {}, i + 1
    while true do
        local a = find(s, '["\\%z\1-\31]', j)
        if not a then decode_error(s, i, 'unterminated string') end
        local c = sub(s, a, a)
        if a > j then parts[#parts + 1] = sub(s, j, a - 1) end
        if c == '"' then return concat(parts), a + 1 end
        if c ~= '\\' then decode_error(s, a, 'control character in string') end
        local e = sub(s, a + 1, a + 1)
        if UNESC[e] then
            parts[#parts + 1] = UNESC[e]
            j = a + 2
        elseif e == 'u' then
            local hex = sub(s, a + 2, a + 5)
            if not hex:match('^%x%x%x%x$') then decode_error(s, a, 'bad \\u escape') end
            local cp = tonumber(hex, 16)
            j = a + 6
            if cp >= 0xD800 and cp <= 0xDBFF then
                local lo = sub(s, j, j + 5):match('^\\u(%x%x%x%x)$')
                lo = lo and tonumber(lo, 16)
                if not lo or lo < 0xDC00 or lo > 0xDFFF then decode_error(s, a, 'lone surrogate') end
                cp = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00)
                j = j + 6
            elseif cp >= 0xDC00 and cp <= 0xDFFF then
                decode_error(s, a, 'lone surrogate')
            end
            parts[#parts + 1] = utf8_char(cp)
        else
            decode_error(s, a, 'bad escape')
        end
    end
end

local LITERALS = {{'true', true}, {'false', false}, {'null', M.null}, {'NaN', 0 / 0}, {'Infinity', huge},
                  {'-Infinity', -huge}}

-- returns value, next index, is_float
local function parse_value(s, i, depth)
    if depth > 200 then decode_error(s, i, 'nested more than 200 levels') end
    i = skip(s, i)
    local c = sub(s, i, i)
    if c == '{' then
        local t, keys, floats = {}, {}, nil
        i = skip(s, i + 1)
        if sub(s, i, i) == '}' then return setmetatable(t, {__keys = keys}), i + 1 end
        while true do
            if sub(s, i, i) ~= '"' then decode_error(s, i, 'expected a string key') end
            local k
            k, i = parse_string(s, i)
            i = skip(s, i)
            if sub(s, i, i) ~= ':' then decode_error(s, i, "expected ':'") end
            local v, f
            v, i, f = parse_value(s, i + 1, depth + 1)
            if t[k] == nil then keys[#keys + 1] = k end
            t[k] = v
            if f then
                floats = floats or {}
                floats[k] = true
            elseif floats then
                floats[k] = nil
            end
            i = skip(s, i)
            c = sub(s, i, i)
            if c == '}' then return setmetatable(t, {__keys = keys, __json_floats = floats}), i + 1 end
            if c ~= ',' then decode_error(s, i, "expected ',' or '}'") end
            i = skip(s, i + 1)
        end
    elseif c == '[' then
        local t, n, floats = {}, 0, nil
        i = skip(s, i + 1)
        if sub(s, i, i) == ']' then return setmetatable(t, ARRAY_MT), i + 1 end
        while true do
            local v, f
            v, i, f = parse_value(s, i, depth + 1)
            n = n + 1
            t[n] = v
            if f then
                floats = floats or {}
                floats[n] = true
            end
            i = skip(s, i)
            c = sub(s, i, i)
            if c == ']' then
                return setmetatable(t, floats and {__json_array = true, __json_floats = floats} or ARRAY_MT), i + 1
            end
            if c ~= ',' then decode_error(s, i, "expected ',' or ']'") end
            i = i + 1
        end
    elseif c == '"' then
        return parse_string(s, i)
    else
        local a, b = find(s, '^-?%d+', i)
        if a then
            local is_float = false
            local _, e2 = find(s, '^%.%d+', b + 1)
            if e2 then b, is_float = e2, true end
            _, e2 = find(s, '^[eE][-+]?%d+', b + 1)
            if e2 then b, is_float = e2, true end
            local text = sub(s, a, b)
            if text:match('^-?0%d') then decode_error(s, i, 'leading zero in number') end
            local v = tonumber(text)
            -- an int a double cannot hold stays exact (Python's ints have no limit)
            if not is_float and v ~= 0 and format('%.0f', v) ~= text then return M.int(text), b + 1, false end
            return v, b + 1, is_float
        end
        for _, lit in ipairs(LITERALS) do
            if sub(s, i, i + #lit[1] - 1) == lit[1] then
                return lit[2], i + #lit[1], type(lit[2]) == 'number'
            end
        end
        decode_error(s, i, c == '' and 'unexpected end of text' or 'unexpected character ' .. format('%q', c))
    end
end

-- json.loads(text): objects keep their key order (metatable __keys), numbers written as floats
-- are marked (__json_floats), integers beyond a double stay exact (pyjson.int), null is
-- pyjson.null, empty arrays are marked arrays.
function M.decode(text)
    if type(text) ~= 'string' then error('pyjson.decode: expected a string, got ' .. type(text), 2) end
    local v, i = parse_value(text, 1, 0)
    i = skip(text, i)
    if i <= #text then decode_error(text, i, 'extra data after the value') end
    return v
end

return M
