-- lunar.eval.run: evaluation of a model on math benchmarks with k samples per problem: prompts
-- built as each grader expects, completions from lunar.generate, answers extracted and scored
-- (lunar.eval.grade), avg@k and pass@k per dataset (lunar.eval.metrics). recipes/eval.lua runs
-- it from the command line; a training recipe can call it every N steps.
--
--   local evaluate = require 'lunar.eval.run'
--   local report = evaluate.run(model, tok, {datasets = {'gsm8k', 'MATH-500'}, k = 4, limit = 50,
--       temperature = 0.6, seed = 1, max_new_tokens = 1024, samples = 'runs/eval/samples.jsonl'})
--   print(evaluate.format(report))
--
-- opts: datasets (names, default every shipped one: evaluate.DATASETS), k (samples per problem,
-- 1), limit (problems per dataset, all), the sampling settings of lunar.generate (temperature,
-- top_k, top_p, min_p, seed (required when temperature > 0), max_new_tokens), template,
-- enable_thinking (the chat template's options), max_batch, samples (a JSONL path: one row per
-- sample {dataset, problem, sample, prompt, completion, pred, score, correct, finish_reason,
-- tokens}), pass_k (the k of pass@k; default 1 and k), data_dir (where the shipped files are,
-- default the repository's examples/data/eval), on_progress(done, total, tokens).
-- Returns the report of lunar.eval.metrics.summarize plus report.samples (the rows).
local lunar = require 'lunar'
local tensor = require 'lunar.tensor'
local grade = require 'lunar.eval.grade'
local metrics = require 'lunar.eval.metrics'
local pyjson = require 'lunar.pyjson'

local fail = tensor.fail

local M = {}

-- the shipped evaluation sets: name -> {file, how a row gives its question and gold}
M.DATASETS = {
    ['gsm8k'] = {file = 'gsm8k_test.jsonl', question = 'question',
                 gold = function(row) return grade.gsm8k_gold(row.answer) end},
    ['MATH-500'] = {file = 'math500_aime24_aime25.jsonl', source = 'MATH-500'},
    ['AIME-2024-30'] = {file = 'math500_aime24_aime25.jsonl', source = 'AIME-2024-30'},
    ['AIME-2025-30'] = {file = 'math500_aime24_aime25.jsonl', source = 'AIME-2025-30'},
    -- the tiny RL task's held-out problems (recipes/tools/arith.lua), kept beside its training
    -- data in examples/data/rl
    ['arith'] = {file = '../rl/arith_test.jsonl', question = 'question',
                 gold = function(row) return grade.gsm8k_gold(row.answer) end},
}
M.ORDER = {'gsm8k', 'MATH-500', 'AIME-2024-30', 'AIME-2025-30', 'arith'}

local function default_dir()
    local here = debug.getinfo(1, 'S').source
    -- the embedded copy has no file: the data is found from the working directory then
    local root = here:match('^@(.*)/lua/lunar/eval/run%.lua$')
    return (root or '.') .. '/examples/data/eval'
end

-- the problems of dataset `name`: {{id =, question =, gold =}, ...}
function M.problems(name, opts)
    opts = opts or {}
    local d = M.DATASETS[name]
    if not d then
        fail(('eval: unknown dataset %q (known: %s)'):format(tostring(name), table.concat(M.ORDER, ', ')))
    end
    local path = (opts.data_dir or default_dir()) .. '/' .. d.file
    local f = io.open(path, 'rb')
    if not f then fail(('eval: %s: cannot open %s (set data_dir to the folder of the evaluation files)'):format(name, path)) end
    local out, ln = {}, 0
    for line in f:lines() do
        ln = ln + 1
        if line:find('%S') then
            local ok, row = pcall(lunar.io.decode_json, line)
            if not ok then f:close(); fail(('eval: %s:%d: %s'):format(path, ln, tostring(row))) end
            if not d.source or row.data_source == d.source then
                local q = row[d.question or 'question']
                local gold = d.gold and d.gold(row) or row.ref_answer
                if type(q) ~= 'string' or gold == nil then
                    f:close()
                    fail(('eval: %s:%d: a row without its question or answer'):format(path, ln))
                end
                out[#out + 1] = {id = #out + 1, question = q, gold = tostring(gold)}
                if opts.limit and #out >= opts.limit then break end
            end
        end
    end
    f:close()
    if #out == 0 then fail(('eval: %s: no problem in %s'):format(name, path)) end
    return out
end

function M.run(model, tok, opts)
    opts = opts or {}
    local names = opts.datasets or M.ORDER
    if type(names) == 'string' then names = {names} end
    local k = opts.k or 1
    if type(k) ~= 'number' or k < 1 or k ~= math.floor(k) then fail('eval: k must be a positive integer, got ' .. tostring(k)) end
    local rows, writer = {}, nil
    if opts.samples then
        local dir = opts.samples:match('^(.*)/[^/]*$')
        if dir then lunar.core.fs.mkdir_p(dir) end
        local err
        writer, err = io.open(opts.samples, 'wb')
        if not writer then fail('eval: samples: cannot write ' .. tostring(err)) end
    end
    local total, done, tokens = 0, 0, 0
    local sets = {}
    for i, name in ipairs(names) do
        sets[i] = {name = name, grader = grade.grader_for(name), problems = M.problems(name, opts)}
        total = total + #sets[i].problems * k
    end
    for _, set in ipairs(sets) do
        local prompts = {}
        for i, p in ipairs(set.problems) do
            prompts[i] = {{role = 'user', content = grade.prompt(set.grader, p.question)}}
        end
        local results = lunar.generate(model, prompts, {tokenizer = tok, n = k, max_new_tokens = opts.max_new_tokens,
            temperature = opts.temperature, top_k = opts.top_k, top_p = opts.top_p, min_p = opts.min_p,
            seed = opts.seed, template = opts.template, enable_thinking = opts.enable_thinking,
            max_batch = opts.max_batch,
            on_token = opts.on_progress and function(r, _)
                tokens = tokens + 1
                if r.finish_reason then done = done + 1 end
                opts.on_progress(done, total, tokens)
            end or nil})
        for _, r in ipairs(results) do
            local p = set.problems[r.prompt]
            local g = grade.score(set.grader, r.text or '', p.gold)
            local row = {dataset = set.name, problem = p.id, sample = r.sample, correct = g.correct, score = g.score,
                         pred = g.pred, gold = p.gold, finish_reason = r.finish_reason, tokens = #r.ids,
                         prompt = prompts[r.prompt][1].content, completion = r.text}
            rows[#rows + 1] = row
            if writer then
                writer:write(pyjson.dumps(pyjson.object({{'dataset', row.dataset}, {'problem', row.problem},
                    {'sample', row.sample}, {'correct', row.correct}, {'score', row.score},
                    {'pred', row.pred or pyjson.null}, {'gold', row.gold}, {'finish_reason', row.finish_reason},
                    {'tokens', row.tokens}, {'prompt', row.prompt}, {'completion', row.completion or ''}})), '\n')
            end
        end
    end
    if writer then writer:close() end
    local ks = opts.pass_k
    if not ks then ks = k > 1 and {1, k} or {1} end
    local report = metrics.summarize(rows, {k = ks})
    report.samples = rows
    return report
end

-- the report as lines: dataset, problems, samples per problem, avg@k, pass@k, mean score
function M.format(report)
    local lines = {('%-14s %8s %3s %8s  %s'):format('dataset', 'problems', 'k', 'avg@k', 'pass@k')}
    for _, e in ipairs(report) do
        local ks = {}
        for kk in pairs(e.pass) do ks[#ks + 1] = kk end
        table.sort(ks)
        local parts = {}
        for _, kk in ipairs(ks) do parts[#parts + 1] = ('pass@%d %.4f'):format(kk, e.pass[kk]) end
        lines[#lines + 1] = ('%-14s %8d %3d %8.4f  %s'):format(e.dataset, e.problems, e.n, e.avg, table.concat(parts, '  '))
    end
    return table.concat(lines, '\n')
end

return M
