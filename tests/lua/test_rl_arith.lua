-- test_rl_arith.lua: the tiny RL task's problems (recipes/tools/arith.lua) and its shipped files
-- (examples/data/rl/): a seed gives the same problems every time and another seed others; every
-- answer is the one a separate solver reads off the question's words, and every line of its
-- worked solution is right; the warm-up's rows are right too, direct and ending in "The answer is
-- N." in the fractions asked (the formats drawn apart from the problems); the shipped files are
-- the generator's output for their settings, byte for byte; no question is in two sets; the held-out set loads as the evaluation's `arith`
-- dataset, graded by skyrl_gsm8k.
local arith = dofile('recipes/tools/arith.lua')
local evaluate = require 'lunar.eval.run'
local grade = require 'lunar.eval.grade'
local T = require('lunar.testing').suite('rl.arith')

local DIR = 'examples/data/rl'

-- a and b equal (strings or numbers), or an error showing both
local function same(a, b, what)
    if a ~= b then error(('%s: got %s, expected %s'):format(what, tostring(a), tostring(b)), 2) end
end

local function read(path)
    local f = assert(io.open(path, 'rb'), 'cannot open ' .. path)
    local s = f:read('*a')
    f:close()
    return s
end

local function numbers_of(text)
    local out = {}
    for n in text:gmatch('%d+') do out[#out + 1] = tonumber(n) end
    return out
end

-- the answer of a question from its words alone (the stories' meaning written out again)
local function solve(q)
    local n = numbers_of(q)
    if q:find('twice as many', 1, true) then return n[1] + 2 * n[1] end
    if q:find('boxes', 1, true) then
        local p = n[1] * n[2]
        if q:find('already had', 1, true) then return p + n[3] end
        if q:find('uses', 1, true) then return p - n[3] end
        return p
    end
    if q:find('more and then gives', 1, true) or q:find('in the morning', 1, true) then return n[1] + n[2] - n[3] end
    if q:find('fewer', 1, true) or q:find('gives', 1, true) then return n[1] - n[2] end
    if q:find('more', 1, true) then return n[1] + n[2] end
    error('no rule for the question: ' .. q)
end

-- checks one problem: the final answer, each worked line, the operands' origins
local function check_problem(p)
    local want = solve(p.question)
    local lines = {}
    for line in (p.answer .. '\n'):gmatch('(.-)\n') do lines[#lines + 1] = line end
    same(lines[#lines], ('#### %d'):format(want), 'the final line of ' .. p.question)
    assert(#lines == 2 or #lines == 3, 'one or two worked lines: ' .. p.answer)
    local in_question = {}
    for _, x in ipairs(numbers_of(p.question)) do in_question[x] = true end
    if p.question:find('twice', 1, true) then in_question[2] = true end
    local previous
    for i = 1, #lines - 1 do
        local x, op, y, r = lines[i]:match('^(%d+) ([%+%-x]) (%d+) = (%d+)$')
        assert(x, 'a worked line "a op b = c": ' .. lines[i])
        x, y, r = tonumber(x), tonumber(y), tonumber(r)
        local exact = op == '+' and x + y or op == '-' and x - y or x * y
        same(r, exact, lines[i])
        for _, v in ipairs({x, y}) do
            assert(in_question[v] or v == previous, ('%s: %d is neither in the question nor the line before')
                :format(lines[i], v))
        end
        assert(r >= 1 and r <= arith.MAX_VALUE, 'a result in range: ' .. lines[i])
        previous = r
    end
    same(previous, want, 'the last worked result')
    same(grade.gsm8k_gold(p.answer), tostring(want), 'the gold the graders read')
    same(grade.score('skyrl_gsm8k', p.answer, tostring(want)).score, 1, 'skyrl_gsm8k on the answer')
end

local function questions(text, field)
    local out = {}
    for line in text:gmatch('[^\n]+') do
        local row = require('lunar').io.decode_json(line)
        out[#out + 1] = field == 'chat' and row.messages[1].content or row.question
    end
    return out
end

T:test('a seed gives the same problems, another seed others', function()
    local a = arith.generate({seed = 7, test = 20, sft = 30, train = 40})
    local b = arith.generate({seed = 7, test = 20, sft = 30, train = 40})
    local c = arith.generate({seed = 8, test = 20, sft = 30, train = 40})
    same(#a.test, 20, 'test size')
    same(#a.sft, 30, 'sft size')
    same(#a.train, 40, 'train size')
    local differ = 0
    for _, set in ipairs({'test', 'sft', 'train'}) do
        for i = 1, #a[set] do
            same(a[set][i].question, b[set][i].question, set .. ' question ' .. i)
            same(a[set][i].answer, b[set][i].answer, set .. ' answer ' .. i)
            if a[set][i].question ~= c[set][i].question then differ = differ + 1 end
        end
    end
    assert(differ > 80, ('seed 8 should draw other problems than seed 7; only %d of 90 differ'):format(differ))
end)

T:test('every answer is right: the final number and each worked line', function()
    local sets = arith.generate(arith.SHIPPED)
    local two_steps = 0
    for _, set in ipairs({'test', 'sft', 'train'}) do
        for _, p in ipairs(sets[set]) do
            check_problem(p)
            if select(2, p.answer:gsub('\n', '')) == 2 then two_steps = two_steps + 1 end
        end
    end
    -- both kinds of problem are there in quantity (the mix is part of the task's difficulty)
    local total = #sets.test + #sets.sft + #sets.train
    assert(two_steps > total / 4 and two_steps < 3 * total / 4,
        ('%d of %d problems take two steps'):format(two_steps, total))
end)

T:test('the shipped files are the generator output for their settings', function()
    local files = arith.files(arith.generate(arith.SHIPPED))
    same(#files, 3, 'three files')
    for _, file in ipairs(files) do
        local shipped = read(DIR .. '/' .. file.name)
        assert(shipped == file.text, ('%s/%s differs from recipes/tools/make_arith.lua\'s output (%d bytes against %d): '
            .. 'run lunar recipes/tools/make_arith.lua'):format(DIR, file.name, #shipped, #file.text))
    end
end)

-- the story (index into arith.STORIES) a question was drawn from
local function story_of(q)
    for i, st in ipairs(arith.STORIES) do
        local pat = st.text:gsub('[%.%?]', '%%%0'):gsub('{[NPFI]}', '%%a+'):gsub('{[abc]}', '%%d+')
        if q:match('^' .. pat .. '$') then return i end
    end
    error('no story for the question: ' .. q)
end

-- the warm-up's chat rows in `text`: the question with the instruction, then a right answer,
-- direct ("#### N") in about the fraction `direct` of the rows, else worked; the final line "The
-- answer is N." instead of "#### N" in about the fraction say[story] of each story's rows
local function check_warmup_rows(text, want_rows, direct_fraction, say)
    local direct, rows = 0, 0
    local said, want_said = 0, 0
    for line in text:gmatch('[^\n]+') do
        local row = require('lunar').io.decode_json(line)
        rows = rows + 1
        same(#row.messages, 2, 'a user and an assistant turn')
        same(row.messages[1].role, 'user', 'the first turn')
        same(row.messages[2].role, 'assistant', 'the second turn')
        local q = row.messages[1].content:sub(1, #row.messages[1].content - #arith.INSTRUCTION - 1)
        same(arith.user_prompt(q), row.messages[1].content, 'sft row ' .. rows .. ' ends with the instruction')
        local answer = row.messages[2].content
        local story = story_of(q)
        local fraction = type(say) == 'table' and say[story] or say or 0
        want_said = want_said + fraction
        local n = answer:match('The answer is (%d+)%.$')
        if n then
            assert(fraction > 0, 'a "The answer is" row of a story whose fraction is 0: ' .. answer)
            said = said + 1
            answer = answer:gsub('The answer is %d+%.$', '#### ' .. n)
        end
        if answer:find('\n', 1, true) then
            check_problem({question = q, answer = answer})
        else
            same(answer, ('#### %d'):format(solve(q)), 'the direct answer of ' .. q)
            direct = direct + 1
        end
    end
    same(rows, want_rows, 'sft rows')
    local want = direct_fraction * rows
    assert(math.abs(direct - want) <= 0.05 * rows, ('%d direct rows, about %d expected'):format(direct, want))
    assert(math.abs(said - want_said) <= 0.05 * rows, ('%d "The answer is" rows, about %d expected'):format(said,
        want_said))
end

T:test('the warm-up rows: the question with the instruction, a right answer, direct or worked', function()
    check_warmup_rows(read(DIR .. '/arith_sft_chat.jsonl'), arith.SHIPPED.sft, arith.SHIPPED.direct, arith.SHIPPED.say)
    for _, case in ipairs({{direct = 0.5, say = 0}, {direct = 1, say = 0}, {direct = 0.3, say = 0.5},
                           {direct = 0, say = {1, 0, 1, 0, 1, 0, 1, 0, 1, 0}}}) do
        local files = arith.files(arith.generate({seed = 3, test = 10, sft = 400, train = 10, direct = case.direct,
            say = case.say}))
        for _, file in ipairs(files) do
            if file.name == 'arith_sft_chat.jsonl' then check_warmup_rows(file.text, 400, case.direct, case.say) end
        end
    end
end)

T:test('the answer formats do not change the problems', function()
    local plain = arith.generate({seed = 5, test = 30, sft = 60, train = 40})
    local mixed = arith.generate({seed = 5, test = 30, sft = 60, train = 40, say = 0.5})
    for _, set in ipairs({'test', 'sft', 'train'}) do
        for i = 1, #plain[set] do same(mixed[set][i].question, plain[set][i].question, set .. ' question ' .. i) end
    end
end)

T:test('the sets share no question, and none repeats', function()
    local test = questions(read(DIR .. '/arith_test.jsonl'))
    local train = questions(read(DIR .. '/arith_train.jsonl'))
    local sft = questions(read(DIR .. '/arith_sft_chat.jsonl'), 'chat')
    same(#test, arith.SHIPPED.test, 'test rows')
    same(#train, arith.SHIPPED.train, 'train rows')
    same(#sft, arith.SHIPPED.sft, 'sft rows')
    local owner = {}
    for name, list in pairs({test = test, train = train, sft = sft}) do
        for i, q in ipairs(list) do
            if name == 'sft' then
                local plain = q:sub(1, #q - #arith.INSTRUCTION - 1)
                same(arith.user_prompt(plain), q, 'sft row ' .. i .. ' ends with the instruction')
                q = plain
            end
            assert(not owner[q], ('%q is in %s and in %s'):format(q, tostring(owner[q]), name))
            owner[q] = name
        end
    end
end)

T:test('the held-out set is the evaluation dataset arith, graded by skyrl_gsm8k', function()
    local problems = evaluate.problems('arith', {data_dir = 'examples/data/eval'})
    same(#problems, 200, 'problems')
    local rows = {}
    for line in read(DIR .. '/arith_test.jsonl'):gmatch('[^\n]+') do rows[#rows + 1] = require('lunar').io.decode_json(line) end
    for i, p in ipairs(problems) do
        same(p.question, rows[i].question, 'question ' .. i)
        same(p.gold, tostring(solve(rows[i].question)), 'gold ' .. i)
    end
    same(grade.grader_for('arith'), 'skyrl_gsm8k', 'grader')
    same(grade.prompt('skyrl_gsm8k', 'Q?'), arith.user_prompt('Q?'), 'the prompt the warm-up trains on')
end)

T:test('bad settings are errors naming them', function()
    local ok, err = pcall(arith.generate, {seed = 0, test = 1, sft = 1, train = 1})
    assert(not ok and tostring(err):find('seed must be an integer', 1, true), tostring(err))
    ok, err = pcall(arith.generate, {seed = 1, test = 1, sft = 1, train = 1, direct = 1.5})
    assert(not ok and tostring(err):find('direct must be a fraction', 1, true), tostring(err))
    ok, err = pcall(arith.generate, {seed = 1, test = 1, sft = 1, train = 1, say = {0.5, 0.5}})
    assert(not ok and tostring(err):find('say must be a fraction in [0, 1] or a list of 10', 1, true), tostring(err))
    ok, err = pcall(arith.generate, {seed = 1, test = -1, sft = 1, train = 1})
    assert(not ok and tostring(err):find('test must be a count', 1, true), tostring(err))
end)

os.exit(T:run())
