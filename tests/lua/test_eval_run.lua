-- test_eval_run.lua: lunar.eval.run, the evaluation loop (recipes/eval.lua; a training recipe can
-- call it): the shipped sets load with their sizes and golds; a run of a small model with k
-- samples per problem writes one row per sample, each row's score is the grader's on its
-- completion, and the report's avg@k and pass@k are those of the rows; unknown datasets and a
-- sampling run without a seed are errors.
local lunar = require 'lunar'
local evaluate = require 'lunar.eval.run'
local grade = require 'lunar.eval.grade'
local metrics = require 'lunar.eval.metrics'
local T = require('lunar.testing').suite('eval.run')

local function refuses(fn, want)
    local ok, err = pcall(fn)
    assert(not ok, 'expected an error mentioning ' .. want)
    assert(tostring(err):find(want, 1, true), ('error %q does not mention %q'):format(tostring(err), want))
end

T:test('the shipped sets: sizes and golds', function()
    local dir = 'examples/data/eval'
    T.equal(#evaluate.problems('gsm8k', {data_dir = dir}), 1319, 'GSM8K test')
    T.equal(#evaluate.problems('MATH-500', {data_dir = dir}), 500, 'MATH-500')
    T.equal(#evaluate.problems('AIME-2024-30', {data_dir = dir}), 30, 'AIME 2024')
    T.equal(#evaluate.problems('AIME-2025-30', {data_dir = dir}), 30, 'AIME 2025')
    local g = evaluate.problems('gsm8k', {data_dir = dir, limit = 2})
    assert(#g == 2 and g[1].gold == '18', 'the first GSM8K gold is 18, got ' .. tostring(g[1].gold))
    refuses(function() evaluate.problems('gsm9k', {data_dir = dir}) end, 'unknown dataset "gsm9k"')
end)

T:test('a run: one row per sample, scores from the grader, the report from the rows', function()
    local preset = dofile('recipes/presets/tiny.lua')
    local model = lunar.model.new(preset.common.model.config, {seed = 3})
    local tok = lunar.tokenizer.load('recipes/presets/tiny/tokenizer.json')
    local path = os.tmpname()
    local report = evaluate.run(model, tok, {datasets = {'gsm8k', 'AIME-2024-30'}, limit = 3, k = 2,
        temperature = 0.9, seed = 4, max_new_tokens = 8, data_dir = 'examples/data/eval', samples = path})
    T.equal(#report.samples, 12, '2 datasets x 3 problems x 2 samples')
    local lines = 0
    for line in io.lines(path) do
        lines = lines + 1
        local row = lunar.io.decode_json(line)
        local want = grade.score(grade.grader_for(row.dataset), row.completion, row.gold)
        assert(row.correct == want.correct and row.score == want.score, 'row ' .. lines .. ' is graded')
    end
    os.remove(path)
    T.equal(lines, 12, 'rows written')
    local again = metrics.summarize(report.samples, {k = {1, 2}})
    for i, e in ipairs(report) do
        T.equal({e.avg, e.pass[1], e.pass[2], e.problems, e.n}, {again[i].avg, again[i].pass[1], again[i].pass[2], 3, 2},
            e.dataset)
    end
    refuses(function() evaluate.run(model, tok, {datasets = {'gsm8k'}, limit = 1, temperature = 0.5,
        data_dir = 'examples/data/eval'}) end, 'seed')
end)

os.exit(T:run())
