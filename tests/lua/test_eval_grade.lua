-- lunar.eval.grade and lunar.eval.metrics: every row of the grading fixtures (score, verdict and
-- extracted answer of verl 0.9.1's and skyrl-gym 0.4.0's own graders, made by
-- tests/ref/make_grading_fixtures.py), the gold answers of the shipped GSM8K test set, the
-- dataset routing, the Python string behaviours the graders rest on, pass@k against exact
-- binomial ratios, avg@k / pass@k per dataset, and the errors.
local T = require('lunar.testing').suite('eval.grade')
local grade = require 'lunar.eval.grade'
local metrics = require 'lunar.eval.metrics'
local pytext = require 'lunar.eval.pytext'
local pyjson = require 'lunar.pyjson'

local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
local FIXTURES = here .. '/../fixtures/grading/'
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

local FILES = {'gsm8k', 'math', 'dapo', 'cross', 'random'}

T:test('fixture rows: score, verdict and extracted answer of every reference grader', function()
    local total, by_grader, failures = 0, {}, {}
    for _, name in ipairs(FILES) do
        for i, row in ipairs(read_jsonl(FIXTURES .. name .. '.jsonl')) do
            local r = grade.score(row.grader, row.response, row.gold)
            local want_pred = not pyjson.is_null(row.pred) and row.pred or nil
            if r.score ~= row.score or r.correct ~= row.correct or r.pred ~= want_pred then
                failures[#failures + 1] = ('%s.jsonl:%d %s [%s] response %q gold %q: got score %s correct %s pred %q, '
                    .. 'expected %s %s %q'):format(name, i, row.grader, row.case, row.response:sub(1, 60), row.gold,
                    tostring(r.score), tostring(r.correct), tostring(r.pred), tostring(row.score),
                    tostring(row.correct), tostring(want_pred))
            end
            total = total + 1
            by_grader[row.grader] = (by_grader[row.grader] or 0) + 1
        end
    end
    if #failures > 0 then
        error(('%d of %d rows differ:\n%s'):format(#failures, total,
            table.concat(failures, '\n', 1, math.min(#failures, 20))))
    end
    assert(total >= 300, 'the table has fewer than 300 rows')
    for _, g in ipairs(grade.GRADERS) do assert((by_grader[g] or 0) >= 300, g .. ' has fewer than 300 rows') end
end)

T:test('fixture cases each dataset rule decides differently', function()
    local function s(g, resp, gold) return grade.score(g, resp, gold).correct end
    -- 0.5 vs \frac{1}{2}: equal under MATH's rule only
    eq(s('verl_math', '\\boxed{0.5}', '\\frac{1}{2}'), true, 'math 0.5')
    eq(s('verl_math_dapo', 'Answer: 0.5', '\\frac{1}{2}'), false, 'dapo 0.5')
    -- 1,000 vs 1000: the Minerva rule and GSM8K's "####" drop the commas, MATH's does not
    eq(s('verl_math_dapo', 'Answer: 1,000', '1000'), true, 'dapo 1,000')
    eq(s('verl_gsm8k', '#### 1,000', '1000'), true, 'gsm8k 1,000')
    eq(s('verl_gsm8k_flexible', 'so 1,000', '1000'), false, 'gsm8k flexible 1,000')
    eq(s('verl_math', '\\boxed{1,000}', '1000'), false, 'math 1,000')
    -- AIME golds are zero-padded: only lunar's aime grader compares integers by value
    eq(s('verl_math_dapo', 'Answer: 33', '033'), false, 'dapo 033')
    eq(s('aime', 'Answer: 33', '033'), true, 'aime 033')
    -- the last \boxed counts, nested braces matched
    local r = grade.score('verl_math', 'First \\boxed{3}, then \\boxed{\\frac{1}{2}}.', '0.5')
    eq(r.pred, '\\frac{1}{2}', 'last boxed')
    eq(r.score, 1, 'last boxed score')
    -- the graders' reward scales
    eq(grade.score('verl_gsm8k', '#### 7', '8').score, 0, 'gsm8k wrong')
    eq(grade.score('aime', 'Answer: 7', '8').score, -1, 'aime wrong')
end)

T:test('GSM8K gold answers of the shipped test set', function()
    local golds = pyjson.decode(assert(io.open(FIXTURES .. 'gsm8k_test_golds.json')):read('*a'))
    local rows = read_jsonl(EVAL_DATA .. 'gsm8k_test.jsonl')
    eq(#rows, 1319, 'GSM8K test rows')
    eq(#golds, #rows, 'gold count')
    local commas, negatives = 0, 0
    for i, row in ipairs(rows) do
        eq(grade.gsm8k_gold(row.answer), golds[i], 'gold of row ' .. i)
        if row.answer:find('#### %-') then negatives = negatives + 1 end
        if row.answer:match('#### ([^\n]*)'):find(',') then commas = commas + 1 end
    end
    eq(commas, 14, 'golds with thousands separators')
    eq(negatives, 2, 'negative golds')
    eq(grade.gsm8k_gold('so 1,080 in all.\n#### 1,080'), '1080', 'comma')
    T.raises(function() grade.gsm8k_gold('the answer is 5') end, 'no "#### <number>" in the answer')
end)

T:test('every dataset of the shipped eval sets has a grader', function()
    local seen = {}
    for _, row in ipairs(read_jsonl(EVAL_DATA .. 'math500_aime24_aime25.jsonl')) do
        seen[row.data_source] = (seen[row.data_source] or 0) + 1
    end
    eq(seen['MATH-500'], 500, 'MATH-500 rows')
    eq(grade.grader_for('MATH-500'), 'verl_math', 'MATH-500')
    eq(grade.grader_for('AIME-2024-30'), 'aime', 'AIME 2024')
    eq(grade.grader_for('AIME-2025-30'), 'aime', 'AIME 2025')
    for ds in pairs(seen) do grade.grader_for(ds) end
    eq(grade.grader_for('gsm8k'), 'verl_gsm8k', 'gsm8k')
    eq(grade.grader_for('DAPO-17k'), 'verl_math_dapo', 'dapo')
    T.raises(function() grade.grader_for('MATH-501') end, 'no grader for dataset MATH-501')
end)

T:test('prompts carry the instruction each grader parses', function()
    local q = 'What is 3 + 4?'
    eq(grade.prompt('verl_gsm8k', q), q .. ' Let\'s think step by step and output the final answer after "####".',
        'gsm8k')
    eq(grade.prompt('verl_math', q), q .. ' Let\'s think step by step and output the final answer within \\boxed{}.',
        'math')
    local d = grade.prompt('aime', q)
    assert(d:find('\n\n' .. q .. '\n\n', 1, true), 'dapo prompt holds the question')
    assert(d:find('Answer: $Answer', 1, true) and d:find('after "Answer:".', 1, true), 'dapo instruction')
end)

T:test('bad arguments give one clear error', function()
    T.raises(function() grade.score('gsm8k', '#### 1', '1') end, 'unknown grader gsm8k (graders: verl_gsm8k,')
    T.raises(function() grade.score('verl_gsm8k', nil, '1') end, 'response must be a string, got nil')
    T.raises(function() grade.score('verl_gsm8k', '#### 1', 1) end, 'gold answer must be a string, got number 1')
    T.raises(function() grade.prompt('nope', 'q') end, 'unknown grader nope')
end)

T:test('Python str behaviours: code point clips, isdigit, strip', function()
    eq(pytext.len('a×数'), 3, 'len')
    eq(pytext.tail('ab×数', 2), '×数', 'tail')
    eq(pytext.tail('ab', 5), 'ab', 'tail of a short string')
    eq(pytext.isdigit('12²٣'), true, 'unicode digits')
    eq(pytext.isdigit('1.2'), false, 'period')
    eq(pytext.isdigit(''), false, 'empty')
    eq(pytext.isdigit('½'), false, 'vulgar fraction (numeric, not a digit)')
    eq(pytext.strip('\u{3000} x y\u{a0}\n'), 'x y', 'strip unicode spaces')
    eq(pytext.strip(' \t '), '', 'strip to empty')
    -- the 300-character clip counts characters (a byte clip would keep only the é's): 11 + 289
    -- characters keep the whole Answer line, one more cuts its 'A'
    local ans = 'Answer: 34\n'
    eq(grade.score('verl_math_dapo', ans .. ('é'):rep(289), '34').correct, true, '289 after')
    eq(grade.score('verl_math_dapo', ans .. ('é'):rep(290), '34').pred, '[INVALID]', '290 after')
    eq(grade.score('verl_gsm8k', '#### 34\n' .. ('é'):rep(292), '34').correct, true, 'gsm8k 292 after')
    eq(grade.score('verl_gsm8k', '#### 34\n' .. ('é'):rep(293), '34').pred, nil, 'gsm8k 293 after')
    eq(grade.score('verl_gsm8k_flexible', '#### 34\n' .. ('é'):rep(298), '34').pred, '4', 'flexible 298 after')
end)

-- exact C(n-c, k) / C(n, k) from integer binomials (all exact in doubles at these sizes)
local function binom(n, k)
    if k < 0 or k > n then return 0 end
    local r = 1
    for i = 1, k do r = r * (n - k + i) / i end
    return math.floor(r + 0.5)
end

T:test('pass@k: exact values for n = 10, c = 3, k = 1..10 and identities', function()
    local expected = {3 / 10, 24 / 45, 85 / 120, 175 / 210, 231 / 252, 203 / 210, 119 / 120, 1, 1, 1}
    for k = 1, 10 do
        local exact = 1 - binom(7, k) / binom(10, k)
        T.close(exact, expected[k], {rtol = 0, atol = 1e-15, msg = 'binomial check k=' .. k})
        T.close(metrics.pass_at_k(10, 3, k), exact, {rtol = 0, atol = 2e-16, msg = 'pass@' .. k})
    end
    for n = 1, 30 do
        for c = 0, n do
            for k = 1, n do
                local exact = 1 - binom(n - c, k) / binom(n, k)
                T.close(metrics.pass_at_k(n, c, k), exact, {rtol = 0, atol = 1e-14,
                    msg = ('n=%d c=%d k=%d'):format(n, c, k)})
            end
        end
    end
    eq(metrics.pass_at_k(10, 0, 5), 0, 'c = 0')
    eq(metrics.pass_at_k(10, 10, 1), 1, 'c = n')
    eq(metrics.pass_at_k(1, 1, 1), 1, 'n = 1')
    -- stable where the binomials are far past a double: c = 1 gives k / n exactly
    T.close(metrics.pass_at_k(2000, 1, 700), 0.35, {rtol = 1e-14, atol = 0, msg = 'c = 1'})
    local v = metrics.pass_at_k(2000, 1000, 1000)
    assert(v > 1 - 1e-12 and v <= 1, 'pass@1000 of 2000 with 1000 correct: ' .. v)
    T.close(metrics.pass_at_k(2000, 1000, 1), 0.5, {rtol = 1e-14, atol = 0, msg = 'pass@1 = c / n'})
end)

T:test('pass@k refuses k > n and other bad counts', function()
    T.raises(function() metrics.pass_at_k(4, 2, 5) end, 'k must be an integer in [1, n = 4]')
    T.raises(function() metrics.pass_at_k(4, 2, 0) end, 'k must be an integer in [1, n = 4]')
    T.raises(function() metrics.pass_at_k(4, 5, 1) end, 'c (correct samples) must be an integer in [0, n = 4]')
    T.raises(function() metrics.pass_at_k(4, -1, 1) end, 'c (correct samples)')
    T.raises(function() metrics.pass_at_k(0, 0, 1) end, 'n (samples) must be a positive integer')
    T.raises(function() metrics.pass_at_k(4, 1.5, 1) end, 'c (correct samples)')
end)

T:test('summarize: avg@k and pass@k per dataset', function()
    local samples = {}
    local function add(ds, p, outcomes, score_of)
        for _, ok in ipairs(outcomes) do
            samples[#samples + 1] = {dataset = ds, problem = p, correct = ok, score = score_of and score_of(ok)}
        end
    end
    local pm = function(ok) return ok and 1 or -1 end
    -- AIME: 4 samples per problem, 2 problems: 1 of 4 and 4 of 4 correct
    add('AIME-2024-30', 60, {false, true, false, false}, pm)
    add('gsm8k', 'a', {true, true})
    add('AIME-2024-30', 61, {true, true, true, true}, pm)
    add('gsm8k', 'b', {false, false})
    add('gsm8k', 'c', {true, false})
    local r = metrics.summarize(samples, {k = {1, 2}})
    eq(#r, 2, 'datasets')
    eq(r[1].dataset, 'AIME-2024-30', 'first-seen order')
    local a = r.by_dataset['AIME-2024-30']
    eq(a.problems, 2, 'aime problems')
    eq(a.n, 4, 'aime n')
    T.close(a.avg, (1 / 4 + 1) / 2, {rtol = 0, atol = 1e-15, msg = 'aime avg@4'})
    T.close(a.pass[1], (1 / 4 + 1) / 2, {rtol = 0, atol = 1e-15, msg = 'aime pass@1 = avg'})
    T.close(a.pass[2], ((1 - binom(3, 2) / binom(4, 2)) + 1) / 2, {rtol = 0, atol = 1e-15, msg = 'aime pass@2'})
    T.close(a.mean_score, (1 - 3 + 4) / 8, {rtol = 0, atol = 1e-15, msg = 'aime mean reward'})
    local g = r.by_dataset.gsm8k
    eq(g.n, 2, 'gsm8k n')
    T.close(g.avg, (1 + 0 + 0.5) / 3, {rtol = 0, atol = 1e-15, msg = 'gsm8k avg@2'})
    T.close(g.pass[2], 2 / 3, {rtol = 0, atol = 1e-15, msg = 'gsm8k pass@2'})
    eq(g.mean_score, nil, 'no mean reward without scores')
    local flat = metrics.scalars(r, 'eval')
    T.close(flat['eval/gsm8k/avg@2'], g.avg, {rtol = 0, atol = 0})
    T.close(flat['eval/AIME-2024-30/pass@2'], a.pass[2], {rtol = 0, atol = 0})
    -- default k: 1 and n
    local d = metrics.summarize(samples).by_dataset['AIME-2024-30']
    assert(d.pass[1] and d.pass[4] and not d.pass[2], 'default k = {1, n}')
end)

T:test('summarize: bad samples and k > n are refused', function()
    local ok = {{dataset = 'd', problem = 1, correct = true}, {dataset = 'd', problem = 1, correct = false}}
    T.raises(function() metrics.summarize(ok, {k = {3}}) end, 'dataset d: pass@3 needs 1 <= k <= 2')
    T.raises(function() metrics.summarize({{dataset = 'd', problem = 1, correct = 1}}) end,
        'sample 1 has correct = 1, expected true or false')
    T.raises(function() metrics.summarize({{problem = 1, correct = true}}) end, 'sample 1 has no dataset name')
    T.raises(function() metrics.summarize({{dataset = 'd', correct = true}}) end, 'sample 1 has no problem id')
    local uneven = {ok[1], ok[2], {dataset = 'd', problem = 2, correct = true}}
    T.raises(function() metrics.summarize(uneven) end, 'problem 1 has 2 samples and problem 2 has 1')
end)

os.exit(T:run())
