-- np: 4
-- Generation on a split model (lunar.generate.parallel), on 4 ranks: every rank generates its own
-- prompts (the members of a tp group the same ones, the dp ranks others, a rank with none under
-- expert parallel) with the sharded weights, and each sample equals the one the whole model
-- generates alone: the same tokens (greedy and sampled, n = 2), logprobs within 1e-5 and the same
-- recorded routes. Layouts: tp=2 x ep=2 (GLM-5, the DSA indexer selecting at decode), ep=4 with
-- ranks of 0 to 3 prompts, ep=2 x etp=2, tp=4 (GLM-4.x, sequence parallel), tp=2 x dp=2 with the
-- indexer's heads split, and tp=2 with the vocabulary whole. tp ranks given different prompts
-- are refused on every rank. The SFT recipe's benchmark (benchmark.every) at tp=2 x ep=2 logs the
-- numbers one rank logs.
local lunar = require 'lunar'
local common = dofile('tests/mpi/common.lua')
local dpc = dofile('tests/mpi/dp_common.lua')
local d = lunar.dist

lunar.threads(1)
local T = common.suite('generation on split models np4', 4)

local function config(changes)
    local cfg = {}
    if not (changes and changes.model_type) then
        for k, v in pairs(dpc.preset.common.model.config) do cfg[k] = v end
    end
    for k, v in pairs(changes or {}) do cfg[k] = v end
    return cfg
end

-- the prompts of data-parallel index i: n prompts of other lengths
local function prompts_of(i, n, V)
    local list = {}
    for p = 1, n do
        local ids = {}
        for j = 1, 5 + 3 * p + i do ids[j] = (j * 37 + p * 101 + i * 211 + j * j) % V end
        list[p] = ids
    end
    return list
end

-- generates on the split model and on the whole one; compares every sample
local function check(label, spec, cfg, opts)
    local lspec = {}
    for k, v in pairs(spec) do if k ~= 'sequence_parallel' and k ~= 'split_indexer' then lspec[k] = v end end
    local lay = d.layout(lspec)
    local c = lay:coords()
    local whole = lunar.model.new(cfg, {seed = 4})
    local split = lunar.model.new(cfg, {seed = 4, tp = lay:group('tp'), ep = lay:group('ep'), etp = lay:group('etp'),
        sequence_parallel = spec.sequence_parallel, split_indexer = spec.split_indexer})
    local n = opts.count and opts.count[d.rank() + 1] or 2
    local prompts = prompts_of(c.dp, n, cfg.vocab_size)
    local gopts = {max_new_tokens = opts.max_new_tokens or 10, n = opts.n, temperature = opts.temperature,
                   seed = opts.seed, routing = opts.routing, max_batch = opts.max_batch, stop_token_ids = {}}
    local got = lunar.generate(split, prompts, gopts)
    local want = #prompts > 0 and lunar.generate(whole, prompts, gopts) or {}
    T.equal(#got, #want, label .. ': samples')
    local worst, tokens = 0, 0
    for k, r in ipairs(got) do
        local w = want[k]
        T.equal(r.prompt, w.prompt, label .. ': prompt order')
        T.equal(#r.ids, #w.ids, ('%s: prompt %d sample %d length'):format(label, r.prompt, r.sample))
        for j = 1, #w.ids do
            if r.ids[j] ~= w.ids[j] then
                error(('%s: rank %d prompt %d sample %d token %d is %d, the whole model generates %d'):format(label,
                    d.rank(), r.prompt, r.sample, j, r.ids[j], w.ids[j]))
            end
            worst = math.max(worst, math.abs(r.logprobs[j] - w.logprobs[j]))
        end
        tokens = tokens + #r.ids
        if opts.routing then
            for layer, idx in pairs(w.routing) do
                local mine = r.routing[layer]
                assert(mine, ('%s: no routes of layer %d'):format(label, layer))
                T.equal(lunar.ops.sum(lunar.ops.ne(mine, idx)):item(), 0, label .. ': routes of layer ' .. layer)
            end
        end
    end
    assert(worst <= 1e-5, ('%s: rank %d logprob differs by %.3g from the whole model\'s'):format(label, d.rank(), worst))
    local t = d.all_reduce(lunar.tensor({worst, tokens}, 'f64'), {op = 'max'}):tolist_flat()
    if d.rank() == 0 then print(('  %s: worst logprob gap %.2g over the ranks, %d tokens on the busiest'):format(label,
        t[1], t[2])) end
end

T:test('tp=2 x ep=2 (GLM-5): each dp pair its prompts, greedy and sampled, routes recorded', function()
    local cfg = config({index_topk = 8})   -- decode steps past 8 tokens select keys
    check('tp=2 x ep=2 greedy', {tp = 2, ep = 2}, cfg, {routing = true})
    check('tp=2 x ep=2 sampled n=2', {tp = 2, ep = 2}, cfg, {n = 2, temperature = 1, seed = 7, max_batch = 3})
end)

T:test('ep=4: ranks with 3, 1, 0 and 2 prompts stay in step', function()
    check('ep=4', {ep = 4}, config({index_topk = 8}), {count = {3, 1, 0, 2}, routing = true, max_batch = 2,
        n = 2, temperature = 0.8, seed = 3, max_new_tokens = 12})
end)

T:test('ep=2 x etp=2 (GLM-5)', function()
    check('ep=2 x etp=2', {ep = 2, etp = 2}, config(), {count = {2, 2, 1, 3}, n = 2, temperature = 1, seed = 5})
end)

T:test('tp=4 (GLM-4.x) with sequence parallel, and tp=2 x dp=2 with the indexer heads split', function()
    check('tp=4 GLM-4.x sequence parallel', {tp = 4, sequence_parallel = true}, config(dpc.glm4_config), {routing = true})
    check('tp=2 x dp=2 split_indexer', {tp = 2, split_indexer = true}, config({index_topk = 8}), {n = 2,
        temperature = 1, seed = 9})
end)

T:test('tp=2 x ep=2 with a vocabulary tp does not divide (logits whole on every rank)', function()
    local cfg = config({vocab_size = 6401})
    local split = lunar.model.new(cfg, {seed = 4, tp = d.layout{tp = 2, ep = 2}:group('tp')})
    assert(split.vocab == nil, 'the vocabulary stays whole')
    check('tp=2 x ep=2 whole vocabulary', {tp = 2, ep = 2}, cfg, {n = 2, temperature = 1, seed = 2})
end)

T:test('tp ranks given different prompts are refused on every rank', function()
    local lay = d.layout{tp = 2, ep = 2}
    local m = lunar.model.new(config(), {seed = 4, tp = lay:group('tp'), ep = lay:group('ep')})
    local ids = {{1, 2, 3 + d.rank()}}
    T.raises(function() lunar.generate(m, ids, {max_new_tokens = 2}) end, 'were given different prompts')
end)
T:test('the SFT recipe\'s benchmark at tp=2 x ep=2 logs what one rank logs', function()
    local dir = dpc.tmpdir()
    local over = {train = {steps = 2}, optim = {warmup = 1}, benchmark = {every = 2, datasets = {'gsm8k'}, limit = 3, k = 2,
        max_new_tokens = 8, temperature = 1, seed = 5}}
    local function rows(path)
        local out = {}
        local f = assert(io.open(path .. '/metrics.jsonl', 'rb'))
        for line in f:read('*a'):gmatch('[^\n]+') do
            local row = lunar.io.decode_json(line)
            for k, v in pairs(row) do if k:match('^benchmark/') then out[k] = v end end
        end
        f:close()
        return out
    end
    if d.rank() == 0 then dpc.single(dir .. '/one', over) end
    d.barrier()
    local recipes = dofile('recipes/common.lua')
    local o = dpc.recipe(dir .. '/split', over)
    o.parallel.tp, o.parallel.ep = 2, 2
    recipes.run('sft', o)
    if d.rank() == 0 then
        local a, b = rows(dir .. '/split'), rows(dir .. '/one')
        local n = 0
        for k, v in pairs(b) do
            T.equal(a[k], v, k)
            n = n + 1
        end
        assert(n >= 3 and b['benchmark/gsm8k/avg@2'] ~= nil, 'benchmark metrics logged: ' .. n)
        print(('  benchmark at tp=2 x ep=2: %d numbers as one rank logs them'):format(n))
    end
    d.barrier()
    if d.rank() == 0 then os.execute(('rm -rf %q'):format(dir)) end
end)

os.exit(T:run())
