-- np: 4
-- Data parallel on 4 ranks: one step equals one rank's on the whole global batch (distributed
-- optimizer on and off), and so do 20 steps of the tiny SFT recipe; the distributed optimizer's
-- state on each rank is a quarter of one rank's, counted from the tensors; the peak memory
-- logged is the largest of any rank's.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('data parallel np4', 4)

T:test('one step at dp=4, distributed optimizer on, equals one rank', function()
    local m = dpc.one_step(T, true, 1)
    if d.rank() == 0 then
        print(('  loss rel %.2g, gradient rel %.2g, parameter rel %.2g (%s), update rel %.2g (%s), %d buckets (%d started in '
            .. 'backward)'):format(m.loss_rel, m.grad_rel, m.param_rel, m.param_name, m.update_rel, m.update_name,
            m.buckets, m.early))
    end
end)

-- without the MTP layer, which the training backward does not reach (its parameters get no state
-- on one rank, and sit at the end of the flat layout, so the last rank would hold less): every
-- parameter has state after the step
T:test('the distributed optimizer\'s state on each of 4 ranks is a quarter of one rank\'s', function()
    local m = dpc.one_step(T, true, 1, {num_nextn_predict_layers = 0})
    local one = m.reference:state_bytes()
    local mine = m.optimizer:state_bytes()
    local all = d.all_gather(lunar.tensor({mine}, 'f64')):tolist_flat()
    local padded = m.optimizer.buffer.padded - m.optimizer.buffer.total
    assert(one > 0, 'the reference has optimizer state')
    local sum = 0
    for r, b in ipairs(all) do
        sum = sum + b
        -- a quarter, plus at most the rounding of the slice (its padding, 8 bytes an element)
        assert(math.abs(b - one / 4) <= 8 * (padded + 4), ('rank %d holds %d bytes of optimizer state, one rank %d (a '
            .. 'quarter: %d)'):format(r - 1, b, one, one / 4))
    end
    T.equal(sum, one, 'the shards add up to one rank\'s state')
    if d.rank() == 0 then
        print(('  optimizer state: one rank %d bytes, each of 4 ranks %s'):format(one, table.concat(all, ' / ')))
    end
end)

T:test('one step at dp=4, distributed optimizer off, equals one rank', function()
    local m = dpc.one_step(T, false, 1)
    T.equal(m.optimizer:state_bytes(), m.reference:state_bytes(), 'a whole copy of the state on every rank')
end)

T:test('the peak memory a data-parallel run logs is the largest of any rank\'s', function()
    local metrics = require 'lunar.train.metrics'
    local dp = require('lunar.train.data_parallel').setup({parallel = {}})
    -- rank 3 touches 256 MiB more than the highest peak any rank has reached so far (the
    -- earlier tests leave the ranks' peaks where they happen to be)
    local most = d.all_reduce(lunar.tensor({metrics.process_peak_bytes()}, 'f64'), {op = 'max'}):item()
    if d.rank() == 3 then
        local t = lunar.empty({math.ceil((most + 256 * 2 ^ 20) / 4)}, {dtype = 'f32'}):fill_(1)
        t:free()
    end
    -- (a peak only grows, and the collectives themselves add a little: the value lies between
    -- the largest of the peaks read before and after)
    local before = metrics.process_peak_bytes()
    local logged = dp:peak_memory('cpu')
    local after = metrics.process_peak_bytes()
    local all = d.all_gather(lunar.tensor({before, after}, 'f64')):tolist_flat()
    local lo, hi = 0, 0
    for r = 0, 3 do lo, hi = math.max(lo, all[2 * r + 1]), math.max(hi, all[2 * r + 2]) end
    assert(logged >= lo and logged <= hi, ('logged peak %d, the ranks\' peaks %d .. %d'):format(logged, lo, hi))
    assert(all[7] > all[1] + 200 * 2 ^ 20 and logged >= all[7], 'rank 3 peaked higher, and its peak is the one logged')
end)

-- (after the peak memory test: a run raises every rank's peak, which that test reads)
T:test('20 steps of the tiny SFT recipe at dp=4 give the losses of one rank (distributed optimizer on and off)',
    function()
    local recipes = dofile('recipes/common.lua')
    local dir = dpc.tmpdir()
    -- one rank reads the four ranks' micro-batches one after the other: the same rows per step
    local one = dpc.single(dir .. '/one.' .. d.rank(), dpc.same_micro_batches(1, 4))
    local on = recipes.run('sft', dpc.recipe(dir .. '/on', {data = {micro_batch = 1}}))
    local off = recipes.run('sft', dpc.recipe(dir .. '/off', {data = {micro_batch = 1},
        parallel = {distributed_optimizer = false}}))
    assert(on.optimizer.shard_state and not off.optimizer.shard_state, 'the optimizer each run asked for')
    dpc.same_losses(T, 'dp=4, distributed optimizer', on.losses, one.losses, 20)
    dpc.same_losses(T, 'dp=4, replicated optimizer', off.losses, one.losses, 20)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
