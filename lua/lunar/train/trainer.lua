-- lunar.train.trainer: the training loop behind recipes/pretrain.lua, sft.lua and lora.lua.
--
--   local trainer = require 'lunar.train.trainer'
--   local result = trainer.run(cfg)     -- cfg: a validated recipe table (recipes/common.lua)
--   local plan = trainer.plan(cfg)      -- what run(cfg) would do: model size, memory, data; no training
--
-- One step = grad_accum micro-batches through the schedule's forwards and backwards (the
-- gradients summed by the modules; lunar.parallel.schedule), then one optimizer step (AdamW with
-- schedule, clipping, non-finite steps skipped and counted), metrics (JSONL, TensorBoard,
-- progress), an evaluation of data.valid when due and, when due, a checkpoint (lunar.train.run,
-- which this loop shares with the RL trainer: setup, the step's tail, checkpoints, the final
-- output).
--
-- The loss of a step is the mean over every target token of its micro-batches (HF's
-- num_items_in_batch convention), so the number of micro-batches does not change the result.
--
-- The run refuses before its first step, naming the setting, what would otherwise go wrong
-- later or silently: an output directory it cannot write, a checkpoint directory whose
-- checkpoints are all unusable, a resumed run whose data, model or batch settings differ from
-- its checkpoint's, rows longer than the model's positions, data with too many rejected rows.
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
local flops = require 'lunar.model.flops'
local moe_load = require 'lunar.train.moe_load'
local metrics_mod = require 'lunar.train.metrics'
local runner = require 'lunar.train.runner'
local schedule = require 'lunar.parallel.schedule'

local fs = core.fs
local user_error = core.user_error
local setting_error, strip_where = lunar.config.setting_error, lunar.config.strip_where
local log, mib, model_config = runner.log, runner.mib, runner.model_config

local M = {}

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

-- opts.dp: this rank's share of each global batch (lunar.train.data_parallel; one process: all)
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

-- ---- setup --------------------------------------------------------------------------------------

-- everything a run needs before its first step: {tok, loader, valid_source, model, adapters,
-- opt, schedule, cm, st (the checkpoint resumed), start (its step)}
local function setup(cfg)
    local r = runner.begin(cfg, function(_, mcfg)
        local mpe = mcfg.max_position_embeddings
        if mpe and cfg.data.seq_len > mpe then
            user_error(('data.seq_len=%d is longer than the model\'s max_position_embeddings=%d; set data.seq_len <= %d')
                :format(cfg.data.seq_len, mpe, mpe))
        end
    end)
    log(cfg, '%s: tokenizer %s (%d tokens)', cfg.name, cfg.tokenizer, r.tok:vocab_size())
    local source, rep = setting_error('data.train', M.load_documents, cfg, r.tok)
    report_data(cfg, rep, 'data.train')
    r.loader = make_loader(cfg, source, {shuffle = cfg.data.shuffle ~= false, quiet = cfg.quiet, dp = r.dp})
    if cfg.data.valid then
        local vsource, vrep = setting_error('data.valid', M.load_documents, cfg, r.tok, cfg.data.valid)
        report_data(cfg, vrep, 'data.valid')
        r.valid_source = vsource
    end
    local o = cfg.optim
    runner.build(r, {
        lr = o.lr, betas = o.betas, eps = o.eps, weight_decay = o.weight_decay, no_decay = o.no_decay,
        clip = o.clip_grad, accum = cfg.train.grad_accum,
        schedule = {warmup = o.warmup or 0, total = cfg.train.steps, decay = o.schedule, min_lr = o.min_lr}})
    local st = r.st
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
    targets, tokens = r.dp:sum_counts(targets, tokens)
    if targets == 0 then
        user_error(('step %d has no token to train on: every target of its %d rows is masked (a prompt longer than '
            .. 'data.seq_len=%d, or documents of one token); check the data and data.seq_len'):format(step,
            r.cfg.train.grad_accum * r.cfg.data.micro_batch, r.cfg.data.seq_len))
    end
    local loss_sum = 0
    schedule.forward_backward(r.schedule, batches, {
        forward = function(b)
            local out, saved = r.model:forward(b, {loss = true, num_items_in_batch = targets})
            loss_sum = loss_sum + out.loss
            return saved
        end,
        backward = function(_, saved) r.model:backward(nil, saved) end,
    })
    -- each rank's loss is its share of the global mean (divided by the global target count)
    loss_sum = r.dp:sum(loss_sum)
    -- the modules summed the gradients of loss_i = sum_i / targets: their sum is the step's
    -- mean loss already, so the optimizer must not divide by the number of micro-batches again
    local info = r.opt:step{loss = loss_sum, micro_batches = 1}
    r.opt:zero_grad()
    local extra = moe_load.step_metrics(r.model, r.dp)   -- the experts' load (collective under dp)
    return {loss = loss_sum, grad_norm = info.grad_norm, lr = info.lr, tokens = tokens, skipped = info.skipped,
            time = lunar.clock() - t0, extra = extra,
            peak_mem_bytes = r.dp:peak_memory(r.model:device())}   -- the largest of any rank
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
    local collective = r.dp.ep ~= nil
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
    sum, targets = r.dp:sum(sum, targets)
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

local function save_checkpoint(r, step, m)
    local counts = m:counts()
    runner.save_checkpoint(r, step, m, r.loader:state(),
        {loss = r.last_loss, skipped_steps = counts.skipped_steps, nan_steps = counts.nan_steps})
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

-- the output of a finished run that died after its last checkpoint (or that asks for one now);
-- a split model is gathered for it by every rank (rank 0's look at the directory decides)
local function output_if_missing(r)
    local cfg = r.cfg
    local out = cfg.output and cfg.output.dir
    local missing = out and not fs.stat(out .. (r.adapters and '/adapter_config.json' or '/config.json')) or false
    if r.dp:any(r.dp:is_main() and missing) then
        local whole, written = runner.write_final(r)
        if r.dp:is_main() then runner.save_output(cfg, whole, r.adapters, written) end
    end
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
        output_if_missing(r)
        result.finished, result.seconds = true, lunar.clock() - t_start
        return result
    end
    local main = r.dp:is_main()
    local m = runner.metrics(r, {flops_per_token = flops.training_per_token(r.model.cfg, cfg.data.seq_len)})
    local bm = cfg.benchmark
    local function eval_now(step)
        if r.valid_source then
            local loss, n = evaluate(r)
            m:log_eval(step, {loss = loss, ppl = math.exp(loss), tokens = n})
        end
        -- (a model split by tp / ep / etp generates on every rank together, each rank the whole
        -- benchmark: lunar.generate.parallel; rank 0 logs it)
        if bm and bm.every > 0 and (step % bm.every == 0 or step == cfg.train.steps) and (main or r.dp.tp or r.dp.ep) then
            benchmark(r, main and m or nil, step)
        end
    end
    local every, bevery = cfg.train.eval_every, bm and bm.every or 0
    local stop, early = runner.loop(r, m, {
        step = function(step)
            local rec = train_step(r, step)
            r.last_loss = rec.loss
            result.losses[#result.losses + 1] = rec.loss
            return rec
        end,
        eval_due = function(step) return (every > 0 and step % every == 0) or (bevery > 0 and step % bevery == 0) end,
        eval = eval_now,
        save = function(step) save_checkpoint(r, step, m) end,
        max_skipped = cfg.train.max_skipped_in_a_row,
    })
    result.stopped_early = early
    if not stop and not early then eval_now(cfg.train.steps) end
    result.summary = m:close()
    runner.raise_stop(r, stop)
    local out_model, written = runner.write_final(r)
    if main then runner.save_output(cfg, out_model, r.adapters, written) end
    local losses = result.losses
    local fall, tail, k = loss_fall(losses)
    result.fall, result.last_loss = fall, r.last_loss
    if fall then
        log(cfg, 'loss %.4f at step %d -> %.4f (mean of the last %d steps): %s', losses[1], r.start + 1, tail, k,
            M.fall_text(losses[1], tail))
        -- the gate holds for a whole run from step 1 (not a resumed or a stopped one)
        if cfg.expect_loss_fall and r.start == 0 and not early and not M.loss_fell_enough(fall, cfg.expect_loss_fall) then
            user_error(('the loss fell by %s, less than the %.0f%% this recipe expects'):format(
                finite(fall) and ('%.1f%%'):format(100 * fall) or 'a non-finite amount', 100 * cfg.expect_loss_fall))
        end
    end
    result.seconds = lunar.clock() - t_start
    return result
end

-- ---- the plan -----------------------------------------------------------------------------------

local DTYPE_BYTES = {f32 = 4, bf16 = 2, f16 = 2}

-- the parameters LoRA adds for peft = {r =, targets =, exclude =, include_mtp =} on a model of
-- these parameter specs, found by lunar.peft's own target rules on a stand-in for the model's
-- store that has the shapes but no memory
local function lora_parameters(spec, mcfg, peft)
    local shapes, names = {}, {}
    for _, s in ipairs(spec) do
        local L = lunar.peft.layer_of(s.name)
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
    local spec = require('lunar.model.spec').of(mcfg)
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
