-- lunar.train.runner: what every trainer's run shares (lunar.train.trainer: pretrain, SFT, LoRA;
-- lunar.rl.trainer: GRPO, DAPO): the setup of the run's parallel state, model, adapters,
-- optimizer, schedule and checkpoints, and the tail of every step: metrics, evaluation, signals,
-- checkpoints, the final output.
--
--   local runner = require 'lunar.train.runner'
--   local r = runner.begin(cfg, check_model)  -- {cfg, mcfg, dp, tok}: the parallel state (one voice:
--                                          -- rank 0 prints and writes), the model config checked,
--                                          -- the output directories tried, the tokenizer
--   runner.build(r, adamw_opts, {after_model = fn(r) -> note})   -- r.cm, r.st (the checkpoint
--                                          -- resumed), r.model, r.adapters, r.opt, r.schedule
--   local m = runner.metrics(r, {flops_per_token =})
--   local stop, early = runner.loop(r, m, {step =, eval =, eval_due =, save =, after_step =, max_skipped =})
--   runner.raise_stop(r, stop)                -- a stopped run's one line (after the summary)
--   runner.save_checkpoint(r, step, m, data_state, metric_counts)
--   local model, written = runner.write_final(r); runner.save_output(cfg, model, adapters, written)
--
-- A checkpoint holds everything a resumed run needs to continue bit for bit: the weights in their
-- training dtype (or the LoRA adapters; a split model as its ranks' pieces), the optimizer and
-- scheduler state, the data position, the RNG streams, the recipe it was trained with and the
-- layout. A resumed run's recipe and layout are compared with the checkpoint's first: a
-- difference that changes the data order or the model is refused (unless
-- checkpoint.allow_changes), another layout reshards the optimizer state (lunar.optim.reshard).
-- During the run, SIGTERM or a first Ctrl-C finishes the step, writes a checkpoint and stops
-- (non-zero exit); a second one ends the process at once.
local lunar = require 'lunar'
local core = require 'lunar.core'
local checkpoint = require 'lunar.train.checkpoint'
local metrics_mod = require 'lunar.train.metrics'
local recipe_diff = require 'lunar.train.recipe_diff'
local data_parallel = require 'lunar.train.data_parallel'
local parallel_state = require 'lunar.parallel.state'
local sharded = require 'lunar.parallel.checkpoint'
local export = require 'lunar.train.export'
local dist = require 'lunar.dist'
local schedule = require 'lunar.parallel.schedule'

local fs = core.fs
local user_error = core.user_error
local setting_error, strip_where = lunar.config.setting_error, lunar.config.strip_where

local M = {}

local function log(cfg, fmt, ...)
    if cfg.quiet then return end
    io.stdout:write(('[lunar] ' .. fmt .. '\n'):format(...))
    io.stdout:flush()
end

local function mib(bytes) return ('%.1f MiB'):format(bytes / 2 ^ 20) end


-- ---- model ------------------------------------------------------------------------------------

-- the validated model config of the recipe (from model.config or model.path), without building it
local function model_config(cfg)
    if cfg.model.path then return lunar.model.config.load(cfg.model.path .. '/config.json') end
    return lunar.model.config.from_table(cfg.model.config, 'model.config')
end

local function build_model(cfg, resume_model_dir, dp)
    local mc = cfg.model
    local opts = dp:model_opts()   -- (the layout's groups: lunar.parallel.state)
    opts.dtype, opts.device, opts.seed, opts.indexer_loss_coeff = mc.dtype, mc.device, mc.seed, mc.indexer_loss_coeff
    opts.fp32_residual, opts.strict = mc.fp32_residual, mc.strict or nil
    if resume_model_dir and not cfg.peft then
        return lunar.model.load(resume_model_dir, opts)
    end
    if mc.path then return lunar.model.load(mc.path, opts) end
    return lunar.model.new(mc.config, opts)
end

-- ---- outputs ------------------------------------------------------------------------------------

-- the files that travel with an exported model so that transformers loads it with its tokenizer,
-- chat template and generation defaults
local TOKENIZER_FILES = {'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja'}
local BASE_COMPANIONS = {'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
    'special_tokens_map.json', 'chat_template.jinja'}

local function copy_file(from, to)
    local f = io.open(from, 'rb')
    if not f then return false end
    local bytes = f:read('*a')
    f:close()
    if bytes == nil then return false end   -- a directory
    lunar.io.write_file(to, bytes)
    return true
end

-- copies into dir the companions of the base checkpoint (model.path: its generation config,
-- tokenizer files and chat template), then the run's tokenizer (cfg.tokenizer: a tokenizer.json,
-- written under that name, or a folder holding one, with the companion files found beside it),
-- which wins where both have a file: it is the one the model was trained with
local function copy_companions(cfg, dir)
    if cfg.model.path then
        for _, name in ipairs(BASE_COMPANIONS) do copy_file(cfg.model.path .. '/' .. name, dir .. '/' .. name) end
    end
    local src = cfg.tokenizer
    local st = src and fs.stat(src)
    if not st then return end
    local from = st.type == 'dir' and src or (src:match('^(.*)/[^/]*$') or '.')
    for _, name in ipairs(TOKENIZER_FILES) do
        local path = (name == 'tokenizer.json' and st.type ~= 'dir') and src or (from .. '/' .. name)
        copy_file(path, dir .. '/' .. name)
    end
end

-- the final model (HF format) or adapters (PEFT format) to output.dir
local function save_output(cfg, model, adapters, written)
    local out = cfg.output and cfg.output.dir
    if not out then return end
    if adapters then
        -- adapters are named with their base by its absolute path (PEFT reads a path it cannot find
        -- as a Hub id); adapters of a fresh base (a seeded init, no model.path) are useless without
        -- it, so the base is written beside them (<output.dir>/base)
        local base = cfg.model.path and (fs.realpath(cfg.model.path) or cfg.model.path)
        if not base then
            base = out .. '/base'
            model:save_hf(base)
            copy_companions(cfg, base)
            base = fs.realpath(base) or base
            log(cfg, 'saved the base model to %s', base)
        end
        local _, gaps = lunar.peft.save(model, out, {base_model_name_or_path = base})
        -- adapters PEFT cannot apply come with the merged model (<out>/merged), which needs the tokenizer too
        if gaps and #gaps > 0 then copy_companions(cfg, out .. '/merged') end
    elseif not written then   -- (a split model was written by every rank: lunar.train.export)
        model:save_hf(out)
    end
    copy_companions(cfg, out)
    log(cfg, 'saved %s to %s', adapters and 'the adapters' or 'the model', out)
end

-- every directory the run writes must be writable before the first step, not found at the end.
-- The checkpoint and metrics directories are made now; the output directory is made to be
-- tried, then removed again with the parents made for it (a stopped run leaves no empty one).
local function check_writable(cfg)
    for _, key in ipairs({'checkpoint.dir', 'metrics.dir', 'output.dir'}) do
        local sect, k = key:match('^(%w+)%.(%w+)$')
        local dir = cfg[sect] and cfg[sect][k]
        if dir then
            local ok, err = pcall(function()
                local made = {}
                if key == 'output.dir' then
                    local p = dir:gsub('/+$', '')
                    while p ~= '' and p ~= '.' and not fs.stat(p) do
                        made[#made + 1] = p
                        p = p:match('^(.*)/[^/]*$') or ''
                    end
                end
                fs.mkdir_p(dir)
                local probe = ('%s/.lunar_write_test.%d'):format(dir, fs.getpid())
                local f, why = io.open(probe, 'wb')
                if not f then error(why, 0) end
                f:close()
                os.remove(probe)
                for _, p in ipairs(made) do os.remove(p) end   -- deepest first
            end)
            if not ok then
                user_error(('%s=%s cannot be written: %s'):format(key, dir, strip_where(err)))
            end
        end
    end
end

-- ---- resuming -----------------------------------------------------------------------------------

-- the checkpoint to resume from, or nil to start afresh. With resume=auto, a directory whose
-- checkpoints are all unusable is refused (a quiet fresh start would overwrite that history):
-- each one is listed with the reason.
local function find_checkpoint(cfg, cm)
    local mode = cfg.checkpoint.resume
    if not mode or mode == 'none' then return nil end
    if mode ~= 'auto' then return cm:resume(mode) end
    local st, skipped = cm:resume('auto')
    if st then return st end
    local lines = {}
    for _, s in ipairs(skipped or {}) do
        if s.dir:match('/step_%d+$') then lines[#lines + 1] = ('  %s: %s'):format(s.dir, s.reason) end
    end
    if #lines > 0 then
        user_error(('checkpoint.dir=%s holds %d checkpoint%s and none can be resumed:\n%s\nSet checkpoint.resume=none '
            .. 'to start afresh (the directory is kept), or checkpoint.resume=<a checkpoint directory> to name one')
            :format(cfg.checkpoint.dir, #lines, #lines == 1 and '' or 's', table.concat(lines, '\n')))
    end
    return nil
end

-- compares the recipe a checkpoint was written with against this run's: differences that change
-- the data order or the model refuse (unless checkpoint.allow_changes), the others are printed
-- the global batch in rows of a checkpoint's run and of this one: data.micro_batch x
-- train.grad_accum x dp (nil when the checkpoint does not say: the RL recipes' batch is their
-- prompts, and older checkpoints)
local function global_rows(cfg, st, dp)
    local lc = type(st.data) == 'table' and type(st.data.config) == 'table' and st.data.config
    local saved = st.extra and st.extra.recipe
    if not (lc and lc.micro_batch and lc.dp_size and saved and cfg.data and cfg.data.micro_batch) then return nil end
    local accum = tonumber(saved['train.grad_accum']) or 1
    local was = {rows = lc.micro_batch * accum * lc.dp_size, mb = lc.micro_batch, accum = accum, dp = lc.dp_size}
    local dpn = dp.size
    local now = {rows = cfg.data.micro_batch * cfg.train.grad_accum * dpn, mb = cfg.data.micro_batch,
                 accum = cfg.train.grad_accum, dp = dpn}
    return was, now
end

local function rows_text(b)
    return ('%d rows (micro_batch %d x grad_accum %d x dp %d)'):format(b.rows, b.mb, b.accum, b.dp)
end

-- the recipe a checkpoint was written with against this run's: breaking differences refused
-- unless checkpoint.allow_changes, the others reported. The global batch counts as a setting: in
-- another layout (dp) it changes unless data.micro_batch or train.grad_accum make up for it, and
-- a change of those that keeps it is not breaking.
local function check_resumed_recipe(cfg, st, dp)
    local saved = st.extra and st.extra.recipe
    if not saved then
        log(cfg, 'note: %s does not record its recipe, so its settings were not compared with this run\'s', st.dir)
        return
    end
    local diffs = recipe_diff.compare(saved, recipe_diff.snapshot(cfg))
    local was, now = global_rows(cfg, st, dp)
    if was and was.rows ~= now.rows then
        diffs[#diffs + 1] = {key = 'global batch', old = rows_text(was), new = rows_text(now),
            breaking = 'changes the batch of every later step'}
    end
    if #diffs == 0 then return end
    local breaking, other = {}, {}
    for _, d in ipairs(diffs) do
        if was and was.rows == now.rows and (d.key == 'data.micro_batch' or d.key == 'train.grad_accum') then
            d.breaking = nil   -- the global batch stays the same rows
            d.note = ('the global batch stays %d rows'):format(now.rows)
        end
        local why = d.breaking or d.note
        local line = ('  %s: %s -> %s%s'):format(d.key, d.old, d.new, why and ('  (' .. why .. ')') or '')
        if d.breaking then breaking[#breaking + 1] = line else other[#other + 1] = line end
    end
    if #breaking > 0 and not cfg.checkpoint.allow_changes then
        user_error(('resuming %s with other settings than it was written with:\n%s\nThe resumed run would not continue '
            .. 'the one that wrote it. Set checkpoint.allow_changes=true to resume anyway, checkpoint.resume=none to '
            .. 'start afresh, or another checkpoint.dir'):format(st.dir, table.concat(breaking, '\n')
            .. (#other > 0 and ('\n' .. table.concat(other, '\n')) or '')))
    end
    if cfg.silent then return end
    print(('[lunar] resuming %s with changed settings:\n%s'):format(st.dir, table.concat(breaking, '\n')
        .. (#breaking > 0 and #other > 0 and '\n' or '') .. table.concat(other, '\n')))
end

-- the layout a checkpoint was written in against this run's: nil when the same, else a line
-- saying what changes (the optimizer state is then resharded: lunar.optim.reshard). The
-- replicated optimizer of several ranks (parallel.distributed_optimizer=false) writes its state
-- whole on rank 0 only, in a form not read into another layout: refused, naming both.
local function layout_text(l)
    local parts = {('dp=%d'):format(l.dp)}
    for _, k in ipairs({'tp', 'ep', 'etp'}) do if (l[k] or 1) > 1 then parts[#parts + 1] = ('%s=%d'):format(k, l[k]) end end
    if l.split_indexer then parts[#parts + 1] = 'split_indexer' end
    return table.concat(parts, ' ')
end

local function check_resumed_layout(cfg, st, dp)
    local one = {dp = 1, distributed_optimizer = false}   -- (what a one-process checkpoint records: nothing)
    local saved = st.extra and st.extra.parallel or one
    local now = dp:layout_record() or one
    local same = saved.dp == now.dp and (now.dp == 1 or saved.distributed_optimizer == now.distributed_optimizer)
    for _, k in ipairs({'tp', 'ep', 'etp'}) do same = same and (saved[k] or 1) == (now[k] or 1) end
    -- (the split indexer's heads are blocks of their own)
    same = same and (saved.split_indexer or false) == (now.split_indexer or false)
    if same then return nil end
    local function replicated(l) return l.dp > 1 and not l.distributed_optimizer end
    if replicated(saved) or replicated(now) then
        user_error(('%s was written with %s%s, this run has %s%s: the replicated optimizer\'s state '
            .. '(parallel.distributed_optimizer=false) is not resharded to another layout. Resume in the layout that '
            .. 'wrote it, or set checkpoint.resume=none to start afresh (its model loads in any layout: model.path=%s)')
            :format(st.dir, layout_text(saved), replicated(saved) and ' (replicated optimizer)' or '', layout_text(now),
            replicated(now) and ' (replicated optimizer)' or '', st.model_dir))
    end
    return ('%s -> %s'):format(layout_text(saved), layout_text(now))
end

-- the optimizer state of checkpoint st: as it was written, or (reshard, a line saying from which
-- layout) read into this one
local function restore_optimizer(opt, st, dp, reshard)
    if reshard then
        require('lunar.optim.reshard').load(opt, st)
    elseif opt.shard_state then
        opt:load_state_dict(st.optimizer, {shard = checkpoint.load_shard(st, dp.world_rank)})
    else
        opt:load_state_dict(st.optimizer)
    end
end

-- the checkpoint manager of cfg.checkpoint.dir and the checkpoint to resume (nil: a fresh start),
-- checked against this run: every rank resumes the same one, its recipe and layout are compared;
-- reshard: a line saying from which layout, when the optimizer state is read into another
local function open_checkpoints(cfg, dp)
    local cm = checkpoint.manager{dir = cfg.checkpoint.dir, every = cfg.checkpoint.every,
        keep_last = cfg.checkpoint.keep_last, group = dp:checkpoint_group(), quiet = (not dp:is_main()) or nil}
    local st = setting_error('checkpoint.resume=' .. cfg.checkpoint.resume, find_checkpoint, cfg, cm)
    dp:check_same_checkpoint(st)
    if st then check_resumed_recipe(cfg, st, dp) end
    return cm, st, st and check_resumed_layout(cfg, st, dp)
end

-- a LoRA run's adapters on `model`: read back from checkpoint st (the base weights come from
-- model.path), or applied fresh
local function adapters_of(cfg, model, st, dp)
    local adapters
    if st then
        -- (expert parallel: the adapters of the experts this rank does not hold stay in the file)
        adapters = setting_error('the checkpoint ' .. st.model_dir, lunar.peft.load, model, st.model_dir,
            {skip = dp.ep and data_parallel.is_expert or nil})
        -- the dropout stream continues where it stopped (its draws count is in the checkpoint)
        if st.extra and st.extra.lora_rng then adapters:set_rng_state(st.extra.lora_rng) end
    else
        adapters = setting_error('peft', lunar.peft.apply, model, cfg.peft)
    end
    dp:check_adapters(adapters, model)
    return adapters
end

-- the optimizer of `params` (lunar.train.data_parallel's, with its report; on one process
-- AdamW), its state restored from checkpoint st (resharded from another layout: reshard)
local function optimizer_of(cfg, model, params, dp, adamw_opts, st, reshard)
    local opt = dp:optimizer(params, model, adamw_opts)
    dp:report(cfg, model.params, opt, log, model)
    if st then
        -- the state holds moments (and f32 master weights of non-f32 parameters) per parameter
        -- dtype, not converted to another: a changed model.dtype (allowed by
        -- checkpoint.allow_changes) would drop or misread them. (LoRA's adapters stay f32.)
        local saved = st.extra and st.extra.recipe
        local was = not cfg.peft and saved and saved['model.dtype']
        if was and was ~= tostring(cfg.model.dtype) then
            user_error(('%s was written with model.dtype=%s, this run has %s: the optimizer state (its moments and f32 '
                .. 'master weights) is not converted to another dtype. Resume with model.dtype=%s, or start a new run '
                .. 'from its weights (model.path=%s/model, checkpoint.resume=none)'):format(st.dir, was,
                tostring(cfg.model.dtype), was, st.dir))
        end
        -- (a damaged or mismatched state is one line naming the checkpoint, on the rank that met it)
        local ok, err = pcall(restore_optimizer, opt, st, dp, reshard)
        if not ok then user_error(('the optimizer state of %s: %s'):format(st.dir, strip_where(err))) end
        if reshard then log(cfg, 'resharded the optimizer state of %s: %s', st.dir, reshard) end
    end
    return opt
end


-- what a checkpoint of run r ({cfg, model, adapters, dp, opt}) writes of the model, and the
-- layout it records. A model split by tp, ep or etp is written as each rank's pieces and a
-- manifest (lunar.parallel.checkpoint: no rank gathers it); the LoRA adapters are gathered whole (every
-- ep group its experts', every tp group its blocks, the base model not at all) and rank 0 writes
-- them. Collective under data parallel (every rank calls it, in step).
local function checkpoint_model(r)
    local cfg = r.cfg
    local pieces = not r.adapters and (r.dp.tp or r.dp.ep) and
        sharded.shard_tensors(r.model, r.dp.layout.plan, dist.rank()) or nil
    local model = r.model
    if r.adapters then model = r.dp:adapters_view(r.model)
    elseif not pieces then model = r.dp:gathered_model(r.model) end
    return {
        save_model = function(dir)
            -- the checkpoint keeps the real dropout (PEFT's own files may say 0, see peft.save)
            -- (what PEFT cannot apply is reported and merged for the final output, not each checkpoint)
            if r.adapters then lunar.peft.save(model, dir, {lora_dropout = cfg.peft.dropout or 0, merged = false})
            elseif pieces then sharded.write_manifest(r.model, dir, r.dp.layout.plan)
            else model:save_hf(dir, {keep_dtype = true}) end
        end,
        pieces = pieces,
        shard = r.opt.shard_state and r.opt:shard_state() or nil,
        parallel = r.dp:layout_record(),
    }
end


-- the final model of a split run (tp / ep / etp, no adapters) written by every rank, gathered as
-- it is written (lunar.train.export); otherwise the model rank 0 writes (the LoRA base and
-- adapters gathered whole, or the model itself). Returns that model and whether it is written.
local function write_final(r)
    local out = r.cfg.output and r.cfg.output.dir
    if out and (r.dp.tp or r.dp.ep) and not r.adapters then
        export.write_hf(r.dp, r.model, out)
        return r.model, true
    end
    return r.dp:gathered_model(r.model), false
end


-- ---- setup --------------------------------------------------------------------------------------

local function model_setting(cfg) return cfg.model.path and ('model.path=' .. cfg.model.path) or 'model.config' end

-- begin(cfg, check_model) -> r = {cfg, mcfg, dp, tok}: the run's parallel state
-- (lunar.train.data_parallel), its model config checked (check_model(cfg, mcfg): the trainer's
-- own limits; then the layout's, lunar.parallel.state), the directories it writes tried, and the
-- tokenizer
function M.begin(cfg, check_model)
    if cfg.threads then lunar.threads(cfg.threads) end
    local dp = data_parallel.setup(cfg)
    -- one voice: rank 0 prints and writes the run's files, the other ranks train silently
    if not dp:is_main() then cfg.quiet, cfg.silent = true, true end
    local mcfg = setting_error(model_setting(cfg), model_config, cfg)
    check_model(cfg, mcfg)
    parallel_state.check_model(cfg, mcfg, dp)
    if dp:is_main() then check_writable(cfg) end
    local r = {cfg = cfg, mcfg = mcfg, dp = dp}
    r.tok = setting_error('tokenizer=' .. cfg.tokenizer, lunar.tokenizer.load, cfg.tokenizer)
    return r
end

-- build(r, adamw_opts[, {after_model = fn(r) -> a note for the model line}]): the checkpoints
-- (r.cm, and r.st the checkpoint resumed, checked against this run), the model (from that
-- checkpoint, model.path or model.config, split as the layout says), the LoRA adapters
-- (r.adapters), after_model(r), the model line, the optimizer with its state restored (r.opt)
-- and the schedule of the micro-batches (r.schedule); r.start = 0
function M.build(r, adamw_opts, o)
    o = o or {}
    local cfg, dp = r.cfg, r.dp
    local st, reshard
    r.cm, st, reshard = open_checkpoints(cfg, dp)
    r.st = st
    r.model = setting_error(st and not cfg.peft and ('the checkpoint ' .. st.model_dir) or model_setting(cfg),
        build_model, cfg, st and st.model_dir, dp)
    local params = r.model.params
    if cfg.peft then
        r.adapters = adapters_of(cfg, r.model, st, dp)
        params = r.adapters.params
    end
    local note = o.after_model and o.after_model(r) or ''
    -- (a split model: the whole model's numbers, not this rank's blocks)
    log(cfg, 'model: %s, %.2fM parameters (%.2fM trainable)%s', r.model.cfg.architecture,
        dp:whole_count(r.model.params, r.model) / 1e6, dp:whole_count(params, r.model) / 1e6, note)
    r.opt = optimizer_of(cfg, r.model, params, dp, adamw_opts, st, reshard)
    r.schedule = schedule.new{grads = dp}
    r.start = 0
    return r
end

-- ---- the loop ------------------------------------------------------------------------------------

-- the run's metrics: rank 0 logs the global numbers (metrics.jsonl, TensorBoard, progress), the
-- other ranks keep the counts only. o.flops_per_token: the model's training FLOPs a token (TFLOP/s
-- and MFU per device)
function M.metrics(r, o)
    o = o or {}
    local cfg = r.cfg
    -- on a device, the peak of lunar's pool there (the process's resident memory says nothing about it)
    local memory = r.model:device() ~= 'cpu' and r.model:device() or nil
    if r.dp:is_main() then
        return metrics_mod.new{dir = cfg.metrics.dir, total_steps = cfg.train.steps, start_step = r.start,
            warmup_steps = cfg.metrics.warmup_steps, flops_per_token = o.flops_per_token,
            peak_flops = o.flops_per_token and cfg.metrics.peak_flops or nil,
            progress = (not cfg.quiet) and cfg.metrics.progress,
            -- (several ranks: tokens/s is the job's, TFLOP/s and MFU per rank's device)
            flops_devices = o.flops_per_token and r.dp:devices() or nil,
            log_every = cfg.train.log_every, counts = r.st and r.st.metrics or nil, summary = true,
            memory = memory, tensorboard = cfg.metrics.tensorboard == false and false or nil}
    end
    return metrics_mod.new{total_steps = cfg.train.steps, start_step = r.start, progress = false, summary = false,
        counts = r.st and r.st.metrics or nil, memory = memory}
end

-- loop(r, m, o): steps r.start + 1 .. train.steps. Each: rec = o.step(step), logged (m:log);
-- o.after_step(step, rec); o.eval(step) when o.eval_due(step) (not at the last step, which the
-- caller evaluates after the loop); a checkpoint (o.save(step)) when due and at the end, on a
-- signal (every rank stops at the same step) and after o.max_skipped skipped steps in a row;
-- cfg.stop_after stops early. Returns the stop ({step =, why =} or nil) and, when cfg.stop_after
-- ended the loop, whether that was before the last step (else nil).
function M.loop(r, m, o)
    local cfg = r.cfg
    local stop, early, in_a_row = nil, nil, 0
    core.signal.catch_stop()
    local ok, err = pcall(function()
        for step = r.start + 1, cfg.train.steps do
            local rec = o.step(step)
            m:log(step, rec)
            if o.after_step then o.after_step(step, rec) end
            in_a_row = rec.skipped and in_a_row + 1 or 0
            if step < cfg.train.steps and o.eval_due(step) then o.eval(step) end
            local signal = core.signal.stop_requested()
            -- a signal reaches the ranks at different steps: every rank stops at the same one
            if r.dp:any(signal) then signal = signal or 'a signal to another rank' end
            local too_many = (o.max_skipped or 0) > 0 and in_a_row >= o.max_skipped
            if r.cm:due(step, step == cfg.train.steps) or signal or too_many then o.save(step) end
            if signal then stop = {step = step, why = 'stopped by ' .. signal} break end
            if too_many then stop = {step = step, why = ('%d consecutive steps were skipped (a non-finite loss or '
                .. 'gradient norm): lower optim.lr, check the data, or raise train.max_skipped_in_a_row'):format(in_a_row)} break end
            if cfg.stop_after and step >= cfg.stop_after then
                early = step < cfg.train.steps
                break
            end
        end
    end)
    core.signal.release()
    if not ok then
        m:close()
        error(err, 0)
    end
    return stop, early
end

-- a stopped run's one line, naming the checkpoint that holds it
function M.raise_stop(r, stop)
    if not stop then return end
    local cfg = r.cfg
    user_error(('%s at step %d of %d; the checkpoint %s/%s holds it: run the same command again to resume')
        :format(stop.why, stop.step, cfg.train.steps, cfg.checkpoint.dir, checkpoint.step_name(stop.step)))
end

-- save_checkpoint(r, step, m, data_state, metric_counts): every rank calls it (a split model's
-- pieces, the gathered adapters and the optimizer shards are collective)
function M.save_checkpoint(r, step, m, data_state, counts)
    local cfg, t0 = r.cfg, lunar.clock()
    local cp = checkpoint_model(r)
    local dir, info = r.cm:save(step, {
        save_model = cp.save_model,
        optimizer = r.opt:state_dict(), data = data_state, metrics = counts,
        extra = {lora_rng = r.adapters and r.adapters:rng_state() or nil, recipe = recipe_diff.snapshot(cfg),
                 parallel = cp.parallel}},
        cp.shard, cp.pieces)
    m:note(('checkpoint step %d: %s (%s, %.1f s)'):format(step, dir, mib(info.bytes), lunar.clock() - t0))
    return dir
end

M.log, M.mib = log, mib
M.model_config, M.build_model, M.check_writable = model_config, build_model, check_writable
M.open_checkpoints, M.adapters_of, M.optimizer_of = open_checkpoints, adapters_of, optimizer_of
M.checkpoint_model, M.write_final, M.save_output = checkpoint_model, write_final, save_output

return M
