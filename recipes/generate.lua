-- recipes/generate.lua: completions for a JSONL of prompts, from a checkpoint, with lunar.generate.
--   lunar recipes/generate.lua [model.path=runs/tiny_sft/final] [input=prompts.jsonl]
--       [output=runs/generate/completions.jsonl] [temperature=0.7 seed=1 n=4 max_new_tokens=512] ...
-- Each input row is {"prompt": "text"} (sent as one user message through the chat template),
-- {"messages": [...]} (a chat, rendered with the generation prompt) or {"prompt_ids": [...]}; the
-- output has one row per sample: {index, sample, prompt, completion, ids, finish_reason, logprob
-- (the sum of the tokens' logprobs), tokens}. By default the model of the main job
-- (runs/tiny_sft/final) answers the shipped GSM8K test questions.
local common = dofile(((arg and arg[0] or 'recipes/generate.lua'):match('^(.*/)') or './') .. 'common.lua')
local lunar = require 'lunar'
local pyjson = require 'lunar.pyjson'
local source = debug.getinfo(1, 'S').source:match('^@(.*)$')

local defaults = {
    model = {
        path = 'runs/tiny_sft/final', -- an HF checkpoint directory (lunar's exports are)
        dtype = 'f32',           -- f32, bf16 or f16
        device = 'cpu',          -- cpu, cuda or cuda:N
    },
    tokenizer = false,           -- tokenizer.json (default: the one in model.path)
    input = false,               -- JSONL of prompts ({"prompt"}, {"messages"}, {"prompt_ids"}); default: the
                                 -- shipped GSM8K test questions (examples/data/eval/gsm8k_test.jsonl)
    prompt_field = 'prompt',     -- the JSON field holding a text prompt (GSM8K's is question)
    limit = 8,                   -- read at most this many prompts (false: all)
    output = 'runs/generate/completions.jsonl', -- one JSONL row per sample
    n = 1,                       -- samples per prompt (they share one prefill)
    max_new_tokens = 256,        -- tokens to generate at most per sample
    temperature = 0,             -- 0 is greedy
    top_k = 0,                   -- keep the k most likely tokens (0: off)
    top_p = 1,                   -- keep the most likely tokens up to this probability (1: off)
    min_p = 0,                   -- keep tokens at least this fraction of the most likely one (0: off)
    seed = false,                -- sampling seed (required when temperature > 0); prompt i uses seed + i - 1
    stop = false,                -- a list of stop strings
    template = 'glm5',           -- chat template: glm5 or glm45
    enable_thinking = false,     -- the template's thinking switch (false: an empty thinking block)
    max_batch = 64,              -- sequences that decode together at most
    quiet = false,               -- no settings and progress lines
}

local function read_prompts(cfg)
    local f, err = io.open(cfg.input, 'rb')
    if not f then common.user_error(('input=%s: cannot open it (%s)'):format(cfg.input, tostring(err))) end
    local prompts, ln = {}, 0
    local field = cfg.prompt_field
    for line in f:lines() do
        ln = ln + 1
        if line:find('%S') then
            local ok, row = pcall(lunar.io.decode_json, line)
            if not ok or type(row) ~= 'table' then
                f:close()
                common.user_error(('input=%s:%d: not a JSON object'):format(cfg.input, ln))
            end
            local p
            if row.messages then p = {messages = row.messages, tools = row.tools}
            elseif row.prompt_ids then p = {ids = row.prompt_ids}
            elseif type(row[field]) == 'string' then p = {{role = 'user', content = row[field]}}
            elseif field == 'prompt' and type(row.question) == 'string' then p = {{role = 'user', content = row.question}}
            else
                f:close()
                common.user_error(('input=%s:%d: no "messages", "prompt_ids" or "%s" field (set prompt_field)'):format(
                    cfg.input, ln, field))
            end
            prompts[#prompts + 1] = p
            if cfg.limit and #prompts >= cfg.limit then break end
        end
    end
    f:close()
    if #prompts == 0 then common.user_error(('input=%s: no prompt in it'):format(cfg.input)) end
    return prompts
end

local function text_of(p)
    if p.ids then return nil end
    local m = p.messages or p
    return m[#m] and m[#m].content
end

common.run_tool('generate', defaults, source, function(cfg)
    local fs = lunar.core.fs
    cfg.input = cfg.input or common.path('examples/data/eval/gsm8k_test.jsonl')
    local st = fs.stat(cfg.model.path)
    if not st or st.type ~= 'dir' then
        common.user_error(('model.path=%s: no such checkpoint directory (run recipes/sft.lua first, or set model.path)')
            :format(cfg.model.path))
    end
    local tok_path = cfg.tokenizer or (cfg.model.path .. '/tokenizer.json')
    local tok = lunar.config.setting_error('tokenizer=' .. tok_path, lunar.tokenizer.load, tok_path)
    local model = lunar.config.setting_error('model.path=' .. cfg.model.path, lunar.model.load, cfg.model.path,
        {dtype = cfg.model.dtype, device = cfg.model.device})
    local prompts = read_prompts(cfg)
    local total = #prompts * cfg.n
    local done, tokens, t0, shown = 0, 0, lunar.clock(), 0
    local tty = fs.isatty(1)
    local function progress(final)
        local dt = lunar.clock() - t0
        local line = ('generate %d/%d requests | %d tokens | %.1f tokens/s'):format(done, total, tokens,
            tokens / math.max(dt, 1e-9))
        if tty then io.stdout:write('\r', line, final and '\n' or '') else print(line) end
        io.stdout:flush()
    end
    local results = lunar.config.setting_error('generate', lunar.generate, model, prompts, {
        tokenizer = tok, n = cfg.n, max_new_tokens = cfg.max_new_tokens, temperature = cfg.temperature,
        top_k = cfg.top_k, top_p = cfg.top_p, min_p = cfg.min_p, seed = cfg.seed or nil, stop = cfg.stop or nil,
        template = cfg.template, enable_thinking = cfg.enable_thinking, max_batch = cfg.max_batch,
        on_token = function(r)
            tokens = tokens + 1
            if r.finish_reason then
                done = done + 1
                -- a line every tenth of the requests (every request on a terminal)
                if not cfg.quiet and (tty or done - shown >= math.max(1, math.floor(total / 10))) then
                    shown = done
                    progress(false)
                end
            end
        end})
    if not cfg.quiet and (tty or shown ~= done) then progress(true) end
    local dir = cfg.output:match('^(.*)/[^/]*$')
    if dir then fs.mkdir_p(dir) end
    local lines = {}
    for _, r in ipairs(results) do
        local lp = 0
        for _, x in ipairs(r.logprobs) do lp = lp + x end
        lines[#lines + 1] = pyjson.dumps(pyjson.object({{'index', r.prompt}, {'sample', r.sample},
            {'prompt', text_of(prompts[r.prompt]) or pyjson.null}, {'completion', r.text or pyjson.null},
            {'ids', pyjson.array(r.ids)}, {'finish_reason', r.finish_reason}, {'logprob', lp}, {'tokens', #r.ids}}))
    end
    lunar.io.write_file(cfg.output, table.concat(lines, '\n') .. '\n')
    if not cfg.quiet then print(('[lunar] wrote %d completions to %s'):format(#results, cfg.output)) end
    return results
end)
