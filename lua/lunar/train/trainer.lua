-- lunar.train.trainer: the training loop behind recipes/pretrain.lua, sft.lua and lora.lua.
--
--   local trainer = require 'lunar.train.trainer'
--   local result = trainer.run(cfg)     -- cfg: a validated recipe table (recipes/common.lua)
--
-- One step = grad_accum micro-batches (forward + backward, the gradients summed by the modules),
-- then one optimizer step (AdamW with schedule, clipping, non-finite steps skipped and counted),
-- metrics (JSONL, TensorBoard, progress) and, when due, a checkpoint that holds everything a
-- resumed run needs to continue bit for bit: the weights in their training dtype (or the LoRA
-- adapters), the optimizer and scheduler state, the data position and the RNG streams.
--
-- The loss of a step is the mean over every target token of its micro-batches (HF's
-- num_items_in_batch convention), so the number of micro-batches does not change the result.
local lunar = require 'lunar'
local tensor = require 'lunar.tensor'
local data = require 'lunar.data'
local checkpoint = require 'lunar.train.checkpoint'
local metrics_mod = require 'lunar.train.metrics'
local flops = require 'lunar.model.flops'
local fs = require('lunar.core').fs

local M = {}

local fail = tensor.fail

local function log(cfg, fmt, ...)
    if cfg.quiet then return end
    io.stdout:write(('[lunar] ' .. fmt .. '\n'):format(...))
    io.stdout:flush()
end

-- ---- data -----------------------------------------------------------------------------------

local function as_list(x) if type(x) == 'table' then return x end return {x} end

-- documents ({ids =, mask =}) of the configured dataset, and a report of the rejected rows
function M.load_documents(cfg, tok)
    local d = cfg.data
    local max_len = d.max_len or d.seq_len
    local rows, rep, docs
    if d.kind == 'chat' then
        rows, rep = data.read_chat(as_list(d.train), {limit = d.limit, show = 3})
        docs = data.tokenize(rows, function(row)
            return lunar.chat.tokenize(tok, row.messages, {template = d.template, tools = row.tools})
        end, {max_len = max_len, overlong = d.overlong or 'drop', report = rep})
    elseif d.kind == 'prompt_answer' then
        rows, rep = data.read_prompt_answer(as_list(d.train), {prompt = d.prompt_field, answer = d.answer_field,
            system = d.system, limit = d.limit, show = 3})
        docs = data.tokenize(rows, function(row)
            local msgs = {}
            if row.system then msgs[#msgs + 1] = {role = 'system', content = row.system} end
            msgs[#msgs + 1] = {role = 'user', content = row.prompt}
            msgs[#msgs + 1] = {role = 'assistant', content = row.answer}
            return lunar.chat.tokenize(tok, msgs, {template = d.template})
        end, {max_len = max_len, overlong = d.overlong or 'drop', report = rep})
    elseif d.kind == 'text' then
        rows, rep = data.read_text(as_list(d.train), {split = d.split or 'blank'})
        local eos = tok:token_to_id(d.eos_token or '<|endoftext|>')
        -- pretraining text is cut into pieces of max_len (default seq_len) tokens by default, so
        -- a long document is read whole, not its first seq_len tokens every epoch
        docs = data.tokenize(rows, function(row)
            local ids = tok:encode(row.text, {special = false})
            if eos then ids[#ids + 1] = eos end
            return ids
        end, {max_len = max_len, overlong = d.overlong or 'split', report = rep})
    elseif d.kind == 'indexed' then
        return data.indexed_open(d.train), nil
    else
        fail(('data.kind %q is not one of chat, prompt_answer, text, indexed'):format(tostring(d.kind)))
    end
    return docs, rep
end

-- ---- model ------------------------------------------------------------------------------------

local function build_model(cfg, resume_model_dir)
    local mc = cfg.model
    local opts = {dtype = mc.dtype, device = mc.device, seed = mc.seed, indexer_loss_coeff = mc.indexer_loss_coeff,
                  fp32_residual = mc.fp32_residual}
    if resume_model_dir and not cfg.peft then
        return lunar.model.load(resume_model_dir, opts)
    end
    if mc.path then return lunar.model.load(mc.path, opts) end
    if not mc.config then fail('model: set model.path (a checkpoint) or model.config (a config table) in the recipe') end
    return lunar.model.new(mc.config, opts)
end

-- HF tokenizer files that travel with an exported model, so AutoTokenizer loads from its folder
local TOKENIZER_FILES = {'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja'}

-- copies the run's tokenizer into dir: cfg.tokenizer (a tokenizer.json, written under that name,
-- or a folder holding one) and the companion files found beside it
local function copy_tokenizer(cfg, dir)
    local src = cfg.tokenizer
    local st = src and fs.stat(src)
    if not st then return end
    local from = st.type == 'dir' and src or (src:match('^(.*)/[^/]*$') or '.')
    for _, name in ipairs(TOKENIZER_FILES) do
        local path = (name == 'tokenizer.json' and st.type ~= 'dir') and src or (from .. '/' .. name)
        local f = io.open(path, 'rb')
        if f then
            local bytes = f:read('*a')
            f:close()
            lunar.io.write_file(dir .. '/' .. name, bytes)
        end
    end
end

-- the final model (HF format) or adapters (PEFT format) to output.dir, when it is set
local function save_output(cfg, model, adapters)
    local out = cfg.output and cfg.output.dir
    if not out then return end
    if adapters then
        -- adapters of a fresh base (a seeded init, no model.path) are useless without it: the
        -- base is written beside them (<output.dir>/base) and named, by its absolute path (PEFT
        -- reads a path it cannot find as a Hub id), in adapter_config.json
        local base = cfg.model.path or cfg.model.hf_id
        if not base then
            base = out .. '/base'
            model:save_hf(base)
            copy_tokenizer(cfg, base)
            base = fs.realpath(base) or base
            log(cfg, 'saved the base model to %s', base)
        end
        lunar.peft.save(model, out, {base_model_name_or_path = base})
    else
        model:save_hf(out)
    end
    copy_tokenizer(cfg, out)
    log(cfg, 'saved %s to %s', adapters and 'the adapters' or 'the model', out)
end

-- ---- the loop -----------------------------------------------------------------------------------

-- the loss-fall gate: fall >= expect, written so that a NaN fall (a NaN loss) fails it
function M.loss_fell_enough(fall, expect)
    return fall >= expect
end

function M.run(cfg)
    local t_start = lunar.clock()
    if cfg.threads then lunar.threads(cfg.threads) end
    local tok = lunar.tokenizer.load(cfg.tokenizer)
    log(cfg, '%s: tokenizer %s (%d tokens)', cfg.name, cfg.tokenizer, tok:vocab_size())

    local source, rep = M.load_documents(cfg, tok)
    if rep then
        local changed = {}
        for _, what in ipairs({'truncated', 'split'}) do
            if rep.notes[what] then changed[#changed + 1] = ('%d %s'):format(rep.notes[what], what) end
        end
        log(cfg, 'data: %d rows kept%s, %d rejected', rep.n_good,
            #changed > 0 and (' (' .. table.concat(changed, ', ') .. ' at max_len)') or '', rep.n_bad)
        if not cfg.quiet then rep:print() end
    end
    local d = cfg.data
    -- documents longer than a row: split for pretraining data (text, indexed), else as data.overlong says
    local pretraining = d.kind == 'text' or d.kind == 'indexed'
    local loader = data.loader{source = source, seq_len = d.seq_len, micro_batch = d.micro_batch, seed = d.seed,
        shuffle = d.shuffle ~= false, pad_to_multiple = d.pad_to_multiple, quiet = cfg.quiet,
        overlong = d.overlong or (pretraining and 'split' or 'truncate')}

    local cm = checkpoint.manager{dir = cfg.checkpoint.dir, every = cfg.checkpoint.every,
        keep_last = cfg.checkpoint.keep_last}
    local st
    if cfg.checkpoint.resume and cfg.checkpoint.resume ~= 'none' then st = cm:resume(cfg.checkpoint.resume) end

    local model = build_model(cfg, st and st.model_dir)
    local params = model.params
    local adapters
    if cfg.peft then
        -- a resumed LoRA run reads its adapters back (the base weights come from model.path)
        if st then
            adapters = lunar.peft.load(model, st.model_dir)
            -- the dropout stream continues where it stopped (its draws count is in the checkpoint)
            if st.extra and st.extra.lora_rng then adapters:set_rng_state(st.extra.lora_rng) end
        else
            adapters = lunar.peft.apply(model, cfg.peft)
        end
        params = adapters.params
    end
    log(cfg, 'model: %s, %.2fM parameters (%.2fM trainable)', model.cfg.architecture, model.params:count() / 1e6,
        params:count() / 1e6)

    local o = cfg.optim
    local opt = lunar.optim.AdamW.new(params, {
        lr = o.lr, betas = o.betas, eps = o.eps, weight_decay = o.weight_decay, no_decay = o.no_decay,
        clip = o.clip_grad, accum = cfg.train.grad_accum,
        -- a short run (a smoke test with train.steps=N) keeps its warm-up shorter than the run
        schedule = {warmup = math.min(o.warmup or 0, math.floor(cfg.train.steps / 2)), total = cfg.train.steps,
                    decay = o.schedule, min_lr = o.min_lr}})

    local start = 0
    if st then
        opt:load_state_dict(st.optimizer)
        loader:set_state(st.data)
        start = st.step
        log(cfg, 'resumed from %s (step %d)', st.dir, start)
    end
    if start >= cfg.train.steps then
        -- rerunning a finished run trains nothing: say so rather than print an empty summary
        log(cfg, 'nothing to do: %s is at step %d of train.steps=%d (the run finished). Set checkpoint.resume=none '
            .. 'to train afresh, a larger train.steps to continue, or another checkpoint.dir', st.dir, start,
            cfg.train.steps)
        -- the output of a run that died after its last checkpoint (or that asks for one now)
        local out = cfg.output and cfg.output.dir
        if out and not fs.stat(out .. (adapters and '/adapter_config.json' or '/config.json')) then
            save_output(cfg, model, adapters)
        end
        return {model = model, adapters = adapters, losses = {}, optimizer = opt, loader = loader, finished = true,
                seconds = lunar.clock() - t_start, start_step = start}
    end

    local seq = d.seq_len
    local m = metrics_mod.new{dir = cfg.metrics.dir, total_steps = cfg.train.steps, start_step = start,
        warmup_steps = cfg.metrics.warmup_steps, flops_per_token = flops.training_per_token(model.cfg, seq),
        peak_flops = cfg.metrics.peak_flops, progress = (not cfg.quiet) and cfg.metrics.progress, log_every = cfg.train.log_every,
        -- skipped and NaN steps count over the whole run, resumes included
        counts = st and st.metrics or nil,
        -- on a device, the peak of lunar's pool there (the process's resident memory says nothing about it)
        memory = model:device() ~= 'cpu' and model:device() or nil,
        tensorboard = cfg.metrics.tensorboard == false and false or nil}

    local accum = cfg.train.grad_accum
    local losses = {}
    local last_loss, stopped_early
    for step = start + 1, cfg.train.steps do
        local t0 = lunar.clock()
        local batches, targets, tokens = {}, 0, 0
        for i = 1, accum do
            local b = loader:next()
            if not b then fail('data: the loader ran out of batches') end
            batches[i] = b
            targets = targets + b.num_targets
            tokens = tokens + b.num_tokens
        end
        local loss_sum = 0
        for _, b in ipairs(batches) do
            lunar.scope(function()
                local out = model:forward(b, {loss = true, num_items_in_batch = math.max(targets, 1)})
                loss_sum = loss_sum + out.loss
                model:backward()
            end)
        end
        -- the modules summed the gradients of loss_i = sum_i / targets: their sum is the step's
        -- mean loss already, so the optimizer must not divide by the number of micro-batches again
        local info = opt:step{loss = loss_sum, micro_batches = 1}
        opt:zero_grad()
        last_loss = loss_sum
        losses[#losses + 1] = loss_sum
        m:log(step, {loss = loss_sum, grad_norm = info.grad_norm, lr = info.lr, tokens = tokens,
            skipped = info.skipped, time = lunar.clock() - t0})
        if cm:due(step, step == cfg.train.steps) then
            local counts = m:counts()
            cm:save(step, {
                save_model = function(dir)
                    -- the checkpoint keeps the real dropout (PEFT's own files may say 0, see peft.save)
                    if adapters then lunar.peft.save(model, dir, {lora_dropout = cfg.peft.dropout or 0})
                    else model:save_hf(dir, {keep_dtype = true}) end
                end,
                optimizer = opt:state_dict(), data = loader:state(),
                metrics = {loss = loss_sum, skipped_steps = counts.skipped_steps, nan_steps = counts.nan_steps},
                extra = adapters and {lora_rng = adapters:rng_state()} or nil})
        end
        if cfg.stop_after and step >= cfg.stop_after then
            stopped_early = step < cfg.train.steps
            break
        end
    end
    local summary = m:close()
    save_output(cfg, model, adapters)
    -- how far the loss fell: the first step against the mean of the last steps (single steps
    -- are noisy: their documents differ), over this process's steps
    local fall
    if #losses >= 2 then
        local k = math.min(20, math.floor(#losses / 4) + 1)
        local tail = 0
        for i = #losses - k + 1, #losses do tail = tail + losses[i] end
        tail = tail / k
        fall = 1 - tail / losses[1]
        log(cfg, 'loss %.4f at step %d -> %.4f (mean of the last %d steps): %.1f%% lower', losses[1], start + 1, tail, k,
            100 * fall)
        -- the gate holds for a whole run from step 1 (not a resumed or a stopped one)
        if cfg.expect_loss_fall and start == 0 and not stopped_early
            and not M.loss_fell_enough(fall, cfg.expect_loss_fall) then
            fail(('the loss fell by %.1f%%, less than the %.0f%% this recipe expects'):format(100 * fall,
                100 * cfg.expect_loss_fall))
        end
    end
    return {model = model, adapters = adapters, losses = losses, last_loss = last_loss, summary = summary, fall = fall,
            optimizer = opt, loader = loader, seconds = lunar.clock() - t_start, start_step = start}
end

return M
