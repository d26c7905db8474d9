-- lunar.eval.grade: final-answer extraction and scoring of model responses, per dataset,
-- reproducing the reward functions that RL runs and papers report with (verl 0.9.1 and
-- skyrl-gym 0.4.0), quirks included, so that lunar's accuracies and rewards compare with theirs.
--
--   local grade = require('lunar.eval.grade')
--   local g = grade.grader_for('MATH-500')                -- 'verl_math'
--   local user = grade.prompt(g, row.question)            -- the instruction the grader expects
--   local r = grade.score(g, response_text, '\\frac{1}{16}')
--   -- r.score    the reference's reward: 1 / 0 (GSM8K, MATH), +1 / -1 (DAPO, AIME)
--   -- r.correct  true / false (what avg@k and pass@k count)
--   -- r.pred     the extracted answer the reference compared (nil when it found none)
--   local gold = grade.gsm8k_gold(row.answer)             -- '72' from "... #### 72"
--
-- Graders (grade.GRADERS; docs/generation.md, "Evaluation and grading", has the details):
--   verl_gsm8k           verl gsm8k.py, strict: the last "#### <number>" in the last 300
--                        characters, commas and '$' removed, string-equal to the gold; 1 / 0
--   verl_gsm8k_flexible  the same file, flexible: the last number-like run ([-]digits . ,) in the
--                        last 300 characters, kept as written ("18." and "1,000" stay so); 1 / 0
--   skyrl_gsm8k          skyrl-gym's gsm8k: the first "#### <number>" anywhere; 1 / 0
--   verl_math            verl math_reward.py (the Hendrycks MATH rule): the last \boxed{...} (or
--                        "\boxed x$") in the whole response, nested braces matched; both sides
--                        normalised (\dfrac, \left, units "\text{ ...}", \%, "k =", spaces,
--                        \frac12, a/b, 0.5 -> \frac{1}{2}) and compared as strings; 1 / 0
--   verl_math_dapo       verl math_dapo.py (Minerva): in the last 300 characters, the last
--                        "Answer: ..." line (case-insensitive), normalised (text after the last
--                        '=', units, \text{}, \boxed{}, '$', thousands commas) and string-equal
--                        to the normalised gold; with no Answer line, the last \boxed{} in the
--                        last 100 characters compared raw with the raw gold; +1 / -1
--   skyrl_aime           skyrl-gym's copy of it: the answer stops at '<' too, no \boxed
--                        fallback; +1 / -1
--   aime                 lunar's own: verl_math_dapo, except that an integer answer and an
--                        integer gold compare by value ("33" = "033", AIME golds are padded);
--                        +1 / -1
--
-- Datasets (grade.grader_for): gsm8k, openai/gsm8k -> verl_gsm8k; MATH-500,
-- HuggingFaceH4/MATH-500 -> verl_math; AIME-2024-30, AIME-2025-30, aime24, aime25 -> aime;
-- DAPO-17k, math_dapo -> verl_math_dapo; arith (the tiny RL task) -> skyrl_gsm8k. The response is the decoded completion without special
-- tokens, as verl decodes it. Characters are code points (lunar.eval.pytext), as in Python.
local pytext = require('lunar.eval.pytext')

local M = {}

M.GRADERS = {'verl_gsm8k', 'verl_gsm8k_flexible', 'skyrl_gsm8k', 'verl_math', 'verl_math_dapo',
             'skyrl_aime', 'aime'}

local DATASETS = {
    ['gsm8k'] = 'verl_gsm8k', ['openai/gsm8k'] = 'verl_gsm8k',
    ['MATH-500'] = 'verl_math', ['HuggingFaceH4/MATH-500'] = 'verl_math',
    ['AIME-2024-30'] = 'aime', ['AIME-2025-30'] = 'aime', ['aime24'] = 'aime', ['aime25'] = 'aime',
    ['DAPO-17k'] = 'verl_math_dapo', ['math_dapo'] = 'verl_math_dapo',
    ['arith'] = 'skyrl_gsm8k',
}

-- ---- plain-text helpers (Python's str.replace / split / rfind) -------------------------------

local function replace_all(s, old, new)
    local a, b = s:find(old, 1, true)
    if not a then return s end
    local out, pos = {}, 1
    while a do
        out[#out + 1] = s:sub(pos, a - 1)
        out[#out + 1] = new
        pos = b + 1
        a, b = s:find(old, pos, true)
    end
    out[#out + 1] = s:sub(pos)
    return table.concat(out)
end

local function split(s, sep)
    local parts, pos = {}, 1
    while true do
        local a, b = s:find(sep, pos, true)
        if not a then break end
        parts[#parts + 1] = s:sub(pos, a - 1)
        pos = b + 1
    end
    parts[#parts + 1] = s:sub(pos)
    return parts
end

local function find_last(s, needle)
    local last
    local a = s:find(needle, 1, true)
    while a do
        last = a
        a = s:find(needle, a + 1, true)
    end
    return last
end

-- the text from s[idx] to the '}' that closes the first '{' at or after idx (nil if none)
local function brace_span(s, idx)
    local depth = 0
    for i = idx, #s do
        local c = s:byte(i)
        if c == 123 then
            depth = depth + 1
        elseif c == 125 then
            depth = depth - 1
            if depth == 0 then return s:sub(idx, i) end
        end
    end
    return nil
end

-- the character starting at byte i and the byte after it
local function char_at(s, i)
    local j = pytext.char_end(s, i)
    return s:sub(i, j - 1), j
end

-- ---- GSM8K ------------------------------------------------------------------------------

local CLIP = 300   -- verl reads only the last 300 characters of a response

local function gsm8k_strict(text)
    local last
    for m in pytext.tail(text, CLIP):gmatch('#### (%-?[0-9%.,]+)') do last = m end
    return last and (last:gsub('[,$]', ''))
end

local function gsm8k_flexible(text)
    local found = {}
    for m in pytext.tail(text, CLIP):gmatch('%-?[0-9%.,]+') do found[#found + 1] = m end
    if #found == 0 then return nil end
    for k = #found, 1, -1 do
        if found[k] ~= '.' then return found[k] end
    end
    return found[1]   -- every run was '.': the reference's loop ends on the first one
end

local function skyrl_gsm8k_first(text)
    local m = text:match('#### (%-?[0-9%.,]+)')
    return m and (m:gsub('[,$]', ''))
end

local function binary(pred, gold)
    local correct = pred ~= nil and pred == gold
    return {score = correct and 1 or 0, correct = correct, pred = pred}
end

-- ---- MATH (Hendrycks rule, verl math_reward.py) --------------------------------------------

local function math_last_boxed(s)
    -- "\boxed 5$" anywhere wins over braces: the text after the last "\boxed " up to a '$'
    local sp = find_last(s, '\\boxed ')
    if sp then return '\\boxed ' .. s:sub(sp + 7):match('^[^$]*') end
    local idx = find_last(s, '\\boxed') or find_last(s, '\\fbox')
    return idx and brace_span(s, idx)
end

-- nil where the reference's assertion fails (\fbox{...}, "\boxedx{...}"): the response scores 0
local function math_remove_boxed(s)
    if s:find('\\boxed ', 1, true) then
        if s:sub(1, 7) ~= '\\boxed ' then return nil end
        return s:sub(8)
    end
    if s:sub(1, 7) ~= '\\boxed{' or s:sub(-1) ~= '}' then return nil end
    return s:sub(8, -2)
end

-- Each fix returns nil where the reference raises (an index past the end of the text); the
-- comparison then falls back to the raw strings, as is_equiv does.
local function fix_sqrt(s)
    if not s:find('\\sqrt', 1, true) then return s end
    local parts = split(s, '\\sqrt')
    local out = {parts[1]}
    for k = 2, #parts do
        local p = parts[k]
        if p == '' then return nil end
        if p:sub(1, 1) ~= '{' then
            local a, j = char_at(p, 1)
            out[#out + 1] = '\\sqrt{' .. a .. '}' .. p:sub(j)
        else
            out[#out + 1] = '\\sqrt' .. p
        end
    end
    return table.concat(out)
end

local function fix_fracs(s)
    local parts = split(s, '\\frac')
    local out = {parts[1]}
    for k = 2, #parts do
        local p = parts[k]
        out[#out + 1] = '\\frac'
        if p == '' then return nil end
        if p:sub(1, 1) == '{' then
            out[#out + 1] = p
        else
            if pytext.len(p) < 2 then return s end
            local a, j1 = char_at(p, 1)
            local b, j2 = char_at(p, j1)
            if b ~= '{' then
                out[#out + 1] = '{' .. a .. '}{' .. b .. '}' .. p:sub(j2)
            else
                out[#out + 1] = '{' .. a .. '}' .. b .. p:sub(j2)
            end
        end
    end
    return table.concat(out)
end

-- "a/b" with a and b written exactly as Python prints an int (no '+', no leading zeros, no
-- "-0", at most 4300 digits: CPython's int() refuses longer strings by default)
local function canonical_int(x)
    local digits = x:match('^%-?([0-9]+)$')
    if not digits or #digits > 4300 then return false end
    if digits:sub(1, 1) == '0' then return x == '0' end
    return true
end

local function fix_a_slash_b(s)
    local parts = split(s, '/')
    if #parts ~= 2 or not canonical_int(parts[1]) or not canonical_int(parts[2]) then return s end
    return '\\frac{' .. parts[1] .. '}{' .. parts[2] .. '}'
end

local function hendrycks_strip(s)
    s = replace_all(s, '\n', '')
    s = replace_all(s, '\\!', '')
    s = replace_all(s, '\\\\', '\\')
    s = replace_all(s, 'tfrac', 'frac')
    s = replace_all(s, 'dfrac', 'frac')
    s = replace_all(s, '\\left', '')
    s = replace_all(s, '\\right', '')
    s = replace_all(s, '^{\\circ}', '')
    s = replace_all(s, '^\\circ', '')
    s = replace_all(s, '\\$', '')
    if s:find('\\text{ ', 1, true) then   -- units on the right; twice is the reference's error
        local parts = split(s, '\\text{ ')
        if #parts ~= 2 then return nil end
        s = parts[1]
    end
    s = replace_all(s, '\\\\%', '')
    s = replace_all(s, '\\%', '')
    s = replace_all(s, ' .', ' 0.')
    s = replace_all(s, '{.', '{0.')
    if s == '' then return s end
    if s:sub(1, 1) == '.' then s = '0' .. s end
    local eq = split(s, '=')
    if #eq == 2 and pytext.len(eq[1]) <= 2 then s = eq[2] end   -- "k = 2" -> "2"
    s = fix_sqrt(s)
    if not s then return nil end
    s = replace_all(s, ' ', '')
    s = fix_fracs(s)
    if not s then return nil end
    if s == '0.5' then s = '\\frac{1}{2}' end
    return fix_a_slash_b(s)
end

local function verl_math(response, gold)
    local box = math_last_boxed(response)
    local pred = box and math_remove_boxed(box)
    local correct = false
    if pred then
        local a, b = hendrycks_strip(pred), hendrycks_strip(gold)
        if a and b then correct = a == b else correct = pred == gold end
    end
    return {score = correct and 1 or 0, correct = correct, pred = pred}
end

-- ---- DAPO / AIME (Minerva rule, verl math_dapo.py) ------------------------------------------

local SUBSTITUTIONS = {
    {'an ', ''}, {'a ', ''}, {'.$', '$'}, {'\\$', ''}, {'\\ ', ''}, {' ', ''}, {'mbox', 'text'},
    {',\\text{and}', ','}, {'\\text{and}', ','}, {'\\text{m}', '\\text{}'},
}
local REMOVED = {
    'square', 'ways', 'integers', 'dollars', 'mph', 'inches', 'hours', 'km', 'units', '\\ldots',
    'sue', 'points', 'feet', 'minutes', 'digits', 'cents', 'degrees', 'cm', 'gm', 'pounds',
    'meters', 'meals', 'edges', 'students', 'childrentickets', 'multiples', '\\text{s}',
    '\\text{.}', '\\text{\ns}', '\\text{}^2', '\\text{}^3', '\\text{\n}', '\\text{}',
    '\\mathrm{th}', '^\\circ', '^{\\circ}', '\\;', ',\\!', '{,}', '"', '\\dots',
}

-- The reference's regexes use '.', which stops at a newline, so they act line by line.
local function map_lines(s, fn)
    if not s:find('\n', 1, true) then return fn(s) end
    local out = {}
    for line in (s .. '\n'):gmatch('([^\n]*)\n') do out[#out + 1] = fn(line) end
    return table.concat(out, '\n')
end

-- a line with two '$' becomes the first math span: "x is $5$ or $6$" -> "$5$"
local function first_math_span(line)
    local a = line:find('$', 1, true)
    local b = a and line:find('$', a + 1, true)
    if not b then return line end
    return '$' .. line:sub(a + 1, b - 1) .. '$'
end

-- "\text{x}" -> "x", up to the first '}' (so "\text{a{b}c}" -> "a{bc}")
local function unwrap_lazy(prefix)
    return function(line)
        local out, pos = {}, 1
        while true do
            local a, b = line:find(prefix, pos, true)
            if not a then break end
            local close = line:find('}', b + 1, true)
            if not close then break end
            out[#out + 1] = line:sub(pos, a - 1)
            out[#out + 1] = line:sub(b + 1, close - 1)
            pos = close + 1
        end
        out[#out + 1] = line:sub(pos)
        return table.concat(out)
    end
end

-- "\boxed{x}" -> "x", from the first "\boxed{" to the last '}' of the line
local function unwrap_boxed(line)
    local a, b = line:find('\\boxed{', 1, true)
    if not a then return line end
    local close = find_last(line:sub(b + 1), '}')
    if not close then return line end
    close = close + b
    return line:sub(1, a - 1) .. line:sub(b + 1, close - 1) .. line:sub(close + 1)
end

-- "frac" + a character other than '{' + a character other than a newline -> "frac{a}{b}"
local function frac_shorthand(s)
    local out, pos, from = {}, 1, 1
    while true do
        local a, b = s:find('frac', from, true)
        if not a then break end
        from = a + 1
        if b < #s and s:sub(b + 1, b + 1) ~= '{' then
            local c1, j1 = char_at(s, b + 1)
            if j1 <= #s and s:sub(j1, j1) ~= '\n' then
                local c2, j2 = char_at(s, j1)
                out[#out + 1] = s:sub(pos, a - 1)
                out[#out + 1] = 'frac{' .. c1 .. '}{' .. c2 .. '}'
                pos, from = j2, j2
            end
        end
    end
    out[#out + 1] = s:sub(pos)
    return table.concat(out)
end

-- "sqrt" + a character other than '{' -> "sqrt{a}"
local function sqrt_shorthand(s)
    local out, pos, from = {}, 1, 1
    while true do
        local a, b = s:find('sqrt', from, true)
        if not a then break end
        from = a + 1
        if b < #s and s:sub(b + 1, b + 1) ~= '{' then
            local c1, j1 = char_at(s, b + 1)
            out[#out + 1] = s:sub(pos, a - 1)
            out[#out + 1] = 'sqrt{' .. c1 .. '}'
            pos, from = j1, j1
        end
    end
    out[#out + 1] = s:sub(pos)
    return table.concat(out)
end

local function minerva_normalize(s)
    s = s:match('^.*=(.*)$') or s
    for _, sub in ipairs(SUBSTITUTIONS) do s = replace_all(s, sub[1], sub[2]) end
    for _, expr in ipairs(REMOVED) do s = replace_all(s, expr, '') end
    s = map_lines(s, first_math_span)
    s = map_lines(s, unwrap_lazy('\\text{'))
    s = map_lines(s, unwrap_lazy('\\textbf{'))
    s = map_lines(s, unwrap_lazy('\\overline{'))
    s = map_lines(s, unwrap_boxed)
    s = frac_shorthand(s)
    s = sqrt_shorthand(s)
    s = replace_all(s, '$', '')
    local bare = replace_all(s, ',', '')
    if pytext.isdigit(bare) then s = bare end
    return pytext.strip(s)
end

-- "answer" in any case; Python's case-insensitive match also takes U+017F (long s) for 's'
local ANSWER = 'answer'
local function answer_word_end(s, i)
    local p = i
    for k = 1, #ANSWER do
        local want = ANSWER:sub(k, k)
        if s:sub(p, p):lower() == want then
            p = p + 1
        elseif want == 's' and s:sub(p, p + 1) == '\197\191' then
            p = p + 2
        else
            return nil
        end
    end
    return p
end

-- Answer\s*:\s*([^STOP]+) at byte i: the captured text and the byte after the match, or nil.
-- The second \s* gives characters back until the capture can start (as a regex backtracks):
-- "Answer:  " at the end captures " ".
local function answer_at(s, i, stop)
    local p = answer_word_end(s, i)
    if not p then return nil end
    while pytext.space_end(s, p) do p = pytext.space_end(s, p) end
    if s:sub(p, p) ~= ':' then return nil end
    local starts = {p + 1}
    while true do
        local q = pytext.space_end(s, starts[#starts])
        if not q then break end
        starts[#starts + 1] = q
    end
    for k = #starts, 1, -1 do
        local q = starts[k]
        if q <= #s and not s:sub(q, q):find(stop) then
            local e = s:find(stop, q) or #s + 1
            return s:sub(q, e - 1), e
        end
    end
    return nil
end

local function last_answer_line(s, stop)
    local last
    local pos = 1
    while true do
        local a = s:find('[Aa]', pos)
        if not a then break end
        local text, e = answer_at(s, a, stop)
        if text then
            last, pos = text, e
        else
            pos = a + 1
        end
    end
    return last
end

local function minerva(response, gold, stop, boxed_fallback)
    local s = pytext.tail(response, CLIP)
    local pred = minerva_normalize(last_answer_line(s, stop) or '[INVALID]')
    local correct = pred == minerva_normalize(gold)
    if boxed_fallback and pred == '[INVALID]' then
        local tail = pytext.tail(s, 100)
        local idx = find_last(tail, '\\boxed{')
        local box = idx and brace_span(tail, idx)
        if box then
            pred = box:sub(8, -2)
            correct = pred == gold
        end
    end
    return {score = correct and 1 or -1, correct = correct, pred = pred}
end

local function int_value(x)   -- the canonical decimal text of an integer string
    local sign, digits = x:match('^(%-?)([0-9]+)$')
    digits = digits:gsub('^0+', '')
    if digits == '' then return '0' end
    return sign .. digits
end

local function aime(response, gold)
    local r = minerva(response, gold, '\n', true)
    local gold_n = minerva_normalize(gold)
    if r.pred:match('^%-?[0-9]+$') and gold_n:match('^%-?[0-9]+$') then
        r.correct = int_value(r.pred) == int_value(gold_n)
        r.score = r.correct and 1 or -1
    end
    return r
end

-- ---- the table of graders ------------------------------------------------------------------

local GRADE = {
    verl_gsm8k = function(response, gold) return binary(gsm8k_strict(response), gold) end,
    verl_gsm8k_flexible = function(response, gold) return binary(gsm8k_flexible(response), gold) end,
    skyrl_gsm8k = function(response, gold) return binary(skyrl_gsm8k_first(response), gold) end,
    verl_math = verl_math,
    verl_math_dapo = function(response, gold) return minerva(response, gold, '\n', true) end,
    skyrl_aime = function(response, gold) return minerva(response, gold, '[\n<]', false) end,
    aime = aime,
}

local function check_grader(fn, grader)
    if GRADE[grader] then return end
    error(('grade.%s: unknown grader %s (graders: %s)'):format(fn, tostring(grader),
        table.concat(M.GRADERS, ', ')), 3)
end

function M.score(grader, response, gold)
    check_grader('score', grader)
    if type(response) ~= 'string' then
        error(('grade.score: response must be a string, got %s'):format(type(response)), 2)
    end
    if type(gold) ~= 'string' then
        error(('grade.score: gold answer must be a string, got %s %s (write it as text, e.g. "%s")'):format(
            type(gold), tostring(gold), tostring(gold)), 2)
    end
    return GRADE[grader](response, gold)
end

function M.grader_for(dataset)
    local g = DATASETS[dataset]
    if g then return g end
    local known = {}
    for name in pairs(DATASETS) do known[#known + 1] = name end
    table.sort(known)
    error(('grade.grader_for: no grader for dataset %s (datasets: %s; or name a grader: %s)'):format(
        tostring(dataset), table.concat(known, ', '), table.concat(M.GRADERS, ', ')), 2)
end

-- The instruction each grader's reference data preparation appends to the problem (verl's
-- examples/data_preprocess gsm8k.py and math_dataset.py; the DAPO-Math-17k prompt).
local GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
local MATH_INSTRUCTION = 'Let\'s think step by step and output the final answer within \\boxed{}.'
local DAPO_HEAD = 'Solve the following math problem step by step. The last line of your response should be '
    .. 'of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n'
local DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'

function M.prompt(grader, question)
    check_grader('prompt', grader)
    if type(question) ~= 'string' then
        error(('grade.prompt: question must be a string, got %s'):format(type(question)), 2)
    end
    if grader:find('gsm8k', 1, true) then return question .. ' ' .. GSM8K_INSTRUCTION end
    if grader == 'verl_math' then return question .. ' ' .. MATH_INSTRUCTION end
    return DAPO_HEAD .. question .. DAPO_TAIL
end

-- The gold answer of a GSM8K row: the first "#### <number>" of its answer text, commas removed
-- (verl's data preparation; every row of the dataset has one).
function M.gsm8k_gold(answer)
    if type(answer) ~= 'string' then
        error(('grade.gsm8k_gold: answer must be a string, got %s'):format(type(answer)), 2)
    end
    local m = answer:match('#### (%-?[0-9%.,]+)')
    if not m then
        error(('grade.gsm8k_gold: no "#### <number>" in the answer %q'):format(answer:sub(1, 80)), 2)
    end
    return (m:gsub(',', ''))
end

return M
