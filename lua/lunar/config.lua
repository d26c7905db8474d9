-- lunar.config: dotted command-line overrides (`lunar script.lua train.steps=10 model.path=x`)
-- and merging them into a recipe's table with unknown keys rejected.
local core = require 'lunar.core'

local M = {}

-- "10" -> 10, "true" -> true, "nil" -> nil marker, "[1,2]" / "{1,2}" -> {1, 2}, else the string
local function parse_value(s)
    if s == 'true' then return true end
    if s == 'false' then return false end
    local n = tonumber(s)
    if n then return n end
    local inner = s:match('^%[(.*)%]$') or s:match('^{(.*)}$')
    if inner then
        local list = {}
        for item in inner:gmatch('[^,]+') do list[#list + 1] = parse_value(item:match('^%s*(.-)%s*$')) end
        return list
    end
    return s
end
M.parse_value = parse_value

-- true if s is dotted.key=value, each key part a letter or _ then letters, digits or _ (the
-- rule lunar's command line uses to tell overrides from other arguments: host/lua/vm.c)
function M.is_override(s)
    return type(s) == 'string' and core.is_override(s)
end

-- Parse a list of "a.b.c=value" strings into a nested table.
function M.parse(list)
    local out = {}
    for _, item in ipairs(list) do
        local key, value = item:match('^([%w_%.%-]+)=(.*)$')
        if not key then error(('override %q is not key=value'):format(item), 2) end
        local node = out
        if not core.is_override(item) then
            error(('override %q: key %q is not a dotted name (each part a letter or _ then letters, '
                .. 'digits or _)'):format(item, key), 2)
        end
        local parts = {}
        for p in key:gmatch('[^%.]+') do parts[#parts + 1] = p end
        for i = 1, #parts - 1 do
            local k = parts[i]
            if node[k] == nil then node[k] = {} end
            if type(node[k]) ~= 'table' then
                error(('override %q: %s is already a value'):format(item, table.concat(parts, '.', 1, i)), 2)
            end
            node = node[k]
        end
        node[parts[#parts]] = parse_value(value)
    end
    return out
end

-- The overrides given on the command line, nested.
function M.overrides()
    return M.parse(core.overrides())
end

-- Merge overrides into defaults (a copy is returned). A key that defaults does not have is an
-- error naming the full dotted key, unless defaults marks the table open with `__open = true`.
-- A default of `false` means "unset, any type" (e.g. an optional table); other defaults fix the
-- type of their key (a string's may also be a function, in a Lua table), and overriding any key
-- with false unsets it.
function M.merge(defaults, overrides, prefix)
    local out = {}
    for k, v in pairs(defaults) do
        if type(v) == 'table' and k ~= '__open' then out[k] = M.merge(v, {}, nil) else out[k] = v end
    end
    for k, v in pairs(overrides or {}) do
        local name = prefix and (prefix .. '.' .. k) or tostring(k)
        local cur = defaults[k]
        if cur == nil and not defaults.__open then
            local known = {}
            for kk in pairs(defaults) do if kk ~= '__open' then known[#known + 1] = tostring(kk) end end
            table.sort(known)
            error(('unknown config key %q (known here: %s)'):format(name, table.concat(known, ', ')), 2)
        end
        if type(cur) == 'table' and type(v) == 'table' and #cur == 0 then
            out[k] = M.merge(cur, v, name)
        else
            -- (a function may stand for a string setting that names one: a recipe's own reward)
            if cur ~= nil and cur ~= false and v ~= false and type(cur) ~= type(v)
                and not (type(cur) == 'string' and type(v) == 'function') then
                error(('config key %q expects a %s, got %s %q'):format(name, type(cur), type(v), tostring(v)), 2)
            end
            out[k] = v
        end
    end
    return out
end

-- msg without the "file:line: " prefixes that say where in lunar an error was raised (a user
-- error names the setting instead)
function M.strip_where(msg)
    msg = tostring(msg)
    while true do
        local rest = msg:match('^[^%s]-:%d+: (.*)$')
        if not rest then return msg end
        msg = rest
    end
end

-- setting_error(context, fn, ...) -> fn(...); an error becomes a user error (one line, no
-- traceback: core.user_error) that starts with context, the setting it comes from
-- ("model.path=/ckpt"). Under lunar --traceback or --repl-on-error it passes unchanged, with
-- its stack.
function M.setting_error(context, fn, ...)
    if core.errors_debugged() then return fn(...) end
    local res = {pcall(fn, ...)}
    if not res[1] then core.user_error(context .. ': ' .. M.strip_where(res[2])) end
    return unpack(res, 2, table.maxn(res))
end

return M
