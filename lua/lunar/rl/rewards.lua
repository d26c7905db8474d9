-- lunar.rl.rewards: the reward functions of RL runs, each named after the reference it
-- reproduces (quirks included) so that rewards and accuracies compare with runs made with it.
-- The graders themselves live in lunar.eval.grade; this module gives them their RL names, checks
-- a recipe's own reward function, and reads the gold answer and question of a data row.
--
--   local rewards = require 'lunar.rl.rewards'
--   local reward = rewards.get('dapo')                          -- or rewards.get(function ... end)
--   local user = rewards.prompt('dapo', rewards.question('dapo', row))
--   local r = reward(completion, rewards.gold('dapo', row), {prompt = 3, sample = 2})
--   -- r.score    the reward (1 / 0 for the GSM8K and MATH rules, +1 / -1 for the DAPO rules)
--   -- r.correct  the verdict (what accuracy counts)
--   -- r.pred     the answer the rule extracted (nil when it found none or a recipe gave none)
--
-- Names (rewards.NAMES; docs/rl.md, "Rewards"):
--   gsm8k                SkyRL's GSM8K environment (skyrl-gym 0.4.0): the first "#### N" anywhere
--   gsm8k_verl           verl's gsm8k.py, strict: the last "#### N" in the last 300 characters
--   gsm8k_verl_flexible  verl's gsm8k.py, flexible: the last number in the last 300 characters
--   dapo                 verl's math_dapo.py (0.9.1): the last "Answer:" line in the last 300
--                        characters, normalised; else the last \boxed{} in the last 100,
--                        compared raw; +1 / -1
--   dapo_skyrl           SkyRL's copy of math_dapo.py: the answer stops at '<' too, no \boxed{}
--                        fallback; +1 / -1
--   math                 verl's math_reward.py (MATH-500): the last \boxed{}, Hendrycks rule
--   dapo_int             lunar's own lenient rule: dapo, except that an integer answer and an
--                        integer gold compare by value ("7" = "007"); +1 / -1
--
-- A recipe's own function: rewards.get(function(response, gold, info) ... end, {name = ...})
-- returns a number or {score = number, correct = boolean?, pred = string?}; correct defaults to
-- score > 0. A function that raises or returns anything else fails the step with one line that
-- names the reward, the sample and the start of the response, or, with opts.on_error = 'skip',
-- makes the call return nil and that line so that the caller counts the sample as skipped.
local grade = require 'lunar.eval.grade'
local pytext = require 'lunar.eval.pytext'
local pyjson = require 'lunar.pyjson'

local M = {}

M.NAMES = {'gsm8k', 'gsm8k_verl', 'gsm8k_verl_flexible', 'dapo', 'dapo_skyrl', 'math', 'dapo_int'}

-- RL name -> the lunar.eval.grade grader that reproduces its reference
M.GRADER = {
    gsm8k = 'skyrl_gsm8k',
    gsm8k_verl = 'verl_gsm8k',
    gsm8k_verl_flexible = 'verl_gsm8k_flexible',
    dapo = 'verl_math_dapo',
    dapo_skyrl = 'skyrl_aime',
    math = 'verl_math',
    dapo_int = 'aime',
}

local USER_LABEL = "recipe's rl.reward"
local RESULT_FORM = 'a number or a table {score = number, correct = boolean?, pred = string?}'

local function check_name(fn, name)
    if M.GRADER[name] then return end
    local hint = ''
    for rl_name, grader in pairs(M.GRADER) do
        if grader == name then hint = (' (the evaluation grader %s is the reward %s)'):format(name, rl_name) end
    end
    error(('rewards.%s: unknown reward %s%s; rewards: %s'):format(fn, tostring(name), hint,
        table.concat(M.NAMES, ', ')), 3)
end

-- text quoted on one line: its first n characters (code points), then '...' if there are more
local ESCAPES = {['\\'] = '\\\\', ['"'] = '\\"', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t'}
local function quote(text, n)
    local head = text
    if pytext.len(text) > n then
        local stop = 1
        for _ = 1, n do stop = pytext.char_end(text, stop) end
        head = text:sub(1, stop - 1) .. '...'
    end
    return '"' .. head:gsub('[\\"\n\r\t]', ESCAPES) .. '"'
end

local function preview(response)
    if type(response) ~= 'string' then return ('(a %s, not text)'):format(type(response)) end
    return quote(response, 80)
end

local function where(info)
    if type(info) ~= 'table' then return '' end
    local parts = {}
    if info.prompt ~= nil then parts[#parts + 1] = 'prompt ' .. tostring(info.prompt) end
    if info.sample ~= nil then parts[#parts + 1] = 'sample ' .. tostring(info.sample) end
    if #parts == 0 then return '' end
    return ' on ' .. table.concat(parts, ' ')
end

-- a value as a message shows it: strings quoted, the rest by tostring
local function show(v)
    if type(v) == 'string' then return quote(v, 40) end
    return tostring(v)
end

-- a value with its kind: nil, null (JSON), a string "x", a number 3, a table, a boolean true
local function describe(v)
    if v == nil then return 'nil' end
    if pyjson.is_null(v) then return 'null' end
    if type(v) == 'table' or type(v) == 'function' or type(v) == 'userdata' then return 'a ' .. type(v) end
    return ('a %s %s'):format(type(v), show(v))
end

local function is_finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

-- A user function's return value as {score, correct, pred}, or nil and what is wrong with it.
local function user_result(v)
    if type(v) == 'number' then
        if not is_finite(v) then return nil, ('returned %s, expected a finite number'):format(tostring(v)) end
        return {score = v, correct = v > 0}
    end
    if type(v) ~= 'table' then
        return nil, ('returned %s, expected %s'):format(v == nil and 'nothing (nil)' or describe(v), RESULT_FORM)
    end
    local score = v.score
    if type(score) ~= 'number' then
        return nil, ('returned a table whose score is %s, expected %s'):format(describe(score), RESULT_FORM)
    end
    if not is_finite(score) then
        return nil, ('returned score = %s, expected a finite number'):format(tostring(score))
    end
    local correct = v.correct
    if correct == nil then
        correct = score > 0
    elseif type(correct) ~= 'boolean' then
        return nil, ('returned correct = %s, expected true, false or nil (nil: score > 0)'):format(show(correct))
    end
    if v.pred ~= nil and type(v.pred) ~= 'string' then
        return nil, ('returned pred = %s, expected a string or nil'):format(describe(v.pred))
    end
    return {score = score, correct = correct, pred = v.pred}
end

local function checked_opts(opts)
    opts = opts or {}
    if type(opts) ~= 'table' then error(('rewards.get: opts must be a table, got %s'):format(type(opts)), 3) end
    for k in pairs(opts) do
        if k ~= 'on_error' and k ~= 'name' then
            error(('rewards.get: unknown option %s (options: on_error, name)'):format(tostring(k)), 3)
        end
    end
    if opts.on_error ~= nil and opts.on_error ~= 'error' and opts.on_error ~= 'skip' then
        error(('rewards.get: on_error = %s, expected \'error\' or \'skip\''):format(show(opts.on_error)), 3)
    end
    if opts.name ~= nil and type(opts.name) ~= 'string' then
        error(('rewards.get: name must be a string, got %s'):format(type(opts.name)), 3)
    end
    return opts
end

-- rewards.get(spec, opts) -> fn(response, gold, info) -> {score, correct, pred}
--   spec: a name of rewards.NAMES, or function(response, gold, info)
--   opts.on_error: 'error' (default): a failing call raises one line; 'skip': it returns nil and
--                  that line instead
--   opts.name: what the messages call a recipe's function (default "recipe's rl.reward")
function M.get(spec, opts)
    opts = checked_opts(opts)
    local skip = opts.on_error == 'skip'
    local score
    local label
    if type(spec) == 'function' then
        label = opts.name or USER_LABEL
        score = function(response, gold, info)
            local ok, v = pcall(spec, response, gold, info)
            if not ok then return nil, 'raised an error: ' .. tostring(v):gsub('\n', ' | ') end
            return user_result(v)
        end
    elseif type(spec) == 'string' then
        check_name('get', spec)
        label = spec
        local grader = M.GRADER[spec]
        score = function(response, gold)
            if type(gold) ~= 'string' then
                return nil, ('gold answer must be a string, got %s (write it as text)'):format(describe(gold))
            end
            return grade.score(grader, response, gold)
        end
    else
        error(('rewards.get: the reward must be a name (%s) or a function(response, gold, info), got %s'):format(
            table.concat(M.NAMES, ', '), type(spec)), 2)
    end
    return function(response, gold, info)
        local r, reason
        if type(response) ~= 'string' then
            reason = ('response must be a string, got %s'):format(type(response))
        else
            r, reason = score(response, gold, info)
        end
        if r then return r end
        local line = ('reward function %s%s: %s; response %s'):format(label, where(info), reason, preview(response))
        if skip then return nil, line end
        error(line, 0)
    end
end

-- the user message the reference's data preparation builds for a question
function M.prompt(name, question)
    check_name('prompt', name)
    if type(question) ~= 'string' then
        error(('rewards.prompt: question must be a string, got %s'):format(type(question)), 2)
    end
    return grade.prompt(M.GRADER[name], question)
end

local function is_gsm8k(name) return name:sub(1, 5) == 'gsm8k' end

local function field_text(fn, name, row, field)
    local v = row[field]
    if type(v) ~= 'string' then
        error(('rewards.%s(%s): the row\'s %s is %s, expected a string'):format(fn, name, field, describe(v)), 3)
    end
    return v
end

local function first_field(row, fields)
    for _, f in ipairs(fields) do
        if row[f] ~= nil then return f end
    end
    return nil
end

local function check_row(fn, name, row)
    if type(row) ~= 'table' then error(('rewards.%s(%s): row must be a table, got %s'):format(fn, name, type(row)), 3) end
end

-- The gold answer of a data row:
--   gsm8k rewards: GSM8K rows {question, answer = "... #### N"}: the number after the first
--                  "#### ", commas removed (verl's and SkyRL's data preparation)
--   dapo, math:    the row's answer (DAPO-Math {id, problem, answer}, MATH-500 {problem,
--                  answer}), or its ref_answer (examples/data/eval {data_source, question,
--                  ref_answer}), as written
function M.gold(name, row)
    check_name('gold', name)
    check_row('gold', name, row)
    if is_gsm8k(name) then
        local text = field_text('gold', name, row, 'answer')
        local ok, gold = pcall(grade.gsm8k_gold, text)
        if not ok then
            error(('rewards.gold(%s): the row\'s answer has no "#### <number>": %s'):format(name, preview(text)), 2)
        end
        return gold
    end
    local field = first_field(row, {'answer', 'ref_answer'})
    if not field then
        error(('rewards.gold(%s): the row has no answer field (looked for answer, ref_answer)'):format(name), 2)
    end
    return field_text('gold', name, row, field)
end

-- The question text of a data row: its question field, else its problem field.
function M.question(name, row)
    check_name('question', name)
    check_row('question', name, row)
    local field = first_field(row, {'question', 'problem'})
    if not field then
        error(('rewards.question(%s): the row has no question field (looked for question, problem)'):format(name), 2)
    end
    return field_text('question', name, row, field)
end

return M
