-- lunar.repl: how the REPL shows values (tensors pretty-printed, tables shown one level deep).
local M = {}

local function short(v)
    if type(v) == 'string' then return string.format('%q', v) end
    return tostring(v)
end

local function show_table(t)
    local parts, n = {}, 0
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b)
        if type(a) == type(b) and (type(a) == 'number' or type(a) == 'string') then return a < b end
        return type(a) < type(b)
    end)
    for _, k in ipairs(keys) do
        n = n + 1
        if n > 40 then parts[#parts + 1] = '...' break end
        local v = t[k]
        local vs = type(v) == 'table' and (getmetatable(v) and tostring(v) or '{...}') or short(v)
        if type(k) == 'number' and k == n then parts[#parts + 1] = vs
        else parts[#parts + 1] = (type(k) == 'string' and k:match('^[%a_][%w_]*$') and k or '[' .. short(k) .. ']') .. ' = ' .. vs end
    end
    return '{' .. table.concat(parts, ', ') .. '}'
end

function M.show(...)
    for i = 1, select('#', ...) do
        local v = select(i, ...)
        if type(v) == 'table' and not (getmetatable(v) and getmetatable(v).__tostring) then
            print(show_table(v))
        else
            print(tostring(v))
        end
    end
end

return M
