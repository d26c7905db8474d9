-- test_recipe_guards.lua: what a recipe refuses, says or writes so that no run gives a wrong
-- result silently, loses work or changes a setting behind the user's back (the tiny preset, small
-- settings; the process-level behaviour, signals and mpirun, is tests/sh/test_recipe_run.sh):
--   * --help describes every setting; command-line paths are relative to the current directory,
--     a preset's to the repository; data.train takes one path; outputs follow name=;
--   * a preset's warm-up cut for a short run is said (and a user's too-long one refused); betas,
--     dtype, resume, parallel degrees not implemented yet (data, tensor and expert parallel are: tests/mpi),
--     seq_len beyond the model's positions are refused by name;
--   * a checkpoint directory whose checkpoints are all unusable is refused, not started afresh;
--   * an unwritable output directory is found before the first step;
--   * rows that are not UTF-8 or have nothing to train on are counted as rejected, a step with
--     no target is an error, too many rejected rows fail the run;
--   * a resumed run with other data or model settings is refused (unless allowed; a changed
--     model.dtype always: the optimizer state is per dtype), other changes are printed;
--     consecutive skipped steps stop the run with a checkpoint;
--   * data.valid is evaluated into the metrics; every recipe writes its final output, with the
--     base's companion files and, for adapters, the base named by path.
local lunar = require 'lunar'
local T = require('lunar.testing').suite('recipe guards')
local common = dofile('recipes/common.lua')
local trainer = require 'lunar.train.trainer'

local function tmpdir()
    local d = os.tmpname()
    os.remove(d)
    os.execute(('mkdir -p %q'):format(d))
    return d
end

local function merge(o, extra)
    for k, v in pairs(extra or {}) do
        if type(v) == 'table' and type(o[k]) == 'table' and #v == 0 then merge(o[k], v) else o[k] = v end
    end
    return o
end

-- small settings: a fraction of the data, short rows, few steps, everything under dir
local function small(dir, extra)
    return merge({quiet = true, expect_loss_fall = false,
        data = {limit = 24, seq_len = 128, micro_batch = 2, max_rejected = 0.5},
        train = {steps = 2, log_every = 100}, optim = {warmup = 0},
        checkpoint = {dir = dir .. '/ckpt', every = 100, keep_last = 3},
        metrics = {dir = dir, tensorboard = false}, output = {dir = dir .. '/final'}}, extra)
end

-- runs fn, which must raise an error containing every string of wants; returns the message
local function refuses(fn, wants)
    local ok, err = pcall(fn)
    assert(not ok, 'expected an error mentioning ' .. wants[1])
    err = tostring(err)
    for _, w in ipairs(wants) do
        assert(err:find(w, 1, true), ('error %q does not mention %q'):format(err, w))
    end
    return err
end

local function run(kind, o) return common.run(kind, o) end

local function same(a, b, what)
    if a ~= b then error(('%s: %s, expected %s'):format(what, tostring(a), tostring(b)), 2) end
end

local function read(path)
    local f = assert(io.open(path, 'rb'))
    local s = f:read('*a')
    f:close()
    return s
end

local function write(path, s)
    local f = assert(io.open(path, 'wb'))
    f:write(s)
    f:close()
end

-- ---- settings ---------------------------------------------------------------------------------

T:test('--help gives every setting a line of meaning, from the defaults table', function()
    local texts = common.help_texts()
    local missing = {}
    local function walk(t, prefix)
        for k, v in pairs(t) do
            local key = prefix and (prefix .. '.' .. k) or k
            if type(v) == 'table' and #v == 0 and next(v) ~= nil then walk(v, key)
            elseif not texts[key] or texts[key] == '' then missing[#missing + 1] = key end
        end
    end
    walk(common.defaults, nil)
    table.sort(missing)
    assert(#missing == 0, 'settings without a description: ' .. table.concat(missing, ', '))
    local help = common.help('sft', common.recipe('sft', {}))
    for _, key in ipairs({'optim.lr', 'data.packing', 'checkpoint.allow_changes', 'train.eval_every'}) do
        assert(help:find('\n  ' .. key .. ' ', 1, true), key .. ' is not in --help')
    end
    assert(help:find('peak learning rate', 1, true), 'the meaning of optim.lr')
    local _, flags = common.arguments({'--help', 'train.steps=3'})
    assert(flags.help, '--help is a flag')
    local o, f2 = common.arguments({'--dry-run', 'train.steps=3'})
    assert(f2.plan and o.train.steps == 3, '--dry-run is plan=true')
    refuses(function() common.arguments({'foo'}) end, {'recipe argument "foo"'})
end)

T:test('paths: the command line is relative to the current directory, a preset to the repository', function()
    local cfg = common.recipe('sft', {data = {train = 'mine.jsonl'}, tokenizer = 'tok/tokenizer.json'})
    assert(#cfg.data.train == 1, 'one path for data.train')
    same(cfg.data.train[1], 'mine.jsonl', 'data.train, relative to the current directory')
    same(cfg.tokenizer, 'tok/tokenizer.json', 'tokenizer from the command line')
    local preset = common.recipe('sft', {})
    assert(preset.data.train[1] == common.root .. 'examples/data/sft/gsm8k_train_chat_first1000.jsonl',
        'a preset path is relative to the repository: ' .. preset.data.train[1])
    assert(preset.tokenizer == common.root .. 'recipes/presets/tiny/tokenizer.json', preset.tokenizer)
end)

T:test('outputs default under runs/<name>/, for every recipe', function()
    same(common.recipe('sft', {name = 'ptest'}).output.dir, 'runs/ptest/final', 'sft name=ptest')
    same(common.recipe('sft', {name = 'ptest'}).checkpoint.dir, 'runs/ptest/checkpoints', 'checkpoints')
    same(common.recipe('lora', {}).output.dir, 'runs/tiny_lora/final', 'lora')
    same(common.recipe('pretrain', {}).output.dir, 'runs/tiny_pretrain/final', 'pretrain')
end)

T:test('a preset warm-up longer than half a short run is cut and said; a user one too long is refused', function()
    local cfg = common.recipe('sft', {train = {steps = 20}})
    T.equal(cfg.optim.warmup, 10, 'cut to half the run')
    assert(cfg.notes[1] and cfg.notes[1]:find("preset's 40 warm-up steps are cut to 10", 1, true), 'the note')
    T.equal(common.recipe('sft', {train = {steps = 20}, optim = {warmup = 15}}).optim.warmup, 15, 'a user warm-up stays')
    refuses(function() common.validate(common.recipe('sft', {train = {steps = 20}, optim = {warmup = 30}})) end,
        {'optim.warmup=30', 'as long as the run or longer'})
    refuses(function() lunar.optim.AdamW.new(require('lunar.nn.params').new(), {betas = {0.9}}) end,
        {'betas must be two numbers', 'got 1 number'})
end)

T:test('settings that would be replaced or misread are refused by name', function()
    local function check(o, wants) refuses(function() common.validate(common.recipe('sft', o)) end, wants) end
    check({optim = {betas = {0.9}}}, {'optim.betas={0.9}', 'two numbers'})
    check({optim = {betas = {0.9, 1.5}}}, {'optim.betas'})
    check({model = {dtype = 'int8'}}, {'model.dtype=int8', 'f32, bf16, f16'})
    check({checkpoint = {resume = 'bogus'}}, {'checkpoint.resume=bogus', 'no such directory'})
    check({data = {packing = 'tight'}}, {'data.packing=tight'})
    check({peft = {r = 8}}, {'peft.alpha'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {pp = 2}})) end,
        {'parallel.pp=2', 'not implemented', 'world size 1 is not divisible by tp*pp*cp = 1*2*1 = 2'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {tp = 2}})) end,
        {'world size 1 is not divisible by tp*pp*cp = 2*1*1 = 2'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {etp = 2}})) end,
        {'does not fit 1 rank', 'ep*etp = 1*2 = 2 must divide tp*cp*dp = 1*1*1 = 1'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {etp = 2,
        distributed_optimizer = false}})) end, {'parallel.etp=2 with parallel.distributed_optimizer=false'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {split_indexer = true}})) end,
        {'parallel.split_indexer=true needs parallel.tp > 1'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {sequence_parallel = true}})) end,
        {'parallel.sequence_parallel=true needs parallel.tp > 1'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {tp = 4, sequence_parallel = true},
        data = {micro_batch = 1, seq_len = 1022}})) end,
        {'the 1022 tokens of a micro-batch (data.micro_batch 1 x data.seq_len 1022) do not split evenly over parallel.tp=4'})
    refuses(function() common.check_runnable(common.recipe('sft', {parallel = {bucket_mb = 0}})) end,
        {'parallel.bucket_mb=0', 'positive'})
    refuses(function() common.check_runnable(common.recipe('sft', {data = {train = '/'}})) end,
        {'data.train=/ is a directory'})
    refuses(function() common.check_runnable(common.recipe('sft', {data = {train = '/no/such.jsonl'}})) end,
        {'data.train=/no/such.jsonl: no such file'})
    local d = tmpdir()
    refuses(function() run('sft', small(d, {data = {seq_len = 8192}})) end,
        {'data.seq_len=8192', 'max_position_embeddings=4096'})
    os.execute(('rm -rf %q'):format(d))
end)

-- ---- before the first step --------------------------------------------------------------------

T:test('a checkpoint directory whose checkpoints are all unusable is refused, listing each', function()
    local d = tmpdir()
    local ck = d .. '/ckpt'
    os.execute(('mkdir -p %q %q'):format(ck .. '/step_000002', ck .. '/step_000004'))
    write(ck .. '/step_000004/COMPLETE.json', '{not json')
    local err = refuses(function() run('sft', small(d)) end, {'holds 2 checkpoints and none can be resumed',
        'step_000002: no COMPLETE.json marker', 'step_000004: unreadable marker', 'checkpoint.resume=none'})
    assert(not lunar.core.fs.stat(d .. '/metrics.jsonl'), 'nothing ran: ' .. err)
    local r = run('sft', small(d, {checkpoint = {resume = 'none'}}))
    T.equal(#r.losses, 2, 'resume=none starts afresh')
    assert(lunar.core.fs.stat(ck .. '/step_000004'), 'the unusable checkpoints are kept')
    os.execute(('rm -rf %q'):format(d))
end)

T:test('a checkpoint whose model file has a damaged header and no CRC (a large file) is skipped, saying why',
    function()
    local d = tmpdir()
    local ck = d .. '/ckpt'
    run('sft', small(d, {train = {steps = 4}, checkpoint = {every = 2}}))
    -- the marker of step 4 keeps the model file's size only, as for a file over its CRC limit
    local marker = lunar.io.read_json(ck .. '/step_000004/COMPLETE.json')
    local rel = 'model/model.safetensors'
    assert(marker.files[rel], 'the marker lists ' .. rel)
    marker.files[rel].crc32c = nil
    lunar.io.write_json(ck .. '/step_000004/COMPLETE.json', marker)
    local f = assert(io.open(ck .. '/step_000004/' .. rel, 'r+b'))
    f:seek('set', 9)
    f:write('\255\254')   -- two bytes of the header's JSON: not UTF-8
    f:close()
    local r = run('sft', small(d, {train = {steps = 5}, checkpoint = {every = 2}}))
    T.equal(r.start_step, 2, 'resumed from the sound checkpoint of step 2')
    os.execute(('rm -rf %q'):format(d))
end)

T:test('an output directory that cannot be written is found before the first step', function()
    local d = tmpdir()
    write(d .. '/afile', 'x')
    refuses(function() run('sft', small(d, {output = {dir = d .. '/afile/final'}})) end,
        {'output.dir=' .. d .. '/afile/final cannot be written'})
    assert(not lunar.core.fs.stat(d .. '/metrics.jsonl'), 'no step ran')
    refuses(function() run('sft', small(d, {checkpoint = {dir = d .. '/afile/ck'}})) end, {'checkpoint.dir='})
    os.execute(('rm -rf %q'):format(d))
end)

-- ---- data -------------------------------------------------------------------------------------

T:test('rows that are not UTF-8 or have nothing to train on are rejected and counted', function()
    local d = tmpdir()
    local good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'
    write(d .. '/chat.jsonl', table.concat({good, '{"messages": [{"role": "user", "content": "caf\233"}, '
        .. '{"role": "assistant", "content": "x"}]}', good, good}, '\n') .. '\n')
    local rows, rep = lunar.data.read_chat({d .. '/chat.jsonl'})
    T.equal(#rows, 3, 'rows kept')
    T.equal(rep.counts.invalid_utf8, 1, 'the Latin-1 row')
    T.equal(rep:lines('invalid_utf8'), {2}, 'its line')
    -- text documents too
    write(d .. '/t.txt', 'one\n\ntw\255o\n\nthree\n')
    -- a directory among the JSONL files is named, with its path
    refuses(function() lunar.data.read_chat({d}) end, {'read_chat: ' .. d .. ' is a directory, not a JSONL file'})
    local trows, trep = lunar.data.read_text({d .. '/t.txt'})
    T.equal(#trows, 2, 'text documents kept')
    T.equal(trep.counts.invalid_utf8, 1, 'the bad document')
    -- a row whose tokens to train on are all past max_len
    local docs, drep = lunar.data.tokenize({{file = 'f', line = 1}, {file = 'f', line = 2}}, function(row)
        if row.line == 1 then return {1, 2, 3, 4, 5, 6}, {0, 0, 0, 0, 1, 1} end
        return {1, 2, 3}, {0, 1, 1}
    end, {max_len = 4, overlong = 'truncate'})
    T.equal(#docs, 1, 'the row with targets')
    T.equal(drep.counts.no_target, 1, 'the row without')
    -- in a recipe: too many rejected rows fail the run before it starts
    refuses(function() run('sft', small(d, {data = {max_rejected = 0.1}})) end,
        {'were rejected, more than data.max_rejected=0.1'})
    os.execute(('rm -rf %q'):format(d))
end)

T:test('a step with no token to train on is an error, not a loss of 0', function()
    local d = tmpdir()
    -- documents of one token each have no next token to predict
    local w = lunar.data.indexed_writer(d .. '/ones', {dtype = 'int32'})
    for i = 1, 64 do w:add_document({100 + i}) end
    w:finish()
    refuses(function()
        run('pretrain', small(d, {data = {kind = 'indexed', train = d .. '/ones', limit = false}}))
    end, {'step 1 has no token to train on'})
    os.execute(('rm -rf %q'):format(d))
end)

-- ---- resuming -----------------------------------------------------------------------------------

T:test('a resumed run with other data or model settings is refused; other changes are printed', function()
    local d = tmpdir()
    run('sft', small(d, {checkpoint = {every = 2}}))
    local err = refuses(function() run('sft', small(d, {train = {steps = 4}, data = {seq_len = 256}})) end,
        {'with other settings than it was written with', 'data.seq_len: 128 -> 256', 'checkpoint.allow_changes=true'})
    assert(err:find('train.steps: 2 -> 4', 1, true), 'the other differences are listed too: ' .. err)
    -- another learning rate and a longer run continue, the difference said
    local r = run('sft', small(d, {train = {steps = 3}, optim = {lr = 1e-3}}))
    T.equal(r.start_step, 2, 'resumed')
    T.equal(#r.losses, 1, 'one more step')
    -- allowed: the data position starts again, and the run says so
    local r2 = run('sft', small(d, {train = {steps = 4}, data = {seq_len = 256}, checkpoint = {allow_changes = true}}))
    T.equal(r2.start_step, 3, 'resumed with allow_changes')
    os.execute(('rm -rf %q'):format(d))
end)

T:test('a changed model.dtype is refused on resume even when changes are allowed (the optimizer state is per dtype)',
    function()
    local d = tmpdir()
    run('sft', small(d, {model = {dtype = 'bf16'}, checkpoint = {every = 2}}))
    refuses(function() run('sft', small(d, {train = {steps = 4}, checkpoint = {allow_changes = true}})) end,
        {'was written with model.dtype=bf16, this run has f32', 'is not converted to another dtype',
         'model.dtype=bf16'})
    local r = run('sft', small(d, {model = {dtype = 'bf16'}, train = {steps = 3}}))
    T.equal(r.start_step, 2, 'resumed in its own dtype')
    os.execute(('rm -rf %q'):format(d))
end)

T:test('consecutive skipped steps stop the run with a checkpoint', function()
    local d = tmpdir()
    -- a learning rate of 1e30 makes every step after the first non-finite, so it is skipped
    local err = refuses(function()
        run('sft', small(d, {train = {steps = 8, max_skipped_in_a_row = 2}, optim = {lr = 1e30, min_lr = 0}}))
    end, {'2 consecutive steps were skipped', 'at step 3 of 8', 'run the same command again to resume'})
    assert(lunar.core.fs.stat(d .. '/ckpt/step_000003/COMPLETE.json'), 'the checkpoint: ' .. err)
    os.execute(('rm -rf %q'):format(d))
end)

-- ---- what a run writes --------------------------------------------------------------------------

T:test('data.valid is evaluated into the metrics', function()
    local d = tmpdir()
    local r = run('sft', small(d, {data = {valid = 'examples/data/sft/oasst_en100_conversations.jsonl'},
        train = {steps = 4, eval_every = 2, eval_batches = 2}}))
    local evals = {}
    for line in read(d .. '/metrics.jsonl'):gmatch('[^\n]+') do
        if line:find('"valid_loss"') then evals[#evals + 1] = lunar.io.decode_json(line) end
    end
    T.equal(#evals, 2, 'evaluations at steps 2 and 4')
    T.equal({evals[1].step, evals[2].step}, {2, 4}, 'their steps')
    for _, e in ipairs(evals) do
        assert(e.valid_loss > 0 and math.abs(e.valid_ppl - math.exp(e.valid_loss)) < 1e-6 * e.valid_ppl, 'loss and ppl')
    end
    assert(r.summary.valid_loss == evals[2].valid_loss, 'the summary has the last evaluation')
    os.execute(('rm -rf %q'):format(d))
    -- the whole set (eval_batches 0) is every row once, whatever the micro-batch: the rows left
    -- after the last whole micro-batch are evaluated too (lr 1e-30: the weights stay the seeded ones)
    local seen = {}
    for _, mb in ipairs({1, 5, 7}) do   -- (24 rows: 4 and 3 left after the whole micro-batches)
        local dm = tmpdir()
        local e = run('sft', small(dm, {data = {valid = 'examples/data/sft/oasst_en100_conversations.jsonl',
            micro_batch = mb}, train = {steps = 1, eval_every = 1, eval_batches = 0}, optim = {lr = 1e-30, min_lr = 0}}))
        local ev
        for line in read(dm .. '/metrics.jsonl'):gmatch('[^\n]+') do
            if line:find('"valid_loss"') then ev = lunar.io.decode_json(line) end
        end
        assert(ev and ev.valid_loss == e.summary.valid_loss, 'micro_batch ' .. mb .. ': the evaluation logged')
        seen[#seen + 1] = {mb = mb, loss = ev.valid_loss, tokens = ev.valid_tokens}
        os.execute(('rm -rf %q'):format(dm))
    end
    for i = 2, #seen do
        T.equal(seen[i].tokens, seen[1].tokens, ('valid tokens at micro_batch %d and %d'):format(seen[1].mb, seen[i].mb))
        assert(math.abs(seen[i].loss - seen[1].loss) <= 1e-6 * seen[1].loss, ('valid loss %.9g at micro_batch %d, %.9g '
            .. 'at %d'):format(seen[i].loss, seen[i].mb, seen[1].loss, seen[1].mb))
    end
end)

T:test('benchmarks every N steps are logged and leave the training run as it was', function()
    local d1, d2 = tmpdir(), tmpdir()
    local plain = run('sft', small(d1, {train = {steps = 4}}))
    local with = run('sft', small(d2, {train = {steps = 4}, benchmark = {every = 2, limit = 2, max_new_tokens = 4,
        datasets = {'gsm8k', 'AIME-2024-30'}}}))
    for i = 1, 4 do assert(plain.losses[i] == with.losses[i], 'step ' .. i .. ': the same loss') end
    local steps = {}
    for line in read(d2 .. '/metrics.jsonl'):gmatch('[^\n]+') do
        if line:find('"benchmark/gsm8k/avg@1"', 1, true) then
            local row = lunar.io.decode_json(line)
            assert(row['benchmark/AIME-2024-30/pass@1'] ~= nil, 'both datasets')
            steps[#steps + 1] = row.step
        end
    end
    T.equal(steps, {2, 4}, 'benchmarks at steps 2 and 4')
    -- the prompts are those the model was trained on: an SFT row without reasoning renders as
    -- <|assistant|></think>..., so by default the benchmark's prompt ends with </think> too
    local evaluate = require 'lunar.eval.run'
    local real_run, thinking = evaluate.run, {}
    evaluate.run = function(model, tok, opts)
        thinking[#thinking + 1] = tostring(opts.enable_thinking)
        return real_run(model, tok, opts)
    end
    local ok, err = pcall(function()
        run('sft', small(tmpdir(), {train = {steps = 2}, benchmark = {every = 2, limit = 1, max_new_tokens = 2}}))
        run('sft', small(tmpdir(), {train = {steps = 2}, benchmark = {every = 2, limit = 1, max_new_tokens = 2,
            enable_thinking = true}}))
    end)
    evaluate.run = real_run
    assert(ok, err)
    same(thinking[1], 'false', 'the benchmark\'s enable_thinking by default')
    same(thinking[2], 'true', 'benchmark.enable_thinking=true')
    refuses(function() common.validate(common.recipe('sft', {benchmark = {datasets = {'gsm9k'}}})) end,
        {'benchmark.datasets', 'unknown dataset gsm9k'})
    os.execute(('rm -rf %q %q'):format(d1, d2))
end)

T:test('every recipe writes its final output; a fine-tuned model keeps its base companions', function()
    local d = tmpdir()
    run('pretrain', small(d, {data = {limit = 8}}))
    assert(lunar.io.read_json(d .. '/final/config.json').num_hidden_layers == 4, 'pretrain writes its model')
    -- the pretrained model as a base with a generation config: SFT from it carries the file over
    write(d .. '/final/generation_config.json', '{"eos_token_id": 6256, "temperature": 0.6}\n')
    local d2 = tmpdir()
    run('sft', small(d2, {model = {path = d .. '/final'}}))
    same(read(d2 .. '/final/generation_config.json'), read(d .. '/final/generation_config.json'),
        'generation_config.json of the base')
    assert(lunar.core.fs.stat(d2 .. '/final/tokenizer.json'), 'the tokenizer')
    -- LoRA: the adapters name their base by its absolute path
    local d3 = tmpdir()
    run('lora', small(d3, {model = {path = d .. '/final', config = false}}))
    local ac = lunar.io.read_json(d3 .. '/final/adapter_config.json')
    same(ac.base_model_name_or_path, lunar.core.fs.realpath(d .. '/final'), 'base_model_name_or_path')
    -- of a fresh base: the base is written beside the adapters
    local d4 = tmpdir()
    run('lora', small(d4))
    local ac4 = lunar.io.read_json(d4 .. '/final/adapter_config.json')
    same(ac4.base_model_name_or_path, lunar.core.fs.realpath(d4 .. '/final/base'), 'the fresh base')
    os.execute(('rm -rf %q %q %q %q'):format(d, d2, d3, d4))
end)

T:test('the end-of-run line never prints nan or a negative fall', function()
    same(trainer.fall_text(8, 4), '50.0% lower', 'a fall')
    same(trainer.fall_text(4, 5), '25.0% higher', 'a rise')
    same(trainer.fall_text(4, 0 / 0), 'not finite', 'a NaN tail')
    same(trainer.fall_text(math.huge, 3), 'not finite', 'an infinite first loss')
end)

os.exit(T:run())
