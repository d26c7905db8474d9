-- recipes/common.lua: what the training recipes share: the defaults of every setting, the
-- presets, the command-line overrides, validation, and the run.
--
--   lunar recipes/sft.lua [preset=tiny] [train.steps=100] [optim.lr=1e-3] ...
--
-- A recipe is the merge, in this order, of: the defaults below, the defaults of its kind
-- (pretrain / sft / lora), the preset's table for that kind (recipes/presets/<preset>.lua), and
-- the dotted overrides of the command line. A key that does not exist is an error naming it; a
-- value of the wrong type too. The resolved recipe is printed before anything runs.
local lunar = require 'lunar'

local M = {}

-- the repository root (recipes/..), for the paths presets use
local here = debug.getinfo(1, 'S').source:match('^@(.*/)') or './'
-- (run from inside recipes/, `here` is './': the root is then its parent)
if here == 'recipes/' or here:match('/recipes/$') then
    M.root = here:gsub('recipes/$', '')
else
    M.root = here .. '../'
end
if M.root == '' then M.root = './' end

-- p with ${VAR} replaced by the environment's value (an unset variable is an error when the
-- path is used, naming it), relative to the repository root unless absolute
function M.path(p)
    if type(p) ~= 'string' then return p end
    p = p:gsub('%${([%w_]+)}', function(v) return os.getenv(v) or ('${' .. v .. '}') end)
    if p:sub(1, 1) == '/' or p:sub(1, 1) == '$' then return p end
    return M.root .. p
end

M.defaults = {
    name = false,                -- default: <preset>_<kind>
    preset = 'tiny',
    quiet = false,
    threads = false,             -- CPU threads (default: LUNAR_THREADS or all cores)
    stop_after = false,          -- stop after this step (as if interrupted; resume continues)
    expect_loss_fall = false,    -- fail the run unless the loss fell by this fraction (0.5 = half)
    model = {
        config = false,          -- an HF config table (a fresh model) ...
        path = false,            -- ... or an HF checkpoint directory
        hf_id = false,           -- where a real preset's weights come from (documentation)
        dtype = 'f32', device = 'cpu', seed = 1234, indexer_loss_coeff = 0,
        fp32_residual = true,    -- bf16/f16 training keeps the residual stream in f32 (Megatron's
                                 -- --fp32-residual-connection; no effect in f32)
    },
    tokenizer = false,           -- tokenizer.json (a file or the checkpoint directory)
    data = {
        kind = 'chat',           -- chat | prompt_answer | text | indexed
        train = false,           -- a path or a list of paths (indexed: the .bin/.idx prefix)
        template = 'glm5', seq_len = 512, micro_batch = 4, seed = 1, shuffle = true,
        max_len = false, overlong = false, limit = false, pad_to_multiple = 1,
        prompt_field = 'question', answer_field = 'answer', system = false, split = 'blank',
        eos_token = '<|endoftext|>',
    },
    train = {steps = 300, grad_accum = 1, log_every = 10},
    optim = {lr = 3e-3, min_lr = 3e-4, warmup = 20, schedule = 'cosine', betas = {0.9, 0.95}, eps = 1e-8,
             weight_decay = 0.1, clip_grad = 1.0, no_decay = false},
    peft = false,                -- LoRA: {r =, alpha =, dropout =, targets = {...}, seed =}
    checkpoint = {dir = false, every = 100, keep_last = 2, resume = 'auto'},
    metrics = {dir = false, tensorboard = true, progress = 'auto', peak_flops = false, warmup_steps = false},
    output = {dir = false},      -- where the final model (or adapters) is written
    parallel = {tp = 1, pp = 1, cp = 1, ep = 1, etp = 1, vpp = 1, layout = false},
    hardware = {nodes = 1, gpus_per_node = 0, gpu = 'cpu'},
}

local function clean(t)
    -- false means "unset" in the defaults: the trainer wants nil
    if type(t) ~= 'table' then return t end
    local out = {}
    for k, v in pairs(t) do
        if v ~= false or k == 'shuffle' or k == 'quiet' or k == 'tensorboard' then out[k] = clean(v) end
    end
    return out
end

local function world(cfg)
    local p = cfg.parallel
    local h = cfg.hardware
    return math.max(1, h.nodes * math.max(h.gpus_per_node, 1)), p
end

-- Build the recipe table for `kind` from the preset and the command line.
function M.recipe(kind, overrides)
    if overrides == nil then
        -- every argument of a recipe is dotted.key=value: anything else (a bare word, a key like
        -- train.step-s or train..steps) is a mistake, not something to skip
        for i = 1, #(arg or {}) do
            if not lunar.config.is_override(arg[i]) then
                error(("recipe argument %q is not key=value with a dotted key (e.g. train.steps=100)"):format(arg[i]), 0)
            end
        end
        overrides = lunar.config.overrides()
    end
    local preset_name = overrides.preset or M.defaults.preset
    local ok, preset = pcall(dofile, M.root .. 'recipes/presets/' .. preset_name .. '.lua')
    if not ok then
        error(('preset %q: %s (presets live in recipes/presets/)'):format(preset_name, tostring(preset)), 0)
    end
    if type(preset[kind]) ~= 'table' then
        error(('preset %q has no %s recipe'):format(preset_name, kind), 0)
    end
    local cfg = lunar.config.merge(M.defaults, preset.common or {})
    cfg = lunar.config.merge(cfg, preset[kind])
    local preset_steps = cfg.train.steps
    cfg = lunar.config.merge(cfg, overrides)
    -- a preset's expected loss fall holds for its own schedule: a run of another length (a smoke
    -- test with train.steps=20) is not held to it unless the command line sets expect_loss_fall
    if cfg.train.steps ~= preset_steps and overrides.expect_loss_fall == nil then cfg.expect_loss_fall = false end
    cfg.preset = preset_name
    if not cfg.name then cfg.name = preset_name .. '_' .. kind end
    if not cfg.checkpoint.dir then cfg.checkpoint.dir = 'runs/' .. cfg.name .. '/checkpoints' end
    if not cfg.metrics.dir then cfg.metrics.dir = 'runs/' .. cfg.name end
    cfg.kind = kind
    cfg.tokenizer = M.path(cfg.tokenizer)
    if type(cfg.data.train) == 'table' then
        for i, p in ipairs(cfg.data.train) do cfg.data.train[i] = M.path(p) end
    else
        cfg.data.train = M.path(cfg.data.train)
    end
    if cfg.model.path then cfg.model.path = M.path(cfg.model.path) end
    return cfg
end

-- print the resolved recipe (one line per setting, sorted)
function M.print(cfg)
    if cfg.quiet then return end
    local lines = {}
    local function walk(t, prefix)
        local keys = {}
        for k in pairs(t) do keys[#keys + 1] = k end
        table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
        for _, k in ipairs(keys) do
            local v = t[k]
            local name = prefix and (prefix .. '.' .. tostring(k)) or tostring(k)
            if type(v) == 'table' and #v == 0 and next(v) ~= nil and not (k == 'config') then
                walk(v, name)
            elseif type(v) == 'table' and k == 'config' then
                lines[#lines + 1] = ('  %-28s (%s, %d layers, hidden %d)'):format(name, tostring(v.architectures and
                    v.architectures[1] or v.model_type), v.num_hidden_layers or 0, v.hidden_size or 0)
            elseif type(v) == 'table' then
                local parts = {}
                for i, x in ipairs(v) do parts[i] = tostring(x) end
                lines[#lines + 1] = ('  %-28s {%s}'):format(name, table.concat(parts, ', '))
            else
                lines[#lines + 1] = ('  %-28s %s'):format(name, tostring(v))
            end
        end
    end
    walk(cfg, nil)
    print(('recipe %s (%s, preset %s):'):format(cfg.name, cfg.kind, cfg.preset))
    print(table.concat(lines, '\n'))
end

-- Check that this process can run the recipe: the real GLM-5.x presets describe multi-GPU jobs
-- (their layouts are the ones the seeds validated) that this version of lunar cannot execute yet.
function M.check_runnable(cfg)
    local n, p = world(cfg)
    if n > 1 then
        error(('recipe %s describes a %d-GPU job (%d node%s x %d %s; TP%d PP%d CP%d EP%d): multi-rank training '
            .. 'is not implemented in this version of lunar; the tiny preset runs on one CPU process'):format(
            cfg.name, n, cfg.hardware.nodes, cfg.hardware.nodes == 1 and '' or 's', cfg.hardware.gpus_per_node,
            cfg.hardware.gpu, p.tp, p.pp, p.cp, p.ep), 0)
    end
    -- cpu:N (N >= 1) are the debug devices of LUNAR_FAKE_CPU_DEVICES
    local kind, index = tostring(cfg.model.device):match('^(%a+):?(%d*)$')
    local have = (kind == 'cpu' or kind == 'cuda') and lunar.device_count(kind) or 0
    if have <= (tonumber(index) or 0) then
        error(('recipe %s wants model.device=%s but %s'):format(cfg.name, cfg.model.device,
            kind == 'cuda' and 'no such CUDA device is available' or 'there is no such device'), 0)
    end
    if not cfg.tokenizer then error(('recipe %s: set tokenizer (a tokenizer.json)'):format(cfg.name), 0) end
    for _, p in ipairs({cfg.tokenizer, cfg.model.path or nil}) do
        local var = type(p) == 'string' and p:match('%${([%w_]+)}')
        if var then error(('recipe %s: %s needs the environment variable %s'):format(cfg.name, p, var), 0) end
    end
    if not cfg.data.train then error(('recipe %s: set data.train'):format(cfg.name), 0) end
end

-- Check the values the types alone do not: every error names the key and what it accepts.
function M.validate(cfg)
    local function bad(key, v, want)
        error(('recipe %s: %s=%s: %s'):format(cfg.name, key, tostring(v), want), 0)
    end
    local function int(key, v, min)
        if type(v) ~= 'number' or v ~= math.floor(v) or v < min then
            bad(key, v, ('expected an integer >= %d'):format(min))
        end
    end
    local d, t, o = cfg.data, cfg.train, cfg.optim
    local kinds = {chat = true, prompt_answer = true, text = true, indexed = true}
    if not kinds[d.kind] then bad('data.kind', d.kind, 'expected chat, prompt_answer, text or indexed') end
    if d.overlong and not require('lunar.data.pack').OVERLONG[d.overlong] then
        bad('data.overlong', d.overlong, 'expected drop, truncate or split')
    end
    if d.kind == 'chat' or d.kind == 'prompt_answer' then
        if not pcall(lunar.chat.template_name, d.template) then
            bad('data.template', d.template, 'expected glm45 (GLM-4.5/4.6) or glm5 (GLM-4.7/GLM-5)')
        end
    end
    int('data.seq_len', d.seq_len, 1)
    int('data.micro_batch', d.micro_batch, 1)
    int('data.pad_to_multiple', d.pad_to_multiple, 1)
    if d.max_len then int('data.max_len', d.max_len, 1) end
    if d.limit then int('data.limit', d.limit, 1) end
    int('train.steps', t.steps, 1)
    int('train.grad_accum', t.grad_accum, 1)
    int('train.log_every', t.log_every, 1)
    if cfg.stop_after then int('stop_after', cfg.stop_after, 1) end
    int('checkpoint.every', cfg.checkpoint.every, 0)
    int('checkpoint.keep_last', cfg.checkpoint.keep_last, 0)
    int('optim.warmup', o.warmup, 0)
    if not (o.lr > 0) then bad('optim.lr', o.lr, 'expected a positive number') end
    if not (o.min_lr >= 0) then bad('optim.min_lr', o.min_lr, 'expected a number >= 0') end
    local elf = cfg.expect_loss_fall
    if elf and not (type(elf) == 'number' and elf > 0 and elf < 1) then
        bad('expect_loss_fall', cfg.expect_loss_fall, 'expected a fraction in (0, 1), or false')
    end
end

function M.run(kind, overrides)
    local cfg = M.recipe(kind, overrides)
    M.validate(cfg)
    M.print(cfg)
    M.check_runnable(cfg)
    local run_cfg = clean(cfg)
    return require('lunar.train.trainer').run(run_cfg), cfg
end

return M
