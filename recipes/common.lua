-- recipes/common.lua: what the training recipes share: the defaults of every setting, the
-- presets, the command line, validation, and the run.
--
--   lunar recipes/sft.lua [preset=tiny] [train.steps=100] [optim.lr=1e-3] ...
--   lunar recipes/sft.lua --help        every setting, its value in this recipe and its meaning
--   lunar recipes/sft.lua --dry-run     (or plan=true) the resolved recipe, the model's size and
--                                       memory, the data's rows, tokens and packing; no training
--
-- A recipe is the merge, in this order, of: the defaults below, the preset's common table and
-- its table for the recipe's kind (recipes/presets/<preset>.lua), and the dotted overrides of
-- the command line. A key that does not exist is an error naming it; a value of the wrong type
-- too. The resolved recipe is printed before anything runs. Paths a preset names are relative
-- to the repository; paths given on the command line are relative to the current directory.
--
-- The defaults table is also the documentation: `--help` prints each key with the comment on
-- its line (and the comment lines right below it), so every setting has one line of meaning
-- (tests/lua/test_recipe_cli.lua checks that none is missing).
local lunar = require 'lunar'
local core = require 'lunar.core'

local M = {}

-- the repository root (recipes/..), for the paths presets use
local here = debug.getinfo(1, 'S').source:match('^@(.*/)') or './'
M.source = (debug.getinfo(1, 'S').source:match('^@(.*)$'))
-- (run from inside recipes/, `here` is './': the root is then its parent)
if here == 'recipes/' or here:match('/recipes/$') then
    M.root = here:gsub('recipes/$', '')
else
    M.root = here .. '../'
end
if M.root == '' then M.root = './' end

M.defaults = {
    name = false,                -- the run's name (default <preset>_<kind>); outputs go under runs/<name>/
    preset = 'tiny',             -- recipes/presets/<preset>.lua: tiny (one CPU), glm5_2, glm5_3
    plan = false,                -- print the plan (recipe, model size and memory, data, packing) and exit
    quiet = false,               -- no per-step lines or progress bar (the end-of-run summary stays)
    threads = false,             -- CPU threads for kernels (default: LUNAR_THREADS or all cores)
    stop_after = false,          -- stop after this step (as if interrupted; resume continues)
    expect_loss_fall = false,    -- fail the run unless the loss fell by this fraction (0.5 = half)
    model = {
        config = false,          -- an HF config table (a fresh model from a seeded init) ...
        path = false,            -- ... or an HF checkpoint directory to start from
        hf_id = false,           -- where a real preset's weights come from (documentation only)
        dtype = 'f32',           -- parameter dtype: f32, bf16 or f16
        device = 'cpu',          -- cpu, cuda or cuda:N
        seed = 1234,             -- seed of a fresh model's initialisation
        indexer_loss_coeff = 0,  -- weight of the DSA indexer's KL loss (0: off)
        fp32_residual = true,    -- bf16/f16 training keeps the residual stream in f32 (Megatron's
                                 -- --fp32-residual-connection; no effect in f32)
        strict = false,          -- a checkpoint must hold every tensor its config declares (the MTP
                                 -- layer too; by default a checkpoint without it loads with it off)
    },
    tokenizer = false,           -- tokenizer.json, or a checkpoint directory holding one
    data = {
        kind = 'chat',           -- chat | prompt_answer | text | indexed
        train = false,           -- a path or a list of paths (indexed: the .bin/.idx prefix)
        valid = false,           -- validation data (same kind), evaluated every train.eval_every steps
        template = 'glm5',       -- chat template: glm5 (GLM-4.7/GLM-5) or glm45 (GLM-4.5/4.6)
        seq_len = 512,           -- tokens per packed row
        micro_batch = 4,         -- rows per micro-batch
        seed = 1,                -- seed of the data order
        shuffle = true,          -- shuffle the documents and rows each epoch
        packing = 'bfd',         -- bfd (best fit decreasing over a shuffle buffer) or first_fit
        pack_buffer = 10000,     -- documents per packing buffer (bfd)
        max_len = false,         -- longest sample in tokens (default seq_len)
        overlong = false,        -- a longer sample: drop, truncate or split (default: drop for chat and
                                 -- prompt_answer, split for text and indexed)
        max_rejected = 0.1,      -- fail when more than this fraction of the rows is rejected
        limit = false,           -- read at most this many rows (a quick run)
        pad_to_multiple = 1,     -- round each document's slots up to a multiple of this
        prompt_field = 'question', -- prompt_answer: the prompt's JSON field
        answer_field = 'answer', -- prompt_answer: the answer's JSON field
        system = false,          -- prompt_answer: a system message for every row
        split = 'blank',         -- text: documents end at blank lines (blank), per file or per line
        eos_token = '<|endoftext|>', -- text: the token that ends each document
    },
    train = {
        steps = 300,             -- optimizer steps
        grad_accum = 1,          -- micro-batches per step
        log_every = 10,          -- a progress line every N steps (when not on a terminal)
        eval_every = 0,          -- evaluate data.valid every N steps (0: only at the end)
        eval_batches = 0,        -- rounds of micro_batch x dp rows per evaluation (0: all of data.valid)
        max_skipped_in_a_row = 10, -- stop (with a checkpoint) after this many consecutive skipped steps
    },
    optim = {
        lr = 3e-3,               -- peak learning rate
        min_lr = 3e-4,           -- learning rate at the end of the decay
        warmup = 20,             -- linear warm-up steps (a preset's is cut to half a shorter run, and said)
        schedule = 'cosine',     -- decay after warm-up: cosine, linear or constant
        betas = {0.9, 0.95},     -- AdamW's beta1 and beta2
        eps = 1e-8,              -- AdamW's epsilon
        weight_decay = 0.1,      -- decoupled weight decay (not on norms and biases)
        clip_grad = 1.0,         -- clip the global gradient norm to this (0: off)
        no_decay = false,        -- a list of Lua patterns of parameter names without weight decay
    },
    benchmark = {
        every = 0,               -- answer math benchmarks every N steps and at the end (0: never)
        datasets = {'gsm8k'},    -- which: gsm8k, MATH-500, AIME-2024-30, AIME-2025-30
        limit = 50,              -- problems per dataset
        k = 1,                   -- samples per problem (avg@k, pass@k)
        max_new_tokens = 256,    -- tokens per answer
        temperature = 0,         -- 0 is greedy
        seed = 1,                -- sampling seed (temperature > 0)
        enable_thinking = false, -- the chat template's thinking switch: false ends the prompt with
                                 -- </think>, as SFT rows without reasoning are rendered
        data_dir = false,        -- the evaluation files (default: the repository's examples/data/eval)
    },
    peft = false,                -- LoRA: {r =, alpha =, dropout =, targets = {...}, seed =}
    checkpoint = {
        dir = false,             -- where checkpoints go (default runs/<name>/checkpoints)
        every = 100,             -- a checkpoint every N steps (and one at the end)
        keep_last = 2,           -- keep the newest N checkpoints (0: all)
        resume = 'auto',         -- auto (the newest sound checkpoint), none, or a checkpoint directory
        allow_changes = false,   -- resume even when the data, model or batch settings differ from the
                                 -- checkpoint's (the run is then not the one it continues)
    },
    metrics = {
        dir = false,             -- metrics.jsonl and tb/ (default runs/<name>)
        tensorboard = true,      -- write TensorBoard event files
        progress = 'auto',       -- auto (a bar on a terminal), bar, lines
        peak_flops = false,      -- one device's peak FLOP/s, for MFU (989e12: H100 BF16)
        warmup_steps = false,    -- steps left out of the summary's means (default min(10, steps/5))
    },
    output = {
        dir = false,             -- the final model or adapters (default runs/<name>/final)
    },
    parallel = {
        tp = 1,                  -- tensor parallel degree
        pp = 1,                  -- pipeline parallel degree
        cp = 1,                  -- context parallel degree
        ep = 1,                  -- expert parallel degree
        etp = 1,                 -- expert tensor parallel degree
        sequence_parallel = false, -- tp > 1: the norms and the residual on each tp rank's share of the rows
        split_indexer = false,   -- tp > 1: the DSA indexer's heads split too (all-reduces B x T x T scores)
        vpp = 1,                 -- virtual pipeline stages per rank
        layout = false,          -- a custom layout (documentation of a preset)
        distributed_optimizer = true, -- data parallel: shard the AdamW state over the ranks (ZeRO-1);
                                 -- false keeps a whole copy on every rank
        bucket_mb = 16,          -- data parallel: MiB of f32 gradients per bucket reduced during backward
    },
    hardware = {
        nodes = 1,               -- nodes the job runs on
        gpus_per_node = 0,       -- GPUs per node (0: the CPU)
        gpu = 'cpu',             -- the accelerator (for documentation and MFU)
    },
}

-- the settings only the RL recipes (gsm8k.lua: GRPO, dapo.lua: DAPO) have, merged over the ones
-- above for those kinds; data.train and data.valid are then JSONL files of problems (a question
-- and a gold answer per row), train.steps counts rollout steps and train.eval_every the greedy
-- accuracy on data.valid
M.rl_defaults = {
    rl = {
        reward = 'gsm8k',        -- the grader (lunar.rl.rewards: gsm8k, gsm8k_verl, gsm8k_verl_flexible, dapo,
                                 -- dapo_skyrl, math) or, in a preset, a function(response, gold, info)
        on_reward_error = 'error', -- a reward function that fails: error (stop, naming the sample) or skip
                                 -- (the sample scores nothing and trains nothing; counted)
        advantage = 'grpo',      -- grpo (group-normalised) or rloo (leave-one-out baseline)
        std_normalize = true,    -- grpo: divide by the group's std (false: Dr. GRPO)
        std_eps = 1e-6,          -- grpo: added to the group's std
        n = 8,                   -- samples per prompt (the group)
        prompts = 16,            -- prompts per rollout step (the rollout batch)
        mini_batches = 1,        -- optimizer steps per rollout step (the prompts split in as many groups)
        micro_batch = 16,        -- responses per forward and backward
        epochs = 1,              -- passes over the rollout batch (PPO epochs)
        eps_low = 0.2,           -- the ratio's lower clip: 1 - eps_low
        eps_high = 0.2,          -- the ratio's upper clip: 1 + eps_high (DAPO's clip-higher: 0.28)
        dual_clip = false,       -- dual-clip constant c (> 1): caps the loss of A < 0 at c |A| (false: off)
        loss_reduction = 'token-mean', -- token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm
        kl_coef = 0,             -- KL to the reference policy (the starting weights; LoRA: the base) (0: off)
        kl_estimator = 'k3',     -- k1, k2 or k3
        kl_in_reward = false,    -- the KL as a per-token reward penalty instead of a loss term
        entropy_coef = 0,        -- entropy bonus in the loss (0: off; the entropy is logged always)
        tis_cap = false,         -- truncated importance sampling against the rollout logprobs: the cap (false: off)
        routing_replay = true,   -- R3: the training forwards route every token as generation did (MoE models)
        share_prompts = true,    -- a group's samples share one copy of their prompt in the packed micro-batch
        dynamic_sampling = false, -- DAPO: drop groups whose accuracy is all equal and generate more prompts
        max_gen_batches = 10,    -- dynamic sampling: rollout rounds per step at most (0: unlimited)
        overlong_buffer = 0,     -- DAPO soft overlong penalty over the last N tokens before rollout.max_new_tokens (0: off)
        overlong_penalty = 1.0,  -- the penalty at rollout.max_new_tokens
        overlong_filter = false, -- truncated responses train nothing (their reward still counts in the group)
        eval_limit = 200,        -- problems of data.valid in each evaluation (greedy accuracy)
    },
    rollout = {
        max_prompt_len = 512,    -- longer prompts are left out of the prompt set (counted)
        max_new_tokens = 256,    -- the response budget
        temperature = 1.0,       -- sampling temperature (the trainer divides its logits by it too)
        top_k = 0,               -- 0: off
        top_p = 1.0,             -- 1: off
        min_p = 0,               -- 0: off
        seed = 1,                -- sampling seed (each step, round and prompt draws from its own stream)
        max_batch = 64,          -- sequences decoding together at most
        enable_thinking = false, -- the chat template's thinking switch: false ends the prompt in </think>, as
                                 -- rows without reasoning are rendered for SFT; true leaves the model to think
    },
}

-- settings that name a file or directory
local PATH_KEYS = {'tokenizer', 'model.path', 'data.train', 'data.valid', 'output.dir', 'checkpoint.dir',
    'metrics.dir'}
-- those a preset may name relative to the repository (its shipped inputs)
local PRESET_INPUT_KEYS = {tokenizer = true, ['model.path'] = true, ['data.train'] = true, ['data.valid'] = true}

local function get(t, key)
    for part in key:gmatch('[^.]+') do
        if type(t) ~= 'table' then return nil end
        t = t[part]
    end
    return t
end

local function set(t, key, v)
    local parts = {}
    for part in key:gmatch('[^.]+') do parts[#parts + 1] = part end
    for i = 1, #parts - 1 do
        if type(t[parts[i]]) ~= 'table' then return end
        t = t[parts[i]]
    end
    t[parts[#parts]] = v
end

-- p with ${VAR} replaced by the environment's value (an unset variable stays, and is an error
-- naming it when the path is used)
local function expand(p)
    return (p:gsub('%${([%w_]+)}', function(v) return os.getenv(v) or ('${' .. v .. '}') end))
end

-- p expanded, and relative to the repository root unless absolute (a preset's inputs)
function M.path(p)
    if type(p) ~= 'string' then return p end
    p = expand(p)
    if p:sub(1, 1) == '/' or p:sub(1, 1) == '$' then return p end
    return M.root .. p
end

-- applies fn to the path (or each path of a list) at key
local function map_paths(t, key, fn)
    local v = get(t, key)
    if type(v) == 'string' then
        set(t, key, fn(v))
    elseif type(v) == 'table' then
        local out = {}
        for i, p in ipairs(v) do out[i] = type(p) == 'string' and fn(p) or p end
        set(t, key, out)
    end
end

local function copy(t)
    if type(t) ~= 'table' then return t end
    local out = {}
    for k, v in pairs(t) do out[k] = copy(v) end
    return setmetatable(out, getmetatable(t))
end

-- the recipe kinds that train by reinforcement learning (lunar.rl.trainer)
M.RL_KINDS = {grpo = true, dapo = true}

-- the defaults of a recipe kind: M.defaults, and M.rl_defaults over them for the RL kinds
function M.defaults_of(kind)
    if not M.RL_KINDS[kind] then return M.defaults end
    local out = copy(M.defaults)
    for k, v in pairs(M.rl_defaults) do out[k] = copy(v) end
    return out
end

local function clean(t)
    -- false means "unset" in the defaults: the trainer wants nil
    if type(t) ~= 'table' then return t end
    local out = {}
    for k, v in pairs(t) do
        if v ~= false or k == 'shuffle' or k == 'quiet' or k == 'tensorboard' or k == 'distributed_optimizer'
            or k == 'enable_thinking' then
            out[k] = clean(v)
        end
    end
    return out
end

M.clean = clean

-- a user's mistake: one line naming the setting, no traceback into lunar (lunar --traceback
-- shows it)
local function user_error(msg) core.user_error(msg) end
M.user_error = user_error

-- ---- the command line -----------------------------------------------------------------------------

-- flags a recipe takes besides key=value
local FLAGS = {['--help'] = 'help', ['-h'] = 'help', ['--dry-run'] = 'plan', ['--traceback'] = 'traceback'}

-- the recipe's arguments: overrides and flags ({help =, plan =, traceback =})
function M.arguments(args)
    local flags = {}
    local list = {}
    for i = 1, #args do
        local a = args[i]
        if FLAGS[a] then
            flags[FLAGS[a]] = true
        elseif lunar.config.is_override(a) then
            list[#list + 1] = a
        else
            -- anything else (a bare word, a key like train.step-s or train..steps) is a mistake,
            -- not something to skip
            user_error(("recipe argument %q is not key=value with a dotted key (e.g. train.steps=100); "
                .. "--help lists the settings"):format(a))
        end
    end
    local ok, overrides = pcall(lunar.config.parse, list)
    if not ok then user_error(lunar.config.strip_where(overrides)) end
    return overrides, flags
end

-- ---- the recipe -------------------------------------------------------------------------------------

local function load_preset(name)
    local ok, preset = pcall(dofile, M.root .. 'recipes/presets/' .. name .. '.lua')
    if not ok then
        user_error(('preset %q: %s (presets live in recipes/presets/)'):format(name, tostring(preset)))
    end
    return preset
end

-- a list setting given one value: data.train=a.jsonl means {'a.jsonl'}
local LIST_KEYS = {'data.train', 'data.valid'}

-- Build the recipe table for `kind` from the preset and the command line (or `overrides`).
function M.recipe(kind, overrides)
    if overrides == nil then overrides = M.arguments(arg or {}) end
    local preset_name = overrides.preset or M.defaults.preset
    local preset = load_preset(preset_name)
    if type(preset[kind]) ~= 'table' then user_error(('preset %q has no %s recipe'):format(preset_name, kind)) end
    local function merge(a, b)
        local ok, out = pcall(lunar.config.merge, a, b)
        if not ok then user_error(('recipe %s: %s'):format(kind, lunar.config.strip_where(out))) end
        return out
    end
    -- a preset's inputs are relative to the repository, before the command line is merged in
    local layers = {}
    for i, t in ipairs({preset.common or {}, preset[kind]}) do
        layers[i] = copy(t)
        for key in pairs(PRESET_INPUT_KEYS) do map_paths(layers[i], key, M.path) end
    end
    local cfg = merge(M.defaults_of(kind), layers[1])
    cfg = merge(cfg, layers[2])
    local preset_steps, preset_warmup = cfg.train.steps, cfg.optim.warmup
    overrides = copy(overrides)
    for _, key in ipairs(LIST_KEYS) do
        if type(get(overrides, key)) == 'string' and type(get(cfg, key)) == 'table' then
            set(overrides, key, {get(overrides, key)})
        end
    end
    for _, key in ipairs(PATH_KEYS) do map_paths(overrides, key, expand) end
    cfg = merge(cfg, overrides)
    cfg.notes = {}
    -- a preset's expected loss fall holds for its own schedule: a run of another length (a smoke
    -- test with train.steps=20) is not held to it unless the command line sets expect_loss_fall
    if cfg.train.steps ~= preset_steps and overrides.expect_loss_fall == nil then cfg.expect_loss_fall = false end
    -- ... and so does its warm-up: a shorter run warms up over at most half its steps, and says so
    local o_warmup = overrides.optim and overrides.optim.warmup
    if o_warmup == nil and type(cfg.optim.warmup) == 'number' and cfg.optim.warmup > math.floor(cfg.train.steps / 2) then
        cfg.optim.warmup = math.floor(cfg.train.steps / 2)
        cfg.notes[#cfg.notes + 1] = ('optim.warmup: the preset\'s %d warm-up steps are cut to %d, half of '
            .. 'train.steps=%d (set optim.warmup to choose)'):format(preset_warmup, cfg.optim.warmup, cfg.train.steps)
    end
    cfg.preset = preset_name
    if not cfg.name then cfg.name = preset_name .. '_' .. kind end
    if not cfg.checkpoint.dir then cfg.checkpoint.dir = 'runs/' .. cfg.name .. '/checkpoints' end
    if not cfg.metrics.dir then cfg.metrics.dir = 'runs/' .. cfg.name end
    if not cfg.output.dir then cfg.output.dir = 'runs/' .. cfg.name .. '/final' end
    if not cfg.benchmark.data_dir then cfg.benchmark.data_dir = M.path('examples/data/eval') end
    cfg.kind = kind
    return cfg
end

-- ---- printing ---------------------------------------------------------------------------------------

local function value_string(k, v)
    if type(v) == 'table' and k == 'config' then
        return ('(%s, %d layers, hidden %d)'):format(tostring(v.architectures and v.architectures[1] or v.model_type),
            v.num_hidden_layers or 0, v.hidden_size or 0)
    elseif type(v) == 'table' then
        local parts = {}
        for i, x in ipairs(v) do parts[i] = tostring(x) end
        local keys = {}
        for kk in pairs(v) do if type(kk) ~= 'number' then keys[#keys + 1] = kk end end
        table.sort(keys)
        for _, kk in ipairs(keys) do parts[#parts + 1] = kk .. '=' .. value_string(kk, v[kk]) end
        return '{' .. table.concat(parts, ', ') .. '}'
    end
    return tostring(v)
end

-- the settings as {key = dotted name, value =} in order, descending into tables of settings
local function settings_of(cfg, defaults)
    local out = {}
    local function walk(t, d, prefix)
        local keys = {}
        for k in pairs(t) do
            if k ~= 'notes' and k ~= 'kind' and k ~= '__open' then keys[#keys + 1] = k end
        end
        table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
        for _, k in ipairs(keys) do
            local v = t[k]
            local name = prefix and (prefix .. '.' .. tostring(k)) or tostring(k)
            local dv = type(d) == 'table' and d[k] or nil
            if type(v) == 'table' and type(dv) == 'table' and #dv == 0 and next(dv) ~= nil then
                walk(v, dv, name)
            else
                out[#out + 1] = {key = name, value = v, text = value_string(k, v)}
            end
        end
    end
    walk(cfg, defaults, nil)
    return out
end

-- print the resolved recipe (one line per setting, sorted), then its notes
function M.print(cfg)
    -- under mpirun, rank 0 speaks for the job
    if lunar.dist.env().rank ~= 0 then return end
    if cfg.quiet then
        for _, n in ipairs(cfg.notes or {}) do print('note: ' .. n) end
        return
    end
    local lines = {}
    for _, s in ipairs(settings_of(cfg, M.defaults_of(cfg.kind))) do
        lines[#lines + 1] = ('  %-28s %s'):format(s.key, s.text)
    end
    print(('recipe %s (%s, preset %s):'):format(cfg.name, cfg.kind, cfg.preset))
    print(table.concat(lines, '\n'))
    for _, n in ipairs(cfg.notes or {}) do print('note: ' .. n) end
end

-- the meaning of each setting: the comments of a defaults table in a recipe's source, by
-- default this file's M.defaults ({['optim.lr'] = 'peak learning rate', ...}); `head` is the
-- Lua pattern of the line that opens the table
function M.help_texts(source, head)
    source, head = source or M.source, head or 'M%.defaults = {'
    local f = source and io.open(source, 'r')
    if not f then return {} end
    local src = f:read('*a')
    f:close()
    local body = src:match('\n' .. head .. '\n(.-)\n}\n')
    local out, stack, last = {}, {}, nil
    for line in (body or ''):gmatch('[^\n]+') do
        local key, rest = line:match('^%s*([%a_][%w_]*)%s*=%s*(.-)%s*$')
        local comment = line:match('%-%-%s*(.-)%s*$')
        if key and rest:match('^{%s*$') or (key and rest:match('^{%s*%-%-')) then
            stack[#stack + 1] = key
            last = nil
        elseif key then
            local name = table.concat(stack, '.') .. (#stack > 0 and '.' or '') .. key
            out[name] = comment or ''
            last = name
        elseif line:match('^%s*},?%s*$') then
            stack[#stack] = nil
            last = nil
        elseif comment and last and line:match('^%s*%-%-') then
            out[last] = out[last] .. ' ' .. comment
        end
    end
    return out
end

-- --help: every setting, its value in this recipe (preset applied) and its meaning
function M.help(kind, cfg, defaults, texts)
    if not texts then
        texts = M.help_texts()
        if M.RL_KINDS[kind] then
            for k, v in pairs(M.help_texts(M.source, 'M%.rl_defaults = {')) do texts[k] = v end
        end
    end
    local out = {('usage: lunar recipes/%s.lua [key=value ...] [--help] [--dry-run] [--traceback]'):format(kind),
        '',
        cfg.preset and ('Settings of the %s recipe (values: the defaults with preset %s applied; key=value on the '
            .. 'command line overrides them, key=false unsets one):'):format(kind, cfg.preset)
            or ('Settings of the %s recipe (key=value on the command line overrides them):'):format(kind)}
    for _, s in ipairs(settings_of(cfg, defaults or M.defaults_of(kind))) do
        local text = s.text
        if #text > 30 then text = text:sub(1, 27) .. '...' end
        out[#out + 1] = ('  %-28s %-30s %s'):format(s.key, text, texts[s.key] or '')
    end
    out[#out + 1] = ''
    out[#out + 1] = 'Flags: --help (this list), --dry-run (as plan=true), --traceback (tracebacks of user errors too).'
    return table.concat(out, '\n')
end

-- ---- checks ---------------------------------------------------------------------------------------

-- Check that this process can run the recipe. Under a launcher with several ranks the recipe
-- runs data parallel, with the attention heads and MLP widths split over parallel.tp ranks, the
-- routed experts spread over parallel.ep ranks and their matrices over parallel.etp (pp = cp = vpp
-- = 1; docs/parallel.md). A layout that does not fit the number of ranks, and the parallel
-- degrees not implemented yet (pipeline, context, virtual pipeline), refuse on every rank before
-- any work, naming the numbers.
function M.check_runnable(cfg)
    local env = lunar.dist.env()
    -- the parallel settings against the world (every refusal of a layout: lunar.parallel.state)
    require('lunar.parallel.state').check(cfg, env.size)
    -- cpu:N (N >= 1) are the debug devices of LUNAR_FAKE_CPU_DEVICES
    local kind, index = tostring(cfg.model.device):match('^(%a+):?(%d*)$')
    local have = (kind == 'cpu' or kind == 'cuda') and lunar.device_count(kind) or 0
    if have <= (tonumber(index) or 0) then
        local why = 'there is no such device'
        if kind == 'cuda' then
            local _, status = lunar.cuda_status()
            why = have == 0 and status or ('there are %d CUDA devices'):format(have)
        end
        user_error(('recipe %s wants model.device=%s but %s'):format(cfg.name, cfg.model.device, why))
    end
    if not cfg.tokenizer then user_error(('recipe %s: set tokenizer (a tokenizer.json)'):format(cfg.name)) end
    for _, key in ipairs(PATH_KEYS) do
        local v = get(cfg, key)
        for _, p in ipairs(type(v) == 'table' and v or {v}) do
            local var = type(p) == 'string' and p:match('%${([%w_]+)}')
            if var then user_error(('recipe %s: %s=%s needs the environment variable %s'):format(cfg.name, key, p, var)) end
        end
    end
    if not cfg.data.train then user_error(('recipe %s: set data.train'):format(cfg.name)) end
    if cfg.benchmark.every > 0 then
        local evaluate = require 'lunar.eval.run'
        for _, name in ipairs(cfg.benchmark.datasets) do
            local file = cfg.benchmark.data_dir .. '/' .. evaluate.DATASETS[name].file
            if not core.fs.stat(file) then
                user_error(('recipe %s: benchmark.datasets: %s needs %s, which does not exist (set benchmark.data_dir)')
                    :format(cfg.name, name, file))
            end
        end
    end
    local fs = core.fs
    local function exists(key, p, want)
        local st = fs.stat(p)
        if not st then user_error(('recipe %s: %s=%s: no such %s'):format(cfg.name, key, p, want)) end
        return st
    end
    exists('tokenizer', cfg.tokenizer, 'file or directory')
    if cfg.model.path then
        local st = exists('model.path', cfg.model.path, 'directory')
        if st.type ~= 'dir' then user_error(('recipe %s: model.path=%s is not a directory (an HF checkpoint directory)')
            :format(cfg.name, cfg.model.path)) end
    end
    for _, key in ipairs({'data.train', 'data.valid'}) do
        local v = get(cfg, key)
        if v then
            for _, p in ipairs(type(v) == 'table' and v or {v}) do
                if cfg.data.kind == 'indexed' then
                    exists(key, p .. '.idx', 'Megatron index (.idx)')
                else
                    local st = exists(key, p, 'file')
                    if st.type == 'dir' and cfg.data.kind ~= 'text' then
                        user_error(('recipe %s: %s=%s is a directory; %s data is read from JSONL files (list them)')
                            :format(cfg.name, key, p, cfg.data.kind))
                    end
                end
            end
        end
    end
end

-- Check the values the types alone do not: every error names the key and what it accepts.
function M.validate(cfg)
    local function bad(key, v, want)
        user_error(('recipe %s: %s=%s: %s'):format(cfg.name, key, value_string(key, v), want))
    end
    local function int(key, v, min)
        if type(v) ~= 'number' or v ~= math.floor(v) or v < min then
            bad(key, v, ('expected an integer >= %d'):format(min))
        end
    end
    local function fraction(key, v, lo_open)
        if type(v) ~= 'number' or v ~= v or v > 1 or v < 0 or (lo_open and v == 0) then
            bad(key, v, 'expected a fraction in ' .. (lo_open and '(0, 1]' or '[0, 1]'))
        end
    end
    local function one_of(key, v, list)
        for _, x in ipairs(list) do if v == x then return end end
        bad(key, v, 'expected ' .. table.concat(list, ', '))
    end
    local d, t, o, c, m = cfg.data, cfg.train, cfg.optim, cfg.checkpoint, cfg.model
    one_of('data.kind', d.kind, {'chat', 'prompt_answer', 'text', 'indexed'})
    if d.overlong then one_of('data.overlong', d.overlong, {'drop', 'truncate', 'split'}) end
    if d.kind == 'chat' or d.kind == 'prompt_answer' then
        if not pcall(lunar.chat.template_name, d.template) then
            bad('data.template', d.template, 'expected glm45 (GLM-4.5/4.6) or glm5 (GLM-4.7/GLM-5)')
        end
    end
    one_of('data.packing', d.packing, {'bfd', 'first_fit'})
    int('data.pack_buffer', d.pack_buffer, 1)
    int('data.seq_len', d.seq_len, 1)
    int('data.micro_batch', d.micro_batch, 1)
    int('data.pad_to_multiple', d.pad_to_multiple, 1)
    if d.seq_len % d.pad_to_multiple ~= 0 then
        bad('data.pad_to_multiple', d.pad_to_multiple, ('data.seq_len=%d must be a multiple of it'):format(d.seq_len))
    end
    if d.max_len then int('data.max_len', d.max_len, 1) end
    if d.limit then int('data.limit', d.limit, 1) end
    int('data.seed', d.seed, 0)
    fraction('data.max_rejected', d.max_rejected)
    one_of('data.split', d.split, {'blank', 'file', 'line'})
    int('train.steps', t.steps, 1)
    int('train.grad_accum', t.grad_accum, 1)
    int('train.log_every', t.log_every, 1)
    int('train.eval_every', t.eval_every, 0)
    int('train.eval_batches', t.eval_batches, 0)
    int('train.max_skipped_in_a_row', t.max_skipped_in_a_row, 0)
    local bm = cfg.benchmark
    int('benchmark.every', bm.every, 0)
    int('benchmark.limit', bm.limit, 1)
    int('benchmark.k', bm.k, 1)
    int('benchmark.max_new_tokens', bm.max_new_tokens, 1)
    if not (bm.temperature >= 0) then bad('benchmark.temperature', bm.temperature, 'expected a number >= 0') end
    local known = require('lunar.eval.run').DATASETS
    for _, name in ipairs(bm.datasets) do
        if not known[name] then bad('benchmark.datasets', bm.datasets, 'unknown dataset ' .. tostring(name)
            .. ' (known: ' .. table.concat(require('lunar.eval.run').ORDER, ', ') .. ')') end
    end
    if cfg.stop_after then int('stop_after', cfg.stop_after, 1) end
    int('checkpoint.every', c.every, 0)
    int('checkpoint.keep_last', c.keep_last, 0)
    if type(c.resume) ~= 'string' then bad('checkpoint.resume', c.resume, "expected auto, none or a checkpoint directory") end
    if c.resume ~= 'auto' and c.resume ~= 'none' then
        local ckpt = require 'lunar.train.checkpoint'
        local st = core.fs.stat(c.resume)
        if not st or st.type ~= 'dir' then
            bad('checkpoint.resume', c.resume, 'no such directory; expected auto, none or a checkpoint directory '
                .. '(<checkpoint.dir>/step_N)')
        end
        local marker, why = ckpt.check(c.resume, {checksums = false})
        if not marker then bad('checkpoint.resume', c.resume, 'not a usable checkpoint: ' .. why) end
    end
    one_of('model.dtype', m.dtype, {'f32', 'bf16', 'f16'})
    if not m.config and not m.path then
        user_error(('recipe %s: set model.path (an HF checkpoint directory) or model.config'):format(cfg.name))
    end
    int('optim.warmup', o.warmup, 0)
    if o.warmup >= t.steps and o.schedule ~= 'constant' then
        bad('optim.warmup', o.warmup, ('as long as the run or longer (train.steps=%d), which leaves no steps to decay '
            .. 'over; set optim.warmup < train.steps'):format(t.steps))
    end
    if not (o.lr > 0) then bad('optim.lr', o.lr, 'expected a positive number') end
    if not (o.min_lr >= 0) then bad('optim.min_lr', o.min_lr, 'expected a number >= 0') end
    if o.min_lr > o.lr then bad('optim.min_lr', o.min_lr, ('above optim.lr=%g'):format(o.lr)) end
    one_of('optim.schedule', o.schedule, {'cosine', 'linear', 'constant'})
    local b = o.betas
    if type(b) ~= 'table' or #b ~= 2 or type(b[1]) ~= 'number' or type(b[2]) ~= 'number'
        or not (b[1] >= 0 and b[1] < 1 and b[2] >= 0 and b[2] < 1) then
        bad('optim.betas', b, 'expected two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]')
    end
    if not (o.eps > 0) then bad('optim.eps', o.eps, 'expected a positive number') end
    if not (o.weight_decay >= 0) then bad('optim.weight_decay', o.weight_decay, 'expected a number >= 0') end
    if not (o.clip_grad >= 0) then bad('optim.clip_grad', o.clip_grad, 'expected a number >= 0 (0: off)') end
    local elf = cfg.expect_loss_fall
    if elf and not (type(elf) == 'number' and elf > 0 and elf < 1) then
        bad('expect_loss_fall', cfg.expect_loss_fall, 'expected a fraction in (0, 1), or false')
    end
    if cfg.kind == 'lora' and not cfg.peft then bad('peft', cfg.peft, 'the lora recipe needs peft = {r =, alpha =, targets = {...}}') end
    local p = cfg.peft
    if p then
        if type(p) ~= 'table' then bad('peft', p, 'expected a table {r =, alpha =, targets = {...}, dropout =, seed =}') end
        local known = {r = true, alpha = true, dropout = true, targets = true, seed = true, exclude = true,
                       include_mtp = true, rslora = true}
        for k in pairs(p) do
            if not known[k] then bad('peft.' .. tostring(k), p[k], 'unknown LoRA setting (known: alpha, dropout, '
                .. 'exclude, include_mtp, r, rslora, seed, targets)') end
        end
        int('peft.r', p.r, 1)
        if type(p.alpha) ~= 'number' or not (p.alpha > 0) then bad('peft.alpha', p.alpha, 'expected a positive number') end
        if type(p.targets) ~= 'table' or #p.targets == 0 then
            bad('peft.targets', p.targets, "expected a list of module names or patterns, e.g. peft.targets=[q_a_proj,o_proj]")
        end
        if p.dropout ~= nil and not (type(p.dropout) == 'number' and p.dropout >= 0 and p.dropout < 1) then
            bad('peft.dropout', p.dropout, 'expected a number in [0, 1)')
        end
        if p.seed ~= nil then int('peft.seed', p.seed, 0) end
    end
    if cfg.threads then int('threads', cfg.threads, 1) end
end

-- Check the RL settings (the kinds of M.RL_KINDS): every error names the key and what it accepts.
function M.validate_rl(cfg)
    local function bad(key, v, want)
        user_error(('recipe %s: %s=%s: %s'):format(cfg.name, key, value_string(key, v), want))
    end
    local function int(key, v, min)
        if type(v) ~= 'number' or v ~= math.floor(v) or v < min then bad(key, v, ('expected an integer >= %d'):format(min)) end
    end
    local function num(key, v, ok, want)
        if type(v) ~= 'number' or v ~= v or not ok(v) then bad(key, v, want) end
    end
    local function one_of(key, v, list)
        for _, x in ipairs(list) do if v == x then return end end
        bad(key, v, 'expected ' .. table.concat(list, ', '))
    end
    local rl, ro = cfg.rl, cfg.rollout
    if type(rl.reward) == 'string' then
        one_of('rl.reward', rl.reward, require('lunar.rl.rewards').NAMES)
    elseif type(rl.reward) ~= 'function' then
        bad('rl.reward', rl.reward, 'expected a grader name or, in a preset, a function(response, gold, info)')
    end
    one_of('rl.on_reward_error', rl.on_reward_error, {'error', 'skip'})
    one_of('rl.advantage', rl.advantage, {'grpo', 'rloo'})
    int('rl.n', rl.n, 1)
    if rl.n == 1 and (rl.advantage == 'rloo' or rl.std_normalize) then
        bad('rl.n', rl.n, rl.advantage == 'rloo' and 'RLOO needs at least 2 samples per prompt (a baseline of the others)'
            or 'a group of one sample has no std to normalise by (and an advantage of 0): set rl.n >= 2, or '
            .. 'rl.std_normalize=false')
    end
    num('rl.std_eps', rl.std_eps, function(v) return v >= 0 end, 'expected a number >= 0')
    int('rl.prompts', rl.prompts, 1)
    int('rl.mini_batches', rl.mini_batches, 1)
    if rl.prompts % rl.mini_batches ~= 0 then
        bad('rl.mini_batches', rl.mini_batches, ('rl.prompts=%d must split evenly into it (a group is never split)')
            :format(rl.prompts))
    end
    int('rl.micro_batch', rl.micro_batch, 1)
    int('rl.epochs', rl.epochs, 1)
    num('rl.eps_low', rl.eps_low, function(v) return v >= 0 and v < 1 end, 'expected a number in [0, 1)')
    num('rl.eps_high', rl.eps_high, function(v) return v >= 0 end, 'expected a number >= 0')
    if rl.dual_clip then num('rl.dual_clip', rl.dual_clip, function(v) return v > 1 end, 'expected a number > 1, or false') end
    one_of('rl.loss_reduction', rl.loss_reduction, {'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean',
        'seq-mean-token-sum-norm'})
    num('rl.kl_coef', rl.kl_coef, function(v) return v >= 0 end, 'expected a number >= 0 (0: off)')
    one_of('rl.kl_estimator', rl.kl_estimator, {'k1', 'k2', 'k3'})
    num('rl.entropy_coef', rl.entropy_coef, function(v) return v >= 0 end, 'expected a number >= 0 (0: off)')
    if rl.tis_cap then num('rl.tis_cap', rl.tis_cap, function(v) return v > 0 end, 'expected a number > 0, or false') end
    int('rl.max_gen_batches', rl.max_gen_batches, 0)
    int('rl.overlong_buffer', rl.overlong_buffer, 0)
    num('rl.overlong_penalty', rl.overlong_penalty, function(v) return v >= 0 end, 'expected a number >= 0')
    int('rl.eval_limit', rl.eval_limit, 1)
    int('rollout.max_prompt_len', ro.max_prompt_len, 1)
    int('rollout.max_new_tokens', ro.max_new_tokens, 1)
    if rl.overlong_buffer >= ro.max_new_tokens then
        bad('rl.overlong_buffer', rl.overlong_buffer, ('must be below rollout.max_new_tokens=%d'):format(ro.max_new_tokens))
    end
    num('rollout.temperature', ro.temperature, function(v) return v > 0 end,
        'expected a number > 0 (the samples of a group must differ; greedy rollouts give them no spread)')
    int('rollout.top_k', ro.top_k, 0)
    num('rollout.top_p', ro.top_p, function(v) return v > 0 and v <= 1 end, 'expected a number in (0, 1]')
    num('rollout.min_p', ro.min_p, function(v) return v >= 0 and v < 1 end, 'expected a number in [0, 1)')
    int('rollout.seed', ro.seed, 0)
    int('rollout.max_batch', ro.max_batch, 1)
end

-- run_tool(kind, defaults, source, fn[, overrides]): a recipe that is not a training run
-- (generate, eval): its defaults table (declared in `source` as `local defaults = {`, one
-- setting a line with its meaning as a comment, for --help), merged with the command line (or
-- `overrides`), printed unless quiet, then fn(cfg). Returns what fn returns, and cfg.
function M.run_tool(kind, defaults, source, fn, overrides)
    local flags = {}
    if overrides == nil then overrides, flags = M.arguments(arg or {}) end
    if flags.traceback then core.show_tracebacks(true) end
    local ok, cfg = pcall(lunar.config.merge, defaults, overrides)
    if not ok then user_error(('recipe %s: %s'):format(kind, lunar.config.strip_where(cfg))) end
    if flags.help then
        print(M.help(kind, cfg, defaults, M.help_texts(source, 'local defaults = {')))
        return nil, cfg
    end
    cfg.kind = kind
    if not cfg.quiet then
        print(('recipe %s:'):format(kind))
        for _, s in ipairs(settings_of(cfg, defaults)) do print(('  %-28s %s'):format(s.key, s.text)) end
    end
    return fn(cfg), cfg
end

-- Runs the recipe `kind`: the command line's (or `overrides`') settings, checked, printed, then
-- trained (or planned). A user's mistake found before training is one line naming the setting.
function M.run(kind, overrides)
    local flags = {}
    if overrides == nil then overrides, flags = M.arguments(arg or {}) end
    if flags.traceback then core.show_tracebacks(true) end
    local cfg = M.recipe(kind, overrides)
    if flags.help then
        print(M.help(kind, cfg))
        return nil, cfg
    end
    if flags.plan then cfg.plan = true end
    M.validate(cfg)
    if M.RL_KINDS[kind] then M.validate_rl(cfg) end
    M.print(cfg)
    M.check_runnable(cfg)
    local trainer = require(M.RL_KINDS[kind] and 'lunar.rl.trainer' or 'lunar.train.trainer')
    if cfg.plan then return trainer.plan(clean(cfg)), cfg end
    return trainer.run(clean(cfg)), cfg
end

return M
