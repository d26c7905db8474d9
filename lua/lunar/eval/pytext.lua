-- lunar.eval.pytext: the few behaviours of Python's str that the reference answer graders
-- depend on, for UTF-8 text.
--
--   local pytext = require('lunar.eval.pytext')
--   pytext.len(s)              number of characters (code points), as Python's len(str)
--   pytext.tail(s, n)          the last n characters, as Python's s[-n:]
--   pytext.char_end(s, i)      the byte after the character that starts at byte i
--   pytext.space_end(s, i)     the byte after the character at i if it is whitespace (Python's
--                              str.isspace, which is also what re's \s matches), else nil
--   pytext.isdigit(s)          Python's s.isdigit(): non-empty and every character a digit in
--                              Unicode's sense (Numeric_Type Decimal or Digit: '7', '²', '٣')
--   pytext.strip(s)            Python's s.strip(): whitespace removed at both ends
--
-- The graders of lunar.eval.grade reproduce verl's and SkyRL's Python graders, whose clips
-- ("the last 300 characters"), regex classes (\s, ., [^{]) and normalisations (isdigit, strip)
-- count and classify code points, not bytes: a response with "×" or "数" clipped at 300 bytes
-- would keep another window of text. The digit table is Unicode 14.0 (Python 3.11's
-- unicodedata), the version the committed grading fixtures were made with.
--
-- Text is taken to be UTF-8 (decoded model output). A character starts at every byte that is
-- not a continuation byte (0x80-0xBF); a stray continuation byte belongs to the character
-- before it, so invalid input is counted consistently, never rejected.
local M = {}

local byte = string.byte

local function is_cont(b) return b >= 0x80 and b < 0xC0 end

function M.char_end(s, i)
    local n = #s
    local j = i + 1
    while j <= n and is_cont(byte(s, j)) do j = j + 1 end
    return j
end

function M.len(s)
    local count = 0
    for i = 1, #s do
        if not is_cont(byte(s, i)) then count = count + 1 end
    end
    return count
end

function M.tail(s, n)
    local i, seen = #s + 1, 0
    while seen < n and i > 1 do
        i = i - 1
        if not is_cont(byte(s, i)) then seen = seen + 1 end
    end
    -- a stray continuation byte at the very start has no character of its own: keep it with
    -- the first counted one (i is then already at the start)
    return s:sub(i)
end

-- the code point of the character s[i .. j-1] (j = char_end(s, i)); -1 when it is not valid
-- UTF-8, which no table below contains
local function codepoint(s, i, j)
    local b = byte(s, i)
    local len = j - i
    if b < 0x80 then return len == 1 and b or -1 end
    local nbytes = b >= 0xF0 and 4 or b >= 0xE0 and 3 or b >= 0xC0 and 2 or 0
    if nbytes ~= len then return -1 end
    local cp = b % (2 ^ (7 - nbytes))
    for k = i + 1, j - 1 do cp = cp * 64 + byte(s, k) % 64 end
    return cp
end

local SPACE = {}
for _, cp in ipairs{0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x20, 0x85, 0xA0, 0x1680,
                    0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009,
                    0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000} do
    SPACE[cp] = true
end

function M.space_end(s, i)
    if i > #s then return nil end
    local j = M.char_end(s, i)
    if SPACE[codepoint(s, i, j)] then return j end
    return nil
end

-- inclusive ranges of the code points whose str.isdigit() is True
local DIGITS = {
    0x30,0x39, 0xB2,0xB3, 0xB9,0xB9, 0x660,0x669, 0x6F0,0x6F9, 0x7C0,0x7C9, 0x966,0x96F,
    0x9E6,0x9EF, 0xA66,0xA6F, 0xAE6,0xAEF, 0xB66,0xB6F, 0xBE6,0xBEF, 0xC66,0xC6F, 0xCE6,0xCEF,
    0xD66,0xD6F, 0xDE6,0xDEF, 0xE50,0xE59, 0xED0,0xED9, 0xF20,0xF29, 0x1040,0x1049, 0x1090,0x1099,
    0x1369,0x1371, 0x17E0,0x17E9, 0x1810,0x1819, 0x1946,0x194F, 0x19D0,0x19DA, 0x1A80,0x1A89,
    0x1A90,0x1A99, 0x1B50,0x1B59, 0x1BB0,0x1BB9, 0x1C40,0x1C49, 0x1C50,0x1C59, 0x2070,0x2070,
    0x2074,0x2079, 0x2080,0x2089, 0x2460,0x2468, 0x2474,0x247C, 0x2488,0x2490, 0x24EA,0x24EA,
    0x24F5,0x24FD, 0x24FF,0x24FF, 0x2776,0x277E, 0x2780,0x2788, 0x278A,0x2792, 0xA620,0xA629,
    0xA8D0,0xA8D9, 0xA900,0xA909, 0xA9D0,0xA9D9, 0xA9F0,0xA9F9, 0xAA50,0xAA59, 0xABF0,0xABF9,
    0xFF10,0xFF19, 0x104A0,0x104A9, 0x10A40,0x10A43, 0x10D30,0x10D39, 0x10E60,0x10E68,
    0x11052,0x1105A, 0x11066,0x1106F, 0x110F0,0x110F9, 0x11136,0x1113F, 0x111D0,0x111D9,
    0x112F0,0x112F9, 0x11450,0x11459, 0x114D0,0x114D9, 0x11650,0x11659, 0x116C0,0x116C9,
    0x11730,0x11739, 0x118E0,0x118E9, 0x11950,0x11959, 0x11C50,0x11C59, 0x11D50,0x11D59,
    0x11DA0,0x11DA9, 0x16A60,0x16A69, 0x16AC0,0x16AC9, 0x16B50,0x16B59, 0x1D7CE,0x1D7FF,
    0x1E140,0x1E149, 0x1E2F0,0x1E2F9, 0x1E950,0x1E959, 0x1F100,0x1F10A, 0x1FBF0,0x1FBF9,
}

local function is_digit_cp(cp)
    for k = 1, #DIGITS, 2 do
        if cp < DIGITS[k] then return false end
        if cp <= DIGITS[k + 1] then return true end
    end
    return false
end

function M.isdigit(s)
    if s == '' then return false end
    if not s:find('[^0-9]') then return true end   -- the common case, ASCII digits only
    local i = 1
    while i <= #s do
        local j = M.char_end(s, i)
        if not is_digit_cp(codepoint(s, i, j)) then return false end
        i = j
    end
    return true
end

function M.strip(s)
    local i = 1
    while true do
        local j = M.space_end(s, i)
        if not j then break end
        i = j
    end
    if i > #s then return '' end
    -- from the end: step back one character at a time
    local e = #s
    while e >= i do
        local start = e
        while start > i and is_cont(byte(s, start)) do start = start - 1 end
        if M.space_end(s, start) ~= e + 1 then break end
        e = start - 1
    end
    return s:sub(i, e)
end

return M
