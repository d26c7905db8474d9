-- lunar.print: tensors printed like torch7: values in columns, then a line with the dtype,
-- size and device. Large tensors show the first and last 3 entries of each dim.
local M = {}

local EDGE = 3          -- entries kept at each end of a summarised dim
local FULL_LIMIT = 1000 -- print every element up to this many

-- integer dtypes always print as integers, whatever their magnitude (token ids, offsets)
local INT_DTYPES = {i8 = true, i32 = true, i64 = true, u8 = true, bool = true}

local function fmt_for(values, int_dtype)
    if int_dtype then return '%.0f', true end
    local all_int, maxabs, minabs = true, 0, math.huge
    for _, v in ipairs(values) do
        if v ~= v or v == math.huge or v == -math.huge then
            -- handled per value
        else
            if v ~= math.floor(v) then all_int = false end
            local a = math.abs(v)
            if a > maxabs then maxabs = a end
            if a > 0 and a < minabs then minabs = a end
        end
    end
    if all_int and maxabs < 1e15 then return '%d', true end   -- exact, and -0 prints as 0
    if maxabs >= 1e5 or (minabs < 1e-4 and minabs ~= math.huge) then return '%.4e', false end
    return '%.4f', false
end

local function fmt_value(v, fmt, is_int)
    if v ~= v then return 'nan' end
    if v == math.huge then return 'inf' end
    if v == -math.huge then return '-inf' end
    return string.format(fmt, v)
end

-- indices to show along a dim of size n (0 in the list marks the "..." gap)
local function picks(n, summarise)
    local out = {}
    if not summarise or n <= 2 * EDGE then
        for i = 1, n do out[#out + 1] = i end
    else
        for i = 1, EDGE do out[#out + 1] = i end
        out[#out + 1] = 0
        for i = n - EDGE + 1, n do out[#out + 1] = i end
    end
    return out
end

-- the one-line summary that ends a printed tensor: dtype, size, device and name
function M.summary(t)
    local shape = t:size()
    local desc = #shape == 0 and 'scalar' or table.concat(shape, 'x')
    return ('[lunar.%s tensor of size %s%s%s]'):format(t:dtype(), desc,
        t:device() ~= 'cpu' and (' on ' .. t:device()) or '', t:name() and (' "' .. t:name() .. '"') or '')
end

function M.tostring(t)
    local ok, why = t:is_valid()
    local shape = t:size()
    local footer = M.summary(t)
    if not ok then return ('[invalid tensor: %s]\n%s'):format(why, footer) end
    if t:numel() == 0 then return '[empty tensor]\n' .. footer end
    local host = t:device() == 'cpu' and t or t:to('cpu')
    local summarise = t:numel() > FULL_LIMIT
    -- gather the shown values to choose one format for all of them
    local values = {}
    local function collect(prefix, d)
        if d > #shape then values[#values + 1] = host:get(unpack(prefix)) return end
        for _, i in ipairs(picks(shape[d], summarise)) do
            if i > 0 then prefix[d] = i; collect(prefix, d + 1) end
        end
        prefix[d] = nil
    end
    if #shape == 0 then values[1] = host:item() else collect({}, 1) end
    for i, v in ipairs(values) do if type(v) == 'boolean' then values[i] = v and 1 or 0 end end
    local fmt, is_int = fmt_for(values, INT_DTYPES[t:dtype()])
    local width = 0
    for _, v in ipairs(values) do width = math.max(width, #fmt_value(v, fmt, is_int)) end
    local function cell(v)
        if type(v) == 'boolean' then v = v and 1 or 0 end
        local s = fmt_value(v, fmt, is_int)
        return string.rep(' ', width - #s) .. s
    end
    local lines = {}
    if #shape == 0 then
        lines[1] = cell(host:item())
    elseif #shape == 1 then
        for _, i in ipairs(picks(shape[1], summarise)) do
            lines[#lines + 1] = i > 0 and cell(host:get(i)) or string.rep(' ', width - 3) .. '...'
        end
    else
        local nd = #shape
        local function matrix(prefix)
            local out = {}
            for _, r in ipairs(picks(shape[nd - 1], summarise)) do
                if r == 0 then
                    out[#out + 1] = ' ...'
                else
                    local row = {}
                    for _, c in ipairs(picks(shape[nd], summarise)) do
                        if c == 0 then row[#row + 1] = '...'
                        else
                            local idx = {unpack(prefix)}
                            idx[#idx + 1] = r
                            idx[#idx + 1] = c
                            row[#row + 1] = cell(host:get(unpack(idx)))
                        end
                    end
                    out[#out + 1] = table.concat(row, ' ')
                end
            end
            return out
        end
        local function slices(prefix, d)
            if d == nd - 1 then
                if #prefix > 0 then
                    lines[#lines + 1] = '(' .. table.concat(prefix, ',') .. ',.,.) = '
                end
                for _, l in ipairs(matrix(prefix)) do lines[#lines + 1] = ' ' .. l end
                if #prefix > 0 then lines[#lines + 1] = '' end
                return
            end
            for _, i in ipairs(picks(shape[d], summarise)) do
                if i == 0 then lines[#lines + 1] = '...' lines[#lines + 1] = ''
                else
                    prefix[#prefix + 1] = i
                    slices(prefix, d + 1)
                    prefix[#prefix] = nil
                end
            end
        end
        slices({}, 1)
        if lines[#lines] == '' then lines[#lines] = nil end
    end
    lines[#lines + 1] = footer
    return table.concat(lines, '\n')
end

return M
