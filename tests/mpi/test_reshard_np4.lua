-- np: 4
-- A checkpoint resumed in another layout (lunar.optim.reshard): the SFT recipe at tp=2 x ep=2
-- (dp=2, 2 rows a rank) stopped after step 3 resumes at ep=4 (dp=4, 1 row a rank), tp=4 (dp=1,
-- 4 rows), ep=2 x etp=2 (dp=4) and on one rank (4 rows), the model and the distributed optimizer's
-- state read into the new layout and the data going on from the same row: steps 4 to 6 give the
-- uninterrupted run's losses within 1e-5 relative (a fresh optimizer state does not: its first
-- Adam step is a sign step); data.micro_batch changed to keep the global batch is not a breaking
-- change, and a layout that would change the global batch is refused naming the rows. A
-- one-process checkpoint resumes at tp=2 x ep=2 the same way. bf16 (with the f32 routers, a part
-- per dtype): tp=2 x ep=2 follows one process within 1e-3, resumed at ep=4 within 1e-3 of the
-- uninterrupted run (a fresh state is 7e-3 away), and in its own layout bit for bit. The LoRA
-- recipe resumes from tp=2 x ep=2 at ep=2 (dp=4) the same way; LoRA on the routed experts alone
-- (no dense adapter: one optimizer part, reduced over edp) follows one process at tp=2 x ep=2 and
-- resumes at ep=4. A checkpoint of the replicated optimizer is refused in another layout, naming
-- both.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local recipes = dofile('recipes/common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('resharded resume np4', 4)

local function copy(from, to)
    if d.rank() == 0 then assert(os.execute(('rm -rf %q && cp -r %q %q'):format(to, from, to))) end
    d.barrier()
end

-- the recipe of kind under dir (its checkpoints in dir/ckpt), with extra
local function run(kind, dir, extra)
    local o = dpc.recipe(dir, extra)
    o.train.steps = 6
    o.checkpoint.every = 3
    return recipes.run(kind, o)
end

-- the SFT recipe of run() on this rank alone (dpc.single)
local function single(dir, extra)
    return dpc.single(dir, dpc.merge({train = {steps = 6}, checkpoint = {every = 3}}, extra))
end

-- a run resumed from step 3: its steps 4-6 against the uninterrupted run's, within 1e-5
local function check(label, got, want)
    T.equal(got.start_step, 3, label .. ': resumed from step 3')
    dpc.same_losses(T, label .. ', steps 4-6', got.losses, {want.losses[4], want.losses[5], want.losses[6]}, 3)
end

T:test('SFT from tp=2 x ep=2 resumed at ep=4, tp=4, ep=2 x etp=2 and one rank', function()
    local dir = dpc.tmpdir()
    local base = {data = {micro_batch = 2}, parallel = {tp = 2, ep = 2}}
    local whole = run('sft', dir .. '/whole', base)
    local cut = run('sft', dir .. '/cut', {data = {micro_batch = 2}, parallel = {tp = 2, ep = 2}, stop_after = 3})
    T.equal(#cut.losses, 3, 'stopped after step 3')
    local layouts = {
        {'ep=4 (dp=4)', {data = {micro_batch = 1}, parallel = {ep = 4}}},
        {'tp=4 (dp=1)', {data = {micro_batch = 4}, parallel = {tp = 4}}},
        {'ep=2 x etp=2 (dp=4)', {data = {micro_batch = 1}, parallel = {ep = 2, etp = 2}}},
    }
    -- (data.micro_batch changes with the layout and keeps the global batch: not a breaking change)
    local reshard = require 'lunar.optim.reshard'
    for i, l in ipairs(layouts) do
        local sub = dir .. '/to' .. i
        copy(dir .. '/cut', sub)
        -- (the first with one old shard file open at a time: each read may close another)
        reshard.MAX_OPEN = i == 1 and 1 or 64
        check('sft ' .. l[1], run('sft', sub, l[2]), whole)
    end
    reshard.MAX_OPEN = 64
    -- another layout that would change the global batch is refused, naming the rows
    copy(dir .. '/cut', dir .. '/bigger')
    T.raises(function() run('sft', dir .. '/bigger', {data = {micro_batch = 2}, parallel = {ep = 4}}) end,
        'global batch: 4 rows (micro_batch 2 x grad_accum 1 x dp 2) -> 8 rows (micro_batch 2 x grad_accum 1 x dp 4)')
    -- one rank (rank 0 alone), 4 rows a step
    copy(dir .. '/cut', dir .. '/one')
    if d.rank() == 0 then
        check('sft one rank', single(dir .. '/one', {data = {micro_batch = 4}}), whole)
        -- without the optimizer state the steps go elsewhere: the check above can fail
        os.execute(('rm -rf %q && cp -r %q %q'):format(dir .. '/fresh', dir .. '/cut', dir .. '/fresh'))
        os.execute(('rm -rf %q'):format(dir .. '/fresh/ckpt/step_000003/optimizer_shards'))
        T.raises(function() single(dir .. '/fresh', {data = {micro_batch = 4}}) end,
            'holds 1 checkpoint and none can be resumed')
        -- and reshard itself refuses a distributed optimizer's state without its shards
        T.raises(function()
            require('lunar.optim.reshard').load(lunar.optim.AdamW.new(lunar.model.new(dpc.preset.common.model.config,
                {seed = 1}).params, {lr = 1}), {dir = 'x', optimizer = {scalars = {distributed = {dp = 2}}}})
        end, 'was written by the distributed optimizer but holds no optimizer shards')
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('SFT from one process resumed at tp=2 x ep=2', function()
    local dir = dpc.tmpdir()
    local whole
    if d.rank() == 0 then
        whole = single(dir .. '/whole', {data = {micro_batch = 4}})
        single(dir .. '/cut', {data = {micro_batch = 4}, stop_after = 3})
    end
    d.barrier()
    local losses = d.broadcast(lunar.tensor(whole and whole.losses or {0, 0, 0, 0, 0, 0}, 'f64'), {root = 0}):tolist_flat()
    check('sft one process -> tp=2 x ep=2', run('sft', dir .. '/cut', {data = {micro_batch = 2},
        parallel = {tp = 2, ep = 2}}), {losses = losses})
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('LoRA from tp=2 x ep=2 resumed at ep=2 (dp=4)', function()
    local dir = dpc.tmpdir()
    local whole = run('lora', dir .. '/whole', {data = {micro_batch = 2}, parallel = {tp = 2, ep = 2}})
    run('lora', dir .. '/cut', {data = {micro_batch = 2}, parallel = {tp = 2, ep = 2}, stop_after = 3})
    copy(dir .. '/cut', dir .. '/ep2')
    check('lora ep=2 (dp=4)', run('lora', dir .. '/ep2', {data = {micro_batch = 1}, parallel = {ep = 2}}), whole)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('LoRA on the routed experts alone (no dense adapter): tp=2 x ep=2 follows one process, resumed at ep=4',
    function()
    local dir = dpc.tmpdir()
    local experts_only = {targets = {'^.*%.mlp%.experts%.%d+%.gate_proj$'}}
    local whole = run('lora', dir .. '/whole', {peft = experts_only, data = {micro_batch = 2},
        parallel = {tp = 2, ep = 2}})
    local one
    if d.rank() == 0 then one = single(dir .. '/one', {kind = 'lora', peft = experts_only,
        data = {micro_batch = 4}}).losses end
    d.barrier()
    one = d.broadcast(lunar.tensor(one or {0, 0, 0, 0, 0, 0}, 'f64'), {root = 0}):tolist_flat()
    dpc.same_losses(T, 'experts-only LoRA at tp=2 x ep=2', whole.losses, one, 6)
    run('lora', dir .. '/cut', {peft = experts_only, data = {micro_batch = 2}, parallel = {tp = 2, ep = 2},
        stop_after = 3})
    check('experts-only lora ep=4 (dp=4)', run('lora', dir .. '/cut', {peft = experts_only, data = {micro_batch = 1},
        parallel = {ep = 4}}), whole)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('bf16 (f32 routers: a part per dtype): tp=2 x ep=2 follows one process, resumed at ep=4 with the f32 '
    .. 'master weights read in, and resumed in its own layout bit for bit', function()
    local dir = dpc.tmpdir()
    local bf = {dtype = 'bf16'}
    local whole = run('sft', dir .. '/whole', {model = bf, data = {micro_batch = 2}, parallel = {tp = 2, ep = 2}})
    run('sft', dir .. '/cut', {model = bf, data = {micro_batch = 2}, parallel = {tp = 2, ep = 2}, stop_after = 3})
    local one
    if d.rank() == 0 then one = single(dir .. '/one', {model = bf, data = {micro_batch = 4}}).losses end
    d.barrier()
    one = d.broadcast(lunar.tensor(one or {0, 0, 0, 0, 0, 0}, 'f64'), {root = 0}):tolist_flat()
    local worst = 0
    for i = 1, 6 do worst = math.max(worst, math.abs(whole.losses[i] - one[i]) / one[i]) end
    assert(worst <= 1e-3, ('bf16 at tp=2 x ep=2: loss %.3g from one process\'s'):format(worst))
    local got = run('sft', dir .. '/cut', {model = bf, data = {micro_batch = 1}, parallel = {ep = 4}})
    local gap = 0
    for i = 4, 6 do gap = math.max(gap, math.abs(got.losses[i - 3] - whole.losses[i]) / whole.losses[i]) end
    assert(gap <= 1e-3, ('bf16 resumed at ep=4: steps 4-6 %.3g from the uninterrupted run'):format(gap))
    if d.rank() == 0 then
        print(('  bf16: tp=2 x ep=2 within %.2g of one process over 6 steps; resumed at ep=4, steps 4-6 within %.2g')
            :format(worst, gap))
    end
    -- in the same layout a bf16 run resumes bit for bit
    local same = {model = bf, train = {steps = 8}, checkpoint = {every = 3}, parallel = {tp = 2, ep = 2}}
    dpc.stop_and_resume(T, 'sft', dir .. '/same', same, recipes.run('sft', dpc.recipe(dir .. '/same/whole', same)))
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('the replicated optimizer\'s checkpoint is refused in another layout, naming both', function()
    local dir = dpc.tmpdir()
    run('sft', dir, {parallel = {distributed_optimizer = false}, stop_after = 3})
    T.raises(function() run('sft', dir, {parallel = {ep = 2}, checkpoint = {allow_changes = true}}) end,
        'dp=4 (replicated optimizer), this run has dp=4 ep=2')
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
