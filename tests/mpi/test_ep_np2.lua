-- np: 2
-- Expert parallel on 2 ranks (ep=2, edp=1: each rank holds half the routed experts and is its
-- own expert-data-parallel group): one step equals one rank's on the whole global batch (the loss
-- and every gradient within 1e-5 relative L2), with the routes replayed (R3) too, and 20 steps of
-- the tiny SFT recipe give the losses of one rank.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local recipes = dofile('recipes/common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('expert parallel np2', 2)

T:test('one step at ep=2 equals one rank', function()
    local m = dpc.layout_step(T, {ep = 2})
    if d.rank() == 0 then
        print(('  ep=2: loss rel %.2g, worst gradient rel %.2g (%s), %d gradients'):format(m.loss_rel, m.grad_rel,
            tostring(m.grad_name), m.compared))
    end
end)

T:test('one step at ep=2 with replayed routes (R3) equals one rank', function()
    local m = dpc.layout_step(T, {ep = 2}, nil, nil, true)
    if d.rank() == 0 then
        print(('  ep=2, R3: loss rel %.2g, worst gradient rel %.2g (%s)'):format(m.loss_rel, m.grad_rel, tostring(m.grad_name)))
    end
end)

T:test('20 steps of the tiny SFT recipe at ep=2 give the losses of one rank', function()
    local dir = dpc.tmpdir()
    -- with an evaluation of the whole validation set every 10 steps: 59 rows, each rank a
    -- micro-batch of 2 a round, the last round 3 rows and one of padding (rank 1 runs its forward
    -- of one row and the padding with rank 0): the valid loss of one process and of dp=2. The
    -- one process trains on the ranks' micro-batches in turn (dp_common.same_micro_batches)
    local valid = {data = {valid = {'examples/data/sft/oasst_en100_conversations.jsonl'}},
                   train = {eval_every = 10, eval_batches = 0}}
    local one = dpc.single(dir .. '/one.' .. d.rank(), dpc.merge(dpc.same_micro_batches(2, 2),
        {data = {valid = valid.data.valid}, train = valid.train}))
    local ep = recipes.run('sft', dpc.recipe(dir .. '/ep', {parallel = {ep = 2}, checkpoint = {every = 0},
        data = {valid = valid.data.valid}, train = valid.train}))
    local dp = recipes.run('sft', dpc.recipe(dir .. '/dp', {checkpoint = {every = 0}, data = {valid = valid.data.valid},
        train = valid.train}))
    if d.rank() == 0 then
        local a, b, c = ep.summary.valid_loss, dp.summary.valid_loss, one.summary.valid_loss
        for _, x in ipairs({a, b}) do
            assert(x and c and math.abs(x - c) <= 1e-5 * math.abs(c), ('valid loss %s at ep=2, %s at dp=2, %s on one '
                .. 'process'):format(tostring(a), tostring(b), tostring(c)))
        end
        print(('  valid loss at ep=2 %.9g, at dp=2 %.9g, one process %.9g'):format(a, b, c))
    end
    dpc.same_losses(T, 'ep=2', ep.losses, one.losses, 20)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
