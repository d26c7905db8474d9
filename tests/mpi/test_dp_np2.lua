-- np: 2
-- Data parallel on 2 ranks: one step equals one rank's on the whole global batch (distributed
-- optimizer on and off: loss, every gradient, every parameter after the update within 1e-5
-- relative L2), 20 steps of
-- the tiny SFT recipe give the losses of one rank at every step, and a run stopped after its
-- checkpoint and resumed gives bit-identical later losses and weights (another layout resumes
-- it too: tests/mpi/test_reshard_np4.lua).
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local recipes = dofile('recipes/common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('data parallel np2', 2)

T:test('one step at dp=2, distributed optimizer on, equals one rank', function()
    local m = dpc.one_step(T, true)
    if d.rank() == 0 then
        print(('  loss rel %.2g, worst gradient rel %.2g, parameter rel %.2g (%s), update rel %.2g (%s), %d buckets (%d started '
            .. 'in backward)'):format(m.loss_rel, m.grad_rel, m.param_rel, m.param_name, m.update_rel, m.update_name,
            m.buckets, m.early))
    end
end)

T:test('one step at dp=2, distributed optimizer off, equals one rank', function()
    dpc.one_step(T, false)
end)

local single = dpc.single

T:test('20 steps of the tiny SFT recipe at dp=2 give the losses of one rank', function()
    local dir = dpc.tmpdir()
    local dp = recipes.run('sft', dpc.recipe(dir .. '/dp'))
    -- one rank reads the two ranks' micro-batches one after the other: the same rows per step
    local one = single(dir .. '/one.' .. d.rank(), dpc.same_micro_batches(2, 2))
    T.equal(#dp.losses, 20, 'steps')
    local worst = 0
    for i = 1, 20 do
        local rel = math.abs(dp.losses[i] - one.losses[i]) / math.abs(one.losses[i])
        assert(rel <= 1e-5, ('step %d: loss %.9g at dp=2, %.9g on one rank (rel %.3g)'):format(i, dp.losses[i],
            one.losses[i], rel))
        worst = math.max(worst, rel)
    end
    assert(dp.losses[20] < dp.losses[1], 'the loss fell')
    assert(dp.optimizer.shard_state, 'the distributed optimizer by default')
    -- parallel.distributed_optimizer=false: the replicated AdamW, the same losses
    local rep = recipes.run('sft', dpc.recipe(dir .. '/rep', {train = {steps = 3},
        parallel = {distributed_optimizer = false}}))
    assert(not rep.optimizer.shard_state, 'distributed_optimizer=false gives the replicated optimizer')
    for i = 1, 3 do
        local rel = math.abs(rep.losses[i] - one.losses[i]) / math.abs(one.losses[i])
        assert(rel <= 1e-5, ('replicated optimizer, step %d: loss %.9g, one rank %.9g'):format(i, rep.losses[i],
            one.losses[i]))
    end
    if d.rank() == 0 then
        print(('  20 steps: worst loss rel %.2g'):format(worst))
        -- tokens/s is the job's (both ranks' tokens), TFLOP/s per rank's device: FLOPs per token
        -- (TFLOP/s over tokens/s) are half one process's
        local per = dp.summary.tflops / dp.summary.tokens_per_s
        local want = one.summary.tflops / one.summary.tokens_per_s / 2
        assert(math.abs(per - want) <= 1e-9 * want, ('TFLOP/s per token/s %.6g at dp=2, want %.6g'):format(per, want))
        T.equal(dp.summary.total_tokens, one.summary.total_tokens, 'tokens counted over both ranks')
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('stopped after a checkpoint and resumed at dp=2: bit-identical losses and weights', function()
    local dir = dpc.tmpdir()
    local steps = {train = {steps = 8}, checkpoint = {every = 3}}
    local whole = recipes.run('sft', dpc.recipe(dir .. '/whole', steps))
    -- the run ends after step 5 (as if killed: its last checkpoint is step 3) ...
    local cut = dpc.recipe(dir .. '/cut', steps)
    cut.stop_after = 5
    local first = recipes.run('sft', cut)
    T.equal(#first.losses, 5, 'steps before the stop')
    -- ... and the same command resumes from step 3
    cut.stop_after = false
    local second = recipes.run('sft', cut)
    T.equal(second.start_step, 3, 'resumed from the checkpoint of step 3')
    for i = 4, 8 do
        local a, b = whole.losses[i], second.losses[i - 3]
        assert(a == b, ('step %d: loss %.17g uninterrupted, %.17g resumed'):format(i, a, b))
    end
    for name in whole.model.params:names() do
        local pa, pb = whole.model.params:get(name), second.model.params:get(name)
        assert(lunar.ops.global_norm({lunar.ops.sub(pa, pb)}) == 0, name .. ' differs after the resume')
    end
    -- every rank wrote its optimizer shard into the checkpoint
    local ck = dir .. '/cut/ckpt/step_000003/optimizer_shards/'
    for r = 0, 1 do assert(require('lunar.core').fs.stat(ck .. ('rank_%05d.safetensors'):format(r)), 'shard of rank ' .. r) end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
