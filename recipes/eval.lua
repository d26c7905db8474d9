-- recipes/eval.lua: a checkpoint on the shipped math benchmarks (GSM8K test, MATH-500, AIME 2024
-- and 2025), k samples per problem, graded as verl and SkyRL grade them (lunar.eval.grade):
-- avg@k and pass@k per dataset, and one JSONL row per sample.
--   lunar recipes/eval.lua [model.path=runs/tiny_sft/final] [datasets=[gsm8k,MATH-500]] [k=4
--       temperature=0.6 seed=1] [limit=50] [samples=runs/eval/samples.jsonl]
-- The report also goes to <samples without .jsonl>.report.json. lunar.eval.run does the work, so a
-- training loop can evaluate the same way every N steps.
local common = dofile(((arg and arg[0] or 'recipes/eval.lua'):match('^(.*/)') or './') .. 'common.lua')
local lunar = require 'lunar'
local evaluate = require 'lunar.eval.run'
local source = debug.getinfo(1, 'S').source:match('^@(.*)$')

local defaults = {
    model = {
        path = 'runs/tiny_sft/final', -- an HF checkpoint directory (lunar's exports are)
        dtype = 'f32',           -- f32, bf16 or f16
        device = 'cpu',          -- cpu, cuda or cuda:N
    },
    tokenizer = false,           -- tokenizer.json (default: the one in model.path)
    datasets = {'gsm8k', 'MATH-500', 'AIME-2024-30', 'AIME-2025-30'}, -- the benchmarks to run
    limit = 20,                  -- problems per dataset (false: every problem)
    k = 1,                       -- samples per problem (avg@k, pass@k)
    pass_k = false,              -- the k of pass@k to report (default: 1 and k)
    max_new_tokens = 256,        -- tokens to generate at most per sample
    temperature = 0,             -- 0 is greedy (then k = 1 makes sense)
    top_p = 1,                   -- nucleus sampling (1: off)
    seed = false,                -- sampling seed (required when temperature > 0)
    template = 'glm5',           -- chat template: glm5 or glm45
    enable_thinking = false,     -- the template's thinking switch
    max_batch = 64,              -- sequences that decode together at most
    samples = 'runs/eval/samples.jsonl', -- one JSONL row per sample (false: none)
    quiet = false,               -- no settings and progress lines
}

common.run_tool('eval', defaults, source, function(cfg)
    local fs = lunar.core.fs
    local st = fs.stat(cfg.model.path)
    if not st or st.type ~= 'dir' then
        common.user_error(('model.path=%s: no such checkpoint directory (run recipes/sft.lua first, or set model.path)')
            :format(cfg.model.path))
    end
    if cfg.temperature > 0 and not cfg.seed then
        common.user_error(('temperature=%g samples: set seed= (every sample then comes out the same on every run)')
            :format(cfg.temperature))
    end
    for _, name in ipairs(cfg.datasets) do
        if not evaluate.DATASETS[name] then
            common.user_error(('datasets: unknown dataset %q (known: %s)'):format(tostring(name),
                table.concat(evaluate.ORDER, ', ')))
        end
    end
    local tok_path = cfg.tokenizer or (cfg.model.path .. '/tokenizer.json')
    local tok = lunar.config.setting_error('tokenizer=' .. tok_path, lunar.tokenizer.load, tok_path)
    local model = lunar.config.setting_error('model.path=' .. cfg.model.path, lunar.model.load, cfg.model.path,
        {dtype = cfg.model.dtype, device = cfg.model.device})
    local tty, t0, shown = fs.isatty(1), lunar.clock(), 0
    local report = lunar.config.setting_error('eval', evaluate.run, model, tok, {
        datasets = cfg.datasets, k = cfg.k, limit = cfg.limit or nil, pass_k = cfg.pass_k or nil,
        max_new_tokens = cfg.max_new_tokens, temperature = cfg.temperature, top_p = cfg.top_p,
        seed = cfg.seed or nil, template = cfg.template, enable_thinking = cfg.enable_thinking,
        max_batch = cfg.max_batch, samples = cfg.samples or nil, data_dir = common.path('examples/data/eval'),
        on_progress = not cfg.quiet and function(done, total, tokens)
            if done ~= shown and (tty or done == total or done - shown >= math.max(1, math.floor(total / 10))) then
                shown = done
                local line = ('eval %d/%d samples | %d tokens | %.1f tokens/s'):format(done, total, tokens,
                    tokens / math.max(lunar.clock() - t0, 1e-9))
                if tty then io.stdout:write('\r', line, done == total and '\n' or '') else print(line) end
                io.stdout:flush()
            end
        end or nil})
    print(evaluate.format(report))
    if cfg.samples then
        local out = cfg.samples:gsub('%.jsonl$', '') .. '.report.json'
        local entries = {}
        for i, e in ipairs(report) do
            local pass = {}
            for kk, v in pairs(e.pass) do pass['pass@' .. kk] = v end
            entries[i] = {dataset = e.dataset, problems = e.problems, k = e.n, avg = e.avg, pass = pass,
                          mean_score = e.mean_score}
        end
        lunar.io.write_json(out, {model = cfg.model.path, datasets = lunar.io.array(entries)})
        print(('[lunar] samples in %s, report in %s'):format(cfg.samples, out))
    end
    return report
end)
