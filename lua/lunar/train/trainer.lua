-- lunar.train.trainer: the training loop behind recipes/pretrain.lua, sft.lua and lora.lua.
--
--   local trainer = require 'lunar.train.trainer'
--   local result = trainer.run(cfg)     -- cfg: a validated recipe table (recipes/common.lua)
--   local plan = trainer.plan(cfg)      -- what run(cfg) would do: model size, memory, data; no training
--
-- One step = grad_accum micro-batches (forward + backward, the gradients summed by the modules),
-- then one optimizer step (AdamW with schedule, clipping, non-finite steps skipped and counted),
-- metrics (JSONL, TensorBoard, progress), an evaluation of data.valid when due and, when due, a
-- checkpoint that holds everything a resumed run needs to continue bit for bit: the weights in
-- their training dtype (or the LoRA adapters), the optimizer and scheduler state, the data
-- position, the RNG streams and the recipe it was trained with.
--
-- The loss of a step is the mean over every target token of its micro-batches (HF's
-- num_items_in_batch convention), so the number of micro-batches does not change the result.
--
-- The run refuses before its first step, naming the setting, what would otherwise go wrong
-- later or silently: an output directory it cannot write, a checkpoint directory whose
-- checkpoints are all unusable, a resumed run whose data, model or batch settings differ from
-- its checkpoint's, rows longer than the model's positions, data with too many rejected rows.
-- During the run, SIGTERM or a first Ctrl-C finishes the step, writes a checkpoint and stops
-- (non-zero exit); a second one ends the process at once.
--
-- Under mpirun with several ranks the run is data parallel (lunar.train.data_parallel): each rank
-- reads its share of every global batch (micro_batch x grad_accum x ranks rows), the gradients
-- are reduced in buckets during backward and the optimizer state is sharded over the ranks; rank
-- 0 prints, logs the metrics (tokens summed over the ranks) and writes the outputs, every rank
-- writes its optimizer shard into the checkpoint. A step with no token to train on is an
-- error; train.max_skipped_in_a_row consecutive skipped steps stop the run with a checkpoint.
local lunar = require 'lunar'
local core = require 'lunar.core'
local data = require 'lunar.data'
local checkpoint = require 'lunar.train.checkpoint'
local metrics_mod = require 'lunar.train.metrics'
local flops = require 'lunar.model.flops'
local recipe_diff = require 'lunar.train.recipe_diff'
local data_parallel = require 'lunar.train.data_parallel'
local moe_load = require 'lunar.train.moe_load'
local sharded = require 'lunar.model.sharded'
local export = require 'lunar.train.export'
local dist = require 'lunar.dist'

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

-- ---- data -----------------------------------------------------------------------------------

local function as_list(x) if type(x) == 'table' then return x end return {x} end

-- documents ({ids =, mask =}) of the files `paths` (data.train or data.valid), and a report of
-- the rejected rows
function M.load_documents(cfg, tok, paths)
    local d = cfg.data
    paths = paths or d.train
    local max_len = d.max_len or d.seq_len
    local rows, rep, docs
    if d.kind == 'chat' then
        rows, rep = data.read_chat(as_list(paths), {limit = d.limit, show = 3})
        docs = data.tokenize(rows, function(row)
            return lunar.chat.tokenize(tok, row.messages, {template = d.template, tools = row.tools})
        end, {max_len = max_len, overlong = d.overlong or 'drop', report = rep})
    elseif d.kind == 'prompt_answer' then
        rows, rep = data.read_prompt_answer(as_list(paths), {prompt = d.prompt_field, answer = d.answer_field,
            system = d.system, limit = d.limit, show = 3})
        docs = data.tokenize(rows, function(row)
            local msgs = {}
            if row.system then msgs[#msgs + 1] = {role = 'system', content = row.system} end
            msgs[#msgs + 1] = {role = 'user', content = row.prompt}
            msgs[#msgs + 1] = {role = 'assistant', content = row.answer}
            return lunar.chat.tokenize(tok, msgs, {template = d.template})
        end, {max_len = max_len, overlong = d.overlong or 'drop', report = rep})
    elseif d.kind == 'text' then
        rows, rep = data.read_text(as_list(paths), {split = d.split or 'blank', limit = d.limit, show = 3})
        local eos = tok:token_to_id(d.eos_token or '<|endoftext|>')
        -- pretraining text is cut into pieces of max_len (default seq_len) tokens by default, so
        -- a long document is read whole, not its first seq_len tokens every epoch
        docs = data.tokenize(rows, function(row)
            local ids = tok:encode(row.text, {special = false})
            if eos then ids[#ids + 1] = eos end
            return ids
        end, {max_len = max_len, overlong = d.overlong or 'split', report = rep})
    elseif d.kind == 'indexed' then
        return data.indexed_open(paths), nil
    else
        user_error(('data.kind %q is not one of chat, prompt_answer, text, indexed'):format(tostring(d.kind)))
    end
    return docs, rep
end

-- prints what the readers kept, changed and rejected, and refuses data with no usable row or
-- with more rejected rows than data.max_rejected allows
local function report_data(cfg, rep, what)
    if not rep then return end
    local changed = {}
    for _, n in ipairs({'truncated', 'split'}) do
        if rep.notes[n] then changed[#changed + 1] = ('%d %s'):format(rep.notes[n], n) end
    end
    log(cfg, '%s: %d rows kept%s, %d rejected', what, rep.n_good,
        #changed > 0 and (' (' .. table.concat(changed, ', ') .. ' at max_len)') or '', rep.n_bad)
    if not cfg.silent and (not cfg.quiet or rep.n_bad > 0) then rep:print() end
    local total = rep.n_good + rep.n_bad
    if rep.n_good == 0 then
        user_error(('%s: no usable row in %s (%d rejected; the reasons are above)'):format(what,
            table.concat(as_list(cfg.data[what == 'data.valid' and 'valid' or 'train']), ', '), rep.n_bad))
    end
    local limit = cfg.data.max_rejected or 1
    if total > 0 and rep.n_bad / total > limit then
        user_error(('%s: %d of %d rows (%.1f%%) were rejected, more than data.max_rejected=%g allows (the reasons '
            .. 'are above); fix the data or the settings, or raise data.max_rejected'):format(what, rep.n_bad, total,
            100 * rep.n_bad / total, limit))
    end
end

-- opts.dp: this rank's share of each global batch (lunar.train.data_parallel)
local function make_loader(cfg, source, opts)
    local d = cfg.data
    -- documents longer than a row: split for pretraining data (text, indexed), else as data.overlong says
    local pretraining = d.kind == 'text' or d.kind == 'indexed'
    return data.loader{source = source, seq_len = d.seq_len, micro_batch = d.micro_batch, seed = d.seed,
        shuffle = opts.shuffle, pad_to_multiple = d.pad_to_multiple, quiet = opts.quiet, epochs = opts.epochs,
        packing = d.packing, pack_buffer = d.pack_buffer,
        dp_rank = opts.dp and opts.dp.rank, dp_size = opts.dp and opts.dp.size, pad_last = opts.pad_last,
        overlong = d.overlong or (pretraining and 'split' or 'truncate')}
end

-- ---- model ------------------------------------------------------------------------------------

-- the validated model config of the recipe (from model.config or model.path), without building it
local function model_config(cfg)
    if cfg.model.path then return lunar.model.config.load(cfg.model.path .. '/config.json') end
    return lunar.model.config.from_table(cfg.model.config, 'model.config')
end

local function build_model(cfg, resume_model_dir, dp)
    local mc = cfg.model
    local opts = {dtype = mc.dtype, device = mc.device, seed = mc.seed, indexer_loss_coeff = mc.indexer_loss_coeff,
                  fp32_residual = mc.fp32_residual, strict = mc.strict or nil,
                  ep = dp and dp.ep, tp = dp and dp.tp, etp = dp and dp.etp,
                  sequence_parallel = dp and dp.sequence_parallel, split_indexer = dp and dp.split_indexer}
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
    local dpn = dp and dp.size or 1
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
    local saved = st.extra and st.extra.parallel or {dp = 1, distributed_optimizer = false}
    local now = {dp = dp and dp.size or 1, distributed_optimizer = dp and dp.distributed or false,
                 tp = dp and dp.tp and dp.tp:size() or nil, ep = dp and dp.ep and dp.ep:size() or nil,
                 etp = dp and dp.etp and dp.etp:size() or nil, split_indexer = dp and dp.split_indexer or nil}
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
        keep_last = cfg.checkpoint.keep_last, group = dp and dist.world(), quiet = dp and not dp:is_main() or nil}
    local st = setting_error('checkpoint.resume=' .. cfg.checkpoint.resume, find_checkpoint, cfg, cm)
    if dp then dp:check_same_checkpoint(st) end
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
            {skip = dp and dp.ep and data_parallel.is_expert or nil})
        -- the dropout stream continues where it stopped (its draws count is in the checkpoint)
        if st.extra and st.extra.lora_rng then adapters:set_rng_state(st.extra.lora_rng) end
    else
        adapters = setting_error('peft', lunar.peft.apply, model, cfg.peft)
    end
    if dp and dp.ep then dp:check_adapters(adapters, model.cfg.n_routed_experts / dp.ep:size()) end
    return adapters
end

-- the optimizer of `params` (data parallel: lunar.train.data_parallel's, with its report; else
-- AdamW), its state restored from checkpoint st (resharded from another layout: reshard)
local function optimizer_of(cfg, model, params, dp, adamw_opts, st, reshard)
    local opt
    if dp then
        opt = dp:optimizer(params, model, adamw_opts)
        dp:report(cfg, model.params, opt, log, model)
    else
        opt = lunar.optim.AdamW.new(params, adamw_opts)
    end
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

-- ---- setup --------------------------------------------------------------------------------------

-- expert parallel needs routed experts that the ep ranks divide (and an expert width etp
-- divides); what it does not do yet is refused here, on every rank, before any work
local function check_expert_parallel(cfg, mcfg, dp)
    local ep, E = dp.ep:size(), mcfg.n_routed_experts
    local etp = dp.etp and dp.etp:size() or 1
    local what = etp > 1 and ('parallel.etp=%d'):format(etp) or ('parallel.ep=%d'):format(ep)
    if not E or E < 1 then
        user_error(('%s: the model (%s) has no routed experts to spread; set parallel.ep=1 and parallel.etp=1'):format(what,
            tostring(mcfg.architecture)))
    end
    local Im = mcfg.moe_intermediate_size
    if etp > 1 and Im % etp ~= 0 then
        user_error(('parallel.etp=%d does not divide the experts\' width %d (moe_intermediate_size): choose an etp that '
            .. 'divides %d'):format(etp, Im, Im))
    end
    if etp > 1 and cfg.peft then
        user_error(('parallel.etp=%d with LoRA (peft): adapters on experts split by etp are not implemented in this '
            .. 'version of lunar; set parallel.etp=1'):format(etp))
    end
    if E % ep ~= 0 then
        user_error(('parallel.ep=%d does not divide the model\'s %d routed experts (n_routed_experts): choose an ep '
            .. 'that divides %d'):format(ep, E, E))
    end
    if cfg.peft and (cfg.peft.dropout or 0) > 0 then
        -- each rank runs its experts' adapters on other ranks' rows: the dropout draws would follow
        -- neither one rank's stream nor survive a resume
        user_error(('parallel.ep=%d with peft.dropout=%s: LoRA dropout under expert parallel is not implemented in this '
            .. 'version of lunar; set peft.dropout=0, or parallel.ep=1'):format(ep, tostring(cfg.peft.dropout)))
    end
end

-- everything a run needs before its first step: {tok, loader, valid, model, adapters, opt, cm,
-- st (the checkpoint resumed), start (its step)}
local function setup(cfg)
    if cfg.threads then lunar.threads(cfg.threads) end
    local dp = data_parallel.setup(cfg)
    -- one voice: rank 0 prints and writes the run's files, the other ranks train silently
    if dp and not dp:is_main() then cfg.quiet, cfg.silent = true, true end
    local model_setting = cfg.model.path and ('model.path=' .. cfg.model.path) or 'model.config'
    local mcfg = setting_error(model_setting, model_config, cfg)
    local mpe = mcfg.max_position_embeddings
    if mpe and cfg.data.seq_len > mpe then
        user_error(('data.seq_len=%d is longer than the model\'s max_position_embeddings=%d; set data.seq_len <= %d')
            :format(cfg.data.seq_len, mpe, mpe))
    end
    if dp and dp.ep then check_expert_parallel(cfg, mcfg, dp) end
    if not dp or dp:is_main() then check_writable(cfg) end
    local r = {cfg = cfg, mcfg = mcfg, dp = dp}
    r.tok = setting_error('tokenizer=' .. cfg.tokenizer, lunar.tokenizer.load, cfg.tokenizer)
    log(cfg, '%s: tokenizer %s (%d tokens)', cfg.name, cfg.tokenizer, r.tok:vocab_size())
    local source, rep = setting_error('data.train', M.load_documents, cfg, r.tok)
    report_data(cfg, rep, 'data.train')
    r.loader = make_loader(cfg, source, {shuffle = cfg.data.shuffle ~= false, quiet = cfg.quiet, dp = dp})
    if cfg.data.valid then
        local vsource, vrep = setting_error('data.valid', M.load_documents, cfg, r.tok, cfg.data.valid)
        report_data(cfg, vrep, 'data.valid')
        r.valid_source = vsource
    end

    local st, reshard
    r.cm, st, reshard = open_checkpoints(cfg, dp)
    r.st = st

    r.model = setting_error(st and not cfg.peft and ('the checkpoint ' .. st.model_dir) or model_setting,
        build_model, cfg, st and st.model_dir, dp)
    local params = r.model.params
    if cfg.peft then
        r.adapters = adapters_of(cfg, r.model, st, dp)
        params = r.adapters.params
    end
    -- (a split model: the whole model's numbers, not this rank's blocks)
    log(cfg, 'model: %s, %.2fM parameters (%.2fM trainable)', r.model.cfg.architecture,
        data_parallel.count(dp, r.model.params, r.model) / 1e6, data_parallel.count(dp, params, r.model) / 1e6)

    local o = cfg.optim
    local adamw_opts = {
        lr = o.lr, betas = o.betas, eps = o.eps, weight_decay = o.weight_decay, no_decay = o.no_decay,
        clip = o.clip_grad, accum = cfg.train.grad_accum,
        schedule = {warmup = o.warmup or 0, total = cfg.train.steps, decay = o.schedule, min_lr = o.min_lr}}
    r.opt = optimizer_of(cfg, r.model, params, dp, adamw_opts, st, reshard)
    r.start = 0
    if st then
        local ok, err = pcall(r.loader.set_state, r.loader, st.data)
        if not ok then
            if not cfg.checkpoint.allow_changes then error(err, 0) end
            log(cfg, 'note: the data position was not restored (%s): the data starts from the beginning',
                strip_where(err))
        end
        r.start = st.step
        log(cfg, 'resumed from %s (step %d)', st.dir, r.start)
    end
    return r
end

-- ---- one step, an evaluation, a checkpoint --------------------------------------------------------

-- forward + backward of grad_accum micro-batches and one optimizer step -> the metrics record
local function train_step(r, step)
    local t0 = lunar.clock()
    r.model:moe_load_reset()
    local batches, targets, tokens = {}, 0, 0
    for i = 1, r.cfg.train.grad_accum do
        local b = r.loader:next()
        if not b then user_error('data: the loader ran out of batches') end
        batches[i] = b
        targets, tokens = targets + b.num_targets, tokens + b.num_tokens
    end
    if r.dp then targets, tokens = r.dp:sum_counts(targets, tokens) end
    if targets == 0 then
        user_error(('step %d has no token to train on: every target of its %d rows is masked (a prompt longer than '
            .. 'data.seq_len=%d, or documents of one token); check the data and data.seq_len'):format(step,
            r.cfg.train.grad_accum * r.cfg.data.micro_batch, r.cfg.data.seq_len))
    end
    local loss_sum = 0
    for i, b in ipairs(batches) do
        lunar.scope(function()
            local out = r.model:forward(b, {loss = true, num_items_in_batch = targets})
            loss_sum = loss_sum + out.loss
            if r.dp then r.dp:before_backward(i == #batches) end
            r.model:backward()
            if r.dp then r.dp:after_backward(i == #batches) end
        end)
    end
    -- each rank's loss is its share of the global mean (divided by the global target count)
    if r.dp then loss_sum = r.dp:sum(loss_sum) end
    -- the modules summed the gradients of loss_i = sum_i / targets: their sum is the step's
    -- mean loss already, so the optimizer must not divide by the number of micro-batches again
    local info = r.opt:step{loss = loss_sum, micro_batches = 1}
    r.opt:zero_grad()
    local extra = moe_load.step_metrics(r.model, r.dp)   -- the experts' load (collective under dp)
    return {loss = loss_sum, grad_norm = info.grad_norm, lr = info.lr, tokens = tokens, skipped = info.skipped,
            time = lunar.clock() - t0, extra = extra,
            peak_mem_bytes = r.dp and r.dp:peak_memory(r.model:device()) or nil}   -- the largest of any rank
end

-- the mean loss per target token of data.valid (train.eval_batches rounds, or all of it)
local function evaluate(r)
    -- data parallel: each call gives this rank its micro-batch of the next micro_batch x dp rows,
    -- the last ones filled up with padding, so every row is evaluated once and every rank runs
    -- as many forwards (expert and tensor parallel exchange rows in them); train.eval_batches
    -- counts those rounds, so a layout of the same micro_batch x dp evaluates the same rows
    local loader = make_loader(r.cfg, r.valid_source, {shuffle = false, quiet = true, epochs = 1, pad_last = true,
                                                       dp = r.dp})
    if r.adapters then r.adapters:eval() end
    local sum, targets, limit, n = 0, 0, r.cfg.train.eval_batches, 0
    -- (the members of a tp group hold the same rows: they skip a round without targets together)
    local collective = r.dp and r.dp.ep ~= nil
    while limit == 0 or n < limit do
        local b = loader:next()
        if not b then break end
        n = n + 1
        if b.num_targets > 0 or collective then
            lunar.scope(function()
                local out = r.model:forward(b, {loss = true, num_items_in_batch = math.max(b.num_targets, 1), keep = false})
                if b.num_targets > 0 then sum, targets = sum + out.loss * b.num_targets, targets + b.num_targets end
            end)
        end
    end
    if r.adapters then r.adapters:train() end
    if r.dp then sum, targets = r.dp:sum(sum, targets) end
    return targets > 0 and sum / targets or 0 / 0, targets
end

-- the math benchmarks of cfg.benchmark (lunar.eval.run) on the model as it is, logged as
-- benchmark/<dataset>/avg@k and pass@k; generation draws from its own streams, so the training
-- run continues bit for bit whether or not it evaluates
local function benchmark(r, m, step)
    local bm = r.cfg.benchmark
    local report = lunar.scope(function()
        return require('lunar.eval.run').run(r.model, r.tok, {datasets = bm.datasets, limit = bm.limit, k = bm.k,
            max_new_tokens = bm.max_new_tokens, temperature = bm.temperature, seed = bm.seed,
            template = r.cfg.data.template, enable_thinking = bm.enable_thinking, data_dir = bm.data_dir})
    end)
    local list, text = {}, {}
    for _, e in ipairs(report) do
        list[#list + 1] = {('benchmark/%s/avg@%d'):format(e.dataset, e.n), e.avg}
        for kk, v in pairs(e.pass) do list[#list + 1] = {('benchmark/%s/pass@%d'):format(e.dataset, kk), v} end
        text[#text + 1] = ('%s avg@%d %.4f'):format(e.dataset, e.n, e.avg)
    end
    table.sort(list, function(a, b) return a[1] < b[1] end)
    if not m then return end
    m:log_scalars(step, list)
    m:note(('benchmark step %d | %s'):format(step, table.concat(text, ' | ')))
end

-- what a checkpoint of run r ({cfg, model, adapters, dp, opt}) writes of the model, and the
-- layout it records. A model split by tp, ep or etp is written as each rank's pieces and a
-- manifest (lunar.model.sharded: no rank gathers it); the LoRA adapters are gathered whole (every
-- ep group its experts', every tp group its blocks, the base model not at all) and rank 0 writes
-- them. Collective under data parallel (every rank calls it, in step).
local function checkpoint_model(r)
    local cfg = r.cfg
    local pieces = r.dp and not r.adapters and (r.dp.tp or r.dp.ep) and
        sharded.shard_tensors(r.model, r.dp.layout.plan, dist.rank()) or nil
    local model = r.model
    if r.dp and r.adapters then model = r.dp:adapters_view(r.model)
    elseif r.dp and not pieces then model = r.dp:gathered_model(r.model) end
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
        parallel = r.dp and {dp = r.dp.size, distributed_optimizer = r.dp.distributed,
                             ep = r.dp.ep and r.dp.ep:size() or nil, tp = r.dp.tp and r.dp.tp:size() or nil,
                             etp = r.dp.etp and r.dp.etp:size() or nil,
                             split_indexer = r.dp.split_indexer or nil} or nil,
    }
end

local function save_checkpoint(r, step, m)
    local cfg, t0 = r.cfg, lunar.clock()
    local cp = checkpoint_model(r)
    local counts = m:counts()
    local dir, info = r.cm:save(step, {
        save_model = cp.save_model,
        optimizer = r.opt:state_dict(), data = r.loader:state(),
        metrics = {loss = r.last_loss, skipped_steps = counts.skipped_steps, nan_steps = counts.nan_steps},
        extra = {lora_rng = r.adapters and r.adapters:rng_state() or nil, recipe = recipe_diff.snapshot(cfg),
                 parallel = cp.parallel}},
        cp.shard, cp.pieces)
    r.saved_step = step
    m:note(('checkpoint step %d: %s (%s, %.1f s)'):format(step, dir, mib(info.bytes), lunar.clock() - t0))
    return dir
end

-- ---- the run ------------------------------------------------------------------------------------

-- how far the loss fell: the first step against the mean of the last steps (single steps are
-- noisy: their documents differ), over this process's steps; nil for fewer than two
local function loss_fall(losses)
    if #losses < 2 then return nil end
    local k = math.min(20, math.floor(#losses / 4) + 1)
    local tail = 0
    for i = #losses - k + 1, #losses do tail = tail + losses[i] end
    tail = tail / k
    return 1 - tail / losses[1], tail, k
end

-- the loss-fall gate: fall >= expect, written so that a NaN fall (a NaN loss) fails it
function M.loss_fell_enough(fall, expect)
    return fall >= expect
end

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

-- the end-of-run words for a loss that went from first to tail: "54.4% lower", "3.0% higher",
-- or "not finite" (never nan or a negative fall)
function M.fall_text(first, tail)
    if not finite(first) or not finite(tail) or first == 0 then return 'not finite' end
    local fall = 1 - tail / first
    if fall >= 0 then return ('%.1f%% lower'):format(100 * fall) end
    return ('%.1f%% higher'):format(-100 * fall)
end

-- the final model of a split run (tp / ep / etp, no adapters) written by every rank, gathered as
-- it is written (lunar.train.export); otherwise the model rank 0 writes (the LoRA base and
-- adapters gathered whole, or the model itself). Returns that model and whether it is written.
local function write_final(r)
    local out = r.cfg.output and r.cfg.output.dir
    if out and r.dp and (r.dp.tp or r.dp.ep) and not r.adapters then
        export.write_hf(r.dp, r.model, out)
        return r.model, true
    end
    return r.dp and r.dp:gathered_model(r.model) or r.model, false
end

function M.run(cfg)
    local t_start = lunar.clock()
    local r = setup(cfg)
    local result = {model = r.model, adapters = r.adapters, losses = {}, optimizer = r.opt, loader = r.loader,
                    start_step = r.start}
    if r.start >= cfg.train.steps then
        -- rerunning a finished run trains nothing: say so rather than print an empty summary
        log(cfg, 'nothing to do: %s is at step %d of train.steps=%d (the run finished). Set checkpoint.resume=none '
            .. 'to train afresh, a larger train.steps to continue, or another checkpoint.dir', r.st.dir, r.start,
            cfg.train.steps)
        -- the output of a run that died after its last checkpoint (or that asks for one now); a
        -- split model is gathered for it by every rank (rank 0's look at the directory decides)
        local out = cfg.output and cfg.output.dir
        local missing = out and not fs.stat(out .. (r.adapters and '/adapter_config.json' or '/config.json')) or false
        if r.dp then missing = r.dp:any(r.dp:is_main() and missing) end
        if missing then
            local whole, written = write_final(r)
            if not r.dp or r.dp:is_main() then save_output(cfg, whole, r.adapters, written) end
        end
        result.finished, result.seconds = true, lunar.clock() - t_start
        return result
    end
    local main = not r.dp or r.dp:is_main()
    local m = main and metrics_mod.new{dir = cfg.metrics.dir, total_steps = cfg.train.steps, start_step = r.start,
        warmup_steps = cfg.metrics.warmup_steps, flops_per_token = flops.training_per_token(r.model.cfg, cfg.data.seq_len),
        peak_flops = cfg.metrics.peak_flops, progress = (not cfg.quiet) and cfg.metrics.progress,
        -- (several ranks: tokens/s is the job's, TFLOP/s and MFU per rank's device)
        flops_devices = r.dp and dist.world_size() or nil,
        log_every = cfg.train.log_every, counts = r.st and r.st.metrics or nil, summary = true,
        -- on a device, the peak of lunar's pool there (the process's resident memory says nothing about it)
        memory = r.model:device() ~= 'cpu' and r.model:device() or nil,
        tensorboard = cfg.metrics.tensorboard == false and false or nil}
        -- the other ranks of a data-parallel run keep the counts only (rank 0 logs the global numbers)
        or metrics_mod.new{total_steps = cfg.train.steps, start_step = r.start, progress = false, summary = false,
            counts = r.st and r.st.metrics or nil, memory = r.model:device() ~= 'cpu' and r.model:device() or nil}
    local function eval_now(step)
        if r.valid_source then
            local loss, n = evaluate(r)
            m:log_eval(step, {loss = loss, ppl = math.exp(loss), tokens = n})
        end
        -- (a model split by tp / ep / etp generates on every rank together, each rank the whole
        -- benchmark: lunar.generate.parallel; rank 0 logs it)
        local bm = cfg.benchmark
        local split = r.dp and (r.dp.tp or r.dp.ep)
        if bm and bm.every > 0 and (step % bm.every == 0 or step == cfg.train.steps) and (main or split) then
            benchmark(r, main and m or nil, step)
        end
    end
    local stop, in_a_row = nil, 0
    core.signal.catch_stop()
    local ok, err = pcall(function()
        for step = r.start + 1, cfg.train.steps do
            local rec = train_step(r, step)
            r.last_loss = rec.loss
            result.losses[#result.losses + 1] = rec.loss
            m:log(step, rec)
            in_a_row = rec.skipped and in_a_row + 1 or 0
            local every, bevery = cfg.train.eval_every, cfg.benchmark and cfg.benchmark.every or 0
            if step < cfg.train.steps and ((every > 0 and step % every == 0) or (bevery > 0 and step % bevery == 0)) then
                eval_now(step)
            end
            local signal = core.signal.stop_requested()
            -- data parallel: a signal stops every rank at the same step
            if r.dp and r.dp:any(signal) then signal = signal or 'a signal to another rank' end
            local too_many = cfg.train.max_skipped_in_a_row > 0 and in_a_row >= cfg.train.max_skipped_in_a_row
            if r.cm:due(step, step == cfg.train.steps) or signal or too_many then save_checkpoint(r, step, m) end
            if signal then stop = {step = step, why = 'stopped by ' .. signal} break end
            if too_many then stop = {step = step, why = ('%d consecutive steps were skipped (a non-finite loss or '
                .. 'gradient norm): lower optim.lr, check the data, or raise train.max_skipped_in_a_row'):format(in_a_row)} break end
            if cfg.stop_after and step >= cfg.stop_after then
                result.stopped_early = step < cfg.train.steps
                break
            end
        end
    end)
    core.signal.release()
    if not ok then
        m:close()
        error(err, 0)
    end
    if not stop and not result.stopped_early then eval_now(cfg.train.steps) end
    result.summary = m:close()
    if stop then
        user_error(('%s at step %d of %d; the checkpoint %s/%s holds it: run the same command again to resume')
            :format(stop.why, stop.step, cfg.train.steps, cfg.checkpoint.dir, checkpoint.step_name(stop.step)))
    end
    local out_model, written = write_final(r)
    if main then save_output(cfg, out_model, r.adapters, written) end
    local losses = result.losses
    local fall, tail, k = loss_fall(losses)
    result.fall, result.last_loss = fall, r.last_loss
    if fall then
        log(cfg, 'loss %.4f at step %d -> %.4f (mean of the last %d steps): %s', losses[1], r.start + 1, tail, k,
            M.fall_text(losses[1], tail))
        -- the gate holds for a whole run from step 1 (not a resumed or a stopped one)
        if cfg.expect_loss_fall and r.start == 0 and not result.stopped_early
            and not M.loss_fell_enough(fall, cfg.expect_loss_fall) then
            user_error(('the loss fell by %s, less than the %.0f%% this recipe expects'):format(
                finite(fall) and ('%.1f%%'):format(100 * fall) or 'a non-finite amount', 100 * cfg.expect_loss_fall))
        end
    end
    result.seconds = lunar.clock() - t_start
    return result
end

-- what the RL trainer (lunar.rl.trainer) shares with this one
M.setup_parts = {model_config = model_config, build_model = build_model, check_writable = check_writable,
                 open_checkpoints = open_checkpoints, adapters_of = adapters_of, optimizer_of = optimizer_of,
                 check_expert_parallel = check_expert_parallel,
                 checkpoint_model = checkpoint_model, write_final = write_final,
                 save_output = save_output, log = log, mib = mib, loss_fall = loss_fall}

-- ---- the plan -----------------------------------------------------------------------------------

local DTYPE_BYTES = {f32 = 4, bf16 = 2, f16 = 2}

-- the parameters LoRA adds for peft = {r =, targets =, exclude =, include_mtp =} on a model of
-- these parameter specs, found by lunar.peft's own target rules on a stand-in for the model's
-- store that has the shapes but no memory
local function lora_parameters(spec, mcfg, peft)
    local shapes, names = {}, {}
    for _, s in ipairs(spec) do
        local L = tonumber(s.name:match('^model%.layers%.(%d+)%.'))
        if not (L and L >= mcfg.num_hidden_layers) or peft.include_mtp then
            shapes[s.name] = s.shape
            names[#names + 1] = s.name
        end
    end
    local function shape_only(shape)
        return {dim = function() return #shape end, size = function(_, i) return shape[i] end}
    end
    local store = {tensors = shapes,
        names = function() local i = 0 return function() i = i + 1 return names[i] end end,
        get = function(_, name) return shape_only(shapes[name]) end}
    local chosen, info = lunar.peft.targets(store, peft.targets, {exclude = peft.exclude, include_mtp = true})
    local n = 0
    for _, mod in ipairs(chosen) do n = n + peft.r * (info[mod]['in'] + info[mod].out) end
    return n
end

-- what run(cfg) would do, printed and returned, without building the model or training:
-- {params =, trainable =, memory = {weights =, grads =, optimizer =, total =}, data = {rows =,
-- documents =, tokens =, efficiency =, rows_per_step =, steps_per_epoch =, epochs =}}
function M.plan(cfg)
    -- under a launcher, rank 0 prints the plan
    if lunar.dist.env().rank ~= 0 then cfg.quiet, cfg.silent = true, true end
    local mcfg = model_config(cfg)
    local spec = require('lunar.model.params').spec(mcfg)
    local params = 0
    for _, s in ipairs(spec) do
        local n = 1
        for _, d in ipairs(s.shape) do n = n * d end
        params = params + n
    end
    local trainable = cfg.peft and lora_parameters(spec, mcfg, cfg.peft) or params
    local wb = DTYPE_BYTES[cfg.model.dtype] or 4
    local mem = {weights = params * wb, grads = trainable * wb,
                 -- AdamW: two f32 moments, and an f32 master copy of a parameter that is not f32
                 optimizer = trainable * (8 + (wb ~= 4 and 4 or 0))}
    mem.total = mem.weights + mem.grads + mem.optimizer
    local tok = lunar.tokenizer.load(cfg.tokenizer)
    local source, rep = M.load_documents(cfg, tok)
    report_data(cfg, rep, 'data.train')
    local loader = make_loader(cfg, source, {shuffle = cfg.data.shuffle ~= false, quiet = true})
    local st = loader:plan(0).stats
    -- data parallel (under a launcher): the global batch is micro_batch x grad_accum x ranks rows
    local env = lunar.dist.env()
    local per_step = cfg.data.micro_batch * cfg.train.grad_accum * env.size
    local steps_per_epoch = st.rows / per_step
    local p = {params = params, trainable = trainable, memory = mem,
               data = {documents = st.documents, rows = st.rows, tokens = st.real_tokens, slots = st.slots,
                       efficiency = st.efficiency, rows_per_step = per_step, steps_per_epoch = steps_per_epoch,
                       epochs = cfg.train.steps / steps_per_epoch}}
    local lines = {
        ('plan of %s (%s):'):format(cfg.name, cfg.kind),
        ('  model        %s, %s parameters (%s trainable), %s, %d layers'):format(mcfg.architecture,
            metrics_mod.commas(params), metrics_mod.commas(trainable), cfg.model.dtype, mcfg.num_hidden_layers),
        ('  memory       %s weights + %s gradients + %s AdamW state = %s (activations not included)'):format(
            mib(mem.weights), mib(mem.grads), mib(mem.optimizer), mib(mem.total)),
        ('  data         %s documents, %s tokens -> %s rows of %d (packing %s, efficiency %.2f%%)'):format(
            metrics_mod.commas(st.documents), metrics_mod.commas(st.real_tokens), metrics_mod.commas(st.rows),
            cfg.data.seq_len, cfg.data.packing or 'bfd', 100 * st.efficiency),
        ('  schedule     %d steps of %d rows (%d x %d%s): %.1f steps per epoch, %.2f epochs'):format(cfg.train.steps,
            per_step, cfg.data.micro_batch, cfg.train.grad_accum, env.size > 1 and (' x ' .. env.size .. ' ranks') or '',
            steps_per_epoch, p.data.epochs),
        ('  outputs      checkpoints %s, metrics %s, final %s'):format(cfg.checkpoint.dir, cfg.metrics.dir,
            cfg.output.dir or '-'),
    }
    if env.size > 1 then
        local zero1 = not cfg.parallel or cfg.parallel.distributed_optimizer ~= false
        lines[#lines + 1] = ('  parallel     data parallel over %d ranks: AdamW state %s per rank (%s)'):format(env.size,
            mib(zero1 and mem.optimizer / env.size or mem.optimizer), zero1 and 'sharded' or 'replicated')
    end
    if env.rank == 0 then print(table.concat(lines, '\n')) end
    return p
end

return M
