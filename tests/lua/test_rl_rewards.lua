-- lunar.rl.rewards: every RL reward name against every fixture row of the reference grader it
-- reproduces (scores made by running verl 0.9.1's and skyrl-gym 0.4.0's own code,
-- tests/ref/make_grading_fixtures.py), at least 300 rows each; a recipe's own reward function
-- (numbers, tables, and each way it can fail, raised or skipped); the gold answers and questions
-- of GSM8K, MATH-500 / AIME and DAPO-Math rows; the prompts; the errors.
local T = require('lunar.testing').suite('rl.rewards')
local rewards = require 'lunar.rl.rewards'
local grade = require 'lunar.eval.grade'
local pyjson = require 'lunar.pyjson'

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local GRADING = here .. '/../fixtures/grading/'
local ROWS = here .. '/../fixtures/rewards/'
local EVAL_DATA = here .. '/../../examples/data/eval/'

local function eq(actual, expected, msg)
    if actual ~= expected then
        local function show(v) return type(v) == 'string' and ('%q'):format(v) or tostring(v) end
        error(('%s: got %s, expected %s'):format(msg or 'eq', show(actual), show(expected)), 2)
    end
end

local function read_jsonl(path)
    local f = assert(io.open(path, 'r'))
    local rows = {}
    for line in f:lines() do
        if line ~= '' then rows[#rows + 1] = pyjson.decode(line) end
    end
    f:close()
    return rows
end

-- every fixture row, by grader
local BY_GRADER = {}
for _, name in ipairs({'gsm8k', 'math', 'dapo', 'cross', 'random'}) do
    for i, row in ipairs(read_jsonl(GRADING .. name .. '.jsonl')) do
        row.where = name .. '.jsonl:' .. i
        BY_GRADER[row.grader] = BY_GRADER[row.grader] or {}
        table.insert(BY_GRADER[row.grader], row)
    end
end

local function fixture_row(grader, case)
    for _, row in ipairs(BY_GRADER[grader]) do
        if row.case == case then return row end
    end
    error(('no fixture row %s [%s]'):format(grader, case))
end

T:test('the names and the graders they reproduce', function()
    local expected = {gsm8k = 'skyrl_gsm8k', gsm8k_verl = 'verl_gsm8k', gsm8k_verl_flexible = 'verl_gsm8k_flexible',
                      dapo = 'verl_math_dapo', dapo_skyrl = 'skyrl_aime', math = 'verl_math', dapo_int = 'aime'}
    local n = 0
    for _, name in ipairs(rewards.NAMES) do
        eq(rewards.GRADER[name], expected[name], 'grader of ' .. name)
        n = n + 1
    end
    eq(n, 7, 'names')
    -- every grader of lunar.eval.grade has an RL name
    for _, g in ipairs(grade.GRADERS) do
        local found = false
        for _, name in ipairs(rewards.NAMES) do found = found or rewards.GRADER[name] == g end
        assert(found, 'no reward name for grader ' .. g)
    end
end)

T:test('every name agrees with every fixture row of its reference (>= 300 rows each)', function()
    for _, name in ipairs(rewards.NAMES) do
        local grader = rewards.GRADER[name]
        local rows = BY_GRADER[grader] or {}
        assert(#rows >= 300, ('%s (%s) has %d fixture rows, fewer than 300'):format(name, grader, #rows))
        local reward = rewards.get(name)
        local failures, scores = {}, {}
        for _, row in ipairs(rows) do
            local r = reward(row.response, row.gold, {prompt = 1, sample = 1})
            local want_pred = not pyjson.is_null(row.pred) and row.pred or nil
            if r.score ~= row.score or r.correct ~= row.correct or r.pred ~= want_pred then
                failures[#failures + 1] = ('%s %s [%s] gold %q: got score %s correct %s pred %q, expected %s %s %q'):format(
                    row.where, name, row.case, row.gold, tostring(r.score), tostring(r.correct), tostring(r.pred),
                    tostring(row.score), tostring(row.correct), tostring(want_pred))
            end
            scores[r.score] = true
        end
        if #failures > 0 then
            error(('%s: %d of %d rows differ:\n%s'):format(name, #failures, #rows,
                table.concat(failures, '\n', 1, math.min(#failures, 20))))
        end
        -- the reference's scale: 1 / 0 for GSM8K and MATH, +1 / -1 for the DAPO rules
        local scale = name:find('dapo', 1, true) and {1, -1} or {1, 0}
        for s in pairs(scores) do assert(s == scale[1] or s == scale[2], name .. ': score ' .. s) end
        assert(scores[scale[1]] and scores[scale[2]], name .. ': the fixture rows reach both scores')
    end
end)

T:test('the quirks the names keep apart (fixture rows)', function()
    local function check(name, case, score)
        local row = fixture_row(rewards.GRADER[name], case)
        eq(row.score, score, name .. ' fixture [' .. case .. ']')
        eq(rewards.get(name)(row.response, row.gold).score, score, name .. ' [' .. case .. ']')
    end
    -- a stop token right after the answer: verl's pattern keeps it, SkyRL's stops at '<'
    check('dapo', 'Answer then stop token <|user|> [gold 34]', -1)
    check('dapo_skyrl', 'Answer then stop token <|user|> [gold 34]', 1)
    -- \boxed{} without an Answer line: verl 0.9.1 falls back to it, SkyRL's copy does not
    check('dapo', 'boxed only, then 90 characters [gold 34]', 1)
    check('dapo_skyrl', 'boxed only, then 90 characters [gold 34]', -1)
    check('dapo', 'boxed only, then 91 characters [gold 34]', -1)
    -- zero-padded golds compare as text, except under the lenient dapo_int
    check('dapo', 'padded gold 007 [gold 007]', -1)
    check('dapo_int', 'padded gold 007 [gold 007]', 1)
    -- GSM8K: SkyRL takes the first "####" anywhere, verl the last within 300 characters
    check('gsm8k', 'two #### lines, first right', 1)
    check('gsm8k_verl', 'two #### lines, first right', 0)
    check('gsm8k', '#### then padding tokens past the clip [gold 18]', 1)
    check('gsm8k_verl', '#### then padding tokens past the clip [gold 18]', 0)
    check('gsm8k_verl', '#### then 293 filler characters [gold 72]', 1)
    check('gsm8k_verl', '#### then 294 filler characters [gold 72]', 0)
    check('gsm8k_verl_flexible', '#### then 294 filler characters [gold 72]', 1)
end)

T:test('a recipe\'s function: numbers and tables', function()
    local seen
    local reward = rewards.get(function(response, gold, info)
        seen = {response, gold, info}
        return #response == #gold and 1 or 0
    end)
    local info = {prompt = 4, sample = 2}
    local r = reward('abc', 'xyz', info)
    eq(r.score, 1, 'score')
    eq(r.correct, true, 'correct = score > 0')
    eq(r.pred, nil, 'no pred')
    eq(seen[1], 'abc', 'response passed')
    eq(seen[2], 'xyz', 'gold passed')
    eq(seen[3], info, 'info passed')
    eq(reward('ab', 'xyz').correct, false, 'score 0 is not correct')
    eq(rewards.get(function() return -0.5 end)('a', 'b').correct, false, 'negative score')
    eq(rewards.get(function() return 0.25 end)('a', 'b').score, 0.25, 'fractional score')
    -- a table: correct and pred as given, correct defaulting to score > 0
    r = rewards.get(function() return {score = 0.2, correct = false, pred = '7'} end)('a', 'b')
    eq(r.score, 0.2, 'table score')
    eq(r.correct, false, 'table correct overrides score > 0')
    eq(r.pred, '7', 'table pred')
    r = rewards.get(function() return {score = -1} end)('a', 'b')
    eq(r.correct, false, 'table without correct, score -1')
    r = rewards.get(function() return {score = 1} end)('a', 'b')
    eq(r.correct, true, 'table without correct, score 1')
    -- gold can be anything a recipe's function wants (a table of tests, a number)
    r = rewards.get(function(_, gold) return gold.n end)('a', {n = 3})
    eq(r.score, 3, 'table gold')
    -- a function can wrap a named reward
    local dapo = rewards.get('dapo')
    r = rewards.get(function(resp, gold) local d = dapo(resp, gold); return {score = (d.score + 1) / 2, pred = d.pred} end)(
        'Answer: 34', '34')
    eq(r.score, 1, 'wrapped dapo')
    eq(r.pred, '34', 'wrapped pred')
end)

T:test('a recipe\'s function that fails: one line naming the reward, the sample and the response', function()
    local info = {prompt = 3, sample = 2}
    local long = 'Step one:\n"quoted" ' .. ('é'):rep(100)
    local function fails(fn, pattern, opts)
        local msg = T.raises(function() rewards.get(fn, opts)(long, '34', info) end, pattern)
        assert(not msg:find('\n', 1, true), 'one line: ' .. msg)
        return msg
    end
    local msg = fails(function() error('no grader for this row') end,
        "reward function recipe's rl.reward on prompt 3 sample 2: raised an error: ")
    assert(msg:find('no grader for this row', 1, true), msg)
    -- the first 80 characters of the response, newlines and quotes escaped
    local head = 'Step one:\\n\\"quoted\\" ' .. ('é'):rep(80 - 19) .. '..."'
    assert(msg:find('; response "' .. head, 1, true), msg)
    fails(function() return '1' end, 'returned a string "1", expected a number or a table {score = number')
    fails(function() return nil end, 'returned nothing (nil), expected a number or a table')
    fails(function() return true end, 'returned a boolean true, expected')
    fails(function() return 0 / 0 end, 'on prompt 3 sample 2: returned nan, expected a finite number')
    fails(function() return math.huge end, 'returned inf, expected a finite number')
    fails(function() return -math.huge end, 'returned -inf, expected a finite number')
    fails(function() return {correct = true} end, 'returned a table whose score is nil, expected')
    fails(function() return {score = '1'} end, 'returned a table whose score is a string "1"')
    fails(function() return {score = 0 / 0} end, 'returned score = nan, expected a finite number')
    fails(function() return {score = 1, correct = 1} end, 'returned correct = 1, expected true, false or nil')
    fails(function() return {score = 1, pred = 7} end, 'returned pred = a number 7, expected a string or nil')
    -- a name of the recipe's choosing, and a call without sample information
    T.raises(function() rewards.get(function() return 'x' end, {name = 'format_bonus'})('r', 'g') end,
        'reward function format_bonus: returned a string "x"')
    -- a response that is not text (the caller's mistake) is named as such
    T.raises(function() rewards.get(function() return 1 end)(nil, 'g', info) end,
        "reward function recipe's rl.reward on prompt 3 sample 2: response must be a string, got nil; response (a nil, not text)")
end)

T:test('on_error = skip: nil and the line, for the caller to count', function()
    local skipped, reasons, total = 0, {}, 0
    local reward = rewards.get(function(response)
        if response == 'raise' then error('bad row') end
        if response == 'string' then return 'yes' end
        if response == 'nan' then return 0 / 0 end
        return 1
    end, {on_error = 'skip'})
    for i, response in ipairs({'ok', 'raise', 'ok', 'string', 'nan', 'ok'}) do
        local r, why = reward(response, 'g', {prompt = 1, sample = i})
        total = total + 1
        if r == nil then
            skipped = skipped + 1
            reasons[#reasons + 1] = why
        else
            eq(r.score, 1, 'kept sample ' .. i)
            eq(why, nil, 'no reason for a kept sample')
        end
    end
    eq(total, 6, 'calls')
    eq(skipped, 3, 'skipped')
    assert(reasons[1]:find("reward function recipe's rl.reward on prompt 1 sample 2: raised an error: ", 1, true)
        and reasons[1]:find('bad row', 1, true), reasons[1])
    assert(reasons[2]:find('on prompt 1 sample 4: returned a string "yes"', 1, true), reasons[2])
    assert(reasons[3]:find('on prompt 1 sample 5: returned nan', 1, true), reasons[3])
    -- a named reward skips a gold that is not text
    local r, why = rewards.get('gsm8k', {on_error = 'skip'})('#### 3', 3, {prompt = 7, sample = 1})
    eq(r, nil, 'skipped')
    eq(why, 'reward function gsm8k on prompt 7 sample 1: gold answer must be a string, got a number 3 (write it as text); '
        .. 'response "#### 3"', 'named reward, number gold')
end)

T:test('a named reward refuses a gold or response that is not text', function()
    T.raises(function() rewards.get('dapo')('Answer: 34', 34, {prompt = 2, sample = 1}) end,
        'reward function dapo on prompt 2 sample 1: gold answer must be a string, got a number 34')
    T.raises(function() rewards.get('math')(false, '1') end, 'reward function math: response must be a string, got boolean')
end)

T:test('get: bad specs and options', function()
    T.raises(function() rewards.get('verl_math_dapo') end,
        'unknown reward verl_math_dapo (the evaluation grader verl_math_dapo is the reward dapo); rewards: gsm8k,')
    T.raises(function() rewards.get('aime') end, 'the evaluation grader aime is the reward dapo_int')
    T.raises(function() rewards.get('gsm9k') end, 'rewards.get: unknown reward gsm9k; rewards: gsm8k, gsm8k_verl,')
    T.raises(function() rewards.get(42) end, 'the reward must be a name (gsm8k, ')
    T.raises(function() rewards.get(nil) end, 'or a function(response, gold, info), got nil')
    T.raises(function() rewards.get('dapo', {on_error = 'ignore'}) end, 'on_error = "ignore", expected \'error\' or \'skip\'')
    T.raises(function() rewards.get('dapo', {on_eror = 'skip'}) end, 'unknown option on_eror (options: on_error, name)')
    T.raises(function() rewards.get('dapo', 'skip') end, 'opts must be a table, got string')
end)

T:test('gold and question: GSM8K rows (examples/data/eval/gsm8k_test.jsonl)', function()
    local rows = read_jsonl(EVAL_DATA .. 'gsm8k_test.jsonl')
    local golds = pyjson.decode(assert(io.open(GRADING .. 'gsm8k_test_golds.json')):read('*a'))
    eq(#rows, #golds, 'rows')
    for _, name in ipairs({'gsm8k', 'gsm8k_verl', 'gsm8k_verl_flexible'}) do
        for i, row in ipairs(rows) do
            eq(rewards.gold(name, row), golds[i], name .. ' gold of row ' .. i)
            eq(rewards.question(name, row), row.question, name .. ' question of row ' .. i)
        end
    end
    -- the first row: Janet's ducks, 18 dollars; the reference's own completion scores 1
    eq(rewards.gold('gsm8k', rows[1]), '18', 'first gold')
    assert(rewards.question('gsm8k', rows[1]):find('^Janet'), 'first question')
    for _, name in ipairs({'gsm8k', 'gsm8k_verl', 'gsm8k_verl_flexible'}) do
        eq(rewards.get(name)(rows[1].answer, rewards.gold(name, rows[1])).score, 1, name .. ' on the worked answer')
    end
    T.raises(function() rewards.gold('gsm8k', {question = 'q', answer = 'about 5'}) end,
        'rewards.gold(gsm8k): the row\'s answer has no "#### <number>": "about 5"')
    T.raises(function() rewards.gold('gsm8k_verl', {question = 'q'}) end,
        'rewards.gold(gsm8k_verl): the row\'s answer is nil, expected a string')
    T.raises(function() rewards.gold('gsm8k', {answer = 72}) end, 'the row\'s answer is a number 72, expected a string')
end)

T:test('gold and question: DAPO-Math rows {id, problem, answer}', function()
    local rows = read_jsonl(ROWS .. 'dapo_rows.jsonl')
    eq(#rows, 5, 'rows')
    local negative = 0
    for i, row in ipairs(rows) do
        for _, name in ipairs({'dapo', 'dapo_skyrl', 'dapo_int'}) do
            local gold = rewards.gold(name, row)
            eq(gold, row.answer, name .. ' gold of row ' .. i)
            eq(rewards.question(name, row), row.problem, name .. ' question of row ' .. i)
            -- the prompt holds the problem, and a response in the asked form scores +1
            local prompt = rewards.prompt(name, rewards.question(name, row))
            assert(prompt:find('\n\n' .. row.problem .. '\n\n', 1, true), 'prompt holds the problem')
            eq(rewards.get(name)('Some work.\nAnswer: ' .. gold, gold).score, 1, name .. ' answer of row ' .. i)
            eq(rewards.get(name)('Some work.\nAnswer: ' .. gold .. '1', gold).score, -1, name .. ' wrong of row ' .. i)
        end
        if row.answer:sub(1, 1) == '-' then negative = negative + 1 end
    end
    eq(negative, 1, 'negative golds among the rows')
    T.raises(function() rewards.gold('dapo', {id = 1, problem = 'p'}) end,
        'rewards.gold(dapo): the row has no answer field (looked for answer, ref_answer)')
    T.raises(function() rewards.gold('dapo', {id = 1, problem = 'p', answer = 34}) end,
        'rewards.gold(dapo): the row\'s answer is a number 34, expected a string')
    T.raises(function() rewards.gold('dapo', {answer = pyjson.null}) end, 'the row\'s answer is null, expected a string')
    T.raises(function() rewards.question('dapo', {id = 1, answer = '3'}) end,
        'rewards.question(dapo): the row has no question field (looked for question, problem)')
    T.raises(function() rewards.question('dapo', {problem = {'x'}}) end, 'the row\'s problem is a table')
end)

T:test('gold and question: MATH-500 and AIME rows', function()
    local count = {}
    for _, row in ipairs(read_jsonl(EVAL_DATA .. 'math500_aime24_aime25.jsonl')) do
        local name = row.data_source == 'MATH-500' and 'math' or 'dapo_int'
        eq(rewards.gold(name, row), row.ref_answer, 'gold (ref_answer)')
        eq(rewards.question(name, row), row.question, 'question')
        count[name] = (count[name] or 0) + 1
        if name == 'math' and count[name] <= 20 then
            eq(rewards.get('math')('So \\boxed{' .. row.ref_answer .. '}.', rewards.gold('math', row)).score, 1,
                'math: the boxed gold scores 1')
        end
    end
    eq(count.math, 500, 'MATH-500 rows')
    eq(count.dapo_int, 60, 'AIME rows')
    -- Hugging Face MATH-500 layout {problem, solution, answer}: the answer field, taken before ref_answer
    local hf = {problem = 'What is $1/2$ as a fraction?', solution = '... $\\boxed{\\frac12}$', answer = '\\frac{1}{2}'}
    eq(rewards.gold('math', hf), '\\frac{1}{2}', 'HF gold')
    eq(rewards.question('math', hf), hf.problem, 'HF question')
    eq(rewards.gold('math', {answer = 'a', ref_answer = 'b'}), 'a', 'answer first')
    eq(rewards.question('math', {question = 'q', problem = 'p'}), 'q', 'question first')
    T.raises(function() rewards.gold('math', {problem = 'p', solution = '\\boxed{2}'}) end,
        'rewards.gold(math): the row has no answer field')
    T.raises(function() rewards.gold('math', 'row') end, 'rewards.gold(math): row must be a table, got string')
    T.raises(function() rewards.gold('nope', {}) end, 'rewards.gold: unknown reward nope')
    T.raises(function() rewards.question('nope', {}) end, 'rewards.question: unknown reward nope')
end)

T:test('prompts: the user message each reference\'s data preparation builds', function()
    local q = 'What is 3 + 4?'
    for _, name in ipairs({'gsm8k', 'gsm8k_verl', 'gsm8k_verl_flexible'}) do
        eq(rewards.prompt(name, q), q .. ' Let\'s think step by step and output the final answer after "####".', name)
    end
    eq(rewards.prompt('math', q), q .. ' Let\'s think step by step and output the final answer within \\boxed{}.', 'math')
    for _, name in ipairs({'dapo', 'dapo_skyrl', 'dapo_int'}) do
        eq(rewards.prompt(name, q), 'Solve the following math problem step by step. The last line of your response '
            .. 'should be of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n'
            .. q .. '\n\nRemember to put your answer on its own line after "Answer:".', name)
    end
    for _, name in ipairs(rewards.NAMES) do
        eq(rewards.prompt(name, q), grade.prompt(rewards.GRADER[name], q), name .. ' = grade.prompt')
    end
    T.raises(function() rewards.prompt('dapo', nil) end, 'rewards.prompt: question must be a string, got nil')
    T.raises(function() rewards.prompt('MATH', q) end, 'rewards.prompt: unknown reward MATH')
end)

os.exit(T:run())
