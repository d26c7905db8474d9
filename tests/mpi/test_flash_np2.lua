-- np: 2
-- GLM-5.3-Flash (glm5_next, the tiny_flash preset's model) on 2 ranks: one step at dp=2, tp=2
-- (KDA's and the NoPE MLA's heads split, the MLPs' rows), ep=2 (the routed experts) and etp=2
-- (each expert's matrices) equals one rank's on the whole global batch (the loss and every
-- gradient within 1e-5 relative L2, each rank's block against its block of the whole gradient,
-- each against the larger of its own norm and 1e-4 of the largest gradient's: the mHC scales of
-- layer 0, where every stream is still the embedding, have gradients that cancel to rounding
-- noise), with routes replayed (R3) too; 20 steps of the tiny_flash SFT recipe at dp=2, tp=2 and
-- ep=2 give the losses of one rank; generation at tp=2 and ep=2 gives one rank's tokens; a model split at tp=2 or ep=2 is written as the one-rank
-- file byte for byte (the vision tower carried).
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local recipes = dofile('recipes/common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('GLM-5.3-Flash parallel np2', 2)
local FLASH = dofile('recipes/presets/tiny_flash.lua').common.model.config
local FLOOR = {norm_floor = 1e-4}

T:test('one step at dp=2 equals one rank', function()
    dpc.report('flash dp=2', dpc.layout_step(T, {dp = 2}, FLASH, nil, nil, FLOOR))
end)

T:test('one step at dp=2 with replayed routes (R3) equals one rank', function()
    dpc.report('flash dp=2, R3', dpc.layout_step(T, {dp = 2}, FLASH, nil, true, FLOOR))
end)

T:test('one step at tp=2, ep=2 and etp=2 equals one rank (R3 at ep=2)', function()
    dpc.report('flash tp=2', dpc.layout_step(T, {tp = 2}, FLASH, nil, nil, FLOOR))
    dpc.report('flash ep=2', dpc.layout_step(T, {ep = 2}, FLASH, nil, nil, FLOOR))
    dpc.report('flash ep=2, R3', dpc.layout_step(T, {ep = 2}, FLASH, nil, true, FLOOR))
    dpc.report('flash etp=2', dpc.layout_step(T, {etp = 2}, FLASH, nil, nil, FLOOR))
end)

T:test('20 steps of the tiny_flash SFT recipe at dp=2, tp=2 and ep=2 give the losses of one rank', function()
    local dir = dpc.tmpdir()
    local over = {preset = 'tiny_flash', data = {seq_len = 128}, checkpoint = {every = 0}}
    local one = dpc.single(dir .. '/one.' .. d.rank(), dpc.merge(dpc.same_micro_batches(2, 2), over))
    local dp = recipes.run('sft', dpc.recipe(dir .. '/dp', over))
    dpc.same_losses(T, 'flash dp=2', dp.losses, one.losses, 20)
    -- ep=2: each rank its own rows (ep within dp), as dp=2; tp=2: both ranks the same rows (the
    -- one-rank run of micro-batch 2)
    local ep = recipes.run('sft', dpc.recipe(dir .. '/ep', dpc.merge({parallel = {ep = 2}}, over)))
    dpc.same_losses(T, 'flash ep=2', ep.losses, one.losses, 20)
    local one2 = dpc.single(dir .. '/one2.' .. d.rank(), dpc.merge({}, over))
    local tp = recipes.run('sft', dpc.recipe(dir .. '/tp', dpc.merge({parallel = {tp = 2}}, over)))
    dpc.same_losses(T, 'flash tp=2', tp.losses, one2.losses, 20)
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

T:test('generation at tp=2 (the same prompts) and ep=2 (each rank its own, in lockstep) gives one rank\'s ids', function()
    local one = lunar.model.new(FLASH, {seed = 5})
    local prompts = {}
    for i = 1, 3 do
        local p = {}
        for j = 1, 5 + 7 * i do p[j] = (j * 31 + i * 17) % 6000 end
        prompts[i] = p
    end
    local opts = {max_new_tokens = 12, temperature = 0.9, seed = 4, stop_token_ids = {}}
    local ref = lunar.generate(one, prompts, opts)
    for _, layout in ipairs({{tp = 2}, {ep = 2}}) do
        local name = next(layout)
        local lay = d.layout(layout)
        local m = lunar.model.new(FLASH, {seed = 5, tp = lay:group('tp'), ep = lay:group('ep')})
        -- ep: rank r generates prompts r + 1, r + 3, ... (with their own seeds)
        local mine, which = {}, {}
        for i = 1, 3 do
            if name == 'tp' or (i - 1) % 2 == d.rank() then
                mine[#mine + 1] = {ids = prompts[i], seed = opts.seed + i - 1}
                which[#mine] = i
            end
        end
        local res = lunar.generate(m, mine, opts)
        T.equal(#res, #mine, name .. ': one result per prompt')
        for k, r in ipairs(res) do
            local got, want = table.concat(r.ids, ','), table.concat(ref[which[k]].ids, ',')
            assert(got == want, ('%s prompt %d: %s, one rank %s'):format(name, which[k], got, want))
        end
    end
end)

T:test('a model split at tp=2 or ep=2 is written as the one-rank file, byte for byte (the vision tower carried)', function()
    local data_parallel = require 'lunar.train.data_parallel'
    local export = require 'lunar.train.export'
    local dir = dpc.tmpdir()
    for _, layout in ipairs({{tp = 2}, {ep = 2}}) do
        local name = next(layout)
        local dp = data_parallel.setup({parallel = layout})
        local split = lunar.model.new(FLASH, {seed = 5, tp = dp.tp, ep = dp.ep})
        export.write_hf(dp, split, dir .. '/' .. name)
        if d.rank() == 0 then
            local one = lunar.model.new(FLASH, {seed = 5})
            one:save_hf(dir .. '/one')
            dpc.same_model_files(dir .. '/' .. name, dir .. '/one')
            local f = assert(io.open(dir .. '/' .. name .. '/model.safetensors', 'rb'))
            local head = f:read(200000)
            f:close()
            assert(head:find('model.visual.', 1, true), name .. ': the vision tower is in the file')
        end
        d.barrier()
    end
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
